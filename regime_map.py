#!/usr/bin/env python
"""The regime map: where AGG's claims hold at this scale. Trains MLE and AGG-family runs over rare shares and training
lengths (cpu preset), evaluates each on the test split, and plots AGG / MLE ratios of the same seed.

    python regime_map.py --shares 0.05 0.1 0.2 0.4 --steps 1200 --seeds 0 1       # rarity axis -> out/map/
    python regime_map.py --shares 0.2 --steps 600 1200 2400 --seeds 0 1            # training length axis
    python regime_map.py --methods agg-continuous agg-centered --shares 0.2 --steps 1200 --seeds 0 1

Each point is one (method, rare share, steps) cell; it shows the mean over seeds and the seeds' range of
  PPL ratio (AGG / MLE, claim: <= 1.01), rare-group PPL ratio (<= 0.5) and 1 - I(W) ratio (<= 0.5),
and regime_map.json holds every run's numbers; cells from earlier invocations are kept, so the map builds up. Runs
that finished are reused (out/map/runs/NAME/); flags after `--` go to every train_lm.py run.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

from grid import finished

ROOT = os.path.dirname(os.path.abspath(__file__))
CLAIMS = {"ppl": 1.01, "rare": 0.5, "anisotropy": 0.5}  # AGG Table 3's directions, as thresholds


def run_name(method, steps, seed, share=None):
    return f"{method}-n{steps}-s{seed}" if share is None else f"{method}-r{share:g}-n{steps}-s{seed}"


def ensure(folder, flags, extra):
    """Train (or resume) the run, then evaluate it into folder/report/ unless done."""
    if not finished(folder):
        resume = ["--resume"] if os.path.exists(os.path.join(folder, "ckpt.pt")) else []
        cmd = [sys.executable, os.path.join(ROOT, "train_lm.py"), *flags, "--out", folder, *resume, *extra]
        print(" ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"regime_map: `{' '.join(cmd)}` failed; fix it and rerun (finished runs are kept)")
    report = os.path.join(folder, "report")
    if not os.path.exists(os.path.join(report, "metrics.json")):
        cmd = [sys.executable, os.path.join(ROOT, "eval.py"), folder, "--out", report, "--n-samples", "0"]
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"regime_map: `{' '.join(cmd)}` failed")
    with open(os.path.join(report, "metrics.json")) as f:
        return next(iter(json.load(f).values()))


def ratios(agg, mle):
    return dict(ppl=agg["ppl"] / mle["ppl"], rare=agg["ppl_groups"]["rare"] / mle["ppl_groups"]["rare"],
                anisotropy=(1 - agg["isotropy"]) / (1 - mle["isotropy"]), uniq=agg["uniq"] - mle["uniq"],
                cos_rare=agg["mean_cosine_groups"]["rare"] / mle["mean_cosine_groups"]["rare"])


def plot(cells, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    titles = {"ppl": "PPL ratio (claim <= 1.01)", "rare": "rare-group PPL ratio (claim <= 0.5)",
              "anisotropy": "1 - I(W) ratio (claim <= 0.5)"}
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for col, key in enumerate(titles):
        for row, (x_key, line_key, x_label) in enumerate([("share", "steps", "rare share of the vocabulary"),
                                                          ("steps", "share", "training steps")]):
            ax = axes[row][col]
            lines = {}
            for c in cells:
                lines.setdefault((c["method"], c[line_key]), []).append(c)
            for (method, value), cs in sorted(lines.items()):
                cs = sorted(cs, key=lambda c: c[x_key])
                if len(cs) < 2:
                    continue
                x = [c[x_key] for c in cs]
                vals = [[r[key] for r in c["seeds"]] for c in cs]
                mean = [np.mean(v) for v in vals]
                err = [[m - min(v) for m, v in zip(mean, vals)], [max(v) - m for m, v in zip(mean, vals)]]
                label = f"{method}, {value} steps" if line_key == "steps" else f"{method}, share {value:g}"
                ax.errorbar(x, mean, yerr=err, marker="o", capsize=3, label=label)
            ax.axhline(CLAIMS[key], color="k", ls="--", lw=0.8)
            ax.axhline(1.0, color="0.7", lw=0.6)
            ax.set_xlabel(x_label, fontsize=8)
            ax.set_title(titles[key], fontsize=9)
            ax.set_xticks(sorted({c[x_key] for c in cells}))
            ax.legend(fontsize=6)
    fig.suptitle("AGG vs MLE on the cpu preset: ratios of the same seed (mean and range over seeds); dashed: the "
                 "claim's threshold", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["agg"])
    p.add_argument("--shares", nargs="+", type=float, default=[0.05, 0.1, 0.2, 0.4])
    p.add_argument("--steps", nargs="+", type=int, default=[1200])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--out", default=os.path.join(ROOT, "out", "map"))
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    runs = os.path.join(args.out, "runs")
    cells = []
    for steps in args.steps:
        eval_every = ["--eval-interval", str(max(50, steps // 12))]
        mle = {s: ensure(os.path.join(runs, run_name("mle", steps, s)),
                         ["--method", "mle", "--seed", str(s), "--max-steps", str(steps), *eval_every], extra)
               for s in args.seeds}
        for method in args.methods:
            for share in args.shares:
                seeds = []
                for s in args.seeds:
                    m = ensure(os.path.join(runs, run_name(method, steps, s, share)),
                               ["--method", method, "--seed", str(s), "--max-steps", str(steps), "--rare-share",
                                str(share), *eval_every], extra)
                    seeds.append(dict(seed=s, **ratios(m, mle[s])))
                holds = [all(r[k] <= t for k, t in CLAIMS.items()) and r["uniq"] > 0 and r["cos_rare"] <= 0.5
                         for r in seeds]
                cells.append(dict(method=method, share=share, steps=steps, seeds=seeds, all_claims_hold=holds))
                print(f"{method} share {share:g} {steps} steps: " + "; ".join(
                    f"seed {r['seed']}: PPL x{r['ppl']:.3f} rare x{r['rare']:.2f} 1-I x{r['anisotropy']:.2f}"
                    for r in seeds), flush=True)
    path = os.path.join(args.out, "regime_map.json")  # cells of earlier invocations are kept: maps build up
    key = lambda c: (c["method"], c["share"], c["steps"])
    if os.path.exists(path):
        with open(path) as f:
            done = {key(c) for c in cells}
            cells = [c for c in json.load(f) if key(c) not in done] + cells
    cells.sort(key=key)
    with open(path, "w") as f:
        json.dump(cells, f, indent=1)
    plot(cells, os.path.join(args.out, "regime_map.png"))
    print(f"wrote {args.out}/regime_map.png and regime_map.json")


if __name__ == "__main__":
    main()
