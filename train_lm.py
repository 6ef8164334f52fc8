#!/usr/bin/env python
"""Language modelling with AGG and its peers: a pre-LN GPT decoder with tied input/output embeddings.

    python train_lm.py --method agg                          # offline default corpus, cpu preset on CPU
    python train_lm.py --dataset wikitext-103 --preset paper-6l --method agg
    torchrun --nproc_per_node 8 train_lm.py --dataset wikitext-103 --preset gpt2-medium --method agg
    python train_lm.py --out out/lm-agg-s0 --resume       # continue a run with its saved config

Everything a run needs is in its --out folder: config.json (full config and provenance), log.jsonl (one JSON object
per line: train and valid records), ckpt.pt (written atomically; --resume continues it exactly) and ckpt_best.pt.
The run plumbing shared with train_nmt.py is in runlib.py; the methods live in agg.py, and this file only feeds
them (hidden, tied weight, targets). evaluate() below is the test-set evaluation eval.py calls.
"""
import argparse
import bz2
import contextlib
import glob
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import agg
import runlib

ROOT = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.path.join(ROOT, "data_cache", "lm")
OFFLINE_DATASET = "gensim-wiki"  # the shortened English Wikipedia dump shipped in the gensim wheel
GENSIM_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
HUB_DATASETS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
EOS, PAD, UNK = "<|endoftext|>", "<pad>", "<unk>"
DATA_VERSION = 1  # bump when the cleaning / encoding below changes, so caches are rebuilt

# Presets. paper-6l: 001 Table 11 "empirical study"; gpt2-medium: 001 Table 11 "language modeling" column.
# cpu: 4 layers, d 128 (1.9M params) on the offline corpus: 2,400 steps of 1,024 tokens (3.5 epochs), ~7 min per run
# on 2 cores. lr and warm-up: MLE's best on validation (RESULTS.md: the lr x warm-up sweep), the paper's protocol of
# one setting fit for the baseline.
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
# Method defaults per preset, used where the method takes them and no flag overrides them. gpt2-medium: AGG Table 11
# (alpha 0.03, the 24-layer LM). paper-6l: Table 11 gives no alpha for the 6-layer column; agg.py's default 0.03
# applies. Both: AGPS's LM settings. cpu: alpha 0.03 marks almost nothing rare at 4,096 tokens per step, so the rare
# group is stated as a share of the vocabulary (see the README's regime map).
AGPS_LM = dict(rare_rank=25000, mu1=5e2, mu2=2e1)  # AGPS Tables 5 and 8 (i_r, mu1, mu2), language modelling
PRESET_METHOD = {"cpu": dict(rare_share=0.2), "paper-6l": dict(AGPS_LM), "gpt2-medium": dict(AGPS_LM, alpha=0.03)}
MODEL_FIELDS = ("n_layer", "d_model", "n_head", "d_ff", "dropout", "block_size")
# config keys that may change when a run is resumed, besides runlib.RUN_CONTROL
RUN_CONTROL = runlib.RUN_CONTROL | {"micro_batch", "cache_dir", "eval_tokens", "snapshot_steps"}
CKPT_FORMAT = "train_lm/1"  # the "format" of a training checkpoint (runlib.restore_training checks it)


# ----------------------------------------------------------------------------------------------------------- config
def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=OFFLINE_DATASET,
                   help=f"{OFFLINE_DATASET} (offline default) | wikitext-103 | wikitext-2 (hub) ; ignored with --data-dir")
    g.add_argument("--data-dir", default=None,
                   help="folder with train.txt, valid.txt, test.txt; or the raw WikiText layout (wiki.train.tokens, ...); or parquet files with a text column (train-*.parquet, validation-*.parquet, ...); or a datasets.save_to_disk folder")
    g.add_argument("--tokenizer", default="bpe", choices=["bpe", "word"],
                   help="bpe: byte-level BPE trained on train (GPT-2 style); word: whitespace words (WikiText's level)")
    g.add_argument("--vocab-size", type=int, default=None, help="BPE / word vocabulary size (preset default)")
    g.add_argument("--cache-dir", default=CACHE_DIR, help="tokenizer + token-id cache")
    g.add_argument("--split-seed", type=int, default=0,
                   help=f"{OFFLINE_DATASET}: which articles are valid and test (0: the default split; another "
                        f"value: another split of the same articles)")
    g.add_argument("--train-fraction", type=float, default=1.0,
                   help="train on the first FRACTION of the train split (whole articles of the offline corpus, lines "
                        "otherwise, in a fixed order: smaller fractions are nested in larger ones); the tokenizer is "
                        "still trained on the whole split, so every fraction shares the vocabulary and the valid and "
                        "test ids")
    g = p.add_argument_group("model (override any preset field)")
    g.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                   help="default cpu on any device (the README's numbers); the paper's set-ups by name. " +
                        "; ".join(f"{k}: " + ", ".join(f"{f}={v}" for f, v in p.items()) for k, p in PRESETS.items()))
    g.add_argument("--n-layer", type=int, default=None)
    g.add_argument("--d-model", type=int, default=None)
    g.add_argument("--n-head", type=int, default=None)
    g.add_argument("--d-ff", type=int, default=None)
    g.add_argument("--dropout", type=float, default=None)
    g.add_argument("--block-size", type=int, default=None, help="context length")
    g.add_argument("--output-bias", action="store_true",
                   help="a learned per-token bias on the tied softmax's logits (zero-initialised, no weight decay); "
                        "every method's gates act on the weight, the bias gets the plain gradient")
    runlib.add_method_flags(p)
    runlib.add_run_flags(p, "lm")
    g = p.add_argument_group("training")
    g.add_argument("--tokens-per-step", type=int, default=None, help="tokens per optimizer step, all ranks")
    g.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (gradient accumulation)")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--warmup", type=int, default=None, help="linear warm-up steps, then cosine decay to 0.1 lr")
    g.add_argument("--eval-interval", type=int, default=None, help="validate + checkpoint every N steps")
    g.add_argument("--eval-tokens", type=int, default=None, help="cap on validation tokens (default all)")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--snapshot-steps", type=lambda t: sorted({int(x) for x in t.split(",") if x}), default=[],
                   help="comma-separated steps at which to save the embedding matrix to OUT/snapshots/ "
                        "(eval.py draws them as SVD projections over time, AGG Fig. 1)")
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--init-from", default=None, metavar="RUN",
                   help="start from the model weights of this run folder (or checkpoint file): a fine-tune with a "
                        "fresh optimizer and schedule on the same data, tokenizer and model shape")
    g.add_argument("--seq-ul-prob", type=float, default=0.0,
                   help="probability of a sequence-level unlikelihood update instead of the method's update at each "
                        "step (Welleck et al. 2020 Sec. 5.2 fine-tune mle or ul models with 0.5; see seq_ul_step)")
    return p


def resolve_config(args, explicit=None):
    """Fill preset defaults into the parsed flags; returns a plain dict (the run's config)."""
    cfg = dict(vars(args))
    runlib.default_device(cfg)
    cfg["preset"] = cfg["preset"] or "cpu"  # a config saved without one
    for k, v in PRESETS[cfg["preset"]].items():
        if cfg.get(k) is None:
            cfg[k] = v
    if cfg["tokenizer"] == "word" and (explicit is None or "vocab_size" not in explicit):
        cfg["vocab_size"] = 0  # word level: keep every word of the train split (WikiText's closed vocabulary)
    if cfg["data_dir"]:
        cfg["dataset"] = "dir"
    if cfg["split_seed"] and cfg["dataset"] != OFFLINE_DATASET:
        raise SystemExit(f"--split-seed {cfg['split_seed']}: only the offline corpus {OFFLINE_DATASET} is split here; "
                         f"{describe_source(cfg)} comes with its own splits")
    if not 0 < cfg["train_fraction"] <= 1:
        raise SystemExit(f"--train-fraction {cfg['train_fraction']}: must be in (0, 1]")
    if cfg["out"] is None:
        cfg["out"] = runlib.default_out("lm", cfg["method"], cfg["seed"])
    for k in ("n_layer", "d_model", "n_head", "d_ff", "block_size", "tokens_per_step", "micro_batch", "max_steps",
              "eval_interval", "log_interval", "vocab_size"):
        if cfg[k] < (0 if k == "vocab_size" else 1):
            raise SystemExit(f"--{k.replace('_', '-')} {cfg[k]}: must be a positive integer")
    runlib.check_run_flags(cfg)
    if not 0 <= cfg["seq_ul_prob"] <= 1:
        raise SystemExit(f"--seq-ul-prob {cfg['seq_ul_prob']}: must be a probability in [0, 1]")
    if cfg["seq_ul_prob"] and cfg["method"] not in ("mle", "ul"):
        raise SystemExit(f"--seq-ul-prob with --method {cfg['method']}: sequence-level unlikelihood updates are plain "
                         f"gradients (no gates, freezing or regulariser), so they fine-tune mle or ul models only")
    if cfg["d_model"] % cfg["n_head"]:
        raise SystemExit(f"--d-model {cfg['d_model']} is not divisible by --n-head {cfg['n_head']}: change one of them")
    cfg["task"] = "lm"
    return cfg


def make_config(**fields):
    """The resolved config of a run with `fields` set as their flags would set them (names as in config.json): how
    bench.py, hf_agg.py and the tests get a config without a command line."""
    return runlib.make_config(build_parser(), resolve_config, fields)


# ------------------------------------------------------------------------------------------------------------- data
def clean_wiki_article(markup):
    """Wikipedia markup -> plain paragraphs (one per line), with gensim.corpora.wikicorpus.filter_wiki."""
    from gensim.corpora.wikicorpus import filter_wiki
    text = filter_wiki(markup)
    lines = []
    for line in text.split("\n"):
        line = line.replace("'''", "").replace("''", "").strip()
        m = re.match(r"^(=+)\s*(.*?)\s*\1$", line)
        if m:  # section heading, WikiText style " = = Heading = = "
            line = " ".join(["="] * len(m.group(1)) + [m.group(2)] + ["="] * len(m.group(1)))
        line = re.sub(r"\s+", " ", line).strip()
        if line and not re.fullmatch(r"[\W_]*", line):
            lines.append(line)
    return lines


def load_gensim_wiki(split_seed=0):
    """The 106-article Wikipedia sample from the gensim wheel, split by article: 6 valid, 5 test, the rest train.
    The split is deterministic: articles are ordered by the SHA-1 of their title (split_seed 0) or of
    "SEED:title" (another split of the same articles, for a second measurement of the same claim)."""
    from gensim.corpora.wikicorpus import extract_pages
    path = gensim_wiki_path()
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: install the gensim wheel (pip install gensim) or pass --data-dir DIR")
    articles = []
    with bz2.open(path) as f:
        for title, markup, _pid in extract_pages(f):
            if markup.lstrip().lower().startswith("#redirect"):
                continue
            lines = clean_wiki_article(markup)
            if lines:
                key = title if not split_seed else f"{split_seed}:{title}"
                articles.append((hashlib.sha1(key.encode()).hexdigest(), lines))
    articles.sort()
    split = {"valid": articles[:6], "test": articles[6:11], "train": articles[11:]}
    out = {k: [line for _h, lines in v for line in lines] for k, v in split.items()}
    out["train_documents"] = [len(lines) for _h, lines in split["train"]]  # lines per article: --train-fraction cuts here
    return out


def train_subset(corpus, fraction):
    """The first `fraction` of the train split by characters, cut at whole documents (articles of the offline corpus,
    else lines): the longest prefix of documents with at most that share of the characters, and at least one."""
    lines, docs, start = corpus["train"], [], 0
    for n in corpus.get("train_documents") or [1] * len(lines):
        docs.append(lines[start:start + n])
        start += n
    chars = np.cumsum([sum(map(len, doc)) for doc in docs])
    keep = max(1, int(np.searchsorted(chars, fraction * chars[-1], side="right")))
    return [line for doc in docs[:keep] for line in doc]


# --data-dir layouts, per split: (file name patterns, reader). The first layout whose three splits all exist is used.
SPLIT_NAMES = {"train": ("train",), "valid": ("valid", "validation"), "test": ("test",)}
DIR_LAYOUTS = (("text", ("{s}.txt",)),                                    # one paragraph a line
               ("wikitext", ("wiki.{s}.tokens", "wiki.{s}.raw")),         # the raw WikiText-103 / -2 zip layout
               ("parquet", ("{s}.parquet", "{s}-*.parquet", "*/{s}-*.parquet")))  # the hub's parquet files


def data_dir_files(data_dir):
    """--data-dir -> (layout, {split: [files]}): train/valid/test .txt, the raw WikiText layout (wiki.train.tokens),
    parquet files with a "text" column (train-*.parquet, validation-*.parquet, ...), or a `datasets.save_to_disk`
    folder (dataset_dict.json with train / validation / test)."""
    if not os.path.isdir(data_dir):
        raise SystemExit(f"--data-dir {data_dir}: not a folder")
    if os.path.exists(os.path.join(data_dir, "dataset_dict.json")):  # datasets.DatasetDict.save_to_disk
        with open(os.path.join(data_dir, "dataset_dict.json")) as f:
            have = json.load(f).get("splits", [])
        files = {}
        for split, names in SPLIT_NAMES.items():
            name = next((n for n in names if n in have), None)
            if name is None:
                raise SystemExit(f"--data-dir {data_dir}: the saved dataset has splits {have}, no {' or '.join(names)}")
            files[split] = sorted(glob.glob(os.path.join(data_dir, name, "*.arrow")))
        return "save_to_disk", files
    for layout, patterns in DIR_LAYOUTS:
        files = {split: sorted({f for n in names for p in patterns for f in glob.glob(os.path.join(data_dir, p.format(s=n)))})
                 for split, names in SPLIT_NAMES.items()}
        if all(files.values()):
            return layout, files
    raise SystemExit(f"--data-dir {data_dir}: no train/valid/test files found. Use train.txt, valid.txt, test.txt; "
                     f"the raw WikiText layout (wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens); parquet "
                     f"files with a 'text' column (train-*.parquet, validation-*.parquet, test-*.parquet); or a "
                     f"datasets.save_to_disk folder")


def read_split(layout, paths):
    """The non-empty lines (stripped) of one split's files."""
    if layout in ("text", "wikitext"):
        lines = []
        for path in paths:
            try:
                with open(path, encoding="utf-8") as f:
                    lines += [line.strip() for line in f]
            except UnicodeDecodeError as e:
                raise SystemExit(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. "
                                 f"iconv -f latin1 -t utf-8") from None
    else:
        import pyarrow.parquet as pq
        if layout == "parquet":
            tables = [pq.read_table(p, columns=["text"]) for p in paths]
        else:
            import pyarrow as pa
            tables = [pa.ipc.open_stream(p).read_all() for p in paths]
        if any("text" not in t.column_names for t in tables):
            raise SystemExit(f"{paths[0]}: no 'text' column (columns: {tables[0].column_names})")
        lines = [str(t).strip() for tab in tables for t in tab.column("text").to_pylist() if t is not None]
    return [line for line in lines if line]


def load_text_dir(data_dir):
    layout, files = data_dir_files(data_dir)
    out = {split: read_split(layout, paths) for split, paths in files.items()}
    for split, lines in out.items():
        if not lines:
            raise SystemExit(f"--data-dir {data_dir}: the {split} split ({', '.join(files[split])}) is empty; put "
                             f"at least a few lines of text in each split")
    return out


def load_hub(name):
    """WikiText through `datasets` (raw configs). Fails in seconds when the hub is unreachable and nothing is cached."""
    import datasets
    try:
        with runlib.hub_offline(not runlib.hub_reachable()):
            ds = datasets.load_dataset("Salesforce/wikitext", HUB_DATASETS[name])
    except Exception as e:
        raise SystemExit(
            f"--dataset {name}: cannot load it through `datasets` (Hugging Face hub unreachable and no local cache: "
            f"{type(e).__name__}: {str(e)[:200]}).\nFix: put train.txt, valid.txt and test.txt in a folder and pass "
            f"--data-dir DIR, or leave --dataset out to use the offline default '{OFFLINE_DATASET}' (the Wikipedia "
            f"sample shipped in the gensim wheel).") from None
    return {k: [t.strip() for t in ds[s]["text"] if t.strip()]
            for k, s in (("train", "train"), ("valid", "validation"), ("test", "test"))}


def gensim_wiki_path():
    import gensim
    return os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", GENSIM_WIKI)


def source_files(cfg):
    """The local files a corpus is read from (their hash keys the cache), or None for hub datasets."""
    if cfg.get("data_dir"):
        files = [f for paths in data_dir_files(cfg["data_dir"])[1].values() for f in paths]
    elif cfg["dataset"] == OFFLINE_DATASET:
        files = [gensim_wiki_path()]
    else:
        return None
    return files if all(os.path.exists(f) for f in files) else None


def describe_source(cfg):
    return f"--data-dir {cfg['data_dir']}" if cfg.get("data_dir") else f"--dataset {cfg['dataset']}"


def load_corpus(cfg):
    if cfg.get("data_dir"):
        return load_text_dir(cfg["data_dir"])
    if cfg["dataset"] == OFFLINE_DATASET:
        return load_gensim_wiki(cfg.get("split_seed") or 0)
    if cfg["dataset"] in HUB_DATASETS:
        return load_hub(cfg["dataset"])
    raise SystemExit(f"unknown --dataset {cfg['dataset']!r}: use {OFFLINE_DATASET}, "
                     f"{', '.join(HUB_DATASETS)} or --data-dir DIR")


def train_tokenizer(lines, kind, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if kind == "bpe":  # GPT-2 style byte-level BPE
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordLevel(unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size or 10 ** 8, special_tokens=[EOS, PAD, UNK],
                                            show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return tok


def encode_lines(tok, lines, eos_id, desc):
    """Each line (paragraph) followed by EOS, concatenated."""
    parts = []
    for i in tqdm(range(0, len(lines), 20000), desc=f"encode {desc}", disable=len(lines) < 50000, leave=False):
        for enc in tok.encode_batch(lines[i:i + 20000]):
            parts.append(np.asarray(enc.ids + [eos_id], dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def prepare_data(cfg, log=print):
    """Corpus -> tokenizer -> token-id memmaps + train counts, cached under cache_dir/<hash of corpus and tokenizer>.
    Returns dict(ids={split: np.memmap}, counts=LongTensor (V,), tokenizer, vocab_size, eos_id, pad_id, dir, reused)."""
    from tokenizers import Tokenizer
    corpus, h = None, hashlib.sha256()
    fraction = cfg.get("train_fraction", 1.0)
    h.update(json.dumps([DATA_VERSION, cfg["tokenizer"], cfg["vocab_size"]]
                        + ([cfg["split_seed"]] if cfg.get("split_seed") else [])
                        + ([fraction] if fraction < 1 else [])).encode())
    files = source_files(cfg)
    if files:  # local sources: hash the files, so a cache hit needs no parsing
        for path in files:
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    else:  # hub datasets: hash the text
        corpus = load_corpus(cfg)
        for split in ("train", "valid", "test"):
            h.update(f"\0{split}\0".encode())
            for line in corpus[split]:
                h.update(line.encode("utf-8"))
                h.update(b"\n")
    name = cfg["dataset"] if cfg["dataset"] != "dir" else "dir"
    cdir = os.path.join(cfg["cache_dir"], f"{name}-{cfg['tokenizer']}{cfg['vocab_size'] or ''}"
                                          f"{f'-f{fraction:g}' if fraction < 1 else ''}-{h.hexdigest()[:16]}")
    meta_path = os.path.join(cdir, "meta.json")
    reused = os.path.exists(meta_path)
    if not reused:
        corpus = corpus or load_corpus(cfg)
        log(f"building tokenizer + token ids in {cdir}")
        tok = train_tokenizer(corpus["train"], cfg["tokenizer"], cfg["vocab_size"])
        V, eos_id, pad_id = tok.get_vocab_size(), tok.token_to_id(EOS), tok.token_to_id(PAD)
        if fraction < 1:
            corpus = dict(corpus, train=train_subset(corpus, fraction))
        encoded = {split: encode_lines(tok, corpus[split], eos_id, split) for split in ("train", "valid", "test")}
        if len(encoded["train"]) < cfg.get("block_size", 1) + 1:
            raise SystemExit(f"the train split of {describe_source(cfg)} has {len(encoded['train'])} tokens, fewer "
                             f"than --block-size {cfg['block_size']} + 1: use a larger corpus or a smaller "
                             f"--block-size")
        dtype = np.uint16 if V <= 65535 else np.uint32
        meta = dict(vocab_size=V, eos_id=eos_id, pad_id=pad_id, dtype=np.dtype(dtype).name, tokens={},
                    dataset=name, tokenizer=cfg["tokenizer"], lines={k: len(corpus[k]) for k in ("train", "valid", "test")})
        # built in a folder of this process, then renamed into place: runs started together (grid.py --jobs) never
        # write the same files, and a cache appears whole or not at all
        tmp = f"{cdir}.tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        for split, ids in encoded.items():
            if split == "train":
                np.save(os.path.join(tmp, "counts.npy"), np.bincount(ids, minlength=V).astype(np.int64))
            ids.astype(dtype).tofile(os.path.join(tmp, f"{split}.bin"))
            meta["tokens"][split] = int(len(ids))
        tok.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(cdir) and not os.path.exists(meta_path):  # the remains of a build that was killed
            shutil.rmtree(cdir, ignore_errors=True)
        try:
            os.rename(tmp, cdir)
        except OSError:  # another process finished the same cache first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        log(f"reusing cached tokenizer + token ids in {cdir}")
    with open(meta_path) as f:
        meta = json.load(f)
    for s in ("train", "valid", "test"):  # a cache damaged after it was built (a copy cut short, a full disk)
        path, want = os.path.join(cdir, f"{s}.bin"), meta["tokens"][s] * np.dtype(meta["dtype"]).itemsize
        if not os.path.exists(path) or os.path.getsize(path) != want:
            raise SystemExit(f"the data cache {cdir} is damaged ({s}.bin has "
                             f"{os.path.getsize(path) if os.path.exists(path) else 0} bytes, not {want}): delete "
                             f"that folder and run again to rebuild it")
    ids = {s: np.memmap(os.path.join(cdir, f"{s}.bin"), dtype=meta["dtype"], mode="r", shape=(meta["tokens"][s],))
           for s in ("train", "valid", "test")}
    return dict(ids=ids, counts=torch.from_numpy(np.load(os.path.join(cdir, "counts.npy"))), meta=meta,
                tokenizer=Tokenizer.from_file(os.path.join(cdir, "tokenizer.json")), vocab_size=meta["vocab_size"],
                eos_id=meta["eos_id"], pad_id=meta["pad_id"], dir=cdir, reused=reused)


class Sequences:
    """The train stream cut into non-overlapping (block+1)-token windows, reshuffled every epoch by (seed, epoch).
    Global sequence number g -> (epoch g // n, window perm_epoch[g % n]): the data position is just a counter."""

    def __init__(self, ids, block_size, seed):
        self.ids, self.block, self.seed = ids, block_size, seed
        self.n = (len(ids) - 1) // block_size
        if self.n < 1:
            raise SystemExit(f"the train split has {len(ids)} tokens, fewer than --block-size {block_size} + 1: "
                             f"use a larger corpus or a smaller --block-size")
        self._perm = (None, None)

    def perm(self, epoch):
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g).numpy())
        return self._perm[1]

    def get(self, start, count):
        rows = []
        for g in range(start, start + count):
            w = int(self.perm(g // self.n)[g % self.n]) * self.block
            rows.append(np.asarray(self.ids[w:w + self.block + 1], dtype=np.int64))
        t = torch.from_numpy(np.stack(rows))
        return t[:, :-1], t[:, 1:]


# ------------------------------------------------------------------------------------------------------------ model
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
    """Pre-LN decoder. The output layer is the input embedding (tied): logits = features(x) @ tok_emb.weight.T, plus a
    learned per-token bias with output_bias (zero-initialised, no weight decay: a unigram prior that can encode
    frequency without moving the embeddings). forward(x) returns the features (the input of the tied head), so DDP
    wraps the call that agg's losses need."""

    def __init__(self, vocab_size, n_layer, d_model, n_head, d_ff, dropout, block_size, output_bias=False):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_ff, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.out_bias = nn.Parameter(torch.zeros(vocab_size)) if output_bias else None
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 L)
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def features(self, x):
        T = x.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.block_size}")
        h = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(T, device=x.device)))
        for blk in self.blocks:
            h = blk(h)
        return self.ln_f(h)

    def forward(self, x):
        return self.features(x)

    def head(self, h):
        """The tied output layer: logits of features h."""
        logits = h @ self.tok_emb.weight.t()
        return logits if self.out_bias is None else logits + self.out_bias

    def logits(self, x):
        return self.head(self.features(x))


def build_model(cfg, vocab_size):
    return GPT(vocab_size, **{k: cfg[k] for k in MODEL_FIELDS}, output_bias=bool(cfg.get("output_bias")))


def init_from(model, cfg):
    """Load the model weights of the run (folder or checkpoint file) named by --init-from, after checking that it was
    trained on the same data with the same tokenizer and model shape."""
    path = cfg["init_from"]
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    src = runlib.load_checkpoint(path, "lm")
    for key in ("dataset", "data_dir", "tokenizer", "vocab_size", *[k for k in MODEL_FIELDS if k != "dropout"]):
        if src["config"].get(key) != cfg.get(key):
            raise SystemExit(f"--init-from {path} was trained with {key}={src['config'].get(key)!r}, this run has "
                             f"{key}={cfg.get(key)!r}: pass the same --preset, data and model flags")
    model.load_state_dict(src["model"])
    return src["step"]


@torch.no_grad()
def generate(model, prefix, n_new, autocast=contextlib.nullcontext):
    """Greedy continuation of a (B, T) prefix, cropping the context to block_size."""
    x = prefix
    for _ in range(n_new):
        with autocast():
            logits = model.head(model.features(x[:, -model.block_size:])[:, -1])
        x = torch.cat([x, logits.float().argmax(-1, keepdim=True)], dim=1)
    return x[:, prefix.shape[1]:]


# --------------------------------------------------------------------------------------------------------- training

def check_memory(cfg, V, B):
    """Refuse a configuration whose activations cannot fit in this machine's memory (a clear message, no traceback
    from a giant allocation). Estimate for a micro-batch of B sequences: attention scores, layer activations, logits."""
    T, d = cfg["block_size"], cfg["d_model"]
    need = 4 * B * T * (cfg["n_layer"] * (cfg["n_head"] * T + 16 * d + 2 * cfg["d_ff"]) + V)
    if cfg["device"] != "cpu":
        return
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > 0.8 * have:
        raise SystemExit(f"--block-size {T} with micro-batches of {B} sequences needs about {need / 2**30:.0f} GiB of activations, "
                         f"more than this machine's {have / 2**30:.0f} GiB: lower --block-size or --micro-batch")


def seq_ul_now(cfg, step):
    """Whether step `step` is a sequence-level unlikelihood update: a coin of probability --seq-ul-prob seeded by
    (seed, step), so a resumed run makes the same choices."""
    p = cfg.get("seq_ul_prob", 0.0)
    return p > 0 and random.Random(f"{cfg['seed']}:{step}").random() < p


def seq_ul_step(model, raw, opt, x_all, autocast, prefix_len=50, cont_len=100, n=4, scaler=runlib.NO_SCALER):
    """One sequence-level unlikelihood update (Welleck et al. 2020 Sec. 5.2: prefixes of 50 tokens, greedy
    continuations of 100, candidates the tokens of repeated 4-grams). The prefixes are the first tokens of this
    process's sequences; prefix + continuation fit in one block (shorter when block_size < 150), so one forward pass
    gives the probabilities the continuation was decoded from. Returns (loss, share of tokens penalised)."""
    prefix_len = min(prefix_len, raw.block_size // 2)
    cont_len = min(cont_len, raw.block_size - prefix_len)
    prefix = x_all[:, :prefix_len]
    raw.eval()
    cont = generate(raw, prefix, cont_len, autocast)
    raw.train()
    full = torch.cat([prefix, cont], dim=1)
    with autocast():
        hidden = model(full[:, :-1])[:, prefix_len - 1:]  # the features that predicted each continuation token
        logits = raw.head(hidden)
    loss, share = agg.sequence_unlikelihood(logits, cont, n)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss.item(), share.item()


def train_step(model, raw, method, opt, x_all, y_all, micro_batch, autocast, ddp=False, world=1,
               scaler=runlib.NO_SCALER):
    """One optimizer step on this process's sequences (x_all, y_all): method.observe once, then gradient accumulation
    over micro-batches with each micro-batch's mean loss weighted by its share of the step's targets, clipping at
    1.0, the optimizer step (through `scaler`: float16's loss scaling, a no-op otherwise). Returns (mean loss, mean NLL over all ranks, the method's stats of the last micro-batch).
    The scheduler is the caller's. bench.py times this function."""
    method.observe(y_all)  # once per optimizer step, all targets of the step (agg all-reduces under DDP)
    loss_sum, nll_sum = 0.0, 0.0
    starts = list(range(0, len(x_all), micro_batch))
    for j, s in enumerate(starts):
        x, y = x_all[s:s + micro_batch], y_all[s:s + micro_batch]
        sync = model.no_sync() if ddp and j < len(starts) - 1 else contextlib.nullcontext()
        with sync:
            with autocast():
                hidden = model(x)  # = raw.features(x), the input of the tied head
                loss = method.loss(hidden, raw.tok_emb.weight, y, bias=raw.out_bias)
            scaler.scale(loss * (y.numel() / y_all.numel())).backward()
        loss_sum += loss.item() * y.numel()
        nll_sum += float(method.stats.get("nll", loss.item())) * y.numel()
    scaler.unscale_(opt)  # float16: clip the true gradient
    torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)  # GPT-2 / nanoGPT practice for decoder LMs
    scaler.step(opt)  # float16: skipped when the gradient has inf/NaN
    scaler.update()
    method.after_step(raw.tok_emb.weight)
    opt.zero_grad(set_to_none=True)
    stats = method.stats
    if ddp:
        t = torch.tensor([loss_sum, nll_sum], dtype=torch.float64, device=y_all.device)
        torch.distributed.all_reduce(t)
        loss_sum, nll_sum = t.tolist()
    n = y_all.numel() * world
    return loss_sum / n, nll_sum / n, stats


def windows(n, block, context=0):
    """(start, length, skip) input windows over n targets: each window scores its last `length - skip` targets after
    `skip` tokens of context (fairseq's --context-window; context 0: non-overlapping blocks, cold starts)."""
    if not 0 <= context < block:
        raise SystemExit(f"--context-window {context}: must be in [0, block_size {block})")
    stride, out = block - context, []
    for s in range(0, n, stride):
        a = max(0, s - context)
        out.append((a, min(s + stride, n) - a, s - a))
    return out


def score(model, ids, n, cfg, device, autocast, context=0):
    """Yields (logits, targets) of the scored positions of the first n targets of `ids`, in micro-batches of
    windows of one shape (every target scored once)."""
    by_shape = {}
    for a, L, skip in windows(n, cfg["block_size"], context):
        by_shape.setdefault((L, skip), []).append(a)
    for (L, skip), starts in sorted(by_shape.items(), reverse=True):
        for i in range(0, len(starts), max(1, cfg["micro_batch"])):
            group = starts[i:i + cfg["micro_batch"]]
            t = torch.from_numpy(np.stack([np.asarray(ids[a:a + L + 1], dtype=np.int64) for a in group])).to(device)
            with autocast():
                logits = model.logits(t[:, :-1])
            yield logits[:, skip:], t[:, 1 + skip:]


@torch.no_grad()
def validate(model, ids, cfg, device, autocast, groups, max_tokens=None, method_rare=None, seen=None, method=None):
    """Valid PPL (the same scoring as evaluate()), total and per frequency group (30/50/20% by train counts),
    the embedding geometry per group over the tokens `seen` in training (agg.geometry; AGG Fig. 2: I(W) per group,
    cosine between rare and frequent embeddings), and
    the predicted vs true probability mass of the static rare group (`group_rare_mass_*`) and of the method's own
    rare set (`method_rare_mass_*`; AGG can over-predict it). With `method`: the mean row norms of the parts (a), (b),
    (c) of the weight gradient (AGG Eq. 4, agg.gradient_parts) per group, as the method's gates apply them, on the
    first micro-batch of windows (`grad_a_rare`, ...; freeze-rare's frozen rows are not shown as frozen)."""
    model.eval()
    n = len(ids) - 1 if not max_tokens else min(len(ids) - 1, max_tokens)
    gid = agg.group_of(groups, model.tok_emb.weight.shape[0]).to(device)
    rare = gid == 2
    dyn = None if method_rare is None else method_rare.to(device)
    nll_g, count_g = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.long)
    rare_pred, dyn_pred, dyn_true = 0.0, 0.0, 0
    for logits, y in score(model, ids, n, cfg, device, autocast):
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1).double()
        g = gid[y]
        nll_g += torch.zeros(3, dtype=torch.float64, device=device).index_add_(0, g.flatten(), nll.flatten()).cpu()
        count_g += torch.bincount(g.flatten(), minlength=3).cpu()
        p = logp.exp()
        rare_pred += p[..., rare].sum().item()
        if dyn is not None:
            dyn_pred += p[..., dyn].sum().item()
            dyn_true += dyn[y].sum().item()
    model.train()
    count = int(count_g.sum())
    geo = agg.geometry(model.tok_emb.weight, dict(zip(agg.GROUPS, groups)), seen)
    out = dict(loss=float(nll_g.sum()) / max(1, count), ppl=ppl_of(nll_g.sum(), count), tokens=count,
               **{f"ppl_{name}": ppl_of(nll_g[k], count_g[k]) for k, name in enumerate(agg.GROUPS)},
               isotropy=geo["isotropy"], **{f"isotropy_{g}": geo["isotropy_groups"][g] for g in agg.GROUPS},
               mean_cosine=geo["mean_cosine"], mean_cosine_rare=geo["mean_cosine_groups"]["rare"],
               cosine_rare_freq=geo["cosine_rare_freq"], **{f"norm_{g}": geo["norm_groups"][g] for g in agg.GROUPS},
               geometry_rows=geo["rows"],
               group_rare_mass_pred=rare_pred / max(1, count), group_rare_mass_true=int(count_g[2]) / max(1, count))
    if dyn is not None:
        out.update(method_rare_count=int(dyn.sum()), method_rare_mass_pred=dyn_pred / max(1, count),
                   method_rare_mass_true=dyn_true / max(1, count))
    if method is not None:
        block = cfg["block_size"]
        n_seq = max(1, min(cfg["micro_batch"], (len(ids) - 1) // block))
        t = torch.from_numpy(np.asarray(ids[:n_seq * block + 1], dtype=np.int64)).to(device)
        x, y = t[:-1].view(n_seq, block), t[1:].view(n_seq, block)
        model.eval()
        with autocast():
            hidden = model.features(x)
        model.train()
        gates = method.gates(y.reshape(-1)) if method.steps else (None, None, None)
        parts = agg.gradient_parts(hidden, model.tok_emb.weight, y, gid == 2, gates).cpu()
        for k, name in enumerate(agg.GROUPS):
            out.update({f"grad_{part}_{name}": float(parts[groups[k].cpu(), j].mean()) for j, part in enumerate("abc")})
    return out


def ppl_of(nll_sum, count):
    """exp(mean NLL); nan stays nan (a diverged model), overflow is inf."""
    if count <= 0:
        return float("nan")
    mean = float(nll_sum) / int(count)
    return math.exp(mean) if mean < 700 else (mean if math.isnan(mean) else math.inf)


def train(cfg, explicit=frozenset(), argv=()):
    """Train (or resume) the run `cfg` describes; returns its folder. main() parses the command line into cfg."""
    cfg, ck = runlib.start_or_resume(cfg, set(explicit), "lm", RUN_CONTROL)
    ddp, rank, world = runlib.setup_ddp(cfg)
    device = torch.device(cfg["device"])
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    out = cfg["out"]
    ckpt_path, log_path = os.path.join(out, "ckpt.pt"), os.path.join(out, "log.jsonl")
    best_path = os.path.join(out, "ckpt_best.pt")  # the model at the lowest validation PPL (eval.py --checkpoint best)
    if ck is not None:
        log(f"resuming {ckpt_path} at step {ck['step']}")
    runlib.seed_everything(cfg["seed"], rank)

    # -- data (rank 0 builds the cache, the others wait without a time limit, then read it)
    if not master:
        runlib.wait_for_rank0(ddp)
    data = prepare_data(cfg, log=log)
    if master:
        runlib.wait_for_rank0(ddp)
    V = data["vocab_size"]
    seq = Sequences(data["ids"]["train"], cfg["block_size"], cfg["seed"])
    seqs_per_step = max(1, round(cfg["tokens_per_step"] / cfg["block_size"]))
    if seqs_per_step % world:
        raise SystemExit(f"--tokens-per-step {cfg['tokens_per_step']} gives {seqs_per_step} sequences of "
                         f"{cfg['block_size']} tokens, not divisible by {world} processes: change --tokens-per-step")
    local_seqs = seqs_per_step // world
    check_memory(cfg, V, min(cfg["micro_batch"], local_seqs))
    tokens_per_step = seqs_per_step * cfg["block_size"]
    steps_per_epoch = seq.n / seqs_per_step
    groups = agg.frequency_groups(data["counts"])
    cfg["data_fingerprint"] = os.path.basename(data["dir"])  # corpus + tokenizer hash: checked on resume and eval

    # -- model, method, optimizer
    model = build_model(cfg, V)
    if cfg.get("init_from") and ck is None:
        log(f"initialised from {cfg['init_from']} (step {init_from(model, cfg)})")
    model = model.to(device)
    special_ids = [data["pad_id"], data["eos_id"]]
    hp = runlib.method_hparams(cfg, steps_per_epoch, data["counts"], tokens_per_step, special_ids,
                               PRESET_METHOD.get(cfg["preset"]))
    method = agg.build_method(cfg["method"], vocab_size=V, counts=data["counts"], special_ids=special_ids, **hp)
    opt = runlib.make_optimizer(model, cfg["lr"], cfg["weight_decay"])
    schedule = runlib.lr_schedule("cosine", cfg["warmup"], cfg["max_steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    autocast, scaler = runlib.autocast(cfg), runlib.grad_scaler(cfg)
    step, best_ppl = 0, math.inf
    if ck is not None:  # continue the checkpoint exactly
        step = runlib.restore_training(ck, ckpt_path, model, opt, sched, schedule, method, scaler, rank, world,
                                       CKPT_FORMAT, log)
        best_ppl = ck.get("best_valid_ppl", math.inf)
        if ck.get("data_position", {}).get("sequences") != step * seqs_per_step:
            raise SystemExit(f"{ckpt_path}: data position {ck['data_position']} does not match step {step} x "
                             f"{seqs_per_step} sequences per step: resume with the original --tokens-per-step")
    raw = model
    if cfg["compile"]:
        model = torch.compile(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    n_params = sum(p.numel() for p in raw.parameters())
    if master:
        runlib.lock_run(out)  # one writer per run folder
        if ck is None:
            runlib.clear_run(out)  # a new run (or --overwrite, or a restart before any checkpoint): no old files
        if ck is not None and ck["config"].get("data_fingerprint") not in (None, os.path.basename(data["dir"])):
            raise SystemExit(f"{ckpt_path}: the corpus or tokenizer changed since this run started (its data was "
                             f"{ck['config']['data_fingerprint']}, now {os.path.basename(data['dir'])}): restore the "
                             f"original files, or start a new run with another --out")
        shutil.copyfile(os.path.join(data["dir"], "tokenizer.json"), os.path.join(out, "tokenizer.json"))
        prov = runlib.provenance(argv)
        segments = runlib.run_segments(out, argv, step if ck is not None else None)
        prov.update({k: segments[0][k] for k in ("git_commit", "argv", "agg_sha256") if k in segments[0]})
        rare_share = agg.rare_share_of_alpha(data["counts"], hp["alpha"], tokens_per_step, special_ids) \
            if "alpha" in hp else None
        runlib.write_json(os.path.join(out, "config.json"), dict(
            cfg, **prov, segments=segments, world_size=world, n_params=n_params, vocab_size_actual=V,
            data_cache=data["dir"], data_tokens=data["meta"]["tokens"], tokens_per_step_actual=tokens_per_step,
            steps_per_epoch=steps_per_epoch, method_hparams=hp, method_rare_share=rare_share,
            resumed_from_step=step if ck is not None else None))
        runlib.start_log(log_path, step if ck is not None else None)
        log(f"{n_params / 1e6:.2f}M params, V={V}, {tokens_per_step} tokens/step ({local_seqs} seqs/process x "
            f"{world}), {steps_per_epoch:.1f} steps/epoch, method {cfg['method']} {hp}" +
            (f" (alpha marks {rare_share:.1%} of the vocabulary rare at average rates)" if rare_share is not None
             else ""))

    tracker = runlib.Tracker(cfg["log_to"] if master else "none", out, cfg)

    def write_log(rec):
        if master:
            runlib.append_log(log_path, rec, tracker)

    def checkpoint():
        rngs = runlib.all_rng_states(ddp, world)
        if not all(bool(torch.isfinite(p).all()) for p in raw.parameters()):
            raise SystemExit(f"step {step}: the model has non-finite weights (diverged); {ckpt_path} keeps the last "
                             f"good checkpoint. Lower --lr or check the method's hyper-parameters")
        if master:
            runlib.save_checkpoint(ckpt_path, dict(
                format=CKPT_FORMAT, model=raw.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                method=method.state_dict(), scaler=scaler.state_dict(), step=step, rng=rngs, config=cfg, task="lm",
                best_valid_ppl=best_ppl,
                data_position=dict(sequences=step * seqs_per_step, epoch=step * seqs_per_step // seq.n)))

    def run_validation():
        nonlocal best_ppl
        if master:
            v = validate(raw, data["ids"]["valid"], cfg, device, autocast, groups, cfg.get("eval_tokens"),
                         method.rare_mask() if method.steps else None, seen=data["counts"] > 0, method=method)
            if hasattr(method, "frozen"):  # freeze-rare: whether the rare rows are still frozen (AGG Fig. 2)
                v["rare_frozen"] = method.frozen()
            write_log(dict(step=step, split="valid", **v))
            if v["ppl"] < best_ppl:
                best_ppl = v["ppl"]
                runlib.save_checkpoint(best_path, dict(model=raw.state_dict(), step=step, config=cfg, task="lm",
                                                       valid_ppl=best_ppl))
            tqdm.write(f"step {step}: valid ppl {v['ppl']:.2f} (rare group {v['ppl_rare']:.0f})  I(W) "
                       f"{v['isotropy']:.3f}  rare group mass pred/true "
                       f"{v['group_rare_mass_pred']:.4f}/{v['group_rare_mass_true']:.4f}")
        if ddp:
            torch.distributed.barrier()

    stop = min(cfg["max_steps"], cfg["stop_at"] or cfg["max_steps"])
    bar = tqdm(total=cfg["max_steps"], initial=step, disable=not master, dynamic_ncols=True, mininterval=1.0)
    t0, tokens_seen = time.time(), 0
    model.train()
    with runlib.StopSignal() as stop_signal:  # SIGTERM / SIGINT: checkpoint at the next step boundary
        while step < stop:
            x_all, y_all = seq.get(step * seqs_per_step + rank * local_seqs, local_seqs)
            x_all, y_all = x_all.to(device), y_all.to(device)
            if seq_ul_now(cfg, step):  # a sequence-level unlikelihood update (fine-tuning with --seq-ul-prob)
                seq_loss, seq_share = seq_ul_step(model, raw, opt, x_all, autocast, scaler=scaler)
                sched.step()
                step += 1
                bar.update(1)
                write_log(dict(step=step, split="train", seq_ul_loss=seq_loss, seq_ul_share=seq_share,
                               lr=sched.get_last_lr()[0], epoch=step / steps_per_epoch))
            else:
                loss_mean, nll_mean, stats = train_step(model, raw, method, opt, x_all, y_all, cfg["micro_batch"],
                                                        autocast, ddp, world, scaler)
                sched.step()
                step += 1
                tokens_seen += tokens_per_step
                if not math.isfinite(loss_mean):
                    raise SystemExit(f"step {step}: loss is {loss_mean}; lower --lr or check the method's "
                                     f"hyper-parameters ({ckpt_path} keeps the last good checkpoint)")
                tps = tokens_seen / max(1e-9, time.time() - t0)
                post = dict(loss=f"{loss_mean:.3f}", ppl=f"{math.exp(min(nll_mean, 50)):.1f}", tok_s=f"{tps:.0f}")
                if "rare_fraction" in stats:
                    post["rare"] = f"{stats['rare_fraction']:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
                if step % cfg["log_interval"] == 0 or step == 1 or step == stop:
                    rec = dict(step=step, split="train", loss=loss_mean, nll=nll_mean, ppl=math.exp(min(nll_mean, 50)),
                               lr=sched.get_last_lr()[0], tokens_per_s=tps, epoch=step / steps_per_epoch,
                               **{("method_" + k if k.startswith("rare") else k): v for k, v in stats.items()
                                  if k != "nll"})
                    if "rare_count" in stats:  # method stats are those of the last micro-batch
                        rec["R_over_B"] = stats["rare_count"] / tokens_per_step
                    write_log(rec)
            if master and step in cfg.get("snapshot_steps", ()):
                os.makedirs(os.path.join(out, "snapshots"), exist_ok=True)
                runlib.save_checkpoint(os.path.join(out, "snapshots", f"emb_{step}.pt"),
                                       dict(step=step, weight=raw.tok_emb.weight.detach().float().cpu().clone()))
            evaluated = step % cfg["eval_interval"] == 0 or step == stop
            if evaluated:
                run_validation()
                checkpoint()
            if step < stop and stop_signal.received(ddp, device):
                if not evaluated:
                    checkpoint()
                log(f"\n{stop_signal.name} at step {step}: checkpoint {ckpt_path} written; continue with "
                    f"`python train_lm.py --out {out} --resume`")
                break
    bar.close()
    tracker.close()
    if ddp:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if master:
        runlib.unlock_run(out)
    log(f"done: step {step}, checkpoint {ckpt_path}")
    return out


# ------------------------------------------------------------------------------------------------------- evaluation
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


def rare_bias_metrics(st, b, gid):
    """PPL total and per group, rare-group mass (predicted / true), Uniq and the precision and recall of rare argmax
    predictions of the positions `st` with b added to the rare group's logits (b = 0: the model as it is)."""
    lse_rare = st["lse_rare"].double() + b
    nll = torch.logaddexp(st["lse_other"].double(), lse_rare) - (st["z_y"].double() + b * st["y_rare"].double())
    pred = torch.where(st["max_rare"] + b > st["max_other"], st["arg_rare"], st["arg_other"])
    g = gid[st["target"]]
    pred_rare, hit = gid[pred] == 2, pred == st["target"]
    up = pred.unique()
    return dict(bias=b, ppl=ppl_of(nll.sum(), len(nll)),
                ppl_groups={name: ppl_of(nll[g == k].sum(), int((g == k).sum())) for k, name in enumerate(agg.GROUPS)},
                rare_mass_pred=float(torch.sigmoid(lse_rare - st["lse_other"].double()).mean()),
                rare_mass_true=float(st["y_rare"].double().mean()),
                uniq=int(len(up)), uniq_groups={name: int((gid[up] == k).sum()) for k, name in enumerate(agg.GROUPS)},
                rare_argmax_precision=float(hit[pred_rare].double().mean()) if pred_rare.any() else float("nan"),
                rare_argmax_recall=float(hit[g == 2].double().mean()) if (g == 2).any() else float("nan"),
                rare_argmax_count=int(pred_rare.sum()))


@torch.no_grad()
def evaluate(run_dir, device="cpu", split="test", checkpoint="last", max_tokens=None, context_window=0, n_samples=5,
             prefix_len=50, gen_len=100, cache_dir=None):
    """Test-set evaluation of a run folder for eval.py: PPL total and per frequency group, Uniq (distinct argmax
    next-token predictions; AGG Table 3) total and per group with the human reference, greedy continuations of test
    prefixes (AGG Table 14). checkpoint: last (ckpt.pt) or best (ckpt_best.pt). Returns {"metrics": {...},
    "weight": (V, d) CPU float tensor, "counts": train counts (V,), "tokens": list of str, "tokenizer", "kind"};
    eval.py adds the geometry and word similarity."""
    path = os.path.join(run_dir, "ckpt.pt" if checkpoint == "last" else "ckpt_best.pt")
    ck = runlib.load_checkpoint(path, "lm")
    cfg = dict(ck["config"], device=str(device))
    if cache_dir:
        cfg["cache_dir"] = cache_dir
    data = prepare_data(cfg, log=lambda *a: None)
    if cfg.get("data_fingerprint") not in (None, os.path.basename(data["dir"])):
        raise SystemExit(f"{path}: the corpus or tokenizer changed since this run trained (its data was "
                         f"{cfg['data_fingerprint']}, now {os.path.basename(data['dir'])}): restore the original "
                         f"files to evaluate it")
    V = data["vocab_size"]
    model = build_model(cfg, V)
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise SystemExit(f"{path} does not fit the model of its own config ({str(e)[:200]}); the checkpoint or its "
                         f"data cache is inconsistent: retrain or check --cache-dir") from None
    model.to(device).eval()
    autocast = runlib.autocast(cfg)
    gid = agg.group_of(agg.frequency_groups(data["counts"]), V)
    gid_d = gid.to(device)
    ids = data["ids"][split]
    n = len(ids) - 1 if not max_tokens else min(len(ids) - 1, max_tokens)
    nll_sum, cnt = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.long)
    type_nll = torch.zeros(V, dtype=torch.float64)  # NLL summed per target type: the per-type share of a PPL gap
    preds, targets, stats = [], [], []
    for logits, y in tqdm(score(model, ids, n, cfg, device, autocast, context_window),
                          desc=f"{os.path.basename(os.path.normpath(run_dir))} {split}", leave=False):
        nll = -torch.log_softmax(logits.float(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1).double()
        g = gid_d[y]
        nll_sum += torch.zeros(3, dtype=torch.float64, device=device).index_add_(0, g.flatten(), nll.flatten()).cpu()
        cnt += torch.bincount(g.flatten(), minlength=3).cpu()
        type_nll.index_add_(0, y.flatten().cpu(), nll.flatten().cpu())
        preds.append(logits.argmax(-1).flatten().cpu())
        targets.append(y.flatten().cpu())
        stats.append({k: v.cpu() for k, v in rare_logit_stats(logits, y, gid_d == 2).items()})
    preds, targets = torch.cat(preds), torch.cat(targets)
    # The free re-weighting baseline: one bias on the rare group's logits, fitted on the valid split (minimum NLL,
    # which also calibrates the group's predicted mass), applied to this split.
    fit = [{k: v.cpu() for k, v in rare_logit_stats(lg, y, gid_d == 2).items()}
           for lg, y in score(model, data["ids"]["valid"], len(data["ids"]["valid"]) - 1, cfg, device, autocast,
                              context_window)]
    cat = lambda parts: {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    stats, bias = cat(stats), fit_rare_bias(cat(fit))
    up, ut = preds.unique(), targets.unique()
    m = dict(task="lm", method=cfg["method"], step=ck["step"], out_dir=run_dir, split=split,
             context_window=context_window, tokens=int(cnt.sum()), ppl=ppl_of(nll_sum.sum(), cnt.sum()),
             ppl_groups={g: ppl_of(nll_sum[k], cnt[k]) for k, g in enumerate(agg.GROUPS)},
             uniq=int(len(up)), uniq_groups={g: int((gid[up] == k).sum()) for k, g in enumerate(agg.GROUPS)},
             uniq_human=int(len(ut)), uniq_human_groups={g: int((gid[ut] == k).sum()) for k, g in enumerate(agg.GROUPS)},
             rare_argmax=rare_bias_metrics(stats, 0.0, gid), rare_bias=rare_bias_metrics(stats, bias, gid))
    gens, tok = [], data["tokenizer"]
    span = prefix_len + gen_len
    if len(ids) > span and n_samples:
        for j in range(n_samples):
            s = j * (len(ids) - span) // max(1, n_samples)
            prefix = torch.from_numpy(np.asarray(ids[s:s + prefix_len], dtype=np.int64))[None].to(device)
            cont = generate(model, prefix, gen_len, autocast)[0].tolist()
            human = np.asarray(ids[s + prefix_len:s + span]).tolist()
            gens.append(dict(position=s, prefix=tok.decode(prefix[0].tolist()), continuation=tok.decode(cont),
                             human=tok.decode(human), uniq=len(set(cont)), uniq_human=len(set(human)),
                             rep4=repeated_4grams(cont), rep4_human=repeated_4grams(human)))
    m["generations"] = gens
    m["gen_uniq"] = float(np.mean([g["uniq"] for g in gens])) if gens else float("nan")
    m["gen_uniq_human"] = float(np.mean([g["uniq_human"] for g in gens])) if gens else float("nan")
    m["gen_rep4"] = float(np.mean([g["rep4"] for g in gens])) if gens else float("nan")
    m["gen_rep4_human"] = float(np.mean([g["rep4_human"] for g in gens])) if gens else float("nan")
    tokens = [tok.decode([i]) if cfg["tokenizer"] == "bpe" else (tok.id_to_token(i) or "") for i in range(V)]
    return {"metrics": m, "weight": model.tok_emb.weight.detach().float().cpu(), "counts": data["counts"],
            "tokens": tokens, "tokenizer": tok, "kind": cfg["tokenizer"], "type_nll": type_nll,
            "type_count": torch.bincount(targets, minlength=V)}


def repeated_4grams(tokens):
    """seq-rep-4 of Welleck et al. 2020: the share of a continuation's 4-grams that are repeats, 1 - unique / all."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    explicit = runlib.explicit_flags(build_parser(), argv)
    if args.prepare_only:  # build the data cache and stop, touching no run folder
        data = prepare_data(resolve_config(args, explicit))
        print(f"data ready in {data['dir']}: " + ", ".join(f"{k} {v:,} tokens" for k, v in data["meta"]["tokens"].items())
              + f", V={data['vocab_size']}")
        return None
    return train(resolve_config(args, explicit), explicit, argv)


if __name__ == "__main__":
    main()
