"""Is AGG's gain at 14 epochs a regularisation a tuned MLE also gets? MLE and AGG with their
dropout and weight decay selected on validation, in the schedule study's two 14-epoch cells.

    # train, evaluate; rerun to go on
    python -m studies.regularise --jobs 2 --results results/lm_regularise.json
    # the study so far: JSON, figure
    python -m studies.regularise --no-train --results results/lm_regularise.json

The protocol (this project's choices, fixed before any run):
- the cells (CELLS, train fraction: steps): 0.25 of the offline corpus's train articles for 2,400
  steps and the full data for 9,600, both 14 epochs (the schedule study's cells of those names);
- every run: M (the cpu preset) in float32 on any device, lr 4e-3, warm-up 240 steps, 12
  validations; MLE, and AGG at the headline's rare share 0.2;
- per cell and method, dropout (DROPOUTS) x weight decay (WEIGHT_DECAYS) on seeds 0-2; selected:
  the lowest mean over those seeds of each run's best valid PPL (early stopping's);
- each method's selection on seeds 0-4, paired by seed on one host: AGG at its selection against
  MLE at its own (`tuned`); both at the preset's dropout 0.1 and weight decay 0.01 on seeds 0-4
  (`preset`: the schedule study's 14-epoch cells again, now with test at the best step);
- the warm-up control: both selections again with a warm-up of 10% of the steps, seeds 0-4
  (`warmup10`; at 2,400 steps 10% is the preset's 240 steps, so there it is `tuned`);
- `matched D/W`: both methods at each setting of the sweep, seeds 0-2 (how the regularisation of
  both moves AGG's ratio);
- every run evaluated on test twice: at its last step (RUN/report) and at its best validation
  (ckpt_best.pt, RUN/report-best); per comparison the paired AGG / MLE quantities of the scale
  study at both (scale.paired_cell: the test PPL ratio also over seeds and test articles);
- each run's record holds its validation curve (PPL total and per frequency group at every
  validation); the figure plots the tuned pairs' per-group valid NLL, AGG minus MLE, by step.
Every run is a train_lm.py run folder under OUT/runs (stop this script at any time and rerun it).
"""

import itertools
import json
import math
import os
import shlex

import matplotlib.pyplot as plt
import numpy as np

import eval as ev
import runlib
from studies import compare, scale, schedule

CELLS = {0.25: 2400, 1.0: 9600}
DROPOUTS = [0.1, 0.2, 0.3]
WEIGHT_DECAYS = [0.01, 0.1]
PRESET = (0.1, 0.01)  # the cpu preset's (dropout, weight decay)
SEEDS = range(5)
METHODS = ["mle", "agg"]
WARMUP = schedule.WARMUP
GROUPS = ["freq", "med", "rare"]
# what eval.py reports at the best validation step, kept in each record
BEST_KEYS = ["step", "valid_ppl", "ppl", "ppl_groups", "rare_bias", "isotropy", "article_stats"]


def run_spec(fraction, method, setting, seed, warmup=WARMUP):
    """(name, train_lm.py flags) of a run; setting: (dropout, weight decay)."""
    steps = CELLS[fraction]
    dropout, weight_decay = setting
    flags = schedule.pair_flags(method, seed, steps, fraction, warmup)
    flags += ["--dropout", f"{dropout:g}", "--weight-decay", f"{weight_decay:g}"]
    name = f"f{fraction:g}-{method}-do{dropout:g}-wd{weight_decay:g}"
    if warmup != WARMUP:
        name += f"-wu{warmup}"
    return f"{name}-s{seed}", flags


def comparisons(fraction, chosen):
    """{label: (MLE's setting, AGG's setting, seeds, warm-up)} of a cell; chosen: the selections."""
    steps = CELLS[fraction]
    out = {"preset": (PRESET, PRESET, SEEDS, WARMUP)}
    if None not in chosen.values():
        out["tuned"] = (chosen["mle"], chosen["agg"], SEEDS, WARMUP)
        if steps // 10 != WARMUP:
            out["warmup10"] = (chosen["mle"], chosen["agg"], SEEDS, steps // 10)
    return out


def pair_names(fraction, comparison):  # [{method: [name]}] of a comparison, one per seed
    mle, agg, seeds, warmup = comparison
    return [
        {
            "mle": [run_spec(fraction, "mle", mle, seed, warmup)[0]],
            "agg": [run_spec(fraction, "agg", agg, seed, warmup)[0]],
        }
        for seed in seeds
    ]


def at_best(record):
    """A run's record as at its best validation: the test metrics of ckpt_best.pt."""
    best = record["best_checkpoint"]
    return dict(record, valid_ppl=best["valid_ppl"], **{k: best[k] for k in BEST_KEYS[2:]})


def sweep_order(flags):
    """Where a run stands in its cell: by setting, then seed, then method (MLE and AGG of a seed at
    one setting side by side, so that a sweep cut short leaves pairs)."""
    values = dict(zip(flags[::2], flags[1::2]))  # --flag value, every flag of run_spec
    setting = (float(values["--dropout"]), float(values["--weight-decay"]), int(values["--warmup"]))
    return setting, int(values["--seed"]), values["--method"]


class Regularise(scale.Study):
    label, name = "out/regularise", "regularise"
    reports = {"report": [], "report-best": ["--checkpoint", "best"]}

    def best_valid_ppl(self, name):  # a finished run's lowest valid PPL (NaN: diverged), else None
        if self.diverged(name):
            return math.nan
        if not self.finished(name):
            return None
        log = ev.log_records(self.folder(name))
        if not log:  # a run of a prior file, no folder here
            return self.prior[name]["valid_ppl_best"]
        return min(r["ppl"] for r in log)

    def selection(self, fraction, method):
        """(the setting of the lowest mean best valid PPL over the selection seeds once every run
        ended, else None; the runs of the sweep)."""
        candidates = {
            setting: [run_spec(fraction, method, setting, s) for s in scale.SELECTION_SEEDS]
            for setting in itertools.product(DROPOUTS, WEIGHT_DECAYS)
        }
        wanted = sum(candidates.values(), [])
        for name, flags in wanted:
            self.check(name, flags)
        ppl = {
            setting: [self.best_valid_ppl(name) for name, _flags in runs]
            for setting, runs in candidates.items()
        }
        if None in sum(ppl.values(), []):
            return None, wanted

        def mean(setting):  # a diverged run (NaN) never wins
            return float(np.nan_to_num(np.mean(ppl[setting]), nan=np.inf))

        return min(ppl, key=mean), wanted

    def plan(self):
        """[(name, flags, cost)] of every run wanted so far: the shortest first, in each cell the
        preset's pairs first (the comparison every other is read against), then sweep_order."""
        runs, pairs, preset = {}, [], set()
        for fraction, steps in CELLS.items():
            cost = steps / 2400
            chosen = {}
            for method in METHODS:
                chosen[method], wanted = self.selection(fraction, method)
                runs.update({name: (flags, cost) for name, flags in wanted})
            for label, comparison in comparisons(fraction, chosen).items():
                mle, agg, seeds, warmup = comparison
                for seed in seeds:
                    for method, setting in (("mle", mle), ("agg", agg)):
                        name, flags = run_spec(fraction, method, setting, seed, warmup)
                        runs[name] = (flags, cost)
                        if label == "preset":
                            preset.add(name)
                pairs += pair_names(fraction, comparison)
        runs.update(self.replicas(runs, pairs))
        plan = [(n, f, c) for n, (f, c) in runs.items()]
        return sorted(plan, key=lambda run: (run[2], run[0] not in preset, *sweep_order(run[1])))

    def selections(self):
        return {
            f"{fraction:g}": {m: self.selection(fraction, m)[0] for m in METHODS}
            for fraction in CELLS
        }

    # scale's record, the test metrics at the best validation, the validation curve
    def record(self, name):
        folder = self.folder(name)
        record = scale.run_record(self, name, sizes=True)
        dropout = runlib.run_config(folder)["dropout"]
        with open(os.path.join(folder, "report-best", "metrics.json")) as f:
            best = next(iter(json.load(f).values()))
        curve = [
            dict(step=r["step"], ppl=r["ppl"], ppl_groups=r["ppl_groups"])
            for r in ev.log_records(folder)
        ]
        label = f"{self.label}/runs/{name}"
        report = [
            label,
            "--out",
            f"{label}/report-best",
            *self.eval_args,
            *self.reports["report-best"],
        ]
        best["eval_command"] = shlex.join(["python", "eval.py", *report])
        replica = {"replica": True} if scale.REPLICA.search(name) else {}
        return dict(
            record,
            host=scale.host(record),
            dropout=dropout,
            best_checkpoint={k: best.get(k) for k in [*BEST_KEYS, "eval_command"]},
            valid_curve=curve,
            **replica,
        )

    def write_results(self, path, argv, _corpus_path=None):
        names = sorted({n for n, _f, _c in self.plan()} | self.made())
        runs, diverged = self.records(names, self.record)
        selection, cells = {}, []
        for fraction in CELLS:
            chosen = {}
            for method in METHODS:
                chosen[method], wanted = self.selection(fraction, method)
                selection[f"{fraction:g}/{method}"] = dict(
                    selected=chosen[method],
                    best_valid_ppl={n: self.best_valid_ppl(n) for n, _f in wanted},
                )
            # and both methods at each setting of the sweep, seeds 0-2 (no runs of their own)
            matched = {
                f"matched {d:g}/{w:g}": ((d, w), (d, w), scale.SELECTION_SEEDS, WARMUP)
                for d, w in itertools.product(DROPOUTS, WEIGHT_DECAYS)
            }
            for label, comparison in {**comparisons(fraction, chosen), **matched}.items():
                wanted = {
                    n for pair in pair_names(fraction, comparison) for n in sum(pair.values(), [])
                }
                members = [r for n, r in runs.items() if scale.REPLICA.sub("", n) in wanted]
                cell = dict(train_fraction=fraction, max_steps=CELLS[fraction], comparison=label)
                cell["mle"], cell["agg"], _seeds, cell["warmup"] = comparison
                for when, view in (("last", members), ("best", [at_best(r) for r in members])):
                    paired = scale.paired_cell(view)
                    if paired is not None:
                        cell[when] = paired
                if "last" in cell:
                    cells.append(cell)
        self.write(
            path,
            argv,
            dict(
                selection=dict(
                    rule="lowest mean best valid PPL over seeds 0-2, per cell and method",
                    settings="(dropout, weight decay)",
                    **selection,
                ),
                runs=runs,
                diverged=diverged,
                compare=cells,
            ),
        )
        plotted = [c for c in cells if not c["comparison"].startswith("matched")]
        if plotted:
            plot_curves(runs, plotted, os.path.splitext(path)[0] + ".png")
        print(f"wrote {path}: {len(runs)} runs, {len(cells)} comparisons")


def group_nll_gap(runs, cell):
    """{group: (steps, mean over the cell's pairs of AGG's minus MLE's valid NLL)}."""
    by = {}
    for r in runs.values():
        setting = (r["dropout"], r["weight_decay"])
        if r["train_fraction"] == cell["train_fraction"] and r["warmup"] == cell["warmup"]:
            by[r["method"], setting, r["seed"], scale.host(r)] = r["valid_curve"]
    out = {}
    for group in ["total", *GROUPS]:
        gaps = []
        for seed, host in zip(cell["last"]["seeds"], cell["last"]["hosts"]):
            mle = by[("mle", tuple(cell["mle"]), seed, host)]
            agg = by[("agg", tuple(cell["agg"]), seed, host)]
            if group == "total":
                gap = [math.log(a["ppl"] / b["ppl"]) for a, b in zip(agg, mle)]
            else:
                gap = [
                    math.log(a["ppl_groups"][group] / b["ppl_groups"][group])
                    for a, b in zip(agg, mle)
                ]
            gaps.append(gap)
        steps = [r["step"] for r in mle]
        out[group] = (steps, np.mean(gaps, axis=0))
    return out


def plot_curves(runs, cells, path):
    """One row per cell, one panel per frequency group: AGG's minus MLE's valid NLL by step, for
    each comparison (mean over its pairs)."""
    fractions = sorted({c["train_fraction"] for c in cells})
    panels = ["total", *GROUPS]
    fig, axes = plt.subplots(len(fractions), 4, figsize=(14, 3.2 * len(fractions)), squeeze=False)
    for row, fraction in zip(axes, fractions):
        for cell in [c for c in cells if c["train_fraction"] == fraction]:
            gaps = group_nll_gap(runs, cell)
            label = f"{cell['comparison']} (MLE {cell['mle']}, AGG {cell['agg']})"
            for ax, group in zip(row, panels):
                steps, gap = gaps[group]
                ax.plot(steps, gap, marker=".", label=label)
        for ax, group in zip(row, panels):
            ax.axhline(0, color="grey", lw=0.5)
            ax.set_title(f"{group}, train fraction {fraction:g}, 14 epochs", fontsize=8)
            ax.set_xlabel("step")
            ax.set_ylabel("valid NLL, AGG - MLE (nats)")
        row[0].legend(fontsize=6)
    fig.suptitle(
        "AGG against MLE by validation step, each at the comparison's (dropout, weight decay), "
        "mean over its pairs; below 0: AGG lower",
        fontsize=10,
    )
    compare.save(fig, path)


if __name__ == "__main__":
    scale.main(study_class=Regularise)
