"""`ds-tsp plan` / `ds-tsp bench` for hybrid (Gated DeltaNet) models: ds_tsp.tools.plan.hybrid against real TSP steps.

Comm bytes per CommCounter kind equal the measured totals EXACTLY on every rank; params and grads bytes per rank
exactly; saved activations within 10% of what autograd keeps (saved-tensor hooks, deduped by storage, params
excluded) and the peak within 10% of bench's MemTracker reading of one training step (bench's own TSP session,
so this also runs `ds-tsp bench`'s TSP layout on a hybrid model) -- the tolerances tests/tools/test_plan.py uses.
One launch of 2 ranks for every case.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch.distributed as dist

pytest.importorskip("transformers")
from hybrid_tiny import hybrid_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402
from plan_step_measure import measure_step  # noqa: E402

from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.plan import (  # noqa: E402
    PlanInput,
    PlanInputError,
    plan_layouts,
    plan_tsp,
    tsp_counter_bytes,
)
from ds_tsp.tools.plan import cli as plan_cli  # noqa: E402
from ds_tsp.tools.plan.hybrid import hybrid_counter_bytes  # noqa: E402

# name -> (config kwargs, seq, batch): seq 29 pads to 2D; seq 6 gives chunks of 1-2 tokens, shorter than the conv's
# K-1 = 3 halo (the halo then spans several chunks)
CASES = {
    "qwen3_5": (dict(family="qwen3_5"), 29, 2),
    "qwen3_next_short": (dict(family="qwen3_next", layer_types=("linear_attention", "linear_attention",
                                                                "full_attention"), num_hidden_layers=3), 6, 1),
}


def _shape(name: str) -> ModelShape:
    kwargs, _, _ = CASES[name]
    return ModelShape.from_hf_config(hybrid_config(**kwargs).to_dict())


def _measure(shapes: dict) -> dict:
    out = {}
    for name, shape in shapes.items():
        _, seq, batch = CASES[name]
        out[name] = measure_step(shape, seq, batch)
    return out


# the live peak: a Gated DeltaNet layer on top (its backward is the peak), at two head sizes: 4 (the chunk
# kernel's [C, C] matrices dominate its temporaries) and 64 (its per-head rows and [dk, dk + dv] transitions do, as
# at real head sizes): a plan fitted at head size 4 alone planned about half the peak at 64
PEAK_CASES = {4: 512, 64: 256}  # head size -> seq


def _peak_shape(head_dim: int = 4) -> ModelShape:
    return ModelShape.from_hf_config(hybrid_config("qwen3_5", layer_types=("full_attention", "linear_attention"),
                                                   hidden_size=64, intermediate_size=192, vocab_size=512,
                                                   linear_key_head_dim=head_dim,
                                                   linear_value_head_dim=head_dim).to_dict())


def _measure_and_peak(shapes: dict, peak_shapes: dict) -> dict:
    from ds_tsp.tools.bench import tsp
    from ds_tsp.tools.bench.config import BenchConfig
    from ds_tsp.tools.bench.measure import tracked_step

    out = _measure(shapes)
    _, seq, batch = CASES["qwen3_5"]
    out["speed"] = measure_step(shapes["qwen3_5"], seq, batch, options={"recompute_projections": False})
    out["peak"] = {}
    for head_dim, seq in PEAK_CASES.items():
        cfg = BenchConfig(layout="tsp", seqs=(seq,), tsp=dist.get_world_size(), shape=peak_shapes[head_dim])
        workload = tsp.build(cfg, {"mode": "memory"}).workload(seq)
        workload.step()  # optimizer state exists from here on, as in the bench's warm-up
        out["peak"][head_dim] = tracked_step(workload)["peak_bytes"]
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_on_local_ranks(_measure_and_peak, 2, {name: _shape(name) for name in CASES},
                              {head_dim: _peak_shape(head_dim) for head_dim in PEAK_CASES}, timeout_s=240)


def _input(name: str) -> PlanInput:
    _, seq, batch = CASES[name]
    return PlanInput(model=_shape(name), seq=seq, batch=batch, degree=2, dtype="fp32")


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_comm_params_and_grads_equal_the_measured_step(measured, name):
    inp = _input(name)
    predicted = hybrid_counter_bytes(inp)
    with pytest.raises(PlanInputError, match="hybrid_counter_bytes"):  # not Llama layers' bytes
        tsp_counter_bytes(inp)
    for rank, per_rank in enumerate(measured):  # the later ranks move less of the causal K/V (at_rank)
        want = hybrid_counter_bytes(inp, rank=rank)
        assert per_rank[name]["bytes"] == want, (rank, per_rank[name]["bytes"], want)
    plan = plan_tsp(inp)
    for per_rank in measured:
        assert per_rank[name]["params"] == plan.params_bytes and per_rank[name]["grads"] == plan.grads_bytes
    assert plan.comm_bytes_per_step == sum(predicted.values())
    linear = sum(t == "linear_attention" for t in inp.model.layer_types)
    assert linear * (plan.comm_bytes_per_layer_fwd + plan.comm_bytes_per_layer_bwd) + \
        sum(t.bytes for t in plan.step_terms) == plan.comm_bytes_per_step


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_saved_activations_within_10_percent(measured, name):
    plan = plan_tsp(_input(name))
    for per_rank in measured:
        assert abs(plan.activations_bytes - per_rank[name]["saved"]) <= 0.10 * per_rank[name]["saved"], \
            (plan.activations_bytes, per_rank[name]["saved"])


def test_speed_mode_comm_and_saved_activations_equal_the_measured_step(measured):
    """recompute_projections off: no transition re-gather in backward, and every Gated DeltaNet head block's kept
    forward (traced under FakeTensorMode by the planner) in the saved activations."""
    inp = dataclasses.replace(_input("qwen3_5"), recompute_projections=False)
    predicted, memory_mode = hybrid_counter_bytes(inp), hybrid_counter_bytes(_input("qwen3_5"))
    assert predicted["all_gather"] < memory_mode["all_gather"]
    plan = plan_tsp(inp)
    for rank, per_rank in enumerate(measured):
        want = hybrid_counter_bytes(inp, rank=rank)
        assert per_rank["speed"]["bytes"] == want, (per_rank["speed"]["bytes"], want)
        assert abs(plan.activations_bytes - per_rank["speed"]["saved"]) <= 0.10 * per_rank["speed"]["saved"], \
            (plan.activations_bytes, per_rank["speed"]["saved"])


@pytest.mark.parametrize("head_dim", list(PEAK_CASES))
def test_hybrid_peak_within_5_percent_of_the_bench_measurement(measured, head_dim):
    peak = max(per_rank["peak"][head_dim] for per_rank in measured)
    plan = plan_tsp(PlanInput(model=_peak_shape(head_dim), seq=PEAK_CASES[head_dim], degree=2, dtype="fp32"))
    assert abs(plan.peak_bytes_per_rank - peak) <= 0.05 * peak, (plan.peak_bytes_per_rank, peak, plan.peak_phase)
    assert plan.peak_phase == "gdn_bwd"


def test_bench_runs_hybrids_on_the_tsp_layouts_and_refuses_the_peers_by_name(tmp_path):
    from ds_tsp.tools.bench.cli import build_parser, configs_from_args

    (tmp_path / "config.json").write_text(hybrid_config("qwen3_5", layer_types=(
        "linear_attention", "full_attention", "linear_attention"), num_hidden_layers=3).to_json_string())
    base = ["--hf-config", str(tmp_path / "config.json"), "--tsp", "2", "--seq", "32"]
    configs = configs_from_args(build_parser().parse_args(base))  # --layouts all: the TSP ones + the ZeRO-3 peer
    assert [c.layout for c in configs] == ["tsp", "tsp_speed", "hf_zero3_dp"]
    assert configs[0].shape.layer_types == ("linear_attention", "full_attention", "linear_attention")
    cut = configs_from_args(build_parser().parse_args([*base, "--layers", "2", "--layouts", "tsp"]))
    assert cut[0].shape.num_layers == 2 and cut[0].shape.layer_types == ("linear_attention", "full_attention")
    with pytest.raises(ValueError, match=r"ulysses_zero3.*hybrid.*Gated DeltaNet"):
        configs_from_args(build_parser().parse_args([*base, "--layouts", "tsp,ulysses_zero3"]))


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds-tsp")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_cli_plans_a_hybrid_config_for_tsp_and_refuses_the_peers_by_name(tmp_path, capsys):
    (tmp_path / "config.json").write_text(hybrid_config("qwen3_5").to_json_string())
    assert _run_cli(["plan", "--hf-config", str(tmp_path), "--seq", "4k", "--tsp", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [r["layout"] for r in rows] == ["tsp"]
    names = [t["name"] for t in rows[0]["layer_fwd_terms"]]
    assert "chunk transition all-gather (per head block)" in names and "conv halo all-gather" in names
    assert _run_cli(["plan", "--hf-config", str(tmp_path), "--seq", "4k", "--tsp", "2", "--layers", "1",
                     "--json"]) == 0  # --layers keeps the first layers' types
    one = json.loads(capsys.readouterr().out.splitlines()[0])
    assert one["comm_bytes_per_step"] < rows[0]["comm_bytes_per_step"]
    assert not any(t["name"].startswith("full-attention layers") for t in one["step_terms"])
    inp = PlanInput(model=_shape("qwen3_5"), seq=4096, degree=2, dtype="bf16")
    with pytest.raises(PlanInputError, match="hybrid"):
        plan_layouts(inp, ("tsp", "ulysses"))
    # pipeline stages are planned (checked against real stages in tests/tools/test_plan_hybrid_pipeline.py)
    assert plan_tsp(PlanInput(model=inp.model, seq=4096, degree=2, pp=2)).layers_per_stage == 1
    # the Gated DeltaNet's comm does not grow with S; the attention layer's K/V does
    long = plan_tsp(PlanInput(model=inp.model, seq=65536, degree=2, dtype="bf16"))
    short = plan_tsp(inp)
    assert long.comm_bytes_per_layer_fwd == short.comm_bytes_per_layer_fwd
    assert long.comm_bytes_per_step > short.comm_bytes_per_step
