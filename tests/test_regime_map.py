"""regime_map.py: trains MLE and AGG per (share, steps, seed), evaluates each run, writes the map."""
import json

import pytest

import regime_map


def test_ratios_compare_agg_with_mle_of_the_same_seed():
    mle = dict(ppl=100.0, ppl_groups={"rare": 1000.0}, isotropy=0.6, uniq=50, mean_cosine_groups={"rare": 0.8})
    agg = dict(ppl=101.0, ppl_groups={"rare": 400.0}, isotropy=0.9, uniq=60, mean_cosine_groups={"rare": 0.2})
    r = regime_map.ratios(agg, mle)
    assert r == pytest.approx(dict(ppl=1.01, rare=0.4, anisotropy=0.25, uniq=10, cos_rare=0.25))


@pytest.mark.slow
def test_map_end_to_end(corpus, lm_tiny, tmp_path):
    flags = ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], *lm_tiny]
    common = ["--shares", "0.9", "--tokens", "128", "--seeds", "0", "--out", str(tmp_path)]
    regime_map.main([*common, "--steps", "2", "--", *flags])
    regime_map.main([*common, "--steps", "3", "--", *flags])
    cells = json.load(open(tmp_path / "regime_map.json"))
    assert [(c["share"], c["steps"]) for c in cells] == [(0.9, 2), (0.9, 3)]  # the second call adds to the first
    assert set(cells[0]["seeds"][0]) == {"seed", "ppl", "rare", "anisotropy", "uniq", "cos_rare"}
    assert (tmp_path / "regime_map.png").stat().st_size > 0
    m = json.load(open(tmp_path / "runs" / "agg-r0.9-n3-t128-s0" / "report-valid" / "metrics.json"))
    assert next(iter(m.values()))["split"] == "valid"  # the map selects settings: it never scores test
