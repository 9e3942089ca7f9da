"""What a recurrent layer (Gated DeltaNet) needs across the zigzag split: the conv halo and the state hand-off.

Rank p of D holds the zigzag chunks p and 2D-1-p (c tokens each) of the 2D chunks of a sequence. A causal conv of
kernel K needs, before each chunk, the K-1 tokens that precede it in the SEQUENCE, which live on other ranks (and
in several chunks when c < K-1); the recurrent state entering chunk g is a function of every chunk before it.

| step                     | what moves (per rank)                                   | collective (autograd dual)    |
|--------------------------|---------------------------------------------------------|-------------------------------|
| conv halo (once a layer) | the last min(c, K-1) hidden states of both chunks       | all-gather (reduce-scatter)   |
| transitions (per block)  | (M, U) of both chunks: [2, B, H_block, dk, dk + dv]     | all-gather (reduce-scatter)   |
Every rank then composes the 2D transitions in sequence order itself (2D small GEMMs): no ring, no second round.

With a cp axis (C TSP groups share the sequence, `comm.cp`; layout in ds_tsp.core.tokens.zigzag) the sequence is 2CD
chunks and rank (i, p) holds global chunks `cp_global_chunks(D, p, C, i)`. Both gathers then take two stages:
this rank's own piece is all-gathered over the cp group first ([C, 2, ...]: each piece crosses nodes once, not
once per TSP rank), then that over the TSP group ([D, C, 2, ...], used as its [C, D, 2, ...] view:
`cp_chunk_slot` says where each global chunk lies in it), so a halo or a state from a chunk of another cp group
arrives; the autograd dual reduce-scatters over TSP, then over cp (posted on every rank, same order). Every rank
composes all 2CD transitions itself. cp bytes per rank: (C-1) 2 B min(c, K-1) h for the halo (once a layer) and
(C-1) 2 B H_block dk (dk + dv) for the transitions (per block); the TSP stage moves (D-1) C x those, intra-node:
O(1) in S. Without a cp axis nothing changes.

Packed documents (`ChunkPlan`): a document start resets the state (`reset`: the chunk kernel cuts it exactly, see
ds_tsp.core.layers.linear_attention.delta_rule) and the conv (taps never read a token of an earlier document:
`tap_mask`). The sequence's own start (global token 0) is no cut: the state there is zero and the taps before it
read the zero halo. Everything here is shapes and host ints from the DocumentLayout; the masks are built by fills on
the input's device (no host-to-device copy, no sync).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.tokens.zigzag import cp_global_chunks, zigzag_chunks


class _GatherAll(torch.autograd.Function):
    """forward: all-gather [D, *local] (rank order); backward: reduce-scatter (sum) of the grad to each rank."""

    @staticmethod
    def forward(ctx, local, comm: TSPComm, what: str, over_cp: bool):
        ctx.comm, ctx.what, ctx.over_cp = comm, what, over_cp
        axis = comm.cp_axis() if over_cp else comm
        out = local.new_empty((axis.size, *local.shape))
        axis.all_gather(out, local.contiguous(), what=what).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        axis = ctx.comm.cp_axis() if ctx.over_cp else ctx.comm
        out = grad.new_empty(grad.shape[1:])
        axis.reduce_scatter(out, grad.contiguous(), what=f"grad of {ctx.what}").wait()
        return out, None, None, None


def gather_all(local: torch.Tensor, comm: TSPComm, what: str) -> torch.Tensor:
    """forward: all-gather over the TSP group into [D, *local.shape]; backward: reduce-scatter (sum).
    With a cp axis (comm.cp) every cp group's: [C, D, *local.shape], gathered over cp FIRST (this rank's own
    `local`: each piece crosses nodes once) and then over the TSP group ([D, C, ...], returned as its [C, D, ...]
    view); backward: reduce-scatter over TSP, then over cp."""
    if comm.cp is None:
        return _GatherAll.apply(local, comm, what, False)
    ring = _GatherAll.apply(local, comm, f"{what} over cp", True)
    return _GatherAll.apply(ring, comm, what, False).transpose(0, 1)


def global_chunk_slot(chunk: int, tsp: int) -> tuple[int, int]:
    """(rank, local slot 0/1) holding global zigzag chunk `chunk` of 2*tsp."""
    return (chunk, 0) if chunk < tsp else (2 * tsp - 1 - chunk, 1)


def cp_chunk_slot(chunk: int, tsp: int, cp: int) -> tuple[int, int, int]:
    """(cp rank, TSP rank, local slot 0/1) holding global chunk `chunk` of 2*cp*tsp (ds_tsp.core.tokens.zigzag's two
    zigzags: cp chunk chunk // tsp goes to a cp group, whose TSP zigzag places the piece chunk % tsp)."""
    cp_rank, half = global_chunk_slot(chunk // tsp, cp)
    rank, slot = global_chunk_slot(half * tsp + chunk % tsp, tsp)
    return cp_rank, rank, slot


def _chunk_owners(tsp: int, rank: int, cp: int | None = None, cp_rank: int | None = None
                  ) -> tuple[list, tuple[int, int]]:
    """(index into the gathered [D, 2, ...] (cp None) or [C, D, 2, ...] of each global chunk in sequence order, this
    rank's two global chunks)."""
    if cp is None:
        return [global_chunk_slot(g, tsp) for g in range(2 * tsp)], zigzag_chunks(tsp, rank)
    return [cp_chunk_slot(g, tsp, cp) for g in range(2 * cp * tsp)], cp_global_chunks(tsp, rank, cp, cp_rank)


def conv_halo(x: torch.Tensor, comm: TSPComm, halo: int) -> torch.Tensor:
    """[B, 2, halo, h]: for each local chunk, the `halo` hidden states that precede it in the sequence (zeros before
    the sequence start; the tap mask keeps them out). x: [B, L, h] in local zigzag order. Differentiable: the grad
    of a halo token returns to the rank that holds it (also across cp groups, comm.cp)."""
    B, L, h = x.shape
    c = L // 2
    tail = min(c, halo)  # tokens each chunk contributes; with c < halo a chunk's halo spans several chunks
    local = torch.stack([x[:, c - tail:c], x[:, L - tail:L]])  # [2, B, tail, h]
    everyone = gather_all(local, comm, what=f"conv halo ({tail} tokens per chunk)")  # [(C,) D, 2, B, tail, h]
    owners, mine = _chunk_owners(comm.size, comm.rank, *(() if comm.cp is None else (comm.cp.size, comm.cp.rank)))
    tails = [everyone[where] for where in owners]
    reach = -(-halo // tail)  # chunks a halo spans
    out = []
    for g in mine:
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
                dtype: torch.dtype, device: torch.device, cp: int = 1, cp_rank: int = 0
                ) -> tuple[ChunkPlan, ChunkPlan]:
    """The two local chunks' plans from the per-row document starts (global positions of the whole sequence, each
    row starting at 0); cp, cp_rank: the cp axis (the chunks are then global chunks of 2*cp*tsp).

    Built once per step (memoised on the layout: every linear-attention layer and head block of the step, and
    backward, reuse it), by fills of slices on `device`: no host-to-device copy (an element assignment `t[i] = v`
    would be one, blocking, on CUDA). Constants (no grad), safe to share."""
    c, B = local_len // 2, len(doc_rows)
    plans = []
    with torch.inference_mode(False):  # a cached inference tensor would be unusable once autograd records
        for g in cp_global_chunks(tsp, rank, cp, cp_rank):
            lo, hi = g * c, (g + 1) * c
            reset = mask = None
            offsets = []
            for b, starts in enumerate(doc_rows):
                # the sequence's own start needs no cut: the state entering it is zero and the conv taps before it
                # read the zero halo (no bias anywhere before the conv), so both are exact without a reset or a
                # mask: the chunk holding it runs the kernels' plain path (no tap mask; FLA without cu_seqlens)
                starts = [s for s in starts if s > 0]
                inside = [s for s in starts if lo <= s < hi]
                offsets.append(tuple(s - lo for s in inside))
                for s in inside:
                    if reset is None:
                        reset = torch.zeros(B, c, dtype=dtype, device=device)
                    reset[b, s - lo:s - lo + 1] = 1  # a slice: an asynchronous fill (an element: a blocking copy)
                # tap s of token t reads t - s: valid iff t - s >= the start of t's document (t's position in it)
                governing = [s for s in starts if s <= lo]
                for d in ([governing[-1]] if governing else []) + [s for s in inside if s > lo]:
                    for t in range(max(d, lo), min(d + kernel - 1, hi)):
                        if mask is None:
                            mask = torch.ones(B, c, kernel, dtype=dtype, device=device)
                        mask[b, t - lo, t - d + 1:] = 0
            plans.append(ChunkPlan(lo, reset, mask, tuple(offsets)))
    return plans[0], plans[1]


class TransitionGather:
    """Every rank's [2, B, H, dk, dk + dv] chunk transitions (M | U), rank order: [D, 2, B, H, dk, dk + dv]; with a
    cp axis every cp group's: [C, D, 2, B, H, dk, dk + dv] (cp rank order), gathered over cp first (this rank's
    own transitions: each crosses nodes once, not D times) and then over the TSP group ([D, C, ...], waited as its
    [C, D, ...] view).

    Posted on construction and waited when the states are needed (`wait`), so the gather travels while the caller
    computes (the next head block's chunks); with cp, `advance` moves it on to the TSP stage as soon as the cp stage
    is in (call it before the overlapped compute, so both stages travel behind it). Every rank posts the same
    stages in the same order: construction, then the TSP stage at its first advance or wait.
    Not differentiable by itself: the layer's backward posts the dual (`TransitionGradScatter`) on every rank
    unconditionally, also where its own chunks do not depend on the state (a rank whose chunks all start
    documents), so every rank posts the same collectives."""

    WHAT = "gated delta rule chunk transitions"

    def __init__(self, local_transitions: torch.Tensor, comm: TSPComm):
        self.comm, self.ring = comm, None
        local = local_transitions.detach().contiguous()
        if comm.cp is None:
            self.everyone = local.new_empty((comm.size, *local.shape))
            self.handle = comm.all_gather(self.everyone, local, what=self.WHAT)
        else:
            cp = comm.cp_axis()
            self.ring = local.new_empty((cp.size, *local.shape))
            self.handle = cp.all_gather(self.ring, local, what=f"{self.WHAT} over cp")

    def advance(self) -> None:
        """With cp: wait for the cp stage and post the TSP stage (once); without cp nothing to do."""
        if self.ring is None:
            return
        self.handle.wait()
        self.everyone = self.ring.new_empty((self.comm.size, *self.ring.shape))
        self.handle, self.ring = self.comm.all_gather(self.everyone, self.ring, what=self.WHAT), None

    def wait(self) -> torch.Tensor:
        self.advance()
        self.handle.wait()
        return self.everyone if self.comm.cp is None else self.everyone.transpose(0, 1)


def gather_transitions(local_transitions: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """TransitionGather posted and waited at once."""
    return TransitionGather(local_transitions, comm).wait()


class TransitionGradScatter:
    """Backward of TransitionGather: the sum over ranks (of the TSP group and, with cp, of every cp group) of the
    grads of this rank's transitions: reduce-scatter over TSP first ([C, D, ...] grads taken as [D, C, ...]), then
    over cp (the dual of the gather's order: each rank's share crosses nodes once). Posted on construction (the
    first stage), waited by `wait` (with cp the cp stage is posted there), so it travels behind the caller's work."""

    WHAT = "grad of gated delta rule chunk transitions"

    def __init__(self, grad_everyone: torch.Tensor, comm: TSPComm):
        self.comm, self.cp_pending = comm, comm.cp is not None
        if comm.cp is not None:
            grad_everyone = grad_everyone.transpose(0, 1)  # [D, C, ...]: rank order over TSP
        self.out = grad_everyone.new_empty(grad_everyone.shape[1:])
        self.handle = comm.reduce_scatter(self.out, grad_everyone.contiguous(), what=self.WHAT)

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        if self.cp_pending:  # [C, ...] summed over the TSP group: the sum over cp of this rank's piece
            self.cp_pending, tsp_stage = False, self.out
            self.out = tsp_stage.new_empty(tsp_stage.shape[1:])
            self.handle = self.comm.cp_axis().reduce_scatter(self.out, tsp_stage, what=f"{self.WHAT} over cp")
            self.handle.wait()
        return self.out


def scatter_transition_grads(grad_everyone: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """TransitionGradScatter posted and waited at once."""
    return TransitionGradScatter(grad_everyone, comm).wait()


def start_states(everyone: torch.Tensor, rank: int, dk: int, cp_rank: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering each of `rank`'s two chunks from every rank's transitions [D, 2, B, H, dk, dk + dv]
    (gather_transitions; with cp_rank given, every cp group's [C, D, 2, ...]), composed in global chunk order from
    a zero state: (S_in of local chunk 0, of local chunk 1), each [B, H, dk, dv]. Differentiable in `everyone`."""
    if cp_rank is None:
        owners, (first, second) = _chunk_owners(everyone.shape[0], rank)
    else:
        owners, (first, second) = _chunk_owners(everyone.shape[1], rank, everyone.shape[0], cp_rank)
    ordered = [everyone[where] for where in owners]
    state = torch.zeros_like(ordered[0][..., dk:])
    found = {}
    for g in range(second + 1):
        if g in (first, second):
            found[g] = state
        if g < second:
            m, u = ordered[g][..., :dk], ordered[g][..., dk:]
            state = m @ state + u
    return found[first], found[second]
