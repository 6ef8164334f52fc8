#!/usr/bin/env python
"""The regime map: where AGG's claims hold at this scale. Trains MLE and AGG-family runs over rare shares, training
lengths and tokens per step (cpu preset otherwise), evaluates each on the valid split (the map chooses settings, so it
never looks at test), and plots AGG / MLE ratios of the same seed.

    python regime_map.py --shares 0.1 0.2 0.4 --steps 2400 --tokens 1024 --seeds 0 1      # rarity -> out/map/
    python regime_map.py --shares 0.2 --steps 600 --tokens 4096 --seeds 0 1               # same tokens, fewer steps
    python regime_map.py --methods agg-continuous agg-centered --shares 0.2 --steps 2400 --tokens 1024 --seeds 0

Each point is one (method, rare share, steps) cell; it shows the mean over seeds and the seeds' range of
  PPL ratio (AGG / MLE, claim: <= 1.01), rare-group PPL ratio (<= 0.5) and 1 - I(W) ratio (<= 0.5),
and regime_map.json holds every run's numbers; cells from earlier invocations are kept, so the map builds up. Runs
that finished are reused (out/map/runs/NAME/); flags after `--` go to every train_lm.py run.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys

import numpy as np

import runlib


ROOT = os.path.dirname(os.path.abspath(__file__))
CLAIMS = {"ppl": 1.01, "rare": 0.5, "anisotropy": 0.5}  # AGG Table 3's directions, as thresholds


def run_name(method, steps, tokens, seed, share=None):
    rarity = "" if share is None else f"-r{share:g}"
    return f"{method}{rarity}-n{steps}-t{tokens}-s{seed}"


def ensure(folder, flags, extra):
    """Train (or resume) the run, then evaluate it into folder/report/ unless done."""
    if not runlib.finished(folder):
        resume = ["--resume"] if os.path.exists(os.path.join(folder, "ckpt.pt")) else []
        cmd = [sys.executable, os.path.join(ROOT, "train_lm.py"), *flags, "--out", folder, *resume, *extra]
        print(" ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"regime_map: `{' '.join(cmd)}` failed; fix it and rerun (finished runs are kept)")
    report = os.path.join(folder, "report-valid")
    if not os.path.exists(os.path.join(report, "metrics.json")):
        cmd = [sys.executable, os.path.join(ROOT, "eval.py"), folder, "--out", report, "--n-samples", "0",
               "--split", "valid"]
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
    # row 1: x = rare share, a line per (method, steps, tokens); row 2: x = optimizer steps, a line per (method,
    # share) at fixed tokens per step (longer training) and at a fixed token budget (same data in more, smaller steps)
    rows = [("share", lambda c: (c["method"], c["steps"], c["tokens"]),
             lambda k: f"{k[0]}, {k[1]} x {k[2]} tokens", "rare share of the vocabulary"),
            ("steps", lambda c: (c["method"], c["share"], "tokens/step", c["tokens"]),
             lambda k: f"{k[0]}, share {k[1]:g}, {k[3]} tokens/step", "optimizer steps"),
            ("steps", lambda c: (c["method"], c["share"], "budget", c["steps"] * c["tokens"]),
             lambda k: f"{k[0]}, share {k[1]:g}, {k[3] / 1e6:.2f}M tokens", "optimizer steps")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    for col, key in enumerate(titles):
        for r, (x_key, line_of, label_of, x_label) in enumerate(rows):
            ax = axes[min(r, 1)][col]
            lines = {}
            for c in cells:
                lines.setdefault(line_of(c), []).append(c)
            for k, cs in sorted(lines.items(), key=str):
                cs = sorted(cs, key=lambda c: c[x_key])
                if len(cs) < 2:
                    continue
                x = [c[x_key] for c in cs]
                vals = [[s[key] for s in c["seeds"]] for c in cs]
                mean = [np.mean(v) for v in vals]
                err = [[m - min(v) for m, v in zip(mean, vals)], [max(v) - m for m, v in zip(mean, vals)]]
                ax.errorbar(x, mean, yerr=err, marker="o" if r < 2 else "s", ls="-" if r < 2 else ":", capsize=3,
                            label=label_of(k))
            ax.axhline(CLAIMS[key], color="k", ls="--", lw=0.8)
            ax.axhline(1.0, color="0.7", lw=0.6)
            ax.set_xlabel(x_label, fontsize=8)
            ax.set_title(titles[key], fontsize=9)
            ax.set_xticks(sorted({c[x_key] for c in cells}))
            if ax.get_legend_handles_labels()[0]:
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
    p.add_argument("--steps", nargs="+", type=int, default=[2400])
    p.add_argument("--tokens", nargs="+", type=int, default=[1024], help="tokens per optimizer step")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--out", default=os.path.join(ROOT, "out", "map"))
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    runs = os.path.join(args.out, "runs")
    cells = []
    for steps, tokens in itertools.product(args.steps, args.tokens):
        run = ["--max-steps", str(steps), "--tokens-per-step", str(tokens), "--eval-interval",
               str(max(50, steps // 12))]
        mle = {s: ensure(os.path.join(runs, run_name("mle", steps, tokens, s)),
                         ["--method", "mle", "--seed", str(s), *run], extra) for s in args.seeds}
        for method in args.methods:
            for share in args.shares:
                seeds = []
                for s in args.seeds:
                    m = ensure(os.path.join(runs, run_name(method, steps, tokens, s, share)),
                               ["--method", method, "--seed", str(s), "--rare-share", str(share), *run], extra)
                    seeds.append(dict(seed=s, **ratios(m, mle[s])))
                holds = [all(r[k] <= t for k, t in CLAIMS.items()) and r["uniq"] > 0 and r["cos_rare"] <= 0.5
                         for r in seeds]
                cells.append(dict(method=method, share=share, steps=steps, tokens=tokens, seeds=seeds,
                                  all_claims_hold=holds))
                print(f"{method} share {share:g} {steps} x {tokens} tokens: " + "; ".join(
                    f"seed {r['seed']}: PPL x{r['ppl']:.3f} rare x{r['rare']:.2f} 1-I x{r['anisotropy']:.2f}"
                    for r in seeds), flush=True)
    path = os.path.join(args.out, "regime_map.json")  # cells of earlier invocations are kept: maps build up
    key = lambda c: (c["method"], c["share"], c["steps"], c["tokens"])
    if os.path.exists(path):
        with open(path) as f:
            done = {key(c) for c in cells}
            cells = [c for c in json.load(f) if key(c) not in done] + cells
    cells.sort(key=key)
    runlib.write_json(path, cells)
    plot(cells, os.path.join(args.out, "regime_map.png"))
    print(f"wrote {args.out}/regime_map.png and regime_map.json")


if __name__ == "__main__":
    main()
