"""The layout registry: name -> planner, the default set `ds-tsp plan` prints, and planning several at once."""
from __future__ import annotations

from collections.abc import Callable

from ds_tsp.tools.plan.fsdp_cp import plan_fsdp_cp
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import gemma4_peer_refusal
from ds_tsp.tools.plan.tp import plan_autotp, plan_tp
from ds_tsp.tools.plan.tp_sp import plan_tp_sp
from ds_tsp.tools.plan.tsp import plan_tsp
from ds_tsp.tools.plan.ulysses import plan_ulysses, plan_ulysses_replicated

LAYOUTS: dict[str, Callable[[PlanInput], LayoutPlan]] = {
    "tsp": plan_tsp, "tp": plan_tp, "tp_sp": plan_tp_sp, "ulysses": plan_ulysses, "fsdp_cp": plan_fsdp_cp,
    "ulysses_replicated": plan_ulysses_replicated, "autotp": plan_autotp,
}
DEFAULT_LAYOUTS = ("tsp", "tp", "tp_sp", "ulysses", "fsdp_cp")


def plan_layouts(inp: PlanInput, layouts: tuple[str, ...] | list[str] = DEFAULT_LAYOUTS) -> list[LayoutPlan]:
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise PlanInputError("layout", f"layout {unknown}: choose among {sorted(LAYOUTS)}")
    peers = [name for name in layouts if name != "tsp"]
    if inp.model.num_experts and peers:
        raise PlanInputError("layout", f"layout {peers}: mixture-of-experts shapes (num_experts="
                                       f"{inp.model.num_experts}) are planned for tsp only; the peers' expert "
                                       "parallelism is not modelled. Use --layout tsp")
    if inp.model.layer_types is not None and peers:
        raise PlanInputError("layout", f"layout {peers}: hybrid models (Gated DeltaNet layers) are planned for tsp "
                                       "only; the peers' plans count Llama attention layers. Use --layout tsp")
    if gemma4_peer_refusal(inp.model) and peers:
        raise PlanInputError("layout", f"layout {peers}: {gemma4_peer_refusal(inp.model)} planned for tsp only; the "
                                       "peers' plans count one attention shape and no per-layer inputs. Use --layout "
                                       "tsp")
    if inp.offload_activations and peers:
        raise PlanInputError("offload_activations", f"layout {peers}: offload of checkpointed activations is "
                                                    "planned for tsp only; use --layout tsp")
    return [LAYOUTS[name](inp) for name in layouts]
