"""FSDP (ZeRO-3 style, torch FSDP2) over the cp*dp = D*dp ranks + context parallelism of degree D with ring
attention (not run by `ds-tsp bench`: its memory terms are the measured HF layer's, its state FSDP2's).

Tokens S/D per rank (zigzag, seq padded to 2D), all heads. Per layer forward: the layer's weights all-gathered
and D-1 ring hops of the local K and V (2*B*S/D*h_kv each hop); backward: re-gather + grad reduce-scatter and
2(D-1) hops (K/V again and dK/dV). Activations: the HF layer on S/D tokens. Transient: gathered layer
(+ prefetch), its full grads, the K/V ring's send/receive buffers. LM head: full-vocab logits of the local
tokens. FSDP2 keeps sharded params and grads in dtype and frees the unsharded ones after use.
"""
from __future__ import annotations

from ds_tsp.tools.plan.activation_terms import (
    Placement,
    embedding_saved,
    hf_head_saved,
    hf_layer_saved,
    hf_loss_backward,
)
from ds_tsp.tools.plan.assemble import layout_plan
from ds_tsp.tools.plan.comm_terms import pipeline_hops, recompute, sharded_weight_terms, term
from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.peer_stage import PeerState, peer_stage
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import peer_dims, round_up
from ds_tsp.tools.plan.ulysses import head_extras_sharded, zero3_params


def plan_fsdp_cp(inp: PlanInput) -> LayoutPlan:
    dims = peer_dims(inp, "fsdp_cp")
    D, b, B = inp.degree, inp.dtype_bytes, inp.batch
    S = round_up(inp.seq, 2 * D)
    local = B * S // D
    G = D * inp.dp
    kv_hop = 2 * local * dims.nkv * dims.d * b
    fwd = [term("ring attention K/V hops", "ring", kv_hop, D - 1, (D - 1) * kv_hop)]
    bwd = [term("ring attention K/V + dK/dV hops", "ring", kv_hop, 2 * (D - 1), 2 * (D - 1) * kv_hop)]
    if inp.activation_checkpointing:
        bwd += recompute(fwd)
    wf, wb = sharded_weight_terms(inp, dims.layer, G, "layer")
    fwd, bwd = fwd + wf, bwd + wb
    params = zero3_params(dims, G)
    per_layer = hf_layer_saved(inp, dims, Placement(local, local, local, 1, dims.nkv, local, 1))
    head_act = hf_head_saved(inp, dims, norm_tokens=local, head_tokens=local, logits_tokens=local, vocab=dims.V)
    gathered = dims.layer * b
    transients = {"layer_fwd": 2 * gathered + 2 * kv_hop + local * 2 * dims.F * b,
                  "layer_bwd": 3 * gathered + 4 * kv_hop + local * 3 * dims.F * b + 3 * local * dims.h * b,
                  "lm_head_fwd": dims.V * dims.h * b + local * dims.V * b,
                  "lm_head_bwd": 2 * dims.V * dims.h * b + hf_loss_backward(inp, local, dims.V)}

    def stage_fn(stage):
        return peer_stage(inp, stage, params=params, how=PeerState(), per_layer=per_layer,
                          layer_input=local * dims.h * b, other_act=embedding_saved(local, dims, b),
                          head_act=head_act, transients=transients,
                          step_terms=head_extras_sharded(inp, dims, stage, G) + pipeline_hops(inp, stage, local))

    return layout_plan("fsdp_cp", inp, stage_fn, fwd, bwd, per_layer,
                       (f"seq padded to {S} (multiple of 2D)", f"FSDP over D*dp={G} ranks",
                        "ring attention backward counted as 2(D-1) hops of K/V size"))
