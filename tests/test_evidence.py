"""A results file is evidence: re-analysis joins a run only to what it is, and no command writes
over another's file, a run folder's file, or the runs a file holds."""

import fractions
import json
import os

import pytest
import torch

from studies import compare, scale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADLINE = os.path.join(ROOT, "results", "lm_headline.json")
MLE0 = "mle-lr0.004-wu240-s0"


def copy(src, dst, runs=None):  # a committed results file at dst (runs: instead of its own)
    res = json.load(open(src))
    dst.write_text(json.dumps(res if runs is None else dict(res, runs=runs)))
    return str(dst)


def test_a_rerun_of_another_split_corpus_or_method_never_replaces_a_run(tmp_path):
    path = copy(HEADLINE, tmp_path / "h.json")
    before = open(path).read()
    split1 = os.path.join(ROOT, "results", "lm_headline_split1.json")
    split = rf"its run {MLE0} and the run {MLE0} of .* differ in split_seed \(0 vs 1\)"
    with pytest.raises(SystemExit, match=split):
        compare.main(["--reanalyse", path, "--add", split1])
    run = json.load(open(HEADLINE))["runs"][MLE0]
    corpus = dict(run, tokens=2000, rows=290, vocab_size_actual=300, data_fingerprint="tiny-bpe300")
    agg = json.load(open(HEADLINE))["runs"]["agg-lr0.004-wu240-s0"]
    for record, differ in (
        (corpus, r"tokens \(50727 vs 2000\)"),
        (agg, r"method \(mle vs agg\)"),
        (dict(corpus, seed=9), r"tokens \(50727 vs 2000\)"),
    ):  # a new seed too
        name = MLE0 if record["seed"] == 0 else "mle-s9"
        more = copy(HEADLINE, tmp_path / "more.json", {name: record})
        with pytest.raises(SystemExit, match=f"differ in {differ}"):
            compare.main(["--reanalyse", path, "--add", more])
    assert open(path).read() == before


def test_a_renamed_rerun_replaces_the_run_it_is(tmp_path):
    path = copy(HEADLINE, tmp_path / "h.json")
    run = json.load(open(HEADLINE))["runs"][MLE0]
    more = copy(HEADLINE, tmp_path / "more.json", {"renamed": dict(run, ppl=run["ppl"] * 1.1)})
    res = compare.main(["--reanalyse", path, "--add", more])
    assert MLE0 not in res["runs"] and len(res["runs"]) == 10
    assert res["runs"]["renamed"]["variant"] == "mle"
    assert res["compare"][0]["metrics"]["ppl"]["base"][0] == pytest.approx(run["ppl"] * 1.1)


def test_results_are_never_written_over_a_run_file_another_commands_file_or_its_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"task": "lm"}')
    (run / "log.jsonl").write_text('{"step": 1}\n')
    for target in (run / "log.jsonl", run / "metrics.json", tmp_path / "ckpt_best.pt"):
        with pytest.raises(SystemExit, match="a run folder's file; write results outside runs"):
            compare.main([str(run), "--out", str(tmp_path / "rep"), "--results", str(target)])
    assert (run / "log.jsonl").read_text() == '{"step": 1}\n'
    scale_copy = copy(os.path.join(ROOT, "results", "lm_scale.json"), tmp_path / "s.json")
    other = r"s.json: written by another command \(python -m studies.scale"
    with pytest.raises(SystemExit, match=other):
        compare.main([str(run), "--out", str(tmp_path / "rep"), "--results", scale_copy])
    headline = copy(HEADLINE, tmp_path / "h.json")
    with pytest.raises(SystemExit, match=r"h.json: holds 9 runs this would drop .*--overwrite"):
        compare.results_target(headline, compare.COMPARE_KINDS, [MLE0])
    assert compare.results_target(headline, compare.COMPARE_KINDS, [MLE0], overwrite=True)["runs"]
    bible = copy(os.path.join(ROOT, "results", "lm_bible.json"), tmp_path / "b.json")
    before = open(bible).read()
    with pytest.raises(SystemExit, match=r"b.json: holds 9 runs this would drop"):
        scale.main(["--no-train", "--out", str(tmp_path / "empty"), "--results", bible])
    assert open(bible).read() == before
    (tmp_path / "x.json").write_text(json.dumps(dict(runs={})))  # no command: no one's file
    with pytest.raises(SystemExit, match=r"x.json: written by another command \(None\)"):
        compare.results_target(str(tmp_path / "x.json"), ("scale",))


def test_a_crafted_snapshot_ends_in_one_line_without_torchs_advice(tmp_path):
    path = tmp_path / "emb_1.pt"
    torch.save({"weight": fractions.Fraction(1, 2)}, path)  # a pickle that asks for a class
    with pytest.raises(SystemExit, match=r"emb_1.pt: not a snapshot of this project") as e:
        compare.snapshot_weight(str(path))
    assert "weights_only" not in str(e.value) and "\n" not in str(e.value)
