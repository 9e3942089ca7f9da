"""A mixture-of-experts model under the cp ring (`ds-tsp plan --cp C` with experts): what cp adds to TSP's MoE rows.

Each TSP group of the ring is planned as TSP alone at S_pad / C tokens (ds_tsp.tools.plan.tsp_cp.group_input), and
its MoE rows are TSP's (ds_tsp.tools.plan.moe_terms: experts 1/D per rank, both dispatch schedules' bytes per
sparse layer at the group's B x S_pad / (C D) local tokens, "auto" decided on those): expert dispatch never leaves
the TSP group, so the cp ring's bytes stay the attention ring's. What cp adds is the load-balancing loss's
statistic of the whole sequence (ds_tsp.core.layers.moe.aux_loss): with output_router_logits, the per-expert counts
and the row total ((E + 1) values, compute dtype), already all-reduced over the TSP group, are all-reduced once
more over the cp group per step, across nodes.
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.tools.plan.activation_terms import compute_bytes
from ds_tsp.tools.plan.comm_terms import all_reduce_bytes, term
from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.result import CommTerm, LayoutPlan

__all__ = ["moe_cp_step_terms", "with_moe_cp_terms"]


def moe_cp_step_terms(inp: PlanInput, cp: int) -> list[CommTerm]:
    """Per step, across nodes: the aux loss counts' all-reduce over the cp group (what comm.cp's counter counts)."""
    m = inp.model
    if cp == 1 or not m.num_experts or not m.output_router_logits:
        return []
    payload = (m.num_experts + 1) * compute_bytes(inp.dtype_bytes)
    return [term("MoE aux loss counts all-reduce over cp", "all_reduce", payload, 1, all_reduce_bytes(payload, cp))]


def with_moe_cp_terms(plan: LayoutPlan, inp: PlanInput, cp: int) -> LayoutPlan:
    """`plan` (a tsp_cp plan) with the cp group's MoE step terms added to its step bytes and inter-node bytes."""
    terms = moe_cp_step_terms(inp, cp)
    if not terms:
        return plan
    extra = sum(t.bytes for t in terms)
    summary = dict(plan.cp)
    summary["inter_node_bytes_per_step"] += extra
    summary["inter_node_bytes_per_rank"] = [b + extra for b in summary["inter_node_bytes_per_rank"]]
    summary["moe_aux_cp_bytes_per_step"] = extra
    note = (f"MoE under cp: experts dispatched inside each TSP group (bytes per sparse layer as TSP's at "
            f"{summary['tokens_per_rank']} tokens per rank); the aux loss's counts all-reduced over cp too, "
            f"{extra} B per step across nodes")
    return replace(plan, step_terms=plan.step_terms + tuple(terms),
                   comm_bytes_per_step=plan.comm_bytes_per_step + extra, cp=summary, notes=plan.notes + (note,))
