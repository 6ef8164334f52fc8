"""Shared test set-up: the repository on sys.path, one thread for tiny models, the tiny corpus and
flag sets. `pytest -m "not slow"` is the fast inner loop; the full suite is what CI runs."""

import json
import os
import random
import sys

import pytest
import torch

# Triton's interpreter for the fused head's tests: before anything (torch.compile) imports Triton,
# whose standard library is defined for the interpreter or the GPU at its import
os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)  # tiny models: extra threads only spin on a shared 2-core machine

# train_lm.py: a 1-layer model on a tiny Zipfian corpus (seconds per run)
LM_TINY = (
    "--n-layer 1 --d-model 16 --n-head 2 --d-ff 32 --block-size 16 --vocab-size 300 "
    "--tokens-per-step 128 --micro-batch 4 --lr 3e-3 --warmup 2 --device cpu --preset cpu "
    "--log-interval 1"
).split()
# train_nmt.py: the synthetic task (Zipfian lexicon, adjacent words swapped); vocab 600 holds every
# word whole
NMT_TINY = (
    "--dataset synthetic --synthetic-size 2000 --vocab-size 600 --enc-layers 2 --dec-layers 2 "
    "--d-model 64 --n-head 4 --d-ff 256 --tokens-per-step 1024 --lr 1e-2 --warmup 30 "
    "--log-interval 50 --valid-bleu-sents 20 --beam 2 --device cpu"
).split()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes more than a few seconds (deselect with -m 'not slow')"
    )


def write_corpus(folder, n_lines=(600, 60, 60), seed=0):
    """Zipfian pseudo-words in sentences: enough structure for BPE and a few training steps."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(400)
    ]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(words))]
    os.makedirs(folder, exist_ok=True)
    for split, n in zip(("train", "valid", "test"), n_lines):
        with open(os.path.join(folder, f"{split}.txt"), "w") as f:
            for _ in range(n):
                f.write(
                    " ".join(rng.choices(words, weights, k=rng.randint(5, 20))).capitalize()
                    + " .\n"
                )
    return folder


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A tiny LM corpus folder and its tokenizer cache: {"data": DIR, "cache": DIR}."""
    base = tmp_path_factory.mktemp("lm")
    return dict(data=write_corpus(str(base / "data")), cache=str(base / "cache"))


@pytest.fixture(scope="session")
def corpus_writer():
    return write_corpus


@pytest.fixture
def lm_run(corpus):
    """lm_run(out, *flags, steps=2): train_lm.main on the tiny corpus with LM_TINY."""
    import train_lm

    def run(out, *extra, steps=2):
        argv = [
            "--data-dir",
            corpus["data"],
            "--cache-dir",
            corpus["cache"],
            "--out",
            str(out),
            "--max-steps",
            str(steps),
            "--eval-interval",
            "2",
            *LM_TINY,
            *extra,
        ]
        return train_lm.main([str(a) for a in argv])

    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Three tiny finished LM runs {label: folder}: mle, agg (snapshots at steps 1, 3), mle-s1."""
    import train_lm

    base = tmp_path_factory.mktemp("ev")
    out = {}
    for label, method, extra in (
        ("mle", "mle", []),
        ("agg", "agg", ["--alpha", "0.5", "--snapshot-steps", "1,3"]),
        ("mle-s1", "mle", ["--seed", "1"]),
    ):
        out[label] = str(base / label)
        train_lm.main(
            ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], "--out", out[label]]
            + ["--method", method, *LM_TINY, "--max-steps", "3", "--eval-interval", "3", *extra]
        )
    return out


@pytest.fixture(scope="session")
def lm_tiny():
    return list(LM_TINY)


@pytest.fixture(scope="session")
def nmt_tiny():
    return list(NMT_TINY)


@pytest.fixture(scope="session")
def read_log():
    def read(out):
        with open(os.path.join(out, "log.jsonl")) as f:
            return [json.loads(line) for line in f]

    return read
