"""TSP attention: head blocks are streamed by broadcast, tokens never leave their rank except K/V.

Shapes (rank p of D, local tokens L = S_pad/D = two zigzag chunks of c = L/2):
| tensor            | shape                         | sharding                                   |
|-------------------|-------------------------------|--------------------------------------------|
| x                 | [B, L, h]                     | tokens of rank p (zigzag chunks p, 2D-1-p) |
| packed shard j    | [layout.numel]                | Wq_j [nq*d, h], Wk_j, Wv_j [nkv*d, h], Wo_j [h, nq*d], biases |
| q_j               | [B, L, nq, d]                 | local tokens, head block j                 |
| k_j, v_j          | [B, L, nkv, d]                | local tokens, head block j                 |
| K_j, V_j gathered | [B, S_pad, nkv, d]            | all tokens (global order), head block j; transient |
| y                 | [B, L, h]                     | local tokens, summed over head blocks      |
nq = n_heads/D and nkv = n_kv_heads/D are the heads of ONE block. With fewer kv heads than ranks (MQA, or GQA at
large D) each block holds the one kv head its query heads read (nkv = 1) and D/n_kv_heads consecutive blocks (a
kv group) share it. Its K/V is gathered ONCE per group and kept while the group's blocks run (then dropped), and
backward sums the group's dK/dV before ONE reduce-scatter: K/V traffic is n_kv_heads heads, not D blocks. Only
the group's first rank (its leader) holds the live kv weights: forward and backward read wk/wv from the leader's
shard, and the group's kv weight grad goes to the leader alone (the other copies get zero grads and are never
read). So every kv head is one parameter to the optimizer and to gradient norms: DeepSpeed's clipping norm (which
sums every TSP-sharded element over the TSP ranks) counts it once, not once per replica.

Packed documents and sliding windows (Mistral, Qwen2/3 sliding layers) restrict which keys a query sees:
`doc_starts` (global token indices where documents start, per batch row) and `spec.window` go to
ds_tsp.core.layers.attention.masked, which splits each zigzag chunk into pieces of plain causal attention (no [S, S]
mask). Qwen3's per-head q_norm / k_norm (replicated weights [d], grads summed over the TSP group by the caller) are
applied to the local projections before RoPE, and undone by their written-out backward. OLMo's q/k norms over the
WHOLE projection (spec.projection_norm; weights [n_heads * d] / [n_kv_heads * d], each block using its slice) need
every block's sums of squares first and, in backward, every block's grad before any raw grad: two more streams of
the blocks' [wq, wk] rows, one before the forward loop and one after the backward loop, whose [wq, wk] grads are
reduced to the owners apart from the rest of the shard (ds_tsp.core.layers.attention.projection_norm). Gemma 4's
weightless v norm (spec.value_norm_eps) is applied to v likewise, its backward from the raw v recomputed with the
group's dK/dV; with spec.values_from_keys (Gemma 4's attention_k_eq_v) there is no wv: v is the raw k projection,
and dV joins dK.
Gated attention (Qwen3.5 / Qwen3-Next, spec.output_gate): wq holds [q, gate] rows per head ([nq*2d, h], transformers'
q_proj rows of this block, so the gate's columns travel with q in the owner's broadcast); the block's attention
output is multiplied by sigmoid(gate) before wo. The gate is recomputed with q in backward (or saved with it when
recompute_projections is False). Partial rotary: cos/sin [.., r] with r < d rotate the first r dims of every head.
Attention sinks (GPT-OSS, spec.sinks): the block's query heads' sink logits [nq] are a piece of its packed shard
(they travel, and their grads return to the owner, with the block's weights); ds_tsp.core.layers.attention.sinks
applies them to the block's merged (out, lse) after whichever path computed it (plain, masked, varlen, cp ring or
cp window), and "out" saved for backward is the sinked output.

Saved per block: the attention output and its log-sum-exp (local, O(S/D)); plus x once. Backward re-broadcasts
each block's shard, recomputes the cheap local projections q, k, v from x (three small GEMMs instead of keeping
[B, L, (nq + 2 nkv) d] per block), re-gathers K/V, runs the kernel backward with the saved output and
log-sum-exp (no attention recomputation), reduce-scatters dK/dV to the token owners and reduces the packed weight
grad to the block owner. No foreign shard and no gathered K/V is kept, unless `keep_gathered_kv` trades O(S)
memory per kv group for skipping the backward re-gather. With `recompute_projections` off every block's q (and
gate) and every kv group's local K/V are saved instead, with the raw k / v projections a k or v norm's backward
reads (spec.saved_per_kv_group): backward then runs no projection GEMM twice. A frozen shard (requires_grad
False, alike on every rank) still re-broadcasts for dx but computes no weight grad and reduces nothing to the
owners.

Overlap schedule. NCCL runs each communicator as ONE in-order stream, so what is posted on a channel waits behind
everything posted there before it. Weights travel on `comm.weight_channel` (a second communicator over the same
ranks when the comm has one: ds_tsp.core.parallel.runtime gives every CUDA run one), sequence data on the TSP group. K/V
arrive as two all-gathers per kv group (one per zigzag half, straight into global order: ds_tsp.core.comm.kv_gather).
g(j) is block j's kv group; "next group" is g(j)+1, whose first block is j+1 when j is the last block of its group.
| when (block j)                        | posted                                    | channel | awaited            |
|---------------------------------------|-------------------------------------------|---------|--------------------|
| before block 0                        | broadcast shards 0, 1                     | weights | take(j), block j   |
| before block 0                        | K/V gather of group 0 (2 all-gathers)     | tsp     | block 0, after q   |
| start of block j                      | broadcast shard j+2                       | weights | block j+2 (start)  |
| j last of its group, before attention | K/V gather of the next group (needs shard | tsp     | block j+1, after   |
|                                       | j+1, taken early)                         |         | its q projection   |
| backward: same three rows (re-broadcast, re-gather unless keep_gathered_kv)  | | | |
| backward: j last of its group, after  | dK/dV reduce-scatter of group g(j)        | tsp     | block j+1 after    |
| its attention backward, before its dq |                                           |         | ITS attention      |
| tail (dx, wq grad)                    |                                           |         | backward (after    |
|                                       |                                           |         | the loop for the   |
|                                       |                                           |         | last)              |
| backward: once block j's grads        | reduce of block j's packed grad to owner  | weights | 2 reduces later,   |
| are whole                             | j (last block of a group: when the        |         | or at the end      |
|                                       | scatter is consumed)                      |         |                    |
So block j's attention (forward or backward) runs while the next group's K/V gather, the next shards' broadcasts
and the previous group's dK/dV scatter are in flight: on separate streams the broadcasts never hold up the K/V
the kernel waits for. Live buffers: 3 packed shards (j, j+1, j+2 in flight), 2 gathered K/V (this group's, the
next one's in flight), and in backward one rank-ordered dK/dV being filled plus one being scattered.
tests/core/test_attention_schedule.py checks the recorded post order against this table.

With a context-parallel axis (comm.cp, tsp.cp_size > 1) the kernel calls on a block's gathered K/V become
ds_tsp.core.layers.attention.cp_ring's: the same own-group attention plus the other cp groups' K/V around the cp ring
(its hops on comm.cp, posted one block ahead inside the call; backward also returns their dK/dV into this group's
rank-ordered buffer before its reduce-scatter). The table above is unchanged; doc_starts is then the whole sequence's
layout. With spec.cp_comm "all_to_all" a kv group's K/V source is instead cp_all_to_all.A2AKVGather (its local K/V
all-to-all over cp posted where the gather is, the TSP all-gather of this rank's cp heads when the group starts), the
kernel calls are cp_all_to_all's (q / out all-to-alls around the whole sequence's attention of its cp heads) and the
group's dK/dV go back through A2AKVGrad (reduce-scatter over TSP, then the inverse all-to-all over cp). Those
exchanges are pipelined a block deep (cp_all_to_all's "Pipelining"): block j+1's q is projected, and in backward
its dout computed, and sent before block j's attention; block j's sinks / gate / wo (forward) or dq tail
(backward: dx, wq grads, its reduce to the owner) run after block j+1's attention, when its output or dq is back;
a kv group's finish (its dK/dV into dx and the kv weight grads) one block later than the table's row says. So
block j-1's packed shard (its wo, or wq) stays live through block j: 4 shards instead of 3.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.kv_gather import GlobalKVGather, RankOrderedKVGrad, kv_prefix, local_from_chunks, local_kv
from ds_tsp.core.comm.primitives import ShardGradReducer, ShardStream
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION, apply_autocast, dtype_inside
from ds_tsp.core.layers.attention.cp_all_to_all import (
    A2AKVGather,
    A2AKVGrad,
    HeadSplit,
    a2a_attention_backward,
    a2a_attention_forward,
    post_grad_inputs,
    post_queries,
)
from ds_tsp.core.layers.attention.cp_ring import cp_attention_backward, cp_attention_forward
from ds_tsp.core.layers.attention.masked import masked_attention_backward_pieces, masked_attention_forward
from ds_tsp.core.layers.attention.projection_norm import (
    BlockNorm,
    ProjectionNormGrads,
    ProjectionNorms,
    projection_norms,
    qk_rows_backward,
    suffix_grad,
)
from ds_tsp.core.layers.attention.sinks import sinks_backward, sinks_forward
from ds_tsp.core.layers.norm import rms_norm, rms_norm_backward
from ds_tsp.core.layers.shard_rebuild import save_with_shard, saved_with_shard
from ds_tsp.core.layers.weight_packing import PackedLayout
from ds_tsp.core.tokens.documents import document_layout, single_documents
from ds_tsp.core.tokens.rope import apply_rope, apply_rope_backward
from ds_tsp.core.tokens.zigzag import zigzag_chunks


@dataclass(frozen=True)
class AttentionSpec:
    hidden: int
    heads_per_block: int  # query heads owned by one rank
    kv_heads_per_block: int
    head_dim: int
    qkv_bias: bool
    kv_replicas: int = 1  # > 1 when num_kv_heads < D: that many consecutive ranks hold the same kv head
    keep_gathered_kv: bool = False  # save every block's gathered K/V (O(S) memory) to skip the backward re-gather
    recompute_projections: bool = True  # False: save local q per block (and k/v per kv group), not recompute

    def saved_per_block(self) -> tuple[str, ...]:
        """Names of the tensors forward saves for each head block, in order."""
        if self.recompute_projections:
            return ("out", "lse0", "lse1")
        return ("out", "lse0", "lse1", "q") + (("gate",) if self.output_gate else ())

    def saved_per_kv_group(self) -> tuple[str, ...]:
        """Names saved once per kv group (the kv_replicas consecutive blocks that read the same kv heads). With the
        projections kept, also the raw k / v projections a norm's backward reads (saved, not projected again)."""
        kept = ("kv_all",) if self.keep_gathered_kv else (() if self.recompute_projections else ("kv_local",))
        return kept if self.recompute_projections else kept + self.raw_kv_read_in_backward()

    def raw_kv_read_in_backward(self) -> tuple[str, ...]:
        """The raw (pre-norm, unroped) projections the kv backward reads: k under a k norm (per head or over the
        whole projection) or as Gemma 4's normed values' source, v under the weightless v norm."""
        if self.kv_role == "import":  # no kv projection here: its dK/dV go back to the layer that made them
            return ()
        raw_k = self.qk_norm_eps is not None or (self.value_norm_eps is not None and self.values_from_keys)
        raw_v = self.value_norm_eps is not None and not self.values_from_keys
        return ("raw_k",) * raw_k + ("raw_v",) * raw_v

    kernel_backend: str | None = None  # None: kernels.select_backend picks per device/dtype
    window: int | None = None  # sliding window (HF semantics: key s visible to query t iff t - window < s <= t)
    qk_norm_eps: float | None = None  # Qwen3: RMSNorm (this eps) of every q and k head before RoPE; None: off
    norm_zero_centred: bool = False  # Qwen3.5: the q/k norms scale by (1 + w) (ds_tsp.core.layers.norm)
    output_gate: bool = False  # Qwen3.5 / Qwen3-Next: wq emits [q, gate] per head; out * sigmoid(gate) before wo
    softmax_scale: float | None = None  # Gemma 3: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    value_norm_eps: float | None = None  # Gemma 4: every v head RMS-normalised (no weight) with this eps; None: off
    values_from_keys: bool = False  # Gemma 4 k_eq_v: no wv, v is the raw (pre-norm, unroped) k projection
    # Gemma 4 KV sharing: "export" also returns every kv group's local K/V (a later layer attends over them, its
    # dK/dV coming back as their grad); "import" has no wk / wv and attends over such K/V given as an input
    kv_role: str = "own"
    # OLMo 2/3: q_norm / k_norm (eps qk_norm_eps) over a token's whole q / k projection, not per head
    # (ds_tsp.core.layers.attention.projection_norm)
    projection_norm: bool = False
    sinks: bool = False  # GPT-OSS: a learned logit per query head in the softmax's denominator (attention.sinks)
    cp_comm: str = "ring"  # with a cp axis: K/V around the cp ring, or "all_to_all" (heads scattered over cp)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale

    @cached_property
    def layout(self) -> PackedLayout:
        q, kv, h = self.heads_per_block * self.head_dim, self.kv_heads_per_block * self.head_dim, self.hidden
        q_rows = 2 * q if self.output_gate else q  # gated: [q, gate] per head
        pieces = [("wq", (q_rows, h)), ("wk", (kv, h)), ("wv", (kv, h)), ("wo", (h, q))]
        if self.qkv_bias:
            pieces += [("bq", (q_rows,)), ("bk", (kv,)), ("bv", (kv,))]
        if self.values_from_keys:
            pieces = [p for p in pieces if p[0] not in ("wv", "bv")]
        if self.kv_role == "import":
            pieces = [p for p in pieces if p[0] not in ("wk", "wv", "bk", "bv")]
        if self.sinks:  # the block's query heads' sinks travel with their weights
            pieces.append(("sinks", (self.heads_per_block,)))
        return PackedLayout(tuple(pieces))


def _chunks(rank: int, tsp: int, local_len: int):
    """(local slice, global start position) of the two zigzag chunks held by `rank`."""
    c = local_len // 2
    return [(slice(i * c, (i + 1) * c), g * c) for i, g in enumerate(zigzag_chunks(tsp, rank))]


def _raw_q_and_gate(x, w, spec: AttentionSpec):
    """(q before norm and RoPE [B, L, nq, d], the output gate [B, L, nq, d] or None when the spec has none)."""
    B, L, _ = x.shape
    if not spec.output_gate:
        return F.linear(x, w["wq"], w.get("bq")).view(B, L, spec.heads_per_block, spec.head_dim), None
    both = F.linear(x, w["wq"], w.get("bq")).view(B, L, spec.heads_per_block, 2 * spec.head_dim)
    return both[..., :spec.head_dim], both[..., spec.head_dim:]


def _raw_q(x, w, spec: AttentionSpec):
    return _raw_q_and_gate(x, w, spec)[0]


def _raw_k(x, w, spec: AttentionSpec):
    B, L, _ = x.shape
    return F.linear(x, w["wk"], w.get("bk")).view(B, L, spec.kv_heads_per_block, spec.head_dim)


def _norm(t, weight, spec: AttentionSpec):
    """t normed per head (a weight [d]), by its block's share of a whole-projection norm (a BlockNorm), or t."""
    if isinstance(weight, BlockNorm):
        return weight(t)
    return t if weight is None else rms_norm(t, weight, spec.qk_norm_eps, spec.norm_zero_centred)


def _block_norms(norms: ProjectionNorms | None, q_norm, k_norm):
    """(q norm of head block j, k norm of kv group g): the per-head weights, or the blocks' BlockNorms."""
    if norms is None:
        return (lambda j: q_norm), (lambda g: k_norm)
    return (lambda j: norms.block("q", j)), (lambda g: norms.block("k", g))


def _finish_q(raw, cos, sin, q_norm, q_scale, spec: AttentionSpec):
    """q normed, roped and scaled per position (q_scale [B, L, 1, 1] or None) from its raw projection."""
    q = apply_rope(_norm(raw, q_norm, spec), cos, sin)
    return q if q_scale is None else q * q_scale


def _project_q(x, w, spec: AttentionSpec, cos, sin, q_norm=None, q_scale=None, keep_raw: bool = False):
    """(q normed, roped and scaled per position [B, L, nq, d], the output gate or None, the raw projection when
    keep_raw and a q norm reads it in backward, else None)."""
    raw, gate = _raw_q_and_gate(x, w, spec)
    return _finish_q(raw, cos, sin, q_norm, q_scale, spec), gate, (raw if keep_raw and q_norm is not None else None)


def _gate_forward(out, gate):
    """The attention output wo multiplies: out, or out * sigmoid(gate) (gated attention)."""
    return out if gate is None else out * torch.sigmoid(gate)


def _gate_backward(d_gated, out, gate):
    """(d out, d gate or None) from the grad of out * sigmoid(gate)."""
    if gate is None:
        return d_gated, None
    sig = torch.sigmoid(gate)
    return d_gated * sig, d_gated * out * sig * (1 - sig)


def _raw_v(x, w, spec: AttentionSpec):
    if spec.values_from_keys:
        return _raw_k(x, w, spec)
    B, L, _ = x.shape
    return F.linear(x, w["wv"], w.get("bv")).view(B, L, spec.kv_heads_per_block, spec.head_dim)


def _project_kv_and_raw(x, w, spec: AttentionSpec, cos, sin, k_norm=None):
    """This rank's K (normed, roped) and V (normed without a weight under value_norm_eps) of one kv head block,
    chunk-major for the gather: [2, c, B, 2, nkv, d]; and the raw (k, v) projections that a k norm / the v norm
    read in backward (None where no norm reads them; with values_from_keys the v norm reads the raw k, returned as
    k's)."""
    raw_k = _raw_k(x, w, spec)
    k = apply_rope(_norm(raw_k, k_norm, spec), cos, sin)
    v = raw_k if spec.values_from_keys else _raw_v(x, w, spec)
    v_normed = spec.value_norm_eps is not None
    if v_normed:
        v_raw, v = v, rms_norm(v, None, spec.value_norm_eps)
    k_read = k_norm is not None or (v_normed and spec.values_from_keys)
    return local_kv(k, v), (raw_k if k_read else None, v_raw if v_normed and not spec.values_from_keys else None)


def _unproject(d_roped, cos, sin, norm_weight, raw, spec: AttentionSpec):
    """Grad w.r.t. the raw projection (and the norm weight's grad, or None) from the grad of the roped one."""
    d = apply_rope_backward(d_roped, cos, sin)
    if norm_weight is None:
        return d, None
    return rms_norm_backward(d, raw(), norm_weight, spec.qk_norm_eps, spec.norm_zero_centred)


def _kv_group(j: int, spec: AttentionSpec) -> tuple[bool, bool]:
    """(first, last) block of its kv group: blocks j // kv_replicas share one kv head, gathered once for all."""
    r = spec.kv_replicas
    return j % r == 0, j % r == r - 1


def _all_to_all(comm: TSPComm, spec: AttentionSpec) -> bool:
    """A cp axis with the all-to-all schedule (ds_tsp.core.layers.attention.cp_all_to_all)."""
    return comm.cp is not None and spec.cp_comm == "all_to_all"


def _head_split(spec: AttentionSpec, comm: TSPComm) -> HeadSplit:
    return HeadSplit(spec.heads_per_block, spec.kv_heads_per_block, comm.cp.size)


def _kv_gather(comm: TSPComm, kv_local: torch.Tensor, spec: AttentionSpec):
    """A kv group's K/V source (wait() gives the buffer): over the TSP group in global order, or under the cp
    all-to-all the whole sequence's K/V of this rank's cp heads."""
    if _all_to_all(comm, spec):
        return A2AKVGather(comm, kv_local, _head_split(spec, comm))
    # without a cp axis this rank's queries read the keys up to its second chunk only: no later chunk travels here
    return GlobalKVGather(comm, kv_local, causal=comm.cp is None)


def _kv_weights(w: dict) -> dict:
    """A copy of the kv projection weights of a block: kept past the block (for its deferred dK/dV), not the shard."""
    return {n: w[n].clone() for n in ("wk", "wv", "bk", "bv") if n in w}


class _TSPAttention(torch.autograd.Function):
    AUTOCAST = AUTOCAST_LOW_PRECISION  # projections and attention kernels: autocast's lower-precision list

    @staticmethod
    def forward(ctx, x, packed_shard, q_norm, k_norm, cos, sin, q_scale, kv_in, spec: AttentionSpec, comm: TSPComm,
                doc_starts):
        B, L, h = x.shape
        D, p = comm.size, comm.rank
        # validated here unless the model's input check did it already (once per step, not per chunk and block)
        doc_starts = single_documents(B) if doc_starts is None else document_layout(doc_starts, B)
        y = torch.zeros_like(x)
        saved_blocks, saved_groups = [], []
        # whole-projection norms: every block's q/k sums of squares first (a stream of the [wq, wk] rows)
        norms = projection_norms(x, packed_shard, q_norm, k_norm, spec, comm) if spec.projection_norm else None
        q_norm_of, k_norm_of = _block_norms(norms, q_norm, k_norm)
        shards = ShardStream(comm, packed_shard)

        group_names = spec.saved_per_kv_group()  # what forward saves per kv group

        def group_kv(g, take):
            """This rank's K/V of kv group g: given (KV sharing) or projected with its block's shard; and the raw
            (k, v) projections backward reads, where they are saved (else None: not held past the projection)."""
            if spec.kv_role == "import":
                return kv_in[g], (None, None)
            kv_local, (raw_k, raw_v) = _project_kv_and_raw(x, spec.layout.unpack(take()), spec, cos, sin,
                                                            k_norm_of(g))
            return kv_local, (raw_k if "raw_k" in group_names else None, raw_v if "raw_v" in group_names else None)

        a2a = _all_to_all(comm, spec)
        keep_raw_q = not spec.recompute_projections  # speed mode saves the raw q (finish); memory mode nothing

        def post_q(j: int, w):
            """(q, gate, q's cp all-to-all posted) of block j: under the all-to-all schedule a block ahead."""
            q, gate, raw = _project_q(x, w, spec, cos, sin, q_norm_of(j), q_scale, keep_raw=keep_raw_q)
            return q, gate, raw, post_queries(q, comm)

        def finish(w, out, lses, q, gate, raw_q):
            """The block's sinks, gate and wo into y; what backward reads of it saved (the speed mode's q: the raw
            projection when a q norm reads that in backward, normed and roped again there without a GEMM)."""
            if spec.sinks:  # on the merged (out, lse) of every path (attention.sinks)
                out = sinks_forward(out, torch.cat(lses, dim=2), w["sinks"])
            y.add_(F.linear(_gate_forward(out, gate).reshape(B, L, -1), w["wo"]))
            block = {"out": out, "lse0": lses[0], "lse1": lses[1], "q": q if raw_q is None else raw_q, "gate": gate}
            saved_blocks.extend(block[name] for name in spec.saved_per_block())

        kv_local, raw_kv = group_kv(0, lambda: shards.take(0))
        gather = _kv_gather(comm, kv_local, spec)
        ahead = post_q(0, spec.layout.unpack(shards.take(0))) if a2a else None
        behind = None  # all-to-all: the previous block's output on its way back, and what its wo reads
        kv_all, exported = None, []
        for j in range(D):
            shards.next_block(j)
            w = spec.layout.unpack(shards.take(j))
            first, last = _kv_group(j, spec)
            if last and j + 1 < D:  # the next kv group's K/V travel while this block's attention runs
                next_local, next_raw = group_kv(j // spec.kv_replicas + 1, lambda: shards.take(j + 1))
                next_gather = _kv_gather(comm, next_local, spec)
            if a2a:  # block j+1's q travels to the cp ranks while this block's attention runs
                q, gate, raw_q, sent_q = ahead
                ahead = post_q(j + 1, spec.layout.unpack(shards.take(j + 1))) if j + 1 < D else None
            else:
                q, gate, raw_q = _project_q(x, w, spec, cos, sin, q_norm_of(j), q_scale, keep_raw=keep_raw_q)
            if first:
                kv_all = gather.wait()
                if spec.kv_role == "export":
                    exported.append(kv_local)
                group = {"kv_all": kv_all, "kv_local": kv_local, "raw_k": raw_kv[0], "raw_v": raw_kv[1]}
                saved_groups += [group[name] for name in group_names]
            if a2a:  # this rank's cp heads over the whole sequence (cp_all_to_all); the output goes back behind
                sent_out = a2a_attention_forward(sent_q, kv_all, comm, _head_split(spec, comm), doc_starts=doc_starts,
                                                 window=spec.window, scale=spec.scale, backend=spec.kernel_backend)
                if behind is not None:  # the previous block's output came back while this attention ran
                    w_prev, sent_prev, q_prev, gate_prev, raw_prev = behind
                    finish(w_prev, *sent_prev.wait(), q_prev, gate_prev, raw_prev)
                behind = w, sent_out, (None if spec.recompute_projections else q), gate, raw_q
            else:
                if comm.cp is not None:  # the sequence's other cp groups' K/V come around the cp ring
                    out, lses = cp_attention_forward(q, kv_all, comm, doc_starts=doc_starts, window=spec.window,
                                                     scale=spec.scale, backend=spec.kernel_backend)
                else:
                    outs, lses = [], []
                    for local, start in _chunks(p, D, L):
                        end = start + local.stop - local.start
                        k_all, v_all = kv_prefix(kv_all, end)
                        o, lse = masked_attention_forward(q[:, local], k_all, v_all, q_start=start,
                                                          doc_starts=doc_starts, window=spec.window,
                                                          scale=spec.scale, backend=spec.kernel_backend)
                        outs.append(o)
                        lses.append(lse)
                    out = torch.cat(outs, dim=1)
                finish(w, out, lses, q, gate, raw_q)
            if last:  # memory-optimal: this group's gathered K/V is dropped; at most the next one is in flight
                kv_all = kv_local = gather = raw_kv = None
                if j + 1 < D:
                    kv_local, gather, raw_kv = next_local, next_gather, next_raw
        if behind is not None:  # the last block's output
            w_prev, sent_prev, q_prev, gate_prev, raw_prev = behind
            finish(w_prev, *sent_prev.wait(), q_prev, gate_prev, raw_prev)
        ctx.spec, ctx.comm, ctx.doc_starts = spec, comm, doc_starts
        ctx.has_qk_norm, ctx.has_q_scale = q_norm is not None, q_scale is not None
        ctx.n_block_saved = len(saved_blocks)
        weights = (q_norm, k_norm) if ctx.has_qk_norm else ()
        rstds = (norms.rstd_q, norms.rstd_k) if norms is not None else ()
        scale = (q_scale,) if ctx.has_q_scale else ()
        given = (kv_in,) if spec.kv_role == "import" else ()
        # a LoRA-merged shard is saved as its base and factors and rebuilt in backward (shard_rebuild)
        save_with_shard(ctx, packed_shard, x, cos, sin, *scale, *given, *weights, *rstds, *saved_blocks,
                        *saved_groups)
        return (y, torch.stack(exported)) if spec.kv_role == "export" else y

    @staticmethod
    def backward(ctx, dy, dkv_out=None):
        spec, comm, doc_starts = ctx.spec, ctx.comm, ctx.doc_starts
        packed_shard, (x, cos, sin, *saved) = saved_with_shard(ctx)
        q_scale = saved.pop(0) if ctx.has_q_scale else None
        kv_in = saved.pop(0) if spec.kv_role == "import" else None
        dkv_in = torch.zeros_like(kv_in) if kv_in is not None else None
        q_norm, k_norm = (saved.pop(0), saved.pop(0)) if ctx.has_qk_norm else (None, None)
        norms = None
        if spec.projection_norm:
            norms = ProjectionNorms(q_norm, k_norm, saved.pop(0), saved.pop(0),
                                    (spec.heads_per_block, spec.kv_heads_per_block), spec.head_dim)
        # whole-projection norms: raw q/k grads wait for every block's dn (projection_norm's last pass)
        deferred = ProjectionNormGrads(norms) if norms is not None else None
        q_norm_of, k_norm_of = _block_norms(norms, q_norm, k_norm)
        saved_blocks, saved_groups = saved[:ctx.n_block_saved], saved[ctx.n_block_saved:]
        norm_grads = {"q": None, "k": None}  # this rank's q_norm / k_norm weight grads, summed over blocks
        dy = dy.contiguous()
        B, L, h = x.shape
        D, p = comm.size, comm.rank
        # A frozen shard (requires_grad False on every rank alike): no weight-grad GEMMs and no reduce to owners
        need_w = ctx.needs_input_grad[1]
        dx = torch.zeros_like(x)
        x2d, dy2d = x.reshape(-1, h), dy.reshape(-1, h)
        reducer = ShardGradReducer(comm)
        names, group_names = spec.saved_per_block(), spec.saved_per_kv_group()
        shards = ShardStream(comm, packed_shard)

        def add_norm_grad(key, grad):
            if grad is not None:
                norm_grads[key] = grad if norm_grads[key] is None else norm_grads[key] + grad

        def start_group(g: int, w):
            """(The kv group's gathered K/V: kept from forward, or re-gathered (posted now, waited on first use);
            the raw (k, v) projections its norms' backward reads when they were projected again here, else
            (None, None))."""
            group = dict(zip(group_names, saved_groups[len(group_names) * g:len(group_names) * (g + 1)]))
            raws = (group.get("raw_k"), group.get("raw_v"))  # saved with the kept projections, else None
            if spec.keep_gathered_kv:
                return group["kv_all"], raws
            kv_local = kv_in[g] if kv_in is not None else group.get("kv_local")
            if kv_local is None:
                kv_local, raws = _project_kv_and_raw(x, w, spec, cos, sin, k_norm_of(g))
            return _kv_gather(comm, kv_local, spec), raws

        def finish_group(pending):
            """A kv group's reduce-scattered dK/dV -> dx, its kv weight grads (into its last block's grad, which
            _kv_grads_to_group_leaders moves to the leader) and that block's reduce to its owner."""
            dkv_local, scatter, w_kv, grads, j, (raw_k, raw_v) = pending
            scatter.wait()
            if kv_in is not None:  # KV sharing: dK/dV go back to the layer that made them
                dkv_in[j // spec.kv_replicas] = dkv_local
                if need_w:
                    reducer.reduce(j, block_grad(grads))
                return
            if dkv_out is not None:  # the later layers' dK/dV of the K/V this layer exported
                dkv_local = dkv_local + dkv_out[j // spec.kv_replicas]
            dv = local_from_chunks(dkv_local, 1)
            # the raw projections the norms read: from start_group, or projected again, once (K/V saved)
            raws = {"k": raw_k, "v": raw_k if spec.values_from_keys else raw_v}

            def raw(name):
                name = "k" if spec.values_from_keys else name
                if raws[name] is None:
                    raws[name] = (_raw_k if name == "k" else _raw_v)(x, w_kv, spec)
                return raws[name]

            if spec.value_norm_eps is not None:  # through the weightless v norm
                dv = rms_norm_backward(dv, raw("v"), None, spec.value_norm_eps)[0]
            if deferred is not None:  # dk waits for every kv group's (projection_norm)
                dk_normed = apply_rope_backward(local_from_chunks(dkv_local, 0), cos, sin)
                deferred.add("k", j // spec.kv_replicas, dk_normed, raw("k"))
            else:
                dk, dkn = _unproject(local_from_chunks(dkv_local, 0), cos, sin, k_norm, lambda: raw("k"), spec)
                if spec.values_from_keys:  # v is k's raw projection: its grad joins k's
                    dk, dv = dk + dv, None
                dk = dk.reshape(-1, w_kv["wk"].shape[0])
                dx.view(-1, h).addmm_(dk, w_kv["wk"])
                add_norm_grad("k", dkn)
                if need_w:
                    grads["wk"] = dk.t() @ x2d
                    if spec.qkv_bias:
                        grads["bk"] = dk.sum(0)
            if dv is not None:
                dv = dv.reshape(-1, w_kv["wv"].shape[0])
                dx.view(-1, h).addmm_(dv, w_kv["wv"])
                if need_w:
                    grads["wv"] = dv.t() @ x2d
                    if spec.qkv_bias:
                        grads["bv"] = dv.sum(0)
            if need_w:
                reducer.reduce(j, block_grad(grads))

        def block_grad(grads):
            """Block j's packed grad for its owner (whole-projection norms: all but the [wq, wk] prefix)."""
            return suffix_grad(spec.layout, grads) if deferred is not None else spec.layout.pack(grads)

        def prepare(j: int, w):
            """Block j's (q, out, lses, dout, dgate, grads, raw q or None): dout through wo, the gate and the sinks,
            the wo / sinks grads, and the raw q projection a q norm's backward reads (dq_tail)."""
            block = dict(zip(names, saved_blocks[len(names) * j:len(names) * (j + 1)]))
            out, lses = block["out"], (block["lse0"], block["lse1"])
            if "q" not in block:  # the raw q lives to the block's dq tail, which reads it instead of projecting again
                q, gate, raw_q = _project_q(x, w, spec, cos, sin, q_norm_of(j), q_scale, keep_raw=True)
            elif q_norm_of(j) is not None:  # the raw projection was saved (finish in forward)
                raw_q, gate = block["q"], block.get("gate")
                q = _finish_q(raw_q, cos, sin, q_norm_of(j), q_scale, spec)
            else:
                q, gate, raw_q = block["q"], block.get("gate"), None
            dout, dgate = _gate_backward((dy2d @ w["wo"]).view_as(out), out, gate)
            if spec.sinks:  # out is the sinked output: the kernels take dout * g with it (attention.sinks)
                dout, dsinks = sinks_backward(dout, out, torch.cat(lses, dim=2), w["sinks"])
            gated = _gate_forward(out, gate)
            grads = {"wo": dy2d.t() @ gated.reshape(-1, out.shape[2] * out.shape[3])} if need_w else {}
            if need_w and spec.sinks:
                grads["sinks"] = dsinks
            return q, out, lses, dout, dgate, grads, raw_q

        def post_prepared(j: int, w):
            """All-to-all schedule: block j prepared and its q / out / dout / lse posted to the cp ranks."""
            q, out, lses, dout, dgate, grads, raw_q = prepare(j, w)
            return post_grad_inputs(dout, q, out, lses, comm, _head_split(spec, comm)), dgate, grads, raw_q

        def dq_tail(j: int, w, dq_chunks, dgate, grads, raw_q, last: bool):
            """Block j's dq -> dx and its wq grads; a block that is not its kv group's last is reduced to its owner
            (the last one is when its group's dK/dV are: finish_group)."""
            dq = torch.cat(dq_chunks, dim=1)
            if q_scale is not None:
                dq = dq * q_scale
            if deferred is not None:  # dq waits for every block's (projection_norm)
                deferred.add("q", j, apply_rope_backward(dq, cos, sin), _raw_q(x, w, spec) if raw_q is None else raw_q)
            else:
                dq, dqn = _unproject(dq, cos, sin, q_norm, lambda: _raw_q(x, w, spec) if raw_q is None else raw_q,
                                     spec)
                if dgate is not None:  # back to q_proj's [q, gate] rows per head
                    dq = torch.cat((dq, dgate), dim=-1)
                dq = dq.reshape(-1, w["wq"].shape[0])
                dx.view(-1, h).addmm_(dq, w["wq"])
                add_norm_grad("q", dqn)
                if need_w:
                    grads["wq"] = dq.t() @ x2d
                    if spec.qkv_bias:
                        grads["bq"] = dq.sum(0)
            if not last and need_w:  # the group's kv weight grad lands in its last block (see finish_group)
                for name in ("wk", "wv", "bk", "bv"):
                    if name in w:
                        grads[name] = torch.zeros_like(w[name])
                reducer.reduce(j, block_grad(grads))

        a2a = _all_to_all(comm, spec)
        kv_source = start_group(0, spec.layout.unpack(shards.take(0)))
        ahead = post_prepared(0, spec.layout.unpack(shards.take(0))) if a2a else None
        behind = None  # all-to-all: the previous block's dq on its way back, and what its tail reads
        sent_kv = None  # all-to-all: a kv group whose dK/dV cp all-to-all is in flight (finish_group's tuple)
        kv_all = dkv = w_kv = pending = None
        for j in range(D):
            shards.next_block(j)
            w = spec.layout.unpack(shards.take(j))
            first, last = _kv_group(j, spec)
            if first:  # the group's live kv weights (the other blocks' copies are stale: see the module docstring)
                w_kv = _kv_weights(w)
            if last and j + 1 < D:  # the next group's K/V travel while this block's attention backward runs
                next_source = start_group(j // spec.kv_replicas + 1, spec.layout.unpack(shards.take(j + 1)))
            if a2a:  # block j+1's q / out / dout travel to the cp ranks while this block's attention backward runs
                sent, dgate, grads, raw_q = ahead
                ahead = post_prepared(j + 1, spec.layout.unpack(shards.take(j + 1))) if j + 1 < D else None
            else:
                q, out, lses, dout, dgate, grads, raw_q = prepare(j, w)
            if first:
                kv_all, group_raws = kv_source
                kv_all = kv_all if spec.keep_gathered_kv else kv_all.wait()
                kv_source = None
                # summed over the group's blocks, scattered once (all-to-all: the whole sequence's of its cp heads)
                dkv = (A2AKVGrad(kv_all, comm, _head_split(spec, comm), spec.kv_heads_per_block)
                       if a2a else RankOrderedKVGrad(kv_all, D, chunk=L // 2, causal=comm.cp is None))
            if a2a:  # dq goes back behind the next block's attention backward
                sent_dq = a2a_attention_backward(sent, kv_all, dkv, comm, doc_starts=doc_starts, window=spec.window,
                                                 scale=spec.scale, backend=spec.kernel_backend)
                del sent
                if behind is not None:  # the previous block's dq came back while this attention backward ran
                    j_prev, w_prev, sent_prev, dgate_prev, grads_prev, raw_prev, last_prev = behind
                    dq_tail(j_prev, w_prev, sent_prev.wait(), dgate_prev, grads_prev, raw_prev, last_prev)
                if pending is not None:  # the previous group's dK/dV: its TSP reduce-scatter ran behind this
                    pending[1].post()  # attention backward, its cp all-to-all goes behind the next one
                    if sent_kv is not None:
                        finish_group(sent_kv)
                    sent_kv, pending = pending, None
                behind = j, w, sent_dq, dgate, grads, raw_q, last
            else:
                if comm.cp is not None:  # and the other cp groups' dK/dV of this group's K/V come back around it
                    dq_chunks = cp_attention_backward(dout, q, kv_all, out, lses, dkv, comm, doc_starts=doc_starts,
                                                      window=spec.window, scale=spec.scale,
                                                      backend=spec.kernel_backend)
                else:
                    dq_chunks = []
                    for (local, start), lse in zip(_chunks(p, D, L), lses):
                        end = start + local.stop - local.start
                        k_all, v_all = kv_prefix(kv_all, end)
                        # each kernel's dK/dV go straight into the rank-ordered buffer (no [B, end] concatenation)
                        dq_chunks.append(masked_attention_backward_pieces(
                            dout[:, local], q[:, local], k_all, v_all, out[:, local], lse, q_start=start,
                            doc_starts=doc_starts, window=spec.window, scale=spec.scale, backend=spec.kernel_backend,
                            take_kv=dkv.take))
                if pending is not None:  # the previous group's dK/dV scatter ran behind this attention backward
                    finish_group(pending)
                    pending = None
                if last:  # the group's dK/dV are whole: their reduce-scatter travels behind this block's dq tail
                    scattered = dkv.scatter(comm)
                dq_tail(j, w, dq_chunks, dgate, grads, raw_q, last)
            if last:
                kv_all = None
                dkv_local, scatter = dkv.scatter(comm) if a2a else scattered
                pending, dkv = (dkv_local, scatter, w_kv, grads, j, group_raws), None
                group_raws = None
                if j + 1 < D:
                    kv_source = next_source
        if behind is not None:  # the last block's dq
            j_prev, w_prev, sent_prev, dgate_prev, grads_prev, raw_prev, last_prev = behind
            dq_tail(j_prev, w_prev, sent_prev.wait(), dgate_prev, grads_prev, raw_prev, last_prev)
        if sent_kv is not None:  # the last group's dK/dV set off before the one ahead of it is finished
            pending[1].post()
            finish_group(sent_kv)
        finish_group(pending)
        grad_shard = reducer.finish() if need_w else None
        if deferred is not None:
            qk_grad = qk_rows_backward(x, packed_shard, deferred, dx, spec, comm, need_w)
            grad_shard = torch.cat((qk_grad, grad_shard)) if need_w else None
            norm_grads["q"], norm_grads["k"] = deferred.weight_grads()
        if need_w and spec.kv_replicas > 1:
            _kv_grads_to_group_leaders(grad_shard, spec, comm)
        return dx, grad_shard, norm_grads["q"], norm_grads["k"], None, None, None, dkv_in, None, None, None


def _kv_grads_to_group_leaders(grad_shard: torch.Tensor, spec: AttentionSpec, comm: TSPComm) -> None:
    """In place: a kv group's leader gets the sum of the kv weight grads of all the group's blocks, the other
    replicas zeros (their copies are never read)."""
    views = spec.layout.unpack(grad_shard)
    names = [n for n in ("wk", "wv", "bk", "bv") if n in views]
    if not names:  # KV sharing: this layer has no kv weights
        return
    local = torch.cat([views[n].reshape(-1) for n in names])
    everyone = torch.empty(comm.size, local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(everyone, local).wait()
    mine = everyone.view(comm.size // spec.kv_replicas, spec.kv_replicas, -1)[comm.rank // spec.kv_replicas].sum(0)
    if comm.rank % spec.kv_replicas:
        mine.zero_()
    offset = 0
    for n in names:
        numel = views[n].numel()
        views[n].copy_(mine[offset:offset + numel].view_as(views[n]))
        offset += numel


def attention_compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tsp_attention computes and sends K/V in for an input of `dtype`: the autocast dtype when autocast is
    on for `device_type`, else `dtype` (what the cp schedule's cost counts)."""
    return dtype_inside(_TSPAttention, device_type, dtype)


def tsp_attention(x: torch.Tensor, packed_shard: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  spec: AttentionSpec, comm: TSPComm, *, qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
                  doc_starts: tuple[tuple[int, ...], ...] | None = None,
                  q_scale: torch.Tensor | None = None, kv_in: torch.Tensor | None = None):
    """Causal self-attention of the local tokens against all tokens, every head block streamed from its owner.
    spec.kv_role "export": returns (output, this rank's K/V of every kv group [groups, 2, c, B, 2, nkv, d]);
    "import": attends over kv_in, such an export of an earlier layer (Gemma 4's KV sharing), k_norm None.

    qk_norm: Qwen3's (q_norm, k_norm) weights [d], or with spec.projection_norm OLMo's [n_heads * d] and
    [n_kv_heads * d]; their grads are this rank's contribution (sum them over the group, e.g. with
    comm.replicated_param). doc_starts: per batch row, the global token indices where packed
    documents start, or the DocumentLayout the model's input check built from them (None: one document per row).
    q_scale: [B, L, 1, 1] each local query's scale after RoPE (Ministral 3's position-scaled queries), or None.
    """
    q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
    if (q_norm is None) != (spec.qk_norm_eps is None):
        raise ValueError("spec.qk_norm_eps and the qk_norm weights must be given together")
    if spec.projection_norm and (q_norm is None or spec.output_gate or spec.qkv_bias):
        raise ValueError("projection_norm needs the q/k norm weights (and qk_norm_eps), without output_gate or "
                         "q/k/v bias: its grads are split at the [wq, wk] prefix of the packed shard")
    if (kv_in is not None) != (spec.kv_role == "import"):
        raise ValueError("kv_in is given exactly when spec.kv_role is 'import'")
    if spec.cp_comm not in ("ring", "all_to_all"):
        raise TSPConfigError(f"AttentionSpec(cp_comm={spec.cp_comm!r}): tsp_attention takes 'ring' or 'all_to_all' "
                             "(resolve 'auto' per sequence length with cp_cost.choose_cp_comm first)")
    return apply_autocast(_TSPAttention, x.device.type, x, packed_shard, q_norm, k_norm, cos, sin, q_scale, kv_in,
                          spec, comm, doc_starts)
