"""The fused head's Triton kernel (agg.fused_head_chunk) under Triton's CPU interpreter:
against a literal copy of agg._head_chunk's arithmetic (and that copy against agg._head_chunk
itself), and method.loss through it against the torch head."""

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: they run on CPU tensors

import pytest
import torch

import agg
import agg as fh

pytest.importorskip("triton")

R, V, BLOCK = 6, 300, 128  # V not a multiple of the block
SCALES = {}  # the largest errors seen, printed at the end (pytest -s)


# ----------------------------------------------------------------------------- the torch reference
def ref_gate_(grad, ys, col_gate, group_rows, group_gate):
    """agg._gate_, copied."""
    if group_rows is None:
        if col_gate is not None:
            grad.mul_(col_gate)
        return
    ones = torch.ones(grad.shape[1], dtype=grad.dtype, device=grad.device)
    col = ones if col_gate is None else col_gate
    group = ones if group_gate is None else group_gate
    pull = grad.gather(1, ys[:, None])
    gate = torch.where(group_rows[:, None], group, col)
    grad.mul_(gate)
    gated_pull = grad.gather(1, ys[:, None])
    kept = torch.where(group_rows[:, None], pull, gated_pull)
    grad.scatter_(1, ys[:, None], kept)


def reference(
    logits_mm,
    ys,
    valid,
    div,
    bias=None,
    gates=(None, None, None),
    smoothing=0.0,
    z_coef=0.0,
    softcap=None,
    mass_cols=None,
):
    """agg._head_chunk's arithmetic from the GEMM's output on: per-row (loss, nll, mass, log_z2),
    G (float32) and G * gate (float32, None when ungated)."""
    div = torch.where(valid, div, math.inf)[:, None]  # _head's row_div: inf on ignored rows
    logits = logits_mm.to(torch.float32, copy=True)  # agg: a fresh GEMM output
    if bias is not None:
        logits += bias
    if softcap:
        logits = logits.div_(softcap).tanh_()
        dcap = 1 - logits.square()
        logits.mul_(softcap)
    target_logit = logits.gather(1, ys[:, None]).squeeze(1)
    row_max = logits.amax(dim=1, keepdim=True)
    mean_logit = logits.mean(dim=1) if smoothing else None
    exp = logits.sub_(row_max).exp_()
    sum_exp = exp.sum(dim=1)
    lse = row_max.squeeze(1) + sum_exp.log()
    nll = lse - target_logit
    log_z2 = lse.square()
    loss = nll
    if smoothing:
        loss = (1 - smoothing) * nll + smoothing * (lse - mean_logit)
    if z_coef:
        loss = loss + z_coef * log_z2
    loss = torch.where(valid, loss, 0.0)
    nll = torch.where(valid, nll, 0.0)
    log_z2 = torch.where(valid, log_z2, 0.0)
    p = exp.div_(sum_exp[:, None] * div)
    mass = torch.zeros_like(loss)
    if mass_cols is not None:  # agg's (p @ mass_cols) * div, per row (0, not nan, on ignored rows)
        mass = torch.where(valid, (p @ mass_cols) * div.squeeze(1), 0.0)
    grad = p
    if z_coef:
        grad.mul_((1 + 2 * z_coef * lse)[:, None])
    div64 = div.double()
    grad.scatter_add_(1, ys[:, None], ((smoothing - 1.0) / div64).to(torch.float32))
    if smoothing:
        grad.sub_((smoothing / (logits_mm.shape[1] * div64)).to(torch.float32))
    if softcap:
        grad.mul_(dcap)
    col_gate, group_rows, group_gate = gates
    gated = None
    if col_gate is not None or (group_rows is not None and group_gate is not None):
        gated = grad.clone()
        ref_gate_(gated, ys, col_gate, group_rows, group_gate)
    return torch.stack([loss, nll, mass, log_z2]), grad, gated


# ----------------------------------------------------------------------------- inputs and checks
def make(dtype, seed=0, scale=4.0, per_row_div=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * scale).to(dtype)
    ys = torch.randint(0, V, (R,), generator=g)
    ys[1] = V - 1  # a target in the last, partial block
    logits[0, V - 5] = 4 * scale  # row 0's max in the last block (the online sum rescales)
    valid = torch.ones(R, dtype=torch.bool)
    valid[2] = False  # an ignored row
    div = torch.full((R,), float(valid.sum()))  # the mean's count
    if per_row_div:  # reduction "none": 1 / dL/dloss_i
        div = torch.rand(R, generator=g) * 3 + 0.25
    return logits, ys, valid, div


def gate_inputs(kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    col = torch.rand(V, generator=g)
    col[::3] = 1.0
    group = torch.rand(V, generator=g)
    rows = torch.zeros(R, dtype=torch.bool)
    rows[[0, 2, 3]] = True  # row 2 is ignored too
    return {
        "col": (col, None, None),
        "group": (None, rows, group),
        "both": (col, rows, group),
        "rows_col": (col, rows, None),
        "none_rows": (None, rows, None),
    }[kind]


def run(logits, ys, valid, div, **kw):
    out = logits.clone()
    ys = torch.where(valid, ys, -100)  # an ignored row's target is never read (ignore_index)
    stats, gated = fh.fused_head_chunk(out, ys, valid, div, block=BLOCK, **kw)
    return stats, out, gated


def rel(a, b):
    """Largest |a - b| over the largest |b| (per tensor), largest elementwise relative error."""
    a, b = a.double(), b.double()
    scale = b.abs().max().clamp(min=1e-30)
    err = (a - b).abs()
    return float(err.max() / scale), float((err / b.abs().clamp(min=1e-30)).max())


def note(name, value):
    SCALES[name] = max(SCALES.get(name, 0.0), value)


def check_stats(stats, ref_stats, name):
    for i in range(4):  # each statistic within 1e-6 of its own size
        err, _ = rel(stats[i], ref_stats[i])
        note(f"{name} stats[{i}] rel", err)
        assert err <= 1e-6, (i, stats[i], ref_stats[i])
    assert bool((stats[:, 2] == 0).all()) and bool((ref_stats[:, 2] == 0).all())  # ignored row


def check_grad(g, g_ref, name):
    """float32: within 1e-6 of each row's scale; 16-bit: the rounded reference or one step."""
    if g.dtype == torch.float32:
        err = ((g - g_ref).abs().amax(1) / g_ref.abs().amax(1).clamp(min=1e-30)).max()
        note(f"{name} fp32 rel (row scale)", float(err))
        note(
            f"{name} fp32 rel (elementwise, |G|>1e-12)",
            float(((g - g_ref).abs() / g_ref.abs()).where(g_ref.abs() > 1e-12, 0).max()),
        )
        assert float(err) <= 1e-6
    else:
        want = g_ref.to(g.dtype)
        steps = (g.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        note(f"{name} {g.dtype} elements off by one step", float((steps > 0).double().mean()))
        assert int(steps.max()) <= 1  # adjacent values (no sign flips: |G| > 0 both)
    assert bool((g[2] == 0).all())  # the ignored row


# ----------------------------------------------------------------------------- tests
DTYPES = [torch.float32, torch.bfloat16]
FEATURES = {
    "plain": {},
    "bias": {"bias": True},
    "softcap": {"softcap": 5.0},
    "smoothing": {"smoothing": 0.1},
    "zloss": {"z_coef": 1e-3},
    "all": {"bias": True, "softcap": 5.0, "smoothing": 0.1, "z_coef": 1e-3},
}


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(dtype, feature):
    """Loss statistics and G (in place) match the reference, with each option and all together."""
    kw = dict(FEATURES[feature])
    logits, ys, valid, div = make(dtype, scale=12.0 if "softcap" in kw else 4.0)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(V, generator=torch.Generator().manual_seed(5))
    stats, g, gated = run(logits, ys, valid, div, **kw)
    ref_stats, g_ref, _ = reference(logits, ys, valid, div, **kw)
    assert gated is None
    check_stats(stats, ref_stats, feature)
    check_grad(g, g_ref, feature)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["col", "group", "both", "rows_col", "none_rows"])
def test_gates(dtype, kind):
    """G * gate (AGG Eq. 7-8) in the second buffer; G ungated (dL/dh is MLE's); per-row divisors."""
    logits, ys, valid, div = make(dtype, seed=2, per_row_div=True)
    gates = gate_inputs(kind)
    kw = dict(smoothing=0.1, z_coef=1e-3)
    stats, g, gated = run(logits, ys, valid, div, gates=gates, **kw)
    ref_stats, g_ref, gated_ref = reference(logits, ys, valid, div, gates=gates, **kw)
    check_stats(stats, ref_stats, "gates")
    check_grad(g, g_ref, "gates G")
    if kind == "none_rows":  # group rows but no gate vector: all ones, nothing to write
        assert gated is None and gated_ref is None
        return
    check_grad(gated, gated_ref, "gates G*gate")
    _, g_plain, _ = run(logits, ys, valid, div, **kw)
    assert torch.equal(g, g_plain)  # gating leaves G (dL/dh) alone, bit for bit
    if dtype == torch.float32:  # gated = G * gate rounded once: against the kernel's own G
        want = g.clone()
        ref_gate_(want, ys, *gates)
        assert torch.equal(gated, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gates_all_ones_bit_exact(dtype):
    """Every gate 1: the gated buffer is G bit for bit, G equals the ungated call's (AGG = MLE)."""
    logits, ys, valid, div = make(dtype, seed=3)
    ones = torch.ones(V)
    rows = torch.tensor([True, False, True, False, True, False])
    kw = dict(softcap=5.0, smoothing=0.1, z_coef=1e-3, bias=torch.randn(V))
    _, g_plain, none = run(logits, ys, valid, div, **kw)
    assert none is None
    for gates in [(ones, None, None), (ones, rows, ones), (None, rows, ones)]:
        _, g, gated = run(logits, ys, valid, div, gates=gates, **kw)
        assert torch.equal(g, g_plain) and torch.equal(gated, g_plain)
        assert torch.equal(gated.view(torch.uint8), g_plain.view(torch.uint8))  # -0 vs +0 too


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_no_grad_and_mass(dtype):
    """need_grad=False: stats only (as with gradients), logits untouched; the mass statistic."""
    logits, ys, valid, div = make(dtype, seed=4)
    mass_cols = (torch.rand(V, generator=torch.Generator().manual_seed(6)) < 0.3).float()
    out = logits.clone()
    stats, gated = fh.fused_head_chunk(
        out,
        ys,
        valid,
        div,
        mass_cols=mass_cols,
        need_grad=False,
        gates=gate_inputs("both"),
        block=BLOCK,
        z_coef=1e-3,
    )
    assert gated is None and torch.equal(out, logits)
    ref_stats, _, _ = reference(logits, ys, valid, div, mass_cols=mass_cols, z_coef=1e-3)
    check_stats(stats, ref_stats, "no-grad")
    with_grad, _, _ = run(logits, ys, valid, div, mass_cols=mass_cols, z_coef=1e-3)
    assert torch.equal(with_grad, stats)


def test_block_sizes_and_repeat():
    """One block wider than V, and a small one: same statistics within 1e-6, G within a rounding;
    a repeated call is bit-identical (no atomics)."""
    logits, ys, valid, div = make(torch.float32, seed=7)
    a = run(logits, ys, valid, div, smoothing=0.1)
    b = run(logits, ys, valid, div, smoothing=0.1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    out = logits.clone()
    stats, _ = fh.fused_head_chunk(out, ys, valid, div, smoothing=0.1)  # default block: 512 >= V
    assert rel(stats, a[0])[0] <= 1e-6 and rel(out, a[1])[0] <= 1e-6


def test_bf16_round_to_nearest_even():
    """The store helper rounds float32 to bfloat16 as torch does: ties to even, signs, overflow."""
    import triton
    import triton.language as tl

    fh._fused_kernel()
    globals()["tl"] = tl  # the interpreter looks for triton.language in the kernel's globals

    @triton.jit
    def _round_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        fh._fused_store(dst + offs, tl.load(src + offs, mask=mask), mask)

    bits = torch.tensor(
        [
            0x3F808000,
            0x3F818000,
            0x3F808001,
            0x3F80FFFF,
            0x7F7FFFFF,
            0x7F7F7FFF,
            0x00008000,
            0x00018000,
            0x80000000,
            0x7F800000,
        ],
        dtype=torch.int64,
    )
    special = torch.cat([bits, -bits - 1]).to(torch.int32).view(torch.float32)
    special = special[special.isfinite() | special.isinf()]
    x = torch.cat([special, torch.randn(200) * 10 ** torch.randint(-30, 30, (200,)).float()])
    out = torch.empty(len(x), dtype=torch.bfloat16)
    _round_kernel[(1,)](x, out, len(x), BLOCK=256)
    assert torch.equal(out.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_reference_is_agg_head_chunk():
    """The copied reference equals agg._head_chunk: with h the identity, the logits are the weight's
    columns and dL/dW is (G * gate)^T in the matmul dtype, exactly."""
    for dtype in DTYPES:
        logits, ys, valid, div = make(dtype, seed=8, per_row_div=True)
        gates = gate_inputs("both")
        kw = dict(smoothing=0.1, z_coef=1e-3, softcap=5.0)
        bias = torch.randn(V)
        opts = agg.HeadOptions(**kw)
        row_div = torch.where(valid, div, math.inf)[:, None]
        chunk = agg._Chunk(torch.eye(R, dtype=dtype), ys, valid, row_div, gates[1])
        grads = (torch.empty(R, R, dtype=dtype), torch.zeros(V, R), torch.zeros(V))
        weight = logits.T.contiguous()
        _, row_loss = agg._head_chunk(chunk, weight, bias, gates, None, opts, None, grads)
        ref_stats, g_ref, gated_ref = reference(logits, ys, valid, div, bias, gates, **kw)
        assert torch.equal(row_loss, ref_stats[0])
        assert torch.equal(grads[1].T, gated_ref.to(dtype).float())
        assert torch.equal(grads[2], g_ref.sum(0))


@pytest.mark.parametrize("name", ["mle", "agg", "zloss", "agg-no-g2"])
def test_method_loss_through_the_kernel_equals_the_torch_head(name, monkeypatch):
    """method.loss with FUSED_HEAD "always" (the interpreter here, CUDA in use) against "never":
    float32 values and gradients within 1e-6 relative, with label smoothing, soft-cap, output bias,
    ignored positions and chunks; repeated calls bit-identical."""
    V_, D_ = 300, 16
    torch.manual_seed(0)
    hp = dict(alpha=0.9, window=2) if agg.agg_family(name) else {}
    method = agg.build_method(name, V_, **hp)
    y = torch.randint(0, V_, (3, 8))
    y[0, 2] = -100
    method.observe(y)
    h = torch.randn(3, 8, D_, requires_grad=True)
    w = torch.randn(V_, D_, requires_grad=True)
    b = torch.randn(V_, requires_grad=True)
    kw = dict(label_smoothing=0.1, softcap=30.0, bias=b, chunk_size=10)
    results = {}
    for mode in ("never", "always", "always"):
        monkeypatch.setattr(agg, "FUSED_HEAD", mode)
        loss = method.loss(h, w, y, **kw)
        grads = torch.autograd.grad(loss, (h, w, b))
        results.setdefault(mode, []).append((loss.detach(), *grads))
    torch_head, fused = results["never"][0], results["always"][0]
    for ours, reference_value in zip(fused, torch_head):
        err = (ours - reference_value).abs().max() / reference_value.abs().max()
        assert float(err) <= 1e-6
    for first, again in zip(*results["always"]):
        assert torch.equal(first, again)  # no atomics: a repeat is bit-identical


def test_gated_methods_with_every_gate_one_equal_mle_bit_for_bit_through_the_kernel(monkeypatch):
    monkeypatch.setattr(agg, "FUSED_HEAD", "always")
    torch.manual_seed(1)
    V_, D_ = 300, 16
    y = torch.randint(0, V_, (24,))
    h = torch.randn(24, D_, requires_grad=True)
    w = torch.randn(V_, D_, requires_grad=True)
    gated = agg.build_method("agg", V_, alpha=0.0, window=2)  # alpha 0: nothing rare, every gate 1
    gated.observe(y)
    mle = agg.build_method("mle", V_)
    for a, b in zip(
        torch.autograd.grad(gated.loss(h, w, y), (h, w)),
        torch.autograd.grad(mle.loss(h, w, y), (h, w)),
    ):
        assert torch.equal(a, b)
