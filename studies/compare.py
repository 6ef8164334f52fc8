"""Many runs side by side: summaries over seeds, paired comparisons, results files, report.md and
plots.

    python -m studies.compare out/lm-mle-s0 out/lm-agg-s0 --compare mle agg --out out/report
    python -m studies.compare --reanalyse results/nmt_table.json --add out/nmt/nmt_s3.json

Evaluates each run folder with eval.evaluate (eval.py's flags) into REPORT/metrics.json,
summary.json (mean and std over the seeds of each variant, variant_names), compare.json (variants
paired by seed), report.md and the plots.
"""

import functools
import json
import math
import os
import re
import shlex
import statistics
import sys

import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy import stats

import agg
import eval as ev
import runlib
import train_lm
import train_nmt

SCRIPTS = {"lm": train_lm, "nmt": train_nmt}


# ------------------------------------------------------------------------------ the same experiment
# config keys that never tell experiments apart, besides the scripts' RUN_CONTROL (data_fingerprint
# tells corpora)
NOT_AN_EXPERIMENT = {"seed", "data_dir", "source_only_rare"}


@functools.cache
def flag_defaults(task):
    """{config key: default} of the training flags of a task's script: what a run saved before a
    flag existed ran."""
    return vars(SCRIPTS[task].build_parser().parse_args([]))


def variant_names(configs):
    """{run: variant} for {run: config}, the one definition of "the same experiment": the method,
    then the settings that tell apart runs of one method that differ in more than their seed (e.g.
    'ul+agg gate_ul=False')."""

    def task(cfg):
        return cfg.get("task", "lm")

    def setting(cfg, key):
        if key == "rare_rule" and cfg.get("task") == "nmt":
            return train_nmt.rare_rule(cfg)  # also of a config saved before --rare-rule
        # a run saved before the flag
        value = cfg[key] if key in cfg else flag_defaults(task(cfg)).get(key)
        return (
            getattr(agg.METHODS.get(cfg.get("method")), "defaults", {}).get(key)
            if value is None
            else value
        )

    names = {}
    for method in dict.fromkeys(cfg.get("method", "?") for cfg in configs.values()):
        runs = [r for r, cfg in configs.items() if cfg.get("method", "?") == method]
        flags = {k for r in runs for k in flag_defaults(task(configs[r]))}
        control = (
            set().union(*(SCRIPTS[task(configs[r])].RUN_CONTROL for r in runs)) | NOT_AN_EXPERIMENT
        )
        keys = sorted(
            (
                {k for r in runs for k in configs[r]}
                & (flags | {"task", "rare_rule", "data_fingerprint"})
            )
            - control
        )
        differ = [k for k in keys if len({repr(setting(configs[r], k)) for r in runs}) > 1]
        names.update(
            {r: method + "".join(f" {k}={setting(configs[r], k)}" for k in differ) for r in runs}
        )
    return names


SUMMARY_SKIP = {
    "step",
    "tokens",
    "rows",
    "rows_groups",
    "seed",
    "uniq_human",
    "uniq_human_groups",
    "gen_uniq_human",
    "gen_rep4_human",
    "n_sentences",
    "beam",
    "lenpen",
    "word_similarity_pairs",
    "singular_values",
}


def summarise(metrics):
    """{variant: {"n": runs, METRIC: {"mean", "std", "median"}, GROUPED: {group: {...}}}} over each
    variant's seeds."""

    def stat(values):
        t = torch.tensor(values, dtype=torch.float64)
        return {
            "mean": float(t.mean()),
            "std": float(t.std()) if len(t) > 1 else 0.0,
            "median": statistics.median(values),
        }

    # numbers and dicts of them, leaf by leaf (at the top: not SUMMARY_SKIP, no empty)
    def nested(runs, top=False):
        out = {}
        for k, v in runs[0].items():
            if top and k in SUMMARY_SKIP or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                out[k] = stat([r[k] for r in runs])
            elif isinstance(v, dict) and v and ((sub := nested([r[k] for r in runs])) or not top):
                out[k] = sub
        return out

    by_variant = {}
    for m in metrics.values():
        by_variant.setdefault(m.get("variant", m.get("method", "?")), []).append(m)
    return {variant: {"n": len(runs), **nested(runs, True)} for variant, runs in by_variant.items()}


def get(record, dotted):  # record["a"]["b"] for "a.b", or None
    for part in dotted.split("."):
        record = record.get(part) if isinstance(record, dict) else None
    return record


# -------------------------------------------------------------------------------- paired statistics
G = agg.GROUPS
COMPARE_KEYS = (
    "ppl",
    *(f"ppl_groups.{g}" for g in G),
    "valid_ppl",
    "uniq",
    "uniq_groups.rare",
    "isotropy",
    *(f"isotropy_groups.{g}" for g in G),
    "mean_cosine",
    "mean_row_share",
    "mean_cosine_groups.rare",
    "isoscore",
    "isotropy_centered",
    "isotropy_weighted",
    "isotropy_weighted_centered",
    "undertrained.count",
    "gen_rep4",
    "gen_rep4_sampled",
    "rare_bias.ppl",
    "rare_bias.ppl_groups.rare",
    "temperature.t",
    "temperature.ppl",
    "temperature.ppl_groups.rare",
    "rare_argmax.rare_argmax_precision",
    "rare_argmax.rare_argmax_recall",
    "word_similarity.ws353",
    "word_similarity.simlex999",
    # NMT: BLEU, test PPL and the target side (train_nmt.validate's)
    "bleu",
    "test_ppl",
    *(f"target.ppl_groups.{g}" for g in G),
    "target.rare_mass_pred",
    "target.uniq",
    "target.uniq_groups.rare",
    "target.rare_recall",
    "target.rare_precision",
    "target.isotropy",
    "target.isotropy_groups.rare",
    "target.mean_cosine",
    "target.cosine_rare_freq",
)


def paired_interval(diffs, n_boot=10000, seed=0):
    """Mean of paired differences with its 95% t and percentile bootstrap intervals, paired t-test
    p, the median, and min_detectable: the true mean difference these pairs detect with 80% power at
    5% two-sided ((t_.975 + t_.8) se)."""
    d = np.asarray(diffs, dtype=np.float64)
    out = dict(n=len(d), mean=float(d.mean()), median=float(np.median(d)), diffs=d.tolist())
    if len(d) > 1:
        se = d.std(ddof=1) / math.sqrt(len(d))
        half = float(stats.t.ppf(0.975, len(d) - 1) * se)
        boot = np.random.default_rng(seed).choice(d, (n_boot, len(d))).mean(1)
        out.update(
            t95=[out["mean"] - half, out["mean"] + half],
            boot95=np.percentile(boot, [2.5, 97.5]).tolist(),
            p=float(stats.ttest_1samp(d, 0).pvalue) if d.std() > 0 else float("nan"),
            min_detectable=float(
                (stats.t.ppf(0.975, len(d) - 1) + stats.t.ppf(0.8, len(d) - 1)) * se
            ),
        )
    return out


def pair_difference(a, b):
    """What makes two runs (configs) unfit to pair, or None; a value one config does not record is
    not compared."""
    for what, key in (
        ("task", "task"),
        ("data", "data_fingerprint"),
        ("vocabulary size", "vocab_size_actual"),
        ("thread count", "threads"),
        ("host kernels", "kernels"),
    ):
        x, y = (
            (c.get("versions") or {}).get(key) if key in ("threads", "kernels") else c.get(key)
            for c in (a, b)
        )
        same = runlib.same_data(x, y) or runlib.same_data(y, x) if what == "data" else x == y
        if x is not None and y is not None and not same:
            return f"{what} ({x} vs {y})"
    return None


def comparable_pairs(pairs, configs, variants, default=False):
    """The pairs whose runs of each seed can be paired: another is refused, or dropped with a note
    if the default."""
    keep = []
    for base, cand in pairs:
        runs = {
            v: {c.get("seed"): r for r, c in configs.items() if variants[r] == v}
            for v in (base, cand)
        }
        problems = [
            f"the runs of seed {s} ({runs[base][s]}, {runs[cand][s]}) differ in {diff}; paired "
            f"runs must share the task, the data, the vocabulary, the thread count and the host"
            for s in sorted(set(runs[base]) & set(runs[cand]), key=str)
            if (diff := pair_difference(configs[runs[base][s]], configs[runs[cand][s]]))
        ]
        if problems and not default:
            raise SystemExit(f"--compare {base} {cand}: {problems[0]}")
        if problems:
            print(f"no paired comparison of {cand} against {base}: {problems[0]}")
        else:
            keep.append([base, cand])
    return keep


def compare(metrics, type_stats, base, cand, tokens, texts=None):
    """Variant cand against base, paired by seed: per metric the differences (PPLs as log ratios)
    with intervals; the rare-PPL gap over rare target types (LM), the paired BLEU bootstrap per seed
    (NMT, texts), the shares of the rare gap that calibrating base / both (eval.py's rare_bias)
    closes, TOST of the PPLs, the article bootstrap."""
    runs = {
        v: {m["seed"]: k for k, m in metrics.items() if m.get("variant") == v} for v in (base, cand)
    }
    if not (seeds := sorted(set(runs[base]) & set(runs[cand]))):
        raise SystemExit(
            f"--compare {base!r} {cand!r}: no seed in common; give runs of both with the same "
            "--seed"
        )
    labels = [(runs[base][s], runs[cand][s]) for s in seeds]
    pairs = [(metrics[b], metrics[c]) for b, c in labels]
    out = dict(base=base, cand=cand, seeds=seeds, metrics={})
    for key in COMPARE_KEYS:
        vals = [(get(b, key), get(c, key)) for b, c in pairs]
        # none missing or nan
        if all(isinstance(x, (int, float)) and x == x for pair in vals for x in pair):
            out["metrics"][key] = dict(
                base=[b for b, _ in vals],
                cand=[c for _, c in vals],
                log_ratio="ppl" in key,
                **paired_interval([math.log(c / b) if "ppl" in key else c - b for b, c in vals]),
            )
    if all(
        b in type_stats
        and c in type_stats
        and type_stats[b]["count"][type_stats[b]["rare"]].sum() > 0
        for b, c in labels
    ):
        rare = type_stats[labels[0][0]]["rare"]
        # per rare type, pooled
        gap = sum(type_stats[b]["nll"] - type_stats[c]["nll"] for b, c in labels)[rare]
        count = sum(type_stats[b]["count"] for b, _ in labels)[rare].double()
        gap, count, ids = gap[count > 0], count[count > 0], rare.nonzero().squeeze(1)[count > 0]
        order = torch.argsort(gap, descending=True)
        total = float(gap.sum()) or float("nan")  # nan shares when the two variants score alike
        out["rare_types"] = dict(
            types=len(ids),
            targets=int(count.sum()),
            ratio=math.exp(-total / float(count.sum())),
            # over rare target types
            ratio_type_boot95=ratio_boot95(gap.numpy(), count.numpy()),
            share_top1=float(gap[order[:1]].sum()) / total,
            share_top10=float(gap[order[:10]].sum()) / total,
            top=[
                dict(token=tokens[int(ids[j])], targets=int(count[j]), share=float(gap[j]) / total)
                for j in order[:10].tolist()
            ],
        )
    if texts and all(b in texts and c in texts for b, c in labels):
        out["bleu_paired_bootstrap"] = [
            dict(
                seed=s,
                **paired_bleu(
                    texts[b]["hyps"],
                    texts[c]["hyps"],
                    texts[b]["refs"],
                    texts[b]["bleu_tokenize"],
                ),
            )
            for s, (b, c) in zip(seeds, labels)
        ]
    if all(b.get("rare_bias") and c.get("rare_bias") for b, c in pairs):

        def rare_ppl(r):
            return r["ppl_groups"]["rare"]

        gap = [math.log(rare_ppl(b) / rare_ppl(c)) or float("nan") for b, c in pairs]
        shares = [
            (math.log(rare_ppl(b)) - math.log(rare_ppl(b["rare_bias"]))) / g
            for (b, _), g in zip(pairs, gap)
        ]
        closed = [
            1 - math.log(rare_ppl(b["rare_bias"]) / rare_ppl(c["rare_bias"])) / g
            for (b, c), g in zip(pairs, gap)
        ]
        out["free_baseline_share"] = dict(
            per_seed=shares,
            mean=float(np.mean(shares)),
            base_bias=[b["rare_bias"]["bias"] for b, _ in pairs],
        )
        out["gap_closed_by_calibration"] = dict(
            per_seed=closed,
            mean=float(np.mean(closed)),
            min=float(np.min(closed)),
            max=float(np.max(closed)),
        )
    out["equivalence"] = {
        k: dict(tost(out["metrics"][k]["diffs"], m), log_ratio=True)
        for k, m in EQUIVALENCE_MARGINS.items()
        if k in out["metrics"]
    }
    if all(b.get("article_stats") and c.get("article_stats") for b, c in pairs):
        nll = [np.array([p[side]["article_stats"]["nll"] for p in pairs]) for side in (0, 1)]
        count = np.array(pairs[0][0]["article_stats"]["count"])  # the same targets in every run
        out["rare_articles"] = article_bootstrap(*nll, count)
        parts = {"ppl": [0, 1, 2], **{f"ppl_groups.{g}": [i] for i, g in enumerate(G)}}
        for key in [k for k in parts if k in out["metrics"]]:  # beside the seed intervals
            base, cand = (x[..., parts[key]].sum(2) for x in nll)
            targets = count[:, parts[key]].sum(1)
            interval = seed_article_boot95(base, cand, targets)
            out["metrics"][key]["seed_article_boot95"] = interval
    return out


def article_bootstrap(base, cand, count, n_boot=10000):
    """The rare PPL ratio cand / base over the seeds, bootstrapped over held-out articles (the units
    of the split). base, cand: NLL sums (seed x article x group); count: each article's targets per
    group (one seed's)."""
    count = count[:, 2] * len(base)  # rare targets per article, over the seeds
    gap = base[..., 2].sum(0) - cand[..., 2].sum(0)
    gap, count = gap[count > 0], count[count > 0]
    return dict(
        articles=int(len(gap)),
        rare_targets=count.tolist(),
        ratio=math.exp(-gap.sum() / count.sum()),
        ratio_article_boot95=ratio_boot95(gap, count, n_boot),
        gap_share_per_article=(gap / gap.sum()).tolist() if gap.sum() else None,
    )


def ratio_boot95(gap, count, n_boot=10000):
    """The 95% bootstrap interval over units (rare types, articles) of the PPL ratio exp(-sum gap /
    sum count), seeded."""
    rng = np.random.default_rng(0)
    return np.percentile(
        [
            math.exp(-gap[i].sum() / max(count[i].sum(), 1))
            for i in (rng.integers(0, len(gap), len(gap)) for _ in range(n_boot))
        ],
        [2.5, 97.5],
    ).tolist()


def seed_article_boot95(base, cand, count, n_boot=10000, seed=0):
    """The 95% two-way bootstrap interval of the paired mean log PPL ratio cand / base: the seeds
    and, independently, the held-out articles resampled. base, cand: NLL sums (seed x article);
    count: each article's targets. Per draw: the mean over the drawn seeds of the log ratio over
    the drawn articles (one article: paired_interval's seed bootstrap; identical seeds: the
    article bootstrap)."""
    diff = np.asarray(cand, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    count = np.asarray(count, dtype=np.float64)
    n_seeds, n_articles = diff.shape
    rng = np.random.default_rng(seed)
    seed_draws = rng.integers(0, n_seeds, (n_boot, n_seeds))
    article_draws = rng.integers(0, n_articles, (n_boot, n_articles))
    seed_means = diff[seed_draws].mean(1)  # (draw, article): the drawn seeds' mean NLL difference
    drawn_gap = np.take_along_axis(seed_means, article_draws, 1).sum(1)
    drawn_count = np.maximum(count[article_draws].sum(1), 1)
    return np.percentile(drawn_gap / drawn_count, [2.5, 97.5]).tolist()


# Equivalence margins (this project's): "equal" or "matches" in the docs means the 90% interval of
# the paired mean log ratio lies within these (TOST at 5%): 2% for a total PPL, 10% for a frequency
# group's PPL.
EQUIVALENCE_MARGINS = {
    **dict.fromkeys(("ppl", "valid_ppl", "rare_bias.ppl", "temperature.ppl"), math.log(1.02)),
    **dict.fromkeys(("ppl_groups.rare", "rare_bias.ppl_groups.rare"), math.log(1.10)),
    "test_ppl": math.log(1.02),
}


def tost(diffs, margin):
    """Two one-sided t-tests against +-margin: equivalent at 5% when the 90% t interval lies inside
    the margins."""
    d = np.asarray(diffs, dtype=np.float64)
    n, mean = len(d), float(d.mean())
    if n < 2 or d.std() == 0:
        return dict(margin=margin, n=n, equivalent=None)
    se = d.std(ddof=1) / math.sqrt(n)
    half = float(stats.t.ppf(0.95, n - 1) * se)
    p = max(stats.t.sf((mean + margin) / se, n - 1), stats.t.cdf((mean - margin) / se, n - 1))
    return dict(
        margin=margin, n=n, ci90=[mean - half, mean + half], p=float(p), equivalent=bool(p < 0.05)
    )


# ------------------------------------------------------------------------------------ results files
RESULT_KEYS = (
    "method",
    "variant",
    "seed",
    "step",
    "split",
    "tokens",
    "valid_ppl",
    "ppl",
    "ppl_groups",
    "uniq",
    "uniq_groups",
    "uniq_human",
    "uniq_human_groups",
    "isotropy",
    "isotropy_groups",
    "mean_cosine",
    "mean_cosine_groups",
    "norm_groups",
    "mean_row_share",
    "cosine_rare_freq",
    "rows",
    "geometry_rows_rule",
    "rare_argmax",
    "rare_bias",
    "temperature",
    "output_bias",
    "gen_rep4",
    "gen_rep4_sampled",
    "gen_distinct",
    "bleu",
    "bleu_signature",
    "test_ppl",
    "target",
    "rare_rule",
    "checkpoints_averaged",
    "isoscore",
    "isotropy_centered",
    "isotropy_weighted",
    "isotropy_weighted_centered",
    "undertrained",
    "article_stats",
    "word_similarity",
    "word_similarity_pairs",
)
RUN_KEYS = (
    "lr",
    "warmup",
    "split_seed",
    "preset",
    "tokens_per_step",
    "max_steps",
    "method_hparams",
    "optimizer",
    "untie",
    "weight_decay",
    "embedding_weight_decay",
    "dataset",
    "train_fraction",
    "device",
    "dtype",
    "method_rare_share",
    "keep_last",
    "save_interval",
    "git_commit",
    "agg_sha256",
)


def paired_bleu(base_hyps, cand_hyps, refs, tokenize, n_boot=1000):
    """Paired bootstrap of corpus BLEU (Koehn 2004, as sacrebleu's paired test): both systems on the
    same resampled sentences; p: twice the share of resamples whose difference (cand - base) has the
    other sign."""
    import sacrebleu

    metric = sacrebleu.BLEU(tokenize=tokenize)
    stats = [
        np.asarray(metric._extract_corpus_statistics(h, [refs]), dtype=np.int64)
        for h in (base_hyps, cand_hyps)
    ]

    def bleu(sentence_stats):
        return metric._compute_score_from_stats(sentence_stats.sum(0).tolist()).score

    base, cand, rng = bleu(stats[0]), bleu(stats[1]), np.random.default_rng(0)
    diffs = np.array(
        [
            bleu(stats[1][i]) - bleu(stats[0][i])
            for i in (rng.integers(0, len(refs), len(refs)) for _ in range(n_boot))
        ]
    )
    other_side = float(np.mean(diffs <= 0) if cand > base else np.mean(diffs >= 0))
    return dict(
        base=base,
        cand=cand,
        diff=cand - base,
        boot95=np.percentile(diffs, [2.5, 97.5]).tolist(),
        p=min(1.0, 2 * other_side),
        n_boot=n_boot,
        sentences=len(refs),
    )


def repo_relative(words):  # absolute paths relative to the repository, the rest as given
    return [os.path.relpath(a, runlib.ROOT) if os.path.isabs(a) else str(a) for a in words]


def run_command(saved, script):
    """The command that reproduces a run from its config.json: its segments' flags, a later one's
    value winning, with --lr / --warmup and the thread count; the segments in order when a later one
    changed the result (another --dtype, a --max-steps that moved the cosine decay)."""
    segments = saved.get("segments") or [saved]
    later = {a.split("=")[0] for s in segments[1:] for a in s.get("argv") or []}

    # [flag, values...] in order of first appearance, a later segment's value winning
    def words(segs, drop):
        flags = {}
        for seg in segs:
            groups = []
            for a in seg.get("argv") or []:
                groups.append([a]) if a.startswith("--") or not groups else groups[-1].append(a)
            flags.update((g[0].split("=")[0], g) for g in groups if g[0].split("=")[0] not in drop)
        return repo_relative(a for g in flags.values() for a in g)

    if "--dtype" in later or (saved.get("schedule") == "cosine" and "--max-steps" in later):
        argv, rest = (
            words(segments[:1], {"--resume"}),
            [words([s], {"--resume"}) + ["--resume"] for s in segments[1:]],
        )
    else:
        argv, rest = words(segments, {"--resume", "--stop-at"}), []
    for key in ("lr", "warmup"):
        if "--" + key not in argv and saved.get(key) is not None:
            argv += [
                "--" + key,
                f"{saved[key]:g}" if isinstance(saved[key], float) else str(saved[key]),
            ]
    device = str(saved.get("device") or "cpu")
    if device != "cpu" and "--device" not in argv:  # a GPU
        argv += ["--device", device]
    threads = (saved.get("versions") or {}).get("threads")
    threads = (
        threads
        if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0
        else None
    )
    # every word shell-quoted, the thread count a number: a crafted config.json cannot put shell
    # text in the command
    return " && ".join(
        [(f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(["python", script, *argv])]
        + [shlex.join(["python", script, *r]) for r in rest]
    )


def run_record(m, cfg, **extra):
    """One run of a results file (every study's schema): metrics, settings, provenance and its
    training command."""
    versions, task = cfg.get("versions") or {}, cfg.get("task", "lm")
    return dict(
        {k: m[k] for k in RESULT_KEYS if k in m},
        **{k: cfg.get(k) for k in RUN_KEYS},
        **{k: versions.get(k) for k in ("threads", "cpu_capability", "kernels")},
        task=task,
        **{k: cfg.get(k) for k in ("data_fingerprint", "vocab_size_actual")},
        segments=[
            {k: seg.get(k) for k in ("start_step", "git_commit", "git_dirty", "agg_sha256")}
            for seg in cfg.get("segments") or []
        ],
        command=run_command(cfg, f"train_{task}.py"),
        **extra,
    )


COMPARE_KINDS = ("compare", "eval")  # this script's results files (eval.py wrote the older ones)
RUN_FILE = r"config\.json|log\.jsonl|tokenizer\.json|ckpt.*\.pt"  # a run folder's files


def results_target(path, kinds, runs=None, overwrite=False):
    """The results file `path` a command of `kinds` (its modules) may write, as read ({} if none).
    Refused: a run folder's file, another command's file, and (runs: the names to write) one that
    would lose runs."""
    in_run = os.path.exists(os.path.join(os.path.dirname(os.path.abspath(path)), "config.json"))
    if in_run or re.fullmatch(RUN_FILE, os.path.basename(path)):
        raise SystemExit(f"--results {path}: a run folder's file; write results outside runs")
    if not os.path.exists(path):
        return {}
    saved = read_results(path, "--results", records=False)  # a study's records: its own keys
    command = saved.get("command")
    listed = isinstance(command, list) and command  # a reanalysis: its commands
    first = str(command[0] if listed else command)
    kind = "|".join(kinds)
    ours = rf"(\S+=\S* )*python3? (-m studies\.|\S*/)?({kind})\b"  # python -m studies.K, K.py
    if not re.match(ours, first):
        raise SystemExit(
            f"--results {path}: written by another command ({first[:60]}); give "
            f"this one its own file"
        )
    held = saved.get("runs") if isinstance(saved.get("runs"), dict) else {}
    lost = sorted(set(held) - set(runs if runs is not None else held))
    if lost and not overwrite:
        some = ", ".join(lost[:3])
        raise SystemExit(
            f"--results {path}: holds {len(lost)} runs this would drop ({some}); give "
            f"another file, or add --overwrite to replace it"
        )
    return saved


def write_evidence(path, result, kinds, overwrite=False):
    """Write a results file (result: its dict, with runs) where results_target allows it."""
    results_target(path, kinds, result["runs"], overwrite)
    runlib.write_json(path, result)


def write_results(path, metrics, configs, folders, comparisons, argv, overwrite=False):
    """A results file: run_record per run (+ gradient parts, NMT's BLEU over training), the command,
    comparisons."""
    runs = {label: run_record(m, configs[folders[label]]) for label, m in metrics.items()}
    for label, m in metrics.items():
        valid = ev.log_records(folders[label])
        if parts := [
            {k: v for k, v in r.items() if k in ("step", "grad_parts", "norm_groups")}
            for r in valid
            if "grad_parts" in r
        ]:
            runs[label]["gradient_parts"] = parts
        # NMT: BLEU over training and the test records training wrote (last checkpoint, average)
        if "bleu" in m:
            runs[label]["valid_bleu"] = {r["step"]: r["bleu"] for r in valid if "bleu" in r}
            runs[label]["training_test_bleu"] = {
                r["split"]: r["bleu"]
                for split in ("test", "test_averaged")
                for r in ev.log_records(folders[label], split)[-1:]
            }
    command = shlex.join(["python", "-m", "studies.compare", *repo_relative(argv)])
    result = dict(command=command, runs=runs, compare=comparisons)
    write_evidence(path, result, COMPARE_KINDS, overwrite)


def record_config(record):
    """The part of a config that pair_difference reads, from a results record (threads: else its
    command's)."""
    command, threads = record.get("command") or "", record.get("threads")
    if threads is None and (given := re.match(r"OMP_NUM_THREADS=(\d+) ", command)):
        threads = int(given.group(1))
    return dict(
        seed=record["seed"],
        task=record.get("task") or ("nmt" if "train_nmt.py" in command else "lm"),
        data_fingerprint=record.get("data_fingerprint"),
        vocab_size_actual=record.get("vocab_size_actual"),
        versions=dict(threads=threads, kernels=record.get("kernels")),
    )


# what a results record is besides its name: its data and split (one a file), then its settings
DATA_KEYS = (
    "task",
    "data_fingerprint",
    "vocab_size_actual",
    "dataset",
    "split_seed",
    "split",
    "tokens",
    "rows",
)
RUN_IDENTITY = DATA_KEYS + (
    "method",
    "seed",
    "lr",
    "warmup",
    "max_steps",
    "preset",
    "tokens_per_step",
    "method_hparams",
    "optimizer",
    "untie",
    "weight_decay",
    "embedding_weight_decay",
    "train_fraction",
    "method_rare_share",
)


def record_difference(a, b, keys):
    """The first of `keys` two results records hold with other values ("key (x vs y)"), or None;
    a value one lacks is not compared; task: else the command's."""
    for key in keys:
        x, y = (record_config(r)["task"] if key == "task" else r.get(key) for r in (a, b))
        if x is None or y is None or x == y:
            continue
        moved = runlib.same_data(str(x), str(y)) or runlib.same_data(str(y), str(x))
        if not (key == "data_fingerprint" and moved):
            return f"{key} ({x} vs {y})"
    return None


def held_run(runs, name, record, variant):
    """The run of `runs` an added record stands for: the one of its name, else of its variant and
    seed, or None."""
    if name in runs:
        return name
    wanted = (variant, record["seed"])
    same = [k for k, r in runs.items() if (r.get("variant", r["method"]), r["seed"]) == wanted]
    return same[0] if same else None


def variant_of(record, variants):
    """The variant of a results file an added run belongs to: its own, else the only one its
    settings match."""
    own, hparams = record.get("variant", record["method"]), record.get("method_hparams") or {}

    def holds(key, value):
        return str(record[key] if key in record else hparams.get(key)) == value

    fits = [
        v
        for v in variants
        if v.split()[0] == record["method"]
        and all(holds(*x.partition("=")[::2]) for x in v.split()[1:])
    ]
    return own if own in variants or len(fits) != 1 else fits[0]


def read_results(path, flag, records=True):
    """A results file of runs (records: each with its method and seed), or one line why not."""
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"{flag} {path}: cannot read it as JSON ({getattr(e, 'strerror', None) or e})"
        )
    if (
        not isinstance(res, dict)
        or records
        and isinstance(res.get("runs"), dict)
        and not all(
            isinstance(r, dict) and "seed" in r and "method" in r for r in res["runs"].values()
        )
    ):
        raise SystemExit(
            f"{flag} {path}: not a results file of runs (records with their method and seed)"
        )
    return res


def reanalyse(path, add=()):
    """Recompute a results file's comparisons from its records, in place; add: files whose runs join
    (a rerun replaces its name's); what needs the run folders (BLEU bootstraps, the rare-type split)
    is kept while its pairs are."""
    res = read_results(path, "--reanalyse")
    if not isinstance(res.get("runs"), dict) or not all(
        "base" in e and "cand" in e and "unpaired" not in e for e in res.get("compare") or []
    ):
        raise SystemExit(
            f"--reanalyse {path}: not a file of this script's comparisons (a study's file: rerun "
            f"the study with --no-train to rewrite it)"
        )

    def variant(r):
        return r.get("variant", r["method"])

    runs, replaced = res["runs"], set()
    commands = [res["command"]] if isinstance(res["command"], str) else list(res["command"])
    for other in add:
        more = read_results(other, "--add")
        known = {variant(r) for r in runs.values()}
        for k, r in more["runs"].items():
            held = held_run(runs, k, r, variant_of(r, known))
            keys = RUN_IDENTITY if held else DATA_KEYS  # a rerun is its run; a new one: the data
            problem = record_difference(runs[held] if held else next(iter(runs.values())), r, keys)
            if problem:
                its = f"the run {held} of {path}" if held else f"the runs of {path}"
                raise SystemExit(
                    f"--add {other}: its run {k} and {its} differ in {problem}: a results file "
                    "holds one task, corpus and split, and a rerun replaces only its own run"
                )
            old = runs.pop(held) if held else None
            runs[k] = dict(r, variant=variant(old) if held else variant_of(r, known))
            if held and old != runs[k]:
                replaced.add((runs[k]["variant"], r["seed"]))
        commands.append(more["command"])
        boots = {
            (e["base"], e["cand"]): e.get("bleu_paired_bootstrap") or []
            for e in more.get("compare") or []
        }
        for entry in res.get("compare") or []:
            new = {b["seed"]: b for b in boots.get((entry["base"], entry["cand"]), [])}
            kept = [
                b
                for b in entry.get("bleu_paired_bootstrap") or []
                if b["seed"] not in new
                and (entry["base"], b["seed"]) not in replaced
                and (entry["cand"], b["seed"]) not in replaced
            ]
            if "bleu_paired_bootstrap" in entry or new:
                entry["bleu_paired_bootstrap"] = sorted(
                    kept + list(new.values()), key=lambda b: b["seed"]
                )
    configs, variants = (
        {k: record_config(r) for k, r in runs.items()},
        {k: variant(r) for k, r in runs.items()},
    )
    for entry in res.get("compare") or []:
        comparable_pairs([(entry["base"], entry["cand"])], configs, variants)
        new = compare(
            {k: dict(r, variant=variants[k]) for k, r in runs.items()},
            {},
            entry["base"],
            entry["cand"],
            [],
        )
        if new["seeds"] != entry["seeds"] or any(
            (v, s) in replaced for v in (entry["base"], entry["cand"]) for s in new["seeds"]
        ):
            entry.pop("rare_types", None)
        entry.update(
            {k: v for k, v in new.items() if k not in ("rare_types", "bleu_paired_bootstrap")}
        )
    res["command"] = commands[0] if len(commands) == 1 else commands
    res["reanalysis_command"] = shlex.join(
        ["python", "-m", "studies.compare", "--reanalyse", os.path.relpath(path, runlib.ROOT)]
    )
    runlib.write_json(path, res)
    return res


# -------------------------------------------------------------------------------------------- plots
def save(fig, path, rect=None):  # tight layout (the axes within rect), the PNG, the figure closed
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_singular_values(spectra, path):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, s in spectra.items():
        ax.plot(np.arange(1, len(s) + 1), s, label=label)
    ax.set(
        xlabel="index",
        ylabel="normalised singular value",
        title="Singular values of the tied embedding",
    )
    ax.legend(fontsize=8)
    return save(fig, path)


def scatter_groups(ax, x, y, gid, title):  # AGG Fig. 1's colours; gid -1: not drawn
    for g in (2, 1, 0):  # frequent drawn last, on top
        ax.scatter(
            x[gid == g],
            y[gid == g],
            s=2,
            alpha=0.5,
            c=("tab:blue", "tab:green", "tab:red")[g],
            label=agg.GROUPS[g],
            rasterized=True,
        )
    ax.set_title(title)


def snapshot_weight(path):  # a snapshot's embedding (train_lm.py --snapshot-steps), loaded as data
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["weight"]
    except Exception as e:
        why = runlib.load_error(e)
        raise SystemExit(f"{path}: not a snapshot of this project ({why}); remove it, then rerun")


def plot_svd(rows, path, title):
    """AGG Fig. 1/3: W on its top two right singular vectors (uncentred). rows: {row: [(title, W or
    file, gid)]}."""
    n_col = max(len(panels) for panels in rows.values())
    fig, axes = plt.subplots(len(rows), n_col, figsize=(4 * n_col, 4 * len(rows)), squeeze=False)
    for row, panels in zip(axes, rows.values()):
        for ax, (name, W, gid) in zip(row, panels):
            W = snapshot_weight(W) if isinstance(W, str) else W
            W = W.detach().double().cpu()
            P = (W @ torch.linalg.svd(W, full_matrices=False)[2][:2].T).numpy()
            scatter_groups(ax, P[:, 0], P[:, 1], gid.numpy(), name)
            ax.set_aspect("equal", adjustable="datalim")
        for ax in row[len(panels) :]:
            ax.axis("off")
    axes[0][0].legend(markerscale=5, fontsize=8)
    fig.suptitle(f"{title} (red rare, green medium, blue frequent)")
    return save(fig, path)


def plot_output_bias(biases, counts, path):
    """The learned output bias against the log train count (seen tokens)."""
    fig, axes = plt.subplots(
        1, len(biases), figsize=(4 * len(biases), 3.6), squeeze=False, sharey=True
    )
    for ax, (label, b) in zip(axes[0], biases.items()):
        c = torch.as_tensor(counts[label]).double()
        gid = torch.where(c > 0, ev.group_index(counts[label])[0], -1).numpy()
        scatter_groups(ax, c.log().numpy(), b.double().numpy(), gid, label)
        ax.set_xlabel("log train count")
    axes[0][0].set_ylabel("learned output bias")
    axes[0][0].legend(markerscale=5)
    fig.suptitle("Learned output bias against token frequency (--output-bias)")
    return save(fig, path)


def by_variant(folders, variants, key, split="valid"):
    """[(variant, colour, [the `split` records of each of its runs])], of the runs whose records
    carry `key`."""
    out = {}
    for label, d in folders.items():
        if recs := [r for r in ev.log_records(d, split) if key in r]:
            out.setdefault(variants[label], []).append(recs)
    colours = plt.get_cmap("tab20" if len(out) > 10 else "tab10")
    return [
        (variant, colours(i % colours.N), runs) for i, (variant, runs) in enumerate(out.items())
    ]


def seed_curve(ax, runs, key, colour, label, band=True, **style):
    """The mean over a variant's runs of the record value key ("a.b") at the steps all logged, with
    a min-max band."""
    steps = sorted(set.intersection(*({r["step"] for r in recs} for recs in runs)))
    values = np.array([[get({r["step"]: r for r in recs}[s], key) for s in steps] for recs in runs])
    ax.plot(steps, values.mean(0), label=label, color=colour, lw=style.pop("lw", 1), **style)
    if band and len(runs) > 1:
        ax.fill_between(steps, values.min(0), values.max(0), color=colour, alpha=0.2, lw=0)


def plot_training_curves(folders, variants, path):
    """AGG Fig. 2: the valid records over training per variant, a dotted line at freeze-rare's
    release step."""
    if not (groups := by_variant(folders, variants, "isotropy_groups")):
        return None
    keys = [
        ("isotropy_groups.freq", "I(W) frequent"),
        ("isotropy_groups.med", "I(W) medium"),
        ("isotropy_groups.rare", "I(W) rare"),
        ("cosine_rare_freq", "cos(rare, frequent)"),
        ("ppl", "valid PPL"),
    ]
    # NMT: the seeds' spread
    if all("bleu" in r for _, _, runs in groups for recs in runs for r in recs):
        keys.append(("bleu", "valid BLEU"))
    release = {
        variants[k]: until
        for k, d in folders.items()
        if (until := (runlib.run_config(d) or {}).get("method_hparams", {}).get("until"))
        is not None
    }
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.4))
    for ax, (key, title) in zip(axes, keys):
        for variant, colour, runs in groups:
            if variant in release:
                ax.axvline(release[variant], color=colour, ls=":", lw=1)
            seed_curve(
                ax,
                runs,
                key,
                colour,
                f"{variant} (mean of {len(runs)})"
                if len(runs) > 1
                else next(k for k in folders if variants[k] == variant),
            )
        ax.set(title=title, xlabel="step", yscale="log" if key == "ppl" else "linear")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        fontsize=6,
        loc="lower center",
        ncol=min(len(groups), 7),
        frameon=False,
    )
    fig.suptitle("Validation records over training (AGG Fig. 2)")
    return save(fig, path, (0, 0.06 + 0.03 * ((len(groups) - 1) // 7), 1, 1))


def plot_gradient_parts(folders, variants, path):
    """AGG Eq. 4 over training: the mean row norm of the gradient's parts (a), (b), (c) per
    group."""
    if not (groups := by_variant(folders, variants, "grad_parts")):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    for ax, group in zip(axes, agg.GROUPS):
        for variant, colour, runs in groups:
            for part, ls in zip("abc", ("--", "-", ":")):
                seed_curve(
                    ax,
                    runs,
                    f"grad_parts.{part}.{group}",
                    colour,
                    f"{variant} {part}" if group == "rare" else None,
                    band=False,
                    ls=ls,
                    lw=1.2,
                )
        ax.set(yscale="log", title=f"{group} rows", xlabel="step")
    axes[0].set_ylabel("mean row norm of the part")
    # beside the axes: many methods fit
    fig.legend(loc="center right", fontsize=6, ncol=1 + len(groups) // 6)
    fig.suptitle(
        "Parts of the embeddings' gradient (AGG Eq. 4): (a) dashed, (b) solid, (c) dotted, as each "
        "method applies them"
    )
    return save(fig, path, (0, 0, 0.93 - 0.08 * (len(groups) // 6), 1))


def plot_rare_share(folders, variants, path):
    """AGG Fig. 4: the method's rare group (share of the vocabulary) over training, from the train
    records."""
    if not (groups := by_variant(folders, variants, "method_rare_fraction", "train")):
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for variant, colour, runs in groups:
        seed_curve(
            ax,
            runs,
            "method_rare_fraction",
            colour,
            f"{variant} ({len(runs)} runs)",
            band=False,
            lw=1.2,
        )
    ax.set(
        xscale="log",
        xlabel="optimizer step",
        ylabel="rare group / vocabulary",
        title="Size of the rare group over training (AGG Fig. 4)",
    )
    ax.legend()
    return save(fig, path)


# ------------------------------------------------------------------------------------------- report
def md_cell(s):
    return str(s).replace("|", "\\|").replace("\n", " ⏎ ").strip()


# the tables over variants (report.md, studies.grid): {metric: (header, decimals)}
COLUMNS = {
    **{f"ppl_groups.{g}": (f"PPL {g}", 2) for g in G},
    "ppl": ("PPL", 2),
    "rare_bias.ppl": ("PPL calibrated", 2),
    "rare_bias.ppl_groups.rare": ("PPL rare calibrated", 2),
    **{f"uniq_groups.{g}": (f"Uniq {g}", 1) for g in G},
    "uniq": ("Uniq", 1),
    **{f"isotropy_groups.{g}": (f"I(W) {g}", 3) for g in G},
    "isotropy": ("I(W)", 3),
    "mean_cosine": ("mean cos", 3),
    "mean_cosine_groups.rare": ("cos rare", 3),
    "word_similarity.ws353": ("WS353", 3),
    "word_similarity.simlex999": ("SimLex", 3),
    "gen_uniq": ("Uniq per sample", 1),
    "gen_rep4": ("seq-rep-4", 3),
    "bleu": ("BLEU", 2),
    "test_ppl": ("test PPL", 2),
    "group_rare_mass_pred": ("rare mass pred", 4),
    "group_rare_mass_true": ("rare mass true", 4),
}


def table(header, rows):
    def row(cells):
        return "| " + " | ".join(map(str, cells)) + " |"

    return [row(header), "|" + " --- |" * len(header), *map(row, rows), ""]


# a variant's summary at COLUMNS key: "mean ± std" over its runs (one run: its value), or "-"
def cell(summary, key):
    node, nd = get(summary, key), COLUMNS[key][1]
    return (
        ev.fmt(node["mean"], nd) + (f" ± {ev.fmt(node['std'], nd)}" if summary["n"] > 1 else "")
        if node
        else "-"
    )


def write_report(path, metrics, args, argv, summary, comparisons, plots):
    cols = [k for k in COLUMNS if any(get(s, k) for s in summary.values())]
    L = [
        "# Evaluation report",
        "",
        f"`{shlex.join(['python', '-m', 'studies.compare', *argv])}`",
        "",
        f"Checkpoint: {args.checkpoint} "
        f"({'ckpt.pt' if args.checkpoint == 'last' else 'ckpt_best.pt'}).",
        "",
        "## Mean ± std over the runs (seeds) of each variant (groups: 30% frequent / 50% medium / "
        "20% rare by train counts)",
        "",
        *table(
            ["variant", "n", *(COLUMNS[k][0] for k in cols)],
            [[v, s["n"], *(cell(s, k) for k in cols)] for v, s in summary.items()],
        ),
    ]
    if h := next((m for m in metrics.values() if "uniq_human" in m), None):
        L += [
            f"Human text ({h['split']} split): Uniq {h['uniq_human']} ("
            + ", ".join(f"{g} {h['uniq_human_groups'][g]}" for g in G)
            + f"), Uniq per sample {ev.fmt(h['gen_uniq_human'], 1)}, "
            f"seq-rep-4 {ev.fmt(h['gen_rep4_human'], 3)}. Word similarity, pairs used / total: "
            + "; ".join(f"{n} {u}/{t}" for n, (u, t) in h["word_similarity_pairs"].items())
            + ".",
            "",
        ]
    for c in comparisons:
        rows = []
        for key, r in c["metrics"].items():

            def shown(x):  # a log ratio as the ratio, a difference signed
                return f"x{math.exp(x):.3f}" if r["log_ratio"] else f"{x:+.4g}"

            def interval(name):
                return f"[{shown(r[name][0])}, {shown(r[name][1])}]" if name in r else "-"

            rows.append(
                [
                    key,
                    ev.fmt(float(np.mean(r["base"])), 3),
                    ev.fmt(float(np.mean(r["cand"])), 3),
                    shown(r["mean"]),
                    interval("t95"),
                    interval("boot95"),
                    interval("seed_article_boot95"),
                    shown(r["median"]),
                    ev.fmt(r.get("p", float("nan")), 3),
                ]
            )
        L += [
            f"## Paired comparison: {c['cand']} against {c['base']} (seeds "
            f"{', '.join(map(str, c['seeds']))})",
            "",
            *table(
                [
                    "metric",
                    "base (mean)",
                    "cand (mean)",
                    "change",
                    "95% t interval",
                    "95% bootstrap",
                    "95% seeds x articles",
                    "median",
                    "p (paired t)",
                ],
                rows,
            ),
        ]
        if t := c.get("rare_types"):
            L += [
                f"Rare PPL ratio x{t['ratio']:.3f}, type bootstrap "
                f"[x{t['ratio_type_boot95'][0]:.3f}, "
                f"x{t['ratio_type_boot95'][1]:.3f}], {t['targets']} targets of {t['types']} types; "
                f"gap share of the top type {t['share_top1']:.0%}, top 10 {t['share_top10']:.0%} ("
                + ", ".join(
                    f"{md_cell(repr(x['token']))} {x['share']:.0%} of {x['targets']}"
                    for x in t["top"]
                )
                + ").",
                "",
            ]
        if "bleu_paired_bootstrap" in c:
            L += [
                "BLEU, paired bootstrap per seed (cand - base): "
                + "; ".join(
                    f"seed {x['seed']}: {x['diff']:+.2f} [{x['boot95'][0]:+.2f}, "
                    f"{x['boot95'][1]:+.2f}], p {x['p']:.3f}"
                    for x in c["bleu_paired_bootstrap"]
                )
                + ".",
                "",
            ]
        if s := c.get("free_baseline_share"):
            L += [
                f"Share of the rare-PPL gain that calibrating {c['base']} gets: {s['mean']:.0%} "
                "(per seed: " + ", ".join(f"{x:.0%}" for x in s["per_seed"]) + ").",
                "",
            ]
    L += [
        "## Top-5 cosine neighbours of rare tokens (AGG Tables 12-13; * = neighbour in the rare "
        "group)",
        "",
    ]
    for k, m in metrics.items():
        L += [f"**{k}**", ""] + table(
            ["token", "top-5 neighbours"],
            [[md_cell(t), ", ".join(md_cell(n) for n in ns)] for t, ns in m["neighbours"].items()],
        )
    L += ["## Plots", ""] + [
        f"![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in plots if p
    ]
    runlib.write_text(path, "\n".join(L))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ev.build_parser(__doc__, runs="*")
    p.add_argument(
        "--compare",
        nargs=2,
        action="append",
        default=[],
        metavar=("BASE", "CAND"),
        help="paired comparison of two variants (as in summary.json) over their common seeds -> "
        "compare.json (repeatable; default for two variants: the two, mle as the base)",
    )
    p.add_argument(
        "--results", metavar="FILE", help="also write FILE: every run's record and the comparisons"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="let --results replace a file holding other runs"
    )
    p.add_argument(
        "--reanalyse",
        metavar="FILE",
        help="recompute a results file's comparisons from its run records",
    )
    p.add_argument(
        "--add",
        nargs="+",
        default=[],
        metavar="FILE",
        help="with --reanalyse: results files whose runs join FILE's (a rerun replaces the run of "
        "its name)",
    )
    args = p.parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.add)
    if args.add:
        raise SystemExit("--add goes with --reanalyse FILE (the results file the runs join)")
    if not args.out_dirs:
        raise SystemExit("give run folders (or --reanalyse RESULTS.json)")
    real = [os.path.realpath(d) for d in args.out_dirs]
    for d in [d for i, d in enumerate(args.out_dirs) if real[i] in real[:i]][:1]:
        raise SystemExit(f"{d}: this run folder is given twice (under two paths): each run once")
    for base, cand in [pair for pair in args.compare if pair[0] == pair[1]][:1]:
        raise SystemExit(f"--compare {base} {cand}: compare two different variants")
    if args.results:  # a file it may not write fails before any long work, as a bad folder or flag
        results_target(args.results, COMPARE_KINDS, ev.labels_for(args.out_dirs), args.overwrite)
    configs = ev.read_configs(args)
    variants = variant_names(configs)
    names = list(dict.fromkeys(variants[d] for d in args.out_dirs))  # in the order given
    seeds = [{configs[d].get("seed") for d in args.out_dirs if variants[d] == v} for v in names]
    default = not args.compare and len(names) == 2 and bool(seeds[0] & seeds[1])
    # mle first, or as given
    args.compare = [sorted(names, key=lambda v: v != "mle")] if default else args.compare
    # every variant compared is run
    for v in [v for pair in args.compare for v in pair if v not in names][:1]:
        raise SystemExit(
            f"--compare: no run of variant {v!r}; variants here: {', '.join(sorted(names))}"
        )
    args.compare = comparable_pairs(args.compare, configs, variants, default)
    results = ev.evaluate_runs(args)
    folders = dict(zip(ev.labels_for(args.out_dirs), args.out_dirs))
    variants = {label: variants[d] for label, d in folders.items()}
    metrics = {
        label: dict(res["metrics"], variant=variants[label]) for label, res in results.items()
    }
    summary = summarise(metrics)
    type_stats, texts = (
        {k: r[key] for k, r in results.items() if key in r} for key in ("type_stats", "texts")
    )
    comparisons = [
        compare(
            metrics, type_stats, base, cand, next(iter(results.values()))["tokens"], texts=texts
        )
        for base, cand in args.compare
    ]

    def out(name):
        return os.path.join(args.out, name)

    for name, data in (("metrics", metrics), ("summary", summary), ("compare", comparisons)):
        if data:  # compare.json only with comparisons
            runlib.write_json(out(f"{name}.json"), data)
    if args.results:
        write_results(args.results, metrics, configs, folders, comparisons, argv, args.overwrite)
    gid = {k: ev.group_index(r["counts"])[0] for k, r in results.items()}
    snapshots = {}  # train_lm.py's --snapshot-steps
    for k, d in folders.items():
        for step in configs[d].get("snapshot_steps") or []:
            path = os.path.join(d, "snapshots", f"emb_{step}.pt")
            if os.path.exists(path):
                snapshots.setdefault(k, []).append((f"{k} step {step}", path, gid[k]))
    biases = {k: r["out_bias"] for k, r in results.items() if r["out_bias"] is not None}
    with plt.rc_context(
        {"axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7, "figure.titlesize": 9}
    ):
        plots = [
            plot_singular_values(
                {k: m["singular_values"] for k, m in metrics.items()}, out("singular_values.png")
            ),
            plot_svd(
                {"": [(k, r["weight"], gid[k]) for k, r in results.items()]},
                out("svd_projection.png"),
                "2-D SVD projection of the tied embedding",
            ),
            # AGG Fig. 1 over time: one row per run
            snapshots
            and plot_svd(
                snapshots, out("svd_over_time.png"), "Embeddings over training: 2-D SVD projection"
            ),
            plot_training_curves(folders, variants, out("training_curves.png")),
            plot_gradient_parts(folders, variants, out("gradient_parts.png")),
            plot_rare_share(folders, variants, out("rare_share.png")),
            biases
            and plot_output_bias(
                biases, {k: results[k]["counts"] for k in biases}, out("output_bias.png")
            ),
        ]
    write_report(out("report.md"), metrics, args, argv, summary, comparisons, plots)
    print(f"wrote {args.out}/metrics.json, summary.json, report.md and plots")
    return metrics


if __name__ == "__main__":
    main()
