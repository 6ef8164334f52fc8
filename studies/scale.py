"""Where AGG's conclusions hold as the model and the data grow: MLE and AGG over model sizes x
training-data sizes.

    # train and evaluate what is runnable, small first
    python -m studies.scale --jobs 2
    # the study so far: JSON, figure, fits
    python -m studies.scale --no-train --results results/lm_scale.json

The protocol (this project's choices; RESULTS.md states them with the numbers):
- model sizes S, M, L (SIZES): depth and width grow together; the tied head's rank is d_model. M is
  the cpu preset.
- data sizes: --train-fraction 0.25 / 0.5 / 1 of the offline corpus's train articles (nested
  prefixes, the same valid and test articles and the same tokenizer at every size).
- steps: 2400 x fraction, the cpu preset's 3.5 epochs at every data size (each cell sees its data
  equally often); warm-up 10% of the steps, 12 validations.
- learning rate: per size and method, LRS on the full data, the lowest mean valid PPL at the last
  step over seeds 0-2; a best value at the edge of the list extends it by a factor 2 (up to twice),
  so the selection is bracketed.
- AGG's rare share: SHARES at M on the full data, lr 4e-3, the lowest mean valid PPL over seeds 0-2
  (bracketed as the lr); used at every size.
- seeds 0 1 2 per (size, data, method) at the selected lr, paired by seed; the sweep's runs at the
  selection are the full-data cell's. AGG runs twice in every cell: at the selected share and at the
  headline's 0.2 (the share the conclusions under test were measured at), both at the lr selected
  for the selected share.
- a second corpus: the pairs at M with M's selections on the English Bible (--dataset bible-en, 2400
  steps), seeds 0 1 2, so that no conclusion rests on one set of articles.
- a pair never spans two hosts (config.json's `versions.kernels`; a run made before it was recorded
  takes its commit's host, HOSTS): both runs of a pair that ran on two hosts are trained again on
  one (NAME-kHOST), the originals kept for the selections.

Every run is a train_lm.py run folder under OUT/runs (resumable: stop this script at any time and
rerun it), evaluated by eval.py into RUN/report/ once finished. Selections read validation only;
test is read by eval.py for the table.
"""

import argparse
import itertools
import json
import math
import os
import re
import shlex
import sys

import matplotlib.pyplot as plt
import numpy as np
from scipy import stats

import eval as ev
import runlib
from studies import compare, pool

ROOT = runlib.ROOT
SIZES = {
    "S": dict(n_layer=2, d_model=64, n_head=2, d_ff=256),
    "M": dict(n_layer=4, d_model=128, n_head=4, d_ff=512),
    "L": dict(n_layer=6, d_model=192, n_head=6, d_ff=768),
}
# time of a run relative to M at the same data size (to run small cells first)
COST = {"S": 0.5, "M": 1.0, "L": 2.4}
LRS = {"S": [4e-3, 8e-3, 1.6e-2], "M": [2e-3, 4e-3, 8e-3], "L": [1e-3, 2e-3, 4e-3]}
FRACTIONS = [0.25, 0.5, 1.0]
SHARES = [0.1, 0.2, 0.4]
SHARE_SETTING = dict(size="M", lr=4e-3)
# selections on the mean valid PPL of these seeds: one seed would select a mode
SEEDS = SELECTION_SEEDS = [0, 1, 2]
METHODS = ["mle", "agg"]
# the share of the conclusions under test (README's headline): AGG runs with it in every cell
HEADLINE_SHARE = 0.2
SECOND_CORPUS = dict(name="bible", size="M", flags=["--dataset", "bible-en"], cost=1.3)
FULL_STEPS = 2400
# The host of a run recorded before config.json carried `versions.kernels`, by its first segment's
# commit (one machine per commit): a kernel-recording run of the same command it matches to the
# digit, else its own (RESULTS.md, "Hosts").
HOSTS = {
    **dict.fromkeys(
        ["22848175", "12f4d436", "46b49903", "239a9ec6", "0fb0103d", "d1235e38"], "94e9eedb52747eaa"
    ),
    **dict.fromkeys(["8d6c18a1", "93b8f84e"], "unrecorded: results/lm_ablations.json's host"),
}
# NAME-kHOST: NAME trained again on HOST, so that its pair shares a host
REPLICA = re.compile(r"-k[0-9a-f]{8}$")


def host(record):
    """A run record's host: its kernels, else its commit's (HOSTS), else None."""
    return record.get("kernels") or HOSTS.get((record.get("git_commit") or "")[:8])


def run_spec(size, fraction, method, lr, seed, share=None):  # (name, train_lm.py flags) of a run
    steps = round(FULL_STEPS * fraction)
    flags = (
        f"--method {method} --seed {seed} --lr {lr:g} --train-fraction {fraction:g} "
        f"--max-steps {steps} --warmup {steps // 10} --eval-interval {steps // 12}"
    ).split()
    for key, value in SIZES[size].items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    name = (
        f"{size}-f{fraction:g}-{method}"
        + (f"-r{share:g}" if share is not None else "")
        + f"-lr{lr:g}-s{seed}"
    )
    return name, flags + (["--rare-share", f"{share:g}"] if share is not None else [])


class Study:
    """The runs of the study as far as the finished ones decide them; prior: its results files
    (their runs count)."""

    eval_args = ["--n-samples", "0"]  # eval.py flags of every run's evaluation
    # each run's report folders and their own eval.py flags
    reports = {"report": []}
    # the default --out, as the results' commands say; the study's module
    label, name = "out/scale", "scale"
    # this machine's kernels (runlib.kernel_fingerprint at the runs' thread count), set by main
    host = None
    overwrite = False  # --overwrite: a results file may lose runs

    def __init__(self, out, prior=()):
        self.runs, self.done, self.prior, self.checked, self.failed = (
            os.path.join(out, "runs"),
            set(),
            {},
            set(),
            {},
        )
        for path in [p for p in prior if p]:
            saved = compare.results_target(path, (self.name,))
            self.prior.update(saved.get("runs", {}))
            self.failed.update(saved.get("diverged", {}))

    def folder(self, name):
        return os.path.join(self.runs, name)

    # the runs of the results files and the run folders here (os.walk's first dirnames, or none)
    def made(self):
        return set(self.prior) | set(next(os.walk(self.runs), ((), [], ()))[1])

    def write(self, path, argv, result):
        result = dict(
            command=shlex.join(["python", "-m", f"studies.{self.name}", *portable(argv)]),
            protocol=sys.modules[type(self).__module__].__doc__.split("The protocol")[1].strip(),
            **result,
        )
        compare.write_evidence(path, result, (self.name,), self.overwrite)
        return result

    def records(self, names, record):
        """The records of the finished, evaluated runs of names (record(n), else the prior file's)
        and the diverged."""
        self.checked_plan()
        runs = {
            n: record(n)
            if os.path.exists(os.path.join(self.folder(n), "report"))
            else self.prior[n]
            for n in names
            if self.finished(n) and self.evaluated(n) and not self.diverged(n)
        }
        return runs, {n: self.failed[n] for n in names if self.diverged(n)}

    # a run folder made with other flags than its name stands for is refused
    def check(self, name, flags):
        if name not in self.checked and os.path.isdir(self.folder(name)):  # config.json or ckpt
            pool.check_flags(self.folder(name), flags)
        self.checked.add(name)

    def checked_plan(self):  # the plan, each of its runs here checked against its flags
        plan = self.plan()
        for name, flags, _cost in plan:
            self.check(name, flags)
        return plan

    def diverged(self, name):
        """The line a run that stopped on a non-finite loss or weights ended with (a result: NaN),
        else None."""
        folder = self.folder(name)  # its log counts while the folder is here (deleted: redone)
        if name not in self.failed and os.path.isdir(folder) and os.path.lexists(folder + ".log"):
            with pool.log_file(folder + ".log", "rb") as f:
                f.seek(max(0, os.path.getsize(folder + ".log") - 4000))
                tail = f.read().decode(errors="replace")
            found = re.findall(r"[^\r\n]*(?:\(diverged\)|: loss is (?:nan|inf))[^\r\n]*", tail)
            if found and not pool.finished(folder):  # a run redone since has its own result
                self.failed[name] = found[-1].strip()
        return self.failed.get(name)

    def finished(self, name):
        if name not in self.done and (
            name in self.prior or self.diverged(name) or pool.finished(self.folder(name))
        ):
            self.done.add(name)
        return name in self.done

    def evaluated(self, name):  # a diverged run has nothing to evaluate
        folder = self.folder(name)
        reported = [os.path.join(folder, report, "metrics.json") for report in self.reports]
        return (
            all(os.path.exists(path) for path in reported)
            or bool(self.diverged(name))
            or (name in self.prior and not os.path.exists(os.path.join(folder, "ckpt.pt")))
        )

    def valid_ppl(self, name):  # at the last step of a finished run (NaN: diverged), else None
        folder = self.folder(name)
        if self.diverged(name) or not self.finished(name):
            return math.nan if self.diverged(name) else None
        # a run of a prior file, no folder here
        if not os.path.exists(os.path.join(folder, "log.jsonl")):
            return self.prior[name]["valid_ppl"]
        return ev.last_valid_ppl(folder, runlib.run_config(folder)["max_steps"])

    def select(self, candidates):
        """(value of the lowest mean valid PPL once all ran, else None; wanted runs) of {value:
        [(name, flags)]}."""
        wanted = [spec for group in candidates.values() for spec in group]
        for name, flags in wanted:
            self.check(name, flags)
        ppl = {v: [self.valid_ppl(name) for name, _f in group] for v, group in candidates.items()}

        def mean(v):  # a diverged run (NaN) never wins
            return float(np.nan_to_num(np.mean(ppl[v]), nan=np.inf))

        return (None if None in sum(ppl.values(), []) else min(ppl, key=mean)), wanted

    def bracketed(self, values, spec):
        """select over values on SELECTION_SEEDS; a winner at an edge extends the list by a factor 2
        (twice at most)."""
        best, wanted = self.select({v: [spec(v, s) for s in SELECTION_SEEDS] for v in values})
        if best is None or min(values) < best < max(values) or len(values) >= 5:
            return best, wanted
        return self.bracketed([*values, best * 2 if best == max(values) else best / 2], spec)

    def share(self):  # the selected share and the sweep's runs
        size, lr = SHARE_SETTING["size"], SHARE_SETTING["lr"]
        return self.bracketed(SHARES, lambda sh, seed: run_spec(size, 1.0, "agg", lr, seed, sh))

    # the selected lr of (size, method) and the sweep's runs; MLE has no share
    def lr(self, size, method, share):
        share = share if method == "agg" else None
        return self.bracketed(
            LRS[size], lambda lr, seed: run_spec(size, 1.0, method, lr, seed, share)
        )

    def plan(self):
        """[(name, flags, cost)] of every run wanted so far, cheapest first."""
        share, wanted = self.share()
        runs, cells = {name: (flags, COST[SHARE_SETTING["size"]]) for name, flags in wanted}, {}
        for size, method in itertools.product(SIZES, METHODS if share is not None else ["mle"]):
            lr, sweep = self.lr(size, method, share)
            runs.update({name: (flags, COST[size]) for name, flags in sweep})
            for sh in (
                (sorted({share, HEADLINE_SHARE}) if method == "agg" else [None])
                if lr is not None
                else []
            ):
                # the selected share and the headline's
                for fraction, seed in itertools.product(FRACTIONS, SEEDS):
                    name, flags = run_spec(size, fraction, method, lr, seed, sh)
                    runs[name] = (flags, COST[size] * fraction)
                    cells.setdefault((size, fraction, seed), {}).setdefault(method, []).append(name)
                    # the full-data pair on the second corpus
                    if size == SECOND_CORPUS["size"] and fraction == 1.0:
                        runs[f"{SECOND_CORPUS['name']}-{name}"] = (
                            flags + SECOND_CORPUS["flags"],
                            SECOND_CORPUS["cost"],
                        )
        runs.update(self.replicas(runs, cells.values()))
        return sorted(((n, f, c) for n, (f, c) in runs.items()), key=lambda r: (r[2], r[0]))

    # the host of a finished run: its config.json's kernels, else its record's
    def run_host(self, name):
        cfg = runlib.run_config(self.folder(name))
        return (cfg.get("versions") or {}).get("kernels") if cfg else host(self.prior.get(name, {}))

    def replicas(self, runs, cells):
        """{NAME-kHOST: (flags, cost)}: both runs of a finished MLE / AGG pair of a cell ({method:
        names} of one size, data size and seed) that ran on two hosts, trained again here (HOST:
        this machine's kernels)."""
        out, made = {}, self.made()

        def copies(n):  # the run n and its replicas (a replica stays until evaluated)
            return [n] + [
                r
                for r in made
                if r.startswith(n)
                and REPLICA.fullmatch(r[len(n) :])
                and self.finished(r)
                and self.evaluated(r)
            ]

        for by in cells if self.host else []:
            for mle, agg in itertools.product(by.get("mle", []), by.get("agg", [])):
                if (
                    self.finished(mle)
                    and self.finished(agg)
                    and not any(  # no pair on one host yet
                        self.run_host(a) == self.run_host(b)
                        for a in copies(mle)
                        for b in copies(agg)
                    )
                ):
                    out.update(
                        {
                            f"{n}-k{self.host[:8]}": runs[n]
                            for n in (mle, agg)
                            if self.run_host(n) != self.host
                        }
                    )
        return out

    def selections(self):
        share, _ = self.share()
        return dict(
            share=share,
            lr={size: {m: self.lr(size, m, share)[0] for m in METHODS} for size in SIZES},
        )

    def write_results(self, path, argv, corpus_path=None):
        names = {n for n, _f, _c in self.plan()} | self.made()
        runs, diverged = self.records(sorted(names), lambda n: run_record(self, n, sizes=True))
        runs = {
            n: dict(r, host=host(r), **{"replica": True} if REPLICA.search(n) else {})
            for n, r in runs.items()
        }
        sel = self.selections()

        def ppl(specs):
            return {name: self.valid_ppl(name) for name, _f in specs}

        lr_runs = {
            size: {
                m: ppl(self.lr(size, m, sel["share"])[1])
                for m in METHODS
                if m == "mle" or sel["share"] is not None
            }
            for size in SIZES
        }
        corpus = {n: r for n, r in runs.items() if n.startswith(SECOND_CORPUS["name"] + "-")}
        runs = {n: r for n, r in runs.items() if n not in corpus}
        shares = sorted({sel["share"], HEADLINE_SHARE}) if sel["share"] is not None else []

        def at(rs, lrs, share):  # a pair's runs: each method's at its lr, AGG's at the share
            return [
                r
                for r in rs
                if r["lr"] == lrs.get(r["method"])
                and (r["method"] == "mle" or r["rare_share"] == share)
            ]

        cells = []
        for share, size, fraction in itertools.product(shares, SIZES, FRACTIONS):
            members = at(
                [r for r in runs.values() if r["size"] == size and r["train_fraction"] == fraction],
                sel["lr"][size],
                share,
            )
            if (cell := paired_cell(members)) is not None:
                cells.append(
                    dict(
                        agg_share=share,
                        size=size,
                        train_fraction=fraction,
                        **{
                            k: members[0][k]
                            for k in (
                                "train_tokens",
                                "n_params_non_embedding",
                                "d_model",
                                "n_layer",
                            )
                        },
                        lr=sel["lr"][size],
                        **cell,
                    )
                )
        of = {share: [c for c in cells if c["agg_share"] == share] for share in shares}
        fits = {
            f"{sh:g}": {k: fit_trend(of[sh], k) for k in FIT_QUANTITIES}
            for sh in shares
            if len(of[sh]) >= 3
        }
        result = self.write(
            path,
            argv,
            dict(
                selection=dict(
                    rule="lowest mean valid PPL at the last step over seeds 0-2, full data",
                    share=sel["share"],
                    share_valid_ppl=ppl(self.share()[1]),
                    lr=sel["lr"],
                    lr_valid_ppl=lr_runs,
                ),
                runs=runs,
                diverged=diverged,
                compare=cells,  # one cell per (AGG share, size, data size)
                fits=fits,
                pooled_by_data={f"{sh:g}": pooled_by_data(of[sh]) for sh in shares if of[sh]},
                prediction=prediction(fits),
            ),
        )
        # the selected share's figure, one per other share
        for share in [share for share in shares if of[share]]:
            suffix = "" if share == sel["share"] else f"_share{share:g}"
            plot_cells(
                of[share],
                os.path.splitext(path)[0] + suffix + ".png",
                f"AGG (rare share {share:g}) against MLE as the model and the data grow "
                "(cpu-preset family; mean over seeds, paired 95% intervals)",
            )
        print(f"wrote {path}: {len(runs)} runs, {len(cells)} paired cells")
        if corpus_path and corpus:
            lrs = sel["lr"][SECOND_CORPUS["size"]]
            pairs = [
                dict(agg_share=share, **cell)
                for share in shares
                if (cell := paired_cell(at(corpus.values(), lrs, share))) is not None
            ]
            second = dict(
                command=result["command"],
                corpus=SECOND_CORPUS,
                selection=dict(share=sel["share"], lr=lrs),
                runs=corpus,
                compare=pairs,
            )
            compare.write_evidence(corpus_path, second, (self.name,), self.overwrite)
            print(f"wrote {corpus_path}: {len(corpus)} runs")


def next_job(study, busy):
    """The next job for studies.pool (name, command, log), or None: evaluations first, then the
    cheapest run."""
    plan = [
        (name, flags, study.folder(name))
        for name, flags, _cost in study.checked_plan()
        if name not in busy
    ]
    for name, _flags, folder in plan:
        if study.finished(name) and not study.evaluated(name):
            report = next(
                r
                for r in study.reports
                if not os.path.exists(os.path.join(folder, r, "metrics.json"))
            )
            return (
                name,
                [
                    sys.executable,
                    os.path.join(ROOT, "eval.py"),
                    folder,
                    "--out",
                    os.path.join(folder, report),
                    *study.eval_args,
                    *study.reports[report],
                ],
                folder + ".log",
            )
    for name, flags, folder in plan:
        if not study.finished(name):
            resume = ["--resume"] if os.path.exists(os.path.join(folder, "ckpt.pt")) else []
            if not os.path.isdir(folder) and os.path.isfile(folder + ".log"):  # a deleted run's
                os.replace(folder + ".log", folder + ".log.old")
            return (
                name,
                [
                    sys.executable,
                    os.path.join(ROOT, "train_lm.py"),
                    *flags,
                    "--out",
                    folder,
                    *resume,
                ],
                folder + ".log",
            )


def run_record(study, name, sizes=False, **extra):
    """A run's results record (compare.run_record), its commands as run in study.label/runs; sizes:
    the sizes too."""
    folder, label, cfg = (
        study.folder(name),
        f"{study.label}/runs",
        runlib.run_config(study.folder(name)),
    )
    with open(os.path.join(folder, "report", "metrics.json")) as f:
        m = next(iter(json.load(f).values()))
    # the lowest valid PPL: early stopping's
    best = min((r["ppl"] for r in ev.log_records(folder)), default=None)
    if sizes:
        V, d = cfg["vocab_size_actual"], cfg["d_model"]
        extra = dict(
            size=next(k for k, v in SIZES.items() if all(cfg[f] == x for f, x in v.items())),
            n_params=cfg["n_params"],
            n_params_non_embedding=cfg["n_params"] - V * d - cfg["block_size"] * d,
            d_model=d,
            n_layer=cfg["n_layer"],
            head_rank=d,
            train_tokens=cfg["data_tokens"]["train"],
            rare_share=cfg.get("rare_share"),
        )
    record = compare.run_record(
        m,
        cfg,
        **extra,
        valid_ppl_best=best,
        eval_command=shlex.join(
            [
                "python",
                "eval.py",
                f"{label}/{name}",
                "--out",
                f"{label}/{name}/report",
                *study.eval_args,
            ]
        ),
    )
    record["command"] = record["command"].replace(os.path.relpath(study.runs, ROOT), label)
    return record


def paired_cell(runs):
    """AGG against MLE in one (size, data) cell, paired by seed on one host (the runs themselves,
    else replicas): PPLs as they are and calibrated, I(W), Uniq, and each pair's host."""
    by = {}
    for r in sorted(runs, key=lambda r: bool(r.get("replica"))):
        by.setdefault((r["method"], r["seed"]), []).append(r)
    pairs = {
        s: next(((b, a) for a in aggs for b in by.get(("mle", s), []) if host(a) == host(b)), None)
        for (m, s), aggs in by.items()
        if m == "agg"
    }
    seeds = sorted(s for s, pair in pairs.items() if pair)
    pairs = [pairs[s] for s in seeds]
    if len(pairs) < 2:
        return None

    def ratio(key):  # AGG's / MLE's value per pair, as a log ratio
        return [math.log(compare.get(a, key) / compare.get(b, key)) for b, a in pairs]

    def diff(key):
        return [compare.get(a, key) - compare.get(b, key) for b, a in pairs]

    def log_rare_gap(b, a):  # log(MLE's / AGG's rare PPL)
        return math.log(b["ppl_groups"]["rare"] / a["ppl_groups"]["rare"])

    quantities = dict(
        ppl_log_ratio=ratio("ppl"),
        valid_ppl_log_ratio=ratio("valid_ppl"),
        rare_ppl_log_ratio=ratio("ppl_groups.rare"),
        calibrated_rare_ppl_log_ratio=ratio("rare_bias.ppl_groups.rare"),
        calibrated_ppl_log_ratio=ratio("rare_bias.ppl"),
        # and early stopping's valid PPL, where the records have it
        valid_ppl_best_log_ratio=all(r.get("valid_ppl_best") for r in sum(pairs, ()))
        and ratio("valid_ppl_best"),
        gap_closed_by_calibration=[
            1 - log_rare_gap(b["rare_bias"], a["rare_bias"]) / log_rare_gap(b, a) for b, a in pairs
        ],
        isotropy_diff=diff("isotropy"),
        rare_isotropy_diff=diff("isotropy_groups.rare"),
        uniq_diff=diff("uniq"),
    )
    out = dict(
        seeds=seeds,
        hosts=[host(b) for b, _a in pairs],
        **{k: compare.paired_interval(v) for k, v in quantities.items() if v},
    )
    # the test PPL ratio over seeds and, two-way, over the test articles too
    if all(r.get("article_stats") for r in sum(pairs, ())):
        base, cand = (np.array([p[i]["article_stats"]["nll"] for p in pairs]) for i in (0, 1))
        count = np.array(pairs[0][0]["article_stats"]["count"]).sum(1)
        interval = compare.seed_article_boot95(base.sum(2), cand.sum(2), count)
        out["ppl_log_ratio"]["seed_article_boot95"] = interval
    for k, key in (
        ("isotropy", "isotropy"),
        ("uniq", "uniq"),
        ("rare_isotropy", "isotropy_groups.rare"),
    ):
        out.update(
            {
                f"{m}_{k}": [compare.get(r[i], key) for r in pairs]
                for i, m in enumerate(("mle", "agg"))
            }
        )
    return out


FIT_QUANTITIES = (
    "ppl_log_ratio",
    "calibrated_ppl_log_ratio",
    "calibrated_rare_ppl_log_ratio",
    "gap_closed_by_calibration",
)
# Where the fits are asked to predict: the paper's GPT-2 medium on WikiText-103 (AGG Sec. 5.1), and
# the M model on WikiText-103 prefixes of 0.7M, 2.2M and 7M tokens, where the hub is reachable
# (TEST_PREDICTION says how)
PREDICT = dict(
    paper_regime=dict(n_params_non_embedding=302e6, train_tokens=103e6),
    **{
        f"wikitext103_M_{t}": dict(size="M", train_tokens=float(t[:-1]) * 1e6)
        for t in ("0.7M", "2.2M", "7M")
    },
)
TEST_PREDICTION = (
    "each cell, seeds 0 1 2: python train_lm.py --dataset wikitext-103 --train-fraction F "
    "--max-steps N "
    "--warmup N/10 --eval-interval N/12 --lr LR --method mle (or agg --rare-share SHARE) --seed S, "
    "F giving the tokens (config.json's data_tokens), N = 3.5 epochs of 1,024 tokens, LR the "
    "selection at M; then python -m studies.compare RUNS --compare mle agg --out REPORT"
)

# a cell key the fits regress on: (its name in the fit, in words)
AXES = {
    "n_params_non_embedding": ("params", "non-embedding params"),
    "train_tokens": ("tokens", "train tokens"),
    "epochs": ("epochs", "epochs"),
}


def fit_trend(cells, key, on=("n_params_non_embedding", "train_tokens"), predict=PREDICT):
    """OLS of a paired quantity's cell means (one point per cell: the seeds of a cell are not design
    points) on the log10 of two cell keys (`on`); a lack-of-fit F test of that plane against the
    seeds' spread within the cells; its predictions at `predict` (params and tokens), extrapolations
    over up to three decades, to be read as such."""
    X = np.asarray([[1.0, *(math.log10(c[k]) for k in on)] for c in cells])
    y, n = (
        np.asarray([c[key]["mean"] for c in cells]),
        np.asarray([len(c[key]["diffs"]) for c in cells]),
    )
    if len(y) <= 3 or np.linalg.matrix_rank(X) < 3:
        return None
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    dof, resid = len(y) - 3, y - X @ beta
    s2 = float(resid @ resid) / dof
    cov = s2 * np.linalg.inv(X.T @ X)
    se, t = np.sqrt(np.diag(cov)), stats.t.ppf(0.975, dof)
    # within cells
    pure = sum(float(np.sum((np.asarray(c[key]["diffs"]) - c[key]["mean"]) ** 2)) for c in cells)
    df_pure = int(n.sum() - len(n))
    f_lof = float(n @ resid**2) / dof / (pure / df_pure) if df_pure and pure > 0 else float("nan")
    params, predictions = {c.get("size"): c.get("n_params_non_embedding") for c in cells}, {}
    for name, at in predict.items():
        if (p := at.get("n_params_non_embedding", params.get(at.get("size")))) is not None:
            x0 = np.array([1.0, math.log10(p), math.log10(at["train_tokens"])])
            pred, pred_se = float(x0 @ beta), float(np.sqrt(x0 @ cov @ x0 + s2))
            predictions[name] = dict(
                at,
                n_params_non_embedding=p,
                prediction=pred,
                pi95=[pred - t * pred_se, pred + t * pred_se],
            )
    return dict(
        model=f"{key} = a + b log10({AXES[on[0]][1]}) + c log10({AXES[on[1]][1]}), OLS over the "
        "cell means",
        cells=len(y),
        seeds_per_cell=sorted(set(n.tolist())),
        residual_sd=math.sqrt(s2),
        **{
            n: dict(value=float(b), se=float(e), ci95=[float(b - t * e), float(b + t * e)])
            for n, b, e in zip(("intercept", *(f"per_decade_{AXES[k][0]}" for k in on)), beta, se)
        },
        lack_of_fit=dict(F=f_lof, df=[dof, df_pure], p=float(stats.f.sf(f_lof, dof, df_pure))),
        **dict(predictions=predictions) if predict else {},
    )


def prediction(fits):
    """The AGG/MLE test-PPL ratios the fits predict on the WikiText-103 prefixes (raw and with both
    calibrated), each with its 95% prediction interval, and how to test them."""

    def ratio(p):
        return dict(ratio=math.exp(p["prediction"]), pi95=[math.exp(x) for x in p["pi95"]])

    return dict(
        test=TEST_PREDICTION,
        **{
            f"share{sh}": {
                name[14:]: {
                    q: ratio(f[k]["predictions"][name])
                    for q, k in (
                        ("raw", "ppl_log_ratio"),
                        ("calibrated", "calibrated_ppl_log_ratio"),
                    )
                    if name in (f[k] or {}).get("predictions", {})
                }
                for name in PREDICT
                if name != "paper_regime"
            }
            for sh, f in fits.items()
        },
    )


def pooled_by_data(cells):
    """Per data size, the paired quantities pooled over the model sizes (each size's seeds are
    independent pairs)."""
    return {
        f"{f:g}": {
            k: compare.paired_interval(
                [v for c in cells if c["train_fraction"] == f for v in c[k]["diffs"]]
            )
            for k in FIT_QUANTITIES
        }
        for f in sorted({c["train_fraction"] for c in cells})
    }


# (key, title, to the y axis; exp: ratios)
PANELS = [
    ("ppl_log_ratio", "AGG / MLE test PPL", math.exp),
    ("calibrated_rare_ppl_log_ratio", "AGG / MLE rare PPL, both calibrated", math.exp),
    ("gap_closed_by_calibration", "share of the rare gap closed by calibrating both", float),
    ("rare_isotropy_diff", "rare I(W): AGG - MLE", float),
    ("uniq_diff", "Uniq: AGG - MLE", float),
]
SIZE_ROWS = [
    ("n_params_non_embedding", "train_tokens", "non-embedding parameters", "{:,.0f} train tokens"),
    ("train_tokens", "n_params_non_embedding", "training tokens", "{:,.0f} non-emb. params"),
]


def plot_cells(cells, path, suptitle, rows=SIZE_ROWS, panels=PANELS):
    """Each paired quantity against each row's x key, a line per value of its line key (seed mean,
    paired 95% t CI)."""
    fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 7.5))
    for row, (x_key, line_key, x_label, line_label) in enumerate(rows):
        for ax, (key, title, f) in zip(axes[row], panels):
            for line in sorted({c[line_key] for c in cells if key in c}):
                cs = sorted(
                    (c for c in cells if c[line_key] == line and key in c), key=lambda c: c[x_key]
                )
                mean, lo, hi = (
                    [f(v) for v in vs]
                    for vs in zip(*((c[key]["mean"], *c[key]["t95"]) for c in cs))
                )
                ax.errorbar(
                    [c[x_key] for c in cs],
                    mean,
                    yerr=[np.subtract(mean, lo), np.subtract(hi, mean)],
                    marker="o",
                    capsize=3,
                    label=line_label.format(line),
                )
            ax.axhline(f(0.0), color="0.6", lw=0.8)  # no difference
            ax.set_xscale("log")
            xs = sorted({c[x_key] for c in cells})  # ticks at the grid's sizes only, e.g. "793k"
            ax.set_xticks(
                xs,
                [
                    f"{x / 1e6:.2g}M" if x >= 1e6 else f"{x / 1e3:.0f}k" if x >= 1e3 else f"{x:.3g}"
                    for x in xs
                ],
                minor=False,
            )
            ax.set_xticks([], minor=True)
            ax.set_xlabel(x_label, fontsize=8)
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=6)
    fig.suptitle(suptitle, fontsize=10)
    compare.save(fig, path)


def portable(argv):
    """The command as a user runs it: the default --out, training on, the results file relative
    (else folder/name)."""
    out, args = [], iter(argv)
    for a in args:
        if a == "--results":
            path = os.path.relpath(value := os.path.abspath(next(args)), ROOT)
            out += [a, os.path.join(*value.split(os.sep)[-2:]) if path.startswith("..") else path]
        elif a == "--out":
            next(args)
        elif a != "--no-train" and not a.startswith("--out="):
            out.append(a)
    return out


def main(argv=None, study_class=Study):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog=f"python -m studies.{study_class.name}",
        description=sys.modules[study_class.__module__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default=os.path.join(ROOT, study_class.label))
    p.add_argument(
        "--jobs", type=int, default=1, help="runs at once (2 on a 2-core CPU: one thread each)"
    )
    p.add_argument(
        "--no-train",
        action="store_true",
        help="train nothing: write the results of the finished runs",
    )
    p.add_argument(
        "--results",
        default=None,
        metavar="FILE",
        help="write the study's JSON here (and its figures)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="let --results replace a file holding other runs"
    )
    p.set_defaults(corpus_results=None)
    if study_class is Study:
        p.add_argument(
            "--corpus-results",
            default=None,
            metavar="FILE",
            help="write the second corpus's pair here",
        )
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give 1 or more")
    study = study_class(args.out, prior=[args.results, args.corpus_results])
    study.overwrite = args.overwrite
    study.host = runlib.kernel_fingerprint(
        max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    )
    results = (
        (lambda *_: study.write_results(args.results, argv, args.corpus_results))
        if args.results
        else None
    )
    # keep jobs runs and evaluations going until nothing is runnable, writing as each ends
    if not args.no_train:
        os.makedirs(study.runs, exist_ok=True)
        pool.run(lambda busy: next_job(study, busy), args.jobs, results, study.diverged)
    print(json.dumps(study.selections()))
    if results:
        results()


if __name__ == "__main__":
    main()
