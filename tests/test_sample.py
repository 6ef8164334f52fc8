"""tools.sample: text from an LM run folder, translations from an NMT run folder, the LM exported to
transformers."""

import os

import pytest
import torch

import train_lm
import train_nmt
from tools import sample


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory, corpus, lm_tiny):
    out = str(tmp_path_factory.mktemp("s") / "lm")
    train_lm.main(
        [
            "--data-dir",
            corpus["data"],
            "--cache-dir",
            corpus["cache"],
            "--out",
            out,
            *lm_tiny,
            "--max-steps",
            "3",
            "--eval-interval",
            "3",
        ]
    )
    return out


def test_greedy_sampling_is_the_models_greedy_continuation(lm_folder, capsys):
    texts = sample.main(
        [
            lm_folder,
            "--prompt",
            "Abc de",
            "--temperature",
            "0",
            "--num-samples",
            "2",
            "--max-new-tokens",
            "12",
            "--device",
            "cpu",
        ]
    )
    model, tok, _ = sample.load(lm_folder, "last", "cpu")
    ids = tok.encode("Abc de").ids
    greedy = model.generate(torch.tensor([ids]), 12)[0].tolist()
    assert texts == [tok.decode(greedy)] * 2 and texts[0] in capsys.readouterr().out
    a = sample.main(
        [lm_folder, "--seed", "1", "--max-new-tokens", "8", "--num-samples", "1", "--device", "cpu"]
    )
    b = sample.main(
        [lm_folder, "--seed", "1", "--max-new-tokens", "8", "--num-samples", "1", "--device", "cpu"]
    )
    assert a == b  # seeded


def test_export_to_transformers_gives_the_same_logits(lm_folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    sample.main([lm_folder, "--export-hf", str(tmp_path / "hf"), "--device", "cpu"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    model, _, _ = sample.load(lm_folder, "last", "cpu")
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model.logits(x), rtol=1e-4, atol=1e-4)
    assert os.path.exists(tmp_path / "hf" / "tokenizer.json")
    # the model's own <|endoftext|> id as bos / eos / pad, in the config and the generation config
    _, tok, _ = sample.load(lm_folder, "last", "cpu")
    eos = tok.token_to_id("<|endoftext|>")
    gen = transformers.GenerationConfig.from_pretrained(str(tmp_path / "hf"))
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (
        eos,
        eos,
        eos,
    )
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (eos, eos, eos)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).eos_token_id == eos
    # generate() stops at the model's end of text: a model made to predict it at once ends after one
    # token
    with torch.no_grad():
        u = torch.zeros(hf.config.n_embd)
        u[0] = 1.0
        hf.transformer.ln_f.weight.zero_()
        hf.transformer.ln_f.bias.copy_(u)  # every position's feature is u
        hf.transformer.wte.weight[eos] = 10 * u  # so <|endoftext|> has the largest logit
    out = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10, do_sample=False)
    assert out[0].tolist() == [5, 6, 7, eos]


def test_export_never_writes_into_a_run_or_a_non_empty_folder(lm_folder, tmp_path):
    before = {
        n: open(os.path.join(lm_folder, n), "rb").read() for n in ("config.json", "tokenizer.json")
    }
    with pytest.raises(
        SystemExit, match=r"--export-hf .*: a run folder, whose config.json and tokenizer.json"
    ):
        sample.main([lm_folder, "--export-hf", lm_folder, "--device", "cpu"])
    assert {n: open(os.path.join(lm_folder, n), "rb").read() for n in before} == before
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match=r"--export-hf .*full: not empty \(1 entries\)"):
        sample.main([lm_folder, "--export-hf", str(tmp_path / "full"), "--device", "cpu"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        SystemExit, match=r"--export-hf .*file: is a file; give a new or empty folder"
    ):
        sample.main([lm_folder, "--export-hf", str(tmp_path / "file"), "--device", "cpu"])
    (tmp_path / "empty").mkdir()
    pytest.importorskip("transformers")
    sample.main(
        [lm_folder, "--export-hf", str(tmp_path / "empty"), "--device", "cpu"]
    )  # an empty folder is fine
    assert os.path.exists(tmp_path / "empty" / "config.json")


def test_an_nmt_run_translates_a_file(nmt_tiny, tmp_path, capsys):
    out = str(tmp_path / "nmt")
    train_nmt.main(
        [
            "--out",
            out,
            *nmt_tiny,
            "--max-steps",
            "2",
            "--eval-interval",
            "2",
            "--synthetic-size",
            "300",
        ]
    )
    (tmp_path / "in.txt").write_text("w1 w2 w3\nw4 w5\n")
    hyps = sample.main([out, "--file", str(tmp_path / "in.txt"), "--beam", "1", "--device", "cpu"])
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)
    with pytest.raises(SystemExit, match="no checkpoint"):
        sample.main([str(tmp_path / "none")])
    with pytest.raises(
        SystemExit, match=r"ckpt_best.pt: no checkpoint"
    ):  # NMT runs keep no best checkpoint
        sample.main([out, "--checkpoint", "best"])


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--temperature", "inf"], r"--temperature inf: must be in \[0, 100\]"),
        (["--temperature", "-1"], "--temperature -1.0"),
        (["--beam", "0"], "--beam 0: must be >= 1"),
        (["--top-k", "-3"], "--top-k -3: must be >= 0"),
        (["--device", "foo"], "--device foo: unknown device"),
        (["--file", "/nonexistent/x.en"], "--file /nonexistent/x.en: no such file"),
        (["--export-hf", "/proc/x/y"], "--export-hf /proc/x/y: cannot create that folder"),
    ],
)
def test_bad_sampling_flags_end_in_one_line(lm_folder, flags, match):
    with pytest.raises(SystemExit, match=match):
        sample.main([lm_folder, "--device", "cpu", *flags])  # the last --device wins


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--logit-softcap", "30"], "--logit-softcap"),
        (["--untie-at", "0.5"], "--untie-at"),
        (["--output-bias"], "--output-bias"),
    ],
)
def test_export_refuses_what_gpt2_has_no_place_for(corpus, lm_tiny, tmp_path, flags, named):
    out = str(tmp_path / "lm")
    train_lm.main(
        [
            "--data-dir",
            corpus["data"],
            "--cache-dir",
            corpus["cache"],
            "--out",
            out,
            *lm_tiny,
            "--max-steps",
            "2",
            "--eval-interval",
            "2",
            *flags,
        ]
    )
    with pytest.raises(SystemExit, match=rf"trained with {named}, which GPT-2"):
        sample.main([out, "--export-hf", str(tmp_path / "hf"), "--device", "cpu"])
    assert not os.path.exists(tmp_path / "hf" / "config.json")
