"""A run never silently becomes another run: resume without a checkpoint, one writer per folder,
torn logs,
preemption, divergence, a changed corpus, --overwrite, damaged checkpoints, provenance, bad flags
(train_lm.py)."""

import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile

import pytest
import torch
from conftest import LM_TINY, ROOT

import agg
import eval as ev
import runlib
import train_lm


def lm_argv(corpus, out, *extra, steps=2):
    return [
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


def start_subprocess(argv):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train_lm.py"), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_step(out, step, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        path = os.path.join(out, "log.jsonl")
        if os.path.exists(path) and any(f'"step": {step},' in line for line in open(path)):
            return
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached")


def test_a_run_stopped_before_its_first_checkpoint_is_started_again_with_its_command(
    corpus, tmp_path
):
    out = tmp_path / "r"
    argv = lm_argv(corpus, out, "--method", "agg", "--alpha", "0.5", "--seed", "3")
    train_lm.main(argv)
    os.remove(out / "ckpt.pt")  # killed (config.json and log written) before its first checkpoint
    with pytest.raises(
        SystemExit, match=r"ckpt.pt: no checkpoint there\. Check --out, or start a new run without"
    ):
        train_lm.main(["--out", str(out), "--resume"])
    train_lm.main(argv)  # its own command again: no --overwrite needed, the old run's files go
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["config"]["method"] == "agg" and ck["config"]["seed"] == 3 and ck["step"] == 2
    assert [s["start_step"] for s in json.load(open(out / "config.json"))["segments"]] == [0]


def test_one_writer_per_run_folder(corpus, tmp_path):
    out = tmp_path / "busy"
    proc = start_subprocess(lm_argv(corpus, out, steps=400) + ["--eval-interval", "400"])
    try:
        wait_for_step(out, 10, proc)
        with pytest.raises(SystemExit, match="being written by another process"):
            train_lm.main(lm_argv(corpus, out, "--overwrite"))
        assert os.path.exists(out / "log.jsonl")  # nothing of the first run was removed
    finally:
        proc.kill()
        proc.wait()
    train_lm.main(lm_argv(corpus, out, "--overwrite"))  # a killed writer leaves no stuck lock


def test_sigterm_writes_a_checkpoint_at_the_step_it_stopped_and_resume_continues(corpus, tmp_path):
    out = tmp_path / "pre"
    proc = start_subprocess(lm_argv(corpus, out, steps=400) + ["--eval-interval", "400"])
    wait_for_step(out, 20, proc)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1 and "SIGTERM: stopped at step" in text and "--resume" in text
    assert re.search(
        r"SIGTERM: stopped at step \d+, checkpoint .*ckpt.pt written; `python train_lm.py --out .* "
        r"--resume` continues it",
        text,
    )
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    logged = [json.loads(line)["step"] for line in open(out / "log.jsonl")]
    assert ck["step"] >= 20 and ck["step"] == max(logged)
    assert not [n for n in os.listdir(out) if ".tmp" in n]
    train_lm.main(["--out", str(out), "--resume", "--max-steps", str(ck["step"] + 2)])
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == ck["step"] + 2


def test_a_torn_log_line_is_dropped_on_resume_and_in_eval(corpus, tmp_path, capsys):
    out = tmp_path / "torn"
    train_lm.main(lm_argv(corpus, out, steps=4) + ["--stop-at", "2"])
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tra')  # a write cut short
    train_lm.main(["--out", str(out), "--resume"])
    records = [json.loads(line) for line in open(out / "log.jsonl")]  # every line parses again
    assert records[-1]["step"] == 4 and "torn write" in capsys.readouterr().out
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 9, "spl')
    assert [r["step"] for r in ev.log_records(str(out))] == [2, 4]  # eval.py reads past it
    assert (
        ev.last_valid_ppl(str(out), 4) == [r for r in records if r["split"] == "valid"][-1]["ppl"]
    )


def test_divergence_keeps_the_last_good_checkpoint_and_nan_is_reported_as_nan(corpus, tmp_path):
    out = tmp_path / "nan"
    train_lm.main(lm_argv(corpus, out, steps=6) + ["--stop-at", "2"])
    good = torch.load(out / "ckpt.pt", weights_only=True)
    good["model"]["ln_f.weight"][0] = float("nan")  # a state that diverges at the next step
    runlib.save_checkpoint(str(out / "ckpt.pt"), good)
    before = (out / "ckpt.pt").read_bytes()
    with pytest.raises(SystemExit, match="keeps the last good checkpoint"):
        train_lm.main(["--out", str(out), "--resume"])
    assert (
        out / "ckpt.pt"
    ).read_bytes() == before  # no checkpoint of the diverged model was written
    assert agg.ppl_of(float("nan"), 10) != agg.ppl_of(float("nan"), 10)  # nan, not 5.18e21
    assert agg.ppl_of(1e6, 1) == float("inf")


@pytest.mark.parametrize("name", ["log.jsonl", ".lock", "snapshots"])
def test_links_in_a_run_folder_are_refused_and_nothing_is_written_through_them(
    corpus, tmp_path, name
):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    train_lm.main(lm_argv(corpus, out, steps=4) + ["--stop-at", "2"])
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep me")
    target = elsewhere if name == "snapshots" else elsewhere / "precious"
    if (out / name).is_dir():
        shutil.rmtree(out / name)
    elif (out / name).exists():
        os.remove(out / name)
    os.symlink(target, out / name)
    for argv in (
        ["--out", str(out), "--resume"],
        lm_argv(corpus, out, "--overwrite", "--snapshot-steps", "1"),
    ):
        with pytest.raises(SystemExit, match=f"{name} is a symbolic link"):
            train_lm.main(argv)
    assert (
        os.listdir(elsewhere) == ["precious"] and (elsewhere / "precious").read_text() == "keep me"
    )


def test_a_model_whose_valid_ppl_overflows_is_never_checkpointed(corpus, tmp_path):
    argv = lm_argv(corpus, tmp_path / "big", steps=4)
    argv[argv.index("--lr") + 1] = "1e4"  # the valid loss is finite (about 3e10), its PPL is not
    with pytest.raises(SystemExit, match=r"step 2: the valid loss is .* PPL inf \(diverged\)"):
        train_lm.main(argv)
    assert not os.path.exists(tmp_path / "big" / "ckpt.pt")


def test_a_changed_corpus_is_refused_on_resume_and_in_eval(corpus_writer, tmp_path):
    data = corpus_writer(str(tmp_path / "data"))
    argv = [
        "--data-dir",
        data,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "4",
        "--eval-interval",
        "2",
        *LM_TINY,
        "--stop-at",
        "2",
    ]
    train_lm.main(argv)
    assert os.path.exists(tmp_path / "run" / "tokenizer.json")  # the run folder holds its tokenizer
    with open(os.path.join(data, "train.txt"), "a") as f:
        f.write("An extra line changes the corpus .\n")
    with pytest.raises(SystemExit, match="corpus or tokenizer changed"):
        train_lm.main(["--out", str(tmp_path / "run"), "--resume"])
    with pytest.raises(SystemExit, match="corpus or tokenizer changed"):
        ev.main([str(tmp_path / "run"), "--out", str(tmp_path / "rep"), "--n-samples", "0"])


def test_a_moved_corpus_resumes_and_evaluates_with_data_dir(corpus_writer, tmp_path, monkeypatch):
    """A run is tied to its data by the fingerprint, not by the --data-dir string: the corpus moved
    elsewhere resumes
    with --resume --data-dir NEW and evaluates with eval.py --data-dir NEW; another corpus there is
    still refused."""
    import shutil

    old = corpus_writer(str(tmp_path / "data"), n_lines=(200, 20, 20))
    out = str(tmp_path / "run")
    monkeypatch.chdir(tmp_path)  # a relative --data-dir is stored as an absolute path
    train_lm.main(
        [
            "--data-dir",
            "data",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            out,
            "--max-steps",
            "2",
            "--eval-interval",
            "2",
            *LM_TINY,
        ]
    )
    assert json.load(open(os.path.join(out, "config.json")))["data_dir"] == old
    new = str(tmp_path / "elsewhere" / "corpus")
    shutil.move(old, new)
    with pytest.raises(
        SystemExit, match=r"data folder .*data is not there \(moved\?\): give eval.py --data-dir"
    ):
        ev.main([out, "--out", str(tmp_path / "rep"), "--n-samples", "0"])
    train_lm.main(["--out", out, "--resume", "--data-dir", new, "--max-steps", "4"])
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["step"] == 4
    assert json.load(open(os.path.join(out, "config.json")))["data_dir"] == new
    shutil.move(new, old)  # and back: evaluated from the new place given on the command line
    m = ev.main([out, "--out", str(tmp_path / "rep"), "--n-samples", "0", "--data-dir", old])["run"]
    assert m["step"] == 4 and math.isfinite(m["ppl"])
    other = corpus_writer(str(tmp_path / "other"), n_lines=(200, 20, 20), seed=5)
    with pytest.raises(SystemExit, match="corpus or tokenizer changed"):
        ev.main([out, "--out", str(tmp_path / "rep"), "--n-samples", "0", "--data-dir", other])
    with pytest.raises(SystemExit, match="corpus or tokenizer changed"):
        train_lm.main(["--out", out, "--resume", "--data-dir", other, "--max-steps", "6"])


def test_the_nmt_data_fingerprint_does_not_name_the_folder(tmp_path):
    import shutil

    import data as data_py

    a = tmp_path / "corpus-a"
    a.mkdir()
    for split in ("train", "valid", "test"):
        (a / f"{split}.en").write_text("the cat sat\na dog ran\nthe dog sat\n")
        (a / f"{split}.de").write_text("die katze sass\nein hund lief\nder hund sass\n")
    cfg = dict(
        dataset="dir",
        data_dir=str(a),
        src="en",
        tgt="de",
        vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
    )
    first = data_py.prepare_nmt(cfg, log=lambda *x: None).cache.name
    shutil.move(a, tmp_path / "b")
    again = data_py.prepare_nmt(
        dict(cfg, data_dir=str(tmp_path / "b")), log=lambda *x: None
    ).cache.name
    assert first == again and first.startswith("dir-en-de-")
    assert runlib.same_data(
        "corpus-a-en-de-" + first[len("dir-en-de-") :], first
    )  # a run saved with the old name
    assert not runlib.same_data("corpus-a-en-de-0123456789ab", first) and runlib.same_data(
        None, first
    )


def test_overwrite_removes_the_previous_runs_files(corpus, tmp_path):
    out = tmp_path / "ow"
    train_lm.main(lm_argv(corpus, out, "--snapshot-steps", "1,2"))
    assert os.path.exists(out / "snapshots" / "emb_2.pt")
    (out / "ckpt.pt.tmp999").write_text("left by a killed write")
    train_lm.main(lm_argv(corpus, out, "--overwrite", steps=1) + ["--eval-interval", "1"])
    assert not os.path.exists(out / "snapshots") and not os.path.exists(out / "ckpt.pt.tmp999")
    assert [json.loads(line)["step"] for line in open(out / "log.jsonl")][-1] == 1


def test_an_out_folder_that_holds_no_run_is_not_emptied(corpus, tmp_path):
    """--out pointed at a folder of other files: only the run's own files are written and removed,
    with --overwrite
    too. A config.json that no run wrote (a Hugging Face export) is never replaced."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    train_lm.main(lm_argv(corpus, out))
    assert (out / "notes.txt").read_text() == "my notes" and os.path.exists(out / "ckpt.pt")
    mine = {
        "notes.txt": "my notes",
        "results.tmp7": "a temp file of mine",
        "ckpt_mine.pt": "not a snapshot",
        "config.json.bak": "{}",
        os.path.join("snapshots", "plot.png"): "a figure",
    }
    os.makedirs(out / "snapshots")
    for name, text in mine.items():
        (out / name).write_text(text)
    train_lm.main(
        lm_argv(corpus, out, "--overwrite", "--snapshot-steps", "1")
    )  # a run in the folder: no refusal
    assert {name: (out / name).read_text() for name in mine} == mine
    assert os.path.exists(out / "snapshots" / "emb_1.pt") and os.path.exists(out / "ckpt.pt")
    (out / "snapshots" / "emb_1.pt.tmp42").write_text("left by a killed write")
    train_lm.main(lm_argv(corpus, out, "--overwrite"))  # the old snapshots go, the figure stays
    assert os.listdir(out / "snapshots") == ["plot.png"]

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1}')
    (hf / "model.safetensors").write_bytes(b"weights")
    for flags in ((), ("--overwrite",), ("--resume",)):
        with pytest.raises(SystemExit, match=r"its config.json is not a run's"):
            train_lm.main(lm_argv(corpus, hf, *flags))
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]
    assert json.load(open(hf / "config.json")) == {"model_type": "gpt2", "n_layer": 1}


def test_provenance_of_every_segment_is_kept(corpus, tmp_path):
    out = tmp_path / "prov"
    train_lm.main(lm_argv(corpus, out, steps=4) + ["--stop-at", "2"])
    first = json.load(open(out / "config.json"))
    train_lm.main(["--out", str(out), "--resume"])
    cfg = json.load(open(out / "config.json"))
    assert [s["start_step"] for s in cfg["segments"]] == [0, 2]
    assert cfg["segments"][1]["argv"] == ["--out", str(out), "--resume"]
    assert (
        cfg["argv"] == first["argv"] and cfg["segments"][0]["argv"] == first["argv"]
    )  # the original kept


def test_the_checkpoint_carries_the_provenance_and_a_broken_config_json_is_rebuilt_from_it(
    corpus, tmp_path
):
    out = tmp_path / "prov2"
    train_lm.main(lm_argv(corpus, out, steps=6) + ["--stop-at", "2"])
    first = json.load(open(out / "config.json"))
    assert torch.load(out / "ckpt.pt", weights_only=True)["provenance"] == first["segments"]
    (out / "config.json").write_text('{"task": "lm", "segm')  # damaged (a disk error, an editor)
    train_lm.main(["--out", str(out), "--resume", "--stop-at", "4"])
    cfg = json.load(open(out / "config.json"))
    assert [s["start_step"] for s in cfg["segments"]] == [0, 2] and cfg["argv"] == first["argv"]
    os.remove(out / "config.json")
    train_lm.main(["--out", str(out), "--resume"])
    cfg = json.load(open(out / "config.json"))
    assert [s["start_step"] for s in cfg["segments"]] == [0, 2, 4] and cfg["segments"][0] == first[
        "segments"
    ][0]
    assert torch.load(out / "ckpt.pt", weights_only=True)["provenance"] == cfg["segments"]


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--stop-at", "0"], "--stop-at 0"),
        (["--stop-at", "-1"], "--stop-at -1"),
        (["--stop-at", "9"], "--stop-at 9"),
        (["--lr", "nan"], "--lr nan"),
        (["--eval-interval", "0"], "--eval-interval 0"),
        (["--log-interval", "0"], "--log-interval 0"),
        (["--vocab-size", "-5"], "--vocab-size -5"),
        (["--device", "cuda"], "CUDA is not available"),
        (["--device", "tpu"], "--device tpu: unknown device; use cpu, cuda"),
        (["--method", "agg", "--alpha", "inf"], "alpha must be a finite number >= 0, got inf"),
        (["--method", "agg", "--alpha", "nan"], "alpha must be a finite number >= 0, got nan"),
        (
            ["--method", "agps", "--rare-fraction", "1.5"],
            r"--method agps: .*rare_fraction must be a share .*\[0, 1\], got 1.5",
        ),
        (
            ["--method", "agg", "--window", "0"],
            "--method agg: .*window must be a whole number >= 1",
        ),
        (["--weight-decay", "-0.1"], r"--weight-decay -0.1: must be >= 0"),
        (["--embedding-weight-decay", "-1"], r"--embedding-weight-decay -1.0: must"),
        (["--eval-tokens", "-5"], "--eval-tokens -5: must be >= 1"),
        (["--dropout", "2"], r"--dropout 2.0: must be in \[0, 1\]"),
        (["--seed", "-1"], "--seed -1: must be >= 0"),
        (["--n-head", "0"], "--n-head 0: must be >= 1"),
    ],
)
def test_bad_run_flags_end_in_one_line_before_anything_is_written(corpus, tmp_path, flags, match):
    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit, match=match):
        train_lm.main(lm_argv(corpus, tmp_path / "bad", *flags, steps=2))
    assert not os.path.exists(tmp_path / "bad")


def test_torn_checkpoint_messages_never_advise_weights_only_false(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        runlib.load_checkpoint(str(path))
    assert "corrupted or not a checkpoint" in str(e.value) and "weights_only" not in str(e.value)
    assert "trusted source" not in str(e.value) and "\n" not in str(e.value)


def test_sighup_and_a_full_disk_while_logging_end_in_one_line(tmp_path):
    before = signal.getsignal(signal.SIGHUP)
    with runlib.stop_signals() as signals:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.01)
        assert signals == ["SIGHUP"]  # the loop checkpoints at its next step boundary, then stops
    assert signal.getsignal(signal.SIGHUP) is before  # the previous handler is back
    if os.path.exists("/dev/full"):
        with pytest.raises(
            SystemExit,
            match=r"cannot append to /dev/full \(No space left on device\): free disk "
            r"space, then --resume",
        ):
            runlib.log("/dev/full", dict(step=1, split="train", loss=1.0))


def test_out_or_cache_dir_that_is_a_file_is_refused(corpus, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match="--out .*afile: is a file"):
        train_lm.main(lm_argv(corpus, tmp_path / "afile"))
    with pytest.raises(SystemExit, match="--cache-dir .*afile: is a file"):
        train_lm.main(lm_argv(corpus, tmp_path / "run") + ["--cache-dir", str(tmp_path / "afile")])
    assert not (tmp_path / "run").exists()


def test_nmt_refuses_empty_data_and_bad_steps_and_keeps_one_writer(nmt_tiny, tmp_path):
    import train_nmt

    data = tmp_path / "d"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.en").write_text("hello world\nthe cat\n")
        (data / f"{split}.de").write_text("hallo welt\ndie katze\n")
    (data / "valid.en").write_text("  \n\n")
    (data / "valid.de").write_text(" \n\n")
    with pytest.raises(SystemExit, match="no sentence pair with text"):
        train_nmt.main(
            [
                "--data-dir",
                str(data),
                "--src",
                "en",
                "--tgt",
                "de",
                "--out",
                str(tmp_path / "o"),
                "--device",
                "cpu",
                "--max-steps",
                "2",
            ]
        )
    for flags, match in (
        (["--max-steps", "0"], "--max-steps 0"),
        (["--max-steps", "4", "--stop-at", "0"], "--stop-at 0"),
        (["--max-steps", "4", "--stop-at", "-1"], "--stop-at -1"),
        (["--lr", "nan"], "--lr nan"),
        (["--max-len", "0"], "--max-len 0: must be >= 1"),
        (["--beam", "0"], "--beam 0"),
        (["--synthetic-size", "0"], "--synthetic-size 0"),
        (["--valid-bleu-sents", "-1"], "sents -1"),
        (["--label-smoothing", "1.5"], r"--label-smoothing 1.5: must be in \[0, 0.999\]"),
    ):
        with pytest.raises(SystemExit, match=match):
            train_nmt.main(["--out", str(tmp_path / "bad"), *nmt_tiny, *flags])
    assert not os.path.exists(tmp_path / "bad")
    out = tmp_path / "nmt"
    train_nmt.main(
        [
            "--out",
            str(out),
            *nmt_tiny,
            "--max-steps",
            "4",
            "--eval-interval",
            "2",
            "--stop-at",
            "2",
            "--warmup",
            "0",
            "--synthetic-size",
            "300",
        ]
    )
    train_nmt.main(["--out", str(out), "--resume"])
    cfg = json.load(open(out / "config.json"))
    assert [s["start_step"] for s in cfg["segments"]] == [0, 2]
    assert runlib.load_checkpoint(str(out / "ckpt.pt"))["step"] == 4


def test_data_that_is_not_utf8_and_a_damaged_cache_end_in_one_line(corpus_writer, tmp_path):
    data = corpus_writer(str(tmp_path / "data"), n_lines=(200, 20, 20))
    with open(os.path.join(data, "valid.txt"), "ab") as f:
        f.write(b"caf\xe9 latin-1\n")
    argv = [
        "--data-dir",
        data,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "o"),
        "--max-steps",
        "2",
        "--eval-interval",
        "2",
        *LM_TINY,
    ]
    with pytest.raises(SystemExit, match=r"valid.txt: not UTF-8 text .*iconv"):
        train_lm.main(argv)
    corpus_writer(data, n_lines=(200, 20, 20))  # clean files again
    train_lm.main(argv)
    cache = os.path.join(tmp_path / "cache", os.listdir(tmp_path / "cache")[0])
    with open(os.path.join(cache, "valid.bin"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(
        SystemExit,
        match=r"data cache .* is damaged \(valid.bin: ValueError: mmap length .*delete "
        r"that folder",
    ):
        train_lm.main(argv[:5] + [str(tmp_path / "o2")] + argv[6:])


@pytest.mark.parametrize("name", ["counts.npy", "meta.json", "tokenizer.json"])
def test_a_damaged_cache_file_ends_in_one_line(corpus_writer, tmp_path, name):
    import data as data_py

    cfg = train_lm.make_config(
        data_dir=corpus_writer(str(tmp_path / "data"), n_lines=(200, 20, 20)),
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        block_size=16,
    )
    cache = data_py.prepare_lm(cfg, log=lambda *a: None)["dir"]
    path = os.path.join(cache, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # a copy cut short
    with pytest.raises(
        SystemExit, match=rf"data cache .* is damaged \({name}: .*delete that folder and run again"
    ):
        data_py.prepare_lm(cfg, log=lambda *a: None)


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(corpus, tmp_path, monkeypatch):
    train_lm.main(lm_argv(corpus, tmp_path / "r", "--stop-at", "2", steps=4))
    before = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(
        SystemExit, match="cannot write .*ckpt.*No space left.*previous checkpoint is intact"
    ):
        train_lm.main(["--out", str(tmp_path / "r"), "--resume"])
    monkeypatch.undo()
    after = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)
    assert after["step"] == before["step"] == 2 and not [
        n for n in os.listdir(tmp_path / "r") if ".tmp" in n
    ]


def test_resume_keeps_the_saved_dtype_unless_given(corpus, tmp_path):
    out = tmp_path / "bf16"
    train_lm.main(
        lm_argv(corpus, out, steps=4)
        + ["--dtype", "bfloat16", "--stop-at", "2", "--eval-interval", "2"]
    )
    train_lm.main(["--out", str(out), "--resume"])
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"
    assert torch.load(out / "ckpt.pt", weights_only=True)["config"]["dtype"] == "bfloat16"


def test_a_results_write_to_a_full_disk_or_a_read_only_folder_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"cannot write /dev/full/x.json \(.*\): free disk space"):
        runlib.write_json("/dev/full/x.json", {})
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root writes anywhere
        pytest.skip("running as root")
    with pytest.raises(SystemExit, match="cannot write .*ro/m.json"):
        runlib.write_json(str(ro / "m.json"), {})


def flip_a_bit(
    path,
):  # one bit in the middle of the largest record of the checkpoint's zip (tensor bytes)
    with zipfile.ZipFile(path) as z:
        record = max(z.infolist(), key=lambda info: info.file_size)
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)
        name, extra = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name + extra + record.file_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 4]))


def test_a_checkpoint_with_a_flipped_bit_is_refused_and_an_old_one_still_loads(corpus, tmp_path):
    out = tmp_path / "flip"
    train_lm.main(lm_argv(corpus, out, steps=4) + ["--stop-at", "2"])
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["sha256"] == runlib.digest({k: v for k, v in ck.items() if k != "sha256"})
    flip_a_bit(out / "ckpt.pt")
    damaged = rf"{out / 'ckpt.pt'}: its content does not match its checksum .*restore a good copy"
    with pytest.raises(SystemExit, match=damaged):
        train_lm.main(["--out", str(out), "--resume"])
    with pytest.raises(SystemExit, match=damaged):
        ev.main([str(out), "--out", str(tmp_path / "report")])
    del ck["sha256"]  # a checkpoint saved before the checksum: loaded as it is
    torch.save(ck, out / "ckpt.pt")
    assert runlib.load_checkpoint(str(out / "ckpt.pt"))["step"] == 2


def test_a_damaged_log_line_is_named_on_resume_and_a_damaged_config_is_rebuilt(corpus, tmp_path):
    good, out = tmp_path / "good", tmp_path / "run"
    train_lm.main(lm_argv(corpus, good, steps=4) + ["--stop-at", "2"])
    n = len(open(good / "log.jsonl").readlines()) + 1
    for line in ("garbage\n", "[1, 2]\n", '{"step": "2", "split": "train"}\n'):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(good, out)
        with open(out / "log.jsonl", "a") as f:
            f.write(line)
        with pytest.raises(
            SystemExit, match=rf"{out / 'log.jsonl'} line {n} is damaged .*delete or repair"
        ):
            train_lm.main(["--out", str(out), "--resume"])
    shutil.rmtree(out)
    shutil.copytree(good, out)
    (out / "config.json").write_text("{}")  # the checkpoint's config is the run's
    train_lm.main(["--out", str(out), "--resume"])
    assert json.loads((out / "config.json").read_text())["max_steps"] == 4


def test_a_run_that_diverges_before_its_first_checkpoint_says_there_is_none(corpus, tmp_path):
    with pytest.raises(
        SystemExit, match=r"loss is nan \(diverged\); .*ckpt.pt was never written\. Lower --lr"
    ):
        train_lm.main(lm_argv(corpus, tmp_path / "nan", "--lr", "1e9", steps=4))
    assert not os.path.exists(tmp_path / "nan" / "ckpt.pt")
