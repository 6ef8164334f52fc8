"""The fused head on a device, in one process (a part of studies/gpu_check.sh):

    python -m studies.gpu_head OUT.json [--cpu-test]

- exactness: the fused head (agg.FUSED_HEAD "always") against the torch head ("never") for mle
  and agg: float32 values and gradients, bfloat16 gradients; AGG with every gate 1 against MLE;
  a repeat, bit for bit;
- synchronisations: steady-state steps of observe + loss + backward + after_step for mle and agg
  under torch.cuda.set_sync_debug_mode("error") (CUDA only);
- one profiled step of agg's fused head at V 50,304, d 1,024, T 8,192 (the kernels by device time).
Its time and memory against F.cross_entropy and F.linear_cross_entropy are the head part's
(studies.bench on CUDA, where the fused head is agg.py's default).
--cpu-test: tiny sizes through Triton's interpreter (TRITON_INTERPRET=1 set by the caller).
"""

import argparse

import torch

import agg
import runlib


def make_inputs(V, d, T, device, seed=0):
    """hidden (T, d), weight (V, d) float32 leaves, Zipfian targets (T,)."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, d, generator=g) / d**0.5).to(device).requires_grad_()
    weight = (torch.randn(V, d, generator=g) * 0.02).to(device).requires_grad_()
    ranks = torch.arange(1, V + 1, dtype=torch.float64)
    targets = torch.multinomial(1 / ranks, T, replacement=True, generator=g)
    return hidden, weight, targets.to(device)


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
            errors = dict(zip(("loss", "dh", "dW"), map(relative, fused, torch_head)))
            out[key] = dict(errors, repeat_bit_identical=all(map(torch.equal, fused, again)))
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
    small, large = (4096, 256, 2048), (50304, 1024, 8192)  # (V, d, T)
    if args.cpu_test:
        small = large = (300, 16, 64)
    result = {}
    result["exactness"] = exactness(device, *small)
    result["synchronisations"] = synchronisations(device, *small)
    runlib.write_json(args.out, result)  # each part saved as it ends
    result["profile"] = profile(device, *large)
    runlib.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
