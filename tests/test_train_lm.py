"""train_lm.py: every method trains, resume == uninterrupted, 2-process gloo == 1 process, clear errors, caches.
A tiny model on a tiny Zipfian corpus: each test takes seconds."""
import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import agg  # noqa: E402
import train_lm  # noqa: E402

torch.set_num_threads(1)  # tiny models: extra threads only spin on a shared 2-core machine

TINY = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--d-ff", "32", "--block-size", "16",
        "--vocab-size", "300", "--tokens-per-step", "128", "--micro-batch", "4", "--lr", "3e-3", "--warmup", "2",
        "--device", "cpu", "--preset", "cpu", "--log-interval", "1"]


def write_corpus(folder, n_lines=(600, 60, 60), seed=0):
    """Zipfian pseudo-words in sentences: enough structure for BPE and a few training steps."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(words))]
    os.makedirs(folder, exist_ok=True)
    for split, n in zip(("train", "valid", "test"), n_lines):
        with open(os.path.join(folder, f"{split}.txt"), "w") as f:
            for _ in range(n):
                f.write(" ".join(rng.choices(words, weights, k=rng.randint(5, 20))).capitalize() + " .\n")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("lm")
    return dict(data=write_corpus(str(base / "data")), cache=str(base / "cache"))


def run(corpus, out, *extra, steps=2):
    argv = ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], "--out", str(out), "--max-steps",
            str(steps), "--eval-interval", "2", *TINY, *extra]
    return train_lm.main([str(a) for a in argv])


def read_log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("method", sorted(agg.METHODS))
def test_every_method_trains_with_finite_loss(corpus, tmp_path, method):
    run(corpus, tmp_path / method, "--method", method)
    log = read_log(tmp_path / method)
    train = [r for r in log if r["split"] == "train"]
    valid = [r for r in log if r["split"] == "valid"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert valid and valid[-1]["step"] == 2 and 0 < valid[-1]["isotropy"] <= 1
    assert 0 < valid[-1]["ppl"] < 1e5
    if method.startswith("agg") or method in ("ul+agg", "agps", "freeze-rare", "freeze-b", "freeze-c", "freeze-bc"):
        assert 0 < train[-1]["rare_fraction"] < 1 and train[-1]["rare_count"] >= 1  # R logged
        assert "R_over_B" in train[-1] and "method_rare_mass_pred" in valid[-1]
    ck = torch.load(os.path.join(tmp_path / method, "ckpt.pt"), weights_only=False)
    assert ck["config"]["task"] == "lm" and ck["config"]["method"] == method and ck["step"] == 2
    cfg = json.load(open(os.path.join(tmp_path / method, "config.json")))
    assert cfg["task"] == "lm" and "torch" in cfg["versions"] and "git_commit" in cfg


def test_window_defaults_to_steps_per_epoch_and_flags_pass_through(corpus, tmp_path):
    run(corpus, tmp_path / "a", "--method", "agg", "--alpha", "0.5")
    cfg = json.load(open(tmp_path / "a" / "config.json"))
    assert cfg["method_hparams"] == {"alpha": 0.5, "window": round(cfg["steps_per_epoch"])}
    run(corpus, tmp_path / "b", "--method", "agg", "--window", "7")
    assert json.load(open(tmp_path / "b" / "config.json"))["method_hparams"]["window"] == 7
    with pytest.raises(SystemExit, match="--gamma does not apply to --method agg"):
        run(corpus, tmp_path / "c", "--method", "agg", "--gamma", "1.0")
    with pytest.raises(SystemExit, match="unknown --method"):
        run(corpus, tmp_path / "d", "--method", "nope")


@pytest.mark.parametrize("method", ["agg", "frage"])
def test_resume_equals_uninterrupted(corpus, tmp_path, method):
    """Stop after 3 of 6 steps (dropout on, so RNG states matter), resume, compare with one uninterrupted run."""
    extra = ["--method", method, "--dropout", "0.2", "--eval-interval", "3"]
    run(corpus, tmp_path / "full", *extra, steps=6)
    run(corpus, tmp_path / "split", *extra, "--stop-at", "3", steps=6)
    assert torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)["step"] == 3
    run(corpus, tmp_path / "split", *extra, "--resume", steps=6)
    a = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    if method == "agg":
        assert torch.equal(a["method"]["appearances"], b["method"]["appearances"])
    else:
        assert torch.equal(a["method"]["disc"]["model"]["weight"], b["method"]["disc"]["model"]["weight"])
    la, lb = read_log(tmp_path / "full"), read_log(tmp_path / "split")
    assert [(r["step"], r["split"]) for r in la] == [(r["step"], r["split"]) for r in lb]
    assert la[-1]["ppl"] == pytest.approx(lb[-1]["ppl"], rel=1e-9)


def test_resume_without_flags_uses_saved_config(corpus, tmp_path):
    run(corpus, tmp_path / "r", "--method", "agg", "--alpha", "0.4", "--stop-at", "2", steps=4)
    train_lm.main(["--out", str(tmp_path / "r"), "--resume", "--cache-dir", corpus["cache"], "--device", "cpu"])
    ck = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=False)
    assert ck["step"] == 4 and ck["config"]["method"] == "agg" and ck["config"]["alpha"] == 0.4


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    train_lm.main(argv)


def test_two_process_gloo_matches_one_process(corpus, tmp_path):
    """DDP splits each step's sequences over 2 ranks; with dropout off the result must equal a 1-process run."""
    extra = ["--method", "agg", "--alpha", "0.5", "--dropout", "0"]
    run(corpus, tmp_path / "one", *extra, steps=3)
    argv = ["--data-dir", corpus["data"], "--cache-dir", corpus["cache"], "--out", str(tmp_path / "two"),
            "--max-steps", "3", "--eval-interval", "3", *TINY, *extra]
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), argv), nprocs=2, join=True)
    a = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=False)
    assert len(b["rng"]) == 2 and b["step"] == 3
    assert torch.equal(a["method"]["appearances"], b["method"]["appearances"])  # observe() all-reduced
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], atol=1e-5, rtol=1e-4), k
    assert json.load(open(tmp_path / "two" / "config.json"))["world_size"] == 2


def test_hub_dataset_fails_fast_with_offline_hint(tmp_path):
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"),
               HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"))
    t = time.time()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_lm.py"), "--dataset", "wikitext-2", "--out",
                        str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"), "--device", "cpu"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert time.time() - t < 30
    assert "--data-dir" in p.stderr and train_lm.OFFLINE_DATASET in p.stderr and "wikitext-2" in p.stderr
    assert "Traceback" not in p.stderr


def test_corrupted_checkpoint_gives_clear_error(corpus, tmp_path):
    run(corpus, tmp_path / "c", steps=2)
    path = tmp_path / "c" / "ckpt.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated, as by an interrupted copy
    with pytest.raises(SystemExit) as e:
        run(corpus, tmp_path / "c", "--resume", steps=4)
    assert str(path) in str(e.value) and "corrupted" in str(e.value) and "--overwrite" in str(e.value)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="corrupted"):
        train_lm.load_checkpoint(str(path))


def test_mismatched_checkpoint_gives_clear_error(corpus, tmp_path):
    run(corpus, tmp_path / "m", "--method", "agg", steps=2)
    with pytest.raises(SystemExit) as e:
        run(corpus, tmp_path / "m", "--method", "agg", "--d-model", "32", "--resume", steps=4)
    msg = str(e.value)
    assert "d_model=16" in msg and "d_model=32" in msg and "config.json" in msg and "ckpt.pt" in msg
    with pytest.raises(SystemExit, match="method='agg'.*method='mle'"):
        run(corpus, tmp_path / "m", "--method", "mle", "--resume", steps=4)
    with pytest.raises(SystemExit, match="already exists: pass --resume"):
        run(corpus, tmp_path / "m", "--method", "agg", steps=4)
    ck = torch.load(tmp_path / "m" / "ckpt.pt", weights_only=False)
    ck["config"]["task"] = "nmt"
    torch.save(ck, tmp_path / "m" / "ckpt.pt")
    with pytest.raises(SystemExit, match="task 'nmt', not 'lm'"):
        run(corpus, tmp_path / "m", "--method", "agg", "--resume", steps=4)


def test_tokenizer_cache_is_reused_and_keyed(corpus, tmp_path):
    folder = write_corpus(str(tmp_path / "data"), seed=1)
    cfg = dict(data_dir=folder, dataset="dir", tokenizer="bpe", vocab_size=300, cache_dir=str(tmp_path / "cache"))
    a = train_lm.prepare_data(cfg, log=lambda *a: None)
    mtime = os.path.getmtime(os.path.join(a["dir"], "tokenizer.json"))
    b = train_lm.prepare_data(cfg, log=lambda *a: None)
    assert not a["reused"] and b["reused"] and a["dir"] == b["dir"]
    assert os.path.getmtime(os.path.join(b["dir"], "tokenizer.json")) == mtime
    assert (a["ids"]["train"] == b["ids"]["train"]).all() and int(a["counts"].sum()) == len(a["ids"]["train"])
    assert a["vocab_size"] == 300 and a["tokenizer"].decode(list(a["ids"]["valid"][:5])).strip()
    c = train_lm.prepare_data(dict(cfg, vocab_size=280), log=lambda *a: None)
    assert not c["reused"] and c["dir"] != a["dir"] and c["vocab_size"] == 280
    with open(os.path.join(folder, "train.txt"), "a") as f:
        f.write("a changed corpus gets a new cache .\n")
    d = train_lm.prepare_data(cfg, log=lambda *a: None)
    assert not d["reused"] and d["dir"] != a["dir"]
    w = train_lm.prepare_data(dict(cfg, tokenizer="word", vocab_size=0), log=lambda *a: None)
    words = {t for line in open(os.path.join(folder, "train.txt")) for t in line.split()}
    assert w["vocab_size"] == len(words) + 3  # every train word + <|endoftext|>, <pad>, <unk>


def test_offline_default_corpus_split_by_article():
    splits = train_lm.load_gensim_wiki()
    sizes = {k: sum(len(line) for line in v) for k, v in splits.items()}
    assert 2.5e6 < sum(sizes.values()) < 3.5e6 and sizes["train"] > 10 * sizes["valid"] > 0 and sizes["test"] > 0
    long = {k: {line for line in v if len(line) > 80} for k, v in splits.items()}  # paragraphs, not headings
    assert not long["test"] & long["valid"] and not long["test"] & long["train"] and not long["valid"] & long["train"]
    assert not any("[[" in line or "'''" in line for line in splits["train"][:2000])


def test_model_features_feed_the_tied_head_and_are_causal():
    torch.manual_seed(0)
    m = train_lm.GPT(50, n_layer=2, d_model=16, n_head=2, d_ff=32, dropout=0.0, block_size=8).eval()
    x = torch.randint(0, 50, (2, 8))
    h = m.features(x)
    assert torch.allclose(m.logits(x), h @ m.tok_emb.weight.T) and torch.equal(m(x), h)
    x2 = x.clone()
    x2[:, 5:] = (x2[:, 5:] + 1) % 50
    assert torch.allclose(m.features(x2)[:, :5], h[:, :5], atol=1e-6)
    assert not torch.allclose(m.features(x2)[:, 5:], h[:, 5:])
    g = train_lm.generate(m, x[:, :3], 4)
    assert g.shape == (2, 4) and torch.equal(g[:, 0], m.logits(x[:, :3])[:, -1].argmax(-1))
