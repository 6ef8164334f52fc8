"""The fused head on a device, in one process (a part of studies/gpu_check.sh):

    python -m studies.gpu_head OUT.json [--cpu-test]

- exactness: the fused head (agg.FUSED_HEAD "always") against the torch head ("never") for mle
  and agg: float32 values and gradients, bfloat16 gradients; AGG with every gate 1 against MLE;
  a repeat, bit for bit;
- synchronisations: steady-state steps of observe + loss + backward + after_step for mle and agg
  under torch.cuda.set_sync_debug_mode("error") (CUDA only);
- time and memory at T tokens, bf16 autocast: F.cross_entropy(h @ W.T), F.linear_cross_entropy
  where torch has it, and mle / agg through the torch head and the fused one (CUDA events, the
  variants interleaved, medians; peak memory above the inputs);
- one profiled step of agg's fused head (the kernels by device time).
--cpu-test: tiny sizes through Triton's interpreter (TRITON_INTERPRET=1 set by the caller).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import agg
import runlib

SHAPES = [(50304, 1024), (44256, 1024), (44256, 512)]  # (V, d), as in results/gpu.json


def make_inputs(V, d, T, device, seed=0):
    """hidden (T, d), weight (V, d) float32 leaves, Zipfian targets (T,)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(T, d, generator=g) / d**0.5
    weight = torch.randn(V, d, generator=g) * 0.02
    ranks = torch.arange(1, V + 1, dtype=torch.float64)
    targets = torch.multinomial(1 / ranks, T, replacement=True, generator=g)
    leaves = [t.to(device).requires_grad_() for t in (hidden, weight)]
    return leaves[0], leaves[1], targets.to(device)


def built(name, V, targets):
    """mle, or agg at a 20% rare share with a window of 8 steps of `targets`."""
    if name == "mle":
        return agg.build_method("mle", V)
    counts = torch.bincount(targets.cpu(), minlength=V) + 1
    tokens = len(targets)
    method = agg.build_method("agg", V, counts=counts, tokens_per_step=tokens, rare_share=0.2)
    for _ in range(8):
        method.observe(targets)
    return method


def head_step(method, hidden, weight, targets, fused, bf16=True):
    """One step of the head: loss and backward; returns (loss, dh, dW)."""
    agg.FUSED_HEAD = "always" if fused else "never"
    hidden.grad = weight.grad = None
    with torch.autocast(hidden.device.type, torch.bfloat16, enabled=bf16):
        loss = method.loss(hidden, weight, targets)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def relative(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def exactness(device, V, d, T):
    """The fused head against the torch head, and its own guarantees."""
    hidden, weight, targets = make_inputs(V, d, T, device)
    out = {}
    for name in ("mle", "agg"):
        method = built(name, V, targets)
        for bf16 in (False, True):
            torch_head = head_step(method, hidden, weight, targets, fused=False, bf16=bf16)
            fused = head_step(method, hidden, weight, targets, fused=True, bf16=bf16)
            again = head_step(method, hidden, weight, targets, fused=True, bf16=bf16)
            key = f"{name} {'bfloat16' if bf16 else 'float32'}"
            errors = [relative(f, t) for f, t in zip(fused, torch_head)]
            out[key] = dict(loss=errors[0], dh=errors[1], dW=errors[2])
            out[key]["repeat_bit_identical"] = all(map(torch.equal, fused, again))
    ones = agg.build_method("agg", V, alpha=0.0, window=8)  # nothing rare: every gate 1
    ones.observe(targets)
    mle = built("mle", V, targets)
    gated = head_step(ones, hidden, weight, targets, fused=True)
    plain = head_step(mle, hidden, weight, targets, fused=True)
    out["agg_all_gates_1_equals_mle"] = all(map(torch.equal, gated, plain))
    return out


def synchronisations(device, V, d, T):
    """Steady-state steps of mle and agg with the fused head under the CUDA sync debug mode."""
    if device.type != "cuda":
        return "not measured: CUDA only"
    hidden, weight, targets = make_inputs(V, d, T, device)
    out = {}
    for name in ("mle", "agg"):
        method = built(name, V, targets)
        head_step(method, hidden, weight, targets, fused=True)  # the first call's host checks
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                method.observe(targets)
                head_step(method, hidden, weight, targets, fused=True)
                method.after_step(weight)
            out[name] = "no synchronisation"
        except RuntimeError as e:
            out[name] = f"synchronised: {str(e)[:300]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out


def variants(hidden, weight, targets, V):
    """{name: a function running one head step} for the timing."""

    def cross_entropy():
        hidden.grad = weight.grad = None
        with torch.autocast(hidden.device.type, torch.bfloat16):
            logits = hidden @ weight.T
        F.cross_entropy(logits.float(), targets).backward()

    def linear_cross_entropy():
        hidden.grad = weight.grad = None
        with torch.autocast(hidden.device.type, torch.bfloat16):
            loss = F.linear_cross_entropy(hidden, weight, targets)
        loss.backward()

    runs = {"F.cross_entropy": cross_entropy}
    if hasattr(F, "linear_cross_entropy"):
        runs["F.linear_cross_entropy"] = linear_cross_entropy
    for name in ("mle", "agg"):
        method = built(name, V, targets)
        for fused in (False, True):
            label = f"{name} {'fused' if fused else 'torch head'}"

            def step(method=method, fused=fused):
                method.observe(targets)
                head_step(method, hidden, weight, targets, fused)

            runs[label] = step
    return runs


def timed(run, device):
    """Milliseconds of one call (CUDA events; the wall clock on CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return 1000 * (time.perf_counter() - start)
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end)


def peak_mb(run, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def timings(device, shapes, T, rounds, warmup):
    rows = []
    for V, d in shapes:
        hidden, weight, targets = make_inputs(V, d, T, device)
        runs = variants(hidden, weight, targets, V)
        names = list(runs)
        times = {name: [] for name in names}
        for r in range(warmup + rounds):  # interleaved, the order rotating every round
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                ms = timed(runs[name], device)
                if r >= warmup:
                    times[name].append(ms)
        base = statistics.median(times["F.cross_entropy"])
        mle_fused = statistics.median(times["mle fused"])
        for name in names:
            median = statistics.median(times[name])
            row = dict(V=V, d=d, T=T, variant=name, ms=round(median, 4))
            row["ms_vs_cross_entropy"] = round(median / base, 4)
            row["ms_vs_mle_fused"] = round(median / mle_fused, 4)
            row["peak_mb"] = peak_mb(runs[name], device)
            rows.append(row)
        ce_mb = next(r["peak_mb"] for r in rows if r["V"] == V and r["variant"] == names[0])
        for row in rows:
            if row["V"] == V and row["d"] == d and ce_mb and row["peak_mb"] is not None:
                row["mem_vs_cross_entropy"] = round(row["peak_mb"] / ce_mb, 4)
        del hidden, weight, targets, runs
    return rows


def profile(device, V, d, T):
    """The kernels of one agg step through the fused head, by device time."""
    hidden, weight, targets = make_inputs(V, d, T, device)
    method = built("agg", V, targets)
    head_step(method, hidden, weight, targets, fused=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        method.observe(targets)
        head_step(method, hidden, weight, targets, fused=True)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="the JSON file to write")
    p.add_argument("--cpu-test", action="store_true", help="tiny sizes on CPU (the interpreter)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu_test else "cuda")
    shapes, T, rounds, warmup = SHAPES, 8192, 15, 3
    small = (4096, 256, 2048)
    if args.cpu_test:
        shapes, T, rounds, warmup = [(300, 16)], 64, 2, 1
        small = (300, 16, 64)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    result["commit"] = (runlib.git("rev-parse", "HEAD") or "").strip() or None
    result["exactness"] = exactness(device, *small)
    result["synchronisations"] = synchronisations(device, *small)
    runlib.write_json(args.out, result)  # each part saved as it ends
    result["timings"] = timings(device, shapes, T, rounds, warmup)
    runlib.write_json(args.out, result)
    result["profile"] = profile(device, shapes[0][0], shapes[0][1], T)
    runlib.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
