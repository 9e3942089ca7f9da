"""`ds-tsp plan` for MoE hybrids (Qwen3-Next, Qwen3.5-MoE: experts + shared expert + its sigmoid gate) and for hybrid
models under activation checkpointing and offload_activations, against real TSP steps (ds_tsp.tools.plan.hybrid).

The method of tests/tools/test_plan_hybrid.py: comm bytes per CommCounter kind equal the measured totals EXACTLY on every
rank (top_k = num_experts, so all_to_all moves the plan's even-routing rows exactly, as tests/tools/test_plan_moe.py
does; both dispatch schedules), params and grads bytes exactly, saved activations within 10% of saved-tensor hooks
(exact under checkpointing: each layer keeps its input only), the offload pool's host bytes exactly, and the peak
within 10% of bench's MemTracker reading of one training step. One launch of 2 ranks for every case.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch.distributed as dist

pytest.importorskip("transformers")
from hybrid_tiny import hybrid_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402
from plan_step_measure import measure_step  # noqa: E402

from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.plan import PlanInput, plan_tsp  # noqa: E402
from ds_tsp.tools.plan import cli as plan_cli  # noqa: E402
from ds_tsp.tools.plan.hybrid import described_kind, hybrid_counter_bytes, layer_kinds  # noqa: E402

# Qwen3-Next with a dense Gated DeltaNet layer 0 (mlp_only_layers), a sparse full-attention layer and a sparse Gated
# DeltaNet layer: every (mixer, MLP) kind but one; top-k = all 4 experts (exact all_to_all rows)
NEXT = dict(family="qwen3_next_moe", layer_types=("linear_attention", "full_attention", "linear_attention"),
            num_hidden_layers=3, num_experts_per_tok=4)
THREE_LINEAR = dict(family="qwen3_5", layer_types=("linear_attention", "full_attention", "linear_attention"),
                    num_hidden_layers=3)
# name -> (config kwargs, TSPOptions / PlanInput options); seq 29 pads to 32, batch 2
CASES = {
    "next_ring": (NEXT, dict(moe_dispatch="ring")),
    "next_all_to_all": (NEXT, dict(moe_dispatch="all_to_all")),
    "qwen3_5_moe_ckpt": (dict(family="qwen3_5_moe", num_experts_per_tok=4),
                         dict(moe_dispatch="all_to_all", activation_checkpointing=True)),
    "qwen3_5_ckpt": (THREE_LINEAR, dict(activation_checkpointing=True)),
    "qwen3_5_offload": (THREE_LINEAR, dict(activation_checkpointing=True, offload_activations=True)),
}
SEQ, BATCH = 29, 2


def _shape(kwargs: dict) -> ModelShape:
    return ModelShape.from_hf_config(hybrid_config(**kwargs).to_dict())


# the live peak at S = 256 (the chunk kernel's [64, 64] matrices at full size), a Gated DeltaNet layer on top
PEAK_SEQ = 256
_BIG = dict(hidden_size=64, intermediate_size=192, vocab_size=512, layer_types=("full_attention", "linear_attention"))
PEAK_CASES = {
    "moe_all_to_all": (dict(family="qwen3_next_moe", mlp_only_layers=[], **_BIG),
                       dict(moe_dispatch="all_to_all")),
    "dense_ckpt": (dict(family="qwen3_5", **_BIG), dict(activation_checkpointing=True)),
}


def _measure_all(shapes: dict, peak_shapes: dict) -> dict:
    from ds_tsp.tools.bench import tsp
    from ds_tsp.tools.bench.config import BenchConfig
    from ds_tsp.tools.bench.measure import tracked_step

    out = {name: measure_step(shape, SEQ, BATCH, options=CASES[name][1]) for name, shape in shapes.items()}
    for name, shape in peak_shapes.items():
        options = PEAK_CASES[name][1]
        cfg = BenchConfig(layout="tsp", seqs=(PEAK_SEQ,), tsp=dist.get_world_size(), shape=shape,
                          moe_dispatch=options.get("moe_dispatch", "auto"),
                          activation_checkpointing="all" if options.get("activation_checkpointing") else "none")
        workload = tsp.build(cfg, {"mode": "memory"}).workload(PEAK_SEQ)
        workload.step()  # optimizer state exists from here on, as in the bench's warm-up
        out[f"peak_{name}"] = tracked_step(workload)["peak_bytes"]
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_on_local_ranks(_measure_all, 2, {name: _shape(kw) for name, (kw, _) in CASES.items()},
                              {name: _shape(kw) for name, (kw, _) in PEAK_CASES.items()}, timeout_s=300)


def _input(name: str) -> PlanInput:
    kwargs, options = CASES[name]
    return PlanInput(model=_shape(kwargs), seq=SEQ, batch=BATCH, degree=2, dtype="fp32", **options)


@pytest.mark.parametrize("name", list(CASES))
def test_comm_params_and_grads_equal_the_measured_step(measured, name):
    inp = _input(name)
    predicted = hybrid_counter_bytes(inp)
    for rank, per_rank in enumerate(measured):  # the later ranks move less of the causal K/V (at_rank)
        want = hybrid_counter_bytes(inp, rank=rank)
        assert per_rank[name]["bytes"] == want, (rank, per_rank[name]["bytes"], want)
    plan = plan_tsp(inp)
    for per_rank in measured:
        assert per_rank[name]["params"] == plan.params_bytes and per_rank[name]["grads"] == plan.grads_bytes
    assert plan.comm_bytes_per_step == sum(predicted.values())
    # the layer terms x the layers of the kind they describe + the step terms (every other kind) = the whole step
    described = layer_kinds(inp).count(described_kind(inp))
    assert described * (plan.comm_bytes_per_layer_fwd + plan.comm_bytes_per_layer_bwd) + \
        sum(t.bytes for t in plan.step_terms) == plan.comm_bytes_per_step


def test_moe_hybrid_comm_has_the_shared_expert_ring_and_the_aux_loss(measured):
    plan = plan_tsp(_input("next_all_to_all"))
    layer = [t.name for t in (*plan.layer_fwd_terms, *plan.layer_bwd_terms)]
    assert "shared expert weight ring (D-1 hops)" in layer and "Gated DeltaNet shard broadcast" in layer
    assert any(t.kind == "all_to_all" for t in plan.layer_fwd_terms)
    step = [t.name for t in plan.step_terms]
    assert "MoE aux loss counts all-reduce" in step
    assert any(n.startswith("Gated DeltaNet layers (dense MLP) x1: MLP weight ring") for n in step)
    assert any(n.startswith("full-attention layers (sparse MLP) x1: ") for n in step)
    assert plan.moe["schedule"] == "all_to_all" and set(plan.moe["peak_bytes"]) == {"ring", "all_to_all"}
    ckpt = plan_tsp(_input("qwen3_5_moe_ckpt"))
    assert any(t.name.startswith("recompute: MoE") for t in ckpt.layer_bwd_terms)


@pytest.mark.parametrize("name", list(CASES)[:4])
def test_saved_activations_within_10_percent(measured, name):
    plan = plan_tsp(_input(name))
    for per_rank in measured:
        saved = per_rank[name]["saved"]
        assert abs(plan.activations_bytes - saved) <= 0.10 * saved, (plan.activations_bytes, saved)
        if "ckpt" in name:  # each layer's input, the head's tensors, ids and cos/sin: counted exactly
            assert plan.activations_bytes == saved


def test_offload_host_pool_equals_the_plan(measured):
    plan = plan_tsp(_input("qwen3_5_offload"))
    kept = plan_tsp(_input("qwen3_5_ckpt"))
    x = BATCH * 16 * 32 * 4  # one layer input [B, S_pad/D, h] fp32
    assert plan.host_bytes_per_rank == 2 * x  # 3 layers: all but the last one's input
    assert kept.activations_bytes - plan.activations_bytes == x  # the device keeps two of three
    for per_rank in measured:
        assert per_rank["qwen3_5_offload"]["offload_host_bytes"] == plan.host_bytes_per_rank
        assert per_rank["qwen3_5_ckpt"]["offload_host_bytes"] == 0


@pytest.mark.parametrize("name", list(PEAK_CASES))
def test_peak_within_10_percent_of_the_bench_measurement(measured, name):
    kwargs, options = PEAK_CASES[name]
    peak = max(per_rank[f"peak_{name}"] for per_rank in measured)
    plan = plan_tsp(PlanInput(model=_shape(kwargs), seq=PEAK_SEQ, degree=2, dtype="fp32", **options))
    assert abs(plan.peak_bytes_per_rank - peak) <= 0.10 * peak, (plan.peak_bytes_per_rank, peak, plan.peak_phase)


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds-tsp")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_cli_plans_an_moe_hybrid_with_checkpointing_and_offload(tmp_path, capsys):
    (tmp_path / "config.json").write_text(hybrid_config(**NEXT).to_json_string())
    base = ["plan", "--hf-config", str(tmp_path), "--seq", "8k", "--tsp", "2", "--json"]
    assert _run_cli(base) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[0])
    assert plain["moe"]["num_experts"] == 4 and plain["layout"] == "tsp"
    assert _run_cli([*base, "--activation-checkpointing", "--offload-activations"]) == 0
    off = json.loads(capsys.readouterr().out.splitlines()[0])
    assert off["host_bytes_per_rank"] > 0 and off["peak_bytes_per_rank"] < plain["peak_bytes_per_rank"]
    assert off["comm_bytes_per_step"] > plain["comm_bytes_per_step"]  # the recompute's forward traffic
    (tmp_path / "config.json").write_text(hybrid_config(**{**NEXT, "mlp_only_layers": [0, 2]}).to_json_string())
    assert _run_cli([*base, "--layers", "2"]) == 0  # the dense layer 2 is cut with the layer types
    cut = json.loads(capsys.readouterr().out.splitlines()[0])
    assert cut["layers_per_stage"] == 2 and cut["moe"]["num_experts"] == 4
