"""Tests of AGG's rivals in agg.py (centering, z-loss, agg+center, Coupled Adam) and the extra
geometry metrics (IsoScore, weighted/centered I(W), the under-trained-token indicator): against
autograd and literal references."""

import argparse
import io

import pytest
import torch
import torch.nn.functional as F
from test_agg import ALPHA, WINDOW, D, V, make_counts, observe_counts

import agg


def inputs(seed=0, T=60, ignore=()):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    # a shared offset: log Z far from 0
    w = torch.randn(V, D, generator=g, dtype=torch.float64) + 0.5
    y = torch.randint(0, V, (T,), generator=g)
    y[list(ignore)] = -100
    return h, w, y


def grads(method, h, w, y, bias=None, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    loss = method.loss(h, w, y, bias=b, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


# --------------------------------------------------------------------------------- z-loss


def autograd_zloss(h, w, y, c, bias=None, smoothing=0.0):
    """F.cross_entropy + c * mean (logsumexp)^2 over the non-ignored positions, by autograd."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    keep = y != -100
    logits = h[keep] @ w.T + (0 if b is None else b)
    loss = (
        F.cross_entropy(logits, y[keep], label_smoothing=smoothing)
        + c * torch.logsumexp(logits, dim=1).pow(2).mean()
    )
    loss.backward()
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("chunk_size", [None, 7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_zloss_matches_autograd(chunk_size, with_bias):
    h, w, y = inputs(seed=1, ignore=(2, 3, 40))
    b = (
        torch.randn(V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        if with_bias
        else None
    )
    c = 0.05  # large enough that the z term moves every gradient
    method = agg.build_method("zloss", V, z_coef=c)
    got = grads(method, h, w, y, bias=b, chunk_size=chunk_size)
    want = autograd_zloss(h, w, y, c, bias=b)
    for a, e in zip(got, want):
        if e is not None:
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)
    assert torch.all(got[1][y == -100] == 0)  # ignored positions get no gradient
    mle = grads(agg.build_method("mle", V), h, w, y, bias=b, chunk_size=chunk_size)
    for a, e in zip(got[1:], mle[1:]):
        if e is not None:
            assert (a - e).abs().max() > 1e-4  # the z term is really there
    keep = y != -100
    logits = h[keep] @ w.T + (0 if b is None else b)
    lse = torch.logsumexp(logits, 1)
    assert method.stats["zloss"] == pytest.approx(float(c * lse.pow(2).mean()), rel=1e-12)
    assert method.stats["nll"] == pytest.approx(float(F.cross_entropy(logits, y[keep])), rel=1e-12)


def test_zloss_with_label_smoothing_and_without_grad():
    h, w, y = inputs(seed=2, ignore=(0,))
    method = agg.build_method("zloss", V, z_coef=0.02)
    got = grads(method, h, w, y, label_smoothing=0.1)
    want = autograd_zloss(h, w, y, 0.02, smoothing=0.1)
    for a, e in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)
    with torch.no_grad():  # the validation path (no gradient buffers) reports the same value
        assert float(method.loss(h, w, y, label_smoothing=0.1)) == pytest.approx(
            float(want[0]), rel=1e-12
        )
    assert agg.build_method("zloss", V).hparams["z_coef"] == 1e-4  # PaLM / OLMo 2
    assert "zloss" not in agg.build_method("mle", V).stats  # other methods' stats are unchanged
    # all ignored: 0 with zero gradients, as for MLE
    empty = grads(method, h, w, torch.full_like(y, -100))
    assert float(empty[0]) == 0.0 and torch.all(empty[2] == 0)


def test_bad_new_hyper_parameters_are_refused_with_the_range():
    for name, kw, match in (
        ("zloss", dict(z_coef=-1e-4), r"z_coef must be a finite number >= 0, got -0.0001"),
        ("zloss", dict(z_coef=float("nan")), r"z_coef must be a finite number >= 0, got nan"),
        ("zloss", dict(z_coef=float("inf")), r"z_coef must be a finite number >= 0, got inf"),
        ("center", dict(mu_coef=-1.0), r"mu_coef must be a finite number >= 0"),
        ("center", dict(center_mode="mean"), r"center_mode must be 'step' or 'loss', got 'mean'"),
        ("agg+center", dict(center_mode="step"), r"unknown hyper-parameter"),
    ):
        with pytest.raises(ValueError, match=match):
            agg.build_method(name, V, **kw)


# --------------------------------------------------------------------------------- centering


def test_center_step_mode_centers_after_each_step_and_keeps_mles_loss():
    h, w, y = inputs(seed=3, ignore=(5,))
    method = agg.build_method("center", V)
    assert method.hparams == {"center_mode": "step", "mu_coef": 1.0}
    got = grads(method, h, w, y)
    mle = grads(agg.build_method("mle", V), h, w, y)
    for a, e in zip(got[:3], mle[:3]):
        assert torch.equal(a, e)
    assert "regulariser" not in method.stats
    param = torch.nn.Parameter(w.clone())
    before = param.detach().clone()
    assert before.mean(0).abs().max() > 0.1
    method.after_step(param)
    assert param.detach().mean(0).abs().max() < 1e-14
    # a shift, nothing else
    torch.testing.assert_close(param.detach(), before - before.mean(0), rtol=0, atol=1e-15)
    # in a loop: after every optimizer step the mean row is zero again (float32, as a model holds
    # it)
    emb = torch.nn.Embedding(V, D)
    opt = torch.optim.AdamW(emb.parameters(), lr=0.05)
    for step in range(3):
        x = torch.arange(V)[None, :]
        method.observe(y[None, :V])
        opt.zero_grad()
        method.loss(torch.tanh(emb(x)) + 1.0, emb.weight, x.roll(1, 1)).backward()
        opt.step()
        assert emb.weight.mean(0).abs().max() > 1e-3  # the step moved the mean ...
        method.after_step(emb.weight)
        assert emb.weight.mean(0).abs().max() < 1e-6  # ... and centering put it back


def test_center_mu_loss_matches_autograd_and_does_not_touch_the_weight():
    h, w, y = inputs(seed=4, ignore=(1, 9))
    method = agg.build_method("center", V, center_mode="loss", mu_coef=0.7)
    got = grads(method, h, w, y)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    keep = y != -100
    ref = F.cross_entropy(hh[keep] @ ww.T, y[keep]) + 0.7 * ww.mean(0).pow(2).sum()
    ref.backward()
    for a, e in zip(got[:3], (ref.detach(), hh.grad, ww.grad)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)
    assert method.stats["regulariser"] == pytest.approx(
        float(0.7 * w.mean(0).pow(2).sum()), rel=1e-12
    )
    param = torch.nn.Parameter(w.clone())
    method.after_step(param)
    assert torch.equal(param.detach(), w)


def test_agg_center_has_aggs_gradients_and_centers_after_the_step():
    counts = make_counts(5)
    a = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    ac = agg.build_method("agg+center", V, alpha=ALPHA, window=WINDOW)
    assert agg.agg_family("agg+center") and set(ac.hparams) == set(agg.AGG.defaults)
    observe_counts(a, counts)
    observe_counts(ac, counts)
    assert ac.rare_mask().any()
    h, w, y = inputs(seed=5, ignore=(4,))
    for x, e in zip(grads(ac, h, w, y), grads(a, h, w, y)):
        if e is not None:
            assert torch.equal(x, e)
    mle_w = grads(agg.build_method("mle", V), h, w, y)[2]
    assert not torch.allclose(grads(ac, h, w, y)[2], mle_w)  # the gates act
    param = torch.nn.Parameter(w.clone())
    ac.after_step(param)
    assert param.detach().mean(0).abs().max() < 1e-14
    param = torch.nn.Parameter(w.clone())
    a.after_step(param)
    assert torch.equal(param.detach(), w)  # plain AGG leaves it
    # rare_share sets its alpha like AGG's (build_method treats it as AGG family)
    m = agg.build_method(
        "agg+center", V, counts=counts * 10 + 1, tokens_per_step=64, rare_share=0.25
    )
    assert m.hparams["alpha"] == agg.alpha_for_rare_share(counts * 10 + 1, 0.25, 64)


def test_new_methods_are_registered_with_documented_hparams():
    old_family = [
        "agg",
        "agg-no-g1",
        "agg-no-g2",
        "agg-static",
        "agg-continuous",
        "agg-centered",
        "agg-prefill",
        "ul+agg",
        "ul+agg-features",
    ]
    assert [n for n in agg.METHODS if agg.agg_family(n)] == old_family + ["agg+center"]
    assert not agg.agg_family("center") and not agg.agg_family("zloss")
    for name in ("center", "zloss", "agg+center"):
        for key, default in agg.METHODS[name].defaults.items():
            assert key in agg.HPARAMS, (name, key)
            assert default is None or isinstance(default, agg.HPARAMS[key][0]), (name, key, default)
    import runlib

    p = argparse.ArgumentParser()
    runlib.add_run_flags(p, "lm")
    args = p.parse_args(
        ["--method", "center", "--center-mode", "loss", "--mu-coef", "0.5", "--z-coef", "1e-3"]
    )
    assert (args.method, args.center_mode, args.mu_coef, args.z_coef) == (
        "center",
        "loss",
        0.5,
        1e-3,
    )


# --------------------------------------------------------------------------------- Coupled Adam


def literal_adamw(w0, grad_seq, lr, betas, eps, wd, coupled):
    """AdamW (decoupled weight decay) step by step; coupled: the bias-corrected second moment
    averaged over dim 0."""
    b1, b2 = betas
    w, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    for t, g in enumerate(grad_seq, start=1):
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        if coupled:
            v_hat = v_hat.mean(dim=0, keepdim=True).expand_as(v_hat)
        w = w - lr * m_hat / (v_hat.sqrt() + eps)
    return w, m, v


def fixed_grads(shape, steps=5, seed=0, dtype=torch.float64):
    """Gradients whose rows differ in scale by 100x (rare vs frequent rows), so coupling changes the
    update."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 0, shape[0], dtype=dtype).reshape(-1, *([1] * (len(shape) - 1)))
    return [torch.randn(shape, generator=g, dtype=dtype) * scale for _ in range(steps)]


def run_optimizer(opt, params, grad_seqs):
    for step in range(len(grad_seqs[0])):
        for p, seq in zip(params, grad_seqs):
            p.grad = seq[step].clone()
        opt.step()


@pytest.mark.parametrize("coupled", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_coupled_adamw_matches_the_literal_reference(coupled, wd):
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(12, 5, generator=g, dtype=torch.float64)
    seq = fixed_grads((12, 5))
    hp = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd)
    W = torch.nn.Parameter(w0.clone())
    opt = agg.CoupledAdamW([{"params": [W], "coupled": coupled}], **hp)
    run_optimizer(opt, [W], [seq])
    want, m, v = literal_adamw(w0, seq, hp["lr"], hp["betas"], hp["eps"], wd, coupled)
    torch.testing.assert_close(W.detach(), want, rtol=1e-12, atol=1e-14)
    state = opt.state[W]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 5
    torch.testing.assert_close(state["exp_avg"], m, rtol=1e-12, atol=1e-16)
    # stored per element, not averaged
    torch.testing.assert_close(state["exp_avg_sq"], v, rtol=1e-12, atol=1e-18)
    other, _, _ = literal_adamw(w0, seq, hp["lr"], hp["betas"], hp["eps"], wd, not coupled)
    assert (want - other).abs().max() > 1e-3  # coupling changes the result on these gradients


def test_coupled_adamw_uncoupled_group_is_torch_adamw_and_groups_mix():
    g = torch.Generator().manual_seed(2)
    shapes = [(10, 4), (4,), (3, 4)]
    init = [torch.randn(s, generator=g) for s in shapes]
    seqs = [fixed_grads(s, steps=6, seed=i, dtype=torch.float32) for i, s in enumerate(shapes)]
    hp = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    run_optimizer(agg.CoupledAdamW([{"params": ours, "coupled": False}], **hp), ours, seqs)
    run_optimizer(torch.optim.AdamW(ref, **hp), ref, seqs)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)  # same arithmetic: bit-identical on CPU
    # the default is coupled; a mixed optimizer couples the embedding only
    emb, rest = (
        torch.nn.Parameter(init[0].clone()),
        [torch.nn.Parameter(x.clone()) for x in init[1:]],
    )
    opt = agg.CoupledAdamW([{"params": [emb]}, {"params": rest, "coupled": False}], **hp)
    assert [grp["coupled"] for grp in opt.param_groups] == [True, False]
    run_optimizer(opt, [emb] + rest, seqs)
    for a, b in zip(rest, ref[1:]):
        assert torch.equal(a, b)
    want, _, _ = literal_adamw(
        init[0].double(),
        [s.double() for s in seqs[0]],
        hp["lr"],
        hp["betas"],
        hp["eps"],
        hp["weight_decay"],
        coupled=True,
    )
    torch.testing.assert_close(emb.detach().double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(emb, ref[0])


def test_coupled_adamw_one_dimensional_parameter_shares_one_second_moment():
    b0 = torch.linspace(-1, 1, 9, dtype=torch.float64)
    seq = fixed_grads((9,), steps=4, seed=3)
    b = torch.nn.Parameter(b0.clone())
    run_optimizer(agg.CoupledAdamW([b], lr=0.02, weight_decay=0.0), [b], [seq])
    want, _, _ = literal_adamw(b0, seq, 0.02, (0.9, 0.999), 1e-8, 0.0, coupled=True)
    torch.testing.assert_close(b.detach(), want, rtol=1e-12, atol=1e-14)


def test_coupled_adamw_state_dict_round_trip_continues_identically():
    g = torch.Generator().manual_seed(4)
    w0 = torch.randn(8, 3, generator=g)
    seq = fixed_grads((8, 3), steps=6, seed=4, dtype=torch.float32)
    a = torch.nn.Parameter(w0.clone())
    opt_a = agg.CoupledAdamW([a], lr=0.01, weight_decay=0.1)
    run_optimizer(opt_a, [a], [seq[:3]])
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = agg.CoupledAdamW([b], lr=0.01, weight_decay=0.1)
    opt_b.load_state_dict(torch.load(buf, weights_only=True))
    assert float(opt_b.state[b]["step"]) == 3 and opt_b.param_groups[0]["coupled"] is True
    run_optimizer(opt_a, [a], [seq[3:]])
    run_optimizer(opt_b, [b], [seq[3:]])
    assert torch.equal(a, b)
    fresh = torch.nn.Parameter(a.detach().clone())
    run_optimizer(agg.CoupledAdamW([fresh], lr=0.01, weight_decay=0.1), [fresh], [seq[3:]])
    assert not torch.equal(fresh, a)  # the loaded moments mattered


def test_coupled_adamw_refuses_unsupported_arguments():
    p = [torch.nn.Parameter(torch.zeros(3, 2))]
    for kw, match in (
        (dict(amsgrad=True), "amsgrad"),
        (dict(fused=True), "fused"),
        (dict(maximize=True), "maximize"),
        (dict(foreach=True), "foreach"),
        (dict(lr=-1.0), "lr must be a finite number >= 0"),
        (dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
        (dict(eps=-1.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ):
        with pytest.raises(ValueError, match=match):
            agg.CoupledAdamW(p, **kw)


# --------------------------------------------------------------------------------- metrics


def test_isoscore_matches_the_isoscore_package():
    pkg = pytest.importorskip("IsoScore.IsoScore")
    g = torch.Generator().manual_seed(0)
    values = []
    for seed, (n_rows, n_dims) in enumerate([(200, 8), (500, 16), (50, 5), (300, 30)]):
        scale = torch.logspace(-1.5 * (seed % 3) / 2, 0, n_dims, dtype=torch.float64)
        mix = torch.linalg.qr(torch.randn(n_dims, n_dims, generator=g, dtype=torch.float64))[0]
        points = (torch.randn(n_rows, n_dims, generator=g, dtype=torch.float64) * scale) @ mix + 3.0
        ours = agg.isoscore(points)
        theirs = float(pkg.IsoScore(points.numpy()))
        assert ours == pytest.approx(theirs, abs=1e-5), (n_rows, n_dims)
        values.append(ours)
    assert max(values) - min(values) > 0.2  # the cases span a range of scores


def test_isoscore_extremes_and_k_dimensions():
    g = torch.Generator().manual_seed(1)
    assert agg.isoscore(torch.randn(20000, 16, generator=g)) > 0.98  # isotropic Gaussian
    rank1 = torch.outer(
        torch.randn(500, generator=g, dtype=torch.float64),
        torch.randn(16, generator=g, dtype=torch.float64),
    )
    assert abs(agg.isoscore(rank1 + 5.0)) < 1e-6  # one dimension used (an offset does not count)
    # equal variance in k of n dimensions: phi = k / n, IsoScore = (k - 1) / (n - 1)
    n, k = 12, 4
    basis = torch.eye(n, dtype=torch.float64)[:k]
    points = (
        torch.cat([basis, -basis])
        @ torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    )
    assert agg.isoscore(points) == pytest.approx((k - 1) / (n - 1), abs=1e-9)
    with pytest.raises(ValueError, match="2 dimensions"):
        agg.isoscore(torch.randn(10, 1))


def isotropy_as_it_was(weight):
    """agg.isotropy before the weights/center options, verbatim."""
    w = weight.detach().double()
    _, eigvecs = torch.linalg.eigh(w.T @ w)
    proj = w @ eigvecs
    log_z = torch.cat([torch.logsumexp(proj, dim=0), torch.logsumexp(-proj, dim=0)])
    return float(torch.exp(log_z.min() - log_z.max()))


def test_isotropy_unchanged_and_its_weighted_and_centered_forms():
    g = torch.Generator().manual_seed(2)
    cone = torch.randn(300, 8, generator=g, dtype=torch.float64) + 0.7 * torch.randn(
        8, generator=g, dtype=torch.float64
    )
    for W in (cone, torch.randn(100, 5, generator=g), cone * 30):
        assert agg.isotropy(W) == isotropy_as_it_was(W)  # bit-identical
    plain = agg.isotropy(cone)
    assert agg.isotropy(cone, weights=torch.full((300,), 3.0)) == pytest.approx(plain, rel=1e-9)
    assert agg.isotropy(cone, center=True) == agg.isotropy(cone - cone.mean(0))
    assert agg.isotropy(cone, center=True) > plain + 0.1  # centering removes the cone's offset
    # integer weights = rows repeated that many times (weight 0 = row dropped), centered or not
    # Zipfian, 100 zeros
    counts = (200 / torch.arange(1, 301)).floor().long()[torch.randperm(300, generator=g)]
    repeated = cone.repeat_interleave(counts, dim=0)
    weighted = agg.isotropy(cone, weights=counts)
    assert weighted == pytest.approx(agg.isotropy(repeated), rel=1e-9)
    assert agg.isotropy(cone, weights=counts, center=True) == pytest.approx(
        agg.isotropy(repeated - repeated.mean(0)), rel=1e-9
    )
    assert abs(weighted / plain - 1) > 0.1  # the weights matter
    # both signs, as unweighted
    assert agg.isotropy(-cone, weights=counts) == pytest.approx(weighted, rel=1e-9)
    for bad in (-counts, counts[:-1], torch.zeros(300)):
        with pytest.raises(ValueError, match="weights must be"):
            agg.isotropy(cone, weights=bad)


def literal_magikarp(W, unused):
    """Land & Bartolo's indicator written out: first PC by SVD of the centered rows, removed from
    the raw rows; cosine similarity of each row to the mean of the unused rows."""
    W = W.double()
    pc = torch.linalg.svd(W - W.mean(0), full_matrices=False).Vh[0]
    Wr = W - (W @ pc)[:, None] * pc[None, :]
    mean_unused = Wr[unused].mean(0)
    return torch.stack([torch.dot(r, mean_unused) / (r.norm() * mean_unused.norm()) for r in Wr])


def test_undertrained_rows_flag_planted_untrained_rows():
    g = torch.Generator().manual_seed(3)
    V_, d = 300, 16
    hidden_mean = F.normalize(torch.randn(d, generator=g), dim=0)
    # trained-like: diverse, with a shared offset
    W = torch.randn(V_, d, generator=g) + 1.0 * hidden_mean
    untrained = torch.randperm(V_, generator=g)[:30]
    # never a target: left at a small init, pushed only along -mean(h) by everybody's softmax
    W[untrained] = 0.02 * torch.randn(30, d, generator=g) - 0.5 * hidden_mean
    unused, planted = untrained[:10], untrained[10:]
    ind = agg.undertrained_rows(W, unused)
    assert ind.shape == (V_,) and ind.dtype == torch.float64
    torch.testing.assert_close(ind, literal_magikarp(W, unused), rtol=1e-9, atol=1e-12)
    trained = torch.ones(V_, dtype=torch.bool)
    trained[untrained] = False
    assert ind[planted].min() > ind[trained].max()
    with pytest.raises(ValueError, match="unused"):
        agg.undertrained_rows(W, [])
