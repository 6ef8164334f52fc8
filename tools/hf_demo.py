"""A small GPT-2 trained from scratch on the offline corpus by the HF Trainer with an agg.py method
(tools/hf_agg.py).

python -m tools.hf_demo --method agg --max-steps 300      # -> out/hf-agg
# continue from the last checkpoint in --out
python -m tools.hf_demo --method agg --resume
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import agg
import train_lm
from data import prepare_lm
from tools import hf_agg


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.hf_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--method", default="agg", choices=list(agg.METHODS))
    p.add_argument(
        "--rare-share", type=float, default=0.2, help="AGG family: rare share of the vocabulary"
    )
    p.add_argument("--out", default="out/hf-agg")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    data = prepare_lm(train_lm.make_config(device="cpu"))
    V = data["vocab_size"]
    T = 128
    ids = data["ids"]["train"]
    model_shape = dict(block_size=T, d_model=128, n_layer=4, n_head=4, d_ff=512, device="cpu")
    train_lm.check_memory(model_shape, V, args.batch)
    blocks = [torch.from_numpy(ids[s : s + T].astype("int64")) for s in range(0, len(ids) - T, T)]
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=V,
        n_positions=T,
        n_embd=128,
        n_layer=4,
        n_head=4,
        bos_token_id=data["eos_id"],
        eos_token_id=data["eos_id"],
    )
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.max_steps,
        seed=0,
        per_device_train_batch_size=args.batch,
        learning_rate=2e-3,
        gradient_accumulation_steps=args.accum,
        warmup_steps=30,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        logging_steps=10,
        save_steps=100,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    train = [{"input_ids": b, "labels": b} for b in blocks]
    trainer = Trainer(model=model, args=training_args, train_dataset=train)
    special_ids = [data["eos_id"], data["pad_id"]]
    hf_agg.patch_trainer(
        trainer,
        args.method,
        counts=data["counts"],
        special_ids=special_ids,
        rare_share=args.rare_share,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"done: {args.out}; method state in {args.out}/checkpoint-*/{hf_agg.METHOD_STATE}")


if __name__ == "__main__":
    main()
