"""
Watch tied token embeddings degenerate into a cone under MLE, and AGG cure it, on a CPU in seconds.

    python toy_degeneration.py                          # MLE vs AGG, ~20 s on 2 cores
    python toy_degeneration.py --methods mle,agg,agg-no-g1,agps,freeze-rare,freeze-b,cosreg,frage,ul,ul+agg
    python toy_degeneration.py --alpha-sweep 0.2,0.4,0.8,1.6 --steps 600   # AGG Appendix E: too large a rare
                                                        # group hurts isotropy again (it shows after ~300 steps)

alpha is in AGG's own unit (Eq. 5): appearances per optimizer step. At the default 4096 tokens per step, alpha 0.2 /
0.4 / 0.8 / 1.6 make ~5% / ~26% / ~55% / ~75% of the vocabulary rare; 0.1 and below catch (almost) nothing.

The language: a Zipfian vocabulary (unigram prior p_k ~ k^-zipf) with real structure to learn. Every token k has a
hidden "true" vector u_k; the next token after (x_-2, x_-1) is drawn from the mixture
    p(k | x_-2, x_-1) = lam * T1[x_-1, k] + (1 - lam) * T2[x_-2, k],   Tj[i, k] ~ prior_k * exp(beta * (A_j u_i) . u_k)
i.e. softmax(context . true vectors) tilted by the Zipf prior, so rare tokens are rare the way they are in text.
Both transition tables are N x N, so sampling is one searchsorted per token (no softmax per token).

The model has the ingredients of the theory (Gao et al. 2019 Sec. 4): tied input/output embeddings W and a LayerNorm
right before the softmax layer:  h = LN(MLP([W[x_-2], W[x_-1]]) + W[x_-1]),  logits = h @ W.T.
The methods (MLE, AGG and its peers) and the metrics (I(W), mean cosine, singular spectrum, frequency groups) all
come from agg.py. Frequency groups as in AGG Sec. 3.1: frequent 30%, medium 50%, rare 20% by training counts.
Outputs in --out: metrics.json, svd.png (AGG Fig. 1/3), spectrum.png (Gao et al. Fig. 2b),
training.png (AGG Fig. 2 and Fig. 4), alpha_sweep.png and svd_alpha_sweep.png with --alpha-sweep, and
embeddings.pt (the final W of every run).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import agg

GROUP_COLOURS = {"freq": "tab:blue", "med": "tab:green", "rare": "tab:red"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", default="mle,agg", help=f"comma-separated, any of: {','.join(agg.METHODS)}")
    p.add_argument("--alpha-sweep", default="",
                   help="comma-separated AGG alphas to run in addition to --methods (e.g. 0.2,0.4,0.8,1.6)")
    p.add_argument("--seed", type=int, default=0, help="seeds the language, the corpora and the model init")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per method")
    p.add_argument("--out", default="out/toy", help="folder for metrics.json and the plots")
    # the language
    p.add_argument("--vocab", type=int, default=2000, help="vocabulary size N")
    p.add_argument("--zipf", type=float, default=1.1, help="exponent of the Zipf prior p_k ~ k^-zipf")
    p.add_argument("--rank", type=int, default=16, help="dimension of the hidden true token vectors")
    p.add_argument("--beta", type=float, default=20.0, help="strength of the context . true-vector term")
    p.add_argument("--lam", type=float, default=0.7, help="weight of the x_-1 transition table in the mixture")
    p.add_argument("--epoch-steps", type=int, default=100,
                   help="training corpus size in optimizer steps (one epoch); also AGG's window K (AGG Sec. 4.1)")
    p.add_argument("--val-tokens", type=int, default=32768, help="held-out tokens for perplexity")
    # the model and its training
    p.add_argument("--dim", type=int, default=32, help="embedding size d")
    p.add_argument("--init-std", type=float, default=0.02, help="std of the embedding init")
    p.add_argument("--seq-len", type=int, default=64, help="targets per sequence")
    p.add_argument("--batch-seqs", type=int, default=64, help="sequences per step (tokens per step = this x seq-len)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--alpha", type=float, default=0.4,
                   help="AGG alpha (rare if appearances per step a_k/K < alpha, AGG Eq. 5) for agg, agg-*, ul+agg")
    p.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="override a method hyper-parameter, e.g. --set cosreg.gamma=0.5 (repeatable)")
    p.add_argument("--log-every", type=int, default=5, help="steps between geometry snapshots for training.png")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default); on a machine busy with other jobs, 1 is often faster")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (metrics.json and the table only)")
    args = p.parse_args(argv)

    args.method_list = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    bad = [m for m in args.method_list if m not in agg.METHODS]
    if bad or not args.method_list:
        p.error(f"--methods: unknown {bad or 'empty list'}; valid: {','.join(agg.METHODS)}")
    try:
        args.sweep = [float(a) for a in args.alpha_sweep.split(",") if a.strip()]
    except ValueError:
        p.error(f"--alpha-sweep must be comma-separated numbers, got {args.alpha_sweep!r}")
    if any(a <= 0 for a in args.sweep):
        p.error(f"--alpha-sweep values must be > 0, got {args.sweep}")
    args.overrides = {}
    for item in args.set:
        try:
            key, value = item.split("=", 1)
            name, hp = key.rsplit(".", 1)
        except ValueError:
            p.error(f"--set {item!r}: expected METHOD.KEY=VALUE, e.g. cosreg.gamma=0.5")
        if name not in agg.METHODS or hp not in agg.METHODS[name].defaults:
            p.error(f"--set {item!r}: {name!r} has no hyper-parameter {hp!r}; "
                    f"valid: {sorted(agg.METHODS[name].defaults) if name in agg.METHODS else list(agg.METHODS)}")
        args.overrides.setdefault(name, {})[hp] = _parse_value(value)
    for name, flag in [("steps", args.steps), ("epoch-steps", args.epoch_steps), ("vocab", args.vocab),
                       ("dim", args.dim), ("seq-len", args.seq_len), ("batch-seqs", args.batch_seqs),
                       ("log-every", args.log_every), ("val-tokens", args.val_tokens)]:
        if flag < 1:
            p.error(f"--{name} must be >= 1, got {flag}")
    return args


def _parse_value(text):
    """'0.5' -> 0.5, '3' -> 3, 'true' -> True, 'none' -> None, anything else stays a string."""
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


# -----------------------------------------------------------------------------
# The synthetic language


def make_language(vocab, zipf, rank, beta, lam, gen):
    """Zipf prior, hidden true vectors, and the two transition tables, stored as one flat CDF (row r of table j at
    rows j * vocab + r) so that sampling every sequence's next token is a single searchsorted."""
    prior = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
    prior /= prior.sum()
    u = F.normalize(torch.randn(vocab, rank, generator=gen, dtype=torch.float64), dim=1)
    cdfs = []
    for _ in range(2):
        a = torch.linalg.qr(torch.randn(rank, rank, generator=gen, dtype=torch.float64))[0]  # a random rotation
        logits = prior.log()[None, :] + beta * (u @ a.T) @ u.T  # row i: next-token logits after token i
        cdfs.append(torch.softmax(logits, dim=1).cumsum(1).clamp(max=1.0))
    # Row r lives in [r, r + 1]: the whole table is one increasing sequence.
    cdf = torch.cat(cdfs) + torch.arange(2 * vocab, dtype=torch.float64)[:, None]
    return {"prior": prior, "cdf": cdf.reshape(-1), "lam": lam, "vocab": vocab}


def _rows(lang, x, t, use1):
    """Flat-CDF row of position t: table 1 after x[:, t-1] or table 2 after x[:, t-2]."""
    return torch.where(use1, x[:, t - 1], lang["vocab"] + x[:, t - 2])


def sample_corpus(lang, n_seqs, seq_len, gen):
    """(n_seqs, seq_len + 2) token ids: two prior-drawn context tokens, then seq_len tokens of the Markov chain."""
    V = lang["vocab"]
    x = torch.empty(n_seqs, seq_len + 2, dtype=torch.long)
    x[:, :2] = torch.multinomial(lang["prior"], 2 * n_seqs, replacement=True, generator=gen).view(n_seqs, 2)
    for t in range(2, seq_len + 2):
        rows = _rows(lang, x, t, torch.rand(n_seqs, generator=gen, dtype=torch.float64) < lang["lam"])
        u = torch.rand(n_seqs, generator=gen, dtype=torch.float64) + rows
        x[:, t] = (torch.searchsorted(lang["cdf"], u) - rows * V).clamp(0, V - 1)
    return x


def true_nll(lang, x):
    """Mean -log p(x_t | x_-2, x_-1) under the true process: the best any model can do (its exp: the oracle PPL)."""
    V, cdf = lang["vocab"], lang["cdf"]
    y = x[:, 2:].reshape(-1)

    def prob(rows):
        at = rows * V + y
        below = torch.where(y > 0, cdf[(at - 1).clamp(min=0)], rows.double())
        return cdf[at] - below

    ones = torch.ones(len(x), dtype=torch.bool)
    p1 = torch.stack([_rows(lang, x, t, ones) for t in range(2, x.shape[1])], 1).reshape(-1)
    p2 = torch.stack([_rows(lang, x, t, ~ones) for t in range(2, x.shape[1])], 1).reshape(-1)
    p = lang["lam"] * prob(p1) + (1 - lang["lam"]) * prob(p2)
    return float(-p.clamp(min=1e-300).log().mean())


# -----------------------------------------------------------------------------
# The model: tied embeddings + LayerNorm before the softmax layer (Gao et al. 2019 Sec. 4)


class ToyLM(nn.Module):
    def __init__(self, vocab, dim, init_std=0.02):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)  # W: the input embedding AND the softmax weight (tied)
        nn.init.normal_(self.emb.weight, std=init_std)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln = nn.LayerNorm(dim)

    def forward(self, x2, x1):
        """Hidden state h (the input of the tied softmax layer) for contexts (x_-2, x_-1)."""
        e2, e1 = self.emb(x2), self.emb(x1)
        return self.ln(self.mlp(torch.cat([e2, e1], dim=-1)) + e1)


# -----------------------------------------------------------------------------
# Geometry


def snapshot(step, W, groups, method):
    """The geometry over training (AGG Fig. 2) and the size of the rare group (AGG Fig. 4)."""
    rare = method.rare_mask()
    return {"step": step, "isotropy": agg.isotropy(W),
            "isotropy_freq": agg.isotropy(W[groups["freq"]]), "isotropy_rare": agg.isotropy(W[groups["rare"]]),
            "cos_rare": agg.mean_cosine(W[groups["rare"]]),
            "cos_rare_freq": agg.mean_cosine_between(W[groups["rare"]], W[groups["freq"]]),
            "rare_count": None if rare is None else int(rare.sum())}


# -----------------------------------------------------------------------------
# Training and evaluation


def method_hparams(name, args):
    """Toy-scale hyper-parameters of method `name` on top of agg.build_method's paper defaults (window K = steps per
    epoch, AGG Sec. 4.1): AGG's alpha, and agg-static's group fixed within this run."""
    hp = {"alpha": args.alpha} if agg.agg_family(name) else {}
    if agg.METHODS[name].defaults.get("static_after") is not None:
        hp["static_after"] = min(args.epoch_steps, max(1, args.steps // 2))
    hp.update(args.overrides.get(name, {}))
    return hp


def train_one(label, name, hparams, data, args):
    """Train a fresh ToyLM (same init for every method) with agg method `name`; return its metrics and history."""
    torch.manual_seed(args.seed + 1)
    model = ToyLM(args.vocab, args.dim, args.init_std)
    method = agg.build_method(name, vocab_size=args.vocab, counts=data["counts"], steps_per_epoch=args.epoch_steps,
                              **hparams)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    W = model.emb.weight
    train, groups = data["train"], data["groups"]
    order_gen = torch.Generator().manual_seed(args.seed + 2)  # same batch order for every method
    order, pos = torch.randperm(len(train), generator=order_gen), 0
    history = []
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"{label:>14}", leave=True, dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        if pos + args.batch_seqs > len(order):  # next epoch
            order, pos = torch.randperm(len(train), generator=order_gen), 0
        x = train[order[pos:pos + args.batch_seqs]]
        pos += args.batch_seqs
        y = x[:, 2:]
        method.observe(y)  # once per optimizer step, all targets of the step
        loss = method.loss(model(x[:, :-2], x[:, 1:-1]), W, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        method.after_step(W)
        if step % args.log_every == 0 or step == args.steps - 1:
            history.append(snapshot(step + 1, W.detach(), groups, method))
            bar.set_postfix(nll=f"{method.stats['nll']:.3f}", IW=f"{history[-1]['isotropy']:.2f}", refresh=False)
    train_seconds = time.perf_counter() - t0
    result = {**agg.geometry(W, groups, data["counts"] > 0), **evaluate(model, method, data, args),
              "seconds": time.perf_counter() - t0, "train_seconds": train_seconds}  # wall time: training + evaluation
    rare = method.rare_mask()
    tokens_per_step = args.batch_seqs * args.seq_len
    result.update(method=name, hparams=hparams,
                  rare_count=None if rare is None else int(rare.sum()),
                  rare_fraction=None if rare is None else float(rare.float().mean()),
                  R_over_B=None if rare is None else int(rare.sum()) / tokens_per_step,  # R/B
                  history=history)
    return result, W.detach().clone()


@torch.no_grad()
def evaluate(model, method, data, args, chunk_seqs=128):
    """Held-out PPL, total and per frequency group; Uniq; the rare set's predicted vs true probability mass."""
    val, group_of = data["val"], data["group_of"]
    W = model.emb.weight
    nll, preds, pred_mass, true_mass = [], [], [], []
    for s in range(0, len(val), chunk_seqs):
        x = val[s:s + chunk_seqs]
        h, y = model(x[:, :-2], x[:, 1:-1]), x[:, 2:]
        logits = h.reshape(-1, h.shape[-1]) @ W.T
        nll.append(F.cross_entropy(logits, y.reshape(-1), reduction="none"))
        preds.append(logits.argmax(1))
        if method.rare_mask() is not None:  # the method's own group: its stats carry the masses
            method.loss(h, W, y)
            pred_mass.append(method.stats["rare_mass_pred"] * y.numel())
            true_mass.append(method.stats["rare_mass_true"] * y.numel())
    nll, y_all = torch.cat(nll).double(), val[:, 2:].reshape(-1)
    tgt_group = group_of[y_all]
    out = {"ppl": math.exp(float(nll.mean())),
           "ppl_groups": {g: math.exp(float(nll[tgt_group == i].mean())) if bool((tgt_group == i).any()) else None
                          for i, g in enumerate(agg.GROUPS)},  # None: no held-out target in that group
           "uniq": int(torch.cat(preds).unique().numel())}
    if pred_mass:
        out.update(rare_mass_pred=sum(pred_mass) / len(nll), rare_mass_true=sum(true_mass) / len(nll))
    return out


def make_data(args):
    gen = torch.Generator().manual_seed(args.seed)
    lang = make_language(args.vocab, args.zipf, args.rank, args.beta, args.lam, gen)
    n_train = args.epoch_steps * args.batch_seqs
    n_val = max(1, args.val_tokens // args.seq_len)
    train = sample_corpus(lang, n_train, args.seq_len, gen)
    val = sample_corpus(lang, n_val, args.seq_len, gen)
    counts = torch.bincount(train[:, 2:].reshape(-1), minlength=args.vocab)
    freq, med, rare = agg.frequency_groups(counts)  # AGG Sec. 3.1: 30/50/20 by training counts
    group_of = torch.empty(args.vocab, dtype=torch.long)
    for i, idx in enumerate((freq, med, rare)):
        group_of[idx] = i
    unigram = (counts.double() + 1) / (counts.sum() + args.vocab)  # add-one unigram model of the training split
    return {"train": train, "val": val, "counts": counts, "groups": dict(zip(agg.GROUPS, (freq, med, rare))),
            "group_of": group_of, "oracle_ppl": math.exp(true_nll(lang, val)),
            "unigram_ppl": math.exp(float(-unigram[val[:, 2:]].log().mean()))}


# -----------------------------------------------------------------------------
# Reporting


def table(results):
    """A Markdown table (pastes into the README as is)."""
    head = ("| method | I(W) | I(W) freq/med/rare | mean cos | cos freq/med/rare | PPL | PPL freq/med/rare "
            "| Uniq | rare set (R/B) | rare mass pred/true | s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for label, r in results.items():
        ig, cg, pg = r["isotropy_groups"], r["mean_cosine_groups"], r["ppl_groups"]
        group_ppl = "/".join("-" if pg[g] is None else f"{pg[g]:.0f}" for g in agg.GROUPS)
        rare = "-" if r["rare_count"] is None else f"{r['rare_count']} ({r['R_over_B']:.3f})"
        mass = "-" if "rare_mass_pred" not in r else f"{r['rare_mass_pred']:.4f}/{r['rare_mass_true']:.4f}"
        lines.append(f"| {label} | {r['isotropy']:.3f} | {ig['freq']:.2f}/{ig['med']:.2f}/{ig['rare']:.2f} "
                     f"| {r['mean_cosine']:.3f} | {cg['freq']:.2f}/{cg['med']:.2f}/{cg['rare']:.2f} "
                     f"| {r['ppl']:.1f} | {group_ppl} | {r['uniq']} "
                     f"| {rare} | {mass} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def method_colours(labels):
    """One colour per run, the same in every plot."""
    import matplotlib.pyplot as plt
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {lab: cycle[i % len(cycle)] for i, lab in enumerate(labels)}


def svd_xy(W, basis):
    """Rows of W projected on the top two right singular vectors `basis` (2, d), as in AGG Fig. 1/3."""
    return (W.double() @ basis.T).numpy()


def top_singular_basis(W):
    """Top two right singular vectors of the (uncentred) W, signed so that the mean row projects positively."""
    _, _, vh = torch.linalg.svd(W.double(), full_matrices=False)
    vh = vh[:2]
    return vh * torch.sign(W.double().mean(0) @ vh.T).clamp(min=0).mul(2).sub(1)[:, None]


def plot_svd(weights, results, groups, path, title):
    """Per run, two panels: the embeddings projected on their top-2 singular directions (AGG Fig. 1/3), and the
    same for the unit-normalised rows, where a cone (all rare rows pointing one way) becomes one tight spot."""
    import matplotlib.pyplot as plt
    n = len(weights)
    cols = n if n <= 5 else math.ceil(n / math.ceil(n / 4))  # at most 5 columns, blocks as full as possible
    blocks = math.ceil(n / cols)
    fig, axes = plt.subplots(2 * blocks, cols, figsize=(4.3 * cols, 8.4 * blocks + 1.3), squeeze=False,
                             layout="constrained")
    for i, (label, W) in enumerate(weights.items()):
        basis = top_singular_basis(W)
        r = results[label]
        views = [(W, "embeddings"), (F.normalize(W.double(), dim=1), "directions (unit rows)")]
        for row, (Wp, what) in enumerate(views):
            ax = axes[2 * (i // cols) + row, i % cols]
            xy = svd_xy(Wp, basis)
            for g in ("freq", "med", "rare"):  # rare last: on top
                idx = groups[g].numpy()
                ax.scatter(xy[idx, 0], xy[idx, 1], s=4, alpha=0.55, color=GROUP_COLOURS[g], linewidths=0)
            lim = 1.05 if row == 1 else max(float(abs(xy).max()) * 1.05, 1e-6)
            ax.set_xlim(-lim, lim)
            ax.set_ylim(-lim, lim)
            ax.set_aspect("equal")
            ax.axhline(0, color="0.85", lw=0.6, zorder=0)
            ax.axvline(0, color="0.85", lw=0.6, zorder=0)
            ax.tick_params(labelsize=8)
            if row == 0:
                cos_rare = r["mean_cosine_groups"]["rare"]
                ax.set_title(f"{label}\nI(W) {r['isotropy']:.2f}   rare-group cos {cos_rare:.2f}",
                             fontsize=11, fontweight="bold" if label in ("mle", "agg") else None)
            ax.set_xlabel(f"{what}: singular dir. 1", fontsize=9)
            ax.set_ylabel("singular dir. 2", fontsize=9)
    for j in range(n, blocks * cols):
        for row in range(2):
            axes[2 * (j // cols) + row, j % cols].axis("off")
    handles = [plt.Line2D([], [], marker="o", ls="", color=GROUP_COLOURS[g], label=f"{g} ({lab})")
               for g, lab in zip(agg.GROUPS, ("top 30%", "middle 50%", "bottom 20%"))]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False, fontsize=10,
               title="frequency group, by training counts", title_fontsize=10)
    fig.suptitle(title, fontsize=12)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_spectrum(weights, colours, path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, W in weights.items():
        s = agg.singular_spectrum(W).numpy()
        ax.plot(range(1, len(s) + 1), s, marker="o", ms=3, label=label, color=colours[label],
                lw=2.2 if label in ("mle", "agg") else 1.2)
    ax.set_xlabel("index of singular value")
    ax.set_ylabel("singular value / largest")
    ax.set_title("Normalised singular values of W\n(a fast drop = one dominant direction = a cone)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(results, colours, vocab, path):
    """AGG Fig. 2 (group isotropy, rare-frequent cosine over steps) and Fig. 4 (rare-group size over steps)."""
    import matplotlib.pyplot as plt
    panels = [("isotropy", "I(W), all tokens", "higher = more isotropic"),
              ("isotropy_freq", "I(W), frequent group", None), ("isotropy_rare", "I(W), rare group", None),
              ("cos_rare", "mean cosine within the rare group", "near 1 = a narrow cone"),
              ("cos_rare_freq", "mean cosine rare vs frequent", None),
              ("rare_count", "size of the method's rare group", "tokens")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, ylabel) in zip(axes.flat, panels):
        for label, r in results.items():
            h = [s for s in r["history"] if s[key] is not None]
            if h:
                ax.plot([s["step"] for s in h], [s[key] for s in h], label=label, color=colours[label],
                        lw=2.2 if label in ("mle", "agg") else 1.2)
        if key == "rare_count":
            ax.axhline(len(results) and round(0.2 * vocab), color="tab:red", ls=":", lw=1,
                       label="bottom 20% (rare frequency group)")
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("training step")
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=9)
    fig.suptitle("Training dynamics of the tied embeddings (groups by training frequency: 30/50/20%)", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_alpha_sweep(sweep, reference, path):
    """AGG Appendix E: isotropy against the rare-group size; I(W) over training; the rare set's mass; PPL."""
    import matplotlib.pyplot as plt
    sweep = sorted(sweep, key=lambda r: r["rare_fraction"])
    x = [100 * r["rare_fraction"] for r in sweep]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    axes = axes.flat
    ax = axes[0]
    for key, lab, col in [("isotropy", "all tokens", "black"), ("freq", "frequent group", GROUP_COLOURS["freq"]),
                          ("rare", "rare group (bottom 20%)", GROUP_COLOURS["rare"])]:
        ys = [r[key] if key == "isotropy" else r["isotropy_groups"][key] for r in sweep]
        ax.plot(x, ys, marker="o", color=col, label=f"I(W), {lab}", lw=2.2 if key == "isotropy" else 1.2)
        if reference is not None:
            ref = reference[key] if key == "isotropy" else reference["isotropy_groups"][key]
            ax.axhline(ref, color=col, ls=":", lw=1.2)
    for r, xi in zip(sweep, x):
        ax.annotate(f"alpha {r['alpha']:g}", (xi, r["isotropy"]), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=8)
    ax.set_xlabel("AGG's rare group at the end of training (% of vocabulary)")
    ax.set_ylabel("I(W) at the end of training")
    ax.set_title("Isotropy vs AGG's rare-group size (dotted: MLE)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")

    ax = axes[1]
    cmap = plt.get_cmap("viridis")
    if reference is not None:
        h = reference["history"]
        ax.plot([s["step"] for s in h], [s["isotropy"] for s in h], color="black", ls=":", lw=1.5, label="MLE")
    for i, r in enumerate(sweep):
        h = r["history"]
        ax.plot([s["step"] for s in h], [s["isotropy"] for s in h], color=cmap(i / max(len(sweep) - 1, 1)),
                label=f"AGG alpha {r['alpha']:g} ({100 * r['rare_fraction']:.0f}% rare)")
    ax.set_xlabel("training step")
    ax.set_ylabel("I(W), all tokens")
    ax.set_title("Isotropy during training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    ax = axes[2]
    ax.plot(x, [r["rare_mass_pred"] for r in sweep], marker="s", color=GROUP_COLOURS["rare"],
            label="probability AGG predicts for its rare set")
    ax.plot(x, [r["rare_mass_true"] for r in sweep], marker="o", color="0.4", label="true frequency of that set")
    ax.plot(x, [r["R_over_B"] for r in sweep], ls="--", color=GROUP_COLOURS["rare"], lw=1,
            label="R / B (rare-set size / tokens per step)")
    ax.set_xlabel("AGG's rare group at the end of training (% of vocabulary)")
    ax.set_ylabel("probability mass (held-out)")
    ax.set_title("AGG over-predicts its rare set (towards R / B)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[3]
    ax.plot(x, [r["ppl"] for r in sweep], marker="o", color="black", lw=2, label="AGG")
    if reference is not None:
        ax.axhline(reference["ppl"], color="black", ls=":", lw=1.2, label="MLE")
    ax.set_xlabel("AGG's rare group at the end of training (% of vocabulary)")
    ax.set_ylabel("held-out PPL")
    ax.set_title("Held-out perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"AGG's alpha sweep after {sweep[0]['history'][-1]['step']} steps (AGG Appendix E)", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    data = make_data(args)
    t_data = time.perf_counter() - t_start
    runs = [(m, m, method_hparams(m, args)) for m in args.method_list]
    for a in args.sweep:
        runs.append((f"agg@{a:g}", "agg", {**method_hparams("agg", args), "alpha": a}))
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # the first optimizer imports torch._dynamo (seconds):
    results, weights = {}, {}                                # do it here, not inside the first method's wall time
    for label, name, hp in runs:
        same = [lab for lab, n, h in runs if lab in results and n == name and h == hp]
        if same:  # e.g. the sweep's alpha is the default one: reuse that run
            results[label], weights[label] = results[same[0]], weights[same[0]]
        else:
            results[label], weights[label] = train_one(label, name, hp, data, args)

    methods = {lab: results[lab] for lab in args.method_list}
    sweep = [{"alpha": hp["alpha"], **results[lab]} for lab, name, hp in runs[len(args.method_list):]]
    config = {k: v for k, v in vars(args).items() if k not in ("method_list", "sweep", "set", "overrides")}
    config.update(tokens_per_step=args.batch_seqs * args.seq_len, train_tokens=int(data["train"][:, 2:].numel()),
                  val_tokens=int(data["val"][:, 2:].numel()), oracle_ppl=data["oracle_ppl"],
                  unigram_ppl=data["unigram_ppl"], overrides=args.overrides, torch=torch.__version__,
                  group_sizes={g: len(i) for g, i in data["groups"].items()})
    metrics = {"methods": methods, "config": config}
    if sweep:
        metrics["alpha_sweep"] = sweep
    write_json(metrics, os.path.join(args.out, "metrics.json"))
    tmp = os.path.join(args.out, "embeddings.pt.tmp")
    torch.save(weights, tmp)  # the final W of every run, for your own analysis
    os.replace(tmp, os.path.join(args.out, "embeddings.pt"))

    print("\n" + table(results))
    print(f"\nheld-out PPL of the true process (the best possible): {data['oracle_ppl']:.1f}; "
          f"of a unigram model: {data['unigram_ppl']:.1f}. Groups: frequent 30% / medium 50% / rare 20% of the "
          f"vocabulary by training counts; R/B = the method's rare-set size / {args.batch_seqs * args.seq_len} "
          "tokens per step.")
    t_plots = time.perf_counter()
    if not args.no_plots:
        import matplotlib
        matplotlib.use("Agg")
        colours = method_colours(results)
        title = (f"Tied embeddings after {args.steps} steps (N = {args.vocab}, d = {args.dim}, seed {args.seed})\n"
                 "top: SVD projection of W; bottom: the same for W's unit rows (a cone = one tight spot)")
        main_w = {lab: weights[lab] for lab in methods}
        plot_svd(main_w, results, data["groups"], os.path.join(args.out, "svd.png"), title)
        plot_spectrum(main_w, colours, os.path.join(args.out, "spectrum.png"))
        plot_training(methods, colours, args.vocab, os.path.join(args.out, "training.png"))
        if sweep:
            sweep_labels = [lab for lab, _, _ in runs[len(args.method_list):]]
            plot_alpha_sweep(sweep, results.get("mle"), os.path.join(args.out, "alpha_sweep.png"))
            sweep_w = {lab: weights[lab] for lab in (["mle"] if "mle" in results else []) + sweep_labels}
            plot_svd(sweep_w, results, data["groups"], os.path.join(args.out, "svd_alpha_sweep.png"),
                     "AGG's embeddings as its rare group grows (alpha sweep)\n"
                     "top: SVD projection of W; bottom: the same for W's unit rows")
    t_end = time.perf_counter()
    print(f"\nwrote {args.out}/metrics.json{'' if args.no_plots else ' and PNGs'}: {t_end - t_start:.1f} s in all "
          f"(data {t_data:.1f} s, training + evaluation {t_plots - t_start - t_data:.1f} s, "
          f"plots {t_end - t_plots:.1f} s)")
    return metrics


if __name__ == "__main__":
    main()
