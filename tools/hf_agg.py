"""AGG (or any agg.py method) in a Hugging Face transformers causal LM trained by the HF Trainer.

Copy agg.py and this file into your project (they need torch and transformers only). Patch a stock
Trainer:

    trainer = Trainer(model=model, args=args, train_dataset=train)
    hf_agg.patch_trainer(trainer, "agg", counts=train_counts, rare_share=0.2, special_ids=[eos_id])
    trainer.train()

or build `hf_agg.AGGTrainer(model=..., args=..., method="agg", method_kwargs=dict(counts=...))`. A
method given by name is built when training starts: its window K is the Trainer's optimizer steps
per epoch and tokens_per_step the training split's targets per step (counts.sum() / K); pass a built
method to choose them yourself.

Training: the model runs without labels (`logits_to_keep=1`: no T x V logits) and its last hidden
state, shifted as in the model's own loss, goes to `method.loss` with the output embedding; each
optimizer step's targets are observed once and each micro-batch weighted by its share of them (the
gradient is the step's mean); `method.after_step` runs after each optimizer step; the method's state
is saved in every checkpoint and restored on resume; `method.stats` are logged as `agg/...`;
lm_head's bias, the model's logit scale and final-logit soft-capping are kept. Evaluation
(`evaluate()`, `eval_on_start`, `predict`) is the stock Trainer's: the model's own loss and logits,
so `compute_metrics` sees what it always sees. An untied model (e.g. LlamaConfig's default) trains
with the gates on its output projection `lm_head.weight`, said once."""

import glob
import inspect
import os
import re

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import agg

METHOD_STATE = "agg_method.pt"


class AGGTrainerMixin:
    """The Trainer methods that train with an agg.py method; mixed into a Trainer class by
    patch_trainer."""

    loss_is_scaled_for_ga = (
        True  # compute_loss already weights each micro-batch by its share of the step
    )

    def setup_method(self, method, method_kwargs):
        """`method`: a name of agg.METHODS (built when training starts) or a built method."""
        self.method = None if isinstance(method, str) else method
        self.method_name = method
        self.method_kwargs = dict(method_kwargs)
        cfg = self.model.config
        # logits = scale * (h W^T + b), scale: Cohere's logit_scale, 1 / Granite's logits_scaling,
        # or 1
        scale = float(getattr(cfg, "logit_scale", None) or 1)
        self.logit_scale = scale / float(getattr(cfg, "logits_scaling", 0) or 1)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2: C tanh(logits / C)
        self._step_targets = None  # valid targets in the current optimizer step, all ranks
        self.add_callback(AfterStep(self))
        output = self.model.get_output_embeddings().weight
        if output is not self.model.get_input_embeddings().weight:
            print(
                "hf_agg: the model's embeddings are untied: the method gates lm_head.weight, the "
                "output "
                "projection; the input embedding trains as usual"
            )

    def build_method(self):
        """The method named in setup_method, its window one epoch of this Trainer's optimizer
        steps."""
        kwargs = dict(self.method_kwargs)
        accum = self.args.gradient_accumulation_steps
        steps_per_epoch = max(1, len(self.get_train_dataloader()) // accum)
        kwargs.setdefault("steps_per_epoch", steps_per_epoch)
        if kwargs.get("counts") is not None and kwargs.get("tokens_per_step") is None:
            total = float(torch.as_tensor(kwargs["counts"]).double().sum())
            kwargs["tokens_per_step"] = total / kwargs["steps_per_epoch"]
        vocab_size = self.model.get_output_embeddings().weight.shape[0]
        return agg.build_method(self.method_name, vocab_size, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples:  # one optimizer step's micro-batches: observe their targets once
            targets = torch.cat([b["labels"][:, 1:].reshape(-1) for b in batch_samples]).to(device)
            n = (targets != -100).sum()
            if self.args.world_size > 1:
                n = self.accelerator.reduce(n, "sum")
            self._step_targets = n.clamp(min=1)
            self.method.observe(targets)  # agg gathers every rank's targets itself
        return batch_samples, num_items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:  # evaluation: the stock Trainer's loss and outputs
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        unwrapped = self.accelerator.unwrap_model(model)
        if "logits_to_keep" in inspect.signature(unwrapped.forward).parameters:
            inputs["logits_to_keep"] = 1
        outputs = model(**inputs, output_hidden_states=True)
        hidden = outputs.hidden_states[-1][:, :-1]  # lm_head's input; position t predicts t + 1
        targets = labels[:, 1:]
        head = unwrapped.get_output_embeddings()
        bias = getattr(head, "bias", None)
        if self.logit_scale != 1.0:  # logits = scale * (h W^T + b): scale the features and the bias
            hidden = hidden * self.logit_scale
            bias = None if bias is None else bias * self.logit_scale
        loss = self.method.loss(hidden, head.weight, targets, bias=bias, softcap=self.softcap)
        if (
            self._step_targets is not None
        ):  # its share of the step's targets, x ranks (DDP averages)
            share = (targets != -100).sum() / self._step_targets
            loss = loss * share * self.args.world_size
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self.method is not None and self.method.steps:
            stats = {f"agg/{k}": v for k, v in self.method.stats.items()}
            logs = {**logs, **stats}
        super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        folder = os.path.join(self._get_output_dir(trial), name)
        if self.args.should_save:
            torch.save(self.method.state_dict(), os.path.join(folder, METHOD_STATE))

    def train(self, resume_from_checkpoint=None, **kwargs):
        if self.method is None:
            self.method = self.build_method()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
        if resume_from_checkpoint:
            path = os.path.join(
                resume_from_checkpoint, METHOD_STATE
            )  # missing: not an AGGTrainer checkpoint
            self.method.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)


class AGGTrainer(AGGTrainerMixin, Trainer):
    """The HF Trainer whose training loss is an agg.py method's (`method`: a name or a built
    method)."""

    def __init__(self, *args, method, method_kwargs=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.setup_method(method, method_kwargs or {})


def patch_trainer(trainer, method="agg", **method_kwargs):
    """Make a stock (or custom) Trainer train with an agg.py method, as AGGTrainer does; returns the
    trainer."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"patch_trainer: give a transformers Trainer, not {type(trainer).__name__}")
    base = type(trainer)
    trainer.__class__ = type(f"AGG{base.__name__}", (AGGTrainerMixin, base), {})
    trainer.setup_method(method, method_kwargs)
    return trainer


# method.after_step(output weight): on_step_end follows optimizer.step
class AfterStep(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.trainer.method.after_step(model.get_output_embeddings().weight)


def last_complete_checkpoint(output_dir):
    """The newest checkpoint-N of output_dir holding the method's state, or None (a newer one
    without it: skipped)."""
    pattern = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-*")
    found = [d for d in glob.glob(pattern) if re.search(r"-\d+$", d) and os.path.isdir(d)]
    for folder in sorted(found, key=lambda d: -int(d.rsplit("-", 1)[1])):
        if os.path.exists(os.path.join(folder, METHOD_STATE)):
            return folder
        print(
            f"AGGTrainer: skipping {folder}: it has no {METHOD_STATE} (the run stopped while "
            "saving it)"
        )
    return None
