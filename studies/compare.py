"""Many runs side by side: summaries over seeds, paired comparisons, results files, report.md and plots.

    python -m studies.compare out/lm-mle-s0 out/lm-agg-s0 --compare mle agg --out out/report
    python -m studies.compare --reanalyse results/nmt_table.json --add out/nmt/nmt_s3.json

Evaluates each run folder with eval.evaluate (one at a time; eval.py's flags) and writes REPORT/metrics.json ({run
label: metrics}), REPORT/summary.json (mean and std over the seeds of each variant: the runs of one experiment, see
variant_names), REPORT/compare.json (variants paired by seed: intervals, TOST equivalence, the rare-PPL gap over
types and articles, NMT's paired BLEU bootstrap), REPORT/report.md and the plots; --results FILE: every run's
record (run_record: metrics, settings, the command that trained it) and the comparisons, for results/;
--reanalyse FILE: a results file's comparisons recomputed from its records alone.
"""
import functools
import json
import math
import os
import re
import shlex
import statistics
import sys

import matplotlib
import numpy as np
import torch
from scipy import stats

import agg
import eval as ev
import runlib
import train_lm
import train_nmt

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

fmt = ev.fmt
GROUP_COLOURS = {"freq": "tab:blue", "med": "tab:green", "rare": "tab:red"}  # as AGG Fig. 1
SCRIPTS = {"lm": train_lm, "nmt": train_nmt}


# --------------------------------------------------------------------------------------------- the same experiment
# config keys that do not make two runs different experiments: the seed, where the data lies (data_fingerprint, the
# hash of the corpus and tokenizer, tells corpora apart), the run-control keys of the task's script
# (runlib.RUN_CONTROL), and a flag that rare_rule tells
NOT_AN_EXPERIMENT = {"seed", "data_dir", "source_only_rare"}


@functools.cache
def flag_defaults(task):
    """{config key: default} of the training flags of task's script: what a run saved before a flag existed ran."""
    return vars(SCRIPTS[task].build_parser().parse_args([]))


def variant_names(configs):
    """{run: variant} for runs given as {run: config}, the one definition of "the same experiment" in every study:
    the run's method, or, where runs of one method differ in more than their seed, the method followed by the
    settings that tell them apart (e.g. 'ul+agg gate_ul=False'), so runs of different experiments are never averaged
    or paired. A method flag left unset shows the method's default."""
    task = lambda cfg: cfg.get("task", "lm")

    def setting(cfg, key):
        if key == "rare_rule" and cfg.get("task") == "nmt":
            return train_nmt.rare_rule(cfg)  # also of a config saved before --rare-rule
        value = cfg[key] if key in cfg else flag_defaults(task(cfg)).get(key)  # a run saved before the flag
        if value is None:
            return getattr(agg.METHODS.get(cfg.get("method")), "defaults", {}).get(key)
        return value

    by_method = {}
    for run, cfg in configs.items():
        by_method.setdefault(cfg.get("method", "?"), []).append(run)
    names = {}
    for method, runs in by_method.items():
        flags = {k for r in runs for k in flag_defaults(task(configs[r]))}
        control = set().union(*(SCRIPTS[task(configs[r])].RUN_CONTROL for r in runs)) | NOT_AN_EXPERIMENT
        keys = sorted(({k for r in runs for k in configs[r]} & (flags | {"task", "rare_rule", "data_fingerprint"}))
                      - control)
        differ = [k for k in keys if len({repr(setting(configs[r], k)) for r in runs}) > 1]
        for r in runs:
            names[r] = method + "".join(f" {k}={setting(configs[r], k)}" for k in differ)
    return names


SUMMARY_SKIP = {"step", "tokens", "rows", "rows_groups", "seed", "uniq_human", "uniq_human_groups", "gen_uniq_human",
                "gen_rep4_human", "n_sentences", "beam", "lenpen", "word_similarity_pairs", "singular_values"}


def summarise(metrics):
    """{variant: {"n": runs, METRIC: {"mean", "std", "median"}, GROUPED_METRIC: {group: {...}}}} over the runs of
    each variant (its seeds): every numeric metric and every dict of numeric metrics (std with ddof 1; 0 for one
    run)."""
    def stat(values):
        t = torch.tensor(values, dtype=torch.float64)
        return {"mean": float(t.mean()), "std": float(t.std()) if len(t) > 1 else 0.0,
                "median": statistics.median(values)}

    def numeric(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def nested(runs, key):  # a dict of numbers or of such dicts: summarised leaf by leaf
        out = {}
        for k, v in runs[0][key].items():
            if numeric(v):
                out[k] = stat([r[key][k] for r in runs])
            elif isinstance(v, dict) and v:
                out[k] = nested([r[key] for r in runs], k)
        return out

    by_variant = {}
    for m in metrics.values():
        by_variant.setdefault(m.get("variant", m.get("method", "?")), []).append(m)
    out = {}
    for variant, runs in by_variant.items():
        s = out[variant] = {"n": len(runs)}
        for key, value in runs[0].items():
            if key in SUMMARY_SKIP or isinstance(value, bool):
                continue
            if numeric(value):
                s[key] = stat([r[key] for r in runs])
            elif isinstance(value, dict) and value and nested(runs, key):
                s[key] = nested(runs, key)
    return out


def get(record, dotted):
    """record["a"]["b"] for "a.b", or None."""
    for part in dotted.split("."):
        if not isinstance(record, dict) or part not in record:
            return None
        record = record[part]
    return record


# ------------------------------------------------------------------------------------------------ paired statistics
COMPARE_KEYS = ("ppl", "ppl_groups.freq", "ppl_groups.med", "ppl_groups.rare", "valid_ppl", "uniq", "uniq_groups.rare",
                "isotropy", "isotropy_groups.freq", "isotropy_groups.med", "isotropy_groups.rare", "mean_cosine", "mean_row_share",
                "mean_cosine_groups.rare", "isoscore", "isotropy_centered", "isotropy_weighted", "isotropy_weighted_centered",
                "undertrained.count", "gen_rep4", "gen_rep4_sampled",
                "rare_bias.ppl", "rare_bias.ppl_groups.rare", "temperature.t", "temperature.ppl",
                "temperature.ppl_groups.rare", "rare_argmax.rare_argmax_precision",
                "rare_argmax.rare_argmax_recall", "word_similarity.ws353", "word_similarity.simlex999",
                # NMT: BLEU, test PPL and the target side (train_nmt.validate's "target")
                "bleu", "test_ppl", "target.ppl_groups.freq", "target.ppl_groups.med", "target.ppl_groups.rare",
                "target.rare_mass_pred", "target.uniq", "target.uniq_groups.rare", "target.rare_recall",
                "target.rare_precision", "target.isotropy", "target.isotropy_groups.rare", "target.mean_cosine",
                "target.cosine_rare_freq")


def paired_interval(diffs, n_boot=10000, seed=0):
    """Mean of paired differences with its 95% t interval, percentile bootstrap interval and paired t-test p-value,
    the median difference, and min_detectable: the smallest true mean difference this many pairs detect with 80%
    power at a two-sided 5% level, given the differences' spread ((t_.975 + t_.8) sd / sqrt(n))."""
    d = np.asarray(diffs, dtype=np.float64)
    out = dict(n=len(d), mean=float(d.mean()), median=float(np.median(d)), diffs=d.tolist())
    if len(d) > 1:
        se = d.std(ddof=1) / math.sqrt(len(d))
        half = float(stats.t.ppf(0.975, len(d) - 1) * se)
        boot = np.random.default_rng(seed).choice(d, (n_boot, len(d))).mean(1)
        out.update(t95=[out["mean"] - half, out["mean"] + half], boot95=np.percentile(boot, [2.5, 97.5]).tolist(),
                   p=float(stats.ttest_1samp(d, 0).pvalue) if d.std() > 0 else float("nan"),
                   min_detectable=float((stats.t.ppf(0.975, len(d) - 1) + stats.t.ppf(0.8, len(d) - 1)) * se))
    return out


def pair_difference(a, b):
    """What makes two runs (their configs) unfit to pair, or None: another task, other data (corpus or tokenizer, the
    data fingerprint), another vocabulary size, another thread count or another host's kernels (CPU results depend
    on both: runlib.kernel_fingerprint). A value one of the configs does not record is not compared."""
    values = {"task": lambda c: c.get("task"), "data": lambda c: c.get("data_fingerprint"),
              "vocabulary size": lambda c: c.get("vocab_size_actual"),
              "thread count": lambda c: (c.get("versions") or {}).get("threads"),
              "host kernels": lambda c: (c.get("versions") or {}).get("kernels")}
    for what, value in values.items():
        x, y = value(a), value(b)
        same = runlib.same_data(x, y) or runlib.same_data(y, x) if what == "data" else x == y
        if x is not None and y is not None and not same:
            return f"{what} ({x} vs {y})"
    return None


def pair_problem(configs, variants, base, cand):
    """The first pair of runs (the same seed, variants `base` and `cand`) that cannot be compared, said in one line;
    None when every pair can. configs and variants: {run: config}, {run: variant name}."""
    runs = {v: {c.get("seed"): r for r, c in configs.items() if variants[r] == v} for v in (base, cand)}
    for s in sorted(set(runs[base]) & set(runs[cand]), key=str):
        a, b = runs[base][s], runs[cand][s]
        diff = pair_difference(configs[a], configs[b])
        if diff:
            return (f"the runs of seed {s} ({a}, {b}) differ in {diff}; paired runs must share the task, the data, "
                    f"the vocabulary, the thread count and the host")
    return None


def comparable_pairs(pairs, configs, variants, default):
    """The --compare pairs whose runs can be paired (pair_problem). A pair given with --compare that cannot is
    refused in one line; the default pair (two variants, no --compare) is dropped with a note instead, since runs
    on other data may still be evaluated side by side."""
    keep = []
    for base, cand in pairs:
        problem = pair_problem(configs, variants, base, cand)
        if problem and not default:
            raise SystemExit(f"--compare {base} {cand}: {problem}")
        if problem:
            print(f"no paired comparison of {cand} against {base}: {problem}")
        else:
            keep.append([base, cand])
    return keep


def compare(metrics, type_stats, base, cand, tokens, n_boot=10000, seed=0, texts=None, configs=None):
    """Variant `cand` against variant `base` over the seeds both have (pairs share a seed, hence the init and the
    data order): per metric the paired differences (cand - base; PPLs as log ratios, so exp(mean) is the geometric
    mean ratio) with intervals; for LM runs the rare-PPL gap split over the rare target types (pooled over the
    pairs: what share the top types carry) with a type-level bootstrap interval of the rare-PPL ratio, and the share
    of cand's rare-PPL gain that base gains from one bias on the rare logits fitted on valid (the free baseline);
    for NMT runs (texts: {label: test hypotheses and references}) the paired bootstrap of BLEU over test sentences
    for each seed (train_nmt.paired_bleu). configs ({label: config}), when given: pairs that cannot be compared
    (pair_problem: other data, vocabulary, task or thread count) are refused."""
    runs = {v: {m["seed"]: k for k, m in metrics.items() if m.get("variant") == v} for v in (base, cand)}
    for v in (base, cand):
        if not runs[v]:
            raise SystemExit(f"--compare: no run of variant {v!r}; variants here: "
                             f"{', '.join(sorted({m.get('variant') for m in metrics.values()}))}")
    problem = configs and pair_problem(configs, {k: m.get("variant") for k, m in metrics.items()}, base, cand)
    if problem:
        raise SystemExit(f"--compare {base} {cand}: {problem}")
    seeds = sorted(set(runs[base]) & set(runs[cand]))
    if not seeds:
        raise SystemExit(f"--compare {base!r} {cand!r}: no seed in common; give runs of both with the same --seed")
    pairs = [(metrics[runs[base][s]], metrics[runs[cand][s]]) for s in seeds]
    out = dict(base=base, cand=cand, seeds=seeds, metrics={})
    for key in COMPARE_KEYS:
        vals = [(get(b, key), get(c, key)) for b, c in pairs]
        if any(not isinstance(x, (int, float)) or x != x for pair in vals for x in pair):  # missing or nan
            continue
        log = "ppl" in key
        diffs = [math.log(c / b) if log else c - b for b, c in vals]
        out["metrics"][key] = dict(base=[b for b, _ in vals], cand=[c for _, c in vals], log_ratio=log,
                                   **paired_interval(diffs, n_boot, seed))
    labels = [(runs[base][s], runs[cand][s]) for s in seeds]
    rare_targets = [int(type_stats[b]["count"][type_stats[b]["rare"]].sum()) for b, _ in labels if b in type_stats]
    if all(b in type_stats and c in type_stats for b, c in labels) and all(rare_targets):
        rare = type_stats[labels[0][0]]["rare"]
        gap = sum(type_stats[b]["nll"] - type_stats[c]["nll"] for b, c in labels)[rare]  # per rare type, pooled
        count = sum(type_stats[b]["count"] for b, _ in labels)[rare].double()
        ids = rare.nonzero().squeeze(1)
        keep = count > 0
        gap, count, ids = gap[keep], count[keep], ids[keep]
        order = torch.argsort(gap, descending=True)
        total = float(gap.sum()) or float("nan")  # nan shares when the two variants score alike
        rng = np.random.default_rng(seed)
        g_np, c_np = gap.numpy(), count.numpy()
        boot = []
        for _ in range(n_boot):  # resample rare target types; ratio = cand rare PPL / base rare PPL
            i = rng.integers(0, len(g_np), len(g_np))
            boot.append(math.exp(-g_np[i].sum() / c_np[i].sum()))
        out["rare_types"] = dict(
            types=len(ids), targets=int(count.sum()), ratio=math.exp(-total / float(count.sum())),
            ratio_type_boot95=np.percentile(boot, [2.5, 97.5]).tolist(),
            share_top1=float(gap[order[:1]].sum()) / total, share_top10=float(gap[order[:10]].sum()) / total,
            top=[dict(token=tokens[int(ids[j])], targets=int(count[j]), share=float(gap[j]) / total)
                 for j in order[:10].tolist()])
    if texts and all(b in texts and c in texts for b, c in labels):
        out["bleu_paired_bootstrap"] = [
            dict(seed=s, **train_nmt.paired_bleu(texts[b]["hyps"], texts[c]["hyps"], texts[b]["refs"], None,
                                                 texts[b]["bleu_tokenize"], seed=seed))
            for s, (b, c) in zip(seeds, labels)]
    out.update(calibration_and_equivalence(pairs, out["metrics"]))
    if all(b.get("article_stats") and c.get("article_stats") for b, c in pairs):
        out["rare_articles"] = article_bootstrap(pairs, n_boot, seed)
    return out


def article_bootstrap(pairs, n_boot=10000, seed=0):
    """The rare-group PPL ratio cand / base pooled over the seed pairs, with a bootstrap over the held-out articles
    (the units the test set was drawn in: one article can carry much of a gap) and each article's share of the gap."""
    base = np.array([b["article_stats"]["nll"] for b, _ in pairs])[..., 2].sum(0)  # rare NLL per article
    cand = np.array([c["article_stats"]["nll"] for _, c in pairs])[..., 2].sum(0)
    count = np.array(pairs[0][0]["article_stats"]["count"])[:, 2] * len(pairs)  # the same targets in every run
    gap = base - cand
    keep = count > 0
    gap, count = gap[keep], count[keep]
    rng = np.random.default_rng(seed)
    boot = [math.exp(-gap[i].sum() / max(count[i].sum(), 1)) for i in rng.integers(0, len(gap), (n_boot, len(gap)))]
    return dict(articles=int(len(gap)), rare_targets=count.tolist(), ratio=math.exp(-gap.sum() / count.sum()),
                ratio_article_boot95=np.percentile(boot, [2.5, 97.5]).tolist(),
                gap_share_per_article=(gap / gap.sum()).tolist() if gap.sum() else None)


# Equivalence margins (this project's): "equal" or "matches" in the docs means the 90% interval of the paired mean
# log ratio lies within these (TOST at 5%): 2% for a total PPL, 10% for a frequency group's PPL.
EQUIVALENCE_MARGINS = {"ppl": math.log(1.02), "valid_ppl": math.log(1.02), "rare_bias.ppl": math.log(1.02),
                       "temperature.ppl": math.log(1.02),
                       "ppl_groups.rare": math.log(1.10), "rare_bias.ppl_groups.rare": math.log(1.10),
                       "test_ppl": math.log(1.02)}


def tost(diffs, margin):
    """Two one-sided t-tests of the paired mean difference against +-margin: equivalent at 5% when the 90% t
    interval lies inside (-margin, margin); p is the larger one-sided p-value."""
    d = np.asarray(diffs, dtype=np.float64)
    n, mean = len(d), float(d.mean())
    if n < 2 or d.std() == 0:
        return dict(margin=margin, n=n, equivalent=None)
    se = d.std(ddof=1) / math.sqrt(n)
    half = float(stats.t.ppf(0.95, n - 1) * se)
    p = max(stats.t.sf((mean + margin) / se, n - 1), stats.t.cdf((mean - margin) / se, n - 1))
    return dict(margin=margin, n=n, ci90=[mean - half, mean + half], p=float(p), equivalent=bool(p < 0.05))


def calibration_and_equivalence(pairs, compared):
    """For (base, cand) run pairs with eval.py's rare_bias (one bias on the rare logits fitted on valid): the share of
    cand's rare-PPL gain that calibrating base alone recovers (free_baseline_share), the share of the rare-PPL gap
    that calibrating both closes (gap_closed_by_calibration: 1 - calibrated gap / gap), and TOST equivalence
    (EQUIVALENCE_MARGINS) of every compared PPL."""
    out = {}
    if all(b.get("rare_bias") and c.get("rare_bias") for b, c in pairs):
        gap = [math.log(b["ppl_groups"]["rare"] / c["ppl_groups"]["rare"]) or float("nan") for b, c in pairs]
        shares = [(math.log(b["ppl_groups"]["rare"]) - math.log(b["rare_bias"]["ppl_groups"]["rare"])) / g
                  for (b, _), g in zip(pairs, gap)]
        closed = [1 - math.log(b["rare_bias"]["ppl_groups"]["rare"] / c["rare_bias"]["ppl_groups"]["rare"]) / g
                  for (b, c), g in zip(pairs, gap)]
        out["free_baseline_share"] = dict(per_seed=shares, mean=float(np.mean(shares)),
                                          base_bias=[b["rare_bias"]["bias"] for b, _ in pairs])
        out["gap_closed_by_calibration"] = dict(per_seed=closed, mean=float(np.mean(closed)),
                                                min=float(np.min(closed)), max=float(np.max(closed)))
    out["equivalence"] = {k: dict(tost(compared[k]["diffs"], m), log_ratio=True)
                          for k, m in EQUIVALENCE_MARGINS.items() if k in compared}
    return out


# --------------------------------------------------------------------------------------------------- results files
RESULT_KEYS = ("method", "variant", "seed", "step", "split", "tokens", "valid_ppl", "ppl", "ppl_groups", "uniq",
               "uniq_groups", "uniq_human", "uniq_human_groups", "isotropy", "isotropy_groups", "mean_cosine",
               "mean_cosine_groups", "norm_groups", "mean_row_share", "cosine_rare_freq", "rows", "geometry_rows_rule",
               "rare_argmax", "rare_bias", "temperature", "output_bias", "gen_rep4", "gen_rep4_sampled", "gen_distinct",
               "bleu", "bleu_signature", "test_ppl", "target", "rare_rule", "checkpoints_averaged", "isoscore",
               "isotropy_centered", "isotropy_weighted", "isotropy_weighted_centered", "undertrained", "article_stats",
               "word_similarity", "word_similarity_pairs")
RUN_KEYS = ("lr", "warmup", "split_seed", "preset", "tokens_per_step", "max_steps", "method_hparams", "optimizer",
            "untie", "weight_decay", "embedding_weight_decay", "dataset", "train_fraction",
            "method_rare_share", "keep_last", "save_interval", "git_commit", "agg_sha256")


def run_record(m, cfg, **extra):
    """One run of a results file (the one schema of every study's): its headline metrics (`m`, eval.py's), its
    settings and provenance from its config and the command that trained it; `extra` adds or replaces keys."""
    versions = cfg.get("versions") or {}
    record = dict({k: m[k] for k in RESULT_KEYS if k in m}, **{k: cfg.get(k) for k in RUN_KEYS},
                  threads=versions.get("threads"), cpu_capability=versions.get("cpu_capability"),
                  kernels=versions.get("kernels"),
                  command=runlib.run_command(cfg, "train_lm.py" if cfg.get("task", "lm") == "lm" else "train_nmt.py"))
    record.update(extra)
    return record


def write_results(path, metrics, configs, folders, comparisons, argv):
    """A small JSON for results/: per run its run_record (and, when its valid records hold them, "gradient_parts":
    per valid record the step, grad_parts (AGG Eq. 4's parts per group) and norm_groups, the data of
    gradient_parts.png; for NMT, "valid_bleu" per step and "training_test_bleu", the test records training wrote:
    "test", the last checkpoint, and "test_averaged"); this evaluation's command; the paired comparisons."""
    runs = {}
    for label, m in metrics.items():
        folder = folders[label]
        runs[label] = run_record(m, runlib.run_config(folder) or configs[label])  # config.json: with the provenance
        parts = [{k: v for k, v in r.items() if k in ("step", "grad_parts", "norm_groups")}
                 for r in ev.log_records(folder) if "grad_parts" in r]
        if parts:
            runs[label]["gradient_parts"] = parts
        if "bleu" in m:  # NMT: BLEU over training and the test records training wrote (last checkpoint, average)
            runs[label]["valid_bleu"] = {r["step"]: r["bleu"] for r in ev.log_records(folder) if "bleu" in r}
            runs[label]["training_test_bleu"] = {r["split"]: r["bleu"] for split in ("test", "test_averaged")
                                                 for r in ev.log_records(folder, split)[-1:]}
    rel = [os.path.relpath(a, runlib.ROOT) if os.path.isabs(a) else a for a in argv]
    runlib.write_json(path, dict(command=shlex.join(["python", "-m", "studies.compare", *rel]), runs=runs,
                                 compare=comparisons))


def record_threads(record):
    """The thread count a results record was trained with: its "threads", else the OMP_NUM_THREADS of its command
    (run_command writes it from config.json); None when neither says."""
    if record.get("threads") is not None:
        return record["threads"]
    m = re.match(r"OMP_NUM_THREADS=(\d+) ", record.get("command") or "")
    return int(m.group(1)) if m else None


def record_config(record):
    """The part of a config that pair_difference reads, from a results record."""
    return dict(seed=record["seed"], versions=dict(threads=record_threads(record), kernels=record.get("kernels")))


def variant_of(record, variants):
    """The variant among `variants` (a results file's names, e.g. 'agg rare_rule=target-only') an added run belongs
    to: its own when the file knows it, else the one whose method and settings the record has (a run evaluated alone
    is named by its method only). Its own when none or several match."""
    own = record.get("variant", record["method"])
    if own in variants:
        return own
    hparams = record.get("method_hparams") or {}

    def holds(setting):
        key, _, value = setting.partition("=")
        return str(record[key] if key in record else hparams.get(key)) == value

    fits = [v for v in variants if v.split()[0] == record["method"] and all(holds(x) for x in v.split()[1:])]
    return fits[0] if len(fits) == 1 else own


def reanalyse(path, add=()):
    """Recompute the statistics of a results file's comparisons from its per-run records (no checkpoint needed):
    paired intervals, calibration shares, equivalence, the article bootstrap. `add`: other results files whose runs
    join this one's (a run of the same name is replaced: a rerun, which keeps the replaced run's variant; a new run
    takes the file's variant its settings match, variant_of) with their per-seed BLEU bootstraps, so a
    comparison grows by seeds without the earlier run folders. What needs the runs themselves is kept from the file
    that computed it: the per-seed BLEU bootstraps (a replaced run's seed takes the added file's, or none) and the
    rare-type split (dropped once its pairs change). Written back in place, atomically."""
    with open(path) as f:
        res = json.load(f)
    if not isinstance(res.get("runs"), dict) or not all("base" in e and "cand" in e and "unpaired" not in e
                                                        for e in res.get("compare") or []):
        raise SystemExit(f"--reanalyse {path}: not a file of this script's comparisons (a study's file: rerun the "
                         f"study with --no-train to rewrite it)")
    runs, replaced = res["runs"], set()
    commands = [res["command"]] if isinstance(res["command"], str) else list(res["command"])
    for other in add:
        with open(other) as f:
            more = json.load(f)
        variants = {r.get("variant", r["method"]) for r in runs.values()}
        more["runs"] = {k: dict(r, variant=runs[k].get("variant", runs[k]["method"]) if k in runs  # a rerun
                                else variant_of(r, variants)) for k, r in more["runs"].items()}
        replaced |= {(r["variant"], r["seed"]) for k, r in more["runs"].items() if k in runs and runs[k] != r}
        runs.update(more["runs"])
        commands.append(more["command"])
        boots = {(e["base"], e["cand"]): e.get("bleu_paired_bootstrap") or [] for e in more.get("compare") or []}
        for entry in res.get("compare") or []:
            new = {b["seed"]: b for b in boots.get((entry["base"], entry["cand"]), [])}
            kept = [b for b in entry.get("bleu_paired_bootstrap") or [] if b["seed"] not in new and
                    (entry["base"], b["seed"]) not in replaced and (entry["cand"], b["seed"]) not in replaced]
            if "bleu_paired_bootstrap" in entry or new:
                entry["bleu_paired_bootstrap"] = sorted(kept + list(new.values()), key=lambda b: b["seed"])
    configs = {k: record_config(r) for k, r in runs.items()}
    for entry in res.get("compare") or []:
        new = compare({k: dict(r, variant=r.get("variant", r["method"])) for k, r in runs.items()}, {},
                      entry["base"], entry["cand"], [], configs=configs)
        if new["seeds"] != entry["seeds"] or any((v, s) in replaced for v in (entry["base"], entry["cand"])
                                                 for s in new["seeds"]):
            entry.pop("rare_types", None)
        entry.update({k: v for k, v in new.items() if k not in ("rare_types", "bleu_paired_bootstrap")})
    res["command"] = commands[0] if len(commands) == 1 else commands
    res["reanalysis_command"] = shlex.join(["python", "-m", "studies.compare", "--reanalyse",
                                            os.path.relpath(path, runlib.ROOT)])
    runlib.write_json(path, res)
    return res


# ----------------------------------------------------------------------------------------------------------- plots
def save(fig, path, dpi=120):
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_singular_values(spectra, path):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, s in spectra.items():
        ax.plot(np.arange(1, len(s) + 1), s, label=label)
    ax.set_xlabel("index")
    ax.set_ylabel("normalised singular value")
    ax.set_title("Singular values of the tied embedding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def plot_svd(rows, path, title):
    """AGG Fig. 1/3: each matrix projected on its top two right singular vectors (uncentred, so a common direction
    shows), coloured by frequency group. rows: {row: [(panel title, W or a snapshot file, group ids (V,))]}."""
    n_col = max(len(panels) for panels in rows.values())
    fig, axes = plt.subplots(len(rows), n_col, figsize=(4 * n_col, 4 * len(rows)), squeeze=False)
    for r, panels in enumerate(rows.values()):
        for c, (name, W, gid) in enumerate(panels):
            W = torch.load(W, map_location="cpu", weights_only=True)["weight"] if isinstance(W, str) else W
            W = W.detach().double().cpu()
            P = (W @ torch.linalg.svd(W, full_matrices=False)[2][:2].T).numpy()
            for g in (2, 1, 0):  # frequent drawn last, on top
                m = (gid == g).numpy()
                axes[r][c].scatter(P[m, 0], P[m, 1], s=2, alpha=0.5, c=GROUP_COLOURS[agg.GROUPS[g]],
                                   label=agg.GROUPS[g], rasterized=True)
            axes[r][c].set_title(name, fontsize=9)
            axes[r][c].set_aspect("equal", adjustable="datalim")
        for c in range(len(panels), n_col):
            axes[r][c].axis("off")
    axes[0][0].legend(markerscale=5, fontsize=8)
    fig.suptitle(f"{title} (red rare, green medium, blue frequent)", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def embedding_snapshots(folder):
    """[(step, file)] of a run's embedding snapshots (train_lm.py --snapshot-steps), in step order."""
    d = os.path.join(folder, "snapshots")
    names = os.listdir(d) if os.path.isdir(d) else []
    return sorted((int(f[4:-3]), os.path.join(d, f)) for f in names
                  if f.startswith("emb_") and f.endswith(".pt") and f[4:-3].isdigit())


def by_variant(folders, variants, key, split="valid"):
    """{variant: [the `split` records of each of its runs]}, of the runs whose records carry `key`."""
    out = {}
    for label, d in folders.items():
        recs = [r for r in ev.log_records(d, split) if key in r]
        if recs:
            out.setdefault(variants[label], []).append(recs)
    return out


def seed_curve(ax, runs, key, colour, label, band=True, **style):
    """The mean over a variant's runs of the record value `key` ("a.b": nested) at the steps every run logged, with
    the runs' min-max band."""
    steps = sorted(set.intersection(*({r["step"] for r in recs} for recs in runs)))
    values = np.array([[get({r["step"]: r for r in recs}[s], key) for s in steps] for recs in runs])
    ax.plot(steps, values.mean(0), label=label, color=colour, lw=style.pop("lw", 1), **style)
    if band and len(runs) > 1:
        ax.fill_between(steps, values.min(0), values.max(0), color=colour, alpha=0.2, lw=0)


def plot_training_curves(folders, variants, path):
    """AGG Fig. 2: I(W) per frequency group and the rare-frequent cosine over training (NMT adds valid BLEU), from the
    valid records of each run's log.jsonl; a variant's runs (seeds) as their mean with a min-max band, freeze-rare's
    release of the rare rows dotted. Returns the path, or None when no run has such records."""
    groups = by_variant(folders, variants, "isotropy_groups")
    if not groups:
        return None
    keys = [("isotropy_groups.freq", "I(W) frequent"), ("isotropy_groups.med", "I(W) medium"),
            ("isotropy_groups.rare", "I(W) rare"), ("cosine_rare_freq", "cos(rare, frequent)"), ("ppl", "valid PPL")]
    if all("bleu" in r for runs in groups.values() for recs in runs for r in recs):  # NMT: the seeds' spread
        keys.append(("bleu", "valid BLEU"))
    release = {variants[k]: until for k, d in folders.items()  # freeze-rare's release step
               if (until := (runlib.run_config(d) or {}).get("method_hparams", {}).get("until")) is not None}
    colours = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.4))
    for ax, (key, title) in zip(axes, keys):
        for i, (variant, runs) in enumerate(groups.items()):
            colour = colours(i % colours.N)
            if variant in release:
                ax.axvline(release[variant], color=colour, ls=":", lw=1)
            label = next(k for k in folders if variants[k] == variant) if len(runs) == 1 else \
                f"{variant} (mean of {len(runs)})"
            seed_curve(ax, runs, key, colour, label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if key == "ppl":
            ax.set_yscale("log")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=6, loc="lower center", ncol=min(len(groups), 7),
               frameon=False)
    fig.suptitle("Validation records over training (AGG Fig. 2)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(groups) - 1) // 7), 1, 1))
    return save(fig, path)


def plot_gradient_parts(folders, variants, path):
    """AGG Eq. 4 over training: the mean row norm of the parts (a) pull, (b) push from non-rare-target features and
    (c) push from rare-target features of the weight gradient, per frequency group, as each method applies them
    (the valid records' grad_parts; mean over the runs of a variant). Returns the path, or None without records."""
    groups = by_variant(folders, variants, "grad_parts")
    if not groups:
        return None
    colours = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")  # one colour per method
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    for ax, group in zip(axes, agg.GROUPS):
        for i, (variant, runs) in enumerate(groups.items()):
            for part, ls in zip("abc", ("--", "-", ":")):
                seed_curve(ax, runs, f"grad_parts.{part}.{group}", colours(i % colours.N),
                           f"{variant} {part}" if group == "rare" else None, band=False, ls=ls, lw=1.2)
        ax.set_yscale("log")
        ax.set_title(f"{group} rows", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    axes[0].set_ylabel("mean row norm of the part", fontsize=8)
    fig.legend(loc="center right", fontsize=6, ncol=1 + len(groups) // 6)  # beside the axes: many methods fit
    fig.suptitle("Parts of the embeddings' gradient (AGG Eq. 4): (a) dashed, (b) solid, (c) dotted, as each method "
                 "applies them", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93 - 0.08 * (len(groups) // 6), 1))
    return save(fig, path)


def plot_rare_share(folders, variants, path):
    """AGG Fig. 4: the size of the method's rare group (share of the vocabulary) over training, from the train
    records of the AGG-family runs (mean over the runs of a variant). Returns the path, or None without records."""
    groups = by_variant(folders, variants, "method_rare_fraction", "train")
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, (variant, runs) in enumerate(groups.items()):
        seed_curve(ax, runs, "method_rare_fraction", f"C{i % 10}", f"{variant} ({len(runs)} runs)", band=False, lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.set_ylabel("rare group / vocabulary", fontsize=8)
    ax.set_title("Size of the rare group over training (AGG Fig. 4)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, path)


def plot_output_bias(biases, counts, path):
    """The learned output bias of each run against its token's log train count (seen tokens), coloured by group."""
    fig, axes = plt.subplots(1, len(biases), figsize=(4 * len(biases), 3.6), squeeze=False, sharey=True)
    for ax, (label, b) in zip(axes[0], biases.items()):
        c = torch.as_tensor(counts[label]).double()
        gid, _ = ev.group_index(counts[label])
        seen = c > 0
        for k, g in enumerate(agg.GROUPS):
            m = seen & (gid == k)
            ax.scatter(c[m].log().numpy(), b.double()[m].numpy(), s=2, alpha=0.4, c=GROUP_COLOURS[g], label=g,
                       rasterized=True)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("log train count", fontsize=8)
    axes[0][0].set_ylabel("learned output bias", fontsize=8)
    axes[0][0].legend(markerscale=5, fontsize=7)
    fig.suptitle("Learned output bias against token frequency (--output-bias)", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------- report
def row(*cells):
    """A markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def _md(s):
    return str(s).replace("|", "\\|").replace("\n", " ⏎ ").strip()


def write_report(path, metrics, args, argv, summary=None, curves=None, snapshots=None, comparisons=()):
    L = ["# Evaluation report", "", f"`{shlex.join(['python', '-m', 'studies.compare', *argv])}`", "",
         f"Checkpoint: {args.checkpoint} ({'ckpt.pt' if args.checkpoint == 'last' else 'ckpt_best.pt'}).", ""]
    G, nan = agg.GROUPS, float("nan")
    if summary and any(s["n"] > 1 for s in summary.values()):
        cols = [("ppl", "PPL"), ("ppl_groups.rare", "PPL rare"), ("uniq", "Uniq"), ("isotropy", "I(W)"),
                ("isotropy_groups.rare", "I rare"), ("mean_cosine", "mean cos"),
                ("mean_cosine_groups.rare", "cos rare"), ("bleu", "BLEU"), ("test_ppl", "test PPL"),
                ("group_rare_mass_pred", "rare mass pred"), ("group_rare_mass_true", "rare mass true")]
        cols = [(k, h) for k, h in cols if any(get(s, k) for s in summary.values())]
        pm = lambda s, nd: f"{fmt(s['mean'], nd)} ± {fmt(s['std'], nd)}"
        L += ["## Mean ± std over the runs (seeds) of each method", "", row("method", "n", *(h for _, h in cols)),
              "|" + " --- |" * (2 + len(cols))]
        L += [row(v, s["n"], *(pm(get(s, k), 3 if "isotropy" in k or "cos" in k else 2) if get(s, k) else "-"
                               for k, _ in cols)) for v, s in summary.items()]
        L.append("")
    lm = [k for k, m in metrics.items() if m["task"] == "lm"]
    nmt = [k for k, m in metrics.items() if m["task"] == "nmt"]
    if lm:
        h = metrics[lm[0]]
        ws = list(h["word_similarity"])
        L += [f"## Language modelling ({h['split']} split; groups: 30% frequent / 50% medium / 20% rare by train "
              f"counts)", "", row("run", "method", "step", *(f"PPL {g}" for g in G), "PPL total",
                                  *(f"Uniq {g}" for g in G), "Uniq total", "I(W)", *(f"I {g}" for g in G), "mean cos",
                                  *ws), "|" + " --- |" * (16 + len(ws))]
        for k in lm:
            m = metrics[k]
            L.append(row(k, m["method"], m["step"], *(fmt(m["ppl_groups"][g]) for g in G), fmt(m["ppl"]),
                         *(m["uniq_groups"][g] for g in G), m["uniq"], fmt(m["isotropy"], 3),
                         *(fmt(m["isotropy_groups"][g], 3) for g in G), fmt(m["mean_cosine"], 3),
                         *(fmt(v, 3) for v in m["word_similarity"].values())))
        L.append(row("human", *["-"] * 6, *(h["uniq_human_groups"][g] for g in G), h["uniq_human"],
                     *["-"] * (5 + len(ws))))
        L += ["", "Word similarity: Spearman correlation of the cosine of mean subword embeddings with human scores "
              "(pairs used / total: " + "; ".join(f"{n} {u}/{t}" for n, (u, t) in
                                                   h["word_similarity_pairs"].items()) + ").", ""]
        L += ["Greedy continuations (Uniq = distinct tokens in 100 generated tokens; seq-rep-4 = share of repeated "
              "4-grams, Welleck et al. 2020):", "", row("run", "mean Uniq per sample", "mean seq-rep-4"),
              "| --- | --- | --- |"]
        L += [row(k, fmt(metrics[k]["gen_uniq"], 1), fmt(metrics[k]["gen_rep4"], 3)) for k in lm]
        L += [row("human", fmt(h["gen_uniq_human"], 1), fmt(h["gen_rep4_human"], 3)), ""]
        for j, g in enumerate(h["generations"][:args.show_samples]):
            L += [f"**Sample {j + 1}** prefix: {_md(g['prefix'])}", "",
                  f"- human (Uniq {g['uniq_human']}): {_md(g['human'])}"]
            L += [f"- {k} (Uniq {metrics[k]['generations'][j]['uniq']}): "
                  f"{_md(metrics[k]['generations'][j]['continuation'])}" for k in lm]
            L.append("")
    if nmt:
        L += ["## Machine translation", "", row("run", "method", "BLEU", "test PPL", *(f"PPL {g}" for g in G), "I(W)",
                                                *(f"I {g}" for g in G), "mean cos", "rare mass pred / true",
                                                "signature"), "|" + " --- |" * 14]
        for k in nmt:
            m = metrics[k]
            L.append(row(k, m.get("method", "?"), fmt(m.get("bleu", nan)), fmt(m.get("test_ppl", nan)),
                         *(fmt(m.get("ppl_groups", {}).get(g, nan)) for g in G), fmt(m["isotropy"], 3),
                         *(fmt(m["isotropy_groups"][g], 3) for g in G), fmt(m["mean_cosine"], 3),
                         f"{fmt(m.get('group_rare_mass_pred', nan), 4)} / {fmt(m.get('group_rare_mass_true', nan), 4)}",
                         f"`{_md(m.get('bleu_signature', ''))}`"))
        L += ["", "PPL per group: of the target tokens in each frequency group (30% / 50% / 20% of the vocabulary by "
              "train counts of both sides). Rare mass: the probability the model gives the rare group, summed over "
              "target positions, against the rare group's share of the targets.", ""]
        shown = [k for k in nmt if metrics[k].get("translations")]
        for j in range(min([args.show_samples] + [len(metrics[k]["translations"]) for k in shown]) if shown else 0):
            t = metrics[shown[0]]["translations"][j]
            L += [f"**Test sentence {j + 1}**: {_md(t['src'])}", "", f"- reference: {_md(t['ref'])}"]
            L += [f"- {k}: {_md(metrics[k]['translations'][j]['hyp'])}" for k in shown]
            L.append("")
    biased = [k for k in lm if "rare_bias" in metrics[k]]
    if biased:
        L += ["## The free baseline: one bias on the rare group's logits, fitted on the valid split", "",
              "Fitted by minimum valid NLL, which also calibrates the rare group's predicted mass. Precision / recall: "
              "of the argmax predictions that are rare tokens, the share that are right / of the rare targets, the "
              "share predicted exactly.", "", row("run", "bias", "PPL", "PPL rare", "rare mass pred / true", "Uniq",
                                                  "Uniq rare", "rare argmax precision", "rare argmax recall"),
              "|" + " --- |" * 9]
        for k in biased:
            a, b = metrics[k]["rare_argmax"], metrics[k]["rare_bias"]
            to = lambda f, key, nd=2: f"{fmt(f(a)[key], nd)} -> {fmt(f(b)[key], nd)}"
            L.append(row(k, f"0 -> {b['bias']:+.3f}", to(dict, "ppl"), to(lambda x: x["ppl_groups"], "rare"),
                         f"{a['rare_mass_pred']:.4f} -> {b['rare_mass_pred']:.4f} / {a['rare_mass_true']:.4f}",
                         to(dict, "uniq"), to(lambda x: x["uniq_groups"], "rare"),
                         to(dict, "rare_argmax_precision", 3), to(dict, "rare_argmax_recall", 3)))
        L.append("")
    for c in comparisons:
        L += [f"## Paired comparison: {c['cand']} against {c['base']} (seeds {', '.join(map(str, c['seeds']))})", "",
              "PPL rows: geometric-mean ratio cand / base and intervals of the ratio; other rows: differences.", "",
              row("metric", "base (mean)", "cand (mean)", "change", "95% t interval", "95% bootstrap", "median",
                  "p (paired t)"), "|" + " --- |" * 8]
        for key, r in c["metrics"].items():
            f = (lambda x: f"x{math.exp(x):.3f}") if r["log_ratio"] else (lambda x: f"{x:+.4g}")
            iv = lambda name: f"[{f(r[name][0])}, {f(r[name][1])}]" if name in r else "-"
            L.append(row(key, fmt(float(np.mean(r["base"])), 3), fmt(float(np.mean(r["cand"])), 3), f(r["mean"]),
                         iv("t95"), iv("boot95"), f(r["median"]), fmt(r.get("p", nan), 3)))
        if "rare_types" in c:
            t = c["rare_types"]
            L += ["", f"Rare-group PPL ratio pooled over the pairs: x{t['ratio']:.3f}, 95% interval over rare target "
                  f"types (type-level bootstrap) [x{t['ratio_type_boot95'][0]:.3f}, x{t['ratio_type_boot95'][1]:.3f}]; "
                  f"{t['targets']} rare targets of {t['types']} types. Share of the log-PPL gap from the top type: "
                  f"{t['share_top1']:.0%}, top 10 types: {t['share_top10']:.0%} (" +
                  ", ".join(f"{_md(repr(x['token']))} {x['share']:.0%} of {x['targets']}" for x in t["top"]) + ")."]
        if "bleu_paired_bootstrap" in c:
            L += ["", "BLEU, paired bootstrap over test sentences (per seed; cand - base): " + "; ".join(
                f"seed {x['seed']}: {x['diff']:+.2f} [{x['boot95'][0]:+.2f}, {x['boot95'][1]:+.2f}], p {x['p']:.3f}"
                for x in c["bleu_paired_bootstrap"]) + "."]
            if "min_detectable" in c["metrics"].get("bleu", {}):
                L += ["", f"Smallest BLEU difference {len(c['seeds'])} paired seeds detect (80% power, 5% two-sided): "
                      f"{c['metrics']['bleu']['min_detectable']:.2f}."]
        if "free_baseline_share" in c:
            s = c["free_baseline_share"]
            L += ["", f"Share of {c['cand']}'s rare-PPL gain that {c['base']} gets from one bias on the rare logits "
                  f"(fitted on valid): {s['mean']:.0%} (per seed: " + ", ".join(f"{x:.0%}" for x in s["per_seed"]) + ")."]
        L.append("")
    L += ["## Top-5 cosine neighbours of rare tokens (AGG Tables 12-13; * = neighbour in the rare group)", ""]
    for k, m in metrics.items():
        L += [f"**{k}**", "", "| token | top-5 neighbours |", "| --- | --- |"]
        L += [row(_md(t), ", ".join(_md(n) for n in ns)) for t, ns in m["neighbours"].items()]
        L.append("")
    L += ["## Plots", "", "![singular values](singular_values.png)", "", "![SVD projection](svd_projection.png)", ""]
    L += ["![training curves](training_curves.png)", ""] if curves else []
    L += ["![SVD projection over training](svd_over_time.png)", ""] if snapshots else []
    L += ["Tokens that never occur in training receive (almost) no gradient under the gated methods and stay near "
          "their initialisation: they form a cluster at the origin of the projection.", ""]
    runlib.write_text(path, "\n".join(L))


def build_parser():
    p = ev.build_parser(__doc__, runs="*")
    p.add_argument("--show-samples", type=int, default=2,
                   help="continuations (LM) or test translations (NMT) printed in report.md")
    p.add_argument("--compare", nargs=2, action="append", default=[], metavar=("BASE", "CAND"),
                   help="paired comparison of two variants (names as in summary.json, e.g. mle agg) over their common "
                        "seeds: intervals, rare-PPL per-type split, free-baseline share, NMT's paired BLEU "
                        "bootstrap -> compare.json (repeatable). Default, for runs of exactly two variants: the "
                        "two, mle as the base where it is one of them")
    p.add_argument("--results", default=None, metavar="FILE",
                   help="also write FILE: a small JSON of every run's headline metrics with the command that trained it "
                        "and this evaluation's command, plus the --compare results (for results/)")
    p.add_argument("--reanalyse", default=None, metavar="FILE",
                   help="recompute the comparisons of a results file from its per-run records (no run folders)")
    p.add_argument("--add", nargs="+", default=[], metavar="FILE",
                   help="with --reanalyse: results files whose runs join FILE's first (more seeds; a rerun replaces "
                        "the run of its name)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.add)
    if args.add:
        raise SystemExit("--add goes with --reanalyse FILE (the results file the runs join)")
    if not args.out_dirs:
        raise SystemExit("give run folders (or --reanalyse RESULTS.json)")
    configs = ev.read_configs(args)  # a bad folder or flag fails before any long work
    variants = variant_names(configs)
    names = list(dict.fromkeys(variants[d] for d in args.out_dirs))  # in the order given
    seeds = [{configs[d].get("seed") for d in args.out_dirs if variants[d] == v} for v in names]
    default = not args.compare and len(names) == 2 and bool(seeds[0] & seeds[1])
    if default:
        args.compare = [sorted(names, key=lambda v: v != "mle")]  # stable: mle first, else the order given
    for pair in args.compare:  # every variant compared must be among the runs
        for v in pair:
            if v not in names:
                raise SystemExit(f"--compare: no run of variant {v!r}; variants here: {', '.join(sorted(names))}")
    args.compare = comparable_pairs(args.compare, configs, variants, default)
    results = ev.evaluate_runs(args)
    folders = dict(zip(ev.labels_for(args.out_dirs), args.out_dirs))
    metrics = {label: dict(res["metrics"], variant=variants[folders[label]]) for label, res in results.items()}
    variants = {label: m["variant"] for label, m in metrics.items()}
    summary = summarise(metrics)
    # pairs checked again with the vocabulary size the weights have (a config may not record it)
    configs = {label: dict(configs[d], vocab_size_actual=int(results[label]["weight"].shape[0]))
               for label, d in folders.items()}
    args.compare = comparable_pairs(args.compare, configs, variants, default)
    type_stats = {k: r["type_stats"] for k, r in results.items() if "type_stats" in r}
    texts = {k: r["texts"] for k, r in results.items() if "texts" in r}
    tokens = next(iter(results.values()))["tokens"]
    comparisons = [compare(metrics, type_stats, base, cand, tokens, texts=texts, configs=configs)
                   for base, cand in args.compare]
    out = lambda name: os.path.join(args.out, name)
    runlib.write_json(out("metrics.json"), metrics)
    runlib.write_json(out("summary.json"), summary)
    if comparisons:
        runlib.write_json(out("compare.json"), comparisons)
    if args.results:
        write_results(args.results, metrics, configs, folders, comparisons, argv)
    plot_singular_values({k: m["singular_values"] for k, m in metrics.items()}, out("singular_values.png"))
    gid = {k: ev.group_index(r["counts"])[0] for k, r in results.items()}
    plot_svd({"": [(k, r["weight"], gid[k]) for k, r in results.items()]}, out("svd_projection.png"),
             "2-D SVD projection of the tied embedding")
    snapshots = {k: [(f"{k} step {s}", f, gid[k]) for s, f in embedding_snapshots(d)] for k, d in folders.items()}
    snapshots = {k: v for k, v in snapshots.items() if v}
    if snapshots:  # AGG Fig. 1 over time: one row per run
        plot_svd(snapshots, out("svd_over_time.png"), "Embeddings over training: 2-D SVD projection")
    curves = plot_training_curves(folders, variants, out("training_curves.png"))
    plot_gradient_parts(folders, variants, out("gradient_parts.png"))
    plot_rare_share(folders, variants, out("rare_share.png"))
    biases = {k: r["out_bias"] for k, r in results.items() if r["out_bias"] is not None}
    if biases:
        plot_output_bias(biases, {k: results[k]["counts"] for k in biases}, out("output_bias.png"))
    write_report(out("report.md"), metrics, args, argv, summary, curves, snapshots, comparisons)
    print(f"wrote {args.out}/metrics.json, summary.json, report.md and plots")
    return metrics


if __name__ == "__main__":
    main()
