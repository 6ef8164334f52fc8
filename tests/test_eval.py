"""eval.py: every metrics key on tiny checkpoints, values checked against independent computations, NMT dispatch."""
import json
import math
import os
import shlex
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data as data_py
import eval as ev
import runlib
import train_lm

KEYS = ["ppl", "ppl_groups", "uniq", "uniq_groups", "uniq_human", "isotropy", "isotropy_groups", "mean_cosine",
        "word_similarity"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, lm_tiny):
    base = tmp_path_factory.mktemp("ev")
    out = {}
    for label, method, extra in (("mle", "mle", []), ("agg", "agg", ["--alpha", "0.5", "--snapshot-steps", "1,3"]),
                                 ("mle-s1", "mle", ["--seed", "1"])):
        out[label] = str(base / label)
        train_lm.main(["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], "--out", out[label],
                       "--method", method, *lm_tiny, "--max-steps", "3", "--eval-interval", "3", *extra])
    return out


def test_eval_lm_writes_every_key_and_correct_values(runs, tmp_path):
    report = tmp_path / "report"
    metrics = ev.main([runs["mle"], runs["agg"], "--out", str(report), "--device", "cpu", "--n-samples", "2",
                       "--prefix-len", "8", "--gen-len", "12"])
    on_disk = json.load(open(report / "metrics.json"))
    assert set(on_disk) == {"mle", "agg"}
    for label, m in on_disk.items():
        for k in KEYS:
            assert k in m, (label, k)
        for k in ("ppl_groups", "uniq_groups", "isotropy_groups"):
            assert set(m[k]) == {"freq", "med", "rare"}
        assert set(m["word_similarity"]) == {"ws353", "simlex999"}
        assert all(-1 <= v <= 1 for v in m["word_similarity"].values())
        assert m["uniq"] == sum(m["uniq_groups"].values()) and 0 < m["uniq"] <= m["tokens"]
        assert m["uniq_human"] == sum(m["uniq_human_groups"].values())
        assert 0 < m["isotropy"] <= 1 and -1 <= m["mean_cosine"] <= 1
        finite = [v for v in m["ppl_groups"].values() if math.isfinite(v)]
        assert min(finite) <= m["ppl"] <= max(finite)
        assert len(m["generations"]) == 2 and all(0 < g["uniq"] <= 12 for g in m["generations"])
        assert m["singular_values"][0] == pytest.approx(1.0)
    assert on_disk["agg"]["method"] == "agg" and on_disk["agg"]["step"] == 3
    assert metrics["mle"]["ppl"] == on_disk["mle"]["ppl"]

    # PPL and human Uniq recomputed independently from the checkpoint and the cached test ids
    ck = torch.load(os.path.join(runs["mle"], "ckpt.pt"), weights_only=True)
    data = data_py.prepare_lm(ck["config"], log=lambda *a: None)
    model = train_lm.build_model(ck["config"], data["vocab_size"])
    model.load_state_dict(ck["model"])
    model.eval()
    ids = torch.from_numpy(np.asarray(data["ids"]["test"], dtype=np.int64))
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 16):
            x, y = ids[s:s + 16 + 1][:-1], ids[s + 1:s + 16 + 1]
            x = x[:len(y)]
            nll += F.cross_entropy(model.logits(x[None])[0], y, reduction="sum").item()
            n += len(y)
    assert on_disk["mle"]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert on_disk["mle"]["uniq_human"] == len(ids[1:].unique())

    md = (report / "report.md").read_text()
    assert "| mle | mle | 3 |" in md and "| agg | agg | 3 |" in md and "| human |" in md
    for png in ("singular_values.png", "svd_projection.png"):
        assert (report / png).stat().st_size > 5000


def test_word_pair_loaders_and_spearman(tmp_path):
    (tmp_path / "men.txt").write_text("sun-n sunlight-n 50.000000\ncar-n automobile-n 48.0\n")
    (tmp_path / "rg65.csv").write_text("cord;smile;0.02\nrooster;voyage;0.04\n")
    (tmp_path / "rw.txt").write_text("word1\tword2\tscore\nsquishing\tsquirt\t5.88\t7\t6\n")
    assert ev.load_word_pairs(str(tmp_path / "men.txt")) == [("sun", "sunlight", 50.0), ("car", "automobile", 48.0)]
    assert ev.load_word_pairs(str(tmp_path / "rg65.csv"))[1] == ("rooster", "voyage", 0.04)
    assert ev.load_word_pairs(str(tmp_path / "rw.txt")) == [("squishing", "squirt", 5.88)]
    ws = ev.load_word_pairs(ev.gensim_test_data(ev.WORDSIM["ws353"]))
    assert len(ws) == 353 and ws[0] == ("love", "sex", 6.77)
    assert len(ev.load_word_pairs(ev.gensim_test_data(ev.WORDSIM["simlex999"]))) == 999

    # word-level vocabulary whose cosines rank the pairs exactly as the human scores do -> Spearman 1
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3}
    tok = types.SimpleNamespace(token_to_id=lambda w: vocab.get(w))
    W = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.0, 1.0], [-1.0, 0.2]])
    (tmp_path / "pairs.txt").write_text("a b 9\na c 5\na d 1\nb d 2\nzz a 3\n")
    rho, used, total = ev.word_similarity(W, tok, "word", {"x": str(tmp_path / "pairs.txt")})["x"]
    assert rho == pytest.approx(1.0) and (used, total) == (4, 5)  # 'zz' is out of vocabulary


def test_neighbours_and_rare_token_choice():
    W = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [-1.0, 0.0]])
    assert ev.neighbours(W, [0, 2], k=2) == [[1, 3], [3, 1]]
    counts = torch.tensor([100, 90, 80, 5, 4, 3, 2, 1, 0, 0])
    tokens = [" the", " a", " of", " x", " y", "zz", " wordy", " rarely", " never", " nope"]
    gid, groups = ev.group_index(counts)
    assert gid[:3].tolist() == [0, 0, 0] and set(groups[2].tolist()) == {8, 9}
    counts2 = torch.tensor([100, 90, 80, 70, 60, 50, 40, 3, 2, 0])
    assert ev.pick_rare_tokens(counts2, tokens, 3) == [8]  # rare group {8, 9}: 9 never seen in training
    assert ev.pick_rare_tokens(counts2, tokens, 3, src_counts=torch.tensor([0] * 7 + [1, 5, 9])) == [9, 8]


def test_bad_run_folder_errors(tmp_path, runs):
    with pytest.raises(SystemExit, match="no checkpoint"):
        ev.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "r")])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "ckpt.pt").write_bytes(b"garbage")
    with pytest.raises(SystemExit, match=r"bad/ckpt.pt: corrupted"):
        ev.main([runs["mle"], str(bad), "--out", str(tmp_path / "r")])


def test_nmt_dispatch_merges_task_metrics(tmp_path, monkeypatch):
    """eval.py hands NMT runs to evaluate_nmt and adds the geometry itself (a stand-in evaluate_nmt here)."""
    V, d = 60, 8
    torch.manual_seed(0)
    weight = torch.randn(V, d)
    calls = []
    tokens = ["w" + "".join("abcdefghij"[int(c)] for c in f"{i:02d}") + "xx" for i in range(V)]

    def evaluate_nmt(out_dir, model, ck, args, device):
        calls.append((out_dir, str(device), args.beam))
        m = {"bleu": 12.5, "bleu_signature": "nrefs:1|case:mixed|tok:13a", "method": "agg", "task": "nmt"}
        return m, weight, torch.arange(V).flip(0), torch.arange(V), tokens

    monkeypatch.setattr(ev, "evaluate_nmt", evaluate_nmt)
    monkeypatch.setattr(ev.train_nmt, "load_model", lambda ck, device: None)
    run = tmp_path / "nmt-run"
    run.mkdir()
    torch.save({"config": {"task": "nmt"}, "task": "nmt", "model": {}, "step": 5}, run / "ckpt.pt")
    m = ev.main([str(run), "--out", str(tmp_path / "r"), "--device", "cpu"])["nmt-run"]
    assert calls == [(str(run), "cpu", 4)]
    assert m["bleu"] == 12.5 and m["bleu_signature"].startswith("nrefs")
    seen = torch.arange(V).flip(0) > 0  # token 59 never occurs in training: left out of the geometry
    assert m["isotropy"] == pytest.approx(ev.agg.isotropy(weight[seen])) and set(m["isotropy_groups"]) == {"freq", "med",
                                                                                                           "rare"}
    assert m["mean_cosine"] == pytest.approx(ev.agg.mean_cosine(weight[seen])) and m["rows"] == V - 1
    # neighbours of target-rare tokens most frequent on the source side (ids 59, 58, ... are target-rare)
    assert list(m["neighbours"])[:2] == [tokens[59], tokens[58]]
    assert "## Machine translation" in (tmp_path / "r" / "report.md").read_text()


def test_nmt_end_to_end_with_train_nmt_and_checkpoint_averaging(tmp_path):
    import train_nmt
    out = str(tmp_path / "nmt")
    flags = ["--dataset", "synthetic", "--synthetic-size", "300", "--enc-layers", "1", "--dec-layers", "1",
             "--d-model", "16", "--n-head", "2", "--d-ff", "32", "--max-steps", "6", "--eval-interval", "2",
             "--tokens-per-step", "512", "--micro-tokens", "512", "--warmup", "2", "--valid-bleu-sents", "8",
             "--no-test", "--device", "cpu"]
    train_nmt.main(flags + ["--out", out, "--keep-last", "2"])
    assert sorted(os.path.basename(p) for p in runlib.snapshots(out)) == ["ckpt_4.pt", "ckpt_6.pt"]  # the last 2 kept
    m = ev.main([out, "--out", str(tmp_path / "r"), "--device", "cpu", "--beam", "2"])["nmt"]
    for k in ("bleu", "bleu_signature", "isotropy", "isotropy_groups", "mean_cosine", "test_ppl", "ppl_groups",
              "group_rare_mass_pred", "group_rare_mass_true", "translations"):
        assert k in m
    report = (tmp_path / "r" / "report.md").read_text()
    assert "rare mass pred / true" in report and "**Test sentence 1**" in report
    assert f"- nmt: {m['translations'][0]['hyp']}" in report
    assert 0 <= m["bleu"] <= 100 and 0 < m["isotropy"] <= 1 and m["checkpoints_averaged"] == 0
    avg = ev.main([out, "--out", str(tmp_path / "r2"), "--device", "cpu", "--beam", "2", "--average-last", "2"])["nmt"]
    assert avg["checkpoints_averaged"] == 2 and avg["averaged_files"] == ["ckpt_4.pt", "ckpt_6.pt"]
    a, b = (torch.load(os.path.join(out, f"ckpt_{s}.pt"), weights_only=True)["model"] for s in (4, 6))
    weights, _ = ev.average_checkpoints(out, 2)
    torch.testing.assert_close(weights["embed"], (a["embed"] + b["embed"]) / 2)
    with pytest.raises(SystemExit, match="--keep-last 3"):
        ev.main([out, "--out", str(tmp_path / "r3"), "--average-last", "3"])
    # --save-interval: snapshots between evaluations, and the same training (saving and validating draw no RNG)
    out2 = str(tmp_path / "nmt-save")
    train_nmt.main([f for f in flags[:flags.index("--eval-interval")] + ["--eval-interval", "6", "--save-interval", "2"]
                    + flags[flags.index("--eval-interval") + 2:] if f != "--no-test"] + ["--out", out2, "--keep-last", "2"])
    assert sorted(os.path.basename(p) for p in runlib.snapshots(out2)) == ["ckpt_4.pt", "ckpt_6.pt"]
    log = list(map(json.loads, open(os.path.join(out2, "log.jsonl"))))
    assert [r["step"] for r in log if r["split"] == "valid"] == [6]
    # training never reads the test split; eval.py tests the last checkpoint and the average of the last snapshots
    assert {r["split"] for r in log} == {"train", "valid"}
    averaged = ev.evaluate(out2, beam=2, average_last=2)["metrics"]
    last = ev.evaluate(out2, beam=2)["metrics"]
    assert averaged["averaged_files"] == ["ckpt_4.pt", "ckpt_6.pt"] and averaged["checkpoints_averaged"] == 2
    assert averaged["test_loss"] != last["test_loss"]
    for s in (4, 6):
        torch.testing.assert_close(torch.load(os.path.join(out2, f"ckpt_{s}.pt"), weights_only=True)["model"],
                                   torch.load(os.path.join(out, f"ckpt_{s}.pt"), weights_only=True)["model"],
                                   atol=0, rtol=0)


def test_seeds_are_aggregated_in_summary_json(runs, tmp_path):
    report = tmp_path / "report"
    metrics = ev.main([runs["mle"], runs["mle-s1"], runs["agg"], "--out", str(report), "--device", "cpu",
                       "--n-samples", "0"])
    summary = json.load(open(report / "summary.json"))
    assert summary["mle"]["n"] == 2 and summary["agg"]["n"] == 1
    ppl = [metrics["mle"]["ppl"], metrics["mle-s1"]["ppl"]]
    assert summary["mle"]["ppl"]["mean"] == pytest.approx(np.mean(ppl))
    assert summary["mle"]["ppl"]["std"] == pytest.approx(np.std(ppl, ddof=1))
    assert summary["agg"]["ppl"]["std"] == 0.0
    for key in ("ppl_groups", "isotropy_groups"):
        assert set(summary["mle"][key]) == {"freq", "med", "rare"}
        assert summary["mle"][key]["freq"]["mean"] == pytest.approx(np.mean([metrics[k][key]["freq"]
                                                                               for k in ("mle", "mle-s1")]))
    for key in ("uniq", "isotropy", "mean_cosine"):
        assert set(summary["mle"][key]) == {"mean", "std", "median"}
    assert summary["mle"]["ppl"]["median"] == pytest.approx(np.median(ppl))
    assert summary["mle"]["rare_bias"]["ppl_groups"]["freq"]["mean"] == pytest.approx(
        np.mean([metrics[k]["rare_bias"]["ppl_groups"]["freq"] for k in ("mle", "mle-s1")]))  # nested dicts too
    text = (report / "report.md").read_text()
    assert "Mean ± std" in text and "| mle | 2 |" in text
    assert (report / "training_curves.png").stat().st_size > 0  # from the valid records of log.jsonl
    assert (report / "svd_over_time.png").stat().st_size > 0  # from agg's --snapshot-steps 1,3
    snap = torch.load(os.path.join(runs["agg"], "snapshots", "emb_3.pt"), weights_only=True)
    ck = torch.load(os.path.join(runs["agg"], "ckpt.pt"), weights_only=True)
    assert snap["step"] == 3 and torch.equal(snap["weight"], ck["model"]["tok_emb.weight"])


def test_best_checkpoint_is_kept_and_can_be_evaluated(runs, tmp_path):
    best = torch.load(os.path.join(runs["agg"], "ckpt_best.pt"), weights_only=True)
    valid = [json.loads(line) for line in open(os.path.join(runs["agg"], "log.jsonl")) if '"valid"' in line]
    assert best["valid_ppl"] == pytest.approx(min(r["ppl"] for r in valid))
    m = ev.main([runs["agg"], "--out", str(tmp_path / "r"), "--device", "cpu", "--n-samples", "0", "--checkpoint",
                 "best"])["agg"]
    assert m["checkpoint"] == "best" and m["step"] == best["step"]


def test_runs_that_differ_in_more_than_their_seed_are_never_averaged():
    base = dict(method="ul+agg", seed=0, out="a", lr=2e-3, gate_ul=None, init_from=None, eval_interval=200)
    seeds_only = {"a": base, "b": dict(base, seed=1, out="b", eval_interval=100)}
    assert ev.variant_names(seeds_only) == {"a": "ul+agg", "b": "ul+agg"}
    mle = dict(method="mle", seed=0, out="d", lr=2e-3, init_from=None, seq_ul_prob=0.0)
    configs = {**seeds_only, "c": dict(base, out="c", gate_ul=False), "d": mle,
               "e": dict(mle, seed=1, out="e", init_from="runs/mle-s1", seq_ul_prob=0.5)}
    assert ev.variant_names(configs) == {
        "a": "ul+agg gate_ul=True", "b": "ul+agg gate_ul=True", "c": "ul+agg gate_ul=False",  # unset: the default
        "d": "mle init_from=False seq_ul_prob=0.0", "e": "mle init_from=True seq_ul_prob=0.5"}
    metrics = {r: {"method": configs[r]["method"], "variant": v, "ppl": float(i)}
               for i, (r, v) in enumerate(ev.variant_names(configs).items())}
    summary = ev.summarise(metrics)
    assert summary["ul+agg gate_ul=True"]["n"] == 2 and summary["ul+agg gate_ul=True"]["ppl"]["mean"] == 0.5
    assert summary["ul+agg gate_ul=False"]["n"] == 1 and summary["ul+agg gate_ul=False"]["ppl"]["mean"] == 2.0


def test_rare_bias_is_the_nll_optimum_and_calibrates_the_rare_mass():
    g = torch.Generator().manual_seed(0)
    V, N = 30, 400
    rare = torch.zeros(V, dtype=torch.bool)
    rare[20:] = True
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    logits[:, 20:] += 1.5  # the model over-predicts the rare group
    y = torch.randint(0, V, (N,), generator=g)
    gid = torch.where(rare, 2, torch.where(torch.arange(V) < 8, 0, 1))
    st = ev.rare_logit_stats(logits, y, rare)
    b = ev.fit_rare_bias(st)
    nll = lambda c: F.cross_entropy(logits + c * rare.double(), y).item()
    grid = torch.linspace(b - 0.5, b + 0.5, 101)
    assert nll(b) <= min(nll(float(c)) for c in grid) + 1e-12 and b < 0
    m = ev.rare_bias_metrics(st, b, gid)
    probs = torch.softmax(logits + b * rare.double(), -1)
    assert m["rare_mass_pred"] == pytest.approx(float(probs[:, rare].sum(1).mean()), rel=1e-6)
    assert m["rare_mass_pred"] == pytest.approx(m["rare_mass_true"], abs=1e-7)  # the fit calibrates the mass
    assert m["ppl"] == pytest.approx(math.exp(nll(b)), rel=1e-6)
    pred = (logits + b * rare.double()).argmax(-1)
    is_rare = rare[pred]
    assert m["uniq"] == len(pred.unique()) and m["rare_argmax_count"] == int(is_rare.sum())
    assert m["rare_argmax_precision"] == pytest.approx(float((pred == y)[is_rare].double().mean()))
    assert m["rare_argmax_recall"] == pytest.approx(float((pred == y)[rare[y]].double().mean()))
    rare_nll = F.cross_entropy(logits[rare[y]] + b * rare.double(), y[rare[y]]).item()
    assert m["ppl_groups"]["rare"] == pytest.approx(math.exp(rare_nll), rel=1e-6)


def test_paired_interval_matches_the_paired_t_test():
    from scipy import stats
    diffs = [0.3, -0.1, 0.5, 0.2, 0.4]
    r = ev.paired_interval(diffs, n_boot=2000)
    t = stats.ttest_1samp(diffs, 0)
    assert r["p"] == pytest.approx(t.pvalue) and r["mean"] == pytest.approx(0.26) and r["median"] == 0.3
    ci = t.confidence_interval()
    assert r["t95"] == pytest.approx([ci.low, ci.high])
    assert min(diffs) <= r["boot95"][0] < r["mean"] < r["boot95"][1] <= max(diffs)


def test_compare_pairs_runs_by_seed_and_splits_the_rare_gap_by_type(runs, tmp_path):
    ev.main([runs["mle"], runs["mle-s1"], runs["agg"], "--out", str(tmp_path), "--n-samples", "0",
             "--compare", "mle", "agg", "--results", str(tmp_path / "my results" / "r.json")])
    (c,) = json.load(open(tmp_path / "compare.json"))
    res = json.load(open(tmp_path / "my results" / "r.json"))
    assert res["compare"] == [c] and set(res["runs"]) == {"mle", "mle-s1", "agg"}
    cmd = shlex.split(res["command"])  # a shell command: the path with a space stays one argument
    assert cmd[:2] == ["python", "eval.py"] and len(cmd) == 14 and cmd[-1].endswith("my results/r.json")
    assert res["runs"]["agg"]["command"].startswith("OMP_NUM_THREADS=1 python train_lm.py ")
    assert res["runs"]["agg"]["threads"] == json.load(open(os.path.join(runs["agg"], "config.json")))["versions"]["threads"]
    assert res["runs"]["agg"]["command"].endswith("--alpha 0.5 --snapshot-steps 1,3")
    assert res["runs"]["mle-s1"]["seed"] == 1 and "rare_bias" in res["runs"]["mle"] and "generations" not in res["runs"]["mle"]
    logged = [r for r in ev.log_records(runs["agg"]) if "grad_b_rare" in r]
    parts = res["runs"]["agg"]["gradient_parts"]  # the data of gradient_parts.png, one entry per valid record
    assert [p["step"] for p in parts] == [r["step"] for r in logged] and parts[-1]["grad_b_rare"] == logged[-1]["grad_b_rare"]
    assert {f"grad_{x}_{g}" for x in "abc" for g in ("freq", "med", "rare")} <= set(parts[0]) and "ppl" not in parts[0]
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert c["seeds"] == [0] and c["metrics"]["ppl"]["n"] == 1  # mle seed 1 has no agg partner
    assert c["metrics"]["ppl"]["mean"] == pytest.approx(math.log(metrics["agg"]["ppl"] / metrics["mle"]["ppl"]))
    ws = c["metrics"]["word_similarity.ws353"]  # AGG Table 5: a difference of Spearman's rho, not a log ratio
    assert not ws["log_ratio"] and ws["mean"] == pytest.approx(metrics["agg"]["word_similarity"]["ws353"]
                                                               - metrics["mle"]["word_similarity"]["ws353"])
    assert res["runs"]["mle"]["word_similarity"] == metrics["mle"]["word_similarity"]
    assert "Paired comparison: agg against mle" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit, match="no run of variant 'ul'"):
        ev.main([runs["mle"], runs["agg"], "--out", str(tmp_path), "--n-samples", "0", "--compare", "mle", "ul"])


def test_runs_on_other_data_or_thread_counts_are_never_paired(runs, corpus, lm_tiny, tmp_path, capsys):
    """A paired comparison needs runs alike but for the method: another corpus or vocabulary (data fingerprint,
    vocab_size_actual) or another thread count (versions.threads) is refused with --compare and not paired by
    default (the runs are still evaluated side by side)."""
    import shutil
    other = str(tmp_path / "agg-v280")
    train_lm.main(["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], "--out", other, "--method", "agg",
                   *lm_tiny, "--vocab-size", "280", "--max-steps", "3", "--eval-interval", "3", "--alpha", "0.5",
                   "--snapshot-steps", "1,3"])
    with pytest.raises(SystemExit, match=r"--compare mle agg: the runs of seed 0 .* differ in data \(dir-bpe300-.* vs "
                                         r"dir-bpe280-.*\); paired runs must share"):
        ev.main([runs["mle"], other, "--out", str(tmp_path / "r1"), "--n-samples", "0", "--compare", "mle", "agg"])
    assert not (tmp_path / "r1" / "metrics.json").exists()  # refused before any evaluation
    metrics = ev.main([runs["mle"], other, "--out", str(tmp_path / "r2"), "--n-samples", "0"])
    assert set(metrics) == {"mle", "agg-v280"} and not (tmp_path / "r2" / "compare.json").exists()
    assert "no paired comparison of agg against mle: the runs of seed 0" in capsys.readouterr().out
    threads = str(tmp_path / "agg-threads")
    shutil.copytree(runs["agg"], threads)
    cfg = json.load(open(os.path.join(threads, "config.json")))
    cfg["versions"]["threads"] = cfg["versions"]["threads"] + 1
    json.dump(cfg, open(os.path.join(threads, "config.json"), "w"))
    with pytest.raises(SystemExit, match=r"differ in thread count \(1 vs 2\)"):
        ev.main([runs["mle"], threads, "--out", str(tmp_path / "r3"), "--compare", "mle", "agg"])
    assert ev.pair_difference(dict(task="lm", versions={"threads": 2}), dict(task="lm")) is None  # not recorded
    assert cfg["versions"]["kernels"] == runlib.kernel_fingerprint()  # the host: the same kernels, the same hash
    assert ev.pair_difference(dict(versions={"kernels": "a1"}), dict(versions={"kernels": "b2"})) == \
        "host kernels (a1 vs b2)"
    assert ev.pair_difference(dict(task="lm", vocab_size_actual=300), dict(task="lm", vocab_size_actual=280)) == \
        "vocabulary size (300 vs 280)"
    assert ev.pair_difference(dict(task="lm"), dict(task="nmt")) == "task (lm vs nmt)"
    metrics = {"a": dict(variant="mle", seed=0, ppl=2.0), "b": dict(variant="agg", seed=0, ppl=1.0)}
    with pytest.raises(SystemExit, match=r"--compare mle agg: .*differ in data \(x vs y\)"):
        ev.compare(metrics, {}, "mle", "agg", [], configs={"a": dict(data_fingerprint="x"),
                                                           "b": dict(data_fingerprint="y")})


def test_compare_splits_the_rare_gap_over_types_and_pools_the_seeds():
    V = 6
    rare = torch.tensor([False, False, False, True, True, True])
    count = torch.tensor([50, 40, 30, 8, 1, 1])
    base_nll = torch.tensor([100.0, 90, 80, 40, 6, 6], dtype=torch.float64)  # per-type NLL sums
    gain = torch.tensor([0.0, 0, 0, 16, 2, 2], dtype=torch.float64)  # cand is better on the rare types, mostly type 3
    metrics, stats = {}, {}
    for seed in (0, 1):
        for v, nll in (("mle", base_nll), ("agg", base_nll - gain)):
            rare_ppl = math.exp(float(nll[rare].sum()) / 10)
            label = f"{v}-s{seed}"
            metrics[label] = dict(variant=v, seed=seed, ppl=100.0 + seed, ppl_groups=dict(rare=rare_ppl),
                                  rare_bias=dict(bias=-0.5, ppl_groups=dict(rare=rare_ppl * 0.9)))
            stats[label] = dict(nll=nll, count=count, rare=rare)
    c = ev.compare(metrics, stats, "mle", "agg", [f"t{i}" for i in range(V)], n_boot=500)
    t = c["rare_types"]
    assert c["seeds"] == [0, 1] and t["types"] == 3 and t["targets"] == 20
    assert t["ratio"] == pytest.approx(math.exp(-40 / 20))
    assert t["share_top1"] == pytest.approx(0.8) and t["top"][0]["token"] == "t3"
    assert t["ratio_type_boot95"][0] <= t["ratio"] <= t["ratio_type_boot95"][1]
    assert c["metrics"]["ppl"]["mean"] == 0.0 and c["metrics"]["ppl_groups.rare"]["mean"] == pytest.approx(-2.0)
    share = math.log(1 / 0.9) / 2.0  # the bias gains log(1/0.9) of the 2.0 nats AGG gains
    assert c["free_baseline_share"]["mean"] == pytest.approx(share)


NMT_EVAL_TINY = ["--dataset", "synthetic", "--synthetic-size", "300", "--enc-layers", "1", "--dec-layers", "1",
                 "--d-model", "16", "--n-head", "2", "--d-ff", "32", "--max-steps", "4", "--eval-interval", "4",
                 "--tokens-per-step", "512", "--micro-tokens", "512", "--warmup", "2", "--valid-bleu-sents", "4",
                 "--no-test", "--device", "cpu"]


def test_nmt_compare_gives_paired_bleu_bootstrap_and_target_side_metrics(tmp_path, read_log):
    import train_nmt
    runs = []
    for method in ("mle", "agg"):
        for seed in (0, 1):
            out = str(tmp_path / f"{method}-s{seed}")
            train_nmt.main(NMT_EVAL_TINY + ["--method", method, "--seed", str(seed), "--out", out])
            runs.append(out)
    cfg = json.load(open(tmp_path / "agg-s0" / "config.json"))
    assert cfg["rare_rule"] == "official" and json.load(open(tmp_path / "mle-s0" / "config.json"))["rare_rule"] is None
    metrics = ev.main(runs + ["--out", str(tmp_path / "r"), "--beam", "1",  # two variants: compared by default
                              "--results", str(tmp_path / "nmt.json")])
    m = metrics["agg-s0"]
    target = m["target"]
    # target groups: ranked over the tokens that occur as training targets only
    counts = ev.evaluate(runs[2], beam=1)["tgt_counts"]
    groups = train_nmt.target_groups(counts)
    assert sum(len(i) for i in groups.values()) == int((counts[len(data_py.NMT_SPECIALS):] > 0).sum())
    assert target["rows"] == sum(len(i) for i in groups.values()) and set(target["ppl_groups"]) == {"freq", "med", "rare"}
    assert 0 <= target["rare_recall"] <= 1 and 0 < target["rare_mass_true"] < 1 and target["uniq_human"] > 0
    assert 0 < target["isotropy"] <= 1 and target["isotropy_groups"]["rare"] > 0
    saved = json.load(open(tmp_path / "nmt.json"))["runs"]["agg-s0"]
    assert json.dumps(saved["target"], sort_keys=True) == json.dumps(target, sort_keys=True)  # NaN-safe equality
    assert saved["rare_rule"] == "official"  # per-run JSON for results/
    valid = [r for r in read_log(runs[2]) if r["split"] == "valid"]
    assert saved["valid_bleu"] == {"4": pytest.approx(valid[-1]["bleu"])} and saved["training_test_bleu"] == {}
    comp = json.load(open(tmp_path / "r" / "compare.json"))[0]
    assert (comp["base"], comp["cand"]) == ("mle", "agg")
    boot = comp["bleu_paired_bootstrap"]
    assert [b["seed"] for b in boot] == [0, 1]
    for b, s in zip(boot, (0, 1)):
        assert b["base"] == pytest.approx(metrics[f"mle-s{s}"]["bleu"]) and b["cand"] == pytest.approx(
            metrics[f"agg-s{s}"]["bleu"])
        assert b["boot95"][0] <= b["diff"] <= b["boot95"][1] or b["boot95"][0] == b["boot95"][1]
        assert 0 <= b["p"] <= 1
    assert comp["metrics"]["bleu"]["n"] == 2 and "min_detectable" in comp["metrics"]["bleu"]
    assert "target.ppl_groups.rare" in comp["metrics"] and "target.rare_recall" in comp["metrics"]
    assert json.load(open(tmp_path / "nmt.json"))["compare"][0]["bleu_paired_bootstrap"] == boot


def test_paired_bleu_matches_sacrebleu_and_detects_a_real_difference():
    import sacrebleu
    import train_nmt
    refs = [f"the cat number {i} sat on the mat today" for i in range(60)]
    good = list(refs)
    bad = [r.replace("sat on", "ran under") if i % 2 else r for i, r in enumerate(refs)]
    res = train_nmt.paired_bleu(bad, good, refs, "en", n_boot=300)
    assert res["base"] == pytest.approx(sacrebleu.corpus_bleu(bad, [refs]).score)
    assert res["cand"] == pytest.approx(100.0) and res["diff"] > 0 and res["boot95"][0] > 0 and res["p"] < 0.01
    same = train_nmt.paired_bleu(good, good, refs, "en", n_boot=100)
    assert same["diff"] == 0 and same["boot95"] == [0.0, 0.0]


def test_rare_token_recall_clips_counts_per_sentence():
    import train_nmt
    rare = torch.zeros(10, dtype=torch.bool)
    rare[[7, 8]] = True
    r = train_nmt.rare_token_recall(hyps=[[1, 7, 7, 7], [2, 3]], refs=[[7, 8, 1], [8]], rare=rare)
    assert (r["rare_matched"], r["rare_ref_tokens"], r["rare_hyp_tokens"]) == (1, 3, 3)
    assert r["rare_recall"] == pytest.approx(1 / 3) and r["rare_precision"] == pytest.approx(1 / 3)


def test_output_bias_is_reported_against_frequency(lm_run, tmp_path):
    lm_run(tmp_path / "b", "--method", "mle", "--output-bias", "--lr", "3e-2", steps=6)
    m = ev.main([str(tmp_path / "b"), "--out", str(tmp_path / "r"), "--n-samples", "0", "--results",
                 str(tmp_path / "b.json")])["b"]
    ob = m["output_bias"]
    same = lambda a, b: json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN-safe
    assert same(json.load(open(tmp_path / "b.json"))["runs"]["b"]["output_bias"], ob)  # the figure's numbers, saved
    bias = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["model"]["out_bias"]
    cfg = json.load(open(tmp_path / "b" / "config.json"))
    counts = torch.from_numpy(np.load(os.path.join(cfg["data_cache"], "counts.npy")))
    seen = counts > 0
    from scipy import stats
    assert ob["spearman_log_count"] == pytest.approx(stats.spearmanr(counts[seen].log(), bias[seen]).statistic)
    assert ob["spearman_log_count"] > 0  # frequent tokens get the larger bias within a few steps
    assert set(ob["mean_groups"]) == {"freq", "med", "rare"} and (tmp_path / "r" / "output_bias.png").exists()


def test_a_run_saved_before_a_flag_existed_is_the_same_variant_as_its_default():
    old = {"task": "lm", "method": "agg", "lr": 0.002, "seed": 0}
    new = dict(old, seed=1, output_bias=False, split_seed=0)
    other = dict(old, seed=2, output_bias=True)
    names = ev.variant_names({"old": old, "new": new, "other": other})
    assert names["old"] == names["new"] != names["other"] and "output_bias=True" in names["other"]


def test_compare_names_are_checked_before_any_evaluation(runs, tmp_path):
    with pytest.raises(SystemExit, match="no run of variant 'nope'; variants here: agg, mle"):
        ev.main([runs["mle"], runs["agg"], "--out", str(tmp_path / "r"), "--compare", "mle", "nope"])
    assert not (tmp_path / "r" / "metrics.json").exists()


def test_a_crafted_config_json_puts_no_shell_text_in_the_command():
    saved = {"segments": [{"argv": ["--method", "agg", "--out", "; rm -rf /", "--seed", "$(reboot)"]}], "lr": 1e-3,
             "warmup": "5; rm -rf ~", "schedule": "cosine", "versions": {"threads": "1; rm -rf /"}}
    cmd = runlib.run_command(saved, "train_lm.py")
    assert shlex.split(cmd) == ["python", "train_lm.py", "--method", "agg", "--out", "; rm -rf /", "--seed",
                                "$(reboot)", "--lr", "0.001", "--warmup", "5; rm -rf ~"]  # each one word, none run
    saved["versions"]["threads"] = 2
    assert runlib.run_command(saved, "train_lm.py").startswith("OMP_NUM_THREADS=2 python train_lm.py ")


def test_average_last_below_zero_is_refused(runs, tmp_path):
    with pytest.raises(SystemExit, match=r"--average-last -2: give the number of snapshots to average, >= 1"):
        ev.main([runs["mle"], "--out", str(tmp_path / "r"), "--average-last", "-2"])
    with pytest.raises(SystemExit, match=r"--average-last -2"):
        ev.average_checkpoints(runs["mle"], -2)


def test_the_command_of_a_resumed_run_reproduces_it():
    """A run continued in a new folder to a longer --max-steps: one command under inverse-sqrt (the same run, see
    test_resume_equals_uninterrupted), its segments in order under cosine (the decay moved with --max-steps)."""
    import runlib
    segs = [{"argv": ["--method", "agg", "--seed", "1", "--out", "out/a"]},
            {"argv": ["--out", "out/b", "--resume", "--max-steps", "10000"]}]
    saved = {"segments": segs, "lr": 4e-3, "warmup": 200, "out": "out/b"}
    cmd = runlib.run_command(dict(saved, schedule="inverse-sqrt"), "train_nmt.py")
    assert cmd == "python train_nmt.py --method agg --seed 1 --out out/b --max-steps 10000 --lr 0.004 --warmup 200"
    cmd = runlib.run_command(dict(saved, schedule="cosine"), "train_lm.py")
    assert cmd.split(" && ")[1] == "python train_lm.py --out out/b --max-steps 10000 --resume"
    eq = dict(saved, schedule="inverse-sqrt", segments=[{"argv": ["--method", "agg", "--max-steps", "5000"]},
                                                         {"argv": ["--resume", "--max-steps=10000"]}])
    assert runlib.run_command(eq, "train_nmt.py").startswith("python train_nmt.py --method agg --max-steps=10000 --lr")
    spaced = dict(saved, schedule="cosine", segments=[{"argv": ["--method", "agg", "--out", "out/my run"]}])
    assert shlex.split(runlib.run_command(spaced, "train_lm.py"))[4:6] == ["--out", "out/my run"]
    plain = dict(saved, schedule="cosine", segments=[segs[0], {"argv": ["--out", "out/a", "--resume"]}])
    assert runlib.run_command(plain, "train_lm.py") == ("python train_lm.py --method agg --seed 1 --out out/a "
                                                        "--lr 0.004 --warmup 200")


def test_tost_and_the_reanalysis_of_a_results_file(tmp_path):
    assert ev.tost([0.001, -0.002, 0.0015, 0.0], math.log(1.02))["equivalent"] is True
    assert ev.tost([0.05, -0.06, 0.07, -0.04], math.log(1.02))["equivalent"] is False  # too noisy to claim it
    assert ev.tost([0.03, 0.031, 0.029], math.log(1.02))["equivalent"] is False  # a real difference
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "lm_headline.json")
    path = tmp_path / "h.json"
    path.write_text(open(src).read())
    before = json.load(open(src))["compare"][0]
    after = ev.main(["--reanalyse", str(path)])["compare"][0]
    assert after["metrics"]["ppl"]["t95"] == before["metrics"]["ppl"]["t95"]  # the same runs, the same interval
    closed = after["gap_closed_by_calibration"]
    runs = json.load(open(src))["runs"]
    b, c = runs["mle-lr0.004-wu240-s0"], runs["agg-lr0.004-wu240-s0"]
    gap = math.log(b["ppl_groups"]["rare"] / c["ppl_groups"]["rare"])
    cal = math.log(b["rare_bias"]["ppl_groups"]["rare"] / c["rare_bias"]["ppl_groups"]["rare"])
    assert closed["per_seed"][0] == pytest.approx(1 - cal / gap)
    assert set(after["equivalence"]) >= {"ppl", "rare_bias.ppl", "rare_bias.ppl_groups.rare"}
    # a pair whose runs differ in thread count (the record's "threads", else its command's OMP_NUM_THREADS) is refused
    res = json.load(open(src))
    res["runs"]["agg-lr0.004-wu240-s0"]["command"] = "OMP_NUM_THREADS=2 " + \
        res["runs"]["agg-lr0.004-wu240-s0"]["command"].split(" ", 1)[1]
    path.write_text(json.dumps(res))
    with pytest.raises(SystemExit, match=r"the runs of seed 0 .* differ in thread count \(1 vs 2\)"):
        ev.main(["--reanalyse", str(path)])
    assert ev.record_threads(dict(threads=2, command="OMP_NUM_THREADS=1 python train_lm.py")) == 2
    assert ev.record_threads(dict(command="python train_lm.py")) is None
    path.write_text(json.dumps(dict(runs={}, compare=[dict(cells="a study's own comparison")])))
    with pytest.raises(SystemExit, match="not eval.py's"):
        ev.main(["--reanalyse", str(path)])


def test_a_comparison_grows_by_seeds_from_results_files_alone(tmp_path):
    """--reanalyse FILE --add MORE: the runs of MORE join FILE's and the comparison is recomputed over every seed, as
    if evaluated together; a rerun replaces the run of its name and drops that seed's stale BLEU bootstrap."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "nmt_table.json")
    full = json.load(open(src))
    part = lambda seeds: dict(full, runs={k: r for k, r in full["runs"].items() if r["seed"] in seeds},
                              compare=[dict(c, bleu_paired_bootstrap=[b for b in c["bleu_paired_bootstrap"]
                                                                      if b["seed"] in seeds])
                                       for c in full["compare"]])
    seeds = full["compare"][0]["seeds"]
    (tmp_path / "a.json").write_text(json.dumps(dict(part(set(seeds[:2])), command="python eval.py two seeds")))
    (tmp_path / "b.json").write_text(json.dumps(dict(part(set(seeds[2:])), command="python eval.py the others")))
    got = ev.main(["--reanalyse", str(tmp_path / "a.json"), "--add", str(tmp_path / "b.json")])
    (want,), (c,) = full["compare"], got["compare"]
    assert c["seeds"] == seeds and c["bleu_paired_bootstrap"] == want["bleu_paired_bootstrap"]
    assert c["metrics"]["bleu"]["t95"] == pytest.approx(want["metrics"]["bleu"]["t95"])
    assert got["command"] == ["python eval.py two seeds", "python eval.py the others"]
    assert len(got["runs"]) == len(full["runs"])
    rerun = dict(full, runs={"agg-s0": dict(full["runs"]["agg-s0"], bleu=11.0)}, compare=[])
    (tmp_path / "c.json").write_text(json.dumps(rerun))
    got = ev.main(["--reanalyse", str(tmp_path / "a.json"), "--add", str(tmp_path / "c.json")])
    assert [b["seed"] for b in got["compare"][0]["bleu_paired_bootstrap"]] == seeds[1:]
    assert got["runs"]["agg-s0"]["bleu"] == 11.0
    with pytest.raises(SystemExit, match="--add goes with --reanalyse"):
        ev.main(["--add", str(tmp_path / "c.json")])


def test_a_run_evaluated_alone_joins_the_variant_its_settings_match(tmp_path):
    """A run evaluated on its own is named by its method ('agg'); added to a file whose variants say more
    ('agg rare_rule=target-only'), a rerun keeps the replaced run's variant and a new seed takes the variant its
    settings match, so both land in the comparison."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "nmt_rare_rule.json")
    full = json.load(open(src))
    (entry,) = full["compare"]
    (tmp_path / "a.json").write_text(json.dumps(full))
    runs = full["runs"]
    alone = lambda name, seed, **kw: dict(runs[name], variant="agg", seed=seed, **kw)
    more = {"agg-target-only-s0": alone("agg-target-only-s0", 0, bleu=20.0),
            "agg-s7": alone("agg-s0", 7), "agg-target-only-s7": alone("agg-target-only-s0", 7)}
    (tmp_path / "b.json").write_text(json.dumps(dict(full, runs=more, compare=[], command="python eval.py alone")))
    got = ev.main(["--reanalyse", str(tmp_path / "a.json"), "--add", str(tmp_path / "b.json")])
    assert got["runs"]["agg-target-only-s0"]["variant"] == entry["cand"]
    assert got["runs"]["agg-s7"]["variant"] == entry["base"] and got["runs"]["agg-target-only-s7"]["variant"] == entry["cand"]
    (c,) = got["compare"]
    assert c["seeds"] == sorted(entry["seeds"] + [7])
    assert c["metrics"]["bleu"]["cand"][0] == 20.0
    assert 0 not in [b["seed"] for b in c.get("bleu_paired_bootstrap", [])]  # the rerun's seed: its bootstrap is stale


def test_evaluation_builds_no_autograd_graph(runs):
    res = ev.evaluate(runs["agg"], n_samples=1, gen_len=4, prefix_len=4, device="cpu")
    assert not res["metrics"]["type_stats"]["nll"].requires_grad and not res["weight"].requires_grad


def test_articles_are_the_bootstrap_units_of_the_rare_ppl_ratio():
    eos = 9
    ids = np.array([1, 2, eos, 3, eos, 4, 5, 6, eos])  # lines: [1 2 E] [3 E] [4 5 6 E]; articles: lines 0-1, line 2
    art, docs = ev.document_of(ids, eos, [2, 1])
    assert art.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1] and docs == [2, 1]
    assert ev.document_of(ids, eos, None) is None
    # two articles, rare NLL per (article, group); cand gains 2 nats on article 0's 4 rare targets, none on article 1
    stats = lambda rare0, rare1: dict(nll=[[0, 0, rare0], [0, 0, rare1]], count=[[1, 1, 4], [1, 1, 4]])
    pairs = [(dict(article_stats=stats(10.0, 8.0)), dict(article_stats=stats(8.0, 8.0)))] * 2
    res = ev.article_bootstrap(pairs, n_boot=2000)
    assert res["ratio"] == pytest.approx(math.exp(-4 / 16)) and res["gap_share_per_article"] == [1.0, 0.0]
    lo, hi = res["ratio_article_boot95"]
    assert lo == pytest.approx(math.exp(-8 / 16)) and hi == pytest.approx(1.0)  # both articles from 0, both from 1


def test_temperature_is_the_nll_optimum_over_a_fresh_pass_per_step():
    g = torch.Generator().manual_seed(1)
    V, N = 40, 600
    logits = torch.randn(N, V, generator=g) * 3  # over-confident: the fit cools it (t > 1)
    y = torch.where(torch.rand(N, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, V, (N,), generator=g))
    passes = []

    def batches():  # three micro-batches of shape (batch, positions, V), as train_lm.score yields them
        passes.append(1)
        for i in range(0, N, 200):
            yield logits[i:i + 200].view(4, 50, V), y[i:i + 200].view(4, 50)
    beta = ev.fit_temperature(batches)
    nll = lambda b: F.cross_entropy(b * logits.double(), y).item()
    assert nll(beta) <= min(nll(float(b)) for b in torch.linspace(beta - 0.2, beta + 0.2, 81)) + 1e-9
    assert beta < 1 and nll(beta) < nll(1.0) and 2 <= len(passes) < 30
