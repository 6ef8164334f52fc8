#!/usr/bin/env python
"""Evaluate trained runs side by side: the task metrics and the geometry of the tied embedding matrix.

    python eval.py out/lm-mle-s0 out/lm-agg-s0 --out out/report

Each run folder holds ckpt.pt; its config's "task" picks the evaluation:
  lm  (train_lm.py): test PPL total and per frequency group, Uniq (distinct argmax next-token predictions) total and
      per group with the human reference (distinct targets), greedy continuations of test prefixes with Uniq per
      sample (AGG Table 14), word similarity (Spearman of cosine vs human scores; AGG Table 5), and two free
      calibrations fitted on valid (one bias on the rare group's logits, one temperature on all logits);
  nmt (train_nmt.py): BLEU with its sacrebleu signature (train_nmt.evaluate).
Both: I(W) total and per group (AGG Eq. 3), mean cosine S(w) (AGPS Eq. 9), normalised singular values (plot),
2-D SVD projection coloured by group (plot, AGG Fig. 1/3), top-5 cosine neighbours of rare tokens (AGG Tables 12-13).
Frequency groups: 30% frequent / 50% medium / 20% rare of the vocabulary by training counts (AGG Sec. 3.1).
Writes REPORT/metrics.json ({run label: metrics}), REPORT/summary.json (mean and std over the seeds of each method,
or of each variant where runs of one method differ in more than their seed), REPORT/report.md and the PNG plots.
"""
import argparse
import json
import math
import os
import re
import shlex
import statistics
import sys

import numpy as np
import torch

from tqdm import tqdm

import agg
import runlib
import train_lm
import train_nmt
from data import prepare_lm, prepare_nmt

GROUP_COLOURS = {"freq": "tab:blue", "med": "tab:green", "rare": "tab:red"}  # as AGG Fig. 1


def gensim_test_data(name):
    import gensim
    return os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", name)


WORDSIM = {"ws353": "wordsim353.tsv", "simlex999": "simlex999.txt"}  # shipped in the gensim wheel


# ------------------------------------------------------------------------------------------------- word similarity
def load_word_pairs(path):
    """(word1, word2, score) triples from WordSim353 / SimLex-999 / MEN / RG65 / RW style files: the first two fields
    are the words, the third the human score; fields split by tabs, semicolons or spaces; '#' lines are comments.
    MEN's lemma file suffixes (-n, -v, -j) are dropped."""
    if not os.path.exists(path):
        raise SystemExit(f"word-similarity file {path} not found: check the path")
    pairs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = [x for x in re.split(r"[\t;]|\s+", line) if x]
            if len(fields) < 3:
                continue
            try:
                score = float(fields[2])
            except ValueError:
                continue  # a header line
            w1, w2 = (re.sub(r"-[nvja]$", "", w) for w in fields[:2])
            pairs.append((w1, w2, score))
    if not pairs:
        raise SystemExit(f"{path}: no 'word1 word2 score' lines found")
    return pairs


def word_vector(word, weight, tokenizer, kind):
    """Mean of the word's subword embeddings (BPE: the word as it appears in running text, after a space);
    None when the word is out of the vocabulary (word-level tokenizer)."""
    if kind == "bpe":
        ids = tokenizer.encode(" " + word).ids
    else:
        i = tokenizer.token_to_id(word)
        if i is None:
            i = tokenizer.token_to_id(word.capitalize())
        ids = [] if i is None else [i]
    return weight[ids].mean(0) if ids else None


def word_similarity(weight, tokenizer, kind, datasets):
    """{name: (spearman, pairs used, pairs total)} of cosine similarity vs human scores."""
    from scipy.stats import spearmanr
    out = {}
    for name, path in datasets.items():
        pairs = load_word_pairs(path)
        human, model = [], []
        for w1, w2, score in pairs:
            a, b = word_vector(w1, weight, tokenizer, kind), word_vector(w2, weight, tokenizer, kind)
            if a is None or b is None:
                continue
            human.append(score)
            model.append(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
        rho = float(spearmanr(human, model).statistic) if len(human) > 2 else float("nan")
        out[name] = (rho, len(human), len(pairs))
    return out


# ------------------------------------------------------------------------------------------------------- geometry
def group_index(counts):
    """Tensor (V,) of group ids 0/1/2 (freq/med/rare) and the three index tensors (AGG Sec. 3.1)."""
    groups = agg.frequency_groups(counts)
    return agg.group_of(groups, len(counts)), groups


def geometry(weight, counts, include_unseen=False):
    """agg.geometry per frequency group, over the tokens seen in training unless include_unseen, and the metrics that
    favour no method: IsoScore (Rudman et al. 2022; not dominated by rare rows as I(W)'s min/max is), I(W) with rows
    weighted by their training frequency (Yokoi et al. 2024), I(W) after removing the mean row (does a method do more
    than remove the common drift?) and the weighted view of it (minus the frequency-weighted mean row), and the
    under-trained rows of Land & Bartolo 2024 (undertrained_count)."""
    _, groups = group_index(counts)
    counts = torch.as_tensor(counts)
    seen = None if include_unseen else counts > 0
    geo = agg.geometry(weight, dict(zip(agg.GROUPS, groups)), seen)
    geo["geometry_rows_rule"] = "all" if include_unseen else "seen in training"
    W = weight.detach().double().cpu()
    rows = W if seen is None else W[seen]
    seen_rows, freq = W[counts > 0], counts[counts > 0].double()
    geo.update(isoscore=agg.isoscore(rows), isotropy_centered=agg.isotropy(rows, center=True),
               isotropy_weighted=agg.isotropy(seen_rows, weights=freq),
               isotropy_weighted_centered=agg.isotropy(seen_rows, weights=freq, center=True),
               undertrained=undertrained_count(W, counts))
    return geo


def undertrained_count(W, counts):
    """How many rows of tokens seen in training look as untrained as a typical never-seen token: the indicator of
    Land & Bartolo 2024 (agg.undertrained_rows: cosine to the mean of the never-seen rows after removing the first
    principal component) at least the median of the never-seen rows' own. None when every token was seen."""
    unused = (counts == 0).nonzero().squeeze(1)
    if len(unused) < 2:
        return dict(unused_rows=len(unused), count=None, share_of_seen=None)
    ind = agg.undertrained_rows(W, unused)
    threshold = float(ind[unused].median())
    count = int((ind[counts > 0] >= threshold).sum())
    return dict(unused_rows=len(unused), threshold=threshold, count=count, share_of_seen=count / int((counts > 0).sum()),
                rule="seen rows whose indicator >= the median indicator of the never-seen rows")


def pick_rare_tokens(counts, tokens, n, src_counts=None):
    """A few rare-group tokens to show neighbours of: word-like tokens (letters, >= 4 chars), the most frequent of
    the rare group (the rare tokens the model saw most, as AGG Table 12's examples) - or, for NMT, the target-side
    rare tokens most frequent on the source side (AGG Table 13)."""
    gid, _ = group_index(counts)
    key = counts if src_counts is None else torch.as_tensor(src_counts)
    cands = [i for i in torch.argsort(key.double(), descending=True, stable=True).tolist()
             if gid[i] == 2 and key[i] > 0 and re.fullmatch(r"[^\W\d_]{4,}", tokens[i].strip())]
    words = [i for i in cands if tokens[i].startswith(" ")]  # byte-level BPE: word-initial tokens are whole words
    return (words if len(words) >= n else cands)[:n]


def neighbours(weight, ids, k=5):
    W = torch.nn.functional.normalize(weight.detach().float().cpu(), dim=1)
    sims = W[ids] @ W.T
    sims[torch.arange(len(ids)), ids] = -2  # not itself
    return sims.topk(k, dim=1).indices.tolist()


def plot_singular_values(spectra, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, s in spectra.items():
        ax.plot(np.arange(1, len(s) + 1), s, label=label)
    ax.set_xlabel("index")
    ax.set_ylabel("normalised singular value")
    ax.set_title("Singular values of the tied embedding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_svd(weights, counts, path):
    """2-D projection on the top two right singular vectors of W (uncentred, so a common direction shows)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(weights)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 4), squeeze=False)
    for ax, (label, W) in zip(axes[0], weights.items()):
        W = W.detach().double().cpu()
        _, _, vh = torch.linalg.svd(W, full_matrices=False)
        P = (W @ vh[:2].T).numpy()
        gid, _ = group_index(counts[label])
        for g in (0, 1, 2):  # frequent drawn last, on top
            m = (gid == 2 - g).numpy()
            name = agg.GROUPS[2 - g]
            ax.scatter(P[m, 0], P[m, 1], s=2, alpha=0.5, c=GROUP_COLOURS[name], label=name, rasterized=True)
        ax.set_title(label, fontsize=9)
        ax.set_aspect("equal", adjustable="datalim")
    axes[0][0].legend(markerscale=5, fontsize=8)
    fig.suptitle("2-D SVD projection of the tied embedding (red rare, green medium, blue frequent)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------- LM
def rare_logit_stats(logits, y, rare):
    """Per scored position, all that a scalar bias b on the rare group's logits changes: the target, its logit and
    whether it is rare, and the log-sum-exp and argmax (value, id) over the rare group and over the other tokens."""
    z, y = logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)
    zr, zo = z.masked_fill(~rare, -math.inf), z.masked_fill(rare, -math.inf)
    (max_rare, arg_rare), (max_other, arg_other) = zr.max(-1), zo.max(-1)
    return dict(target=y, z_y=z.gather(1, y[:, None]).squeeze(1), y_rare=rare[y], lse_rare=torch.logsumexp(zr, -1),
                lse_other=torch.logsumexp(zo, -1), max_rare=max_rare, arg_rare=arg_rare, max_other=max_other,
                arg_other=arg_other)


def fit_rare_bias(st):
    """The scalar b on the rare group's logits that minimises the mean NLL of the positions `st` (rare_logit_stats).
    The NLL is convex in b and its derivative is (mean predicted rare mass) - (share of rare targets), so the fitted
    b also calibrates the rare group's predicted mass. Newton's method, steps clipped to +-4."""
    b, y_share = 0.0, st["y_rare"].double().mean()
    for _ in range(100):
        p = torch.sigmoid(st["lse_rare"].double() + b - st["lse_other"].double())
        step = float(((p.mean() - y_share) / (p * (1 - p)).mean().clamp(min=1e-12)).clamp(-4, 4))
        b -= step
        if abs(step) < 1e-9:
            break
    return b


def fit_temperature(batches, tol=1e-6):
    """The inverse temperature beta that minimises the mean NLL of softmax(beta * logits) over the positions that
    batches() yields as (logits, targets), a fresh pass per call. The NLL is convex in beta, with derivative
    E_p[z] - z_y and second derivative Var_p[z] per position: Newton's method from beta = 1, one pass per step."""
    beta = 1.0
    for _ in range(30):
        grad = curv = 0.0
        for logits, y in batches():
            z = logits.float().reshape(-1, logits.shape[-1])
            p = torch.softmax(beta * z, -1)
            mean = (p * z).sum(-1, keepdim=True)
            grad += float((mean.squeeze(1) - z.gather(1, y.reshape(-1, 1)).squeeze(1)).double().sum())
            curv += float((p * (z - mean) ** 2).sum(-1).double().sum())
        step = max(-0.5, min(0.5, grad / max(curv, 1e-12)))
        beta -= step
        if abs(step) < tol:
            break
    return beta


def rare_bias_metrics(st, b, gid):
    """PPL total and per group, rare-group mass (predicted / true), Uniq and the precision and recall of rare argmax
    predictions of the positions `st` with b added to the rare group's logits (b = 0: the model as it is)."""
    lse_rare = st["lse_rare"].double() + b
    nll = torch.logaddexp(st["lse_other"].double(), lse_rare) - (st["z_y"].double() + b * st["y_rare"].double())
    pred = torch.where(st["max_rare"] + b > st["max_other"], st["arg_rare"], st["arg_other"])
    g = gid[st["target"]]
    pred_rare, hit = gid[pred] == 2, pred == st["target"]
    up = pred.unique()
    acc = agg.GroupNLL()
    acc.add(nll, g)
    return dict(bias=b, ppl=acc.ppl(), ppl_groups=acc.ppl_groups(),
                rare_mass_pred=float(torch.sigmoid(lse_rare - st["lse_other"].double()).mean()),
                rare_mass_true=float(st["y_rare"].double().mean()),
                uniq=int(len(up)), uniq_groups={name: int((gid[up] == k).sum()) for k, name in enumerate(agg.GROUPS)},
                rare_argmax_precision=float(hit[pred_rare].double().mean()) if pred_rare.any() else float("nan"),
                rare_argmax_recall=float(hit[g == 2].double().mean()) if (g == 2).any() else float("nan"),
                rare_argmax_count=int(pred_rare.sum()))


def repeated_4grams(tokens):
    """seq-rep-4 of Welleck et al. 2020: the share of a continuation's 4-grams that are repeats, 1 - unique / all."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def distinct_n(continuations, n):
    """distinct-n (Li et al. 2016): distinct n-grams over all n-grams of the continuations, pooled."""
    grams = [tuple(c[i:i + n]) for c in continuations for i in range(len(c) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def run_data_dir(cfg, data_dir):
    """--data-dir: the run's corpus read from another folder (moved or copied); the data fingerprint is checked after
    reading, as for the run's own folder. A run whose data folder is gone says so."""
    if data_dir:
        if cfg.get("dataset") != "dir":
            raise SystemExit(f"--data-dir {data_dir}: {cfg['out']} was trained on --dataset {cfg.get('dataset')}, "
                             f"not on a --data-dir; leave --data-dir out")
        cfg["data_dir"] = os.path.abspath(data_dir)
    elif cfg.get("dataset") == "dir" and not os.path.isdir(cfg["data_dir"]):
        raise SystemExit(f"{cfg['out']}: its data folder {cfg['data_dir']} is not there (moved?): give eval.py "
                         f"--data-dir with the folder's new place")


def document_of(ids, eos_id, documents):
    """(article index of every position of `ids` as a LongTensor, lines per article) when the split's articles are
    known (data.py's meta.json "documents": lines per article; every line ends with EOS), else None."""
    if not documents:
        return None
    eos = torch.from_numpy(np.asarray(ids) == eos_id)
    line = torch.cumsum(eos.long(), 0) - eos.long()  # a line's EOS belongs to it
    ends = torch.cumsum(torch.tensor(documents), 0)
    return torch.searchsorted(ends, line, right=True).clamp(max=len(documents) - 1), documents


@torch.no_grad()
def evaluate_lm(out_dir, model, ck, args, device):
    """A train_lm.py run on its test split (or --split valid): PPL total and per frequency group, Uniq (distinct argmax
    next-token predictions; AGG Table 3) total and per group with the human reference, the free re-weighting baseline
    (one bias on the rare group's logits fitted on valid), the free calibration baseline (one temperature on all
    logits fitted on valid), greedy continuations of test prefixes (AGG Table 14) and
    word similarity of the tied embedding (AGG Table 5). Returns (metrics, weight, train counts, None, tokens)."""
    cfg = dict(ck["config"], device=str(device), out=out_dir)
    if args.cache_dir:
        cfg["cache_dir"] = args.cache_dir
    run_data_dir(cfg, args.data_dir)
    data = prepare_lm(cfg, log=lambda *a: None)
    if not runlib.same_data(cfg.get("data_fingerprint"), os.path.basename(data["dir"])):
        raise SystemExit(f"{cfg['out']}: the corpus or tokenizer changed since this run trained (its data was "
                         f"{cfg['data_fingerprint']}, now {os.path.basename(data['dir'])}): restore the original "
                         f"files to evaluate it")
    V, tok = data["vocab_size"], data["tokenizer"]
    autocast = runlib.autocast(cfg)
    gid = agg.group_of(agg.frequency_groups(data["counts"]), V)
    gid_d, rare_d = gid.to(device), gid.to(device) == 2
    ids = data["ids"][args.split]
    n = len(ids) - 1 if not args.max_tokens else min(len(ids) - 1, args.max_tokens)
    # The free calibration baseline: one temperature on all logits, fitted on the valid split (minimum NLL)
    beta = fit_temperature(lambda: train_lm.score(model, data["ids"]["valid"], len(data["ids"]["valid"]) - 1, cfg,
                                                  device, autocast, args.context_window))
    acc, acc_t = agg.GroupNLL(), agg.GroupNLL()
    type_nll = torch.zeros(V, dtype=torch.float64)  # NLL summed per target type: the per-type share of a PPL gap
    preds, targets, stats = [], [], []
    doc = document_of(ids, data["eos_id"], data["meta"].get("documents", {}).get(args.split))
    articles = agg.GroupNLL(3 * len(doc[1])) if doc is not None else None  # NLL per (article, group)
    for logits, y, pos in tqdm(train_lm.score(model, ids, n, cfg, device, autocast, args.context_window, True),
                               desc=f"{os.path.basename(os.path.normpath(cfg['out']))} {args.split}", leave=False):
        nll = -torch.log_softmax(logits.float(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1).double()
        acc.add(nll, gid_d[y])
        acc_t.add(-torch.log_softmax(beta * logits.float(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1).double(), gid_d[y])
        if articles is not None:
            articles.add(nll.cpu(), 3 * doc[0][pos] + gid[y.cpu()])
        type_nll.index_add_(0, y.flatten().cpu(), nll.flatten().cpu())
        preds.append(logits.argmax(-1).flatten().cpu())
        targets.append(y.flatten().cpu())
        stats.append({k: v.cpu() for k, v in rare_logit_stats(logits, y, rare_d).items()})
    preds, targets = torch.cat(preds), torch.cat(targets)
    # The free re-weighting baseline: one bias on the rare group's logits, fitted on the valid split (minimum NLL,
    # which also calibrates the group's predicted mass), applied to this split.
    fit = [{k: v.cpu() for k, v in rare_logit_stats(lg, y, rare_d).items()}
           for lg, y in train_lm.score(model, data["ids"]["valid"], len(data["ids"]["valid"]) - 1, cfg, device,
                                       autocast, args.context_window)]
    cat = lambda parts: {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    stats, bias = cat(stats), fit_rare_bias(cat(fit))
    up, ut = preds.unique(), targets.unique()
    m = dict(task="lm", method=cfg["method"], step=ck["step"], out_dir=cfg["out"], split=args.split,
             context_window=args.context_window, tokens=acc.tokens(), ppl=acc.ppl(), ppl_groups=acc.ppl_groups(),
             uniq=int(len(up)), uniq_groups={g: int((gid[up] == k).sum()) for k, g in enumerate(agg.GROUPS)},
             uniq_human=int(len(ut)), uniq_human_groups={g: int((gid[ut] == k).sum()) for k, g in enumerate(agg.GROUPS)},
             rare_argmax=rare_bias_metrics(stats, 0.0, gid), rare_bias=rare_bias_metrics(stats, bias, gid),
             temperature=dict(t=1 / beta, ppl=acc_t.ppl(), ppl_groups=acc_t.ppl_groups()),
             type_stats=dict(nll=type_nll, count=torch.bincount(targets, minlength=V)),  # for --compare, not saved
             article_stats=None if articles is None else dict(  # per held-out article and group: the bootstrap units
                 nll=articles.nll.view(-1, 3).tolist(), count=articles.count.view(-1, 3).tolist()))
    # greedy continuations of evenly spaced prefixes of the split (AGG Table 14)
    gens, greedy, span = [], [], args.prefix_len + args.gen_len
    if len(ids) > span and args.n_samples:
        for j in range(args.n_samples):
            s = j * (len(ids) - span) // max(1, args.n_samples)
            prefix = torch.from_numpy(np.asarray(ids[s:s + args.prefix_len], dtype=np.int64))[None].to(device)
            cont = model.generate(prefix, args.gen_len, autocast=autocast)[0, prefix.shape[1]:].tolist()
            greedy.append(cont)
            human = np.asarray(ids[s + args.prefix_len:s + span]).tolist()
            gens.append(dict(position=s, prefix=tok.decode(prefix[0].tolist()), continuation=tok.decode(cont),
                             human=tok.decode(human), uniq=len(set(cont)), uniq_human=len(set(human)),
                             rep4=repeated_4grams(cont), rep4_human=repeated_4grams(human)))
    m["generations"] = gens
    for key in ("uniq", "uniq_human", "rep4", "rep4_human"):
        m[f"gen_{key}"] = float(np.mean([g[key] for g in gens])) if gens else float("nan")
    # the same prefixes continued by sampling (temperature 1, seeded): diversity where greedy decoding hides it
    if gens:
        torch.manual_seed(0)
        sampled = []
        for g in gens:
            prefix = torch.from_numpy(np.asarray(ids[g["position"]:g["position"] + args.prefix_len], dtype=np.int64))
            out = model.generate(prefix[None].to(device), args.gen_len, temperature=1.0)
            sampled.append(out[0, args.prefix_len:].tolist())
        m["gen_rep4_sampled"] = float(np.mean([repeated_4grams(c) for c in sampled]))
        m["gen_distinct"] = {kind: {str(n): distinct_n(conts, n) for n in (1, 2, 3, 4)}
                             for kind, conts in (("greedy", greedy), ("sampled", sampled))}
    W = model.out_weight.detach().float().cpu()  # the softmax's matrix: the tied embedding, or lm_head with --untie
    sims = {k: gensim_test_data(v) for k, v in WORDSIM.items()}
    sims.update({k: getattr(args, k) for k in ("men", "rg65", "rw") if getattr(args, k)})
    ws = word_similarity(W, tok, cfg["tokenizer"], sims)
    m["word_similarity"] = {k: v[0] for k, v in ws.items()}
    m["word_similarity_pairs"] = {k: [v[1], v[2]] for k, v in ws.items()}
    tokens = [tok.decode([i]) if cfg["tokenizer"] == "bpe" else (tok.id_to_token(i) or "") for i in range(V)]
    return m, W, data["counts"], None, tokens


# ------------------------------------------------------------------------------------------------------------ NMT
def average_checkpoints(out_dir, n):
    """The mean of the model weights of the last n snapshots, as fairseq's scripts/average_checkpoints.py."""
    if n < 1:  # [-n:] of a negative n would drop snapshots instead of taking the last ones
        raise SystemExit(f"--average-last {n}: give the number of snapshots to average, >= 1 (0: the last checkpoint)")
    paths = runlib.snapshots(out_dir)[-n:]
    if len(paths) < n:
        raise SystemExit(f"{out_dir}: --average-last {n} needs {n} ckpt_STEP.pt snapshots, found {len(paths)}; "
                         f"train with --keep-last {n} (or more)")
    avg = None
    for p in paths:
        model = runlib.load_checkpoint(p, "nmt")["model"]
        if avg is None:
            avg = {k: v.double().clone() for k, v in model.items()}
        else:
            for k, v in model.items():
                avg[k] += v.double()
    return {k: (v / n).to(model[k].dtype) for k, v in avg.items()}, [os.path.basename(p) for p in paths]


@torch.no_grad()
def evaluate_nmt(out_dir, model, ck, args, device):
    """A train_nmt.py run on its test split: BLEU (sacrebleu, detokenised, with its signature), test PPL total and per
    group, the target side's metrics (train_nmt.validate) and the first test translations; with --average-last N
    the mean of the last N snapshots instead of the last checkpoint. Returns (metrics, weight, counts of both sides,
    source counts, tokens)."""
    import train_nmt  # its decoding and metrics
    cfg = dict(ck["config"], device=str(device), beam=args.beam, out=out_dir)
    run_data_dir(cfg, args.data_dir)
    data = prepare_nmt(cfg, log=lambda *a: None)
    same = runlib.same_data(cfg.get("data_fingerprint"), data.cache.name)
    if not same or data.vocab_size != model.out_weight.shape[0]:
        raise SystemExit(f"{cfg['out']}: the corpus or tokenizer changed since this run trained (its data was "
                         f"{cfg.get('data_fingerprint')}, V={model.out_weight.shape[0]}; now {data.cache.name}, "
                         f"V={data.vocab_size}): restore the original files to evaluate it")
    if args.max_sentences:
        for k in ("test.src", "test.tgt"):
            data.ids[k] = data.ids[k][:args.max_sentences]
        data.text["test"] = tuple(side[:args.max_sentences] for side in data.text["test"])
    averaged = None
    if args.average_last:
        weights, averaged = average_checkpoints(cfg["out"], args.average_last)
        model.load_state_dict(weights)
    res, hyps = train_nmt.validate(model, None, data, cfg, device, split="test", bleu_sents=0)
    hyp_text = [data.decode(h) for h in hyps]
    src_text, ref_text = data.text["test"]
    m = dict(task="nmt", out_dir=cfg["out"], bleu=res["bleu"], bleu_signature=res["bleu_signature"],
             test_loss=res["loss"], test_ppl=res["ppl"], ppl_groups=res["ppl_groups"],
             group_rare_mass_pred=res["group_rare_mass_pred"], group_rare_mass_true=res["group_rare_mass_true"],
             decode_s=res["decode_s"], n_sentences=res["bleu_sents"], beam=args.beam, lenpen=cfg["lenpen"],
             src=cfg["src"], tgt=cfg["tgt"], dataset=cfg["dataset"], method=cfg["method"], step=ck["step"],
             norm=cfg.get("norm", "pre"), target=res["target"], rare_rule=train_nmt.rare_rule(cfg),
             checkpoints_averaged=len(averaged) if averaged else 0, averaged_files=averaged,
             **{k: res[k] for k in ("bleu_tok_compound", "bleu_tok_compound_protocol") if k in res},
             translations=[dict(src=src_text[i], ref=ref_text[i], hyp=hyp_text[i]) for i in range(min(5, len(hyps)))],
             texts=dict(hyps=hyp_text, refs=list(ref_text),  # for --compare's paired bootstrap, not saved
                        bleu_tokenize=cfg["bleu_tokenize"] or train_nmt.BLEU_TOKENIZE.get(cfg["tgt"], "13a")))
    print(f"{cfg['out']}: test BLEU {res['bleu']:.2f} ({res['bleu_signature']})")
    return m, model.out_weight.detach().float().cpu(), data.corpus_counts.clone(), data.src_counts.clone(), data.tokens()


# --------------------------------------------------------------------------------------------------------- driver
def evaluate(run_dir, args=None, device=None, **flags):
    """One run's evaluation, task metrics and geometry, the one read of its checkpoint. From Python: flags are
    eval.py's by name (split="valid", n_samples=0, beam=2, average_last=5, ...). Returns {"metrics", "weight" (V, d),
    "counts" (the frequency groups'), "src_counts" and "tgt_counts" (NMT, else None), "tokens", "out_bias"}."""
    if args is None:
        args = build_parser().parse_args([run_dir])
        unknown = set(flags) - set(vars(args))
        if unknown:
            raise TypeError(f"unknown eval.py flags {sorted(unknown)}")
        vars(args).update(flags)
    device = torch.device(device or args.device)
    ck = runlib.load_checkpoint(runlib.checkpoint_file(run_dir, args.checkpoint))
    model = {"lm": train_lm, "nmt": train_nmt}[ck["task"]].load_model(ck, device)
    task = ck.get("task") or ck["config"].get("task")
    m, W, c, src_c, tokens = (evaluate_lm if task == "lm" else evaluate_nmt)(run_dir, model, ck, args, device)
    m.update(geometry(W, c, args.include_unseen))
    bias = getattr(model, "out_bias", None)
    return dict(metrics=m, weight=W, counts=c, tokens=tokens, src_counts=src_c,
                tgt_counts=None if src_c is None else c - src_c,
                out_bias=None if bias is None else bias.detach().float().cpu())


def read_config(out_dir, which="last"):
    """(config, task) of a run folder from its config.json (no checkpoint read), checking that the checkpoint to
    evaluate exists; a folder without config.json falls back to the checkpoint's own config."""
    path = os.path.join(out_dir, "ckpt.pt" if which == "last" else "ckpt_best.pt")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no checkpoint. Pass run folders written by train_lm.py / train_nmt.py --out.")
    try:
        with open(os.path.join(out_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = runlib.load_checkpoint(path)["config"]
    task = cfg.get("task")
    if task not in ("lm", "nmt"):
        raise SystemExit(f"{path}: unknown task {task!r} (expected 'lm' or 'nmt')")
    return cfg, task


SUMMARY_SKIP = {"step", "tokens", "rows", "rows_groups", "seed", "uniq_human", "uniq_human_groups", "gen_uniq_human", "gen_rep4_human", "n_sentences", "beam",
                "lenpen", "word_similarity_pairs", "singular_values"}


# config keys that do not make two runs different experiments: the seed, where the data lies (data_fingerprint, the
# hash of the corpus and tokenizer, tells corpora apart), the run-control keys of the task's script
# (runlib.RUN_CONTROL), and a flag that rare_rule tells
NOT_AN_EXPERIMENT = {"seed", "data_dir", "source_only_rare"}


_FLAG_DEFAULTS = {}


def script_of(cfg):
    """The training script (module) of a run's config."""
    if cfg.get("task", "lm") == "lm":
        return train_lm
    import train_nmt
    return train_nmt


def flag_default(task, key):
    """The default of a training flag (by config key) of task's script: what a run saved before the flag existed ran."""
    if task not in _FLAG_DEFAULTS:
        import train_nmt
        script = train_lm if task == "lm" else train_nmt
        _FLAG_DEFAULTS[task] = vars(script.build_parser().parse_args([]))
    return _FLAG_DEFAULTS[task].get(key)


def variant_names(configs):
    """{run: summary key} for runs given as {run: config}: the run's method, or, where runs of one method differ in
    more than their seed, the method followed by the settings that tell them apart (e.g. 'ul+agg gate_ul=False'), so
    runs of different experiments are never averaged together. A method flag left unset shows the method's default;
    init_from shows whether one was given (the runs it names differ by seed)."""
    def setting(cfg, key):
        if key == "rare_rule" and cfg.get("task") == "nmt":
            import train_nmt
            return train_nmt.rare_rule(cfg)  # also of a config saved before --rare-rule
        value = cfg[key] if key in cfg else flag_default(cfg.get("task", "lm"), key)  # a run saved before the flag
        if key == "init_from":
            return value is not None
        if value is None:
            return getattr(agg.METHODS.get(cfg.get("method")), "defaults", {}).get(key)
        return value

    by_method = {}
    for run, cfg in configs.items():
        by_method.setdefault(cfg.get("method", "?"), []).append(run)
    names = {}
    for method, runs in by_method.items():
        flags = {k for r in runs for k in vars(script_of(configs[r]).build_parser().parse_args([]))}
        control = set().union(*(script_of(configs[r]).RUN_CONTROL for r in runs)) | NOT_AN_EXPERIMENT
        keys = sorted(({k for r in runs for k in configs[r]} & (flags | {"task", "rare_rule", "data_fingerprint"}))
                      - control)
        differ = [k for k in keys if len({repr(setting(configs[r], k)) for r in runs}) > 1]
        for r in runs:
            names[r] = method + "".join(f" {k}={setting(configs[r], k)}" for k in differ)
    return names


def summarise(metrics):
    """{variant: {"n": runs, METRIC: {"mean": m, "std": s}, GROUPED_METRIC: {group: {"mean", "std"}}}} over the runs
    of each variant (its seeds; the variant is the method unless runs of one method differ in more than their seed,
    see variant_names): every numeric metric and every dict of numeric metrics (std with ddof 1; 0 for one run)."""
    def stat(values):
        t = torch.tensor(values, dtype=torch.float64)
        return {"mean": float(t.mean()), "std": float(t.std()) if len(t) > 1 else 0.0,
                "median": statistics.median(values)}

    def numeric(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def nested(runs, key):  # a dict of numbers or of such dicts: summarised leaf by leaf
        first = runs[0][key]
        out = {}
        for k, v in first.items():
            if numeric(v):
                out[k] = stat([r[key][k] for r in runs])
            elif isinstance(v, dict) and v:
                out[k] = nested([r[key] for r in runs], k)
        return out

    by_method = {}
    for m in metrics.values():
        by_method.setdefault(m.get("variant", m.get("method", "?")), []).append(m)
    out = {}
    for method, runs in by_method.items():
        s = {"n": len(runs)}
        for key, value in runs[0].items():
            if key in SUMMARY_SKIP or isinstance(value, bool):
                continue
            if numeric(value):
                s[key] = stat([r[key] for r in runs])
            elif isinstance(value, dict) and value:
                s[key] = nested(runs, key) or None
                if s[key] is None:
                    del s[key]
        out[method] = s
    return out


# ----------------------------------------------------------------------------------------------- paired comparison
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
    from scipy import stats
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
        vals = [(_get(b, key), _get(c, key)) for b, c in pairs]
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
        import train_nmt
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
    from scipy import stats
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
    if not all("base" in e and "cand" in e for e in res.get("compare") or []):
        raise SystemExit(f"--reanalyse {path}: its comparisons are not eval.py's (a study's file: rerun the study's "
                         f"script with --no-train to rewrite it)")
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
    res["reanalysis_command"] = shlex.join(["python", "eval.py", "--reanalyse", os.path.relpath(path, runlib.ROOT)])
    runlib.write_json(path, res)
    return res


def pm(s, nd=2):
    """'mean +- std' of a summary entry."""
    return f"{fmt(s['mean'], nd)} ± {fmt(s['std'], nd)}"


def plot_training_curves(run_dirs, variants, path):
    """AGG Fig. 2: I(W) per frequency group and the rare-frequent cosine over training (LM or NMT; NMT adds valid
    BLEU), from the validation records of each run's log.jsonl. Runs of one variant (seeds) are drawn as their mean
    with a min-max band.
    Returns the path, or None when no run has such records."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [("isotropy_freq", "I(W) frequent"), ("isotropy_med", "I(W) medium"), ("isotropy_rare", "I(W) rare"),
            ("cosine_rare_freq", "cos(rare, frequent)"), ("ppl", "valid PPL")]
    groups = {}  # variant -> [records of each run]
    for label, d in run_dirs.items():
        recs = [r for r in log_records(d) if "isotropy_rare" in r]
        if recs:
            groups.setdefault(variants[label], []).append((label, recs))
    if not groups:
        return None
    if all("bleu" in r for runs in groups.values() for _, recs in runs for r in recs):  # NMT: the seeds' spread
        keys.append(("bleu", "valid BLEU"))
    colours = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    release = {}  # variant -> the step freeze-rare releases the rare embeddings (AGG Fig. 2), marked dotted
    for label, d in run_dirs.items():
        try:
            with open(os.path.join(d, "config.json")) as f:
                until = json.load(f).get("method_hparams", {}).get("until")
        except (OSError, json.JSONDecodeError):
            until = None
        if until is not None:
            release[variants[label]] = until
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.4))
    for ax, (key, title) in zip(axes, keys):
        for i, (variant, runs) in enumerate(groups.items()):
            colour = colours(i % colours.N)
            if variant in release:
                ax.axvline(release[variant], color=colour, ls=":", lw=1)
            if len(runs) == 1:
                label, recs = runs[0]
                ax.plot([r["step"] for r in recs], [r[key] for r in recs], label=label, lw=1, color=colour)
                continue
            steps = sorted(set.intersection(*({r["step"] for r in recs} for _, recs in runs)))
            values = np.array([[{r["step"]: r[key] for r in recs}[s] for s in steps] for _, recs in runs])
            ax.plot(steps, values.mean(0), label=f"{variant} (mean of {len(runs)})", lw=1, color=colour)
            ax.fill_between(steps, values.min(0), values.max(0), color=colour, alpha=0.2, lw=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if key == "ppl":
            ax.set_yscale("log")
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=6, loc="lower center",
               ncol=min(len(groups), 7), frameon=False)
    fig.suptitle("Validation records over training (AGG Fig. 2)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(groups) - 1) // 7), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_gradient_parts(run_dirs, variants, path):
    """AGG Eq. 4 over training: the mean row norm of the parts (a) pull, (b) push from non-rare-target features and
    (c) push from rare-target features of the weight gradient, per frequency group, as each method applies them
    (the valid records' grad_* keys; mean over the runs of a variant). Returns the path, or None without records."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_variant = {}
    for label, d in run_dirs.items():
        recs = [r for r in log_records(d) if "grad_b_rare" in r]
        if recs:
            by_variant.setdefault(variants[label], []).append(recs)
    if not by_variant:
        return None
    colours = plt.get_cmap("tab10" if len(by_variant) <= 10 else "tab20")  # one colour per method
    styles = {"a": ("--", "(a) pull to own features"), "b": ("-", "(b) push, non-rare targets"),
              "c": (":", "(c) push, rare targets")}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    for ax, group in zip(axes, agg.GROUPS):
        for i, (variant, runs) in enumerate(by_variant.items()):
            steps = sorted(set.intersection(*({r["step"] for r in recs} for recs in runs)))
            for part, (ls, _) in styles.items():
                key = f"grad_{part}_{group}"
                mean = np.array([[{r["step"]: r[key] for r in recs}[s] for s in steps] for recs in runs]).mean(0)
                ax.plot(steps, mean, ls=ls, color=colours(i % colours.N), lw=1.2,
                        label=f"{variant} {part}" if group == "rare" else None)
        ax.set_yscale("log")
        ax.set_title(f"{group} rows", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    axes[0].set_ylabel("mean row norm of the part", fontsize=8)
    fig.legend(loc="center right", fontsize=6, ncol=1 + len(by_variant) // 6)  # beside the axes: many methods fit
    fig.suptitle("Parts of the embeddings' gradient (AGG Eq. 4): (a) dashed, (b) solid, (c) dotted, as each method "
                 "applies them", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93 - 0.08 * (len(by_variant) // 6), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def output_bias_stats(bias, counts):
    """How a learned output bias (train_lm.py --output-bias) encodes frequency, over the tokens seen in training:
    Pearson and Spearman correlation with log train counts, the least-squares slope (bias per nat of frequency), and
    the mean bias per frequency group."""
    from scipy import stats
    b, c = bias.double(), torch.as_tensor(counts).double()
    seen = c > 0
    x, y = c[seen].log().numpy(), b[seen].numpy()
    gid, _ = group_index(counts)
    return dict(pearson_log_count=float(stats.pearsonr(x, y)[0]), spearman_log_count=float(stats.spearmanr(x, y)[0]),
                slope_per_log_count=float(np.polyfit(x, y, 1)[0]),
                mean_groups={g: float(b[seen & (gid == k)].mean()) for k, g in enumerate(agg.GROUPS)})


def plot_output_bias(biases, counts, path):
    """The learned output bias of each run against its token's log train count (seen tokens), coloured by group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(biases), figsize=(4 * len(biases), 3.6), squeeze=False, sharey=True)
    for ax, (label, b) in zip(axes[0], biases.items()):
        c = torch.as_tensor(counts[label]).double()
        gid, _ = group_index(counts[label])
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_rare_share(run_dirs, variants, path):
    """AGG Fig. 4: the size of the method's rare group (share of the vocabulary) over training, from the train records
    of the AGG-family runs (mean over the runs of a variant). Returns the path, or None without such records."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_variant = {}
    for label, d in run_dirs.items():
        recs = [r for r in log_records(d, "train") if "method_rare_fraction" in r]
        if recs:
            by_variant.setdefault(variants[label], []).append({r["step"]: r["method_rare_fraction"] for r in recs})
    if not by_variant:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for variant, runs in by_variant.items():
        steps = sorted(set.intersection(*(set(r) for r in runs)))
        ax.plot(steps, [np.mean([r[s] for r in runs]) for s in steps], label=f"{variant} ({len(runs)} runs)", lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.set_ylabel("rare group / vocabulary", fontsize=8)
    ax.set_title("Size of the rare group over training (AGG Fig. 4)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_snapshots(run_dirs, counts, path):
    """AGG Fig. 1 over time: the 2-D SVD projection of each run's embedding snapshots (train_lm.py --snapshot-steps),
    one row per run. Returns the path, or None when no run has snapshots."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {}
    for label, d in run_dirs.items():
        folder = os.path.join(d, "snapshots")
        if os.path.isdir(folder):
            files = sorted((int(f[4:-3]), os.path.join(folder, f)) for f in os.listdir(folder)
                           if f.startswith("emb_") and f.endswith(".pt") and f[4:-3].isdigit())
            if files:
                rows[label] = files
    if not rows:
        return None
    n_col = max(len(v) for v in rows.values())
    fig, axes = plt.subplots(len(rows), n_col, figsize=(3 * n_col, 3 * len(rows)), squeeze=False)
    for r, (label, files) in enumerate(rows.items()):
        gid, _ = group_index(counts[label])
        for c, (step, f) in enumerate(files):
            W = torch.load(f, map_location="cpu", weights_only=True)["weight"].double()
            _, _, vh = torch.linalg.svd(W, full_matrices=False)
            P = (W @ vh[:2].T).numpy()
            ax = axes[r][c]
            for g in (2, 1, 0):
                m = (gid == g).numpy()
                ax.scatter(P[m, 0], P[m, 1], s=1, alpha=0.5, c=GROUP_COLOURS[agg.GROUPS[g]], rasterized=True)
            ax.set_title(f"{label} step {step}", fontsize=8)
            ax.set_aspect("equal", adjustable="datalim")
        for c in range(len(files), n_col):
            axes[r][c].axis("off")
    fig.suptitle("Embeddings over training: 2-D SVD projection (red rare, green medium, blue frequent)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_records(out_dir, split="valid"):
    """The records of one split (valid or train) of a run's log.jsonl ([] when it has none); a torn line (a write cut
    short) is skipped with a warning."""
    path, recs = os.path.join(out_dir, "log.jsonl"), []
    if os.path.exists(path):
        with open(path) as f:
            for i, line in enumerate(f, 1):
                try:
                    r = json.loads(line) if line.strip() else {}
                except json.JSONDecodeError:
                    print(f"warning: {path} line {i} is not complete JSON (a torn write): skipped", file=sys.stderr)
                    continue
                if r.get("split") == split:
                    recs.append(r)
    return recs


def last_valid_ppl(out_dir, step):
    """The valid PPL logged at `step` in the run's log.jsonl (None when there is none)."""
    ppl = [r.get("ppl") for r in log_records(out_dir) if r.get("step") == step]
    return ppl[-1] if ppl else None


RESULT_KEYS = ("method", "variant", "seed", "step", "split", "tokens", "valid_ppl", "ppl", "ppl_groups", "uniq",
               "uniq_groups", "uniq_human", "uniq_human_groups", "isotropy", "isotropy_groups", "mean_cosine",
               "mean_cosine_groups", "norm_groups", "mean_row_share", "cosine_rare_freq", "rows", "geometry_rows_rule", "rare_argmax",
               "rare_bias", "temperature", "output_bias", "gen_rep4", "gen_distinct", "bleu", "bleu_signature", "test_ppl", "target",
               "rare_rule", "checkpoints_averaged", "isoscore", "isotropy_centered", "isotropy_weighted",
               "isotropy_weighted_centered",
               "undertrained", "article_stats", "word_similarity", "word_similarity_pairs")
RUN_KEYS = ("lr", "warmup", "split_seed", "preset", "tokens_per_step", "max_steps", "method_hparams", "optimizer",
            "untie", "weight_decay", "embedding_weight_decay", "dataset", "train_fraction",
            "method_rare_share", "keep_last", "save_interval", "git_commit", "agg_sha256")


def write_results(path, metrics, configs, folders, comparisons, argv):
    """A small JSON for results/: per run its headline metrics, its settings and the command that trained it (and,
    when its valid records hold them, "gradient_parts": per valid record the step and the mean row norms grad_*_GROUP
    of AGG Eq. 4's parts and norm_GROUP of the rows, the data of gradient_parts.png; for NMT, "valid_bleu" per step
    and "training_test_bleu", the test records of training: "test", the last checkpoint, and "test_averaged"); the
    evaluation command; the paired comparisons."""
    runs = {}
    for label, m in metrics.items():
        saved = os.path.join(folders[label], "config.json")  # with the provenance (argv, threads) of the run
        cfg = json.load(open(saved)) if os.path.exists(saved) else configs[folders[label]]
        script = "train_lm.py" if m.get("task") == "lm" else "train_nmt.py"
        versions = cfg.get("versions") or {}
        runs[label] = dict({k: m[k] for k in RESULT_KEYS if k in m}, **{k: cfg.get(k) for k in RUN_KEYS},
                           threads=versions.get("threads"), cpu_capability=versions.get("cpu_capability"),
                           kernels=versions.get("kernels"),
                           command=runlib.run_command(cfg, script))
        parts = [{k: v for k, v in r.items() if k == "step" or k.startswith(("grad_", "norm_"))}
                 for r in log_records(folders[label]) if "grad_b_rare" in r]
        if parts:
            runs[label]["gradient_parts"] = parts
        if "bleu" in m:  # NMT: BLEU over training and the test records training wrote (last checkpoint, average)
            runs[label]["valid_bleu"] = {r["step"]: r["bleu"] for r in log_records(folders[label]) if "bleu" in r}
            runs[label]["training_test_bleu"] = {r["split"]: r["bleu"] for split in ("test", "test_averaged")
                                                 for r in log_records(folders[label], split)[-1:]}
    rel = [os.path.relpath(a, runlib.ROOT) if os.path.isabs(a) else a for a in argv]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    runlib.write_json(path, dict(command=shlex.join(["python", "eval.py", *rel]), runs=runs, compare=comparisons))


def labels_for(out_dirs):
    labels = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    if len(set(labels)) < len(labels):
        labels = [os.path.relpath(os.path.normpath(d)) for d in out_dirs]
    return labels


def fmt(x, nd=2):
    if isinstance(x, float):
        return "nan" if math.isnan(x) else (f"{x:.{nd}f}" if abs(x) < 1e5 else f"{x:.3g}")
    return str(x)


def write_report(path, metrics, extras, args, argv, summary=None, curves=None, snapshots=None, comparisons=()):
    L = ["# Evaluation report", "", f"`{shlex.join(['python', 'eval.py', *argv])}`", "",
         f"Checkpoint: {args.checkpoint} ({'ckpt.pt' if args.checkpoint == 'last' else 'ckpt_best.pt'}).", ""]
    if summary and any(s["n"] > 1 for s in summary.values()):
        cols = [("ppl", "PPL"), ("ppl_groups.rare", "PPL rare"), ("uniq", "Uniq"), ("isotropy", "I(W)"),
                ("isotropy_groups.rare", "I rare"), ("mean_cosine", "mean cos"),
                ("mean_cosine_groups.rare", "cos rare"), ("bleu", "BLEU"), ("test_ppl", "test PPL"),
                ("group_rare_mass_pred", "rare mass pred"), ("group_rare_mass_true", "rare mass true")]
        cols = [(k, h) for k, h in cols if any(_get(s, k) for s in summary.values())]
        L += ["## Mean ± std over the runs (seeds) of each method", "", "| method | n | " + " | ".join(h for _, h in cols) +
              " |", "|" + " --- |" * (2 + len(cols))]
        for method, s in summary.items():
            L.append(f"| {method} | {s['n']} | " + " | ".join(pm(_get(s, k), 3 if "isotropy" in k or "cos" in k
                                                                      else 2) if _get(s, k) else "-"
                                                                 for k, _ in cols) + " |")
        L.append("")
    lm = [k for k, m in metrics.items() if m["task"] == "lm"]
    nmt = [k for k, m in metrics.items() if m["task"] == "nmt"]
    if lm:
        split = metrics[lm[0]]["split"]
        L += [f"## Language modelling ({split} split; groups: 30% frequent / 50% medium / 20% rare by train counts)",
              "", "| run | method | step | PPL freq | PPL med | PPL rare | PPL total | Uniq freq | Uniq med | Uniq rare "
              "| Uniq total | I(W) | I freq | I med | I rare | mean cos | " +
              " | ".join(metrics[lm[0]]["word_similarity"]) + " |",
              "|" + " --- |" * (16 + len(metrics[lm[0]]["word_similarity"]))]
        for k in lm:
            m = metrics[k]
            L.append(f"| {k} | {m['method']} | {m['step']} | " +
                     " | ".join(fmt(m["ppl_groups"][g]) for g in agg.GROUPS) + f" | {fmt(m['ppl'])} | " +
                     " | ".join(str(m["uniq_groups"][g]) for g in agg.GROUPS) + f" | {m['uniq']} | {fmt(m['isotropy'], 3)} | " +
                     " | ".join(fmt(m["isotropy_groups"][g], 3) for g in agg.GROUPS) + f" | {fmt(m['mean_cosine'], 3)} | " +
                     " | ".join(fmt(v, 3) for v in m["word_similarity"].values()) + " |")
        h = metrics[lm[0]]
        L.append("| human | - | - | - | - | - | - | " + " | ".join(str(h["uniq_human_groups"][g]) for g in agg.GROUPS) +
                 f" | {h['uniq_human']} |" + " - |" * (5 + len(h["word_similarity"])))
        L += ["", "Word similarity: Spearman correlation of the cosine of mean subword embeddings with human scores "
              "(pairs used / total: " + "; ".join(f"{n} {u}/{t}" for n, (u, t) in
                                                   h["word_similarity_pairs"].items()) + ").", ""]
        L += ["Greedy continuations (Uniq = distinct tokens in 100 generated tokens; seq-rep-4 = share of repeated "
              "4-grams, Welleck et al. 2020):", "",
              "| run | mean Uniq per sample | mean seq-rep-4 |", "| --- | --- | --- |"]
        L += [f"| {k} | {fmt(metrics[k]['gen_uniq'], 1)} | {fmt(metrics[k]['gen_rep4'], 3)} |" for k in lm]
        L += [f"| human | {fmt(h['gen_uniq_human'], 1)} | {fmt(h['gen_rep4_human'], 3)} |", ""]
        for j, g in enumerate(h["generations"][:args.show_samples]):
            L += [f"**Sample {j + 1}** prefix: {_md(g['prefix'])}", "",
                  f"- human (Uniq {g['uniq_human']}): {_md(g['human'])}"]
            L += [f"- {k} (Uniq {metrics[k]['generations'][j]['uniq']}): "
                  f"{_md(metrics[k]['generations'][j]['continuation'])}" for k in lm]
            L.append("")
    if nmt:
        L += ["## Machine translation", "", "| run | method | BLEU | test PPL | PPL freq | PPL med | PPL rare | I(W) | "
              "I freq | I med | I rare | mean cos | rare mass pred / true | signature |", "|" + " --- |" * 14]
        for k in nmt:
            m = metrics[k]
            L.append(f"| {k} | {m.get('method', '?')} | {fmt(m.get('bleu', float('nan')))} | "
                     f"{fmt(m.get('test_ppl', float('nan')))} | " +
                     " | ".join(fmt(m.get("ppl_groups", {}).get(g, float("nan"))) for g in agg.GROUPS) +
                     f" | {fmt(m['isotropy'], 3)} | " + " | ".join(fmt(m["isotropy_groups"][g], 3) for g in agg.GROUPS) +
                     f" | {fmt(m['mean_cosine'], 3)} | {fmt(m.get('group_rare_mass_pred', float('nan')), 4)} / "
                     f"{fmt(m.get('group_rare_mass_true', float('nan')), 4)} | `{_md(m.get('bleu_signature', ''))}` |")
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
              "share predicted exactly.", "",
              "| run | bias | PPL | PPL rare | rare mass pred / true | Uniq | Uniq rare | rare argmax precision | "
              "rare argmax recall |", "|" + " --- |" * 9]
        for k in biased:
            a, b = metrics[k]["rare_argmax"], metrics[k]["rare_bias"]
            L.append(f"| {k} | 0 -> {b['bias']:+.3f} | {fmt(a['ppl'])} -> {fmt(b['ppl'])} | "
                     f"{fmt(a['ppl_groups']['rare'])} -> {fmt(b['ppl_groups']['rare'])} | "
                     f"{a['rare_mass_pred']:.4f} -> {b['rare_mass_pred']:.4f} / {a['rare_mass_true']:.4f} | "
                     f"{a['uniq']} -> {b['uniq']} | {a['uniq_groups']['rare']} -> {b['uniq_groups']['rare']} | "
                     f"{fmt(a['rare_argmax_precision'], 3)} -> {fmt(b['rare_argmax_precision'], 3)} | "
                     f"{fmt(a['rare_argmax_recall'], 3)} -> {fmt(b['rare_argmax_recall'], 3)} |")
        L.append("")
    for c in comparisons:
        L += [f"## Paired comparison: {c['cand']} against {c['base']} (seeds {', '.join(map(str, c['seeds']))})", "",
              "PPL rows: geometric-mean ratio cand / base and intervals of the ratio; other rows: differences.", "",
              "| metric | base (mean) | cand (mean) | change | 95% t interval | 95% bootstrap | median | p (paired t) |",
              "|" + " --- |" * 8]
        for key, r in c["metrics"].items():
            f = (lambda x: f"x{math.exp(x):.3f}") if r["log_ratio"] else (lambda x: f"{x:+.4g}")
            iv = lambda name: f"[{f(r[name][0])}, {f(r[name][1])}]" if name in r else "-"
            L.append(f"| {key} | {fmt(float(np.mean(r['base'])), 3)} | {fmt(float(np.mean(r['cand'])), 3)} | "
                     f"{f(r['mean'])} | {iv('t95')} | {iv('boot95')} | {f(r['median'])} | {fmt(r.get('p', float('nan')), 3)} |")
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
    for k, (rows, _) in extras.items():
        L += [f"**{k}**", "", "| token | top-5 neighbours |", "| --- | --- |"]
        L += [f"| {_md(t)} | {', '.join(_md(n) for n in ns)} |" for t, ns in rows.items()]
        L.append("")
    L += ["## Plots", "", "![singular values](singular_values.png)", "", "![SVD projection](svd_projection.png)", ""]
    if curves:
        L += ["![training curves](training_curves.png)", ""]
    if snapshots:
        L += ["![SVD projection over training](svd_over_time.png)", ""]
    L += [
          "Tokens that never occur in training receive (almost) no gradient under the gated methods and stay near "
          "their initialisation: they form a cluster at the origin of the projection.", ""]
    runlib.write_text(path, "\n".join(L))


def _get(summary, dotted):
    """summary["a"]["b"] for "a.b", or None."""
    node = summary
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _md(s):
    return str(s).replace("|", "\\|").replace("\n", " ⏎ ").strip()


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", nargs="*", help="run folders (each with ckpt.pt)")
    p.add_argument("--reanalyse", default=None, metavar="FILE",
                   help="recompute the comparisons of a results file from its per-run records (no run folders)")
    p.add_argument("--add", nargs="+", default=[], metavar="FILE",
                   help="with --reanalyse: results files whose runs join FILE's first (more seeds; a rerun replaces "
                        "the run of its name)")
    p.add_argument("--out", default=os.path.join(runlib.ROOT, "out", "report"), help="report folder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--split", default="test", choices=["test", "valid"], help="LM split to evaluate")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on LM evaluation tokens (default: all)")
    p.add_argument("--max-sentences", type=int, default=None, help="NMT: the first N test sentences (default: all)")
    p.add_argument("--context-window", type=int, default=0,
                   help="LM: score each block after this many tokens of context, as fairseq's --context-window "
                        "(default 0: non-overlapping blocks, the same scoring as training's validation)")
    p.add_argument("--cache-dir", default=None, help="LM data cache (default: the run's own)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="the runs' --data-dir corpus at another path (moved or copied); used when its files are the "
                        "ones the run trained on (the data fingerprint matches)")
    p.add_argument("--n-samples", type=int, default=5, help="greedy continuations per run")
    p.add_argument("--show-samples", type=int, default=2, help="continuations (LM) or test translations (NMT) printed in report.md")
    p.add_argument("--prefix-len", type=int, default=50)
    p.add_argument("--gen-len", type=int, default=100)
    p.add_argument("--n-rare-tokens", type=int, default=6, help="rare tokens whose neighbours are listed")
    p.add_argument("--men", default=None, help="MEN word-similarity file (word1 word2 score)")
    p.add_argument("--rg65", default=None, help="RG65 word-similarity file")
    p.add_argument("--rw", default=None, help="Stanford Rare Words file")
    p.add_argument("--beam", type=int, default=4, help="NMT beam size")
    p.add_argument("--average-last", type=int, default=0,
                   help="NMT: evaluate the mean weights of the last N snapshots of a run trained with --keep-last N "
                        "(fairseq's average_checkpoints); recorded as checkpoints_averaged")
    p.add_argument("--include-unseen", action="store_true",
                   help="count the tokens never seen in training in the geometry metrics (default: left out)")
    p.add_argument("--compare", nargs=2, action="append", default=[], metavar=("BASE", "CAND"),
                   help="paired comparison of two variants (names as in summary.json, e.g. mle agg) over their common "
                        "seeds: intervals, rare-PPL per-type split, free-baseline share, NMT's paired BLEU "
                        "bootstrap -> compare.json (repeatable). Default, for runs of exactly two variants: the "
                        "two, mle as the base where it is one of them")
    p.add_argument("--results", default=None, metavar="FILE",
                   help="also write FILE: a small JSON of every run's headline metrics with the command that trained it "
                        "and this evaluation's command, plus the --compare results (for results/)")
    p.add_argument("--checkpoint", default="last", choices=["last", "best"],
                   help="last: ckpt.pt (the end of training); best: ckpt_best.pt (lowest validation PPL, LM runs)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.add)
    if args.add:
        raise SystemExit("eval.py: --add goes with --reanalyse FILE (the results file the runs join)")
    if not args.out_dirs:
        raise SystemExit("eval.py: give run folders (or --reanalyse RESULTS.json)")
    if args.average_last < 0:
        raise SystemExit(f"--average-last {args.average_last}: give the number of snapshots to average, >= 1 "
                         f"(0: the last checkpoint)")
    device = torch.device(args.device)
    metrics, weights, counts, extras, type_stats, all_tokens, texts = {}, {}, {}, {}, {}, {}, {}
    # fail on a bad folder before any long work; one checkpoint in memory at a time (each task script loads its own)
    tasks, configs, out_bias = {}, {}, {}
    for d in args.out_dirs:
        configs[d], tasks[d] = read_config(d, args.checkpoint)
    variants = variant_names(configs)
    names = list(dict.fromkeys(variants[d] for d in args.out_dirs))  # in the order given
    seeds = [{configs[d].get("seed") for d in args.out_dirs if variants[d] == v} for v in names]
    default = not args.compare and len(names) == 2 and bool(seeds[0] & seeds[1])
    if default:
        args.compare = [sorted(names, key=lambda v: v != "mle")]  # stable: mle first, else the order given
    for pair in args.compare:  # before any long work: every variant compared must be among the runs
        for v in pair:
            if v not in variants.values():
                raise SystemExit(f"--compare: no run of variant {v!r}; variants here: "
                                 f"{', '.join(sorted(set(variants.values())))}")
    args.compare = comparable_pairs(args.compare, configs, variants, default)
    os.makedirs(args.out, exist_ok=True)
    picks = {}
    for label, out_dir in zip(labels_for(args.out_dirs), args.out_dirs):
        task = tasks[out_dir]
        if task == "lm" and args.average_last:
            raise SystemExit(f"{out_dir}: --average-last applies to NMT runs (train_nmt.py --keep-last N)")
        res = evaluate(out_dir, args, device)
        m, W, c, src_c, tokens = (res[k] for k in ("metrics", "weight", "counts", "src_counts", "tokens"))
        if res["out_bias"] is not None:  # train_lm.py --output-bias
            out_bias[out_dir] = res["out_bias"]
        m["seed"] = configs[out_dir].get("seed")
        m["valid_ppl"] = last_valid_ppl(out_dir, m.get("step"))
        if "texts" in m:  # NMT: the test translations, one per line, in the report folder
            texts[label] = m.pop("texts")
            runlib.write_text(os.path.join(args.out, f"test_hyps_{label}.txt"), "\n".join(texts[label]["hyps"]) + "\n")
        if "type_stats" in m:
            type_stats[label] = dict(m.pop("type_stats"), rare=group_index(c)[0] == 2)
        all_tokens[label] = tokens
        m["singular_values"] = agg.singular_spectrum(W).tolist()
        if out_dir in out_bias:
            m["output_bias"] = output_bias_stats(out_bias[out_dir], c)
        # the same probe tokens for runs on the same data (same counts), chosen from the first such run
        key = (task, int(c.sum()), len(c))
        if key not in picks:
            picks[key] = pick_rare_tokens(c, tokens, args.n_rare_tokens, src_c)
        gid, _ = group_index(c)
        ids = picks[key]
        rows = {}
        if ids:
            for i, ns in zip(ids, neighbours(W, ids)):
                rows[tokens[i].strip()] = [tokens[j].strip() + ("*" if gid[j] == 2 else "") for j in ns]
        m["neighbours"] = rows
        m["checkpoint"] = args.checkpoint
        m["variant"] = variants[out_dir]
        metrics[label], weights[label], counts[label], extras[label] = m, W, c, (rows, ids)
        print(f"{label}: " + ", ".join(f"{k} {fmt(m[k], 3)}" for k in ("ppl", "bleu", "isotropy", "mean_cosine")
                                         if k in m))
    summary = summarise(metrics)
    # pairs checked again with the vocabulary size the weights have (a config may not record it)
    label_configs = {label: dict(configs[d], vocab_size_actual=int(weights[label].shape[0]))
                     for label, d in zip(labels_for(args.out_dirs), args.out_dirs)}
    args.compare = comparable_pairs(args.compare, label_configs, {k: m["variant"] for k, m in metrics.items()},
                                    default)
    comparisons = []
    for base, cand in args.compare:
        comparisons.append(compare(metrics, type_stats, base, cand, next(iter(all_tokens.values())), texts=texts,
                                   configs=label_configs))
    for name, obj in (("metrics.json", metrics), ("summary.json", summary)) + ((("compare.json", comparisons),)
                                                                                  if comparisons else ()):
        runlib.write_json(os.path.join(args.out, name), obj)
    if args.results:
        write_results(args.results, metrics, configs, dict(zip(labels_for(args.out_dirs), args.out_dirs)),
                      comparisons, argv)
    plot_singular_values({k: m["singular_values"] for k, m in metrics.items()},
                         os.path.join(args.out, "singular_values.png"))
    plot_svd(weights, counts, os.path.join(args.out, "svd_projection.png"))
    folders = dict(zip(labels_for(args.out_dirs), args.out_dirs))
    curves = plot_training_curves(folders, {label: variants[d] for label, d in folders.items()},
                                  os.path.join(args.out, "training_curves.png"))
    snaps = plot_snapshots(folders, counts, os.path.join(args.out, "svd_over_time.png"))
    plot_gradient_parts(folders, {label: variants[d] for label, d in folders.items()},
                        os.path.join(args.out, "gradient_parts.png"))
    plot_rare_share(folders, {label: variants[d] for label, d in folders.items()}, os.path.join(args.out, "rare_share.png"))
    if out_bias:
        plot_output_bias({label: out_bias[d] for label, d in folders.items() if d in out_bias}, counts,
                         os.path.join(args.out, "output_bias.png"))
    write_report(os.path.join(args.out, "report.md"), metrics, extras, args, argv, summary, curves, snaps, comparisons)
    print(f"wrote {args.out}/metrics.json, summary.json, report.md and plots")
    return metrics


if __name__ == "__main__":
    main()
