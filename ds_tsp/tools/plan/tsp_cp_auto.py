"""`ds-tsp plan --cp C` under tsp.cp_comm "auto" (the default): the schedule the model would run, and why.

The choice is the model's own (ds_tsp.core.layers.attention.cp_cost.choose_cp_comm: per attention layer, from the
padded sequence length, the schedule with less exposed inter-node time at the plan's hardware defaults, ties to the
ring; sliding-window layers and head blocks the all-to-all cannot split take the ring), for this input's shapes. The
result is the chosen schedule's plan (tsp_cp.plan_tsp_cp or tsp_cp_all_to_all.plan_tsp_cp_all_to_all) with its cp
summary telling the choice: `cp_comm` (chosen), `cp_comm_requested` "auto", and `cp_comm_auto` with both schedules'
per-layer bytes, transfer and exposed seconds (at the --inter-node-gbps / --gpu-tflops given, which the model does
not know: its choice is at the defaults, and `decided_at` says so), the attention seconds the ring hides behind,
the attention layers counted, and from which padded length the ring is chosen.

A model whose sliding-window layers take the ring while its full layers would take the all-to-all runs both
schedules; the plan models one per model, so it refuses that input by name (plan --cp-comm ring or all_to_all).
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.core.layers.attention.cp_cost import (
    GPU_TFLOPS,
    INTER_NODE_GBPS,
    CPLayerShape,
    choose_cp_comm,
    cp_costs,
    describe_choice,
    ring_from_seq,
)
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.tsp_comm import TSPGeometry
from ds_tsp.tools.plan.tsp_cp import group_input, plan_tsp_cp

__all__ = ["plan_tsp_cp_auto", "cp_layer_shape", "auto_lines"]


def cp_layer_shape(inp: PlanInput, cp: int) -> CPLayerShape:
    """The attention layers' cp traffic shape (cp_cost.CPLayerShape) for a plan input."""
    g = TSPGeometry.of(group_input(inp, cp))
    return CPLayerShape(g.nq_b, g.nkv_b, g.kv_replicas, g.dims.d, inp.degree, cp, inp.dtype_bytes,
                        inp.activation_checkpointing, inp.keep_gathered_kv)


def plan_tsp_cp_auto(inp: PlanInput, cp: int, *, inter_node_gbps: float = INTER_NODE_GBPS,
                     gpu_tflops: float = GPU_TFLOPS, gpus_per_node: int = 8) -> LayoutPlan:
    """The plan of the schedule "auto" runs for this input, its cp summary telling which and why."""
    rates = {"inter_node_gbps": inter_node_gbps, "gpu_tflops": gpu_tflops, "gpus_per_node": gpus_per_node}
    if cp == 1:
        return plan_tsp_cp(inp, cp, **rates)
    shape = cp_layer_shape(inp, cp)
    seq = group_input(inp, cp).seq * cp  # S padded to 2CD, as the model sees it
    windows = [w for w in inp.model.attention_windows or () if w is not None]
    full = choose_cp_comm("auto", shape, seq)
    if windows and full == "all_to_all" and len(windows) < len(inp.model.attention_windows):
        raise PlanInputError("cp_comm", f"cp_comm auto with cp={cp}: the sliding-window layers take the ring and "
                                        "the full layers the all-to-all; the plan models one schedule per model: "
                                        "plan --cp-comm ring or --cp-comm all_to_all")
    chosen = "ring" if windows else full
    if chosen == "all_to_all":
        from ds_tsp.tools.plan.tsp_cp_all_to_all import plan_tsp_cp_all_to_all

        plan = plan_tsp_cp_all_to_all(inp, cp, **rates)
    else:
        plan = plan_tsp_cp(inp, cp, **rates)
    layers = (sum(t == "full_attention" for t in inp.model.layer_types) if inp.model.layer_types is not None
              else plan.layers_per_stage)
    window = windows[0] if windows else None
    auto = {"chosen": chosen, "reason": describe_choice("auto", shape, window=window),
            "ring_from_seq": ring_from_seq(shape, window=window), "seq_padded": seq, "attention_layers": layers,
            "per_layer": cp_costs(shape, seq, inp.batch, inter_node_gbps=inter_node_gbps, gpu_tflops=gpu_tflops),
            "decided_at": {"inter_node_gbps": INTER_NODE_GBPS, "gpu_tflops": GPU_TFLOPS}}
    return replace(plan, cp={**plan.cp, "cp_comm": chosen, "cp_comm_requested": "auto", "cp_comm_auto": auto})


def auto_lines(plan: LayoutPlan) -> list[str]:
    """The choice's line under `ds-tsp plan --cp C` (cp_comm auto): which schedule, why, both schedules' figures."""
    auto = plan.cp["cp_comm_auto"]
    cost, n = auto["per_layer"], auto["attention_layers"]
    a2a = cost["all_to_all"]

    def figures(c):
        return (f"{n * c['bytes'] / 2 ** 30:.1f} GiB, {n * c['seconds']:.2f} s, exposed "
                f"{n * c['exposed_seconds']:.2f} s")

    at = ("" if (cost["inter_node_gbps"], cost["gpu_tflops"]) == (INTER_NODE_GBPS, GPU_TFLOPS) else
          f"; the model decides at {INTER_NODE_GBPS:g} Gb/s and {GPU_TFLOPS:g} TFLOP/s")
    return [f"cp schedule (cp_comm auto): {auto['chosen']} at seq {auto['seq_padded']}; per layer: {auto['reason']}",
            f"  per step and rank over {n} attention layers at {cost['inter_node_gbps']:g} Gb/s: ring "
            f"{figures(cost['ring'])} (behind {n * cost['attention_seconds']:.2f} s of attention); all-to-all "
            + (figures(a2a) if a2a is not None else "refused (heads do not split over cp)") + at]
