"""One run on many processes: `torchrun --nproc_per_node=2` (gloo on CPU) trains the run one
process trains at the same --tokens-per-step, and a 2-process run stopped and resumed equals an
uninterrupted one bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import LM_TINY, NMT_TINY, ROOT, write_corpus

pytestmark = pytest.mark.slow
# no dropout: each process draws its own masks, so only a dropout-free run can equal one process's
LM = [*LM_TINY, "--max-steps", "20", "--eval-interval", "10", "--dropout", "0"]
NMT = [*NMT_TINY, "--synthetic-size", "300", "--max-steps", "12", "--eval-interval", "6"]
# four micro-batches a step: two a process, padded to different lengths
NMT += [
    "--dropout",
    "0",
    "--label-smoothing",
    "0.1",
    "--micro-tokens",
    "256",
    "--log-interval",
    "1",
]


def launch(script, flags, processes):
    """`script` with `flags` in one process, or under torchrun in `processes` of them."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, script]
    if processes > 1:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*torchrun, f"--nproc_per_node={processes}", script]
    args = command + [str(f) for f in flags]
    # a hang (a rank waiting for a dead one) fails the test instead of the suite
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def train(script, flags, processes):
    done = launch(script, flags, processes)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = flags[flags.index("--out") + 1]
    checkpoint = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return checkpoint, records


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    corpus = write_corpus(str(base / "data"))
    return ["--data-dir", corpus, "--cache-dir", str(base / "cache")]


def relative_difference(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def without_key_biases(weights):
    """The weights but the attention keys' biases: a softmax ignores a shift common to its row, so
    their gradient is 0 in exact arithmetic and float noise alone, which Adam's 1 / sqrt(v) turns
    into whole steps: they follow the summation order, not the run."""
    kept = {}
    for name, value in weights.items():
        if name.endswith("qkv.bias"):  # train_lm.py: q, k, v biases in one tensor
            d = len(value) // 3
            value = torch.cat([value[:d], value[2 * d :]])
        if not name.endswith(".k.bias"):  # train_nmt.py's
            kept[name] = value
    return kept


def assert_same_run(one, two, one_log, two_log):
    """Two runs equal within float summation: weights (key biases aside), losses, AGG's window
    bit for bit, FRAGE's discriminator."""
    ours = without_key_biases(two["model"])
    for key, weight in without_key_biases(one["model"]).items():
        assert relative_difference(ours[key], weight) <= 1e-5, key
    if "appearances" in one["method"]:  # AGG's window: every rank's targets, gathered
        assert torch.equal(two["method"]["appearances"], one["method"]["appearances"])
    if one["method"].get("disc"):  # FRAGE's discriminator, trained on every rank alike
        for key, value in one["method"]["disc"]["model"].items():
            assert relative_difference(two["method"]["disc"]["model"][key], value) <= 1e-5
    losses = torch.tensor([r["loss"] for r in one_log if r["split"] == "train"])
    losses_two = torch.tensor([r["loss"] for r in two_log if r["split"] == "train"])
    assert relative_difference(losses_two, losses) <= 1e-5  # the step's mean, over the ranks


@pytest.mark.parametrize("method", ["mle", "agg", "frage", "ul+agg"])
def test_two_processes_train_the_lm_run_of_one(lm_data, tmp_path, method):
    flags = [*LM, *lm_data, "--method", method]
    if method == "frage":
        # its discriminator steps at a process's first micro-batch and later micro-batches see it
        # updated: one micro-batch a process on both sides
        flags += ["--micro-batch", "8"]
    one, one_log = train("train_lm.py", [*flags, "--out", tmp_path / "one"], 1)
    two, two_log = train("train_lm.py", [*flags, "--out", tmp_path / "two"], 2)
    assert_same_run(one, two, one_log, two_log)
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    assert config["world_size"] == 2 and config["segments"][0]["world_size"] == 2


def test_two_processes_train_the_nmt_run_of_one(tmp_path):
    flags = [*NMT, "--method", "agg", "--cache-dir", tmp_path / "cache"]
    one, one_log = train("train_nmt.py", [*flags, "--out", tmp_path / "one"], 1)
    two, two_log = train("train_nmt.py", [*flags, "--out", tmp_path / "two"], 2)
    assert_same_run(one, two, one_log, two_log)


def test_a_stopped_and_resumed_two_process_run_is_the_uninterrupted_one(lm_data, tmp_path):
    flags = [*LM, *lm_data, "--method", "agg", "--dropout", "0.1"]
    whole, _ = train("train_lm.py", [*flags, "--out", tmp_path / "whole"], 2)
    train("train_lm.py", [*flags, "--out", tmp_path / "split", "--stop-at", "10"], 2)
    resumed, _ = train("train_lm.py", ["--out", tmp_path / "split", "--resume"], 2)
    for part in ("model", "optimizer", "method", "scheduler", "rng", "step"):
        assert identical(resumed[part], whole[part]), part


def identical(a, b):
    """Bit for bit: tensors equal, containers alike all the way down."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def test_sequences_that_do_not_split_over_the_processes_are_refused_in_one_line(lm_data, tmp_path):
    flags = [*LM, *lm_data, "--tokens-per-step", "112", "--out", tmp_path / "odd"]  # 7 sequences
    done = launch("train_lm.py", flags, 2)
    assert done.returncode != 0
    assert "7 sequences a step do not split over 2 processes" in done.stderr


def test_a_signal_to_the_group_checkpoints_once_and_exits_1(lm_data, tmp_path):
    out = tmp_path / "signal"
    flags = [*LM_TINY, *lm_data, "--max-steps", "100000", "--eval-interval", "100000"]
    flags += ["--method", "agg", "--out", out]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*torchrun, "train_lm.py", *[str(f) for f in flags]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log = out / "log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.exists() and '"train"' in log.read_text()):
        time.sleep(0.2)  # until the group trains
    run.send_signal(signal.SIGTERM)  # to torchrun: it passes it to every rank
    text, _ = run.communicate(timeout=300)
    assert run.returncode == 1, text[-3000:]
    assert text.count("SIGTERM: stopped at step") == 1  # rank 0 says it, once
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert step > 0
    resumed, _ = train("train_lm.py", ["--out", out, "--resume", "--max-steps", step + 2], 2)
    assert resumed["step"] == step + 2
