"""tools.hf_agg.AGGTrainer against transformers itself: `mle` equals GPT-2's own loss and gradients,
gradient accumulation gives the gradient of one big batch exactly, stop + resume gives the
uninterrupted run."""

import inspect

import pytest
import torch

import agg

transformers = pytest.importorskip("transformers")
hf_agg = pytest.importorskip("tools.hf_agg")

V, T = 50, 12


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=V,
        n_positions=T,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def dataset(n=8, seed=0):
    """Rows of different lengths (labels -100 past the end), so micro-batches hold different numbers
    of targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, V, (T,), generator=g)
        labels = ids.clone()
        labels[3 + (5 * i) % (T - 3) :] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def test_mle_equals_the_models_own_loss_and_gradients():
    model = tiny_gpt2()
    batch = dataset(4)
    ids = torch.stack([r["input_ids"] for r in batch])
    labels = torch.stack([r["labels"] for r in batch])
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    loss = agg.build_method("mle", V).loss(hidden[:, :-1], model.lm_head.weight, labels[:, 1:])
    loss.backward()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-7, msg=n)


def train(tmp_path, method_name, batch, accum, steps, lr=1.0, resume=False, save_steps=100, **hp):
    model = tiny_gpt2()
    method = agg.build_method(method_name, V, **hp)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        learning_rate=lr,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=0.0,
        save_steps=save_steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    trainer = hf_agg.AGGTrainer(model=model, args=args, train_dataset=dataset(8), method=method)
    trainer.train(resume_from_checkpoint=True if resume else None)
    return model, method, trainer


@pytest.mark.parametrize("method_name", ["mle", "agg"])
def test_gradient_accumulation_gives_the_gradient_of_one_big_batch(tmp_path, method_name):
    """One SGD step (lr 1, no clipping): the weight change is minus the gradient of the step."""
    hp = dict(alpha=0.5, window=1) if method_name == "agg" else {}
    before = {n: p.detach().clone() for n, p in tiny_gpt2().named_parameters()}
    big, m_big, _ = train(tmp_path / "big", method_name, batch=4, accum=1, steps=1, **hp)
    acc, m_acc, _ = train(tmp_path / "acc", method_name, batch=2, accum=2, steps=1, **hp)
    assert m_big.steps == m_acc.steps == 1  # observe once per optimizer step
    if method_name == "agg":
        assert torch.equal(m_big.appearances, m_acc.appearances)
    moved = False
    for (n, a), (_, b) in zip(big.named_parameters(), acc.named_parameters()):
        torch.testing.assert_close(
            a.detach() - before[n], b.detach() - before[n], rtol=1e-5, atol=1e-7, msg=n
        )
        moved |= not torch.equal(a.detach(), before[n])
    assert moved


def test_stop_and_resume_gives_the_uninterrupted_run(tmp_path):
    hp = dict(alpha=0.4, window=3)
    full, m_full, _ = train(tmp_path / "full", "agg", batch=2, accum=2, steps=4, lr=0.1, **hp)
    train(tmp_path / "split", "agg", batch=2, accum=2, steps=2, lr=0.1, save_steps=2, **hp)
    assert (tmp_path / "split" / "checkpoint-2" / hf_agg.METHOD_STATE).exists()
    resumed, m_res, trainer = train(
        tmp_path / "split", "agg", batch=2, accum=2, steps=4, lr=0.1, resume=True, **hp
    )
    assert m_res.steps == 4 and torch.equal(m_res.appearances, m_full.appearances)
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)
    logged = [r for r in trainer.state.log_history if "agg/nll" in r]
    assert logged and "agg/rare_fraction" in logged[-1]


def tiny(name, **kw):
    """A tiny random causal LM of a transformers architecture (tied embeddings, no dropout)."""
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=True,
        **kw,
    )
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(cfg).eval()


def trainer_loss(model, ids, labels, tmp_path):
    """The training loss of AGGTrainer with mle (train mode: evaluation is the stock Trainer's)."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = hf_agg.AGGTrainer(model=model, args=args, method=agg.build_method("mle", V))
    return trainer.compute_loss(model.train(), {"input_ids": ids, "labels": labels})


@pytest.mark.parametrize(
    "name, kw",
    [
        ("Llama", {}),
        ("Cohere", dict(logit_scale=0.25)),
        ("Gemma2", dict(final_logit_softcapping=None, head_dim=8)),
        # a cap that bites
        ("Gemma2", dict(final_logit_softcapping=0.05, head_dim=8)),
    ],
)
def test_the_trainers_loss_is_the_models_own(tmp_path, name, kw):
    model = tiny(name, **kw)
    batch = dataset(4)
    ids, labels = (
        torch.stack([r["input_ids"] for r in batch]),
        torch.stack([r["labels"] for r in batch]),
    )
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels).loss
        ours = trainer_loss(model, ids, labels, tmp_path)
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-6)


def test_a_soft_capped_models_gradients_are_its_own(tmp_path):
    """Gemma 2 caps its logits (C tanh(logits / C)): under MLE the trainer's gradients are the
    model's own loss's."""
    model = tiny("Gemma2", final_logit_softcapping=0.05, head_dim=8).train()
    batch = dataset(2)
    ids, labels = (
        torch.stack([r["input_ids"] for r in batch]),
        torch.stack([r["labels"] for r in batch]),
    )
    own = torch.autograd.grad(model(input_ids=ids, labels=labels).loss, list(model.parameters()))
    ours = torch.autograd.grad(trainer_loss(model, ids, labels, tmp_path), list(model.parameters()))
    for a, b in zip(ours, own):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_resume_skips_a_checkpoint_without_the_method_state(tmp_path, capsys):
    for step, complete in ((2, True), (4, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / hf_agg.METHOD_STATE).write_bytes(b"")
    assert hf_agg.last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert (
        "skipping" in capsys.readouterr().out
        and hf_agg.last_complete_checkpoint(str(tmp_path / "none")) is None
    )


def test_after_step_runs_after_each_optimizer_step(tmp_path):
    """center subtracts the mean row of the tied output matrix after every step; freeze-rare keeps
    its rows."""
    model, _, _ = train(tmp_path / "c", "center", batch=2, accum=1, steps=2, lr=0.1)
    assert model.get_output_embeddings().weight.mean(0).abs().max() < 1e-6
    start = tiny_gpt2().get_output_embeddings().weight.detach().clone()
    counts = torch.arange(V, 0, -1)  # token V-1 rarest
    model, method, _ = train(
        tmp_path / "f", "freeze-rare", batch=2, accum=1, steps=2, lr=0.1, counts=counts
    )
    frozen = method.rare_mask()
    assert frozen.any() and torch.equal(
        model.get_output_embeddings().weight.detach()[frozen], start[frozen]
    )


def test_the_recipe_needs_agg_py_only():
    """hf_agg uses agg.py and transformers only (none of the project's other modules)."""
    code = inspect.getsource(hf_agg)
    assert "train_lm" not in code and "prepare_lm" not in code and "runlib" not in code


def test_a_patched_stock_trainer_trains_like_aggtrainer_and_evaluates_as_the_stock_one(tmp_path):
    """patch_trainer: the method named, its window the Trainer's steps per epoch; evaluate() before
    training and compute_metrics see the stock Trainer's loss and logits."""
    counts = torch.bincount(
        torch.stack([r["labels"] for r in dataset(8)]).clamp(min=0).reshape(-1), minlength=V
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "p"),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=0.0,
        save_steps=100,
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        eval_strategy="steps",
        eval_steps=1,
        eval_on_start=True,
        per_device_eval_batch_size=4,
    )
    seen = []

    def metrics(prediction):
        seen.append(prediction.predictions.shape)
        return {"seen": 1.0}

    model = tiny_gpt2()
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=dataset(8),
        eval_dataset=dataset(4),
        compute_metrics=metrics,
    )
    assert hf_agg.patch_trainer(trainer, "agg", counts=counts, rare_share=0.3) is trainer
    # before any step (AGG has seen no targets): the stock Trainer's evaluation
    before = trainer.evaluate()
    stock = transformers.Trainer(
        model=tiny_gpt2(), args=args, eval_dataset=dataset(4), compute_metrics=metrics
    )
    assert before["eval_loss"] == stock.evaluate()["eval_loss"]
    trainer.train()
    # 8 rows / (2 per micro-batch x 2 micro-batches): 2 steps an epoch
    assert trainer.method.hparams["window"] == 2
    assert trainer.method.steps == 2
    # the logits compute_metrics always gets
    assert seen and all(shape == (4, T, V) for shape in seen)
    reference, m_ref, _ = train(
        tmp_path / "r",
        "agg",
        batch=2,
        accum=2,
        steps=2,
        lr=0.1,
        alpha=trainer.method.hparams["alpha"],
        window=2,
    )
    assert torch.equal(m_ref.appearances, trainer.method.appearances)
    for (n, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)


def test_patch_trainer_refuses_what_is_not_a_trainer():
    with pytest.raises(TypeError, match="patch_trainer: give a transformers Trainer, not object"):
        hf_agg.patch_trainer(object(), "agg")
