"""What a recurrent layer (Gated DeltaNet) needs across the zigzag split: the conv halo and the state hand-off.

Rank p of D holds the zigzag chunks p and 2D-1-p (c tokens each) of the 2D chunks of a sequence. A causal conv of
kernel K needs, before each chunk, the K-1 tokens that precede it in the SEQUENCE, which live on other ranks (and
in several chunks when c < K-1); the recurrent state entering chunk g is a function of every chunk before it.

| step                     | what moves (per rank)                                   | collective (autograd dual)    |
|--------------------------|---------------------------------------------------------|-------------------------------|
| conv halo (once a layer) | the last min(c, K-1) hidden states of both chunks       | all-gather (reduce-scatter)   |
| transitions (per block)  | (M, U) of both chunks: [2, B, H_block, dk, dk + dv]     | all-gather (reduce-scatter)   |
Every rank then composes the 2D transitions in sequence order itself (2D small GEMMs): no ring, no second round.

Packed documents (`ChunkPlan`): a document start resets the state (`reset`: the chunk kernel cuts it exactly, see
ds_tsp.core.gated_delta_rule) and the conv (taps never read a token of an earlier document: `tap_mask`).
Everything here is shapes and host ints from the DocumentLayout; the masks are built by fills on the input's
device (no host-to-device copy, no sync).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ds_tsp.core.comm import TSPComm
from ds_tsp.core.partition import zigzag_chunks


class _GatherAll(torch.autograd.Function):
    """forward: all-gather [D, *local] (rank order); backward: reduce-scatter (sum) of the grad to each rank."""

    @staticmethod
    def forward(ctx, local, comm: TSPComm, what: str):
        ctx.comm, ctx.what = comm, what
        out = local.new_empty((comm.size, *local.shape))
        comm.all_gather(out, local.contiguous(), what=what).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        ctx.comm.reduce_scatter(out, grad.contiguous(), what=f"grad of {ctx.what}").wait()
        return out, None, None


def gather_all(local: torch.Tensor, comm: TSPComm, what: str) -> torch.Tensor:
    """forward: all-gather over the TSP group into [D, *local.shape]; backward: reduce-scatter (sum)."""
    return _GatherAll.apply(local, comm, what)


def global_chunk_slot(chunk: int, tsp: int) -> tuple[int, int]:
    """(rank, local slot 0/1) holding global zigzag chunk `chunk` of 2*tsp."""
    return (chunk, 0) if chunk < tsp else (2 * tsp - 1 - chunk, 1)


def conv_halo(x: torch.Tensor, comm: TSPComm, halo: int) -> torch.Tensor:
    """[B, 2, halo, h]: for each local chunk, the `halo` hidden states that precede it in the sequence (zeros before
    the sequence start; the tap mask keeps them out). x: [B, L, h] in local zigzag order. Differentiable: the grad
    of a halo token returns to the rank that holds it."""
    B, L, h = x.shape
    c, D = L // 2, comm.size
    tail = min(c, halo)  # tokens each chunk contributes; with c < halo a chunk's halo spans several chunks
    local = torch.stack([x[:, c - tail:c], x[:, L - tail:L]])  # [2, B, tail, h]
    everyone = gather_all(local, comm, what=f"conv halo ({tail} tokens per chunk)")  # [D, 2, B, tail, h]
    tails = [everyone[r, s] for r, s in (global_chunk_slot(g, D) for g in range(2 * D))]
    reach = -(-halo // tail)  # chunks a halo spans
    out = []
    for g in zigzag_chunks(D, comm.rank):
        before = tails[max(0, g - reach):g]
        missing = halo - tail * len(before)
        if missing > 0:
            before = [x.new_zeros(B, missing, h)] + before
        out.append(torch.cat(before, dim=1)[:, -halo:] if before else x.new_zeros(B, halo, h))
    return torch.stack(out, dim=1)


@dataclass(frozen=True)
class ChunkPlan:
    start: int  # global position of the chunk's first token
    reset: torch.Tensor | None  # [B, c] 1 where a document starts (the state entering it is dropped); None: none
    tap_mask: torch.Tensor | None  # [B, c, K] 1 where tap s (reading token t - s) is in t's document; None: all 1
    starts_in_chunk: tuple[tuple[int, ...], ...] = ()  # per row, the chunk offsets where documents start (host)


@functools.lru_cache(maxsize=8)
def chunk_plans(doc_rows: tuple[tuple[int, ...], ...], rank: int, tsp: int, local_len: int, kernel: int,
                dtype: torch.dtype, device: torch.device) -> tuple[ChunkPlan, ChunkPlan]:
    """The two local chunks' plans from the per-row document starts (global positions, each row starting at 0).

    Built once per step (memoised on the layout: every linear-attention layer and head block of the step, and
    backward, reuse it), by fills on `device`: no host-to-device copy. Constants (no grad), safe to share."""
    c, B = local_len // 2, len(doc_rows)
    plans = []
    with torch.inference_mode(False):  # a cached inference tensor would be unusable once autograd records
        for g in zigzag_chunks(tsp, rank):
            lo, hi = g * c, (g + 1) * c
            reset = mask = None
            offsets = []
            for b, starts in enumerate(doc_rows):
                inside = [s for s in starts if lo <= s < hi]
                offsets.append(tuple(s - lo for s in inside))
                for s in inside:
                    if reset is None:
                        reset = torch.zeros(B, c, dtype=dtype, device=device)
                    reset[b, s - lo] = 1
                # tap s of token t reads t - s: valid iff t - s >= the start of t's document (t's position in it)
                governing = [s for s in starts if s <= lo]
                for d in ([governing[-1]] if governing else []) + [s for s in inside if s > lo]:
                    for t in range(max(d, lo), min(d + kernel - 1, hi)):
                        if mask is None:
                            mask = torch.ones(B, c, kernel, dtype=dtype, device=device)
                        mask[b, t - lo, t - d + 1:] = 0
            plans.append(ChunkPlan(lo, reset, mask, tuple(offsets)))
    return plans[0], plans[1]


def gather_transitions(local_transitions: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """Every rank's [2, B, H, dk, dk + dv] chunk transitions (M | U), rank order: [D, 2, B, H, dk, dk + dv].
    Not differentiable by itself: the layer's backward posts the dual (`scatter_transition_grads`) on every rank
    unconditionally, also where its own chunks do not depend on the state (a rank whose chunks all start
    documents), so every rank posts the same collectives."""
    everyone = local_transitions.new_empty((comm.size, *local_transitions.shape))
    comm.all_gather(everyone, local_transitions.detach().contiguous(), what="gated delta rule chunk transitions").wait()
    return everyone


def scatter_transition_grads(grad_everyone: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """Backward of gather_transitions: the sum over ranks of the grads of this rank's transitions."""
    out = grad_everyone.new_empty(grad_everyone.shape[1:])
    comm.reduce_scatter(out, grad_everyone.contiguous(), what="grad of gated delta rule chunk transitions").wait()
    return out


def start_states(everyone: torch.Tensor, rank: int, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering each of `rank`'s two chunks from every rank's transitions [D, 2, B, H, dk, dk + dv]
    (gather_transitions), composed in global chunk order from a zero state: (S_in of local chunk 0, of local
    chunk 1), each [B, H, dk, dv]. Differentiable in `everyone`."""
    D = everyone.shape[0]
    ordered = [everyone[r, s] for r, s in (global_chunk_slot(g, D) for g in range(2 * D))]
    first, second = zigzag_chunks(D, rank)
    state = torch.zeros_like(ordered[0][..., dk:])
    found = {}
    for g in range(second + 1):
        if g in (first, second):
            found[g] = state
        if g < second:
            m, u = ordered[g][..., :dk], ordered[g][..., dk:]
            state = m @ state + u
    return found[first], found[second]
