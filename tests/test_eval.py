"""eval.py: every metrics key on tiny checkpoints, values checked against independent computations,
NMT dispatch."""

import json
import math
import os
import shlex
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data as data_py
import eval as ev
import runlib
import train_lm
from studies import compare

KEYS = [
    "ppl",
    "ppl_groups",
    "uniq",
    "uniq_groups",
    "uniq_human",
    "isotropy",
    "isotropy_groups",
    "mean_cosine",
    "word_similarity",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, lm_tiny):
    base = tmp_path_factory.mktemp("ev")
    out = {}
    for label, method, extra in (
        ("mle", "mle", []),
        ("agg", "agg", ["--alpha", "0.5", "--snapshot-steps", "1,3"]),
        ("mle-s1", "mle", ["--seed", "1"]),
    ):
        out[label] = str(base / label)
        train_lm.main(
            [
                "--data-dir",
                corpus["data"],
                "--cache-dir",
                corpus["cache"],
                "--out",
                out[label],
                "--method",
                method,
                *lm_tiny,
                "--max-steps",
                "3",
                "--eval-interval",
                "3",
                *extra,
            ]
        )
    return out


def test_eval_lm_writes_every_key_and_correct_values(runs, tmp_path):
    report = tmp_path / "report"
    metrics = ev.main(
        [
            runs["mle"],
            runs["agg"],
            "--out",
            str(report),
            "--device",
            "cpu",
            "--n-samples",
            "2",
            "--prefix-len",
            "8",
            "--gen-len",
            "12",
        ]
    )
    on_disk = json.load(open(report / "metrics.json"))
    assert set(on_disk) == {"mle", "agg"}
    for label, m in on_disk.items():
        for k in KEYS:
            assert k in m, (label, k)
        for k in ("ppl_groups", "uniq_groups", "isotropy_groups"):
            assert set(m[k]) == {"freq", "med", "rare"}
        assert set(m["word_similarity"]) == {"ws353", "simlex999"}
        assert all(-1 <= v <= 1 for v in m["word_similarity"].values())
        assert m["uniq"] == sum(m["uniq_groups"].values()) and 0 < m["uniq"] <= m["tokens"]
        assert m["uniq_human"] == sum(m["uniq_human_groups"].values())
        assert 0 < m["isotropy"] <= 1 and -1 <= m["mean_cosine"] <= 1
        finite = [v for v in m["ppl_groups"].values() if math.isfinite(v)]
        assert min(finite) <= m["ppl"] <= max(finite)
        assert len(m["generations"]) == 2 and all(0 < g["uniq"] <= 12 for g in m["generations"])
        assert m["singular_values"][0] == pytest.approx(1.0)
    assert on_disk["agg"]["method"] == "agg" and on_disk["agg"]["step"] == 3
    assert metrics["mle"]["ppl"] == on_disk["mle"]["ppl"] and on_disk["agg"]["seed"] == 0
    valid = [
        r
        for r in map(json.loads, open(os.path.join(runs["agg"], "log.jsonl")))
        if r["split"] == "valid"
    ]
    assert (
        on_disk["agg"]["valid_ppl"] == valid[-1]["ppl"] and on_disk["agg"]["checkpoint"] == "last"
    )
    assert set(on_disk["agg"]["neighbours"]) == set(
        on_disk["mle"]["neighbours"]
    )  # the same rare tokens
    assert os.listdir(report) == [
        "metrics.json"
    ]  # summaries, reports and plots: studies/compare.py

    # PPL and human Uniq recomputed independently from the checkpoint and the cached test ids
    ck = torch.load(os.path.join(runs["mle"], "ckpt.pt"), weights_only=True)
    data = data_py.prepare_lm(ck["config"], log=lambda *a: None)
    model = train_lm.build_model(ck["config"], data["vocab_size"])
    model.load_state_dict(ck["model"])
    model.eval()
    ids = torch.from_numpy(np.asarray(data["ids"]["test"], dtype=np.int64))
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 16):
            x, y = ids[s : s + 16 + 1][:-1], ids[s + 1 : s + 16 + 1]
            x = x[: len(y)]
            nll += F.cross_entropy(model.logits(x[None])[0], y, reduction="sum").item()
            n += len(y)
    assert on_disk["mle"]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert on_disk["mle"]["uniq_human"] == len(ids[1:].unique())


def test_word_pair_loaders_and_spearman(tmp_path):
    ws = ev.load_word_pairs(ev.gensim_test_data(ev.WORDSIM["ws353"]))
    assert len(ws) == 353 and ws[0] == ("love", "sex", 6.77)
    assert len(ev.load_word_pairs(ev.gensim_test_data(ev.WORDSIM["simlex999"]))) == 999

    # word-level vocabulary whose cosines rank the pairs exactly as the human scores do -> Spearman
    # 1
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3}
    tok = types.SimpleNamespace(token_to_id=lambda w: vocab.get(w))
    W = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.0, 1.0], [-1.0, 0.2]])
    (tmp_path / "pairs.txt").write_text(
        "# a\tb\tscore\na\tb\t9\na\tc\t5\na\td\t1\nb\td\t2\nzz\ta\t3\n"
    )
    rho, used, total = ev.word_similarity(W, tok, "word", {"x": str(tmp_path / "pairs.txt")})["x"]
    assert rho == pytest.approx(1.0) and (used, total) == (4, 5)  # 'zz' is out of vocabulary


def test_neighbours_and_rare_token_choice():
    W = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [-1.0, 0.0]])
    assert ev.neighbours(W, [0, 2], k=2) == [[1, 3], [3, 1]]
    counts = torch.tensor([100, 90, 80, 5, 4, 3, 2, 1, 0, 0])
    tokens = [" the", " a", " of", " x", " y", "zz", " wordy", " rarely", " never", " nope"]
    gid, groups = ev.group_index(counts)
    assert gid[:3].tolist() == [0, 0, 0] and set(groups[2].tolist()) == {8, 9}
    counts2 = torch.tensor([100, 90, 80, 70, 60, 50, 40, 3, 2, 0])
    assert ev.pick_rare_tokens(counts2, tokens, 3) == [
        8
    ]  # rare group {8, 9}: 9 never seen in training
    assert ev.pick_rare_tokens(
        counts2, tokens, 3, src_counts=torch.tensor([0] * 7 + [1, 5, 9])
    ) == [9, 8]


def test_bad_run_folder_errors(tmp_path, runs):
    with pytest.raises(SystemExit, match="no checkpoint"):
        ev.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "r")])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "ckpt.pt").write_bytes(b"garbage")
    with pytest.raises(SystemExit, match=r"bad/ckpt.pt: corrupted"):
        ev.main([runs["mle"], str(bad), "--out", str(tmp_path / "r")])


def test_nmt_dispatch_merges_task_metrics(tmp_path, monkeypatch):
    """eval.py hands NMT runs to evaluate_nmt and adds the geometry itself (a stand-in evaluate_nmt
    here)."""
    V, d = 60, 8
    torch.manual_seed(0)
    weight = torch.randn(V, d)
    calls = []
    tokens = ["w" + "".join("abcdefghij"[int(c)] for c in f"{i:02d}") + "xx" for i in range(V)]

    def evaluate_nmt(out_dir, model, ck, args, device):
        calls.append((out_dir, str(device), args.beam))
        m = {
            "bleu": 12.5,
            "bleu_signature": "nrefs:1|case:mixed|tok:13a",
            "method": "agg",
            "task": "nmt",
        }
        return m, weight, torch.arange(V).flip(0), torch.arange(V), tokens

    monkeypatch.setattr(ev, "evaluate_nmt", evaluate_nmt)
    monkeypatch.setattr(ev.train_nmt, "load_model", lambda ck, device: None)
    run = tmp_path / "nmt-run"
    run.mkdir()
    torch.save({"config": {"task": "nmt"}, "task": "nmt", "model": {}, "step": 5}, run / "ckpt.pt")
    m = ev.main([str(run), "--out", str(tmp_path / "r"), "--device", "cpu"])["nmt-run"]
    assert calls == [(str(run), "cpu", 4)]
    assert m["bleu"] == 12.5 and m["bleu_signature"].startswith("nrefs")
    seen = (
        torch.arange(V).flip(0) > 0
    )  # token 59 never occurs in training: left out of the geometry
    assert m["isotropy"] == pytest.approx(ev.agg.isotropy(weight[seen])) and set(
        m["isotropy_groups"]
    ) == {"freq", "med", "rare"}
    assert (
        m["mean_cosine"] == pytest.approx(ev.agg.mean_cosine(weight[seen])) and m["rows"] == V - 1
    )
    # neighbours of target-rare tokens most frequent on the source side (ids 59, 58, ... are
    # target-rare)
    assert list(m["neighbours"])[:2] == [tokens[59], tokens[58]]


def test_nmt_end_to_end_with_train_nmt_and_checkpoint_averaging(tmp_path):
    import train_nmt

    out = str(tmp_path / "nmt")
    flags = [
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "300",
        "--enc-layers",
        "1",
        "--dec-layers",
        "1",
        "--d-model",
        "16",
        "--n-head",
        "2",
        "--d-ff",
        "32",
        "--max-steps",
        "6",
        "--eval-interval",
        "2",
        "--tokens-per-step",
        "512",
        "--micro-tokens",
        "512",
        "--warmup",
        "2",
        "--valid-bleu-sents",
        "8",
        "--device",
        "cpu",
    ]
    train_nmt.main(flags + ["--out", out, "--keep-last", "2"])
    assert sorted(os.path.basename(p) for p in runlib.snapshots(out)) == [
        "ckpt_4.pt",
        "ckpt_6.pt",
    ]  # the last 2 kept
    m = ev.main([out, "--out", str(tmp_path / "r"), "--device", "cpu", "--beam", "2"])["nmt"]
    for k in (
        "bleu",
        "bleu_signature",
        "isotropy",
        "isotropy_groups",
        "mean_cosine",
        "test_ppl",
        "ppl_groups",
        "group_rare_mass_pred",
        "group_rare_mass_true",
        "translations",
    ):
        assert k in m
    hyps = (tmp_path / "r" / "test_hyps_nmt.txt").read_text().splitlines()
    assert hyps[0] == m["translations"][0]["hyp"]  # every test translation, one per line
    assert 0 <= m["bleu"] <= 100 and 0 < m["isotropy"] <= 1 and m["checkpoints_averaged"] == 0
    avg = ev.main(
        [
            out,
            "--out",
            str(tmp_path / "r2"),
            "--device",
            "cpu",
            "--beam",
            "2",
            "--average-last",
            "2",
        ]
    )["nmt"]
    assert avg["checkpoints_averaged"] == 2 and avg["averaged_files"] == ["ckpt_4.pt", "ckpt_6.pt"]
    a, b = (
        torch.load(os.path.join(out, f"ckpt_{s}.pt"), weights_only=True)["model"] for s in (4, 6)
    )
    weights, _ = ev.average_checkpoints(out, 2)
    torch.testing.assert_close(weights["embed"], (a["embed"] + b["embed"]) / 2)
    with pytest.raises(SystemExit, match="--keep-last 3"):
        ev.main([out, "--out", str(tmp_path / "r3"), "--average-last", "3"])
    # --save-interval: snapshots between evaluations, and the same training (saving and validating
    # draw no RNG)
    out2 = str(tmp_path / "nmt-save")
    train_nmt.main(
        [
            f
            for f in flags[: flags.index("--eval-interval")]
            + ["--eval-interval", "6", "--save-interval", "2"]
            + flags[flags.index("--eval-interval") + 2 :]
        ]
        + ["--out", out2, "--keep-last", "2"]
    )
    assert sorted(os.path.basename(p) for p in runlib.snapshots(out2)) == ["ckpt_4.pt", "ckpt_6.pt"]
    log = list(map(json.loads, open(os.path.join(out2, "log.jsonl"))))
    assert [r["step"] for r in log if r["split"] == "valid"] == [6]
    # training never reads the test split; eval.py tests the last checkpoint and the average of the
    # last snapshots
    assert {r["split"] for r in log} == {"train", "valid"}
    averaged = ev.evaluate(out2, beam=2, average_last=2)["metrics"]
    last = ev.evaluate(out2, beam=2)["metrics"]
    assert (
        averaged["averaged_files"] == ["ckpt_4.pt", "ckpt_6.pt"]
        and averaged["checkpoints_averaged"] == 2
    )
    assert averaged["test_ppl"] != last["test_ppl"]
    for s in (4, 6):
        torch.testing.assert_close(
            torch.load(os.path.join(out2, f"ckpt_{s}.pt"), weights_only=True)["model"],
            torch.load(os.path.join(out, f"ckpt_{s}.pt"), weights_only=True)["model"],
            atol=0,
            rtol=0,
        )


def test_best_checkpoint_is_kept_and_can_be_evaluated(runs, tmp_path):
    best = torch.load(os.path.join(runs["agg"], "ckpt_best.pt"), weights_only=True)
    valid = [
        json.loads(line)
        for line in open(os.path.join(runs["agg"], "log.jsonl"))
        if '"valid"' in line
    ]
    assert best["valid_ppl"] == pytest.approx(min(r["ppl"] for r in valid))
    m = ev.main(
        [
            runs["agg"],
            "--out",
            str(tmp_path / "r"),
            "--device",
            "cpu",
            "--n-samples",
            "0",
            "--checkpoint",
            "best",
        ]
    )["agg"]
    assert m["checkpoint"] == "best" and m["step"] == best["step"]


def test_rare_bias_is_the_nll_optimum_and_calibrates_the_rare_mass():
    g = torch.Generator().manual_seed(0)
    V, N = 30, 400
    rare = torch.zeros(V, dtype=torch.bool)
    rare[20:] = True
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    logits[:, 20:] += 1.5  # the model over-predicts the rare group
    y = torch.randint(0, V, (N,), generator=g)
    gid = torch.where(rare, 2, torch.where(torch.arange(V) < 8, 0, 1))
    st = ev.rare_logit_stats(logits, y, rare)
    b = ev.fit_rare_bias(st)

    def nll(c):
        return F.cross_entropy(logits + c * rare.double(), y).item()

    grid = torch.linspace(b - 0.5, b + 0.5, 101)
    assert nll(b) <= min(nll(float(c)) for c in grid) + 1e-12 and b < 0
    m = ev.rare_bias_metrics(st, b, gid)
    probs = torch.softmax(logits + b * rare.double(), -1)
    assert m["rare_mass_pred"] == pytest.approx(float(probs[:, rare].sum(1).mean()), rel=1e-6)
    assert m["rare_mass_pred"] == pytest.approx(
        m["rare_mass_true"], abs=1e-7
    )  # the fit calibrates the mass
    assert m["ppl"] == pytest.approx(math.exp(nll(b)), rel=1e-6)
    pred = (logits + b * rare.double()).argmax(-1)
    is_rare = rare[pred]
    assert m["uniq"] == len(pred.unique()) and m["rare_argmax_count"] == int(is_rare.sum())
    assert m["rare_argmax_precision"] == pytest.approx(float((pred == y)[is_rare].double().mean()))
    assert m["rare_argmax_recall"] == pytest.approx(float((pred == y)[rare[y]].double().mean()))
    rare_nll = F.cross_entropy(logits[rare[y]] + b * rare.double(), y[rare[y]]).item()
    assert m["ppl_groups"]["rare"] == pytest.approx(math.exp(rare_nll), rel=1e-6)


def test_rare_token_recall_clips_counts_per_sentence():
    import train_nmt

    rare = torch.zeros(10, dtype=torch.bool)
    rare[[7, 8]] = True
    r = train_nmt.rare_token_recall(hyps=[[1, 7, 7, 7], [2, 3]], refs=[[7, 8, 1], [8]], rare=rare)
    assert (r["rare_matched"], r["rare_ref_tokens"], r["rare_hyp_tokens"]) == (1, 3, 3)
    assert r["rare_recall"] == pytest.approx(1 / 3) and r["rare_precision"] == pytest.approx(1 / 3)


def test_a_crafted_config_json_puts_no_shell_text_in_the_command():
    saved = {
        "segments": [{"argv": ["--method", "agg", "--out", "; rm -rf /", "--seed", "$(reboot)"]}],
        "lr": 1e-3,
        "warmup": "5; rm -rf ~",
        "schedule": "cosine",
        "versions": {"threads": "1; rm -rf /"},
    }
    cmd = compare.run_command(saved, "train_lm.py")
    assert shlex.split(cmd) == [
        "python",
        "train_lm.py",
        "--method",
        "agg",
        "--out",
        "; rm -rf /",
        "--seed",
        "$(reboot)",
        "--lr",
        "0.001",
        "--warmup",
        "5; rm -rf ~",
    ]  # each one word, none run
    saved["versions"]["threads"] = 2
    assert compare.run_command(saved, "train_lm.py").startswith(
        "OMP_NUM_THREADS=2 python train_lm.py "
    )


def test_the_command_names_the_device_of_a_run_off_the_cpu():
    saved = {
        "segments": [{"argv": ["--method", "agg", "--dtype", "float32"]}],
        "lr": 4e-3,
        "warmup": 240,
    }
    assert "--device" not in compare.run_command(dict(saved, device="cpu"), "train_lm.py")
    assert compare.run_command(dict(saved, device="cuda"), "train_lm.py").endswith(
        " --warmup 240 --device cuda"
    )


def test_average_last_below_zero_is_refused(runs, tmp_path):
    with pytest.raises(
        SystemExit, match=r"--average-last -2: give the number of snapshots to average, >= 1"
    ):
        ev.main([runs["mle"], "--out", str(tmp_path / "r"), "--average-last", "-2"])
    with pytest.raises(SystemExit, match=r"--average-last -2"):
        ev.average_checkpoints(runs["mle"], -2)


def test_the_command_of_a_resumed_run_reproduces_it():
    """A run continued in a new folder to a longer --max-steps: one command under inverse-sqrt (the
    same run, see
    test_resume_equals_uninterrupted), its segments in order under cosine (the decay moved with
    --max-steps)."""
    segs = [
        {"argv": ["--method", "agg", "--seed", "1", "--out", "out/a"]},
        {"argv": ["--out", "out/b", "--resume", "--max-steps", "10000"]},
    ]
    saved = {"segments": segs, "lr": 4e-3, "warmup": 200, "out": "out/b"}
    cmd = compare.run_command(dict(saved, schedule="inverse-sqrt"), "train_nmt.py")
    assert (
        cmd == "python train_nmt.py --method agg --seed 1 --out out/b --max-steps 10000 --lr 0.004 "
        "--warmup 200"
    )
    cmd = compare.run_command(dict(saved, schedule="cosine"), "train_lm.py")
    assert cmd.split(" && ")[1] == "python train_lm.py --out out/b --max-steps 10000 --resume"
    eq = dict(
        saved,
        schedule="inverse-sqrt",
        segments=[
            {"argv": ["--method", "agg", "--max-steps", "5000"]},
            {"argv": ["--resume", "--max-steps=10000"]},
        ],
    )
    assert compare.run_command(eq, "train_nmt.py").startswith(
        "python train_nmt.py --method agg --max-steps=10000 --lr"
    )
    spaced = dict(
        saved, schedule="cosine", segments=[{"argv": ["--method", "agg", "--out", "out/my run"]}]
    )
    assert shlex.split(compare.run_command(spaced, "train_lm.py"))[4:6] == ["--out", "out/my run"]
    plain = dict(
        saved, schedule="cosine", segments=[segs[0], {"argv": ["--out", "out/a", "--resume"]}]
    )
    assert compare.run_command(plain, "train_lm.py") == (
        "python train_lm.py --method agg --seed 1 --out out/a --lr 0.004 --warmup 200"
    )
    split = dict(
        plain, segments=[{"argv": segs[0]["argv"] + ["--stop-at", "4"]}, plain["segments"][1]]
    )
    assert compare.run_command(split, "train_lm.py") == compare.run_command(
        plain, "train_lm.py"
    )  # trains the whole run
    dtype = dict(
        split,
        segments=[
            split["segments"][0],
            {"argv": ["--out", "out/a", "--resume", "--dtype", "bfloat16"]},
        ],
    )
    assert compare.run_command(dtype, "train_lm.py") == (
        "python train_lm.py --method agg --seed 1 --out out/a --stop-at 4 --lr 0.004 --warmup 200 "
        "&& "
        "python train_lm.py --out out/a --dtype bfloat16 --resume"
    )  # float32 to step 4, then bfloat16


def test_evaluation_builds_no_autograd_graph(runs):
    res = ev.evaluate(runs["agg"], n_samples=1, gen_len=4, prefix_len=4, device="cpu")
    assert not res["metrics"]["type_stats"]["nll"].requires_grad and not res["weight"].requires_grad


def test_temperature_is_the_nll_optimum_over_a_fresh_pass_per_step():
    g = torch.Generator().manual_seed(1)
    V, N = 40, 600
    logits = torch.randn(N, V, generator=g) * 3  # over-confident: the fit cools it (t > 1)
    y = torch.where(
        torch.rand(N, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, V, (N,), generator=g)
    )
    passes = []

    # three micro-batches of shape (batch, positions, V), as train_lm.score yields them
    def batches():
        passes.append(1)
        for i in range(0, N, 200):
            yield logits[i : i + 200].view(4, 50, V), y[i : i + 200].view(4, 50)

    beta = ev.fit_temperature(batches)

    def nll(b):
        return F.cross_entropy(b * logits.double(), y).item()

    assert (
        nll(beta) <= min(nll(float(b)) for b in torch.linspace(beta - 0.2, beta + 0.2, 81)) + 1e-9
    )
    assert beta < 1 and nll(beta) < nll(1.0) and 2 <= len(passes) < 30


def test_device_cuda_without_cuda_ends_in_one_line(runs, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(
        SystemExit, match="--device cuda: CUDA is not available on this machine; use --device cpu"
    ):
        ev.main([runs["mle"], "--out", str(tmp_path / "r"), "--device", "cuda"])


def test_a_flag_of_the_other_task_is_refused_in_one_line(runs, tmp_path):
    lm = runs["mle"]
    for flag, value in (("--beam", "2"), ("--average-last", "2"), ("--max-sentences", "5")):
        with pytest.raises(SystemExit, match=f"{flag} is a flag of NMT runs and these are LM runs"):
            ev.main([str(lm), "--out", str(tmp_path / "r"), flag, value])


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--n-samples", "-1"], "--n-samples -1: must be >= 0"),
        (["--prefix-len", "0"], "--prefix-len 0: must be >= 1"),
        (["--gen-len", "-1"], "--gen-len -1: must be >= 1"),
        (["--device", "foo"], "--device foo: unknown device"),
        (["--out", "/proc/x/y"], "--out /proc/x/y: cannot create that folder"),
    ],
)
def test_bad_evaluation_flags_end_in_one_line_before_any_work(runs, tmp_path, flags, match):
    with pytest.raises(SystemExit, match=match):
        ev.main([runs["mle"], "--out", str(tmp_path / "r"), *flags])
