"""TSP mixture-of-experts MLP (Qwen3-MoE / Mixtral / GLM-4.5 sparse block): E/D whole experts per rank, a replicated
router.

Routing is transformers' own (ds_tsp.core.layers.moe.routing); the routed rows meet the experts by one of two
schedules, both dropless (variable rows per expert, no token dropped), forward and backward in one
torch.autograd.Function each:
- "ring" (ds_tsp.core.layers.moe.ring): the packed experts travel the weight ring like the dense MLP's shards;
  bytes independent of the sequence length.
- "all_to_all" (ds_tsp.core.layers.moe.all_to_all): token rows go to the experts' owners and come back;
  bytes proportional to tokens x top_k x hidden.
choose_moe_dispatch picks the one with fewer bytes per layer (ds_tsp.core.layers.moe.cost); the load-balancing
auxiliary loss is ds_tsp.core.layers.moe.aux_loss.

Autocast: both Functions are AUTOCAST_LOW_PRECISION (ds_tsp.core.layers.amp): under torch.autocast x, the routing
weights and the packed experts are cast to the autocast dtype ONCE on entry, so the ring carries the cast experts
(half the bytes of fp32 master weights), all_to_all the cast rows, and backward runs in that one dtype; autograd
casts the grads back to the fp32 parameters' dtype. The router itself runs outside, under autocast as in
transformers (its logits in the autocast dtype, the softmax in float32).

Host syncs: ONE device-to-host read per MoE layer forward under either dispatch (the per-expert row counts: the
ring's step bounds, all_to_all's split sizes), none in backward; see moe_ring / moe_all_to_all.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.amp import apply_autocast, dtype_inside
from ds_tsp.core.layers.moe.all_to_all import MoEAllToAll
from ds_tsp.core.layers.moe.aux_loss import moe_aux_loss_share
from ds_tsp.core.layers.moe.cost import choose_moe_dispatch, moe_bytes_per_layer
from ds_tsp.core.layers.moe.experts import ExpertGLU, select_expert_gemm
from ds_tsp.core.layers.moe.ring import MoERing
from ds_tsp.core.layers.moe.routing import route, route_sigmoid_grouped
from ds_tsp.core.layers.weight_packing import PackedLayout

__all__ = ["MoESpec", "tsp_moe_mlp", "moe_compute_dtype", "moe_aux_loss_share", "moe_bytes_per_layer",
           "choose_moe_dispatch"]

DISPATCHES = {"ring": MoERing, "all_to_all": MoEAllToAll}


@dataclass(frozen=True)
class MoESpec:
    hidden: int
    moe_ffn: int  # per-expert intermediate size F (Qwen3-MoE moe_intermediate_size; Mixtral intermediate_size)
    num_experts: int  # E, global
    experts_per_rank: int  # E // D: rank p owns experts [p*E_r, (p+1)*E_r)
    top_k: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum 1 (Mixtral: always True)
    recompute_projections: bool = True  # memory-optimal backward (recompute expert activations), like MLPSpec
    glu: ExpertGLU = ExpertGLU()  # the experts' gated unit (GPT-OSS: clamped SwiGLU, gate / up rows interleaved)
    biases: bool = False  # GPT-OSS: every expert has gate_up and down biases (and the router a bias)
    # routing kind (ModelShape.moe_routing, ds_tsp.core.layers.moe.routing): "softmax_topk" (Qwen3-MoE, Mixtral),
    # "topk_softmax" (GPT-OSS), or GLM-4.5's "sigmoid_grouped" with its groups, kept groups and weight scale (a
    # correction bias passed to tsp_moe_mlp)
    routing: str = "softmax_topk"
    groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0

    @cached_property
    def layout(self) -> PackedLayout:
        """transformers' fused in-memory layout, sliced along the expert dim: gate = rows [0, F) of gate_up (GPT-OSS:
        gate / up rows interleaved, its checkpoint's [E, h, 2F] transposed per expert), biases after the weights."""
        e, f, h = self.experts_per_rank, self.moe_ffn, self.hidden
        pieces = [("gate_up", (e, 2 * f, h)), ("down", (e, h, f))]
        if self.biases:
            pieces += [("gate_up_bias", (e, 2 * f)), ("down_bias", (e, h))]
        return PackedLayout(tuple(pieces))


def _check(x, router_weight, experts_shard, spec: MoESpec, comm: TSPComm, dispatch: str, path: str,
           correction_bias) -> None:
    if (spec.routing == "sigmoid_grouped") != (correction_bias is not None):
        given = "a tensor" if correction_bias is not None else None
        raise TSPConfigError(f"routing={spec.routing!r} with correction_bias={given}: grouped sigmoid routing (and "
                             "only it) takes the [num_experts] bias")
    if dispatch not in DISPATCHES:
        raise TSPConfigError(f"moe_dispatch={dispatch!r}: tsp_moe_mlp takes 'ring' or 'all_to_all' (resolve 'auto' "
                             "with choose_moe_dispatch first)")
    if spec.experts_per_rank * comm.size != spec.num_experts:
        raise TSPConfigError(f"num_experts={spec.num_experts} with experts_per_rank={spec.experts_per_rank} on a TSP "
                             f"group of {comm.size}: every rank must own num_experts / tsp whole experts")
    if not 1 <= spec.top_k <= spec.num_experts:
        raise TSPConfigError(f"top_k={spec.top_k}: must be between 1 and num_experts={spec.num_experts}")
    if tuple(router_weight.shape) != (spec.num_experts, spec.hidden) or x.shape[-1] != spec.hidden:
        raise TSPConfigError(f"router_weight {tuple(router_weight.shape)} / x {tuple(x.shape)}: expected router "
                             f"[num_experts={spec.num_experts}, hidden={spec.hidden}] and x [..., {spec.hidden}]")
    if experts_shard.numel() != spec.layout.numel:
        raise TSPConfigError(f"experts_shard has {experts_shard.numel()} elements; MoESpec.layout needs "
                             f"{spec.layout.numel} (experts_per_rank x 3 x moe_ffn x hidden)")
    if x.device.type == "meta" and (dispatch == "all_to_all" or path == "loop"):
        raise TSPConfigError(f"moe_dispatch={dispatch!r} with the {path} expert GEMMs on the meta device: it reads "
                             "the per-expert row counts on the host (all_to_all split sizes / loop bounds), which "
                             "meta tensors do not have. Use moe_dispatch='ring' with bfloat16 weights (grouped GEMMs; "
                             "on meta each ring step takes a static worst-case row window instead) for meta runs")


def moe_compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the MoE Functions compute (and send) in for a tensor of `dtype`: the autocast dtype when autocast
    is on for `device_type` (both dispatches share the AUTOCAST_LOW_PRECISION policy), else `dtype`."""
    return dtype_inside(MoERing, device_type, dtype)


def tsp_moe_mlp(x: torch.Tensor, router_weight: torch.Tensor, experts_shard: torch.Tensor, spec: MoESpec,
                comm: TSPComm, *, dispatch: str, correction_bias: torch.Tensor | None = None,
                router_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, h] local tokens; router_weight [E, h] (replicated; the caller wraps it in replicated_param so its
    grad is summed over the TSP group); experts_shard: flat packed param of this rank's E_r experts; dispatch
    "ring" or "all_to_all" (already resolved from "auto"); correction_bias [E]: the choice bias of spec.routing
    "sigmoid_grouped" (replicated, no gradient); router_bias [E]: GPT-OSS's (replicated like the weight), given iff
    spec.biases. Returns (y [B, L, h], router_logits [B*L, E] (x.dtype; float32 or float64 for sigmoid_grouped),
    differentiable w.r.t. x and router_weight -- what HF returns as router_logits)."""
    if (router_bias is not None) != spec.biases:
        raise TSPConfigError(f"router_bias {'given' if router_bias is not None else 'missing'} with spec.biases="
                             f"{spec.biases}: a biased MoE (GPT-OSS) has a router bias, the others none")
    # the expert GEMMs see the dtype the Function casts the experts to (the autocast dtype under autocast)
    path = select_expert_gemm(x.device, moe_compute_dtype(x.device.type, experts_shard.dtype), spec.hidden,
                              spec.moe_ffn)
    _check(x, router_weight, experts_shard, spec, comm, dispatch, path, correction_bias)
    x2d = x.reshape(-1, spec.hidden)
    if spec.routing == "sigmoid_grouped":
        logits, top_w, top_i = route_sigmoid_grouped(x2d, router_weight, correction_bias, spec.top_k, spec.groups,
                                                     spec.topk_groups, spec.norm_topk_prob, spec.scaling)
    else:
        logits, top_w, top_i = route(x2d, router_weight, spec.top_k, spec.norm_topk_prob, router_bias, spec.routing)
    y2d = apply_autocast(DISPATCHES[dispatch], x.device.type, x2d, top_w, top_i, experts_shard, spec, comm, path)
    return y2d.view(x.shape), logits
