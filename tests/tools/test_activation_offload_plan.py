"""`ds-tsp plan` with offload of checkpointed activations: the device peak, the host pool per rank and
per node, PCIe time against compute, `--max-seq`, `--recommend`, the goal numbers for Llama-3-8B at D=8, and the
plan against the fake-tensor measurement of the production offload path (`ds-tsp bench --layer-memory --fake
--offload-activations`, within 10%)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from ds_tsp.tools.plan import PRESETS, PlanInput, PlanInputError, plan_layouts, plan_tsp
from ds_tsp.tools.plan import cli as plan_cli
from ds_tsp.tools.plan.max_seq import longest_seq
from ds_tsp.tools.plan.recommend import recommend

GIB = 2 ** 30
LLAMA3_8B = PlanInput(model=PRESETS["8b"], seq=4 * 2 ** 20, degree=8, activation_checkpointing=True)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    """`ds-tsp plan ARGS` in this process: (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="ds-tsp")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["plan", *args])
    rc = parsed.run(parsed)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_offload_moves_all_but_two_layer_inputs_off_the_device():
    kept, off = plan_tsp(LLAMA3_8B), plan_tsp(replace(LLAMA3_8B, offload_activations=True))
    x = 1 * (LLAMA3_8B.seq // 8) * 4096 * 2  # one layer input [S/D, h] bf16: 4 GiB
    assert kept.peak_bytes_per_rank - off.peak_bytes_per_rank == (32 - 2) * x
    assert off.host_bytes_per_rank == 31 * x and kept.host_bytes_per_rank == 0
    o = off.offload
    assert o["host_bytes_per_node"] == 8 * 31 * x and o["pcie_gb_per_s_per_direction"] == 55.0
    assert o["pcie_seconds_per_step"] == pytest.approx(31 * x / 55e9)
    assert 0 < o["pcie_seconds_per_layer"] < o["compute_seconds_per_layer_fwd"]  # the copies hide behind compute


def test_goal_numbers_for_llama3_8b_at_d8():
    """>= 4M tokens within 80 GiB per GPU; >= 6M within 141 GiB with <= 2 TB of host memory per node."""
    at_4m = plan_tsp(replace(LLAMA3_8B, offload_activations=True))
    assert at_4m.peak_bytes_per_rank <= 80 * GIB
    at_6m = plan_tsp(replace(LLAMA3_8B, seq=6 * 2 ** 20, offload_activations=True))
    assert at_6m.peak_bytes_per_rank <= 141 * GIB and at_6m.offload["host_bytes_per_node"] <= 2e12
    assert plan_tsp(LLAMA3_8B).peak_bytes_per_rank > 80 * GIB  # without offload 4M does not fit


def test_max_seq_is_the_longest_that_fits_and_names_the_limit():
    inp = replace(LLAMA3_8B, offload_activations=True)
    device_bound = longest_seq(inp, gpu_mem_bytes=80 * GIB, host_mem_bytes=1000 * GIB)
    assert device_bound.limit == "device" and device_bound.seq >= 4 * 2 ** 20
    assert device_bound.plan.peak_bytes_per_rank <= 80 * GIB < device_bound.next_plan.peak_bytes_per_rank
    host_bound = longest_seq(inp, gpu_mem_bytes=141 * GIB, host_mem_bytes=100 * GIB)
    assert host_bound.limit == "host"
    assert host_bound.plan.host_bytes_per_rank <= 100 * GIB < host_bound.next_plan.host_bytes_per_rank
    assert host_bound.seq % host_bound.unit == 0 and host_bound.unit % 16 == 0
    plain = longest_seq(LLAMA3_8B, gpu_mem_bytes=80 * GIB)
    assert plain.seq < device_bound.seq  # offload is what makes the longer sequence fit
    with pytest.raises(PlanInputError, match="--host-mem-gib"):
        longest_seq(inp, gpu_mem_bytes=80 * GIB)


def test_recommend_offloads_only_when_that_is_what_fits():
    inp = replace(LLAMA3_8B, activation_checkpointing=False)
    rec = recommend(inp, gpu_mem_gib=80, devices=8, offload=True, host_mem_gib=232)
    assert rec.best.layout == "tsp" and rec.best.degree == 8 and rec.best.offload_activations
    assert rec.best.host_bytes_per_rank == 31 * 4 * GIB
    short = recommend(replace(inp, seq=32768), gpu_mem_gib=80, devices=8, offload=True, host_mem_gib=232)
    assert not short.best.offload_activations  # fits without: no PCIe traffic for nothing
    tight = recommend(inp, gpu_mem_gib=80, devices=8, offload=True, host_mem_gib=64)
    assert tight.best is None and any("host memory per rank" in c.verdict for c in tight.rejected)


def test_bad_inputs_name_the_flag():
    with pytest.raises(PlanInputError, match="needs activation_checkpointing"):
        PlanInput(model=PRESETS["8b"], seq=4096, offload_activations=True)
    with pytest.raises(PlanInputError, match="pp=2"):
        PlanInput(model=PRESETS["8b"], seq=4096, pp=2, activation_checkpointing=True, offload_activations=True)
    with pytest.raises(PlanInputError, match="tsp only"):
        plan_layouts(replace(LLAMA3_8B, offload_activations=True), ("tsp", "ulysses"))


def test_cli_lines_and_max_seq(capsys):
    rc, out, err = _plan(capsys, "--model", "8b", "--seq", "4m", "--tsp", "8", "--offload-activations")
    assert rc == 0, err
    assert "host (offloaded) GiB" in out and "124.00 GiB per rank" in out
    assert "992.00 GiB (1.07 TB) per node of 8 GPUs" in out
    assert "PCIe at 55 GB/s per direction" in out and "hidden behind compute" in out
    rc, out, err = _plan(capsys, "--model", "8b", "--tsp", "8", "--max-seq", "--gpu-mem-gib", "141", "--host-mem-gib",
                         "232", "--offload-activations", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["max_seq"] >= 6 * 2 ** 20 and result["limit"] in ("device", "host")
    rc, out, err = _plan(capsys, "--model", "8b", "--tsp", "8", "--max-seq", "--gpu-mem-gib", "80",
                         "--offload-activations")
    assert rc == 2 and "--host-mem-gib" in err and err.count("\n") == 1 and out == ""
    rc, out, err = _plan(capsys, "--model", "8b", "--seq", "4m", "--layout", "tsp,ulysses", "--offload-activations")
    assert rc == 2 and "--offload-activations" in err and "tsp only" in err


def test_plan_within_10_percent_of_the_fake_measurement():
    """The production offload path (ShardedCausalLM, 8 checkpointed layers) under FakeTensorMode: the device peak
    drop and the host pool against plan_tsp (fresh process: the fake process group needs none up)."""
    code = ("import json; from ds_tsp.tools.bench.layer_memory import LayerMemoryConfig; "
            "from ds_tsp.tools.bench.offload_memory import measure_offload; "
            "print(json.dumps(measure_offload(LayerMemoryConfig(hidden=64, heads=4, ffn=96, seq=16384, tsp=1, "
            "dtype='bf16', fake=True), 8)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(result["drop_over_plan"] - 1) <= 0.10, result
    assert result["host_over_plan"] == 1.0  # the pool is exactly the offloaded inputs
    (rank,) = result["ranks"]
    assert rank["device_held_inputs"] <= result["plan"]["device_held_inputs"] + 0.25  # the in-flight ones only
    assert rank["offload"]["host_pool_bytes"] == result["plan"]["host_bytes_per_rank"]
