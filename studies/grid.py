"""The methods table: train every method x seed with train_lm.py, evaluate them with
studies.compare, write the tables. From the repository root:

    # cpu preset, every method, seeds 0 1 2 -> out/grid/
    python -m studies.grid
    # a part of the grid, two one-thread runs at once
    python -m studies.grid --methods mle agg --seeds 0 --jobs 2
    # the tables of the runs finished so far
    python -m studies.grid --no-train
    # a learning-rate sweep
    python -m studies.grid --methods mle agg --lrs 5e-4 1e-3 2e-3 --seeds 0 1 --out out/sweep
    # a method's knob
    python -m studies.grid --methods cosreg --sweep gamma 0.3 1 3 --seeds 0 --out out/peers-gamma
    # the same grid on a GPU
    python -m studies.grid --out out/grid-6l -- --dataset wikitext-103 --preset paper-6l

Flags after `--` go to every train_lm.py run. A finished run is skipped, a stopped one resumed, one
made with other training flags refused. Writes OUT/runs/METHOD[-lrLR][-wuN][-FLAG=V]-sSEED/,
OUT/report/ (studies.compare) and OUT/tables.md: AGG Tables 1-2, 3, 4, 7-8, 9, 10 and Table 6's
peers, mean +- std over seeds. A sweep (--lrs, --warmups, --sweep) also writes OUT/sweep.json: each
run's valid and test PPL, each method's lowest mean valid PPL.
"""

import argparse
import itertools
import os
import shlex
import sys

import agg
import runlib
import train_lm
from studies import compare, pool

ROOT = runlib.ROOT
METHODS = [
    "mle",
    "agg",
    "agg-no-g1",
    "agg-no-g2",
    "agg-static",
    "ul",
    "ul+agg",
    "agps",
    "freeze-rare",
    "freeze-b",
    "freeze-c",
    "freeze-bc",
    "cosreg",
    "frage",
]
PPL3, ISO3 = ([f"{k}_groups.{g}" for g in ("freq", "med", "rare")] for k in ("ppl", "isotropy"))
RARE = ["ppl_groups.rare", "ppl", "uniq", "isotropy"]
# (title, methods, columns): the columns are keys of compare.COLUMNS
TABLES = [
    (
        "AGG Table 3: MLE vs AGG",
        ["mle", "agg"],
        PPL3 + ["ppl", "uniq_groups.rare", "uniq", "isotropy"],
    ),
    (
        "AGG Table 4: UL vs UL+AGG",
        ["ul", "ul+agg"],
        PPL3 + ["ppl", "uniq_groups.rare", "uniq", "isotropy", "gen_rep4"],
    ),
    (
        "AGG Tables 7-8: I(W) per frequency group",
        ["mle", "agg", "ul", "ul+agg"],
        ISO3 + ["isotropy"],
    ),
    ("AGG Table 9: ablation of the gates", ["mle", "agg", "agg-no-g1", "agg-no-g2"], RARE),
    ("AGG Table 10: static vs dynamic grouping", ["mle", "agg", "agg-static"], RARE),
    (
        "AGG Tables 1-2: freezing the rare embeddings or parts of their gradient",
        ["mle", "freeze-rare", "freeze-bc", "freeze-b", "freeze-c"],
        PPL3 + ["ppl"] + ISO3 + ["isotropy"],
    ),
    (
        "Other methods against the degeneration (AGG Table 6's Adv-MLE and spectrum control are "
        "not implemented)",
        ["mle", "agg", "agps", "cosreg", "frage", "ul", "ul+agg"],
        RARE + ["mean_cosine"],
    ),
]


def settings(args):
    """[(folder name part, train_lm.py flags)] of each setting: --lrs x --warmups x --sweep (none:
    the preset's)."""
    flag, values = args.sweep or (None, [])
    axes = [
        [(f"-lr{v:g}", ["--lr", f"{v:g}"]) for v in args.lrs or []],  # :g names 1 and 1.0 alike
        [(f"-wu{v}", ["--warmup", str(v)]) for v in args.warmups or []],
        [(f"-{flag}={v:g}", [f"--{flag}", f"{v:g}"]) for v in values],
    ]
    return [
        ("".join(n for n, _ in s), [f for _, fs in s for f in fs])
        for s in itertools.product(*(axis or [("", [])] for axis in axes))
    ]


def parse_sweep(words, methods):
    """--sweep FLAG V...: (flag, config key, values) of a numeric train_lm.py flag: a method
    hyper-parameter (e.g. 'lambda' -> 'lambda_'; every method of the grid must take it) or another
    (rare-share, embedding-weight-decay)."""
    flag = words[0].lstrip("-")
    if flag in ("seed", "lr", "warmup"):  # the grid's own axes
        raise SystemExit(f"grid: --sweep {flag}: give the values with --{flag}s instead")
    action = next(
        (a for a in train_lm.build_parser()._actions if f"--{flag}" in a.option_strings), None
    )
    if action is None or action.type not in (int, float):
        knobs = ", ".join(
            agg.method_flag(k)[2:] for k, (typ, _) in agg.HPARAMS.items() if typ in (int, float)
        )
        raise SystemExit(
            f"grid: --sweep {flag}: not a numeric train_lm.py flag; give a method hyper-parameter "
            f"({knobs}) or a flag such as rare-share, embedding-weight-decay, weight-decay"
        )
    if without := [
        m
        for m in methods
        if action.dest in agg.HPARAMS and action.dest not in agg.METHODS[m].defaults
    ]:
        raise SystemExit(
            f"grid: --sweep {flag}: {', '.join(without)} do not take --{flag}; give --methods that "
            "do"
        )
    try:
        # no value: "" fails as a bad one
        return flag, action.dest, [action.type(v) for v in words[1:] or [""]]
    except ValueError:
        raise SystemExit(
            f"grid: --sweep {' '.join(words)}: give a numeric hyper-parameter and its values "
            f"({action.type.__name__}), e.g. --sweep gamma 0.3 1 3"
        ) from None


def train_command(args, extra, method, seed, setting):
    """(folder, the train_lm.py command) of one run of the grid; --resume when it has a
    checkpoint."""
    folder = os.path.join(args.out, "runs", f"{method}{setting[0]}-s{seed}")
    return folder, [
        sys.executable,
        os.path.join(ROOT, "train_lm.py"),
        "--method",
        method,
        "--seed",
        str(seed),
        "--out",
        folder,
        *(["--resume"] if os.path.exists(os.path.join(folder, "ckpt.pt")) else []),
        *extra,
        *setting[1],
    ]


def sweep_table(metrics, command, key=None):
    """{"command", "runs": [{method, lr, warmup, [key,] seed, valid_ppl, test_ppl, ...}],
    "settings": [mean valid and test PPL per method, lr, warm-up (, key)], "selected": {method: the
    setting with the lowest mean valid PPL}}."""
    runs, by = [], {}
    for m in metrics.values():
        cfg = runlib.run_config(m["out_dir"])
        setting = dict(method=m["method"], lr=cfg["lr"], warmup=cfg["warmup"])
        if key:
            setting[key] = cfg[key]
        run = dict(
            setting,
            seed=m["seed"],
            step=m["step"],
            valid_ppl=m["valid_ppl"],
            test_ppl=m["ppl"],
            test_ppl_rare=m["ppl_groups"]["rare"],
            isotropy=m["isotropy"],
            run=os.path.relpath(m["out_dir"], ROOT),
            command=compare.run_command(cfg, "train_lm.py"),
            threads=cfg.get("versions", {}).get("threads"),
            git_commit=cfg.get("git_commit"),
        )
        runs.append(run)
        by.setdefault(tuple(setting.values()), (setting, []))[1].append(run)
    table = []
    for _, (setting, rs) in sorted(by.items()):
        valid_ppl_mean = sum(r["valid_ppl"] for r in rs) / len(rs)
        test_ppl_mean = sum(r["test_ppl"] for r in rs) / len(rs)
        table.append(
            dict(setting, n=len(rs), valid_ppl_mean=valid_ppl_mean, test_ppl_mean=test_ppl_mean)
        )

    def best(method):
        return min((s for s in table if s["method"] == method), key=lambda s: s["valid_ppl_mean"])

    return dict(
        command=command,
        selection="lowest mean valid PPL over seeds (last checkpoint)",
        runs=runs,
        settings=table,
        selected={s["method"]: best(s["method"]) for s in table},
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(
        prog="python -m studies.grid",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--methods", nargs="+", default=METHODS, choices=list(agg.METHODS), metavar="METHOD"
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", default=os.path.join(ROOT, "out", "grid"))
    p.add_argument(
        "--eval-args",
        default="",
        help="studies.compare flags, e.g. '--checkpoint best --n-samples 0'",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained at once (on a CPU 2 one-thread runs are faster)",
    )
    p.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        metavar="LR",
        help="each method x seed at each lr (default: preset)",
    )
    p.add_argument(
        "--warmups",
        nargs="+",
        type=int,
        metavar="N",
        help="... at each warm-up length (default: preset)",
    )
    p.add_argument(
        "--sweep",
        nargs="+",
        metavar=("FLAG", "V"),
        help="... at each value of a numeric train_lm.py flag",
    )
    p.add_argument(
        "--no-train",
        action="store_true",
        help="train nothing: evaluate the grid's finished runs only",
    )
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give 1 or more runs at once")
    flag, key, values = parse_sweep(args.sweep, args.methods) if args.sweep else (None, None, None)
    args.sweep = (flag, values) if args.sweep else None
    runs = {
        (m, s, st[0]): train_command(args, extra, m, s, st)
        for m in args.methods
        for st in settings(args)
        for s in args.seeds
    }
    done = {f: pool.finished(f) for f, _ in runs.values()}
    # --no-train: the finished runs only
    folders = [f for f in done if done[f] or not args.no_train]
    for folder, cmd in runs.values():  # before any run starts
        if folder in folders:
            pool.check_flags(folder, cmd[2:])
    if not folders:
        raise SystemExit(
            f"grid: no finished run in {args.out}/runs; run studies.grid without --no-train first"
        )
    if len(folders) < len(runs):
        print(
            f"grid: {len(runs) - len(folders)} runs not finished, left out: "
            + " ".join(os.path.basename(f) for f in done if not done[f])
        )
    # seed-major, --jobs at a time (studies.pool; with several jobs each run writes NAME.log)
    if not args.no_train:
        todo = [
            runs[m, s, st[0]] for s in args.seeds for st in settings(args) for m in args.methods
        ]
        jobs = []
        for i, (folder, cmd) in enumerate(todo):
            name = f"[{i + 1}/{len(todo)}] {os.path.basename(folder)}"
            if done[folder]:
                print(f"{name}: done, skipped")
            else:
                state = "resuming" if "--resume" in cmd else "training"
                jobs.append((f"{name}: {state}", cmd, folder + ".log" if args.jobs > 1 else None))
        queue = iter(jobs)
        os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
        pool.run(lambda busy: next(queue, None), args.jobs)
    report = os.path.join(args.out, "report")
    # report/summary.json: summarise's
    metrics = compare.main([*folders, "--out", report, *args.eval_args.split()])
    command, summary = (
        shlex.join(["python", "-m", "studies.grid", *argv]),
        compare.summarise(metrics),
    )
    lines = [
        "# Methods table",
        "",
        f"`{command}`",
        "",
        "Each cell: mean ± std over seeds (n = runs per method; one "
        "run: its value). Test split, frequency groups 30/50/20% of the vocabulary by train "
        "counts; Uniq = distinct next-token argmax predictions.",
        "",
    ]
    for title, methods, cols in TABLES:
        # a sweep: "mle lr=.."
        if methods := [v for m in methods for v in summary if v == m or v.startswith(m + " ")]:
            lines += [f"## {title}", ""] + compare.table(
                ["method", "n", *(compare.COLUMNS[c][0] for c in cols)],
                [
                    [m, summary[m]["n"], *(compare.cell(summary[m], c) for c in cols)]
                    for m in methods
                ],
            )
    runlib.write_text(os.path.join(args.out, "tables.md"), "\n".join(lines))
    if args.lrs or args.warmups or args.sweep:
        sweep = sweep_table(metrics, command, key)
        runlib.write_json(os.path.join(args.out, "sweep.json"), sweep)
        for method, s in sweep["selected"].items():
            knob = f", --{args.sweep[0]} {s[key]:g}" if key else ""
            print(
                f"{method}: selected lr {s['lr']:g}, warm-up {s['warmup']}{knob} (mean valid PPL "
                f"{s['valid_ppl_mean']:.2f} over {s['n']} seeds)"
            )
    print(f"wrote {args.out}/tables.md and {report}/")


if __name__ == "__main__":
    main()
