"""How much does the choice of held-out articles move the headline? MLE against AGG (rare share 0.2)
at three draws of the valid and test articles.

    # train, evaluate; rerun to go on
    python -m studies.splits --jobs 2 --results results/lm_splits.json
    # the study so far
    python -m studies.splits --no-train --results results/lm_splits.json

The protocol (this project's choices, fixed before any run):
- three splits of the offline corpus's articles (--split-seed 0, 1, 2: each draws its own 6 valid
  and 5 test articles, the rest train);
- every run: the headline's pair at M (the cpu preset) in float32 on any device, 2,400 steps, lr
  4e-3, warm-up 240 steps, 12 validations; MLE, and AGG at rare share 0.2; seeds 0-4 in every
  split, paired by seed on one host;
- per split the paired AGG / MLE quantities of the scale study (scale.paired_cell: test PPL as it
  is and with both models' rare bias calibrated, the test PPL ratio over seeds and, two-way, over
  seeds and test articles);
- pooled: the mean log ratio over the three splits' means, its 95% t interval over the splits (2
  degrees of freedom: the articles' draw is the unit), and the spread the split adds beyond the
  seeds' (between-split standard deviation, a method-of-moments estimate, 0 when the seeds explain
  it all).
Every run is a train_lm.py run folder under OUT/runs (stop this script at any time and rerun it),
evaluated by eval.py into RUN/report/; nothing is selected.
"""

import math

import numpy as np
from scipy import stats

from studies import scale, schedule

SPLITS = [0, 1, 2]
SEEDS = range(5)
METHODS = ["mle", "agg"]


def run_spec(split, method, seed):  # (name, train_lm.py flags) of a run
    flags = schedule.pair_flags(method, seed, 2400) + ["--split-seed", str(split)]
    return f"split{split}-{method}-s{seed}", flags


def pooled(cells, key):
    """The mean over the splits of the per-split mean log ratio `key`, a t interval over splits,
    and the between-split standard deviation beyond the seeds'."""
    means = np.array([c[key]["mean"] for c in cells])
    within = np.mean([np.var(c[key]["diffs"], ddof=1) / c[key]["n"] for c in cells])
    between = max(0.0, float(np.var(means, ddof=1) - within))
    half = stats.t.ppf(0.975, len(means) - 1) * means.std(ddof=1) / math.sqrt(len(means))
    return dict(
        splits=len(means),
        split_means=means.tolist(),
        mean=float(means.mean()),
        t95_over_splits=[float(means.mean() - half), float(means.mean() + half)],
        between_split_sd=math.sqrt(between),
        within_split_se=math.sqrt(within),
    )


class Splits(scale.Study):
    label, name = "out/splits", "splits"

    def plan(self):
        """[(name, flags, cost)] of every run, split by split."""
        runs = {}
        pairs = []
        for split in SPLITS:
            for seed in SEEDS:
                pair = {m: [run_spec(split, m, seed)[0]] for m in METHODS}
                pairs.append(pair)
                runs.update(run_spec(split, m, seed) for m in METHODS)
        plan = [(name, flags, 1.0) for name, flags in runs.items()]
        plan += [(n, f, 1.0) for n, f in self.replicas(runs, pairs).items()]
        return plan

    def selections(self):
        return {}

    def write_results(self, path, argv, _corpus_path=None):
        names = sorted({n for n, _f, _c in self.plan()} | self.made())
        runs, diverged = self.records(names, lambda n: scale.run_record(self, n))
        runs = {n: dict(r, host=scale.host(r)) for n, r in runs.items()}
        cells = []
        for split in SPLITS:
            members = [r for r in runs.values() if r["split_seed"] == split]
            cell = scale.paired_cell(members)
            if cell is not None:
                cells.append(dict(split_seed=split, **cell))
        keys = ["ppl_log_ratio", "calibrated_ppl_log_ratio", "valid_ppl_log_ratio"]
        result = dict(runs=runs, diverged=diverged, compare=cells)
        if len(cells) >= 2:
            result["pooled"] = {k: pooled(cells, k) for k in keys}
        self.write(path, argv, result)
        print(f"wrote {path}: {len(runs)} runs, {len(cells)} paired splits")


if __name__ == "__main__":
    scale.main(study_class=Splits)
