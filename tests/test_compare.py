"""studies/compare.py: summaries over seeds, variants, paired statistics, results files and their
re-analysis, report.md and plots, on tiny runs and on the results/ files."""

import contextlib
import json
import math
import os
import shlex
import shutil

import numpy as np
import pytest
import torch

import data as data_py
import eval as ev
import runlib
import train_lm
from studies import compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_seeds_are_aggregated_in_summary_json(runs, tmp_path):
    report = tmp_path / "report"
    metrics = compare.main(
        [
            runs["mle"],
            runs["mle-s1"],
            runs["agg"],
            "--out",
            str(report),
            "--device",
            "cpu",
            "--n-samples",
            "0",
        ]
    )
    summary = json.load(open(report / "summary.json"))
    assert summary["mle"]["n"] == 2 and summary["agg"]["n"] == 1
    ppl = [metrics["mle"]["ppl"], metrics["mle-s1"]["ppl"]]
    assert summary["mle"]["ppl"]["mean"] == pytest.approx(np.mean(ppl))
    assert summary["mle"]["ppl"]["std"] == pytest.approx(np.std(ppl, ddof=1))
    assert summary["agg"]["ppl"]["std"] == 0.0
    for key in ("ppl_groups", "isotropy_groups"):
        assert set(summary["mle"][key]) == {"freq", "med", "rare"}
        assert summary["mle"][key]["freq"]["mean"] == pytest.approx(
            np.mean([metrics[k][key]["freq"] for k in ("mle", "mle-s1")])
        )
    for key in ("uniq", "isotropy", "mean_cosine"):
        assert set(summary["mle"][key]) == {"mean", "std", "median"}
    assert summary["mle"]["ppl"]["median"] == pytest.approx(np.median(ppl))
    # nested dicts too
    assert summary["mle"]["rare_bias"]["ppl_groups"]["freq"]["mean"] == pytest.approx(
        np.mean([metrics[k]["rare_bias"]["ppl_groups"]["freq"] for k in ("mle", "mle-s1")])
    )
    text = (report / "report.md").read_text()
    assert "Mean ± std" in text and "| mle | 2 |" in text and "| agg | 1 |" in text
    assert "Human text (test split)" in text
    # mean ± std over the seeds
    row = next(line for line in text.splitlines() if line.startswith("| mle | 2 |"))
    assert f"{summary['mle']['ppl']['mean']:.2f} ± {summary['mle']['ppl']['std']:.2f}" in row
    for png in (
        "singular_values.png",
        "training_curves.png",
        "gradient_parts.png",
        "svd_over_time.png",
    ):
        assert f"]({png})" in text
    for png in ("singular_values.png", "svd_projection.png"):
        assert (report / png).stat().st_size > 5000
    # from the valid records of log.jsonl
    assert (report / "training_curves.png").stat().st_size > 0
    assert (report / "gradient_parts.png").stat().st_size > 0  # from their grad_parts
    # from agg's train records (method_rare_fraction)
    assert (report / "rare_share.png").stat().st_size > 0
    assert (report / "svd_over_time.png").stat().st_size > 0  # from agg's --snapshot-steps 1,3
    snap = torch.load(os.path.join(runs["agg"], "snapshots", "emb_3.pt"), weights_only=True)
    ck = torch.load(os.path.join(runs["agg"], "ckpt.pt"), weights_only=True)
    assert snap["step"] == 3 and torch.equal(snap["weight"], ck["model"]["tok_emb.weight"])


def test_runs_that_differ_in_more_than_their_seed_are_never_averaged():
    base = dict(
        method="ul+agg", seed=0, out="a", lr=2e-3, gate_ul=None, untie=False, eval_interval=200
    )
    seeds_only = {"a": base, "b": dict(base, seed=1, out="b", eval_interval=100)}
    assert compare.variant_names(seeds_only) == {"a": "ul+agg", "b": "ul+agg"}
    mle = dict(method="mle", seed=0, out="d", lr=2e-3, untie=False, train_fraction=1.0)
    configs = {
        **seeds_only,
        "c": dict(base, out="c", gate_ul=False),
        "d": mle,
        "e": dict(mle, seed=1, out="e", untie=True, train_fraction=0.5),
    }
    assert compare.variant_names(configs) == {
        # unset: the default
        "a": "ul+agg gate_ul=True",
        "b": "ul+agg gate_ul=True",
        "c": "ul+agg gate_ul=False",
        "d": "mle train_fraction=1.0 untie=False",
        "e": "mle train_fraction=0.5 untie=True",
    }
    metrics = {
        r: {"method": configs[r]["method"], "variant": v, "ppl": float(i)}
        for i, (r, v) in enumerate(compare.variant_names(configs).items())
    }
    summary = compare.summarise(metrics)
    assert (
        summary["ul+agg gate_ul=True"]["n"] == 2
        and summary["ul+agg gate_ul=True"]["ppl"]["mean"] == 0.5
    )
    assert (
        summary["ul+agg gate_ul=False"]["n"] == 1
        and summary["ul+agg gate_ul=False"]["ppl"]["mean"] == 2.0
    )


def test_paired_interval_matches_the_paired_t_test():
    from scipy import stats

    diffs = [0.3, -0.1, 0.5, 0.2, 0.4]
    r = compare.paired_interval(diffs, n_boot=2000)
    t = stats.ttest_1samp(diffs, 0)
    assert (
        r["p"] == pytest.approx(t.pvalue)
        and r["mean"] == pytest.approx(0.26)
        and r["median"] == 0.3
    )
    ci = t.confidence_interval()
    assert r["t95"] == pytest.approx([ci.low, ci.high])
    assert min(diffs) <= r["boot95"][0] < r["mean"] < r["boot95"][1] <= max(diffs)


def test_compare_pairs_runs_by_seed_and_splits_the_rare_gap_by_type(runs, tmp_path):
    compare.main(
        [
            runs["mle"],
            runs["mle-s1"],
            runs["agg"],
            "--out",
            str(tmp_path),
            "--n-samples",
            "0",
            "--compare",
            "mle",
            "agg",
            "--results",
            str(tmp_path / "my results" / "r.json"),
        ]
    )
    (c,) = json.load(open(tmp_path / "compare.json"))
    res = json.load(open(tmp_path / "my results" / "r.json"))
    assert res["compare"] == [c] and set(res["runs"]) == {"mle", "mle-s1", "agg"}
    cmd = shlex.split(res["command"])  # a shell command: the path with a space stays one argument
    assert (
        cmd[:3] == ["python", "-m", "studies.compare"]
        and len(cmd) == 15
        and cmd[-1].endswith("my results/r.json")
    )
    assert res["runs"]["agg"]["command"].startswith("OMP_NUM_THREADS=1 python train_lm.py ")
    assert (
        res["runs"]["agg"]["threads"]
        == json.load(open(os.path.join(runs["agg"], "config.json")))["versions"]["threads"]
    )
    assert res["runs"]["agg"]["command"].endswith("--alpha 0.5 --snapshot-steps 1,3")
    assert (
        res["runs"]["mle-s1"]["seed"] == 1
        and "rare_bias" in res["runs"]["mle"]
        and "generations" not in res["runs"]["mle"]
    )
    logged = [r for r in ev.log_records(runs["agg"]) if "grad_parts" in r]
    # the data of gradient_parts.png, one entry per valid record
    parts = res["runs"]["agg"]["gradient_parts"]
    assert [p["step"] for p in parts] == [r["step"] for r in logged] and parts[-1][
        "grad_parts"
    ] == logged[-1]["grad_parts"]
    assert set(parts[0]) == {"step", "grad_parts", "norm_groups"} and set(
        parts[0]["grad_parts"]["b"]
    ) == {"freq", "med", "rare"}
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert c["seeds"] == [0] and c["metrics"]["ppl"]["n"] == 1  # mle seed 1 has no agg partner
    assert c["metrics"]["ppl"]["mean"] == pytest.approx(
        math.log(metrics["agg"]["ppl"] / metrics["mle"]["ppl"])
    )
    # AGG Table 5: a difference of Spearman's rho, not a log ratio
    ws = c["metrics"]["word_similarity.ws353"]
    assert not ws["log_ratio"] and ws["mean"] == pytest.approx(
        metrics["agg"]["word_similarity"]["ws353"] - metrics["mle"]["word_similarity"]["ws353"]
    )
    assert res["runs"]["mle"]["word_similarity"] == metrics["mle"]["word_similarity"]
    assert "Paired comparison: agg against mle" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit, match="no run of variant 'ul'"):
        compare.main(
            [
                runs["mle"],
                runs["agg"],
                "--out",
                str(tmp_path),
                "--n-samples",
                "0",
                "--compare",
                "mle",
                "ul",
            ]
        )


def test_runs_on_other_data_or_thread_counts_are_never_paired(
    runs, corpus, lm_tiny, tmp_path, capsys
):
    """A paired comparison needs runs alike but for the method: another corpus or vocabulary (data
    fingerprint, vocab_size_actual) or another thread count (versions.threads) is refused with
    --compare and not paired by default (the runs are still evaluated side by side)."""
    other = str(tmp_path / "agg-v280")
    train_lm.main(
        [
            "--data-dir",
            corpus["data"],
            "--cache-dir",
            corpus["cache"],
            "--out",
            other,
            "--method",
            "agg",
            *lm_tiny,
            "--vocab-size",
            "280",
            "--max-steps",
            "3",
            "--eval-interval",
            "3",
            "--alpha",
            "0.5",
            "--snapshot-steps",
            "1,3",
        ]
    )
    with pytest.raises(
        SystemExit,
        match=r"--compare mle agg: the runs of seed 0 .* differ in data \(dir-bpe300-.* vs "
        r"dir-bpe280-.*\); paired runs must share",
    ):
        compare.main(
            [
                runs["mle"],
                other,
                "--out",
                str(tmp_path / "r1"),
                "--n-samples",
                "0",
                "--compare",
                "mle",
                "agg",
            ]
        )
    assert not (tmp_path / "r1" / "metrics.json").exists()  # refused before any evaluation
    metrics = compare.main([runs["mle"], other, "--out", str(tmp_path / "r2"), "--n-samples", "0"])
    assert set(metrics) == {"mle", "agg-v280"} and not (tmp_path / "r2" / "compare.json").exists()
    assert "no paired comparison of agg against mle: the runs of seed 0" in capsys.readouterr().out
    threads = str(tmp_path / "agg-threads")
    shutil.copytree(runs["agg"], threads)
    cfg = json.load(open(os.path.join(threads, "config.json")))
    cfg["versions"]["threads"] = cfg["versions"]["threads"] + 1
    json.dump(cfg, open(os.path.join(threads, "config.json"), "w"))
    with pytest.raises(SystemExit, match=r"differ in thread count \(1 vs 2\)"):
        compare.main(
            [runs["mle"], threads, "--out", str(tmp_path / "r3"), "--compare", "mle", "agg"]
        )
    # not recorded
    assert (
        compare.pair_difference(dict(task="lm", versions={"threads": 2}), dict(task="lm")) is None
    )
    # the host: the same kernels, the same hash
    assert cfg["versions"]["kernels"] == runlib.kernel_fingerprint()
    assert (
        compare.pair_difference(dict(versions={"kernels": "a1"}), dict(versions={"kernels": "b2"}))
        == "host kernels (a1 vs b2)"
    )
    assert (
        compare.pair_difference(
            dict(task="lm", vocab_size_actual=300), dict(task="lm", vocab_size_actual=280)
        )
        == "vocabulary size (300 vs 280)"
    )
    assert compare.pair_difference(dict(task="lm"), dict(task="nmt")) == "task (lm vs nmt)"
    with pytest.raises(SystemExit, match=r"--compare mle agg: .*differ in data \(x vs y\)"):
        compare.comparable_pairs(
            [("mle", "agg")],
            {"a": dict(seed=0, data_fingerprint="x"), "b": dict(seed=0, data_fingerprint="y")},
            {"a": "mle", "b": "agg"},
        )


def test_compare_splits_the_rare_gap_over_types_and_pools_the_seeds():
    V = 6
    rare = torch.tensor([False, False, False, True, True, True])
    count = torch.tensor([50, 40, 30, 8, 1, 1])
    base_nll = torch.tensor([100.0, 90, 80, 40, 6, 6], dtype=torch.float64)  # per-type NLL sums
    # cand is better on the rare types, mostly type 3
    gain = torch.tensor([0.0, 0, 0, 16, 2, 2], dtype=torch.float64)
    metrics, stats = {}, {}
    for seed in (0, 1):
        for v, nll in (("mle", base_nll), ("agg", base_nll - gain)):
            rare_ppl = math.exp(float(nll[rare].sum()) / 10)
            label = f"{v}-s{seed}"
            metrics[label] = dict(
                variant=v,
                seed=seed,
                ppl=100.0 + seed,
                ppl_groups=dict(rare=rare_ppl),
                rare_bias=dict(bias=-0.5, ppl_groups=dict(rare=rare_ppl * 0.9)),
            )
            stats[label] = dict(nll=nll, count=count, rare=rare)
    c = compare.compare(metrics, stats, "mle", "agg", [f"t{i}" for i in range(V)])
    t = c["rare_types"]
    assert c["seeds"] == [0, 1] and t["types"] == 3 and t["targets"] == 20
    assert t["ratio"] == pytest.approx(math.exp(-40 / 20))
    assert t["share_top1"] == pytest.approx(0.8) and t["top"][0]["token"] == "t3"
    assert t["ratio_type_boot95"][0] <= t["ratio"] <= t["ratio_type_boot95"][1]
    assert c["metrics"]["ppl"]["mean"] == 0.0 and c["metrics"]["ppl_groups.rare"][
        "mean"
    ] == pytest.approx(-2.0)
    share = math.log(1 / 0.9) / 2.0  # the bias gains log(1/0.9) of the 2.0 nats AGG gains
    assert c["free_baseline_share"]["mean"] == pytest.approx(share)


NMT_EVAL_TINY = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "300",
    "--enc-layers",
    "1",
    "--dec-layers",
    "1",
    "--d-model",
    "16",
    "--n-head",
    "2",
    "--d-ff",
    "32",
    "--max-steps",
    "4",
    "--eval-interval",
    "4",
    "--tokens-per-step",
    "512",
    "--micro-tokens",
    "512",
    "--warmup",
    "2",
    "--valid-bleu-sents",
    "4",
    "--device",
    "cpu",
]


def test_nmt_compare_gives_paired_bleu_bootstrap_and_target_side_metrics(tmp_path, read_log):
    import train_nmt

    runs = []
    for method in ("mle", "agg"):
        for seed in (0, 1):
            out = str(tmp_path / f"{method}-s{seed}")
            train_nmt.main(NMT_EVAL_TINY + ["--method", method, "--seed", str(seed), "--out", out])
            runs.append(out)
    cfg = json.load(open(tmp_path / "agg-s0" / "config.json"))
    assert (
        cfg["rare_rule"] == "official"
        and json.load(open(tmp_path / "mle-s0" / "config.json"))["rare_rule"] is None
    )
    # two variants: compared by default
    metrics = compare.main(
        runs
        + ["--out", str(tmp_path / "r"), "--beam", "1", "--results", str(tmp_path / "nmt.json")]
    )
    m = metrics["agg-s0"]
    target = m["target"]
    # target groups: ranked over the tokens that occur as training targets only
    counts = ev.evaluate(runs[2], beam=1)["tgt_counts"]
    groups = train_nmt.target_groups(counts)
    assert sum(len(i) for i in groups.values()) == int(
        (counts[len(data_py.NMT_SPECIALS) :] > 0).sum()
    )
    assert target["rows"] == sum(len(i) for i in groups.values()) and set(target["ppl_groups"]) == {
        "freq",
        "med",
        "rare",
    }
    assert (
        0 <= target["rare_recall"] <= 1
        and 0 < target["rare_mass_true"] < 1
        and target["uniq_human"] > 0
    )
    assert 0 < target["isotropy"] <= 1 and target["isotropy_groups"]["rare"] > 0
    saved = json.load(open(tmp_path / "nmt.json"))["runs"]["agg-s0"]
    # NaN-safe equality
    assert json.dumps(saved["target"], sort_keys=True) == json.dumps(target, sort_keys=True)
    assert saved["rare_rule"] == "official"  # per-run JSON for results/
    valid = [r for r in read_log(runs[2]) if r["split"] == "valid"]
    assert (
        saved["valid_bleu"] == {"4": pytest.approx(valid[-1]["bleu"])}
        and saved["training_test_bleu"] == {}
    )
    comp = json.load(open(tmp_path / "r" / "compare.json"))[0]
    assert (comp["base"], comp["cand"]) == ("mle", "agg")
    boot = comp["bleu_paired_bootstrap"]
    assert [b["seed"] for b in boot] == [0, 1]
    for b, s in zip(boot, (0, 1)):
        assert b["base"] == pytest.approx(metrics[f"mle-s{s}"]["bleu"]) and b[
            "cand"
        ] == pytest.approx(metrics[f"agg-s{s}"]["bleu"])
        assert b["boot95"][0] <= b["diff"] <= b["boot95"][1] or b["boot95"][0] == b["boot95"][1]
        assert 0 <= b["p"] <= 1
    assert comp["metrics"]["bleu"]["n"] == 2 and "min_detectable" in comp["metrics"]["bleu"]
    assert "target.ppl_groups.rare" in comp["metrics"] and "target.rare_recall" in comp["metrics"]
    assert json.load(open(tmp_path / "nmt.json"))["compare"][0]["bleu_paired_bootstrap"] == boot
    report = (tmp_path / "r" / "report.md").read_text()
    assert "| BLEU | test PPL |" in report and "rare mass pred" in report


def test_output_bias_is_reported_against_frequency(lm_run, tmp_path):
    lm_run(tmp_path / "b", "--method", "mle", "--output-bias", "--lr", "3e-2", steps=6)
    m = compare.main(
        [
            str(tmp_path / "b"),
            "--out",
            str(tmp_path / "r"),
            "--n-samples",
            "0",
            "--results",
            str(tmp_path / "b.json"),
        ]
    )["b"]
    ob = m["output_bias"]

    def same(a, b):  # NaN-safe
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)

    # the figure's numbers, saved
    assert same(json.load(open(tmp_path / "b.json"))["runs"]["b"]["output_bias"], ob)
    bias = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["model"]["out_bias"]
    cfg = json.load(open(tmp_path / "b" / "config.json"))
    counts = torch.from_numpy(np.load(os.path.join(cfg["data_cache"], "counts.npy")))
    seen = counts > 0
    from scipy import stats

    assert ob["spearman_log_count"] == pytest.approx(
        stats.spearmanr(counts[seen].log(), bias[seen]).statistic
    )
    assert ob["spearman_log_count"] > 0  # frequent tokens get the larger bias within a few steps
    assert (
        set(ob["mean_groups"]) == {"freq", "med", "rare"}
        and (tmp_path / "r" / "output_bias.png").exists()
    )


def test_a_run_saved_before_a_flag_existed_is_the_same_variant_as_its_default():
    old = {"task": "lm", "method": "agg", "lr": 0.002, "seed": 0}
    new = dict(old, seed=1, output_bias=False, split_seed=0)
    other = dict(old, seed=2, output_bias=True)
    names = compare.variant_names({"old": old, "new": new, "other": other})
    assert names["old"] == names["new"] != names["other"] and "output_bias=True" in names["other"]


def test_compare_names_are_checked_before_any_evaluation(runs, tmp_path):
    with pytest.raises(SystemExit, match="no run of variant 'nope'; variants here: agg, mle"):
        compare.main(
            [runs["mle"], runs["agg"], "--out", str(tmp_path / "r"), "--compare", "mle", "nope"]
        )
    with pytest.raises(SystemExit, match="--compare mle mle: compare two different variants"):
        compare.main(
            [runs["mle"], runs["agg"], "--out", str(tmp_path / "r"), "--compare", "mle", "mle"]
        )
    # one folder under a second path
    twice = os.path.join(runs["mle"], "..", os.path.basename(runs["mle"]))
    with pytest.raises(SystemExit, match="this run folder is given twice"):
        compare.main([runs["mle"], runs["agg"], twice, "--out", str(tmp_path / "r")])
    assert not (tmp_path / "r" / "metrics.json").exists()


def test_tost_and_the_reanalysis_of_a_results_file(tmp_path):
    assert compare.tost([0.001, -0.002, 0.0015, 0.0], math.log(1.02))["equivalent"] is True
    # too noisy to claim it
    assert compare.tost([0.05, -0.06, 0.07, -0.04], math.log(1.02))["equivalent"] is False
    # a real difference
    assert compare.tost([0.03, 0.031, 0.029], math.log(1.02))["equivalent"] is False
    src = os.path.join(ROOT, "results", "lm_headline.json")
    path = tmp_path / "h.json"
    path.write_text(open(src).read())
    before = json.load(open(src))["compare"][0]
    after = compare.main(["--reanalyse", str(path)])["compare"][0]
    # the same runs, the same interval
    assert after["metrics"]["ppl"]["t95"] == before["metrics"]["ppl"]["t95"]
    closed = after["gap_closed_by_calibration"]
    runs = json.load(open(src))["runs"]
    b, c = runs["mle-lr0.004-wu240-s0"], runs["agg-lr0.004-wu240-s0"]
    gap = math.log(b["ppl_groups"]["rare"] / c["ppl_groups"]["rare"])
    cal = math.log(b["rare_bias"]["ppl_groups"]["rare"] / c["rare_bias"]["ppl_groups"]["rare"])
    assert closed["per_seed"][0] == pytest.approx(1 - cal / gap)
    assert set(after["equivalence"]) >= {"ppl", "rare_bias.ppl", "rare_bias.ppl_groups.rare"}
    # a pair whose runs differ in thread count (the record's "threads", else its command's
    # OMP_NUM_THREADS) is refused
    res = json.load(open(src))
    res["runs"]["agg-lr0.004-wu240-s0"]["command"] = (
        "OMP_NUM_THREADS=2 " + res["runs"]["agg-lr0.004-wu240-s0"]["command"].split(" ", 1)[1]
    )
    path.write_text(json.dumps(res))
    with pytest.raises(
        SystemExit, match=r"the runs of seed 0 .* differ in thread count \(1 vs 2\)"
    ):
        compare.main(["--reanalyse", str(path)])

    def threads(record):
        return compare.record_config(dict(record, seed=0))["versions"]["threads"]

    assert threads(dict(threads=2, command="OMP_NUM_THREADS=1 python train_lm.py")) == 2
    assert threads(dict(command="python train_lm.py")) is None
    path.write_text(open(src).read())
    assert compare.main(["--reanalyse", str(path)])["reanalysis_command"] == shlex.join(
        ["python", "-m", "studies.compare", "--reanalyse", os.path.relpath(path, ROOT)]
    )
    # a study's own comparisons (scale's cells, rivals' pairs by host, a sweep's list of runs) are
    # its script's
    for res in (
        dict(runs={}, compare=[dict(cells="a study's own comparison")]),
        dict(runs={}, compare=[dict(base="mle", cand="agg", unpaired={})]),
        dict(runs=[], compare=[]),
    ):
        path.write_text(json.dumps(res))
        with pytest.raises(SystemExit, match="a study's file: rerun the study with --no-train"):
            compare.main(["--reanalyse", str(path)])
    # a missing file, a broken one, records without a seed: one line each
    for text, says in (
        (None, "cannot read it as JSON"),
        ('{"runs": 3', "cannot read it as JSON"),
        ('{"runs": {"a": {"one_sign": 0.1}}}', "not a results file of runs"),
    ):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit, match=f"--reanalyse .*: {says}"):
            compare.main(["--reanalyse", str(path)])


def test_a_comparison_grows_by_seeds_from_results_files_alone(tmp_path):
    """--reanalyse FILE --add MORE: the runs of MORE join FILE's and the comparison is recomputed
    over every seed, as if evaluated together; a rerun replaces the run of its name and drops that
    seed's stale BLEU bootstrap."""
    src = os.path.join(ROOT, "results", "nmt_table.json")
    full = json.load(open(src))

    def part(seeds):  # the results file of these seeds only
        kept = {k: r for k, r in full["runs"].items() if r["seed"] in seeds}
        comparisons = [
            dict(
                c,
                bleu_paired_bootstrap=[b for b in c["bleu_paired_bootstrap"] if b["seed"] in seeds],
            )
            for c in full["compare"]
        ]
        return dict(full, runs=kept, compare=comparisons)

    seeds = full["compare"][0]["seeds"]
    (tmp_path / "a.json").write_text(
        json.dumps(dict(part(set(seeds[:2])), command="python eval.py two seeds"))
    )
    (tmp_path / "b.json").write_text(
        json.dumps(dict(part(set(seeds[2:])), command="python eval.py the others"))
    )
    got = compare.main(["--reanalyse", str(tmp_path / "a.json"), "--add", str(tmp_path / "b.json")])
    (want,), (c,) = full["compare"], got["compare"]
    assert c["seeds"] == seeds and c["bleu_paired_bootstrap"] == want["bleu_paired_bootstrap"]
    assert c["metrics"]["bleu"]["t95"] == pytest.approx(want["metrics"]["bleu"]["t95"])
    assert got["command"] == ["python eval.py two seeds", "python eval.py the others"]
    assert len(got["runs"]) == len(full["runs"])
    rerun = dict(full, runs={"agg-s0": dict(full["runs"]["agg-s0"], bleu=11.0)}, compare=[])
    (tmp_path / "c.json").write_text(json.dumps(rerun))
    got = compare.main(["--reanalyse", str(tmp_path / "a.json"), "--add", str(tmp_path / "c.json")])
    assert [b["seed"] for b in got["compare"][0]["bleu_paired_bootstrap"]] == seeds[1:]
    assert got["runs"]["agg-s0"]["bleu"] == 11.0
    with pytest.raises(SystemExit, match="--add goes with --reanalyse"):
        compare.main(["--add", str(tmp_path / "c.json")])


def test_a_run_evaluated_alone_joins_the_variant_its_settings_match(tmp_path):
    """A run evaluated on its own is named by its method ('agg'); added to a file whose variants say
    more ('agg rare_rule=target-only'), a rerun keeps the replaced run's variant and a new seed
    takes the variant its settings match, so both land in the comparison."""
    src = os.path.join(ROOT, "results", "nmt_rare_rule.json")
    full = json.load(open(src))
    (entry,) = full["compare"]
    (tmp_path / "a.json").write_text(json.dumps(full))
    runs = full["runs"]

    def alone(name, seed, **kw):
        return dict(runs[name], variant="agg", seed=seed, **kw)

    more = {
        "agg-target-only-s0": alone("agg-target-only-s0", 0, bleu=20.0),
        "agg-s7": alone("agg-s0", 7),
        "agg-target-only-s7": alone("agg-target-only-s0", 7),
    }
    (tmp_path / "b.json").write_text(
        json.dumps(dict(full, runs=more, compare=[], command="python eval.py alone"))
    )
    got = compare.main(["--reanalyse", str(tmp_path / "a.json"), "--add", str(tmp_path / "b.json")])
    assert got["runs"]["agg-target-only-s0"]["variant"] == entry["cand"]
    assert (
        got["runs"]["agg-s7"]["variant"] == entry["base"]
        and got["runs"]["agg-target-only-s7"]["variant"] == entry["cand"]
    )
    (c,) = got["compare"]
    assert c["seeds"] == sorted(entry["seeds"] + [7])
    assert c["metrics"]["bleu"]["cand"][0] == 20.0
    # the rerun's seed: its bootstrap is stale
    assert 0 not in [b["seed"] for b in c.get("bleu_paired_bootstrap", [])]


def test_articles_are_the_bootstrap_units_of_the_rare_ppl_ratio():
    eos = 9
    # lines: [1 2 E] [3 E] [4 5 6 E]; articles: lines 0-1, line 2
    ids = np.array([1, 2, eos, 3, eos, 4, 5, 6, eos])
    art, docs = ev.document_of(ids, eos, [2, 1])
    assert art.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1] and docs == [2, 1]
    assert ev.document_of(ids, eos, None) is None
    # two articles, rare NLL per (article, group); cand gains 2 nats on article 0's 4 rare targets,
    # none on article 1

    def stats(rare0, rare1):
        return dict(nll=[[0, 0, rare0], [0, 0, rare1]], count=[[1, 1, 4], [1, 1, 4]])

    # two seeds alike: NLL (seed x article x group), each article's targets per group
    base, cand = (np.array([stats(*rare)["nll"]] * 2) for rare in ((10.0, 8.0), (8.0, 8.0)))
    res = compare.article_bootstrap(base, cand, np.array(stats(0, 0)["count"]), n_boot=2000)
    assert res["ratio"] == pytest.approx(math.exp(-4 / 16)) and res["gap_share_per_article"] == [
        1.0,
        0.0,
    ]
    lo, hi = res["ratio_article_boot95"]
    # both articles from 0, both from 1
    assert lo == pytest.approx(math.exp(-8 / 16)) and hi == pytest.approx(1.0)


def test_paired_bleu_matches_sacrebleu_and_detects_a_real_difference():
    import sacrebleu

    refs = [f"the cat number {i} sat on the mat today" for i in range(60)]
    good = list(refs)
    bad = [r.replace("sat on", "ran under") if i % 2 else r for i, r in enumerate(refs)]
    res = compare.paired_bleu(bad, good, refs, "13a", n_boot=300)
    assert res["base"] == pytest.approx(sacrebleu.corpus_bleu(bad, [refs]).score)
    assert (
        res["cand"] == pytest.approx(100.0)
        and res["diff"] > 0
        and res["boot95"][0] > 0
        and res["p"] < 0.01
    )
    same = compare.paired_bleu(good, good, refs, "13a", n_boot=100)
    assert same["diff"] == 0 and same["boot95"] == [0.0, 0.0]


def test_a_reanalysis_never_pairs_runs_of_another_task(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lm = tmp_path / "lm.json"
    lm.write_text(open(os.path.join(root, "results", "lm_headline.json")).read())
    before = lm.read_text()
    with pytest.raises(
        SystemExit, match=r"nmt_table.json: its run .* differ in task \(lm vs nmt\)"
    ):
        compare.main(
            ["--reanalyse", str(lm), "--add", os.path.join(root, "results", "nmt_table.json")]
        )
    assert lm.read_text() == before
