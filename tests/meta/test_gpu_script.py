"""benchmarks/gpu/tsp_memory_7b.py cannot run here at full size (no GPU); its --tiny CPU mode runs the whole script."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "tsp_memory_7b.py"


def test_gpu_script_self_test_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    layouts = {r.get("layout") for r in results}
    assert {"tsp", "tsp_checkpointed", "tp_sp", "ulysses_zero3"} <= layouts
    assert all("error" not in r for r in results), [r for r in results if "error" in r]
    assert any(r.get("backend") == "cpu_flash" for r in results)
    tsp_runs = [r for r in results if r.get("layout", "").startswith("tsp")]
    # every simulated rank fed its real shard: the causal step ran, not a document-masked one
    assert tsp_runs and all(r["document_masking"] is False for r in tsp_runs)
    # the fake group's works never complete: no watchdog poller may collect them
    assert all(r["comm_timeout_s"] is None for r in tsp_runs)
    # TP+SP's peak is a training step's: built on meta, shards materialized, warm-up, THEN the peak reset
    tp_sp = [r for r in results if r.get("layout") == "tp_sp"]
    assert tp_sp and all(r["phases"] == ["built:meta", "parallelized", "materialized", "warm-up", "peak reset", "step"]
                         and r["step_s_no_comm"] > 0 for r in tp_sp), tp_sp


def test_one_failing_case_keeps_the_others(tmp_path):
    """A case that raises is recorded with its error; the cases after it still run and are written."""
    pytest.importorskip("transformers")
    code = (f"import sys, runpy; sys.argv = ['x']; mod = runpy.run_path({str(SCRIPT)!r}, run_name='gpu_script')\n"
            "def broken(*a, **k): raise ValueError('injected')\n"
            "mod['main'].__globals__['tp_sp_peak'] = broken\n"
            f"sys.exit(mod['main'](['--device', 'cpu', '--tiny', '--out', {str(tmp_path)!r}]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    failed = [r for r in results if "error" in r]
    assert [r["layout"] for r in failed] == ["tp_sp"] and "injected" in failed[0]["error"]
    assert any("kernel" in r for r in results)  # the case after the failure ran


def test_first_contact_checks_self_test_on_cpu(tmp_path):
    """benchmarks/gpu/first_contact_checks.py (the GPU-only first-contact checks): on CPU the MoE autocast step runs for
    real (bf16 autocast, both dispatches, against fp32), the timeout margin is reported, the poller check skips."""
    script = ROOT / "benchmarks" / "gpu" / "first_contact_checks.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = {r["check"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert set(results) == {"poller_memory", "nccl_timeout_margin", "moe_autocast", "offload_pool"}
    assert "skipped" in results["poller_memory"] and "skipped" in results["offload_pool"]
    assert results["nccl_timeout_margin"]["group_timeouts_s"] and "ok" not in results["nccl_timeout_margin"]
    moe = results["moe_autocast"]
    for dispatch in ("ring", "all_to_all"):
        assert moe[dispatch]["ok"] and moe[dispatch]["grad_rel_err"] > 0, moe  # > 0: bf16 really ran
        assert moe[dispatch]["routing"] == "held at fp32's choice" and moe[dispatch]["free_bf16_routing_flips"] >= 0


def _device_checks():
    import runpy

    return runpy.run_path(str(ROOT / "benchmarks" / "gpu" / "device_checks.py"), run_name="device_checks")


def test_device_checks_self_test_on_cpu():
    """benchmarks/gpu/device_checks.py's FLA and offload checks on the CPU (in process: no interpreter start-up):
    the FLA adapter through a stand-in of FLA's contract against the float64 torch kernel, forward and backward,
    bf16 / fp16 within their tolerances and float32 within 1e-5; offload's pool after steps of varying length
    equals the plan, losses and gradients bit-equal. CUDA-only parts say why they skipped."""
    script = _device_checks()
    cpu = torch.device("cpu")
    fla = script["fla_delta_rule"](cpu)
    assert fla["ok"] and fla["kernel"].startswith("stand-in"), fla
    for layout in ("no_documents", "documents"):
        case = fla["cases"][layout]
        assert case["torch_float32"]["backward"] <= 1e-5 and 0 < case["bfloat16"]["worst"] <= 3e-2, case
    offload = script["offload_overlap"](cpu)
    assert offload["ok"] and offload["pool_over_plan_bytes"] == 0 and offload["grad_rel_err"] == 0.0, offload
    assert "skipped" in offload["copy_hidden"]


def test_device_checks_fla_tolerance_catches_a_wrong_kernel():
    """The FLA check fails a kernel that applies the decay twice (a log-decay convention mixed up): not a check that
    passes whatever the kernel returns."""
    script = _device_checks()
    standin = script["_standin_fla"]

    def twice_the_decay(q, k, v, g, beta, **kw):
        return standin(q, k, v, 2 * g, beta, **kw)

    script["fla_delta_rule"].__globals__["_standin_fla"] = twice_the_decay
    assert script["fla_delta_rule"](torch.device("cpu"))["ok"] is False


@pytest.mark.slow  # spawns the cp ring's 2 gloo ranks (~1 min on the loaded 2-core box)
def test_device_checks_script_runs_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "device_checks.py"), "--device", "cpu",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = {r["check"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert set(results) == {"fla_delta_rule", "offload_overlap", "cp_ring"}
    assert results["cp_ring"]["ok"] and results["cp_ring"]["tsp1_cp2"]["backend"] == "gloo on the CPU"
