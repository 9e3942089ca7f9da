"""TSP communication: exactly what ds_tsp.core.layers / ds_tsp.core.comm.communicator put on the CommCounter (tests
check it per kind).

Design-doc terms (W = a layer's weights, KV = B*S*h_kv, rho = (D-1)/D): fwd rho*W + rho*2KV; bwd rho*W
(re-stream) + rho*W_attn + rho*W_mlp (grads to owners: the ring's D-1 grad hops) + rho*2KV
(re-gather) + rho*2KV (reduce-scatter).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.tools.plan.comm_terms import all_reduce_bytes, gather_bytes, recompute, term
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.result import CommTerm
from ds_tsp.tools.plan.shape_terms import (
    Dims,
    Stage,
    ceil_div,
    mixed_attention_shapes,
    qk_norm_elems,
    round_up,
)


@dataclass(frozen=True)
class TSPGeometry:
    """One rank's share under TSP: L local tokens (zigzag, S padded to 2D), one head block, F/D, V/D."""

    dims: Dims
    D: int
    S_pad: int
    L: int
    nq_b: int  # query heads per block
    nkv_b: int  # kv heads per block (1 when num_kv_heads < D)
    kv_replicas: int  # blocks sharing one kv head
    A: int  # packed attention shard, elements
    M: int  # packed MLP shard, elements
    Vd: int  # vocab rows per rank

    @classmethod
    def of(cls, inp: PlanInput, layer: int | None = None) -> "TSPGeometry":
        """The geometry of the model's layers, or of decoder layer `layer` (Gemma 4's full layers: their own
        attention shape)."""
        dims = Dims.of(inp.model, layer)
        D = inp.degree
        try:
            inp.model.check_tsp_degree(D)
        except TSPConfigError as exc:
            raise PlanInputError("degree", f"tsp: {exc}") from None
        nq_b, nkv_b = dims.nq // D, dims.kv_heads_per_rank(D)
        S_pad = round_up(inp.seq, 2 * D)
        return cls(dims, D, S_pad, S_pad // D, nq_b, nkv_b, max(D // dims.nkv, 1), dims.attn(nq_b, nkv_b),
                   3 * dims.h * (dims.F // D), ceil_div(dims.V, D))


def per_layer_gate_shard(inp: PlanInput, D: int) -> int:
    """Elements of one layer's packed per_layer_input_gate rows + per_layer_projection columns (P/D each)."""
    return 2 * (inp.model.per_layer_input_size // D) * inp.model.hidden_size


def per_layer_input_params(inp: PlanInput, D: int) -> tuple[int, int]:
    """Gemma 4's model-wide per-layer input params per rank: (the [Vp, N] table's ceil(Vp/D) rows, the
    per_layer_model_projection's N/D rows of [N, h]); N = num_layers * P."""
    m = inp.model
    N = m.num_layers * m.per_layer_input_size
    return ceil_div(m.per_layer_input_vocab_size, D) * N, (N // D) * m.hidden_size


# The K/V terms of an attention layer (names of tsp_layer_terms' CommTerms): the gather, the backward's re-gather and
# the dK/dV reduce-scatter of each kv group
KV_GATHER_TERM = "K/V all-gather (per kv group)"
KV_REGATHER_TERM = "K/V re-gather (per kv group)"
KV_SCATTER_TERM = "dK/dV reduce-scatter (per kv group)"
KV_TERMS = (KV_GATHER_TERM, KV_REGATHER_TERM, KV_SCATTER_TERM)


def tsp_layer_terms(inp: PlanInput, layer: int | None = None) -> tuple[list[CommTerm], list[CommTerm]]:
    """One decoder layer's CommCounter terms (of decoder layer `layer` where layers differ in attention shape).

    forward:  (D-1) attention shard broadcasts, one K/V all-gather per kv group (D groups of one block, or
              n_kv groups of D/n_kv blocks sharing a kv head when n_kv < D), D-1 MLP ring hops.
    backward: the broadcasts again (re-stream), D-1 grad reduces to the owners, one K/V re-gather per group (none
              with keep_gathered_kv), one dK/dV reduce-scatter per group, MLP ring D-1 weight hops + D-1 grad hops,
              and with kv_replicas > 1 one all-gather of the kv weight grads (replica sum); with activation
              checkpointing the forward terms once more (the recompute). The 2 norm-grad all-reduces are
              per layer only on a pipeline stage (pp > 1); ShardedCausalLM buckets every replicated grad into one
              all-reduce per backward (tsp_extra_terms).
    So the K/V terms are rho*2KV whatever n_kv is: each kv head is gathered once.
    """
    g = TSPGeometry.of(inp, layer)
    D, b, B, L, dims = g.D, inp.dtype_bytes, inp.batch, g.L, g.dims
    if D == 1:
        return [], []
    shard, mlp = g.A * b, g.M * b
    kv_out = D * 2 * B * L * g.nkv_b * dims.d * b  # one group's gathered K/V: [D, 2, B, L, nkv_b, d]
    groups = D // g.kv_replicas
    fwd = [
        term("attention shard broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
        term(KV_GATHER_TERM, "all_gather", kv_out, groups, groups * gather_bytes(kv_out, D)),
        term("MLP weight ring (D-1 hops)", "ring", mlp, D - 1, (D - 1) * mlp),
    ]
    regather = 0 if inp.keep_gathered_kv else groups
    # OLMo's whole-projection q/k norms (ds_tsp.core.layers.attention.projection_norm): the [wq, wk] rows streamed
    # once more in forward and in backward, and reduced to their owners apart from the rest of the shard
    qk = g.dims.qk_rows(g.nq_b, g.nkv_b) * b if inp.model.projection_qk_norm else 0
    if qk:
        fwd.insert(0, term("q/k rows broadcast (whole-projection norm statistics)", "broadcast", qk, D - 1,
                           (D - 1) * qk))
    bwd = [
        term("attention shard re-broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
        term("attention grad reduce to owner", "reduce", shard - qk, D - 1, (D - 1) * (shard - qk)),
        term(KV_REGATHER_TERM, "all_gather", kv_out, regather, regather * gather_bytes(kv_out, D)),
        term(KV_SCATTER_TERM, "reduce_scatter", kv_out, groups,
             groups * gather_bytes(kv_out, D)),
        term("MLP ring (D-1 weight + D-1 grad hops)", "ring", mlp, 2 * (D - 1), 2 * (D - 1) * mlp),
    ]
    gate = per_layer_gate_shard(inp, D) * b  # Gemma 4: the per-layer input gate / projection ring, like the MLP's
    if gate:
        fwd.append(term("per-layer input gate ring (D-1 hops)", "ring", gate, D - 1, (D - 1) * gate))
        bwd.append(term("per-layer input gate ring (D-1 weight + D-1 grad hops)", "ring", gate, 2 * (D - 1),
                        2 * (D - 1) * gate))
    if qk:
        bwd += [term("q/k rows re-broadcast (whole-projection norm grads)", "broadcast", qk, D - 1, (D - 1) * qk),
                term("q/k rows grad reduce to owner", "reduce", qk, D - 1, (D - 1) * qk)]
    if inp.pp > 1:
        norms = 4 if inp.model.sandwich_norms else 2
        bwd.append(term(f"norm weight grad all-reduce ({norms} norms)", "replicated_grad", dims.h * b, norms,
                        norms * all_reduce_bytes(dims.h * b, D)))
        qk_elems = qk_norm_elems(inp.model, layer or 0)
        if qk_elems:  # q_norm and k_norm (OLMo's over the whole projection), each reduced on its own
            q_elems = (dims.nq if inp.model.projection_qk_norm else 1) * dims.d
            bwd.append(term("q/k norm grad all-reduce", "replicated_grad", qk_elems * b, 2,
                            all_reduce_bytes(q_elems * b, D) + all_reduce_bytes((qk_elems - q_elems) * b, D)))
        if dims.out_bias:  # GPT-OSS's o_proj bias, replicated like a norm
            bwd.append(term("o_proj bias grad all-reduce", "replicated_grad", dims.h * b, 1,
                            all_reduce_bytes(dims.h * b, D)))
    if g.kv_replicas > 1 and not dims.kv_import:  # a KV-sharing layer has no kv weights
        kv_mats = 1 if dims.values_from_keys else 2  # k_eq_v: wk only
        kv_grad = kv_mats * (g.nkv_b * dims.d * dims.h + (g.nkv_b * dims.d if dims.bias else 0)) * b
        bwd.append(term("kv weight grad all-gather (replica sum)", "all_gather", D * kv_grad, 1,
                        gather_bytes(D * kv_grad, D)))
    if inp.activation_checkpointing:
        bwd += recompute(fwd) + stage_positions_regather(inp, g)
    return fwd, bwd


def stage_positions_regather(inp: PlanInput, g: TSPGeometry) -> list[CommTerm]:
    """On a pipeline stage under activation checkpointing: DeepSpeed's checkpoint hands each recomputed layer
    detached copies of its inputs, so the stage's StepPositions sees new position_ids and gathers them over TSP once
    more per layer ([D, B, L] int64; under cp over cp too: tsp_cp.cp_check_terms)."""
    if inp.pp == 1 or not inp.activation_checkpointing or g.D == 1:
        return []
    positions = g.D * inp.batch * g.L * 8
    return [term("recompute: position_ids re-gather over TSP (the layer's detached inputs)", "all_gather", positions,
                 1, gather_bytes(positions, g.D))]


# The input check (ds_tsp.core.tokens.input_check) gathers a fixed payload: its PayloadHead's 7 counts +
# ds_tsp.core.tokens.documents.LAYOUT_SLOTS (this module stays torch-free, so the numbers are repeated here;
# tests/tools/test_plan.py checks them against the comm counters).
INPUT_CHECK_COUNTS = 7
DOCUMENT_LAYOUT_SLOTS = 1024


def input_check_cp_payload(tsp: int, cp: int) -> int:
    """Bytes of the input check's all-gathered result over the cp group: C x D payloads of (INPUT_CHECK_COUNTS +
    DOCUMENT_LAYOUT_SLOTS) int64 (ds_tsp.core.tokens.input_check.over_cp)."""
    return cp * tsp * (INPUT_CHECK_COUNTS + DOCUMENT_LAYOUT_SLOTS) * 8


def input_check_cp_bytes(tsp: int, cp: int) -> int:
    """Bytes per step and rank of the input check's all-gather over the cp group
    (ds_tsp.core.tokens.input_check.over_cp): the TSP group's gathered payloads, D x (INPUT_CHECK_COUNTS +
    DOCUMENT_LAYOUT_SLOTS) int64, arrive from the C-1 other cp groups. Fixed size (whatever the batch, sequence or
    dtype); 0 without a cp axis. The one formula the plan (ds_tsp.tools.plan.tsp_cp) and bench's cp report
    (ds_tsp.tools.bench.cp_report) both use."""
    return gather_bytes(input_check_cp_payload(tsp, cp), cp)


def tsp_extra_terms(inp: PlanInput, stage: Stage) -> list[CommTerm]:
    """Per step outside the layers: input checks, the embedding and LM head vocab rings, the final norm grad
    (and an MoE model's router grads / aux loss counts, ds_tsp.tools.plan.moe_terms)."""
    from ds_tsp.tools.plan.moe_terms import moe_step_terms, router_grad_elems

    g = TSPGeometry.of(inp)
    D, b, h = g.D, inp.dtype_bytes, g.dims.h
    if D == 1:
        return []
    table = g.Vd * h * b
    terms = []
    if inp.pp > 1:  # a pipeline stage runs no input check: it finds the documents in the position_ids it gathers
        # (ds_tsp.core.tokens.positions.StepPositions: [D, B, L] int64, once per micro-batch)
        positions = D * inp.batch * g.L * 8
        terms.append(term("position_ids all-gather over TSP (the stage's document layout)", "all_gather", positions,
                          1, gather_bytes(positions, D)))
    if stage.embed and inp.pp == 1:
        check = D * (INPUT_CHECK_COUNTS + DOCUMENT_LAYOUT_SLOTS) * 8  # fixed size, whatever the batch
        terms.append(term(f"input check + document layout all-gather ({INPUT_CHECK_COUNTS} + "
                          f"{DOCUMENT_LAYOUT_SLOTS} int64 per rank)", "all_gather", check, 1, gather_bytes(check, D)))
    if stage.embed:
        terms += [term("embedding ring fwd (D-1 hops)", "ring", table, D - 1, (D - 1) * table),
                  term("embedding ring bwd (D-1 weight + D-1 grad hops)", "ring", table, 2 * (D - 1),
                       2 * (D - 1) * table)]
        if inp.model.per_layer_input_size:  # Gemma 4: the per-layer input table and projection rings
            for name, shard in zip(("per-layer input table", "per-layer model projection"),
                                   per_layer_input_params(inp, D)):
                terms += [term(f"{name} ring fwd (D-1 hops)", "ring", shard * b, D - 1, (D - 1) * shard * b),
                          term(f"{name} ring bwd (D-1 weight + D-1 grad hops)", "ring", shard * b, 2 * (D - 1),
                               2 * (D - 1) * shard * b)]
    if stage.head:
        terms += [term("LM head ring fwd (D-1 hops)", "ring", table, D - 1, (D - 1) * table),
                  term("LM head ring bwd (D-1 weight + D-1 grad hops)", "ring", table, 2 * (D - 1),
                       2 * (D - 1) * table)]
    if inp.pp > 1:
        if stage.head:  # + the loss denominator (ds_tsp.model.loss.count_valid_tokens: one int64)
            terms += [term("final norm grad all-reduce", "replicated_grad", h * b, 1, all_reduce_bytes(h * b, D)),
                      term("loss denominator all-reduce (int64)", "all_reduce", 8, 1, all_reduce_bytes(8, D))]
    else:  # ds_tsp.core.grads.replicated: every replicated weight's grad in ONE all-reduce per backward
        norms = 4 if inp.model.sandwich_norms else 2  # per layer (Gemma 3 norms each sublayer's output too)
        # q/k norms per layer: Gemma 4's full layers norm their own head_dim
        flat = (norms * stage.layers + 1) * h + sum(qk_norm_elems(inp.model, i) for i in range(stage.layers))
        flat += stage.layers * g.dims.replicated_attn  # GPT-OSS's o_proj biases
        if inp.model.per_layer_input_size:  # Gemma 4: post_per_layer_input_norm [h] each, per_layer_projection_norm
            flat += stage.layers * h + inp.model.per_layer_input_size
        flat += router_grad_elems(inp, stage)  # MoE routers are replicated too
        terms.append(term("replicated grads all-reduce (norms, bucketed)", "replicated_grad", flat * b, 1,
                          all_reduce_bytes(flat * b, D)))
    return terms + moe_step_terms(inp, stage)


def at_rank(t: CommTerm, D: int, rank: int | None) -> CommTerm:
    """Term `t` as TSP rank `rank` counts it on CPU tensors (None: as planned, the busiest rank's of its kind).

    The causal K/V gather and dK/dV scatter (ds_tsp.core.comm.kv_gather) trim the K/V terms there: rank p sends
    D-1+p of the 2(D-1) zigzag chunks a whole all-gather sends (its first half to every rank, its second half to the
    p ranks before it) and 2D-2-p of the reduce-scatter's; the plan's terms are the busiest rank's per kind (rank
    D-1's gathers, rank 0's scatter), every rank's on CUDA tensors (NCCL's collectives). D = 1 moves nothing."""
    if rank is not None and not 0 <= rank < D:
        raise ValueError(f"rank={rank}: a TSP rank is in 0 .. {D - 1} (D={D})")
    if rank is None or D == 1 or t.name.removeprefix("recompute: ") not in KV_TERMS:
        return t
    chunks = D - 1 + (rank if t.kind == "all_gather" else D - 1 - rank)
    return replace(t, bytes=t.bytes // (2 * D - 2) * chunks)


def tsp_counter_bytes(inp: PlanInput, stage: Stage | None = None, rank: int | None = None) -> dict[str, int]:
    """Predicted CommCounter.bytes (kind -> bytes) of one TSP forward + backward of the whole model (pp = 1), or
    with pipeline stages of one micro-batch through `stage` (one of shape_terms.stages(inp)); of TSP rank `rank`
    on CPU tensors (at_rank), else the busiest rank's per kind."""
    if inp.model.layer_types is not None:  # counting Llama layers would be silently wrong
        raise PlanInputError("model", "a hybrid model (layer_types): its TSP counter bytes are "
                                      "ds_tsp.tools.plan.hybrid.hybrid_counter_bytes")
    if stage is None and inp.pp > 1:
        raise PlanInputError("pp", f"pp={inp.pp}: the counter bytes are per stage; pass one of stages(inp)")
    fwd, bwd = tsp_layer_terms(inp)
    out: dict[str, int] = {}
    stage = stage or Stage("only", True, True, inp.model.num_layers, 1)
    layer_terms = [*fwd, *bwd] * stage.layers
    if mixed_attention_shapes(inp.model):  # Gemma 4: each layer's own attention shard and K/V
        layer_terms = [t for i in range(inp.model.num_layers) for terms in tsp_layer_terms(inp, i) for t in terms]
    if inp.model.num_experts:  # sparse layers: the MoE schedule's terms instead of the MLP ring
        from ds_tsp.tools.plan.moe_terms import (
            moe_geometry,
            sparse_count,
            sparse_layer_terms,
        )

        g = TSPGeometry.of(inp)
        sparse = sparse_count(inp, stage)
        s_fwd, s_bwd = sparse_layer_terms(inp, fwd, bwd, moe_geometry(inp, inp.batch * g.L))
        layer_terms = [*fwd, *bwd] * (stage.layers - sparse) + [*s_fwd, *s_bwd] * sparse
    for t in [at_rank(t, inp.degree, rank) for t in layer_terms] + tsp_extra_terms(inp, stage):
        if t.bytes:
            out[t.kind] = out.get(t.kind, 0) + t.bytes
    return out
