"""studies.bench and studies.official: the official-AGG reference against agg.py, and the
benchmark's outputs (no timing assertions)."""

import json
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import agg
from studies import bench, official


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids waiting on a busy second core (restored afterwards for other
    test files)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def zipf_batches(V, n, shape, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
    return [
        torch.multinomial(p, shape[0] * shape[1], replacement=True, generator=g).view(shape)
        for _ in range(n)
    ]


def grads(method, h, w, y):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    method.loss(h, w, y).backward()
    return h.grad, w.grad


@pytest.mark.parametrize("window", [3, 50])  # 3: the counter memory wraps around during the test
def test_official_ref_gradients_equal_agg(window):
    """The literal three-logit criterion (dense gates, T x T counts) and agg.py's one-logit head
    give the same gradients wrt hidden and weight, step after step, with a dynamic rare group and
    both gates active."""
    V, d, alpha = 60, 8, 0.6
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 24, d, generator=g, dtype=torch.float64)
    w = torch.randn(V, d, generator=g, dtype=torch.float64)
    ours = agg.build_method("agg", vocab_size=V, alpha=alpha, window=window, special_ids=[0])
    ref = official.OfficialAGGRef(V, alpha=alpha, window=window, special_ids=[0])
    mle = agg.build_method("mle", vocab_size=V)
    checked = 0
    for y in zipf_batches(V, 8, (2, 24), seed=2):
        ours.observe(y)
        rare = ours.rare_mask()
        gh_ours, gw_ours = grads(ours, h, w, y)
        gh_ref, gw_ref = grads(ref, h, w, y)
        gh_mle, gw_mle = grads(mle, h, w, y)
        torch.testing.assert_close(gh_ref, gh_ours, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gw_ref, gw_ours, rtol=1e-10, atol=1e-12)
        # the hidden gradient is never gated
        torch.testing.assert_close(gh_ours, gh_mle, rtol=1e-10, atol=1e-12)
        if rare.any() and rare[y].any() and (~rare[y]).any():
            assert not torch.allclose(gw_ours, gw_mle)  # the gates really act on this step
            checked += 1
    assert checked >= 4, (
        "too few steps with both rare- and non-rare-target rows: the test checks nothing"
    )


def test_official_ref_counts_like_agg():
    """The T x T counting into a dense (K, V) memory yields agg.py's rare group and a_k, including
    after wrap."""
    V, window = 30, 4
    ours = agg.build_method("agg", vocab_size=V, alpha=0.8, window=window)
    ref = official.OfficialAGGRef(V, alpha=0.8, window=window)
    h, w = torch.zeros(1, 10, 4), torch.zeros(V, 4)
    for y in zipf_batches(V, 7, (1, 10), seed=3):
        ours.observe(y)
        ref.loss(h, w, y)
        torch.testing.assert_close(ref.memory.sum(0).long(), ours.appearances)


def test_prefill_equals_counting_steps():
    """prefill() (set-up only, bincount) leaves the memory exactly as the timed counting path
    would."""
    V, window = 40, 5
    batches = zipf_batches(V, 7, (2, 8), seed=4)
    a = official.OfficialAGGRef(V, alpha=0.5, window=window)
    b = official.OfficialAGGRef(V, alpha=0.5, window=window)
    a.prefill(batches)
    for y in batches:
        b.loss(torch.zeros(2, 8, 3), torch.zeros(V, 3), y)
    assert a.itr == b.itr
    torch.testing.assert_close(a.memory, b.memory)


def test_torch_ce_is_plain_cross_entropy():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 5, 4, generator=g), torch.randn(11, 4, generator=g)
    y = torch.randint(0, 11, (2, 5), generator=g)
    expected = F.cross_entropy((h @ w.T).reshape(-1, 11), y.reshape(-1))
    torch.testing.assert_close(bench.TorchCE().loss(h, w, y), expected)
    if "linear-ce" in bench.BASELINES:  # F.linear_cross_entropy, where this torch has it
        torch.testing.assert_close(bench.LinearCE().loss(h, w, y), expected)
    torch.testing.assert_close(agg.build_method("mle", vocab_size=11).loss(h, w, y), expected)


def test_make_data_rare_share_and_shapes():
    data = bench.make_data(
        V=2000, T=1024, d=8, seq_len=64, seed=0, rare_fraction=0.2, window=20, device="cpu"
    )
    assert data["hidden"].shape == (16, 64, 8) and data["batches"][0].shape == (16, 64)
    assert 0.15 < data["rare_vocab"] < 0.25  # close to the asked 20%
    assert 0 < data["rare_rows"] < 0.1  # Zipf: rare tokens are a small share of the targets
    m = bench.Runner("agg", data).method
    # agg sees that rare group
    assert abs(float(m.rare_mask().double().mean()) - data["rare_vocab"]) < 0.02


def test_cpu_peak_memory_sees_the_logits_and_chunks_shrink_it():
    """The fresh-process RSS measurement: T x V = 128 MiB of float32 logits show up, chunk_size=32
    removes them (4 MiB chunks; glibc keeps a few freed chunks resident), F.cross_entropy keeps ~3
    such buffers."""
    kw = dict(V=32768, T=1024, d=8, seq_len=1024, seed=0, rare_fraction=0.2, window=5)
    full = bench.cpu_peak_mb("mle", **kw)
    chunked = bench.cpu_peak_mb("mle", chunk_size=32, **kw)
    torch_ce = bench.cpu_peak_mb("torch-ce", **kw)
    assert full > 120  # at least the one 128 MiB logits buffer
    assert chunked < full - 64
    assert torch_ce > full + 100


def test_quick_run_writes_every_key(tmp_path):
    """A --quick run on tiny sizes writes bench.json with its documented keys for every method,
    official-ref and PyTorch's heads."""
    out = tmp_path / "b"
    bench.main(
        [
            "--quick",
            "--out",
            str(out),
            "--vocab",
            "128",
            "--tokens",
            "32",
            "--d-model",
            "8",
            "--seq-len",
            "16",
            "--repeats",
            "1",
            "--window",
            "5",
            "--chunk-vocab",
            "256",
            "--chunk-tokens",
            "32",
            "--chunk-d",
            "4",
            "--chunk-sizes",
            "0",
            "8",
            "--threads",
            "1",
        ]
    )
    result = json.loads((out / "bench.json").read_text())
    keys = {"method", "V", "device", "ms", "ms_min", "ms_max", "ms_ratio_vs_mle", "peak_mb"}
    keys |= {"min_ratio_vs_mle", "mem_ratio_vs_mle", "cpu_ms", "cpu_ratio_vs_mle"}
    keys |= {"samples_ms", "cpu_samples_ms"}
    cases = result["cases"]
    names = set(agg.METHODS) | {"official-ref", *bench.BASELINES}
    assert {c["method"] for c in cases} == names
    for c in cases:
        assert set(c) == keys
        assert c["V"] == 128 and c["device"] == "cpu" and c["ms"] > 0 and c["peak_mb"] >= 0
        assert c["ms_min"] <= c["ms"] <= c["ms_max"] and len(c["samples_ms"]) == 1
    mle = next(c for c in cases if c["method"] == "mle")
    assert mle["ms_ratio_vs_mle"] == 1.0
    assert {(r["method"], r["chunk_size"]) for r in result["chunked"]} == {
        ("mle", None),
        ("mle", 8),
        ("agg", None),
        ("agg", 8),
    }
    assert (out / "bench.md").read_text().count("| official-ref |") == 1


def test_lm_section_times_train_lms_step(monkeypatch):
    """The lm section runs train_lm.train_step (AdamW, the method's observe) per method on the
    preset's training split (here a tiny Zipf stream), AGG's window full, and reports tokens/s
    against MLE."""
    V = 300
    ids = torch.multinomial(
        torch.arange(1, V + 1.0) ** -1.1,
        5000,
        replacement=True,
        generator=torch.Generator().manual_seed(0),
    )
    data = dict(
        ids={"train": ids.numpy().astype("uint16")},
        counts=torch.bincount(ids, minlength=V),
        vocab_size=V,
        pad_id=1,
        eos_id=0,
        dir="tiny",
    )
    monkeypatch.setattr(bench, "prepare_lm", lambda cfg, log: data)
    calls, train_step = [], bench.train_lm.train_step

    def spy(model, raw, method, *a, **k):  # the method and the weights before each step
        calls.append((method, model.tok_emb.weight.detach().clone()))
        return train_step(model, raw, method, *a, **k)

    monkeypatch.setattr(bench.train_lm, "train_step", spy)
    logged = []
    args = bench.build_parser().parse_args(
        ["--methods", "mle", "agg", "torch-ce", "--lm-steps", "2", "--lm-rounds", "1"]
    )
    res = bench.bench_lm(args, logged.append)
    assert [r["method"] for r in res["rows"]] == ["mle", "agg"] and res["rows"][0][
        "ratio_vs_mle"
    ] == 1.0
    assert res["rows"][1]["tokens_per_s"] > 0 and 0 < res["rows"][1]["rare_vocab"] < 1
    # 39 windows / 8 per step
    assert res["data"] == "train_lm.py training split (tiny)" and res["window"] == 5
    # warm-up, then a rotated round
    assert [m.name for m, _ in calls] == ["mle", "agg", "agg", "agg", "mle", "mle"]
    # one observe per step, after a 5-step window
    assert calls[0][0].steps == 3 and calls[1][0].steps == 5 + 3
    assert not torch.equal(calls[1][1], calls[2][1])  # the step trains
    assert "| agg |" in logged[0]


def test_flag_mistakes_are_one_line_errors(capsys):
    for argv, message in (
        (["--tokens", "100", "--seq-len", "64"], "--tokens 100 must be a multiple of --seq-len 64"),
        (["--methods", "mle", "agq"], "--methods: invalid choice: 'agq'"),
        (["--sections", "head", "lm2"], "--sections: invalid choice: 'lm2'"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
        (["--vocab", "8192", "1"], "argument --vocab: must be >= 2, got 1"),
        (["--lm-alpha", "nan"], "argument --lm-alpha: must be >= 0, got nan"),
        (["--lm-alpha", "inf"], "argument --lm-alpha: must be >= 0, got inf"),
        (["--tokens", "4k"], "argument --tokens: invalid int value: '4k'"),
        (["--threads", "-1"], "argument --threads: must be >= 0, got -1"),
        (["--sections"], "argument --sections: expected at least one argument"),
        (["--out", ""], "--out must name a folder"),
    ],
)
def test_bad_flags_end_in_one_argparse_line_before_any_measurement(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu"] + flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_unusable_paths_and_memory_end_in_one_line(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for flags, message in [
        (["--out", str(a_file)], "--out: cannot create the folder"),
        (["--out", str(a_file / "x")], "(Not a directory)"),
        (["--results", str(tmp_path)], "not a regular file"),
        (["--results", str(a_file / "x.json")], "--results: cannot create the folder"),
    ]:
        with pytest.raises(SystemExit) as e:
            bench.main(["--device", "cpu", "--sections", "head"] + flags)
        assert e.value.code == 2 and message in capsys.readouterr().err, flags
    no_memory = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")
    monkeypatch.setattr(bench, "bench_head", mock.Mock(side_effect=no_memory))
    argv = ["--device", "cpu", "--sections", "head", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match="out of memory: try a smaller --vocab"):
        bench.main(argv)
    monkeypatch.setattr(bench, "bench_head", mock.Mock(side_effect=RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # only the allocators' errors are reworded
        bench.main(argv)
