"""
What each method of agg.py costs, measured side by side with MLE.

    python bench.py --threads 1      # T=4096, d=512, V in {8192, 32768, 50304} + chunked head + train_lm tokens/s
                                     # (~1 h on 2 CPU cores; on a GPU machine the head adds CUDA rows)
    python bench.py --quick          # one small V, few repeats: a spot check in about a minute
    python bench.py --sections head --vocab 8192 --repeats 5

On a machine shared with other jobs use --threads 1 (two threads wait on each other whenever one is descheduled)
and read the CPU-time column next to the wall-clock one: process CPU time does not count the time other jobs hold
the cores.

Sections (--sections):
  head     forward+backward of the loss head (observe() + loss() + backward(): hidden (T, d) -> loss -> grads wrt hidden
           and the tied weight) for every agg.METHODS entry, for `official-ref` (a literal reference of the official AGG
           criterion: three logit matrices, dense T x V gates, T x T counting - it lives only in this file, as the
           baseline) and for `torch-ce` (F.cross_entropy(h @ W.T, y), plain PyTorch). Candidates are interleaved (the
           order rotates every repeat) after warm-up; medians and min-max. Peak memory per case: CUDA
           max_memory_allocated; CPU peak RSS above the set-up of a fresh process per case. Ratios vs `mle` of the
           same run.
  chunked  the chunk_size option of loss() at large vocabularies: peak head memory ~ chunk x V instead of T x V.
  lm       tokens/s of train_lm.py's training step per method vs MLE (cpu preset on CPU).

Writes OUT/bench.json (--out OUT, default out/bench):
  {"cases": [{"method", "V", "device", "ms", "ms_ratio_vs_mle", "peak_mb", "mem_ratio_vs_mle"}, ...],
   "spread": [{"method", "V", "device", "ms_min", "ms_max", "samples_ms", "cpu_ms", "cpu_ratio_vs_mle",
               "cpu_samples_ms"}, ...], "chunked": [...], "lm": {...}, "meta": {...}}
(ms: median wall-clock ms of one step; peak_mb: peak memory of one step above its set-up.) Also OUT/bench.md: the
printed tables.
Timings on a shared machine are noisy: compare rows of one run only.
"""
import argparse
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

EXTRA = ["official-ref", "torch-ce"]  # candidates that are not agg.METHODS entries
SPECIAL_IDS = [0]  # never rare (like pad/eos)


# -----------------------------------------------------------------------------
# The baselines that live only here


class OfficialAGGRef:
    """Literal reference of the official AGG criterion (the authors' fairseq criterion, AGG Eq. 5, 7-10), as the
    cost baseline `official-ref`. Every step it:
      - overwrites the oldest row of a dense (K, V) token counter memory with this step's counts, counted by
        comparing every target with every other target (T x T), and sums the memory (AGG Sec. 4.1, Eq. 5);
      - finds the rare-target rows by comparing every target with every rare id (T x R);
      - builds two dense gate matrices, (rows with a non-rare target) x V for g1 and (rows with a rare target) x V
        for g2, with 1 at each row's target column (Eq. 7-8);
      - computes three logit matrices (Eq. 9): z0 = h W~^T (gradient to h only), z1/z2 = g * (h~ W^T) + (1 - g) *
        (h~ W^T)~ on the two row sets (gradient to W only, gated), and three log-softmaxes (Eq. 10).
    (x~ = x.detach().) The loss is a mean over positions (fairseq sums) so that gradients compare with agg.py's
    'agg'; no ignore_index / label smoothing (the benchmark uses neither).
    """
    name = "official-ref"

    def __init__(self, vocab_size, alpha, window, special_ids=()):
        self.vocab_size, self.alpha, self.window = vocab_size, alpha, window
        self.special_ids = list(special_ids)
        self.memory = torch.zeros(window, vocab_size)  # m_1..m_K, dense, as in the official code
        self.itr = 0

    def prefill(self, batches):
        """Set-up only (not timed): the memory as it would be after the steps whose targets are `batches`."""
        for y in batches:
            self.itr += 1
            self.memory[self.itr % self.window] = torch.bincount(y.reshape(-1).cpu(), minlength=self.vocab_size)

    def observe(self, targets):
        pass  # the official criterion counts inside the loss

    def loss(self, hidden, weight, targets, chunk_size=None):
        d, V, K = hidden.shape[-1], self.vocab_size, self.window
        h, y = hidden.reshape(-1, d), targets.reshape(-1)
        n = len(y)
        self.memory = self.memory.to(h.device)
        # token counter memory (AGG Sec. 4.1): this step's counts by a T x T comparison, into the oldest slot
        self.itr += 1
        slot = self.memory[self.itr % K]
        slot.zero_()
        slot[y] = (y[:, None] == y[None, :]).float().sum(1)
        a = self.memory.sum(0).to(torch.promote_types(h.dtype, torch.float32))  # appearances over the last K steps
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
        acc = torch.promote_types(z0.dtype, torch.float32)  # the official .float(); float64 stays float64
        lp0 = F.log_softmax(z0.to(acc), dim=-1)
        lp1 = F.log_softmax(z1.to(acc), dim=-1)
        lp2 = F.log_softmax(z2.to(acc), dim=-1)
        nll = -(lp0.gather(1, y[:, None]).sum() + lp1.gather(1, y[rows_n, None]).sum()
                + lp2.gather(1, y[rows_r, None]).sum())  # AGG Eq. 10
        return nll / max(n, 1)


class TorchCE:
    """Plain PyTorch: F.cross_entropy(h @ W.T, y) (logits, log-softmax and its gradient: ~3 T x V buffers)."""
    name = "torch-ce"

    def observe(self, targets):
        pass

    def loss(self, hidden, weight, targets, chunk_size=None):
        return F.cross_entropy((hidden @ weight.T).reshape(-1, weight.shape[0]).float(), targets.reshape(-1))


# -----------------------------------------------------------------------------
# Synthetic inputs: Zipfian targets, a window of previous steps for the counters, "training" counts


def make_data(V, T, d, seq_len, seed, rare_fraction, window, device, n_batches=4):
    """Inputs shared by all candidates of one (V, device). Deterministic in `seed` (rebuilt in memory children).

    Targets ~ Zipf(1.1) over the vocabulary, shaped (T / seq_len, seq_len) (ul needs (B, T)). `window` previous
    steps fill the counters of agg / official-ref; their token counts stand in for the training counts of the
    static-group methods. alpha is chosen so that about `rare_fraction` of the vocabulary is rare (as the static
    methods' rare_fraction), from the counts the counters will hold.
    """
    if T % seq_len:
        raise ValueError(f"--tokens {T} must be a multiple of --seq-len {seq_len}")
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
    if name not in agg.METHODS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(list(agg.METHODS) + EXTRA)}")
    defaults = agg.METHODS[name].defaults
    hp = {}
    if agg.agg_family(name):
        hp.update(alpha=data["alpha"], window=data["window"])
    if "rare_fraction" in defaults:
        hp.update(rare_fraction=data["rare_fraction"])
    m = agg.build_method(name, vocab_size=V, counts=data["counts"], special_ids=SPECIAL_IDS, **hp)
    if agg.agg_family(name):
        for y in data["history"]:
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
        h = self.hidden if hidden is None else hidden
        self.method.observe(y)  # once per optimizer step: part of each step's cost
        kw = {"chunk_size": self.chunk_size} if self.chunk_size else {}
        loss = self.method.loss(h, self.weight, y, **kw)
        loss.backward()
        return loss

    def warm_tiny(self):
        """Run every code path once on a few positions (loads kernels) without a large allocation."""
        y = self.batches[0][:1, :16]
        self.step(hidden=self.hidden[:1, :16], y=y)
        self.hidden.grad = self.weight.grad = None


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_candidates(runners, device, repeats, warmup, desc):
    """Interleaved timing: every repeat runs each candidate once, the order rotating.

    Returns ({name: [wall ms, ...]}, {name: [process CPU ms, ...]}). On CPU the process CPU time does not count the
    time other jobs hold the cores (with 1 thread it is the step's own work); wall time is the contract's `ms`."""
    names = list(runners)
    samples, cpu = {n: [] for n in names}, {n: [] for n in names}
    total = (warmup + repeats) * len(names)
    with tqdm(total=total, desc=desc, leave=False, file=sys.stderr) as bar:
        for r in range(warmup + repeats):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                runners[n].step()
                sync(device)
                if r >= warmup:
                    samples[n].append(1000 * (time.perf_counter() - t0))
                    cpu[n].append(1000 * (time.process_time() - c0))
                runners[n].hidden.grad = runners[n].weight.grad = None
                bar.update()
    return samples, cpu


# -----------------------------------------------------------------------------
# Peak memory: CUDA in process, CPU in a fresh process per case


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_peak_child(spec, conn):
    """In a fresh process: build the case, warm up on a few positions, then peak RSS of one full step above set-up."""
    try:
        torch.set_num_threads(spec.pop("threads"))
        name, chunk_size = spec.pop("method"), spec.pop("chunk_size")
        data = make_data(device="cpu", **spec)
        runner = Runner(name, data, chunk_size)
        runner.warm_tiny()
        gc.collect()
        try:  # reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            reset = True
        except OSError:
            reset = False
        base = _status_kb("VmRSS")
        runner.step()
        peak = _status_kb("VmHWM")
        conn.send({"peak_mb": max(peak - base, 0) / 1024, "base_mb": base / 1024, "hwm_reset": reset})
    except Exception as e:  # report it in the parent
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


_CTX = None


def _mp_context():
    """forkserver with torch + agg preloaded: every case gets a fresh process without paying torch's import."""
    global _CTX
    if _CTX is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        _CTX = mp.get_context(method)
        if method == "forkserver":
            _CTX.set_forkserver_preload(["torch", "agg"])
    return _CTX


def cpu_peak_mb(method, V, T, d, seq_len, seed, rare_fraction, window, chunk_size=None):
    """Peak RSS (MB) of one step of `method` above its set-up, in a fresh process."""
    spec = dict(method=method, V=V, T=T, d=d, seq_len=seq_len, seed=seed, rare_fraction=rare_fraction,
                window=window, chunk_size=chunk_size, threads=torch.get_num_threads())
    ctx = _mp_context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_cpu_peak_child, args=(spec, child))
    # A fixed glibc mmap threshold: every buffer >= 1 MiB is its own mapping, returned to the OS when freed, so the
    # peak RSS counts live tensors (glibc's dynamic threshold would keep some freed buffers resident, at random).
    # Set while the process (or the forkserver, on its first use) starts.
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2 ** 20)
    try:
        proc.start()
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    child.close()
    try:
        out = parent.recv()
    except EOFError:  # killed before it could answer (the kernel's OOM killer, most likely)
        proc.join()
        out = {"error": f"the child process died (exit code {proc.exitcode}); out of memory? Try a smaller "
                        f"--tokens / --vocab, or --no-memory"}
    proc.join()
    if "error" in out:
        raise RuntimeError(f"peak memory of {method} at V={V}: {out['error']}")
    return out["peak_mb"]


def cuda_peak_mb(runner, device):
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    runner.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    runner.hidden.grad = runner.weight.grad = None
    return peak / 2 ** 20


# -----------------------------------------------------------------------------
# Sections


def bench_head(args, devices, log, cases, spread, info, save=lambda: None):
    """The method table: appends to cases, spread and info (one entry per (device, V)), save() after each group."""
    names = args.methods
    for device in devices:
        for V in args.vocab:
            data = make_data(V, args.tokens, args.d_model, args.seq_len, args.seed, args.rare_fraction, args.window,
                             device)
            info.append(dict(V=V, device=device, alpha=data["alpha"], rare_vocab=data["rare_vocab"],
                             rare_rows=data["rare_rows"], load_before=os.getloadavg()))
            runners = {n: Runner(n, data) for n in names}
            samples, cpu = time_candidates(runners, device, args.repeats, args.warmup, f"head {device} V={V}")
            peaks = {}
            if not args.no_memory:
                for n in tqdm(names, desc=f"memory {device} V={V}", leave=False, file=sys.stderr):
                    if device == "cpu":
                        peaks[n] = cpu_peak_mb(n, V, args.tokens, args.d_model, args.seq_len, args.seed,
                                               args.rare_fraction, args.window)
                    else:
                        peaks[n] = cuda_peak_mb(runners[n], device)
            del runners, data
            gc.collect()
            ms = {n: statistics.median(s) for n, s in samples.items()}
            for n in names:
                peak = peaks.get(n)
                cases.append(dict(method=n, V=V, device=device, ms=round(ms[n], 3),
                                  ms_ratio_vs_mle=round(ms[n] / ms["mle"], 4),
                                  peak_mb=None if peak is None else round(peak, 2),
                                  mem_ratio_vs_mle=round(peak / peaks["mle"], 4) if peaks.get("mle") else None))
                spread.append(dict(method=n, V=V, device=device, ms_min=round(min(samples[n]), 3),
                                   ms_max=round(max(samples[n]), 3), samples_ms=[round(x, 3) for x in samples[n]],
                                   cpu_ms=round(statistics.median(cpu[n]), 3),
                                   cpu_ratio_vs_mle=round(statistics.median(cpu[n]) / statistics.median(cpu["mle"]), 4),
                                   cpu_samples_ms=[round(x, 3) for x in cpu[n]]))
            info[-1]["load_after"] = os.getloadavg()
            log(head_table([c for c in cases if c["V"] == V and c["device"] == device], spread, info[-1], args))
            save()


def bench_chunked(args, devices, log):
    """chunk_size at large V: same step timed and measured with the full T x V head and with chunks."""
    rows = []
    for device in devices:
        for V in args.chunk_vocab:
            data = make_data(V, args.chunk_tokens, args.chunk_d, args.chunk_tokens, args.seed, args.rare_fraction,
                             args.window, device)
            configs = [(m, c or None) for m in args.chunk_methods for c in args.chunk_sizes]
            runners = {f"{m}|{c}": Runner(m, data, c) for m, c in configs}
            samples, _ = time_candidates(runners, device, args.chunk_repeats, 1, f"chunked {device} V={V}")
            for m, c in configs:
                key = f"{m}|{c}"
                if args.no_memory:
                    peak = None
                elif device == "cpu":
                    peak = cpu_peak_mb(m, V, args.chunk_tokens, args.chunk_d, args.chunk_tokens, args.seed,
                                       args.rare_fraction, args.window, chunk_size=c)
                else:
                    peak = cuda_peak_mb(runners[key], device)
                head_rows = c or args.chunk_tokens
                rows.append(dict(method=m, V=V, T=args.chunk_tokens, d=args.chunk_d, device=device,
                                 chunk_size=c, ms=round(statistics.median(samples[key]), 3),
                                 peak_mb=None if peak is None else round(peak, 2),
                                 logits_mb=round(head_rows * V * 4 / 2 ** 20, 2),  # one float32 rows x V buffer
                                 weight_grad_mb=round(V * args.chunk_d * 4 / 2 ** 20, 2)))
            del runners, data
            gc.collect()
    if rows:
        log(chunked_table(rows))
    return rows


def lm_setup(args, log):
    """train_lm.py's cpu-preset config, model builder and training data; synthetic Zipf ids if its data is unusable."""
    import train_lm
    from data import prepare_lm
    cfg = train_lm.make_config(device="cpu", preset="cpu")
    try:
        data = prepare_lm(cfg, log=lambda *a: None)
        ids = torch.from_numpy(data["ids"]["train"].astype("int64"))
        V, counts, special = data["vocab_size"], data["counts"], [data["pad_id"], data["eos_id"]]
        source = f"train_lm.py training split ({data['dir']})"
    except Exception as e:  # noqa: BLE001 - the step's cost does not depend on the text: fall back, and say so
        V = cfg["vocab_size"]
        g = torch.Generator().manual_seed(args.seed)
        p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
        ids = torch.multinomial(p, 500_000, replacement=True, generator=g)
        counts, special = torch.bincount(ids, minlength=V), [0]
        source = f"synthetic Zipf(1.1) ids (data.prepare_lm failed: {type(e).__name__}: {e})"
    return train_lm, cfg, ids, V, counts, special, source


class LMTrainer:
    """One method's model + optimizer + method, stepped by train_lm.train_step: the training step of train_lm.py's
    main loop (observe, micro-batches of features -> method.loss -> backward, clip, AdamW step)."""

    def __init__(self, train_lm, cfg, name, V, counts, special, hp):
        torch.manual_seed(0)  # same initial model for every method
        self.train_lm = train_lm
        self.model = train_lm.build_model(cfg, V)
        self.model.train()
        self.method = agg.build_method(name, vocab_size=V, counts=counts, special_ids=special, **hp)
        self.opt = runlib.make_optimizer(self.model, cfg)
        self.micro_batch = cfg["micro_batch"]
        self.autocast = runlib.autocast(cfg)

    def step(self, x_all, y_all):
        self.train_lm.train_step(self.model, self.model, self.method, self.opt, x_all, y_all, self.micro_batch,
                                 self.autocast)


def bench_lm(args, log):
    """tokens/s of train_lm.py's training step per method vs MLE (cpu preset). Returns a dict; 'skipped' says why not."""
    try:
        train_lm, cfg, ids, V, counts, special, source = lm_setup(args, log)
        train_lm.build_model  # the parts used here must exist
        train_lm.train_step
    except Exception as e:  # noqa: BLE001 - any failure means: skip with the reason
        msg = f"skipped: train_lm.py is not usable ({type(e).__name__}: {e})"
        log(msg)
        return {"skipped": msg}
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
        cfg_m = dict(cfg, method=name, alpha=args.lm_alpha if agg.agg_family(name) else None)
        kw, share = runlib.method_args(cfg_m)
        hp = dict(kw, steps_per_epoch=steps_per_epoch, tokens_per_step=tps, rare_share=share)  # window: one epoch
        trainers[name] = LMTrainer(train_lm, cfg, name, V, counts, special, hp)
        for s in range(K if "window" in trainers[name].method.hparams else 0):  # a full window, as after epoch 1
            trainers[name].method.observe(batch(s)[1])
    rare = {n: float(t.method.rare_mask().double().mean()) for n, t in trainers.items()
            if t.method.rare_mask() is not None}
    samples = {n: [] for n in names}
    step = K
    with tqdm(total=(1 + args.lm_rounds) * len(names), desc="lm steps", leave=False, file=sys.stderr) as bar:
        for r in range(1 + args.lm_rounds):  # round 0: warm-up
            k = r % len(names)
            xs = [batch(step + i) for i in range(args.lm_steps if r else 1)]
            step += len(xs)
            for n in names[k:] + names[:k]:
                t0 = time.perf_counter()
                for x, y in xs:
                    trainers[n].step(x, y)
                if r:
                    samples[n].append(len(xs) * seqs_per_step * block / (time.perf_counter() - t0))
                bar.update()
    med = {n: statistics.median(s) for n, s in samples.items()}
    rows = [dict(method=n, tokens_per_s=round(med[n], 1), ratio_vs_mle=round(med[n] / med["mle"], 4),
                 min=round(min(samples[n]), 1), max=round(max(samples[n]), 1), rare_vocab=rare.get(n))
            for n in names]
    res = dict(preset="cpu", data=source, vocab_size=V, tokens_per_step=seqs_per_step * block, block_size=block,
               window=K, alpha=args.lm_alpha, steps_per_round=args.lm_steps, rounds=args.lm_rounds, rows=rows,
               model={k: cfg[k] for k in train_lm.MODEL_FIELDS})
    log(lm_table(res))
    return res


# -----------------------------------------------------------------------------
# Tables


def _fmt_ratio(x):
    return "n/a" if x is None else f"{x:.2f}x"


def _fmt_mb(x):
    return "n/a" if x is None else f"{x:.0f}"


def lm_table(res):
    lines = [f"\ntrain_lm.py training step, cpu preset ({res['model']}), V={res['vocab_size']}, "
             f"{res['tokens_per_step']} tokens/step, AGG alpha={res['alpha']} window={res['window']}; data: "
             f"{res['data']}; median of {res['rounds']} rounds x {res['steps_per_round']} steps (min-max)",
             "| method | tokens/s (min-max) | vs MLE | rare share of vocab |", "| --- | --- | --- | --- |"]
    for r in res["rows"]:
        rare = "" if r["rare_vocab"] is None else f"{100 * r['rare_vocab']:.1f}%"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.0f} ({r['min']:.0f}-{r['max']:.0f}) | "
                     f"{r['ratio_vs_mle']:.2f}x | {rare} |")
    return "\n".join(lines)


def head_table(cases, spread, info, args):
    sp = {(s["method"], s["V"], s["device"]): s for s in spread}
    lines = [f"\nhead: T={args.tokens}, d={args.d_model}, V={info['V']}, {info['device']}; "
             f"alpha={info['alpha']:.4g}: rare vocab {100 * info['rare_vocab']:.1f}%, rare-target rows "
             f"{100 * info['rare_rows']:.1f}%; median of {args.repeats} (min-max); load average "
             f"{info['load_before'][0]:.1f} -> {info['load_after'][0]:.1f}",
             "| method | ms: median (min-max) | time vs MLE: median (min) | CPU time vs MLE | peak MB | memory vs MLE |",
             "| --- | --- | --- | --- | --- | --- |"]
    mle_min = sp[("mle", info["V"], info["device"])]["ms_min"]
    for c in cases:
        s = sp[(c["method"], c["V"], c["device"])]
        lines.append(f"| {c['method']} | {c['ms']:.0f} ({s['ms_min']:.0f}-{s['ms_max']:.0f}) | "
                     f"{_fmt_ratio(c['ms_ratio_vs_mle'])} ({_fmt_ratio(s['ms_min'] / mle_min)}) | "
                     f"{_fmt_ratio(s.get('cpu_ratio_vs_mle'))} | "
                     f"{_fmt_mb(c['peak_mb'])} | {_fmt_ratio(c['mem_ratio_vs_mle'])} |")
    return "\n".join(lines)


def chunked_table(rows):
    lines = ["\nchunked head (chunk_size of loss()): peak MB above set-up; one rows x V float32 buffer = logits MB",
             "| method | V | T | d | chunk_size | ms | peak MB | logits MB | weight grad MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['V']} | {r['T']} | {r['d']} | {r['chunk_size'] or 'none (T)'} | "
                     f"{r['ms']:.0f} | {_fmt_mb(r['peak_mb'])} | {r['logits_mb']:.0f} | {r['weight_grad_mb']:.0f} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def plan(task, preset, gpus=1, tflops=100.0, mfu=0.4):
    """What a preset costs, by formula: parameters (counted on the meta device), training FLOPs per token
    6 N + 12 L d T (Kaplan et al. 2020: forward + backward of every weight, plus attention scores over a context of
    T), the run's tokens and FLOPs, memory per GPU (16 bytes per parameter for fp32 weights, gradients and Adam's two
    moments; activations ~34 d bytes per token and layer in bf16 (Korthikanti et al. 2022, no recomputation) for a
    micro-batch; the head's fp32 logits buffer, micro-batch tokens x V x 4 bytes), and hours at gpus x tflops x mfu."""
    import train_lm
    import train_nmt
    if task == "lm":
        cfg = dict(train_lm.PRESETS[preset])
        with torch.device("meta"):
            model = train_lm.build_model(cfg, cfg["vocab_size"])
        layers, ctx, micro = cfg["n_layer"], cfg["block_size"], cfg["micro_batch"] * cfg["block_size"]
    else:
        cfg = dict(train_nmt.PRESETS[preset])
        with torch.device("meta"):
            model = train_nmt.build_model(cfg, cfg["vocab_size"])
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


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plan:
        import train_lm
        import train_nmt
        task = "lm" if args.plan in train_lm.PRESETS else "nmt"
        if args.plan not in train_lm.PRESETS and args.plan not in train_nmt.PRESETS:
            parser.error(f"--plan {args.plan}: not a preset of train_lm.py or train_nmt.py")
        p = plan(task, args.plan, args.gpus, args.tflops, args.mfu)
        print(f"{p['task']} preset {p['preset']}: {p['params'] / 1e6:.1f}M parameters, "
              f"{p['flops_per_token'] / 1e9:.2f} GFLOPs per training token, {p['steps']} steps x "
              f"{p['tokens'] // p['steps']} tokens = {p['tokens'] / 1e9:.2f}B tokens, {p['flops']:.2e} FLOPs; "
              f"~{p['memory_per_gpu_gb']:.1f} GB per GPU at {p['micro_batch_tokens']} tokens per micro-batch; "
              f"{p['hours']:.1f} h on {p['gpus']} GPU(s) at {p['tflops']:g} TFLOP/s x MFU {p['mfu']:g}")
        return p
    if args.quick:  # quick values, unless a flag was given explicitly
        given = argv if argv is not None else sys.argv[1:]
        explicit = {a.dest for a in parser._actions
                    if any(x == o or x.startswith(o + "=") for x in given for o in a.option_strings)}
        for k, v in QUICK.items():
            if k not in explicit:
                setattr(args, k, v)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - {"head", "chunked", "lm"})
    if unknown:
        parser.error(f"--sections: unknown {unknown}; valid: head, chunked, lm")
    bad = [m for m in args.methods if m not in agg.METHODS and m not in EXTRA]
    if bad:
        parser.error(f"--methods: unknown {bad}; valid: {', '.join(list(agg.METHODS) + EXTRA)}")
    bad = [m for m in args.lm_methods if m not in agg.METHODS]
    if bad:
        parser.error(f"--lm-methods: unknown {bad}; valid: {', '.join(agg.METHODS)}")
    args.methods = ["mle"] + [m for m in args.methods if m != "mle"]
    if args.device is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        devices = [d.strip() for d in args.device.split(",")]
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")

    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    report = []

    def log(s):
        report.append(s)
        print(s, flush=True)

    meta = dict(command="python bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                torch=torch.__version__, threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), cuda=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                load_before=os.getloadavg(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                tokens=args.tokens, d_model=args.d_model, seq_len=args.seq_len, repeats=args.repeats,
                warmup=args.warmup, window=args.window, rare_fraction=args.rare_fraction,
                memory="CUDA: max_memory_allocated above set-up; CPU: peak RSS (VmHWM) above set-up of a fresh process",
                agg_sha256=hashlib.sha256(open(agg.__file__, "rb").read()).hexdigest()[:16])
    log(f"bench: torch {meta['torch']}, {meta['threads']} threads, devices {devices}, "
        f"load average {' '.join(f'{x:.2f}' for x in meta['load_before'])}")
    result = {"cases": [], "spread": [], "chunked": [], "lm": {"skipped": "section not run"}, "meta": meta}
    path = os.path.join(args.out, "bench.json")

    def save():  # after every group, so a long run leaves its finished parts behind
        for p in [path] + ([args.results] if args.results else []):
            runlib.write_json(p, result)
        with open(os.path.join(args.out, "bench.md.tmp"), "w") as f:
            f.write("\n".join(report) + "\n")
        os.replace(os.path.join(args.out, "bench.md.tmp"), os.path.join(args.out, "bench.md"))

    t0 = time.time()
    meta["head_groups"] = []
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
