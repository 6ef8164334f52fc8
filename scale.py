#!/usr/bin/env python
"""Where AGG's conclusions hold as the model and the data grow: MLE and AGG over model sizes x training-data sizes.

    python scale.py --jobs 2                                # train and evaluate what is runnable, small cells first
    python scale.py --no-train --results results/lm_scale.json     # the study so far: JSON, figure, fits

The protocol (this project's choices; RESULTS.md states them with the numbers):
- model sizes S, M, L (SIZES): depth and width grow together; the tied head's rank is d_model. M is the cpu preset.
- data sizes: --train-fraction 0.25 / 0.5 / 1 of the offline corpus's train articles (nested prefixes, the same valid
  and test articles and the same tokenizer at every size).
- steps: 2400 x fraction, the cpu preset's 3.5 epochs at every data size (each cell sees its data equally often);
  warm-up 10% of the steps, 12 validations.
- learning rate: per size and method, LRS on the full data, seed 0, the lowest valid PPL at the last step; a best
  value at the edge of the list extends it by a factor 2 (up to twice), so the selection is bracketed.
- AGG's rare share: SHARES at M on the full data, lr 4e-3, seed 0, the lowest valid PPL; used at every size.
- seeds 0 1 2 per (size, data, method) at the selected lr, paired by seed; the lr sweep's seed-0 run is reused.

Every run is a train_lm.py run folder under OUT/runs (resumable: stop this script at any time and rerun it), evaluated
by eval.py into RUN/report/ once finished. Selections read validation only; test is read by eval.py for the table.
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import runlib

ROOT = os.path.dirname(os.path.abspath(__file__))
SIZES = {"S": dict(n_layer=2, d_model=64, n_head=2, d_ff=256),
         "M": dict(n_layer=4, d_model=128, n_head=4, d_ff=512),
         "L": dict(n_layer=6, d_model=192, n_head=6, d_ff=768)}
COST = {"S": 0.5, "M": 1.0, "L": 2.4}  # time of a run relative to M at the same data size (to run small cells first)
LRS = {"S": [4e-3, 8e-3, 1.6e-2], "M": [2e-3, 4e-3, 8e-3], "L": [1e-3, 2e-3, 4e-3]}
FRACTIONS = [0.25, 0.5, 1.0]
SHARES = [0.1, 0.2, 0.4]
SHARE_SETTING = dict(size="M", lr=4e-3, seed=0)
SEEDS = [0, 1, 2]
METHODS = ["mle", "agg"]
FULL_STEPS = 2400


def run_name(size, fraction, method, lr, seed, share=None):
    return f"{size}-f{fraction:g}-{method}" + (f"-r{share:g}" if share is not None else "") + f"-lr{lr:g}-s{seed}"


def run_flags(size, fraction, method, lr, seed, share=None):
    steps = round(FULL_STEPS * fraction)
    flags = ["--method", method, "--seed", str(seed), "--lr", f"{lr:g}", "--train-fraction", f"{fraction:g}",
             "--max-steps", str(steps), "--warmup", str(steps // 10), "--eval-interval", str(steps // 12)]
    flags += [x for k, v in SIZES[size].items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return flags + (["--rare-share", f"{share:g}"] if share is not None else [])


class Study:
    """The runs of the study as far as the finished ones decide them (selections need their sweeps done)."""

    def __init__(self, out):
        self.runs = os.path.join(out, "runs")
        self.done = set()  # runs known finished (a finished run stays finished)

    def finished(self, name):
        if name not in self.done and runlib.finished(self.folder(name)):
            self.done.add(name)
        return name in self.done

    def folder(self, name):
        return os.path.join(self.runs, name)

    def valid_ppl(self, name):
        """Valid PPL at the last step of a finished run, else None."""
        folder = self.folder(name)
        if not self.finished(name):
            return None
        with open(os.path.join(folder, "config.json")) as f:
            last = json.load(f)["max_steps"]
        recs = [json.loads(line) for line in open(os.path.join(folder, "log.jsonl")) if line.strip()]
        ppl = [r["ppl"] for r in recs if r.get("split") == "valid" and r.get("step") == last]
        return ppl[-1] if ppl else None

    def select(self, candidates):
        """(value, wanted runs): the value of the lowest valid PPL once every candidate's run finished (None before)."""
        ppl = {v: self.valid_ppl(spec[0]) for v, spec in candidates.items()}
        best = None if None in ppl.values() else min(ppl, key=ppl.get)
        return best, [spec for v, spec in candidates.items()]

    def share(self):
        s = SHARE_SETTING
        return self.select({sh: (run_name(s["size"], 1.0, "agg", s["lr"], s["seed"], sh),
                                 run_flags(s["size"], 1.0, "agg", s["lr"], s["seed"], sh)) for sh in SHARES})

    def lr(self, size, method, share):
        """The selected lr of (size, method) and the sweep's runs; an edge winner extends the list (twice at most)."""
        lrs, wanted = list(LRS[size]), []
        for _ in range(3):
            best, wanted = self.select({lr: (run_name(size, 1.0, method, lr, 0, share),
                                             run_flags(size, 1.0, method, lr, 0, share)) for lr in lrs})
            if best is None or min(lrs) < best < max(lrs) or len(lrs) >= len(LRS[size]) + 2:
                return best, wanted
            lrs.append(best * 2 if best == max(lrs) else best / 2)
        return best, wanted

    def plan(self):
        """[(name, flags, cost)] of every run wanted so far, and whether selections are still pending."""
        share, wanted = self.share()
        runs = {name: (flags, COST[SHARE_SETTING["size"]]) for name, flags in wanted}
        pending = share is None
        for size in SIZES:
            for method in METHODS:
                if method == "agg" and share is None:
                    continue
                sh = share if method == "agg" else None
                lr, sweep = self.lr(size, method, sh)
                runs.update({name: (flags, COST[size]) for name, flags in sweep})
                if lr is None:
                    pending = True
                    continue
                for fraction in FRACTIONS:
                    for seed in SEEDS:
                        runs[run_name(size, fraction, method, lr, seed, sh)] = (
                            run_flags(size, fraction, method, lr, seed, sh), COST[size] * fraction)
        return sorted(((n, f, c) for n, (f, c) in runs.items()), key=lambda r: (r[2], r[0])), pending

    def selections(self):
        share, _ = self.share()
        return dict(share=share, lr={size: {m: self.lr(size, m, share if m == "agg" else None)[0] for m in METHODS}
                                     for size in SIZES})


def evaluated(folder):
    return os.path.exists(os.path.join(folder, "report", "metrics.json"))


def next_job(study, busy):
    """The next command to run: an evaluation of a finished run first, then the cheapest unfinished run."""
    plan, pending = study.plan()
    for name, flags, _cost in plan:
        folder = study.folder(name)
        if name in busy:
            continue
        if study.finished(name):
            if not evaluated(folder):
                return name, [sys.executable, os.path.join(ROOT, "eval.py"), folder, "--out",
                              os.path.join(folder, "report"), "--n-samples", "0"]
            continue
        resume = ["--resume"] if os.path.exists(os.path.join(folder, "ckpt.pt")) else []
        return name, [sys.executable, os.path.join(ROOT, "train_lm.py"), *flags, "--out", folder, *resume]
    return None, pending


def train(study, jobs):
    """Keep `jobs` processes busy (one thread each when jobs > 1) until nothing is runnable; SIGTERM / SIGINT stop
    the runs cleanly (each checkpoints) and the script, which a rerun continues."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))} if jobs > 1 else {}))
    running = {}

    def stop(signum, frame):
        for proc in running.values():
            proc.send_signal(signal.SIGTERM)
        for proc in running.values():
            proc.wait()
        raise SystemExit(f"scale: {signal.Signals(signum).name}: runs checkpointed; rerun to continue")
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)
    os.makedirs(study.runs, exist_ok=True)
    while True:
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                if proc.returncode:
                    raise SystemExit(f"scale: {name} failed (see {study.folder(name)}.log); fix it and rerun")
        while len(running) < jobs:
            name, cmd = next_job(study, running)
            if name is None:
                break
            print(f"{time.strftime('%H:%M:%S')} {name}: {shlex.join(cmd[1:2] + cmd[2:])}", flush=True)
            with open(study.folder(name) + ".log", "a") as log:
                running[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        if not running:
            return
        time.sleep(2 if len(running) == jobs else 30)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "scale"))
    p.add_argument("--jobs", type=int, default=1, help="runs at once (2 on a 2-core CPU: one thread each)")
    p.add_argument("--no-train", action="store_true", help="train nothing: write the results of the finished runs")
    p.add_argument("--results", default=None, metavar="FILE", help="write the study's JSON here (and a figure beside it)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give 1 or more")
    study = Study(args.out)
    if not args.no_train:
        train(study, args.jobs)
    print(json.dumps(study.selections()))


if __name__ == "__main__":
    main()
