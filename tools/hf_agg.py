"""AGG (or any agg.py method) in a Hugging Face transformers causal LM trained by the HF Trainer.

    python -m tools.hf_agg --method agg --max-steps 300      # a small GPT-2 from scratch on the offline corpus
    python -m tools.hf_agg --method agg --resume             # continue from the last checkpoint in --out

Everything above main needs agg.py only: copy it into your own code. AGGTrainer gives the model's last hidden state
(run without labels, `logits_to_keep=1`: no T x V logits), shifted as in the model's own loss, to `method.loss`;
observes each optimizer step's targets once and weights each micro-batch by its share of them (the gradient is the
step's mean); calls `method.after_step` after each optimizer step; saves the method's state in every checkpoint and
resumes from the newest one holding it; logs `method.stats` as `agg/...`; keeps lm_head's bias, the model's logit
scale and final-logit soft-capping.
"""
import argparse
import glob
import inspect
import os
import re

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import agg
import train_lm
from data import prepare_lm

METHOD_STATE = "agg_method.pt"


class AGGTrainer(Trainer):
    """HF Trainer whose training loss is `method.loss` on the tied output embedding (an agg.py method)."""

    loss_is_scaled_for_ga = True  # compute_loss already weights each micro-batch by its share of the step

    def __init__(self, *args, method, **kwargs):
        super().__init__(*args, **kwargs)
        self.method, cfg = method, self.model.config
        # logits = scale * (h W^T + b), scale: Cohere's logit_scale, 1 / Granite's logits_scaling, or 1
        self.logit_scale = float(getattr(cfg, "logit_scale", None) or 1) / float(getattr(cfg, "logits_scaling", 0) or 1)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2: C tanh(logits / C)
        self._step_targets = None  # valid targets in the current optimizer step, all ranks
        self.add_callback(AfterStep(self))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples:  # one optimizer step's micro-batches: count and observe its targets once
            targets = torch.cat([b["labels"][:, 1:].reshape(-1) for b in batch_samples]).to(device)
            n = (targets != -100).sum()
            self._step_targets = int(self.accelerator.reduce(n, "sum") if self.args.world_size > 1 else n)
            self.method.observe(targets)  # agg sums the counts over ranks itself
        return batch_samples, num_items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, inputs = inputs["labels"], {k: v for k, v in inputs.items() if k != "labels"}
        unwrapped = self.accelerator.unwrap_model(model)
        if "logits_to_keep" in inspect.signature(unwrapped.forward).parameters:
            inputs["logits_to_keep"] = 1
        outputs = model(**inputs, output_hidden_states=True)
        hidden, targets = outputs.hidden_states[-1][:, :-1], labels[:, 1:]  # lm_head's input; t predicts t + 1
        head = unwrapped.get_output_embeddings()  # tied with the input embedding
        bias = getattr(head, "bias", None)
        if self.logit_scale != 1.0:  # logits = scale * (h W^T + b): scale the features and the bias
            hidden, bias = hidden * self.logit_scale, None if bias is None else bias * self.logit_scale
        loss = self.method.loss(hidden, head.weight, targets, ignore_index=-100, bias=bias, softcap=self.softcap)
        if model.training and self._step_targets:  # its share of the step's targets, x ranks (DDP averages)
            loss = loss * ((targets != -100).sum() / self._step_targets) * self.args.world_size
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self.method.steps:
            logs = {**logs, **{f"agg/{k}": v for k, v in self.method.stats.items()}}
        super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            torch.save(self.method.state_dict(), os.path.join(folder, METHOD_STATE))

    def train(self, resume_from_checkpoint=None, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
        if resume_from_checkpoint:
            path = os.path.join(resume_from_checkpoint, METHOD_STATE)  # missing: not an AGGTrainer checkpoint
            self.method.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)


class AfterStep(TrainerCallback):  # method.after_step(output weight): on_step_end follows optimizer.step
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        head = self.trainer.accelerator.unwrap_model(self.trainer.model).get_output_embeddings()
        self.trainer.method.after_step(head.weight)


def last_complete_checkpoint(output_dir):
    """The newest checkpoint-N of output_dir holding the method's state, or None (a newer one without it: skipped)."""
    found = [d for d in glob.glob(os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-*")) if re.search(r"-\d+$", d)]
    for folder in sorted(filter(os.path.isdir, found), key=lambda d: -int(d.rsplit("-", 1)[1])):
        if os.path.exists(os.path.join(folder, METHOD_STATE)):
            return folder
        print(f"AGGTrainer: skipping {folder}: it has no {METHOD_STATE} (the run stopped while saving it)")
    return None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.hf_agg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="agg", choices=list(agg.METHODS))
    p.add_argument("--rare-share", type=float, default=0.2, help="AGG family: rare share of the vocabulary")
    p.add_argument("--out", default="out/hf-agg")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    data = prepare_lm(train_lm.make_config(device="cpu"))
    V, ids, T, seqs = data["vocab_size"], data["ids"]["train"], 128, args.batch * args.accum
    train_lm.check_memory(dict(block_size=T, d_model=128, n_layer=4, n_head=4, d_ff=512, device="cpu"), V, args.batch)
    blocks = [torch.from_numpy(ids[s:s + T].astype("int64")) for s in range(0, len(ids) - T, T)]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=128, n_layer=4, n_head=4,
                                       bos_token_id=data["eos_id"], eos_token_id=data["eos_id"]))
    method = agg.build_method(args.method, V, counts=data["counts"], special_ids=[data["eos_id"], data["pad_id"]],
                              steps_per_epoch=len(blocks) / seqs, tokens_per_step=seqs * T,
                              rare_share=args.rare_share if agg.agg_family(args.method) else None)
    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, seed=0, per_device_train_batch_size=args.batch,
        learning_rate=2e-3, gradient_accumulation_steps=args.accum, warmup_steps=30, lr_scheduler_type="cosine",
        weight_decay=0.01, logging_steps=10, save_steps=100, report_to="none", use_cpu=not torch.cuda.is_available())
    trainer = AGGTrainer(model=model, args=training_args, method=method,
                         train_dataset=[{"input_ids": b, "labels": b} for b in blocks])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"done: {args.out}; method state in {args.out}/checkpoint-*/{METHOD_STATE}")


if __name__ == "__main__":
    main()
