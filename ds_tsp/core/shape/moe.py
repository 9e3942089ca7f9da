"""The mixture-of-experts part of a ModelShape: its rules, and how the experts split over the TSP degree (rank p owns
experts [p*E/D, (p+1)*E/D)). Which config fields each MoE family reads, and which layers it makes sparse: its
adapter in ds_tsp.core.shape.families (qwen3_moe, mixtral, qwen3_5, qwen3_next)."""
from __future__ import annotations

from ds_tsp.core.errors import TSPConfigError


def check_moe_fields(shape) -> None:
    """ModelShape.__post_init__'s MoE checks (no-op for a dense shape)."""
    if shape.num_experts == 0:
        return
    for name in ("num_experts_per_tok", "moe_intermediate_size"):
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TSPConfigError(f"{name}={value!r}: must be a positive integer in a mixture-of-experts model")
    if shape.num_experts_per_tok > shape.num_experts:
        raise TSPConfigError(f"num_experts_per_tok={shape.num_experts_per_tok} exceeds num_experts="
                             f"{shape.num_experts}: a token cannot pick more experts than exist")
    bad = [i for i in shape.dense_mlp_layers if not 0 <= i < shape.num_layers]
    if bad:
        raise TSPConfigError(f"dense_mlp_layers contains {bad[0]}: layer indices are 0..{shape.num_layers - 1}")
    check_routing(shape)


MOE_ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")


def check_routing(shape) -> None:
    """The routing kind and its fields: the softmax routings have no groups and no scaling; sigmoid_grouped
    (GLM-4.5) splits the experts into moe_groups groups of at least 2 (a group scores the sum of its best two)."""
    if shape.moe_routing not in MOE_ROUTINGS:
        raise TSPConfigError(f"moe_routing={shape.moe_routing!r}: TSP routes by {', '.join(MOE_ROUTINGS)}")
    groups, keep, scale = shape.moe_groups, shape.moe_topk_groups, shape.routed_scaling_factor
    if shape.moe_routing != "sigmoid_grouped":
        if (groups, keep, scale) != (1, 1, 1.0):
            raise TSPConfigError(f"moe_groups={groups}, moe_topk_groups={keep}, routed_scaling_factor={scale} with "
                                 "softmax routing: grouped and scaled routing is moe_routing='sigmoid_grouped'")
        return
    for name in ("moe_groups", "moe_topk_groups"):
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TSPConfigError(f"{name}={value!r}: must be a positive integer")
    if shape.num_experts % groups or shape.num_experts // groups < 2:
        raise TSPConfigError(f"moe_groups={groups} for num_experts={shape.num_experts}: the experts split into equal "
                             "groups of at least 2 (a group is scored by the sum of its two best experts)")
    if keep > groups or shape.num_experts_per_tok > keep * (shape.num_experts // groups):
        raise TSPConfigError(f"moe_topk_groups={keep} of moe_groups={groups}: at most every group, holding at least "
                             f"num_experts_per_tok={shape.num_experts_per_tok} experts together")
    if shape.output_router_logits:
        raise TSPConfigError("output_router_logits=True with moe_routing='sigmoid_grouped': transformers' GLM-4.5 "
                             "adds no load-balancing loss (its correction bias balances the experts); set it False")


def check_moe_degree(shape, tsp: int) -> None:
    """Experts split whole over the TSP ranks; the per-expert width moe_intermediate_size need not divide."""
    if shape.num_experts and shape.num_experts % tsp:
        fits = [d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]
        raise TSPConfigError(
            f"num_experts={shape.num_experts} is not divisible by tsp={tsp}: every rank owns num_experts/tsp whole "
            f"experts; pick tsp among {fits}")
