"""TSP plan rows for a hybrid model (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers + gated full attention).

Per rank (rho = (D-1)/D, G = one Gated DeltaNet head block's packed shard, A = one gated attention head block's):
- Gated DeltaNet layer (ds_tsp.core.functions.gated_deltanet): params G = 1/D of in_proj (q, k, v, z, b, a rows of
  the block's heads), conv channels, A_log, dt_bias and out_proj columns, + its gated-norm weight [dv] (replicated),
  + the MLP's F/D columns and the two layer norms. Saved for backward: x and the conv halo [B, 2, K-1, h] (nothing
  per block). Comm forward: D-1 shard broadcasts, one halo all-gather (min(c, K-1) tokens per chunk), D transition
  all-gathers ([2, B, H_v/D, dk, dk + dv] per rank, float32 for 16/32-bit models); backward: the broadcasts again,
  D-1 grad reduces to the owners, the D transition all-gathers again, their D reduce-scatters, the halo's
  reduce-scatter. Plus the MLP ring of every TSP layer.
- Full-attention layer: the TSP attention terms (ds_tsp.tools.plan.tsp_comm) with q_proj's rows doubled ([q, gate]
  per head: the gate rides in the shard) and the gate saved per head block.
The layer terms of the plan describe the Gated DeltaNet layers; the full-attention layers' come in the step terms
("full-attention layers xN: ..."), as an MoE model's dense layers do. tests/test_plan_hybrid.py checks every comm
kind against CommCounter exactly, params / grads exactly, the saved bytes against saved-tensor hooks and the peak
against bench's MemTracker (10%).

Not modelled (refused by name): pipeline stages, context parallelism, activation checkpointing / offload and the
MoE hybrids (Qwen3-Next / Qwen3.5-MoE with experts); the peers' layouts (their plans count Llama layers).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ds_tsp.tools.plan.activation_terms import compute_bytes, tsp_norm_saved
from ds_tsp.tools.plan.assemble import layout_plan
from ds_tsp.tools.plan.comm_terms import dp_sync, gather_bytes, term
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.memory import Phase, StageMemory, state, zero_divs
from ds_tsp.tools.plan.result import CommTerm, LayoutPlan
from ds_tsp.tools.plan.shape_terms import Stage
from ds_tsp.tools.plan.tsp_comm import TSPGeometry, tsp_extra_terms, tsp_layer_terms


def is_hybrid(inp: PlanInput) -> bool:
    return inp.model.layer_types is not None


def check_hybrid_input(inp: PlanInput) -> None:
    """One PlanInputError naming the field for what the hybrid plan does not model."""
    m = inp.model
    if m.num_experts:
        raise PlanInputError("hf_config", "a hybrid MoE model (Qwen3-Next / Qwen3.5-MoE with experts): the planner "
                             "models dense hybrids (Qwen3.5) only; measure it with `ds-tsp bench`")
    for field, on in (("pp", inp.pp > 1), ("activation_checkpointing", inp.activation_checkpointing),
                      ("offload_activations", inp.offload_activations)):
        if on:
            raise PlanInputError(field, f"{field}: not modelled for hybrid (Gated DeltaNet) models; plan without it")


@dataclass(frozen=True)
class HybridGeometry:
    tsp: TSPGeometry
    n_linear: int
    n_full: int
    G: int  # one Gated DeltaNet head block's packed shard, elements
    A: int  # one gated attention head block's packed shard, elements
    vb: int  # value heads per block
    dk: int
    dv: int
    K: int
    tail: int  # halo tokens each chunk contributes: min(c, K-1)
    transition_bytes: int  # element size of the gathered transitions (the kernel's compute dtype)

    @classmethod
    def of(cls, inp: PlanInput) -> "HybridGeometry":
        g = TSPGeometry.of(inp)
        m, dims, D = inp.model, g.dims, g.D
        if m.has_linear_attention and m.linear_num_key_heads % D:
            raise PlanInputError("degree", f"tsp: degree={D} does not divide linear_num_key_heads="
                                 f"{m.linear_num_key_heads} (Gated DeltaNet head blocks)")
        n_linear = sum(t == "linear_attention" for t in m.layer_types)
        kb, vb = m.linear_num_key_heads // D, m.linear_num_value_heads // D
        dk, dv, K, h = m.linear_key_head_dim, m.linear_value_head_dim, m.linear_conv_kernel_dim, dims.h
        channels = 2 * kb * dk + vb * dv  # conv / in_proj_qkv channels of one block
        G = channels * h + vb * dv * h + 2 * vb * h + channels * K + 2 * vb + h * vb * dv if n_linear else 0
        gate = g.nq_b * dims.d * h + (g.nq_b * dims.d if dims.bias else 0) if m.attn_output_gate else 0
        return cls(g, n_linear, m.num_layers - n_linear, G, g.A + gate, vb, dk, dv, K, min(g.L // 2, max(K - 1, 0)),
                   compute_bytes(inp.dtype_bytes))


def gdn_layer_terms(inp: PlanInput, hg: HybridGeometry) -> tuple[list[CommTerm], list[CommTerm]]:
    """One Gated DeltaNet decoder layer's CommCounter terms (module docstring), MLP ring included."""
    g, b, B = hg.tsp, inp.dtype_bytes, inp.batch
    D, h = g.D, g.dims.h
    shard, mlp = hg.G * b, g.M * b
    halo = D * 2 * B * hg.tail * h * b  # [D, 2, B, tail, h]
    trans = D * 2 * B * hg.vb * hg.dk * (hg.dk + hg.dv) * hg.transition_bytes  # one block's [D, 2, B, vb, dk, dk+dv]
    halo_calls = 1 if hg.K > 1 else 0
    fwd = [term("Gated DeltaNet shard broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
           term("conv halo all-gather", "all_gather", halo, halo_calls, halo_calls * gather_bytes(halo, D)),
           term("chunk transition all-gather (per head block)", "all_gather", trans, D, D * gather_bytes(trans, D)),
           term("MLP weight ring (D-1 hops)", "ring", mlp, D - 1, (D - 1) * mlp)]
    bwd = [term("Gated DeltaNet shard re-broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
           term("Gated DeltaNet grad reduce to owner", "reduce", shard, D - 1, (D - 1) * shard),
           term("chunk transition re-gather (per head block)", "all_gather", trans, D, D * gather_bytes(trans, D)),
           term("transition grad reduce-scatter (per head block)", "reduce_scatter", trans, D,
                D * gather_bytes(trans, D)),
           term("conv halo grad reduce-scatter", "reduce_scatter", halo, halo_calls,
                halo_calls * gather_bytes(halo, D)),
           term("MLP ring (D-1 weight + D grad hops)", "ring", mlp, 2 * D - 1, (2 * D - 1) * mlp)]
    return fwd, bwd


def gated_attention_layer_terms(inp: PlanInput, hg: HybridGeometry) -> tuple[list[CommTerm], list[CommTerm]]:
    """tsp_layer_terms with the gated attention's larger shard (q_proj rows doubled)."""
    fwd, bwd = tsp_layer_terms(inp)
    b, old = inp.dtype_bytes, hg.tsp.A * inp.dtype_bytes

    def gated(t: CommTerm) -> CommTerm:
        if t.kind in ("broadcast", "reduce") and t.payload_bytes == old:
            return replace(t, payload_bytes=hg.A * b, bytes=t.calls * hg.A * b)
        return t
    return [gated(t) for t in fwd], [gated(t) for t in bwd]


def hybrid_extra_terms(inp: PlanInput, hg: HybridGeometry, stage: Stage) -> list[CommTerm]:
    """tsp_extra_terms with the replicated-grad bucket of a hybrid model: 2 norms per layer + the final norm, q/k
    norms of the full-attention layers, the gated-norm weight [dv] of the Gated DeltaNet layers."""
    from ds_tsp.tools.plan.comm_terms import all_reduce_bytes

    dims, b, D = hg.tsp.dims, inp.dtype_bytes, hg.tsp.D
    flat = (2 * stage.layers + 1) * dims.h + (2 * hg.n_full * dims.d if inp.model.qk_norm else 0) \
        + hg.n_linear * hg.dv
    out = []
    for t in tsp_extra_terms(inp, stage):
        if t.kind == "replicated_grad":
            t = replace(t, payload_bytes=flat * b, bytes=all_reduce_bytes(flat * b, D))
        out.append(t)
    return out


def hybrid_counter_bytes(inp: PlanInput) -> dict[str, int]:
    """Predicted CommCounter.bytes (kind -> bytes) of one TSP forward + backward of a hybrid model (pp = 1)."""
    check_hybrid_input(inp)
    hg = HybridGeometry.of(inp)
    g_fwd, g_bwd = gdn_layer_terms(inp, hg)
    a_fwd, a_bwd = gated_attention_layer_terms(inp, hg)
    stage = Stage("only", True, True, inp.model.num_layers, 1)
    out: dict[str, int] = {}
    if hg.tsp.D == 1:
        return out
    terms = [*g_fwd, *g_bwd] * hg.n_linear + [*a_fwd, *a_bwd] * hg.n_full + hybrid_extra_terms(inp, hg, stage)
    for t in terms:
        if t.bytes:
            out[t.kind] = out.get(t.kind, 0) + t.bytes
    return out


def gdn_layer_saved(inp: PlanInput, hg: HybridGeometry) -> int:
    """Saved for backward by one Gated DeltaNet decoder layer: the two norms (input, rstd), the layer's x and conv
    halo [B, 2, K-1, h], the MLP's input."""
    dims, b, T = hg.tsp.dims, inp.dtype_bytes, inp.batch * hg.tsp.L
    return 2 * tsp_norm_saved(T, dims, b) + 2 * T * dims.h * b + inp.batch * 2 * max(hg.K - 1, 0) * dims.h * b


def gated_attention_layer_saved(inp: PlanInput, hg: HybridGeometry, tsp_layer_saved) -> int:
    """tsp_layer_saved + (with recompute_projections off) the output gate [B, L, nq/D, d] of every head block; the
    gate is recomputed with q in backward otherwise."""
    g, b = hg.tsp, inp.dtype_bytes
    keep_gate = inp.model.attn_output_gate and not inp.recompute_projections
    gate = inp.batch * g.L * g.dims.nq * g.dims.d * b if keep_gate else 0
    return tsp_layer_saved(inp, g) + gate


GDN_CHUNK = 64  # GatedDeltaNetSpec.chunk_size: the pure-torch kernel's sub-chunk


def gdn_transients(inp: PlanInput, hg: HybridGeometry) -> dict[str, int]:
    """Temporaries of a Gated DeltaNet layer: the prefetched shards (ShardStream: two foreign blocks ahead), the
    halo, one block's projections (q, k repeated to value heads, v, z; compute dtype), its gathered transitions,
    the chunk kernel's [C, C] sub-chunk matrices (ds_tsp.core.gated_delta_rule, C = min(64, L/2): decay, k_beta k^T,
    the triangular system, q k^T, intra: 5 per value head and token), y; backward the block recomputed under
    autograd, so its graph (the 5 matrices + their grads and the solves' temporaries: 10 per value head and token,
    a count FITTED to MemTracker: peaks within 7% at three shapes, tests/test_plan_hybrid.py checks one) and twice
    the token-sized tensors, the grad reducer's shards and dx. This is the pure-torch kernel (CPU, or without
    flash-linear-attention); fla's fused kernel holds less, so the plan is an upper bound there."""
    g, b, B = hg.tsp, inp.dtype_bytes, inp.batch
    D, T, h = g.D, B * g.L, g.dims.h
    cb = hg.transition_bytes
    shard_in = hg.G * b if D > 1 else 0
    x = T * h * b
    halo = B * 2 * max(hg.K - 1, 0) * h * b
    block = T * hg.vb * (2 * hg.dk + 3 * hg.dv) * cb
    square = T * hg.vb * min(GDN_CHUNK, g.L // 2) * cb  # one [C, C] matrix per value head, every local token
    trans = D * 2 * B * hg.vb * hg.dk * (hg.dk + hg.dv) * cb
    return {"gdn_fwd": 2 * shard_in + halo + block + 5 * square + trans + x,
            "gdn_bwd": 2 * shard_in + min(D - 1, 3) * hg.G * b + halo + 2 * (block + trans) + 10 * square + 2 * x}


def plan_tsp_hybrid(inp: PlanInput, *, layer_saved, attention_mlp_transients) -> LayoutPlan:
    """TSP's LayoutPlan for a hybrid model (module docstring); ds_tsp.tools.plan.tsp.plan_tsp calls it with its
    tsp_layer_saved and tsp_transients (the attention and MLP figures: passed in, so this module does not import
    the one that dispatches to it)."""
    check_hybrid_input(inp)
    hg = HybridGeometry.of(inp)
    g = hg.tsp
    dims, b, T = g.dims, inp.dtype_bytes, inp.batch * g.L
    g_fwd, g_bwd = gdn_layer_terms(inp, hg)
    a_fwd, a_bwd = gated_attention_layer_terms(inp, hg)
    layer_fixed = g.M + 2 * dims.h
    linear_params = hg.G + hg.dv + layer_fixed
    full_params = hg.A + (2 * dims.d if inp.model.qk_norm else 0) + layer_fixed
    gdn_saved, attn_saved = gdn_layer_saved(inp, hg), gated_attention_layer_saved(inp, hg, layer_saved)
    gated_g = replace(g, A=hg.A)  # the attention transients with the gated shard
    transients = {**attention_mlp_transients(inp, gated_g), **gdn_transients(inp, hg)}

    def stage_fn(stage: Stage) -> StageMemory:
        params = hg.n_linear * linear_params + hg.n_full * full_params + g.Vd * dims.h
        head_params = dims.h + (0 if dims.tied else g.Vd * dims.h)
        params += head_params
        saved = hg.n_linear * gdn_saved + hg.n_full * attn_saved
        head_act = tsp_norm_saved(T, dims, b) + T * dims.h * b + T * compute_bytes(b) + T * 8 + b
        acts = saved + 2 * T * inp.model.rotary_dim * b + T * 8 + head_act  # cos, sin: the rotated dims only
        below_head = acts - head_act
        head_grads = head_params * b
        # each mixer's phases as if it were the top layer (its backward then has the most saved bytes alive; a
        # lower layer's backward holds more grads but fewer saved bytes -- same order of magnitude either way)
        phases = {"mlp_fwd": Phase(transients["mlp_fwd"], below_head, 0),
                  "mlp_bwd": Phase(transients["mlp_bwd"], below_head, head_grads)}
        for mixer, present, top_saved in (("gdn", hg.n_linear, gdn_saved), ("attention", hg.n_full, attn_saved)):
            if present:
                phases[f"{mixer}_fwd"] = Phase(transients[f"{mixer}_fwd"], below_head - top_saved
                                               + tsp_norm_saved(T, dims, b) + T * dims.h * b, 0)
                phases[f"{mixer}_bwd"] = Phase(transients[f"{mixer}_bwd"], below_head - T * dims.h * b,
                                               head_grads + (g.M + dims.h) * b)
        phases.update({"lm_head_fwd": Phase(transients["lm_head_fwd"], below_head, 0),
                       "lm_head_bwd": Phase(transients["lm_head_bwd"], acts, 0),
                       "end_of_backward": Phase(0, 0, params * b)})
        full_terms = [replace(t, name=f"full-attention layers x{hg.n_full}: {t.name}", calls=t.calls * hg.n_full,
                              bytes=t.bytes * hg.n_full) for t in (*a_fwd, *a_bwd)] if hg.n_full and g.D > 1 else []
        s = state(inp, params, **zero_divs(inp))
        return StageMemory(params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=acts,
                           phases=phases, step_terms=(hybrid_extra_terms(inp, hg, stage) if g.D > 1 else [])
                           + dp_sync(inp, params, inp.dp) + full_terms)

    notes = (f"zigzag: seq padded to {g.S_pad} (multiple of 2D)",
             f"hybrid: {hg.n_linear} Gated DeltaNet layers (the layer terms) and {hg.n_full} gated full-attention "
             "layers (in the step terms); the Gated DeltaNet's comm does not grow with S (halo K-1 tokens per chunk, "
             "transitions [2, B, H_v/D, dk, dk + dv] per rank)")
    return layout_plan("tsp", inp, stage_fn, g_fwd if g.D > 1 else [], g_bwd if g.D > 1 else [], gdn_saved, notes,
                       layers_of=lambda stage: hg.n_linear)
