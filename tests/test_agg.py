"""Tests of agg.py: gradients against the papers' closed forms and literal reference
implementations."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import agg

V, D, WINDOW, ALPHA = 40, 6, 10, 0.45


def make_counts(seed=0):
    """Appearance counts a_k in 0..WINDOW with ~half the vocabulary below ALPHA * WINDOW (rare)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, WINDOW + 1, (V,), generator=g)


def observe_counts(method, counts, window=WINDOW):
    """Feed `window` steps so that afterwards the method's window holds exactly `counts`
    appearances."""
    for s in range(window):
        method.observe(torch.nonzero(counts > s).squeeze(1))


def inputs(seed=0, T=60, ignore=()):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (T,), generator=g)
    y[list(ignore)] = -100
    return h, w, y


def grads(method, h, w, y, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = method.loss(h, w, y, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def literal_agg_grads(h, w, y, rare, g1_vec, g2_vec, smoothing=0.0):
    """AGG Eq. 9-10 written out: three logits with detach and dense per-row gates (Eq. 7-8)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    keep = y != -100
    h_, y_ = h[keep], y[keep]
    # v_k in V_r and v_k != y_i
    rare_other = rare[None, :] & (torch.arange(V)[None, :] != y_[:, None])
    g1 = torch.where(rare_other, g1_vec[None, :], torch.ones(()))
    g2 = torch.where(rare_other, g2_vec[None, :], torch.ones(()))
    z0 = h_ @ w.detach().T
    z1 = g1 * (h_.detach() @ w.T) + (1 - g1) * (h_.detach() @ w.detach().T)
    z2 = g2 * (h_.detach() @ w.T) + (1 - g2) * (h_.detach() @ w.detach().T)

    def ce(z):
        return F.cross_entropy(z, y_, reduction="none", label_smoothing=smoothing)

    loss = ce(z0) + torch.where(rare[y_], ce(z2), ce(z1))  # Eq. 10
    loss.mean().backward()
    return h.grad, w.grad


def paper_gates(counts, window=WINDOW, alpha=ALPHA):
    a = counts.double()
    rare = a / window < alpha  # Eq. 5
    g1 = a / window  # Eq. 7
    g2 = (a / a[rare].mean()).clamp(max=1)  # Eq. 8
    return rare, g1, g2


@pytest.mark.parametrize("variant", ["agg", "agg-no-g1", "agg-no-g2", "agg-continuous"])
def test_agg_matches_literal_eq_9_10(variant):
    counts = make_counts()
    rare, g1, g2 = paper_gates(counts)
    assert 5 < rare.sum() < V - 5
    if variant == "agg-no-g1":
        g1 = torch.ones(V, dtype=torch.float64)
    if variant == "agg-no-g2":
        g2 = torch.ones(V, dtype=torch.float64)
    if variant == "agg-continuous":  # g1 = min(a_k / (alpha K), 1): 1 at the rarity threshold
        g1 = (counts.double() / WINDOW / ALPHA).clamp(max=1)
        assert (g1[rare] > paper_gates(counts)[1][rare]).any()
    method = agg.build_method(variant, V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, counts)
    h, w, y = inputs(ignore=(3, 17))
    assert rare[y[y >= 0]].any() and (~rare[y[y >= 0]]).any()
    loss, gh, gw = grads(method, h, w, y)
    ref_gh, ref_gw = literal_agg_grads(h, w, y, rare, g1, g2)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, y))  # the value is the plain mean NLL
    # gradient wrt hidden is exactly MLE's
    _, mle_gh, mle_gw = grads(agg.build_method("mle", V), h, w, y)
    torch.testing.assert_close(gh, mle_gh, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(gw, mle_gw)


def test_agg_weight_gradient_is_eq_23():
    counts = make_counts(1)
    rare, g1, g2 = paper_gates(counts)
    method = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, counts)
    h, w, y = inputs(seed=1)
    _, _, gw = grads(method, h, w, y)
    p = torch.softmax(h @ w.T, dim=1)
    expected = torch.zeros(V, D, dtype=torch.float64)
    for r in range(V):
        for i in range(len(y)):
            if y[i] == r:
                coef = p[i, r] - 1
            elif not rare[r]:
                coef = p[i, r]  # non-rare embeddings: plain MLE
            elif not rare[y[i]]:
                coef = g1[r] * p[i, r]
            else:
                coef = g2[r] * p[i, r]
            expected[r] += coef * h[i]
    torch.testing.assert_close(gw, expected / len(y), rtol=1e-12, atol=1e-14)


def test_agg_with_label_smoothing_matches_literal():
    counts = make_counts(2)
    rare, g1, g2 = paper_gates(counts)
    method = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, counts)
    h, w, y = inputs(seed=2, ignore=(0,))
    loss, gh, gw = grads(method, h, w, y, label_smoothing=0.1)
    ref_gh, ref_gw = literal_agg_grads(h, w, y, rare, g1, g2, smoothing=0.1)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, y, label_smoothing=0.1))


def test_mle_matches_cross_entropy_and_chunking_changes_nothing():
    h, w, y = inputs(seed=3, T=50, ignore=(5, 6))
    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    F.cross_entropy(ref_h @ ref_w.T, y).backward()
    counts = make_counts(3)
    for name in ["mle", "agg"]:
        method = agg.build_method(
            name, V, **(dict(alpha=ALPHA, window=WINDOW) if name == "agg" else {})
        )
        observe_counts(method, counts)
        full = grads(method, h, w, y)
        chunked = grads(method, h, w, y, chunk_size=7)
        for a, b in zip(full, chunked):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        if name == "mle":
            torch.testing.assert_close(full[1], ref_h.grad, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(full[2], ref_w.grad, rtol=1e-12, atol=1e-14)


def test_ignored_positions_are_dropped_from_value_and_gradients():
    h, w, y = inputs(seed=4, ignore=(1, 2, 30))
    method = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, make_counts(4))
    loss, gh, gw = grads(method, h, w, y)
    keep = y != -100
    loss_k, gh_k, gw_k = grads(method, h[keep], w, y[keep])
    torch.testing.assert_close(loss, loss_k)
    assert torch.all(gh[~keep] == 0)
    torch.testing.assert_close(gh[keep], gh_k)
    torch.testing.assert_close(gw, gw_k)


def static_kw():
    return dict(counts=make_counts(5) + 1)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("agg", dict(alpha=0.0, window=WINDOW)),
        ("agg-no-g1", dict(alpha=0.0, window=WINDOW)),
        ("agg-no-g2", dict(alpha=0.0, window=WINDOW)),
        ("agg-continuous", dict(alpha=0.0, window=WINDOW)),
        ("agg-centered", dict(alpha=0.0, window=WINDOW)),
        ("agg-static", dict(alpha=0.0, static_after=2, window=WINDOW)),
        ("ul+agg", dict(alpha=0.0, alpha_ul=0.0, window=WINDOW)),
        ("agps", dict(rare_fraction=0.0)),
        ("freeze-rare", dict(rare_fraction=0.0)),
        ("freeze-b", dict(rare_fraction=0.0)),
        ("freeze-c", dict(rare_fraction=0.0)),
        ("freeze-bc", dict(rare_fraction=0.0)),
    ],
)
def test_no_rare_tokens_is_exactly_mle(name, kw):
    method = agg.build_method(name, V, **static_kw(), **kw)
    observe_counts(method, make_counts(5))
    h, w, y = inputs(seed=5, ignore=(4,))
    y2 = y.reshape(6, 10)  # (B, T) for ul+agg
    ours = grads(method, h.reshape(6, 10, D), w, y2)
    mle = grads(agg.build_method("mle", V), h.reshape(6, 10, D), w, y2)
    for a, b in zip(ours, mle):
        assert torch.equal(a, b)


def test_sliding_window_special_ids_and_ignore_index():
    method = agg.build_method("agg", 6, alpha=1.5, window=3, special_ids=[0])
    steps = [[1, 1, 2, -100], [1, 1, 3, 0], [2, 2, 2, 1], [4, 4, 4, 4], [5, 1, -100, -100]]
    expected_mean = [
        [0, 2, 1, 0, 0, 0],  # one step seen: average over 1
        [0.5, 2, 0.5, 0.5, 0, 0],
        [1 / 3, 5 / 3, 4 / 3, 1 / 3, 0, 0],
        [1 / 3, 1, 1, 1 / 3, 4 / 3, 0],  # step 1 left the window of 3
        [0, 2 / 3, 1, 0, 4 / 3, 1 / 3],
    ]
    for targets, mean in zip(steps, expected_mean):
        method.observe(torch.tensor(targets))
        torch.testing.assert_close(method.mean_counts(), torch.tensor(mean, dtype=torch.float64))
        rare = method.rare_mask()
        assert not rare[0]  # special ids are never rare, even with 0 appearances
        assert torch.equal(rare[1:], torch.tensor(mean[1:]) < 1.5)


def test_loss_before_observe_is_a_clear_error():
    method = agg.build_method("agg", V, window=WINDOW)
    h, w, y = inputs()
    mle = agg.build_method("mle", V).loss(h, w, y)
    # an evaluation before the first step (nanoGPT's at iter 0)
    assert torch.equal(method.loss(h, w, y), mle)
    with pytest.raises(RuntimeError, match="observe"):
        method.loss(h, w.requires_grad_(), y)  # a training call: its gates need the step's targets


def test_static_agg_freezes_the_group():
    method = agg.build_method("agg-static", 4, alpha=1.0, window=2, static_after=2)
    method.observe(torch.tensor([0, 0, 1]))
    method.observe(torch.tensor([0, 0, 1]))
    frozen = method.rare_mask().clone()
    assert frozen.tolist() == [False, False, True, True]
    for _ in range(3):
        method.observe(torch.tensor([2, 2, 3, 3]))  # counts now say 0, 1 are rare and 2, 3 are not
    assert torch.equal(method.rare_mask(), frozen)
    dynamic = agg.build_method("agg", 4, alpha=1.0, window=2)
    for t in [[0, 0, 1], [0, 0, 1], [2, 2, 3, 3], [2, 2, 3, 3]]:
        dynamic.observe(torch.tensor(t))
    assert dynamic.rare_mask().tolist() == [True, True, False, False]


@pytest.mark.parametrize("name", ["agg", "agg-static", "agg-prefill", "frage", "freeze-rare"])
def test_state_dict_round_trip_continues_identically(name):
    kw = dict(counts=make_counts(6) + 1)
    if name.startswith("agg"):
        # prefill: still filling at the reload
        kw.update(alpha=0.4, window=8 if name == "agg-prefill" else 4)
    if name == "agg-static":
        kw.update(static_after=5)
    g = torch.Generator().manual_seed(6)
    batches = [torch.randint(0, V, (30,), generator=g) for _ in range(8)]
    h, w, _ = inputs(seed=6, T=30)
    a = agg.build_method(name, V, **kw)
    for y in batches[:4]:
        a.observe(y)
        grads(a, h, w, y)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = agg.build_method(name, V, **kw)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for y in batches[4:]:
        a.observe(y)
        b.observe(y)
        for x, z in zip(grads(a, h, w, y), grads(b, h, w, y)):
            assert torch.equal(x, z)
        if name.startswith("agg"):
            assert torch.equal(a.gates(y)[0], b.gates(y)[0])


def test_state_dict_refuses_another_method():
    with pytest.raises(ValueError, match="agps"):
        agg.build_method("agg", V, window=2).load_state_dict(
            agg.build_method("agps", V, counts=torch.ones(V)).state_dict()
        )


def test_build_method_errors_list_valid_choices():
    with pytest.raises(ValueError, match="agg-no-g1"):
        agg.build_method("agg2", V)
    with pytest.raises(ValueError, match="alpha"):
        agg.build_method("agg", V, alpah=0.1)
    with pytest.raises(ValueError, match="counts"):
        agg.build_method("agps", V)


def literal_algorithm_1(h, w, y, counts, rare, mu1, mu2):
    """AGPS Algorithm 1 line by line (rare = the words from index i_r on, in frequency order)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    c_clip = counts.double().clamp(max=mu1)  # 1
    f1 = c_clip / mu1  # 2
    f2 = (c_clip / mu2).clamp(max=1)  # 3
    m_word = torch.zeros(V, dtype=torch.float64)  # 4
    m_word[y] = 1  # 5
    m_word[~rare] = 1  # 6
    m_wordrev = (1 - m_word) * f2  # 7
    m_word = (m_word + f1).clamp(max=1)  # 8
    w_mask = m_word[:, None] * w + (1 - m_word[:, None]) * w.detach()  # 9
    w_maskrev = m_wordrev[:, None] * w + (1 - m_wordrev[:, None]) * w.detach()  # 10
    z = -F.log_softmax(h @ w_mask.T, dim=1)  # 11
    rare_tgt = rare[y].nonzero().squeeze(1)  # 12-13
    z_rare = -F.log_softmax(h.detach()[rare_tgt] @ w_maskrev.T, dim=1)  # 14-15
    l1 = z.gather(1, y[:, None]).squeeze(1)  # 16
    l2 = z_rare.gather(1, y[rare_tgt][:, None]).squeeze(1)  # 17
    ((l1.sum() + l2.sum()) / len(y)).backward()  # 18, mean reduction
    return h.grad, w.grad


def test_agps_follows_algorithm_1():
    counts = torch.arange(V, 0, -1) * 7  # index order = frequency order, as Algorithm 1 assumes
    method = agg.build_method("agps", V, counts=counts, rare_fraction=0.4, mu1=150.0, mu2=60.0)
    rare = torch.arange(V) >= 24  # i_r = 24
    assert torch.equal(method.rare_mask(), rare)
    h, w, y = inputs(seed=7, T=25)
    y[:5] = torch.tensor([30, 31, 35, 2, 39])  # some rare words in the batch
    _, gh, gw = grads(method, h, w, y)
    ref_gh, ref_gw = literal_algorithm_1(h, w, y, counts, rare, 150.0, 60.0)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("parts", ["b", "c", "bc"])
def test_gradient_part_freezing_drops_parts_of_eq_4(parts):
    counts = torch.arange(V, 0, -1)
    method = agg.build_method(f"freeze-{parts}", V, counts=counts, rare_fraction=0.5)
    rare = method.rare_mask()
    h, w, y = inputs(seed=8)
    _, _, gw = grads(method, h, w, y)
    p = torch.softmax(h @ w.T, dim=1)
    onehot = F.one_hot(y, V).double()
    expected = (p - onehot).T @ h / len(y)  # MLE
    for r in rare.nonzero().squeeze(1):
        part_a = ((p[:, r] - 1) * (y == r))[:, None] * h
        part_b = (p[:, r] * ~rare[y])[:, None] * h
        part_c = (p[:, r] * (rare[y] & (y != r)))[:, None] * h
        expected[r] = (part_a + part_b * ("b" not in parts) + part_c * ("c" not in parts)).sum(
            0
        ) / len(y)
    torch.testing.assert_close(gw, expected, rtol=1e-12, atol=1e-14)


def test_freeze_rare_freezes_whole_rows_until_step():
    counts = torch.arange(V, 0, -1)
    method = agg.build_method("freeze-rare", V, counts=counts, until=2)
    emb = torch.nn.Embedding(V, D)
    x = torch.arange(V)[None, :]  # every token is also an input: the input side must be frozen too
    y = torch.arange(V)[None, :].roll(1, 1)
    for step in range(3):
        method.observe(y)
        emb.zero_grad()
        method.loss(torch.tanh(emb(x)), emb.weight, y).backward()
        rare_grad = emb.weight.grad[method.rare_mask()].abs().sum()
        # steps seen: 1, 2, 3; frozen while steps < until
        assert (rare_grad == 0) == (step < 1), step
        assert emb.weight.grad[~method.rare_mask()].abs().sum() > 0


def test_cosreg_equals_quadratic_definition():
    w = torch.randn(15, D, dtype=torch.float64, requires_grad=True)
    unit = w / w.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    quadratic = (cos.sum() - cos.diagonal().sum()) / 15**2  # CosReg Eq. 6
    method = agg.build_method("cosreg", 15, gamma=2.0)
    h, y = torch.randn(4, D, dtype=torch.float64), torch.tensor([1, 2, 3, 4])
    loss = method.loss(h, w, y)
    torch.testing.assert_close(loss - F.cross_entropy(h @ w.T, y), 2.0 * quadratic)
    torch.testing.assert_close(agg.mean_cosine(w), float(quadratic.detach()))
    (grad,) = torch.autograd.grad(method.regulariser(h, w, y, -100), w)
    (ref,) = torch.autograd.grad(2.0 * quadratic.float(), w)
    torch.testing.assert_close(grad, ref.double(), rtol=1e-5, atol=1e-6)


def test_frage_discriminator_learns_and_generator_fools_it():
    torch.manual_seed(0)
    counts = torch.arange(50, 0, -1)
    method = agg.build_method("frage", 50, counts=counts, lambda_=1.0, disc_lr=0.05)
    popular = torch.zeros(50, dtype=torch.bool)
    popular[:10] = True  # top 20%
    w = torch.randn(50, D) * 0.3
    w[popular, 0] += 1.0  # separable along the first axis
    h, y = torch.randn(8, D), torch.randint(0, 50, (8,))
    method.observe(y)
    method.loss(h, w, y)
    acc_start = method.disc_accuracy(w)
    for _ in range(60):
        method.observe(y)
        method.loss(h, w, y)
    acc_trained = method.disc_accuracy(w)
    assert acc_trained > max(acc_start, 0.9)
    # generator: gradient descent on the model's term -lambda * L_D moves the embeddings to fool the
    # discriminator
    disc_before = [p.detach().clone() for p in method.disc.parameters()]
    w_gen = w.clone().requires_grad_()
    for _ in range(30):  # no observe(): no discriminator step is pending, so D stays fixed
        (g,) = torch.autograd.grad(method.regulariser(h, w_gen, y, -100), w_gen)
        w_gen = (w_gen - 0.5 * g * 50).detach().requires_grad_()
    assert method.disc_accuracy(w_gen) < acc_trained - 0.2
    assert all(torch.equal(a, b) for a, b in zip(disc_before, method.disc.parameters()))


def test_frage_takes_disc_steps_literal_adam_steps_per_optimizer_step():
    """disc_steps = k: k full-batch Adam steps on L_D (FRAGE Eq. 4) per optimizer step, none for the
    model's term."""
    torch.manual_seed(0)
    counts = torch.arange(50, 0, -1)
    w, h, y = torch.randn(50, D), torch.randn(8, D), torch.randint(0, 50, (8,))
    method = agg.build_method("frage", 50, counts=counts, disc_steps=3)
    method.observe(y)
    torch.manual_seed(1)
    method.loss(h, w, y)  # builds the discriminator (from the RNG) and takes its 3 steps
    torch.manual_seed(1)
    ref = torch.nn.Linear(D, 1)
    opt = torch.optim.Adam(ref.parameters(), lr=method.hparams["disc_lr"])
    popular = torch.zeros(50, dtype=torch.bool)
    popular[:10] = True
    for _ in range(3):
        opt.zero_grad()
        score = ref(w).squeeze(1)
        (-(F.logsigmoid(score[popular]).mean() + F.logsigmoid(-score[~popular]).mean())).backward()
        opt.step()
    torch.testing.assert_close(method.disc.weight, ref.weight)
    torch.testing.assert_close(method.disc.bias, ref.bias)
    before = method.disc.weight.detach().clone()
    # a second micro-batch of the same optimizer step: no further discriminator step
    method.loss(h, w, y)
    assert torch.equal(before, method.disc.weight)


def test_unlikelihood_hand_computed():
    torch.manual_seed(0)
    y = torch.tensor([[3, 1, 3, 2, -100], [2, 2, 0, 1, 4]])
    h = torch.randn(2, 5, D)
    w = torch.randn(5, D)
    p = torch.softmax(h @ w.T, dim=-1)
    # candidates: distinct earlier targets of the same sequence, minus the current target
    cands = {
        (0, 1): [3],
        (0, 2): [1],
        (0, 3): [3, 1],
        (1, 2): [2],
        (1, 3): [2, 0],
        (1, 4): [2, 0, 1],
    }
    expected = sum(-torch.log(1 - p[b, t, c]) for (b, t), cs in cands.items() for c in cs) / 9
    torch.testing.assert_close(agg.unlikelihood(h, w, y), expected)
    method = agg.build_method("ul", 5, alpha_ul=0.5)
    nll = F.cross_entropy((h @ w.T).reshape(-1, 5), y.reshape(-1))
    torch.testing.assert_close(method.loss(h, w, y), nll + 0.5 * expected)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        method.loss(h[0], w, y[0])


def test_isotropy_metric():
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(20000, 16, generator=g)
    assert agg.isotropy(gaussian) > 0.9
    cone = torch.randn(2000, 16, generator=g) * 0.1 + 3.0 * torch.randn(16, generator=g)
    assert agg.isotropy(cone) < 0.01
    huge = torch.nn.functional.normalize(torch.randn(500, 16, generator=g), dim=1) * 1e3
    value = agg.isotropy(huge)
    assert 0.0 <= value <= 1.0 and value == value


def test_isotropy_takes_both_signs_of_each_eigenvector():
    g = torch.Generator().manual_seed(1)
    cone = torch.randn(300, 8, generator=g, dtype=torch.float64) + 0.5 * torch.randn(
        8, generator=g, dtype=torch.float64
    )
    _, vecs = torch.linalg.eigh(cone.T @ cone)

    def log_z(a):  # Z(a) of AGG Eq. 3, per column of a
        return torch.logsumexp(cone @ a, dim=0)

    one_sign = float(torch.exp(log_z(vecs).min() - log_z(vecs).max()))
    flipped = float(torch.exp(log_z(-vecs).min() - log_z(-vecs).max()))
    both = torch.cat([log_z(vecs), log_z(-vecs)])
    # the sign eigh returns would change a one-sign I(W) of this matrix
    assert abs(one_sign - flipped) > 0.01
    assert agg.isotropy(cone) == pytest.approx(float(torch.exp(both.min() - both.max())), rel=1e-9)
    assert agg.isotropy(cone) == agg.isotropy(-cone) and agg.isotropy(cone) <= min(
        one_sign, flipped
    )


def test_geometry_counts_the_seen_tokens_per_group():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(60, 6, generator=g, dtype=torch.float64)
    counts = torch.arange(60, 0, -1)
    counts[-5:] = 0  # never seen: the least frequent, so in the rare group
    # a far, tight cluster
    W[-5:] = 10.0 + 0.01 * torch.randn(5, 6, generator=g, dtype=torch.float64)
    groups = dict(zip(agg.GROUPS, agg.frequency_groups(counts)))
    seen = agg.geometry(W, groups, counts > 0)
    everything = agg.geometry(W, groups)
    assert seen["rows"] == 55 and seen["rows_groups"] == {"freq": 18, "med": 30, "rare": 7}
    assert seen["isotropy"] == agg.isotropy(W[:55]) and seen["mean_cosine"] == agg.mean_cosine(
        W[:55]
    )
    assert seen["isotropy_groups"]["rare"] == agg.isotropy(W[48:55])
    assert seen["norm_groups"]["rare"] == pytest.approx(float(W[48:55].norm(dim=1).mean()))
    assert seen["cosine_rare_freq"] == pytest.approx(agg.mean_cosine_between(W[48:55], W[:18]))
    assert (
        everything["rows"] == 60
        and everything["mean_cosine_groups"]["rare"] > seen["mean_cosine_groups"]["rare"]
    )
    assert seen["mean_row_share"] == pytest.approx(
        float(W[:55].mean(0).norm() / W[:55].norm(dim=1).mean())
    )
    # the far cluster is a common drift
    assert everything["mean_row_share"] > 1.5 * seen["mean_row_share"]
    assert agg.geometry(torch.eye(2), dict(rare=[0, 1]))["mean_row_share"] == pytest.approx(
        0.5**0.5
    )


def test_agg_prefill_starts_with_the_expected_rare_group_and_becomes_agg():
    g = torch.Generator().manual_seed(3)
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)  # a Zipf law over the vocabulary
    counts = (p / p.sum() * 100000).round().long()
    batches = [torch.multinomial(p, 64, replacement=True, generator=g) for _ in range(12)]
    rate = counts.double() / counts.sum() * 64
    # a quarter of the vocabulary rare at average rates
    alpha = float(rate.sort().values[V // 4 : V // 4 + 2].mean())
    plain = agg.build_method("agg", V, alpha=alpha, window=8)
    filled = agg.build_method("agg-prefill", V, alpha=alpha, window=8, counts=counts)
    plain.observe(batches[0])
    filled.observe(batches[0])
    # one step of counts: far more than a quarter looks rare
    assert plain.rare_mask().float().mean() >= 0.45
    expected = (batches[0] == torch.arange(V)[:, None]).sum(1) / 8 + 7 / 8 * rate
    torch.testing.assert_close(filled.mean_counts(), expected.double())
    assert filled.rare_mask().float().mean() <= 0.35
    for y in batches[1:]:
        plain.observe(y)
        filled.observe(y)
    h, w, _ = inputs(seed=3, T=64)
    y = batches[-1]
    for a, b in zip(grads(plain, h, w, y), grads(filled, h, w, y)):  # past the window: exactly AGG
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="prefill needs counts"):
        agg.build_method("agg-prefill", V, alpha=alpha, window=8)


def test_spectrum_and_frequency_groups():
    s = agg.singular_spectrum(torch.randn(30, 5))
    assert s[0] == 1 and torch.all(s[1:] <= s[:-1])
    counts = torch.tensor([5, 100, 1, 50, 7, 3, 0, 20, 9, 2])
    freq, med, rare = agg.frequency_groups(counts)
    assert freq.tolist() == [1, 3, 7] and sorted(rare.tolist()) == [2, 6] and len(med) == 5


def _dist_worker(rank, world, init_file, batch, out_file):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    method = agg.build_method("agg", V, alpha=ALPHA, window=3)
    for step in batch:
        half = len(step) // world
        method.observe(step[rank * half : (rank + 1) * half])
    col_gate, _, group_gate = method.gates(torch.arange(V))
    torch.save({"rare": method.rare_mask(), "g1": col_gate, "g2": group_gate}, f"{out_file}.{rank}")
    torch.distributed.destroy_process_group()


def test_distributed_ranks_see_the_gates_of_the_whole_batch(tmp_path):
    g = torch.Generator().manual_seed(9)
    batch = [torch.randint(0, V, (40,), generator=g) for _ in range(4)]
    torch.multiprocessing.spawn(
        _dist_worker, args=(2, str(tmp_path / "init"), batch, str(tmp_path / "out")), nprocs=2
    )
    single = agg.build_method("agg", V, alpha=ALPHA, window=3)
    for step in batch:
        single.observe(step)
    col_gate, _, group_gate = single.gates(torch.arange(V))
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        assert torch.equal(got["rare"], single.rare_mask())
        assert torch.equal(got["g1"], col_gate) and torch.equal(got["g2"], group_gate)


def test_bf16_autocast_runs_and_stays_close():
    counts = make_counts(10)
    method = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, counts)
    h, w, y = inputs(seed=10)
    h, w = h.float(), w.float()
    _, gh, gw = grads(method, h, w, y)
    for chunk in (None, 7):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, gh16, gw16 = grads(method, h, w, y, chunk_size=chunk)
        assert gh16.dtype == torch.float32 and gw16.dtype == torch.float32
        torch.testing.assert_close(gh16, gh, rtol=0.05, atol=0.02)
        # the gates act on G before its cast to bf16: each row of dL/dW, gated or not, within bf16's
        # precision of fp32's
        assert ((gw16 - gw).norm(dim=1) <= 0.02 * gw.norm(dim=1)).all()


def test_stats_report_the_rare_group_and_its_probability_mass():
    counts = make_counts(11)
    rare, _, _ = paper_gates(counts)
    method = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, counts)
    h, w, y = inputs(seed=11)
    with torch.no_grad():
        loss = method.loss(h, w, y)
    stats = method.stats
    p = torch.softmax(h @ w.T, dim=1)
    assert stats["rare_count"] == rare.sum() and stats["rare_fraction"] == pytest.approx(
        rare.double().mean()
    )
    assert stats["rare_mass_true"] == pytest.approx(rare[y].double().mean())
    assert stats["rare_mass_pred"] == pytest.approx(float(p[:, rare].sum(1).mean()))
    assert stats["nll"] == pytest.approx(float(loss))


# ---------------------------------------------------------------------- the practitioner's contract


def test_rarity_helpers_turn_a_share_or_a_frequency_into_alpha():
    counts = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 500, 1000])
    tokens_per_step = 4096
    for share in (0.1, 0.25, 0.6):
        alpha = agg.alpha_for_rare_share(counts, share, tokens_per_step, special_ids=[11])
        rate = counts[:11].double() / counts.sum() * tokens_per_step
        assert (rate < alpha).sum() == round(share * 11)  # the share of the non-special vocabulary
        assert agg.rare_share_of_alpha(counts, alpha, tokens_per_step, [11]) == pytest.approx(
            round(share * 11) / 11
        )
        # the same share at another batch size marks the same tokens: alpha scales with tokens per
        # step
        assert agg.alpha_for_rare_share(counts, share, 8 * tokens_per_step, [11]) == pytest.approx(
            8 * alpha
        )
    with pytest.raises(ValueError, match="rare_share"):
        agg.alpha_for_rare_share(counts, 1.5, 100)
    # an AGG whose window has seen exactly the training rates marks that share rare (Eq. 5
    # unchanged)
    alpha = agg.alpha_for_rare_share(counts, 0.25, int(counts.sum()))
    method = agg.build_method("agg", len(counts), alpha=alpha, window=1)
    method.observe(torch.repeat_interleave(torch.arange(len(counts)), counts))
    assert int(method.rare_mask().sum()) == 3


def test_load_state_dict_refuses_another_vocabulary_or_hyper_parameters():
    a = agg.build_method("agg", V, alpha=0.1, window=6)
    a.observe(torch.arange(V))
    with pytest.raises(ValueError, match="window=6.*window=3"):
        agg.build_method("agg", V, alpha=0.1, window=3).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=f"vocab_size {V}.*{V + 1}"):
        agg.build_method("agg", V + 1, alpha=0.1, window=6).load_state_dict(a.state_dict())
    # the matching one loads
    agg.build_method("agg", V, alpha=0.1, window=6).load_state_dict(a.state_dict())


def test_observe_rejects_ids_outside_the_vocabulary_and_build_rejects_bad_hparams():
    for name in ("mle", "agg"):
        method = agg.build_method(name, V, **(dict(window=2) if name == "agg" else {}))
        with pytest.raises(ValueError, match=f"target id {V} is outside"):
            method.observe(torch.tensor([0, V]))
        with pytest.raises(ValueError, match="target id -3"):
            method.observe(torch.tensor([0, -3]))
        method.observe(torch.tensor([0, -100]))  # ignore_index is fine
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        agg.build_method("agg", V, alpha=-0.1)
    with pytest.raises(ValueError, match="window must be a whole number >= 1"):
        agg.build_method("agg", V, window=0)


def test_tensors_of_the_wrong_kind_are_a_value_error_naming_them():
    """What a practitioner can pass by mistake gets agg.py's ValueError, not an error from inside
    torch (or a number)."""
    m = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    h, w, y = inputs(seed=16)
    m.observe(y)
    for kw, match in (
        (dict(targets=y.float()), "targets must be integer token ids, got torch.float32"),
        (dict(targets=y > 3), "targets must be integer token ids, got torch.bool"),
        # ran on, a wrong number
        (dict(hidden=h.long()), "hidden, weight .* must be floating point"),
        (dict(bias=torch.zeros(V, dtype=torch.long)), "must be floating point"),
        (dict(hidden=h.to("meta")), "on one device, with data; got .*'meta'"),
    ):
        with pytest.raises(ValueError, match=match):
            m.loss(**dict(dict(hidden=h, weight=w, targets=y), **kw))
    with pytest.raises(
        ValueError, match="method 'agg': targets must be integer token ids, got torch.float32"
    ):
        m.observe(y.float())


def test_second_backward_through_one_loss_says_what_to_do():
    method = agg.build_method("mle", V)
    h, w, y = inputs()
    h.requires_grad_()
    loss = method.loss(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call method.loss"):
        loss.backward()


def test_all_ignored_batch_gives_zero_loss_and_zero_gradients():
    method = agg.build_method("mle", V)
    h, w, _ = inputs(T=5)
    loss, gh, gw = grads(method, h, w, torch.full((5,), -100))
    assert float(loss) == 0.0 and torch.all(gh == 0) and torch.all(gw == 0)


def test_freeze_rare_hook_lasts_one_backward_and_after_step_undoes_weight_decay():
    counts = torch.arange(V, 0, -1)
    emb = torch.nn.Embedding(V, D)
    x, y = torch.arange(V)[None, :], torch.arange(V)[None, :].roll(1, 1)
    frozen = agg.build_method("freeze-rare", V, counts=counts)
    rare = frozen.rare_mask()
    opt = torch.optim.AdamW(emb.parameters(), lr=0.1, weight_decay=0.5)
    initial = emb.weight.detach().clone()
    for _ in range(3):
        frozen.observe(y)
        frozen.loss(torch.tanh(emb(x)), emb.weight, y).backward()
        assert torch.all(emb.weight.grad[rare] == 0)
        opt.step()
        frozen.after_step(emb.weight)
        opt.zero_grad()
    assert torch.equal(emb.weight[rare], initial[rare]) and not torch.equal(
        emb.weight[~rare], initial[~rare]
    )
    # the same weight under another method (frozen is still alive) trains fully
    mle = agg.build_method("mle", V)
    mle.observe(y)
    mle.loss(torch.tanh(emb(x)), emb.weight, y).backward()
    assert emb.weight.grad[rare].abs().sum() > 0


def literal_repeat_mask(row, n):
    """Welleck et al. 2020 Sec. 5.2 read literally: every token of an n-gram seen earlier in the
    row."""
    mask, seen = [0] * len(row), set()
    for j in range(len(row) - n + 1):
        gram = tuple(row[j : j + n])
        if gram in seen:
            mask[j : j + n] = [1] * n
        seen.add(gram)
    return mask


def test_unlikelihood_keeps_float64():
    y = torch.tensor([[3, 1, 3, 2]])
    h, w = torch.randn(1, 4, D, dtype=torch.float64), torch.randn(5, D, dtype=torch.float64)
    assert agg.unlikelihood(h, w, y).dtype == torch.float64


@pytest.mark.parametrize("gate_ul", [True, False, "features"])
def test_ul_agg_gates_the_ul_weight_gradient_like_the_nll(gate_ul):
    counts = make_counts(13)
    rare, g1, g2 = paper_gates(counts)
    name, kw = (
        ("ul+agg-features", {}) if gate_ul == "features" else ("ul+agg", dict(gate_ul=gate_ul))
    )
    method = agg.build_method(name, V, alpha=ALPHA, window=WINDOW, alpha_ul=0.7, **kw)
    observe_counts(method, counts)
    h, w, y = inputs(seed=13)
    h, y = h.reshape(6, 10, D), y.reshape(6, 10)
    _, gh, gw = grads(method, h, w, y)
    # literal reference: AGG's NLL gradients (Eq. 9-10) + alpha_ul x the UL term's, whose weight
    # part is gated by the same per-(row type, column) gates (target column 1)
    nll_gh, nll_gw = literal_agg_grads(h.reshape(-1, D), w, y.reshape(-1), rare, g1, g2)
    z = (h @ w.T).detach().requires_grad_()
    # gradient of the UL value wrt the logits, through a logits-level copy of unlikelihood()
    lp = torch.log_softmax(z, -1)
    B, T = y.shape
    same = y[:, :, None] == y[:, None, :]
    before = torch.ones(T, T, dtype=torch.bool).tril(-1)
    first = ~(same & before).any(-1)
    cand = before & first[:, None, :] & ~same
    pen = -torch.log((1 - lp.gather(2, y[:, None, :].expand(B, T, T)).exp()).clamp(min=1e-5))
    (g_logits,) = torch.autograd.grad((pen * cand).sum() / y.numel(), z)
    gate = torch.where(rare[y][..., None], g2, g1).expand(B, T, V).clone()
    gate = torch.where(rare[None, None, :], gate, torch.ones(()))  # only rare columns are gated
    gate.scatter_(2, y[..., None], 1.0)
    w_part = (g_logits * (gate if gate_ul is True else 1)).reshape(-1, V) * (gate_ul != "features")
    ref_gw = nll_gw + 0.7 * w_part.T @ h.reshape(-1, D)
    ref_gh = nll_gh.reshape(B, T, D) + 0.7 * g_logits @ w
    torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-10, atol=1e-12)


def test_agps_rare_rank_is_the_papers_i_r():
    counts = torch.tensor([50, 3, 40, 1, 30, 2, 20, 10])  # ranks: 0, 6, 1, 7, 2, 5, 3, 4
    method = agg.build_method("agps", 8, counts=counts, rare_rank=5, special_ids=[3])
    assert method.rare_mask().tolist() == [False, True, False, False, False, True, False, False]


def test_agg_centered_gates_only_the_push_along_the_mean_feature():
    counts = make_counts(14)
    rare, g1, g2 = paper_gates(counts)
    method = agg.build_method("agg-centered", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, counts)
    h, w, y = inputs(seed=14, ignore=(2, 9))
    loss, gh, gw = grads(method, h, w, y)
    keep = y != -100
    hk, yk = h[keep], y[keep]
    G = (torch.softmax(hk @ w.T, 1) - F.one_hot(yk, V)) / len(yk)
    gate = torch.where(rare[yk][:, None], g2[None, :], g1[None, :])
    gate = torch.where(rare[None, :], gate, torch.ones(()))
    gate[torch.arange(len(yk)), yk] = 1.0
    mean_h = hk.mean(0)
    # deviation whole, mean part gated
    expected = G.T @ (hk - mean_h) + (gate * G).T @ mean_h.expand_as(hk)
    torch.testing.assert_close(gw, expected, rtol=1e-12, atol=1e-14)
    _, mle_gh, _ = grads(agg.build_method("mle", V), h, w, y)
    torch.testing.assert_close(gh, mle_gh, rtol=1e-12, atol=1e-14)  # the hidden gradient is MLE's
    torch.testing.assert_close(grads(method, h, w, y, chunk_size=7)[2], gw, rtol=1e-12, atol=1e-14)


def bias_grads(method, h, w, b, y, **kw):
    h, w, b = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    loss = method.loss(h, w, y, bias=b, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad


def test_output_bias_gets_the_plain_gradient_and_the_gates_act_on_the_weight():
    h, w, y = inputs(seed=11, ignore=(3, 7))
    b = torch.randn(V, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    # mle: autograd through F.cross_entropy(h @ W.T + b, y), chunked or not
    hh, ww, bb = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = F.cross_entropy(hh @ ww.T + bb, y)
    ref.backward()
    for chunk in (None, 7):
        loss, gh, gw, gb = bias_grads(agg.build_method("mle", V), h, w, b, y, chunk_size=chunk)
        torch.testing.assert_close(loss, ref.detach())
        for got, want in ((gh, hh.grad), (gw, ww.grad), (gb, bb.grad)):
            torch.testing.assert_close(got, want)
    # agg: the literal Eq. 9-10 with the bias in every logit; the bias's gradient comes from z0
    # alone
    counts = make_counts(11)
    method = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, counts)
    rare, g1v, g2v = paper_gates(counts)
    hh, ww, bb = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    keep = y != -100
    h_, y_ = hh[keep], y[keep]
    rare_other = rare[None, :] & (torch.arange(V)[None, :] != y_[:, None])
    g1 = torch.where(rare_other, g1v[None, :], torch.ones(()))
    g2 = torch.where(rare_other, g2v[None, :], torch.ones(()))
    z0 = h_ @ ww.detach().T + bb
    z1 = g1 * (h_.detach() @ ww.T) + (1 - g1) * (h_.detach() @ ww.detach().T) + bb.detach()
    z2 = g2 * (h_.detach() @ ww.T) + (1 - g2) * (h_.detach() @ ww.detach().T) + bb.detach()

    def ce(z):
        return F.cross_entropy(z, y_, reduction="none")

    (ce(z0) + torch.where(rare[y_], ce(z2), ce(z1))).mean().backward()
    _, gh, gw, gb = bias_grads(method, h, w, b, y)
    for got, want in ((gh, hh.grad), (gw, ww.grad), (gb, bb.grad)):
        torch.testing.assert_close(got, want)
    # ul: the unlikelihood term sees the biased logits too
    hb, wb, bias = h.reshape(4, 15, D), w, b
    yb = y.reshape(4, 15)
    hh, ww, bb = (
        hb.clone().requires_grad_(),
        wb.clone().requires_grad_(),
        bias.clone().requires_grad_(),
    )
    ref = F.cross_entropy((hh @ ww.T + bb).reshape(-1, V), yb.reshape(-1)) + agg.unlikelihood(
        hh, ww, yb, bias=bb
    )
    ref.backward()
    _, gh, gw, gb = bias_grads(agg.build_method("ul", V), hb, wb, bias, yb)
    for got, want in ((gh, hh.grad), (gw, ww.grad), (gb, bb.grad)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="bias must be"):
        agg.build_method("mle", V).loss(h, w, y, bias=b[:-1])


def test_gradient_parts_are_eq_4_and_add_up_to_the_methods_weight_gradient():
    h, w, y = inputs(seed=12, ignore=(5,))
    counts = make_counts(12)
    rare_static = torch.arange(V) >= 30  # the rare set the parts are split by (eval's static group)
    for name in ("mle", "agg"):
        method = (
            agg.build_method(name, V, alpha=ALPHA, window=WINDOW)
            if name == "agg"
            else agg.build_method("mle", V)
        )
        if name == "agg":
            observe_counts(method, counts)
        keep = y != -100
        hk, yk = h[keep], y[keep]
        gates = method.gates(yk)
        parts = agg.gradient_parts(h, w, y, rare_static, gates)
        # literal Eq. 4 with the method's dense gate
        p = torch.softmax(hk @ w.T, -1) * agg.gate_matrix(yk, V, *gates)
        a, b, c = (torch.zeros(V, D, dtype=torch.float64) for _ in range(3))
        for i in range(len(yk)):
            for k in range(V):
                if k == yk[i]:
                    a[k] += (p[i, k] - 1) * hk[i]
                elif rare_static[yk[i]]:
                    c[k] += p[i, k] * hk[i]
                else:
                    b[k] += p[i, k] * hk[i]
        n = len(yk)
        want = torch.stack([a.norm(dim=1), b.norm(dim=1), c.norm(dim=1)], 1) / n
        torch.testing.assert_close(parts, want, rtol=1e-5, atol=1e-7)  # float32 softmax inside
        _, _, gw = grads(method, h, w, y)
        # the three parts are the whole weight gradient
        torch.testing.assert_close((a + b + c) / n, gw)


def test_build_method_applies_the_papers_defaults():
    counts = make_counts(13) * 10 + 1
    m = agg.build_method(
        "agg-static", V, counts=counts, steps_per_epoch=12.4, tokens_per_step=64, rare_share=0.25
    )
    assert m.hparams["window"] == 12 and m.hparams["static_after"] == 12
    assert m.hparams["alpha"] == agg.alpha_for_rare_share(counts, 0.25, 64)
    # given wins
    assert agg.build_method("agg", V, steps_per_epoch=12, window=5).hparams["window"] == 5
    inferred = agg.build_method("agg", V, counts=counts, tokens_per_step=64, rare_share=0.25)
    # one epoch, from the counts
    assert inferred.hparams["window"] == round(float(counts.sum()) / 64)
    with pytest.raises(ValueError, match="window .* is missing"):
        agg.build_method("agg", V, alpha=0.1)  # never a silent default
    # plain AGG stays dynamic
    assert agg.build_method("agg", V, steps_per_epoch=12).hparams["static_after"] is None
    assert "window" not in agg.build_method("cosreg", V, steps_per_epoch=12).hparams
    assert [n for n in agg.METHODS if agg.agg_family(n)] == [
        "agg",
        "agg-no-g1",
        "agg-no-g2",
        "agg-static",
        "agg-continuous",
        "agg-centered",
        "agg-prefill",
        "ul+agg",
        "ul+agg-features",
        "agg+center",
    ]
    ignored = agg.build_method("mle", V, counts=counts, tokens_per_step=64, rare_share=0.2)
    # a method flag switches methods without a branch
    assert ignored.hparams["ignored"] == {"rare_share": 0.2}
    with pytest.raises(ValueError, match="not both"):
        agg.build_method("agg", V, counts=counts, tokens_per_step=64, rare_share=0.2, alpha=0.1)
    with pytest.raises(ValueError, match="needs counts"):
        agg.build_method("agg", V, rare_share=0.2)


def test_bad_numbers_are_refused_with_the_parameter_named():
    for kw, match in (
        (dict(alpha=float("nan")), "alpha must be a finite number"),
        (dict(alpha=float("inf")), "alpha must be a finite number"),
        (dict(alpha=-1.0), "alpha"),
    ):
        with pytest.raises(ValueError, match=match):
            agg.build_method("agg", V, **kw)
    h, w, y = inputs(seed=14)
    m = agg.build_method("mle", V)
    for kw, match in (
        (dict(chunk_size=-4), "chunk_size"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(label_smoothing=1.0), "label_smoothing"),
        (dict(label_smoothing=-0.1), "label_smoothing"),
    ):
        with pytest.raises(ValueError, match=match):
            m.loss(h, w, y, **kw)


def test_values_that_would_give_wrong_numbers_are_refused_with_the_value_and_range():
    counts = make_counts()
    for name, kw, match in (
        ("agg", dict(window=2.5), r"window must be a whole number >= 1, got 2\.5"),
        ("agg", dict(window=True), "window must be a whole number >= 1, got True"),
        ("agps", dict(counts=counts, rare_fraction=1.5), r"rare_fraction .*\[0, 1\].*1\.5"),
        ("freeze-rare", dict(counts=counts, rare_fraction=-0.1), "rare_fraction"),
        ("frage", dict(counts=counts, popular_fraction=1.5), r"popular_fraction .*\[0, 1\].*1\.5"),
        ("mle", dict(special_ids=[-1]), r"special_ids \[-1\] are outside \[0, vocab_size=40\)"),
        ("agg", dict(special_ids=[0, V]), rf"special_ids \[{V}\] are outside"),
        (
            "agps",
            dict(counts=counts.double().index_fill(0, torch.tensor([3]), float("nan"))),
            "counts must be finite numbers >= 0; entry 3 is nan",
        ),
        ("frage", dict(counts=counts.index_fill(0, torch.tensor([5]), -2)), "entry 5 is -2"),
        # knobs that would silently train another method (mu1 0 fell back to its default,
        # parts "x" dropped nothing, rare_rank -1 marked one token rare)
        ("agg-static", dict(static_after=-3), "static_after must be a whole number >= 1, got -3"),
        ("freeze-rare", dict(counts=counts, until=-5), "until must be a whole number >= 0"),
        ("agps", dict(counts=counts, mu1=0.0), r"mu1 must be a finite number > 0, got 0\.0"),
        ("frage", dict(counts=counts, disc_steps=0), "disc_steps must be a whole number >= 1"),
        ("agps", dict(counts=counts, rare_rank=-1), "rare_rank must be a whole number >= 0"),
        ("freeze-b", dict(counts=counts, parts="x"), "parts must be 'b', 'c' or 'bc', got 'x'"),
        ("agg", dict(alpha="0.1"), "alpha must be a finite number >= 0, got '0.1'"),
    ):
        with pytest.raises(ValueError, match=match):
            agg.build_method(name, V, **kw)
    # a whole number given as a float is K
    assert agg.build_method("agg", V, window=4.0).hparams["window"] == 4.0
    h, w, y = inputs(seed=3, ignore=(0, 1))
    for name in ("mle", "agg", "cosreg"):
        for bad in (V, -5):
            yb = y.clone()
            yb[7] = bad
            m = agg.build_method(name, V, **(dict(window=2) if name == "agg" else {}))
            with pytest.raises(
                ValueError, match=f"target id {bad} is outside \\[0, vocab_size={V}\\)"
            ):
                m.observe(yb)  # the first targets are checked on the host: the id named
            m.observe(y)
            # later ones on the device, without a synchronisation (CUDA: a device-side assert)
            with pytest.raises(
                RuntimeError, match=f"a target id is outside \\[0, vocab_size={V}\\)"
            ):
                m.loss(h, w, yb)
        m.loss(h, w, y)  # ignore_index (-100) is fine


def test_hparams_table_covers_every_method_with_the_defaults_types():
    """agg.HPARAMS documents every method hyper-parameter (the scripts' flags) with its defaults'
    type; both come from the one declaration of each method, its spec {key: (default, type,
    meaning)}."""
    for name, cls in agg.METHODS.items():
        assert cls.defaults == {key: default for key, (default, _, _) in cls.spec.items()}, name
        for key, default in cls.defaults.items():
            assert key in agg.HPARAMS and agg.HPARAMS[key] == cls.spec[key][1:], (name, key)
            if default is not None:
                assert isinstance(default, agg.HPARAMS[key][0]), (name, key, default)
    assert (
        agg.METHODS["agg-static"].defaults["static_after"] == 1000
        and agg.AGG.defaults["static_after"] is None
    )
    assert (
        agg.METHODS["freeze-b"].defaults == dict(rare_fraction=0.2, parts="b")
        and agg.MLE.defaults == {}
    )
    assert agg.HPARAMS["mu1"] == (float, "AGPS mu1 (AGPS Eq. 14; default: the largest rare count)")
    assert list(agg.HPARAMS)[:3] == ["alpha", "window", "use_g1"] and len(agg.HPARAMS) == 25


def test_group_of_numbers_tokens_by_frequency_group():
    counts = torch.tensor([5, 0, 9, 1, 7, 3, 2, 8, 4, 6])
    groups = agg.frequency_groups(counts)
    gid = agg.group_of(groups, len(counts))
    # 3 frequent (9, 8, 7), 5 medium, 2 rare (1, 0)
    assert gid.tolist() == [1, 2, 0, 2, 0, 1, 1, 0, 1, 1]
    assert agg.group_of([groups[0]], 10, missing=3).tolist().count(3) == 7


def method_kw(name):
    """Hyper-parameters that give `name` a rare group on the test vocabulary (and a z-loss, a
    mu-loss to check)."""
    kw = dict(counts=make_counts(14) + 1)
    if agg.agg_family(name):
        kw.update(alpha=ALPHA, window=WINDOW)
    if name in ("agps", "freeze-rare", "freeze-b", "freeze-c", "freeze-bc"):
        kw.update(rare_fraction=0.3)
    return dict(kw, **{"zloss": dict(z_coef=0.1), "center": dict(center_mode="loss")}.get(name, {}))


@pytest.mark.parametrize("name", list(agg.METHODS))
def test_softcap_gradients_are_autograds_through_the_cap_for_every_method(name):
    """loss(..., softcap=C) against autograd of the literal composition: C tanh((h W^T + b) / C),
    the NLL (and z-loss) on it, the weight's gradient gated by the method's dense gate
    (agg-centered: the push along the mean feature only), freeze-rare's rows zeroed, plus the
    method's regulariser through the same cap."""
    cap = 2.0  # small against these logits (|s| up to ~8): tanh bends them
    method = agg.build_method(name, V, **method_kw(name))
    observe_counts(method, make_counts(14))
    h, w, y = inputs(seed=14, ignore=(4, 33))
    b = torch.randn(V, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    h, y = h.reshape(6, 10, D), y.reshape(6, 10)
    # FRAGE builds its discriminator at the first call (random init): once, before the copies
    with torch.no_grad():
        method.regulariser(h, w, y, -100)
    # FRAGE's discriminator steps once per optimizer step: each call its own copy
    reference = copy.deepcopy(method)
    hh, ww, bb = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    keep = y.reshape(-1) != -100
    hk, yk = hh.reshape(-1, D)[keep], y.reshape(-1)[keep]
    gate = agg.gate_matrix(yk, V, *reference.gates(yk))

    def gated(x):  # value x @ W.T; its gradient reaches W times the gate
        z = x.detach() @ ww.T
        z.register_hook(lambda g: g * gate)
        return z - z.detach()

    if reference.hparams.get("center_gate"):
        mean_h = hk.mean(0).expand_as(hk)
        via_w = (
            (hk - mean_h).detach() @ ww.T - ((hk - mean_h).detach() @ ww.T).detach() + gated(mean_h)
        )
    else:
        via_w = gated(hk)
    logits = cap * torch.tanh((hk @ ww.detach().T + via_w + bb) / cap)
    z_coef = reference.hparams.get("z_coef", 0.0)
    ref = F.cross_entropy(logits, yk) + z_coef * torch.logsumexp(logits, 1).square().mean()
    reg = reference.regulariser(hh, ww, y, -100, bb, cap)
    (ref + (0 if reg is None else reg)).backward()
    if hasattr(reference, "frozen") and reference.frozen():
        ww.grad[reference.rare] = 0
    for chunk in (None, 7):
        loss, gh, gw, gb = bias_grads(
            copy.deepcopy(method), h, w, b, y, softcap=cap, chunk_size=chunk
        )
        torch.testing.assert_close(loss, (ref + (0 if reg is None else reg)).detach())
        for got, want in ((gh, hh.grad), (gw, ww.grad), (gb, bb.grad)):
            torch.testing.assert_close(got, want)
    uncapped = bias_grads(copy.deepcopy(method), h, w, b, y)
    assert not torch.allclose(uncapped[2], gw)  # the cap changed the gradient: the test sees it


def test_softcap_bends_the_gradient_parts_like_the_heads():
    h, w, y = inputs(seed=15)
    w = w * 3  # logits well past the cap
    method = agg.build_method("agg", V, alpha=ALPHA, window=WINDOW)
    observe_counts(method, make_counts(15))
    parts = agg.gradient_parts(h, w, y, torch.arange(V) >= 30, method.gates(y), softcap=2.0)
    full = grads(method, h, w, y, softcap=2.0)[2].norm(dim=1)
    # the parts' norms bound the whole row's (triangle inequality)
    assert (parts.sum(1) >= full * (1 - 1e-5)).all()
    assert not torch.allclose(
        parts, agg.gradient_parts(h, w, y, torch.arange(V) >= 30, method.gates(y))
    )


def test_softcap_must_be_a_finite_positive_number():
    h, w, y = inputs(seed=16)
    method = agg.build_method("mle", V)
    # inf: C tanh(s / C) = inf x 0, a NaN loss
    for bad in (0, -1.0, float("nan"), float("inf"), "30", True):
        with pytest.raises(ValueError, match="softcap must be a number > 0 and finite"):
            method.loss(h, w, y, softcap=bad)
    assert torch.isfinite(method.loss(h, w, y, softcap=30))


def test_the_library_refuses_what_it_cannot_honour_naming_it():
    """Inputs that would give a wrong number or a raw torch error are a ValueError naming them."""
    counts = make_counts()
    w = torch.randn(V, D)
    cases = [
        (lambda: agg.alpha_for_rare_share(counts, 0.2, 0), "tokens_per_step must be a number > 0"),
        (
            lambda: agg.alpha_for_rare_share(counts, "0.2", 64),
            "rare_share must be a share in \\(0, 1\\)",
        ),
        (
            lambda: agg.alpha_for_rare_share(torch.zeros(V), 0.2, 64),
            "counts must hold at least one token",
        ),
        (lambda: agg.rare_share_of_alpha(["a"] * V, 0.1, 64), "counts must be token counts"),
        (lambda: agg.least_frequent_mask(counts, 1.5), "fraction must be a share"),
        (
            lambda: agg.build_method("mle", V, special_ids=[1.5]),
            "special_ids must be whole token ids",
        ),
        (lambda: agg.build_method("mle", V, counts=torch.ones(V + 1)), "counts has 41 entries"),
        (lambda: agg.build_method("agg", V, window=2, use_g1="no"), "use_g1 must be True or False"),
        (lambda: agg.build_method("mle", 0), "vocab_size must be a whole number > 0"),
        (lambda: agg.isotropy(torch.randn(V)), "weight must be a 2-D floating point tensor"),
        (lambda: agg.undertrained_rows(w, [V + 3]), "unused_ids must be ids in \\[0, 40\\)"),
        (lambda: agg.mean_cosine_between(w, torch.randn(4, D + 1)), "rows of one size"),
        (lambda: agg.frequency_groups(counts, (0.6, 0.6, 0.2)), "fractions must sum to at most 1"),
        (lambda: agg.group_of([[0, V]], V), "groups must be ids in \\[0, 40\\)"),
        (
            lambda: agg.GroupNLL().add(torch.ones(3), torch.zeros(2, dtype=torch.long)),
            "nll has 3 positions",
        ),
        (lambda: agg.geometry(w, {"rare": [0]}, seen=torch.ones(V - 1)), "seen has 39 entries"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    h, y = torch.randn(6, D), torch.randint(0, V, (6,))
    mle = agg.build_method("mle", V)
    for kw, match in (
        (dict(label_smoothing="0.1"), "label_smoothing must be a number in \\[0, 1\\)"),
        (dict(chunk_size=True), "chunk_size must be a positive number of rows"),
        (dict(ignore_index=None), "ignore_index must be a whole number"),
    ):
        with pytest.raises(ValueError, match=match):
            mle.loss(h, w, y, **kw)
    with pytest.raises(ValueError, match="must be tensors"):
        mle.loss(h.tolist(), w, y)


def test_coupled_adamw_refuses_a_group_value_that_gives_wrong_weights():
    emb, rest = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="CoupledAdamW: lr must be a finite number >= 0, got nan"):
        agg.CoupledAdamW([{"params": [emb]}, {"params": [rest], "lr": float("nan")}])
    with pytest.raises(ValueError, match="CoupledAdamW: betas must be two numbers"):
        agg.CoupledAdamW([emb], betas=(0.9,))
    opt = agg.CoupledAdamW([emb])
    with pytest.raises(ValueError, match="coupled must be True or False"):
        opt.add_param_group({"params": [rest], "coupled": "yes"})
    opt.param_groups[0]["lr"] = float("inf")  # as a broken scheduler would set it
    emb.grad = torch.ones_like(emb)
    with pytest.raises(ValueError, match="lr must be a finite number"):
        opt.step()
