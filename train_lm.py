#!/usr/bin/env python
"""Language modelling with AGG and its peers: a pre-LN GPT decoder with tied input/output embeddings.

    python train_lm.py --method agg                          # offline default corpus, cpu preset on CPU
    python train_lm.py --dataset wikitext-103 --preset paper-6l --method agg
    python train_lm.py --dataset wikitext-103 --preset gpt2-medium --method agg --compile  # on a GPU
    python train_lm.py --out out/lm-agg-s0 --resume       # continue a run with its saved config

A run's --out folder holds config.json (config and provenance), log.jsonl (train and valid records), ckpt.pt and
ckpt_best.pt. This file is the experiment: model, loss, loop; the corpora are data.py's, the life of a run is
runlib.Run, the methods are agg.py's (fed hidden states, the tied weight and targets); eval.py reads the test split.
"""
import argparse
import contextlib
import functools
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import agg
import runlib
from data import BIBLE_EN, LM_CACHE, OFFLINE_DATASET, describe_source, prepare_lm

# Presets. paper-6l / gpt2-medium: AGG Table 11's "empirical study" / "language modeling" columns. cpu: 4 layers, d 128
# (1.9M params), 2,400 steps of 1,024 tokens (3.5 epochs of the offline corpus), ~7 min on 2 cores; lr and warm-up
# MLE's best on validation (RESULTS.md), the paper's protocol of one setting fit for the baseline.
PRESETS = {
    "cpu": dict(n_layer=4, d_model=128, n_head=4, d_ff=512, dropout=0.1, block_size=128, vocab_size=8192,
                tokens_per_step=1024, micro_batch=32, lr=4e-3, warmup=240, max_steps=2400, eval_interval=200,
                weight_decay=0.01),
    "paper-6l": dict(n_layer=6, d_model=512, n_head=8, d_ff=2048, dropout=0.1, block_size=512, vocab_size=44256,
                     tokens_per_step=32768, micro_batch=16, lr=7e-4, warmup=4000, max_steps=40000,
                     eval_interval=1000, weight_decay=0.01),
    "gpt2-medium": dict(n_layer=24, d_model=1024, n_head=16, d_ff=4096, dropout=0.1, block_size=1024,
                        vocab_size=44256, tokens_per_step=32768, micro_batch=8, lr=7e-4, warmup=4000,
                        max_steps=50000, eval_interval=1000, weight_decay=0.01),
}
# Method defaults per preset where the method takes them and no flag overrides them: AGG Table 11's alpha 0.03 (also
# agg.py's default, for paper-6l's column without one) and AGPS's LM settings; cpu: alpha is a count per step (0.03
# marks 35% of the vocabulary rare at 1,024 tokens per step), so the rare group is a share of the vocabulary, the
# headline's 0.2 (validation PPL alone selects 0.05, which leaves most of the degeneration in place: RESULTS.md).
AGPS_LM = dict(rare_rank=25000, mu1=5e2, mu2=2e1)  # AGPS Tables 5 and 8 (i_r, mu1, mu2), language modelling
PRESET_METHOD = {"cpu": dict(rare_share=0.2), "paper-6l": dict(AGPS_LM), "gpt2-medium": dict(AGPS_LM, alpha=0.03)}
MODEL_FIELDS = ("n_layer", "d_model", "n_head", "d_ff", "dropout", "block_size")
RUN_CONTROL = runlib.RUN_CONTROL | {"eval_tokens", "snapshot_steps"}  # see runlib.RUN_CONTROL
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)  # train_step's default: no loss scaling


# ----------------------------------------------------------------------------------------------------------- config
def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=OFFLINE_DATASET, help=f"{OFFLINE_DATASET} (offline default) | {BIBLE_EN} "
                   f"(offline: the World English Bible, a chapter a line) | wikitext-103 | wikitext-2 (hub)")
    g.add_argument("--data-dir", help="one corpus: train.txt / valid.txt / test.txt, the raw WikiText layout "
                   "(wiki.train.tokens, ...), parquet files with a text column, or a datasets.save_to_disk folder")
    g.add_argument("--tokenizer", default="bpe", choices=["bpe", "word"],
                   help="bpe: byte-level BPE trained on train (GPT-2 style); word: whitespace words (WikiText's level)")
    g.add_argument("--vocab-size", type=int, default=None, help="BPE / word vocabulary size (preset default)")
    g.add_argument("--cache-dir", default=LM_CACHE, help="tokenizer + token-id cache")
    g.add_argument("--split-seed", type=int, default=0,
                   help=f"{OFFLINE_DATASET}: which articles are valid and test (0: the default split)")
    g.add_argument("--train-fraction", type=float, default=1.0,
                   help="train on the first FRACTION of the train split (nested: smaller fractions are in larger "
                        "ones); the tokenizer, valid and test stay those of the whole split")
    g = p.add_argument_group("model (override any preset field)")
    g.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                   help="cpu (the README's numbers) or the paper's set-ups: " +
                        "; ".join(f"{k}: " + ", ".join(f"{f}={v}" for f, v in p.items()) for k, p in PRESETS.items()))
    for name in MODEL_FIELDS:
        g.add_argument("--" + name.replace("_", "-"), type=float if name == "dropout" else int)
    untie = g.add_mutually_exclusive_group()
    untie.add_argument("--untie", action="store_true",
                       help="a separate output matrix (a control: the methods and the geometry are that matrix's)")
    untie.add_argument("--untie-at", type=float, default=None, metavar="FRACTION",
                       help="tied until this fraction of --max-steps, then the output matrix starts as a copy of the "
                            "tied one (and its Adam state) and both train on; the methods act on it from then on")
    g.add_argument("--logit-softcap", type=float, default=None, metavar="C",
                   help="logits C tanh(logits / C) (Gemma 2's soft-capping) in agg.py's fused head, for every method")
    g.add_argument("--output-bias", action="store_true",
                   help="a learned per-token bias on the logits (zero-initialised, no weight decay, plain gradient)")
    runlib.add_run_flags(p, "lm")
    g = p.add_argument_group("training")
    g.add_argument("--tokens-per-step", type=int, default=None, help="tokens per optimizer step")
    g.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (gradient accumulation)")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--warmup", type=int, default=None, help="linear warm-up steps, then cosine decay to 0.1 lr")
    g.add_argument("--eval-interval", type=int, default=None, help="validate + checkpoint every N steps")
    g.add_argument("--eval-tokens", type=int, default=None, help="cap on validation tokens (default all)")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--snapshot-steps", type=lambda t: sorted({int(x) for x in t.split(",") if x}), default=[],
                   help="comma-separated steps to save the embedding matrix at, to OUT/snapshots/ (AGG Fig. 1)")
    return p


def resolve_config(args, explicit=None):
    """The run's config: the parsed flags with the preset's defaults filled in, checked."""
    cfg = dict(vars(args))
    cfg.update({k: v for k, v in PRESETS[cfg["preset"]].items() if cfg.get(k) is None})
    if cfg["tokenizer"] == "word" and (explicit is None or "vocab_size" not in explicit):
        cfg["vocab_size"] = 0  # word level: keep every word of the train split (WikiText's closed vocabulary)
    if cfg["data_dir"]:
        cfg["dataset"] = "dir"
        cfg["data_dir"] = os.path.abspath(cfg["data_dir"])  # the run's data wherever it is resumed or evaluated from
    if cfg["split_seed"] and cfg["dataset"] != OFFLINE_DATASET:
        raise SystemExit(f"--split-seed {cfg['split_seed']}: only the offline corpus {OFFLINE_DATASET} is split here; "
                         f"{describe_source(cfg)} comes with its own splits")
    if not 0 < cfg["train_fraction"] <= 1:
        raise SystemExit(f"--train-fraction {cfg['train_fraction']}: must be in (0, 1]")
    runlib.check_run_flags(cfg, "lm", dict({k: (1, None) for k in (
        "n_layer", "d_model", "n_head", "d_ff", "block_size", "tokens_per_step", "micro_batch", "eval_interval",
        "log_interval", "eval_tokens")}, vocab_size=(0, None), untie_at=(0, 1), logit_softcap=(1e-3, None)))
    # --untie-at's step, fixed when the run starts (a resume to another --max-steps keeps it)
    cfg["untie_step"] = None if cfg["untie_at"] is None else max(1, round(cfg["untie_at"] * cfg["max_steps"]))
    if cfg["d_model"] % cfg["n_head"]:
        raise SystemExit(f"--d-model {cfg['d_model']} is not divisible by --n-head {cfg['n_head']}: change one of them")
    return cfg


def make_config(**fields):
    """The resolved config of a run with `fields` set as their flags would set them (names as in config.json)."""
    return runlib.make_config(build_parser(), resolve_config, fields)


class Sequences:
    """The train stream cut into non-overlapping (block+1)-token windows, reshuffled every epoch by (seed, epoch).
    Global sequence number g -> (epoch g // n, window perm_epoch[g % n]): the data position is just a counter."""

    def __init__(self, ids, block_size, seed):
        self.ids, self.block, self.seed = ids, block_size, seed
        self.n = (len(ids) - 1) // block_size
        if self.n < 1:
            raise SystemExit(f"the train split has {len(ids)} tokens, fewer than --block-size {block_size} + 1: "
                             f"use a larger corpus or a smaller --block-size")

    @functools.lru_cache(maxsize=1)  # one epoch's permutation at a time
    def perm(self, epoch):
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)).numpy()

    def get(self, start, count, device):
        starts = [int(self.perm(g // self.n)[g % self.n]) * self.block for g in range(start, start + count)]
        t = torch.from_numpy(np.stack([np.asarray(self.ids[w:w + self.block + 1], dtype=np.int64) for w in starts]))
        return t[:, :-1].to(device), t[:, 1:].to(device)  # inputs and their next tokens


class SelfAttention(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self, d_model, n_head, d_ff, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))

    def forward(self, x):  # pre-LN
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LN decoder whose output layer is the input embedding (tied): logits = features(x) @ tok_emb.weight.T (+ a
    learned per-token bias with output_bias; softcap C: C tanh(logits / C)). untie: an output matrix lm_head of its
    own ("late": unused until untie()); out_weight is the softmax's matrix, the one the methods act on."""

    def __init__(self, vocab_size, n_layer, d_model, n_head, d_ff, dropout, block_size, output_bias=False,
                 untie=False, softcap=None):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_ff, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.out_bias = nn.Parameter(torch.zeros(vocab_size)) if output_bias else None
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False) if untie is True else None
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 L)
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
        if untie == "late":  # made after the init (no random draws): the tied model's weights and dropout exactly
            self.lm_head = nn.utils.skip_init(nn.Linear, d_model, vocab_size, bias=False)
            nn.init.zeros_(self.lm_head.weight)
        self.untied, self.softcap = untie is True, softcap

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x):
        """The features of x, the head's input (agg's losses take features and the tied weight, not logits)."""
        T = x.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.block_size}")
        h = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(T, device=x.device)))
        for blk in self.blocks:
            h = blk(h)
        return self.ln_f(h)
    features = forward

    @property
    def out_weight(self):
        """The (V, d) matrix of the softmax: the tied embedding, or lm_head's weight with untie."""
        return self.lm_head.weight if self.untied else self.tok_emb.weight

    @torch.no_grad()
    def untie(self, opt):
        """Untie late: the output matrix starts as a copy of the tied one, with its optimizer state, and trains on."""
        self.lm_head.weight.copy_(self.tok_emb.weight)
        opt.state[self.lm_head.weight] = {k: v.clone() for k, v in opt.state[self.tok_emb.weight].items()}
        self.untied = True

    def head(self, h):
        logits = h @ self.out_weight.t()  # the output layer: logits of features h
        logits = logits if self.out_bias is None else logits + self.out_bias
        return logits if self.softcap is None else self.softcap * torch.tanh(logits.float() / self.softcap)

    def logits(self, x):
        return self.head(self.features(x))

    @torch.no_grad()
    def generate(self, x, n_new, temperature=0.0, top_k=None, autocast=contextlib.nullcontext):
        """Continue the (B, T) token ids x by n_new tokens, the context cropped to block_size (nanoGPT's sampling
        loop, the head applied at the last position only): temperature 0 is greedy; top_k keeps the k most likely."""
        for _ in range(n_new):
            with autocast():
                logits = self.head(self.features(x[:, -self.block_size:])[:, -1]).float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
                    logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(torch.softmax(logits, -1), 1)
            x = torch.cat([x, nxt], dim=1)
        return x


def build_model(cfg, vocab_size, step=0):
    """The model of config cfg as it is after `step` steps (--untie-at: tied before its split step)."""
    model = GPT(vocab_size, **{k: cfg[k] for k in MODEL_FIELDS}, output_bias=bool(cfg.get("output_bias")),
                untie="late" if cfg.get("untie_at") is not None else bool(cfg.get("untie")),
                softcap=cfg.get("logit_softcap"))
    model.untied = untied(cfg, step)
    return model


def untied(cfg, step):
    """Whether the output matrix is lm_head after `step` steps: --untie, or --untie-at's split step reached."""
    return bool(cfg.get("untie")) or cfg.get("untie_step") is not None and step >= cfg["untie_step"]


def load_model(ck, device="cpu"):
    """The trained model of a loaded LM checkpoint (runlib.load_checkpoint), in eval mode on `device`."""
    model = build_model(ck["config"], ck["model"]["tok_emb.weight"].shape[0], ck["step"])
    return runlib.load_state(model, ck, ck["config"].get("out")).to(device).eval()


# --------------------------------------------------------------------------------------------------------- training
def check_memory(cfg, V, B):
    """Refuse a micro-batch of B sequences whose activations (attention scores, layers, logits) cannot fit in memory."""
    T, d = cfg["block_size"], cfg["d_model"]
    need = 4 * B * T * (cfg["n_layer"] * (cfg["n_head"] * T + 16 * d + 2 * cfg["d_ff"]) + V)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if cfg["device"] == "cpu" and need > 0.8 * have:
        raise SystemExit(f"--block-size {T} with micro-batches of {B} sequences needs about {need / 2**30:.0f} GiB, "
                         f"more than this machine's {have / 2**30:.0f} GiB: lower --block-size or --micro-batch")


def train_step(model, raw, method, opt, x_all, y_all, micro_batch, autocast, scaler=NO_SCALER):
    """One optimizer step on the step's sequences: (mean loss, mean NLL, the method's stats)."""
    method.observe(y_all)  # once per optimizer step, all targets of the step
    loss_sum, nll_sum = 0.0, 0.0
    for s in range(0, len(x_all), micro_batch):
        x, y = x_all[s:s + micro_batch], y_all[s:s + micro_batch]
        with autocast():
            hidden = model(x)  # = raw.features(x), the input of the tied head
            loss = method.loss(hidden, raw.out_weight, y, bias=raw.out_bias, softcap=raw.softcap)  # gates W's grad
        scaler.scale(loss * (y.numel() / y_all.numel())).backward()
        loss_sum += loss.item() * y.numel()
        nll_sum += float(method.stats.get("nll", loss.item())) * y.numel()
    scaler.unscale_(opt)  # float16: clip the true gradient
    torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)  # GPT-2 / nanoGPT practice for decoder LMs
    scaler.step(opt)  # float16: skipped when the gradient has inf/NaN
    scaler.update()
    method.after_step(raw.out_weight)  # e.g. FRAGE's discriminator, centering's mean row
    opt.zero_grad(set_to_none=True)
    return loss_sum / y_all.numel(), nll_sum / y_all.numel(), method.stats


def score(model, ids, n, cfg, device, autocast, context=0):
    """Yields (logits, targets, their indices in ids) of the first n targets of `ids`, each scored once, in
    micro-batches of windows of one shape: a window of L inputs from a scores its targets after `skip` tokens of
    context (fairseq's --context-window; context 0: non-overlapping blocks, cold starts)."""
    if not 0 <= context < cfg["block_size"]:
        raise SystemExit(f"--context-window {context}: must be in [0, block_size {cfg['block_size']})")
    stride, by_shape = cfg["block_size"] - context, {}
    for s in range(0, n, stride):
        a = max(0, s - context)
        by_shape.setdefault((min(s + stride, n) - a, s - a), []).append(a)
    for (L, skip), starts in sorted(by_shape.items(), reverse=True):
        for i in range(0, len(starts), max(1, cfg["micro_batch"])):
            group = starts[i:i + cfg["micro_batch"]]
            t = torch.from_numpy(np.stack([np.asarray(ids[a:a + L + 1], dtype=np.int64) for a in group])).to(device)
            with autocast():
                logits = model.logits(t[:, :-1])
            yield logits[:, skip:], t[:, 1 + skip:], torch.tensor(group)[:, None] + torch.arange(1 + skip, L + 1)


@torch.no_grad()
def validate(model, ids, cfg, device, autocast, groups, max_tokens=None, method_rare=None, seen=None, method=None):
    """Valid PPL (eval.py's scoring), total and per frequency group (30/50/20% by train counts); the geometry per group
    over the tokens `seen` in training (agg.geometry; AGG Fig. 2); the predicted vs true probability mass of the static
    rare group and of the method's rare set (`group_rare_mass_*`, `method_rare_mass_*`); with `method`, the mean row
    norms of the weight gradient's parts (a), (b), (c) per group as its gates apply them (AGG Eq. 4, `grad_parts`)."""
    model.eval()
    n = len(ids) - 1 if not max_tokens else min(len(ids) - 1, max_tokens)
    gid = agg.group_of(groups, model.out_weight.shape[0]).to(device)
    rare = gid == 2
    # the predicted and the true probability mass of each rare set: the static group's and the method's own
    sets = dict(group_rare=rare, **({} if method_rare is None else dict(method_rare=method_rare.to(device))))
    acc, mass = agg.GroupNLL(), {k: [0.0, 0] for k in sets}
    for logits, y, _ in score(model, ids, n, cfg, device, autocast):
        logp = torch.log_softmax(logits.float(), dim=-1)
        acc.add(-logp.gather(-1, y.unsqueeze(-1)).squeeze(-1).double(), gid[y])
        p = logp.exp()
        for k, m in sets.items():
            mass[k][0] += p[..., m].sum().item()
            mass[k][1] += m[y].sum().item()
    count = acc.tokens()
    out = dict(loss=acc.loss(), ppl=acc.ppl(), tokens=count, ppl_groups=acc.ppl_groups(),
               **agg.geometry(model.out_weight, dict(zip(agg.GROUPS, groups)), seen),
               **{f"{k}_mass_{w}": v / max(1, count) for k, vs in mass.items() for w, v in zip(("pred", "true"), vs)})
    if method_rare is not None:
        out["method_rare_count"] = int(method_rare.sum())
    out.update({"rare_frozen": method.frozen()} if hasattr(method, "frozen") else {})  # freeze-rare (AGG Fig. 2)
    if method is not None:
        n_seq = max(1, min(cfg["micro_batch"], (len(ids) - 1) // cfg["block_size"]))
        t = torch.from_numpy(np.asarray(ids[:n_seq * cfg["block_size"] + 1], dtype=np.int64)).to(device)
        x, y = t[:-1].view(n_seq, -1), t[1:].view(n_seq, -1)
        with autocast():
            hidden = model.features(x)
        gates = method.gates(y.reshape(-1)) if method.steps else (None, None, None)
        parts = agg.gradient_parts(hidden, model.out_weight, y, rare, gates, softcap=model.softcap).cpu()
        out["grad_parts"] = {part: {name: float(parts[groups[k].cpu(), j].mean()) for k, name in enumerate(agg.GROUPS)}
                             for j, part in enumerate("abc")}
    model.train()
    return out


def train(cfg, explicit=frozenset(), argv=()):
    """Train (or resume) the run `cfg` describes; returns its folder. main() parses the command line into cfg."""
    with runlib.Run(cfg, explicit, argv, RUN_CONTROL) as run:
        cfg, device = run.cfg, torch.device(run.device)
        # data: the token ids of the train and valid splits (data.py builds the cache once)
        data = prepare_lm(cfg)
        V, counts = data["vocab_size"], data["counts"]
        cfg["data_fingerprint"] = os.path.basename(data["dir"])  # corpus + tokenizer hash: checked on resume and eval
        seq = Sequences(data["ids"]["train"], cfg["block_size"], cfg["seed"])
        seqs_per_step = max(1, round(cfg["tokens_per_step"] / cfg["block_size"]))  # in whole sequences
        check_memory(cfg, V, min(cfg["micro_batch"], seqs_per_step))
        tokens_per_step = seqs_per_step * cfg["block_size"]  # what AGG's alpha is counted against
        steps_per_epoch = seq.n / seqs_per_step  # AGG's window K: one epoch (AGG Sec. 4.1)
        groups = agg.frequency_groups(counts)  # 30/50/20% of the vocabulary by train counts (AGG Sec. 3.1)

        # model, method (agg.py: the paper's defaults for this preset), optimizer, schedule
        model = build_model(cfg, V, run.ck["step"] if run.ck else 0).to(device)
        special_ids = [data["pad_id"], data["eos_id"]]  # never rare
        method, hp = runlib.build_method(cfg, PRESET_METHOD[cfg["preset"]], vocab_size=V, counts=counts,
                                         special_ids=special_ids, steps_per_epoch=steps_per_epoch,
                                         tokens_per_step=tokens_per_step)
        opt = runlib.make_optimizer(model, cfg, [m.weight for m in (model.tok_emb, model.lm_head) if m is not None])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, runlib.lr_schedule("cosine", cfg["warmup"], cfg["max_steps"]))
        autocast, scaler = runlib.autocast(cfg), torch.amp.GradScaler(device.type, enabled=cfg["dtype"] == "float16")
        step = run.restore(model, opt, sched, method, scaler)  # a resumed run continues exactly
        best_ppl = run.ck.get("best_valid_ppl", math.inf) if run.ck else math.inf
        raw, model = model, torch.compile(model) if cfg["compile"] else model  # raw: the weights the methods see
        n_params = sum(p.numel() for p in raw.parameters())
        rare_share = agg.rare_share_of_alpha(counts, hp["alpha"], tokens_per_step, special_ids) if "alpha" in hp \
            else None
        run.begin(data["tokenizer"].to_str(), n_params=n_params, vocab_size_actual=V, data_cache=data["dir"],
                  data_tokens=data["meta"]["tokens"], tokens_per_step_actual=tokens_per_step,
                  steps_per_epoch=steps_per_epoch, method_hparams=hp, method_rare_share=rare_share)
        print(f"{n_params / 1e6:.2f}M params, V={V}, {tokens_per_step} tokens/step ({seqs_per_step} seqs), "
                  f"{steps_per_epoch:.1f} steps/epoch, {cfg['method']} {hp}" +
                  (f", {rare_share:.1%} of the vocabulary rare at average rates" if rare_share else ""))
        if cfg["rare_share"] and rare_share is not None and abs(rare_share - cfg["rare_share"]) > 0.02:  # tied counts
            print(f"warning: --rare-share {cfg['rare_share']} marks {rare_share:.1%} of the vocabulary rare here")

        bar = tqdm(total=cfg["max_steps"], initial=step, dynamic_ncols=True, mininterval=1.0)
        t0, first = time.time(), step  # throughput since this invocation started
        model.train()  # dropout on
        while step < run.stop_step:
            # the step's sequences: the data position is just the step counter
            x_all, y_all = seq.get(step * seqs_per_step, seqs_per_step, device)
            # the method's update: observe the targets, accumulate micro-batches, clip, step
            loss, nll, stats = train_step(model, raw, method, opt, x_all, y_all, cfg["micro_batch"], autocast, scaler)
            if not math.isfinite(loss):
                raise run.diverged(f"step {step + 1}: loss is {loss}")
            sched.step()  # the lr of the next step
            step += 1
            if untied(cfg, step) and not raw.untied:  # --untie-at: from here on the output matrix is lm_head
                raw.untie(opt)
            bar.update(1)  # the progress bar counts optimizer steps
            rec = dict(loss=loss, nll=nll, ppl=math.exp(min(nll, 50)), **runlib.method_record(stats, tokens_per_step))
            bar.set_postfix({k: f"{rec[k]:.3g}" for k in ("loss", "ppl", "method_rare_fraction") if k in rec},
                            refresh=False)
            if step % cfg["log_interval"] == 0 or step == 1 or step == run.stop_step:
                speed = (step - first) * tokens_per_step / max(1e-9, time.time() - t0)
                run.log(dict(step=step, split="train", **rec, tokens_per_s=speed, lr=sched.get_last_lr()[0],
                             epoch=step / steps_per_epoch))
            # snapshots of the embedding matrix for the SVD plots over time of studies.compare (AGG Fig. 1)
            if step in cfg["snapshot_steps"]:
                runlib.save_checkpoint(os.path.join(run.out, "snapshots", f"emb_{step}.pt"),
                                       dict(step=step, weight=raw.out_weight.detach().float().cpu().clone()))
            # once in a while: validate and keep the model of the lowest valid PPL
            evaluated = step % cfg["eval_interval"] == 0 or step == run.stop_step
            if evaluated:
                v = validate(raw, data["ids"]["valid"], cfg, device, autocast, groups, cfg["eval_tokens"],
                             method.rare_mask() if method.steps else None, seen=counts > 0, method=method)
                run.log(dict(step=step, split="valid", **v))  # a non-finite PPL stops the run
                tqdm.write(f"step {step}: valid ppl {v['ppl']:.2f} (rare {v['ppl_groups']['rare']:.0f})  I(W) "
                           f"{v['isotropy']:.3f}  rare mass pred/true {v['group_rare_mass_pred']:.4f}/"
                           f"{v['group_rare_mass_true']:.4f}")
                if v["ppl"] < best_ppl:
                    best_ppl = v["ppl"]
                    runlib.save_checkpoint(os.path.join(run.out, "ckpt_best.pt"), dict(
                        model=raw.state_dict(), step=step, config=cfg, task="lm", valid_ppl=best_ppl))
            # checkpoint everything a resume needs; on SIGTERM / SIGINT checkpoint at this step and stop (exit 1)
            stopping = run.stopping(step)
            if evaluated or stopping:
                run.checkpoint(step, raw, opt, sched, method, scaler, best_valid_ppl=best_ppl)
            if stopping:
                break
        bar.close()
    print(f"done: step {step}, checkpoint {run.ckpt_path}")
    return run.out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    explicit = runlib.explicit_flags(build_parser(), argv)
    cfg = resolve_config(build_parser().parse_args(argv), explicit)
    return prepare_lm(cfg)["dir"] if cfg["prepare_only"] else train(cfg, explicit, argv)


if __name__ == "__main__":
    main()
