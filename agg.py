"""
Adaptive Gradient Gating (AGG) and its peers for the representation degeneration problem of tied
embeddings, plus the metrics that show the problem. Depends on torch only: copy this file into your
own project.

    import agg
    method = agg.build_method("agg", V, counts=train_counts, tokens_per_step=tokens_per_step,
                              rare_share=0.2, special_ids=[pad_id, eos_id])
    method.attach(optimizer, model.lm_head.weight)  # each optimizer step ends AGG's step
    ...
    # in the model's forward: x, the input of the tied output layer
    loss = method.loss(x, self.lm_head.weight, targets)

attach() makes each optimizer.step() end the step: its targets (counted by each training loss(),
or given to observe()) join AGG's window of K steps once, and after_step(weight) runs. Without
attach: method.observe(targets) once per optimizer step before its first loss(), and
method.after_step(weight) after optimizer.step(). K (window) is the paper's steps per epoch; during
the first K steps a_k / K divides by the steps seen so far. For an untied model pass the output
projection as the weight. Under DDP every rank passes targets of one shape (padded with
ignore_index); the loss is this rank's mean: weight it by the rank's share of all ranks' targets
(times the world size) when ranks hold different numbers of targets.

Papers (equations are cited by paper and number):
  AGG     Yu et al. 2022, "Rare Tokens Degenerate All Tokens" (Sec. 4, Eq. 5-10, App. A Eq. 23)
  AGPS    Yu et al. 2021, "Rare Words Degenerate All Words" (Eq. 13-15, Algorithm 1)
  CosReg  Gao et al. 2019, "Representation Degeneration Problem in Training NLG Models" (Eq. 6)
  FRAGE   Gong et al. 2018, "FRAGE: Frequency-Agnostic Word Representation" (Eq. 2-5)
  UL      Welleck et al. 2020, "Neural Text Generation with Unlikelihood Training" (token-level)
  Center  Bis et al. 2021, "Too Much in Common: Shifting of Embeddings in Transformer Language
          Models"; Stollenwerk et al. 2026, "Output Embedding Centering for Stable LLM
          Pretraining" (arXiv 2601.02031: mu-centering, mu-loss)
  z-loss  Chowdhery et al. 2022, "PaLM" (Sec. 5, z_loss = 1e-4 log^2 Z); Team OLMo 2024,
          "2 OLMo 2 Furious"
  CoupledAdamW  Stollenwerk & Stollenwerk 2025, "Better Embeddings with Coupled Adam"
          (arXiv 2502.08441)
Metrics beyond AGG's: IsoScore (Rudman et al. 2022, "IsoScore: Measuring the Uniformity of
Embedding Space Utilization"), frequency-weighted I(W) (Yokoi et al. 2024, "Zipfian Whitening"),
the under-trained-token indicator (Land & Bartolo 2024, "Fishing for Magikarp: Automatically
Detecting Under-trained Tokens in Large Language Models").
"""

import math
import numbers
import os
from collections import deque
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


# ----------------- the loss head: cross-entropy with a gated weight gradient, logits computed once
class HeadOptions(NamedTuple):
    """What GatedSoftmaxCE computes besides the plain mean NLL (python values: a compiled graph
    specialises on them)."""

    smoothing: float = 0.0  # label smoothing eps
    chunk_size: Optional[int] = None  # rows per chunk (None: every row at once)
    z_coef: float = 0.0  # z-loss weight (PaLM Sec. 5)
    softcap: Optional[float] = None  # C: logits C tanh(s / C)
    center: bool = False  # agg-centered: gate only the push along the mean feature
    reduction: str = "mean"  # "mean" over the valid rows, "sum", or "none" (one loss per row)
    need_grad: bool = True
    fused: bool = False  # the element-wise work in the Triton kernel (FUSED_HEAD)


class GatedSoftmaxCE(torch.autograd.Function):
    """Softmax cross-entropy of logits = h @ weight.T (+ bias) whose gradient wrt `weight` is gated.
    With G = softmax(logits) - onehot(y) (label-smoothed if asked), dL/dh = G @ W exactly as in MLE,
    and dL/dW = (G * gate)^T h with one gate per (row type, column):
        gate[i, k] = col_gate[k]     if row i is not a group row
                     group_gate[k]   if row i is a group row and k != y_i
                     1               if row i is a group row and k == y_i
    (the pull to the target, part (a) of AGG Eq. 4, is never gated)
    gates = (col_gate, group_rows, group_gate); None means all ones. Rows whose `valid` is False
    (ignored targets) add nothing. The output bias (V,) gets the plain gradient. For "mean" and
    "sum" the gradients are computed during forward, `chunk_size` rows at a time (peak memory: one
    chunk x V buffer, not the ~3 T x V of F.cross_entropy), and backward only scales them; for
    "none" backward computes them, each row weighted by its incoming gradient. Returns (loss,
    stats): stats = means of (loss, nll, rare-set probability, (log Z)^2)."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, valid, gates, mass_cols, opts):
        n = valid.sum()
        ctx.opts = opts
        ctx.grads = None
        if opts.reduction == "none":  # the gradients wait for backward's per-row weights
            ctx.inputs = (h, weight, bias, y, valid, gates)
            sums, row_loss, _ = _head(h, weight, bias, y, valid, gates, mass_cols, opts, n)
            loss = row_loss
        else:
            divisor = n if opts.reduction == "mean" else torch.ones_like(n)
            sums, _, ctx.grads = _head(h, weight, bias, y, valid, gates, mass_cols, opts, divisor)
            loss = sums[0] / divisor.clamp(min=1)
        stats = sums / n.clamp(min=1)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_stats):
        if ctx.opts.reduction == "none":
            h, weight, bias, y, valid, gates = ctx.inputs
            divisor = 1 / grad_loss  # row i of G times dL/dloss_i
            with_grad = ctx.opts._replace(need_grad=True)
            _, _, grads = _head(h, weight, bias, y, valid, gates, None, with_grad, divisor)
        else:
            _check(
                ctx.grads is not None,
                "GatedSoftmaxCE: a second backward through the same loss. The "
                "head computes its gradients in forward and frees them after the first backward; "
                "call "
                "method.loss() again for another backward (retain_graph=True does not keep them)",
                RuntimeError,
            )
            grads = [None if g is None else g.mul_(grad_loss) for g in ctx.grads]
            ctx.grads = None  # free the buffers
        grad_h, grad_w, grad_b = grads
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _head(h, weight, bias, y, valid, gates, mass_cols, opts, divisor):
    """GatedSoftmaxCE's work: (sums of (loss, nll, rare-set probability, (log Z)^2), per-row losses
    for
    "none", (dL/dh, dL/dW, dL/db) if opts.need_grad). Row i of G is divided by divisor (a count, or
    one per row)."""
    n, device = h.shape[0], h.device.type
    # Matmuls in the autocast dtype (bf16 on GPU), softmax and accumulations in float32 (float64
    # stays float64).
    mm_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    acc_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    need_grad = opts.need_grad
    col_gate, group_rows, group_gate = gates
    with torch.autocast(device, enabled=False):
        h_mm = h.to(mm_dtype)
        w_mm = weight.to(mm_dtype)
        b_acc = None if bias is None else bias.detach().to(acc_dtype)
        grad_h, grad_w, grad_b = None, None, None
        if need_grad:
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=h.device)
        if need_grad and bias is not None:
            grad_b = torch.zeros(len(bias), dtype=acc_dtype, device=h.device)
        # each row's divisor of G; inf on ignored rows, whose G is then 0
        row_div = torch.where(valid[:, None], divisor.to(acc_dtype).reshape(-1, 1), math.inf)
        mean_h = None
        if opts.center:  # agg-centered: the mean feature of the valid rows
            h_valid = h_mm.to(acc_dtype) * valid[:, None]
            mean_h = h_valid.sum(0) / valid.sum().clamp(min=1)
        row_loss = None
        if opts.reduction == "none":
            row_loss = torch.zeros(n, dtype=acc_dtype, device=h.device)
        sums = torch.zeros(4, dtype=acc_dtype, device=h.device)
        step = opts.chunk_size or max(n, 1)
        for s in range(0, n, step):
            rows = slice(s, s + step)
            chunk_rows = None if group_rows is None else group_rows[rows]
            chunk = _Chunk(h_mm[rows], y[rows], valid[rows], row_div[rows], chunk_rows)
            chunk_grad_h = None if grad_h is None else grad_h[rows]
            grads = (chunk_grad_h, grad_w, grad_b)
            chunk_sums, chunk_loss = _head_chunk(
                chunk, w_mm, b_acc, gates, mass_cols, opts, mean_h, grads
            )
            sums += chunk_sums
            if row_loss is not None:
                row_loss[rows] = chunk_loss
    if not need_grad:
        return sums, row_loss, None
    grad_w = grad_w.to(weight.dtype)
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return sums, row_loss, (grad_h, grad_w, grad_b)


class _Chunk(NamedTuple):
    """Rows of the head: features, targets, which are valid, each row's divisor of G, which are
    group rows."""

    h: torch.Tensor
    y: torch.Tensor
    valid: torch.Tensor
    div: torch.Tensor
    group_rows: Optional[torch.Tensor]


def _head_chunk(chunk, w_mm, bias, gates, mass_cols, opts, mean_h, grads):
    """One chunk of the head: the sums of (loss, nll, rare-set probability, (log Z)^2) over its
    valid rows and its rows' losses; writes its rows of dL/dh, adds to dL/dW and dL/db (grads).
    mean_h (d,): gate only the push
    along the mean feature (agg-centered): row i, column k gives G_ik (h_i - mean_h) + gate_ik G_ik
    mean_h."""
    if opts.fused:
        return _fused_chunk(chunk, w_mm, bias, gates, mass_cols, opts, grads)
    hs, ys = chunk.h, chunk.y
    acc_dtype = chunk.div.dtype
    smoothing = opts.smoothing
    logits = (hs @ w_mm.T).to(acc_dtype)
    if bias is not None:
        logits += bias
    if (
        opts.softcap
    ):  # soft-capping: logits C tanh(s / C), whose derivative 1 - tanh^2 scales G below
        logits = logits.div_(opts.softcap).tanh_()
        dcap = 1 - logits.square()
        logits.mul_(opts.softcap)
    target_logit = logits.gather(1, ys[:, None]).squeeze(1)
    row_max = logits.amax(dim=1, keepdim=True)
    mean_logit = logits.mean(dim=1) if smoothing else None
    exp = logits.sub_(
        row_max
    ).exp_()  # in place: the one chunk x V buffer (logsumexp would add another)
    sum_exp = exp.sum(dim=1)
    lse = row_max.squeeze(1) + sum_exp.log()
    nll = lse - target_logit
    log_z2 = lse.square()
    loss = nll
    if smoothing:  # = F.cross_entropy's value with label_smoothing
        loss = (1 - smoothing) * nll + smoothing * (lse - mean_logit)
    if opts.z_coef:
        loss = loss + opts.z_coef * log_z2  # z-loss (PaLM Sec. 5): z_coef (log Z)^2 per position
    valid = chunk.valid
    loss = torch.where(valid, loss, 0.0)  # ignored rows add nothing
    nll = torch.where(valid, nll, 0.0)
    log_z2 = torch.where(valid, log_z2, 0.0)
    p = exp.div_(sum_exp[:, None] * chunk.div)  # softmax / divisor, 0 on ignored rows
    mass = torch.zeros((), dtype=acc_dtype, device=hs.device)
    grad_h, grad_w, grad_b = grads
    if (
        grad_h is None and mass_cols is not None
    ):  # no-grad calls: the rare set's predicted probability
        row_mass = (p @ mass_cols) * chunk.div.squeeze(1)
        mass = torch.where(chunk.valid, row_mass, 0.0).sum()  # ignored rows: 0, not 0 x inf
    sums = torch.stack([loss.sum(), nll.sum(), mass, log_z2.sum()])
    if grad_h is None:
        return sums, loss
    grad = p
    if opts.z_coef:  # d(z_coef (log Z)^2)/dlogits = 2 z_coef log Z softmax: scales each row's p
        grad.mul_((1 + 2 * opts.z_coef * lse)[:, None])
    # G = (p - q) / divisor, q = (1 - eps) onehot(y) + eps / V; the quotients in float64, then
    # rounded
    div64 = chunk.div.double()
    grad.scatter_add_(1, ys[:, None], ((smoothing - 1.0) / div64).to(acc_dtype))
    if smoothing:
        grad.sub_((smoothing / (w_mm.shape[0] * div64)).to(acc_dtype))
    if opts.softcap:
        grad.mul_(dcap)  # chain rule through C tanh(s / C)
    grad_h.copy_(grad.to(w_mm.dtype) @ w_mm)  # dL/dh = G W: MLE's, never gated
    if grad_b is not None:
        grad_b += grad.sum(0)  # dL/db = sum_i G_i: never gated
    col_gate, _, group_gate = gates
    if mean_h is None:
        _gate_(grad, ys, col_gate, chunk.group_rows, group_gate)
        _add_grad_w(grad_w, grad, hs, w_mm.dtype)  # dL/dW = (G * gate)^T h
    else:  # ungated G^T h, minus the gated-away part of the push along mean_h
        ungated_colsum = grad.sum(0)
        _add_grad_w(grad_w, grad, hs, w_mm.dtype)
        _gate_(grad, ys, col_gate, chunk.group_rows, group_gate)
        grad_w.sub_(torch.outer(ungated_colsum - grad.sum(0), mean_h))
    return sums, loss


def _add_grad_w(grad_w, grad, hs, mm_dtype):
    """grad_w += grad^T hs, the matmul in the autocast dtype, accumulated in grad_w's."""
    g = grad.to(mm_dtype)
    if g.dtype == grad_w.dtype:
        grad_w.addmm_(g.T, hs)
    else:
        grad_w += g.T @ hs


GATE_ROWS = 1024  # rows of the (rows, V) gate built at a time


def _gate_(grad, ys, col_gate, group_rows, group_gate):
    """Scale grad (rows x V) in place by the per-(row type, column) gate of GatedSoftmaxCE."""
    if group_rows is None:
        if col_gate is not None:
            grad.mul_(col_gate)
        return
    ones = torch.ones(grad.shape[1], dtype=grad.dtype, device=grad.device)
    col = ones if col_gate is None else col_gate
    group = ones if group_gate is None else group_gate
    pull = grad.gather(1, ys[:, None])  # (p - 1) h_i: the pull to the target, part (a) of AGG Eq. 4
    for s in range(0, len(grad), GATE_ROWS):
        rows = slice(s, s + GATE_ROWS)
        gate = torch.where(group_rows[rows, None], group, col)
        grad[rows].mul_(gate)
    gated_pull = grad.gather(1, ys[:, None])
    kept = torch.where(group_rows[:, None], pull, gated_pull)  # group rows keep their pull whole
    grad.scatter_(1, ys[:, None], kept)


def gate_matrix(y, vocab_size, col_gate, group_rows, group_gate, dtype=torch.float64):
    """The dense (T, V) gate that GatedSoftmaxCE applies to G without building it (for analysis and
    the UL term)."""
    gate = torch.ones(len(y), vocab_size, dtype=dtype, device=y.device)
    col = None if col_gate is None else col_gate.to(dtype)
    group = None if group_gate is None else group_gate.to(dtype)
    _gate_(gate, y, col, group_rows, group)
    gate.scatter_(1, y[:, None], 1.0)  # and 1 at every row's target
    return gate


# ---------------------------------------------------------------- the fused head for CUDA (Triton)
# The GEMMs stay cuBLAS; after logits = hs @ W.T, one program per row reads its logits at most twice
# (an online max / sum of exp, then G) and writes G = (softmax (1 + 2 z lse) - q) / div (times
# 1 - tanh^2 under a soft-cap) in place in the matmul dtype, and G times AGG's gate (AGG Eq. 7-8) to
# a second buffer in the same pass. No atomics: each value is computed by one program in a fixed
# order (deterministic). Triton is imported at the first call only.
FUSED_HEAD = "cuda"  # the fused head: "cuda" (CUDA tensors, when Triton imports), "never", or
# "always" (CPU tensors too, through Triton's interpreter: TRITON_INTERPRET=1 before the first call)
_FUSED = None  # the Triton kernel, defined at the first call (Triton imported then)
_TRITON = None  # whether Triton imports (checked once)


def _fused_interpreting():
    """Triton's CPU interpreter (TRITON_INTERPRET=1, set before the first fused call)."""
    flag = os.environ.get("TRITON_INTERPRET", "0")
    return flag.lower() in ("1", "true", "on", "yes")


def _fused_kernel():
    """Import Triton and define the kernel and its helpers, once."""
    # module globals, not closures: the interpreter runs the kernels' source in their globals
    global _FUSED, triton, tl, libdevice, _fused_exp, _fused_log, _fused_tanh, _fused_load
    global _fused_store, _fused_logit, _fused_gate, _fused_ce_kernel
    if _FUSED is not None:
        return _FUSED
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    # LIB: libdevice's exp / log / tanh (CUDA's expf / logf / tanhf, as torch's kernels; tl.exp
    # on a GPU is ex2.approx). The interpreter has no libdevice: numpy's in float64, rounded once.
    @triton.jit
    def _fused_exp(x, LIB: tl.constexpr):
        if LIB:
            e = libdevice.exp(x)
        else:
            e = tl.exp(x.to(tl.float64)).to(tl.float32)
        return e

    @triton.jit
    def _fused_log(x, LIB: tl.constexpr):
        if LIB:
            r = libdevice.log(x)
        else:
            r = tl.log(x.to(tl.float64)).to(tl.float32)
        return r

    @triton.jit
    def _fused_tanh(x, LIB: tl.constexpr):
        if LIB:
            t = libdevice.tanh(x)
        else:  # (1 - e) / (1 + e), e = exp(-2 |x|); its Taylor series near 0 (no cancellation)
            a = tl.abs(x).to(tl.float64)
            e = tl.exp(-2.0 * a)
            series = a * (1.0 - a * a / 3.0 + 2.0 * a * a * a * a / 15.0)
            t = tl.where(a < 1e-3, series, (1.0 - e) / (1.0 + e))
            t = tl.where(x < 0, -t, t).to(tl.float32)
        return t

    @triton.jit
    def _fused_load(ptr, mask):
        """float32 of ptr[...]; bfloat16 widened through its bits (exact, the interpreter too)."""
        x = tl.load(ptr, mask=mask, other=0.0)
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint16, bitcast=True).to(tl.uint32)
            x = (bits << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def _fused_store(ptr, x, mask):
        """Store float32 x in ptr's dtype; bfloat16 rounded to nearest even by integer arithmetic
        (the interpreter's cast truncates), so that the GPU and the interpreter round alike."""
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            x = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fused_logit(ptr, bias, cols, mask, CAP: tl.constexpr, LIB: tl.constexpr):
        """Row logits as _head_chunk makes them: float32, + bias, C tanh(s / C); -inf past V.
        Returns (logits, tanh(s / C)); the second is the logits when there is no cap."""
        x = _fused_load(ptr + cols, mask)
        if bias is not None:
            x += tl.load(bias + cols, mask=mask, other=0.0)
        t = x
        if CAP != 0.0:
            t = _fused_tanh(tl.math.div_rn(x, CAP), LIB)
            x = t * CAP
        return tl.where(mask, x, float("-inf")), t

    @triton.jit
    def _fused_gate(col_gate, group_gate, cols, V, grp, is_y):
        """AGG Eq. 7-8: col_gate[k] on rows that are not group rows; group_gate[k] on group rows,
        except 1 at their target (the pull is never gated). A missing gate is all ones."""
        gate = tl.full(cols.shape, 1.0, tl.float32)
        if col_gate is not None:  # masked loads: a row reads one gate vector only
            gate = tl.load(col_gate + cols, mask=cols < tl.where(grp, 0, V), other=1.0)
        if group_gate is not None:
            group = tl.load(group_gate + cols, mask=cols < tl.where(grp, V, 0), other=1.0)
            gate = tl.where(grp, tl.where(is_y, 1.0, group), gate)
        return gate

    @triton.jit
    def _fused_ce_kernel(
        logits,
        gated,
        stats,
        bias,
        ys,
        valid,
        div,
        col_gate,
        group_rows,
        group_gate,
        mass_cols,
        R,
        V,
        SMOOTH: tl.constexpr,
        Z: tl.constexpr,
        CAP: tl.constexpr,
        GRAD: tl.constexpr,
        LIB: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row: stats[:, row] = (loss, nll, mass, log Z^2), 0 if not valid; with GRAD, G over
        the row's logits in place and G * gate to gated (if given). The arithmetic is _head_chunk's,
        in float32, in its order (the sum of exp excepted: online, rescaled as the max grows)."""
        row = tl.program_id(0)
        base = row.to(tl.int64) * V
        y = tl.load(ys + row)
        ok = tl.load(valid + row)
        offs = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)  # running max
        s = tl.zeros([], tl.float32)  # sum of exp(x - m)
        target = tl.zeros([], tl.float32)  # the target's logit
        sum_x = tl.zeros([], tl.float32)  # sum of logits (label smoothing)
        mass = tl.zeros([], tl.float32)  # sum of exp(x - m) over mass_cols
        for start in range(0, V, BLOCK):  # pass 1: the only read without GRAD
            cols = start + offs
            mask = cols < V
            x, t = _fused_logit(logits + base, bias, cols, mask, CAP, LIB)
            m_new = tl.maximum(m, tl.max(x, 0))
            scale = _fused_exp(m - m_new, LIB)
            e = _fused_exp(x - m_new, LIB)
            s = s * scale + tl.sum(e, 0)
            target += tl.sum(tl.where(cols == y, x, 0.0), 0)  # one term: exact
            if SMOOTH != 0.0:
                sum_x += tl.sum(tl.where(mask, x, 0.0), 0)
            if mass_cols is not None:
                weight = tl.load(mass_cols + cols, mask=mask, other=0.0)
                mass = mass * scale + tl.sum(e * weight, 0)
            m = m_new
        lse = m + _fused_log(s, LIB)
        nll = lse - target
        log_z2 = lse * lse
        loss = nll
        if SMOOTH != 0.0:  # = F.cross_entropy's value with label_smoothing
            mean_x = tl.math.div_rn(sum_x, V.to(tl.float32))
            loss = (1.0 - SMOOTH) * nll + SMOOTH * (lse - mean_x)
        if Z != 0.0:  # z-loss (PaLM Sec. 5)
            loss = loss + Z * log_z2
        out = stats + row
        tl.store(out, tl.where(ok, loss, 0.0))
        tl.store(out + R, tl.where(ok, nll, 0.0))
        tl.store(out + 2 * R, tl.where(ok, tl.math.div_rn(mass, s), 0.0))
        tl.store(out + 3 * R, tl.where(ok, log_z2, 0.0))
        if GRAD:  # pass 2: G = (p (1 + 2 z lse) - q) / div, q = (1 - eps) onehot(y) + eps / V
            d = tl.load(div + row)
            denom = s * d
            z_scale = 1.0 + (2.0 * Z) * lse
            pull = ((SMOOTH - 1.0) / d.to(tl.float64)).to(tl.float32)  # the quotients in float64
            spread = (SMOOTH / (V * d.to(tl.float64))).to(tl.float32)
            grp = tl.full([], 0, tl.int1)  # a group row (AGG Eq. 8)
            if group_rows is not None:
                grp = tl.load(group_rows + row) != 0
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                is_y = cols == y
                x, t = _fused_logit(logits + base, bias, cols, mask, CAP, LIB)
                g = tl.math.div_rn(_fused_exp(x - m, LIB), denom)
                if Z != 0.0:  # d(z (log Z)^2)/dlogits = 2 z log Z softmax
                    g = g * z_scale
                g = tl.where(is_y, g + pull, g)
                if SMOOTH != 0.0:
                    g = g - spread
                if CAP != 0.0:  # chain rule through C tanh(s / C)
                    g = g * (1.0 - t * t)
                g = tl.where(ok, g, 0.0)  # ignored rows: G 0
                _fused_store(logits + base + cols, g, mask)  # in place: dL/dh = G W
                if gated is not None:  # dL/dW = (G * gate)^T h, the gate in the same pass
                    gate = _fused_gate(col_gate, group_gate, cols, V, grp, is_y)
                    _fused_store(gated + base + cols, g * gate, mask)

    _FUSED = _fused_ce_kernel
    return _FUSED


def fused_head_chunk(
    logits,
    ys,
    valid,
    div,
    bias=None,
    gates=(None, None, None),
    smoothing=0.0,
    z_coef=0.0,
    softcap=None,
    mass_cols=None,
    need_grad=True,
    block=None,
    num_warps=None,
):
    """_head_chunk's element-wise work on logits (R, V) = hs @ W.T (contiguous; float32,
    bfloat16 or float16), one Triton program per row. ys (R,) int64 targets; valid (R,) bool;
    div (R,) float32, each row's divisor of G; bias (V,) float32 or None; gates = (col_gate (V,)
    float32, group_rows (R,) bool, group_gate (V,) float32), None meaning all ones (GatedSoftmaxCE's
    gates, AGG Eq. 7-8); mass_cols (V,) float32 or None. Returns (stats, gated): stats (4, R)
    float32, each row's (loss, nll, mass, (log Z)^2), 0 on invalid rows (mass: the softmax's sum
    over mass_cols, 0 without); with need_grad, G overwrites logits and gated (R, V), in logits'
    dtype, holds G times the gate (None where the gate is all ones: use G). Without need_grad
    the logits are read once and not written."""
    kernel = _fused_kernel()
    rows, vocab = logits.shape
    assert logits.is_contiguous() and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    col_gate, group_rows, group_gate = gates
    if group_rows is None:  # no group rows: group_gate unused
        group_gate = None
    gated = None
    if need_grad and (col_gate is not None or group_gate is not None):
        gated = torch.empty_like(logits)
    stats = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    on_gpu = logits.is_cuda and not _fused_interpreting()
    cap = triton.next_power_of_2(vocab)
    block = block or min(cap, 4096 if on_gpu else 1024)
    launch = {}
    if on_gpu:  # as torch's kernels: each step rounded (no fma), subnormals kept (no ftz)
        warps = num_warps or (8 if block >= 4096 else 4)
        launch = dict(num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False)
    kernel[(rows,)](
        logits,
        gated,
        stats,
        bias,
        ys,
        valid,
        div,
        col_gate,
        group_rows,
        group_gate,
        mass_cols,
        rows,
        vocab,
        SMOOTH=float(smoothing),
        Z=float(z_coef),
        CAP=float(softcap or 0.0),
        GRAD=bool(need_grad),
        LIB=on_gpu,
        BLOCK=block,
        **launch,
    )
    return stats, gated


def _use_fused(h, opts):
    """Whether the head's chunks go through the Triton kernel (FUSED_HEAD; float64 and agg-centered
    keep the torch path, the reference)."""
    global _TRITON
    where_ok = FUSED_HEAD == "always" or (FUSED_HEAD == "cuda" and h.is_cuda)
    if not where_ok or h.dtype == torch.float64 or opts.center:
        return False
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


def _fused_chunk(chunk, w_mm, bias, gates, mass_cols, opts, grads):
    """_head_chunk with the element-wise work in the Triton kernel: the same sums, rows' losses and
    gradients (float32 within rounding; bfloat16 G within one rounding)."""
    hs = chunk.h
    logits = hs @ w_mm.T  # in the matmul dtype: G overwrites it
    grad_h, grad_w, grad_b = grads
    need_grad = grad_h is not None
    col_gate, _, group_gate = gates
    row_gates = (col_gate, chunk.group_rows, group_gate)
    div = chunk.div.reshape(-1).float()
    stats, gated = fused_head_chunk(
        logits,
        chunk.y,
        chunk.valid,
        div,
        bias,
        row_gates,
        opts.smoothing,
        opts.z_coef,
        opts.softcap,
        mass_cols,
        need_grad,
    )
    sums = stats.sum(1).to(chunk.div.dtype)  # loss, nll, rare-set probability, (log Z)^2
    if not need_grad:
        return sums, stats[0]
    grad_h.copy_(logits @ w_mm)  # dL/dh = G W: MLE's, never gated
    if grad_b is not None:
        grad_b += logits.float().sum(0)  # dL/db = sum_i G_i: never gated
    gated_grad = logits if gated is None else gated
    _add_grad_w(grad_w, gated_grad, hs, w_mm.dtype)  # dL/dW = (G * gate)^T h
    return sums, stats[0]


# ------------------------------------ AGG's alpha and the static rare groups, from training counts
def _check(ok, message, error=ValueError):
    if not ok:
        raise error(message)


def _check_real(name, value, low, high, what):
    """A ValueError naming `name` unless `value` is a finite real number (not a bool) in [low,
    high]."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = real and math.isfinite(value) and low <= value <= high
    _check(ok, f"{name} must be {what}, got {value!r}")


def _counts_tensor(counts, vocab_size=None):
    """Token counts as a flat tensor; a ValueError unless finite and >= 0 (and vocab_size long, if
    given)."""
    try:
        c = torch.as_tensor(counts).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"counts must be token counts, one number per token id: {e}") from None
    _check(not c.is_complex() and c.dtype != torch.bool, f"counts must be numbers, got {c.dtype}")
    bad = ~torch.isfinite(c) | (c < 0) if c.is_floating_point() else c < 0
    if bool(bad.any()):  # a NaN or negative count would give a wrong rare group without an error
        first = int(bad.nonzero()[0])
        raise ValueError(f"counts must be finite numbers >= 0; entry {first} is {c[first].item()}")
    if vocab_size is not None:
        _check(len(c) == vocab_size, f"counts has {len(c)} entries but vocab_size is {vocab_size}")
    return c


def _special_list(special_ids, vocab_size):
    """special_ids as a sorted list of distinct ints in [0, vocab_size)."""
    ids = list(special_ids)
    whole = [isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids]
    _check(all(whole), f"special_ids must be whole token ids, got {ids!r}")
    bad = [int(i) for i in ids if not 0 <= i < vocab_size]  # -1 would silently mean the last token
    _check(not bad, f"special_ids {bad} are outside [0, vocab_size={vocab_size})")
    return sorted({int(i) for i in ids})


def alpha_for_rare_share(counts, rare_share, tokens_per_step, special_ids=()):
    """The AGG alpha (Eq. 5: rare iff a_k / K < alpha) whose rare group, at the training split's
    average rates, is the `rare_share` least frequent share of the vocabulary (special ids
    excluded). alpha counts per optimizer step, so the paper's 0.03 (~32k tokens per step) marks
    another group at any other batch size; a share means the same everywhere. tokens_per_step: over
    all ranks. Equal counts fall on the same side (rare_share_of_alpha: the
    share)."""
    _check_real("rare_share", rare_share, 0, 1, "a share in (0, 1)")
    _check(0 < rare_share < 1, f"rare_share must be a share in (0, 1), got {rare_share!r}")
    rate_all = _per_step_rate(counts, tokens_per_step, special_ids)
    rates = rate_all.unique()  # sorted distinct rates
    midpoints = (rates[:-1] + rates[1:]) / 2
    cuts = torch.cat(
        [midpoints, rates[-1:] + 1.0]
    )  # a threshold between each rate and the next, one past the last
    below = rate_all[None, :] < cuts[:, None]  # [cut, token]: the token is rare at that threshold
    shares = below.double().mean(1)  # the rare share each threshold gives
    best = (shares - rare_share).abs().argmin()
    return float(cuts[best])


def rare_share_of_alpha(counts, alpha, tokens_per_step, special_ids=()):
    """Share of the (non-special) vocabulary that AGG's Eq. 5 marks rare at the training split's
    average rates."""
    _check_real("alpha", alpha, 0, math.inf, "a finite number >= 0")
    rare = _per_step_rate(counts, tokens_per_step, special_ids) < alpha
    return float(rare.double().mean())


def _per_step_rate(counts, tokens_per_step, special_ids):
    """Each non-special token's expected appearances per optimizer step at the training split's
    rates."""
    _check_real(
        "tokens_per_step", tokens_per_step, 1e-12, math.inf, "a number > 0 (target tokens per step)"
    )
    counts = _counts_tensor(counts).double()
    _check(float(counts.sum()) > 0, "counts must hold at least one token")
    keep = torch.ones(len(counts), dtype=torch.bool)
    keep[_special_list(special_ids, len(counts))] = False
    return counts[keep] / counts.sum().clamp(min=1) * tokens_per_step


def least_frequent_mask(counts, fraction, special_ids=()):
    """Bool mask (V,) of the `fraction` least frequent tokens by `counts` (ties by id); special ids
    never included."""
    _check_real("fraction", fraction, 0, 1, "a share of the vocabulary in [0, 1]")
    counts = _counts_tensor(counts).double().clone()
    special_ids = _special_list(special_ids, len(counts))
    counts[special_ids] = float("inf")
    mask = torch.zeros(len(counts), dtype=torch.bool)
    mask[torch.argsort(counts, stable=True)[: round(fraction * len(counts))]] = True
    mask[special_ids] = False
    return mask


# ----------------------------------------------------------------------------------------- methods
# Each one: observe(targets) once per optimizer step (or attach(optimizer, weight)), loss(hidden,
# weight, targets),
# after_step(weight), stats, state_dict. Each declares its hyper-parameters once: spec = {name:
# (default, type,
# meaning)}. From it come the class's `defaults` {name: default} and the module's HPARAMS {name:
# (type, meaning)},
# the training scripts' flags.
NONNEGATIVE = ("alpha", "gamma", "lambda_", "alpha_ul", "z_coef", "mu_coef", "disc_lr")
SHARES = ("rare_fraction", "popular_fraction")
POSITIVE = ("mu1", "mu2")
WHOLE_FROM_1 = ("window", "static_after", "disc_steps")  # window: K divides a_k (Eq. 5)
WHOLE_FROM_0 = ("until", "rare_rank")
CHOICES = {"parts": ("b", "c", "bc"), "center_mode": ("step", "loss")}


def _hparam_rule(key, value):
    """What hyper-parameter `key` must be, if `value` is not that; else None (NaN fails every
    comparison)."""
    if key in CHOICES:
        choices = CHOICES[key]
        if value in choices:
            return None
        names = [repr(choice) for choice in choices]
        return ", ".join(names[:-1]) + " or " + names[-1]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        number = False
    else:
        number = True
    if key in NONNEGATIVE:
        ok = number and 0 <= value < math.inf
        return None if ok else "a finite number >= 0"
    if key in SHARES:
        ok = number and 0 <= value <= 1
        return None if ok else "a share of the vocabulary in [0, 1]"
    if key in POSITIVE:
        ok = number and 0 < value < math.inf
        return None if ok else "a finite number > 0"
    lowest = 1 if key in WHOLE_FROM_1 else 0 if key in WHOLE_FROM_0 else None
    if lowest is not None:
        ok = number and value >= lowest and float(value).is_integer()
        return None if ok else f"a whole number >= {lowest}"
    return None


class MLE:
    """Plain maximum likelihood, softmax cross-entropy of hidden @ weight.T; the base of every
    method.

    A step's targets reach the method in one of two ways:
    - observe(targets) once per optimizer step, with all of that step's targets, before its first
      loss(), and
      after_step(weight) after optimizer.step() (the paper's loop; the training scripts');
    - attach(optimizer, weight) once: then observe() may be called per micro-batch, or not at all
      (each
      grad-enabled loss() counts its own targets), and the optimizer's step ends the step and runs
      after_step. AGG's gates are computed once per step, at its first loss(), from the window and
      the step's targets seen so far: all of them if observed before, the first micro-batch's if
      counted by loss(); every target joins
      the window once."""

    name = "mle"
    spec = defaults = {}

    def __init_subclass__(cls):
        cls.defaults = {key: default for key, (default, _type, _meaning) in cls.spec.items()}

    def __init__(self, vocab_size, counts=None, special_ids=(), **hparams):
        unknown = sorted(set(hparams) - set(self.defaults))
        _check(
            not unknown,
            f"method {self.name!r}: unknown hyper-parameter(s) {unknown}; "
            f"valid: {sorted(self.defaults) or 'none'} (plus counts, special_ids)",
        )
        self.hparams = {**self.defaults, **hparams}
        for key, value in self.hparams.items():
            kind = self.spec[key][1] if key in self.spec else None
            if value is None:
                continue
            rule = "True or False" if kind is bool and not isinstance(value, bool) else None
            rule = rule or _hparam_rule(key, value)
            _check(rule is None, f"method {self.name!r}: {key} must be {rule}, got {value!r}")
        _check(
            isinstance(vocab_size, numbers.Integral) and vocab_size > 0,
            f"vocab_size must be a whole number > 0, got {vocab_size!r}",
        )
        self.vocab_size = int(vocab_size)
        self.counts = None
        if counts is not None:
            self.counts = _counts_tensor(counts, vocab_size).long().cpu()
        self.special_ids = _special_list(special_ids, vocab_size)
        self.steps = 0  # optimizer steps observed
        self._stats = {}  # the last loss() call's stats
        self._weight = None  # attach(): the weight after_step gets
        self._step_open = False  # attach(): the step's first targets are in, later ones join it
        self._counted_by = (
            None  # attach(): "observe" or "loss", whichever counts this step's targets
        )
        self._ids_checked = (
            False  # the first targets are checked on the host, later ones asynchronously
        )

    # ------------------------------------------------------------------ the steps' targets
    def observe(self, targets, ignore_index=-100):
        """The targets of an optimizer step (never validation batches). Without attach(): once per
        optimizer step,
        all of its targets, before its first loss(). With attach(): per micro-batch or once per
        step."""
        ids = self._window_ids(targets, ignore_index)
        if self._weight is None:
            self._new_step(ids)
            return
        _check(
            self._counted_by != "loss",
            f"method {self.name!r}: observe() after loss() counted this step's "
            "targets: with attach(), observe every micro-batch before its loss(), or never",
        )
        self._counted_by = "observe"
        self._add_to_step(ids)

    def attach(self, optimizer, weight):
        """Let `optimizer` end each step: after every optimizer.step() the step's targets are in the
        window once
        and after_step(weight) runs. Returns the hook's handle (handle.remove() detaches)."""
        self._weight = weight
        return optimizer.register_step_post_hook(self._end_step)

    def _end_step(self, optimizer, args, kwargs):
        self._step_open = False
        self._counted_by = None
        self.after_step(self._weight)

    @torch.compiler.disable  # the window's bookkeeping runs eagerly, outside a compiled forward
    def _add_to_step(self, ids):
        if self._step_open:
            self._join_step(ids)
        else:
            self._new_step(ids)
            self._step_open = True

    def _new_step(self, ids):
        """A new optimizer step whose target ids are `ids` (ignored positions: vocab_size)."""
        self.steps += 1

    def _join_step(self, ids):
        """More targets of the current step (a later micro-batch)."""

    def _target_ids(self, targets, ignore_index):
        """(ids as long, valid mask), flat. Any integer dtype. Checked on the host the first time (a
        clear error
        naming the id), on the device after (no synchronisation; an id outside [0, V) stops the
        run)."""
        _check(
            torch.is_tensor(targets),
            f"method {self.name!r}: targets must be a tensor of token ids, "
            f"got {type(targets).__name__}",
        )
        is_int = not (
            targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool
        )
        _check(
            is_int, f"method {self.name!r}: targets must be integer token ids, got {targets.dtype}"
        )
        ids = targets.reshape(-1).long()
        valid = ids != ignore_index
        if not self._ids_checked:
            self._check_ids(ids, ignore_index)
            self._ids_checked = True
        else:
            in_vocab = (ids >= 0) & (ids < self.vocab_size)
            message = (
                f"method {self.name!r}: a target id is outside [0, vocab_size={self.vocab_size})"
            )
            torch._assert_async((in_vocab | ~valid).all(), message)
        return ids, valid

    def _window_ids(self, targets, ignore_index):
        ids, valid = self._target_ids(targets, ignore_index)
        return torch.where(valid, ids, self.vocab_size)

    @torch.compiler.disable  # reads values: once, outside a compiled graph
    def _check_ids(self, ids, ignore_index):
        t = ids[ids != ignore_index]
        if len(t) and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
            raise ValueError(
                f"method {self.name!r}: target id {bad} is outside [0, "
                f"vocab_size={self.vocab_size}) "
                f"and is not ignore_index={ignore_index}"
            )

    # ------------------------------------------------------------------ hooks of the methods
    def after_step(self, weight):
        """Call after each optimizer.step() (attach() does): freeze-rare restores its frozen rows,
        center subtracts
        the mean row."""

    def to(self, device):
        """Move the state the method keeps updating (counters, a discriminator) to `device`; returns
        self."""
        return self

    def rare_mask(self):
        """Bool (V,) of the current rare group, or None for methods without one."""

    def step_rare(self):
        """The rare group the current step's gates use (AGG: as computed once a step)."""
        return self.rare_mask()

    def ready(self):
        """Whether gates() can be computed (AGG: once a step's targets were seen)."""
        return True

    def gates(self, y):
        """(col_gate, group_rows, group_gate) for GatedSoftmaxCE given the targets y; None =
        ungated."""
        return None, None, None

    def regulariser(self, hidden, weight, targets, ignore_index, bias=None, softcap=None):
        """Extra loss term added to the NLL (a scalar tensor), or None."""

    # ------------------------------------------------------------------ the loss
    def loss(
        self,
        hidden,
        weight,
        targets,
        ignore_index=-100,
        label_smoothing=0.0,
        chunk_size=None,
        bias=None,
        softcap=None,
        reduction="mean",
    ):
        """Softmax cross-entropy of hidden @ weight.T (+ bias) with the method's gated weight
        gradient, plus its regulariser; F.linear_cross_entropy's argument order. hidden (..., d):
        the input of the tied output layer (not the logits); weight (V, d): the tied embedding;
        targets (...) integer ids. reduction "mean" (over the non-ignored positions), "sum" (the
        regulariser counted once per position), or "none" (the loss of each position, 0 where
        ignored; methods without a regulariser). bias (V,) optional: a learned unigram prior with
        the plain gradient; softcap C: logits C tanh(logits / C) (Gemma 2). chunk_size: rows per
        chunk of the head
        (peak memory ~ chunk_size x V, same gradients). All targets ignored gives 0.0 with zero
        gradients."""
        tensors = [torch.is_tensor(t) for t in (hidden, weight, targets)]
        _check(
            all(tensors) and hidden.dim() >= 1 and weight.dim() == 2,
            "hidden (..., d), weight (V, d) and targets (...) must be tensors",
        )
        d = hidden.shape[-1]
        logits_given = d == self.vocab_size and weight.shape[-1] != d
        _check(
            not logits_given,
            f"hidden has vocab_size={d} features and weight is {tuple(weight.shape)}: are "
            "these logits? loss() takes the features the output layer multiplies (its input), not "
            "its output",
        )
        _check(
            weight.shape == (self.vocab_size, d),
            f"weight must be (vocab_size={self.vocab_size}, d={d}), got {tuple(weight.shape)}",
        )
        _check(
            targets.shape == hidden.shape[:-1],
            f"targets {tuple(targets.shape)} must match hidden {tuple(hidden.shape)} without its "
            "last dim",
        )
        whole = isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool)
        chunk_ok = chunk_size is None or whole and chunk_size > 0
        _check(
            chunk_ok, f"chunk_size must be a positive number of rows (or None), got {chunk_size!r}"
        )
        _check_real("label_smoothing", label_smoothing, 0, 1, "a number in [0, 1)")
        _check(
            label_smoothing < 1,
            f"label_smoothing must be a number in [0, 1), got {label_smoothing}",
        )
        whole = isinstance(ignore_index, numbers.Integral) and not isinstance(ignore_index, bool)
        _check(whole, f"ignore_index must be a whole number, got {ignore_index!r}")
        cap_ok = (
            softcap is None or isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
        )
        cap_ok = cap_ok and (softcap is None or 0 < softcap < math.inf)
        _check(cap_ok, f"softcap must be a number > 0 and finite (or None), got {softcap!r}")
        _check(
            reduction in ("mean", "sum", "none"),
            f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}",
        )
        if bias is not None and tuple(bias.shape) != (self.vocab_size,):
            raise ValueError(
                f"bias must be (vocab_size={self.vocab_size},), got {tuple(bias.shape)}"
            )
        floats = [t for t in (hidden, weight, bias) if t is not None]
        _check(
            all(t.is_floating_point() for t in floats),
            f"hidden, weight (and bias) must be floating point; got {[t.dtype for t in floats]}",
        )
        devices = {t.device for t in floats + [targets]}
        _check(
            len(devices) == 1 and hidden.device.type != "meta",
            "hidden, weight, targets (and bias) must be on one device, with data; got "
            f"{sorted(map(str, devices))}",
        )
        y, valid = self._target_ids(targets, ignore_index)
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in floats)
        if self._weight is not None and need_grad and self._counted_by != "observe":
            self._counted_by = "loss"  # attach(): the step's targets counted here
            self._add_to_step(torch.where(valid, y, self.vocab_size))
        y = torch.where(valid, y, 0)  # an ignored position's row adds nothing: any id will do
        col_gate, group_rows, group_gate, rare = None, None, None, None
        if need_grad or self.ready():  # an evaluation before the first step: no gates to apply
            col_gate, group_rows, group_gate = self.gates(y)
            rare = self.step_rare()
        acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        # the rare set's predicted probability mass costs a pass over T x V: measured on no-grad
        # (validation) calls
        mass_cols = None if rare is None or need_grad else rare.to(hidden.device, acc_dtype)
        z_coef = float(self.hparams.get("z_coef", 0.0))
        center = bool(self.hparams.get("center_gate")) and group_rows is not None
        opts = HeadOptions(
            float(label_smoothing), chunk_size, z_coef, softcap, center, reduction, need_grad
        )
        opts = opts._replace(fused=_use_fused(hidden, opts))
        gates = (_as(col_gate, acc_dtype, y), group_rows, _as(group_gate, acc_dtype, y))
        h = hidden.reshape(-1, d)
        loss, stats = GatedSoftmaxCE.apply(h, weight, bias, y, valid, gates, mass_cols, opts)
        self._stats = {"nll": stats[1]}
        if "z_coef" in self.hparams:
            self._stats["zloss"] = z_coef * stats[3]  # the z-loss term inside `loss`
        if rare is not None:
            rare = rare.to(y.device)
            n = valid.sum().clamp(min=1)
            rare_targets = (rare[y] & valid).sum()
            self._stats.update(
                rare_count=rare.sum(),
                rare_fraction=rare.float().mean(),
                rare_mass_true=rare_targets / n,
            )
            if mass_cols is not None:
                self._stats["rare_mass_pred"] = stats[
                    2
                ]  # mean predicted probability of the rare set
        if reduction == "none":
            loss = loss.reshape(targets.shape)
        reg = self.regulariser(hidden, weight, targets, ignore_index, bias, softcap)
        if reg is not None:
            _check(
                reduction != "none",
                f"method {self.name!r} adds a regulariser to the whole batch's loss: "
                "use reduction 'mean' or 'sum'",
            )
            self._stats["regulariser"] = reg.detach()
            loss = loss + (reg if reduction == "mean" else reg * valid.sum())
        return loss

    @property
    def stats(self):
        """Floats from the last loss() call: nll; with a rare group rare_count, rare_fraction (of
        the vocabulary), rare_mass_true (share of rare targets) and, on no-grad calls,
        rare_mass_pred (mean predicted probability of
        the rare set); regulariser; zloss. Converted lazily: reading them syncs the GPU, computing
        them does not."""
        return {k: float(v) for k, v in self._stats.items()}

    def state_dict(self):
        return {
            "name": self.name,
            "steps": self.steps,
            "vocab_size": self.vocab_size,
            "hparams": dict(self.hparams),
        }

    def load_state_dict(self, state):
        """Restore a state_dict(); refuses one made for another method, vocabulary size or
        hyper-parameters."""
        _check(
            state.get("name") == self.name,
            f"state_dict is for method {state.get('name')!r}, not {self.name!r}",
        )
        _check(
            state.get("vocab_size", self.vocab_size) == self.vocab_size,
            f"state_dict is for vocab_size {state.get('vocab_size')}, this method has "
            f"{self.vocab_size}",
        )
        for key, value in state.get("hparams", {}).items():
            _check(
                self.hparams.get(key) == value,
                f"state_dict is for {key}={value!r}, this method has {key}="
                f"{self.hparams.get(key)!r}: build the method with the hyper-parameters of the run "
                "it comes from",
            )
        self.steps = state["steps"]


def _as(gate, dtype, like):
    """A (V,) gate in the head's accumulation dtype on `like`'s device, or None."""
    return None if gate is None else gate.to(like.device, dtype)


def _gather_ranks(ids):
    """Every rank's ids, in rank order, under torch.distributed (all ranks pass the same shape);
    else ids."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ids
    world = torch.distributed.get_world_size()
    parts = [torch.empty_like(ids) for _ in range(world)]
    torch.distributed.all_gather(parts, ids)
    return torch.cat(parts)


class AGG(MLE):
    """Adaptive Gradient Gating (AGG Sec. 4): dynamic rare group (Eq. 5), gates g1/g2 (Eq. 7-8) on
    the weight gradient, equal to the three-logit construction of Eq. 9-10 (gradient wrt hidden:
    MLE's; wrt weight: Eq. 23) with one logit matrix. The window is a ring of the last K steps'
    target ids (under torch.distributed, every rank's, gathered: all ranks pass targets of one
    shape, padded with ignore_index), so every rank gates with the same rare group and a checkpoint
    of any rank resumes exactly. Beyond the paper: agg-continuous (no jump in a token's push at the
    threshold), agg-centered (the cone is along the mean feature) and agg-prefill (the K - t steps
    not yet seen count at the training split's rates, `counts` scaled to the first step's targets,
    so early
    steps do not mark most of the vocabulary rare)."""

    name = "agg"
    spec = {}  # {name: (default, type, meaning)}
    alpha_meaning = (
        "AGG Eq. 5 rarity threshold, in appearances per optimizer step (paper: LM 0.03, "
    )
    spec["alpha"] = (0.03, float, alpha_meaning + "MT 0.08)")
    spec["window"] = (
        None,
        int,
        "AGG counter memory K in optimizer steps (the paper: steps per epoch)",
    )
    spec["use_g1"] = (True, bool, "AGG: apply gate g1 (Eq. 7)")
    spec["use_g2"] = (True, bool, "AGG: apply gate g2 (Eq. 8)")
    static_meaning = (
        "freeze AGG's rare group after N steps (agg-static default: one epoch, AGG App. D)"
    )
    spec["static_after"] = (None, int, static_meaning)
    continuous = "agg-continuous: g1 = min(a_k / (alpha K), 1), 1 at the rarity threshold"
    spec["continuous_g1"] = (False, bool, continuous)
    centered = "agg-centered: gate only the push along the batch's mean feature"
    spec["center_gate"] = (False, bool, centered)
    prefill = "agg-prefill: start AGG's window full, at the training split's expected counts"
    spec["prefill"] = (False, bool, prefill)
    del alpha_meaning, static_meaning, continuous, centered, prefill  # no class attributes

    def __init__(self, vocab_size, **kw):
        super().__init__(vocab_size, **kw)
        _check(
            self.hparams["window"] is not None,
            f"method {self.name!r}: window (K, the paper's steps per epoch) "
            "is missing: give window=, or build_method(..., steps_per_epoch=), or counts= and "
            "tokens_per_step=",
        )
        self.history = (
            deque()
        )  # the target ids of the last `window` steps (ignored: vocab_size), int32
        self.appearances = torch.zeros(vocab_size, dtype=torch.long)  # a = sum_t m_t (Eq. 5)
        self.static_rare = (
            None  # rare group frozen after `static_after` steps ("static AGG", AGG Table 10)
        )
        # expected appearances per step of each token (prefill), set by the first observe()
        self.prefill_rate = None
        self._gates = None  # (col_gate, rare, group_gate) of the current step: computed once a step
        _check(
            not self.hparams["prefill"] or self.counts is not None,
            f"method {self.name!r}: prefill needs counts (the training split's token counts)",
        )

    def _count(self, ids):
        """(V + 1,) long: how often each id occurs in ids (the last entry counts ignored
        positions)."""
        counts = torch.zeros(self.vocab_size + 1, dtype=torch.long, device=ids.device)
        ones = torch.ones(len(ids), dtype=torch.long, device=ids.device)
        return counts.index_add_(0, ids, ones)

    def _new_step(self, ids):
        super()._new_step(ids)
        ids = _gather_ranks(ids.int())
        step_counts = self._count(ids)
        self.appearances = self.appearances.to(ids.device) + step_counts[: self.vocab_size]
        if self.hparams["prefill"] and self.prefill_rate is None:
            step_targets = step_counts[: self.vocab_size].sum()
            self.prefill_rate = (
                self.counts.double().to(ids.device) / self.counts.sum().clamp(min=1) * step_targets
            )
        self.history.append(ids)
        if len(self.history) > self.hparams["window"]:  # the oldest step leaves the window
            old_counts = self._count(self.history.popleft().to(ids.device))
            self.appearances -= old_counts[: self.vocab_size]
        if self.hparams["static_after"] is not None and self.steps == self.hparams["static_after"]:
            self.static_rare = self.rare_mask()
        self._gates = (
            self._compute_gates()
        )  # once a step, outside loss(): a compiled loss only reads them

    def _join_step(self, ids):
        ids = _gather_ranks(ids.int())
        self.history[-1] = torch.cat([self.history[-1], ids])
        self.appearances += self._count(ids)[
            : self.vocab_size
        ]  # this step's gates stay as computed

    def to(self, device):
        self.appearances = self.appearances.to(device)
        self.history = deque(ids.to(device) for ids in self.history)
        self.prefill_rate = None if self.prefill_rate is None else self.prefill_rate.to(device)
        self._gates = None
        return self

    def window_appearances(self):
        """a_k (Eq. 5) as a float64 tensor; with prefill, plus the expected appearances of the steps
        not yet seen."""
        a = self.appearances.double()
        if self.prefill_rate is not None and self.steps < self.hparams["window"]:
            a = a + (self.hparams["window"] - self.steps) * self.prefill_rate.to(a.device)
        return a

    def mean_counts(self):
        """a_k / K: appearances per step over the window (K = min(steps seen, window); with prefill
        K = window)."""
        _check(
            self.steps > 0,
            f"method {self.name!r}: call observe(targets) once per optimizer step before loss(), "
            "or attach(optimizer, weight)",
            RuntimeError,
        )
        k = (
            self.hparams["window"]
            if self.prefill_rate is not None
            else min(self.steps, self.hparams["window"])
        )
        return self.window_appearances() / k

    def rare_mask(self):
        if self.static_rare is not None:
            return self.static_rare
        rare = self.mean_counts() < self.hparams["alpha"]  # AGG Eq. 5
        rare[self.special_ids] = False
        return rare

    def step_gates(self):
        """(col_gate, rare, group_gate), each (V,), of the current step: computed once a step."""
        if self._gates is None:  # after to() or load_state_dict()
            self._gates = self._compute_gates()
        return self._gates

    def step_rare(self):
        return self.step_gates()[1]

    def ready(self):
        return self.steps > 0

    def _compute_gates(self):
        rare = self.rare_mask()
        a = self.window_appearances().to(rare.device)
        g1 = self.mean_counts().to(rare.device)  # AGG Eq. 7: a_k / K (g in [0, 1])
        if self.hparams["continuous_g1"] and self.hparams["alpha"] > 0:
            g1 = (
                g1 / self.hparams["alpha"]
            )  # agg-continuous: a_k / (alpha K), 1 at the rarity threshold
        g1 = g1.clamp(max=1.0)
        rare_mean = (a * rare).sum() / rare.sum().clamp(min=1)  # the rare group's mean appearances
        g2 = (a / rare_mean.clamp(min=1e-12)).clamp(
            max=1.0
        )  # AGG Eq. 8: min(a_k / mean_rare(a), 1)
        col_gate = torch.where(rare, g1, 1.0)  # rows whose target is not rare
        group_gate = torch.where(rare, g2, 1.0)  # rows whose target is rare
        return col_gate, rare, group_gate

    def gates(self, y):
        col_gate, rare, group_gate = self.step_gates()
        col_gate = col_gate if self.hparams["use_g1"] else None
        group_gate = group_gate if self.hparams["use_g2"] else None
        return col_gate, rare.to(y.device)[y], group_gate

    def state_dict(self):
        history = []
        for ids in self.history:  # each step's (ids, counts), sparse
            counts = self._count(ids.long())[: self.vocab_size].cpu()
            seen = counts.nonzero().squeeze(1)
            history.append((seen, counts[seen]))
        state = super().state_dict()
        state["appearances"] = self.appearances.cpu()
        state["history"] = history
        state["static_rare"] = None if self.static_rare is None else self.static_rare.cpu()
        state["prefill_rate"] = None if self.prefill_rate is None else self.prefill_rate.cpu()
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.appearances = state["appearances"].clone()
        steps = [ids.repeat_interleave(counts).int() for ids, counts in state["history"]]
        self.history = deque(steps)
        self.static_rare = state["static_rare"]
        self.prefill_rate = state.get("prefill_rate")
        self._gates = None


def _variant(base, name, **overrides):
    """A registered alias of `base` with other default hyper-parameters (e.g. the AGG ablations)."""
    spec = {
        key: (overrides.get(key, default), typ, meaning)
        for key, (default, typ, meaning) in base.spec.items()
    }
    return type(
        base.__name__ + "_" + name.replace("-", "_"),
        (base,),
        {"name": name, "spec": spec, "__doc__": f"{base.__doc__}\n{overrides}"},
    )


class StaticGroupMethod(MLE):
    """Base of the methods whose rare group is static: the `rare_fraction` least frequent tokens by
    training counts."""

    spec = dict(
        rare_fraction=(
            0.2,
            float,
            "share of the vocabulary in the static rare group (by train counts)",
        )
    )

    def __init__(self, vocab_size, **kw):
        super().__init__(vocab_size, **kw)
        _check(
            self.counts is not None,
            f"method {self.name!r} needs counts=<token counts of the training split, "
            "shape (V,)> to define its static rare group",
        )
        self.rare = least_frequent_mask(
            self.counts, self.hparams["rare_fraction"], self.special_ids
        )

    @property
    def any_rare(self):  # known on the host: the group is fixed
        if getattr(self, "_any_rare", None) is None:
            self._any_rare = bool(self.rare.any())
        return self._any_rare

    def rare_mask(self):
        return self.rare


class AGPS(StaticGroupMethod):
    """Adaptive Gradient Partial Scaling (AGPS Eq. 13-15, Algorithm 1): rare words absent from the
    batch get the push from non-rare features scaled by f1 = c/mu1 and an extra push from rare
    features scaled by f2 = min(c/mu2, 1).
    Follows Algorithm 1 literally: the rare-target rows get f1 + f2 (its L1 and L2 terms both reach
    them)."""

    name = "agps"
    spec = dict(
        StaticGroupMethod.spec,
        mu1=(None, float, "AGPS mu1 (AGPS Eq. 14; default: the largest rare count)"),
        mu2=(None, float, "AGPS mu2 (AGPS Eq. 15; default: the mean rare count)"),
        rare_rank=(
            None,
            int,
            "AGPS i_r: words from this frequency rank on are rare (overrides rare_fraction)",
        ),
    )

    def __init__(self, vocab_size, **kw):
        super().__init__(vocab_size, **kw)
        if (
            self.hparams["rare_rank"] is not None
        ):  # i_r: the words ranked i_r and beyond by frequency are rare
            order = torch.argsort(self.counts.double(), descending=True, stable=True)
            self.rare = torch.zeros(vocab_size, dtype=torch.bool)
            self.rare[order[self.hparams["rare_rank"] :]] = True
            self.rare[self.special_ids] = False
        c = self.counts.double()
        rare_c = c[self.rare] if self.rare.any() else torch.ones(1, dtype=torch.double)
        mu1 = self.hparams["mu1"] or float(rare_c.max().clamp(min=1))
        mu2 = self.hparams["mu2"] or float(rare_c.mean().clamp(min=1))
        c_clip = c.clamp(max=mu1)  # Algorithm 1, lines 1-3
        self.f1, self.f2 = c_clip / mu1, (c_clip / mu2).clamp(max=1.0)

    def gates(self, y):
        if not self.any_rare:
            return None, None, None
        rare = self.rare.to(y.device)
        full = (
            ~rare
        )  # M_word (lines 4-6): non-rare words and words of this batch get the full gradient
        full[y] = True
        col_gate = torch.where(full, 1.0, self.f1.to(y.device))  # line 8: (M_word + f1).clip(max=1)
        extra = torch.where(
            full, 0.0, self.f2.to(y.device)
        )  # line 7: M_wordrev, the L2 path of rare-target rows
        return col_gate, rare[y], col_gate + extra


class FreezeRare(StaticGroupMethod):
    """Rare embeddings frozen (AGG Table 1 / Fig. 2, AGPS Table 1) until step `until` (None: never):
    each loss() puts a one-shot hook on `weight` that zeroes those rows' whole gradient in the next
    backward (the input-embedding use too). Decoupled weight decay would still shrink them:
    after_step(weight) puts them back to their values at the
    first loss() call ("in their initial states", AGG Table 1)."""

    name = "freeze-rare"
    spec = dict(
        StaticGroupMethod.spec,
        until=(None, int, "freeze-rare: release the rare embeddings after this step"),
    )

    def __init__(self, vocab_size, **kw):
        super().__init__(vocab_size, **kw)
        self._initial_rows = None  # the frozen rows as first seen by loss()

    @torch.no_grad()
    def after_step(self, weight):
        if self.frozen() and self._initial_rows is not None:
            weight[self.rare.to(weight.device)] = self._initial_rows.to(weight.device, weight.dtype)

    def frozen(self):
        return self.hparams["until"] is None or self.steps < self.hparams["until"]

    def loss(self, hidden, weight, targets, **kw):
        if weight.requires_grad and torch.is_grad_enabled() and self.frozen():
            if self._initial_rows is None:
                self._initial_rows = weight.detach()[self.rare.to(weight.device)].clone()
            keep = (~self.rare).to(weight.device)[:, None]

            def mask_once(grad):
                handle.remove()
                return grad * keep.to(grad.dtype)

            handle = weight.register_hook(mask_once)
        return super().loss(hidden, weight, targets, **kw)


class FreezeParts(StaticGroupMethod):
    """Gradient-part freezing (AGG Sec. 3.2, Table 2): drop part (b) and/or (c) of Eq. 4 for rare
    embeddings.
    (b) pushes rare embeddings from features whose target is not rare; (c) from features whose
    target is rare."""

    name = "freeze-bc"
    spec = dict(
        StaticGroupMethod.spec,
        parts=("bc", str, "freeze-*: the parts of AGG Eq. 4 to drop (b, c, bc)"),
    )

    def gates(self, y):
        if not self.any_rare:
            return None, None, None
        rare = self.rare.to(y.device)
        zero_on_rare, parts = (~rare).double(), self.hparams["parts"]
        return (
            zero_on_rare if "b" in parts else None,
            rare[y],
            zero_on_rare if "c" in parts else None,
        )


def _pairwise_cosine(weight):
    """(1/N^2) sum_{i != j} cos(w_i, w_j) in O(N d): ||sum of unit rows||^2 minus the diagonal
    (CosReg Eq. 6)."""
    unit = F.normalize(weight, dim=1)
    total = unit.sum(dim=0)
    return (total @ total - (unit * unit).sum()) / weight.shape[0] ** 2


class CosReg(MLE):
    """MLE-CosReg (CosReg Eq. 6): L_MLE + gamma * mean pairwise cosine of the embeddings."""

    name = "cosreg"
    spec = dict(gamma=(1.0, float, "CosReg weight (CosReg Eq. 6)"))

    def regulariser(self, hidden, weight, targets, ignore_index, bias=None, softcap=None):
        return self.hparams["gamma"] * _pairwise_cosine(weight.float())


class FRAGE(MLE):
    """FRAGE (Eq. 2-5): a logistic-regression discriminator tells popular (top `popular_fraction` by
    counts) from rare embeddings; the model adds -lambda * L_D (fooling it); the discriminator, with
    its own Adam, takes `disc_steps`
    class-balanced full-batch steps per optimizer step on detached embeddings (Algorithm 1: one; k >
    1 as in GANs)."""

    name = "frage"
    spec = dict(
        popular_fraction=(0.2, float, "FRAGE: share of popular tokens"),
        lambda_=(0.1, float, "FRAGE adversarial weight (FRAGE Eq. 5)"),
        disc_lr=(1e-2, float, "FRAGE discriminator learning rate"),
        disc_steps=(1, int, "FRAGE discriminator updates per step"),
    )

    def __init__(self, vocab_size, **kw):
        super().__init__(vocab_size, **kw)
        _check(
            self.counts is not None,
            "method 'frage' needs counts=<token counts of the training split, shape (V,)> "
            "to define its popular/rare groups",
        )
        self.rare = least_frequent_mask(
            self.counts, 1 - self.hparams["popular_fraction"], self.special_ids
        )
        self.popular = ~self.rare
        self.popular[self.special_ids] = False
        self.disc = self.disc_opt = self._saved_disc = (
            None  # _saved_disc: a loaded state, for the first loss() call
        )
        self._disc_pending = False

    def to(self, device):
        if self.disc is not None:
            self.disc.to(device)
            self.disc_opt.load_state_dict(
                self.disc_opt.state_dict()
            )  # moves Adam's state to the parameters' device
        return self

    def disc_loss(self, weight, disc_weight, disc_bias):
        """L_D (FRAGE Eq. 2), "the loss of the discriminator": class-balanced binary cross-entropy
        of f = sigmoid(linear(w)) = P(popular). (Eq. 2 as printed drops the minus sign; with it, Eq.
        3-5 are consistent:
        the discriminator minimises L_D, the model adds -lambda * L_D to fool it.)"""
        score = F.linear(weight.float(), disc_weight, disc_bias).squeeze(1)
        pop, rare = self.popular.to(weight.device), self.rare.to(weight.device)
        return -(F.logsigmoid(score[pop]).mean() + F.logsigmoid(-score[rare]).mean())

    @torch.no_grad()
    def disc_accuracy(self, weight):
        """Class-balanced accuracy of the discriminator (score > 0 means popular)."""
        score = self.disc(weight.float()).squeeze(1)
        pop, rare = self.popular.to(weight.device), self.rare.to(weight.device)
        return 0.5 * float((score[pop] > 0).float().mean() + (score[rare] < 0).float().mean())

    def _new_step(self, ids):
        super()._new_step(ids)
        self._disc_pending = True  # one discriminator step per optimizer step

    def regulariser(self, hidden, weight, targets, ignore_index, bias=None, softcap=None):
        if (
            self.disc is None
        ):  # built at the first call, on weight's device; a loaded state draws no random numbers
            saved, self._saved_disc = (
                self._saved_disc,
                None,
            )  # so that a resumed run keeps its random stream exactly
            d, device = weight.shape[1], weight.device
            if saved is None:
                self.disc = torch.nn.Linear(d, 1, device=device)
            else:  # no initialisation: no random numbers drawn
                self.disc = torch.nn.utils.skip_init(torch.nn.Linear, d, 1, device=device)
            self.disc_opt = torch.optim.Adam(self.disc.parameters(), lr=self.hparams["disc_lr"])
            if saved is not None:  # Adam's state moves to the parameters' device
                self.disc.load_state_dict(saved["model"])
                self.disc_opt.load_state_dict(saved["opt"])
        frozen_disc = (
            self.disc.weight.detach().clone(),
            self.disc.bias.detach().clone(),
        )  # the model cannot move D
        reg = -self.hparams["lambda_"] * self.disc_loss(weight, *frozen_disc)  # Eq. 5
        if (
            self._disc_pending and torch.is_grad_enabled()
        ):  # Eq. 4: the discriminator's steps on detached W
            for _ in range(self.hparams["disc_steps"]):
                self.disc_opt.zero_grad(set_to_none=True)
                self.disc_loss(weight.detach(), self.disc.weight, self.disc.bias).backward()
                self.disc_opt.step()
            self._disc_pending = False
        return reg

    def state_dict(self):
        disc = (
            self._saved_disc
            if self.disc is None
            else {"model": self.disc.state_dict(), "opt": self.disc_opt.state_dict()}
        )
        return {**super().state_dict(), "disc": disc, "disc_pending": self._disc_pending}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._disc_pending = state["disc_pending"]
        self.disc, self.disc_opt, self._saved_disc = None, None, state["disc"]


def unlikelihood(
    hidden, weight, targets, ignore_index=-100, weight_gate=None, bias=None, softcap=None
):
    """Token-level unlikelihood (Welleck et al. 2020): sum over previous-context candidates c of
    -log(1 - p(c)), averaged over non-ignored positions. Candidates of position t: the distinct
    targets before t in the same sequence (not across sequences), minus the current target.
    weight_gate (B, T, V), optional: scales the gradient of the
    logits wrt `weight` elementwise (the gradient wrt `hidden` stays whole), as AGG gates the
    NLL's."""
    _check(
        targets.dim() == 2, f"unlikelihood needs targets shaped (B, T), got {tuple(targets.shape)}"
    )
    B, T = targets.shape
    valid = targets != ignore_index
    same = targets[:, :, None] == targets[:, None, :]  # [b, t, j]: y_t == y_j
    before = torch.ones(T, T, dtype=torch.bool, device=targets.device).tril(-1)  # j < t
    first = valid & ~(same & before & valid[:, None, :]).any(
        -1
    )  # y_j occurs for the first time at j
    cand = before & first[:, None, :] & valid[:, :, None] & ~same
    logits = hidden @ weight.T
    if weight_gate is not None and weight.requires_grad and torch.is_grad_enabled():
        # same value; d/dW through the gated copy only, d/dh through the first term only
        via_w = hidden.detach() @ weight.T
        via_w.register_hook(lambda g: g * weight_gate.to(g.dtype))
        logits = hidden @ weight.detach().T + (via_w - via_w.detach())
    if bias is not None:
        logits = logits + bias
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logp = F.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    cand_logp = logp.gather(
        2, targets.clamp(min=0)[:, None, :].expand(B, T, T)
    )  # [b, t, j] = log p_t(y_j)
    penalty = -torch.log((1 - cand_logp.exp()).clamp(min=1e-5))
    return (penalty * cand).sum() / valid.sum().clamp(min=1)


class UL(MLE):
    """MLE + token-level unlikelihood (alpha_ul weights the UL term)."""

    name = "ul"
    spec = dict(alpha_ul=(1.0, float, "unlikelihood weight"))

    def regulariser(self, hidden, weight, targets, ignore_index, bias=None, softcap=None):
        return self.hparams["alpha_ul"] * unlikelihood(
            hidden, weight, targets, ignore_index, None, bias, softcap
        )


class ULAGG(AGG):
    """AGG's gated NLL + token-level unlikelihood (AGG Table 4, which does not say how the two
    combine: gate_ul,
    ungated and ul_features_only are this project's). Ungated, the UL softmax pulls every rare row
    to the features."""

    name = "ul+agg"
    spec = dict(
        AGG.spec,
        alpha_ul=UL.spec["alpha_ul"],
        gate_ul=(
            True,
            bool,
            "ul+agg: gate the UL term's weight gradient with AGG's gates too (our choice)",
        ),
        ul_features_only=(
            False,
            bool,
            "ul+agg-features: the UL term's gradient reaches the features only",
        ),
    )

    def regulariser(self, hidden, weight, targets, ignore_index, bias=None, softcap=None):
        gate = None
        if self.hparams["ul_features_only"]:
            weight, bias = weight.detach(), None if bias is None else bias.detach()
        elif self.hparams["gate_ul"] and weight.requires_grad and torch.is_grad_enabled():
            y = targets.clamp(min=0).reshape(-1)
            col_gate, group_rows, group_gate = self.gates(
                y
            )  # AGG's gates, as the head applies them to the NLL's
            if (
                group_rows is not None
            ):  # something is rare: the (B, T, V) gate of the UL term's weight gradient
                gate = gate_matrix(y, self.vocab_size, col_gate, group_rows, group_gate).view(
                    *targets.shape, -1
                )
        return self.hparams["alpha_ul"] * unlikelihood(
            hidden, weight, targets, ignore_index, gate, bias, softcap
        )


class Center(MLE):
    """Embedding centering (Bis et al. 2021: degenerate rows share a common drift, the mean row,
    which carries the frequency information; Stollenwerk et al. 2026, output embedding centering)
    over all V rows (the softmax sums over
    all): center_mode "step" subtracts the mean row after every optimizer step, "loss" adds mu_coef
    ||mean row||^2."""

    name = "center"
    spec = dict(
        center_mode=(
            "step",
            str,
            "center: 'step' subtracts the mean embedding row after each step "
            "(mu-centering), 'loss' adds mu_coef * ||mean row||^2 (mu-loss)",
        ),
        mu_coef=(
            1.0,
            float,
            "center with center_mode 'loss': weight of the mu-loss ||mean row||^2",
        ),
    )

    @torch.no_grad()
    def after_step(self, weight):
        if self.hparams["center_mode"] == "step":
            weight.sub_(weight.mean(0))  # mu-centering: the rows sum to zero

    def regulariser(self, hidden, weight, targets, ignore_index, bias=None, softcap=None):
        if self.hparams["center_mode"] != "loss":
            return None
        mu = (weight if weight.dtype == torch.float64 else weight.float()).mean(0)
        return self.hparams["mu_coef"] * mu.square().sum()


class ZLoss(MLE):
    """MLE + z-loss (PaLM Sec. 5; OLMo 2): mean NLL + z_coef * mean (log Z)^2, log Z = logsumexp of
    the logits (bias
    included), inside the fused head. Keeps log Z near 0, so logits cannot drift together."""

    name = "zloss"
    spec = dict(
        z_coef=(1e-4, float, "zloss: weight of the z-loss mean (log Z)^2 (PaLM, OLMo 2: 1e-4)")
    )


class AGGCenter(AGG):
    """AGG's gates (Eq. 5-8) plus mu-centering of the weight after every optimizer step (see
    Center): AGG slows the
    push of rare rows, centering removes the drift all rows share."""

    name = "agg+center"

    @torch.no_grad()
    def after_step(self, weight):
        weight.sub_(weight.mean(0))


@torch.no_grad()
def gradient_parts(
    hidden, weight, targets, rare, gates=(None, None, None), ignore_index=-100, softcap=None
):
    """Per embedding row k, the norms of the three parts of the mean NLL's gradient wrt w_k (AGG Eq.
    4) on a batch: (a) the pull towards the features of the positions whose target is k: sum (p_k -
    1) h_i; (b) the push from the features of positions whose target is not in `rare` (and not k):
    sum p_k h_i; (c) the push from the features of positions whose target is another token of
    `rare`: sum p_k h_i; each as the method applies it: gates = method.gates(valid targets) ((None,
    None, None): MLE's); softcap: each term
    times 1 - tanh^2 of the capped logit. Returns (V, 3) float64: ||a_k||, ||b_k||, ||c_k|| / n."""
    d = hidden.shape[-1]
    h, y = hidden.reshape(-1, d).float(), targets.reshape(-1)
    keep = y != ignore_index
    h, y = h[keep], y[keep]
    n, V = len(y), weight.shape[0]
    logits = h @ weight.float().T
    cap = torch.tanh(logits / softcap) if softcap else None
    p = torch.softmax(logits if cap is None else softcap * cap, dim=-1)
    p *= gate_matrix(y, V, *gates, dtype=p.dtype)
    rows = torch.arange(n, device=y.device)
    pull = p[rows, y] - 1.0
    if cap is not None:
        pull, p = pull * (1 - cap[rows, y].square()), p * (1 - cap.square())
    p[rows, y] = 0.0  # the target's own column is part (a)
    to_rare = rare.to(y.device)[y]
    pulls = (pull[:, None] * h).double()
    a = torch.zeros(V, d, dtype=torch.float64, device=h.device).index_add_(0, y, pulls)
    b = (p[~to_rare].T @ h[~to_rare]).double()
    c = (p[to_rare].T @ h[to_rare]).double()
    norms = torch.stack([a.norm(dim=1), b.norm(dim=1), c.norm(dim=1)], dim=1)
    return norms / max(n, 1)


METHODS = {}  # name -> method class, in the order the docs list them


def _register(*classes):
    for cls in classes:
        METHODS[cls.name] = cls


_register(MLE, AGG)
_register(_variant(AGG, "agg-no-g1", use_g1=False), _variant(AGG, "agg-no-g2", use_g2=False))
_register(_variant(AGG, "agg-static", static_after=1000))
_register(_variant(AGG, "agg-continuous", continuous_g1=True))
_register(
    _variant(AGG, "agg-centered", center_gate=True), _variant(AGG, "agg-prefill", prefill=True)
)
_register(AGPS, FreezeRare)
_register(
    _variant(FreezeParts, "freeze-b", parts="b"), _variant(FreezeParts, "freeze-c", parts="c")
)
_register(FreezeParts, CosReg, FRAGE, UL, ULAGG)
_register(_variant(ULAGG, "ul+agg-features", ul_features_only=True), Center, ZLoss, AGGCenter)
HPARAMS = {}  # every method's hyper-parameters {name: (type, meaning)}: the scripts' flags
for _cls in METHODS.values():
    for _key, (_default, _type, _meaning) in _cls.spec.items():
        HPARAMS[_key] = (_type, _meaning)
del _cls, _key, _default, _type, _meaning


def agg_family(name):
    """True for AGG and its variants (the methods with AGG's dynamic rare group and alpha)."""
    _check(name in METHODS, f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    return issubclass(METHODS[name], AGG)


def build_method(
    name, vocab_size, steps_per_epoch=None, tokens_per_step=None, rare_share=None, **hparams
):
    """Make the method `name` for `vocab_size` tokens; method.hparams holds what is in force.

    Common keywords: counts (the training split's token counts, (V,)), special_ids (never rare).
    tokens_per_step: target tokens per optimizer step, over all ranks (sequences x length, not a
    batch size). Where not given, AGG's window K and agg-static's static_after are one epoch (AGG
    Sec. 4.1, Appendix D): steps_per_epoch, or else counts.sum() / tokens_per_step; rare_share sets
    AGG's alpha to the rarity threshold whose rare group is that share of the vocabulary
    (alpha_for_rare_share; needs counts and tokens_per_step).
    A method without alpha ignores rare_share and says so in hparams["ignored"]."""
    _check(name in METHODS, f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    accepted = METHODS[name].defaults
    counts = hparams.get("counts")
    if steps_per_epoch is None and counts is not None and tokens_per_step:
        steps_per_epoch = float(torch.as_tensor(counts).double().sum()) / tokens_per_step
    if steps_per_epoch is not None:
        epoch = max(1, int(round(steps_per_epoch)))
        if "window" in accepted and hparams.get("window") is None:
            hparams["window"] = epoch
        if accepted.get("static_after") is not None and hparams.get("static_after") is None:
            hparams["static_after"] = epoch
    ignored = {}
    if rare_share is not None and "alpha" not in accepted:
        ignored["rare_share"] = rare_share
    elif rare_share is not None:
        _check(
            hparams.get("alpha") is None,
            "give alpha or rare_share, not both: each sets AGG's rarity threshold",
        )
        _check(
            counts is not None and tokens_per_step is not None,
            "rare_share needs counts (training-split token counts) and tokens_per_step",
        )
        special_ids = hparams.get("special_ids", ())
        hparams["alpha"] = alpha_for_rare_share(counts, rare_share, tokens_per_step, special_ids)
    method = METHODS[name](vocab_size, **hparams)
    if ignored:
        method.hparams["ignored"] = ignored
    return method


def _methods_help():
    """One line a method: its name and hyper-parameters with their defaults."""
    lines = []
    for name, cls in METHODS.items():
        params = ", ".join(f"{key}={value!r}" for key, value in cls.defaults.items())
        lines.append(f"    {name}: {params or 'no hyper-parameters'}")
    return "\n".join(lines)


build_method.__doc__ += "\n\n    Methods and their hyper-parameters (defaults):\n" + _methods_help()


def method_flag(key):
    """The command-line flag of hyper-parameter `key`: lambda_ -> --lambda, alpha_ul ->
    --alpha-ul."""
    return "--" + key.rstrip("_").replace("_", "-")


def true_or_false(text):
    """argparse type of the boolean hyper-parameters: 1/0, true/false, yes/no."""
    words = ("0", "false", "no", "1", "true", "yes")
    return (
        words.index(text.lower()) > 2
    )  # another word: argparse's one line "invalid true_or_false value"


def add_method_flags(group, skip=()):
    """One flag per hyper-parameter of the methods (argparse), dest named as method.hparams names
    it."""
    for key, (kind, meaning) in HPARAMS.items():
        if key in skip:
            continue
        users = [name for name, cls in METHODS.items() if key in cls.defaults]
        parse = true_or_false if kind is bool else kind
        group.add_argument(
            method_flag(key), dest=key, type=parse, help=f"{meaning} [{', '.join(users[:3])}]"
        )


# --------------------------------------------------------------------------------------- optimizer
class CoupledAdamW(torch.optim.Optimizer):
    """AdamW whose second moment is shared by the rows of each coupled parameter (Coupled Adam,
    Stollenwerk & Stollenwerk 2025): Adam divides each embedding row's update by its own sqrt(v), so
    rare rows (small v) take large steps in the direction all rows share. Arguments and state as
    torch.optim.AdamW's (amsgrad and its other flags refused); a parameter group may set "coupled".
    Couple only the embedding: [{"params": [emb]}, {"params": rest,
    "coupled": False}]; a group with coupled=False is torch.optim.AdamW, same arithmetic
    (bit-identical on CPU)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        coupled=True,
    ):
        given = [
            k
            for k, v in dict(
                amsgrad=amsgrad,
                capturable=capturable,
                differentiable=differentiable,
                foreach=foreach,
                fused=fused,
                maximize=maximize,
            ).items()
            if v
        ]
        _check(
            not given,
            f"CoupledAdamW: {', '.join(given)} not supported; it takes lr, betas, eps, "
            "weight_decay "
            "and a per-group 'coupled'",
        )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, coupled=coupled)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    @staticmethod
    def _check_group(group):
        """Refuse a group's value that would give wrong weights (a NaN lr: NaN weights), naming
        it."""
        for key in ("lr", "eps", "weight_decay"):
            _check_real(f"CoupledAdamW: {key}", group[key], 0, math.inf, "a finite number >= 0")
        betas = group["betas"]
        pair = isinstance(betas, (tuple, list)) and len(betas) == 2
        _check(pair, f"CoupledAdamW: betas must be two numbers in [0, 1), got {betas!r}")
        for beta in betas:
            _check_real("CoupledAdamW: betas", beta, 0, 1, "two numbers in [0, 1)")
            _check(beta < 1, f"CoupledAdamW: betas must be two numbers in [0, 1), got {betas!r}")
        coupled = group["coupled"]
        _check(
            isinstance(coupled, bool),
            f"CoupledAdamW: coupled must be True or False, got {coupled!r}",
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._check_group(
                group
            )  # a scheduler may have changed it; host numbers, no device work
            lr, (beta1, beta2), eps, wd = (
                group["lr"],
                group["betas"],
                group["eps"],
                group["weight_decay"],
            )
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check(
                    not p.grad.is_sparse,
                    "CoupledAdamW does not support sparse gradients",
                    RuntimeError,
                )
                state = self.state[p]
                if not state:  # AdamW's state, so state_dict() has AdamW's layout
                    state.update(
                        step=torch.tensor(0.0, dtype=torch.float32),
                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                    )
                m, v = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                t = state["step"].item()
                # decoupled weight decay, then the moments, in torch.optim.AdamW's order and
                # arithmetic
                if wd != 0:
                    p.mul_(1 - lr * wd)
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                # Coupled Adam: one second moment per column, the mean over the rows (the
                # vocabulary)
                v_used = v.mean(0, keepdim=True) if group["coupled"] and p.dim() else v
                denom = (v_used.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        return loss


# ---------------------------------------------------------------------- embedding-geometry metrics
def _matrix(name, weight, min_rows=0):
    """`weight` as a float64 (rows, d) tensor; a ValueError naming `name` unless it is one (NaN
    gives NaN)."""
    ok = torch.is_tensor(weight) and weight.dim() == 2 and weight.is_floating_point()
    _check(ok, f"{name} must be a 2-D floating point tensor (rows, d)")
    _check(len(weight) >= min_rows, f"{name} needs >= {min_rows} rows, got {tuple(weight.shape)}")
    return weight.detach().double()


def _ids(name, ids, vocab_size):
    """Token ids as a long tensor on the host; a ValueError naming `name` unless whole and in [0,
    vocab_size)."""
    t = torch.as_tensor(ids).reshape(-1)
    _check(
        not t.is_floating_point() and t.dtype != torch.bool,
        f"{name} must be whole token ids, got {t.dtype}",
    )
    t = t.long().cpu()
    inside = bool(((t >= 0) & (t < vocab_size)).all())
    _check(
        inside, f"{name} must be ids in [0, {vocab_size}), got {t.min().item()}..{t.max().item()}"
    )
    return t


@torch.no_grad()
def isotropy(weight, weights=None, center=False):
    """I(W) = min_a Z(a) / max_a Z(a), Z(a) = sum_i exp(w_i . a) (AGG Eq. 3), a over the
    eigenvectors of W^T W AND their negatives: an eigenvector's sign is arbitrary (eigh may return
    either) and Z(a) != Z(-a) whenever the rows share a direction, so taking both makes I(W) depend
    on W alone. float64, log Z by log-sum-exp. weights (V,), optional: row weights, e.g. token
    frequencies (Zipfian whitening, Yokoi et al. 2024), normalised to p summing to
    1: Z(a) = sum_i p_i exp(w_i . a), a over the eigenvectors of W^T diag(p) W. center: I of W minus
    its p-mean row."""
    w = _matrix("weight", weight)
    if weights is None:
        w = w - w.mean(0) if center else w
        second_moment, log_p = w.T @ w, 0.0
    else:
        p = torch.as_tensor(weights).detach().to(w.device, torch.float64).reshape(-1)
        _check(
            len(p) == len(w)
            and bool(torch.isfinite(p).all())
            and not bool((p < 0).any())
            and float(p.sum()) > 0,
            f"weights must be {len(w)} finite non-negative numbers with a positive sum (one per "
            "row of weight), "
            f"got shape {tuple(p.shape)}",
        )
        p = p / p.sum()
        w = w - p @ w if center else w
        second_moment, log_p = (
            w.T @ (p[:, None] * w),
            p.log()[:, None],
        )  # log 0 = -inf: a row of weight 0 adds nothing
    proj = w @ torch.linalg.eigh(second_moment)[1]
    log_z = torch.cat([torch.logsumexp(proj + log_p, dim=0), torch.logsumexp(-proj + log_p, dim=0)])
    return float(torch.exp(log_z.min() - log_z.max()))


@torch.no_grad()
def isoscore(weight):
    """IsoScore (Rudman et al. 2022) of the rows of `weight` as points in R^n: 1 when they spread
    their variance equally
    over all n dimensions, 0 when they use one (the `isoscore` package's, float64); nan when all
    rows are equal."""
    x = _matrix("weight", weight)
    n = x.shape[1]
    _check(
        n >= 2 and len(x) >= 2, f"isoscore needs >= 2 rows in >= 2 dimensions, got {tuple(x.shape)}"
    )
    x = x - x.mean(0)
    var = torch.linalg.eigvalsh(x.T @ x / (len(x) - 1)).clamp(
        min=0
    )  # variances along the principal components
    var = var * math.sqrt(n) / var.norm()  # scaled to norm sqrt(n)
    delta = (var - 1).norm() / math.sqrt(
        2 * (n - math.sqrt(n))
    )  # normalised distance from the all-ones vector
    phi = (n - delta**2 * (n - math.sqrt(n))) ** 2 / n**2  # the share of dimensions used
    return float((n * phi - 1) / (n - 1))


@torch.no_grad()
def undertrained_rows(weight, unused_ids):
    """Land & Bartolo 2024's under-trained-token indicator (magikarp's "cosine distance w/o 1st
    PC"): each row's cosine
    (V,) to the mean of the known unused rows (e.g. never seen in training), the centered rows'
    first PC removed."""
    w = _matrix("weight", weight)
    ids = _ids("unused_ids", unused_ids, len(w)).to(w.device)
    _check(len(ids) > 0, "undertrained_rows needs at least one known unused token id")
    centered = w - w.mean(0)
    first_pc = torch.linalg.eigh(centered.T @ centered)[1][
        :, -1
    ]  # eigh sorts ascending: the last is the first PC
    w = w - torch.outer(w @ first_pc, first_pc)
    ref = w[ids].mean(0)
    return (w @ ref) / (w.norm(dim=1) * ref.norm()).clamp(min=1e-12)


@torch.no_grad()
def mean_cosine(weight):
    """S(w) = (1/N^2) sum_i sum_{j != i} cos(w_i, w_j) (AGPS Eq. 9)."""
    return float(_pairwise_cosine(_matrix("weight", weight)))


@torch.no_grad()
def mean_cosine_between(a, b):
    """Mean cosine between the rows of a and the rows of b (e.g. rare vs frequent embeddings, AGG
    Fig. 2)."""
    a, b = _matrix("a", a, 0), _matrix("b", b, 0)
    _check(
        a.shape[1] == b.shape[1],
        f"a and b must have rows of one size, got {a.shape[1]} and {b.shape[1]}",
    )
    unit_a = F.normalize(a, dim=1)
    unit_b = F.normalize(b, dim=1)
    pairs = max(1, len(unit_a) * len(unit_b))
    return float(unit_a.sum(0) @ unit_b.sum(0) / pairs)


@torch.no_grad()
def singular_spectrum(weight):
    """Singular values of W normalised so the largest is 1 (CosReg Fig. 2b)."""
    s = torch.linalg.svdvals(_matrix("weight", weight))
    return s / s[0]


def frequency_groups(counts, fractions=(0.3, 0.5, 0.2)):
    """(frequent, medium, rare) index tensors: the vocabulary by training counts, 30/50/20% (AGG
    Sec. 3.1)."""
    shares = list(fractions)
    _check(
        len(shares) == 3,
        f"fractions must be three shares (frequent, medium, rare), got {fractions!r}",
    )
    for share in shares:
        _check_real("fractions", share, 0, 1, "three shares in [0, 1] summing to at most 1")
    _check(sum(shares) <= 1 + 1e-9, f"fractions must sum to at most 1, got {fractions!r}")
    order = torch.argsort(_counts_tensor(counts).double(), descending=True, stable=True)
    n_freq = round(shares[0] * len(order))
    n_med = round(shares[1] * len(order))
    return order[:n_freq], order[n_freq : n_freq + n_med], order[n_freq + n_med :]


GROUPS = ("freq", "med", "rare")  # the names of frequency_groups' three groups, most frequent first


def group_of(groups, vocab_size, missing=-1):
    """(V,) long: each token's number in `groups` (as frequency_groups': 0 freq, 1 med, 2 rare),
    else `missing`."""
    gid = torch.full((vocab_size,), missing, dtype=torch.long)
    for g, idx in enumerate(groups):
        gid[_ids("groups", idx, vocab_size)] = g
    return gid


def ppl_of(nll_sum, count):
    """exp(mean NLL); nan stays nan (a diverged model), overflow is inf, no tokens is nan."""
    if count <= 0:
        return float("nan")
    mean = float(nll_sum) / int(count)
    return math.exp(mean) if mean < 700 else (mean if math.isnan(mean) else math.inf)


class GroupNLL:
    """Summed NLL and token counts per group, for PPL total and per frequency group (AGG Table 3):
    add(nll, group)
    with each position's NLL and group id (group_of's; extra ids up to n_groups - 1 count in the
    total only)."""

    def __init__(self, n_groups=3):
        self.nll, self.count = (
            torch.zeros(n_groups, dtype=torch.float64),
            torch.zeros(n_groups, dtype=torch.long),
        )

    def add(self, nll, group):
        g = group.flatten()
        values = nll.flatten().double()
        n_groups = len(self.nll)
        _check(len(values) == len(g), f"nll has {len(values)} positions but group has {len(g)}")
        inside = bool(((g >= 0) & (g < n_groups)).all())
        _check(inside, f"group ids must be in [0, {n_groups}), as group_of numbers them")
        sums = torch.zeros(n_groups, dtype=torch.float64, device=g.device).index_add_(0, g, values)
        self.nll += sums.cpu()
        self.count += torch.bincount(g, minlength=n_groups).cpu()

    def tokens(self):
        return int(self.count.sum())

    def loss(self):  # mean NLL over every position
        return float(self.nll.sum()) / max(1, self.tokens())

    def ppl(self, group=None):
        return (
            ppl_of(self.nll.sum(), self.count.sum())
            if group is None
            else ppl_of(self.nll[group], self.count[group])
        )

    def ppl_groups(self):
        return {name: self.ppl(k) for k, name in enumerate(GROUPS)}


@torch.no_grad()
def geometry(weight, groups, seen=None):
    """The embedding matrix's geometry, total and per group (*_groups): isotropy (AGG Eq. 3),
    mean_cosine (AGPS Eq. 9), norm (mean row norm), rows (counted); mean_row_share (the mean row's
    norm over the mean row norm: the rows' common drift, Bis et al. 2021) and cosine_rare_freq (AGG
    Fig. 2). groups: {name: index tensor}; seen: bool (V,)
    of the rows to count, e.g. counts > 0 (a token never seen in training has no data to shape its
    row); None: all."""
    W = _matrix("weight", weight).cpu()
    keep = torch.ones(len(W), dtype=torch.bool)
    if seen is not None:
        keep = torch.as_tensor(seen, dtype=torch.bool).cpu().reshape(-1)
        _check(len(keep) == len(W), f"seen has {len(keep)} entries but weight {len(W)} rows")
    rows = {}  # each group's rows that count
    for name, idx in groups.items():
        idx = _ids(f"groups[{name!r}]", idx, len(W))
        rows[name] = idx[keep[idx]]
    Wk = W[keep]
    row_norms = Wk.norm(dim=1)
    out = {}
    out["isotropy"] = isotropy(Wk)
    out["isotropy_groups"] = {g: isotropy(W[i]) for g, i in rows.items()}
    out["mean_cosine"] = mean_cosine(Wk)
    out["mean_cosine_groups"] = {g: mean_cosine(W[i]) for g, i in rows.items()}
    out["norm"] = float(row_norms.mean())
    out["norm_groups"] = {g: float(W[i].norm(dim=1).mean()) for g, i in rows.items()}
    out["mean_row_share"] = float(Wk.mean(0).norm() / row_norms.mean())
    out["rows"] = int(keep.sum())
    out["rows_groups"] = {g: len(i) for g, i in rows.items()}
    if "rare" in rows and "freq" in rows:
        out["cosine_rare_freq"] = mean_cosine_between(W[rows["rare"]], W[rows["freq"]])
    return out
