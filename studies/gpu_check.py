"""The parts of studies/gpu_check.sh (its header says how to run it), each in a process of its own:

# tokens/s, peak memory
python -m studies.gpu_check train OUT.json STEPS lm|nmt METHODS TRAIN_FLAGS...
# device vs CPU, bf16, resume
python -m studies.gpu_check numerics OUT.json DEVICE "LM_FLAGS" "NMT_FLAGS"
# gpu.json: parts and targets
python -m studies.gpu_check report WORK GPU.json
"""

import contextlib
import glob
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

import eval as ev
import runlib
import train_lm
import train_nmt

# dense bf16 FLOP/s of an H100 SXM (NVIDIA's datasheet; the H200 is the same chip): MFU's base
PEAK_FLOPS = 989e12
SCRIPTS = {"lm": train_lm, "nmt": train_nmt}


def throughput(folder):
    """Tokens/s after the warm-up steps (compilation, allocator; NMT: the first epoch, 3.5-7x slower
    per new batch shape) from --log-interval 1 records (train_lm: tokens/s since the start;
    train_nmt: since the last record)."""
    cfg, recs = runlib.run_config(folder), ev.log_records(folder, "train")
    if cfg["task"] == "lm":
        tokens = [cfg["tokens_per_step_actual"]] * len(recs)
        ends = [r["step"] * tokens[0] / r["tokens_per_s"] for r in recs]
        secs = [b - a for a, b in zip([0.0] + ends, ends)]
    else:
        tokens = [r["target_tokens_per_step"] for r in recs]
        secs = [t / r["tokens_per_s"] for t, r in zip(tokens, recs)]
    warm = max(
        3,
        len(recs) // 4,
        round(cfg["steps_per_epoch"]) * (len(recs) >= cfg["steps_per_epoch"] + 10),
    )
    return dict(
        preset=cfg["preset"],
        n_params=cfg["n_params"],
        vocab_size=cfg["vocab_size_actual"],
        steps=len(recs),
        warmup_steps=warm,
        first_step_s=round(secs[0], 3) if secs else None,
        tokens_per_s=round(sum(tokens[warm:]) / sum(secs[warm:]), 1) if len(recs) > warm else None,
    )


def train(out, steps, script, methods, *flags):
    """Each method's run of `script` for `steps` steps or, after 8 steps, its share of the part's
    time limit; it stops as on a signal (no final validation) and writes no checkpoint (not
    measured; minutes at gpt2-medium)."""
    end = time.time() + float(os.environ.get("GPU_CHECK_LIMIT", 1e9)) - 15
    cuda = torch.cuda.is_available()
    rows = []

    class TimeUp(list):
        """runlib.stop_signals' list, asked once a step: true at `steps`, or after 8 steps once
        the method's share of the time is spent (the run then stops as on a signal)."""

        asked = 0

        def __bool__(self):
            self.asked += 1
            late = self.asked >= 8 and time.time() > self.deadline
            return self.asked >= int(steps) or late

    @contextlib.contextmanager
    def time_limit():
        yield time_up

    def skip_checkpoint(path, state):
        return None

    runlib.save_checkpoint = skip_checkpoint
    runlib.stop_signals = time_limit
    methods = methods.split(",")
    for i, method in enumerate(methods):
        time_up = TimeUp(["the time limit"])  # the run's exit names it
        time_up.deadline = time.time() + (end - time.time()) / (len(methods) - i)
        argv = [*flags, "--method", method]
        row = dict(script=script, method=method, compile="--compile" in flags, argv=argv)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        folder = f"{out[:-5]}-{method}"
        try:
            try:
                SCRIPTS[script].main([*argv, "--out", folder, "--overwrite"])
            except SystemExit as e:  # stopped by time_limit: a finished measurement
                if "stopped at step" not in str(e):
                    raise
            row.update(throughput(folder))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - an out-of-memory run is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None
        rows.append(row)
        runlib.write_json(out, rows)


def max_rel(a, b):
    return max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=None)


def numerics(out, device, lm_flags, nmt_flags, steps=8):
    """Per script, tiny fixed-seed runs with the loss of every step: fp32 on `device` vs CPU and
    bf16 vs fp32 (no dropout: its masks differ between devices); with dropout on `device`, a repeat
    (run-to-run noise of the kernels) and --stop-at steps/2 + --resume, each against the
    uninterrupted run (losses and ckpt.pt's weights). lm_practice: the LM with AGG, a late untying
    at step 6 of 8 (in the resumed half), a soft-cap and an embedding lr."""
    res, work = {}, os.path.join(os.path.dirname(os.path.abspath(out)), "numerics")

    def go(script, name, *flags):
        folder = os.path.join(work, f"{key}-{name}")
        SCRIPTS[script].main(
            [*flags, "--out", folder, *(() if "--resume" in flags else ("--overwrite",))]
        )
        losses = [r["loss"] for r in ev.log_records(folder, "train")]
        return losses, torch.load(f"{folder}/ckpt.pt", weights_only=True)["model"]

    def compare(a, b):
        (la, wa), (lb, wb) = a, b
        return dict(
            loss_max_rel=max_rel(la, lb),
            weights_equal=all(torch.equal(wa[k], wb[k]) for k in wa),
            weights_max_abs_diff=max(
                float((wa[k].float() - wb[k].float()).abs().max()) for k in wa
            ),
        )

    practice = f"{lm_flags} --method agg --untie-at 0.75 --logit-softcap 30 --embedding-lr 3"
    for key, script, flags in (
        ("lm", "lm", lm_flags),
        ("lm_practice", "lm", practice),
        ("nmt", "nmt", nmt_flags),
    ):
        base = shlex.split(f"{flags} --max-steps {steps} --log-interval 1 --seed 0")
        on_device, no_dropout = [*base, "--device", device], ["--dropout", "0"]
        cpu = go(script, "cpu", *base, "--device", "cpu", "--dtype", "float32", *no_dropout)[0]
        fp32 = go(script, "fp32", *on_device, "--dtype", "float32", *no_dropout)[0]
        bf16 = go(script, "bf16", *on_device, "--dtype", "bfloat16", *no_dropout)[0]
        with_dropout = [*on_device, "--dtype", "float32"]
        full = go(script, "full", *with_dropout)
        again = go(script, "again", *with_dropout)
        go(script, "split", *with_dropout, "--stop-at", str(steps // 2))
        split = go(script, "split", "--device", device, "--resume")
        res[key] = dict(
            steps=steps,
            loss_fp32=fp32,
            loss_cpu=cpu,
            loss_bf16=bf16,
            device_vs_cpu_fp32_max_rel=max_rel(fp32, cpu),
            bf16_vs_fp32_max_rel=max_rel(bf16, fp32),
            repeat=compare(again, full),
            resume=dict(stop_at=steps // 2, **compare(split, full)),
        )
        runlib.write_json(out, res)


def target(limit, above, each):
    """The worst of `each` [(where, value)] against the limit (value >= limit if `above`, else
    <=)."""
    each = {k: v for k, v in each if v is not None}
    value = (min if above else max)(each.values()) if each else None
    return dict(
        value=value,
        limit=limit,
        met=None if value is None else value >= limit if above else value <= limit,
        each=each,
    )


def ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def throughput_ratios(pairs):
    """[(setting, AGG's tokens/s over the mean of the MLE runs around it)]."""
    ratios = []
    for setting, runs in pairs.items():
        mle = [t for t in runs.get("mle", []) if t]
        agg_tps = [t for t in runs.get("agg", []) if t]
        mle_mean = sum(mle) / len(mle) if mle else None
        ratios.append((setting, ratio(agg_tps[0], mle_mean) if agg_tps else None))
    return ratios


def report(work, dest):
    """gpu.json: the parts' outputs in WORK, and the issue's targets (worst case over dtypes, V,
    presets; the fused head's over bfloat16, its training dtype)."""

    def load(name):  # a part's output, None if it wrote none
        return json.loads(Path(work, name).read_text()) if Path(work, name).exists() else None

    head_rows, tp, pairs, cuda = [], [], {}, torch.cuda.is_available()
    for dtype in ("float32", "bfloat16"):
        b = load(f"head_{dtype}/bench.json") or {"cases": []}
        torch_ce = {c["V"]: c for c in b["cases"] if c["method"] == "torch-ce"}
        for c in b["cases"]:
            ce = torch_ce.get(c["V"], {})
            row = dict(dtype=dtype, T=b["meta"]["tokens"], d=b["meta"]["d_model"], **c)
            row["ms_ratio_vs_torch_ce"] = ratio(c["ms"], ce.get("ms"))
            row["mem_ratio_vs_torch_ce"] = ratio(c["peak_mb"], ce.get("peak_mb"))
            head_rows.append(row)
    for path in sorted(glob.glob(os.path.join(work, "tp_*.json"))):
        for r in load(path):
            tps = r.get("tokens_per_s")
            mfu = round(6 * r["n_params"] * tps / PEAK_FLOPS, 4) if cuda and tps else None
            tp.append(dict(r, mfu=mfu))
            setting = f"{r['script']} {r.get('preset')}" + " compile" * r["compile"]
            runs = pairs.setdefault(setting, {}).setdefault(r["method"], [])
            runs.append(tps)  # MLE runs before and after AGG: their mean

    def rows(method, key, dtypes=("float32", "bfloat16")):  # [(where, value)] of its head rows
        mine = [r for r in head_rows if r["method"] == method and r["dtype"] in dtypes]
        return [(f"{r['dtype']} V={r['V']}", r[key]) for r in mine]

    fused = load("fused_head.json")
    syncs = (fused or {}).get("synchronisations")
    no_sync = isinstance(syncs, dict) and all(v == "no synchronisation" for v in syncs.values())
    tsv = Path(work, "commands.tsv").read_text().splitlines()
    previous = []  # the earlier leases' gpu.json, kept beside the new
    if Path(dest).exists():
        old = json.loads(Path(dest).read_text())
        previous = [{k: v for k, v in old.items() if k != "previous"}] + old.get("previous", [])
    runlib.write_json(
        dest,
        dict(
            commit=(runlib.git("rev-parse", "HEAD") or "").strip() or None,
            previous=previous,
            fused_head=fused,
            device=torch.cuda.get_device_name() if cuda else "cpu",
            torch=torch.__version__,
            cuda=torch.version.cuda,
            date=time.strftime("%Y-%m-%d %H:%M:%S"),
            commands=[
                dict(zip(("part", "rc", "seconds", "status", "command"), line.split("\t", 4)))
                for line in tsv
            ],
            head=head_rows,
            throughput=tp,
            mfu_peak_flops=PEAK_FLOPS,
            numerics=load("numerics.json") or {},
            targets=dict(
                agg_vs_mle_head_time=target(1.05, False, rows("agg", "ms_ratio_vs_mle")),
                agg_vs_mle_head_memory=target(1.00, False, rows("agg", "mem_ratio_vs_mle")),
                mle_vs_torch_ce_time=target(1.2, False, rows("mle", "ms_ratio_vs_torch_ce")),
                mle_vs_torch_ce_memory=target(1.00, False, rows("mle", "mem_ratio_vs_torch_ce")),
                agg_vs_mle_tokens_per_s=target(0.97, True, throughput_ratios(pairs)),
                fused_mle_vs_cross_entropy_time=target(
                    0.6, False, rows("mle", "ms_ratio_vs_torch_ce", ["bfloat16"])
                ),
                fused_mle_vs_cross_entropy_memory=target(
                    0.35, False, rows("mle", "mem_ratio_vs_torch_ce", ["bfloat16"])
                ),
                fused_no_synchronisation=dict(met=no_sync, value=syncs),
            ),
            notes=dict(
                head="studies.bench --sections head: median ms of observe + loss + backward, peak "
                "MB above set-up (max_memory_allocated); bfloat16: bench --dtype bfloat16, each "
                "loss under autocast as in training; on CUDA agg.py's heads run fused where they "
                "can (agg.FUSED_HEAD); linear-ce: F.linear_cross_entropy",
                throughput="tokens/s after the warm-up steps (nmt: target tokens); peak_mem_mb: "
                f"max_memory_allocated; mfu = 6 n_params tokens/s / {PEAK_FLOPS:.3g} (bf16, H100 "
                "SXM / H200), no attention FLOPs",
                numerics="max relative difference of the training loss over the steps; weights: "
                "ckpt.pt's model",
            ),
        ),
    )


if __name__ == "__main__":
    {"train": train, "numerics": numerics, "report": report}[sys.argv[1]](*sys.argv[2:])
