"""The one job pool of the studies: commands run `jobs` at a time (one thread each on a 2-core
machine; one GPU each where there are GPUs), each in a thread of a concurrent.futures pool that
waits on its subprocess. SIGTERM / SIGINT send SIGTERM to every running command (a training run
checkpoints at its next step and exits 1) and stop the study."""

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import time

import torch

import runlib
import train_lm


def run(next_job, jobs, after=None, result=lambda name: None):
    """Keep `jobs` commands running: next_job(busy names) gives (name, argv, log or None), or None
    if none can start now; after(name) as a job ends. A failure stops the pool unless result(name)
    counts it a result (a diverged run)."""
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))} if jobs > 1 else {}
    # CPU tensors on huge pages: fewer page faults
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1", **threads)
    gpus = os.environ.get(
        "CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count())))
    )
    # job slot s runs on the s-th visible GPU (round robin)
    procs, logs, slots = {}, {}, list(range(jobs))

    def start(name, argv, log):
        slot, visible = slots.pop(), [g for g in gpus.split(",") if g]
        gpu_env = dict(env, CUDA_VISIBLE_DEVICES=visible[slot % len(visible)]) if visible else env
        try:
            opened = log_file(log, "a") if log else contextlib.nullcontext()
            with opened as out:  # the child holds its own handle
                procs[name] = subprocess.Popen(
                    argv, env=gpu_env, stdout=out, stderr=out and subprocess.STDOUT
                )
            return procs[name].wait()
        finally:
            slots.append(slot)

    def stop_all():
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait()

    def on_signal(signum, frame):
        stop_all()
        raise SystemExit(
            f"{signal.Signals(signum).name}: the running jobs checkpointed and stopped; rerun the "
            f"same command to continue (finished runs are kept)"
        )

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with cf.ThreadPoolExecutor(jobs) as pool:
            running = {}  # future -> job name
            while True:
                while len(running) < jobs and (job := next_job(set(running.values()))) is not None:
                    name, argv, logs[name] = job
                    print(
                        f"{time.strftime('%H:%M:%S')} {name}"
                        + (f" (output: {logs[name]})" if logs[name] else ""),
                        flush=True,
                    )
                    running[pool.submit(start, *job)] = name
                if not running:
                    return
                for future in cf.wait(running, return_when=cf.FIRST_COMPLETED)[0]:
                    name = running.pop(future)
                    if future.result() and not result(name):
                        stop_all()
                        raise SystemExit(
                            f"{name} failed (exit {future.result()}"
                            + (f"; its output: {logs[name]}" if logs[name] else "")
                            + "): fix it and rerun the same command (finished runs are kept)"
                        )
                    if after is not None:
                        after(name)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def log_file(path, mode):
    """A job's log (a study's runs/NAME.log) opened, never through a link (writes would land
    elsewhere)."""
    try:
        return open(path, mode, opener=nofollow)
    except OSError as e:
        raise SystemExit(
            f"cannot open {path} ({e.strerror}): a study's logs are plain files; "
            f"remove it if a link"
        )


def nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW)


# by its checkpoint, or (a run brought back from another machine without it) by its report
def finished(folder):
    if os.path.exists(path := os.path.join(folder, "ckpt.pt")):
        return (ck := runlib.load_checkpoint(path))["step"] >= ck["config"]["max_steps"]
    with (
        contextlib.suppress(OSError, ValueError, TypeError, KeyError),
        open(f"{folder}/report/metrics.json") as f,
    ):
        return next(iter(json.load(f).values()))["step"] >= runlib.run_config(folder)["max_steps"]
    return False


def check_flags(folder, flags):
    """Refuse the run in `folder` when it was started with other training settings than train_lm.py
    `flags` (steering flags such as --stop-at or --device aside): a study never tabulates or
    continues such a run."""
    saved, ckpt = runlib.run_config(folder), os.path.join(folder, "ckpt.pt")
    # no config.json, or a damaged one: the checkpoint's copy of the provenance
    if not saved and os.path.exists(ckpt):
        saved = {"segments": runlib.load_checkpoint(ckpt).get("provenance")}
    was = saved and (saved.get("segments") or [saved])[0].get("argv")
    parser = train_lm.build_parser()

    def refuse(message):  # argparse's error: a flag or value train_lm.py no longer takes
        raise SystemExit(
            f"{folder} was trained with flags train_lm.py no longer takes "
            f"({message}): delete the run to redo it, or give the study another --out"
        )

    parser.error = refuse
    a, b = (vars(parser.parse_args(argv)) for argv in (was, flags)) if was else ({}, {})
    if diff := sorted(k for k in a if k not in train_lm.RUN_CONTROL and a[k] != b[k]):
        raise SystemExit(
            f"{folder} was trained with "
            + ", ".join(f"{k}={a[k]!r} (now {b[k]!r})" for k in diff)
            + ": give another --out for other flags, or delete the run to redo it"
        )
