"""OLMo 2/3's q/k norms over a token's WHOLE q / k projection, under TSP (AttentionSpec.projection_norm).

transformers: q = q_norm(q_proj(x)), k = k_norm(k_proj(x)) with RMSNorms of width N_q = n_heads * d and
N_k = n_kv_heads * d, applied before the split into heads (Olmo3RMSNorm: w * (x * rstd) in float32 or wider,
rounded to x's dtype after). Under TSP a rank projects its own tokens one head block at a time, so
- a token's rstd needs the sums of squares of EVERY block's raw q (every kv group's raw k) before any block's
  normalised q / k exists;
- the norm's backward, dx_raw = rstd * (g - n * c / N) with n = raw * rstd, g = dn * w and c = sum(g * n) over the
  whole projection, needs c, a sum over every block, before any block's raw grad is known.
Two passes that stream only the [wq, wk] rows of each block (the first pieces of the packed shard) do it:

| pass                        | streams    | computes for the local tokens                                       |
|-----------------------------|------------|---------------------------------------------------------------------|
| forward, before the blocks  | [wq, wk]   | sums of squares of every block's raw q and every kv group's raw k -> |
|                             |            | rstd_q, rstd_k [B, L, 1, 1] (compute dtype; saved for backward)      |
| forward, per block          | full shard | raw q / k recomputed, normalised by the block's BlockNorm            |
| backward, per block         | full shard | attention backward; dn (the grad of the normalised q / k) kept per  |
|                             |            | block / kv group, c and the norm weights' grads accumulated; the    |
|                             |            | [wv, wo] grads reduced to the owners (the shard's suffix)           |
| backward, after the blocks  | [wq, wk]   | raw q / k recomputed, dx_raw, dx, the [wq, wk] grads reduced to the |
|                             |            | owners (the shard's prefix)                                         |
Kept through the backward loop: dn of every block, [B, L, (N_q + N_k)] in x's dtype over all blocks (local tokens
only). Extra traffic per layer: one [wq, wk] stream in forward and one in backward; the grad reduces move the same
bytes as without the norm, in two parts. The norm weights are replicated (their grads here are this rank's tokens'
contributions, summed over the group by the caller); block j (kv group g) uses the slice [j * n d, (j + 1) * n d).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import ShardGradReducer, ShardStream
from ds_tsp.core.layers.weight_packing import PackedLayout

QK_PIECES = ("wq", "wk")  # the packed layout's first pieces: one contiguous prefix of every shard


def qk_layout(layout: PackedLayout) -> PackedLayout:
    """The [wq, wk] prefix of a packed attention layout."""
    if tuple(name for name, _ in layout.pieces[:2]) != QK_PIECES:
        raise ValueError(f"a whole-projection q/k norm needs wq, wk first in the packed layout: {layout.pieces}")
    return PackedLayout(layout.pieces[:2])


def suffix_grad(layout: PackedLayout, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """A block's packed grad without its [wq, wk] prefix (which the last backward pass reduces)."""
    return torch.cat([grads[name].reshape(-1) for name, _ in layout.pieces[2:]])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class BlockNorm(NamedTuple):
    """One head block's (or kv group's) share of a whole-projection norm: weight slice [n, d], tokens' rstd
    [B, L, 1, 1]. Called on the block's raw projection [B, L, n, d]."""

    weight: torch.Tensor
    rstd: torch.Tensor

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        c = self.rstd.dtype
        return (self.weight.to(c) * (raw.to(c) * self.rstd)).to(raw.dtype)


class ProjectionNorms(NamedTuple):
    """The q and k norm weights (whole, replicated: [N_q], [N_k]) and the local tokens' rstd of each
    [B, L, 1, 1]; `heads` (q, k): the heads of one block / one kv group."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    rstd_q: torch.Tensor
    rstd_k: torch.Tensor
    heads: tuple[int, int]
    head_dim: int

    def block(self, kind: str, index: int) -> BlockNorm:
        """kind "q": head block `index`; "k": kv group `index`."""
        weight, rstd, heads = ((self.q_weight, self.rstd_q, self.heads[0]) if kind == "q"
                               else (self.k_weight, self.rstd_k, self.heads[1]))
        width = heads * self.head_dim
        return BlockNorm(weight[index * width:(index + 1) * width].view(heads, self.head_dim), rstd)


def projection_norms(x: torch.Tensor, packed_shard: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     spec, comm: TSPComm) -> ProjectionNorms:
    """Forward's first pass: every block's [wq, wk] rows streamed from its owner, the local tokens' sums of squares
    of their raw q (every block) and raw k (once per kv group) -> rstd (compute dtype). Collective over the group."""
    B, L, _ = x.shape
    c = _compute_dtype(x.dtype)
    layout = qk_layout(spec.layout)
    stream = ShardStream(comm, packed_shard[:layout.numel])
    squares = {"q": x.new_zeros(B, L, 1, dtype=c), "k": x.new_zeros(B, L, 1, dtype=c)}
    for j in range(comm.size):
        stream.next_block(j)
        w = layout.unpack(stream.take(j))
        squares["q"] += F.linear(x, w["wq"]).to(c).pow(2).sum(-1, keepdim=True)
        if j % spec.kv_replicas == 0:  # a kv group's blocks share one kv head: counted once
            squares["k"] += F.linear(x, w["wk"]).to(c).pow(2).sum(-1, keepdim=True)
    rstd_q, rstd_k = (torch.rsqrt(squares[kind] / weight.numel() + spec.qk_norm_eps)[..., None]
                      for kind, weight in (("q", q_weight), ("k", k_weight)))
    return ProjectionNorms(q_weight, k_weight, rstd_q, rstd_k, (spec.heads_per_block, spec.kv_heads_per_block),
                           spec.head_dim)


class ProjectionNormGrads:
    """Backward of the whole-projection norms, collected block by block (the attention loop), finished per block
    once every block has been seen (raw_grad, in the last pass)."""

    def __init__(self, norms: ProjectionNorms):
        self.norms = norms
        c = norms.rstd_q.dtype
        self.dn: dict[tuple[str, int], torch.Tensor] = {}
        self.c = {"q": torch.zeros_like(norms.rstd_q[..., 0]), "k": torch.zeros_like(norms.rstd_k[..., 0])}
        self.dweight = {"q": torch.zeros(norms.q_weight.shape, dtype=c, device=norms.q_weight.device),
                        "k": torch.zeros(norms.k_weight.shape, dtype=c, device=norms.k_weight.device)}

    def add(self, kind: str, index: int, dn: torch.Tensor, raw: torch.Tensor) -> None:
        """dn: grad of block `index`'s normalised projection [B, L, n, d]; raw: that block's raw projection."""
        norm = self.norms.block(kind, index)
        c = norm.rstd.dtype
        n = raw.to(c) * norm.rstd
        dnc = dn.to(c)
        width = n.shape[-2] * n.shape[-1]
        self.dweight[kind][index * width:(index + 1) * width] += (dnc * n).reshape(-1, width).sum(0)
        self.c[kind] += (dnc * norm.weight.to(c) * n).sum((-2, -1))[..., None]
        self.dn[(kind, index)] = dn

    def raw_grad(self, kind: str, index: int, raw: torch.Tensor) -> torch.Tensor:
        """Grad of block `index`'s raw projection [B, L, n, d] (x's dtype): rstd * (g - n * mean over the whole
        projection of g * n), g = dn * w."""
        norm = self.norms.block(kind, index)
        c = norm.rstd.dtype
        n = raw.to(c) * norm.rstd
        g = self.dn.pop((kind, index)).to(c) * norm.weight.to(c)
        total = (self.norms.q_weight if kind == "q" else self.norms.k_weight).numel()
        return (norm.rstd * (g - n * (self.c[kind][..., None] / total))).to(raw.dtype)

    def weight_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_norm, k_norm) weight grads of this rank's tokens, in the weights' dtype."""
        return (self.dweight["q"].to(self.norms.q_weight.dtype), self.dweight["k"].to(self.norms.k_weight.dtype))


def qk_rows_backward(x: torch.Tensor, packed_shard: torch.Tensor, grads: ProjectionNormGrads, dx: torch.Tensor,
                     spec, comm: TSPComm, need_w: bool) -> torch.Tensor | None:
    """Backward's last pass: every block's [wq, wk] rows streamed again; the raw q / k grads (every block's dn is
    in `grads` now) go into dx (in place) and, when need_w, into the [wq, wk] grads reduced to each owner.
    Returns this rank's own [wq, wk] grad (the summed prefix of its packed grad), None without need_w.
    A kv group's k grad travels in its first block's (the leader's) reduce; the other blocks send zeros there, as
    the kv replicas' copies are never read (tsp_attention's _kv_grads_to_group_leaders)."""
    B, L, h = x.shape
    layout = qk_layout(spec.layout)
    stream = ShardStream(comm, packed_shard[:layout.numel])
    reducer = ShardGradReducer(comm)
    x2d, dx2d = x.reshape(-1, h), dx.view(-1, h)
    for j in range(comm.size):
        stream.next_block(j)
        w = layout.unpack(stream.take(j))
        raw_q = F.linear(x, w["wq"]).view(B, L, spec.heads_per_block, spec.head_dim)
        dq = grads.raw_grad("q", j, raw_q).reshape(-1, w["wq"].shape[0])
        dx2d.addmm_(dq, w["wq"])
        dk = None
        if j % spec.kv_replicas == 0:
            raw_k = F.linear(x, w["wk"]).view(B, L, spec.kv_heads_per_block, spec.head_dim)
            dk = grads.raw_grad("k", j // spec.kv_replicas, raw_k).reshape(-1, w["wk"].shape[0])
            dx2d.addmm_(dk, w["wk"])
        if need_w:
            wk = dk.t() @ x2d if dk is not None else torch.zeros_like(w["wk"])
            reducer.reduce(j, torch.cat(((dq.t() @ x2d).reshape(-1), wk.reshape(-1))))
    return reducer.finish() if need_w else None
