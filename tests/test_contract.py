"""One user contract for train_lm.py and train_nmt.py: the same run and method flags, the same
resume policy, the same
config.json provenance, checkpoints that load as data only (a crafted pickle runs nothing)."""

import builtins
import json
import os
import subprocess
import sys

import pytest
import torch

import agg
import eval as ev
import train_lm
import train_nmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_FLAGS = [
    "--out",
    "--seed",
    "--resume",
    "--overwrite",
    "--stop-at",
    "--max-steps",
    "--device",
    "--dtype",
    "--compile",
    "--method",
    "--rare-share",
]
PROVENANCE = ["versions", "git_commit", "git_dirty", "argv", "agg_sha256", "method_hparams", "task"]


@pytest.fixture
def script_run(corpus, lm_tiny, nmt_tiny):
    """script_run(name, out, *flags): a tiny run of train_lm.py or train_nmt.py, in process."""

    def run(name, out, *extra, steps=2):
        if name == "lm":
            base = ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], *lm_tiny]
            return train_lm.main(
                [
                    *base,
                    "--out",
                    str(out),
                    "--max-steps",
                    str(steps),
                    "--eval-interval",
                    "2",
                    *extra,
                ]
            )
        base = [
            *nmt_tiny,
            "--synthetic-size",
            "300",
            "--d-model",
            "16",
            "--d-ff",
            "32",
            "--enc-layers",
            "1",
            "--dec-layers",
            "1",
            "--valid-bleu-sents",
            "4",
        ]
        return train_nmt.main(
            [*base, "--out", str(out), "--max-steps", str(steps), "--eval-interval", "2", *extra]
        )

    return run


@pytest.mark.parametrize("script", ["train_lm.py", "train_nmt.py"])
def test_both_scripts_take_the_same_run_and_method_flags(script):
    text = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    method_flags = ["--" + k.rstrip("_").replace("_", "-") for k in agg.HPARAMS]
    for flag in RUN_FLAGS + method_flags:
        assert flag in text, (script, flag)
    assert {"--popular-fraction", "--disc-lr", "--lambda"} <= set(
        method_flags
    )  # FRAGE can be tuned in both


@pytest.mark.parametrize("task", ["lm", "nmt"])
def test_same_resume_policy_and_provenance(script_run, task, tmp_path):
    out = tmp_path / task
    script_run(task, out, "--method", "agg", "--stop-at", "2", steps=3)
    cfg = json.load(open(out / "config.json"))
    for key in PROVENANCE:
        assert key in cfg, (task, key)
    with open(agg.__file__, "rb") as f:
        assert cfg["agg_sha256"] == __import__("hashlib").sha256(f.read()).hexdigest()
    assert cfg["task"] == task and "--stop-at" in cfg["argv"]
    with pytest.raises(SystemExit, match="already exists: pass --resume"):
        script_run(task, out, "--method", "agg", steps=3)
    with pytest.raises(SystemExit, match="method='agg' but this run asks for method='mle'"):
        (train_lm if task == "lm" else train_nmt).main(
            ["--out", str(out), "--resume", "--method", "mle"]
        )
    (train_lm if task == "lm" else train_nmt).main(["--out", str(out), "--resume"])  # --out alone
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 3 and ck["config"]["method"] == "agg"
    assert json.load(open(out / "config.json"))["resumed_from_step"] == 2
    script_run(task, out, "--method", "mle", "--overwrite", steps=1)
    assert torch.load(out / "ckpt.pt", weights_only=True)["config"]["method"] == "mle"


class _Payload:
    """Unpickling this creates a file: what a malicious checkpoint would do with a real command."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


@pytest.mark.parametrize("reader", ["eval.py", "train_lm.py --resume", "train_nmt.py --resume"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, reader):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    run.mkdir()
    task = "nmt" if "nmt" in reader else "lm"
    torch.save(
        {"model": _Payload(str(marker)), "config": {"task": task}, "task": task}, run / "ckpt.pt"
    )
    with pytest.raises(SystemExit, match="not a plain checkpoint of this project"):
        if reader == "eval.py":
            ev.main([str(run), "--out", str(tmp_path / "report")])
        elif task == "lm":
            train_lm.main(["--out", str(run), "--resume"])
        else:
            train_nmt.main(["--out", str(run), "--resume"])
    assert not marker.exists()
    assert not (tmp_path / "report").exists() and sorted(os.listdir(run)) == ["ckpt.pt"]


def test_checkpoints_and_method_states_load_as_data(script_run, tmp_path):
    script_run("lm", tmp_path / "lm", "--method", "frage", "--dropout", "0.1")
    ck = torch.load(
        tmp_path / "lm" / "ckpt.pt", weights_only=True
    )  # torch's RNG states (CPU, CUDA)
    assert set(ck["rng"][0]) == {"torch", "cuda"}
    torch.set_rng_state(ck["rng"][0]["torch"])
    state = agg.build_method("agg", 10, window=3).state_dict()
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["name"] == "agg"


def test_lr_schedules():
    """cosine: linear warm-up to the peak, then cosine decay to 10% at max_steps (train_lm.py,
    `--schedule cosine`);
    inverse-sqrt: Vaswani et al.'s (every train_nmt.py preset), peak 1 at the end of warm-up."""

    def cos(step):
        return train_nmt.lr_factor(step, "cosine", warmup=10, max_steps=110)

    assert (
        cos(0) == pytest.approx(0.1)
        and cos(9) == pytest.approx(1.0)
        and cos(10) == pytest.approx(1.0)
    )
    assert (
        cos(60) == pytest.approx(0.55)
        and cos(110) == pytest.approx(0.1)
        and cos(500) == pytest.approx(0.1)
    )

    def inv(step):
        return train_nmt.lr_factor(step, "inverse-sqrt", warmup=10, max_steps=110)

    assert (
        inv(4) == pytest.approx(0.5)
        and inv(9) == pytest.approx(1.0)
        and inv(39) == pytest.approx(0.5)
    )
    assert all(p["schedule"] == "inverse-sqrt" for p in train_nmt.PRESETS.values())
    assert [train_lm.cosine_lr(s, 10, 110) for s in (0, 9, 60, 110)] == [
        cos(s) for s in (0, 9, 60, 110)
    ]
