"""Data or epochs? AGG against MLE at M with the training data and the epochs moved apart, the
warm-up fixed.

    # train, evaluate; rerun to go on
    python -m studies.schedule --jobs 2 --results results/lm_schedule.json
    # the study so far: JSON, figure, fits
    python -m studies.schedule --no-train --results results/lm_schedule.json

The protocol (this project's choices):
- the cells (CELLS, train fraction: steps): 0.25 of the offline corpus's train articles for 600 and
  2,400 steps (3.5 and 14 epochs), 0.5 for 1,200 and 2,400 (3.5 and 7), the full data for 2,400,
  4,800 and 9,600 (3.5, 7 and 14). The scale study moves the data, the steps and the warm-up (10% of
  the steps) together: its cells at M are this grid's 3.5-epoch column; here every cell warms up for
  the cpu preset's 240 steps, and (1, 2,400) is the headline's setting;
- every run: M (the cpu preset) in float32 on any device, lr 4e-3, 12 validations; MLE, and AGG at
  the headline's rare share 0.2; seeds 0-4, paired by seed on one host (config.json's
  `versions.kernels`): both runs of a pair that ran on two hosts are trained again on one
  (NAME-kHOST, as in the scale study); `unpaired` lists those waiting;
- per cell the paired AGG/MLE quantities of the scale study (scale.paired_cell: test PPL as it is
  and with both models' rare bias calibrated, rare PPL, I(W), Uniq); OLS over the cell means (cells,
  not seeds, are the design points) on log10 training tokens and log10 epochs, with its lack-of-fit
  test (scale.fit_trend).
Every run is a train_lm.py run folder under OUT/runs (stop this script at any time and rerun it),
evaluated by eval.py into RUN/report/; nothing is selected.
"""

import math
import os

import runlib
from studies import scale

CELLS = {0.25: [600, 2400], 0.5: [1200, 2400], 1.0: [2400, 4800, 9600]}
SEEDS, METHODS, LR, WARMUP, SHARE = range(5), ["mle", "agg"], 4e-3, 240, 0.2
ROWS = [
    ("epochs_nominal", "train_tokens", "epochs", "{:,.0f} train tokens"),
    ("train_tokens", "epochs_nominal", "training tokens", "{:g} epochs"),
]
PANELS = [
    scale.PANELS[0],
    ("calibrated_ppl_log_ratio", "AGG / MLE test PPL, both calibrated", math.exp),
    *scale.PANELS[1:],
]


def pair_flags(method, seed, steps, fraction=1.0, warmup=WARMUP):
    """train_lm.py flags of a run of the headline's pair: M in float32, lr 4e-3, 12 validations;
    MLE, or AGG at rare share 0.2."""
    flags = (
        f"--method {method} --seed {seed} --lr {LR:g} --dtype float32 "
        f"--train-fraction {fraction:g} --max-steps {steps} --warmup {warmup} "
        f"--eval-interval {steps // 12}"
    ).split()
    if method == "agg":
        flags += ["--rare-share", f"{SHARE:g}"]
    return flags


def run_spec(fraction, steps, method, seed):  # (name, train_lm.py flags) of a run
    return f"f{fraction:g}-n{steps}-{method}-s{seed}", pair_flags(method, seed, steps, fraction)


class Schedule(scale.Study):
    label, name = "out/schedule", "schedule"

    # every run, the shortest first; a pair on two hosts is trained again here (scale's replicas)
    def plan(self):
        runs = {
            name: (flags, n)
            for f, ns in CELLS.items()
            for n in ns
            for m in METHODS
            for s in SEEDS
            for name, flags in [run_spec(f, n, m, s)]
        }
        cells = [
            {m: [run_spec(f, n, m, s)[0]] for m in METHODS}
            for f, ns in CELLS.items()
            for n in ns
            for s in SEEDS
        ]
        runs.update(self.replicas(runs, cells))
        return sorted(((name, f, c) for name, (f, c) in runs.items()), key=lambda r: (r[2], r[0]))

    def selections(self):
        return {}

    # scale's record with the epochs: optimizer steps x tokens per step / training tokens
    def record(self, name):
        record, cfg = scale.run_record(self, name, sizes=True), runlib.run_config(self.folder(name))
        return dict(
            record,
            epochs=record["max_steps"] * cfg["tokens_per_step_actual"] / record["train_tokens"],
            **{"replica": True} if scale.REPLICA.search(name) else {},
        )

    def write_results(self, path, argv, _corpus_path=None):
        runs, diverged = self.records(
            sorted({n for n, _f, _c in self.plan()} | self.made()), self.record
        )
        cells, unpaired = [], []
        for fraction, steps in ((f, n) for f, ns in CELLS.items() for n in ns):
            members = {
                n: r
                for n, r in runs.items()
                if (r["train_fraction"], r["max_steps"]) == (fraction, steps)
            }

            def hosts(m, s):  # the hosts of the runs of method m and seed s
                return {
                    scale.host(r) for r in members.values() if (r["method"], r["seed"]) == (m, s)
                }

            lone = {
                s
                for s in SEEDS
                if hosts("mle", s) and hosts("agg", s) and not hosts("mle", s) & hosts("agg", s)
            }
            # both ran, on two hosts
            unpaired += [n for n, r in members.items() if r["seed"] in lone]
            # pairs on one host only
            if (cell := scale.paired_cell(list(members.values()))) is not None:
                first = next(iter(members.values()))
                cells.append(
                    dict(
                        train_fraction=fraction,
                        max_steps=steps,
                        train_tokens=first["train_tokens"],
                        epochs=first["epochs"],
                        epochs_nominal=3.5 * steps / 2400 / fraction,
                        **cell,
                    )
                )
        fits = {
            k: scale.fit_trend(cells, k, on=("train_tokens", "epochs"), predict={})
            for k in scale.FIT_QUANTITIES
        }
        self.write(
            path,
            argv,
            dict(runs=runs, diverged=diverged, unpaired=unpaired, compare=cells, fits=fits),
        )
        if cells:
            scale.plot_cells(
                cells,
                os.path.splitext(path)[0] + ".png",
                f"AGG (rare share {SHARE:g}) against MLE at M, lr {LR:g}, warm-up {WARMUP} steps: "
                "data and epochs apart (mean over seeds, paired 95% intervals)",
                ROWS,
                PANELS,
            )
        print(
            f"wrote {path}: {len(runs)} runs, {len(cells)} paired cells, {len(unpaired)} unpaired"
        )


if __name__ == "__main__":
    scale.main(None, Schedule)
