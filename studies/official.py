"""A literal port of the official AGG criterion (the authors' fairseq criterion, AGG Eq. 5, 7-10):
the oracle the tests hold agg.py's one-logit 'agg' against, and the cost baseline `official-ref` of
studies.bench. As the official code does, it counts into a dense (K, V) memory by comparing every
target with every other (T x T), builds dense gate matrices and three logit matrices with three
log-softmaxes. The loss is a mean over positions (fairseq sums) so that gradients compare with
agg.py's 'agg'; no ignore_index / label smoothing."""

import torch
import torch.nn.functional as F


class OfficialAGGRef:
    def __init__(self, vocab_size, alpha, window, special_ids=()):
        self.vocab_size, self.alpha, self.window, self.special_ids = (
            vocab_size,
            alpha,
            window,
            list(special_ids),
        )
        # m_1..m_K, dense, as in the official code
        self.memory, self.itr = torch.zeros(window, vocab_size), 0

    def prefill(self, batches):
        """Set-up only (not timed): the memory as it would be after the steps whose targets are
        `batches`."""
        for y in batches:
            self.itr += 1
            self.memory[self.itr % self.window] = torch.bincount(
                y.reshape(-1).cpu(), minlength=self.vocab_size
            )

    def observe(self, targets):
        pass  # the official criterion counts inside the loss

    def loss(self, hidden, weight, targets, chunk_size=None):
        d, V, K = hidden.shape[-1], self.vocab_size, self.window
        h, y = hidden.reshape(-1, d), targets.reshape(-1)
        self.memory = self.memory.to(h.device)
        # token counter memory (AGG Sec. 4.1): this step's counts by a T x T comparison, into the
        # oldest slot
        self.itr += 1
        slot = self.memory[self.itr % K]
        slot.zero_()
        slot[y] = (y[:, None] == y[None, :]).float().sum(1)
        # appearances over the last K steps
        a = self.memory.sum(0).to(torch.promote_types(h.dtype, torch.float32))
        g1 = a / min(self.itr, K)  # AGG Eq. 7: a_k / K
        g1[self.special_ids] = 1.0
        rare = g1 < self.alpha  # AGG Eq. 5
        rare_ids = rare.nonzero().squeeze(1)
        g1[~rare] = 1.0
        g2 = (a / a[rare_ids].mean()).clamp(max=1.0)  # AGG Eq. 8: min(a_k / mean_rare(a), 1)
        g2[~rare] = 1.0
        # rows whose target is rare: every target against every rare id (T x R)
        rare_row = (y[:, None] == rare_ids[None, :]).float().sum(1) > 0
        rows_r, rows_n = rare_row.nonzero().squeeze(1), (~rare_row).nonzero().squeeze(1)
        # dense gates, one row per position; the target column is never gated (v_k = y_i -> 1)
        gate1 = g1.expand(len(rows_n), V).clone()
        gate1[torch.arange(len(rows_n), device=h.device), y[rows_n]] = 1.0
        gate2 = g2.expand(len(rows_r), V).clone()
        gate2[torch.arange(len(rows_r), device=h.device), y[rows_r]] = 1.0
        h_t, w_t = h.detach(), weight.detach()
        z0 = h @ w_t.T  # AGG Eq. 9, l = 0: the gradient wrt h, ungated
        z1 = h_t[rows_n] @ weight.T
        z1 = gate1 * z1 + (1 - gate1) * z1.detach()  # AGG Eq. 9, l = 1
        z2 = h_t[rows_r] @ weight.T
        z2 = gate2 * z2 + (1 - gate2) * z2.detach()  # AGG Eq. 9, l = 2
        # the official .float(); float64 stays float64
        acc = torch.promote_types(z0.dtype, torch.float32)
        lp0, lp1, lp2 = (F.log_softmax(z.to(acc), dim=-1) for z in (z0, z1, z2))
        # AGG Eq. 10
        nll = -(
            lp0.gather(1, y[:, None]).sum()
            + lp1.gather(1, y[rows_n, None]).sum()
            + lp2.gather(1, y[rows_r, None]).sum()
        )
        return nll / max(len(y), 1)
