#!/usr/bin/env python
"""Language modelling with AGG and its peers: a pre-LN GPT decoder with tied input/output
embeddings.

    python train_lm.py --method agg        # offline default corpus, cpu preset on CPU
    python train_lm.py --dataset wikitext-103 --preset paper-6l --method agg
    python train_lm.py --dataset wikitext-103 --preset gpt2-medium --method agg --compile  # a GPU
    python train_lm.py --out out/lm-agg-s0 --resume     # continue a run with its saved config

A run's --out folder holds config.json (config and provenance), log.jsonl (train and valid records),
ckpt.pt and ckpt_best.pt. This file is the experiment: model, loss, loop, and the run's life in
train(); the corpora are data.py's, the methods agg.py's (fed hidden states, the tied weight and
targets), the run's tools runlib.py's; eval.py reads the test split.
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

# Presets. paper-6l / gpt2-medium: AGG Table 11's "empirical study" / "language modeling" columns.
# cpu: 4 layers, d 128 (1.9M params), 2,400 steps of 1,024 tokens (3.5 epochs of the offline
# corpus), ~7 min on 2 cores; lr and warm-up MLE's best on validation (RESULTS.md), the paper's
# protocol of one setting fit for the baseline.
CPU = dict(n_layer=4, d_model=128, n_head=4, d_ff=512, dropout=0.1, block_size=128)
CPU.update(vocab_size=8192, tokens_per_step=1024, micro_batch=32, lr=4e-3, warmup=240)
CPU.update(max_steps=2400, eval_interval=200, weight_decay=0.01)
PAPER_6L = dict(n_layer=6, d_model=512, n_head=8, d_ff=2048, dropout=0.1, block_size=512)
PAPER_6L.update(vocab_size=44256, tokens_per_step=32768, micro_batch=16, lr=7e-4, warmup=4000)
PAPER_6L.update(max_steps=40000, eval_interval=1000, weight_decay=0.01)
GPT2_MEDIUM = dict(PAPER_6L, n_layer=24, d_model=1024, n_head=16, d_ff=4096, block_size=1024)
GPT2_MEDIUM.update(micro_batch=8, max_steps=50000)
PRESETS = {"cpu": CPU, "paper-6l": PAPER_6L, "gpt2-medium": GPT2_MEDIUM}
# Method defaults per preset where the method takes them and no flag overrides them: AGG Table 11's
# alpha 0.03 (also agg.py's default, for paper-6l's column without one) and AGPS's LM settings; cpu:
# alpha is a count per step (0.03 marks 35% of the vocabulary rare at 1,024 tokens per step), so the
# rare group is a share of the vocabulary, the headline's 0.2 (validation PPL alone selects 0.05,
# which leaves most of the degeneration in place: RESULTS.md).
# AGPS Tables 5 and 8 (i_r, mu1, mu2), language modelling
AGPS_LM = dict(rare_rank=25000, mu1=5e2, mu2=2e1)
PRESET_METHOD = {"cpu": dict(rare_share=0.2)}  # each preset's method hyper-parameters
PRESET_METHOD["paper-6l"] = dict(AGPS_LM)
PRESET_METHOD["gpt2-medium"] = dict(AGPS_LM, alpha=0.03)
MODEL_FIELDS = ("n_layer", "d_model", "n_head", "d_ff", "dropout", "block_size")
RUN_CONTROL = runlib.RUN_CONTROL | {"eval_tokens", "snapshot_steps"}  # see runlib.RUN_CONTROL
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)  # train_step's default: no loss scaling


# ------------------------------------------------------------------------------------------- config
def step_list(text):
    """--snapshot-steps' value: comma-separated steps, sorted, each once."""
    steps = {int(x) for x in text.split(",") if x}
    return sorted(steps)


def preset_help(presets):
    """Each preset's fields, for --preset's help."""
    described = []
    for name, fields in presets.items():
        values = ", ".join(f"{f}={v}" for f, v in fields.items())
        described.append(f"{name}: {values}")
    return "; ".join(described)


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        default=OFFLINE_DATASET,
        help=f"{OFFLINE_DATASET} (offline default) | {BIBLE_EN} (offline: the World English "
        f"Bible, a chapter a line) | wikitext-103 | wikitext-2 (hub)",
    )
    g.add_argument(
        "--data-dir",
        help="one corpus: DIR/train.txt, valid.txt, test.txt (UTF-8, one paragraph a line), or "
        "the WikiText zip's wiki.train.tokens, ...",
    )
    g.add_argument(
        "--tokenizer",
        default="bpe",
        choices=["bpe", "word"],
        help="bpe: byte-level BPE trained on train (GPT-2 style); word: whitespace words "
        "(WikiText's level)",
    )
    g.add_argument("--vocab-size", type=int, help="BPE / word vocabulary size (preset default)")
    g.add_argument("--cache-dir", default=LM_CACHE, help="tokenizer + token-id cache")
    g.add_argument(
        "--split-seed",
        type=int,
        default=0,
        help=f"{OFFLINE_DATASET}: which articles are valid and test (0: the default split)",
    )
    g.add_argument(
        "--train-fraction",
        type=float,
        default=1.0,
        help="train on the first FRACTION of the train split (nested: smaller fractions are in "
        "larger ones); the tokenizer, valid and test stay those of the whole split",
    )
    g = p.add_argument_group("model (override any preset field)")
    g.add_argument(
        "--preset",
        default="cpu",
        choices=sorted(PRESETS),
        help="cpu (the README's numbers) or the paper's set-ups: " + preset_help(PRESETS),
    )
    for name in MODEL_FIELDS:
        kind = float if name == "dropout" else int
        g.add_argument("--" + name.replace("_", "-"), type=kind)
    untie = g.add_mutually_exclusive_group()
    untie.add_argument(
        "--untie",
        action="store_true",
        help="a separate output matrix (a control: the methods and the geometry are that matrix's)",
    )
    untie.add_argument(
        "--untie-at",
        type=float,
        metavar="FRACTION",
        help="tied until this fraction of --max-steps, then the output matrix starts as a copy of "
        "the tied one (and its Adam state) and both train on; the methods act on it from then on",
    )
    g.add_argument(
        "--logit-softcap",
        type=float,
        metavar="C",
        help="logits C tanh(logits / C) (Gemma 2's soft-capping) in agg.py's fused head, for "
        "every method",
    )
    g.add_argument(
        "--output-bias",
        action="store_true",
        help="a learned per-token bias on the logits (zero-initialised, no weight decay, plain "
        "gradient)",
    )
    runlib.add_run_flags(p, "lm")
    g = p.add_argument_group("training")
    g.add_argument("--tokens-per-step", type=int, help="tokens per optimizer step")
    g.add_argument(
        "--micro-batch", type=int, help="sequences per micro-batch (gradient accumulation)"
    )
    g.add_argument("--lr", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--warmup", type=int, help="linear warm-up steps, then cosine decay to 0.1 lr")
    g.add_argument("--eval-interval", type=int, help="validate + checkpoint every N steps")
    g.add_argument("--eval-tokens", type=int, help="cap on validation tokens (default all)")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument(
        "--snapshot-steps",
        type=step_list,
        default=[],
        help="comma-separated steps to save the embedding matrix at, to OUT/snapshots/ "
        "(AGG Fig. 1)",
    )
    return p


POSITIVE = ("n_layer", "d_model", "n_head", "d_ff", "block_size", "tokens_per_step")
POSITIVE += ("micro_batch", "eval_interval", "log_interval", "eval_tokens")


def resolve_config(args, explicit=None):
    """The run's config: the parsed flags with the preset's defaults filled in, checked."""
    cfg = dict(vars(args))
    for key, value in PRESETS[cfg["preset"]].items():
        if cfg.get(key) is None:
            cfg[key] = value
    size_given = explicit is not None and "vocab_size" in explicit
    if cfg["tokenizer"] == "word" and not size_given:
        # word level: keep every word of the train split (WikiText's closed vocabulary)
        cfg["vocab_size"] = 0
    if cfg["data_dir"]:
        cfg["dataset"] = "dir"
        # the run's data wherever it is resumed or evaluated from
        cfg["data_dir"] = os.path.abspath(cfg["data_dir"])
    if cfg["split_seed"] and cfg["dataset"] != OFFLINE_DATASET:
        raise SystemExit(
            f"--split-seed {cfg['split_seed']}: only the offline corpus {OFFLINE_DATASET} is "
            f"split here; {describe_source(cfg)} comes with its own splits"
        )
    if not 0 < cfg["train_fraction"] <= 1:
        raise SystemExit(f"--train-fraction {cfg['train_fraction']}: must be in (0, 1]")
    ranges = dict.fromkeys(POSITIVE, (1, None))
    ranges.update(vocab_size=(0, None), untie_at=(0, 1), logit_softcap=(1e-3, None))
    runlib.check_run_flags(cfg, "lm", ranges)
    # --untie-at's step, fixed when the run starts (a resume to another --max-steps keeps it)
    cfg["untie_step"] = None
    if cfg["untie_at"] is not None:
        cfg["untie_step"] = max(1, round(cfg["untie_at"] * cfg["max_steps"]))
    if cfg["d_model"] % cfg["n_head"]:
        raise SystemExit(
            f"--d-model {cfg['d_model']} is not divisible by --n-head {cfg['n_head']}: change "
            f"one of them"
        )
    return cfg


def make_config(**fields):
    """The resolved config of a run with `fields` set as their flags would set them (names as in
    config.json)."""
    return runlib.make_config(build_parser(), resolve_config, fields)


class Sequences:
    """The train stream cut into non-overlapping (block+1)-token windows, reshuffled every epoch by
    (seed, epoch). Global sequence number g -> (epoch g // n, window perm_epoch[g % n]): the data
    position is just a counter."""

    def __init__(self, ids, block_size, seed):
        self.ids, self.block, self.seed = ids, block_size, seed
        self.n = (len(ids) - 1) // block_size
        if self.n < 1:
            raise SystemExit(
                f"the train split has {len(ids)} tokens, fewer than --block-size {block_size} + 1: "
                f"use a larger corpus or a smaller --block-size"
            )

    @functools.lru_cache(maxsize=1)  # one epoch's permutation at a time
    def perm(self, epoch):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=generator).numpy()

    def get(self, start, count, device):
        """The inputs and their next tokens of global sequences start .. start + count - 1."""
        windows = []
        for g in range(start, start + count):
            first = int(self.perm(g // self.n)[g % self.n]) * self.block
            window = self.ids[first : first + self.block + 1]
            windows.append(np.asarray(window, dtype=np.int64))
        t = torch.from_numpy(np.stack(windows))
        return t[:, :-1].to(device), t[:, 1:].to(device)


class SelfAttention(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).split(C, dim=2)
        head_dim = C // self.n_head
        heads = [t.view(B, T, self.n_head, head_dim) for t in qkv]
        q, k, v = [h.transpose(1, 2) for h in heads]
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self, d_model, n_head, d_ff, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, dropout)
        up, down = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.mlp = nn.Sequential(up, nn.GELU(), down, nn.Dropout(dropout))

    def forward(self, x):  # pre-LN
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LN decoder whose output layer is the input embedding (tied): logits = features(x) @
    tok_emb.weight.T (+ a learned per-token bias with output_bias; softcap C: C tanh(logits / C)).
    untie: an output matrix lm_head of its own ("late": unused until untie()); out_weight is the
    softmax's matrix, the one the methods act on."""

    def __init__(
        self,
        vocab_size,
        n_layer,
        d_model,
        n_head,
        d_ff,
        dropout,
        block_size,
        output_bias=False,
        untie=False,
        softcap=None,
    ):
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
        if (
            untie == "late"
        ):  # made after the init (no random draws): the tied model's weights and dropout exactly
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
        """The features of x, the head's input (agg's losses take features and the tied weight, not
        logits)."""
        T = x.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.block_size}")
        positions = torch.arange(T, device=x.device)
        h = self.drop(self.tok_emb(x) + self.pos_emb(positions))
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
        """Untie late: the output matrix starts as a copy of the tied one, with its optimizer state,
        and trains on."""
        self.lm_head.weight.copy_(self.tok_emb.weight)
        tied_state = opt.state[self.tok_emb.weight]
        opt.state[self.lm_head.weight] = {k: v.clone() for k, v in tied_state.items()}
        self.untied = True

    def head(self, h):
        logits = h @ self.out_weight.t()  # the output layer: logits of features h
        logits = logits if self.out_bias is None else logits + self.out_bias
        return (
            logits
            if self.softcap is None
            else self.softcap * torch.tanh(logits.float() / self.softcap)
        )

    def logits(self, x):
        return self.head(self.features(x))

    @torch.no_grad()
    def generate(self, x, n_new, temperature=0.0, top_k=None, autocast=contextlib.nullcontext):
        """Continue the (B, T) token ids x by n_new tokens, the context cropped to block_size
        (nanoGPT's sampling loop, the head applied at the last position only): temperature 0 is
        greedy; top_k keeps the k most likely."""
        for _ in range(n_new):
            with autocast():
                context = x[:, -self.block_size :]
                logits = self.head(self.features(context)[:, -1]).float()
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
    """The model of config cfg as it is after `step` steps (--untie-at: tied before its split
    step)."""
    shape = {k: cfg[k] for k in MODEL_FIELDS}
    untie = bool(cfg.get("untie"))
    if cfg.get("untie_at") is not None:
        untie = "late"
    output_bias = bool(cfg.get("output_bias"))
    model = GPT(
        vocab_size, **shape, output_bias=output_bias, untie=untie, softcap=cfg.get("logit_softcap")
    )
    model.untied = untied(cfg, step)
    return model


def untied(cfg, step):
    """Whether the output matrix is lm_head after `step` steps: --untie, or --untie-at's split step
    reached."""
    return bool(cfg.get("untie")) or cfg.get("untie_step") is not None and step >= cfg["untie_step"]


def load_model(ck, device="cpu"):
    """The trained model of a loaded LM checkpoint (runlib.load_checkpoint), in eval mode on
    `device`."""
    model = build_model(ck["config"], ck["model"]["tok_emb.weight"].shape[0], ck["step"])
    return runlib.load_state(model, ck, ck["config"].get("out")).to(device).eval()


# ----------------------------------------------------------------------------------------- training
def check_memory(cfg, V, B):
    """Refuse a micro-batch of B sequences whose activations (attention scores, layers, logits)
    cannot fit in memory."""
    T = cfg["block_size"]
    per_layer = cfg["n_head"] * T + 16 * cfg["d_model"] + 2 * cfg["d_ff"]
    need = 4 * B * T * (cfg["n_layer"] * per_layer + V)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if cfg["device"] == "cpu" and need > 0.8 * have:
        raise SystemExit(
            f"--block-size {T} with micro-batches of {B} sequences needs about "
            f"{need / 2**30:.0f} GiB, more than this machine's {have / 2**30:.0f} GiB: lower "
            f"--block-size or --micro-batch"
        )


def train_step(
    model, raw, method, opt, x_all, y_all, micro_batch, autocast, scaler=NO_SCALER, world=1
):
    """One optimizer step on the step's sequences (under torchrun, this rank's share of them):
    (mean loss, mean NLL, the method's stats)."""
    # once per optimizer step, all targets of the step (under DDP agg gathers every rank's)
    method.observe(y_all)
    n_all = y_all.numel() * world  # the step's targets, all ranks (equal shares)
    loss_sum = 0.0
    nll_sum = 0.0
    for s in range(0, len(x_all), micro_batch):
        x = x_all[s : s + micro_batch]
        y = y_all[s : s + micro_batch]
        if world > 1:  # DDP: all-reduce the gradients in the last micro-batch's backward only
            model.require_backward_grad_sync = s + micro_batch >= len(x_all)
        with autocast():
            hidden = model(x)  # = raw.features(x), the input of the tied head
            # the method's loss: it gates W's gradient
            loss = method.loss(hidden, raw.out_weight, y, bias=raw.out_bias, softcap=raw.softcap)
        # accumulate: each micro-batch weighted by its share of the step's targets (times the
        # ranks: DDP averages their gradients)
        scaler.scale(loss * (y.numel() / n_all * world)).backward()
        loss_sum += loss.item() * y.numel()
        nll_sum += float(method.stats.get("nll", loss.item())) * y.numel()
    loss_sum, nll_sum = runlib.summed(loss_sum, nll_sum)
    scaler.unscale_(opt)  # float16: clip the true gradient
    # clip at 1, GPT-2 / nanoGPT practice for decoder LMs
    torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
    scaler.step(opt)  # float16: skipped when the gradient has inf/NaN
    scaler.update()
    method.after_step(raw.out_weight)  # e.g. FRAGE's discriminator, centering's mean row
    opt.zero_grad(set_to_none=True)  # free the gradients
    return loss_sum / n_all, nll_sum / n_all, method.stats


def score(model, ids, n, cfg, device, autocast, context=0):
    """Yields (logits, targets, their indices in ids) of the first n targets of `ids`, each scored
    once, in micro-batches of windows of one shape: a window of L inputs from a scores its targets
    after `skip` tokens of context (fairseq's --context-window; context 0: non-overlapping blocks,
    cold starts)."""
    if not 0 <= context < cfg["block_size"]:
        raise SystemExit(
            f"--context-window {context}: must be in [0, block_size {cfg['block_size']})"
        )
    stride = cfg["block_size"] - context
    # the windows by (inputs L, context skipped): one shape a micro-batch
    by_shape = {}
    for s in range(0, n, stride):
        first = max(0, s - context)
        shape = (min(s + stride, n) - first, s - first)
        by_shape.setdefault(shape, []).append(first)
    batch = max(1, cfg["micro_batch"])
    for (L, skip), starts in sorted(by_shape.items(), reverse=True):
        for i in range(0, len(starts), batch):
            group = starts[i : i + cfg["micro_batch"]]
            windows = [np.asarray(ids[a : a + L + 1], dtype=np.int64) for a in group]
            t = torch.from_numpy(np.stack(windows)).to(device)
            with autocast():
                logits = model.logits(t[:, :-1])
            positions = torch.tensor(group)[:, None] + torch.arange(1 + skip, L + 1)
            yield logits[:, skip:], t[:, 1 + skip :], positions


@torch.no_grad()
def validate(model, method, data, cfg):
    """Valid PPL (eval.py's scoring), total and per frequency group (30/50/20% by train counts);
    the geometry per group over the tokens seen in training (agg.geometry; AGG Fig. 2); the
    predicted vs true probability mass of the static rare group and of the method's rare set
    (`group_rare_mass_*`, `method_rare_mass_*`); the mean row norms of the weight gradient's parts
    (a), (b), (c) per group as the method's gates apply them (AGG Eq. 4, `grad_parts`)."""
    model.eval()
    device = torch.device(cfg["device"])
    ids = data["ids"]["valid"]
    counts = data["counts"]
    groups = agg.frequency_groups(counts)
    n = len(ids) - 1
    if cfg["eval_tokens"]:
        n = min(n, cfg["eval_tokens"])
    group_id = agg.group_of(groups, model.out_weight.shape[0]).to(device)
    rare = group_id == 2
    # the predicted and the true probability mass of each rare set: the static group's, the method's
    rare_sets = dict(group_rare=rare)
    method_rare = method.rare_mask() if method.steps else None
    if method_rare is not None:
        rare_sets["method_rare"] = method_rare.to(device)
    predicted_mass = dict.fromkeys(rare_sets, 0.0)
    true_mass = dict.fromkeys(rare_sets, 0)
    acc = agg.GroupNLL()
    for logits, y, _ in score(model, ids, n, cfg, device, runlib.autocast(cfg)):
        logp = torch.log_softmax(logits.float(), dim=-1)
        target_logp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        acc.add(-target_logp.double(), group_id[y])
        p = logp.exp()
        for name, mask in rare_sets.items():
            predicted_mass[name] += p[..., mask].sum().item()
            true_mass[name] += mask[y].sum().item()
    count = acc.tokens()
    out = dict(loss=acc.loss(), ppl=acc.ppl(), tokens=count)
    out["ppl_groups"] = acc.ppl_groups()
    named_groups = dict(zip(agg.GROUPS, groups))
    out.update(agg.geometry(model.out_weight, named_groups, counts > 0))
    for name in rare_sets:
        out[f"{name}_mass_pred"] = predicted_mass[name] / max(1, count)
        out[f"{name}_mass_true"] = true_mass[name] / max(1, count)
    if method_rare is not None:
        out["method_rare_count"] = int(method_rare.sum())
    if hasattr(method, "frozen"):  # freeze-rare (AGG Fig. 2)
        out["rare_frozen"] = method.frozen()
    out["grad_parts"] = gradient_parts(model, method, ids, cfg, rare, groups)
    model.train()
    return out


def gradient_parts(model, method, ids, cfg, rare, groups):
    """{part: {group: mean row norm}} of the weight gradient's parts (a), (b), (c) on the first
    micro-batch of `ids`, as the method's gates apply them (AGG Eq. 4)."""
    block = cfg["block_size"]
    n_seq = max(1, min(cfg["micro_batch"], (len(ids) - 1) // block))
    window = np.asarray(ids[: n_seq * block + 1], dtype=np.int64)
    tokens = torch.from_numpy(window).to(rare.device)
    x = tokens[:-1].view(n_seq, -1)
    y = tokens[1:].view(n_seq, -1)
    with runlib.autocast(cfg)():
        hidden = model.features(x)
    gates = (None, None, None)
    if method.steps:
        gates = method.gates(y.reshape(-1))
    parts = agg.gradient_parts(hidden, model.out_weight, y, rare, gates, softcap=model.softcap)
    parts = parts.cpu()
    by_part = {}
    for j, part in enumerate("abc"):
        by_group = {}
        for k, name in enumerate(agg.GROUPS):
            by_group[name] = float(parts[groups[k].cpu(), j].mean())
        by_part[part] = by_group
    return by_part


def evaluate(model, method, data, cfg, step, best_ppl, wandb):
    """Validate (log.jsonl's valid record; a non-finite valid PPL stops the run) and save
    ckpt_best.pt when the valid PPL is the lowest yet. Returns the lowest valid PPL."""
    out = cfg["out"]
    v = validate(model, method, data, cfg)
    log_path = os.path.join(out, "log.jsonl")
    runlib.log(log_path, dict(step=step, split="valid", **v), wandb)
    if not (math.isfinite(v["loss"]) and math.isfinite(v["ppl"])):
        what = f"step {step}: the valid loss is {v['loss']:.4g}, PPL {v['ppl']:.4g}"
        raise runlib.diverged(os.path.join(out, "ckpt.pt"), what)
    rare_ppl = v["ppl_groups"]["rare"]
    mass = f"{v['group_rare_mass_pred']:.4f}/{v['group_rare_mass_true']:.4f}"
    tqdm.write(
        f"step {step}: valid ppl {v['ppl']:.2f} (rare {rare_ppl:.0f})  I(W) {v['isotropy']:.3f}  "
        f"rare mass pred/true {mass}"
    )
    if v["ppl"] >= best_ppl:
        return best_ppl
    best = dict(model=model.state_dict(), step=step, config=cfg, task="lm")
    best["valid_ppl"] = v["ppl"]
    runlib.save_checkpoint(os.path.join(out, "ckpt_best.pt"), best)
    return v["ppl"]


def make_optimizer(model, cfg, vocab_matrices=()):
    """AdamW with betas 0.9 / 0.98 and eps 1e-8, as the papers' fairseq set-ups (agg.CoupledAdamW
    with --optimizer coupled-adam); runlib.param_groups says which parameters decay."""
    groups = runlib.param_groups(model, cfg, vocab_matrices)
    adam = agg.CoupledAdamW if cfg.get("optimizer") == "coupled-adam" else torch.optim.AdamW
    return adam(groups, lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-8)


def cosine_lr(step, warmup, max_steps):
    """The factor of the peak lr at `step`: a linear warm-up, then a cosine decay to 10% of the peak
    at max_steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def wrap(raw, cfg, world):
    """The model the training step calls: compiled (--compile), then DistributedDataParallel
    under torchrun (nanoGPT's order); raw keeps the weights."""
    model = raw
    if cfg["compile"]:
        model = torch.compile(model)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def train(cfg, explicit=frozenset(), argv=()):
    """Train (or resume) the run `cfg` describes; returns its folder. main() parses the command
    line into cfg."""
    # torchrun: this process is rank `rank` of `world` training one run (DDP); rank 0 writes
    rank, world = runlib.start_ddp(cfg)
    # start afresh, or resume a checkpoint with its config (runlib.start states the rule)
    cfg, ck = runlib.start(cfg, explicit, RUN_CONTROL)
    out = cfg["out"]
    ckpt_path = os.path.join(out, "ckpt.pt")
    log_path = os.path.join(out, "log.jsonl")
    device = torch.device(cfg["device"])
    stop_step = min(cfg["max_steps"], cfg["stop_at"] or cfg["max_steps"])
    torch.manual_seed(cfg["seed"])  # init and dropout masks

    # data: the token ids of the train and valid splits (data.py builds the cache once, rank 0
    # first)
    with runlib.rank0_first(rank):
        data = prepare_lm(cfg)
    V = data["vocab_size"]
    counts = data["counts"]
    # corpus + tokenizer hash: checked on resume and eval
    cfg["data_fingerprint"] = os.path.basename(data["dir"])
    seq = Sequences(data["ids"]["train"], cfg["block_size"], cfg["seed"])
    # whole sequences per step, over all ranks; each rank trains on its share
    seqs_per_step = max(1, round(cfg["tokens_per_step"] / cfg["block_size"]))
    if seqs_per_step % world:
        raise SystemExit(
            f"--tokens-per-step {cfg['tokens_per_step']}: {seqs_per_step} sequences a step do "
            f"not split over {world} processes: make them a multiple of {world}"
        )
    share = seqs_per_step // world
    check_memory(cfg, V, min(cfg["micro_batch"], share))
    tokens_per_step = seqs_per_step * cfg["block_size"]  # what AGG's alpha is counted against
    steps_per_epoch = seq.n / seqs_per_step  # AGG's window K: one epoch (AGG Sec. 4.1)

    # model, and the method (agg.py: the paper's defaults for this preset)
    model = build_model(cfg, V, ck["step"] if ck else 0).to(device)
    special_ids = [data["pad_id"], data["eos_id"]]  # never rare
    preset = PRESET_METHOD[cfg["preset"]]
    data_facts = dict(vocab_size=V, counts=counts, special_ids=special_ids)
    data_facts.update(steps_per_epoch=steps_per_epoch, tokens_per_step=tokens_per_step)
    method, hp = runlib.build_method(cfg, preset, **data_facts)
    # the optimizer (make_optimizer: AdamW) and the schedule: a linear warm-up, then cosine decay
    vocab_matrices = [m.weight for m in (model.tok_emb, model.lm_head) if m is not None]
    opt = make_optimizer(model, cfg, vocab_matrices)
    warmup = cfg["warmup"]
    max_steps = cfg["max_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: cosine_lr(step, warmup, max_steps))
    autocast = runlib.autocast(cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg["dtype"] == "float16")
    # a resumed run continues exactly: weights, optimizer, schedule, method, loss scale, RNGs
    step = runlib.restore(ck, model, opt, sched, method, scaler)
    best_ppl = ck.get("best_valid_ppl", math.inf) if ck else math.inf
    raw = model  # the weights the methods see
    model = wrap(raw, cfg, world)
    n_params = sum(p.numel() for p in raw.parameters())
    rare_share = None
    if "alpha" in hp:
        rare_share = agg.rare_share_of_alpha(counts, hp["alpha"], tokens_per_step, special_ids)

    # take the folder (one writer at a time); a signal from here on stops at a step boundary
    folder = runlib.take_folder(out, new=ck is None, rank=rank)
    with folder, runlib.stop_signals() as signals:
        # provenance (config.json), the tokenizer, the log kept up to the checkpoint: rank 0
        info = dict(n_params=n_params, vocab_size_actual=V, data_cache=data["dir"])
        info.update(data_tokens=data["meta"]["tokens"], tokens_per_step_actual=tokens_per_step)
        info.update(
            steps_per_epoch=steps_per_epoch, method_hparams=hp, method_rare_share=rare_share
        )
        info["world_size"] = world
        tokenizer = data["tokenizer"].to_str()
        segments, wandb = None, None
        if rank == 0:
            segments = runlib.write_provenance(cfg, ck, argv, step, tokenizer, world, **info)
            runlib.start_log(log_path, step, resumed=ck is not None)
            wandb = runlib.start_wandb(cfg)
        was = ck["config"].get("world_size", 1) if ck else world
        if rank == 0 and was != world:
            print(
                f"resuming a run of {was} processes on {world}: the same global batch and data "
                f"order; the gradient's summation order and the dropout masks differ"
            )
        rare_note = (
            f", {rare_share:.1%} of the vocabulary rare at average rates" if rare_share else ""
        )
        say = print if rank == 0 else runlib.quiet
        say(
            f"{n_params / 1e6:.2f}M params, V={V}, {tokens_per_step} tokens/step ({seqs_per_step} "
            f"seqs), {steps_per_epoch:.1f} steps/epoch, {cfg['method']} {hp}{rare_note}"
        )
        asked = cfg["rare_share"]
        # tied counts make the share a step function of alpha
        if asked and rare_share is not None and abs(rare_share - asked) > 0.02:
            say(f"warning: --rare-share {asked} marks {rare_share:.1%} of the vocabulary rare here")

        quiet = rank > 0
        bar = tqdm(
            total=cfg["max_steps"], initial=step, dynamic_ncols=True, mininterval=1.0, disable=quiet
        )
        t0 = time.time()  # throughput since this invocation started
        first = step
        stopping = False
        model.train()  # dropout on
        while step < stop_step:
            # the step's sequences (this rank's share): the data position is the step counter
            first_seq = step * seqs_per_step + rank * share
            x_all, y_all = seq.get(first_seq, share, device)
            # the method's update: observe the targets, accumulate micro-batches, clip, step
            micro = cfg["micro_batch"]
            batch = (x_all, y_all, micro, autocast, scaler, world)
            loss, nll, stats = train_step(model, raw, method, opt, *batch)
            if not math.isfinite(loss):
                raise runlib.diverged(ckpt_path, f"step {step + 1}: loss is {loss}")
            sched.step()  # the lr of the next step
            step += 1
            # --untie-at: from here on the output matrix is lm_head
            if untied(cfg, step) and not raw.untied:
                raw.untie(opt)
                model = wrap(raw, cfg, world)  # DDP and the compiler see the new lm_head
            bar.update(1)  # the progress bar counts optimizer steps
            rec = dict(loss=loss, nll=nll, ppl=math.exp(min(nll, 50)))
            rec.update(runlib.method_record(stats, tokens_per_step))
            shown = [k for k in ("loss", "ppl", "method_rare_fraction") if k in rec]
            bar.set_postfix({k: f"{rec[k]:.3g}" for k in shown}, refresh=False)

            # every log_interval steps: a train record
            logged = step % cfg["log_interval"] == 0 or step == 1 or step == stop_step
            if logged and rank == 0:
                speed = (step - first) * tokens_per_step / max(1e-9, time.time() - t0)
                rec.update(tokens_per_s=speed, lr=sched.get_last_lr()[0])
                rec["epoch"] = step / steps_per_epoch
                runlib.log(log_path, dict(step=step, split="train", **rec), wandb)

            # snapshots of the embedding matrix for studies.compare's SVD plots (AGG Fig. 1)
            if step in cfg["snapshot_steps"] and rank == 0:
                weight = raw.out_weight.detach().float().cpu().clone()
                path = os.path.join(out, "snapshots", f"emb_{step}.pt")
                runlib.save_checkpoint(path, dict(step=step, weight=weight))

            # once in a while: validate, and keep the model of the lowest valid PPL
            evaluated = step % cfg["eval_interval"] == 0 or step == stop_step
            if evaluated and rank == 0:  # the other ranks wait for it at the next step
                best_ppl = evaluate(raw, method, data, cfg, step, best_ppl, wandb)

            # checkpoint all that a resume needs; on a signal, at this step, then stop (exit 1)
            stopping = runlib.agreed(bool(signals)) and step < stop_step  # every rank alike
            if (evaluated or stopping) and rank == 0:
                state = dict(optimizer=opt.state_dict(), scheduler=sched.state_dict())
                state.update(method=method.state_dict(), scaler=scaler.state_dict())
                state.update(rng=runlib.rng_state(), provenance=segments, best_valid_ppl=best_ppl)
                runlib.checkpoint(ckpt_path, raw, step, cfg, **state)
            if stopping:
                break
        bar.close()
        if wandb is not None:
            wandb.finish()
    del model  # DDP's reducer holds the process group: it goes first (raw keeps the weights)
    runlib.end_ddp()
    if stopping:  # exit 1: the run is not finished
        raise runlib.stopped(signals, step, ckpt_path, rank, "train_lm.py")
    say(f"done: step {step}, checkpoint {ckpt_path}")
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    explicit = runlib.explicit_flags(build_parser(), argv)
    cfg = resolve_config(build_parser().parse_args(argv), explicit)
    if not cfg["prepare_only"]:
        return train(cfg, explicit, argv)
    if cfg["resume"]:  # the run's own corpus, from its checkpoint's config
        cfg, _ = runlib.start(cfg, explicit, RUN_CONTROL)
    return prepare_lm(cfg)["dir"]


if __name__ == "__main__":
    main()
