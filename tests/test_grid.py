"""grid.py: trains the grid in subprocesses, skips finished runs, resumes stopped ones, writes the tables."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import grid


@pytest.mark.slow
def test_grid_trains_skips_and_writes_the_tables(corpus, lm_tiny, tmp_path, capsys):
    flags = ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], *lm_tiny, "--max-steps", "2",
             "--eval-interval", "2"]
    argv = ["--methods", "mle", "agg", "--seeds", "0", "--out", str(tmp_path), "--eval-args", "--n-samples 0",
            "--", *flags]
    os.makedirs(tmp_path / "runs")
    import train_lm  # a stopped run is resumed, not restarted
    train_lm.main(["--method", "agg", "--seed", "0", "--out", str(tmp_path / "runs" / "agg-s0"), "--stop-at", "1",
                   *flags])
    grid.main(["--jobs", "2", *argv])  # both runs at once, each writing its output beside its folder
    for m in ("mle", "agg"):
        ck = torch.load(tmp_path / "runs" / f"{m}-s0" / "ckpt.pt", weights_only=True)
        assert ck["step"] == 2 and ck["config"]["method"] == m
        assert f"checkpoint {tmp_path / 'runs' / f'{m}-s0'}" in (tmp_path / "runs" / f"{m}-s0.log").read_text()
    assert json.load(open(tmp_path / "runs" / "agg-s0" / "config.json"))["resumed_from_step"] == 1
    summary = json.load(open(tmp_path / "report" / "summary.json"))
    assert set(summary) == {"mle", "agg"} and summary["agg"]["n"] == 1
    tables = (tmp_path / "tables.md").read_text()
    row = next(line for line in tables.split("## AGG Table 3")[1].splitlines() if line.startswith("| agg |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["agg", "1"] and cells[5] == f"{summary['agg']['ppl']['mean']:.1f}"  # one run: no ± std
    assert grid.cell({"agg": {"n": 3, "ppl": {"mean": 271.04, "std": 6.61}}}, "agg", "ppl") == "271.0 ± 6.6"
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


def test_wait_for_slot_frees_slots_and_names_the_failed_runs():
    slow, bad = [sys.executable, "-c", "import time; time.sleep(3)"], [sys.executable, "-c", "raise SystemExit(3)"]
    running = [(subprocess.Popen(cmd), cmd) for cmd in (slow, bad)]
    failed = grid.wait_for_slot(running, 2)  # returns once one of the two has ended
    assert [cmd for _, cmd in running] == [slow] and failed == [bad]
    failed += grid.wait_for_slot(running, 1)
    assert running == [] and failed == [bad]  # the slow one ended well


def test_sweep_folders_and_selection_on_valid_ppl(tmp_path):
    assert grid.run_dir("o", "agg", 2, 1e-3) == os.path.join("o", "runs", "agg-lr0.001-s2")
    assert grid.run_dir("o", "mle", 0, 5e-4, 100) == os.path.join("o", "runs", "mle-lr0.0005-wu100-s0")
    assert grid.run_dir("o", "mle", 0) == os.path.join("o", "runs", "mle-s0")
    metrics = {}
    # mle: lr 1e-3 is best on valid, 2e-3 on test; the selection must follow valid
    for method, lr, seed, valid, test in [("mle", 1e-3, 0, 300, 310), ("mle", 1e-3, 1, 310, 320),
                                          ("mle", 2e-3, 0, 305, 290), ("mle", 2e-3, 1, 320, 291),
                                          ("agg", 2e-3, 0, 280, 285)]:
        folder = tmp_path / f"{method}-{lr}-{seed}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(dict(lr=lr, warmup=30)))
        metrics[folder.name] = dict(method=method, seed=seed, step=10, valid_ppl=valid, ppl=test,
                                    ppl_groups=dict(rare=1.0), isotropy=0.5, out_dir=str(folder))
    sweep = grid.sweep_table(metrics, "python grid.py --lrs 1e-3 2e-3")
    assert len(sweep["runs"]) == 5 and {r["lr"] for r in sweep["runs"]} == {1e-3, 2e-3}
    assert sweep["selected"]["mle"]["lr"] == 1e-3 and sweep["selected"]["mle"]["valid_ppl_mean"] == 305
    assert sweep["selected"]["agg"]["n"] == 1


@pytest.mark.slow
def test_a_knob_sweep_trains_each_value_and_selects_on_valid_ppl(corpus, lm_tiny, tmp_path, capsys):
    flags = ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], *lm_tiny, "--max-steps", "2",
             "--eval-interval", "2"]
    grid.main(["--methods", "cosreg", "--sweep", "gamma", "0.5", "2", "--seeds", "0", "--out", str(tmp_path),
               "--eval-args", "--n-samples 0", "--", *flags])
    sweep = json.load(open(tmp_path / "sweep.json"))
    for g in (0.5, 2.0):
        cfg = json.load(open(tmp_path / "runs" / f"cosreg-gamma={g:g}-s0" / "config.json"))
        assert cfg["gamma"] == g and cfg["method"] == "cosreg"  # the value reached the run
    assert sorted(r["gamma"] for r in sweep["runs"]) == [0.5, 2.0]
    best = min(sweep["settings"], key=lambda s: s["valid_ppl_mean"])
    assert sweep["selected"]["cosreg"]["gamma"] == best["gamma"]
    assert f"cosreg: selected lr 0.003, warm-up 2, --gamma {best['gamma']:g} (mean valid PPL" in capsys.readouterr().out


def test_a_knob_sweep_names_a_bad_flag_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--sweep gama: not a numeric train_lm.py flag"):
        grid.main(["--methods", "cosreg", "--sweep", "gama", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="mle do not take --gamma"):
        grid.main(["--methods", "cosreg", "mle", "--sweep", "gamma", "1", "--out", str(tmp_path)])
    assert grid.sweep_flag("lambda", ["frage"]) == ("lambda", "lambda_", float)  # the flag drops the trailing _
    # any numeric training flag: the rivals' knobs that are not method hyper-parameters
    assert grid.sweep_flag("embedding-weight-decay", ["mle"]) == ("embedding-weight-decay", "embedding_weight_decay",
                                                                   float)
    assert grid.sweep_flag("rare-share", ["agg", "agg+center"])[1] == "rare_share"
    with pytest.raises(SystemExit, match="not a numeric train_lm.py flag"):
        grid.sweep_flag("optimizer", ["mle"])
    assert grid.run_dir("o", "agps", 1, knob=("mu1", 17.0)) == os.path.join("o", "runs", "agps-mu1=17-s1")


def test_a_finished_run_with_other_flags_is_refused(corpus, lm_tiny, tmp_path):
    import train_lm
    flags = ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], *lm_tiny, "--max-steps", "2",
             "--eval-interval", "2"]
    train_lm.main(["--method", "mle", "--seed", "0", "--out", str(tmp_path / "runs" / "mle-s0"), *flags])
    with pytest.raises(SystemExit, match="dropout=None \\(now 0.3\\)"):
        grid.main(["--methods", "mle", "--seeds", "0", "--out", str(tmp_path), "--", *flags, "--dropout", "0.3"])
    cmd = [sys.executable, "train_lm.py", "--method", "mle", "--seed", "0", "--out", str(tmp_path / "runs" / "mle-s0"),
           *flags, "--device", "cpu", "--stop-at", "1"]
    assert grid.same_flags(str(tmp_path / "runs" / "mle-s0"), cmd) is None  # steering flags do not count
    # --no-train tabulates finished runs only when they were made with the grid's flags
    with pytest.raises(SystemExit, match="dropout=None \\(now 0.3\\)"):
        grid.main(["--methods", "mle", "--seeds", "0", "--out", str(tmp_path), "--no-train", "--", *flags,
                   "--dropout", "0.3"])
    os.remove(tmp_path / "runs" / "mle-s0" / "config.json")  # lost: the checkpoint's provenance still tells
    assert "dropout=None (now 0.3)" in grid.same_flags(str(tmp_path / "runs" / "mle-s0"), cmd + ["--dropout", "0.3"])


def test_sigterm_to_the_grid_stops_its_runs_with_checkpoints(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(60)"])
    time.sleep(0.5)
    running = [(child, ["x"])]
    grid.stop_children(running)
    assert child.returncode == 0  # the child got SIGTERM (its handler ran) and the grid waited for it
