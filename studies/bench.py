"""What each method of agg.py costs next to MLE, measured in one run. From the repository root:

    python -m studies.bench --threads 1   # T=4096, d=512, V in {8192, 32768, 50304} + chunked head + train_lm tokens/s
                                          # (~1 h on 2 CPU cores; on a GPU machine the head adds CUDA rows)
    python -m studies.bench --quick       # one small V, few repeats: a spot check in about a minute
    python -m studies.bench --plan paper-6l   # what a preset of train_lm.py / train_nmt.py costs, by formula

Sections (--sections), each interleaving its candidates (the order rotates every round) with ratios vs MLE's rows:
  head     observe() + loss() + backward() of the loss head (hidden (T, d) -> grads wrt hidden and the tied weight)
           for every agg.METHODS entry, `official-ref` (studies.official: three logit matrices, dense T x V gates,
           T x T counting) and `torch-ce` (F.cross_entropy(h @ W.T, y)): median and min-max wall and CPU time, and
           peak memory (CUDA max_memory_allocated; on CPU the peak RSS above the set-up of a fresh process per case);
  chunked  the chunk_size option of loss() at large vocabularies: peak head memory ~ chunk x V instead of T x V;
  lm       tokens/s of train_lm.py's training step per method (cpu preset on CPU).
On a machine shared with other jobs use --threads 1 and read the CPU-time column (process CPU time does not count
the time other jobs hold the cores); timings on a shared machine are noisy: compare rows of one run only.
Writes OUT/bench.md (the printed tables) and OUT/bench.json (--out OUT, default out/bench):
  {"cases": [{"method", "V", "device", "ms", "ms_ratio_vs_mle", "peak_mb", "mem_ratio_vs_mle"}, ...],
   "spread": [{"method", "V", "device", "ms_min", "ms_max", "samples_ms", "cpu_ms", "cpu_ratio_vs_mle",
               "cpu_samples_ms"}, ...], "chunked": [...], "lm": {...}, "meta": {...}}
(ms: median wall-clock ms of one step; peak_mb: peak memory of one step above its set-up.)
"""
import argparse
import functools
import gc
import hashlib
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import agg
import runlib
import train_lm
import train_nmt
from data import prepare_lm
from studies.official import OfficialAGGRef

EXTRA = ["official-ref", "torch-ce"]  # candidates that are not agg.METHODS entries
SPECIAL_IDS = [0]  # never rare (like pad/eos)


class TorchCE:
    """Plain PyTorch: F.cross_entropy(h @ W.T, y) (logits, log-softmax and its gradient: ~3 T x V buffers)."""
    name = "torch-ce"

    def observe(self, targets):
        pass

    def loss(self, hidden, weight, targets, chunk_size=None):
        return F.cross_entropy((hidden @ weight.T).reshape(-1, weight.shape[0]).float(), targets.reshape(-1))


# -------------------------------------------------------------------------------------------------- the loss head
def make_data(V, T, d, seq_len, seed, rare_fraction, window, device, n_batches=4):
    """Inputs shared by all candidates of one (V, device), deterministic in `seed` (rebuilt in memory children).
    Targets ~ Zipf(1.1) over the vocabulary, shaped (T / seq_len, seq_len) (ul needs (B, T)). `window` previous steps
    fill the counters of agg / official-ref; their token counts stand in for the training counts of the static-group
    methods. alpha is chosen so that about `rare_fraction` of the vocabulary is rare, from the counts the counters
    will hold."""
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
    p = (p / p.sum()).float()
    draw = torch.multinomial(p, (window + n_batches) * T, replacement=True, generator=g).view(-1, T // seq_len, seq_len)
    history, batches = draw[:window], [b.to(device) for b in draw[window:]]
    counts = torch.bincount(history.reshape(-1), minlength=V)
    counts[SPECIAL_IDS] = counts.max()
    # alpha: the count threshold whose rare share (a_k < threshold) is closest to rare_fraction (at least 1 rare)
    values = counts.unique()
    shares = torch.searchsorted(counts.sort().values, values[1:]).double() / V  # share of tokens below each value
    best = int((shares - rare_fraction).abs().argmin()) + 1
    alpha = float(values[best]) / window
    hidden = torch.randn(T // seq_len, seq_len, d, generator=g).to(device)
    weight = (0.02 * torch.randn(V, d, generator=g)).to(device)
    rare = counts < values[best]
    rare_rows = float(torch.cat([rare[b.cpu().reshape(-1)] for b in batches]).double().mean())
    return dict(hidden=hidden, weight=weight, history=history, batches=batches, counts=counts, alpha=alpha,
                rare_vocab=float(rare.double().mean()), rare_rows=rare_rows, window=window,
                rare_fraction=rare_fraction)


def build_candidate(name, data):
    """The method object of candidate `name`, its counters filled with data['history']."""
    V = data["weight"].shape[0]
    if name == "official-ref":
        m = OfficialAGGRef(V, alpha=data["alpha"], window=data["window"], special_ids=SPECIAL_IDS)
        m.prefill(data["history"])
        return m
    if name == "torch-ce":
        return TorchCE()
    family = agg.agg_family(name)
    hp = dict(alpha=data["alpha"], window=data["window"]) if family else {}
    if "rare_fraction" in agg.METHODS[name].defaults:
        hp.update(rare_fraction=data["rare_fraction"])
    m = agg.build_method(name, vocab_size=V, counts=data["counts"], special_ids=SPECIAL_IDS, **hp)
    for y in data["history"] if family else []:
        m.observe(y)
    return m


class Runner:
    """One candidate: its own leaf tensors (sharing storage with the data), its method, one step = observe + loss +
    backward, on the next batch of targets."""

    def __init__(self, name, data, chunk_size=None):
        self.name, self.chunk_size = name, chunk_size
        self.method = build_candidate(name, data)
        self.hidden = data["hidden"].detach().requires_grad_()  # own leaves: freeze-rare hooks its weight
        self.weight = data["weight"].detach().requires_grad_()
        self.batches, self.i = data["batches"], 0

    def step(self, hidden=None, y=None):
        self.hidden.grad = self.weight.grad = None
        if y is None:
            y, self.i = self.batches[self.i % len(self.batches)], self.i + 1
        self.method.observe(y)  # once per optimizer step: part of each step's cost
        kw = {"chunk_size": self.chunk_size} if self.chunk_size else {}
        loss = self.method.loss(self.hidden if hidden is None else hidden, self.weight, y, **kw)
        loss.backward()
        return loss


def interleave(names, rounds, warmup, run, desc):
    """run(name, round) for each name in each of warmup + rounds rounds, the order rotating every round: {name: [what
    run returned in each round after the warm-up]}."""
    out = {n: [] for n in names}
    with tqdm(total=(warmup + rounds) * len(names), desc=desc, leave=False, file=sys.stderr) as bar:
        for r in range(warmup + rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                m = run(n, r)
                out[n] += [m] if r >= warmup else []
                bar.update()
    return out


def timed_step(runner, device):
    """(wall ms, process CPU ms) of one step. On CPU the process CPU time does not count the time other jobs hold the
    cores (with 1 thread it is the step's own work); wall time is the `ms` of bench.json."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda device: None
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    runner.step()
    sync(device)
    ms = 1000 * (time.perf_counter() - t0), 1000 * (time.process_time() - c0)
    runner.hidden.grad = runner.weight.grad = None
    return ms


# --------------------------------------------------------------- peak memory: CUDA in process, CPU in a fresh process
def _cpu_peak_child(spec, conn):
    """In a fresh process: build the case, warm up on a few positions, then the peak RSS of one full step above its
    set-up (VmHWM, reset to the current RSS by /proc/self/clear_refs on Linux >= 4.0)."""
    def status_kb(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    try:
        torch.set_num_threads(spec.pop("threads"))
        name, chunk_size = spec.pop("method"), spec.pop("chunk_size")
        data = make_data(device="cpu", **spec)
        runner = Runner(name, data, chunk_size)
        runner.step(hidden=runner.hidden[:1, :16], y=runner.batches[0][:1, :16])  # every code path, a small allocation
        runner.hidden.grad = runner.weight.grad = None
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        base = status_kb("VmRSS")
        runner.step()
        conn.send({"peak_mb": max(status_kb("VmHWM") - base, 0) / 1024})
    except Exception as e:  # report it in the parent
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


@functools.cache
def mp_context():
    """forkserver with torch + agg preloaded: every case gets a fresh process without paying torch's import."""
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["torch", "agg"])
    return ctx


def cpu_peak_mb(method, V, T, d, seq_len, seed, rare_fraction, window, chunk_size=None):
    """Peak RSS (MB) of one step of `method` above its set-up, in a fresh process."""
    spec = dict(method=method, V=V, T=T, d=d, seq_len=seq_len, seed=seed, rare_fraction=rare_fraction,
                window=window, chunk_size=chunk_size, threads=torch.get_num_threads())
    parent, child = mp_context().Pipe(duplex=False)
    proc = mp_context().Process(target=_cpu_peak_child, args=(spec, child))
    # A fixed glibc mmap threshold: every buffer >= 1 MiB is its own mapping, returned to the OS when freed, so the
    # peak RSS counts live tensors (glibc's dynamic threshold would keep some freed buffers resident, at random).
    # Set while the process (or the forkserver, on its first use) starts.
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2 ** 20)
    try:
        proc.start()
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
        os.environ.update({} if old is None else {"MALLOC_MMAP_THRESHOLD_": old})
    child.close()
    try:
        out = parent.recv()
    except EOFError:  # killed before it could answer (the kernel's OOM killer, most likely)
        out = {"error": "the child process died; out of memory? Try a smaller --tokens / --vocab, or --no-memory"}
    proc.join()
    if "error" in out:
        raise RuntimeError(f"peak memory of {method} at V={V}: {out['error']} (exit code {proc.exitcode})")
    return out["peak_mb"]


def peak_mb(runner, device, V, T, d, seq_len, args):
    """Peak memory (MB) of one step of `runner` above its set-up: CUDA max_memory_allocated, or cpu_peak_mb."""
    if device == "cpu":
        return cpu_peak_mb(runner.name, V, T, d, seq_len, args.seed, args.rare_fraction, args.window,
                           runner.chunk_size)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    runner.step()
    torch.cuda.synchronize(device)
    runner.hidden.grad = runner.weight.grad = None
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


# ------------------------------------------------------------------------------------------------------- sections
def table(title, header, rows):
    """A markdown table under a title line."""
    return "\n".join([title, "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def fmt(x, spec):
    return "n/a" if x is None else spec.format(x)


def measure(args, device, V, T, d, seq_len, candidates, repeats, warmup, desc):
    """Time the candidates ((method, chunk_size) pairs) interleaved on one data set, then measure their peak memory:
    (the data's alpha and rare shares, {candidate: ([wall ms], [CPU ms], peak MB or None)})."""
    data = make_data(V, T, d, seq_len, args.seed, args.rare_fraction, args.window, device)
    info = dict(alpha=data["alpha"], rare_vocab=data["rare_vocab"], rare_rows=data["rare_rows"],
                load_before=os.getloadavg())
    runners = {(m, c): Runner(m, data, c) for m, c in candidates}
    timed = interleave(list(runners), repeats, warmup, lambda k, r: timed_step(runners[k], device),
                       f"{desc} {device} V={V}")
    peaks = {k: None if args.no_memory else peak_mb(runners[k], device, V, T, d, seq_len, args)
             for k in tqdm(runners, desc=f"memory {device} V={V}", leave=False, file=sys.stderr)}
    del runners, data
    gc.collect()
    return info, {k: ([t[0] for t in timed[k]], [t[1] for t in timed[k]], peaks[k]) for k in timed}


def bench_head(args, devices, log, cases, spread, info, save=lambda: None):
    """The method table: appends to cases, spread and info (one entry per (device, V)), save() after each group."""
    names = args.methods
    for device in devices:
        for V in args.vocab:
            group, res = measure(args, device, V, args.tokens, args.d_model, args.seq_len, [(n, None) for n in names],
                                 args.repeats, args.warmup, "head")
            info.append(i := dict(V=V, device=device, **group, load_after=os.getloadavg()))
            ms, cpu_ms = ({n: statistics.median(res[n, None][j]) for n in names} for j in (0, 1))
            peak = {n: res[n, None][2] for n in names}
            for n in names:
                wall, cpu = res[n, None][:2]
                cases.append(dict(method=n, V=V, device=device, ms=round(ms[n], 3),
                                  ms_ratio_vs_mle=round(ms[n] / ms["mle"], 4),
                                  peak_mb=None if peak[n] is None else round(peak[n], 2),
                                  mem_ratio_vs_mle=round(peak[n] / peak["mle"], 4) if peak["mle"] else None))
                spread.append(dict(method=n, V=V, device=device, ms_min=round(min(wall), 3), ms_max=round(max(wall), 3),
                                   samples_ms=[round(x, 3) for x in wall], cpu_ms=round(cpu_ms[n], 3),
                                   cpu_ratio_vs_mle=round(cpu_ms[n] / cpu_ms["mle"], 4),
                                   cpu_samples_ms=[round(x, 3) for x in cpu]))
            rows = list(zip(cases[-len(names):], spread[-len(names):]))
            mle_min = spread[-len(names) + names.index("mle")]["ms_min"]
            log(table(f"\nhead: T={args.tokens}, d={args.d_model}, V={V}, {device}; alpha={i['alpha']:.4g}: rare vocab "
                      f"{100 * i['rare_vocab']:.1f}%, rare-target rows {100 * i['rare_rows']:.1f}%; median of "
                      f"{args.repeats} (min-max); load average {i['load_before'][0]:.1f} -> {i['load_after'][0]:.1f}",
                      ["method", "ms: median (min-max)", "time vs MLE: median (min)", "CPU time vs MLE", "peak MB",
                       "memory vs MLE"],
                      [[c["method"], f"{c['ms']:.0f} ({s['ms_min']:.0f}-{s['ms_max']:.0f})",
                        f"{fmt(c['ms_ratio_vs_mle'], '{:.2f}x')} ({fmt(s['ms_min'] / mle_min, '{:.2f}x')})",
                        fmt(s["cpu_ratio_vs_mle"], "{:.2f}x"), fmt(c["peak_mb"], "{:.0f}"),
                        fmt(c["mem_ratio_vs_mle"], "{:.2f}x")] for c, s in rows]))
            save()


def bench_chunked(args, devices, log):
    """chunk_size at large V: the same step timed and measured with the full T x V head and with chunks."""
    rows, T, d = [], args.chunk_tokens, args.chunk_d
    for device in devices:
        for V in args.chunk_vocab:
            _, res = measure(args, device, V, T, d, T, [(m, c or None) for m in args.chunk_methods
                                                        for c in args.chunk_sizes], args.chunk_repeats, 1, "chunked")
            rows += [dict(method=m, V=V, T=T, d=d, device=device, chunk_size=c, ms=round(statistics.median(wall), 3),
                          peak_mb=None if peak is None else round(peak, 2),
                          logits_mb=round((c or T) * V * 4 / 2 ** 20, 2),  # one float32 rows x V buffer
                          weight_grad_mb=round(V * d * 4 / 2 ** 20, 2)) for (m, c), (wall, _, peak) in res.items()]
    if rows:
        log(table("\nchunked head (chunk_size of loss()): peak MB above set-up; one rows x V float32 buffer = logits MB",
                  ["method", "V", "T", "d", "chunk_size", "ms", "peak MB", "logits MB", "weight grad MB"],
                  [[r["method"], str(r["V"]), str(r["T"]), str(r["d"]), str(r["chunk_size"] or "none (T)"),
                    f"{r['ms']:.0f}", fmt(r["peak_mb"], "{:.0f}"), f"{r['logits_mb']:.0f}",
                    f"{r['weight_grad_mb']:.0f}"] for r in rows]))
    return rows


class LMTrainer:
    """One method's model + optimizer + method, stepped by train_lm.train_step: the training step of train_lm.py's
    main loop (observe, micro-batches of features -> method.loss -> backward, clip, AdamW step)."""

    def __init__(self, cfg, V, counts, special, **sizes):
        torch.manual_seed(0)  # same initial model for every method
        self.model = train_lm.build_model(cfg, V).train()
        self.method, _ = runlib.build_method(cfg, {}, vocab_size=V, counts=counts, special_ids=special, **sizes)
        self.opt, self.cfg, self.autocast = runlib.make_optimizer(self.model, cfg), cfg, runlib.autocast(cfg)

    def step(self, x_all, y_all):
        train_lm.train_step(self.model, self.model, self.method, self.opt, x_all, y_all, self.cfg["micro_batch"],
                            self.autocast)


def bench_lm(args, log):
    """tokens/s of train_lm.py's training step per method vs MLE (cpu preset), on its training split (synthetic Zipf
    ids if that cannot be prepared: the step's cost does not depend on the text)."""
    cfg = train_lm.make_config(device="cpu", preset="cpu")
    try:
        data = prepare_lm(cfg, log=lambda *a: None)
        ids = torch.from_numpy(data["ids"]["train"].astype("int64"))
        V, counts, special = data["vocab_size"], data["counts"], [data["pad_id"], data["eos_id"]]
        source = f"train_lm.py training split ({data['dir']})"
    except Exception as e:  # noqa: BLE001 - fall back, and say so in the result
        V = cfg["vocab_size"]
        p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
        ids = torch.multinomial(p, 500_000, replacement=True, generator=torch.Generator().manual_seed(args.seed))
        counts, special = torch.bincount(ids, minlength=V), [0]
        source = f"synthetic Zipf(1.1) ids (data.prepare_lm failed: {type(e).__name__}: {e})"
    block, tps = cfg["block_size"], cfg["tokens_per_step"]
    seqs_per_step = max(1, round(tps / block))
    n_windows = (len(ids) - 1) // block
    steps_per_epoch = n_windows / seqs_per_step
    windows = ids[:n_windows * block + 1]

    def batch(step):  # consecutive windows (the cost does not depend on the shuffling)
        starts = [((step * seqs_per_step + i) % n_windows) * block for i in range(seqs_per_step)]
        t = torch.stack([windows[s:s + block + 1] for s in starts])
        return t[:, :-1], t[:, 1:]

    names = ["mle"] + [m for m in args.lm_methods if m != "mle"]
    trainers = {}
    K = max(1, int(round(steps_per_epoch)))
    for name in names:
        trainers[name] = LMTrainer(dict(cfg, method=name, alpha=args.lm_alpha if agg.agg_family(name) else None), V,
                                   counts, special, steps_per_epoch=steps_per_epoch, tokens_per_step=tps)
        for s in range(K if "window" in trainers[name].method.hparams else 0):  # a full window, as after epoch 1
            trainers[name].method.observe(batch(s)[1])
    rare = {n: float(t.method.rare_mask().double().mean()) for n, t in trainers.items()
            if t.method.rare_mask() is not None}
    rounds, step = [], K
    for r in range(1 + args.lm_rounds):  # round 0: warm-up, one step
        rounds.append([batch(step + i) for i in range(args.lm_steps if r else 1)])
        step += len(rounds[-1])

    def tokens_per_s(name, r):
        t0 = time.perf_counter()
        for x, y in rounds[r]:
            trainers[name].step(x, y)
        return len(rounds[r]) * seqs_per_step * block / (time.perf_counter() - t0)
    samples = interleave(names, args.lm_rounds, 1, tokens_per_s, "lm steps")
    med = {n: statistics.median(s) for n, s in samples.items()}
    rows = [dict(method=n, tokens_per_s=round(med[n], 1), ratio_vs_mle=round(med[n] / med["mle"], 4),
                 min=round(min(samples[n]), 1), max=round(max(samples[n]), 1), rare_vocab=rare.get(n))
            for n in names]
    res = dict(preset="cpu", data=source, vocab_size=V, tokens_per_step=seqs_per_step * block, block_size=block,
               window=K, alpha=args.lm_alpha, steps_per_round=args.lm_steps, rounds=args.lm_rounds, rows=rows,
               model={k: cfg[k] for k in train_lm.MODEL_FIELDS})
    log(table(f"\ntrain_lm.py training step, cpu preset ({res['model']}), V={V}, {res['tokens_per_step']} tokens/step, "
              f"AGG alpha={args.lm_alpha} window={K}; data: {source}; median of {args.lm_rounds} rounds x "
              f"{args.lm_steps} steps (min-max)", ["method", "tokens/s (min-max)", "vs MLE", "rare share of vocab"],
              [[r["method"], f"{r['tokens_per_s']:.0f} ({r['min']:.0f}-{r['max']:.0f})", f"{r['ratio_vs_mle']:.2f}x",
                "" if r["rare_vocab"] is None else f"{100 * r['rare_vocab']:.1f}%"] for r in rows]))
    return res


# ----------------------------------------------------------------------------------------------------- by formula
def plan(task, preset, gpus=1, tflops=100.0, mfu=0.4):
    """What a preset costs, by formula: parameters (counted on the meta device), training FLOPs per token
    6 N + 12 L d T (Kaplan et al. 2020: forward + backward of every weight, plus attention scores over a context of
    T), the run's tokens and FLOPs, memory per GPU (16 bytes per parameter for fp32 weights, gradients and Adam's two
    moments; activations ~34 d bytes per token and layer in bf16 (Korthikanti et al. 2022, no recomputation) for a
    micro-batch; the head's fp32 logits buffer, micro-batch tokens x V x 4 bytes), and hours at gpus x tflops x mfu."""
    script = train_lm if task == "lm" else train_nmt
    cfg = dict(script.PRESETS[preset])
    with torch.device("meta"):
        model = script.build_model(cfg, cfg["vocab_size"])
    if task == "lm":
        layers, ctx, micro = cfg["n_layer"], cfg["block_size"], cfg["micro_batch"] * cfg["block_size"]
    else:
        layers, ctx, micro = cfg["enc_layers"] + cfg["dec_layers"], cfg["max_len"] // 2, cfg["micro_tokens"]
    n = sum(p.numel() for p in model.parameters())
    d, V = cfg["d_model"], cfg["vocab_size"]
    flops_token = 6 * n + 12 * layers * d * ctx
    tokens = cfg["max_steps"] * cfg["tokens_per_step"]
    total = flops_token * tokens
    mem = 16 * n + 34 * d * layers * micro + 4 * micro * V
    hours = total / (gpus * tflops * 1e12 * mfu) / 3600
    return dict(task=task, preset=preset, params=n, flops_per_token=flops_token, tokens=tokens, flops=total,
                memory_per_gpu_gb=mem / 1e9, gpus=gpus, tflops=tflops, mfu=mfu, hours=hours,
                micro_batch_tokens=micro, steps=cfg["max_steps"])


def build_parser():
    p = argparse.ArgumentParser(prog="python -m studies.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench", help="folder for bench.json")
    p.add_argument("--results", default=None, metavar="FILE",
                   help="also write bench.json's content to FILE (the figures RESULTS.md quotes, in results/)")
    p.add_argument("--plan", default=None, metavar="PRESET",
                   help="print what a preset of train_lm.py / train_nmt.py costs (parameters, FLOPs, tokens, memory "
                        "per GPU, hours) instead of timing anything")
    p.add_argument("--gpus", type=int, default=1, help="--plan: number of GPUs")
    p.add_argument("--tflops", type=float, default=312.0, help="--plan: peak TFLOP/s per GPU (A100 bf16: 312)")
    p.add_argument("--mfu", type=float, default=0.4, help="--plan: model FLOPs utilisation")
    p.add_argument("--quick", action="store_true",
                   help="one V (8192), T=1024, d=128, 2 repeats, a small chunked case, no lm: under a minute")
    p.add_argument("--sections", default="head,chunked,lm", help="comma list of head, chunked, lm")
    p.add_argument("--device", default=None, help="cpu | cuda | cpu,cuda (default: cpu, plus cuda if available)")
    p.add_argument("--methods", nargs="+", default=list(agg.METHODS) + EXTRA,
                   help="candidates (agg.METHODS names, official-ref, torch-ce); mle is always added")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default torch's; on a busy machine 1 thread is steadier)")
    g = p.add_argument_group("head")
    g.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768, 50304])
    g.add_argument("--tokens", type=int, default=4096, help="T: positions per step")
    g.add_argument("--d-model", type=int, default=512)
    g.add_argument("--seq-len", type=int, default=1024, help="targets are (T / seq-len, seq-len): ul needs (B, T)")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per candidate (after --warmup)")
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--rare-fraction", type=float, default=0.2,
                   help="share of the vocabulary in the rare group (sets agg's alpha and the static methods')")
    g.add_argument("--window", type=int, default=200, help="AGG counter memory K (steps of synthetic history)")
    g.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    g = p.add_argument_group("chunked")
    g.add_argument("--chunk-vocab", type=int, nargs="+", default=[131072, 262144])
    g.add_argument("--chunk-tokens", type=int, default=1024)
    g.add_argument("--chunk-d", type=int, default=256)
    g.add_argument("--chunk-sizes", type=int, nargs="+", default=[0, 512, 128], help="0 = unchunked (T x V)")
    g.add_argument("--chunk-methods", nargs="+", default=["mle", "agg"])
    g.add_argument("--chunk-repeats", type=int, default=2)
    g = p.add_argument_group("lm")
    g.add_argument("--lm-methods", nargs="+", default=list(agg.METHODS))
    g.add_argument("--lm-alpha", type=float, default=0.075,
                   help="AGG alpha for the lm section (~12%% of the vocabulary rare at 4k tokens per step)")
    g.add_argument("--lm-steps", type=int, default=3, help="timed training steps per method per round")
    g.add_argument("--lm-rounds", type=int, default=3, help="interleaved rounds (after one warm-up step each)")
    return p


QUICK = dict(vocab=[8192], tokens=1024, d_model=128, seq_len=256, repeats=2, warmup=1,
             chunk_vocab=[16384], chunk_tokens=512, chunk_d=64, chunk_sizes=[0, 64], chunk_repeats=1,
             sections="head,chunked", window=50)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plan:
        if args.plan not in train_lm.PRESETS and args.plan not in train_nmt.PRESETS:
            parser.error(f"--plan {args.plan}: not a preset of train_lm.py or train_nmt.py")
        p = plan("lm" if args.plan in train_lm.PRESETS else "nmt", args.plan, args.gpus, args.tflops, args.mfu)
        print(f"{p['task']} preset {p['preset']}: {p['params'] / 1e6:.1f}M parameters, "
              f"{p['flops_per_token'] / 1e9:.2f} GFLOPs per training token, {p['steps']} steps x "
              f"{p['tokens'] // p['steps']} tokens = {p['tokens'] / 1e9:.2f}B tokens, {p['flops']:.2e} FLOPs; "
              f"~{p['memory_per_gpu_gb']:.1f} GB per GPU at {p['micro_batch_tokens']} tokens per micro-batch; "
              f"{p['hours']:.1f} h on {p['gpus']} GPU(s) at {p['tflops']:g} TFLOP/s x MFU {p['mfu']:g}")
        return p
    if args.quick:  # quick values, unless a flag was given explicitly
        explicit = runlib.explicit_flags(build_parser(), argv)
        vars(args).update({k: v for k, v in QUICK.items() if k not in explicit})
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for flag, given, valid in (("--sections", sections, ["head", "chunked", "lm"]),
                               ("--methods", args.methods, list(agg.METHODS) + EXTRA),
                               ("--lm-methods", args.lm_methods, list(agg.METHODS))):
        bad = [x for x in given if x not in valid]
        if bad:
            parser.error(f"{flag}: unknown {bad}; valid: {', '.join(valid)}")
    if args.tokens % args.seq_len:
        parser.error(f"--tokens {args.tokens} must be a multiple of --seq-len {args.seq_len}")
    args.methods = ["mle"] + [m for m in args.methods if m != "mle"]
    devices = [d.strip() for d in args.device.split(",")] if args.device else \
        ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = []

    def log(s):
        report.append(s)
        print(s, flush=True)

    meta = dict(command="python -m studies.bench " + " ".join(argv), torch=torch.__version__,
                threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                cuda=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                load_before=os.getloadavg(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                tokens=args.tokens, d_model=args.d_model, seq_len=args.seq_len, repeats=args.repeats,
                warmup=args.warmup, window=args.window, rare_fraction=args.rare_fraction,
                memory="CUDA: max_memory_allocated above set-up; CPU: peak RSS (VmHWM) above set-up of a fresh process",
                agg_sha256=hashlib.sha256(open(agg.__file__, "rb").read()).hexdigest()[:16], head_groups=[])
    log(f"bench: torch {meta['torch']}, {meta['threads']} threads, devices {devices}, "
        f"load average {' '.join(f'{x:.2f}' for x in meta['load_before'])}")
    result = {"cases": [], "spread": [], "chunked": [], "lm": {"skipped": "section not run"}, "meta": meta}
    path = os.path.join(args.out, "bench.json")

    def save():  # after every group, so a long run leaves its finished parts behind
        for p in [path] + ([args.results] if args.results else []):
            runlib.write_json(p, result)
        runlib.write_text(os.path.join(args.out, "bench.md"), "\n".join(report) + "\n")

    t0 = time.time()
    if "head" in sections:
        bench_head(args, devices, log, result["cases"], result["spread"], meta["head_groups"], save)
    if "chunked" in sections:
        result["chunked"] = bench_chunked(args, devices, log)
        save()
    if "lm" in sections:
        result["lm"] = bench_lm(args, log)
    meta.update(load_after=os.getloadavg(), seconds=round(time.time() - t0, 1))
    log(f"\nload average after: {' '.join(f'{x:.2f}' for x in meta['load_after'])}; {meta['seconds']:.0f} s")
    save()
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
