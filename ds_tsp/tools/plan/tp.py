"""Tensor parallelism without sequence parallelism, degree T = D: Megatron TP (`tp`) and DeepSpeed AutoTP
(`autotp`, what `ds-tsp bench` runs as autotp_zero1).

Weights: q/k/v and gate/up column-parallel, o/down row-parallel (1/T; kv heads replicated when n_kv < T), norms
replicated. Every rank holds all S tokens, so norms, linear inputs and the loss are not divided.
- tp (Megatron): vocab-parallel embedding and LM head (ceil(V/T) rows), vocab-parallel cross-entropy on
  [B*S, V/T] (3 all-reduces of B*S fp32: max, sum-exp, target logit); the embedding's output all-reduced.
- autotp (DeepSpeed AutoTP + ZeRO-1 over dp): the embedding stays whole on every rank; the LM head is
  column-parallel and its [B*S, V/T] logits are all-gathered to the full [B*S, V] before HF's loss, whose
  backward slices the grad back (no comm). ZeRO-1 as ulysses_replicated: a full fp32 grad accumulator, the
  optimizer state / dp, and (fp32 training) an fp32 copy of the partition.
Comm: per layer forward 2 all-reduces of B*S*h (after o-proj and after down-proj), backward 2 (the duals of the
column-parallel inputs' identity); the LM head input grad all-reduced in backward.
"""
from __future__ import annotations

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.plan.activation_terms import (
    Placement,
    compute_bytes,
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
from ds_tsp.tools.plan.shape_terms import ceil_div, check_ffn, check_heads


def _tp_params(dims, T: int, vocab_parallel_embedding: bool) -> PeerParams:
    layer = dims.attn(dims.nq // T, dims.kv_heads_per_rank(T)) + 3 * dims.h * (dims.F // T) + 2 * dims.h
    table = ceil_div(dims.V, T) * dims.h
    return PeerParams(layer, table if vocab_parallel_embedding else dims.V * dims.h, table + dims.h)


def plan_tp(inp: PlanInput, *, autotp: bool = False) -> LayoutPlan:
    dims = check_heads(inp, "autotp" if autotp else "tp")
    check_ffn(dims, inp.degree, "autotp" if autotp else "tp")
    T, b, B, S = inp.degree, inp.dtype_bytes, inp.batch, inp.seq
    P = B * S * dims.h * b
    fwd = [term("all-reduce after o-proj and down-proj", "all_reduce", P, 2 if T > 1 else 0,
                2 * all_reduce_bytes(P, T))]
    bwd = [term("all-reduce of the qkv and gate/up input grads", "all_reduce", P, 2 if T > 1 else 0,
                2 * all_reduce_bytes(P, T))]
    if inp.activation_checkpointing:
        bwd += recompute(fwd)
    params = _tp_params(dims, T, not autotp)
    tokens = B * S
    cb = compute_bytes(b)
    Vt = ceil_div(dims.V, T)
    per_layer = hf_layer_saved(inp, dims, Placement(tokens, tokens, tokens, T, dims.kv_heads_per_rank(T), tokens,
                                                    T))
    vocab = dims.V if autotp else Vt
    head_act = hf_head_saved(inp, dims, norm_tokens=tokens, head_tokens=tokens, logits_tokens=tokens, vocab=vocab)
    qkv_r = (dims.nq // T + 2 * dims.kv_heads_per_rank(T)) * dims.d
    transients = {"layer_fwd": P + tokens * 2 * (dims.F // T) * b + tokens * qkv_r * b,
                  "layer_bwd": 3 * P + tokens * 3 * (dims.F // T) * b + tokens * qkv_r * b,
                  "lm_head_fwd": tokens * Vt * b * (2 if autotp else 1),
                  "lm_head_bwd": hf_loss_backward(inp, tokens, vocab)}
    if autotp:  # ZeRO-1 over dp, DeepSpeed's buffers (see ulysses_replicated)
        how = PeerState(opt_div=inp.dp, grad_bytes=4, persistent_grads=True,
                        framework_per_param=4 if b == 4 else 0, backward_bucket=inp.zero_bucket_elements * b)
    else:
        how = PeerState(grads_div=inp.dp if inp.zero_stage >= 2 else 1,
                        opt_div=inp.dp if inp.zero_stage >= 1 else 1)

    def step_terms(stage, grad_elems):
        terms = []
        if stage.embed and not autotp:
            terms.append(term("embedding all-reduce fwd", "all_reduce", P, 1 if T > 1 else 0, all_reduce_bytes(P, T)))
        if stage.head:
            if autotp:
                full = tokens * dims.V * b
                terms.append(term("logits all-gather fwd", "all_gather", full, 1 if T > 1 else 0,
                                  gather_bytes(full, T)))
            else:
                terms.append(term("cross-entropy all-reduces (max, sum-exp, target) fwd", "all_reduce", tokens * 4,
                                  3 if T > 1 else 0, 3 * all_reduce_bytes(tokens * 4, T)))
            terms.append(term("LM head input grad all-reduce bwd", "all_reduce", P, 1 if T > 1 else 0,
                              all_reduce_bytes(P, T)))
        return terms + dp_sync(inp, grad_elems, inp.dp) + pipeline_hops(inp, stage, ceil_div(tokens, T))

    def stage_fn(stage):
        n, _ = params.of_stage(inp, stage)
        return peer_stage(inp, stage, params=params, how=how, per_layer=per_layer, layer_input=tokens * dims.h * b,
                          other_act=embedding_saved(tokens, dims, b), head_act=head_act, transients=transients,
                          step_terms=step_terms(stage, n), head_grad_transient=tokens * (vocab * cb + dims.h * b),
                          loss_saved=tokens * vocab * cb)

    notes = ["all-reduce counted 2(T-1)/T of its payload (ring); the textbook '2x' is its upper bound"]
    if autotp:
        notes.append("AutoTP: embedding replicated, LM head logits all-gathered to [B*S, V] for HF's loss")
    return layout_plan("autotp" if autotp else "tp", inp, stage_fn, fwd, bwd, per_layer, tuple(notes))


def plan_autotp(inp: PlanInput) -> LayoutPlan:
    return plan_tp(inp, autotp=True)


def megatron_tp_example() -> dict:
    """The textbook Megatron TP check: TP=8, b=1, s=4096, h=8192, bf16.

    One all-reduce payload is 2*b*s*h bytes = 64 MiB; a layer's forward has two. Counted as a ring all-reduce
    (2(T-1)/T of the payload) that is 2 * 2 * 7/8 * 64 MiB = 224 MiB per rank; the commonly quoted ~268 MB is the
    same with the factor rounded up to 2 (2 * 2 * 64 MiB = 268,435,456 bytes).
    """
    shape = ModelShape(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=1, num_heads=64,
                       num_kv_heads=8)
    tp = plan_tp(PlanInput(model=shape, seq=4096, batch=1, degree=8, dtype="bf16"))
    (t,) = tp.layer_fwd_terms
    return {"payload_bytes": t.payload_bytes, "all_reduces_per_layer_fwd": t.calls,
            "comm_bytes_per_layer_fwd": tp.comm_bytes_per_layer_fwd,
            "comm_bytes_per_layer_fwd_2x": 2 * t.calls * t.payload_bytes}
