"""TSP Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): weights 1/D by linear heads, tokens 1/D (zigzag).

Shapes (rank p of D, local tokens L = two zigzag chunks of c = L/2; kb = linear_num_key_heads/D and
vb = linear_num_value_heads/D heads per block; the value heads of block j read its key heads, r = vb/kb each):
| tensor              | shape                          | sharding                                            |
|---------------------|--------------------------------|-----------------------------------------------------|
| x                   | [B, L, h]                      | tokens of rank p (chunks p and 2D-1-p)              |
| halo                | [B, 2, K-1, h]                 | the K-1 tokens before each local chunk (elsewhere)  |
| packed shard j      | [layout.numel]                 | in_proj rows of block j's heads (q, k, v, z, b, a), |
|                     |                                | its conv channels, A_log, dt_bias, out_proj columns |
| norm weight         | [dv]                           | replicated (grads summed over the group by caller)  |
| q, k / v, z         | [B, L, vb, dk] / [B, L, vb, dv]| local tokens, block j (q, k repeated to value heads)|
| (M | U) per chunk   | [2, B, vb, dk, dk + dv]        | gathered from every rank (per-block sequence data)  |
| y                   | [B, L, h]                      | local tokens, summed over head blocks               |

Schedule (like TSP attention: the weights travel, every rank computes its own tokens):
    halo = all-gather of the last min(c, K-1) hidden states of every chunk       (once per layer, before the blocks)
    for j in 0..D-1:   shard j broadcast by its owner (prefetched two blocks ahead: ShardStream)
        project the local tokens and the halo (q|k|v, z, a, b); causal conv over [halo | chunk] with the taps of
        other documents masked; silu; l2-normalize q, k; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
        per local chunk (every row at once, document starts cut inside the kernel): chunked delta rule from a zero
            state -> o_local, q_eff (o = o_local + q_eff S_in) and the chunk's transition (M, U)
            (ds_tsp.core.layers.linear_attention.delta_rule)
        all-gather the transitions (with cp: over cp first, then over TSP), posted at once and waited only after
            block j+1's chunks above have run (TransitionGather: the gather travels behind them; the TSP stage is
            posted as soon as the cp stage is in); compose all 2D (2CD) in sequence order -> S_in of both local chunks
        o = o_local + q_eff @ S_in (q_eff is 0 from a chunk's first document start on); gated RMSNorm;
        y += o @ Wout_j^T
The chunk kernel: on CUDA in fp16 / bf16 flash-linear-attention's chunk_gated_delta_rule when installed (one call
yields o_local, q_eff, M and U: ds_tsp.core.layers.linear_attention.delta_rule_fla), else the pure-torch chunked kernel
(float32 / float64, CPU: the exact path). The transitions travel in the kernel's compute dtype: float32 for float32 /
bfloat16 / float16 models (the M chain is a product of up to 2D matrices: bf16 would drift), float64 for float64.
Document starts reset the state (M = 0 from there) and the conv (masked taps), as transformers' kernels do with
cu_seq_lens.

Backward (hand-written loop, autograd inside each block): for j in 0..D-1 the shard is broadcast again and the
block's forward recomputed from x and the halo the way speed mode keeps it (below: the projections cut off as graph
leaves, the conv and chunk kernels under autograd) and its transitions gathered again, posted before block j-1's
projection GEMMs' backward (stage 3's second half) and waited after it, so they travel behind those GEMMs (with cp
the cross-node stage does, the TSP stage is posted after them; the first block's have nothing before them); its
chunk results (o_local, q_eff, z) are cut off as fresh leaves, so every op's backward runs ONCE per block, in three
stages around the one explicit collective:
    1. the output side (out projection's dX, gated norm, the start-state GEMMs and their composition): grads of
       this rank's chunk results, of the norm weight and of EVERY rank's gathered (M, U); no chunk kernel, no
       projection
    2. reduce-scatter of the (M, U) grads, posted by EVERY rank (also one whose chunks all start documents and so
       read no state: autograd alone would skip it there and the other ranks would wait); the out projection's
       weight grad is computed while it travels
    3. one autograd pass through the chunk kernels (the torch kernel's graph or FLA's backward) and the conv to the
       projections with both cotangents at once: the chunk results' (stage 1) and the transitions' (stage 2); the
       block's graph is freed there. Then, in block j+1 (after the loop for the last block), the q/k/v/z/a/b
       projections' GEMMs' backward by hand (dx accumulated in place, the weight grads from the re-broadcast
       shard) -> the grads of x, the halo and the shard; it reads the grads and the shard only.
Speed mode (spec.keep_activations: TSPOptions.speed() without activation checkpointing) keeps each block's
forward instead: its projections cut off as graph leaves (the weights are not kept: the shard is broadcast again),
the graph of its conv and chunk kernels, and its gathered transitions. Backward then recomputes nothing and
re-gathers nothing: the same three stages on the kept block, block j-1's projection GEMMs run while block j's
transition grads are reduce-scattered (stage 2: there is no gather to hide). Memory: O(B L) per block, every block
(ds_tsp.tools.plan.gdn_kept traces it for the planner).
The block's packed weight grad is reduced to its owner (ShardGradReducer). The halo's grad returns to the ranks
holding those tokens once, after the blocks (conv_halo's autograd dual: a reduce-scatter). Saved for backward: x,
the halo and the parameters (a LoRA-merged shard as its base and factors, rebuilt in backward: shard_rebuild; no
per-block activation, no foreign shard): memory O(B L h) + one block's recompute
graph (O(B L vb (2 dk + 3 dv)) + O(D B vb dk (dk + dv))), with the block before's projection grads beside it while
its GEMMs run, + at most 3 packed shards in flight; forward holds two blocks' chunk results at once (block j's
while block j+1's run). Compute: the forward twice (the price of keeping
nothing per block) and the backward once.

Bytes per layer per rank (elements x dtype bytes; rho = (D-1)/D; W = the layer's sharded weights):
    forward:  rho W (shards) + 2 (D-1) B min(c, K-1) h (halo) + 2 (D-1) B H_v dk (dk + dv) (transitions, compute dtype)
    backward: rho W (re-broadcast) + rho W (weight grads to owners) + 2 x the transitions (re-gather + reduce-scatter)
              + the halo reduce-scatter
Nothing scales with S (the halo is K-1 tokens per chunk).

With a cp axis (comm.cp: C TSP groups share the sequence, 2CD chunks of c tokens; ds_tsp.core.tokens.zigzag) the
schedule is the same with both gathers two-staged (ds_tsp.core.layers.linear_attention.scan): the TSP group's gathered
[D, 2, ...] is all-gathered over the cp group into [C, D, 2, ...], so a halo or a state from another group's chunk
arrives, and every rank composes all 2CD transitions; the backward duals reduce-scatter over cp, then over TSP,
posted on every rank in the same order. The document layout is then the whole sequence's (cp_inputs), so a
document that starts in another group's chunk resets the state and the conv here too. cp bytes per layer per rank
(the cp communicator, across nodes; its all-gather counts the (C-1)/C that arrives):
    forward:  (C-1) D 2 B min(c, K-1) h (halo) + per block (C-1) D 2 B H_block dk (dk + dv) (transitions)
    backward: per block the transitions re-gathered and their grads reduce-scattered (the same bytes each) + the
              halo's reduce-scatter
O(1) in S as well. Without cp the collectives and bytes are exactly those above.

Host syncs: 0 (document cuts are host ints of the DocumentLayout; the reset and tap masks are built by fills of
slices on the device, never `t[i] = v`; FLA's varlen plan goes over in one non-blocking copy from pinned memory and
FLA gets cu_seqlens' host copy as cu_seqlens_cpu, so it reads nothing back; a chunk without a document start calls
FLA without cu_seqlens. FLA older than 0.4.2 takes no cu_seqlens_cpu and reads cu_seqlens itself on a packed chunk:
that read is FLA's; tests/hybrid/test_gated_deltanet_properties.py counts them all, FLA's stand-in included).
Collectives are posted in the same order on every rank: the loop and the masks are decided by shapes and the layout
only, identical on all ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import ShardGradReducer, ShardStream
from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION, apply_autocast, dtype_inside
from ds_tsp.core.layers.linear_attention.causal_conv import causal_conv
from ds_tsp.core.layers.linear_attention.delta_rule import chunk_gated_delta_rule, l2_normalize
from ds_tsp.core.layers.linear_attention.delta_rule_fla import BACKENDS as DELTA_RULE_BACKENDS
from ds_tsp.core.layers.linear_attention.delta_rule_fla import (
    fla_chunk_transition,
    fla_kernel,
    select_delta_rule_backend,
)
from ds_tsp.core.layers.linear_attention.delta_rule_fla import warm_up as fla_warm_up
from ds_tsp.core.layers.linear_attention.scan import (
    ChunkPlan,
    TransitionGather,
    TransitionGradScatter,
    chunk_plans,
    conv_halo,
    start_states,
)
from ds_tsp.core.layers.shard_rebuild import save_with_shard, saved_with_shard
from ds_tsp.core.layers.weight_packing import PackedLayout

HF_FORMATS = ("qwen3_5", "qwen3_next")


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    hidden: int
    key_heads_per_block: int  # kb
    value_heads_per_block: int  # vb (a multiple of kb)
    key_head_dim: int  # dk
    value_head_dim: int  # dv
    conv_kernel: int  # K
    norm_eps: float
    hf_format: str = "qwen3_5"  # "qwen3_5": in_proj_qkv / _z / _b / _a; "qwen3_next": in_proj_qkvz / _ba per key head
    chunk_size: int = 64  # sub-chunk of the pure-torch kernel
    delta_rule_backend: str | None = None  # "fla" / "torch"; None: select_delta_rule_backend by device and dtype
    # True (TSPOptions.speed(), recompute_projections off): every head block's projections and chunk graph are kept
    # from forward for backward, O(B L) per block, instead of recomputed
    keep_activations: bool = False

    def __post_init__(self):
        if self.hf_format not in HF_FORMATS:
            raise ValueError(f"hf_format={self.hf_format!r}: must be one of {HF_FORMATS}")
        if self.delta_rule_backend not in (None, *DELTA_RULE_BACKENDS):
            raise ValueError(f"delta_rule_backend={self.delta_rule_backend!r}: must be None or one of "
                             f"{DELTA_RULE_BACKENDS}")

    @property
    def conv_channels(self) -> int:
        """q | k | v channels of one block, the conv's (and in_proj_qkv's) channel order."""
        return 2 * self.key_heads_per_block * self.key_head_dim + self.value_heads_per_block * self.value_head_dim

    @property
    def group_rows(self) -> int:
        """Qwen3-Next in_proj_qkvz rows per key head: q, k (dk each), its r value heads' v and z (r dv each)."""
        r = self.value_heads_per_block // self.key_heads_per_block
        return 2 * self.key_head_dim + 2 * r * self.value_head_dim

    @cached_property
    def layout(self) -> PackedLayout:
        h, kb, vb = self.hidden, self.key_heads_per_block, self.value_heads_per_block
        dv = self.value_head_dim
        if self.hf_format == "qwen3_5":
            pieces = [("qkv", (self.conv_channels, h)), ("z", (vb * dv, h)), ("b", (vb, h)), ("a", (vb, h))]
        else:  # rows in the checkpoint's per-key-head grouping, so each is ONE contiguous slice of the HF tensor
            pieces = [("qkvz", (kb * self.group_rows, h)), ("ba", (2 * vb, h))]
        return PackedLayout(tuple(pieces + [("conv", (self.conv_channels, 1, self.conv_kernel)), ("dt_bias", (vb,)),
                                            ("A_log", (vb,)), ("out", (h, vb * dv))]))


def _projections(w: dict, spec: GatedDeltaNetSpec):
    """(W_qkv [conv_channels, h] in conv channel order, W_z [vb dv, h], W_b [vb, h], W_a [vb, h]) of one block."""
    if spec.hf_format == "qwen3_5":
        return w["qkv"], w["z"], w["b"], w["a"]
    kb, h = spec.key_heads_per_block, spec.hidden
    r, dk, dv = spec.value_heads_per_block // kb, spec.key_head_dim, spec.value_head_dim
    q, k, v, z = w["qkvz"].view(kb, spec.group_rows, h).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = w["ba"].view(kb, 2 * r, h).split([r, r], dim=1)
    qkv = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
    return qkv, z.reshape(-1, h), b.reshape(-1, h), a.reshape(-1, h)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _causal_conv(pre: torch.Tensor, pre_halo: torch.Tensor | None, conv: torch.Tensor, tap_mask: torch.Tensor | None):
    """silu(depthwise causal conv) of both local chunks at once: [B, L, C]. pre: [B, L, C], pre_halo: [B, 2, K-1, C]
    (the K-1 tokens before each chunk) or None for a kernel-1 conv, tap_mask: [B, 2, c, K] (1 where tap s is in the
    token's document) or None."""
    B, L, C = pre.shape
    c, K = L // 2, conv.shape[-1]
    chunks, weight = pre.view(B, 2, c, C), conv.reshape(C, K)
    acc = chunks * weight[:, 0] if K == 1 else causal_conv(chunks, pre_halo, weight, tap_mask)
    return F.silu(acc).view(B, L, C)


def _both_chunks(plans: tuple[ChunkPlan, ...], B: int, c: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(reset [2B, c] with row b*2 + i the chunk i of batch row b, tap_mask [B, 2, c, K]) of both local chunks, each
    None where neither chunk has a document start (a chunk without one fills in zeros / ones)."""
    resets, masks = [p.reset for p in plans], [p.tap_mask for p in plans]
    reset = mask = None
    if any(r is not None for r in resets):
        like = next(r for r in resets if r is not None)
        reset = torch.stack([like.new_zeros(B, c) if r is None else r for r in resets], dim=1).view(2 * B, c)
    if any(m is not None for m in masks):
        like = next(m for m in masks if m is not None)
        mask = torch.stack([torch.ones_like(like) if m is None else m for m in masks], dim=1)
    return reset, mask


@dataclass
class _LocalBlock:
    """What one head block computes from the local tokens alone (before the state hand-off)."""

    o_local: torch.Tensor  # [B, 2, vb, c, dv] each local chunk's output from a zero state
    q_eff: torch.Tensor  # [B, 2, vb, c, dk] its read of the chunk's start state
    transitions: torch.Tensor  # [2, B, vb, dk, dk + dv]: (M | U) of both local chunks
    z: torch.Tensor  # [B, L, vb, dv] the output gate


def _project(x, halo, w: dict, spec: GatedDeltaNetSpec):
    """The block's projections: (pre [B, L, C] in conv channel order, pre_halo [B, 2, K-1, C] or None for a kernel-1
    conv, z [B, L, vb, dv], b [B, L, vb], a [B, L, vb])."""
    B, L, h = x.shape
    w_qkv, w_z, w_b, w_a = _projections(w, spec)
    pre_halo = F.linear(halo, w_qkv) if spec.conv_kernel > 1 else None
    z = F.linear(x, w_z).view(B, L, spec.value_heads_per_block, spec.value_head_dim)
    return F.linear(x, w_qkv), pre_halo, z, F.linear(x, w_b), F.linear(x, w_a)


def _block_chunks(pre, pre_halo, b, a, conv, A_log, dt_bias, spec: GatedDeltaNetSpec, plans: tuple[ChunkPlan, ...],
                  dtype: torch.dtype):
    """(o_local [B, 2, vb, c, dv], q_eff [B, 2, vb, c, dk], transitions [2, B, vb, dk, dk + dv]) of both local chunks
    from the block's projections: conv, and the chunked delta rule from a zero state (documents reset inside the
    kernel). The torch kernel runs both chunks of every row as ONE batch of 2B rows (half the ops of a call per
    chunk: at small local lengths the layer is bound by op count); FLA takes one call per chunk (its varlen plan
    is per chunk). dtype: the layer's (the compute dtype and the kernel follow from it)."""
    B, L, _ = pre.shape
    c, cd = L // 2, _compute_dtype(dtype)
    kb, vb, dk, dv = spec.key_heads_per_block, spec.value_heads_per_block, spec.key_head_dim, spec.value_head_dim
    reset, tap_mask = _both_chunks(plans, B, c)
    mixed = _causal_conv(pre, pre_halo, conv, tap_mask)
    q, k, v = mixed.split([kb * dk, kb * dk, vb * dv], dim=-1)
    q = l2_normalize(q.reshape(B, L, kb, dk).to(cd)) * dk ** -0.5
    k = l2_normalize(k.reshape(B, L, kb, dk).to(cd))
    if vb != kb:
        q, k = q.repeat_interleave(vb // kb, dim=2), k.repeat_interleave(vb // kb, dim=2)
    v = v.reshape(B, L, vb, dv).to(cd)
    beta = torch.sigmoid(b).to(cd)
    g = -A_log.to(cd).exp() * F.softplus(a.to(cd) + dt_bias.to(cd))

    backend = spec.delta_rule_backend or select_delta_rule_backend(pre.device, dtype)
    if backend == "fla":
        q, k, v, beta, g = (t.transpose(1, 2) for t in (q, k, v, beta, g))  # [B, vb, L, ...]
        outs = []
        for i, plan in enumerate(plans):
            local = slice(i * c, (i + 1) * c)
            args = (q[:, :, local], k[:, :, local], v[:, :, local], g[:, :, local], beta[:, :, local])
            outs.append(fla_chunk_transition(fla_kernel(), *args, plan.starts_in_chunk, dtype))
        o_local, q_eff, m, u = (torch.stack(parts, dim=1) for parts in zip(*outs))  # [B, 2, ...]
    else:
        rows = lambda t: t.reshape(2 * B, c, *t.shape[2:]).transpose(1, 2)  # noqa: E731 [B, L, ..] -> [2B, vb, c, ..]
        o_local, q_eff, m, u = chunk_gated_delta_rule(rows(q), rows(k), rows(v), rows(g), rows(beta),
                                                      spec.chunk_size, reset)
        o_local, q_eff, m, u = (t.reshape(B, 2, *t.shape[1:]) for t in (o_local, q_eff, m, u))
    transitions = torch.cat([m, u], dim=-1).transpose(0, 1).contiguous()  # [2, B, vb, dk, dk + dv]
    return o_local, q_eff, transitions


def _block_local(x, halo, w: dict, spec: GatedDeltaNetSpec, plans: tuple[ChunkPlan, ...]) -> _LocalBlock:
    """Projections, conv, and the chunked delta rule of both local chunks from a zero state."""
    pre, pre_halo, z, b, a = _project(x, halo, w, spec)
    return _LocalBlock(*_block_chunks(pre, pre_halo, b, a, w["conv"], w["A_log"], w["dt_bias"], spec, plans,
                                      x.dtype), z)


_SMALL = ("conv", "A_log", "dt_bias")  # the block's per-channel / per-head weights the chunk graph reads


@dataclass
class _KeptBlock:
    """Speed mode (spec.keep_activations): one head block's forward, kept for backward (no recompute, no
    re-gather): its chunk results with their graph back to the projections (cut off as leaves: the weights are
    not kept, the shard is broadcast again) and to copies of its small weights, the gathered transitions."""

    local: _LocalBlock
    leaves: tuple  # (pre, pre_halo or None, b, a): the projections, graph leaves
    small: tuple  # copies of the block's conv, A_log, dt_bias, graph leaves
    everyone: torch.Tensor


def _keep_block(x, halo, w: dict, spec: GatedDeltaNetSpec, plans: tuple[ChunkPlan, ...]) -> _KeptBlock:
    pre, pre_halo, z, b, a = _project(x, halo, w, spec)
    leaves = tuple(None if t is None else t.detach().requires_grad_() for t in (pre, pre_halo, b, a))
    # copies: the shard's buffer is reused for a later block once this one is done
    small = tuple(w[name].detach().clone().requires_grad_() for name in _SMALL)
    with torch.enable_grad():
        pre_, pre_halo_, b_, a_ = leaves
        chunks = _block_chunks(pre_, pre_halo_, b_, a_, *small, spec, plans, x.dtype)
    return _KeptBlock(_LocalBlock(*chunks, z), leaves, small, None)


def kept_tensors(x, halo, w: dict, spec: GatedDeltaNetSpec, plans: tuple[ChunkPlan, ...]) -> list:
    """The tensors one speed-mode block holds besides its graph's saved ones (its leaves and results): for the
    planner, which traces _keep_block under FakeTensorMode (ds_tsp.tools.plan.gdn_kept)."""
    kept = _keep_block(x, halo, w, spec, plans)
    local = kept.local
    return [t for t in (*kept.leaves, *kept.small, local.o_local, local.q_eff, local.transitions, local.z)
            if t is not None]


def _chunk_graph_grads(kept: _KeptBlock, d_outputs: list, d_local) -> tuple:
    """(d pre, d pre_halo or None, d b, d a, d z, [d conv, d A_log, d dt_bias]) of a kept block: ONE pass through its
    kept chunk graph to the projections (no forward recompute), both cotangents at once (the chunk results' and the
    transitions')."""
    d_o, d_q, d_z = d_outputs
    local = kept.local
    pairs = [(t, g) for t, g in ((local.o_local, d_o), (local.q_eff, d_q), (local.transitions, d_local))
             if g is not None]
    inputs = [t for t in (*kept.leaves, *kept.small) if t is not None]
    with torch.enable_grad():
        found = iter(torch.autograd.grad([t for t, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))
    grads = [None if t is None else next(found) for t in (*kept.leaves, *kept.small)]
    grads = [torch.zeros_like(t) if g is None and t is not None else g for t, g in zip((*kept.leaves, *kept.small),
                                                                                        grads)]
    d_pre, d_pre_halo, d_b, d_a, *d_small = grads
    return d_pre, d_pre_halo, d_b, d_a, (torch.zeros_like(local.z) if d_z is None else d_z), d_small


def _projection_grads(chunk_grads: tuple, x, halo, spec: GatedDeltaNetSpec, shard, need_w: bool,
                      dx: torch.Tensor):
    """(dhalo, the block's packed weight grad pieces but the out projection's, or None) from _chunk_graph_grads,
    the block's dx added into `dx` in place: the q/k/v/z/a/b projections' GEMMs' backward by hand. Reads no graph,
    only the grads, x, the halo and the shard: the layer's backward runs it while the next block's transitions
    travel."""
    d_pre, d_pre_halo, d_b, d_a, d_z, d_small = chunk_grads
    B, L, h = x.shape
    w_qkv, w_z, w_b, w_a = _projections(spec.layout.unpack(shard), spec)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    d_rows = [flat(d_pre), flat(d_z.reshape(B, L, -1)), flat(d_b), flat(d_a)]
    for d, weight in zip(d_rows, (w_qkv, w_z, w_b, w_a)):
        dx.view(-1, h).addmm_(d, weight)
    dhalo = None if d_pre_halo is None else (d_pre_halo @ w_qkv)
    if not need_w:
        return dhalo, None
    x2d = x.reshape(-1, h)
    d_weights = [d.t() @ x2d for d in d_rows]
    if d_pre_halo is not None:
        d_weights[0].addmm_(flat(d_pre_halo).t(), halo.reshape(-1, h))
    # the projections' rows and the small weights back to the packed layout's pieces: the backward of
    # _projections' views (Qwen3-Next's per-key-head regrouping), one grad per piece
    with torch.enable_grad():
        pieces = _piece_leaves(shard, spec, True)
        ws = (*_projections(pieces, spec), *(pieces[name] for name in _SMALL))
        names = [name for name in pieces if name != "out"]
        grads = torch.autograd.grad(ws, [pieces[name] for name in names], (*d_weights, *d_small),
                                    allow_unused=True)
    return dhalo, dict(zip(names, grads))


def _piece_leaves(shard: torch.Tensor, spec: GatedDeltaNetSpec, need_w: bool) -> dict:
    """The packed shard's pieces as separate autograd leaves, so each grad lands in a buffer of its piece's size
    (with the whole shard as the leaf, every piece's view backward fills a shard-sized zero buffer and autograd
    sums them all)."""
    return {name: t.detach().requires_grad_(need_w) for name, t in spec.layout.unpack(shard.detach()).items()}


def _packed_grad(grads: dict, spec: GatedDeltaNetSpec, like: torch.Tensor) -> torch.Tensor:
    """The block's packed weight grad from its pieces' (zeros for a piece autograd reports unused), in the
    layout's order: one copy."""
    pieces = [grads.get(name) for name, _ in spec.layout.pieces]
    return torch.cat([(like.new_zeros(shape) if g is None else g).reshape(-1)
                      for g, (_, shape) in zip(pieces, spec.layout.pieces)])


def _block_output(local: _LocalBlock, everyone, x, w: dict, norm_weight, spec: GatedDeltaNetSpec, comm: TSPComm):
    """The block's [B, L, h] contribution, given every rank's transitions [D, 2, B, vb, dk, dk + dv] (with a cp
    axis every cp group's: [C, D, 2, ...])."""
    B, L, h = x.shape
    s_in = start_states(everyone, comm.rank, spec.key_head_dim, None if comm.cp is None else comm.cp.rank)
    o = local.o_local + local.q_eff @ torch.stack(s_in, dim=1)  # [B, 2, vb, c, dv]
    o = o.transpose(2, 3).reshape(B, L, -1, spec.value_head_dim).to(x.dtype)  # [B, L, vb, dv]

    # Qwen3_5RMSNormGated: normalise in float32 (float64 stays), weight in the input dtype, times silu(z)
    nd = _compute_dtype(x.dtype)
    on = o.to(nd)
    on = on * torch.rsqrt(on.pow(2).mean(-1, keepdim=True) + spec.norm_eps)
    on = (norm_weight * on.to(x.dtype)) * F.silu(local.z.to(nd))
    return F.linear(on.to(x.dtype).reshape(B, L, -1), w["out"])


def _cut(local: _LocalBlock) -> _LocalBlock:
    """The block's local results as fresh autograd leaves: the output side's backward then runs apart from (and
    before) the chunk kernels', whose one pass takes both of its cotangents."""
    leaf = lambda t: t.detach().requires_grad_()  # noqa: E731
    return _LocalBlock(leaf(local.o_local), leaf(local.q_eff), local.transitions, leaf(local.z))


def _ends(local: _LocalBlock) -> list:
    """What the chunk kernels and projections hand the output side: o_local, q_eff (both chunks), then z."""
    return [local.o_local, local.q_eff, local.z]


class _TSPGatedDeltaNet(torch.autograd.Function):
    AUTOCAST = AUTOCAST_LOW_PRECISION  # projections in the autocast dtype; the delta rule itself runs in float32

    @staticmethod
    def forward(ctx, x, halo, packed_shard, norm_weight, spec: GatedDeltaNetSpec, comm: TSPComm, plans):
        y = torch.zeros_like(x)
        shards = ShardStream(comm, packed_shard)
        keep = spec.keep_activations and any(ctx.needs_input_grad[:4])
        kept = []

        def start(j):
            """Block j's chunks from the local tokens, and its transitions' gather posted."""
            w = spec.layout.unpack(shards.take(j))
            if keep:
                kept.append(_keep_block(x, halo, w, spec, plans))
                local = kept[-1].local
            else:
                local = _block_local(x, halo, w, spec, plans)
            return w, local, TransitionGather(local.transitions.detach(), comm)

        pending = None
        for j in range(comm.size):
            shards.next_block(j)
            w, local, gather = pending or start(j)
            gather.advance()
            # block j's transitions travel while block j+1's chunks run (its shard is already posted)
            pending = start(j + 1) if j + 1 < comm.size else None
            everyone = gather.wait()
            if keep:
                kept[j].everyone = everyone
            y.add_(_block_output(local, everyone, x, w, norm_weight, spec, comm))
            del w, local, gather, everyone
        ctx.spec, ctx.comm, ctx.plans = spec, comm, plans
        ctx.kept = kept if keep else None
        # a LoRA-merged shard is saved as its base and factors and rebuilt in backward (shard_rebuild)
        save_with_shard(ctx, packed_shard, x, halo, norm_weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        spec, comm, plans = ctx.spec, ctx.comm, ctx.plans
        packed_shard, (x, halo, norm_weight) = saved_with_shard(ctx)
        need_w = ctx.needs_input_grad[2]  # a frozen shard: no weight grads, nothing reduced to owners
        dy = dy.contiguous()
        dx, dhalo, dnorm = torch.zeros_like(x), torch.zeros_like(halo), torch.zeros_like(norm_weight)
        shards = ShardStream(comm, packed_shard)
        reducer = ShardGradReducer(comm)
        kept, ctx.kept = ctx.kept, None
        behind = None  # (j, chunk grads, shard, out-projection grad) of the block whose projection GEMMs are to run

        def projections_backward(j, chunk_grads, shard, d_out):
            d_halo, pieces = _projection_grads(chunk_grads, x, halo, spec, shard, need_w, dx)
            if d_halo is not None:  # None: the empty halo of a kernel-1 conv
                dhalo.add_(d_halo)
            if need_w:
                reducer.reduce(j, _packed_grad({**pieces, "out": d_out}, spec, shard))

        for j in range(comm.size):
            shard = shards.take(j)
            gather = None
            if kept is None:  # the block's forward again, kept the way speed mode keeps it; its transitions again
                with torch.no_grad():
                    block = _keep_block(x, halo, spec.layout.unpack(shard), spec, plans)
                gather = TransitionGather(block.local.transitions.detach(), comm)
            else:  # speed mode: the forward's chunk graph and gathered transitions
                block, kept[j] = kept[j], None
            if behind is not None and gather is not None:  # block j-1's projection GEMMs: block j's transitions
                projections_backward(*behind)  # travel behind them (with cp its cross-node stage; the TSP stage
                behind = None  # is posted after them). Speed mode gathers nothing: they cover its grad scatter
            if behind is None:
                shards.next_block(j)  # after block j-1's GEMMs, which read its shard
            if gather is not None:
                block.everyone = gather.wait()
            with torch.enable_grad():
                nw_ = norm_weight.detach().requires_grad_()  # x: only its shape and dtype are read here
                w = _piece_leaves(shard, spec, need_w)
                cut = _cut(block.local)
                everyone = block.everyone.detach().requires_grad_()
                y = _block_output(cut, everyone, x, w, nw_, spec, comm)
                # 1. the output side (norm, gate, the start states' GEMMs): grads of every rank's transitions,
                # of this rank's chunk results and of the norm weight; no chunk kernel, no projection
                first = torch.autograd.grad(y, (everyone, nw_, *_ends(cut)), dy, retain_graph=need_w,
                                            allow_unused=True)
                d_everyone = first[0] if first[0] is not None else torch.zeros_like(everyone)
                # 2. the sum over ranks of the grads of OUR transitions (posted on every rank) travels while the
                # out projection's weight grad is computed
                scatter = TransitionGradScatter(d_everyone, comm)
                d_out = torch.autograd.grad(y, w["out"], dy)[0] if need_w else None
                del y, cut, everyone
            if behind is not None:  # speed mode: block j-1's projection GEMMs (with cp the scatter's TSP stage
                projections_backward(*behind)  # travels behind them, its cross-node stage after)
                behind = None
                shards.next_block(j)
            d_local = scatter.wait()
            if first[1] is not None:
                dnorm.add_(first[1])
            # 3. ONE pass through the block's chunk graph to its projections; their GEMMs' backward (by hand) runs
            # in the next block, behind its transition gather (speed mode: its grad scatter), or after the loop for
            # the last block
            chunk_grads = _chunk_graph_grads(block, list(first[2:]), d_local)
            del block, first
            behind = (j, chunk_grads, shard, d_out)
            del chunk_grads, d_out
        projections_backward(*behind)
        grad_shard = reducer.finish() if need_w else None
        return dx, dhalo, grad_shard, dnorm, None, None, None


def tsp_gated_deltanet(x: torch.Tensor, packed_shard: torch.Tensor, norm_weight: torch.Tensor,
                       spec: GatedDeltaNetSpec, comm: TSPComm, doc_rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Gated DeltaNet over the local tokens x [B, L, h] (zigzag order), every head block streamed from its owner.

    doc_rows: per batch row the global token indices where documents start (beginning with 0; a DocumentLayout's
    rows; with a cp axis, comm.cp, the whole sequence's). norm_weight: the replicated gated-norm weight [dv]; its
    grad is this rank's contribution (sum it over the group, e.g. with comm.replicated_param)."""
    B, L, h = x.shape
    if L % 2:
        raise ValueError(f"tsp_gated_deltanet: the local length {L} must hold two zigzag chunks (even)")
    cp = () if comm.cp is None else (comm.cp.size, comm.cp.rank)  # the chunks are then global chunks of 2 C D
    kernel_dtype = dtype_inside(_TSPGatedDeltaNet, x.device.type, x.dtype)
    if (spec.delta_rule_backend or select_delta_rule_backend(x.device, kernel_dtype)) == "fla":
        # FLA's first-call compile before this layer posts anything (once per shape class and process)
        fla_warm_up(fla_kernel(), spec.value_heads_per_block, spec.key_head_dim, spec.value_head_dim, x.device,
                    kernel_dtype)
    plans = chunk_plans(tuple(map(tuple, doc_rows)), comm.rank, comm.size, L, spec.conv_kernel, x.dtype, x.device,
                        *cp)
    halo = conv_halo(x, comm, spec.conv_kernel - 1) if spec.conv_kernel > 1 else x.new_zeros(B, 2, 0, h)
    return apply_autocast(_TSPGatedDeltaNet, x.device.type, x, halo, packed_shard, norm_weight, spec, comm, plans)
