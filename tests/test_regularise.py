"""studies/regularise.py: dropout x weight decay selected per method on each run's best valid PPL,
the selections on every seed, the warm-up control, test at the last and the best step."""

import json
import math
import os

import numpy as np
import pytest

import train_lm
from studies import compare, regularise

# the settings that win: MLE's at the best step (its last valid PPL is the worst), AGG's plainly
WINNER = {"mle": (0.3, 0.01), "agg": (0.2, 0.1)}


def fake_record(fraction, method, setting, seed, warmup=regularise.WARMUP):
    """A results record of one run: AGG 3% below MLE at its last step, 1% at its best."""
    steps = regularise.CELLS[fraction]
    won = setting == WINNER[method]
    best = 100.0 - 5 * won + seed
    last = best * (1.2 if method == "agg" else 1.24) + 30 * won * (method == "mle")
    groups = dict(freq=50.0, med=500.0, rare=4000.0 if method == "agg" else 5000.0)
    curve = [
        dict(
            step=s,
            ppl=best,
            ppl_groups={g: v * (1.01 if method == "agg" else 1) for g, v in groups.items()},
        )
        for s in range(steps // 12, steps + 1, steps // 12)
    ]
    articles = np.full((5, 3), 1000.0)  # NLL sums of 5 test articles, 3 groups
    counts = np.full((5, 3), 200)

    def at(ppl, factor):
        nll = articles * (1 + factor * (method == "agg")) + seed
        return dict(
            ppl=ppl,
            ppl_groups=groups,
            rare_bias=dict(ppl=ppl, ppl_groups=dict(groups, rare=ppl)),
            isotropy=0.1,
            article_stats=dict(nll=nll.tolist(), count=counts.tolist()),
        )

    dropout, weight_decay = setting
    name = regularise.run_spec(fraction, method, setting, seed, warmup)[0]
    record = dict(
        method=method,
        seed=seed,
        train_fraction=fraction,
        max_steps=steps,
        warmup=warmup,
        dropout=dropout,
        weight_decay=weight_decay,
        kernels="a1" * 8,
        valid_ppl=last,
        valid_ppl_best=best,
        isotropy_groups=dict(rare=0.05),
        uniq=100,
        best_checkpoint=dict(step=steps // 2, valid_ppl=best, **at(best * 1.1, 0.01)),
        valid_curve=curve,
        **at(last * 1.1, -0.03),
    )
    return name, record


def test_each_method_is_selected_on_its_best_valid_ppl_then_paired_on_five_seeds(tmp_path):
    study = regularise.Regularise(str(tmp_path / "out"))
    plan = study.plan()
    # first the sweeps (2 cells x 2 methods x 6 settings x 3 seeds) and the preset's seeds 3-4
    assert len(plan) == 72 + 8 and plan[0][2] == 1 and plan[-1][2] == 4
    # the preset's pairs first in each cell
    preset = {
        regularise.run_spec(0.25, m, regularise.PRESET, s)[0]
        for m in "mle agg".split()
        for s in range(5)
    }
    assert {n for n, _f, _c in plan[:10]} == preset
    # then each setting's pairs, seed by seed
    assert [n for n, _f, _c in plan[10:13]] == [
        "f0.25-agg-do0.1-wd0.1-s0",
        "f0.25-mle-do0.1-wd0.1-s0",
        "f0.25-agg-do0.1-wd0.1-s1",
    ]
    parser = train_lm.build_parser()
    for name, flags, _cost in plan:
        args = parser.parse_args(flags)
        assert (args.lr, args.warmup, args.dtype, args.eval_interval * 12) == (
            4e-3,
            240,
            "float32",
            args.max_steps,
        )
        assert name.startswith(f"f{args.train_fraction:g}-{args.method}-do{args.dropout:g}")
    # the 172k cell's sweeps ended: its selections decide its pairs
    runs = dict(
        fake_record(0.25, m, s, seed)
        for m in regularise.METHODS
        for s in [(d, w) for d in regularise.DROPOUTS for w in regularise.WEIGHT_DECAYS]
        for seed in range(3)
    )
    path = tmp_path / "lm_regularise.json"
    path.write_text(json.dumps(dict(command="python -m studies.regularise", runs=runs)))
    study = regularise.Regularise(str(tmp_path / "out"), prior=[str(path)])
    assert study.selections()["0.25"] == WINNER and study.selections()["1"] == dict(
        mle=None, agg=None
    )
    wanted = {n for n, _f, _c in study.plan() if n.startswith("f0.25")} - set(runs)
    # seeds 3-4 of each selection and the preset; at 2,400 steps the 10% warm-up is the preset's
    settings = [*WINNER.items(), ("mle", regularise.PRESET), ("agg", regularise.PRESET)]
    assert wanted == {
        regularise.run_spec(0.25, m, s, seed)[0] for m, s in settings for seed in (3, 4)
    }
    runs.update(fake_record(0.25, m, s, seed) for m, s in settings for seed in (3, 4))
    path.write_text(json.dumps(dict(command="python -m studies.regularise", runs=runs)))
    study = regularise.Regularise(str(tmp_path / "out"), prior=[str(path)])
    study.write_results(str(path), ["--results", str(path)])
    res = json.loads(path.read_text())
    assert res["selection"]["0.25/mle"]["selected"] == list(WINNER["mle"])
    cells = {c["comparison"]: c for c in res["compare"]}
    matched = {
        f"matched {d:g}/{w:g}" for d in regularise.DROPOUTS for w in regularise.WEIGHT_DECAYS
    }
    assert set(cells) == {"preset", "tuned"} | matched
    assert cells["matched 0.2/0.1"]["last"]["seeds"] == [0, 1, 2]
    assert cells["preset"]["last"]["seeds"] == [0, 1, 2, 3, 4]
    tuned = cells["tuned"]
    assert tuned["last"]["seeds"] == [0, 1, 2, 3, 4]
    # the last step's and the best step's test PPL, each paired, the latter from ckpt_best.pt
    last = [
        math.log(runs[regularise.run_spec(0.25, "agg", WINNER["agg"], s)[0]]["ppl"])
        - math.log(runs[regularise.run_spec(0.25, "mle", WINNER["mle"], s)[0]]["ppl"])
        for s in range(5)
    ]
    assert tuned["last"]["ppl_log_ratio"]["diffs"] == pytest.approx(last)
    assert tuned["best"]["valid_ppl_log_ratio"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert tuned["best"]["ppl_log_ratio"]["mean"] > tuned["last"]["ppl_log_ratio"]["mean"]
    # over seeds and test articles: the literal two-way bootstrap of the article NLL sums
    pairs = [
        [runs[regularise.run_spec(0.25, m, WINNER[m], s)[0]]["article_stats"] for s in range(5)]
        for m in ("mle", "agg")
    ]
    base, cand = (np.array([a["nll"] for a in side]).sum(2) for side in pairs)
    count = np.array(pairs[0][0]["count"]).sum(1)
    assert tuned["last"]["ppl_log_ratio"]["seed_article_boot95"] == pytest.approx(
        compare.seed_article_boot95(base, cand, count)
    )
    # the curves: AGG's valid NLL 1% above MLE's in the frequent group at every step
    assert os.path.getsize(tmp_path / "lm_regularise.png") > 10000
    gaps = regularise.group_nll_gap(runs, dict(tuned, mle=WINNER["mle"], agg=WINNER["agg"]))
    assert gaps["freq"][1] == pytest.approx([math.log(1.01)] * 12)
    assert gaps["rare"][1] == pytest.approx([math.log(4000 * 1.01 / 5000)] * 12)
    assert gaps["total"][1] == pytest.approx([0.0] * 12, abs=1e-12)


def test_the_warm_up_control_runs_at_ten_percent_of_the_long_cell():
    chosen = dict(mle=(0.2, 0.1), agg=(0.1, 0.01))
    long = regularise.comparisons(1.0, chosen)
    assert long["warmup10"] == (chosen["mle"], chosen["agg"], regularise.SEEDS, 960)
    assert "warmup10" not in regularise.comparisons(0.25, chosen)
    name, flags = regularise.run_spec(1.0, "agg", chosen["agg"], 4, 960)
    args = train_lm.build_parser().parse_args(flags)
    assert name == "f1-agg-do0.1-wd0.01-wu960-s4" and args.warmup == 960 and args.rare_share == 0.2
