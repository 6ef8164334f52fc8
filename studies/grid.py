#!/usr/bin/env python
"""The methods table: train every method x seed with train_lm.py, evaluate them all with eval.py, write the tables.

    python grid.py                                   # cpu preset, every method, seeds 0 1 2 -> out/grid/
    python grid.py --methods mle agg --seeds 0       # a part of the grid
    python grid.py --jobs 2                          # two runs at once, one thread each (faster on a CPU)
    python grid.py --no-train                        # the tables of the runs finished so far (a grid in progress)
    python grid.py --methods mle agg --lrs 5e-4 1e-3 2e-3 --seeds 0 1 --out out/sweep   # a learning-rate sweep
    python grid.py --methods cosreg --sweep gamma 0.3 1 3 --seeds 0 --out out/peers-gamma  # a method's knob
    python grid.py --out out/grid-6l -- --dataset wikitext-103 --preset paper-6l    # the same grid on a GPU

Flags after `--` go to every train_lm.py run. A finished run (its ckpt.pt at the last step) is skipped and a stopped
one is resumed, so the grid can be stopped and restarted at any time. Runs go one at a time (`--jobs N`: N at once),
each in its own process.
Writes OUT/runs/METHOD-sSEED/ (run folders), OUT/report/ (eval.py: metrics.json, summary.json, report.md, plots)
and OUT/tables.md: the analogues of AGG Tables 1-2, 3, 4, 7-8, 9, 10 and the peers of Table 6, mean +- std over seeds.
With --lrs / --warmups / --sweep the runs are METHOD-lrLR[-wuN][-FLAG=V]-sSEED and OUT/sweep.json lists every run's
valid and test PPL and each method's setting with the lowest mean valid PPL (the selection never looks at test).
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time


import agg
import runlib

ROOT = os.path.dirname(os.path.abspath(__file__))
METHODS = ["mle", "agg", "agg-no-g1", "agg-no-g2", "agg-static", "ul", "ul+agg", "agps", "freeze-rare", "freeze-b",
           "freeze-c", "freeze-bc", "cosreg", "frage"]
# (title, methods, columns): columns are summary.json keys, dotted for groups
TABLES = [
    ("AGG Table 3: MLE vs AGG", ["mle", "agg"],
     ["ppl_groups.freq", "ppl_groups.med", "ppl_groups.rare", "ppl", "uniq_groups.rare", "uniq", "isotropy"]),
    ("AGG Table 4: UL vs UL + AGG", ["ul", "ul+agg"],
     ["ppl_groups.freq", "ppl_groups.med", "ppl_groups.rare", "ppl", "uniq_groups.rare", "uniq", "isotropy",
      "gen_rep4"]),
    ("AGG Tables 7-8: I(W) per frequency group", ["mle", "agg", "ul", "ul+agg"],
     ["isotropy_groups.freq", "isotropy_groups.med", "isotropy_groups.rare", "isotropy"]),
    ("AGG Table 9: ablation of the gates", ["mle", "agg", "agg-no-g1", "agg-no-g2"],
     ["ppl_groups.rare", "ppl", "uniq", "isotropy"]),
    ("AGG Table 10: static vs dynamic grouping", ["mle", "agg", "agg-static"],
     ["ppl_groups.rare", "ppl", "uniq", "isotropy"]),
    ("AGG Tables 1-2: freezing the rare embeddings or parts of their gradient",
     ["mle", "freeze-rare", "freeze-bc", "freeze-b", "freeze-c"],
     ["ppl_groups.freq", "ppl_groups.med", "ppl_groups.rare", "ppl", "isotropy_groups.freq", "isotropy_groups.med",
      "isotropy_groups.rare", "isotropy"]),
    ("Other methods against the degeneration (AGG Table 6's Adv-MLE and spectrum control are not implemented)",
     ["mle", "agg", "agps", "cosreg", "frage", "ul", "ul+agg"],
     ["ppl_groups.rare", "ppl", "uniq", "isotropy", "mean_cosine"]),
]

HEADERS = {"ppl": "PPL", "uniq": "Uniq", "isotropy": "I(W)", "mean_cosine": "mean cos", "gen_rep4": "seq-rep-4",
           **{f"{k}_groups.{g}": f"{h} {g}" for k, h in (("ppl", "PPL"), ("uniq", "Uniq"), ("isotropy", "I(W)"))
              for g in ("freq", "med", "rare")}}


def run_dir(out, method, seed, lr=None, warmup=None, knob=None):
    """OUT/runs/METHOD[-lrLR][-wuN][-FLAG=V]-sSEED; knob = (flag, value) of a --sweep."""
    setting = (f"-lr{lr:g}" if lr is not None else "") + (f"-wu{warmup}" if warmup is not None else "") \
        + (f"-{knob[0]}={knob[1]:g}" if knob is not None else "")  # :g names 1 and 1.0 alike
    return os.path.join(out, "runs", f"{method}{setting}-s{seed}")


def settings(args):
    """(lr, warmup, knob) triples of the grid: None = the preset's; knob = (flag, value) of --sweep."""
    knobs = [(args.sweep[0], v) for v in args.sweep[1]] if args.sweep else [None]
    return [(lr, wu, k) for lr in (args.lrs or [None]) for wu in (args.warmups or [None]) for k in knobs]


def sweep_flag(flag, methods):
    """(flag, config key, type) of the numeric flag given to --sweep: a method hyper-parameter (e.g. 'lambda' ->
    'lambda_'; every method of the grid must take it) or another numeric train_lm.py flag (e.g. rare-share,
    embedding-weight-decay); a one-line error otherwise."""
    import train_lm
    keys = {runlib.method_flag(k)[2:]: k for k in agg.HPARAMS}
    flag = flag.lstrip("-")
    if flag in keys:
        key, typ = keys[flag], agg.HPARAMS[keys[flag]][0]
        without = [m for m in methods if key not in agg.METHODS[m].defaults]
        if without:
            raise SystemExit(f"grid: --sweep {flag}: {', '.join(without)} do not take --{flag}; give --methods that do")
        return flag, key, typ
    action = next((a for a in train_lm.build_parser()._actions if f"--{flag}" in a.option_strings), None)
    if action is None or action.type not in (int, float):
        raise SystemExit(f"grid: --sweep {flag}: not a numeric train_lm.py flag; give a method hyper-parameter "
                         f"({', '.join(keys)}) or a flag such as rare-share, embedding-weight-decay, weight-decay")
    return flag, action.dest, action.type


def wait_for_slot(running, jobs):
    """Wait until fewer than `jobs` runs are running; return the commands of those that failed."""
    failed = []
    while len(running) >= jobs:
        for proc, cmd in list(running):
            if proc.poll() is not None:
                running.remove((proc, cmd))
                failed += [cmd] if proc.returncode else []
        if len(running) >= jobs:
            time.sleep(1)
    return failed


def same_flags(folder, cmd):
    """None when the run in `folder` was started with the training settings of `cmd` (flags that only steer an
    invocation, such as --stop-at or --device, aside), else what differs: a grid never tabulates or continues a run
    made with other flags."""
    import train_lm
    saved, ckpt = runlib.run_config(folder), os.path.join(folder, "ckpt.pt")
    if saved:
        was = (saved.get("segments") or [saved])[0].get("argv")
    else:  # no config.json, or a damaged one: the checkpoint's copy of the provenance
        prov = runlib.load_checkpoint(ckpt).get("provenance") if os.path.exists(ckpt) else None
        was = prov[0].get("argv") if prov else None
    if not was:
        return None
    parse = lambda argv: vars(train_lm.build_parser().parse_args(argv))
    steer = train_lm.RUN_CONTROL
    a, b = parse(was), parse(cmd[2:])
    diff = sorted(k for k in a if k not in steer and a[k] != b[k])
    return None if not diff else "trained with " + ", ".join(f"{k}={a[k]!r} (now {b[k]!r})" for k in diff)


def stop_children(running):
    """SIGTERM to every running train_lm.py (each writes a checkpoint at its next step and exits), then wait."""
    for proc, _ in running:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in running:
        proc.wait()


def train_all(args, extra):
    """Train the unfinished runs, `args.jobs` at a time. With several jobs each run gets cpu_count // jobs threads
    and writes its output to OUT/runs/METHOD-sSEED.log instead of the terminal. SIGTERM or SIGINT to the grid
    stops its runs cleanly (each checkpoints) before the grid exits; rerun it to continue."""
    todo = [(m, s, *st) for s in args.seeds for st in settings(args) for m in args.methods]  # seed-major
    env = dict(os.environ)
    if args.jobs > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
    running, failed = [], []

    def stop(signum, frame):
        stop_children(running)
        raise SystemExit(f"grid: {signal.Signals(signum).name}: its runs wrote checkpoints and stopped; rerun the "
                         f"same command to continue")
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed = _train_todo(args, extra, todo, env, running)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if failed:
        raise SystemExit(f"grid: `{' '.join(failed[0])}` failed; fix it and rerun grid.py (finished runs are kept)")


def train_command(args, extra, method, seed, lr=None, wu=None, knob=None):
    """(folder, the train_lm.py command) of one run of the grid; --resume when it has a checkpoint."""
    folder = run_dir(args.out, method, seed, lr, wu, knob)
    resume = os.path.exists(os.path.join(folder, "ckpt.pt"))
    return folder, [sys.executable, os.path.join(ROOT, "train_lm.py"), "--method", method, "--seed", str(seed),
                    "--out", folder, *(["--resume"] if resume else []), *extra,
                    *(["--lr", f"{lr:g}"] if lr is not None else []),
                    *(["--warmup", str(wu)] if wu is not None else []),
                    *([f"--{knob[0]}", f"{knob[1]:g}"] if knob is not None else [])]


def check_flags(folder, cmd):
    """Refuse a run of the grid's folder that was made with other training flags than the grid's (same_flags)."""
    differs = same_flags(folder, cmd)
    if differs:
        raise SystemExit(f"grid: {folder} was {differs}: give another --out for other flags, or delete the run "
                         f"to redo it")


def _train_todo(args, extra, todo, env, running):
    failed = []
    for i, (method, seed, lr, wu, knob) in enumerate(todo):
        folder, cmd = train_command(args, extra, method, seed, lr, wu, knob)
        check_flags(folder, cmd)
        resume = os.path.exists(os.path.join(folder, "ckpt.pt"))
        if runlib.finished(folder):
            print(f"[{i + 1}/{len(todo)}] {os.path.basename(folder)}: done, skipped")
            continue
        log = None
        if args.jobs > 1:
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            log = open(folder + ".log", "a")
        print(f"[{i + 1}/{len(todo)}] {os.path.basename(folder)}: {'resuming' if resume else 'training'}"
              + (f" (output: {folder}.log)" if log else ""), flush=True)
        running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None), cmd))
        if log:
            log.close()  # the run holds its own handle
        failed += wait_for_slot(running, args.jobs)
        if failed:
            break
    return failed + wait_for_slot(running, 1)


def cell(summary, method, key):
    node = summary.get(method)
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if not node:
        return "-"
    nd = 3 if any(w in key for w in ("isotropy", "cosine", "rep4")) else (0 if key.startswith("uniq") else 1)
    return f"{node['mean']:.{nd}f}" + (f" ± {node['std']:.{nd}f}" if summary[method]["n"] > 1 else "")


def write_tables(summary, path, command):
    lines = ["# Methods table", "", f"`{command}`", "",
             "Each cell: mean ± std over seeds (n = runs per method; one run: its value). Test split, frequency groups 30/50/20% of the "
             "vocabulary by train counts; Uniq = distinct next-token argmax predictions.", ""]
    for title, methods, cols in TABLES:
        methods = [m for m in methods if m in summary]
        if not methods:
            continue
        lines += [f"## {title}", "", "| method | n | " + " | ".join(HEADERS.get(c, c) for c in cols) + " |", "|" + " --- |" * (2 + len(cols))]
        lines += [f"| {m} | {summary[m]['n']} | " + " | ".join(cell(summary, m, c) for c in cols) + " |"
                  for m in methods]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def sweep_table(metrics, command, key=None):
    """{"command", "runs": [{method, lr, warmup, [key,] seed, valid_ppl, test_ppl, ...}], "settings": [mean valid/test
    PPL per method, lr, warm-up (and the swept hyper-parameter `key`)], "selected": {method: the setting with the
    lowest mean valid PPL}}."""
    runs = []
    for m in metrics.values():
        with open(os.path.join(m["out_dir"], "config.json")) as f:
            cfg = json.load(f)
        runs.append(dict(method=m["method"], lr=cfg["lr"], warmup=cfg["warmup"], **({key: cfg[key]} if key else {}),
                         seed=m["seed"], step=m["step"],
                         valid_ppl=m["valid_ppl"], test_ppl=m["ppl"], test_ppl_rare=m["ppl_groups"]["rare"],
                         isotropy=m["isotropy"], run=os.path.relpath(m["out_dir"], ROOT),
                         command=runlib.run_command(cfg, "train_lm.py"),
                         threads=cfg.get("versions", {}).get("threads"), git_commit=cfg.get("git_commit")))
    by = {}
    for r in runs:
        by.setdefault((r["method"], r["lr"], r["warmup"], r.get(key)), []).append(r)
    table = [dict(method=k[0], lr=k[1], warmup=k[2], **({key: k[3]} if key else {}), n=len(rs),
                  valid_ppl_mean=sum(r["valid_ppl"] for r in rs) / len(rs),
                  test_ppl_mean=sum(r["test_ppl"] for r in rs) / len(rs)) for k, rs in sorted(by.items())]
    selected = {}
    for s in table:
        if s["method"] not in selected or s["valid_ppl_mean"] < selected[s["method"]]["valid_ppl_mean"]:
            selected[s["method"]] = s
    return dict(command=command, selection="lowest mean valid PPL over seeds (last checkpoint)", runs=runs,
                settings=table, selected=selected)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=list(agg.METHODS), metavar="METHOD")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", default=os.path.join(ROOT, "out", "grid"))
    p.add_argument("--eval-args", default="", help="extra eval.py flags, e.g. '--checkpoint best --n-samples 0'")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once (default 1); on a CPU, 2 one-thread runs train faster than 1 two-thread run")
    p.add_argument("--lrs", nargs="+", type=float, default=None, metavar="LR",
                   help="a learning-rate sweep: every method x seed at each of these (default: the preset's lr)")
    p.add_argument("--warmups", nargs="+", type=int, default=None, metavar="N",
                   help="a warm-up sweep: every method x seed at each of these warm-up lengths (default: the preset's)")
    p.add_argument("--sweep", nargs="+", default=None, metavar=("FLAG", "V"),
                   help="a sweep of one method hyper-parameter: every method x seed at each value, e.g. "
                        "--sweep gamma 0.3 1 3 (the methods must all take it)")
    p.add_argument("--no-train", action="store_true",
                   help="train nothing: evaluate the grid's finished runs only (n per method says how many)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give 1 or more runs at once")
    key = None
    if args.sweep:
        flag, key, typ = sweep_flag(args.sweep[0], args.methods)
        try:
            assert typ in (int, float)
            args.sweep = (flag, [typ(v) for v in args.sweep[1:]])
        except (AssertionError, ValueError):
            p.error(f"--sweep {' '.join(args.sweep)}: give a numeric hyper-parameter and its values ({typ.__name__}), "
                    f"e.g. --sweep gamma 0.3 1 3")
        if not args.sweep[1]:
            p.error(f"--sweep {flag}: give the values too, e.g. --sweep {flag} 0.3 1 3")
    folders = [run_dir(args.out, m, s, *st) for m in args.methods for st in settings(args) for s in args.seeds]
    if args.no_train:
        missing = [os.path.basename(f) for f in folders if not runlib.finished(f)]
        folders = [f for f in folders if runlib.finished(f)]
        # the tables never take in a run made with other training flags than the grid's (as training would not)
        for folder, cmd in (train_command(args, extra, m, s, *st) for m in args.methods for st in settings(args)
                            for s in args.seeds):
            if folder in folders:
                check_flags(folder, cmd)
        if not folders:
            raise SystemExit(f"grid: no finished run in {args.out}/runs; run grid.py without --no-train first")
        if missing:
            print(f"grid: {len(missing)} runs not finished, left out: {' '.join(missing)}")
    else:
        train_all(args, extra)
    report = os.path.join(args.out, "report")
    cmd = [sys.executable, os.path.join(ROOT, "eval.py"), *folders, "--out", report, *args.eval_args.split()]
    if subprocess.run(cmd).returncode:
        raise SystemExit(f"grid: `{' '.join(cmd)}` failed")
    with open(os.path.join(report, "summary.json")) as f:
        summary = json.load(f)
    command = shlex.join(["python", "grid.py", *argv])
    write_tables(summary, os.path.join(args.out, "tables.md"), command)
    if args.lrs or args.warmups or args.sweep:
        with open(os.path.join(report, "metrics.json")) as f:
            sweep = sweep_table(json.load(f), command, key)
        runlib.write_json(os.path.join(args.out, "sweep.json"), sweep)
        for method, s in sweep["selected"].items():
            knob = f", --{args.sweep[0]} {s[key]:g}" if key else ""
            print(f"{method}: selected lr {s['lr']:g}, warm-up {s['warmup']}{knob} (mean valid PPL "
                  f"{s['valid_ppl_mean']:.2f} over {s['n']} seeds)")
    print(f"wrote {args.out}/tables.md and {report}/")


if __name__ == "__main__":
    main()
