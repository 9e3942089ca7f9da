"""DeepSpeed-Ulysses (ALST) sequence parallelism of degree D, as `ds-tsp bench` runs it (HF Llama +
UlyssesSPAttentionHF + deepspeed.initialize): ZeRO-3 over the D*dp ranks (`ulysses`, bench ulysses_zero3) or
replicated weights under ZeRO-0/1/2 over the D*dp ranks (`ulysses_replicated`, bench ulysses_zero1).

Tokens S/D per rank outside attention; 4 all-to-alls per layer forward (q, k, v to head-sharded full sequence,
the output back), 4 in backward, each (D-1)/D of its input B*S/D*(width). With n_kv < D the kv heads are
replicated to D before the all-to-all. Activations: the HF layer on S/D tokens, attention internals head-sharded
over the full sequence (the same bytes), plus the o-proj input the reverse all-to-all creates. LM head:
full-vocab logits of the local tokens (HF loss).

DeepSpeed's buffers (DeepSpeed 0.19, measured with MemTracker by ds-tsp bench):
- ZeRO-3: param partitions (1/(D*dp), dtype), fp32 grad partitions, the fp32 master partition (in `optimizer`
  under bf16; a separate copy in fp32 training: `framework`), one reduce bucket of `zero_bucket_elements`
  (dtype); transient: the gathered layer (+ one prefetched) and its full grads.
- ZeRO-1/2: whole params; ZeRO-1 accumulates grads in a full fp32 buffer, ZeRO-2 in fp32 partitions;
  optimizer / (D*dp); the fp32 partition copy in fp32 training (`framework`); the reduce bucket (dtype) from
  the first grad of backward on (phase lm_head_grad: bucket + the logits grad + the LM head's input grad).
"""
from __future__ import annotations

from ds_tsp.tools.cli_types import MIB
from ds_tsp.tools.plan.activation_terms import (
    Placement,
    compute_bytes,
    embedding_saved,
    hf_head_saved,
    hf_layer_saved,
    hf_loss_backward,
)
from ds_tsp.tools.plan.assemble import layout_plan
from ds_tsp.tools.plan.comm_terms import dp_sync, gather_bytes, pipeline_hops, recompute, sharded_weight_terms, term
from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.peer_stage import PeerParams, PeerState, peer_stage
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import Dims, Stage, ceil_div, check_heads, round_up


def zero3_params(dims: Dims, group: int) -> PeerParams:
    return PeerParams(ceil_div(dims.layer, group), ceil_div(dims.V * dims.h, group),
                      ceil_div(dims.V * dims.h + dims.h, group))


def head_extras_sharded(inp: PlanInput, dims: Dims, stage: Stage, group: int) -> list:
    """ZeRO-3 / FSDP traffic of the embedding and the LM head (+ final norm)."""
    terms = []
    if stage.embed:
        f, bw = sharded_weight_terms(inp, dims.V * dims.h, group, "embedding")
        terms += f + bw
    if stage.head:
        head = dims.h + (0 if dims.tied and stage.embed else dims.V * dims.h)
        f, bw = sharded_weight_terms(inp, head, group, "LM head + final norm")
        terms += f + bw
    return terms


def plan_ulysses(inp: PlanInput, *, zero3: bool = True) -> LayoutPlan:
    dims = check_heads(inp, "ulysses")
    D, b, B = inp.degree, inp.dtype_bytes, inp.batch
    S = round_up(inp.seq, D)
    local = B * S // D
    kv_eff = max(dims.nkv, D)
    G = D * inp.dp
    a2a = [("q", dims.nq * dims.d), ("k", kv_eff * dims.d), ("v", kv_eff * dims.d),
           ("attention output", dims.nq * dims.d)]
    fwd = [term(f"all-to-all {name}", "all_to_all", local * w * b, 1 if D > 1 else 0, gather_bytes(local * w * b, D))
           for name, w in a2a]
    bwd = [term(t.name + " grad", t.kind, t.payload_bytes, t.calls, t.bytes) for t in fwd]
    if inp.activation_checkpointing:
        bwd += recompute(fwd)
    bucket = inp.zero_bucket_elements * b
    cb = compute_bytes(b)
    if zero3:
        wf, wb = sharded_weight_terms(inp, dims.layer, G, "layer")
        fwd, bwd = fwd + wf, bwd + wb
        params = zero3_params(dims, G)
        how = PeerState(grad_bytes=4, persistent_grads=True, framework_per_param=4 if b == 4 else 0,
                        framework_fixed=bucket)
    else:  # the D sequence ranks are data-parallel for the weights: ZeRO-1/2 partitions over all D*dp of them
        params = PeerParams(dims.layer, dims.V * dims.h, dims.V * dims.h + dims.h)
        zs = inp.zero_stage
        how = PeerState(grads_div=G if zs >= 2 else 1, opt_div=G if zs >= 1 else 1,
                        grad_bytes=4 if zs >= 1 else None, persistent_grads=zs >= 1,
                        framework_per_param=4 if (zs >= 1 and b == 4) else 0,
                        backward_bucket=bucket if zs >= 1 else 0)
    per_layer = hf_layer_saved(inp, dims, Placement(local, local, local, 1, kv_eff, local, 1, o_copy_tokens=local))
    head_act = hf_head_saved(inp, dims, norm_tokens=local, head_tokens=local, logits_tokens=local, vocab=dims.V)
    width = (2 * dims.nq + 2 * kv_eff) * dims.d
    gathered = dims.layer * b if zero3 else 0
    transients = {"layer_fwd": 2 * gathered + 2 * local * width * b + local * 2 * dims.F * b,
                  "layer_bwd": 3 * gathered + 2 * local * width * b + local * 3 * dims.F * b
                  + 3 * local * dims.h * b,
                  "lm_head_fwd": (dims.V * dims.h * b + gathered if zero3 else 0) + local * dims.V * b,
                  # the gathered LM head and the next layer ZeRO-3 prefetches, beside the loss backward
                  "lm_head_bwd": (dims.V * dims.h * b + gathered if zero3 else 0)
                  + hf_loss_backward(inp, local, dims.V)}

    def stage_fn(stage):
        held, _ = params.of_stage(inp, stage)
        if zero3:
            steps = head_extras_sharded(inp, dims, stage, G) + pipeline_hops(inp, stage, local)
        else:
            steps = dp_sync(inp, held, G) + pipeline_hops(inp, stage, local)
        return peer_stage(inp, stage, params=params, how=how, per_layer=per_layer, layer_input=local * dims.h * b,
                          other_act=embedding_saved(local, dims, b), head_act=head_act, transients=transients,
                          step_terms=steps, head_grad_transient=local * (dims.V * cb + dims.h * b),
                          loss_saved=local * dims.V * cb)

    notes = [f"seq padded to {S} (multiple of D)"]
    if kv_eff > dims.nkv:
        notes.append(f"num_kv_heads={dims.nkv} < D={D}: kv heads replicated to {kv_eff} for the all-to-all")
    if zero3:
        notes.append(f"ZeRO-3 over D*dp={G} ranks: params, grads, optimizer / {G}; transient gathered layer")
    if zero3 or inp.zero_stage >= 2:
        notes.append(f"DeepSpeed reduce bucket {inp.zero_bucket_elements:.0e} elements ({bucket / MIB:.0f} MiB)")
    return layout_plan("ulysses" if zero3 else "ulysses_replicated", inp, stage_fn, fwd, bwd, per_layer,
                       tuple(notes))


def plan_ulysses_replicated(inp: PlanInput) -> LayoutPlan:
    return plan_ulysses(inp, zero3=False)
