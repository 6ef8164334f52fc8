"""studies.grid: trains the grid in subprocesses (studies.pool), skips finished runs, resumes
stopped ones, writes the tables."""

import argparse
import json
import os
import signal
import sys
import threading
import time

import pytest
import torch

import train_lm
from studies import compare, grid, pool


@pytest.mark.slow
def test_grid_trains_skips_and_writes_the_tables(corpus, lm_tiny, tmp_path, capsys):
    flags = [
        "--data-dir",
        corpus["data"],
        "--cache-dir",
        corpus["cache"],
        *lm_tiny,
        "--max-steps",
        "2",
        "--eval-interval",
        "2",
    ]
    argv = [
        "--methods",
        "mle",
        "agg",
        "--seeds",
        "0",
        "--out",
        str(tmp_path),
        "--eval-args",
        "--n-samples 0",
        "--",
        *flags,
    ]
    os.makedirs(tmp_path / "runs")
    # a stopped run is resumed, not restarted
    train_lm.main(
        [
            "--method",
            "agg",
            "--seed",
            "0",
            "--out",
            str(tmp_path / "runs" / "agg-s0"),
            "--stop-at",
            "1",
            *flags,
        ]
    )
    # both runs at once, each writing its output beside its folder
    grid.main(["--jobs", "2", *argv])
    for m in ("mle", "agg"):
        ck = torch.load(tmp_path / "runs" / f"{m}-s0" / "ckpt.pt", weights_only=True)
        assert ck["step"] == 2 and ck["config"]["method"] == m
        assert (
            f"checkpoint {tmp_path / 'runs' / f'{m}-s0'}"
            in (tmp_path / "runs" / f"{m}-s0.log").read_text()
        )
    assert json.load(open(tmp_path / "runs" / "agg-s0" / "config.json"))["resumed_from_step"] == 1
    summary = json.load(open(tmp_path / "report" / "summary.json"))
    assert set(summary) == {"mle", "agg"} and summary["agg"]["n"] == 1
    tables = (tmp_path / "tables.md").read_text()
    row = next(
        line
        for line in tables.split("## AGG Table 3")[1].splitlines()
        if line.startswith("| agg |")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    # one run: no ± std
    assert cells[:2] == ["agg", "1"] and cells[5] == f"{summary['agg']['ppl']['mean']:.2f}"
    assert compare.cell({"n": 3, "ppl": {"mean": 271.041, "std": 6.612}}, "ppl") == "271.04 ± 6.61"
    assert compare.cell({"n": 3, "isotropy": {"mean": 0.5, "std": 0.01}}, "ppl") == "-"
    capsys.readouterr()
    mtime = os.path.getmtime(tmp_path / "runs" / "mle-s0" / "ckpt.pt")
    grid.main(argv)
    assert "done, skipped" in capsys.readouterr().out
    assert os.path.getmtime(tmp_path / "runs" / "mle-s0" / "ckpt.pt") == mtime
    capsys.readouterr()  # --no-train tabulates the finished runs and names the rest
    grid.main(["--methods", "mle", "agg", "ul", "--seeds", "0", "1", "--no-train", *argv[5:]])
    assert "4 runs not finished, left out: mle-s1 agg-s1 ul-s0 ul-s1" in capsys.readouterr().out
    assert set(json.load(open(tmp_path / "report" / "summary.json"))) == {"mle", "agg"}
    with pytest.raises(SystemExit, match="no finished run"):
        grid.main(["--methods", "ul", "--no-train", "--out", str(tmp_path)])


# a job that says when it runs and when SIGTERM reaches it (as a training run checkpoints and exits)
SLOW = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1] + '.stopped', 'w').close(), "
    "sys.exit(0)))\nopen(sys.argv[1] + '.started', 'w').close()\ntime.sleep(60)"
)


def test_the_pool_runs_jobs_at_once_and_a_failure_stops_the_others(tmp_path):
    flag = str(tmp_path / "slow")
    wait_then_fail = (
        f"import os, time\nwhile not os.path.exists({flag + '.started'!r}): time.sleep(0.05)\n"
        f"print('bad output')\nraise SystemExit(3)"
    )
    jobs = [
        ("ok", [sys.executable, "-c", "pass"], None),
        ("slow", [sys.executable, "-c", SLOW, flag], None),
        ("bad", [sys.executable, "-c", wait_then_fail], str(tmp_path / "bad.log")),
    ]
    ended = []
    with pytest.raises(
        SystemExit, match=r"bad failed \(exit 3; its output: .*bad.log\): fix it and rerun"
    ):
        pool.run(lambda busy: jobs.pop(0) if jobs else None, 2, ended.append)
    assert ended == ["ok"]  # after() for the job that ended well
    # slow and bad ran at once; bad's failure sent SIGTERM to slow
    assert os.path.exists(flag + ".stopped")
    assert (tmp_path / "bad.log").read_text() == "bad output\n"


def test_sigterm_to_the_pool_stops_its_jobs_with_checkpoints(tmp_path):
    flag = str(tmp_path / "job")

    def send_sigterm():
        while not os.path.exists(flag + ".started"):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_sigterm, daemon=True).start()
    jobs, handler = (
        [("job", [sys.executable, "-c", SLOW, flag], None)],
        signal.getsignal(signal.SIGTERM),
    )
    with pytest.raises(
        SystemExit, match="SIGTERM: the running jobs checkpointed and stopped; rerun"
    ):
        pool.run(lambda busy: jobs.pop(0) if jobs else None, 1)
    # the job got SIGTERM (its handler ran) and the pool waited for it
    assert os.path.exists(flag + ".stopped")
    assert signal.getsignal(signal.SIGTERM) == handler  # the pool's handler is gone with the pool


def test_the_pool_puts_jobs_on_huge_pages_and_shares_the_cores(tmp_path):
    """Each job runs with THP_MEM_ALLOC_ENABLE=1 (PyTorch's CPU tensors on huge pages) and, `jobs`
    at once, with cores // jobs threads."""
    job = (
        "import os, sys\nopen(sys.argv[1], 'w').write(os.environ['THP_MEM_ALLOC_ENABLE'] + ' ' + "
        "os.environ['OMP_NUM_THREADS'])"
    )
    jobs = [("a", [sys.executable, "-c", job, str(tmp_path / "a")], None)]
    pool.run(lambda busy: jobs.pop(0) if jobs else None, 2)
    assert (tmp_path / "a").read_text() == f"1 {max(1, (os.cpu_count() or 1) // 2)}"


def test_a_run_brought_back_without_its_checkpoint_is_finished_by_its_report(tmp_path):
    """Runs trained on another machine come back without ckpt.pt: finished when eval.py's report is
    of the last step."""
    (tmp_path / "report").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"task": "lm", "max_steps": 10}))
    assert not pool.finished(str(tmp_path))  # no report
    for step, done in ((5, False), (10, True)):
        (tmp_path / "report" / "metrics.json").write_text(json.dumps({"run": {"step": step}}))
        assert pool.finished(str(tmp_path)) is done
    (tmp_path / "config.json").write_text("{")  # an unreadable config: not finished, no traceback
    assert not pool.finished(str(tmp_path))


def test_the_pool_gives_each_running_job_its_own_gpu(tmp_path, monkeypatch):
    """Job slot s runs on the s-th visible GPU: two jobs at once never share one, a later job reuses
    a freed one."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    job = (
        "import os, sys, time\nopen(sys.argv[1], 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n"
        # wait for the other's start
        "while sys.argv[2:] and not os.path.exists(sys.argv[2]): time.sleep(0.05)"
    )
    other = {"first": "second", "second": "first"}
    jobs = [
        (
            n,
            [sys.executable, "-c", job, str(tmp_path / n)]
            + ([str(tmp_path / other[n])] if n in other else []),
            None,
        )
        for n in ("first", "second", "third")
    ]
    pool.run(lambda busy: jobs.pop(0) if jobs else None, 2)
    gpu = {n: (tmp_path / n).read_text() for n in ("first", "second", "third")}
    assert {gpu["first"], gpu["second"]} == {"5", "7"} and gpu["third"] in ("5", "7")


def grid_runs(method, seed, **axes):
    """(folder, command) of each setting of a grid over `axes` (lrs, warmups, sweep) with --out
    o."""
    args = argparse.Namespace(**{"out": "o", "lrs": None, "warmups": None, "sweep": None, **axes})
    return [
        grid.train_command(args, ["--x"], method, seed, setting) for setting in grid.settings(args)
    ]


def test_sweep_folders_and_selection_on_valid_ppl(tmp_path):
    assert [f for f, _ in grid_runs("agg", 2, lrs=[1e-3])] == [
        os.path.join("o", "runs", "agg-lr0.001-s2")
    ]
    ((folder, cmd),) = grid_runs("mle", 0, lrs=[5e-4], warmups=[100])
    assert folder == os.path.join("o", "runs", "mle-lr0.0005-wu100-s0")
    assert cmd[-5:] == ["--x", "--lr", "0.0005", "--warmup", "100"] and "--resume" not in cmd
    assert [f for f, _ in grid_runs("mle", 0)] == [os.path.join("o", "runs", "mle-s0")]
    assert (
        len(grid_runs("mle", 0, lrs=[1e-3, 2e-3], warmups=[10, 20], sweep=("gamma", [1.0, 2.0])))
        == 8
    )
    metrics = {}
    # mle: lr 1e-3 is best on valid, 2e-3 on test; the selection must follow valid
    for method, lr, seed, valid, test in [
        ("mle", 1e-3, 0, 300, 310),
        ("mle", 1e-3, 1, 310, 320),
        ("mle", 2e-3, 0, 305, 290),
        ("mle", 2e-3, 1, 320, 291),
        ("agg", 2e-3, 0, 280, 285),
    ]:
        folder = tmp_path / f"{method}-{lr}-{seed}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(dict(task="lm", lr=lr, warmup=30)))
        metrics[folder.name] = dict(
            method=method,
            seed=seed,
            step=10,
            valid_ppl=valid,
            ppl=test,
            ppl_groups=dict(rare=1.0),
            isotropy=0.5,
            out_dir=str(folder),
        )
    sweep = grid.sweep_table(metrics, "python -m studies.grid --lrs 1e-3 2e-3")
    assert len(sweep["runs"]) == 5 and {r["lr"] for r in sweep["runs"]} == {1e-3, 2e-3}
    assert (
        sweep["selected"]["mle"]["lr"] == 1e-3 and sweep["selected"]["mle"]["valid_ppl_mean"] == 305
    )
    assert sweep["selected"]["agg"]["n"] == 1


@pytest.mark.slow
def test_a_knob_sweep_trains_each_value_and_selects_on_valid_ppl(corpus, lm_tiny, tmp_path, capsys):
    flags = [
        "--data-dir",
        corpus["data"],
        "--cache-dir",
        corpus["cache"],
        *lm_tiny,
        "--max-steps",
        "2",
        "--eval-interval",
        "2",
    ]
    grid.main(
        [
            "--methods",
            "cosreg",
            "--sweep",
            "gamma",
            "0.5",
            "2",
            "--seeds",
            "0",
            "--out",
            str(tmp_path),
            "--eval-args",
            "--n-samples 0",
            "--",
            *flags,
        ]
    )
    sweep = json.load(open(tmp_path / "sweep.json"))
    for g in (0.5, 2.0):
        cfg = json.load(open(tmp_path / "runs" / f"cosreg-gamma={g:g}-s0" / "config.json"))
        assert cfg["gamma"] == g and cfg["method"] == "cosreg"  # the value reached the run
    assert sorted(r["gamma"] for r in sweep["runs"]) == [0.5, 2.0]
    best = min(sweep["settings"], key=lambda s: s["valid_ppl_mean"])
    assert sweep["selected"]["cosreg"]["gamma"] == best["gamma"]
    assert (
        f"cosreg: selected lr 0.003, warm-up 2, --gamma {best['gamma']:g} (mean valid PPL"
        in capsys.readouterr().out
    )
    tables = (tmp_path / "tables.md").read_text()  # a sweep's variants fill the method's rows
    assert "| cosreg gamma=0.5 | 1 |" in tables and "| cosreg gamma=2.0 | 1 |" in tables


def test_a_knob_sweep_names_a_bad_flag_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--sweep gama: not a numeric train_lm.py flag"):
        grid.main(["--methods", "cosreg", "--sweep", "gama", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="mle do not take --gamma"):
        grid.main(["--methods", "cosreg", "mle", "--sweep", "gamma", "1", "--out", str(tmp_path)])
    # the flag drops the _
    assert grid.parse_sweep(["lambda", "0.1"], ["frage"]) == ("lambda", "lambda_", [0.1])
    # any numeric training flag: the rivals' knobs that are not method hyper-parameters
    assert grid.parse_sweep(["embedding-weight-decay", "0", "1e-2"], ["mle"]) == (
        "embedding-weight-decay",
        "embedding_weight_decay",
        [0.0, 1e-2],
    )
    assert grid.parse_sweep(["rare-share", "0.1"], ["agg", "agg+center"])[1] == "rare_share"
    with pytest.raises(SystemExit, match="not a numeric train_lm.py flag"):
        grid.parse_sweep(["optimizer", "adamw"], ["mle"])
    for axis in ("seed", "lr", "warmup"):  # the grid's own axes: a sweep would train --seed twice
        with pytest.raises(
            SystemExit, match=f"--sweep {axis}: give the values with --{axis}s instead"
        ):
            grid.parse_sweep([axis, "1"], ["mle"])
    # today's knobs
    assert grid.parse_sweep(["untie-at", "0.33", "0.67"], ["mle"])[1:] == ("untie_at", [0.33, 0.67])
    assert grid.parse_sweep(["logit-softcap", "30"], ["agg"])[1] == "logit_softcap"
    with pytest.raises(
        SystemExit,
        match="--sweep gamma x: give a numeric hyper-parameter and its values \\(float\\)",
    ):
        grid.main(["--methods", "cosreg", "--sweep", "gamma", "x", "--out", str(tmp_path)])
    # a bool one
    with pytest.raises(SystemExit, match="--sweep use-g1: not a numeric train_lm.py flag"):
        grid.parse_sweep(["use-g1", "1"], ["agg"])
    with pytest.raises(SystemExit, match="--sweep gamma: give a numeric"):  # no values
        grid.parse_sweep(["gamma"], ["cosreg"])
    ((folder, cmd),) = grid_runs("agps", 1, sweep=("mu1", [17.0]))
    assert folder == os.path.join("o", "runs", "agps-mu1=17-s1") and cmd[-2:] == ["--mu1", "17"]


def test_a_finished_run_with_other_flags_is_refused(corpus, lm_tiny, tmp_path):
    flags = [
        "--data-dir",
        corpus["data"],
        "--cache-dir",
        corpus["cache"],
        *lm_tiny,
        "--max-steps",
        "2",
        "--eval-interval",
        "2",
    ]
    train_lm.main(
        ["--method", "mle", "--seed", "0", "--out", str(tmp_path / "runs" / "mle-s0"), *flags]
    )
    with pytest.raises(SystemExit, match="dropout=None \\(now 0.3\\)"):
        grid.main(
            [
                "--methods",
                "mle",
                "--seeds",
                "0",
                "--out",
                str(tmp_path),
                "--",
                *flags,
                "--dropout",
                "0.3",
            ]
        )
    cmd = [
        sys.executable,
        "train_lm.py",
        "--method",
        "mle",
        "--seed",
        "0",
        "--out",
        str(tmp_path / "runs" / "mle-s0"),
        *flags,
        "--device",
        "cpu",
        "--stop-at",
        "1",
    ]
    # steering flags do not count: no refusal
    pool.check_flags(str(tmp_path / "runs" / "mle-s0"), cmd[2:])
    # --no-train tabulates finished runs only when they were made with the grid's flags
    with pytest.raises(SystemExit, match="dropout=None \\(now 0.3\\)"):
        grid.main(
            [
                "--methods",
                "mle",
                "--seeds",
                "0",
                "--out",
                str(tmp_path),
                "--no-train",
                "--",
                *flags,
                "--dropout",
                "0.3",
            ]
        )
    # lost: the checkpoint's provenance still tells
    os.remove(tmp_path / "runs" / "mle-s0" / "config.json")
    with pytest.raises(SystemExit, match="dropout=None \\(now 0.3\\)"):
        pool.check_flags(str(tmp_path / "runs" / "mle-s0"), cmd[2:] + ["--dropout", "0.3"])
