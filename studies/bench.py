"""What each method of agg.py costs next to MLE, measured in one run. From the repository root:

    # T=4096, d=512, V in {8192, 32768, 50304}, chunked head, lm: ~1 h on 2 cores
    python -m studies.bench --threads 1
    # one small V, few repeats: a spot check in about a minute
    python -m studies.bench --quick

Sections (--sections), each interleaving its candidates (the order rotates every round), with
ratios vs MLE:
  head     observe() + loss() + backward() of the head for every agg.METHODS entry,
           `official-ref` (studies.official), `torch-ce` (F.cross_entropy(h @ W.T, y)) and, where
           torch has it, `linear-ce` (F.linear_cross_entropy(h, W, y)): wall and CPU time, peak
           memory (CUDA max_memory_allocated; on CPU the peak RSS above the set-up of a fresh
           process per case);
  chunked  loss()'s chunk_size at large vocabularies: peak head memory ~ chunk x V instead of T x V;
  lm       tokens/s of train_lm.py's training step per method (cpu preset).
On a shared machine use --threads 1 and read the column cpu_ratio_vs_mle (CPU time); compare rows of
one run only.
Writes OUT/bench.md (the tables) and OUT/bench.json (ms: median ms of a step; peak_mb above set-up;
samples_ms: each round's).
"""

import argparse
import concurrent.futures as cf
import contextlib
import functools
import gc
import itertools
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F
from tqdm import tqdm

import agg
import runlib
import train_lm
from data import prepare_lm
from studies.official import OfficialAGGRef

SPECIAL_IDS = [0]  # never rare (like pad/eos)
SECTIONS = ["head", "chunked", "lm"]


# plain PyTorch: F.cross_entropy(h @ W.T, y) (logits, log-softmax and its gradient: ~3 T x V)
class TorchCE:
    def observe(self, targets):
        pass

    def loss(self, hidden, weight, targets, chunk_size=None):
        return F.cross_entropy(
            (hidden @ weight.T).reshape(-1, weight.shape[0]).float(), targets.reshape(-1)
        )


# PyTorch's own fused head: F.linear_cross_entropy(h, W, y)
class LinearCE(TorchCE):
    def loss(self, hidden, weight, targets, chunk_size=None):
        flat = hidden.reshape(-1, hidden.shape[-1])
        return F.linear_cross_entropy(flat, weight, targets.reshape(-1))


# the candidates: agg.py's methods, the official criterion and PyTorch's heads
BASELINES = {"torch-ce": TorchCE}
if hasattr(F, "linear_cross_entropy"):  # not in every torch
    BASELINES["linear-ce"] = LinearCE
NAMES = list(agg.METHODS) + ["official-ref", *BASELINES]


def make_data(
    V, T, d, seq_len, window, device, dtype="float32", seed=0, rare_fraction=0.2, n_batches=4
):
    """Zipf(1.1) targets (T / seq_len, seq_len) (ul needs (B, T)) and a history of `window` steps
    for the counters (its counts are the static methods'); alpha makes ~rare_fraction of the
    vocabulary rare."""
    g, p = torch.Generator().manual_seed(seed), torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
    p = (p / p.sum()).float()
    draw = torch.multinomial(p, (window + n_batches) * T, replacement=True, generator=g).view(
        -1, T // seq_len, seq_len
    )
    history, batches = draw[:window], [b.to(device) for b in draw[window:]]
    counts = torch.bincount(history.reshape(-1), minlength=V)
    counts[SPECIAL_IDS] = counts.max()
    # the count threshold whose rare share (a_k < threshold) is closest to rare_fraction (at least 1
    # rare); alpha = threshold / window
    values = counts.unique()
    shares = torch.searchsorted(counts.sort().values, values[1:]).double() / V
    threshold = values[1 + int((shares - rare_fraction).abs().argmin())]
    hidden = torch.randn(T // seq_len, seq_len, d, generator=g).to(device)
    weight = (0.02 * torch.randn(V, d, generator=g)).to(device)
    rare = counts < threshold
    rare_rows = float(torch.cat([rare[b.cpu().reshape(-1)] for b in batches]).double().mean())
    return dict(
        hidden=hidden,
        weight=weight,
        history=history,
        batches=batches,
        counts=counts,
        alpha=float(threshold) / window,
        rare_vocab=float(rare.double().mean()),
        rare_rows=rare_rows,
        window=window,
        rare_fraction=rare_fraction,
        bf16=dtype == "bfloat16",
    )


class Runner:
    """One candidate: its method (counters filled with the history); a step: observe + loss +
    backward."""

    def __init__(self, name, data, chunk_size=None):
        self.name, self.chunk_size, V = name, chunk_size, data["weight"].shape[0]
        if name == "official-ref":
            self.method = OfficialAGGRef(
                V, alpha=data["alpha"], window=data["window"], special_ids=SPECIAL_IDS
            )
            self.method.prefill(data["history"])
        elif name in BASELINES:
            self.method = BASELINES[name]()
        else:
            hp = {
                k: data[k]
                for k in ("alpha", "window", "rare_fraction")
                if k in agg.METHODS[name].defaults
            }
            self.method = agg.build_method(
                name, vocab_size=V, counts=data["counts"], special_ids=SPECIAL_IDS, **hp
            )
            for y in data["history"] if agg.agg_family(name) else []:
                self.method.observe(y)
        self.hidden, self.weight = (data[k].detach().requires_grad_() for k in ("hidden", "weight"))
        self.batches, self.i, self.bf16 = data["batches"], 0, data["bf16"]

    def step(self, hidden=None, y=None):
        self.hidden.grad = self.weight.grad = None
        if y is None:
            y, self.i = self.batches[self.i % len(self.batches)], self.i + 1
        self.method.observe(y)  # once per optimizer step: part of each step's cost
        hidden = self.hidden if hidden is None else hidden
        # as train_lm.py's step
        with torch.autocast(self.weight.device.type, torch.bfloat16, enabled=self.bf16):
            loss = self.method.loss(hidden, self.weight, y, chunk_size=self.chunk_size)
        loss.backward()
        return loss

    def timed(self, device):
        """(wall ms, process CPU ms) of one step; the CPU time leaves out the time other jobs hold
        the cores."""
        sync = torch.cuda.synchronize if device.startswith("cuda") else lambda device: None
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        self.step()
        sync(device)
        self.hidden.grad = self.weight.grad = None
        return 1000 * (time.perf_counter() - t0), 1000 * (time.process_time() - c0)


def interleave(names, rounds, warmup, run, desc):
    """{name: [run(name, round) of each round after the warm-up]}, the order of the names rotating
    every round."""
    out = {n: [] for n in names}
    with tqdm(total=(warmup + rounds) * len(names), desc=desc, leave=False, file=sys.stderr) as bar:
        for r in range(warmup + rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                m = run(n, r)
                out[n] += [m] if r >= warmup else []
                bar.update()
    return out


def _cpu_peak(method, chunk_size, threads, data):
    """The peak RSS (MB) of one step above its set-up (VmHWM, reset by /proc/self/clear_refs on
    Linux >= 4.0)."""

    def status_kb(key):
        return next(int(r.split()[1]) for r in open("/proc/self/status") if r.startswith(key + ":"))

    torch.set_num_threads(threads)
    runner = Runner(method, make_data(device="cpu", **data), chunk_size)
    # every code path, a small allocation
    runner.step(hidden=runner.hidden[:1, :16], y=runner.batches[0][:1, :16])
    runner.hidden.grad = runner.weight.grad = None
    gc.collect()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status_kb("VmRSS")
    runner.step()
    return max(status_kb("VmHWM") - base, 0) / 1024


def cpu_peak_mb(method, chunk_size=None, **data):
    """Peak RSS (MB) of one step of `method` on make_data(**data) above its set-up, in a fresh
    process (forkserver)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "agg"])
    # A fixed glibc mmap threshold (read as the process or its server starts): every buffer >= 1 MiB
    # is its own mapping, unmapped when freed, so the peak RSS counts live tensors, not the freed
    # buffers glibc keeps at random.
    with (
        mock.patch.dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20)),
        cf.ProcessPoolExecutor(1, ctx) as pool,
    ):
        try:
            return pool.submit(
                _cpu_peak, method, chunk_size, torch.get_num_threads(), data
            ).result()
        # killed before it could answer (the OOM killer, most likely)
        except cf.process.BrokenProcessPool:
            raise SystemExit(
                f"peak memory of {method} at V={data['V']}: the child process died; out of memory? "
                "Try a smaller --tokens / --vocab, or --no-memory"
            ) from None


def peak_mb(runner, device, data):
    if device == "cpu":
        return cpu_peak_mb(runner.name, runner.chunk_size, **data)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    runner.timed(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def cell(value):
    return "n/a" if value is None else str(value)


def table(title, rows, keys):
    """A markdown table of `rows` (the JSON's dicts, numbers rounded) in the columns `keys`."""
    lines = [title, "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def measure(args, device, V, T, d, seq_len, candidates, repeats, warmup, desc):
    """Time the (method, chunk_size) candidates interleaved on one data set, then measure their peak
    memory: ({V, device, alpha, rare shares, load}, {candidate: (wall ms per round, CPU ms per
    round, peak MB or None)})."""
    spec = dict(V=V, T=T, d=d, seq_len=seq_len, window=args.window, dtype=args.dtype)
    data = make_data(device=device, **spec)
    info = dict(V=V, device=device, load_before=os.getloadavg())
    info.update({k: data[k] for k in ("alpha", "rare_vocab", "rare_rows")})
    runners = {(m, c): Runner(m, data, c) for m, c in candidates}
    timed = interleave(
        list(runners),
        repeats,
        warmup,
        lambda k, r: runners[k].timed(device),
        f"{desc} {device} V={V}",
    )
    peaks = {
        k: None if args.no_memory else peak_mb(runners[k], device, spec)
        for k in tqdm(runners, desc=f"memory {device} V={V}", leave=False, file=sys.stderr)
    }
    runners.clear()  # the lambda above holds the dict: empty it to free the runners
    del data
    gc.collect()
    info["load_after"] = os.getloadavg()
    return info, {k: (*zip(*v), peaks[k]) for k, v in timed.items()}


def bench_head(args, log, result, save):
    """The method table of each (device, V): rows of result's cases, an entry of its meta's
    head_groups."""
    keys = ["method", "ms", "ms_min", "ms_max", "ms_ratio_vs_mle", "min_ratio_vs_mle"]
    keys += ["cpu_ratio_vs_mle", "peak_mb", "mem_ratio_vs_mle"]
    for device, V in itertools.product(args.device, args.vocab):
        candidates = [(n, None) for n in args.methods]
        T, d, seq_len = args.tokens, args.d_model, args.seq_len
        i, res = measure(
            args, device, V, T, d, seq_len, candidates, args.repeats, args.warmup, "head"
        )
        result["meta"]["head_groups"].append(i)
        mle_wall, mle_cpu, mle_peak = res["mle", None]
        cases = []
        for n in args.methods:
            wall, cpu, peak = res[n, None]
            ms, cpu_ms = statistics.median(wall), statistics.median(cpu)
            cases.append(
                dict(
                    method=n,
                    V=V,
                    device=device,
                    ms=round(ms, 3),
                    ms_min=round(min(wall), 3),
                    ms_max=round(max(wall), 3),
                    ms_ratio_vs_mle=round(ms / statistics.median(mle_wall), 4),
                    min_ratio_vs_mle=round(min(wall) / min(mle_wall), 4),
                    peak_mb=peak and round(peak, 2),
                    mem_ratio_vs_mle=round(peak / mle_peak, 4) if mle_peak else None,
                    cpu_ms=round(cpu_ms, 3),
                    cpu_ratio_vs_mle=round(cpu_ms / statistics.median(mle_cpu), 4),
                    samples_ms=[round(x, 3) for x in wall],
                    cpu_samples_ms=[round(x, 3) for x in cpu],
                )
            )
        title = (
            f"\nhead: T={T}, d={d}, V={V}, {device}; alpha={i['alpha']:.4g}: rare vocab "
            f"{100 * i['rare_vocab']:.1f}%, rare-target rows {100 * i['rare_rows']:.1f}%; "
            f"ms: the median of {args.repeats} rounds; load average {i['load_before'][0]:.1f} "
            f"-> {i['load_after'][0]:.1f}"
        )
        log(table(title, cases, keys))
        result["cases"] += cases
        save()


def bench_chunked(args, log):
    """chunk_size at large V: the same step timed and measured with the full T x V head and with
    chunks."""
    rows, T, d = [], args.chunk_tokens, args.chunk_d
    sizes = [c or None for c in args.chunk_sizes]
    for device, V in itertools.product(args.device, args.chunk_vocab):
        candidates = list(itertools.product(["mle", "agg"], sizes))
        _, res = measure(args, device, V, T, d, T, candidates, args.chunk_repeats, 1, "chunked")
        for (m, c), (wall, _, peak) in res.items():
            rows.append(
                dict(
                    method=m,
                    V=V,
                    T=T,
                    d=d,
                    device=device,
                    chunk_size=c,
                    ms=round(statistics.median(wall), 3),
                    peak_mb=peak and round(peak, 2),
                    logits_mb=round((c or T) * V * 4 / 2**20, 2),
                    weight_grad_mb=round(V * d * 4 / 2**20, 2),
                )
            )
    title = (
        "\nchunked head (chunk_size of loss(); n/a: T): peak MB above set-up; one rows x V "
        "float32 buffer = logits MB"
    )
    log(table(title, rows, ["method", "V", "T", "d", "chunk_size", "ms", "peak_mb", "logits_mb"]))
    return rows


def bench_lm(args, log):
    """tokens/s of train_lm.py's training step (train_lm.train_step, AdamW) per method vs MLE, cpu
    preset."""
    cfg = train_lm.make_config(device="cpu", preset="cpu")
    data = prepare_lm(cfg, log=lambda *a: None)
    V, block, tps = data["vocab_size"], cfg["block_size"], cfg["tokens_per_step"]
    seq, seqs_per_step = (
        train_lm.Sequences(data["ids"]["train"], block, seed=0),
        max(1, round(tps / block)),
    )
    steps_per_epoch = seq.n / seqs_per_step

    def batch(step):  # (x, y) of a step, as training reads
        return seq.get(step * seqs_per_step, seqs_per_step, "cpu")

    names = [m for m in args.methods if m in agg.METHODS]  # mle first
    trainers, rare, K = {}, {}, max(1, int(round(steps_per_epoch)))
    for name in names:
        c = dict(cfg, method=name, alpha=args.lm_alpha if agg.agg_family(name) else None)
        torch.manual_seed(0)  # same initial model for every method
        model = train_lm.build_model(c, V).train()
        method, _ = runlib.build_method(
            c,
            {},
            vocab_size=V,
            counts=data["counts"],
            steps_per_epoch=steps_per_epoch,
            special_ids=[data["pad_id"], data["eos_id"]],
            tokens_per_step=tps,
        )
        trainers[name] = functools.partial(
            train_lm.train_step,
            model,
            model,
            method,
            train_lm.make_optimizer(model, c),
            micro_batch=c["micro_batch"],
            autocast=runlib.autocast(c),
        )
        for s in range(K if "window" in method.hparams else 0):  # a full window, as after epoch 1
            method.observe(batch(s)[1])
        if method.rare_mask() is not None:
            rare[name] = round(float(method.rare_mask().double().mean()), 4)
    # round 0: the warm-up, one step
    rounds = [[batch(K)]] + [
        [batch(K + 1 + r * args.lm_steps + i) for i in range(args.lm_steps)]
        for r in range(args.lm_rounds)
    ]

    def tokens_per_s(name, r):
        t0 = time.perf_counter()
        for x, y in rounds[r]:
            trainers[name](x, y)
        return len(rounds[r]) * seqs_per_step * block / (time.perf_counter() - t0)

    samples = interleave(names, args.lm_rounds, 1, tokens_per_s, "lm steps")
    med = {n: statistics.median(s) for n, s in samples.items()}
    rows = [
        dict(
            method=n,
            tokens_per_s=round(med[n], 1),
            ratio_vs_mle=round(med[n] / med["mle"], 4),
            min=round(min(samples[n]), 1),
            max=round(max(samples[n]), 1),
            rare_vocab=rare.get(n),
        )
        for n in names
    ]
    res = dict(
        preset="cpu",
        data=f"train_lm.py training split ({data['dir']})",
        vocab_size=V,
        block_size=block,
        tokens_per_step=seqs_per_step * block,
        window=K,
        alpha=args.lm_alpha,
        steps_per_round=args.lm_steps,
        rounds=args.lm_rounds,
        rows=rows,
        model={k: cfg[k] for k in train_lm.MODEL_FIELDS},
    )
    title = (
        f"\ntrain_lm.py training step, cpu preset ({res['model']}), V={V}, "
        f"{res['tokens_per_step']} tokens/step, AGG alpha={args.lm_alpha} window={K}; data: "
        f"{res['data']}; median of {args.lm_rounds} rounds x {args.lm_steps} steps; "
        "rare_vocab: the share of the vocabulary rare"
    )
    keys = ["method", "tokens_per_s", "min", "max", "ratio_vs_mle", "rare_vocab"]
    log(table(title, rows, keys))
    return res


def at_least(lo, kind=int):
    """An argparse type: a finite `kind` >= lo (NaN is never one)."""

    def parse(text):
        value = kind(text)
        if not lo <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value: ..."
    return parse


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m studies.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size, size2, count = at_least(1), at_least(2), at_least(0)  # size2: the rare group needs 2 ids
    p.add_argument("--out", default="out/bench", help="folder for bench.json")
    p.add_argument(
        "--results", default=None, metavar="FILE", help="also write bench.json's content to FILE"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one V (8192), T=1024, d=128, small chunked case, no lm",
    )
    p.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    p.add_argument(
        "--device",
        nargs="+",
        default=["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"],
        choices=["cpu", "cuda"],
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=NAMES,
        choices=NAMES,
        metavar="NAME",
        help=f"candidates ({', '.join(NAMES)}; lm: agg.py's only); mle is always added",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: the loss autocast",
    )
    p.add_argument(
        "--threads",
        type=count,
        default=None,
        help="torch CPU threads (on a busy machine 1 is steadier)",
    )
    g = p.add_argument_group("head")
    g.add_argument("--vocab", type=size2, nargs="+", default=[8192, 32768, 50304])
    g.add_argument("--tokens", type=size, default=4096, help="T: positions per step")
    g.add_argument("--d-model", type=size, default=512)
    g.add_argument(
        "--seq-len",
        type=size,
        default=1024,
        help="targets are (T / seq-len, seq-len): ul needs (B, T)",
    )
    g.add_argument(
        "--repeats", type=size, default=3, help="timed runs per candidate (after --warmup)"
    )
    g.add_argument("--warmup", type=count, default=1)
    g.add_argument(
        "--window", type=size, default=200, help="AGG counter memory K (steps of synthetic history)"
    )
    g.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    g = p.add_argument_group("chunked")
    g.add_argument("--chunk-vocab", type=size2, nargs="+", default=[131072, 262144])
    g.add_argument("--chunk-tokens", type=size, default=1024)
    g.add_argument("--chunk-d", type=size, default=256)
    g.add_argument(
        "--chunk-sizes", type=count, nargs="+", default=[0, 512, 128], help="0 = unchunked (T x V)"
    )
    g.add_argument("--chunk-repeats", type=size, default=2)
    g = p.add_argument_group("lm")
    g.add_argument(
        "--lm-alpha",
        type=at_least(0, float),
        default=0.075,
        help="AGG alpha (~12%% of the vocabulary rare)",
    )
    g.add_argument(
        "--lm-steps", type=size, default=3, help="timed training steps per method per round"
    )
    g.add_argument(
        "--lm-rounds", type=size, default=3, help="interleaved rounds (after one warm-up step each)"
    )
    return p


def make_folder(p, flag, folder):
    """The folder a flag writes in, created before any measurement; argparse's one line when it
    cannot be."""
    try:
        os.makedirs(folder or ".", exist_ok=True)
    except OSError as e:
        p.error(f"{flag}: cannot create the folder {folder} ({e.strerror}); choose another")


def check_args(p, args):
    """The flags argparse cannot check: T against seq-len, CUDA, the output paths."""
    if args.tokens % args.seq_len:
        p.error(f"--tokens {args.tokens} must be a multiple of --seq-len {args.seq_len}")
    if "cuda" in args.device and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if not args.out:
        p.error("--out must name a folder, e.g. --out out/bench")
    make_folder(p, "--out", args.out)
    results = args.results
    if results and os.path.exists(results) and not os.path.isfile(results):
        p.error(f"--results {results}: not a regular file; name a .json file")
    if results:
        make_folder(p, "--results", os.path.dirname(results))


@contextlib.contextmanager
def memory_guard():
    """One line, not the allocator's traceback, when a size does not fit in memory."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:  # torch's allocators raise RuntimeErrors
        if not isinstance(e, MemoryError) and "allocate" not in str(e):
            raise
        sizes = "--vocab, --tokens, --d-model, --window or --chunk-vocab"
        raise SystemExit(f"out of memory: try a smaller {sizes}") from None


QUICK = dict(
    vocab=[8192],
    tokens=1024,
    d_model=128,
    seq_len=256,
    repeats=2,
    warmup=1,
    sections=["head", "chunked"],
    chunk_vocab=[16384],
    chunk_tokens=512,
    chunk_d=64,
    chunk_sizes=[0, 64],
    chunk_repeats=1,
    window=50,
)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:  # quick values, unless a flag was given explicitly
        vars(args).update(
            {k: v for k, v in QUICK.items() if k not in runlib.explicit_flags(parser, argv)}
        )
    check_args(parser, args)
    args.methods = ["mle"] + [m for m in args.methods if m != "mle"]
    if args.threads:
        torch.set_num_threads(args.threads)
    report = []

    def log(line):
        report.append(line)
        print(line, flush=True)

    meta = dict(
        command="python -m studies.bench " + " ".join(argv),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpu=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        cuda=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        load_before=os.getloadavg(),
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
        head_groups=[],
        **{
            k: vars(args)[k]
            for k in ("tokens", "d_model", "seq_len", "repeats", "warmup", "window")
        },
    )
    log(
        f"bench: torch {meta['torch']}, {meta['threads']} threads, devices {args.device}, "
        f"load average {' '.join(f'{x:.2f}' for x in meta['load_before'])}"
    )
    result = {"cases": [], "chunked": [], "lm": {"skipped": "section not run"}, "meta": meta}
    path = os.path.join(args.out, "bench.json")

    def save():  # after every group, so a long run leaves its finished parts behind
        for p in [path] + ([args.results] if args.results else []):
            runlib.write_json(p, result)
        runlib.write_text(os.path.join(args.out, "bench.md"), "\n".join(report) + "\n")

    t0 = time.time()
    with memory_guard():
        if "head" in args.sections:
            bench_head(args, log, result, save)
        if "chunked" in args.sections:
            result["chunked"] = bench_chunked(args, log)
            save()
        if "lm" in args.sections:
            result["lm"] = bench_lm(args, log)
    meta.update(load_after=os.getloadavg(), seconds=round(time.time() - t0, 1))
    log(
        f"\nload average after: {' '.join(f'{x:.2f}' for x in meta['load_after'])}; "
        f"{meta['seconds']:.0f} s"
    )
    save()
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
