"""train_lm.py: every method trains, resume == uninterrupted, clear errors, caches.
A tiny model on a tiny Zipfian corpus (tests/conftest.py): each test takes seconds."""

import contextlib
import json
import math
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import agg
import data as data_py
import eval as eval_mod
import runlib
import train_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("method", sorted(agg.METHODS))
def test_every_method_trains_with_finite_loss(lm_run, read_log, tmp_path, method):
    lm_run(tmp_path / method, "--method", method)
    log = read_log(tmp_path / method)
    train = [r for r in log if r["split"] == "train"]
    valid = [r for r in log if r["split"] == "valid"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert valid and valid[-1]["step"] == 2 and 0 < valid[-1]["isotropy"] <= 1
    assert 0 < valid[-1]["ppl"] < 1e5
    if method.startswith("agg") or method in (
        "ul+agg",
        "agps",
        "freeze-rare",
        "freeze-b",
        "freeze-c",
        "freeze-bc",
    ):
        assert (
            0 < train[-1]["method_rare_fraction"] < 1 and train[-1]["method_rare_count"] >= 1
        )  # R logged
        assert "R_over_B" in train[-1] and "method_rare_mass_pred" in valid[-1]
    ck = torch.load(os.path.join(tmp_path / method, "ckpt.pt"), weights_only=True)
    assert ck["config"]["task"] == "lm" and ck["config"]["method"] == method and ck["step"] == 2
    cfg = json.load(open(os.path.join(tmp_path / method, "config.json")))
    assert (
        cfg["task"] == "lm"
        and "torch" in cfg["versions"]
        and cfg["versions"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    )
    for key in ("git_commit", "git_dirty", "argv", "agg_sha256"):
        assert key in cfg, key


def test_window_defaults_to_steps_per_epoch_and_flags_pass_through(lm_run, tmp_path):
    lm_run(tmp_path / "a", "--method", "agg", "--alpha", "0.5")
    cfg = json.load(open(tmp_path / "a" / "config.json"))
    assert cfg["method_hparams"] == {"alpha": 0.5, "window": round(cfg["steps_per_epoch"])}
    lm_run(tmp_path / "b", "--method", "agg", "--window", "7")
    assert json.load(open(tmp_path / "b" / "config.json"))["method_hparams"]["window"] == 7
    with pytest.raises(SystemExit, match="--gamma does not apply to --method agg"):
        lm_run(tmp_path / "c", "--method", "agg", "--gamma", "1.0")
    with pytest.raises(SystemExit):  # argparse lists the valid methods
        lm_run(tmp_path / "d", "--method", "nope")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["agg", "frage", "freeze-rare"])
def test_resume_equals_uninterrupted(lm_run, read_log, tmp_path, method):
    """Stop after 3 of 6 steps (dropout on, so RNG states matter), resume, compare with one
    uninterrupted run."""
    extra = ["--method", method, "--dropout", "0.2", "--eval-interval", "3"]
    lm_run(tmp_path / "full", *extra, steps=6)
    lm_run(tmp_path / "split", *extra, "--stop-at", "3", steps=6)
    assert torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)["step"] == 3
    lm_run(tmp_path / "split", *extra, "--resume", steps=6)
    a = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    if method == "agg":
        assert torch.equal(a["method"]["appearances"], b["method"]["appearances"])
    if method == "frage":
        assert torch.equal(
            a["method"]["disc"]["model"]["weight"], b["method"]["disc"]["model"]["weight"]
        )
    la, lb = read_log(tmp_path / "full"), read_log(tmp_path / "split")
    assert [(r["step"], r["split"]) for r in la] == [(r["step"], r["split"]) for r in lb]
    assert la[-1]["ppl"] == pytest.approx(lb[-1]["ppl"], rel=1e-9)


def test_resume_without_flags_uses_saved_config(lm_run, corpus, tmp_path):
    lm_run(tmp_path / "r", "--method", "agg", "--alpha", "0.4", "--stop-at", "2", steps=4)
    train_lm.main(
        [
            "--out",
            str(tmp_path / "r"),
            "--resume",
            "--cache-dir",
            corpus["cache"],
            "--device",
            "cpu",
        ]
    )
    ck = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)
    assert ck["step"] == 4 and ck["config"]["method"] == "agg" and ck["config"]["alpha"] == 0.4


def test_hub_dataset_fails_fast_with_offline_hint(tmp_path):
    """HF_HUB_OFFLINE=1 and nothing in the datasets cache: one line at once (an unreachable hub
    would be retried)."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HOME=str(tmp_path / "hf"),
        HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"),
    )
    t = time.time()
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train_lm.py"),
            "--dataset",
            "wikitext-2",
            "--out",
            str(tmp_path / "o"),
            "--cache-dir",
            str(tmp_path / "c"),
            "--device",
            "cpu",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0
    assert time.time() - t < 30
    assert (
        "--data-dir" in p.stderr
        and data_py.OFFLINE_DATASET in p.stderr
        and "wikitext-2" in p.stderr
    )
    assert "Traceback" not in p.stderr


def test_corrupted_checkpoint_gives_clear_error(lm_run, tmp_path):
    lm_run(tmp_path / "c", steps=2)
    path = tmp_path / "c" / "ckpt.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated, as by an interrupted copy
    with pytest.raises(SystemExit) as e:
        lm_run(tmp_path / "c", "--resume", steps=4)
    assert (
        str(path) in str(e.value) and "corrupted" in str(e.value) and "--overwrite" in str(e.value)
    )
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="corrupted"):
        runlib.load_checkpoint(str(path))


def test_mismatched_checkpoint_gives_clear_error(lm_run, tmp_path):
    lm_run(tmp_path / "m", "--method", "agg", steps=2)
    with pytest.raises(SystemExit) as e:
        lm_run(tmp_path / "m", "--method", "agg", "--d-model", "32", "--resume", steps=4)
    msg = str(e.value)
    assert "d_model=16" in msg and "d_model=32" in msg and "config.json" in msg and "ckpt.pt" in msg
    with pytest.raises(SystemExit, match="method='agg'.*method='mle'"):
        lm_run(tmp_path / "m", "--method", "mle", "--resume", steps=4)
    with pytest.raises(
        SystemExit, match="micro_batch=4 but this run asks for micro_batch=2"
    ):  # it changes the sums
        lm_run(tmp_path / "m", "--method", "agg", "--micro-batch", "2", "--resume", steps=4)
    with pytest.raises(SystemExit, match="already exists: pass --resume"):
        lm_run(tmp_path / "m", "--method", "agg", steps=4)
    ck = torch.load(tmp_path / "m" / "ckpt.pt", weights_only=True)
    ck["config"]["task"] = ck["task"] = "nmt"
    runlib.save_checkpoint(tmp_path / "m" / "ckpt.pt", ck)  # a valid checksum over the edit
    with pytest.raises(SystemExit, match="task 'nmt', not 'lm'"):
        lm_run(tmp_path / "m", "--method", "agg", "--resume", steps=4)


def test_tokenizer_cache_is_reused_and_keyed(corpus_writer, tmp_path):
    folder = corpus_writer(str(tmp_path / "data"), seed=1)
    cfg = dict(
        data_dir=folder,
        dataset="dir",
        tokenizer="bpe",
        vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
    )
    a = data_py.prepare_lm(cfg, log=lambda *a: None)
    mtime = os.path.getmtime(os.path.join(a["dir"], "tokenizer.json"))
    b = data_py.prepare_lm(cfg, log=lambda *a: None)
    assert not a["reused"] and b["reused"] and a["dir"] == b["dir"]
    assert os.path.getmtime(os.path.join(b["dir"], "tokenizer.json")) == mtime
    assert (a["ids"]["train"] == b["ids"]["train"]).all() and int(a["counts"].sum()) == len(
        a["ids"]["train"]
    )
    assert a["vocab_size"] == 300 and a["tokenizer"].decode(list(a["ids"]["valid"][:5])).strip()
    c = data_py.prepare_lm(dict(cfg, vocab_size=280), log=lambda *a: None)
    assert not c["reused"] and c["dir"] != a["dir"] and c["vocab_size"] == 280
    with open(os.path.join(folder, "train.txt"), "a") as f:
        f.write("a changed corpus gets a new cache .\n")
    d = data_py.prepare_lm(cfg, log=lambda *a: None)
    assert not d["reused"] and d["dir"] != a["dir"]
    w = data_py.prepare_lm(dict(cfg, tokenizer="word", vocab_size=0), log=lambda *a: None)
    words = {t for line in open(os.path.join(folder, "train.txt")) for t in line.split()}
    assert w["vocab_size"] == len(words) + 3  # every train word + <|endoftext|>, <pad>, <unk>


def test_offline_default_corpus_split_by_article():
    splits = data_py.load_gensim_wiki()
    documents = splits.pop("documents")  # lines per article
    assert {k: sum(v) for k, v in documents.items()} == {k: len(v) for k, v in splits.items()}
    assert len(documents["valid"]) == 6 and len(documents["test"]) == 5
    sizes = {k: sum(len(line) for line in v) for k, v in splits.items()}
    assert (
        2.5e6 < sum(sizes.values()) < 3.5e6
        and sizes["train"] > 10 * sizes["valid"] > 0
        and sizes["test"] > 0
    )
    long = {
        k: {line for line in v if len(line) > 80} for k, v in splits.items()
    }  # paragraphs, not headings
    assert (
        not long["test"] & long["valid"]
        and not long["test"] & long["train"]
        and not long["valid"] & long["train"]
    )
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
    g = m.generate(x[:, :3], 4)[:, 3:]
    assert g.shape == (2, 4) and torch.equal(g[:, 0], m.logits(x[:, :3])[:, -1].argmax(-1))


def test_rare_share_resolves_alpha_and_the_cpu_preset_uses_it(lm_run, corpus, read_log, tmp_path):
    lm_run(
        tmp_path / "a", "--method", "agg", "--rare-share", "0.9"
    )  # the tiny corpus: 79% never occur
    cfg = json.load(open(tmp_path / "a" / "config.json"))
    counts = torch.from_numpy(
        __import__("numpy").load(os.path.join(cfg["data_cache"], "counts.npy"))
    )
    special = [1, 0]  # <pad>, <|endoftext|>
    alpha = agg.alpha_for_rare_share(counts, 0.9, cfg["tokens_per_step_actual"], special)
    assert cfg["method_hparams"]["alpha"] == pytest.approx(alpha)
    assert abs(cfg["method_rare_share"] - 0.9) < 0.03
    lm_run(
        tmp_path / "b", "--method", "agg"
    )  # no flag: the cpu preset states the rare group as a share
    cfg_b = json.load(open(tmp_path / "b" / "config.json"))
    assert cfg_b["method_hparams"]["alpha"] == pytest.approx(
        agg.alpha_for_rare_share(
            counts,
            train_lm.PRESET_METHOD["cpu"]["rare_share"],
            cfg["tokens_per_step_actual"],
            special,
        )
    )
    lm_run(
        tmp_path / "c", "--method", "agg", "--alpha", "0.7"
    )  # an explicit alpha wins over the preset
    assert json.load(open(tmp_path / "c" / "config.json"))["method_hparams"]["alpha"] == 0.7
    with pytest.raises(SystemExit, match="not both"):
        lm_run(tmp_path / "d", "--method", "agg", "--alpha", "0.7", "--rare-share", "0.2")
    with pytest.raises(SystemExit, match="rare_share sets AGG's alpha; method 'mle' has none"):
        lm_run(tmp_path / "e", "--method", "mle", "--rare-share", "0.2")
    # validation records carry the per-group numbers of AGG Fig. 2
    valid = [r for r in read_log(tmp_path / "a") if r["split"] == "valid"][-1]
    assert set(valid["ppl_groups"]) == set(valid["isotropy_groups"]) == set(agg.GROUPS)
    for key in (
        "cosine_rare_freq",
        "group_rare_mass_pred",
        "group_rare_mass_true",
        "method_rare_mass_pred",
    ):
        assert key in valid, key


def test_freeze_rare_rows_stay_exactly_at_init_under_weight_decay(lm_run, tmp_path):
    for steps in (1, 4):
        lm_run(
            tmp_path / f"s{steps}", "--method", "freeze-rare", "--weight-decay", "0.5", steps=steps
        )
    a, b = (torch.load(tmp_path / f"s{n}" / "ckpt.pt", weights_only=True) for n in (1, 4))
    cfg = json.load(open(tmp_path / "s1" / "config.json"))
    counts = torch.from_numpy(
        __import__("numpy").load(os.path.join(cfg["data_cache"], "counts.npy"))
    )
    rare = agg.least_frequent_mask(counts, 0.2, [1, 0])
    wa, wb = a["model"]["tok_emb.weight"], b["model"]["tok_emb.weight"]
    torch.manual_seed(0)  # the initial model of seed 0 (train_lm seeds, then builds the model)
    init = train_lm.build_model(dict(cfg), len(counts)).tok_emb.weight.detach()
    assert torch.equal(wb[rare], init[rare]) and torch.equal(wa[rare], init[rare])
    assert not torch.equal(wb[~rare], init[~rare])


@pytest.mark.parametrize("files", ["empty", "tiny"])
def test_unusable_data_files_give_a_clear_error_and_write_nothing(tmp_path, files):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.txt").write_text(
            "" if files == "empty" and split == "valid" else "a b c .\n"
        )
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train_lm.py"),
            "--data-dir",
            str(data),
            "--out",
            str(tmp_path / "o"),
            "--cache-dir",
            str(tmp_path / "c"),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "Traceback" not in p.stderr
    if files == "empty":
        assert "valid.txt" in p.stderr and "empty" in p.stderr
    else:
        assert "--data-dir" in p.stderr and "--block-size" in p.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_a_context_too_large_for_memory_is_refused(lm_run, tmp_path):
    with pytest.raises(SystemExit, match="--block-size.*GiB.*lower --block-size or --micro-batch"):
        lm_run(
            tmp_path / "big",
            "--block-size",
            "20000",
            "--micro-batch",
            "16",
            "--tokens-per-step",
            "320000",
        )
    assert not (tmp_path / "big").exists()


@pytest.mark.parametrize("n,block,context", [(100, 16, 0), (100, 16, 8), (37, 16, 15), (5, 16, 4)])
def test_context_windows_score_every_target_once_after_their_context(n, block, context):
    class Stub:  # zero logits; with ids 0..n the inputs are their own positions
        def logits(self, x):
            inputs.append(x)
            return torch.zeros(*x.shape, 1)

    inputs, scored = [], []
    for _logits, y, pos in train_lm.score(
        Stub(),
        np.arange(n + 1),
        n,
        dict(block_size=block, micro_batch=3),
        "cpu",
        contextlib.nullcontext,
        context,
    ):
        assert torch.equal(y, pos)  # targets at their indices
        for x, p in zip(inputs[-1], pos):
            assert len(x) <= block and p[0] - 1 - x[0] == min(
                context, p[0] - 1
            )  # full context but at the start
            scored += p.tolist()
    assert sorted(scored) == list(range(1, n + 1))


def test_validation_and_evaluation_score_alike(lm_run, tmp_path, read_log):
    lm_run(tmp_path / "r", "--method", "mle", steps=2)
    valid = [r for r in read_log(tmp_path / "r") if r["split"] == "valid"][-1]
    res = eval_mod.evaluate(str(tmp_path / "r"), split="valid", n_samples=0)
    assert res["metrics"]["ppl"] == pytest.approx(valid["ppl"], rel=1e-9)
    assert res["metrics"]["tokens"] == valid["tokens"]
    t = res["metrics"]["temperature"]  # fitted on valid: scored on valid it can only lower the PPL
    assert (
        t["t"] > 0
        and t["ppl"] <= res["metrics"]["ppl"] * (1 + 1e-9)
        and set(t["ppl_groups"]) == set(agg.GROUPS)
    )
    ctx = eval_mod.evaluate(str(tmp_path / "r"), split="valid", n_samples=0, context_window=8)
    assert ctx["metrics"]["tokens"] == valid["tokens"] and ctx["metrics"]["context_window"] == 8


def test_greedy_continuations_are_scored_for_repetition(lm_run, tmp_path):
    lm_run(tmp_path / "base", "--lr", "3e-2", steps=4)
    assert eval_mod.repeated_4grams([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 - 4 / 5)
    m = eval_mod.evaluate(str(tmp_path / "base"), n_samples=2)["metrics"]
    assert 0 <= m["gen_rep4"] <= 1 and m["gen_rep4"] == pytest.approx(
        sum(g["rep4"] for g in m["generations"]) / 2
    )


@pytest.mark.parametrize("method", ["mle", "agg"])
def test_output_bias_trains_is_checkpointed_and_never_decayed(lm_run, tmp_path, method):
    lm_run(tmp_path / "run", "--method", method, "--output-bias", "--weight-decay", "0.5", steps=3)
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    bias = ck["model"]["out_bias"]
    assert bias.shape == (300,) and bias.abs().sum() > 0  # zero-initialised, then trained
    model = train_lm.build_model(ck["config"], 300)
    opt = train_lm.make_optimizer(
        model, dict(lr=1e-3, weight_decay=0.5)
    )  # the optimizer the run was trained with
    assert [
        g["weight_decay"] for g in opt.param_groups if any(p is model.out_bias for p in g["params"])
    ] == [0.0]
    model.load_state_dict(ck["model"])
    model.eval()
    x = torch.randint(0, 300, (2, 8))
    torch.testing.assert_close(model.logits(x), model.features(x) @ model.tok_emb.weight.T + bias)


def test_data_dir_without_its_text_files_names_them(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.md").write_text("x")
    (tmp_path / "d" / "valid.txt").write_text("a b c .\n")
    with pytest.raises(SystemExit, match=r"no train.txt, test.txt there.*valid.txt and test.txt"):
        data_py.load_text_dir(str(tmp_path / "d"))


def test_data_dir_reads_the_wikitext_zips_layout(tmp_path):
    for split in ("train", "valid", "test"):
        text = f" = {split} = \n\n a {split} paragraph . \n"
        (tmp_path / f"wiki.{split}.tokens").write_text(text)
    corpus = data_py.load_text_dir(str(tmp_path))
    assert corpus["valid"] == ["= valid =", "a valid paragraph ."]


def test_prepare_lm_builds_the_cache_a_run_reuses_and_touches_no_run_folder(
    corpus_writer, tmp_path, lm_tiny, capsys
):
    folder = corpus_writer(str(tmp_path / "data"), n_lines=(200, 20, 20))
    argv = [
        "--data-dir",
        folder,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "run"),
        *lm_tiny,
    ]
    cache = train_lm.main(argv + ["--prepare-only"])
    assert "building tokenizer + token ids in" in capsys.readouterr().out
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path / "cache") == [
        os.path.basename(cache)
    ]
    train_lm.main(argv + ["--max-steps", "1", "--eval-interval", "1"])
    assert "reusing cached" in capsys.readouterr().out


def test_wandb_gets_every_record_under_its_split(tmp_path):
    logged = []
    wandb = types.SimpleNamespace(log=lambda numbers, step: logged.append((step, numbers)))
    record = dict(
        step=3,
        split="valid",
        loss=2.0,
        ppl=9.0,
        ppl_groups=dict(freq=2.0, rare=40.0),
        bleu_signature="x",
    )
    runlib.log(str(tmp_path / "log.jsonl"), record, wandb)
    assert logged == [
        (
            3,
            {
                "valid/loss": 2.0,
                "valid/ppl": 9.0,
                "valid/ppl_groups": {"freq": 2.0, "rare": 40.0},
                "valid/bleu_signature": "x",
            },
        )
    ]
    assert [json.loads(line) for line in open(tmp_path / "log.jsonl")] == [record]


def test_float16_trains_with_loss_scaling_and_resumes_exactly(lm_run, read_log, tmp_path):
    """--dtype float16 (V100 / T4): autocast + dynamic loss scaling; the scaler's state is
    checkpointed, so a resumed
    run equals an uninterrupted one. float32 runs carry a disabled scaler (an empty state)."""
    lm_run(tmp_path / "full", "--method", "agg", "--dtype", "float16", steps=4)
    ck = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=True)
    assert ck["scaler"]["scale"] > 0 and ck["config"]["dtype"] == "float16"
    assert all(
        math.isfinite(r["loss"]) for r in read_log(tmp_path / "full") if r["split"] == "train"
    )
    lm_run(tmp_path / "part", "--method", "agg", "--dtype", "float16", "--stop-at", "2", steps=4)
    train_lm.main(
        ["--out", str(tmp_path / "part"), "--resume", "--dtype", "float16"]
    )  # dtype follows the call
    resumed = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=True)
    assert resumed["scaler"] == ck["scaler"]
    for k, v in ck["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    lm_run(tmp_path / "fp32", "--method", "agg", steps=2)
    assert torch.load(tmp_path / "fp32" / "ckpt.pt", weights_only=True)["scaler"] == {}


def _prepare(data, cache, lm_tiny, queue):
    cfg = train_lm.make_config(data_dir=data, cache_dir=cache, vocab_size=300, block_size=16)
    d = data_py.prepare_lm(cfg, log=lambda *a: None)
    queue.put((d["dir"], {k: int(len(v)) for k, v in d["ids"].items()}))


def test_runs_started_together_build_one_whole_cache(corpus_writer, tmp_path, lm_tiny):
    """Two processes preparing the same corpus at once (studies.grid --jobs 2, a fresh clone) end
    with one complete
    cache and no temporary folders."""
    import multiprocessing as mp

    data = corpus_writer(str(tmp_path / "data"), n_lines=(3000, 30, 30))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_prepare, args=(data, str(tmp_path / "cache"), lm_tiny, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    (d1, n1), (d2, n2) = queue.get(), queue.get()
    assert d1 == d2 and n1 == n2 and os.listdir(tmp_path / "cache") == [os.path.basename(d1)]
    ref = data_py.prepare_lm(
        train_lm.make_config(
            data_dir=data, cache_dir=str(tmp_path / "cache"), vocab_size=300, block_size=16
        ),
        log=lambda *a: None,
    )
    assert ref["reused"] and {k: len(v) for k, v in ref["ids"].items()} == n1


def test_freeze_rare_until_releases_the_rare_rows_and_logs_it(lm_run, read_log, tmp_path):
    """freeze-rare --until 3 (AGG Fig. 2): the rare rows stay at init through step 2, train from
    step 3 on, and the
    valid records say when they were released."""
    lm_run(
        tmp_path / "r", "--method", "freeze-rare", "--until", "3", "--eval-interval", "1", steps=5
    )
    frozen = {
        r["step"]: r["rare_frozen"] for r in read_log(tmp_path / "r") if r["split"] == "valid"
    }
    assert frozen == {1: True, 2: True, 3: False, 4: False, 5: False}
    cfg = json.load(open(tmp_path / "r" / "config.json"))
    assert cfg["method_hparams"]["until"] == 3
    counts = torch.from_numpy(
        __import__("numpy").load(os.path.join(cfg["data_cache"], "counts.npy"))
    )
    rare = agg.least_frequent_mask(counts, 0.2, [1, 0])
    torch.manual_seed(0)
    init = train_lm.build_model(dict(cfg), len(counts)).tok_emb.weight.detach()
    w = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)["model"]["tok_emb.weight"]
    assert rare.any() and not torch.equal(
        w[rare], init[rare]
    )  # released rows moved (the softmax pushes them)


def test_coupled_adam_untie_and_embedding_decay_are_run_settings(lm_run, tmp_path):
    lm_run(tmp_path / "ca", "--optimizer", "coupled-adam", "--method", "agg", steps=2)
    cfg = json.load(open(tmp_path / "ca" / "config.json"))
    assert cfg["optimizer"] == "coupled-adam"
    ck = torch.load(tmp_path / "ca" / "ckpt.pt", weights_only=True)
    assert [g["coupled"] for g in ck["optimizer"]["param_groups"]] == [False, False, True]
    lm_run(
        tmp_path / "untied",
        "--untie",
        "--method",
        "center",
        "--embedding-weight-decay",
        "0",
        steps=2,
    )
    ck = torch.load(tmp_path / "untied" / "ckpt.pt", weights_only=True)
    assert ck["model"]["tok_emb.weight"].shape == ck["model"]["lm_head.weight"].shape == (300, 16)
    assert not torch.equal(ck["model"]["tok_emb.weight"], ck["model"]["lm_head.weight"])
    # center acts on the softmax's matrix: the output matrix is centered, the input embedding is not
    assert ck["model"]["lm_head.weight"].mean(0).abs().max() < 1e-6
    assert ck["model"]["tok_emb.weight"].mean(0).abs().max() > 1e-4
    assert [g["weight_decay"] for g in ck["optimizer"]["param_groups"]][-1] == 0.0
    m = eval_mod.evaluate(str(tmp_path / "untied"), n_samples=1, gen_len=8, prefix_len=4)["metrics"]
    for key in ("isoscore", "isotropy_centered", "isotropy_weighted", "isotropy_weighted_centered"):
        assert 0 <= m[key] <= 1, key
    assert set(m["gen_distinct"]) == {"greedy", "sampled"} and 0 <= m["gen_rep4_sampled"] <= 1


@pytest.mark.slow
def test_untie_at_is_tied_before_the_split_copies_there_and_resumes_exactly_across_it(
    lm_run, read_log, tmp_path
):
    """--untie-at 0.5 of 6 steps: steps 1-3 are the tied run's exactly; at step 3 lm_head becomes
    the tied matrix (and
    its Adam state); stopped at 2 (before the split) and at 4 (after it), resumed, both equal the
    straight run."""
    extra = ["--method", "center", "--dropout", "0.2", "--eval-interval", "1"]
    lm_run(tmp_path / "tied", *extra, "--stop-at", "3", steps=6)
    lm_run(tmp_path / "full", *extra, "--untie-at", "0.5", steps=6)
    for stop in (2, 4):
        lm_run(tmp_path / f"s{stop}", *extra, "--untie-at", "0.5", "--stop-at", stop, steps=6)
        lm_run(tmp_path / f"s{stop}", *extra, "--untie-at", "0.5", "--resume", steps=6)
        a, b = (
            torch.load(tmp_path / r / "ckpt.pt", weights_only=True) for r in ("full", f"s{stop}")
        )
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (stop, k)
    tied, full = (read_log(tmp_path / r) for r in ("tied", "full"))

    def valid(log, step):
        return next(r for r in log if r["split"] == "valid" and r["step"] == step)

    assert (
        valid(tied, 3)["ppl"] == valid(full, 3)["ppl"]
    )  # before the split: the tied model, bit for bit
    ck = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=True)
    emb, head = ck["model"]["tok_emb.weight"], ck["model"]["lm_head.weight"]
    assert not torch.equal(emb, head)  # both trained on after the split
    assert (
        head.mean(0).abs().max() < 1e-6 < emb.mean(0).abs().max()
    )  # center acts on the output matrix after it
    lm_run(
        tmp_path / "full", *extra, "--untie-at", "0.5", "--resume", steps=8
    )  # continued to 8 steps
    cfg = json.load(open(tmp_path / "full" / "config.json"))
    assert cfg["max_steps"] == 8 and cfg["untie_step"] == 3  # the split stays where the run made it
    m = train_lm.load_model(dict(ck, step=2))
    assert (
        not m.untied and m.out_weight is m.tok_emb.weight
    )  # a checkpoint from before the split loads tied
    assert train_lm.load_model(dict(ck, step=3)).untied  # from the split step on, lm_head
    with pytest.raises(SystemExit):  # argparse: not allowed with argument --untie
        lm_run(tmp_path / "both", "--untie", "--untie-at", "0.5")
    assert not (tmp_path / "both").exists()
    with pytest.raises(SystemExit, match=r"--untie-at 1.5: must be in \[0, 1\]"):
        lm_run(tmp_path / "far", "--untie-at", "1.5")


def test_embedding_lr_scales_the_vocabulary_matrices_lr_only(lm_run, tmp_path):
    lm_run(tmp_path / "e", "--embedding-lr", "10", steps=2)
    ck = torch.load(tmp_path / "e" / "ckpt.pt", weights_only=True)
    groups = ck["optimizer"]["param_groups"]
    assert [g["initial_lr"] for g in groups] == pytest.approx([3e-3, 3e-3, 3e-2])
    assert len(groups[-1]["params"]) == 1  # the tied embedding alone
    assert groups[-1]["lr"] == pytest.approx(10 * groups[0]["lr"])  # on the same schedule
    with pytest.raises(SystemExit, match="--embedding-lr -1.0: must be >= 0"):
        lm_run(tmp_path / "bad", "--embedding-lr", "-1")


def test_logit_softcap_caps_the_logits_of_training_validation_and_eval(lm_run, read_log, tmp_path):
    lm_run(tmp_path / "c", "--logit-softcap", "0.5", "--method", "agg", "--alpha", "0.4", steps=2)
    ck = torch.load(tmp_path / "c" / "ckpt.pt", weights_only=True)
    model = train_lm.load_model(ck)
    x = torch.randint(0, 300, (2, 8))
    logits = model.logits(x)
    assert logits.abs().max() < 0.5  # the cap bounds them
    raw = model.features(x) @ model.out_weight.T
    torch.testing.assert_close(logits, 0.5 * torch.tanh(raw / 0.5))
    train = [r for r in read_log(tmp_path / "c") if r["split"] == "train"]
    assert (
        train[0]["nll"] >= math.log(300) - 2 * 0.5
    )  # logits within (-C, C): no NLL below log V - 2 C
    with pytest.raises(SystemExit, match="--logit-softcap 0.0: must be >= 0.001"):
        lm_run(tmp_path / "bad", "--logit-softcap", "0")


def test_a_rare_share_the_tied_counts_cannot_give_is_said(lm_run, tmp_path, capsys):
    lm_run(tmp_path / "r", "--method", "agg", "--rare-share", "0.01", steps=1)
    got = json.load(open(tmp_path / "r" / "config.json"))["method_rare_share"]
    assert abs(got - 0.01) > 0.02  # the never-seen tokens tie at count 0: all rare, or none
    assert (
        f"warning: --rare-share 0.01 marks {got:.1%} of the vocabulary rare"
        in capsys.readouterr().out
    )


def test_resume_prepare_only_builds_the_runs_own_corpus(lm_run, tmp_path):
    """--resume --prepare-only reads the run's config (its corpus), not the default flags'."""
    import train_lm

    lm_run(tmp_path / "r", steps=2)
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    cache = train_lm.main(["--out", str(tmp_path / "r"), "--resume", "--prepare-only"])
    assert cache == config["data_cache"]
