"""studies/scale.py and studies/rivals.py: the studies' plans (selections on validation, bracketed
learning rates, nested data, pairs on one host), their results files, and --train-fraction."""

import itertools
import json
import math
import os
import shutil
import sys

import numpy as np
import pytest
import torch

import data as data_py
import train_lm
from studies import compare, pool, practice, rivals, scale, schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_name(*spec):  # the run name studies.scale gives a setting
    return scale.run_spec(*spec)[0]


def fake_run(study, name, valid_ppl, steps=10):
    """A finished run folder as studies.scale reads it: config.json, a last valid record, a
    checkpoint at max_steps."""
    folder = study.folder(name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(max_steps=steps, task="lm"), f)
    with open(os.path.join(folder, "log.jsonl"), "w") as f:
        f.write(json.dumps(dict(step=steps, split="valid", ppl=valid_ppl)) + "\n")
    torch.save(
        dict(step=steps, config=dict(max_steps=steps, task="lm"), model={}),
        os.path.join(folder, "ckpt.pt"),
    )


def test_plan_selects_on_validation_and_brackets_the_lr(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "SIZES", {"S": scale.SIZES["S"]})
    monkeypatch.setattr(scale, "SHARE_SETTING", dict(size="S", lr=4e-3))
    study = scale.Study(str(tmp_path))
    plan = study.plan()
    names = [n for n, _f, _c in plan]
    assert all("-f1-" in n for n in names)  # sweeps first, on the full data, nothing else yet
    assert sorted(n for n in names if "mle" in n) == sorted(
        run_name("S", 1.0, "mle", lr, s) for lr in scale.LRS["S"] for s in scale.SELECTION_SEEDS
    )

    def seeds(name, ppls):
        return [fake_run(study, name(s), p) for s, p in zip(scale.SELECTION_SEEDS, ppls)]

    # the smallest share wins: the list is extended downwards
    for i, share in enumerate(scale.SHARES):
        seeds(lambda s: run_name("S", 1.0, "agg", 4e-3, s, share), [100 + i] * 3)
    assert study.share()[0] is None
    seeds(lambda s: run_name("S", 1.0, "agg", 4e-3, s, scale.SHARES[0] / 2), [101] * 3)
    assert study.share()[0] == scale.SHARES[0]  # now bracketed
    # the mean over seeds decides: the middle lr has the best seed but a bad mode on the others
    lrs = scale.LRS["S"]
    seeds(lambda s: run_name("S", 1.0, "mle", lrs[0], s), [110, 110, 110])
    seeds(lambda s: run_name("S", 1.0, "mle", lrs[1], s), [100, 140, 140])
    seeds(lambda s: run_name("S", 1.0, "mle", lrs[2], s), [105, 105, 106])
    best, sweep = study.lr("S", "mle", None)
    # extended
    assert best is None and run_name("S", 1.0, "mle", 2 * lrs[2], 0) in [n for n, _ in sweep]
    seeds(lambda s: run_name("S", 1.0, "mle", 2 * lrs[2], s), [120] * 3)
    # bracketed, and not the lr of the best single seed
    assert study.lr("S", "mle", None)[0] == lrs[2]
    plan = study.plan()
    names = {n for n, _f, _c in plan}
    cells = {run_name("S", f, "mle", lrs[2], s) for f in scale.FRACTIONS for s in scale.SEEDS}
    assert cells <= names  # every data size and seed at the selected lr
    flags = next(f for n, f, _c in plan if n == run_name("S", 0.25, "mle", lrs[2], 1))
    flags = dict(zip(flags[::2], flags[1::2]))
    assert (
        flags["--max-steps"] == str(scale.FULL_STEPS // 4) and flags["--train-fraction"] == "0.25"
    )


def test_train_fraction_is_a_nested_prefix_with_the_whole_splits_tokenizer(corpus, tmp_path):
    base = dict(data_dir=corpus["data"], cache_dir=str(tmp_path / "cache"), vocab_size=300)
    full = data_py.prepare_lm(train_lm.make_config(**base), log=lambda *a: None)
    half = data_py.prepare_lm(train_lm.make_config(**base, train_fraction=0.5), log=lambda *a: None)
    quarter = data_py.prepare_lm(
        train_lm.make_config(**base, train_fraction=0.25), log=lambda *a: None
    )
    assert full["tokenizer"].to_str() == half["tokenizer"].to_str() == quarter["tokenizer"].to_str()
    for split in ("valid", "test"):  # the same held-out ids at every data size
        assert np.array_equal(full["ids"][split], half["ids"][split])
    n = [len(d["ids"]["train"]) for d in (quarter, half, full)]
    assert n[0] < n[1] < n[2] and abs(n[1] / n[2] - 0.5) < 0.05 and abs(n[0] / n[2] - 0.25) < 0.05
    assert np.array_equal(half["ids"]["train"][: n[0]], quarter["ids"]["train"])  # nested prefixes
    assert np.array_equal(full["ids"]["train"][: n[1]], half["ids"]["train"])
    with pytest.raises(SystemExit, match="--train-fraction 1.5"):
        train_lm.make_config(**base, train_fraction=1.5)


def test_train_subset_cuts_whole_documents():
    corpus = dict(train=["a" * 10, "b" * 10, "c" * 30, "d" * 50], documents=dict(train=[2, 1, 1]))
    # 20 of 100 characters: the first document
    assert data_py.train_subset(corpus, 0.25) == ["a" * 10, "b" * 10]
    assert data_py.train_subset(corpus, 0.5) == ["a" * 10, "b" * 10, "c" * 30]
    assert data_py.train_subset(corpus, 0.01) == ["a" * 10, "b" * 10]  # at least one document
    # lines when no documents
    assert data_py.train_subset(dict(train=["x" * 10] * 4), 0.5) == ["x" * 10] * 2


def test_a_results_file_continues_the_study_without_its_run_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "SIZES", {"S": scale.SIZES["S"]})
    monkeypatch.setattr(scale, "SHARE_SETTING", dict(size="S", lr=4e-3))
    runs = {
        run_name("S", 1.0, "agg", 4e-3, s, sh): dict(valid_ppl=100 + abs(i - 1))
        for i, sh in enumerate(scale.SHARES)
        for s in scale.SELECTION_SEEDS
    }
    path = tmp_path / "lm_scale.json"
    path.write_text(json.dumps(dict(command="python -m studies.scale", runs=runs)))
    study = scale.Study(str(tmp_path / "elsewhere"), prior=[str(path)])
    assert study.share()[0] == scale.SHARES[1]  # selected from the recorded valid PPL
    study.plan()
    assert all(study.finished(n) and study.evaluated(n) for n in runs)
    assert scale.next_job(study, {})[0] not in runs  # nothing recorded is trained again


def test_rivals_select_each_rival_on_validation_then_train_its_seeds(tmp_path):
    study = rivals.Rivals(str(tmp_path))
    plan = study.plan()
    names = [n for n, _f, _c in plan]
    assert len(names) == sum(len(rivals.LRS) * len(k) for _m, _f, k in rivals.RIVALS.values())
    flags = next(f for n, f, _c in plan if n == rivals.run_name("coupled-adam", 4e-3, "ewd0.01", 0))
    assert (
        flags[flags.index("--optimizer") + 1] == "coupled-adam"
        and "--embedding-weight-decay" in flags
    )
    # zloss at seed 0: lr 4e-3 with z 1e-3 best, lr 8e-3 with z 1e-3 next
    for i, lr in enumerate(rivals.LRS):
        for j, (knob, _) in enumerate(rivals.RIVALS["zloss"][2]):
            fake_run(
                study,
                rivals.run_name("zloss", lr, knob, 0),
                100 + abs(i - 1) + abs(j - 1) - 0.5 * (i == 2),
            )
    best, runs = study.selection("zloss")
    finalists = [(4e-3, "z0.001"), (8e-3, "z0.001")]
    # the finalists go on to seeds 1 and 2
    assert best is None and study.finalists("zloss") == finalists
    assert {rivals.run_name("zloss", *v, s) for v in finalists for s in (1, 2)} <= {
        n for n, _f in runs
    }
    # seed 0's best was a good mode: the mean over seeds 0-2 selects the other finalist
    for s in (1, 2):
        fake_run(study, rivals.run_name("zloss", 4e-3, "z0.001", s), 110)
        fake_run(study, rivals.run_name("zloss", 8e-3, "z0.001", s), 101)
    assert study.selection("zloss")[0] == (8e-3, "z0.001")
    plan = study.plan()
    seeds = sorted(n for n, _f, _c in plan if n.startswith("zloss-lr0.008-z0.001-"))
    assert seeds == [
        rivals.run_name("zloss", 8e-3, "z0.001", s) for s in range(rivals.SEEDS["zloss"])
    ]
    # every knob at the selected lr: 3 seeds
    curve = {n for n, _f, _c in plan if n.startswith("zloss-lr0.008-")}
    assert curve == {
        rivals.run_name("zloss", 8e-3, k, s) for k, _ in rivals.RIVALS["zloss"][2] for s in range(3)
    } | set(seeds)
    assert not any(n.startswith("zloss-lr0.002-") and not n.endswith("-s0") for n, _f, _c in plan)
    # the finished runs evaluated; then one more run late in the plan finishes
    for n, _f, _c in plan:
        if study.finished(n):
            os.makedirs(os.path.join(study.folder(n), "report"))
            open(os.path.join(study.folder(n), "report", "metrics.json"), "w").close()
    last = max(curve)  # it is evaluated before an unfinished earlier run trains
    fake_run(study, last, 105)
    name, cmd, log = scale.next_job(study, {})
    assert name == last and cmd[1].endswith("eval.py") and cmd[-2:] == ["--n-samples", "5"]
    assert log == study.folder(name) + ".log"  # the job's output, beside its run folder
    name, cmd, _log = scale.next_job(study, {last})
    assert cmd[1].endswith("train_lm.py") and not study.finished(name)


def test_agg_runs_at_the_selected_and_the_headline_share_and_each_pairs_with_mle(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(scale, "SIZES", {"M": scale.SIZES["M"]})
    monkeypatch.setattr(scale, "FRACTIONS", [0.5, 1.0])
    lr, sel_share = 4e-3, scale.SHARES[0]
    runs = {}

    def record(name, method, fraction, share, seed, ppl, lr=lr):
        rare = dict(freq=100.0, med=1000.0, rare=ppl * 40)
        runs[name] = dict(
            method=method,
            seed=seed,
            size="M",
            train_fraction=fraction,
            train_tokens=int(7e5 * fraction),
            n_params_non_embedding=793_000,
            d_model=128,
            n_layer=4,
            lr=lr,
            rare_share=share,
            valid_ppl=ppl,
            ppl=ppl,
            ppl_groups=rare,
            isotropy=0.1,
            isotropy_groups=dict(rare=0.05),
            uniq=100,
            rare_bias=dict(ppl=ppl, ppl_groups=dict(rare, rare=ppl * 30)),
        )

    # the sweeps: share SHARES[0] bracketed, lr 4e-3 the middle value for both
    for s in scale.SELECTION_SEEDS:
        for i, sh in enumerate([sel_share / 2] + scale.SHARES):
            record(run_name("M", 1.0, "agg", lr, s, sh), "agg", 1.0, sh, s, 101 + abs(i - 1))
        for i, x in enumerate(scale.LRS["M"]):
            record(
                run_name("M", 1.0, "mle", x, s), "mle", 1.0, None, s, 100 + abs(i - 1) + s / 3, x
            )
            record(
                run_name("M", 1.0, "agg", x, s, sel_share),
                "agg",
                1.0,
                sel_share,
                s,
                101 + abs(i - 1) + s,
                x,
            )
    path = tmp_path / "lm_scale.json"
    path.write_text(json.dumps(dict(command="python -m studies.scale", runs=runs)))
    study = scale.Study(str(tmp_path / "out"), prior=[str(path)])
    assert study.selections() == dict(share=sel_share, lr={"M": dict(mle=lr, agg=lr)})
    names = {n for n, _f, _c in study.plan()}
    # both shares in every cell and on the second corpus
    for sh in (sel_share, scale.HEADLINE_SHARE):
        assert (
            run_name("M", 0.5, "agg", lr, 2, sh) in names
            and run_name("M", 1.0, "agg", lr, 2, sh) in names
        )
        assert "bible-" + run_name("M", 1.0, "agg", lr, 0, sh) in names
    for s in scale.SEEDS:  # finish the cells
        record(run_name("M", 0.5, "mle", lr, s), "mle", 0.5, None, s, 150)
        for sh in (sel_share, scale.HEADLINE_SHARE):
            record(
                run_name("M", 0.5, "agg", lr, s, sh),
                "agg",
                0.5,
                sh,
                s,
                150 * (1.01 if sh == sel_share else 1.03),
            )
    path.write_text(json.dumps(dict(command="python -m studies.scale", runs=runs)))
    study = scale.Study(str(tmp_path / "out"), prior=[str(path)])
    study.host = "d4" * 8  # a pair on one host exists now: no machine trains the cell's runs again
    assert not any(scale.REPLICA.search(n) for n, _f, _c in study.plan())
    study.write_results(str(path), [])
    result = json.loads(path.read_text())
    cells = {(c["agg_share"], c["train_fraction"]): c for c in result["compare"]}
    assert set(cells) == {(sh, f) for sh in (sel_share, scale.HEADLINE_SHARE) for f in (0.5, 1.0)}
    assert np.isclose(np.exp(cells[scale.HEADLINE_SHARE, 0.5]["ppl_log_ratio"]["mean"]), 1.03)
    assert np.isclose(np.exp(cells[sel_share, 0.5]["ppl_log_ratio"]["mean"]), 1.01)


def test_a_cell_pairs_runs_on_one_host_and_a_mixed_pair_is_trained_again_here(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(scale, "SIZES", {"M": scale.SIZES["M"]})
    monkeypatch.setattr(scale, "FRACTIONS", [0.5, 1.0])
    lr, share, a1, b2, c3 = 4e-3, scale.SHARES[0], "a1" * 8, "b2" * 8, "c3" * 8
    runs = {}

    def record(name, method, fraction, sh, seed, ppl, lr=lr, kernels=a1):
        rare = dict(freq=100.0, med=1000.0, rare=ppl * 40)
        runs[name] = dict(
            method=method,
            seed=seed,
            size="M",
            train_fraction=fraction,
            train_tokens=int(7e5 * fraction),
            n_params_non_embedding=793_000,
            d_model=128,
            n_layer=4,
            lr=lr,
            rare_share=sh,
            kernels=kernels,
            valid_ppl=ppl,
            ppl=ppl,
            ppl_groups=rare,
            isotropy=0.1,
            isotropy_groups=dict(rare=0.05),
            uniq=100,
            rare_bias=dict(ppl=ppl, ppl_groups=dict(rare, rare=ppl * 30)),
        )

    for s in scale.SELECTION_SEEDS:  # the sweeps select lr 4e-3 for both and the share SHARES[0]
        for i, sh in enumerate([share / 2] + scale.SHARES):
            record(run_name("M", 1.0, "agg", lr, s, sh), "agg", 1.0, sh, s, 101 + abs(i - 1))
        for i, x in enumerate(scale.LRS["M"]):
            record(run_name("M", 1.0, "mle", x, s), "mle", 1.0, None, s, 100 + abs(i - 1), x)
            record(
                run_name("M", 1.0, "agg", x, s, share), "agg", 1.0, share, s, 101 + abs(i - 1), x
            )
    # the half-data cell: seed 1's AGG runs ran on another host than its MLE run
    for s in scale.SEEDS:
        record(run_name("M", 0.5, "mle", lr, s), "mle", 0.5, None, s, 150)
        for sh in (share, scale.HEADLINE_SHARE):
            record(
                run_name("M", 0.5, "agg", lr, s, sh),
                "agg",
                0.5,
                sh,
                s,
                153,
                kernels=b2 if s == 1 else a1,
            )
    path = tmp_path / "lm_scale.json"
    path.write_text(json.dumps(dict(command="python -m studies.scale", runs=runs)))
    study = scale.Study(str(tmp_path / "out"), prior=[str(path)])
    study.host = c3  # this machine: the mixed pair's runs, both, are planned here
    replicas = {n for n, _f, _c in study.plan() if scale.REPLICA.search(n)}
    assert replicas == {run_name("M", 0.5, "mle", lr, 1) + "-kc3c3c3c3"} | {
        run_name("M", 0.5, "agg", lr, 1, sh) + "-kc3c3c3c3" for sh in (share, scale.HEADLINE_SHARE)
    }
    study.write_results(str(path), [])
    cell = next(c for c in json.loads(path.read_text())["compare"] if c["train_fraction"] == 0.5)
    assert cell["seeds"] == [0, 2] and cell["hosts"] == [a1, a1]  # never a pair across hosts
    # trained, not yet evaluated: still planned, so that the pool evaluates them
    for name in replicas:
        fake_run(study, name, 150)
    again = scale.Study(str(tmp_path / "out"), prior=[str(path)])
    again.host = c3
    assert replicas <= {n for n, _f, _c in again.plan()}
    shutil.rmtree(tmp_path / "out")
    for name in replicas:  # trained here: the pair of seed 1 on host c3
        method = "mle" if "-mle-" in name else "agg"
        sh = None if method == "mle" else float(name.split("-r")[1].split("-")[0])
        record(name, method, 0.5, sh, 1, 150 if method == "mle" else 156, kernels=c3)
    path.write_text(json.dumps(dict(command="python -m studies.scale", runs=runs)))
    study = scale.Study(str(tmp_path / "out"), prior=[str(path)])
    study.host = "d4" * 8  # a pair on one host exists now: no machine trains the cell's runs again
    assert not any(scale.REPLICA.search(n) for n, _f, _c in study.plan())
    study.write_results(str(path), [])
    result = json.loads(path.read_text())
    cell = next(
        c for c in result["compare"] if c["train_fraction"] == 0.5 and c["agg_share"] == share
    )
    assert cell["seeds"] == [0, 1, 2] and cell["hosts"] == [a1, c3, a1]
    assert cell["ppl_log_ratio"]["diffs"] == pytest.approx(
        [math.log(153 / 150), math.log(156 / 150), math.log(153 / 150)]
    )
    assert result["runs"][next(iter(replicas))]["replica"] is True
    # a run before kernels: its commit's
    assert scale.host(dict(git_commit="22848175" + "0" * 32)) == "94e9eedb52747eaa"


def test_rivals_results_hold_the_knob_curve_the_pairs_and_the_pareto_picture(tmp_path, monkeypatch):
    # one knob value off the selection gets 5 seeds
    monkeypatch.setattr(rivals.Rivals, "knob_seeds", {("zloss", "z0.01"): 5})

    a1, b2 = "a1" * 8, "b2" * 8  # two hosts' kernels

    def evaluated(name, rival, lr, knob, seed, ppl, rare_iso, host=None):
        fake_run(study, name, ppl)
        folder = study.folder(name)
        method, flags, _ = rivals.RIVALS[rival]
        # zloss's seed 2 ran on another host
        host = host or (b2 if (rival, seed) == ("zloss", 2) else a1)
        cfg = dict(
            task="lm",
            max_steps=10,
            method=method,
            lr=lr,
            seed=seed,
            method_hparams={},
            versions=dict(threads=1, kernels=host),
            git_commit="abc",
            argv=study.flags(rival, lr, knob, seed),
            optimizer="adamw",
        )
        json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
        os.makedirs(os.path.join(folder, "report"))
        m = dict(
            method=method,
            seed=seed,
            valid_ppl=ppl,
            ppl=ppl - 40,
            ppl_groups=dict(freq=50.0, med=900.0, rare=8000.0 - 1000 * rare_iso),
            isotropy=rare_iso + 0.1,
            isotropy_groups=dict(freq=0.3, med=0.2, rare=rare_iso),
            isoscore=0.2,
            uniq=900 + seed,
        )
        json.dump({name: m}, open(os.path.join(folder, "report", "metrics.json"), "w"))

    study = rivals.Rivals(str(tmp_path / "out"))
    for rival, knob_iso in (
        ("mle", {"": 0.03}),
        ("zloss", {"z0.0001": 0.03, "z0.001": 0.05, "z0.01": 0.2, "z0.1": 0.3}),
    ):
        # the seed-0 sweep, then the finalists' seeds, then the selection's and the curve's
        for _ in range(3):
            for name, flags, _c in study.plan():
                if not name.startswith(rival + "-") or study.finished(name):
                    continue
                lr, seed = (
                    float(flags[flags.index("--lr") + 1]),
                    int(flags[flags.index("--seed") + 1]),
                )
                knob = (
                    next(k for k in knob_iso if k and f"-{k}-" in name) if len(knob_iso) > 1 else ""
                )
                ppl = 300 + 10 * abs(math.log2(lr / 4e-3)) + 5 * list(knob_iso).index(knob) + seed
                evaluated(name, rival, lr, knob, seed, ppl, knob_iso[knob] + 0.01 * seed)
    study.write_results(
        str(tmp_path / "lm_rivals.json"),
        ["--no-train", "--out", "/elsewhere", "--results", str(tmp_path / "lm_rivals.json")],
    )
    res = json.load(open(tmp_path / "lm_rivals.json"))
    # runs: out/rivals
    assert res["command"] == f"python -m studies.rivals --results {tmp_path.name}/lm_rivals.json"
    assert res["selection"]["selected"]["zloss"] == [4e-3, "z0.0001"] and res["selection"][
        "selected"
    ]["mle"] == [4e-3, ""]
    curve = res["selection"]["knob_curve"]["zloss"]
    assert list(curve) == ["z0.0001", "z0.001", "z0.01", "z0.1"] and curve["z0.01"][
        "rare_isotropy"
    ] == pytest.approx([0.2, 0.21, 0.22])
    assert curve["z0.001"]["valid_ppl"] == [305, 306, 307]
    # every other knob value against MLE, on one host too
    knobs = {c["cand"]: c for c in res["compare_knobs"]}
    assert set(knobs) == {"zloss z0.001", "zloss z0.01", "zloss z0.1"} and knobs["zloss z0.001"][
        "seeds"
    ] == [0, 1]
    # its KNOB_SEEDS; the curve keeps seeds 0-2 like the others
    assert knobs["zloss z0.01"]["seeds"] == [0, 1, 3, 4]
    assert knobs["zloss z0.01"]["metrics"]["isotropy_groups.rare"]["diffs"] == pytest.approx(
        [0.17] * 4
    )
    (pair,) = res["compare"]
    # never across hosts
    assert pair["base"] == "mle" and pair["cand"] == "zloss" and pair["seeds"] == [0, 1, 3, 4]
    assert pair["unpaired"] == {"2": f"host kernels ({a1} vs {b2})"}
    # on host b2 the study plans MLE's seed 2 again (a replica), and then pairs all three seeds,
    # each on one host
    study.host = b2
    replica = rivals.run_name("mle", 4e-3, "", 2) + "-k" + b2[:8]
    planned = {n for n, _f, _c in study.plan()}
    assert replica in planned and not any(n.endswith("-k" + a1[:8]) for n in planned)
    evaluated(replica, "mle", 4e-3, "", 2, 302, 0.05, host=b2)
    study.write_results(str(tmp_path / "lm_rivals.json"), [])
    res = json.load(open(tmp_path / "lm_rivals.json"))
    (pair,) = res["compare"]
    assert (
        pair["seeds"] == [0, 1, 2, 3, 4]
        and pair["unpaired"] == {}
        and res["runs"][replica]["replica"] is True
    )
    # the results file carries it to another machine
    assert rivals.Rivals(
        str(tmp_path / "elsewhere"), prior=[str(tmp_path / "lm_rivals.json")]
    ).replicas((4e-3, "")) == {replica: study.flags("mle", 4e-3, "", 2)}
    # the replica is no fourth seed
    assert res["selection"]["knob_curve"]["mle"][""]["valid_ppl"] == [300, 301, 302]
    # untied AGG is paired with MLE and with untied MLE, its own control
    for rival, knob_iso in (
        ("untied-mle", {"": 0.03}),
        ("untied-agg", {"share0.05": 0.1, "share0.2": 0.7, "share0.4": 0.5}),
    ):
        for _ in range(3):
            for name, flags, _c in study.plan():
                if not name.startswith(rival + "-") or study.finished(name):
                    continue
                lr, seed = (
                    float(flags[flags.index("--lr") + 1]),
                    int(flags[flags.index("--seed") + 1]),
                )
                knob = (
                    next(k for k in knob_iso if k and f"-{k}-" in name) if len(knob_iso) > 1 else ""
                )
                evaluated(
                    name,
                    rival,
                    lr,
                    knob,
                    seed,
                    300 + 10 * abs(math.log2(lr / 4e-3)) + seed,
                    knob_iso[knob],
                )
    study.write_results(str(tmp_path / "lm_rivals.json"), [])
    pairs = {
        (c["base"], c["cand"]): c for c in json.load(open(tmp_path / "lm_rivals.json"))["compare"]
    }
    assert set(pairs) == {
        ("mle", "zloss"),
        ("mle", "untied-mle"),
        ("mle", "untied-agg"),
        ("untied-mle", "untied-agg"),
    }
    assert pairs["untied-mle", "untied-agg"]["seeds"] == [0, 1, 2]
    assert pairs["untied-mle", "untied-agg"]["metrics"]["isotropy_groups.rare"][
        "diffs"
    ] == pytest.approx([0.07] * 3)
    run_name = rivals.run_name("zloss", 4e-3, "z0.01", 2)
    run = res["runs"][run_name]
    assert run["rival"] == "zloss" and run["command"].startswith(
        "OMP_NUM_THREADS=1 python train_lm.py"
    )
    assert (
        run["eval_command"]
        == f"python eval.py out/rivals/runs/{run_name} --out out/rivals/runs/{run_name}/report "
        "--n-samples 5"
        and run["knob"] == "z0.01"
        and run["isoscore"] == 0.2
    )
    assert os.path.getsize(tmp_path / "lm_rivals.png") > 10000


def test_a_results_file_keeps_a_finished_run_its_plan_no_longer_names(tmp_path):
    # a finalist's seed-1 run of another machine while this machine's seed-0 sweep is unfinished:
    # not in the plan
    name, path = rivals.run_name("zloss", 4e-3, "z0.01", 1), tmp_path / "lm_rivals.json"
    record = dict(
        rival="zloss",
        method="zloss",
        lr=4e-3,
        knob="z0.01",
        seed=1,
        valid_ppl=290.0,
        kernels="a1" * 8,
        isotropy_groups=dict(rare=0.2),
        isoscore=0.2,
    )
    path.write_text(json.dumps(dict(command="python -m studies.rivals", runs={name: record})))
    study = rivals.Rivals(str(tmp_path / "out"), prior=[str(path)])
    assert name not in {n for n, _f, _c in study.plan()}
    study.write_results(str(path), [])
    assert json.loads(path.read_text())["runs"] == {name: record}


def test_the_practice_lr_figure_shows_the_later_fixes_rivals_beside_its_own(tmp_path, monkeypatch):
    shown = {}
    monkeypatch.setattr(
        rivals, "plot_lr_sensitivity", lambda sensitivity, title, path: shown.update(sensitivity)
    )
    # MLE's sweep and its two finalists' seeds
    ppl = {
        (2e-3, 0): 300.0,
        (4e-3, 0): 290.0,
        (8e-3, 0): 310.0,
        (2e-3, 1): 301.0,
        (2e-3, 2): 302.0,
        (4e-3, 1): 291.0,
        (4e-3, 2): 292.0,
    }
    runs = {
        rivals.run_name("mle", lr, "", seed): dict(
            rival="mle",
            method="mle",
            lr=lr,
            knob="",
            seed=seed,
            valid_ppl=v,
            kernels="a1" * 8,
            isotropy_groups=dict(rare=0.03),
            isoscore=0.1,
        )
        for (lr, seed), v in ppl.items()
    }
    (path := tmp_path / "lm_practice.json").write_text(
        json.dumps(dict(command="python -m studies.practice", runs=runs))
    )
    later = dict(sensitivity=0.02, valid_ppl={"0.002": 290.0, "0.004": 280.0, "0.008": 285.0})
    (other := tmp_path / "lm_rivals.json").write_text(
        json.dumps(
            dict(
                command="python -m studies.rivals",
                runs={},
                lr_sensitivity=dict(zloss=later, mle=later),
            )
        )
    )
    study = practice.Practice(str(tmp_path / "out"), prior=[str(path)])
    study.lr_also = str(other)
    study.write_results(str(path), [])
    assert shown["zloss"] == later and shown["mle"]["valid_ppl"] == {
        "0.002": 300.0,
        "0.004": 290.0,
        "0.008": 310.0,
    }


def test_practice_pairs_agg_with_the_knob_at_every_knob_value_both_curves_hold(tmp_path):
    # AGG: 2% above the knob alone at every cap, seed and lr
    def record(rival, lr, cap, seed, host):
        ppl = (290 + 10 * abs(math.log2(lr / 4e-3)) + cap / 10 + seed) * (
            1.02 if rival.startswith("agg") else 1
        )
        return dict(
            rival=rival,
            method=rival[:3] if rival.startswith("agg") else "mle",
            lr=lr,
            knob=f"cap{cap}",
            seed=seed,
            valid_ppl=ppl,
            ppl=ppl,
            kernels=host,
            isotropy_groups=dict(rare=0.03),
            isoscore=0.1,
        )

    runs = {
        rivals.run_name(r, lr, f"cap{c}", s): record(
            r, lr, c, s, "b2" * 8 if (r, c, s) == ("softcap", 30, 1) else "a1" * 8
        )
        for r in ("softcap", "agg+softcap")
        for lr in rivals.LRS
        for c in (15, 30, 60)
        for s in range(5)
    }
    (path := tmp_path / "lm_practice.json").write_text(
        json.dumps(dict(command="python -m studies.practice", runs=runs))
    )
    practice.Practice(str(tmp_path / "out"), prior=[str(path)]).write_results(str(path), [])
    res = json.load(open(path))
    assert (
        res["selection"]["selected"]["softcap"]
        == res["selection"]["selected"]["agg+softcap"]
        == [4e-3, "cap15"]
    )
    same = {c["cand"]: c for c in res["compare_same_knob"]}
    # seeds 0-2 of each curve
    assert set(same) == {"agg+softcap cap15", "agg+softcap cap30", "agg+softcap cap60"}
    assert {c["base"] for c in same.values()} == {"softcap"} and same["agg+softcap cap60"][
        "seeds"
    ] == [0, 1, 2]
    assert same["agg+softcap cap30"]["seeds"] == [0, 2]  # never across hosts
    assert same["agg+softcap cap30"]["metrics"]["ppl"]["diffs"] == pytest.approx(
        [math.log(1.02)] * 2
    )


def test_a_study_refuses_a_results_file_that_is_not_its_own(tmp_path):
    """A results file of another study or of studies.compare is never taken in (and so never
    rewritten)."""
    path = tmp_path / "lm_headline.json"
    path.write_text(
        json.dumps(
            dict(
                command="python eval.py out/a out/b --results results/lm_headline.json",
                runs={"mle-s0": dict(valid_ppl=1.0)},
            )
        )
    )
    before = path.read_text()
    for study in (scale.Study, rivals.Rivals):
        with pytest.raises(
            SystemExit, match=r"lm_headline.json: written by another command \(python eval.py"
        ):
            study(str(tmp_path / "out"), prior=[str(path)])
    assert path.read_text() == before
    # the study's own files are taken in
    bible = json.load(
        open(
            os.path.join(
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                "results",
                "lm_bible.json",
            )
        )
    )
    path.write_text(json.dumps(bible))
    assert (
        scale.Study(str(tmp_path / "out"), prior=[str(path)]).prior.keys() == bible["runs"].keys()
    )


def test_a_diverged_run_never_wins_a_selection(tmp_path):
    path = tmp_path / "lm_scale.json"
    runs = {
        "a-s0": dict(valid_ppl=float("nan")),
        "a-s1": dict(valid_ppl=90.0),
        "b-s0": dict(valid_ppl=120.0),
        "b-s1": dict(valid_ppl=121.0),
    }
    path.write_text(json.dumps(dict(command="python -m studies.scale", runs=runs)))
    study = scale.Study(str(tmp_path / "out"), prior=[str(path)])
    best, _ = study.select({"a": [("a-s0", []), ("a-s1", [])], "b": [("b-s0", []), ("b-s1", [])]})
    assert best == "b"  # a's mean is NaN: a diverged seed, not the lowest PPL


def test_a_run_folder_made_with_other_flags_is_refused(tmp_path):
    """A finished run trained at lr 0.05 in the folder of the lr 0.004 setting never becomes that
    setting's run."""
    study = scale.Study(str(tmp_path))
    name, flags = scale.run_spec("M", 1.0, "mle", 4e-3, 0)
    wrong = flags[: flags.index("--lr") + 1] + ["0.05"] + flags[flags.index("--lr") + 2 :]
    os.makedirs(study.folder(name))
    with open(os.path.join(study.folder(name), "config.json"), "w") as f:
        json.dump(
            dict(
                task="lm",
                max_steps=2400,
                segments=[dict(argv=wrong + ["--out", study.folder(name)])],
            ),
            f,
        )
    torch.save(
        dict(step=2400, config=dict(max_steps=2400, task="lm"), model={}),
        study.folder(name) + "/ckpt.pt",
    )
    with pytest.raises(SystemExit, match=r"was trained with lr=0.05 \(now 0.004\)"):
        study.select({4e-3: [(name, flags)]})
    study.check(name, wrong)  # the flags it was made with: no refusal
    # brought back without it: config.json says what it is
    os.remove(study.folder(name) + "/ckpt.pt")
    with pytest.raises(SystemExit, match=r"was trained with lr=0.05 \(now 0.004\)"):
        scale.Study(str(tmp_path)).check(name, flags)
    with open(os.path.join(study.folder(name), "config.json"), "w") as f:  # a flag removed since
        json.dump(
            dict(task="lm", max_steps=2400, segments=[dict(argv=flags + ["--old-flag", "3"])]), f
        )
    with pytest.raises(
        SystemExit,
        match=rf"{name} was trained with flags train_lm.py no longer takes "
        r"\(unrecognized arguments: --old-flag 3\)",
    ):
        scale.Study(str(tmp_path)).check(name, flags)


def test_a_deleted_diverged_run_is_redone_and_a_linked_log_is_refused(tmp_path, monkeypatch):
    study = scale.Study(str(tmp_path / "out"))
    name, flags = scale.run_spec("M", 1.0, "mle", 4e-3, 0)
    os.makedirs(study.folder(name))
    with open(study.folder(name) + ".log", "w") as f:
        f.write("step 5: the valid loss is nan (diverged); lower --lr\n")
    assert study.diverged(name)
    shutil.rmtree(study.folder(name))  # deleted to redo it
    again = scale.Study(str(tmp_path / "out"))
    assert not again.diverged(name) and not again.finished(name)
    monkeypatch.setattr(scale.Study, "plan", lambda self: [(name, flags, 1.0)])
    job = scale.next_job(scale.Study(str(tmp_path / "out")), set())
    assert (
        job[0] == name
        and "--resume" not in job[1]
        and os.path.exists(study.folder(name) + ".log.old")
    )
    os.makedirs(study.folder(name))
    os.symlink(tmp_path / "elsewhere.log", study.folder(name) + ".log")
    with pytest.raises(SystemExit, match=rf"cannot open .*{name}.log .*remove it if a link"):
        scale.Study(str(tmp_path / "out")).diverged(name)


def test_practice_sweeps_each_knob_with_mle_and_agg_on_real_flags_and_refuses_the_rivals_file(
    tmp_path,
):
    study = practice.Practice(str(tmp_path))
    plan = study.plan()
    flags = {n: f for n, f, _c in plan}
    assert len(plan) == 3 * (1 + 3 + 2 + 2 + 5 + 5 + 3 + 3)  # lr x knob at seed 0, nothing else yet
    f = flags[rivals.run_name("agg+untie-at", 4e-3, "at0.67", 0)]
    assert f[f.index("--rare-share") + 1] == "0.2" and f[f.index("--untie-at") + 1] == "0.67"
    for name, knob_flags in (
        ("emb-lr-lr0.008-x100-s0", ["--embedding-lr", "100"]),
        ("softcap-lr0.002-cap15-s0", ["--logit-softcap", "15"]),
    ):
        assert flags[name][-2:] == knob_flags and flags[name][1] == "mle"
    parser = train_lm.build_parser()
    for f in flags.values():  # every run's flags are train_lm.py's
        parser.parse_args(f)
    assert ("softcap", "agg+softcap") in study.pairs  # does AGG add to the knob?
    with pytest.raises(
        SystemExit, match=r"lm_rivals.json: written by another command \(python -m studies.rivals"
    ):
        practice.Practice(str(tmp_path), prior=[os.path.join(ROOT, "results", "lm_rivals.json")])


def test_the_schedule_moves_data_and_epochs_apart_pairs_within_a_host_and_fits_both(tmp_path):
    plan = schedule.Schedule(str(tmp_path / "out")).plan()
    assert len(plan) == 7 * 2 * 5 and plan[0][0] == "f0.25-n600-agg-s0"  # the shortest runs first
    parser = train_lm.build_parser()
    # every run a train_lm.py run at the preset's warm-up; AGG at the headline's share
    for name, flags, _c in plan:
        args = parser.parse_args(flags)
        assert (args.warmup, args.lr, args.eval_interval * 12) == (240, 4e-3, args.max_steps)
        # on any device
        assert (
            args.rare_share == (0.2 if args.method == "agg" else None) and args.dtype == "float32"
        )
    runs = {}
    for fraction, steps in [(f, n) for f, ns in schedule.CELLS.items() for n in ns]:
        tokens = int(7e5 * fraction)
        # a plane
        log_ratio = 0.01 + 0.02 * math.log10(tokens) + 0.1 * math.log10(steps * 1024 / tokens)
        for seed, method in itertools.product(range(5), ("mle", "agg")):
            ppl = 300 * (math.exp(log_ratio) if method == "agg" else 1) * (1 + 0.01 * seed)
            rare = dict(freq=100.0, med=1000.0, rare=ppl * 40)
            host = (
                "b2" * 8 if (fraction, steps, method, seed) == (1.0, 9600, "agg", 4) else "a1" * 8
            )
            runs[schedule.run_spec(fraction, steps, method, seed)[0]] = dict(
                method=method,
                seed=seed,
                train_fraction=fraction,
                max_steps=steps,
                train_tokens=tokens,
                epochs=steps * 1024 / tokens,
                kernels=host,
                valid_ppl=ppl,
                ppl=ppl,
                ppl_groups=rare,
                isotropy=0.1,
                isotropy_groups=dict(rare=0.05),
                uniq=100,
                rare_bias=dict(ppl=ppl, ppl_groups=dict(rare, rare=ppl)),
                # AGG's best step 1% further below its last
                valid_ppl_best=ppl * (0.98 if method == "agg" else 0.99),
            )
    path = tmp_path / "lm_schedule.json"
    path.write_text(json.dumps(dict(command="python -m studies.schedule", runs=runs)))
    schedule.Schedule(str(tmp_path / "out"), prior=[str(path)]).write_results(str(path), [])
    res = json.loads(path.read_text())
    cells = {(c["train_fraction"], c["max_steps"]): c for c in res["compare"]}
    # seed 4's pair spans two hosts
    assert len(cells) == 7 and cells[1.0, 9600]["seeds"] == [0, 1, 2, 3]
    assert sorted(res["unpaired"]) == ["f1-n9600-agg-s4", "f1-n9600-mle-s4"]
    study = schedule.Schedule(str(tmp_path / "out"), prior=[str(path)])
    study.host = "c3" * 8  # the split pair is trained again, both runs, on this host
    assert {n for n, _f, _c in study.plan() if scale.REPLICA.search(n)} == {
        "f1-n9600-agg-s4-kc3c3c3c3",
        "f1-n9600-mle-s4-kc3c3c3c3",
    }
    assert cells[0.25, 2400]["epochs"] == pytest.approx(4 * cells[0.25, 600]["epochs"])
    # the figure's groups
    assert sorted(c["epochs_nominal"] for c in cells.values()) == [3.5, 3.5, 3.5, 7, 7, 14, 14]
    for c in cells.values():  # early stopping's comparison beside the last step's
        assert c["valid_ppl_best_log_ratio"]["mean"] - c["valid_ppl_log_ratio"][
            "mean"
        ] == pytest.approx(math.log(0.98 / 0.99))
    fit = res["fits"]["ppl_log_ratio"]  # over the 7 cell means, on log tokens and log epochs
    assert fit["cells"] == 7 and "predictions" not in fit and "log10(epochs)" in fit["model"]
    assert fit["per_decade_epochs"]["value"] == pytest.approx(0.1) and fit["per_decade_tokens"][
        "value"
    ] == pytest.approx(0.02)
    assert os.path.getsize(tmp_path / "lm_schedule.png") > 10000


def test_lr_sensitivity_is_the_mean_excess_loss_over_the_grid_a_diverged_run_capped_at_ln_v():
    sweep = {
        "a": {"lr0.002 k": 110.0, "lr0.004 k": 100.0, "lr0.008 k": float("nan")},
        "b": {"lr0.002": 100.0},
    }
    out = rivals.lr_sensitivity(sweep, {"a": (4e-3, "k"), "b": None}, vocab_size=1000)
    assert set(out) == {"a"}  # b: no selection yet
    assert out["a"]["sensitivity"] == pytest.approx((math.log(1.1) + math.log(1000 / 100)) / 3)


def test_the_fits_count_cells_not_seeds_test_their_lack_of_fit_and_predict():
    """Nine cells on an exact plane (a + b lp + c lt) with seed noise: the fit over cell means
    recovers the plane with 6 degrees of freedom whatever the seeds per cell; a bent cell shows as
    lack of fit; pooled_by_data pools sizes."""

    def cells(bend=0.0, seeds=3):
        out = []
        for size, lp in (("S", 5.0), ("M", 5.9), ("L", 6.4)):
            for f, lt in ((0.25, 5.24), (0.5, 5.53), (1.0, 5.85)):
                mean = 0.1 + 0.02 * lp + 0.15 * lt + (bend if f == 0.5 else 0.0)
                diffs = [mean + e for e in (-0.01, 0.0, 0.01, -0.005, 0.005)[:seeds]]
                q = compare.paired_interval(diffs)
                out.append(
                    dict(
                        size=size,
                        train_fraction=f,
                        n_params_non_embedding=10**lp,
                        train_tokens=10**lt,
                        **{
                            k: q
                            for k in (
                                "ppl_log_ratio",
                                "calibrated_ppl_log_ratio",
                                "calibrated_rare_ppl_log_ratio",
                                "gap_closed_by_calibration",
                            )
                        },
                    )
                )
        return out

    fit = scale.fit_trend(cells(), "ppl_log_ratio")
    assert fit["cells"] == 9 and fit["seeds_per_cell"] == [3]
    assert fit["per_decade_tokens"]["value"] == pytest.approx(0.15) and fit["per_decade_params"][
        "value"
    ] == pytest.approx(0.02)
    # more seeds per cell: the same design, the same dof
    more = scale.fit_trend(cells(seeds=5), "ppl_log_ratio")
    assert more["per_decade_tokens"]["ci95"] == pytest.approx(
        fit["per_decade_tokens"]["ci95"], abs=1e-9
    )
    assert (
        fit["lack_of_fit"]["p"] > 0.5
        and scale.fit_trend(cells(bend=0.05), "ppl_log_ratio")["lack_of_fit"]["p"] < 0.01
    )
    pred = fit["predictions"]["wikitext103_M_7M"]
    assert pred["n_params_non_embedding"] == 10**5.9
    assert pred["prediction"] == pytest.approx(0.1 + 0.02 * 5.9 + 0.15 * math.log10(7e6))
    ratio = scale.prediction({"0.2": {"ppl_log_ratio": fit, "calibrated_ppl_log_ratio": None}})[
        "share0.2"
    ]["7M"]
    assert set(ratio) == {"raw"} and ratio["raw"]["ratio"] == pytest.approx(
        math.exp(pred["prediction"])
    )
    assert ratio["raw"]["pi95"] == pytest.approx([math.exp(x) for x in pred["pi95"]])
    pooled = scale.pooled_by_data(cells())
    assert set(pooled) == {"0.25", "0.5", "1"} and pooled["0.5"]["ppl_log_ratio"]["n"] == 9


def test_a_study_never_drops_runs_of_its_results_file_without_overwrite(tmp_path):
    path = tmp_path / "lm_scale.json"
    path.write_text(
        json.dumps(dict(command="python -m studies.scale", runs={"a-s0": {}, "b-s0": {}}))
    )
    before = path.read_text()
    study = scale.Study(str(tmp_path / "out"), prior=[str(path)])
    with pytest.raises(
        SystemExit, match=r"lm_scale.json: holds 1 runs this would drop \(b-s0\).*--overwrite"
    ):
        study.write(str(path), [], dict(runs={"a-s0": {}}))
    assert path.read_text() == before
    # more runs: written
    study.write(str(path), [], dict(runs={"a-s0": {}, "b-s0": {}, "c-s0": {}}))
    study.overwrite = True
    study.write(str(path), [], dict(runs={"a-s0": {}}))
    assert list(json.loads(path.read_text())["runs"]) == ["a-s0"]


def test_a_diverged_run_is_a_result_and_the_pool_goes_on_past_it(tmp_path):
    """A run that stopped on a non-finite loss (its log says so) is finished at NaN, never a failure
    that halts a long study; any other failure still stops the pool."""
    study = scale.Study(str(tmp_path / "out"))
    os.makedirs(study.folder("x-s0"))
    with open(study.folder("x-s0") + ".log", "w") as f:
        f.write(
            "step 3: valid ppl 500.1\r 10%|#   | 4/40 [loss=9]\rstep 5: loss is nan; lower --lr or "
            "check the method\n"
        )
    assert study.diverged("x-s0").startswith("step 5: loss is nan") and study.finished("x-s0")
    assert (
        math.isnan(study.valid_ppl("x-s0"))
        and study.evaluated("x-s0")
        and study.diverged("y-s0") is None
    )

    def fail(name):
        return name, [sys.executable, "-c", "raise SystemExit(1)"], None

    jobs, ended = iter([fail("x-s0"), (("y-s0", [sys.executable, "-c", "pass"], None))]), []
    pool.run(lambda busy: next(jobs, None), 1, ended.append, study.diverged)
    assert ended == ["x-s0", "y-s0"]
    other = iter([fail("y-s0")])  # no divergence in its log: a failure
    with pytest.raises(SystemExit, match="y-s0 failed"):
        pool.run(lambda busy: next(other, None), 1, None, study.diverged)
