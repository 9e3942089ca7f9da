"""Megatron tensor + sequence parallelism on one axis of T = D ranks (Korthikanti et al. 2022), as PyTorch
DTensor runs it (torchtitan's Llama plan; `ds-tsp bench`'s dtensor_tp_sp).

Norms, residuals and dropout-free regions hold S/T tokens; before the qkv and gate/up linears an all-gather of
B*S*h, after the o-proj and down-proj a reduce-scatter: 4 collectives of a B*S*h buffer forward and their 4
duals backward. save_gathered_inputs=True (default) saves the gathered linear inputs (full S: activations only
partly /T); False saves the S/T shards and re-gathers them in backward (2 more all-gathers, everything /T).
Norm weight grads are all-reduced over the group (each rank saw other tokens). Embedding: reduce-scatter
forward / all-gather backward; LM head: all-gather of its input forward / reduce-scatter backward, plus the
vocab-parallel cross-entropy all-reduces. Loss: loss_parallel() keeps the fp32 log-softmax [B*S, V/T] and its
backward holds 3 such buffers. Seq padded to a multiple of T.
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
from ds_tsp.tools.plan.comm_terms import all_reduce_bytes, dp_sync, gather_bytes, pipeline_hops, recompute, term
from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.peer_stage import PeerParams, PeerState, peer_stage
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import ceil_div, check_ffn, check_heads, round_up


def plan_tp_sp(inp: PlanInput, *, save_gathered_inputs: bool = True) -> LayoutPlan:
    dims = check_heads(inp, "tp_sp")
    check_ffn(dims, inp.degree, "tp_sp")
    T, b, B = inp.degree, inp.dtype_bytes, inp.batch
    S = round_up(inp.seq, T)
    P = B * S * dims.h * b
    n = 1 if T > 1 else 0
    ag = gather_bytes(P, T)
    fwd = [term("all-gather before qkv and gate/up", "all_gather", P, 2 * n, 2 * ag),
           term("reduce-scatter after o-proj and down-proj", "reduce_scatter", P, 2 * n, 2 * ag)]
    bwd = [term("all-gather of the o-proj/down-proj output grads", "all_gather", P, 2 * n, 2 * ag),
           term("reduce-scatter of the qkv/gate-up input grads", "reduce_scatter", P, 2 * n, 2 * ag),
           term("norm weight grad all-reduce (2 norms)", "all_reduce", dims.h * b, 2 * n,
                2 * all_reduce_bytes(dims.h * b, T))]
    if not save_gathered_inputs:
        bwd.append(term("re-gather of the linear inputs", "all_gather", P, 2 * n, 2 * ag))
    if inp.activation_checkpointing:
        bwd += recompute(fwd)
    layer = dims.attn(dims.nq // T, dims.kv_heads_per_rank(T)) + 3 * dims.h * (dims.F // T) + 2 * dims.h
    table = ceil_div(dims.V, T) * dims.h
    params = PeerParams(layer, table, table + dims.h)
    full, local = B * S, B * S // T
    per_layer = hf_layer_saved(inp, dims, Placement(local, full if save_gathered_inputs else local, full, T,
                                                    dims.kv_heads_per_rank(T), full, T))
    Vt = ceil_div(dims.V, T)
    head_act = hf_head_saved(inp, dims, norm_tokens=local, head_tokens=full, logits_tokens=full, vocab=Vt)
    qkv_r = (dims.nq // T + 2 * dims.kv_heads_per_rank(T)) * dims.d
    transients = {"layer_fwd": 2 * P + full * 2 * (dims.F // T) * b + full * qkv_r * b,
                  "layer_bwd": 3 * P + full * 3 * (dims.F // T) * b + full * qkv_r * b,
                  "lm_head_fwd": P + full * Vt * b,
                  "lm_head_bwd": hf_loss_backward(inp, full, Vt, buffers=3)}
    how = PeerState(grads_div=inp.dp if inp.zero_stage >= 2 else 1, opt_div=inp.dp if inp.zero_stage >= 1 else 1)

    def step_terms(stage, grad_elems):
        terms = []
        if stage.embed:
            terms += [term("embedding reduce-scatter fwd", "reduce_scatter", P, n, ag),
                      term("embedding grad all-gather bwd", "all_gather", P, n, ag)]
        if stage.head:
            terms += [term("LM head input all-gather fwd", "all_gather", P, n, ag),
                      term("cross-entropy all-reduces (max, sum-exp, target) fwd", "all_reduce", full * 4, 3 * n,
                           3 * all_reduce_bytes(full * 4, T)),
                      term("LM head input grad reduce-scatter bwd", "reduce_scatter", P, n, ag),
                      term("final norm grad all-reduce", "all_reduce", dims.h * b, n,
                           all_reduce_bytes(dims.h * b, T))]
        return terms + dp_sync(inp, grad_elems, inp.dp) + pipeline_hops(inp, stage, local)

    def stage_fn(stage):
        held, _ = params.of_stage(inp, stage)
        # every rank feeds the full ids (embedding input Replicate) and builds cos/sin for all S tokens
        return peer_stage(inp, stage, params=params, how=how, per_layer=per_layer, layer_input=local * dims.h * b,
                          other_act=embedding_saved(full, dims, b), head_act=head_act, transients=transients,
                          step_terms=step_terms(stage, held))

    notes = [f"seq padded to {S} (multiple of T)"]
    if save_gathered_inputs:
        notes.append("gathered linear inputs saved for backward (no re-gather; 10 collectives/layer otherwise)")
    return layout_plan("tp_sp", inp, stage_fn, fwd, bwd, per_layer, tuple(notes))
