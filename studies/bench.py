"""What each method of agg.py costs next to MLE, measured in one run. From the repository root:

    # T=4096, d=512, V in {8192, 32768, 50304}, chunked head, lm: ~1 h on 2 cores
    python -m studies.bench --threads 1
    # one small V, few repeats: a spot check in about a minute
    python -m studies.bench --quick

Sections (--sections), each interleaving its candidates (the order rotates every round), with
ratios vs MLE:
  head     observe() + loss() + backward() of the head for every agg.METHODS entry,
           `official-ref` (studies.official) and `torch-ce` (F.cross_entropy(h @ W.T, y)): wall and
           CPU time, peak memory (CUDA max_memory_allocated; on CPU the peak RSS above the set-up of
           a fresh process per case);
  chunked  loss()'s chunk_size at large vocabularies: peak head memory ~ chunk x V instead of T x V;
  lm       tokens/s of train_lm.py's training step per method (cpu preset).
On a shared machine use --threads 1 and read the CPU-time column; compare rows of one run only.
Writes OUT/bench.md (the tables) and OUT/bench.json (ms: median ms of a step; peak_mb above set-up).
"""

import argparse
import concurrent.futures as cf
import contextlib
import functools
import gc
import itertools
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

# the candidates: agg.py's methods and two baselines
NAMES = list(agg.METHODS) + ["official-ref", "torch-ce"]
SPECIAL_IDS = [0]  # never rare (like pad/eos)


# plain PyTorch: F.cross_entropy(h @ W.T, y) (logits, log-softmax and its gradient: ~3 T x V)
class TorchCE:
    def observe(self, targets):
        pass

    def loss(self, hidden, weight, targets, chunk_size=None):
        return F.cross_entropy(
            (hidden @ weight.T).reshape(-1, weight.shape[0]).float(), targets.reshape(-1)
        )


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
    # alpha: the count threshold whose rare share (a_k < threshold) is closest to rare_fraction (at
    # least 1 rare)
    values = counts.unique()
    best = (
        int(
            (torch.searchsorted(counts.sort().values, values[1:]).double() / V - rare_fraction)
            .abs()
            .argmin()
        )
        + 1
    )
    alpha = float(values[best]) / window
    hidden = torch.randn(T // seq_len, seq_len, d, generator=g).to(device)
    weight = (0.02 * torch.randn(V, d, generator=g)).to(device)
    rare = counts < values[best]
    rare_rows = float(torch.cat([rare[b.cpu().reshape(-1)] for b in batches]).double().mean())
    return dict(
        hidden=hidden,
        weight=weight,
        history=history,
        batches=batches,
        counts=counts,
        alpha=alpha,
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
        elif name == "torch-ce":
            self.method = TorchCE()
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


def table(title, header, rows):
    return "\n".join(
        [title, "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        + ["| " + " | ".join(r) + " |" for r in rows]
    )


def format_or_na(x, spec):
    return "n/a" if x is None else spec.format(x)


def measure(args, device, V, T, d, seq_len, candidates, repeats, warmup, desc):
    """Time the (method, chunk_size) candidates interleaved on one data set, then measure their peak
    memory: ({V, device, alpha, rare shares, load}, {candidate: (wall ms per round, CPU ms per
    round, peak MB or None)})."""
    spec = dict(V=V, T=T, d=d, seq_len=seq_len, window=args.window, dtype=args.dtype)
    data = make_data(device=device, **spec)
    info = dict(
        V=V,
        device=device,
        alpha=data["alpha"],
        rare_vocab=data["rare_vocab"],
        rare_rows=data["rare_rows"],
        load_before=os.getloadavg(),
    )
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
    return dict(info, load_after=os.getloadavg()), {
        k: (*zip(*v), peaks[k]) for k, v in timed.items()
    }


def bench_head(args, devices, log, result, save):
    """The method table of each (device, V): rows of result's cases and spread, an entry of its
    meta's head_groups."""
    for device, V in itertools.product(devices, args.vocab):
        i, res = measure(
            args,
            device,
            V,
            args.tokens,
            args.d_model,
            args.seq_len,
            [(n, None) for n in args.methods],
            args.repeats,
            args.warmup,
            "head",
        )
        result["meta"]["head_groups"].append(i)
        med = {
            n: (statistics.median(res[n, None][0]), statistics.median(res[n, None][1]))
            for n in args.methods
        }
        (mle_wall, _, mle_peak), rows = res["mle", None], []
        for n in args.methods:
            (wall, cpu, peak), (ms, cpu_ms) = res[n, None], med[n]
            result["cases"].append(
                c := dict(
                    method=n,
                    V=V,
                    device=device,
                    ms=round(ms, 3),
                    ms_ratio_vs_mle=round(ms / med["mle"][0], 4),
                    peak_mb=peak and round(peak, 2),
                    mem_ratio_vs_mle=round(peak / mle_peak, 4) if mle_peak else None,
                )
            )
            result["spread"].append(
                s := dict(
                    method=n,
                    V=V,
                    device=device,
                    ms_min=round(min(wall), 3),
                    ms_max=round(max(wall), 3),
                    samples_ms=[round(x, 3) for x in wall],
                    cpu_ms=round(cpu_ms, 3),
                    cpu_ratio_vs_mle=round(cpu_ms / med["mle"][1], 4),
                    cpu_samples_ms=[round(x, 3) for x in cpu],
                )
            )
            rows.append(
                [
                    n,
                    f"{ms:.0f} ({min(wall):.0f}-{max(wall):.0f})",
                    f"{c['ms_ratio_vs_mle']:.2f}x ({min(wall) / min(mle_wall):.2f}x)",
                    f"{s['cpu_ratio_vs_mle']:.2f}x",
                    format_or_na(c["peak_mb"], "{:.0f}"),
                    format_or_na(c["mem_ratio_vs_mle"], "{:.2f}x"),
                ]
            )
        log(
            table(
                f"\nhead: T={args.tokens}, d={args.d_model}, V={V}, {device}; "
                f"alpha={i['alpha']:.4g}: rare vocab {100 * i['rare_vocab']:.1f}%, rare-target "
                f"rows {100 * i['rare_rows']:.1f}%; median of {args.repeats} (min-max); load "
                f"average {i['load_before'][0]:.1f} -> {i['load_after'][0]:.1f}",
                [
                    "method",
                    "ms: median (min-max)",
                    "time vs MLE: median (min)",
                    "CPU time vs MLE",
                    "peak MB",
                    "memory vs MLE",
                ],
                rows,
            )
        )
        save()


def bench_chunked(args, devices, log):
    """chunk_size at large V: the same step timed and measured with the full T x V head and with
    chunks."""
    rows, T, d = [], args.chunk_tokens, args.chunk_d
    for device, V in itertools.product(devices, args.chunk_vocab):
        candidates = [(m, c or None) for m in ("mle", "agg") for c in args.chunk_sizes]
        _, res = measure(args, device, V, T, d, T, candidates, args.chunk_repeats, 1, "chunked")
        rows += [
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
            for (m, c), (wall, _, peak) in res.items()
        ]
    log(
        table(
            "\nchunked head (chunk_size of loss()): peak MB above set-up; one rows x V float32 "
            "buffer = logits MB",
            ["method", "V", "T", "d", "chunk_size", "ms", "peak MB", "logits MB", "weight grad MB"],
            [
                [
                    r["method"],
                    *(str(r[k]) for k in "VTd"),
                    str(r["chunk_size"] or "none (T)"),
                    *(
                        format_or_na(r[k], "{:.0f}")
                        for k in ("ms", "peak_mb", "logits_mb", "weight_grad_mb")
                    ),
                ]
                for r in rows
            ],
        )
    )
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

    names = ["mle"] + [m for m in args.lm_methods if m != "mle"]
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
            rare[name] = float(method.rare_mask().double().mean())
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
    log(
        table(
            f"\ntrain_lm.py training step, cpu preset ({res['model']}), V={V}, "
            f"{res['tokens_per_step']} tokens/step, AGG alpha={args.lm_alpha} window={K}; data: "
            f"{res['data']}; median of {args.lm_rounds} rounds x {args.lm_steps} steps (min-max)",
            ["method", "tokens/s (min-max)", "vs MLE", "rare share of vocab"],
            [
                [
                    r["method"],
                    f"{r['tokens_per_s']:.0f} ({r['min']:.0f}-{r['max']:.0f})",
                    f"{r['ratio_vs_mle']:.2f}x",
                    "" if r["rare_vocab"] is None else f"{100 * r['rare_vocab']:.1f}%",
                ]
                for r in rows
            ],
        )
    )
    return res


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m studies.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="out/bench", help="folder for bench.json")
    p.add_argument(
        "--results", default=None, metavar="FILE", help="also write bench.json's content to FILE"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one V (8192), T=1024, d=128, small chunked case, no lm",
    )
    p.add_argument("--sections", default="head,chunked,lm", help="comma list of head, chunked, lm")
    p.add_argument(
        "--device",
        default="cpu,cuda" if torch.cuda.is_available() else "cpu",
        help="cpu | cuda | cpu,cuda",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=NAMES,
        choices=NAMES,
        metavar="NAME",
        help="candidates (agg.METHODS names, official-ref, torch-ce); mle is always added",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: the loss autocast",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (on a busy machine 1 is steadier)",
    )
    g = p.add_argument_group("head")
    g.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768, 50304])
    g.add_argument("--tokens", type=int, default=4096, help="T: positions per step")
    g.add_argument("--d-model", type=int, default=512)
    g.add_argument(
        "--seq-len",
        type=int,
        default=1024,
        help="targets are (T / seq-len, seq-len): ul needs (B, T)",
    )
    g.add_argument(
        "--repeats", type=int, default=3, help="timed runs per candidate (after --warmup)"
    )
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument(
        "--window", type=int, default=200, help="AGG counter memory K (steps of synthetic history)"
    )
    g.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    g = p.add_argument_group("chunked")
    g.add_argument("--chunk-vocab", type=int, nargs="+", default=[131072, 262144])
    g.add_argument("--chunk-tokens", type=int, default=1024)
    g.add_argument("--chunk-d", type=int, default=256)
    g.add_argument(
        "--chunk-sizes", type=int, nargs="+", default=[0, 512, 128], help="0 = unchunked (T x V)"
    )
    g.add_argument("--chunk-repeats", type=int, default=2)
    g = p.add_argument_group("lm")
    g.add_argument(
        "--lm-methods",
        nargs="+",
        default=list(agg.METHODS),
        choices=list(agg.METHODS),
        metavar="NAME",
    )
    g.add_argument(
        "--lm-alpha", type=float, default=0.075, help="AGG alpha (~12%% of the vocabulary rare)"
    )
    g.add_argument(
        "--lm-steps", type=int, default=3, help="timed training steps per method per round"
    )
    g.add_argument(
        "--lm-rounds", type=int, default=3, help="interleaved rounds (after one warm-up step each)"
    )
    return p


def check_range(p, args, flag, lo, hi=None):
    """argparse's one line when --flag (a number or a list of them) is outside [lo, hi] (hi None:
    any finite value; NaN is never inside); an unset flag passes."""
    value = getattr(args, flag)
    values = value if isinstance(value, list) else [value]
    top = sys.float_info.max if hi is None else hi
    bad = [v for v in values if v is not None and not lo <= v <= top]
    if bad:
        kind = "a finite number " if isinstance(bad[0], float) else ""
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        p.error(f"--{flag.replace('_', '-')} must be {kind}{bound}, got {bad[0]}")


def make_folder(p, flag, folder):
    """The folder a flag writes in, created before any measurement; argparse's one line when it
    cannot be."""
    try:
        os.makedirs(folder or ".", exist_ok=True)
    except OSError as e:
        p.error(f"{flag}: cannot create the folder {folder} ({e.strerror}); choose another")


def check_args(p, args):
    """The flags argparse cannot check: sizes, the devices, the output paths."""
    sizes = ("tokens", "d_model", "seq_len", "repeats", "window", "chunk_tokens", "chunk_d")
    for flag in sizes + ("chunk_repeats", "lm_steps", "lm_rounds"):
        check_range(p, args, flag, 1)
    for flag in ("vocab", "chunk_vocab"):  # make_data's rare group needs two ids at least
        check_range(p, args, flag, 2)
    for flag in ("warmup", "chunk_sizes", "lm_alpha"):
        check_range(p, args, flag, 0)
    check_range(p, args, "threads", 0, os.cpu_count())
    if args.tokens % args.seq_len:
        p.error(f"--tokens {args.tokens} must be a multiple of --seq-len {args.seq_len}")
    devices = [d.strip() for d in args.device.split(",")]
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    valid = ["cpu", "cuda"] + gpus
    unknown = [d for d in devices if d not in valid]
    if unknown:
        p.error(f"--device: unknown {unknown}; valid here: {', '.join(valid)}")
    if not args.out:
        p.error("--out must name a folder, e.g. --out out/bench")
    make_folder(p, "--out", args.out)
    results = args.results
    if results and os.path.exists(results) and not os.path.isfile(results):
        p.error(f"--results {results}: not a regular file; name a .json file")
    if results:
        make_folder(p, "--results", os.path.dirname(results))
    return devices


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
    sections="head,chunked",
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
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in ("head", "chunked", "lm")]
    if bad or not sections:
        parser.error(f"--sections: unknown {bad or 'empty list'}; valid: head, chunked, lm")
    devices = check_args(parser, args)
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
        f"bench: torch {meta['torch']}, {meta['threads']} threads, devices {devices}, "
        f"load average {' '.join(f'{x:.2f}' for x in meta['load_before'])}"
    )
    result = {
        "cases": [],
        "spread": [],
        "chunked": [],
        "lm": {"skipped": "section not run"},
        "meta": meta,
    }
    path = os.path.join(args.out, "bench.json")

    def save():  # after every group, so a long run leaves its finished parts behind
        for p in [path] + ([args.results] if args.results else []):
            runlib.write_json(p, result)
        runlib.write_text(os.path.join(args.out, "bench.md"), "\n".join(report) + "\n")

    t0 = time.time()
    with memory_guard():
        if "head" in sections:
            bench_head(args, devices, log, result, save)
        if "chunked" in sections:
            result["chunked"] = bench_chunked(args, devices, log)
            save()
        if "lm" in sections:
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
