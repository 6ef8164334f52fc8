"""Use a trained run: generate text with an LM run, translate with an NMT run, export an LM to
Hugging Face. From the repository root:

    python -m tools.sample out/lm-agg-s0 --prompt "The history of" --num-samples 3 \\
        --temperature 0.8 --top-k 50
    python -m tools.sample out/nmt-agg-s0 --file sentences.en  # one translation a line (or stdin)
    python -m tools.sample out/lm-agg-s0 --export-hf out/hf-lm-agg  # a GPT2LMHeadModel

A run folder holds ckpt.pt (ckpt_best.pt: --checkpoint best), config.json and tokenizer.json (or
its data cache's).
"""

import argparse
import os
import sys

import numpy as np
import torch
from tokenizers import Tokenizer

import data
import runlib
import train_lm
import train_nmt

EOT = data.LM_EOS  # <|endoftext|>: the end of each paragraph in an LM's training stream
# GPT-2's parameter names: ours
GPT2_NAMES = {
    "ln_1": "ln1",
    "ln_2": "ln2",
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.proj",
    "mlp.c_fc": "mlp.0",
    "mlp.c_proj": "mlp.2",
}


def load(run, checkpoint, device):
    """(model, tokenizer, config) of a run: its checkpoint, and its tokenizer.json (or its data
    cache's)."""
    ck = runlib.load_checkpoint(runlib.checkpoint_file(run, checkpoint))
    trainer = train_lm if ck["task"] == "lm" else train_nmt
    model = trainer.load_model(ck, device)
    cfg = dict(ck["config"], device=device)
    path = os.path.join(run, "tokenizer.json")
    if os.path.exists(path):
        tok = Tokenizer.from_file(path)
    elif cfg["task"] == "lm":
        tok = data.prepare_lm(cfg, runlib.quiet)["tokenizer"]
    else:
        tok = data.prepare_nmt(cfg, runlib.quiet).tokenizer
    return model, tok, cfg


def export_hf(args, model, tok, cfg):
    """The LM as a transformers GPT2LMHeadModel: the same pre-LN blocks, learned positions and tied
    embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    if cfg["task"] != "lm":
        raise SystemExit("--export-hf exports language models (train_lm.py runs)")
    # GPT-2 would silently compute other logits with any of these
    untie = "--untie-at" if cfg.get("untie_at") is not None else "--untie"
    used = {untie: model.untied, "--output-bias": model.out_bias is not None}
    used["--logit-softcap"] = model.softcap is not None
    extra = [flag for flag, on in used.items() if on]
    if extra:
        raise SystemExit(
            f"{args.run} was trained with {extra[0]}, which GPT-2 (tied embeddings, no output "
            "bias, no logit soft-cap) has no place for; export a run without it"
        )
    sd = model.cpu().state_dict()
    V, d = sd["tok_emb.weight"].shape
    # the model's own end of text as bos, eos and pad: generate() stops where a text ends
    eos = tok.token_to_id(EOT)
    shape = dict(vocab_size=V, n_positions=cfg["block_size"], n_embd=d, n_layer=cfg["n_layer"])
    shape.update(n_head=cfg["n_head"], n_inner=cfg["d_ff"], activation_function="gelu")
    shape.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5)
    config = GPT2Config(**shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    hf = GPT2LMHeadModel(config)  # tie_word_embeddings: GPT2Config's default
    new = {
        "wte.weight": sd["tok_emb.weight"],
        "wpe.weight": sd["pos_emb.weight"],
        "ln_f.weight": sd["ln_f.weight"],
        "ln_f.bias": sd["ln_f.bias"],
    }
    for i in range(cfg["n_layer"]):
        for theirs, mine in GPT2_NAMES.items():
            w = sd[f"blocks.{i}.{mine}.weight"]
            # nn.Linear stores (out, in), GPT-2's Conv1D (in, out)
            new[f"h.{i}.{theirs}.weight"] = w if theirs.startswith("ln") else w.T
            new[f"h.{i}.{theirs}.bias"] = sd[f"blocks.{i}.{mine}.bias"]
    hf.transformer.load_state_dict({k: v.contiguous() for k, v in new.items()})
    hf.save_pretrained(args.export_hf)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT
    )
    hf_tok.save_pretrained(args.export_hf)
    print(f"wrote {args.export_hf}: GPT2LMHeadModel.from_pretrained({args.export_hf!r})")
    return hf


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.sample",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="a run folder of train_lm.py or train_nmt.py")
    p.add_argument(
        "--checkpoint", default="last", choices=["last", "best"], help="ckpt.pt or ckpt_best.pt"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--prompt", default="", help="LM: the text to continue (default: a new document)"
    )
    p.add_argument("--num-samples", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="0: no top-k filter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--file", help="NMT: source sentences, one per line (default: stdin)")
    p.add_argument("--beam", type=int, default=4, help="NMT: beam size (1: greedy)")
    p.add_argument("--export-hf", metavar="DIR", help="LM: write the model as a transformers GPT-2")
    args = p.parse_args(argv)
    ranges = dict(temperature=(0, 100), num_samples=(1, None), max_new_tokens=(0, None))
    ranges.update(top_k=(0, None), beam=(1, None), seed=(0, None))
    runlib.check_ranges(vars(args), ranges)
    runlib.check_device(args.device)
    path = runlib.checkpoint_file(args.run, args.checkpoint)
    if not os.path.exists(path):
        raise SystemExit(
            f"{path}: no checkpoint; pass a run folder written by train_lm.py or train_nmt.py"
        )
    out = args.export_hf
    refusal = out and export_refusal(out)
    if refusal:
        example = os.path.normpath(out) + "-hf"
        raise SystemExit(
            f"--export-hf {out}: {refusal}; give a new or empty folder, e.g. {example}"
        )
    if out:  # made before the model is loaded: one line when it cannot be
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"--export-hf {out}: cannot create that folder ({e.strerror})")
    if args.file and not os.path.isfile(args.file):
        raise SystemExit(f"--file {args.file}: no such file (source sentences, one a line)")
    model, tok, cfg = load(args.run, args.checkpoint, args.device)
    if out:
        return export_hf(args, model, tok, cfg)
    if cfg["task"] == "nmt":  # translate each line of --file (or stdin)
        source = open(args.file, encoding="utf-8") if args.file else sys.stdin
        lines = source.read().splitlines()
        src = [np.asarray(tok.encode(line.strip()).ids, dtype=np.int64) for line in lines]
        hyps = train_nmt.translate(model, src, args.device, beam=args.beam, lenpen=cfg["lenpen"])
        out = [data.decode(tok, h) for h in hyps]
        for line in out:
            print(line)
        return out
    # the prompt, or a document's start
    ids = tok.encode(args.prompt).ids if args.prompt else [tok.token_to_id(EOT)]
    x = torch.tensor([ids], device=args.device)  # int64
    torch.manual_seed(args.seed)
    texts = []
    for _ in range(args.num_samples):
        y = model.generate(x, args.max_new_tokens, args.temperature, args.top_k)
        texts.append(tok.decode(y[0].tolist()))
        print(texts[-1] + "\n---------------", flush=True)
    return texts


def export_refusal(out):
    """Why --export-hf may not write into `out` (never into a run folder, never over files), or
    None."""
    if os.path.isfile(out):
        return "is a file"
    if os.path.exists(os.path.join(out, "ckpt.pt")) or runlib.run_config(out):
        return "a run folder, whose config.json and tokenizer.json the export would replace"
    if os.path.isdir(out) and os.listdir(out):
        return f"not empty ({len(os.listdir(out))} entries)"


if __name__ == "__main__":
    main()
