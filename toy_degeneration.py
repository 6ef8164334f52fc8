r"""
Watch tied token embeddings degenerate into a cone under MLE, and AGG cure it, on a CPU in seconds.

    python toy_degeneration.py       # MLE vs AGG -> out/toy/, ~20 s on 2 cores
    python toy_degeneration.py --methods \
        mle,agg,agg-no-g1,agps,freeze-rare,freeze-b,cosreg,frage,ul,ul+agg
    python toy_degeneration.py --alpha-sweep 0.2,0.4,0.8,1.6 --steps 600
                                     # too large a rare group hurts (AGG App. E)

The lesson, in the order of this file: a synthetic language with a Zipfian vocabulary (rare tokens
are rare the way they are in text); a tiny language model whose input embedding is also its
softmax weight (tied); training with each method of agg.py; the geometry of the embeddings after
training. Under MLE the rare tokens' rows drift together into one narrow cone (Gao et al. 2019);
AGG gates the gradient that pushes them there (AGG Eq. 5, 7-8) and they spread out again.

alpha is in AGG's own unit (Eq. 5): appearances per optimizer step. At the default 4096 tokens per
step, alpha 0.2 / 0.4 / 0.8 / 1.6 make ~5% / ~26% / ~55% / ~75% of the vocabulary rare; 0.1 and
below catch (almost) nothing.

Outputs in --out: metrics.json, embeddings.pt (every run's final W), svd.png (AGG Fig. 1/3),
spectrum.png (Gao et al. Fig. 2b), training.png (AGG Fig. 2 and 4, every run: with --alpha-sweep,
I(W) and the rare group's size at each alpha); with --alpha-sweep also svd_alpha_sweep.png.
"""

import argparse
import functools
import json
import math
import os
import sys
import time

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import agg

GROUP_COLOURS = {"freq": "tab:blue", "med": "tab:green", "rare": "tab:red"}


def build_parser():
    description = __doc__.split("\n\n")[0].strip()
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(description=description, formatter_class=formatter)
    methods = ",".join(agg.METHODS)
    p.add_argument("--methods", default="mle,agg", help=f"comma-separated, any of: {methods}")
    p.add_argument(
        "--alpha-sweep",
        default="",
        help="AGG alphas to run besides --methods, e.g. 0.2,0.4,0.8,1.6",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the language, the corpora and the model init"
    )
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per method")
    p.add_argument("--out", default="out/toy", help="folder for metrics.json and the plots")
    # the language
    p.add_argument("--vocab", type=int, default=2000, help="vocabulary size N")
    p.add_argument(
        "--zipf", type=float, default=1.1, help="exponent of the Zipf prior p_k ~ k^-zipf"
    )
    p.add_argument(
        "--rank", type=int, default=16, help="dimension of the hidden true token vectors"
    )
    p.add_argument(
        "--beta", type=float, default=20.0, help="strength of the context . true-vector term"
    )
    p.add_argument(
        "--lam", type=float, default=0.7, help="weight of the x_-1 transition table in the mixture"
    )
    p.add_argument(
        "--epoch-steps",
        type=int,
        default=100,
        help="steps per epoch (the corpus size); AGG's window K",
    )
    p.add_argument("--val-tokens", type=int, default=32768, help="held-out tokens for perplexity")
    # the model and its training
    p.add_argument("--dim", type=int, default=32, help="embedding size d")
    p.add_argument("--init-std", type=float, default=0.02, help="std of the embedding init")
    p.add_argument("--seq-len", type=int, default=64, help="targets per sequence")
    p.add_argument(
        "--batch-seqs",
        type=int,
        default=64,
        help="sequences per step (tokens per step = this x seq-len)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument(
        "--alpha",
        type=float,
        default=0.4,
        help="AGG Eq. 5: rare if a_k/K < alpha (agg, agg-*, ul+agg)",
    )
    p.add_argument(
        "--log-every", type=int, default=5, help="steps between geometry snapshots for training.png"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads, 0: torch's default (1 on a busy machine)",
    )
    p.add_argument(
        "--no-plots", action="store_true", help="skip the PNGs (metrics.json and the table only)"
    )
    # --window, --gamma, ...: the flags of agg.py's methods, as train_lm.py has them
    group = p.add_argument_group("the other method hyper-parameters (as train_lm.py's flags)")
    agg.add_method_flags(group, skip=("alpha",))
    return p


def parse_args(argv=None):
    """The command line, checked where argparse cannot: the counts and numbers, the method names,
    the method flags' methods, every run's hyper-parameters (agg.py's checks); args.runs: the runs
    to train."""
    p = build_parser()
    args = p.parse_args(argv)
    ranges = {"vocab": (4, None)}  # a token in each frequency group
    sizes = ("steps", "epoch_steps", "dim", "seq_len", "batch_seqs", "log_every", "val_tokens")
    for flag in sizes + ("rank",):
        ranges[flag] = (1, None)
    ranges.update(zipf=(0, None), init_std=(0, None), lam=(0, 1))
    ranges["lr"] = (0, torch.finfo().max)  # Adam's steps are float32
    ranges["beta"] = (-sys.float_info.max, None)
    ranges["seed"] = (-(2**63), 2**63 - 3)  # torch's range; the corpora and init use seed + 2
    ranges["threads"] = (0, os.cpu_count())
    for flag, (lo, hi) in ranges.items():
        value = getattr(args, flag)
        below_top = value < math.inf if hi is None else value <= hi
        if not (lo <= value and below_top):  # NaN fails
            bound = f">= {lo} and finite" if hi is None else f"in [{lo}, {hi}]"
            p.error(f"--{flag.replace('_', '-')} {value}: must be {bound}")
    # --methods: each name once, in the order given
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.method_list = list(dict.fromkeys(names))
    unknown = [m for m in args.method_list if m not in agg.METHODS]
    if unknown or not args.method_list:
        valid = ",".join(agg.METHODS)
        p.error(f"--methods: unknown {unknown or 'empty list'}; valid: {valid}")
    # --alpha-sweep: numbers (agg.py checks them below, as AGG's alpha)
    try:
        sweep = [float(a) for a in args.alpha_sweep.split(",") if a.strip()]
    except ValueError:
        p.error(f"--alpha-sweep must be comma-separated numbers, got {args.alpha_sweep!r}")
    # the method flags given, each used by one of --methods at least
    for key in agg.HPARAMS:
        users = [m for m in args.method_list if key in agg.METHODS[m].defaults]
        if key != "alpha" and getattr(args, key) is not None and not users:
            methods = ",".join(args.method_list)
            p.error(f"{agg.method_flag(key)} applies to none of --methods {methods}")
    # the runs (label, method, hyper-parameters): --methods, then AGG at each swept alpha
    args.runs = [(m, m, method_hparams(m, args)) for m in args.method_list]
    for alpha in sweep:
        hp = method_hparams("agg", args)
        hp["alpha"] = alpha
        args.runs.append((f"agg@{alpha:g}", "agg", hp))
    # agg.py checks each run's hyper-parameters, before any training
    counts = torch.ones(args.vocab)
    for _label, name, hp in args.runs:
        try:
            agg.build_method(name, args.vocab, counts=counts, steps_per_epoch=1, **hp)
        except ValueError as e:
            p.error(str(e))
    return args


# ------------------------------------------------------------------------- the synthetic language
def make_language(vocab, zipf, rank, beta, lam, gen):
    """A Zipfian vocabulary (unigram prior p_k ~ k^-zipf) with structure to learn: every token k
    has a hidden "true" vector u_k, and the next token after (x_-2, x_-1) is drawn from the mixture
      p(k | x_-2, x_-1) = lam * T1[x_-1, k] + (1 - lam) * T2[x_-2, k],
      Tj[i, k] ~ prior_k * exp(beta * (A_j u_i) . u_k)
    i.e. softmax(context . true vectors) tilted by the Zipf prior, so rare tokens are rare the way
    they are in text."""
    prior = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
    prior /= prior.sum()
    u = torch.randn(vocab, rank, generator=gen, dtype=torch.float64)
    u = F.normalize(u, dim=1)  # the true vectors, unit length
    cdfs = []
    for _ in range(2):  # the tables T1 and T2
        noise = torch.randn(rank, rank, generator=gen, dtype=torch.float64)
        a = torch.linalg.qr(noise)[0]  # a random rotation A_j
        context = beta * (u @ a.T)  # beta * A_j u_i, one row a token i
        logits = prior.log()[None, :] + context @ u.T  # row i: next-token logits after token i
        probs = torch.softmax(logits, dim=1)
        cdfs.append(probs.cumsum(1).clamp(max=1.0))
    # both tables as one flat CDF, row r shifted into [r, r + 1]: a draw is one searchsorted
    shift = torch.arange(2 * vocab, dtype=torch.float64)[:, None]
    cdf = torch.cat(cdfs) + shift
    return {"prior": prior, "cdf": cdf.reshape(-1), "lam": lam, "vocab": vocab}


def sample_corpus(lang, n_seqs, seq_len, gen):
    """(n_seqs, seq_len + 2) token ids: two prior-drawn context tokens, then seq_len tokens of the
    Markov chain."""
    V = lang["vocab"]
    x = torch.empty(n_seqs, seq_len + 2, dtype=torch.long)
    starts = torch.multinomial(lang["prior"], 2 * n_seqs, replacement=True, generator=gen)
    x[:, :2] = starts.view(n_seqs, 2)
    for t in range(2, seq_len + 2):
        # pick the table: T1 after x_-1 with probability lam, else T2 after x_-2
        coin = torch.rand(n_seqs, generator=gen, dtype=torch.float64)
        use1 = coin < lang["lam"]
        rows = torch.where(use1, x[:, t - 1], V + x[:, t - 2])  # the flat-CDF row of position t
        # draw from that row: a uniform number in [r, r + 1], looked up in the flat CDF
        draw = torch.rand(n_seqs, generator=gen, dtype=torch.float64)
        u = draw + rows
        token = torch.searchsorted(lang["cdf"], u) - rows * V
        x[:, t] = token.clamp(0, V - 1)
    return x


def make_data(args):
    """The language, its training corpus (one epoch) and held-out corpus, the training counts and
    frequency groups."""
    gen = torch.Generator().manual_seed(args.seed)
    lang = make_language(args.vocab, args.zipf, args.rank, args.beta, args.lam, gen)
    n_train = args.epoch_steps * args.batch_seqs
    train = sample_corpus(lang, n_train, args.seq_len, gen)
    n_val = max(1, args.val_tokens // args.seq_len)
    val = sample_corpus(lang, n_val, args.seq_len, gen)
    targets = train[:, 2:].reshape(-1)
    counts = torch.bincount(targets, minlength=args.vocab)
    # AGG Sec. 3.1: frequent 30%, medium 50%, rare 20% of the vocabulary by training counts
    groups = agg.frequency_groups(counts)
    # a yardstick for the held-out PPL: an add-one unigram model (no context)
    unigram = (counts.double() + 1) / (counts.sum() + args.vocab)
    unigram_nll = -unigram[val[:, 2:]].log().mean()
    data = {"train": train, "val": val, "counts": counts}
    data["groups"] = dict(zip(agg.GROUPS, groups))
    data["group_of"] = agg.group_of(groups, args.vocab)
    data["unigram_ppl"] = math.exp(float(unigram_nll))
    return data


# -------------------------------------------------------------------------------------- the model
class ToyLM(nn.Module):
    """h = LN(MLP([W[x_-2], W[x_-1]]) + W[x_-1]), logits = h @ W.T: the ingredients of the theory
    (Gao et al. 2019 Sec. 4), tied input/output embeddings W and a LayerNorm right before the
    softmax layer."""

    def __init__(self, vocab, dim, init_std=0.02):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)  # W: the input embedding AND the softmax weight (tied)
        nn.init.normal_(self.emb.weight, std=init_std)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln = nn.LayerNorm(dim)

    def forward(self, x2, x1):
        e2 = self.emb(x2)
        e1 = self.emb(x1)
        h = self.mlp(torch.cat([e2, e1], dim=-1))
        return self.ln(h + e1)  # the caller multiplies by W.T: the method owns the loss


# ------------------------------------------------------------------------ training and evaluation
def snapshot(step, W, groups, method):
    """The geometry over training (AGG Fig. 2) and the size of the rare group (AGG Fig. 4)."""
    freq = W[groups["freq"]]
    rare = W[groups["rare"]]
    mask = method.rare_mask()
    snap = {"step": step, "isotropy": agg.isotropy(W)}
    snap["isotropy_freq"] = agg.isotropy(freq)
    snap["isotropy_rare"] = agg.isotropy(rare)
    snap["cos_rare"] = agg.mean_cosine(rare)
    snap["cos_rare_freq"] = agg.mean_cosine_between(rare, freq)
    snap["rare_count"] = None if mask is None else int(mask.sum())
    return snap


def check_finite(W, label, step):
    """One line, not linalg's traceback, when a run's embeddings are no longer finite."""
    if not bool(torch.isfinite(W).all()):
        raise SystemExit(
            f"{label}: the embeddings are not finite after step {step}: "
            "try a smaller --lr or --init-std"
        )


def method_hparams(name, args):
    """Toy-scale hyper-parameters over agg.build_method's defaults: agg-static's switch within the
    run, then the method's flags given (AGG's alpha: --alpha, always given)."""
    defaults = agg.METHODS[name].defaults
    hp = {}
    if defaults.get("static_after") is not None:
        hp["static_after"] = min(args.epoch_steps, max(1, args.steps // 2))
    for key in defaults:
        if getattr(args, key) is not None:
            hp[key] = getattr(args, key)
    return hp


def train_one(label, name, hparams, data, args):
    """Train a fresh ToyLM (same init for every method) with agg method `name`; return its metrics
    and history."""
    torch.manual_seed(args.seed + 1)  # the same init for every method
    model = ToyLM(args.vocab, args.dim, args.init_std)
    method = agg.build_method(
        name,
        vocab_size=args.vocab,
        counts=data["counts"],
        steps_per_epoch=args.epoch_steps,
        **hparams,
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    W = model.emb.weight  # the tied embedding: what the methods act on
    train = data["train"]
    order_gen = torch.Generator().manual_seed(args.seed + 2)  # same batch order for every method
    history = []
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"{label:>14}", dynamic_ncols=True)  # on stderr
    for step in bar:
        # each epoch: a fresh order of the training set, cut into epoch_steps batches
        if step % args.epoch_steps == 0:
            order = torch.randperm(len(train), generator=order_gen)
            batches = order.view(args.epoch_steps, args.batch_seqs)
        x = train[batches[step % args.epoch_steps]]
        y = x[:, 2:]  # the targets; x_-2 and x_-1 of each are the columns before
        # the method counts the step's targets: AGG's a_k, once per optimizer step (Eq. 5)
        method.observe(y)
        # the forward pass; the method's loss gates its rare tokens' gradients (AGG Eq. 7-8)
        h = model(x[:, :-2], x[:, 1:-1])
        loss = method.loss(h, W, y)
        # backward pass and an Adam step
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # a method's own edit of W after the step: freeze-rare restores its frozen rows
        method.after_step(W)
        # once in a while: the geometry, for training.png
        if step % args.log_every == 0 or step == args.steps - 1:
            check_finite(W, label, step + 1)
            history.append(snapshot(step + 1, W.detach(), data["groups"], method))
            nll = f"{method.stats['nll']:.3f}"
            isotropy = f"{history[-1]['isotropy']:.2f}"
            bar.set_postfix(nll=nll, IW=isotropy, refresh=False)
    # the final embeddings' geometry, then the held-out metrics
    result = agg.geometry(W, data["groups"], data["counts"] > 0)
    result.update(evaluate(model, data))
    result["seconds"] = time.perf_counter() - t0  # wall time: training + evaluation
    result["method"] = name
    result["hparams"] = hparams
    # the method's rare set at the end (None: it has none)
    rare = method.rare_mask()
    result["rare_count"] = None if rare is None else int(rare.sum())
    result["rare_fraction"] = None if rare is None else float(rare.float().mean())
    result["history"] = history
    return result, W.detach().clone()


@torch.no_grad()
def evaluate(model, data, chunk_seqs=128):
    """Held-out PPL, total and per frequency group; Uniq (distinct argmax predictions)."""
    val = data["val"]
    W = model.emb.weight
    nll = agg.GroupNLL()
    preds = []
    for s in range(0, len(val), chunk_seqs):
        x = val[s : s + chunk_seqs]
        h = model(x[:, :-2], x[:, 1:-1])
        y = x[:, 2:]
        logits = h.reshape(-1, h.shape[-1]) @ W.T
        nll.add(F.cross_entropy(logits, y.reshape(-1), reduction="none"), data["group_of"][y])
        preds.append(logits.argmax(1))
    out = {"ppl": nll.ppl(), "ppl_groups": nll.ppl_groups()}  # a group without targets: nan
    out["uniq"] = int(torch.cat(preds).unique().numel())
    return out


# -------------------------------------------------------------------------------------- reporting
def group_cells(r, key, fmt):
    """One metric of the three frequency groups, as freq/med/rare."""
    cells = [f"{r[key][g]:{fmt}}" for g in agg.GROUPS]
    return "/".join(cells)


def table(results):
    """A Markdown table (pastes into the README as is)."""
    head = (
        "| method | I(W) | I(W) freq/med/rare | mean cos | cos freq/med/rare | PPL "
        "| PPL freq/med/rare | Uniq | rare set | s |"
    )
    rule = "|" + " --- |" * (head.count("|") - 1)
    lines = [head, rule]
    for label, r in results.items():
        ig = group_cells(r, "isotropy_groups", ".2f")
        cg = group_cells(r, "mean_cosine_groups", ".2f")
        pg = group_cells(r, "ppl_groups", ".0f")
        rare = "-" if r["rare_count"] is None else r["rare_count"]
        lines.append(
            f"| {label} | {r['isotropy']:.3f} | {ig} | {r['mean_cosine']:.3f} | {cg} "
            f"| {r['ppl']:.1f} | {pg} | {r['uniq']} | {rare} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def style(ax, title, xlabel, ylabel, legend):
    """Title, labels and grid; a legend of that font size (0: none)."""
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=legend)


def write_file(path, save):
    """save(path); a disk that refuses it is one line, not a traceback."""
    try:
        save(path)
    except (OSError, RuntimeError) as e:  # a full disk, a read-only folder (torch: RuntimeError)
        reason = getattr(e, "strerror", None) or str(e)[:200]
        raise SystemExit(f"cannot write {path} ({reason}): free disk space or choose another --out")


def write_text(text, path):
    with open(path, "w") as f:
        f.write(text)


def save(fig, path, title=None, tight=True):
    if title:
        fig.suptitle(title, fontsize=12)
    if tight:
        fig.tight_layout()
    save_png = functools.partial(fig.savefig, dpi=110, format="png")
    write_file(path, save_png)
    plt.close(fig)


def top2_basis(W):
    """The top two right singular vectors of the (uncentred) W, signed so that the mean row
    projects positively."""
    vh = torch.linalg.svd(W, full_matrices=False)[2][:2]
    flip = W.mean(0) @ vh.T < 0  # the directions on which the mean row projects negatively
    return torch.where(flip[:, None], -vh, vh)


def plot_projection(ax, xy, groups, unit_rows):
    """The rows of W in the plane of its top-2 singular directions, coloured by frequency group."""
    for g in agg.GROUPS:  # rare last: on top
        points = xy[groups[g].numpy()].T
        ax.scatter(*points, s=4, alpha=0.55, color=GROUP_COLOURS[g], linewidths=0)
    lim = 1.05  # unit rows
    if not unit_rows:
        lim = max(float(abs(xy).max()) * 1.05, 1e-6)
    ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal")
    ax.axhline(0, color="0.85", lw=0.6, zorder=0)
    ax.axvline(0, color="0.85", lw=0.6, zorder=0)
    ax.tick_params(labelsize=8)


def plot_svd(weights, results, groups, path, title):
    """Per run, two panels: the embeddings projected on their top-2 singular directions (AGG Fig.
    1/3), and the same for the unit-normalised rows, where a cone (all rare rows pointing one way)
    becomes one tight spot."""
    n = len(weights)
    cols = n
    if n > 5:  # at most 5 columns, blocks as full as possible
        cols = math.ceil(n / math.ceil(n / 4))
    blocks = math.ceil(n / cols)
    size = (4.3 * cols, 8.4 * blocks + 1.3)
    fig, axes = plt.subplots(2 * blocks, cols, figsize=size, squeeze=False, layout="constrained")
    for i, (label, W) in enumerate(weights.items()):
        W = W.double()
        basis = top2_basis(W)
        views = [(W, "embeddings"), (F.normalize(W, dim=1), "directions (unit rows)")]
        for row, (Wp, what) in enumerate(views):
            ax = axes[2 * (i // cols) + row, i % cols]
            xy = (Wp @ basis.T).numpy()
            plot_projection(ax, xy, groups, unit_rows=row == 1)
            if row == 0:
                iw = results[label]["isotropy"]
                cos = results[label]["mean_cosine_groups"]["rare"]
                weight = "bold" if label in ("mle", "agg") else None
                heading = f"{label}\nI(W) {iw:.2f}   rare-group cos {cos:.2f}"
                ax.set_title(heading, fontsize=11, fontweight=weight)
            ax.set_xlabel(f"{what}: singular dir. 1", fontsize=9)
            ax.set_ylabel("singular dir. 2", fontsize=9)
    for ax in axes[-2:, n - (blocks - 1) * cols :].flat:  # the empty slots of the last block
        ax.axis("off")
    handles = []
    for g, share in zip(agg.GROUPS, ("top 30%", "middle 50%", "bottom 20%")):
        colour = GROUP_COLOURS[g]
        handles.append(plt.Line2D([], [], marker="o", ls="", color=colour, label=f"{g} ({share})"))
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=3,
        frameon=False,
        fontsize=10,
        title="frequency group, by training counts",
        title_fontsize=10,
    )
    save(fig, path, title, tight=False)


def plot_spectrum(weights, styles, path):
    """Gao et al. Fig. 2b: the normalised singular values of each run's W."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, W in weights.items():
        s = agg.singular_spectrum(W).numpy()
        index = range(1, len(s) + 1)
        ax.plot(index, s, marker="o", ms=3, label=label, **styles[label])
    ax.set_ylim(0, 1.05)
    title = "Normalised singular values of W\n(a fast drop = one dominant direction = a cone)"
    style(ax, title, "index of singular value", "singular value / largest", legend=9)
    save(fig, path)


def plot_training(results, styles, vocab, path):
    """AGG Fig. 2 (group isotropy, rare-frequent cosine over steps) and Fig. 4 (rare-group size
    over steps)."""
    panels = [  # the top row: isotropy, of all tokens and of two groups
        ("isotropy", "I(W), all tokens", "higher = more isotropic"),
        ("isotropy_freq", "I(W), frequent group", None),
        ("isotropy_rare", "I(W), rare group", None),
    ]
    panels += [  # the bottom row: the rare group's cone and its size
        ("cos_rare", "mean cosine within the rare group", "near 1 = a narrow cone"),
        ("cos_rare_freq", "mean cosine rare vs frequent", None),
        ("rare_count", "size of the method's rare group", "tokens"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, ylabel) in zip(axes.flat, panels):
        for label, r in results.items():
            # rare_count: None for a method without a rare set
            h = [s for s in r["history"] if s[key] is not None]
            if h:
                steps = [s["step"] for s in h]
                values = [s[key] for s in h]
                ax.plot(steps, values, label=label, **styles[label])
        if key == "rare_count":
            rare_group = round(0.2 * vocab)
            what = "bottom 20% (rare frequency group)"
            ax.axhline(rare_group, color="tab:red", ls=":", lw=1, label=what)
        legend = {"isotropy": 9, "rare_count": 8}.get(key, 0)
        style(ax, title, "training step", ylabel, legend=legend)
    title = "Training dynamics of the tied embeddings (groups by training frequency: 30/50/20%)"
    save(fig, path, title)


def make_plots(args, data, results, weights):
    """svd.png and spectrum.png of --methods, training.png of every run; with --alpha-sweep,
    svd_alpha_sweep.png."""
    plt.switch_backend("Agg")
    styles = {}  # one per run, in every plot
    for i, label in enumerate(results):
        styles[label] = {"color": f"C{i}", "lw": 2.2 if label in ("mle", "agg") else 1.2}
    main_w = {label: weights[label] for label in args.method_list}
    out = args.out
    svd_title = "top: SVD projection of W; bottom: the same for W's unit rows"
    title = (
        f"Tied embeddings after {args.steps} steps "
        f"(N = {args.vocab}, d = {args.dim}, seed {args.seed})\n"
        f"{svd_title} (a cone = one tight spot)"
    )
    plot_svd(main_w, results, data["groups"], f"{out}/svd.png", title)
    plot_spectrum(main_w, styles, f"{out}/spectrum.png")
    plot_training(results, styles, args.vocab, f"{out}/training.png")
    sweep_labels = [label for label in results if label not in main_w]
    if not sweep_labels:
        return
    if "mle" in results:  # MLE first, for comparison
        sweep_labels.insert(0, "mle")
    sweep_w = {label: weights[label] for label in sweep_labels}
    title = f"AGG's embeddings as its rare group grows (alpha sweep)\n{svd_title}"
    plot_svd(sweep_w, results, data["groups"], f"{out}/svd_alpha_sweep.png", title)


def make_folder(out):
    """--out, created; one line when it cannot be (a file, a read-only or a full disk)."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {out}: cannot create that folder ({e.strerror}): choose another")


def main(argv=None):
    """The runs of the command line; one line when they need more memory than there is."""
    try:
        args = parse_args(argv)  # its method check allocates --vocab counts
        return run(args)
    except (MemoryError, RuntimeError) as e:
        if "allocate" not in str(e) and not isinstance(e, MemoryError):
            raise
        sizes = "--vocab, --rank, --dim, --epoch-steps, --batch-seqs, --seq-len or --val-tokens"
        raise SystemExit(f"out of memory: try a smaller {sizes}") from None


def run(args):
    """Train every run, write metrics.json and embeddings.pt, print the table, draw the plots."""
    if args.threads:
        torch.set_num_threads(args.threads)
    make_folder(args.out)
    t0 = time.perf_counter()
    data = make_data(args)

    # the first optimizer imports torch._dynamo (seconds): do it here, not in the first run's time
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    results = {}
    weights = {}
    for label, name, hp in args.runs:
        earlier = [k for k, r in results.items() if (r["method"], r["hparams"]) == (name, hp)]
        if earlier:  # the same run as an earlier one (the sweep's default alpha): reused
            results[label] = results[earlier[0]]
            weights[label] = weights[earlier[0]]
            continue
        results[label], weights[label] = train_one(label, name, hp, data, args)

    # metrics.json: every run and the configuration
    methods = {label: results[label] for label in args.method_list}
    sweep = []
    for label, _name, hp in args.runs[len(methods) :]:  # the alpha sweep
        sweep.append({"alpha": hp["alpha"], **results[label]})
    internal = ("method_list", "runs")  # parse_args's, not flags
    config = {k: v for k, v in vars(args).items() if k not in internal and v is not None}
    config["tokens_per_step"] = args.batch_seqs * args.seq_len
    config["val_tokens"] = int(data["val"][:, 2:].numel())
    config["unigram_ppl"] = data["unigram_ppl"]
    config["torch"] = torch.__version__
    metrics = {"methods": methods, "config": config}
    if sweep:
        metrics["alpha_sweep"] = sweep
    text = json.dumps(metrics, indent=1)
    write_file(os.path.join(args.out, "metrics.json"), functools.partial(write_text, text))
    # embeddings.pt: the final W of every run, for your own analysis
    save_weights = functools.partial(torch.save, weights)
    write_file(os.path.join(args.out, "embeddings.pt"), save_weights)

    # the table, and how to read it
    print("\n" + table(results))
    print(
        f"\nheld-out PPL of a unigram model: {data['unigram_ppl']:.1f}. Groups: frequent 30% / "
        "medium 50% / rare 20% of the vocabulary by training counts; rare set: the method's own, "
        "at the end."
    )
    if not args.no_plots:
        make_plots(args, data, results, weights)
    wrote = "metrics.json" if args.no_plots else "metrics.json and PNGs"
    seconds = time.perf_counter() - t0
    print(f"\nwrote {args.out}/{wrote} in {seconds:.1f} s")
    return metrics


if __name__ == "__main__":
    main()
