"""AGG (or any agg.py method) in a Hugging Face transformers causal LM trained by the HF Trainer.

    python -m tools.hf_agg --method agg --max-steps 300      # a small GPT-2 from scratch on the offline corpus
    python -m tools.hf_agg --method agg --resume             # continue from the last checkpoint in --out

Copy everything above main (and agg.py) into your own code: it needs agg.py only (main, the demo, reads this
repository's corpus). AGGTrainer:
- runs the model without labels (`logits_to_keep=1` where it takes it: no full T x V logits) and gives its last hidden
  state, shifted as in the model's own loss (t predicts labels[t + 1], -100 ignored), to `method.loss`;
- observes the targets once per optimizer step (`get_batch_samples` holds all its micro-batches) and weights each
  micro-batch's mean loss by its share of the step's valid targets (all ranks'): the gradient is the step's mean;
- after each optimizer step calls `method.after_step` on the output weight (freeze-rare, center); saves the method's
  state (AGG's window) as `agg_method.pt` in every checkpoint and resumes from the newest checkpoint holding it;
- logs `method.stats` as `agg/...`; keeps lm_head's bias, a logit scale and final-logit soft-capping (Gemma 2).
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
        self.method, self.logit_scale = method, logit_scale(self.model)
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)  # Gemma 2: C tanh(logits / C)
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
            path = os.path.join(resume_from_checkpoint, METHOD_STATE)
            if not os.path.exists(path):
                raise ValueError(f"{path} is missing: not an AGGTrainer checkpoint; the method's state is not in it")
            self.method.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)


class AfterStep(TrainerCallback):  # method.after_step(output weight): on_step_end follows optimizer.step
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        head = self.trainer.accelerator.unwrap_model(self.trainer.model).get_output_embeddings()
        self.trainer.method.after_step(head.weight)


def logit_scale(model):
    """The factor the model applies to h W^T (+ b) to get its logits (before any soft-capping): 1, Cohere's
    logit_scale, or 1 / Granite's logits_scaling."""
    cfg = model.config
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    return scale


def last_complete_checkpoint(output_dir):
    """The newest checkpoint-N of output_dir that holds the method's state, or None; a newer one without it (the run
    stopped between the Trainer's save and the method's) is skipped, with a message."""
    found = sorted(((int(m.group(1)), d) for d in glob.glob(os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-*"))
                    if (m := re.search(r"-(\d+)$", d)) and os.path.isdir(d)), reverse=True)
    for step, folder in found:
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
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", default="none", help="experiment logging of the HF Trainer: none, tensorboard, wandb")
    args = p.parse_args(argv)
    data = prepare_lm(train_lm.make_config(device="cpu"))
    V, ids, T, seqs = data["vocab_size"], data["ids"]["train"], args.block_size, args.batch * args.accum
    if not 1 <= T <= len(ids) // 2:
        p.error(f"--block-size {T}: must be in [1, {len(ids) // 2}] (two blocks of this corpus at least)")
    train_lm.check_memory(dict(block_size=T, d_model=128, n_layer=4, n_head=4, d_ff=512, device="cpu"), V, args.batch)
    blocks = [torch.from_numpy(ids[s:s + T].astype("int64")) for s in range(0, len(ids) - T, T)]
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=128, n_layer=4, n_head=4,
                                       bos_token_id=data["eos_id"], eos_token_id=data["eos_id"]))
    method = agg.build_method(args.method, V, counts=data["counts"], special_ids=[data["eos_id"], data["pad_id"]],
                              steps_per_epoch=len(blocks) / seqs, tokens_per_step=seqs * T,
                              rare_share=args.rare_share if agg.agg_family(args.method) else None)
    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, seed=args.seed, per_device_train_batch_size=args.batch,
        learning_rate=2e-3, gradient_accumulation_steps=args.accum, warmup_steps=30, lr_scheduler_type="cosine",
        weight_decay=0.01, logging_steps=10, save_steps=100, report_to=args.report_to,
        use_cpu=not torch.cuda.is_available())
    trainer = AGGTrainer(model=model, args=training_args, method=method,
                         train_dataset=[{"input_ids": b, "labels": b} for b in blocks])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"done: {args.out}; method state in {args.out}/checkpoint-*/{METHOD_STATE}")


if __name__ == "__main__":
    main()
