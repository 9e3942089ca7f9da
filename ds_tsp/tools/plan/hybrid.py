"""TSP plan rows for a hybrid model (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers + gated full attention).

Per rank (rho = (D-1)/D, G = one Gated DeltaNet head block's packed shard, A = one gated attention head block's):
- Gated DeltaNet layer (ds_tsp.core.layers.linear_attention.gated_deltanet): params G = 1/D of in_proj (q, k, v, z, b, a
  rows of the block's heads), conv channels, A_log, dt_bias and out_proj columns, + its gated-norm weight [dv]
  (replicated), + the MLP's F/D columns and the two layer norms. Saved for backward: x and the conv halo [B, 2, K-1, h]
  (nothing per block). Comm forward: D-1 shard broadcasts, one halo all-gather (min(c, K-1) tokens per chunk), D
  transition all-gathers ([2, B, H_v/D, dk, dk + dv] per rank, float32 for 16/32-bit models); backward: the broadcasts
  again, D-1 grad reduces to the owners, the D transition all-gathers again, their D reduce-scatters, the halo's
  reduce-scatter. Plus the MLP ring of every TSP layer.
- Full-attention layer: the TSP attention terms (ds_tsp.tools.plan.tsp_comm) with q_proj's rows doubled ([q, gate]
  per head: the gate rides in the shard) and the gate saved per head block.
- MoE hybrids (Qwen3-Next, Qwen3.5-MoE): a sparse layer's MLP is the MoE block of ds_tsp.tools.plan.moe_terms (E/D
  whole experts, the replicated router, ring or all_to_all dispatch) plus the shared expert, a gated MLP of width
  Fs sharded Fs/D like the dense MLP (its own weight ring: D-1 hops forward, 2D-1 backward) scaled by
  sigmoid(x @ shared_expert_gate.T), the gate [1, h] replicated; router and gate grads join the replicated-grads
  all-reduce, and output_router_logits adds the aux loss's counts all-reduce. A dense layer of such a model
  (Qwen3-Next's mlp_only_layers) keeps the dense MLP.
- activation checkpointing: every layer's forward traffic once more in backward (the recompute); each layer keeps
  only its input [B, L, h], and the top layer's saved tensors come back while its backward runs. With
  offload_activations those inputs wait in host memory, at most two on the device (ds_tsp.tools.plan.offload).
Layers are grouped by (mixer, MLP) kind: the layer terms of the plan describe the most numerous Gated DeltaNet kind
(ties: the sparse one), every other kind's terms come in the step terms ("full-attention layers xN: ...",
"Gated DeltaNet layers (dense MLP) xN: ..."), as an MoE model's dense layers do. tests/tools/test_plan_hybrid.py and
tests/tools/test_plan_hybrid_moe.py check every comm kind against CommCounter exactly, params / grads exactly, the saved
bytes against saved-tensor hooks, the host pool of offload against the model's, and the peak against bench's
MemTracker (10%).

Pipeline stages (pp > 1; ds_tsp.integrations.deepspeed.pipeline): each stage holds its own layers (shape_terms.stages:
the first ceil(n / pp), the last the rest), the embedding on the first, the final norm and LM head on the last, and
keeps the activations of its micro-batches in flight (1F1B: pp on the first stage). A stage has no replicated-grad
bucket: every replicated weight reduces its own grad per use (the two norms of each layer, each Gated DeltaNet
layer's gated-norm weight [dv], the q / k norms of each full-attention layer, each sparse layer's router and
shared-expert gate, the final norm); no input check: each stage gathers the position_ids over TSP ([D, B, L]
int64) to find the documents (under activation checkpointing once more per recomputed layer: DeepSpeed's checkpoint
hands it detached inputs), and the last one all-reduces the loss denominator (one int64). The layer terms
describe the most numerous Gated DeltaNet kind of the whole model, the stage's other kinds come in its step terms;
the plan reports the stage with the highest peak. tests/tools/test_plan_hybrid_pipeline.py checks every stage's
bytes against the CommCounter of that stage's modules, exactly (with and without checkpointing), and its params,
grads and saved bytes (without checkpointing); tests/integrations/test_pipeline_checkpointing.py against a real
DeepSpeed pipeline step.
Refused with pp, as the runtime refuses them: tied embeddings, and an MoE hybrid with output_router_logits.

Not modelled (refused by name): the peers' layouts (their plans count Llama layers). Context parallelism adds its
cp terms on top of these rows (ds_tsp.tools.plan.hybrid_cp, through plan_tsp_cp), per stage under pp.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ds_tsp.tools.plan.activation_terms import compute_bytes, tsp_norm_saved
from ds_tsp.tools.plan.assemble import layout_plan
from ds_tsp.tools.plan.comm_terms import all_reduce_bytes, dp_sync, gather_bytes, pipeline_hops, recompute, term
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.memory import Phase, StageMemory, state, zero_divs
from ds_tsp.tools.plan.moe_terms import (
    MoEGeometry,
    moe_geometry,
    moe_mlp_terms,
    moe_note,
    moe_saved,
    moe_summary,
    moe_transients,
    sparse_count,
    sparse_layer_params,
    stage_layer_ids,
)
from ds_tsp.tools.plan.offload import device_held_inputs, offload_note, with_offload
from ds_tsp.tools.plan.result import CommTerm, LayoutPlan
from ds_tsp.tools.plan.shape_terms import Stage
from ds_tsp.tools.plan.tsp_comm import (
    TSPGeometry,
    at_rank,
    stage_positions_regather,
    tsp_extra_terms,
    tsp_layer_terms,
)


def check_hybrid_input(inp: PlanInput) -> None:
    """One PlanInputError naming the field for what the runtime refuses with pipeline stages
    (ds_tsp.integrations.deepspeed.pipeline.build_pipeline_module)."""
    m = inp.model
    if inp.pp > 1 and m.tie_word_embeddings:
        raise PlanInputError("pp", f"pp={inp.pp} with tie_word_embeddings=True: the tied embedding and LM head live "
                                   "on different stages (tsp.pipeline_stages refuses it); untie them or plan pp 1")
    if inp.pp > 1 and m.num_experts and m.output_router_logits:
        raise PlanInputError("pp", f"pp={inp.pp} with output_router_logits=True on an MoE hybrid: the stages pass "
                                   "only hidden states, so the aux loss would be dropped (tsp.pipeline_stages "
                                   "refuses it); set output_router_logits=False or plan pp 1")


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
    moe: MoEGeometry | None = None  # the sparse layers' MoE block (None: a dense hybrid)
    Ms: int = 0  # the shared expert's packed shard, elements (3 h Fs/D)

    @classmethod
    def of(cls, inp: PlanInput, schedule: str | None = None) -> "HybridGeometry":
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
        moe = moe_geometry(inp, inp.batch * g.L, schedule)
        Ms = 3 * h * (m.shared_expert_intermediate_size // D) if moe is not None else 0
        return cls(g, n_linear, m.num_layers - n_linear, G, g.A + gate, vb, dk, dv, K, min(g.L // 2, max(K - 1, 0)),
                   compute_bytes(inp.dtype_bytes), moe, Ms)


@dataclass(frozen=True)
class LayerKind:
    """What a decoder layer is made of: its mixer ("linear_attention" = Gated DeltaNet, "full_attention") and
    whether its MLP is the MoE block (+ shared expert)."""

    mixer: str
    sparse: bool

    def title(self, moe_model: bool) -> str:
        name = "Gated DeltaNet layers" if self.mixer == "linear_attention" else "full-attention layers"
        return f"{name} ({'sparse' if self.sparse else 'dense'} MLP)" if moe_model else name


def layer_kinds(inp: PlanInput) -> list[LayerKind]:
    m = inp.model
    return [LayerKind(t, bool(m.num_experts) and m.is_moe_layer(i)) for i, t in enumerate(m.layer_types)]


def described_kind(inp: PlanInput) -> LayerKind:
    """The kind the plan's layer terms describe (module docstring): the most numerous Gated DeltaNet kind."""
    kinds = layer_kinds(inp)
    counts = {k: kinds.count(k) for k in kinds}
    return max(counts, key=lambda k: (k.mixer == "linear_attention", counts[k], k.sparse))


def _without_mlp_ring(terms: list[CommTerm]) -> list[CommTerm]:
    return [t for t in terms if not (t.kind == "ring" and "MLP" in t.name)]


def mlp_terms(inp: PlanInput, hg: HybridGeometry, sparse: bool) -> tuple[list[CommTerm], list[CommTerm]]:
    """A layer's MLP terms: the dense MLP's weight ring, or the MoE schedule's terms plus the shared expert's ring."""
    D, b = hg.tsp.D, inp.dtype_bytes
    if D == 1:
        return [], []
    if not sparse:
        mlp = hg.tsp.M * b
        return ([term("MLP weight ring (D-1 hops)", "ring", mlp, D - 1, (D - 1) * mlp)],
                [term("MLP ring (D-1 weight + D-1 grad hops)", "ring", mlp, 2 * (D - 1), 2 * (D - 1) * mlp)])
    fwd, bwd = moe_mlp_terms(hg.moe)
    shared, h = hg.Ms * b, hg.tsp.dims.h
    # on a pipeline stage the shared expert's gate [1, h] reduces its own grad (the router's: moe_step_terms)
    gate = [term("shared expert gate grad all-reduce", "replicated_grad", h * b, 1, all_reduce_bytes(h * b, D))]
    return (fwd + [term("shared expert weight ring (D-1 hops)", "ring", shared, D - 1, (D - 1) * shared)],
            bwd + [term("shared expert ring (D-1 weight + D-1 grad hops)", "ring", shared, 2 * (D - 1),
                        2 * (D - 1) * shared)] + (gate if inp.pp > 1 else []))


def keeps_gdn_blocks(inp: PlanInput) -> bool:
    """Speed mode without activation checkpointing: every Gated DeltaNet head block's forward is kept for backward
    (its gathered transitions too: no re-gather). ds_tsp.model.modules.gated_deltanet decides it the same way."""
    return not inp.recompute_projections and not inp.activation_checkpointing


def gdn_layer_terms(inp: PlanInput, hg: HybridGeometry, sparse: bool = False) -> tuple[list[CommTerm],
                                                                                       list[CommTerm]]:
    """One Gated DeltaNet decoder layer's CommCounter terms (module docstring), its MLP's included (and, under
    activation checkpointing, the recompute of its forward)."""
    g, b, B = hg.tsp, inp.dtype_bytes, inp.batch
    D = g.D
    if D == 1:
        return [], []
    h = g.dims.h
    shard = hg.G * b
    halo = D * 2 * B * hg.tail * h * b  # [D, 2, B, tail, h]
    trans = D * 2 * B * hg.vb * hg.dk * (hg.dk + hg.dv) * hg.transition_bytes  # one block's [D, 2, B, vb, dk, dk+dv]
    halo_calls = 1 if hg.K > 1 else 0
    mlp_fwd, mlp_bwd = mlp_terms(inp, hg, sparse)
    fwd = [term("Gated DeltaNet shard broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
           term("conv halo all-gather", "all_gather", halo, halo_calls, halo_calls * gather_bytes(halo, D)),
           term("chunk transition all-gather (per head block)", "all_gather", trans, D, D * gather_bytes(trans, D)),
           *mlp_fwd]
    bwd = [term("Gated DeltaNet shard re-broadcast", "broadcast", shard, D - 1, (D - 1) * shard),
           term("Gated DeltaNet grad reduce to owner", "reduce", shard, D - 1, (D - 1) * shard),
           *([] if keeps_gdn_blocks(inp) else [term("chunk transition re-gather (per head block)", "all_gather",
                                                     trans, D, D * gather_bytes(trans, D))]),
           term("transition grad reduce-scatter (per head block)", "reduce_scatter", trans, D,
                D * gather_bytes(trans, D)),
           term("conv halo grad reduce-scatter", "reduce_scatter", halo, halo_calls,
                halo_calls * gather_bytes(halo, D)),
           *mlp_bwd]
    if inp.pp > 1:  # a pipeline stage has no replicated-grad bucket: each use reduces its own grad
        bwd += [term("norm weight grad all-reduce (2 norms)", "replicated_grad", h * b, 2,
                     2 * all_reduce_bytes(h * b, D)),
                term("gated-norm weight grad all-reduce", "replicated_grad", hg.dv * b, 1,
                     all_reduce_bytes(hg.dv * b, D))]
    return fwd, bwd + (recompute(fwd) + stage_positions_regather(inp, g) if inp.activation_checkpointing else [])


def gated_attention_layer_terms(inp: PlanInput, hg: HybridGeometry, sparse: bool = False) -> tuple[list[CommTerm],
                                                                                                   list[CommTerm]]:
    """tsp_layer_terms with the gated attention's larger shard (q_proj rows doubled) and this layer's MLP terms."""
    fwd, bwd = tsp_layer_terms(inp)  # with its recompute under activation checkpointing
    b, old = inp.dtype_bytes, hg.tsp.A * inp.dtype_bytes

    def gated(t: CommTerm) -> CommTerm:
        if t.kind in ("broadcast", "reduce") and t.payload_bytes == old:
            return replace(t, payload_bytes=hg.A * b, bytes=t.calls * hg.A * b)
        return t
    mlp_fwd, mlp_bwd = mlp_terms(inp, hg, sparse)
    fwd = [gated(t) for t in _without_mlp_ring(fwd)]
    bwd = [gated(t) for t in _without_mlp_ring(bwd)]
    return fwd + mlp_fwd, bwd + mlp_bwd + (recompute(mlp_fwd) if inp.activation_checkpointing else [])


def layer_terms(inp: PlanInput, hg: HybridGeometry, kind: LayerKind) -> tuple[list[CommTerm], list[CommTerm]]:
    if kind.mixer == "linear_attention":
        return gdn_layer_terms(inp, hg, kind.sparse)
    return gated_attention_layer_terms(inp, hg, kind.sparse)


def hybrid_extra_terms(inp: PlanInput, hg: HybridGeometry, stage: Stage) -> list[CommTerm]:
    """tsp_extra_terms with the replicated-grad bucket of a hybrid model: 2 norms per layer + the final norm, q/k
    norms of the full-attention layers, the gated-norm weight [dv] of the Gated DeltaNet layers, and per sparse
    layer its router [E, h] and shared-expert gate [1, h]."""
    dims, b, D = hg.tsp.dims, inp.dtype_bytes, hg.tsp.D
    if inp.pp > 1:  # a pipeline stage: no bucket (every replicated grad in its layer's terms), no input check
        return tsp_extra_terms(inp, stage)
    flat = (2 * stage.layers + 1) * dims.h + (2 * hg.n_full * dims.d if inp.model.qk_norm else 0) \
        + hg.n_linear * hg.dv
    if hg.moe is not None:
        flat += sparse_count(inp, stage) * (hg.moe.router + dims.h)
    out = []
    for t in tsp_extra_terms(inp, stage):
        if t.kind == "replicated_grad":
            t = replace(t, payload_bytes=flat * b, bytes=all_reduce_bytes(flat * b, D))
        out.append(t)
    return out


def hybrid_counter_bytes(inp: PlanInput, stage: Stage | None = None, rank: int | None = None) -> dict[str, int]:
    """Predicted CommCounter.bytes (kind -> bytes) of one TSP forward + backward of a hybrid model: the whole model
    (pp = 1), or with pipeline stages one micro-batch through `stage` (one of shape_terms.stages(inp)); of TSP rank
    `rank` on CPU tensors (tsp_comm.at_rank: the full-attention layers' causal K/V), else the busiest rank's per
    kind."""
    check_hybrid_input(inp)
    if stage is None and inp.pp > 1:
        raise PlanInputError("pp", f"pp={inp.pp}: the counter bytes are per stage; pass one of stages(inp)")
    hg = HybridGeometry.of(inp)
    stage = stage or Stage("only", True, True, inp.model.num_layers, 1)
    out: dict[str, int] = {}
    if hg.tsp.D == 1:
        return out
    kinds = layer_kinds(inp)
    terms = [t for i in stage_layer_ids(inp, stage) for t in (lambda f, b: [*f, *b])(*layer_terms(inp, hg, kinds[i]))]
    for t in [at_rank(t, hg.tsp.D, rank) for t in terms] + hybrid_extra_terms(inp, hg, stage):
        if t.bytes:
            out[t.kind] = out.get(t.kind, 0) + t.bytes
    return out


def gdn_layer_saved(inp: PlanInput, hg: HybridGeometry) -> int:
    """Saved for backward by one Gated DeltaNet decoder layer with a dense MLP: the two norms (input, rstd), the
    layer's x and conv halo [B, 2, K-1, h], the MLP's input; with recompute_projections off also the MLP's gate /
    up and (keeps_gdn_blocks: not under activation checkpointing) every head block's kept forward (its graph,
    traced: ds_tsp.tools.plan.gdn_kept) and gathered transitions [D, 2, B, vb, dk, dk + dv] (with a cp axis C
    times that: not counted here)."""
    dims, b, T = hg.tsp.dims, inp.dtype_bytes, inp.batch * hg.tsp.L
    kept = 0 if inp.recompute_projections else 2 * T * dims.F * b
    if keeps_gdn_blocks(inp):
        from ds_tsp.tools.plan.gdn_kept import kept_block_bytes

        D, m = hg.tsp.D, inp.model
        block = kept_block_bytes(inp.batch, hg.tsp.L, dims.h, m.linear_num_key_heads // D, hg.vb, hg.dk, hg.dv, hg.K,
                                 inp.dtype)
        transitions = D * 2 * inp.batch * hg.vb * hg.dk * (hg.dk + hg.dv) * hg.transition_bytes
        kept += D * (block + transitions)
    return (2 * tsp_norm_saved(T, dims, b) + 2 * T * dims.h * b + inp.batch * 2 * max(hg.K - 1, 0) * dims.h * b
            + kept)


def gated_attention_layer_saved(inp: PlanInput, hg: HybridGeometry, tsp_layer_saved) -> int:
    """tsp_layer_saved + (with recompute_projections off) the output gate [B, L, nq/D, d] of every head block; the
    gate is recomputed with q in backward otherwise."""
    g, b = hg.tsp, inp.dtype_bytes
    keep_gate = inp.model.attn_output_gate and not inp.recompute_projections
    gate = inp.batch * g.L * g.dims.nq * g.dims.d * b if keep_gate else 0
    return tsp_layer_saved(inp, g) + gate


def sparse_mlp_saved_extra(inp: PlanInput, hg: HybridGeometry) -> int:
    """What a sparse MLP saves beyond a dense one's input x: the MoE block's (moe_terms.moe_saved), the shared
    expert's output [T, h] and its sigmoid gate [T, 1] (the product's operands), and with recompute_projections
    off the shared expert's gate / up [T, Fs] instead of the dense MLP's [T, F]."""
    dims, b, T = hg.tsp.dims, inp.dtype_bytes, inp.batch * hg.tsp.L
    kept = 0 if inp.recompute_projections else 2 * T * inp.model.shared_expert_intermediate_size * b
    return moe_saved(inp, hg.moe) + T * dims.h * b + T * b + kept


def kind_saved(inp: PlanInput, hg: HybridGeometry, kind: LayerKind, tsp_layer_saved) -> int:
    """Saved for backward by one layer of `kind` without checkpointing."""
    dims, b, T = hg.tsp.dims, inp.dtype_bytes, inp.batch * hg.tsp.L
    base = gdn_layer_saved(inp, hg) if kind.mixer == "linear_attention" else \
        gated_attention_layer_saved(inp, hg, tsp_layer_saved)
    if not kind.sparse:
        return base
    dense_kept = 0 if inp.recompute_projections else 2 * T * dims.F * b
    return base - dense_kept + sparse_mlp_saved_extra(inp, hg)


def kind_params(inp: PlanInput, hg: HybridGeometry, kind: LayerKind) -> int:
    """Parameters per rank of one layer of `kind`: mixer + MLP (dense F/D columns, or E/D experts + router +
    shared expert Fs/D + its gate) + the two layer norms."""
    dims = hg.tsp.dims
    mixer = hg.G + hg.dv if kind.mixer == "linear_attention" else \
        hg.A + (2 * dims.d if inp.model.qk_norm else 0)
    return mixer + kind_mlp_params(hg, kind) + 2 * dims.h


def kind_mlp_params(hg: HybridGeometry, kind: LayerKind) -> int:
    return sparse_layer_params(hg.moe) + hg.Ms + hg.tsp.dims.h if kind.sparse else hg.tsp.M


def checkpointed_aux_loss_saved(inp: PlanInput, hg: HybridGeometry) -> int:
    """Under activation checkpointing, what the aux loss (output_router_logits) keeps outside the checkpointed
    layers: per sparse layer the router softmax [T, E] (compute dtype) and top-k indices [T, k] (int64), and the
    step's counts [E + 1] and token total (compute dtype). Without checkpointing moe_saved counts them per layer."""
    m = hg.moe
    if m is None or not inp.model.output_router_logits:
        return 0
    cb = compute_bytes(inp.dtype_bytes)
    sparse = sparse_count(inp, Stage("only", True, True, inp.model.num_layers, 1))
    return sparse * (m.T * m.E * cb + m.T * m.k * 8) + (m.E + 1) * cb + cb


GDN_CHUNK = 64  # GatedDeltaNetSpec.chunk_size: the pure-torch kernel's sub-chunk


def gdn_transients(inp: PlanInput, hg: HybridGeometry) -> dict[str, int]:
    """Temporaries of a Gated DeltaNet layer: the prefetched shards (ShardStream: two foreign blocks ahead), the
    halo, one block's projections (q, k repeated to value heads, v, z; compute dtype), its gathered transitions,
    the chunk kernel's [C, C] sub-chunk matrices (ds_tsp.core.layers.linear_attention.delta_rule, C = min(64, L/2):
    decay, k_beta k^T, the triangular system, q k^T, intra: 5 per value head and token), y, and the next block's
    chunk results (its transitions' gather overlaps them); backward the block recomputed under autograd, its graph
    walked once by the one-pass backward (the [C, C] matrices, the per-head [dk] / [dv] rows the kernel
    derives from q, k, v (k_beta, the solves' results, the sub-chunks' reads), the sub-chunks' [dk, dk + dv]
    transitions (one per C tokens), more of the gathered transitions' size: their grads, the composed prefixes),
    the block before's projection grads (their GEMMs run while this block's transitions are re-gathered), twice
    the token-sized tensors, the grad reducer's shards and dx. The backward's four counts (6.875 [C, C] matrices,
    7 [dk + dv] rows and 4 / C transitions per value head and token, 5.75 times the gathered transitions) are
    FITTED to MemTracker over head sizes dk = dv = 4 .. 128, S = 256 .. 1024 and D = 2, 4: peaks within -3% / +5%
    at 20 points (tests/tools/test_plan_hybrid.py checks two head sizes). At real head sizes the
    rows and transitions dominate, so a fit at one small head size cannot stand for them (a count of [C, C]
    matrices alone, fitted at dk = 4, plans 20% short at dk = 16 and 60% short at dk = 128).
    This is the pure-torch kernel (CPU, or without flash-linear-attention); fla's fused kernel holds less, so the
    plan is an upper bound there."""
    g, b, B = hg.tsp, inp.dtype_bytes, inp.batch
    D, T, h = g.D, B * g.L, g.dims.h
    cb = hg.transition_bytes
    shard_in = hg.G * b if D > 1 else 0
    x = T * h * b
    halo = B * 2 * max(hg.K - 1, 0) * h * b
    block = T * hg.vb * (2 * hg.dk + 3 * hg.dv) * cb
    C = max(1, min(GDN_CHUNK, g.L // 2))
    square = T * hg.vb * C * cb  # one [C, C] matrix per value head, every local token
    rows = T * hg.vb * (hg.dk + hg.dv) * cb  # one [dk] and one [dv] row per value head, every local token
    states = T * hg.vb * hg.dk * (hg.dk + hg.dv) // C * cb  # one [dk, dk + dv] transition per value head, C tokens
    trans = D * 2 * B * hg.vb * hg.dk * (hg.dk + hg.dv) * cb
    return {"gdn_fwd": 2 * shard_in + halo + 2 * block + 5 * square + trans + x,
            "gdn_bwd": 2 * shard_in + min(D - 1, 3) * hg.G * b + halo + 2 * block + 23 * trans // 4
            + 55 * square // 8 + 7 * rows + 4 * states + 2 * x}


def sparse_mlp_transients(inp: PlanInput, hg: HybridGeometry, attention_mlp_transients, ring_buffers
                          ) -> dict[str, int]:
    """{"moe_fwd", "moe_bwd"}: the MoE block's temporaries (moe_terms.moe_transients) or, while the shared expert
    runs after it, the block's output y [T, h] plus the shared expert's (a dense MLP of width Fs), whichever is
    larger."""
    g = hg.tsp
    moe = moe_transients(inp, hg.moe, ring_buffers(g.D))
    shared_g = replace(g, M=hg.Ms, dims=replace(g.dims, F=inp.model.shared_expert_intermediate_size))
    shared = attention_mlp_transients(inp, shared_g)
    y = inp.batch * g.L * g.dims.h * inp.dtype_bytes
    return {"moe_fwd": max(moe["mlp_fwd"], y + shared["mlp_fwd"]),
            "moe_bwd": max(moe["mlp_bwd"], y + shared["mlp_bwd"])}


def plan_tsp_hybrid(inp: PlanInput, *, layer_saved, attention_mlp_transients, ring_buffers,
                    _other_schedules: bool = True) -> LayoutPlan:
    """TSP's LayoutPlan for a hybrid model (module docstring); ds_tsp.tools.plan.tsp.plan_tsp calls it with its
    tsp_layer_saved, tsp_transients and ring_buffers (the attention and MLP figures: passed in, so this module does
    not import the one that dispatches to it)."""
    check_hybrid_input(inp)
    hg = HybridGeometry.of(inp)
    g = hg.tsp
    dims, b, T = g.dims, inp.dtype_bytes, inp.batch * g.L
    x = T * dims.h * b
    ac = inp.activation_checkpointing
    kinds = layer_kinds(inp)
    counts = {k: kinds.count(k) for k in kinds}
    described = described_kind(inp)
    d_fwd, d_bwd = layer_terms(inp, hg, described)
    saved = {k: kind_saved(inp, hg, k, layer_saved) for k in counts}
    params_of = {k: kind_params(inp, hg, k) for k in counts}
    gated_g = replace(g, A=hg.A)  # the attention transients with the gated shard
    transients = {**attention_mlp_transients(inp, gated_g), **gdn_transients(inp, hg)}
    if hg.moe is not None:
        transients.update(sparse_mlp_transients(inp, hg, attention_mlp_transients, ring_buffers))

    def on_stage(stage: Stage) -> list[LayerKind]:
        return [kinds[i] for i in stage_layer_ids(inp, stage)]

    def stage_fn(stage: Stage) -> StageMemory:
        mine = on_stage(stage)
        here = {k: mine.count(k) for k in counts if k in mine}
        top = mine[-1]  # the stage's top layer: its backward runs first, with the others' saved tensors alive
        params = sum(here[k] * params_of[k] for k in here) + (g.Vd * dims.h if stage.embed else 0)
        head_params = dims.h + (0 if (dims.tied and stage.embed) else g.Vd * dims.h) if stage.head else 0
        params += head_params
        all_saved = sum(here[k] * saved[k] for k in here)
        kept = (device_held_inputs(len(mine)) if inp.offload_activations else len(mine)) * x \
            + checkpointed_aux_loss_saved(inp, hg) if ac else all_saved
        head_act = tsp_norm_saved(T, dims, b) + x + T * compute_bytes(b) + T * 8 + b if stage.head else 0
        # cos, sin (the rotated dims only), the input ids on the first stage
        acts = (kept + 2 * T * inp.model.rotary_dim * b + (T * 8 if stage.embed else 0) + head_act) \
            * stage.in_flight
        below_head = acts - head_act
        head_grads = head_params * b
        # each mixer's and MLP's phases as if its layer were the top layer (its backward then has the most saved
        # bytes alive; a lower layer's backward holds more grads but fewer saved bytes -- same order of magnitude
        # either way); under checkpointing that layer's saved tensors are back (the recompute) during its backward
        phases = {}
        for mlp_phase, present, sparse in (("mlp", any(not k.sparse for k in here), False),
                                           ("moe", any(k.sparse for k in here), True)):
            if present:
                layer_saved_top = max(saved[k] for k in here if k.sparse == sparse)
                recomputing = layer_saved_top if ac else 0
                phases[f"{mlp_phase}_fwd"] = Phase(transients[f"{mlp_phase}_fwd"], below_head, 0)
                phases[f"{mlp_phase}_bwd"] = Phase(transients[f"{mlp_phase}_bwd"], below_head + recomputing,
                                                   head_grads)
        for mixer, name in (("gdn", "linear_attention"), ("attention", "full_attention")):
            of_mixer = [k for k in here if k.mixer == name]
            if not of_mixer:
                continue
            k = top if top in of_mixer else max(of_mixer, key=lambda k: saved[k])
            recomputing = saved[k] if ac else 0
            phases[f"{mixer}_fwd"] = Phase(transients[f"{mixer}_fwd"], below_head - (0 if ac else saved[k])
                                           + tsp_norm_saved(T, dims, b) + x, 0)
            phases[f"{mixer}_bwd"] = Phase(transients[f"{mixer}_bwd"], below_head + recomputing - x,
                                           head_grads + (kind_mlp_params(hg, k) + dims.h) * b)
        if stage.head:
            phases.update({"lm_head_fwd": Phase(transients["lm_head_fwd"], below_head, 0),
                           "lm_head_bwd": Phase(transients["lm_head_bwd"], acts, 0)})
        phases["end_of_backward"] = Phase(0, 0, params * b)
        other_terms = []
        if g.D > 1:
            for k, n in here.items():
                if k != described:
                    k_fwd, k_bwd = layer_terms(inp, hg, k)
                    other_terms += [replace(t, name=f"{k.title(hg.moe is not None)} x{n}: {t.name}",
                                            calls=t.calls * n, bytes=t.bytes * n) for t in (*k_fwd, *k_bwd)]
        s = state(inp, params, **zero_divs(inp))
        return StageMemory(params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=acts,
                           phases=phases, step_terms=(hybrid_extra_terms(inp, hg, stage) if g.D > 1 else [])
                           + dp_sync(inp, params, inp.dp) + pipeline_hops(inp, stage, T) + other_terms)

    notes = [f"zigzag: seq padded to {g.S_pad} (multiple of 2D)",
             f"hybrid: {hg.n_linear} Gated DeltaNet layers and {hg.n_full} gated full-attention layers; the layer "
             f"terms describe the {counts[described]} {described.title(hg.moe is not None)}, the others come in the "
             "step terms; the Gated DeltaNet's comm does not grow with S (halo K-1 tokens per chunk, transitions "
             "[2, B, H_v/D, dk, dk + dv] per rank)"]
    if ac:
        notes.append("activation checkpointing: each layer keeps its input only; its forward (and comm) reruns in "
                     "backward")
    if inp.offload_activations:
        notes.append(offload_note(inp, g))
    moe = {}
    if hg.moe is not None:
        only = Stage("only", True, True, inp.model.num_layers, 1)
        notes.append(moe_note(hg.moe, sparse_count(inp, only), inp.model.num_layers)
                     + f"; + a shared expert of width {inp.model.shared_expert_intermediate_size} per sparse layer")
        peaks = None
        if _other_schedules:
            peaks = {s: plan_tsp_hybrid(replace(inp, moe_dispatch=s), layer_saved=layer_saved,
                                        attention_mlp_transients=attention_mlp_transients,
                                        ring_buffers=ring_buffers, _other_schedules=False).peak_bytes_per_rank
                     for s in ("ring", "all_to_all")}
        moe = moe_summary(hg.moe, peaks)
    plan = layout_plan("tsp", inp, stage_fn, d_fwd, d_bwd, saved[described], tuple(notes),
                       layers_of=lambda stage: on_stage(stage).count(described), moe=moe)
    return with_offload(plan, inp, g)
