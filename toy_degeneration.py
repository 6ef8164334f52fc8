"""
Watch tied token embeddings degenerate into a cone under MLE, and AGG cure it, on a CPU in seconds.

    python toy_degeneration.py                          # MLE vs AGG -> out/toy/, ~20 s on 2 cores
    python toy_degeneration.py --methods mle,agg,agg-no-g1,agps,freeze-rare,freeze-b,cosreg,frage,ul,ul+agg
    python toy_degeneration.py --alpha-sweep 0.2,0.4,0.8,1.6 --steps 600   # too large a rare group hurts (AGG App. E)

alpha is in AGG's own unit (Eq. 5): appearances per optimizer step. At the default 4096 tokens per step, alpha 0.2 /
0.4 / 0.8 / 1.6 make ~5% / ~26% / ~55% / ~75% of the vocabulary rare; 0.1 and below catch (almost) nothing.
Outputs in --out: metrics.json, embeddings.pt (every run's final W), svd.png (AGG Fig. 1/3), spectrum.png (Gao et al.
Fig. 2b), training.png (AGG Fig. 2 and 4); with --alpha-sweep also alpha_sweep.png and svd_alpha_sweep.png.
"""
import argparse
import json
import math
import os
import time

import matplotlib.pyplot as plt
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
    p.add_argument("--alpha-sweep", default="", help="AGG alphas to run besides --methods, e.g. 0.2,0.4,0.8,1.6")
    p.add_argument("--seed", type=int, default=0, help="seeds the language, the corpora and the model init")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per method")
    p.add_argument("--out", default="out/toy", help="folder for metrics.json and the plots")
    # the language
    p.add_argument("--vocab", type=int, default=2000, help="vocabulary size N")
    p.add_argument("--zipf", type=float, default=1.1, help="exponent of the Zipf prior p_k ~ k^-zipf")
    p.add_argument("--rank", type=int, default=16, help="dimension of the hidden true token vectors")
    p.add_argument("--beta", type=float, default=20.0, help="strength of the context . true-vector term")
    p.add_argument("--lam", type=float, default=0.7, help="weight of the x_-1 transition table in the mixture")
    p.add_argument("--epoch-steps", type=int, default=100, help="steps per epoch (the corpus size); AGG's window K")
    p.add_argument("--val-tokens", type=int, default=32768, help="held-out tokens for perplexity")
    # the model and its training
    p.add_argument("--dim", type=int, default=32, help="embedding size d")
    p.add_argument("--init-std", type=float, default=0.02, help="std of the embedding init")
    p.add_argument("--seq-len", type=int, default=64, help="targets per sequence")
    p.add_argument("--batch-seqs", type=int, default=64, help="sequences per step (tokens per step = this x seq-len)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--alpha", type=float, default=0.4, help="AGG Eq. 5: rare if a_k/K < alpha (agg, agg-*, ul+agg)")
    p.add_argument("--log-every", type=int, default=5, help="steps between geometry snapshots for training.png")
    p.add_argument("--threads", type=int, default=0, help="torch threads, 0: torch's default (1 on a busy machine)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (metrics.json and the table only)")
    agg.add_method_flags(p.add_argument_group("the other method hyper-parameters (as train_lm.py's flags)"),
                            skip=("alpha",))
    args = p.parse_args(argv)
    # check the inputs argparse cannot: method names, the sweep's alphas, the method flags' methods, the counts
    args.method_list = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    bad = [m for m in args.method_list if m not in agg.METHODS]
    if bad or not args.method_list:
        p.error(f"--methods: unknown {bad or 'empty list'}; valid: {','.join(agg.METHODS)}")
    try:
        args.sweep = [float(a) for a in args.alpha_sweep.split(",") if a.strip()]
    except ValueError:
        args.sweep = [0.0]
    if any(a <= 0 for a in args.sweep):
        p.error(f"--alpha-sweep must be comma-separated numbers > 0, got {args.alpha_sweep!r}")
    args.overrides = {k: getattr(args, k) for k in agg.HPARAMS if k != "alpha" and getattr(args, k) is not None}
    for key in [k for k in args.overrides if not any(k in agg.METHODS[m].defaults for m in args.method_list)]:
        p.error(f"{agg.method_flag(key)} applies to none of --methods {','.join(args.method_list)}")
    for m in args.method_list:  # agg.py checks each method's hyper-parameters, before any training
        try:
            counts = torch.ones(args.vocab)
            agg.build_method(m, args.vocab, counts=counts, steps_per_epoch=1, **method_hparams(m, args))
        except ValueError as e:
            p.error(str(e))
    for flag in ("steps", "epoch_steps", "vocab", "dim", "seq_len", "batch_seqs", "log_every", "val_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


# ----------------------------------------------------------------------------------------------- the synthetic language
def make_language(vocab, zipf, rank, beta, lam, gen):
    """A Zipfian vocabulary (unigram prior p_k ~ k^-zipf) with structure to learn: every token k has a hidden "true"
    vector u_k, and the next token after (x_-2, x_-1) is drawn from the mixture
      p(k | x_-2, x_-1) = lam * T1[x_-1, k] + (1 - lam) * T2[x_-2, k],  Tj[i, k] ~ prior_k * exp(beta * (A_j u_i) . u_k)
    i.e. softmax(context . true vectors) tilted by the Zipf prior, so rare tokens are rare the way they are in text."""
    prior = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
    prior /= prior.sum()
    u = F.normalize(torch.randn(vocab, rank, generator=gen, dtype=torch.float64), dim=1)
    cdfs = []
    for _ in range(2):
        a = torch.linalg.qr(torch.randn(rank, rank, generator=gen, dtype=torch.float64))[0]  # a random rotation
        logits = prior.log()[None, :] + beta * (u @ a.T) @ u.T  # row i: next-token logits after token i
        cdfs.append(torch.softmax(logits, dim=1).cumsum(1).clamp(max=1.0))
    # one flat CDF, row r of table j at row j * vocab + r, shifted into [r, r + 1]: sampling is one searchsorted
    cdf = torch.cat(cdfs) + torch.arange(2 * vocab, dtype=torch.float64)[:, None]
    return {"prior": prior, "cdf": cdf.reshape(-1), "lam": lam, "vocab": vocab}


def sample_corpus(lang, n_seqs, seq_len, gen):
    """(n_seqs, seq_len + 2) token ids: two prior-drawn context tokens, then seq_len tokens of the Markov chain."""
    V = lang["vocab"]
    x = torch.empty(n_seqs, seq_len + 2, dtype=torch.long)
    x[:, :2] = torch.multinomial(lang["prior"], 2 * n_seqs, replacement=True, generator=gen).view(n_seqs, 2)
    for t in range(2, seq_len + 2):
        use1 = torch.rand(n_seqs, generator=gen, dtype=torch.float64) < lang["lam"]  # table 1 after x_-1, else 2
        rows = torch.where(use1, x[:, t - 1], V + x[:, t - 2])  # flat-CDF row of position t
        u = torch.rand(n_seqs, generator=gen, dtype=torch.float64) + rows
        x[:, t] = (torch.searchsorted(lang["cdf"], u) - rows * V).clamp(0, V - 1)
    return x


def true_nll(lang, x):
    """Mean -log p(x_t | x_-2, x_-1) under the true process: the best any model can do (its exp: the oracle PPL)."""
    V, cdf, y = lang["vocab"], lang["cdf"], x[:, 2:].reshape(-1)
    p = 0
    for rows, weight in ((x[:, 1:-1].reshape(-1), lang["lam"]), (V + x[:, :-2].reshape(-1), 1 - lang["lam"])):
        at = rows * V + y  # T1 after x_-1, T2 after x_-2; p(y) on row r: CDF(y) - CDF(y - 1), where CDF(-1) = r
        p = p + weight * (cdf[at] - torch.where(y > 0, cdf[(at - 1).clamp(min=0)], rows.double()))
    return float(-p.clamp(min=1e-300).log().mean())


def make_data(args):
    """The language, its training corpus (one epoch) and held-out corpus, the training counts and frequency groups."""
    gen = torch.Generator().manual_seed(args.seed)
    lang = make_language(args.vocab, args.zipf, args.rank, args.beta, args.lam, gen)
    train = sample_corpus(lang, args.epoch_steps * args.batch_seqs, args.seq_len, gen)
    val = sample_corpus(lang, max(1, args.val_tokens // args.seq_len), args.seq_len, gen)
    counts = torch.bincount(train[:, 2:].reshape(-1), minlength=args.vocab)
    groups = agg.frequency_groups(counts)  # AGG Sec. 3.1: frequent 30%, medium 50%, rare 20% by training counts
    unigram = (counts.double() + 1) / (counts.sum() + args.vocab)  # add-one unigram model of the training split
    return {"train": train, "val": val, "counts": counts, "groups": dict(zip(agg.GROUPS, groups)),
            "group_of": agg.group_of(groups, args.vocab), "oracle_ppl": math.exp(true_nll(lang, val)),
            "unigram_ppl": math.exp(float(-unigram[val[:, 2:]].log().mean()))}


# ------------------------------------------------------------------------------------------------------------ the model
class ToyLM(nn.Module):
    """h = LN(MLP([W[x_-2], W[x_-1]]) + W[x_-1]), logits = h @ W.T: the ingredients of the theory (Gao et al. 2019
    Sec. 4), tied input/output embeddings W and a LayerNorm right before the softmax layer."""

    def __init__(self, vocab, dim, init_std=0.02):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)  # W: the input embedding AND the softmax weight (tied)
        nn.init.normal_(self.emb.weight, std=init_std)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln = nn.LayerNorm(dim)

    def forward(self, x2, x1):
        e2, e1 = self.emb(x2), self.emb(x1)
        return self.ln(self.mlp(torch.cat([e2, e1], dim=-1)) + e1)


# ---------------------------------------------------------------------------------------------- training and evaluation
def snapshot(step, W, groups, method):
    """The geometry over training (AGG Fig. 2) and the size of the rare group (AGG Fig. 4)."""
    freq, rare, mask = W[groups["freq"]], W[groups["rare"]], method.rare_mask()
    return {"step": step, "isotropy": agg.isotropy(W), "isotropy_freq": agg.isotropy(freq),
            "isotropy_rare": agg.isotropy(rare), "cos_rare": agg.mean_cosine(rare),
            "cos_rare_freq": agg.mean_cosine_between(rare, freq),
            "rare_count": None if mask is None else int(mask.sum())}


def method_hparams(name, args):
    """Toy-scale hyper-parameters over agg.build_method's defaults: AGG's alpha, agg-static's switch within the run."""
    hp = {"alpha": args.alpha} if agg.agg_family(name) else {}
    if agg.METHODS[name].defaults.get("static_after") is not None:
        hp["static_after"] = min(args.epoch_steps, max(1, args.steps // 2))
    return {**hp, **{k: v for k, v in args.overrides.items() if k in agg.METHODS[name].defaults}}


def train_one(label, name, hparams, data, args):
    """Train a fresh ToyLM (same init for every method) with agg method `name`; return its metrics and history."""
    torch.manual_seed(args.seed + 1)
    model = ToyLM(args.vocab, args.dim, args.init_std)
    method = agg.build_method(name, vocab_size=args.vocab, counts=data["counts"], steps_per_epoch=args.epoch_steps,
                              **hparams)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    W, train, groups = model.emb.weight, data["train"], data["groups"]
    order_gen = torch.Generator().manual_seed(args.seed + 2)  # same batch order for every method
    history, t0 = [], time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"{label:>14}", dynamic_ncols=True)  # on stderr
    for step in bar:
        if step % args.epoch_steps == 0:  # each epoch: a fresh order of the training set (epoch_steps batches)
            batches = torch.randperm(len(train), generator=order_gen).view(args.epoch_steps, args.batch_seqs)
        x = train[batches[step % args.epoch_steps]]
        y = x[:, 2:]
        method.observe(y)  # once per optimizer step, all targets of the step
        loss = method.loss(model(x[:, :-2], x[:, 1:-1]), W, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        method.after_step(W)
        if step % args.log_every == 0 or step == args.steps - 1:  # once in a while: the geometry
            history.append(snapshot(step + 1, W.detach(), groups, method))
            bar.set_postfix(nll=f"{method.stats['nll']:.3f}", IW=f"{history[-1]['isotropy']:.2f}", refresh=False)
    train_seconds = time.perf_counter() - t0
    result = {**agg.geometry(W, groups, data["counts"] > 0), **evaluate(model, method, data),
              "seconds": time.perf_counter() - t0, "train_seconds": train_seconds}  # wall time: training + evaluation
    rare = method.rare_mask()  # the method's rare set at the end (None: it has none)
    n_rare = None if rare is None else int(rare.sum())
    result.update(method=name, hparams=hparams, rare_count=n_rare,
                  rare_fraction=None if rare is None else float(rare.float().mean()),
                  R_over_B=None if rare is None else n_rare / (args.batch_seqs * args.seq_len), history=history)
    return result, W.detach().clone()


@torch.no_grad()
def evaluate(model, method, data, chunk_seqs=128):
    """Held-out PPL, total and per frequency group; Uniq; the rare set's predicted vs true probability mass."""
    val, W, nll, preds, masses = data["val"], model.emb.weight, [], [], []
    for s in range(0, len(val), chunk_seqs):
        x = val[s:s + chunk_seqs]
        h, y = model(x[:, :-2], x[:, 1:-1]), x[:, 2:]
        logits = h.reshape(-1, h.shape[-1]) @ W.T
        nll.append(F.cross_entropy(logits, y.reshape(-1), reduction="none"))
        preds.append(logits.argmax(1))
        if method.rare_mask() is not None:  # the method's own group: its stats carry the masses
            method.loss(h, W, y)
            masses.append([method.stats[k] * y.numel() for k in ("rare_mass_pred", "rare_mass_true")])
    nll, tgt_group = torch.cat(nll).double(), data["group_of"][val[:, 2:].reshape(-1)]
    out = {"ppl": math.exp(float(nll.mean())),
           "ppl_groups": {g: math.exp(float(nll[tgt_group == i].mean())) if bool((tgt_group == i).any()) else None
                          for i, g in enumerate(agg.GROUPS)},  # None: no held-out target in that group
           "uniq": int(torch.cat(preds).unique().numel())}
    if masses:  # means per held-out token
        out.update(zip(("rare_mass_pred", "rare_mass_true"), (sum(m) / len(nll) for m in zip(*masses))))
    return out


# ------------------------------------------------------------------------------------------------------------ reporting
def table(results):
    """A Markdown table (pastes into the README as is)."""
    head = ("| method | I(W) | I(W) freq/med/rare | mean cos | cos freq/med/rare | PPL | PPL freq/med/rare "
            "| Uniq | rare set (R/B) | rare mass pred/true | s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for label, r in results.items():
        ig, cg, pg = ("/".join("-" if r[k][g] is None else f"{r[k][g]:{fmt}}" for g in agg.GROUPS)  # freq/med/rare
                      for k, fmt in [("isotropy_groups", ".2f"), ("mean_cosine_groups", ".2f"), ("ppl_groups", ".0f")])
        rare = "-" if r["rare_count"] is None else f"{r['rare_count']} ({r['R_over_B']:.3f})"
        mass = "-" if "rare_mass_pred" not in r else f"{r['rare_mass_pred']:.4f}/{r['rare_mass_true']:.4f}"
        lines.append(f"| {label} | {r['isotropy']:.3f} | {ig} | {r['mean_cosine']:.3f} | {cg} | {r['ppl']:.1f} | {pg} "
                     f"| {r['uniq']} | {rare} | {mass} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def style(ax, title, xlabel, ylabel=None, legend=8, **legend_kw):
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=legend, **legend_kw)


def save(fig, path, title=None, tight=True):
    if title:
        fig.suptitle(title, fontsize=12)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_svd(weights, results, groups, path, title):
    """Per run, two panels: the embeddings projected on their top-2 singular directions (AGG Fig. 1/3), and the
    same for the unit-normalised rows, where a cone (all rare rows pointing one way) becomes one tight spot."""
    n = len(weights)
    cols = n if n <= 5 else math.ceil(n / math.ceil(n / 4))  # at most 5 columns, blocks as full as possible
    blocks = math.ceil(n / cols)
    fig, axes = plt.subplots(2 * blocks, cols, figsize=(4.3 * cols, 8.4 * blocks + 1.3), squeeze=False,
                             layout="constrained")
    for i, (label, W) in enumerate(weights.items()):
        W, iw, cos = W.double(), results[label]["isotropy"], results[label]["mean_cosine_groups"]["rare"]
        # the top two right singular vectors of the (uncentred) W, signed so that the mean row projects positively
        vh = torch.linalg.svd(W, full_matrices=False)[2][:2]
        basis = vh * torch.sign(W.mean(0) @ vh.T).clamp(min=0).mul(2).sub(1)[:, None]
        for row, (Wp, what) in enumerate([(W, "embeddings"), (F.normalize(W, dim=1), "directions (unit rows)")]):
            ax = axes[2 * (i // cols) + row, i % cols]
            xy = (Wp @ basis.T).numpy()
            for g in agg.GROUPS:  # rare last: on top
                ax.scatter(*xy[groups[g].numpy()].T, s=4, alpha=0.55, color=GROUP_COLOURS[g], linewidths=0)
            lim = 1.05 if row == 1 else max(float(abs(xy).max()) * 1.05, 1e-6)
            ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal")
            ax.axhline(0, color="0.85", lw=0.6, zorder=0)
            ax.axvline(0, color="0.85", lw=0.6, zorder=0)
            ax.tick_params(labelsize=8)
            if row == 0:
                ax.set_title(f"{label}\nI(W) {iw:.2f}   rare-group cos {cos:.2f}",
                             fontsize=11, fontweight="bold" if label in ("mle", "agg") else None)
            ax.set_xlabel(f"{what}: singular dir. 1", fontsize=9)
            ax.set_ylabel("singular dir. 2", fontsize=9)
    for ax in axes[-2:, n - (blocks - 1) * cols:].flat:  # the empty slots of the last block
        ax.axis("off")
    handles = [plt.Line2D([], [], marker="o", ls="", color=GROUP_COLOURS[g], label=f"{g} ({lab})")
               for g, lab in zip(agg.GROUPS, ("top 30%", "middle 50%", "bottom 20%"))]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False, fontsize=10,
               title="frequency group, by training counts", title_fontsize=10)
    save(fig, path, title, tight=False)


def plot_spectrum(weights, styles, path):
    """Gao et al. Fig. 2b: the normalised singular values of each run's W."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, W in weights.items():
        s = agg.singular_spectrum(W).numpy()
        ax.plot(range(1, len(s) + 1), s, marker="o", ms=3, label=label, **styles[label])
    ax.set_ylim(0, 1.05)
    style(ax, "Normalised singular values of W\n(a fast drop = one dominant direction = a cone)",
          "index of singular value", "singular value / largest", legend=9)
    save(fig, path)


def plot_training(results, styles, vocab, path):
    """AGG Fig. 2 (group isotropy, rare-frequent cosine over steps) and Fig. 4 (rare-group size over steps)."""
    panels = [("isotropy", "I(W), all tokens", "higher = more isotropic"),
              ("isotropy_freq", "I(W), frequent group", None), ("isotropy_rare", "I(W), rare group", None),
              ("cos_rare", "mean cosine within the rare group", "near 1 = a narrow cone"),
              ("cos_rare_freq", "mean cosine rare vs frequent", None),
              ("rare_count", "size of the method's rare group", "tokens")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, ylabel) in zip(axes.flat, panels):
        for label, r in results.items():
            h = [s for s in r["history"] if s[key] is not None]  # rare_count: None for a method without a rare set
            if h:
                ax.plot([s["step"] for s in h], [s[key] for s in h], label=label, **styles[label])
        if key == "rare_count":
            ax.axhline(round(0.2 * vocab), color="tab:red", ls=":", lw=1, label="bottom 20% (rare frequency group)")
        style(ax, title, "training step", ylabel, legend={"isotropy": 9, "rare_count": 8}.get(key, 0))
    save(fig, path, "Training dynamics of the tied embeddings (groups by training frequency: 30/50/20%)")


def plot_alpha_sweep(sweep, reference, path):
    """AGG Appendix E, four panels: final I(W) against the size of AGG's rare set; I(W) over training; the probability
    AGG gives its rare set against that set's true frequency; held-out PPL. reference: the MLE run (dotted), or None."""
    sweep = sorted(sweep, key=lambda r: r["rare_fraction"])
    x = [100 * r["rare_fraction"] for r in sweep]
    x_label = "AGG's rare group at the end of training (% of vocabulary)"
    fig, ((ax0, ax1), (ax2, ax3)) = plt.subplots(2, 2, figsize=(13, 9.5))
    for key, lab, col in [("isotropy", "all tokens", "black"), ("freq", "frequent group", GROUP_COLOURS["freq"]),
                          ("rare", "rare group (bottom 20%)", GROUP_COLOURS["rare"])]:
        iso = lambda r: r[key] if key == "isotropy" else r["isotropy_groups"][key]  # noqa: E731
        ax0.plot(x, [iso(r) for r in sweep], marker="o", color=col, label=f"I(W), {lab}",
                 lw=2.2 if key == "isotropy" else 1.2)
        if reference is not None:
            ax0.axhline(iso(reference), color=col, ls=":", lw=1.2)
    for r, xi in zip(sweep, x):
        ax0.annotate(f"alpha {r['alpha']:g}", (xi, r["isotropy"]), textcoords="offset points", xytext=(0, 8),
                     ha="center", fontsize=8)
    ax0.set_ylim(0, 1.05)
    style(ax0, "Isotropy vs AGG's rare-group size (dotted: MLE)", x_label, "I(W) at the end of training",
          loc="lower left")
    steps = lambda r: ([s["step"] for s in r["history"]], [s["isotropy"] for s in r["history"]])  # noqa: E731
    if reference is not None:
        ax1.plot(*steps(reference), color="black", ls=":", lw=1.5, label="MLE")
    for i, r in enumerate(sweep):
        ax1.plot(*steps(r), color=plt.get_cmap("viridis")(i / max(len(sweep) - 1, 1)),
                 label=f"AGG alpha {r['alpha']:g} ({100 * r['rare_fraction']:.0f}% rare)")
    style(ax1, "Isotropy during training", "training step", "I(W), all tokens")
    ax2.plot(x, [r["rare_mass_pred"] for r in sweep], marker="s", color=GROUP_COLOURS["rare"],
             label="probability AGG predicts for its rare set")
    ax2.plot(x, [r["rare_mass_true"] for r in sweep], marker="o", color="0.4", label="true frequency of that set")
    ax2.plot(x, [r["R_over_B"] for r in sweep], ls="--", color=GROUP_COLOURS["rare"], lw=1,
             label="R / B (rare-set size / tokens per step)")
    style(ax2, "AGG over-predicts its rare set (towards R / B)", x_label, "probability mass (held-out)",
          loc="upper left")
    ax3.plot(x, [r["ppl"] for r in sweep], marker="o", color="black", lw=2, label="AGG")
    if reference is not None:
        ax3.axhline(reference["ppl"], color="black", ls=":", lw=1.2, label="MLE")
    style(ax3, "Held-out perplexity", x_label, "held-out PPL")
    save(fig, path, f"AGG's alpha sweep after {sweep[0]['history'][-1]['step']} steps (AGG Appendix E)")


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t0, data = time.perf_counter(), make_data(args)
    # the runs (label, method, hyper-parameters): each of --methods, then AGG at each alpha of --alpha-sweep
    runs = [(m, m, method_hparams(m, args)) for m in args.method_list]
    sweep_runs = [(f"agg@{a:g}", "agg", {**method_hparams("agg", args), "alpha": a}) for a in args.sweep]
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # the first optimizer imports torch._dynamo (seconds):
    results, weights = {}, {}                                # do it here, not inside the first method's wall time
    for label, name, hp in runs + sweep_runs:  # a run identical to an earlier one (the sweep's default alpha): reused
        same = [lab for lab, n, h in runs + sweep_runs if lab in results and (n, h) == (name, hp)]
        run = (results[same[0]], weights[same[0]]) if same else train_one(label, name, hp, data, args)
        results[label], weights[label] = run

    # metrics.json: every run and the configuration; embeddings.pt: the final W of every run, for your own analysis
    methods = {lab: results[lab] for lab in args.method_list}
    sweep = [{"alpha": hp["alpha"], **results[lab]} for lab, _, hp in sweep_runs]
    config = {k: v for k, v in vars(args).items() if k not in ("method_list", "sweep", "overrides") and v is not None}
    config.update(tokens_per_step=args.batch_seqs * args.seq_len, train_tokens=int(data["train"][:, 2:].numel()),
                  val_tokens=int(data["val"][:, 2:].numel()), oracle_ppl=data["oracle_ppl"],
                  unigram_ppl=data["unigram_ppl"], torch=torch.__version__,
                  group_sizes={g: len(i) for g, i in data["groups"].items()})
    metrics = {"methods": methods, "config": config, **({"alpha_sweep": sweep} if sweep else {})}
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    torch.save(weights, os.path.join(args.out, "embeddings.pt"))

    print("\n" + table(results))
    print(f"\nheld-out PPL of the true process (the best possible): {data['oracle_ppl']:.1f}; of a unigram model: "
          f"{data['unigram_ppl']:.1f}. Groups: frequent 30% / medium 50% / rare 20% of the vocabulary by training "
          f"counts; R/B = the method's rare-set size / {args.batch_seqs * args.seq_len} tokens per step.")
    if not args.no_plots:
        plt.switch_backend("Agg")
        styles = {lab: dict(color=f"C{i}", lw=2.2 if lab in ("mle", "agg") else 1.2)  # one per run, in every plot
                  for i, lab in enumerate(results)}
        main_w, out = {lab: weights[lab] for lab in methods}, args.out
        svd_title = "top: SVD projection of W; bottom: the same for W's unit rows"
        plot_svd(main_w, results, data["groups"], f"{out}/svd.png", f"Tied embeddings after {args.steps} steps "
                 f"(N = {args.vocab}, d = {args.dim}, seed {args.seed})\n{svd_title} (a cone = one tight spot)")
        plot_spectrum(main_w, styles, f"{out}/spectrum.png")
        plot_training(methods, styles, args.vocab, f"{out}/training.png")
        if sweep:
            plot_alpha_sweep(sweep, results.get("mle"), f"{out}/alpha_sweep.png")
            sweep_w = {lab: weights[lab] for lab in (["mle"] if "mle" in results else []) + [r[0] for r in sweep_runs]}
            plot_svd(sweep_w, results, data["groups"], f"{out}/svd_alpha_sweep.png",
                     f"AGG's embeddings as its rare group grows (alpha sweep)\n{svd_title}")
    print(f"\nwrote {args.out}/metrics.json{'' if args.no_plots else ' and PNGs'} in {time.perf_counter() - t0:.1f} s")
    return metrics


if __name__ == "__main__":
    main()
