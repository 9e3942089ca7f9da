"""Turn one layout's per-stage memory and comm terms into its LayoutPlan (the stage with the highest peak)."""
from __future__ import annotations

from collections.abc import Callable

from ds_tsp.tools.plan.comm_terms import nonzero, total
from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.memory import StageMemory
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import Stage, stages


def layout_plan(layout: str, inp: PlanInput, stage_fn: Callable[[Stage], StageMemory], layer_fwd, layer_bwd,
                per_layer: int, notes: tuple[str, ...], *, layers_of: Callable[[Stage], int] | None = None,
                moe: dict | None = None) -> LayoutPlan:
    """Evaluate every pipeline stage with stage_fn; report the one with the highest peak (comm: the busiest).
    layers_of(stage): how many of the stage's layers the layer terms describe (default all; an MoE model's layer
    terms are its sparse layers', its dense layers' come in the stage's step_terms)."""
    best = None
    comm_max = 0
    for stage in stages(inp):
        s = stage_fn(stage)
        n_layers = stage.layers if layers_of is None else layers_of(stage)
        step = n_layers * (total(layer_fwd) + total(layer_bwd)) + total(s.step_terms)
        comm_max = max(comm_max, step)
        if best is None or s.peak > best[1].peak:
            best = (stage, s)
    stage, s = best
    phase = s.peak_phase
    return LayoutPlan(
        layout=layout, params_bytes=s.params, grads_bytes=s.grads, optimizer_bytes=s.optimizer,
        activations_bytes=s.activations, transients_bytes=s.phases[phase].transient, peak_bytes_per_rank=s.peak,
        comm_bytes_per_layer_fwd=total(layer_fwd), comm_bytes_per_layer_bwd=total(layer_bwd),
        comm_bytes_per_step=comm_max, activation_bytes_per_layer=per_layer, stage=stage.name,
        layers_per_stage=stage.layers, layer_fwd_terms=nonzero(layer_fwd), layer_bwd_terms=nonzero(layer_bwd),
        step_terms=nonzero(s.step_terms), transients={k: p.transient for k, p in s.phases.items()}, notes=notes,
        framework_bytes=s.framework, peak_phase=phase, phase_bytes=s.phase_bytes, moe=moe or {})
