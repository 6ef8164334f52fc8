"""studies/splits.py: the headline pair at three draws of the held-out articles, pooled."""

import json
import math

import numpy as np
import pytest

import train_lm
from studies import splits

# AGG's test PPL ratio per split: the draw of the articles moves it
RATIO = {0: 1.01, 1: 1.04, 2: 0.99}


def fake_record(split, method, seed):
    ratio = RATIO[split] * (1 + 0.002 * seed) if method == "agg" else 1.0
    ppl = 250.0 * ratio
    groups = dict(freq=50.0, med=500.0, rare=5000.0 / ratio)
    nll = np.full((5, 3), 1000.0) + 10 * split + (method == "agg") * seed
    return dict(
        method=method,
        seed=seed,
        split_seed=split,
        kernels="a1" * 8,
        valid_ppl=ppl,
        ppl=ppl,
        ppl_groups=groups,
        rare_bias=dict(ppl=ppl, ppl_groups=dict(groups, rare=4000.0 * ratio)),
        isotropy=0.1,
        isotropy_groups=dict(rare=0.05),
        uniq=100,
        article_stats=dict(nll=nll.tolist(), count=np.full((5, 3), 100).tolist()),
    )


def test_three_splits_five_seeds_each_pooled_over_the_splits(tmp_path):
    plan = splits.Splits(str(tmp_path / "out")).plan()
    assert (
        len(plan) == 3 * 5 * 2 and plan[0][0] == "split0-mle-s0" and plan[1][0] == "split0-agg-s0"
    )
    parser = train_lm.build_parser()
    for name, flags, _c in plan:
        args = parser.parse_args(flags)
        assert (args.lr, args.warmup, args.max_steps, args.dtype) == (4e-3, 240, 2400, "float32")
        assert name == f"split{args.split_seed}-{args.method}-s{args.seed}"
        assert args.rare_share == (0.2 if args.method == "agg" else None)
    runs = {
        splits.run_spec(sp, m, s)[0]: fake_record(sp, m, s)
        for sp in splits.SPLITS
        for m in splits.METHODS
        for s in splits.SEEDS
    }
    path = tmp_path / "lm_splits.json"
    path.write_text(json.dumps(dict(command="python -m studies.splits", runs=runs)))
    splits.Splits(str(tmp_path / "out"), prior=[str(path)]).write_results(str(path), [])
    res = json.loads(path.read_text())
    cells = res["compare"]
    assert [c["split_seed"] for c in cells] == [0, 1, 2]
    assert all("seed_article_boot95" in c["ppl_log_ratio"] for c in cells)
    pooled = res["pooled"]["ppl_log_ratio"]
    means = [np.mean([math.log(RATIO[sp] * (1 + 0.002 * s)) for s in range(5)]) for sp in range(3)]
    assert pooled["split_means"] == pytest.approx(means)
    half = 4.302653 * np.std(means, ddof=1) / math.sqrt(3)  # t(0.975, 2)
    assert pooled["t95_over_splits"] == pytest.approx(
        [np.mean(means) - half, np.mean(means) + half]
    )
    # the seeds' spread is the same in every split: the splits' spread is theirs
    within = np.var([math.log(1 + 0.002 * s) for s in range(5)], ddof=1) / 5
    assert pooled["between_split_sd"] == pytest.approx(math.sqrt(np.var(means, ddof=1) - within))
