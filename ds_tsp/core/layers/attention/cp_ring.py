"""Attention across the context-parallel (cp) axis: K/V travel the cp ring in 1/D shares, reassembled over TSP.

A sequence is split over C TSP groups (tsp.cp_size; layout in ds_tsp.core.tokens.zigzag): cp group i holds cp chunks
i and 2C-1-i of the 2C cp chunks (Ccp = S_pad / (2C) tokens each). Inside the group TSP works as alone: every
head block's K/V are all-gathered over the group (ds_tsp.core.comm.kv_gather), giving `kv_all` [S_loc = 2 Ccp, B, 2,
nkv, d] in "cp-local order" (cp chunk i, then cp chunk 2C-1-i; global order, with a gap between them). Here,
per head block, TSP rank p of group i:

1. own block: attends its two query chunks to its own group's K/V with the kernels TSP uses alone
   (ds_tsp.core.layers.attention.masked), the document starts mapped to cp-local coordinates (`local_layout`);
2. ring: C-1 hops over the cp group (TSP rank p of every group; one `batch_isend_irecv` per hop and
   direction, TSPComm.ring_exchange), each carrying only this rank's 1/D SHARE of a group's block: its two zigzag
   chunks' K/V (`own_share`, local_kv's layout). Hop s brings group r = (i - s) mod C's rank-p share (forwarded at
   hop s+1), and the TSP group reassembles r's whole block over the fast intra-node link with TSP's own K/V gather
   (GlobalKVGather: two all-gathers, one per zigzag half, into cp-local order). So each token's K/V crosses the
   inter-node link once per hop, not once per TSP rank. `_KVRing` keeps two stages in flight: when block s's
   attention starts, block s+1's gather and the hop bringing block s+2's share are already posted, so both travel
   behind it (the own block's second query chunk, the larger, runs first, behind hop 1; the first, behind block
   1's gather and hop 2); the received block's partial (out, lse) is merged by log-sum-exp (kernels._merge) into
   the queries it is visible to.

Causal skipping, and why zigzag balances the ring: every key of group r != i lies strictly before or strictly
after each local query chunk (the chunks are whole cp chunks apart), so a foreign block is either unmasked (one
kernel call) or skipped entirely:

    r < i: cp chunk r is in the past of both query chunks, cp chunk 2C-1-r in the future of both
           -> both query chunks x the first half of r's K/V
    r > i: both of r's cp chunks are in the past of query chunk 2 (cp chunk 2C-1-i) and the future of chunk 1
           -> query chunk 2 x all of r's K/V

Both cases are one (c queries x 2 Ccp keys) of work per rank and hop, so every rank does the same work at every
hop and no rank waits on a slower neighbour (the zigzag ring of ring-flash-attention, here with TSP inside).
Packed documents: a query of document [a, ...) sees the keys of r's buffer from `_buffer_offset(a, r)` on (a
suffix of the buffer, since r's two chunks are in global order), so each run of queries in one document is one
unmasked kernel call over a buffer suffix: no [S, S] mask. Linear-attention (Gated DeltaNet) layers do not take
this ring: their conv halo and chunk transitions are all-gathered over cp (ds_tsp.core.layers.linear_attention.scan).
Sliding-window layers (a window that hides some key of S_pad) do not take this ring:
ds_tsp.core.layers.attention.cp_window fetches, per ring distance that some group needs (a static fact of window, C
and Ccp, the same on every rank), only the hull of the keys its ranks' windows reach, in D slices gathered over TSP
(one exchange per distance; distances no group needs are not posted; dK/dV go back the same way); its module doc has
that schedule and its bytes. Full layers of the same model keep this ring. MoE layers need nothing here: their
experts stay inside the TSP group and the aux loss's counts are reduced over cp (functions/moe_aux).

Backward (same hops, plus the way back): K/V hops and gathers as in forward; each rank computes the received
block's dK/dV contribution with the kernels' backward from the MERGED out / lse (exact partial grads, kernels
module doc) into a whole-block buffer, which the TSP group reduce-scatters (`_scatter_grad`, one per zigzag half)
to each rank's share: the sum over the group's queries of the grads of rank p's share of group r's K/V. That share
is added to the accumulator that arrived from the previous group and passed on around the ring at 1/D (posted
after the next block's backward is queued, so the reduce-scatter and the hop travel behind it), and one last hop
brings every rank its own share's grads from every other group, which are added to the TSP group's dK/dV before
its reduce-scatter (kv_gather.RankOrderedKVGrad.add_share). Accumulators are float32 for half-precision K/V (the
sum of up to C-1 contributions).

Traffic per head block (kv group) and rank, with E = S_loc x B x 2 nkv d elements (one group's block):
inter-node (cp) forward (C-1) x E / D, backward twice that (K/V again, dK/dV back); intra-node (TSP) forward
(C-1) x (D-1)/D x E (the reassembly gathers), backward that again plus (C-1) x (D-1)/D x E of dK/dV reduce-scatters.
Live buffers: two gathered blocks (one attended, one in flight) and two shares; in backward also two dK/dV blocks
(one computed, one being reduce-scattered), the second half's reversed copy and two accumulator shares.
"""
from __future__ import annotations

import bisect
import functools

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.kv_gather import GlobalKVGather, RankOrderedKVGrad, kv_prefix
from ds_tsp.core.layers.attention import kernels
from ds_tsp.core.layers.attention.cp_window import uses_window_path, window_attention_backward, window_attention_forward
from ds_tsp.core.layers.attention.masked import masked_attention_backward_pieces, masked_attention_forward
from ds_tsp.core.tokens.documents import DocumentLayout
from ds_tsp.core.tokens.zigzag import zigzag_chunks

__all__ = ["cp_attention_forward", "cp_attention_backward", "local_layout", "own_share"]

KV_TAG, GRAD_TAG = 31, 32  # gloo matches p2p by tag (NCCL by post order, the same on every rank)
OWN_ORDER = (1, 0)  # the own block's larger query chunk (the second: more keys) first, so hop 1 hides behind it


def _buffer_offset(a: int, cp_rank: int, cp: int, cp_chunk: int) -> int:
    """Where global position `a` falls in cp group `cp_rank`'s buffer (its cp chunks r and 2C-1-r, in order): the
    first buffer key at or after `a` (2 cp_chunk when none is)."""
    first, second = cp_rank * cp_chunk, (2 * cp - 1 - cp_rank) * cp_chunk
    if a <= first:
        return 0
    if a < first + cp_chunk:
        return a - first
    if a <= second:
        return cp_chunk
    return min(cp_chunk + a - second, 2 * cp_chunk)


@functools.lru_cache(maxsize=64)
def local_layout(layout: DocumentLayout, cp: int, cp_rank: int, cp_chunk: int) -> DocumentLayout:
    """The document starts of the whole sequence (global positions) as cp group `cp_rank` sees its own tokens,
    in cp-local coordinates: a document starting in the gap between its two cp chunks starts, for it, at the
    second chunk. Computed once per step and group (cached), not per layer and block."""
    rows = []
    for row in layout.rows:
        mapped = {0}
        for a in row:
            offset = _buffer_offset(a, cp_rank, cp, cp_chunk)
            if offset < 2 * cp_chunk:
                mapped.add(offset)
        rows.append(tuple(sorted(mapped)))
    return DocumentLayout(tuple(rows))


class _Geometry:
    """Where this rank's two query chunks and a foreign group's keys lie (global positions, host ints)."""

    def __init__(self, cp: TSPComm, tsp_rank: int, tsp: int, local_len: int):
        self.cp, self.i, self.tsp, self.p = cp.size, cp.rank, tsp, tsp_rank
        self.c = local_len // 2  # tokens per TSP chunk
        self.cp_chunk = tsp * self.c
        C, i = self.cp, self.i
        first, second = zigzag_chunks(tsp, tsp_rank)
        # (local query slice, local start in cp-local order, global start) of each query chunk
        self.queries = [(slice(0, self.c), first * self.c, i * self.cp_chunk + first * self.c),
                        (slice(self.c, 2 * self.c), second * self.c,
                         (2 * C - 1 - i) * self.cp_chunk + (second - tsp) * self.c)]

    def visible(self, r: int) -> list[tuple[int, int]]:
        """(query chunk index, keys of r's buffer it sees: [0, n)) for a foreign group r: the causal skip."""
        if r < self.i:
            return [(0, self.cp_chunk), (1, self.cp_chunk)]
        return [(1, 2 * self.cp_chunk)]


def _kv_keys(buffer: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, hi-lo, nkv, d] views of keys lo..hi-1 of a [S, B, 2, nkv, d] buffer."""
    keys = buffer[lo:hi]
    return keys[:, :, 0].transpose(0, 1), keys[:, :, 1].transpose(0, 1)


def _runs(layout: DocumentLayout | None, batch: int, t0: int, n_queries: int, r: int, geo: _Geometry,
          n_keys: int):
    """Per group of batch rows with the same runs: (rows slice list, [(q0, q1, k0)]): queries t0+q0 .. t0+q1-1
    (one document) see keys k0 .. n_keys-1 of group r's buffer. Runs that see no key are left out."""
    if layout is None:
        return (((slice(0, batch),), ((0, n_queries, 0),)),)
    return _document_runs(layout, batch, t0, n_queries, r, geo.cp, geo.cp_chunk, n_keys)


@functools.lru_cache(maxsize=256)
def _document_runs(layout: DocumentLayout, batch: int, t0: int, n_queries: int, r: int, cp: int, cp_chunk: int,
                   n_keys: int) -> tuple:
    """_runs for packed documents, computed once per (layout, chunk, foreign group) and step: the forward, the
    recompute and the backward of every layer and head block ask the same. Each row's starts are searched
    (bisect), not scanned: a 1M-token pack of short documents holds thousands per row."""
    groups: dict[tuple, list[int]] = {}
    t1 = t0 + n_queries
    for b, starts in enumerate(layout.rows):
        first = bisect.bisect_right(starts, t0)  # starts[first - 1] <= t0: the document holding t0 (starts[0] = 0)
        inside = starts[first:bisect.bisect_left(starts, t1, lo=first)]  # documents starting in (t0, t1)
        cuts, docs = (t0, *inside, t1), (starts[first - 1], *inside)
        runs = []
        for a, u0, u1 in zip(docs, cuts, cuts[1:]):
            k0 = _buffer_offset(a, r, cp, cp_chunk)
            if k0 < n_keys:
                runs.append((u0 - t0, u1 - t0, k0))
        groups.setdefault(tuple(runs), []).append(b)
    out = []
    for runs, rows in groups.items():
        if runs:
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            out.append(((slice(rows[0], rows[-1] + 1),) if contiguous else tuple(slice(b, b + 1) for b in rows),
                        runs))
    return tuple(out)


def _single(layout: DocumentLayout) -> DocumentLayout | None:
    return None if all(len(row) == 1 for row in layout.rows) else layout


class _KVRing:
    """The K/V of every other group of the cp ring, each carried across nodes once.

    TSP rank p of group i holds 1/D of its group's K/V: its own two zigzag chunks (`share`, local_kv's
    [2, c, B, 2, nkv, d]). The cp ring of TSP rank p passes only these shares (pass-KV: hop s brings group
    (i - s) mod C's rank p share, forwarded at hop s+1), and the TSP group reassembles each received block with
    the K/V gather TSP uses alone (GlobalKVGather, on the TSP communicator, intra-node). Two stages in flight: at
    `next()` for block s the gather of block s+1 and the hop bringing block s+2 are posted before block s's
    attention runs, so both travel behind it; `advance()` (called once between the own group's two query chunks)
    starts that pipeline."""

    def __init__(self, comm: TSPComm, cp: TSPComm, kv_all: torch.Tensor, what: str):
        self.comm, self.cp, self.what = comm, cp, what
        self.hops_posted, self.gathers = 0, []
        self.hop = self._post_hop(own_share(kv_all, comm.size, comm.rank))

    def _post_hop(self, send: torch.Tensor):
        if self.hops_posted >= self.cp.size - 1:
            return None
        self.hops_posted += 1
        recv = torch.empty_like(send)
        handle = self.cp.ring_exchange(send, recv, KV_TAG,
                                       what=f"{self.what} cp hop {self.hops_posted}/{self.cp.size - 1}")
        return handle, recv

    def advance(self) -> None:
        """Wait for the hop in flight, post the TSP gather of the share it brought and the hop forwarding it."""
        if self.hop is None:
            return
        handle, share = self.hop
        handle.wait()
        self.gathers.append(GlobalKVGather(self.comm, share, what=f"{self.what} cp block {self.hops_posted}"))
        self.hop = self._post_hop(share)

    def next(self) -> torch.Tensor:
        """Group (i - s) mod C's gathered K/V [S_loc, B, 2, nkv, d] at the s-th call; posts the next stages."""
        if not self.gathers:
            self.advance()
        self.advance()
        return self.gathers.pop(0).wait()


def own_share(kv_all: torch.Tensor, tsp: int, tsp_rank: int) -> torch.Tensor:
    """This TSP rank's two zigzag chunks of its group's gathered K/V [S_loc, ...], as local_kv lays them out:
    [2, c, ...] (a copy of 1/D of the buffer)."""
    chunks = kv_all.view(2 * tsp, kv_all.shape[0] // (2 * tsp), *kv_all.shape[1:])
    return torch.stack((chunks[tsp_rank], chunks[2 * tsp - 1 - tsp_rank]))


def _scatter_grad(comm: TSPComm, grad: torch.Tensor, what: str):
    """Post the reduce-scatter over the TSP group of a group's dK/dV [S_loc, ...] (global order): returns (this
    rank's share of the sum, [2, c, ...] as own_share lays it out, handle). One reduce-scatter per zigzag half,
    as GlobalKVGather gathers them: the first half is in rank order already, the second reversed."""
    D = comm.size
    half = grad.shape[0] // 2
    out = grad.new_empty((2, half // D, *grad.shape[1:]))
    second = grad[half:].view(D, half // D, *grad.shape[1:]).flip(0)
    handles = [comm.reduce_scatter(out[0], grad[:half], what=f"{what}, first zigzag half"),
               comm.reduce_scatter(out[1], second, what=f"{what}, second zigzag half")]
    return out, _Handles(handles)


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


def cp_attention_forward(q: torch.Tensor, kv_all: torch.Tensor, comm: TSPComm, *, doc_starts: DocumentLayout,
                         window: int | None, scale: float, backend: str | None
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Attention of this rank's queries q [B, L, nq, d] over the whole sequence: its group's gathered K/V
    (kv_all [S_loc, B, 2, nkv, d]) and, around comm.cp's ring, every other group's. doc_starts: the global
    layout. Returns (out [B, L, nq, d], [lse of chunk 1, lse of chunk 2]) merged over every block."""
    cp = comm.cp_axis()
    B, L = q.shape[:2]
    if uses_window_path(window, cp.size * comm.size * L):  # only the keys the window reaches travel
        return window_attention_forward(q, kv_all, comm, cp, doc_starts=doc_starts, window=window, scale=scale,
                                        backend=backend)
    geo = _Geometry(cp, comm.rank, comm.size, L)
    ring = _KVRing(comm, cp, kv_all, "K/V")
    own = local_layout(doc_starts, cp.size, cp.rank, geo.cp_chunk)
    outs, lses = [None, None], [None, None]
    for chunk in OWN_ORDER:  # own block, while hop 1 (then block 1's gather and hop 2) are in flight
        local, start, _ = geo.queries[chunk]
        k_all, v_all = kv_prefix(kv_all, start + geo.c)
        outs[chunk], lses[chunk] = masked_attention_forward(q[:, local], k_all, v_all, q_start=start, doc_starts=own,
                                                            window=None, scale=scale, backend=backend)
        if chunk == OWN_ORDER[0]:
            ring.advance()
    impl = kernels._backend_impl(backend, q)
    layout = _single(doc_starts)
    for s in range(1, cp.size):
        buffer, r = ring.next(), (cp.rank - s) % cp.size  # the next stages posted: they run behind this block
        for chunk, n_keys in geo.visible(r):
            local, _, t0 = geo.queries[chunk]
            qc, oc, lc = q[:, local], outs[chunk], lses[chunk]
            for rows, runs in _runs(layout, B, t0, geo.c, r, geo, n_keys):
                for row in rows:
                    for q0, q1, k0 in runs:
                        k, v = _kv_keys(buffer[:, row], k0, n_keys)
                        o, lse = impl.forward(qc[row, q0:q1], k, v, causal=False, scale=scale)
                        oc[row, q0:q1], lc[row, :, q0:q1] = kernels._merge(oc[row, q0:q1], lc[row, :, q0:q1], o, lse)
    return torch.cat(outs, dim=1), lses


def cp_attention_backward(dout: torch.Tensor, q: torch.Tensor, kv_all: torch.Tensor, out: torch.Tensor,
                          lses: list[torch.Tensor], kv_grad: RankOrderedKVGrad, comm: TSPComm, *,
                          doc_starts: DocumentLayout, window: int | None, scale: float, backend: str | None
                          ) -> list[torch.Tensor]:
    """Backward of cp_attention_forward: returns dq of the two query chunks and adds the grads of this group's
    K/V (its own block's, and every other group's, brought back around the ring) into kv_grad."""
    cp = comm.cp_axis()
    B, L = q.shape[:2]
    if uses_window_path(window, cp.size * comm.size * L):
        return window_attention_backward(dout, q, kv_all, out, lses, kv_grad, comm, cp, doc_starts=doc_starts,
                                         window=window, scale=scale, backend=backend)
    geo = _Geometry(cp, comm.rank, comm.size, L)
    ring = _KVRing(comm, cp, kv_all, "K/V (backward)")
    own = local_layout(doc_starts, cp.size, cp.rank, geo.cp_chunk)
    acc = kernels.accumulation_dtype(q.dtype)
    dq_chunks = [None, None]
    for chunk in OWN_ORDER:
        local, start, _ = geo.queries[chunk]
        k_all, v_all = kv_prefix(kv_all, start + geo.c)
        dq_c = masked_attention_backward_pieces(dout[:, local], q[:, local], k_all, v_all, out[:, local],
                                                lses[chunk], q_start=start, doc_starts=own, window=None,
                                                scale=scale, backend=backend, take_kv=kv_grad.take)
        dq_chunks[chunk] = dq_c.to(acc)
        if chunk == OWN_ORDER[0]:
            ring.advance()
    impl = kernels._backend_impl(backend, q)
    layout = _single(doc_starts)
    scattered = None  # (share of block s-1's dK/dV, its reduce-scatter): summed and sent on behind block s
    carried_hop = None  # (handle, inbox): the accumulator of block s-1's group arriving from the previous group
    for s in range(1, cp.size):
        buffer, r = ring.next(), (cp.rank - s) % cp.size
        mine = torch.zeros(kv_all.shape, dtype=acc, device=kv_all.device)  # this rank's part for group r
        for chunk, n_keys in geo.visible(r):
            local, _, t0 = geo.queries[chunk]
            for rows, runs in _runs(layout, B, t0, geo.c, r, geo, n_keys):
                for row in rows:
                    for q0, q1, k0 in runs:
                        k, v = _kv_keys(buffer[:, row], k0, n_keys)
                        gq, gk, gv = impl.backward(dout[row, local][:, q0:q1], q[row, local][:, q0:q1], k, v,
                                                   out[row, local][:, q0:q1], lses[chunk][row, :, q0:q1],
                                                   causal=False, scale=scale)
                        dq_chunks[chunk][row, q0:q1] += gq
                        dk, dv = _kv_keys(mine[:, row], k0, n_keys)
                        dk += gk
                        dv += gv
        if scattered is not None:  # block s-1's accumulator moves on while block s+1's backward runs
            carried_hop = _pass_on(cp, scattered, carried_hop, s)
        scattered = _scatter_grad(comm, mine, f"dK/dV cp block {s}")  # behind block s+1's backward
    if scattered is not None:  # the last hop brings each group its own K/V's grads from every other group
        inbox, handle = _pass_on(cp, scattered, carried_hop, cp.size)
        handle.wait()
        kv_grad.add_share(comm.rank, inbox.to(kv_all.dtype))
    return [d.to(q.dtype) for d in dq_chunks]


def _pass_on(cp: TSPComm, scattered, carried_hop, s: int):
    """This rank's share of a group's dK/dV summed over this group's TSP ranks (the reduce-scatter) and over the
    groups before it on the ring (the accumulator arriving with `carried_hop`), posted to the next group; returns
    (the inbox receiving the previous group's accumulator, the hop's handle)."""
    share, scatter = scattered
    scatter.wait()
    if carried_hop is not None:
        inbox, handle = carried_hop
        handle.wait()
        share += inbox
    inbox = torch.empty_like(share)
    return inbox, cp.ring_exchange(share, inbox, GRAD_TAG, what=f"dK/dV cp hop {s - 1}/{cp.size - 1}")
