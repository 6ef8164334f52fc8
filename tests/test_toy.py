"""Tests of toy_degeneration.py: the MLE-vs-AGG contrast on fixed seeds, the outputs' contract,
every method runs.

Run: .venv/bin/python -m pytest tests/test_toy.py -q
"""

import ast
import json
import math
import os
from unittest import mock

import pytest
import torch

import agg
import toy_degeneration as toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A reduced configuration: full vocabulary and model, fewer steps, a smaller corpus and held-out
# set, one thread
# (deterministic, and not slowed down by other jobs fighting for the second core).
REDUCED = [
    "--steps",
    "40",
    "--epoch-steps",
    "40",
    "--val-tokens",
    "16384",
    "--threads",
    "1",
    "--no-plots",
]
TINY = [
    "--vocab",
    "300",
    "--dim",
    "8",
    "--seq-len",
    "16",
    "--batch-seqs",
    "8",
    "--epoch-steps",
    "4",
    "--val-tokens",
    "512",
    "--steps",
    "6",
    "--log-every",
    "2",
    "--threads",
    "1",
]


@pytest.fixture(scope="module", params=[0, 1])
def contrast(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"contrast{request.param}")
    toy.main(REDUCED + ["--seed", str(request.param), "--out", str(out)])
    with open(out / "metrics.json") as f:
        return json.load(f)["methods"]


def test_agg_is_more_isotropic_than_mle(contrast):
    mle, agg_ = contrast["mle"], contrast["agg"]
    assert agg_["isotropy"] > mle["isotropy"] + 0.05, (mle["isotropy"], agg_["isotropy"])
    assert agg_["isotropy_groups"]["rare"] > mle["isotropy_groups"]["rare"] + 0.1


def test_mle_rare_tokens_form_a_cone_and_agg_opens_it(contrast):
    mle, agg_ = (
        contrast["mle"]["mean_cosine_groups"]["rare"],
        contrast["agg"]["mean_cosine_groups"]["rare"],
    )
    assert mle > 0.7, mle
    assert agg_ < mle - 0.25, (mle, agg_)


def test_agg_predicts_rare_tokens_better(contrast):
    assert contrast["agg"]["ppl_groups"]["rare"] < 0.8 * contrast["mle"]["ppl_groups"]["rare"]
    # and stays in the same ballpark overall after so few steps
    assert contrast["agg"]["ppl"] < 1.15 * contrast["mle"]["ppl"]


def test_outputs_follow_the_contract(tmp_path, capsys):
    metrics = toy.main(
        TINY + ["--methods", "mle,agg", "--alpha-sweep", "0.4,2", "--out", str(tmp_path)]
    )
    with open(tmp_path / "metrics.json") as f:
        on_disk = json.load(f)
    assert on_disk["methods"].keys() == {"mle", "agg"}
    assert on_disk["config"]["steps"] == 6 and on_disk["config"]["tokens_per_step"] == 128
    for name, m in on_disk["methods"].items():
        for key in ("isotropy", "mean_cosine", "ppl", "uniq", "seconds"):
            assert key in m, (name, key)
        for key in ("isotropy_groups", "mean_cosine_groups", "ppl_groups"):
            assert m[key].keys() == {"freq", "med", "rare"}, (name, key)
        assert (
            0 < m["isotropy"] <= 1 and 1 <= m["ppl"] and 1 <= m["uniq"] <= 300 and m["seconds"] > 0
        )
        assert all(math.isfinite(v) for v in m["ppl_groups"].values())
        assert len(m["history"]) == 4  # steps 1, 3, 5 and the last one
    assert (
        on_disk["methods"]["mle"]["rare_count"] is None
        and on_disk["methods"]["agg"]["rare_count"] >= 0
    )
    assert [s["alpha"] for s in on_disk["alpha_sweep"]] == [0.4, 2.0]
    # alpha 0.4 is --alpha's default: the sweep reuses the agg run instead of training it again
    assert {**on_disk["alpha_sweep"][0], "alpha": None} == {
        **on_disk["methods"]["agg"],
        "alpha": None,
    }
    # a larger alpha can only make the rare group larger (AGG Eq. 5: a_k / K < alpha)
    assert on_disk["alpha_sweep"][0]["rare_count"] <= on_disk["alpha_sweep"][1]["rare_count"]
    assert metrics["methods"]["agg"]["isotropy"] == on_disk["methods"]["agg"]["isotropy"]
    for png in ("svd.png", "spectrum.png", "training.png", "svd_alpha_sweep.png"):
        with open(tmp_path / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    printed = capsys.readouterr().out
    assert "| mle |" in printed and "| agg@2 |" in printed


def test_every_method_trains(tmp_path):
    metrics = toy.main(
        TINY + ["--methods", ",".join(agg.METHODS), "--no-plots", "--out", str(tmp_path)]
    )
    assert list(metrics["methods"]) == list(agg.METHODS)
    for name, m in metrics["methods"].items():
        assert math.isfinite(m["ppl"]) and 0 < m["isotropy"] <= 1, name
    # static-group methods got the training counts: their rare set is the bottom 20% of the
    # vocabulary
    assert metrics["methods"]["freeze-rare"]["rare_count"] == 60


def test_same_data_and_init_for_every_method():
    args = toy.parse_args(TINY)
    a, b = toy.make_data(args), toy.make_data(args)
    assert torch.equal(a["train"], b["train"]) and torch.equal(a["val"], b["val"])
    other = toy.make_data(toy.parse_args(TINY + ["--seed", "1"]))
    assert not torch.equal(a["train"], other["train"])
    r1, w1 = toy.train_one("mle", "mle", {}, a, args)
    r2, w2 = toy.train_one("mle", "mle", {}, a, args)
    assert torch.equal(w1, w2) and r1["ppl"] == r2["ppl"]


def test_language_is_zipfian_and_context_dependent():
    gen = torch.Generator().manual_seed(0)
    lang = toy.make_language(2000, 1.1, 16, 20.0, 0.7, gen)
    x = toy.sample_corpus(lang, 2000, 64, gen)
    assert x.min() >= 0 and x.max() < 2000
    y, prev = x[:, 2:].reshape(-1), x[:, 1:-1].reshape(-1)
    counts = torch.bincount(y, minlength=2000).double()
    ranked = counts.sort(descending=True).values
    ranks = torch.arange(1, 2001, dtype=torch.float64)
    keep = (ranks >= 10) & (ranks <= 1000)  # where counts are large enough to fit a slope
    design = torch.stack([ranks[keep].log(), torch.ones(int(keep.sum()), dtype=torch.float64)], 1)
    slope = -torch.linalg.lstsq(design, ranked[keep].log()[:, None]).solution[0, 0]
    assert 0.8 < slope < 1.5, slope  # a Zipf law with exponent ~1
    assert ranked[-400:].sum() / ranked.sum() < 0.05  # the bottom 20% of the vocabulary is rare
    # the next token depends on the previous one: conditional entropy well below the unigram entropy
    uni = counts / counts.sum()
    h_uni = -(uni[uni > 0] * uni[uni > 0].log()).sum()
    top = counts.argmax()
    nxt = torch.bincount(y[prev == top], minlength=2000).double()
    nxt = nxt / nxt.sum()
    h_cond = -(nxt[nxt > 0] * nxt[nxt > 0].log()).sum()
    assert h_cond < h_uni - 1.0, (float(h_cond), float(h_uni))


def test_bad_inputs_name_the_fix(capsys):
    with pytest.raises(SystemExit):
        toy.parse_args(["--methods", "mle,agg-typo"])
    err = capsys.readouterr().err
    assert "agg-typo" in err and "freeze-rare" in err
    with pytest.raises(SystemExit):  # a method flag that none of --methods takes
        toy.parse_args(["--methods", "mle,agg", "--gamma", "0.5"])
    assert "--gamma applies to none of --methods mle,agg" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy.parse_args(["--alpha-sweep", "0.1,x"])
    assert "--alpha-sweep must be comma-separated numbers, got '0.1,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # agg.py's range check, before any training
        toy.parse_args(["--methods", "mle,cosreg", "--gamma", "-1"])
    assert "cosreg': gamma must be a finite number >= 0, got -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy.parse_args(["--use-g1", "maybe"])
    assert "--use-g1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy.parse_args(["--steps", "0"])
    assert "--steps 0: must be >= 1" in capsys.readouterr().err
    # the method flags of train_lm.py, each to the methods that take it, over the toy's own settings
    args = toy.parse_args(
        [
            "--methods",
            "agg,agg-static,agps,freeze-b",
            "--window",
            "3",
            "--use-g1",
            "false",
            "--mu1",
            "2.5",
            "--parts",
            "c",
        ]
    )
    hp = {m: toy.method_hparams(m, args) for m in args.method_list}
    assert hp == {
        "agg": {"alpha": 0.4, "window": 3, "use_g1": False},
        "agg-static": {"alpha": 0.4, "window": 3, "use_g1": False, "static_after": 75},
        "agps": {"mu1": 2.5},
        "freeze-b": {"parts": "c"},
    }
    assert type(hp["agg"]["window"]) is int


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lam", "2"], "--lam 2.0: must be in [0, 1]"),
        (["--lr", "nan"], "--lr nan: must be in [0, 3.4028"),
        (["--lr", "1e300"], "--lr 1e+300: must be in [0, 3.4028"),
        (["--alpha-sweep", "0.4,inf"], "'agg': alpha must be a finite number >= 0, got inf"),
        (["--vocab", "3"], "--vocab 3: must be >= 4"),
        (["--rank", "-1"], "--rank -1: must be >= 1"),
        (["--seed", str(2**70)], f"--seed {2**70}: must be in"),
        (["--threads", "-1"], "--threads -1: must be in [0, "),
    ],
)
def test_bad_values_end_in_one_argparse_line(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        toy.parse_args(TINY + flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_unusable_out_divergence_full_disk_and_memory_end_in_one_line(tmp_path, monkeypatch):
    """What argparse cannot see: an --out that is a file, a run that diverges, a full disk, sizes
    past the memory."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(SystemExit, match=r"--out .*a_file: cannot create that folder \(File"):
        toy.main(TINY + ["--out", str(a_file)])
    with pytest.raises(SystemExit, match=r"--out : cannot create that folder \(No such file"):
        toy.main(TINY + ["--out", ""])
    quick = TINY + ["--steps", "2", "--methods", "mle", "--no-plots", "--out", str(tmp_path)]
    with pytest.raises(
        SystemExit, match=r"mle: the embeddings are not finite after step \d+: try a smaller --lr"
    ):
        toy.main(quick + ["--lr", "1e30"])
    with pytest.raises(SystemExit, match="out of memory: try a smaller --vocab"):
        toy.main(quick + ["--vocab", str(10**13)])
    full = OSError(28, "No space left on device")
    monkeypatch.setattr(toy, "write_text", mock.Mock(side_effect=full))
    with pytest.raises(
        SystemExit, match=r"cannot write .*metrics.json \(No space left on device\)"
    ):
        toy.main(quick)


def test_the_toy_needs_agg_py_alone_of_this_project():
    # a teacher copies two files: the toy and agg.py (no run plumbing, no corpora)
    tree = ast.parse(open(os.path.join(ROOT, "toy_degeneration.py")).read())
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    ours = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} | {"studies", "tools"}
    assert imported & ours == {"agg"}
