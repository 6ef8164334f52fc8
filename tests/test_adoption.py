"""agg.py as a practitioner adopts it (README, "agg.py in your training loop"): AGG called inside a
nanoGPT-shaped model's forward under DDP (gloo, 2 processes) and torch.compile against one eager
process; a step's targets fed per micro-batch or whole; no host synchronisation in a steady-state
step; F.linear_cross_entropy's arguments."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import agg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, D, T = 48, 16, 12


class TinyGPT(nn.Module):
    """nanoGPT's shape: wte tied to lm_head, a block, ln_f, forward(idx, targets) -> (logits,
    loss)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(T, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.wte.weight = self.lm_head.weight
        self.method = None  # README's change to nanoGPT's model.py: the method, set by train.py

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = self.ln_f(x + self.mlp(x))
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        return None, self.method.loss(x, self.lm_head.weight, targets)  # AGG inside forward


def zipf_batches(steps, accum, seqs):
    """(steps * accum, seqs, T + 1) token ids with a long tail, so that AGG has a rare group."""
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, V + 1, dtype=torch.float64)
    probs = 1 / ranks**1.1
    draws = torch.multinomial(probs, steps * accum * seqs * (T + 1), replacement=True, generator=g)
    return draws.reshape(steps * accum, seqs, T + 1)


def train_tiny(data, rank=0, world=1, compile_model=False, accum=2):
    """nanoGPT's loop on `data`, this rank's share of each micro-batch; returns (losses, lm_head
    weight)."""
    torch.manual_seed(0)
    model = TinyGPT()
    counts = torch.bincount(data[..., 1:].reshape(-1), minlength=V)
    tokens_per_step = data.shape[1] * T * accum  # over all ranks
    model.method = agg.build_method(
        "agg", V, counts=counts, tokens_per_step=tokens_per_step, rare_share=0.3
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.method.attach(opt, model.lm_head.weight)  # ends each step: the window, after_step
    forward = model
    if world > 1:
        forward = nn.parallel.DistributedDataParallel(model)
    if compile_model:
        forward = torch.compile(forward)
    share = data.shape[1] // world
    losses = []
    for micro in range(len(data)):
        batch = data[micro, rank * share : (rank + 1) * share]
        last = micro % accum == accum - 1
        if world > 1:
            # DDP syncs the gradient on the last micro-batch
            forward.require_backward_grad_sync = last
        _, loss = forward(batch[:, :-1], batch[:, 1:])
        (loss / accum).backward()
        losses.append(loss.detach())
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.stack(losses), model.lm_head.weight.detach().clone(), model.method


def _ddp_worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    losses, weight, method = train_tiny(zipf_batches(4, 2, 4), rank, world)
    if rank == 0:
        torch.save({"losses": losses, "weight": weight, "appearances": method.appearances}, out)
    dist.destroy_process_group()


def test_nanogpt_shaped_model_with_agg_in_forward_under_ddp_and_compile_equals_one_process(
    tmp_path,
):
    data = zipf_batches(4, 2, 4)
    losses, weight, method = train_tiny(data)
    assert bool(method.step_rare().any()), "the test needs a rare group"
    out = tmp_path / "rank0.pt"
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2)
    ddp = torch.load(out, weights_only=True)
    # rank 0's losses are its half's means; their average over ranks is not logged, so compare the
    # weights, which every rank shares, and the window both ranks gathered
    assert torch.equal(ddp["appearances"], method.appearances)
    torch.testing.assert_close(ddp["weight"], weight, rtol=1e-5, atol=1e-6)
    compiled_losses, compiled_weight, _ = train_tiny(data, compile_model=True)
    torch.testing.assert_close(compiled_losses, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_weight, weight, rtol=1e-5, atol=1e-6)


def micro_batches(step, n=3):
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, V, (2, 5), generator=g) % (V // (1 + step % 3)) for _ in range(n)]


@pytest.mark.parametrize("feed", ["observe whole", "observe first", "observe each", "loss counts"])
def test_a_steps_targets_enter_the_window_once_however_they_arrive(feed):
    """With attach(), the window counts optimizer steps, not micro-batches (observe per micro-batch
    made the rare group 46-94% of the vocabulary instead of 20%); gates from a step's targets
    observed before its first loss equal the paper's loop bit for bit; loss() counting its own
    targets keeps the window exact."""
    torch.manual_seed(1)
    h, w = torch.randn(2, 5, D), torch.randn(V, D)
    paper = agg.build_method("agg", V, alpha=0.5, window=3)
    method = agg.build_method("agg", V, alpha=0.5, window=3)
    weight = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([weight], lr=0.0)
    method.attach(opt, weight)
    for step in range(6):
        mbs = micro_batches(step)
        paper.observe(torch.cat(mbs))
        if feed in ("observe whole", "observe first"):
            method.observe(torch.cat(mbs) if feed == "observe whole" else mbs[0])
        for k, y in enumerate(mbs):
            if feed == "observe each" or (feed == "observe first" and k > 0):
                method.observe(y)
            method.loss(h, weight, y).backward()
        if feed == "observe whole":  # the paper's gates, bit for bit
            for ours, theirs in zip(method.step_gates(), paper.step_gates()):
                assert torch.equal(ours, theirs)
        opt.step()
        assert method.steps == paper.steps == step + 1
        assert torch.equal(method.appearances, paper.appearances)
    assert torch.equal(method.rare_mask(), paper.rare_mask())


def test_observe_after_loss_counted_the_step_is_refused():
    method = agg.build_method("agg", V, alpha=0.5, window=3)
    weight = torch.nn.Parameter(torch.randn(V, D))
    method.attach(torch.optim.SGD([weight], lr=0.1), weight)
    y = torch.randint(0, V, (4,))
    method.loss(torch.randn(4, D), weight, y)
    with pytest.raises(ValueError, match="observe\\(\\) after loss\\(\\) counted"):
        method.observe(y)


def test_attach_runs_after_step_once_per_optimizer_step():
    method = agg.build_method("center", V)
    weight = torch.nn.Parameter(torch.randn(V, D) + 3.0)
    opt = torch.optim.SGD([weight], lr=0.1)
    method.attach(opt, weight)
    method.loss(torch.randn(4, D), weight, torch.randint(0, V, (4,))).backward()
    opt.step()
    assert method.steps == 1
    # mu-centering ran
    torch.testing.assert_close(weight.detach().mean(0), torch.zeros(D), atol=1e-5, rtol=0)


class CountSyncs(TorchDispatchMode):
    """Counts the calls that make the host wait for the device: a value read (.item(), .tolist(),
    int()), nonzero, boolean indexing, and the ops whose output size depends on the data."""

    SYNCING = (
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::masked_select",
        "aten::unique",
        "aten::_unique2",
        "aten::bincount",
        "aten::repeat_interleave",
        "aten::is_nonzero",
        "aten::equal",
    )

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        is_bool_index = name == "aten::index" and any(
            t is not None and t.dtype == torch.bool for t in args[1]
        )
        if name in self.SYNCING or is_bool_index:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "name", ["mle", "agg", "agg-static", "agg-continuous", "agg-prefill", "ul+agg", "agps"]
)
@pytest.mark.parametrize("attached", [False, True])
def test_no_host_synchronisation_in_a_steady_state_step(name, attached):
    hp = dict(alpha=0.5, window=3) if agg.agg_family(name) else {}
    method = agg.build_method(name, V, counts=torch.arange(V) + 1, **hp)
    weight = torch.nn.Parameter(torch.randn(V, D))
    opt = torch.optim.SGD([weight], lr=0.1)
    if attached:
        method.attach(opt, weight)
    for step in range(6):
        y = torch.randint(0, V, (2, 6))
        y[0, 0] = -100  # an ignored position
        h = torch.randn(2, 6, D, requires_grad=True)
        with CountSyncs() as counter:
            if not attached:
                method.observe(y)
            method.loss(h, weight, y).backward()
            opt.step()
            if not attached:
                method.after_step(weight)
            opt.zero_grad()
        if step >= 4:  # past the first calls' checks (agg-prefill: its window is full from step 3)
            assert counter.calls == [], f"step {step}: {counter.calls}"


@pytest.mark.parametrize("name", ["mle", "agg"])
def test_the_loss_compiles_into_one_graph(name):
    method = agg.build_method(name, V, **(dict(alpha=0.5, window=3) if name == "agg" else {}))
    y = torch.randint(0, V, (20,))
    y[3] = -100
    method.observe(y)
    h = torch.randn(20, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    eager = method.loss(h, w, y)
    eager_grads = torch.autograd.grad(eager, (h, w))
    compiled = torch.compile(method.loss, fullgraph=True)(h, w, y)
    compiled_grads = torch.autograd.grad(compiled, (h, w))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_reductions_follow_f_cross_entropy():
    torch.manual_seed(3)
    h = torch.randn(3, 5, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (3, 5))
    y[1, 2] = -100
    c = torch.rand(3, 5, dtype=torch.float64)  # a weight per position, as a user of "none" applies
    mle = agg.build_method("mle", V)
    ours = mle.loss(h, w, y, reduction="none")
    reference = F.cross_entropy((h @ w.T).transpose(1, 2), y, reduction="none")
    torch.testing.assert_close(ours, reference)
    ours_grads = torch.autograd.grad((ours * c).sum(), (h, w))
    reference_grads = torch.autograd.grad((reference * c).sum(), (h, w))
    for a, b in zip(ours_grads, reference_grads):
        torch.testing.assert_close(a, b)
    total = mle.loss(h, w, y, reduction="sum")
    torch.testing.assert_close(total, reference.sum())
    gated = agg.build_method("agg", V, alpha=0.5, window=3)
    gated.observe(y)
    per_position = gated.loss(h, w, y, reduction="none")
    grads_none = torch.autograd.grad(per_position.sum(), (h, w))
    grads_sum = torch.autograd.grad(gated.loss(h, w, y, reduction="sum"), (h, w))
    for a, b in zip(grads_none, grads_sum):  # the gates apply to each position's gradient alike
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="reduction must be"):
        mle.loss(h, w, y, reduction="avg")


def test_integer_ids_of_any_width_and_logits_named_as_such():
    torch.manual_seed(4)
    h, w = torch.randn(6, D), torch.randn(V, D)
    y = torch.randint(0, V, (6,))
    method = agg.build_method("mle", V)
    expected = method.loss(h, w, y)
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.uint16):
        assert torch.equal(method.loss(h, w, y.to(dtype)), expected)
    with pytest.raises(ValueError, match="are these logits"):
        method.loss(torch.randn(6, V), w, y)


def test_help_lists_every_method_and_its_hyper_parameters():
    text = agg.build_method.__doc__
    for name, cls in agg.METHODS.items():
        assert f"    {name}: " in text
        for key, default in cls.defaults.items():
            assert f"{key}={default!r}" in text


def test_hf_agg_imports_with_agg_alone(tmp_path):
    """A practitioner copies agg.py and hf_agg.py into their project: nothing else is needed to
    import them."""
    for name in ("agg.py", os.path.join("tools", "hf_agg.py")):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    code = "import hf_agg, agg; print(hf_agg.AGGTrainer.__name__, hf_agg.patch_trainer.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["AGGTrainer", "patch_trainer"]
