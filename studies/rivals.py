"""AGG against the fixes that came after it, at the cpu preset, every method tuned as AGG is.

    # train, evaluate, select; rerun to continue
    python -m studies.rivals --jobs 2 --results results/lm_rivals.json
    # the study so far: JSON, Pareto picture
    python -m studies.rivals --no-train --results results/lm_rivals.json

The protocol (this project's choices):
- the rivals (RIVALS): MLE; AGG; Coupled Adam (the vocabulary matrix's update divided by its mean
  second moment); embedding centering (mu-centering after every step, or the mu-loss); z-loss; AGG +
  centering; and the controls an untied output matrix with MLE and with AGG.
- each rival: LRS x its main knob at seed 0 on the full data; the FINALISTS settings with the lowest
  valid PPL at the last step then get seeds 1 and 2, and the lowest mean valid PPL over seeds 0-2 is
  selected (one seed can land in a good or a bad mode: scale.py's S runs at lr 8e-3 did, so one seed
  would select a mode, not a setting);
- then seeds 0-2 at the selection (0-4 for MLE, AGG, Coupled Adam, z-loss and centering), paired
  with MLE by seed, and seeds 0-2 of every other knob value at the selected lr (0-4 for those in
  KNOB_SEEDS), each paired with MLE too: the knob's trade-off between PPL and geometry with seed
  intervals;
- a pair never spans two hosts (config.json's `versions.kernels`): a rival's run of a selection made
  on a host where MLE's run of that seed was not gets an MLE replica on that host
  (mle-lrLR-sS-kHOST); the sweeps' selections may mix hosts, which moves a run as another seed
  would;
- every run evaluated by eval.py (test PPL total, per group and calibrated, the geometry metrics
  that favour no method, Uniq, greedy and sampled continuations); selections read validation only.
The study machinery (restartable runs, results files that continue the study elsewhere) is
scale.py's.
"""

import math
import os
import re

import matplotlib.pyplot as plt
import numpy as np

import train_lm
from studies import compare, scale

LRS = [2e-3, 4e-3, 8e-3]
# AGG's share, three values like every rival's knob: 0.05 is scale.py's selection at this very
# setting (M, full data, lr 4e-3; 0.025 no better on the mean), 0.2 the headline's, 0.4 the peers'
# selection (AGPS, FRAGE)
SHARES = [(f"share{s:g}", ["--rare-share", f"{s:g}"]) for s in (0.05, 0.2, 0.4)]
# name: (method, flags, [(knob label, knob flags)]); a rival without a knob sweeps the lr only
RIVALS = {
    "mle": ("mle", [], [("", [])]),
    "agg": ("agg", [], SHARES),
    "coupled-adam": (
        "mle",
        ["--optimizer", "coupled-adam"],
        [(f"ewd{w:g}", ["--embedding-weight-decay", f"{w:g}"]) for w in (0.0, 0.01, 0.1)],
    ),
    "center": (
        "center",
        [],
        [("step", ["--center-mode", "step"])]
        + [
            (f"mu{c:g}", ["--center-mode", "loss", "--mu-coef", f"{c:g}"]) for c in (0.1, 1.0, 10.0)
        ],
    ),
    # 1e-4: OLMo 2's
    "zloss": ("zloss", [], [(f"z{c:g}", ["--z-coef", f"{c:g}"]) for c in (1e-4, 1e-3, 1e-2, 1e-1)]),
    "agg+center": ("agg+center", [], SHARES),
    "untied-mle": ("mle", ["--untie"], [("", [])]),
    "untied-agg": ("agg", ["--untie"], SHARES),
}
# the others: 3 (center: its selection
SEEDS = {"mle": 5, "agg": 5, "coupled-adam": 5, "zloss": 5, "center": 5}
# at 5 seeds as mu-loss 10 has them; its seeds 3-4 came later, on another host, each with an MLE
# replica there) knob values off the selection run on 5 seeds, chosen after seeing the curves
# (mu-loss 10: no PPL cost on 3 seeds)
KNOB_SEEDS = {("center", "mu10"): 5}  # the others: 3
# settings of a rival's sweep run on seeds 1-2 too, the best of them on the mean of seeds 0-2
FINALISTS = 2
# an MLE replica's run name
REPLICA = re.compile(r"^mle-lr(?P<lr>[0-9.e+-]+)-s(?P<seed>\d+)-k(?P<host>[0-9a-f]{8})$")


def sweep_label(lr, knob):  # a setting's key in the results' selection
    return f"lr{lr:g} {knob}".strip()


def run_name(rival, lr, knob, seed):
    return f"{rival}-lr{lr:g}" + (f"-{knob}" if knob else "") + f"-s{seed}"


class Rivals(scale.Study):
    # greedy and sampled continuations for seq-rep-4 and distinct-n
    eval_args = ["--n-samples", "5"]
    label, name, title = "out/rivals", "rivals", "AGG and its rivals"
    table, seeds, knob_seeds, pairs, lr_also = (
        RIVALS,
        SEEDS,
        KNOB_SEEDS,
        [("untied-mle", "untied-agg")],
        None,
    )

    def flags(self, rival, lr, knob, seed):  # train_lm.py's
        method, flags, knobs = self.table[rival]
        return f"--method {method} --seed {seed} --lr {lr:g}".split() + flags + dict(knobs)[knob]

    def replicas(self, mle_best):
        """The MLE replicas {name: flags} made so far, and one here per selected run whose MLE ran
        on another host (scale.Study.run_host's)."""
        out = {
            n: self.flags("mle", float(m["lr"]), "", int(m["seed"]))
            for n in self.made()
            if (m := REPLICA.match(n)) and self.finished(n)
        }
        selected = (
            {r: b for r, b in self.selections().items() if r != "mle" and b}
            if mle_best and self.host
            else {}
        )
        for rival, best in selected.items():
            for seed in range(self.seeds.get(rival, 3)):
                mle, run = run_name("mle", *mle_best, seed), run_name(rival, *best, seed)
                if (
                    self.finished(run)
                    and self.run_host(run) == self.host
                    and self.finished(mle)
                    and self.run_host(mle) not in (None, self.host)
                ):
                    out[f"{mle}-k{self.host[:8]}"] = self.flags("mle", mle_best[0], "", seed)
        return out

    def sweep_ppl(self, rival):  # {(lr, knob): valid PPL (None: not finished)} of seed 0
        knobs = [k for k, _ in self.table[rival][2]]
        return {(lr, k): self.valid_ppl(run_name(rival, lr, k, 0)) for lr in LRS for k in knobs}

    def finalists(self, rival):
        """The FINALISTS (lr, knob) of the lowest seed-0 valid PPL, or None before the seed-0 sweep
        finished."""
        seed0 = self.sweep_ppl(rival)

        def rank(v):  # a diverged run is never a finalist
            return math.inf if math.isnan(seed0[v]) else seed0[v]

        return None if None in seed0.values() else sorted(seed0, key=rank)[:FINALISTS]

    def selection(self, rival):
        """((lr, knob) or None before its runs finished; runs): seed 0 over the grid, then the
        finalists' mean."""

        def spec(lr, k, seed):
            return run_name(rival, lr, k, seed), self.flags(rival, lr, k, seed)

        sweep = [spec(lr, k, 0) for lr in LRS for k, _ in self.table[rival][2]]
        if (finalists := self.finalists(rival)) is None:
            return None, sweep
        best, final = self.select({v: [spec(*v, seed) for seed in (0, 1, 2)] for v in finalists})
        return best, sweep + [r for r in final if r not in sweep]

    def plan(self):
        runs = {}
        for rival in self.table:
            best, sweep = self.selection(rival)
            runs.update({name: (flags, 1.0) for name, flags in sweep})
            for seed in range(self.seeds.get(rival, 3)) if best else []:
                runs[run_name(rival, *best, seed)] = (self.flags(rival, *best, seed), 1.5)
            # the knob curve at the selected lr
            for knob, _ in self.table[rival][2] if best else []:
                for seed in range(self.knob_seeds.get((rival, knob), 3)):
                    runs.setdefault(
                        run_name(rival, best[0], knob, seed),
                        (self.flags(rival, best[0], knob, seed), 2.0),
                    )
        runs.update(
            {name: (flags, 1.5) for name, flags in self.replicas(self.selection("mle")[0]).items()}
        )
        return sorted(((n, f, c) for n, (f, c) in runs.items()), key=lambda r: (r[2], r[0]))

    def selections(self):
        return {rival: self.selection(rival)[0] for rival in self.table}

    def write_results(self, path, argv, _corpus_path=None):
        names = {
            run_name(rival, lr, k, s): (rival, k)
            for rival, (_m, _f, knobs) in self.table.items()
            for lr in LRS
            for k, _ in knobs
            for s in range(max(self.seeds.values()))  # the others: replicas
        }

        def record(n):
            rival, knob = names.get(n, ("mle", ""))
            return scale.run_record(self, n, rival=rival, replica=bool(REPLICA.match(n)), knob=knob)

        runs, diverged = self.records(
            sorted({n for n, _f, _c in self.plan()} | self.made()), record
        )
        selections = self.selections()
        chosen = {
            n: r
            for n, r in runs.items()
            if (r["lr"], r["knob"]) == tuple(selections.get(r["rival"]) or ())
        }
        # every rival against MLE, and the study's own pairs (does AGG act on an untied output
        # matrix, add to a knob?)
        comparisons = [
            c
            for base, rival in [("mle", r) for r in self.table if r != "mle"] + self.pairs
            if (c := paired(chosen, base, rival, rival))
        ]
        # every other knob value at a rival's selected lr against MLE too: the knob's PPL cost with
        # a seed interval
        mle = {n: r for n, r in chosen.items() if r["rival"] == "mle"}
        knob_pairs = [
            c
            for rival, best in selections.items()
            if best and rival != "mle"
            for knob, rs in knob_curve(self, runs, rival, best, True).items()
            if knob != best[1]
            if (c := paired({**rs, **mle}, "mle", rival, f"{rival} {knob}"))
        ]
        # and a pair's two rivals at each knob value of their curves, where both selected one lr
        # (seeds 0-2)
        curves = {
            rival: knob_curve(self, runs, rival, best) for rival, best in selections.items() if best
        }
        same_knob = [
            c
            for base, rival in self.pairs
            if base in curves and rival in curves and selections[base][0] == selections[rival][0]
            for knob, rs in curves[rival].items()
            if (c := paired({**rs, **curves[base].get(knob, {})}, base, rival, f"{rival} {knob}"))
        ]
        sweep, finalists, sds = {}, {}, []
        for rival in self.table:
            sweep[rival] = {sweep_label(*v): ppl for v, ppl in self.sweep_ppl(rival).items()}
            finalists[rival] = {}
            for lr, k in self.finalists(rival) or []:
                ppl = [self.valid_ppl(run_name(rival, lr, k, s)) for s in (0, 1, 2)]
                finalists[rival][sweep_label(lr, k)] = ppl
                if None not in ppl:
                    sds.append(np.std(np.log(ppl), ddof=1))

        def curve(rs):
            return {
                name: [compare.get(r, key) for r in rs.values()]
                for name, key in (
                    ("valid_ppl", "valid_ppl"),
                    ("rare_isotropy", "isotropy_groups.rare"),
                    ("isoscore", "isoscore"),
                )
            }

        sensitivity = lr_sensitivity(sweep, selections, train_lm.PRESETS["cpu"]["vocab_size"])
        self.write(
            path,
            argv,
            dict(
                selection=dict(
                    rule=f"valid PPL at the last step: seed 0 over the grid, then the {FINALISTS} "
                    "best on the mean of seeds 0-2",
                    selected=selections,
                    sweep_valid_ppl=sweep,
                    finalists_valid_ppl=finalists,
                    knob_curve={
                        rival: {k: curve(rs) for k, rs in c.items()} for rival, c in curves.items()
                    },
                ),
                # the noise floor of one seed's valid loss: its SD over seeds 0-2, median over the
                # finalists
                valid_loss_seed_sd=float(np.median(sds)) if sds else None,
                lr_sensitivity=sensitivity,
                runs=runs,
                diverged=diverged,
                compare=comparisons,
                compare_knobs=knob_pairs,
                compare_same_knob=same_knob,
            ),
        )
        if runs:
            plot_pareto(self, runs, selections, os.path.splitext(path)[0] + ".png")
        # beside the rivals of another study's results file (lr_also), where there is one
        if sensitivity:
            also = (
                os.path.exists(self.lr_also or "")
                and compare.read_results(self.lr_also, "")["lr_sensitivity"]
            )
            plot_lr_sensitivity(
                {**(also or {}), **sensitivity}, self.title, os.path.splitext(path)[0] + "_lr.png"
            )
        print(f"wrote {path}: {len(runs)} runs, {len(comparisons)} comparisons with MLE")


def paired(chosen, base, rival, label):
    """compare.compare of base's and rival's runs paired by seed on one host, {seed: why not}; None
    if none pair."""
    pairs, unpaired = {}, {}
    for nc, c in sorted((n, c) for n, c in chosen.items() if c["rival"] == rival):
        bases = sorted(
            (n, r) for n, r in chosen.items() if r["rival"] == base and r["seed"] == c["seed"]
        )
        whys = [
            compare.pair_difference(compare.record_config(b), compare.record_config(c))
            for _n, b in bases
        ]
        # the seed's base run on the same host: the run itself or (MLE's) its replica there
        if None in whys:
            nb, b = bases[whys.index(None)]
            pairs.update({nb: dict(b, variant=base), nc: dict(c, variant=label)})
        elif bases:
            unpaired[c["seed"]] = whys[0]
    return dict(compare.compare(pairs, {}, base, label, []), unpaired=unpaired) if pairs else None


def knob_curve(study, runs, rival, best, more_seeds=False):
    """{knob: {name: record} of seeds 0-2 (more_seeds: KNOB_SEEDS's)} at the selected lr, the knobs
    with all seeds."""

    def seeds(knob):
        return study.knob_seeds.get((rival, knob), 3) if more_seeds else 3

    curve = {
        knob: {
            n: r
            for n, r in runs.items()
            if (r["rival"], r["lr"], r["knob"]) == (rival, best[0], knob)
            and r["seed"] < seeds(knob)
            and not r.get("replica")
        }
        for knob, _ in study.table[rival][2]
    }
    return {knob: rs for knob, rs in curve.items() if len(rs) == seeds(knob)}


def plot_pareto(study, runs, selections, path):
    """Valid PPL against rare I(W) and against IsoScore: every rival's sweep (seed 0, faint), its
    knob at the selected lr (mean and range of seeds 0-2, joined by a line) and its selection
    (large; all its seeds)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    colours = dict(zip(study.table, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2))

    def spread(v):  # errorbar's [[below], [above]] the mean, >= 0 despite rounding
        return [[max(v.mean() - v.min(), 0)], [max(v.max() - v.mean(), 0)]]

    # the frame holds the knob curves and the selections; sweep runs above it sit on its top edge as
    # triangles
    shown = [
        r["valid_ppl"]
        for r in runs.values()
        if (selections.get(r["rival"]) or (None,))[0] == r["lr"]
    ]
    top = max(shown) + 8 if shown else max([r["valid_ppl"] for r in runs.values()], default=1.0)

    # the mean of runs rs (x(run), valid PPL) with their range
    def point(ax, rs, x, colour, **style):
        x, y = np.array([x(r) for r in rs]), np.array([r["valid_ppl"] for r in rs])
        ax.errorbar(
            x.mean(), y.mean(), xerr=spread(x), yerr=spread(y), marker="o", color=colour, **style
        )

    for ax, (key, label) in zip(
        axes,
        (
            ("isotropy_groups.rare", "I(W) of the rare 20% (sign-invariant, seen tokens)"),
            ("isoscore", "IsoScore (seen tokens)"),
        ),
    ):

        def get(r):
            return compare.get(r, key)

        for rival in study.table:
            # the sweep
            for over, marker, size, alpha in ((False, "o", 10, 0.3), (True, "^", 25, 0.6)):
                rs = [
                    r
                    for r in runs.values()
                    if (r["rival"], r["seed"], r["valid_ppl"] > top) == (rival, 0, over)
                ]
                ax.scatter(
                    [get(r) for r in rs],
                    [min(r["valid_ppl"], top - 1) for r in rs],
                    s=size,
                    alpha=alpha,
                    marker=marker,
                    color=colours[rival],
                )
            if not (best := selections.get(rival)):
                continue
            curve = knob_curve(study, runs, rival, best)
            if len(curve) > 1:

                def means(f):
                    return [np.mean([f(r) for r in rs.values()]) for rs in curve.values()]

                ax.plot(
                    means(get),
                    means(lambda r: r["valid_ppl"]),
                    "-",
                    lw=1,
                    color=colours[rival],
                    alpha=0.7,
                )
                for rs in curve.values():
                    point(ax, rs.values(), get, colours[rival], ms=4, capsize=2, alpha=0.7)
            chosen = [
                r
                for r in runs.values()
                if (r["rival"], r["lr"], r["knob"]) == (rival, *best) and not r.get("replica")
            ]
            if chosen:
                point(
                    ax,
                    chosen,
                    get,
                    colours[rival],
                    ms=9,
                    capsize=3,
                    label=f"{rival}: lr {best[0]:g}{' ' + best[1] if best[1] else ''} "
                    f"({len(chosen)} seeds)",
                )
        ax.set(xlabel=label, ylabel="valid PPL", ylim=(None, top))
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:  # the selections, once there are any, in one legend below both panels
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        f"{study.title} at the cpu preset. Faint: the sweeps (seed 0; triangles: above the "
        "frame);\n"
        "lines: each rival's knob at its selected lr (mean and range of seeds 0-2); large: the "
        "selections (mean and range over seeds)",
        fontsize=9,
    )
    compare.save(fig, path, (0, 0.1 if handles else 0, 1, 1))


def lr_sensitivity(sweep, selections, vocab_size):
    """Each rival's lr sensitivity at its selected knob (Wortsman et al. 2023, as the centering
    paper's sweeps use it): the mean over the lr grid of min(L_lr, L_0) - min_lr L_lr, L the valid
    loss (log PPL) of seed 0, L_0 = ln V (a uniform prediction: a diverged run costs what no
    training costs). {rival: {sensitivity, valid_ppl: {lr: PPL}}}."""
    out = {}
    for rival, best in selections.items():
        ppl = {f"{lr:g}": sweep[rival].get(sweep_label(lr, best[1])) for lr in LRS} if best else {}
        if ppl and None not in ppl.values():
            loss = np.minimum(
                np.log(np.nan_to_num(list(ppl.values()), nan=np.inf)), math.log(vocab_size)
            )
            out[rival] = dict(sensitivity=float(np.mean(loss - loss.min())), valid_ppl=ppl)
    return out


def plot_lr_sensitivity(sensitivity, title, path):
    """Valid PPL against the lr (seed 0) of each rival at its selected knob, its lr sensitivity in
    the legend."""
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, (rival, s) in enumerate(
        sorted(sensitivity.items(), key=lambda kv: kv[1]["sensitivity"])
    ):
        ax.plot(
            LRS,
            list(s["valid_ppl"].values()),
            "o-" if i < 10 else "s--",
            label=f"{rival}: {s['sensitivity']:.3f}",
        )
    ax.set(
        xscale="log",
        xlabel="lr (seed 0)",
        ylabel="valid PPL",
        xticks=LRS,
        xticklabels=[f"{lr:g}" for lr in LRS],
    )
    ax.minorticks_off()
    ax.set_title(
        f"{title}: valid PPL over the lr grid at each selected knob (seed 0)\nlegend: lr "
        "sensitivity, the mean over the grid of the valid loss above its best (nats)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    compare.save(fig, path)


if __name__ == "__main__":
    scale.main(None, Rivals)
