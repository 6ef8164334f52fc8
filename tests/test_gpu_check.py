"""studies/gpu_check.sh --cpu-test: the GPU check end to end on CPU at tiny sizes, and the gpu.json
it writes."""

import json
import os
import subprocess
import sys

import pytest
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_cpu_mode_writes_gpu_json(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run(
        ["bash", "studies/gpu_check.sh", "--cpu-test"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["gpu.json", "gpu_check.log", "gpu_raw.tar.gz"]
    g = json.loads((tmp_path / "gpu.json").read_text())
    assert {"device", "torch", "commands", "head", "throughput", "numerics", "targets"} <= set(g)
    assert g["device"] == "cpu"
    assert [c["status"] for c in g["commands"]] == ["ok"] * 6, g["commands"]
    assert "commit" in g and g["previous"] == []  # a later lease keeps this one under "previous"
    fused = g["fused_head"]  # studies.gpu_head through Triton's interpreter
    assert fused["exactness"]["agg_all_gates_1_equals_mle"] is True
    for case in ("mle float32", "agg float32"):
        errors = fused["exactness"][case]
        assert errors["repeat_bit_identical"] and max(errors["loss"], errors["dh"]) <= 1e-6
    assert fused["synchronisations"] == "not measured: CUDA only"
    assert "Name" in fused["profile"]  # the profiler's table of one step
    methods = {
        "mle",
        "agg",
        "agg-no-g1",
        "agg-no-g2",
        "agps",
        "freeze-rare",
        "center",
        "zloss",
        "ul",
        "ul+agg",
        "torch-ce",
    }
    if hasattr(F, "linear_cross_entropy"):  # F.linear_cross_entropy's row, where torch has it
        methods.add("linear-ce")
    for dtype in ("float32", "bfloat16"):
        assert {r["method"] for r in g["head"] if r["dtype"] == dtype} == methods
    assert all(r["ms"] > 0 and r["ms_ratio_vs_torch_ce"] > 0 for r in g["head"])
    tp = {(r["script"], r["method"]): r for r in g["throughput"]}
    assert set(tp) == {(s, m) for s in ("lm", "nmt") for m in ("mle", "agg")}
    assert all(r["tokens_per_s"] > 0 and r["steps"] == 6 and "error" not in r for r in tp.values())
    # the same run twice on one device, and a stop + resume on CPU: compared equal
    # lm_practice: untied in the resumed half, a soft-cap
    for script in ("lm", "lm_practice", "nmt"):
        n = g["numerics"][script]
        assert len(n["loss_fp32"]) == n["steps"] == 8
        assert n["device_vs_cpu_fp32_max_rel"] == 0.0
        assert 0 < n["bf16_vs_fp32_max_rel"] < 0.05
        for check in ("repeat", "resume"):
            assert n[check]["weights_equal"] and n[check]["weights_max_abs_diff"] == 0.0
            assert n[check]["loss_max_rel"] == 0.0
    t = g["targets"]
    assert set(t) == {
        "agg_vs_mle_head_time",
        "agg_vs_mle_head_memory",
        "mle_vs_torch_ce_time",
        "mle_vs_torch_ce_memory",
        "agg_vs_mle_tokens_per_s",
        "fused_mle_vs_cross_entropy_time",
        "fused_mle_vs_cross_entropy_memory",
        "fused_no_synchronisation",
    }
    assert t["agg_vs_mle_head_time"]["met"] == (t["agg_vs_mle_head_time"]["value"] <= 1.05)
    assert set(t["agg_vs_mle_tokens_per_s"]["each"]) == {"lm cpu", "nmt cpu"}
    assert t["agg_vs_mle_head_memory"]["value"] is None  # --cpu-test measures no memory
    # the fused head's targets: the head part's bfloat16 rows
    assert set(t["fused_mle_vs_cross_entropy_time"]["each"]) == {"bfloat16 V=512"}
    assert t["fused_no_synchronisation"]["met"] is False  # not measured on CPU
