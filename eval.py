#!/usr/bin/env python
"""Evaluate trained runs on their test split: the task metrics and the geometry of the tied
embedding matrix.

    python eval.py out/lm-mle-s0 out/lm-agg-s0 --out out/report      # -> out/report/metrics.json

Each run folder holds ckpt.pt; its config's "task" picks the evaluation:
  lm  (train_lm.py): test PPL total and per frequency group, Uniq (distinct argmax next-token
      predictions) total and per group with the human reference (distinct targets), greedy and
      sampled continuations of test prefixes (AGG Table 14), word similarity (Spearman of cosine
      vs human scores; AGG Table 5), and two free calibrations fitted on valid (one bias on the
      rare group's logits, one temperature on all logits);
  nmt (train_nmt.py): BLEU with its sacrebleu signature (train_nmt.validate on the test split).
Both: I(W) total and per group (AGG Eq. 3), mean cosine S(w) (AGPS Eq. 9), the metrics that favour
no method, normalised singular values, top-5 cosine neighbours of rare tokens (AGG Tables 12-13).
Frequency groups: 30% frequent / 50% medium / 20% rare of the vocabulary by training counts (AGG
Sec. 3.1). Writes REPORT/metrics.json ({run label: metrics}). Summaries over seeds, paired
comparisons, reports and plots of many runs: python -m studies.compare.
"""

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from tqdm import tqdm

import agg
import runlib
import train_lm
import train_nmt
from data import gensim_test_data, prepare_lm, prepare_nmt

N_RARE_TOKENS = 6  # rare tokens whose neighbours are listed
WORDSIM = {"ws353": "wordsim353.tsv", "simlex999": "simlex999.txt"}  # shipped in the gensim wheel


# ---------------------------------------------------------------------------------- word similarity
def load_word_pairs(path):
    """(word1, word2, score) triples of a tab-separated file with '#' comments: the WordSim353 and
    SimLex-999 files of the gensim wheel."""
    pairs = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            word1, word2, score = line.split("\t")
            pairs.append((word1, word2, float(score)))
    return pairs


def word_similarity(weight, tokenizer, kind, datasets):
    """{name: (spearman, pairs used, pairs total)} of cosine similarity vs human scores. A word's
    vector is the mean of its subword embeddings (BPE: the word after a space, as in running text),
    None out of vocabulary."""

    def vector(word):
        if kind == "bpe":
            ids = tokenizer.encode(" " + word).ids
        else:  # word level: word, else Word
            ids = map(tokenizer.token_to_id, (word, word.capitalize()))
            ids = [i for i in ids if i is not None][:1]
        if ids:
            return weight[ids].mean(0)

    out = {}
    for name, path in datasets.items():
        pairs = load_word_pairs(path)
        human = []
        cosine = []
        for w1, w2, score in pairs:
            a = vector(w1)
            b = vector(w2)
            if a is not None and b is not None:  # both words in the vocabulary
                human.append(score)
                cosine.append(float(F.cosine_similarity(a, b, dim=0)))
        rho = float("nan")
        if len(human) > 2:
            rho = float(stats.spearmanr(human, cosine).statistic)
        out[name] = (rho, len(human), len(pairs))
    return out


# ----------------------------------------------------------------------------------------- geometry
def group_index(counts):
    """Tensor (V,) of group ids 0/1/2 (freq/med/rare) and the three index tensors (AGG Sec. 3.1)."""
    groups = agg.frequency_groups(counts)
    return agg.group_of(groups, len(counts)), groups


def geometry(weight, counts, include_unseen=False):
    """agg.geometry per frequency group (seen tokens unless include_unseen) and the metrics that
    favour no method: IsoScore (Rudman et al. 2022), I(W) with rows weighted by train frequency
    (Yokoi et al. 2024), I(W) after removing the (weighted) mean row, and the under-trained rows of
    Land & Bartolo 2024."""
    groups = agg.frequency_groups(counts)
    counts = torch.as_tensor(counts)
    seen = None if include_unseen else counts > 0
    named = dict(zip(agg.GROUPS, groups))
    geo = agg.geometry(weight, named, seen)
    W = weight.detach().double().cpu()
    rows = W if seen is None else W[seen]
    geo["geometry_rows_rule"] = "all" if include_unseen else "seen in training"
    geo["isoscore"] = agg.isoscore(rows)
    geo["isotropy_centered"] = agg.isotropy(rows, center=True)
    # rows weighted by train frequency
    seen_rows = W[counts > 0]
    w = counts[counts > 0].double()
    geo["isotropy_weighted"] = agg.isotropy(seen_rows, weights=w)
    geo["isotropy_weighted_centered"] = agg.isotropy(seen_rows, weights=w, center=True)
    geo["undertrained"] = undertrained_count(W, counts)
    return geo


def undertrained_count(W, counts):
    """How many seen rows look as untrained as a never-seen one: Land & Bartolo 2024's indicator
    (agg.undertrained_rows) at least the never-seen rows' median. None when every token was seen."""
    unused = (counts == 0).nonzero().squeeze(1)
    seen = counts > 0
    if len(unused) < 2:
        return dict(unused_rows=len(unused), count=None, share_of_seen=None)
    ind = agg.undertrained_rows(W, unused)
    threshold = float(ind[unused].median())
    count = int((ind[seen] >= threshold).sum())
    out = dict(unused_rows=len(unused), threshold=threshold, count=count)
    out["share_of_seen"] = count / int(seen.sum())
    out["rule"] = "seen rows whose indicator >= the median indicator of the never-seen rows"
    return out


def pick_rare_tokens(counts, tokens, n, src_counts=None):
    """A few word-like rare-group tokens to show neighbours of: the most frequent ones (AGG Table
    12), or for NMT those most frequent on the source side (AGG Table 13)."""
    gid, _ = group_index(counts)
    key = counts if src_counts is None else torch.as_tensor(src_counts)
    order = torch.argsort(key.double(), descending=True, stable=True)
    by_count = order.tolist()
    rare = [i for i in by_count if gid[i] == 2 and key[i] > 0]
    word_like = r"[^\W\d_]{4,}"
    cands = [i for i in rare if re.fullmatch(word_like, tokens[i].strip())]
    # byte-level BPE: word-initial tokens are whole words
    words = [i for i in cands if tokens[i].startswith(" ")]
    pool = words if len(words) >= n else cands
    return pool[:n]


def neighbours(weight, ids, k=5):
    W = weight.detach().float().cpu()
    W = F.normalize(W, dim=1)
    sims = W[ids] @ W.T
    sims[torch.arange(len(ids)), ids] = -2  # not itself
    return sims.topk(k, dim=1).indices.tolist()


def output_bias_stats(bias, counts):
    """How a learned output bias (--output-bias) encodes frequency over the seen tokens:
    correlations with log train counts, the least-squares slope and the mean bias per group."""
    b = bias.double()
    c = torch.as_tensor(counts).double()
    gid = group_index(counts)[0]
    seen = c > 0
    x = c[seen].log().numpy()
    y = b[seen].numpy()
    pearson = stats.pearsonr(x, y)[0]
    out = dict(pearson_log_count=float(pearson))
    out["spearman_log_count"] = float(stats.spearmanr(x, y)[0])
    out["slope_per_log_count"] = float(np.polyfit(x, y, 1)[0])
    out["mean_groups"] = {}
    for k, g in enumerate(agg.GROUPS):
        out["mean_groups"][g] = float(b[seen & (gid == k)].mean())
    return out


# ----------------------------------------------------------------------------------------------- LM
def rare_logit_stats(logits, y, rare):
    """Per scored position, all that a scalar bias b on the rare group's logits changes: the target,
    its logit and whether it is rare, and the log-sum-exp and argmax (value, id) over the rare group
    and over the other tokens."""
    z = logits.float().reshape(-1, logits.shape[-1])
    y = y.reshape(-1)
    zr = z.masked_fill(~rare, -math.inf)
    zo = z.masked_fill(rare, -math.inf)
    z_y = z.gather(1, y[:, None]).squeeze(1)
    st = dict(target=y, z_y=z_y, y_rare=rare[y])
    st["lse_rare"] = torch.logsumexp(zr, -1)
    st["lse_other"] = torch.logsumexp(zo, -1)
    st["max_rare"], st["arg_rare"] = zr.max(-1)
    st["max_other"], st["arg_other"] = zo.max(-1)
    return st


def fit_rare_bias(st):
    """The scalar b on the rare group's logits that minimises the mean NLL of the positions `st`
    (rare_logit_stats). The NLL is convex in b and its derivative is (mean predicted rare mass) -
    (share of rare targets), so the fitted b also calibrates the rare group's predicted mass.
    Newton's method, steps clipped to +-4."""
    b = 0.0
    y_share = st["y_rare"].double().mean()
    lse_rare = st["lse_rare"].double()
    lse_other = st["lse_other"].double()
    for _ in range(100):
        p = torch.sigmoid(lse_rare + b - lse_other)
        slope = p.mean() - y_share
        curvature = (p * (1 - p)).mean().clamp(min=1e-12)
        step = float((slope / curvature).clamp(-4, 4))
        b -= step
        if abs(step) < 1e-9:
            break
    return b


def fit_temperature(batches, tol=1e-6):
    """The inverse temperature beta that minimises the mean NLL of softmax(beta * logits) over the
    positions that batches() yields as (logits, targets), a fresh pass per call. The NLL is convex
    in beta, with derivative E_p[z] - z_y and second derivative Var_p[z] per position: Newton's
    method from beta = 1, one pass per step."""
    beta = 1.0
    for _ in range(30):
        grad = curv = 0.0
        for logits, y, *_ in batches():
            z = logits.float().reshape(-1, logits.shape[-1])
            p = torch.softmax(beta * z, -1)
            mean = (p * z).sum(-1, keepdim=True)
            z_y = z.gather(1, y.reshape(-1, 1)).squeeze(1)
            residual = mean.squeeze(1) - z_y
            grad += float(residual.double().sum())
            variance = (p * (z - mean) ** 2).sum(-1)
            curv += float(variance.double().sum())
        newton = grad / max(curv, 1e-12)
        step = max(-0.5, min(0.5, newton))
        beta -= step
        if abs(step) < tol:
            break
    return beta


def rare_bias_metrics(st, b, gid):
    """PPL, rare mass, Uniq and rare argmax precision / recall of positions st with b on the rare
    logits."""
    lse_rare = st["lse_rare"].double() + b
    lse_other = st["lse_other"].double()
    z_y = st["z_y"].double() + b * st["y_rare"].double()
    nll = torch.logaddexp(lse_other, lse_rare) - z_y
    rare_wins = st["max_rare"] + b > st["max_other"]
    pred = torch.where(rare_wins, st["arg_rare"], st["arg_other"])
    g = gid[st["target"]]
    pred_rare = gid[pred] == 2
    hit = pred == st["target"]
    up = pred.unique()
    acc = agg.GroupNLL()
    acc.add(nll, g)
    out = dict(bias=b, ppl=acc.ppl())
    out["ppl_groups"] = acc.ppl_groups()
    rare_mass = torch.sigmoid(lse_rare - lse_other)
    out["rare_mass_pred"] = float(rare_mass.mean())
    out["rare_mass_true"] = float(st["y_rare"].double().mean())
    out["uniq"] = int(len(up))
    out["uniq_groups"] = per_group(gid, up)
    out["rare_argmax_precision"] = float(hit[pred_rare].double().mean())  # nan: none predicted
    out["rare_argmax_recall"] = float(hit[g == 2].double().mean())
    out["rare_argmax_count"] = int(pred_rare.sum())
    return out


def per_group(gid, ids):
    """{group: how many of `ids` are in it} (gid: group_index's ids)."""
    of_ids = gid[ids]
    return {name: int((of_ids == k).sum()) for k, name in enumerate(agg.GROUPS)}


def repeated_4grams(tokens):
    """seq-rep-4 of Welleck et al. 2020: the share of a continuation's 4-grams that are repeats, 1 -
    unique / all."""
    if len(tokens) < 4:
        return 0.0
    return 1 - distinct_n([tokens], 4)


def distinct_n(continuations, n):
    """distinct-n (Li et al. 2016): distinct n-grams over all n-grams of the continuations,
    pooled."""
    grams = []
    for c in continuations:
        starts = range(len(c) - n + 1)
        grams += [tuple(c[i : i + n]) for i in starts]
    if not grams:
        return float("nan")
    return len(set(grams)) / len(grams)


def run_data(cfg, data_dir, task, V):
    """The run's data as it trained: --data-dir reads its corpus from a new folder, a gone folder
    says so, and a corpus or tokenizer changed since training (another data fingerprint or
    vocabulary size V) is refused."""
    if data_dir:
        if cfg.get("dataset") != "dir":
            raise SystemExit(
                f"--data-dir {data_dir}: {cfg['out']} was trained on --dataset "
                f"{cfg.get('dataset')}, not on a --data-dir; leave --data-dir out"
            )
        cfg["data_dir"] = os.path.abspath(data_dir)
    elif cfg.get("dataset") == "dir" and not os.path.isdir(cfg["data_dir"]):
        raise SystemExit(
            f"{cfg['out']}: its data folder {cfg['data_dir']} is not there (moved?): give eval.py "
            f"--data-dir with the folder's new place"
        )
    if task == "lm":
        data = prepare_lm(cfg, log=runlib.quiet)
        now = os.path.basename(data["dir"])
        size = data["vocab_size"]
    else:
        data = prepare_nmt(cfg, log=runlib.quiet)
        now = data.cache.name
        size = data.vocab_size
    same = runlib.same_data(cfg.get("data_fingerprint"), now)
    if not same or size != V:
        raise SystemExit(
            f"{cfg['out']}: the corpus or tokenizer changed since this run trained (its data was "
            f"{cfg.get('data_fingerprint')}, V={V}; now {now}, V={size}): restore the original "
            "files to evaluate it"
        )
    return data


def document_of(ids, eos_id, documents):
    """(article index of every position of `ids` as a LongTensor, lines per article) when the
    split's articles are known (data.py's meta.json "documents": lines per article; every line ends
    with EOS), else None."""
    if not documents:
        return None
    eos = torch.from_numpy(np.asarray(ids) == eos_id)
    line = torch.cumsum(eos.long(), 0) - eos.long()  # a line's EOS belongs to it
    ends = torch.cumsum(torch.tensor(documents), 0)
    last = len(documents) - 1
    doc = torch.searchsorted(ends, line, right=True).clamp(max=last)
    return doc, documents


def nll_of(logits, y):
    """-log softmax(logits)[y] at each position, in float64."""
    logp = torch.log_softmax(logits, -1)
    logp_y = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return -logp_y.double()


def cat_stats(parts):
    """The rare_logit_stats of many batches as one."""
    out = {}
    for k in parts[0]:
        out[k] = torch.cat([p[k] for p in parts])
    return out


@torch.no_grad()
def evaluate_lm(out_dir, model, ck, args, device):
    """A train_lm.py run on its test split (or --split valid), the metrics of the module's
    docstring. Returns (metrics, weight, train counts, None, tokens)."""
    cache_dir = args.cache_dir or ck["config"]["cache_dir"]
    cfg = dict(ck["config"], device=str(device), out=out_dir, cache_dir=cache_dir)
    data = run_data(cfg, args.data_dir, "lm", model.out_weight.shape[0])
    V = data["vocab_size"]
    tok = data["tokenizer"]
    ids = data["ids"][args.split]
    autocast = runlib.autocast(cfg)
    gid = agg.group_of(agg.frequency_groups(data["counts"]), V)
    gid_d = gid.to(device)
    rare_d = gid_d == 2
    n = len(ids) - 1
    valid_ids = data["ids"]["valid"]
    window = args.context_window

    def valid():
        n_valid = len(valid_ids) - 1
        return train_lm.score(model, valid_ids, n_valid, cfg, device, autocast, window)

    def stats(logits, y):
        st = rare_logit_stats(logits, y, rare_d)
        return {k: v.cpu() for k, v in st.items()}

    # The free calibration baselines, fitted on the valid split (minimum NLL): one temperature on
    # all logits, and one bias on the rare group's logits (which also calibrates the group's
    # predicted mass)
    beta = fit_temperature(valid)
    valid_stats = [stats(logits, y) for logits, y, _ in valid()]
    bias = fit_rare_bias(cat_stats(valid_stats))
    acc = agg.GroupNLL()  # at temperature 1
    acc_t = agg.GroupNLL()  # at the fitted temperature
    # NLL summed per target type: the per-type share of a PPL gap
    type_nll = torch.zeros(V, dtype=torch.float64)
    preds = []
    logit_stats = []
    documents = data["meta"].get("documents", {}).get(args.split)
    doc = document_of(ids, data["eos_id"], documents)
    articles = None
    if doc is not None:  # NLL per (article, group)
        articles = agg.GroupNLL(3 * len(doc[1]))
    name = os.path.basename(os.path.normpath(cfg["out"]))
    batches = train_lm.score(model, ids, n, cfg, device, autocast, window)
    desc = f"{name} {args.split}"
    for logits, y, pos in tqdm(batches, desc=desc, leave=False):
        nll = nll_of(logits.float(), y)
        acc.add(nll, gid_d[y])
        nll_t = nll_of(beta * logits.float(), y)
        acc_t.add(nll_t, gid_d[y])
        if articles is not None:
            cells = 3 * doc[0][pos] + gid[y.cpu()]  # (article, group)
            articles.add(nll.cpu(), cells)
        flat_y = y.flatten().cpu()
        type_nll.index_add_(0, flat_y, nll.flatten().cpu())
        preds.append(logits.argmax(-1).flatten().cpu())
        logit_stats.append(stats(logits, y))
    up = torch.cat(preds).unique()
    logit_stats = cat_stats(logit_stats)
    ut = logit_stats["target"].unique()
    m = dict(task="lm", method=cfg["method"], step=ck["step"], out_dir=cfg["out"])
    m["split"] = args.split
    m["context_window"] = window
    m["tokens"] = acc.tokens()
    m["ppl"] = acc.ppl()
    m["ppl_groups"] = acc.ppl_groups()
    m["uniq"] = int(len(up))
    m["uniq_groups"] = per_group(gid, up)
    m["uniq_human"] = int(len(ut))
    m["uniq_human_groups"] = per_group(gid, ut)
    m["rare_argmax"] = rare_bias_metrics(logit_stats, 0.0, gid)
    m["rare_bias"] = rare_bias_metrics(logit_stats, bias, gid)
    temperature = dict(t=1 / beta, ppl=acc_t.ppl())
    temperature["ppl_groups"] = acc_t.ppl_groups()
    m["temperature"] = temperature
    type_count = torch.bincount(logit_stats["target"], minlength=V)
    m["type_stats"] = dict(nll=type_nll, count=type_count)  # not saved
    m["article_stats"] = None
    if articles is not None:  # per held-out article and group: the bootstrap units
        article_nll = articles.nll.view(-1, 3).tolist()
        article_count = articles.count.view(-1, 3).tolist()
        m["article_stats"] = dict(nll=article_nll, count=article_count)
    # greedy continuations of evenly spaced prefixes of the split (AGG Table 14), and the same
    # prefixes continued by sampling (temperature 1, seeded): diversity where greedy decoding hides
    # it
    gens = []
    greedy = []
    sampled = []
    span = args.prefix_len + args.gen_len
    torch.manual_seed(0)
    n_gen = args.n_samples if len(ids) > span else 0
    for j in range(n_gen):
        s = j * (len(ids) - span) // args.n_samples
        prefix = np.asarray(ids[s : s + args.prefix_len], dtype=np.int64)
        prefix = torch.from_numpy(prefix)[None].to(device)
        cont = model.generate(prefix, args.gen_len, autocast=autocast)
        cont = cont[0, args.prefix_len :].tolist()
        greedy.append(cont)
        sample = model.generate(prefix, args.gen_len, temperature=1.0)
        sampled.append(sample[0, args.prefix_len :].tolist())
        human = np.asarray(ids[s + args.prefix_len : s + span]).tolist()
        gen = dict(position=s, prefix=tok.decode(prefix[0].tolist()))
        gen["continuation"] = tok.decode(cont)
        gen["human"] = tok.decode(human)
        gen["uniq"] = len(set(cont))
        gen["uniq_human"] = len(set(human))
        gen["rep4"] = repeated_4grams(cont)
        gen["rep4_human"] = repeated_4grams(human)
        gens.append(gen)
    m["generations"] = gens
    for key in ("uniq", "uniq_human", "rep4", "rep4_human"):
        values = [g[key] for g in gens]
        m[f"gen_{key}"] = float(np.mean(values)) if gens else float("nan")
    if gens:
        rep4 = [repeated_4grams(c) for c in sampled]
        m["gen_rep4_sampled"] = float(np.mean(rep4))
        m["gen_distinct"] = {}
        for kind, conts in (("greedy", greedy), ("sampled", sampled)):
            m["gen_distinct"][kind] = {str(n): distinct_n(conts, n) for n in (1, 2, 3, 4)}
    # the softmax's matrix: the tied embedding, or lm_head with --untie
    W = model.out_weight.detach().float().cpu()
    sims = {k: gensim_test_data(v) for k, v in WORDSIM.items()}
    ws = word_similarity(W, tok, cfg["tokenizer"], sims)
    m["word_similarity"] = {k: v[0] for k, v in ws.items()}
    m["word_similarity_pairs"] = {k: [v[1], v[2]] for k, v in ws.items()}
    if cfg["tokenizer"] == "bpe":
        tokens = [tok.decode([i]) for i in range(V)]
    else:
        tokens = [tok.id_to_token(i) or "" for i in range(V)]
    return m, W, data["counts"], None, tokens


# ---------------------------------------------------------------------------------------------- NMT
def average_checkpoints(out_dir, n):
    """The mean of the model weights of the last n snapshots, as fairseq's
    scripts/average_checkpoints.py."""
    if n < 1:  # [-n:] of a negative n would drop snapshots instead of taking the last ones
        raise SystemExit(
            f"--average-last {n}: give the number of snapshots to average, >= 1 (0: the last "
            "checkpoint)"
        )
    paths = runlib.snapshots(out_dir)[-n:]
    if len(paths) < n:
        raise SystemExit(
            f"{out_dir}: --average-last {n} needs {n} ckpt_STEP.pt snapshots, found {len(paths)}; "
            f"train with --keep-last {n} (or more)"
        )
    names = [os.path.basename(p) for p in paths]
    avg = {}
    for p in paths:  # one snapshot in memory at a time
        model = runlib.load_checkpoint(p, "nmt")["model"]
        for k, v in model.items():
            v = v.double()
            avg[k] = avg[k] + v if k in avg else v
    averaged = {k: (v / n).to(model[k].dtype) for k, v in avg.items()}
    return averaged, names


@torch.no_grad()
def evaluate_nmt(out_dir, model, ck, args, device):
    """A train_nmt.py run on its test split: BLEU, test PPL, the target side's metrics
    (train_nmt.validate), the first test translations. Returns (metrics, weight, counts of both
    sides, source counts, tokens)."""
    cfg = dict(ck["config"], device=str(device), beam=args.beam, out=out_dir)
    data = run_data(cfg, args.data_dir, "nmt", model.out_weight.shape[0])
    n = args.max_sentences
    if n:
        for k in ("test.src", "test.tgt"):
            data.ids[k] = data.ids[k][:n]
        data.text["test"] = tuple(side[:n] for side in data.text["test"])
    averaged = None
    if args.average_last:
        weights, averaged = average_checkpoints(cfg["out"], args.average_last)
        model.load_state_dict(weights)
    res, hyps = train_nmt.validate(model, None, data, cfg, device, split="test", bleu_sents=0)
    hyp_text = [data.decode(h) for h in hyps]
    src_text, ref_text = data.text["test"]
    m = dict(task="nmt", out_dir=cfg["out"])
    m["bleu"] = res["bleu"]
    m["bleu_signature"] = res["bleu_signature"]
    m["test_ppl"] = res["ppl"]
    for key in ("ppl_groups", "group_rare_mass_pred", "group_rare_mass_true"):
        m[key] = res[key]
    m["n_sentences"] = res["bleu_sents"]
    m["beam"] = args.beam
    m["lenpen"] = cfg["lenpen"]
    for key in ("src", "tgt", "dataset", "method"):
        m[key] = cfg[key]
    m["step"] = ck["step"]
    m["norm"] = cfg.get("norm", "pre")
    m["target"] = res["target"]
    m["rare_rule"] = train_nmt.rare_rule(cfg)
    m["checkpoints_averaged"] = len(averaged) if averaged else 0
    m["averaged_files"] = averaged
    for key in ("bleu_tok_compound", "bleu_tok_compound_protocol"):
        if key in res:
            m[key] = res[key]
    first = zip(src_text, ref_text, hyp_text[:5])
    m["translations"] = [dict(src=src, ref=ref, hyp=hyp) for src, ref, hyp in first]
    bleu_tokenize = cfg["bleu_tokenize"] or train_nmt.BLEU_TOKENIZE.get(cfg["tgt"], "13a")
    # for --compare's paired bootstrap, not saved
    m["texts"] = dict(hyps=hyp_text, refs=list(ref_text), bleu_tokenize=bleu_tokenize)
    print(f"{cfg['out']}: test BLEU {res['bleu']:.2f} ({res['bleu_signature']})")
    W = model.out_weight.detach().float().cpu()
    counts = data.corpus_counts.clone()
    src_counts = data.src_counts.clone()
    return m, W, counts, src_counts, data.tokens()


# -------------------------------------------------------------------------------------- run folders
def log_records(out_dir, split="valid"):
    """The records of one split of a run's log.jsonl ([] without one); a torn line is skipped with a
    warning."""
    path = os.path.join(out_dir, "log.jsonl")
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            for i, line in enumerate(f, 1):
                try:
                    recs.append(json.loads(line) if line.strip() else {})
                except json.JSONDecodeError:
                    print(
                        f"warning: {path} line {i} is not complete JSON (a torn write): skipped",
                        file=sys.stderr,
                    )
    return [r for r in recs if r.get("split") == split]


def last_valid_ppl(out_dir, step):
    for r in reversed(log_records(out_dir)):
        if r.get("step") == step:
            return r.get("ppl")
    return None


def labels_for(out_dirs):
    labels = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    if len(set(labels)) == len(labels):
        return labels
    return [os.path.relpath(os.path.normpath(d)) for d in out_dirs]


def fmt(x, nd=2):
    if not isinstance(x, float):
        return str(x)
    if abs(x) < 1e5:
        return f"{x:.{nd}f}"
    return f"{x:.3g}"  # nan: "nan"


# ------------------------------------------------------------------------------------------- driver
def evaluate(run_dir, args=None, device=None, probes=None, **flags):
    """One run's evaluation, the one read of its checkpoint (probes {data: token ids}: the same rare
    tokens for runs on the same data; flags: eval.py's by name, e.g. split="valid", beam=2). Returns
    {"metrics", "weight", "counts", "src_counts", "tgt_counts", "tokens", "out_bias"}; metrics'
    "type_stats" / "texts" serve comparisons only."""
    if args is None:
        args = build_parser().parse_args([run_dir])
        unknown = set(flags) - set(vars(args))
        if unknown:
            raise TypeError(f"unknown eval.py flags {sorted(unknown)}")
        vars(args).update(flags)
    device = torch.device(device or args.device)
    path = runlib.checkpoint_file(run_dir, args.checkpoint)
    ck = runlib.load_checkpoint(path)
    trainer = {"lm": train_lm, "nmt": train_nmt}[ck["task"]]
    model = trainer.load_model(ck, device)
    evaluate_task = evaluate_lm if ck["task"] == "lm" else evaluate_nmt
    m, W, c, src_c, tokens = evaluate_task(run_dir, model, ck, args, device)
    m.update(geometry(W, c, args.include_unseen))
    m["seed"] = ck["config"].get("seed")
    m["valid_ppl"] = last_valid_ppl(run_dir, m.get("step"))
    m["singular_values"] = agg.singular_spectrum(W).tolist()
    bias = getattr(model, "out_bias", None)  # train_lm.py --output-bias
    if bias is not None:
        bias = bias.detach().float().cpu()
        m["output_bias"] = output_bias_stats(bias, c)
    # runs on the same data: the probe tokens of the first such run
    key = (ck["task"], int(c.sum()), len(c))
    probes = {} if probes is None else probes
    picked = pick_rare_tokens(c, tokens, N_RARE_TOKENS, src_c)
    ids = probes.setdefault(key, picked)
    gid = group_index(c)[0]
    m["neighbours"] = {}
    near_ids = neighbours(W, ids) if ids else []
    for i, near in zip(ids, near_ids):
        shown = [tokens[j].strip() + ("*" if gid[j] == 2 else "") for j in near]
        m["neighbours"][tokens[i].strip()] = shown
    m["checkpoint"] = args.checkpoint
    tgt_c = None if src_c is None else c - src_c
    return dict(
        metrics=m,
        weight=W,
        counts=c,
        tokens=tokens,
        src_counts=src_c,
        tgt_counts=tgt_c,
        out_bias=bias,
    )


def read_configs(args):
    """{run folder: config} of args.out_dirs (config.json, else the checkpoint's own), checked
    before any long work: the checkpoint to evaluate exists, the task is known, --average-last goes
    with NMT runs."""
    if args.average_last < 0:
        raise SystemExit(
            f"--average-last {args.average_last}: give the number of snapshots to average, >= 1 "
            f"(0: the last checkpoint)"
        )
    ranges = dict(n_samples=(0, None), prefix_len=(1, None), gen_len=(1, None))
    runlib.check_ranges(vars(args), ranges)
    runlib.check_device(args.device)
    configs = {}
    for d in args.out_dirs:
        path = runlib.checkpoint_file(d, args.checkpoint)
        if not os.path.exists(path):
            raise SystemExit(
                f"{path}: no checkpoint. Pass run folders written by train_lm.py / train_nmt.py "
                "--out."
            )
        cfg = runlib.run_config(d) or runlib.load_checkpoint(path)["config"]
        configs[d] = cfg
        if cfg.get("task") not in ("lm", "nmt"):
            raise SystemExit(f"{path}: unknown task {cfg.get('task')!r} (expected 'lm' or 'nmt')")
    tasks = {c["task"] for c in configs.values()}
    parser = build_parser()
    task_flags = dict(lm=("split", "context_window"))
    task_flags["nmt"] = ("max_sentences", "beam", "average_last")
    # a flag of the other task would be ignored without a word
    for task, keys in task_flags.items():
        given = [k for k in keys if getattr(args, k, None) != parser.get_default(k)]
        if task not in tasks and given:
            raise SystemExit(
                f"--{given[0].replace('_', '-')} is a flag of {task.upper()} runs and these are "
                f"{'/'.join(sorted(tasks)).upper()} runs ({', '.join(args.out_dirs)}): drop it"
            )
    return configs


def evaluate_runs(args):
    """evaluate() each of args.out_dirs in turn (one checkpoint in memory at a time): {label: its
    result}, with the test translations of an NMT run in OUT/test_hyps_LABEL.txt and ["texts"], an
    LM run's ["type_stats"]."""
    try:  # the report folder, before any long work
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {args.out}: cannot create that folder ({e.strerror})") from None
    device = torch.device(args.device)
    probes = {}
    results = {}
    for label, out_dir in zip(labels_for(args.out_dirs), args.out_dirs):
        res = evaluate(out_dir, args, device, probes)
        results[label] = res
        m = res["metrics"]
        if "texts" in m:
            res["texts"] = m.pop("texts")
            path = os.path.join(args.out, f"test_hyps_{label}.txt")
            text = "\n".join(res["texts"]["hyps"]) + "\n"
            runlib.write_text(path, text)
        if "type_stats" in m:
            type_stats = m.pop("type_stats")
            rare = group_index(res["counts"])[0] == 2
            res["type_stats"] = dict(type_stats, rare=rare)
        shown = [k for k in ("ppl", "bleu", "isotropy", "mean_cosine") if k in m]
        summary = ", ".join(f"{k} {fmt(m[k], 3)}" for k in shown)
        print(f"{label}: " + summary)
    return results


def build_parser(doc=__doc__, runs="+"):
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=doc, formatter_class=raw)
    p.add_argument("out_dirs", nargs=runs, help="run folders (each with ckpt.pt)")
    report = os.path.join(runlib.ROOT, "out", "report")
    p.add_argument("--out", default=report, help="report folder")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=device)
    p.add_argument(
        "--split", default="test", choices=["test", "valid"], help="LM split to evaluate"
    )
    p.add_argument(
        "--max-sentences",
        type=int,
        help="NMT: the first N test sentences (default: all)",
    )
    p.add_argument(
        "--context-window",
        type=int,
        default=0,
        help="LM: score blocks after N context tokens (fairseq's)",
    )
    p.add_argument("--cache-dir", help="LM data cache (default: the run's own)")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="the runs' --data-dir corpus moved to DIR (the same files)",
    )
    p.add_argument("--n-samples", type=int, default=5, help="greedy continuations per run")
    p.add_argument("--prefix-len", type=int, default=50)
    p.add_argument("--gen-len", type=int, default=100)
    p.add_argument("--beam", type=int, default=4, help="NMT beam size")
    p.add_argument(
        "--average-last",
        type=int,
        default=0,
        help="NMT: average the last N snapshots (--keep-last N)",
    )
    p.add_argument(
        "--include-unseen",
        action="store_true",
        help="geometry over every row (default: the rows seen)",
    )
    p.add_argument(
        "--checkpoint",
        default="last",
        choices=["last", "best"],
        help="last: ckpt.pt (the end of training); best: ckpt_best.pt (lowest validation PPL, LM "
        "runs)",
    )
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    read_configs(args)  # a bad folder fails before any long work
    results = evaluate_runs(args)
    metrics = {label: res["metrics"] for label, res in results.items()}
    path = os.path.join(args.out, "metrics.json")
    runlib.write_json(path, metrics)
    print(f"wrote {args.out}/metrics.json")
    return metrics


if __name__ == "__main__":
    main()
