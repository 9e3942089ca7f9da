"""TSP (ds_tsp): 1/D of every weight and 1/D of the tokens (zigzag) per rank, one axis.

Params per rank: per layer the packed attention shard (nq/D q heads, max(nkv/D, 1) kv heads) + F/D MLP columns
+ 2 replicated norms; ceil(V/D) rows of the embedding and of the LM head; the final norm. Grads appear during
backward (torch AdamW, zero_grad(set_to_none=True)); the LM head's is the first to exist.

Gemma 4: layers whose attention differs (the full layers' own head_dim / kv heads / no v rows, the KV-sharing
layers' missing k/v rows and double-wide MLP) are counted each with its own geometry (TSPGeometry.of(inp, layer));
the layer terms describe layer 0's kind, the other kinds' come as step terms. Per-layer inputs add a gate ring per
layer and the table / projection rings per step (tsp_comm.per_layer_input_params).

Saved activations (tsp_layer_saved; exact against saved-tensor hooks in tests/tools/test_plan.py and against
`ds-tsp bench --layer-memory`, which lists them tensor by tensor) plus cos/sin, the final norm, the LM head input and
its LSE, ids and labels.

Transients, counted from ds_tsp.core.layers (temporaries alive together at the worst point of each phase; checked
against MemTracker per module, tests/fixtures/plan_bench.json):
- attention forward: the prefetched shard, one kv group's gathered K/V (gathered straight into global order) and
  its local k/v stack, plus the next group's while its gather is in flight (the overlap schedule, when there is a
  next group), q and the kernel's outputs, and y.
- attention backward: the re-broadcast shard (+ prefetch), the grad contributions in flight to their owners,
  the re-gathered K/V (+ the next group's in flight), dK/dV accumulated in place in the rank-ordered buffer the
  reduce-scatter sends (no zeros / reorder / cat copies) and the previous group's scatter still in flight, the
  kernel's dK/dV of one key block (the largest: every key before the last zigzag chunk) until it is added there,
  the recomputed local k/v and their grads, q / dout / dq, dx and the incoming dy; with per-head q/k norms the raw
  q (kept to the dq tail), the group's raw k and the norms' backward temporaries.
- MLP: the shards of the weight ring in flight; gate, up, silu(gate), their product ([L, F/D] each), y.
  Backward adds the grad shards travelling with the ring, this rank's own grad kept home (ring_buffers), the packed
  grad being formed and the SwiGLU derivative's temporaries (9 [L, F/D] tensors at once, 7 with the projections
  kept: gate and up are read from what forward saved).
- LM head + loss: per vocab shard one tile of logits [chunk, V/D] (compute dtype; softmax and its grad are
  formed in place; + its dtype copy under bf16), at most `lm_head_chunk_tokens` local tokens at a time; the
  ring's shard and grad buffers (+ the grad being accumulated tile by tile); dx [L, h].
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.tools.plan.activation_terms import compute_bytes, tsp_norm_saved
from ds_tsp.tools.plan.assemble import layout_plan
from ds_tsp.tools.plan.comm_terms import dp_sync, pipeline_hops
from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.memory import Phase, StageMemory, state, zero_divs
from ds_tsp.tools.plan.moe_terms import (
    moe_geometry,
    moe_note,
    moe_saved,
    moe_summary,
    moe_transients,
    shared_expert_shard,
    sparse_count,
    sparse_layer_params,
    sparse_layer_terms,
    stage_layer_ids,
)
from ds_tsp.tools.plan.offload import device_held_inputs, offload_note, with_offload
from ds_tsp.tools.plan.result import LayoutPlan
from ds_tsp.tools.plan.shape_terms import (
    Dims,
    Stage,
    mixed_attention_shapes,
    qk_norm_elems,
)
from ds_tsp.tools.plan.tsp_comm import (
    TSPGeometry,
    per_layer_gate_shard,
    per_layer_input_params,
    tsp_extra_terms,
    tsp_layer_terms,
)


def tsp_layer_saved(inp: PlanInput, g: TSPGeometry) -> int:
    """Saved for backward by one TSP decoder layer (ds_tsp.core.layers): per norm its input and rstd (the fused
    Function; the first norm's input is the layer input); attention: its input x, per head block the output
    [B, L, nq/D, d] and two LSEs (compute dtype); MLP: its input x only (q/k/v and the gate/up activations are
    recomputed in backward). This is the design's minimum (ds_tsp.tools.bench.layer_memory.minimum_saved)."""
    dims, b, T = g.dims, inp.dtype_bytes, inp.batch * g.L
    norms = 4 if inp.model.sandwich_norms else 2  # Gemma 3 norms each sublayer's output too
    saved = (norms * tsp_norm_saved(T, dims, b) + 2 * T * dims.h * b + T * dims.nq * dims.d * b
             + T * dims.nq * compute_bytes(b))
    groups = g.D // g.kv_replicas  # blocks sharing a kv head (n_kv < D) save its K/V once
    if inp.keep_gathered_kv:
        saved += groups * 2 * inp.batch * g.S_pad * g.nkv_b * dims.d * b
    if inp.model.layer_scalars:  # Gemma 4: its layer_scalar buffer [1], which scaling the output saves
        saved += b
    if inp.model.per_layer_input_size:  # Gemma 4: the gate's input x, the post_per_layer_input_norm's
        saved += T * dims.h * b + tsp_norm_saved(T, dims, b)
    if inp.model.projection_qk_norm:
        saved += 2 * T * compute_bytes(b)  # OLMo: the q and k norms' rstd over the whole projection
    if not inp.recompute_projections:
        saved += T * dims.nq * dims.d * b + 2 * T * dims.F * b  # q of every block; MLP gate and up
        if not inp.keep_gathered_kv and not dims.kv_import:  # (a KV-sharing layer projects none)
            saved += groups * 2 * T * g.nkv_b * dims.d * b  # local k/v of every kv group
        if not dims.kv_import:  # the raw k / v projections a k or v norm reads in backward (AttentionSpec)
            m = inp.model
            raws = int(m.qk_norm or m.projection_qk_norm or (m.value_norm and dims.values_from_keys)) \
                + int(m.value_norm and not dims.values_from_keys)
            saved += groups * raws * T * g.nkv_b * dims.d * b
    return saved


def ring_buffers(D: int) -> int:
    """Shard-sized buffers a ring backward step holds besides the owned shard and the grad it is forming
    (ds_tsp.core.comm.primitives.ring_backward): the received shard and this rank's own grad, kept home until the
    others' sum arrives; from D=3 on (steps 2..) the grad arriving and the one sent before it; from D=4 on the next
    shard in flight beside them; none at D=1 (no ring: the step's grad is the result)."""
    if D == 1:
        return 0
    return 2 + (2 if D >= 3 else 0) + (1 if D >= 4 else 0)


def tsp_transients(inp: PlanInput, g: TSPGeometry) -> dict[str, int]:
    """Phase -> temporaries (bytes), as listed in the module docstring."""
    dims, D, b, B = g.dims, g.D, inp.dtype_bytes, inp.batch
    cb = compute_bytes(b)
    T = B * g.L
    f = dims.F // D
    x = T * dims.h * b  # one [B, L, h] activation (y, dx or dy)
    kvb = 2 * B * g.S_pad * g.nkv_b * dims.d * b  # one head block's gathered K/V
    kv_local = 2 * T * g.nkv_b * dims.d * b
    qb = T * g.nq_b * dims.d * b
    shard_in = g.A * b if D > 1 else 0  # a foreign shard received (own shards are params)
    reducer = min(D - 1, 3) * g.A * b  # ShardGradReducer: grad contributions in flight to their owners
    groups = D // g.kv_replicas
    in_flight = 2 if groups > 1 else 1  # overlap schedule: the next kv group's K/V gather posted before attention
    # backward, per kv group: its re-gathered K/V (+ the next group's in flight), its dK/dV accumulator, and the
    # previous group's reduce-scatter still running behind it; a middle group (3+ groups) sees all four
    kv_bufs_bwd = 1 + min(groups - 1, 1) if inp.keep_gathered_kv else 2 + min(groups - 1, 2)
    # the kernel's dK/dV of its largest key block (every key before the last zigzag chunk), until added in place
    kernel_dkv = kvb * (2 * D - 1) // (2 * D)
    Tc = min(T, inp.lm_head_chunk_tokens)
    logits = Tc * g.Vd * cb + (Tc * g.Vd * b if b < cb else 0)
    return {
        "attention_fwd": 2 * shard_in + in_flight * (kvb + kv_local) + 3 * qb + x,
        # the recomputed local k/v and q are saved instead when the projections are kept: their grads remain
        "attention_bwd": (2 * shard_in + g.A * b + reducer + kv_bufs_bwd * kvb + kernel_dkv
                          + (2 * kv_local + 4 * qb if inp.recompute_projections else kv_local + 3 * qb) + 2 * x
                          # OLMo's whole-projection q/k norms: every block's dn kept through the loop
                          + (T * (dims.nq + dims.nkv) * dims.d * b if inp.model.projection_qk_norm else 0)
                          # per-head q/k norms (Qwen3): the raw q kept to the dq tail, the raw k of the group and
                          # the norm backward's temporaries
                          + (2 * qb + (kv_local // 2 if inp.recompute_projections else 0)
                             if inp.model.qk_norm and not inp.model.projection_qk_norm else 0)),
        "mlp_fwd": min(D - 1, 2) * g.M * b + 4 * T * f * b + x,
        "mlp_bwd": (ring_buffers(D) + 1) * g.M * b + (9 if inp.recompute_projections else 7) * T * f * b + 2 * x,
        "lm_head_fwd": logits + (g.Vd * dims.h * b if D > 1 else 0),
        "lm_head_bwd": logits + (ring_buffers(D) + 1) * g.Vd * dims.h * b + x,
    }


def _shape_name(inp: PlanInput, layer: int) -> str:
    kind = "sliding-window" if inp.model.layer_window(layer) is not None else "full-attention"
    return f"KV-sharing {kind}" if inp.model.kv_source(layer) is not None else kind


def plan_tsp(inp: PlanInput, *, _other_schedules: bool = True) -> LayoutPlan:
    """TSP's LayoutPlan (module docstring); comm terms in ds_tsp.tools.plan.tsp_comm; an MoE model's sparse
    layers in ds_tsp.tools.plan.moe_terms; a hybrid model's in ds_tsp.tools.plan.hybrid."""
    if inp.model.layer_types is not None:
        from ds_tsp.tools.plan.hybrid import plan_tsp_hybrid

        return plan_tsp_hybrid(inp, layer_saved=tsp_layer_saved, attention_mlp_transients=tsp_transients,
                               ring_buffers=ring_buffers)
    first = 0 if mixed_attention_shapes(inp.model) else None  # the layer the per-layer figures describe
    g = TSPGeometry.of(inp, first)
    dims, D, b, B = g.dims, g.D, inp.dtype_bytes, inp.batch
    cb = compute_bytes(b)
    T = B * g.L
    fwd, bwd = tsp_layer_terms(inp, first)
    dense_fwd, dense_bwd = fwd, bwd
    qk_norms = qk_norm_elems(inp.model, 0)  # Qwen3's / OLMo's q/k norm weights, replicated
    layer_norms = (4 if inp.model.sandwich_norms else 2) * dims.h
    layer_norms += dims.replicated_attn  # GPT-OSS's o_proj bias: replicated like the norms
    gate = per_layer_gate_shard(inp, D)  # Gemma 4's per-layer input gate / projection (0 without)
    layer_norms += dims.h if gate else 0  # its post_per_layer_input_norm
    layer_params = g.A + g.M + layer_norms + qk_norms + gate
    transients = tsp_transients(inp, g)
    per_layer = tsp_layer_saved(inp, g)
    ac = inp.activation_checkpointing
    moe = moe_geometry(inp, T)
    if moe is not None:  # per-layer figures describe a sparse layer; dense ones (if any) are counted per stage
        Ms, Fs = shared_expert_shard(inp), inp.model.shared_expert_intermediate_size  # GLM-4.5's shared experts
        sparse_mlp = sparse_layer_params(moe) + Ms
        sparse_params = g.A + sparse_mlp + layer_norms + qk_norms
        sparse_saved = per_layer + moe_saved(inp, moe) - (0 if inp.recompute_projections else
                                                          2 * T * (dims.F - (Fs if Ms else 0)) * b)
        sparse_transients = {**transients, **moe_transients(inp, moe, ring_buffers(D))}
        if Ms:  # the shared expert runs after the routed ones: the block's y beside a dense MLP's temporaries
            shared = tsp_transients(inp, replace(g, M=Ms, dims=replace(dims, F=Fs)))
            y = T * dims.h * b
            sparse_transients.update({k: max(sparse_transients[k], y + shared[k]) for k in ("mlp_fwd", "mlp_bwd")})
        fwd, bwd = sparse_layer_terms(inp, dense_fwd, dense_bwd, moe)

    # Gemma 4's full layers (their own head_dim / kv heads / no v_proj): layer 0's figures describe the layers of
    # its shape, the others' terms are per-step terms
    described = [i for i in range(inp.model.num_layers) if Dims.of(inp.model, i) == Dims.of(inp.model, 0)]
    others = [i for i in range(inp.model.num_layers) if i not in described]
    mixed = mixed_attention_shapes(inp.model)
    other_terms: list = []
    kinds: dict = {}  # the other layers by shape: Dims -> their layer ids
    for i in others:
        kinds.setdefault(Dims.of(inp.model, i), []).append(i)
    for ids in kinds.values():
        o_fwd, o_bwd = tsp_layer_terms(inp, ids[0])
        other_terms += [replace(t, name=f"{_shape_name(inp, ids[0])} layers x{len(ids)}: {t.name}",
                                calls=t.calls * len(ids), bytes=t.bytes * len(ids)) for t in (*o_fwd, *o_bwd)]

    def stage_fn(stage: Stage) -> StageMemory:
        top_saved, top_transients = per_layer, transients  # of the stage's top layer (its backward runs first)
        if mixed:  # pp = 1 (PlanInput): every layer, each with its own attention geometry
            geoms = [TSPGeometry.of(inp, i) for i in range(stage.layers)]
            params = sum(gi.A + gi.M + layer_norms + qk_norm_elems(inp.model, i) + gate for i, gi in enumerate(geoms))
            kept_saved, mlp_grads = sum(tsp_layer_saved(inp, gi) for gi in geoms), (g.M + dims.h) * b
            # KV sharing: an exporting layer's local K/V of every kv group, kept by the layers attending over them
            kept_saved += sum((D // gi.kv_replicas) * 2 * T * gi.nkv_b * gi.dims.d * b
                              for i, gi in enumerate(geoms) if inp.model.exports_kv(i))
            top_saved, top_transients = tsp_layer_saved(inp, geoms[-1]), tsp_transients(inp, geoms[-1])
        elif moe is None:
            params = stage.layers * layer_params
            kept_saved, mlp_grads = stage.layers * per_layer, (g.M + dims.h) * b
        else:
            sparse = sparse_count(inp, stage)
            dense = stage.layers - sparse
            params = dense * layer_params + sparse * sparse_params
            kept_saved = dense * per_layer + sparse * sparse_saved
            top_sparse = inp.model.is_moe_layer(stage_layer_ids(inp, stage)[-1])
            if top_sparse:
                top_saved, top_transients = sparse_saved, sparse_transients
            mlp_grads = ((sparse_mlp if top_sparse else g.M) + dims.h) * b
            dense_terms = [replace(t, name=f"dense layers x{dense}: {t.name}", calls=t.calls * dense,
                                   bytes=t.bytes * dense) for t in (*dense_fwd, *dense_bwd)] if dense else []
        # cos, sin (shared by every layer; Gemma 4's full layers: of their own head_dim), the sliding layers' own
        # pair where their theta or head_dim differs (ds_tsp.core.tokens.positions)
        m = inp.model
        own_sliding = any(m.layer_rope(i) == "sliding" for i in range(m.num_layers))
        other = 2 * T * ((m.full_head_dim or m.dim_per_head) + (m.dim_per_head if own_sliding else 0)) * b
        other += T * b if dims.q_scaled else 0  # Ministral 3: each query's position scale, shared by the layers
        head_act = head_params = 0
        if stage.embed:
            params += g.Vd * dims.h
            other += T * 8  # input ids
            if m.per_layer_input_size:  # Gemma 4: the table's and projection's shards, per_layer_projection_norm
                params += sum(per_layer_input_params(inp, D)) + m.per_layer_input_size
                # every layer's input [T, layers * P] (the layers' slices share it), the projection norm's input
                # and rstd
                N = m.num_layers * m.per_layer_input_size
                other += 2 * T * N * b + T * m.num_layers * cb
        if stage.head:
            head_params = dims.h + (0 if (dims.tied and stage.embed) else g.Vd * dims.h)
            params += head_params
            # final norm; LM head: input, lse, labels and the loss denominator (a scalar in dtype)
            head_act = tsp_norm_saved(T, dims, b) + T * dims.h * b + T * cb + T * 8 + b
        # offload_activations: the inputs wait on the host; the device holds at most two (ds_tsp.tools.plan.offload)
        kept = (device_held_inputs(stage.layers) if inp.offload_activations else stage.layers) * T * dims.h * b \
            if ac else kept_saved
        acts = (kept + other + head_act) * stage.in_flight
        below_head = acts - head_act
        head_grads = head_params * b
        recomputing = top_saved if ac else 0
        # the top layer's backward runs MLP first (attention's input grads wait for it): its grads come next
        phases = {
            # the layer's first norm and attention input are saved by the time attention peaks
            "attention_fwd": Phase(top_transients["attention_fwd"], below_head - (0 if ac else top_saved)
                                   + tsp_norm_saved(T, dims, b) + T * dims.h * b, 0),
            "mlp_fwd": Phase(top_transients["mlp_fwd"], below_head, 0),
            "mlp_bwd": Phase(top_transients["mlp_bwd"], below_head + recomputing, head_grads),
            "attention_bwd": Phase(top_transients["attention_bwd"], below_head + recomputing - T * dims.h * b,
                                   head_grads + mlp_grads),
            "end_of_backward": Phase(0, 0, params * b),
        }
        if stage.head:
            phases["lm_head_fwd"] = Phase(transients["lm_head_fwd"], below_head, 0)
            phases["lm_head_bwd"] = Phase(transients["lm_head_bwd"], acts, 0)
        s = state(inp, params, **zero_divs(inp))
        return StageMemory(params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=acts,
                           phases=phases,
                           step_terms=(tsp_extra_terms(inp, stage) + dp_sync(inp, params, inp.dp)
                                       + pipeline_hops(inp, stage, T) + (dense_terms if moe is not None else [])
                                       + other_terms))

    notes = [f"zigzag: seq padded to {g.S_pad} (multiple of 2D)"]
    if g.kv_replicas > 1:
        notes.append(f"num_kv_heads={dims.nkv} < D={D}: the {g.kv_replicas} blocks sharing a kv head gather its K/V "
                     "once (K/V traffic the design's rho*2KV)")
    if inp.keep_gathered_kv:
        notes.append("keep_gathered_kv: every block's gathered K/V saved (O(S) per rank), no backward re-gather")
    if T > inp.lm_head_chunk_tokens:
        notes.append(f"LM head + loss tiled over {inp.lm_head_chunk_tokens} local tokens at a time "
                     f"(logits transient chunk x V/D, not {T} x V/D)")
    if inp.offload_activations:
        notes.append(offload_note(inp, g))
    if others:
        notes.append(f"layer terms: the {len(described)} {_shape_name(inp, 0)} layers; the others' in the step "
                     "terms (their own attention shape / KV sharing / MLP width)")
    if moe is None:
        return with_offload(layout_plan("tsp", inp, stage_fn, fwd, bwd, per_layer, tuple(notes),
                                        layers_of=(lambda stage: len(described)) if others else None), inp, g)
    only = Stage("only", True, True, inp.model.num_layers, 1)
    notes.append(moe_note(moe, sparse_count(inp, only), inp.model.num_layers))
    peaks = None
    if _other_schedules:  # the same plan under each schedule, for "memory per rank of both"
        peaks = {s: plan_tsp(replace(inp, moe_dispatch=s), _other_schedules=False).peak_bytes_per_rank
                 for s in ("ring", "all_to_all")}
    return with_offload(layout_plan("tsp", inp, stage_fn, fwd, bwd, sparse_saved, tuple(notes),
                                    layers_of=lambda stage: sparse_count(inp, stage), moe=moe_summary(moe, peaks)),
                        inp, g)
