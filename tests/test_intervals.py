"""studies/compare.py's two-way bootstrap over seeds and test articles (seed_article_boot95) against
literal references on small synthetic examples."""

import math

import numpy as np
import pytest

from studies import compare

# NLL sums, seed x article
BASE = np.array(
    [[120.0, 80.0, 40.0], [118.0, 83.0, 41.0], [121.0, 79.0, 39.5], [119.5, 81.0, 40.5]]
)
CAND = np.array(
    [[119.0, 81.5, 38.0], [117.0, 82.0, 40.0], [121.5, 80.0, 38.5], [118.0, 80.5, 39.0]]
)
COUNT = np.array([50.0, 30.0, 20.0])  # targets per article


def literal_two_way(base, cand, count, n_boot, seed):
    """A draw at a time: seeds, then articles, each with replacement; the mean over the drawn seeds
    of the log PPL ratio on the drawn articles."""
    rng = np.random.default_rng(seed)
    n_seeds, n_articles = len(base), len(count)
    seed_draws = rng.integers(0, n_seeds, (n_boot, n_seeds))
    article_draws = rng.integers(0, n_articles, (n_boot, n_articles))
    stats = []
    for seeds, articles in zip(seed_draws, article_draws):
        ratios = []
        for s in seeds:
            gap = sum(cand[s][a] - base[s][a] for a in articles)
            ratios.append(gap / sum(count[a] for a in articles))
        stats.append(sum(ratios) / len(ratios))
    return np.percentile(stats, [2.5, 97.5]).tolist()


def test_a_fixed_seed_gives_the_literal_interval():
    got = compare.seed_article_boot95(BASE, CAND, COUNT, n_boot=500, seed=3)
    assert got == pytest.approx(literal_two_way(BASE, CAND, COUNT, 500, 3), abs=1e-12)
    again = compare.seed_article_boot95(BASE, CAND, COUNT, n_boot=500, seed=3)
    assert again == got


def test_one_article_is_the_seed_bootstrap():
    base, cand, count = BASE[:, :1], CAND[:, :1], COUNT[:1]
    diffs = (cand[:, 0] - base[:, 0]) / count[0]  # the per-seed log PPL ratios
    seed_only = compare.paired_interval(diffs.tolist(), n_boot=2000, seed=5)["boot95"]
    got = compare.seed_article_boot95(base, cand, count, n_boot=2000, seed=5)
    assert got == pytest.approx(seed_only, abs=1e-12)


def test_identical_seeds_are_the_article_bootstrap():
    base, cand = np.repeat(BASE[:1], 4, 0), np.repeat(CAND[:1], 4, 0)
    got = compare.seed_article_boot95(base, cand, COUNT, n_boot=2000, seed=7)
    rng = np.random.default_rng(7)
    rng.integers(0, 4, (2000, 4))  # the seed draws, which change nothing here
    stats = []
    for articles in rng.integers(0, 3, (2000, 3)):
        gap = (cand[0, articles] - base[0, articles]).sum()
        stats.append(gap / COUNT[articles].sum())
    assert got == pytest.approx(np.percentile(stats, [2.5, 97.5]).tolist(), abs=1e-12)


def test_compare_reports_it_beside_the_seed_interval():
    def record(nll, seed):
        rows = [[x * 0.5, x * 0.3, x * 0.2] for x in nll]  # freq, med, rare NLL per article
        groups = [[c * 0.5, c * 0.3, c * 0.2] for c in COUNT]
        total = math.exp(sum(nll) / COUNT.sum())
        ppl_groups = {g: math.exp(sum(nll) / COUNT.sum()) for g in compare.G}
        stats = {"nll": rows, "count": groups}
        return dict(seed=seed, ppl=total, ppl_groups=ppl_groups, article_stats=stats)

    metrics = {}
    for s in range(4):
        metrics[f"mle-s{s}"] = dict(record(BASE[s], s), variant="mle")
        metrics[f"agg-s{s}"] = dict(record(CAND[s], s), variant="agg")
    out = compare.compare(metrics, {}, "mle", "agg", [])  # 10,000 draws, seed 0
    ppl = out["metrics"]["ppl"]
    assert ppl["seed_article_boot95"] == pytest.approx(literal_two_way(BASE, CAND, COUNT, 10000, 0))
    assert ppl["mean"] == pytest.approx(np.mean(((CAND - BASE) @ np.ones(3)) / COUNT.sum()))
    rare = literal_two_way(BASE * 0.2, CAND * 0.2, COUNT * 0.2, 10000, 0)
    assert out["metrics"]["ppl_groups.rare"]["seed_article_boot95"] == pytest.approx(rare)
