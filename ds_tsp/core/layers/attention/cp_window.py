"""Sliding-window attention across the cp axis: each rank fetches only the keys its window reaches.

Under cp (ds_tsp.core.layers.attention.cp_ring's module doc for the layout) cp group i holds cp chunks i and 2C-1-i (Ccp
tokens each); its TSP rank p holds one TSP chunk of each (query chunks 1 and 2, c tokens each), and the cp ring of
TSP rank p (comm.cp) joins TSP rank p of every group. A windowed layer (HF's rule: query t sees key s iff
t - w < s <= t, document starts as under TSP alone) needs, of cp group r's buffer [chunk r | chunk 2C-1-r], only
the keys some window of this rank's queries reaches. Zigzag puts those neighbours on both sides of the ring: query
chunk 1 (in cp chunk i) reaches back into cp chunk i-1 (group i-1's first half), query chunk 2 (in cp chunk
2C-1-i) into cp chunk 2C-2-i (group i+1's second half). Pass-KV would forward every block C-1 hops to bring group
i+1 round; instead hop s is one exchange at ring distance s (TSPComm.shift_exchange: send to i+s, receive from
i-s, one batch_isend_irecv) carrying, of the sender's own buffer, a slice of what the receiving group needs. A
rank's own need is

    needed(i, p <- r) = the hull, in r's buffer coordinates, of r's keys in [q0 - w + 1, q0 + c - 1] for the
                        global starts q0 of rank (i, p)'s two query chunks (keys of r after a query chunk are
                        after all of it: cp chunks are whole chunks apart).

It is a static fact of (w, C, D, p, c), computed once per ring (`window_hops`). What crosses nodes is decided
per GROUP (`group_hops`): the hull of its D ranks' ranges from sender r, padded to D slices of m keys inside r's
buffer; TSP rank p of the sender sends slice p to TSP rank p of the receiver (one exchange at distance s), which
all-gathers the D slices over TSP (intra-node) and reads its own range from the hull. So a key that several TSP
ranks' windows reach crosses nodes once, not once per rank. Every rank of a ring and of a group computes the same
lists, so they post the same hops and gathers in the same order in forward and backward: hop s is posted at all
iff some group needs a key at distance s, and a pair of groups whose hull is empty posts nothing on either side.
A window below one TSP chunk reaches another group only from the query chunks that start a cp chunk (TSP ranks 0
and D-1): w - 1 keys per neighbour, in D slices. Windows spanning several chunks reach further, up to the full
causal ranges (then half of a past group's buffer, not all of it as pass-KV sends).
Full-attention layers (window None, or >= S_pad) take cp_ring's pass-KV ring.

Per query chunk the own group's keys come first: the keys of its own cp chunk with
document_attention.masked_attention_forward (window and documents in chunk-local coordinates), then, for query
chunk 2, cp chunk i as a past segment. A past segment (global keys [g0, g1), g1 <= every query) is cut per
document run (queries [u0, u1) of the document starting at a; lo = max(a, g0)) into at most two exact blocks:

    queries t <  lo + w : every key of [lo, g1)            -> one unmasked kernel call
    queries t >= lo + w : keys [t - w + 1, g1), a band     -> both axes reversed it is a causal block
                          (t < g1 + w - 1; later queries see none of the segment)   (document_attention's trick)

merged into the chunk's (out, lse) by log-sum-exp. No [S, S] mask; blocks are host ints, cached per layout.
Backward runs the same blocks with the merged (out, lse) (exact partial grads, kernels module doc) into a hull-
shaped dK/dV buffer, which the group reduce-scatters over TSP to the slices; slice p's grads go straight back to
TSP rank p of their owner group by the reverse exchange (distance -s, posted after the block, so it runs behind
the next block's backward), and are added with the own blocks' grads into the TSP group's dK/dV.

Traffic per head block (kv group) and rank: inter-node forward sum over hops of the slice this rank sends (m
tokens) x B x 2 nkv d elements; backward the same K/V again plus its received slice's dK/dV back (in the
accumulation dtype: float32 for half precision); intra-node the received slices' all-gathers ((D-1) m tokens each,
forward and backward) and their dK/dV reduce-scatters. `hop_elements` gives these counts for ds-tsp plan.
"""
from __future__ import annotations

import functools

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.kv_gather import RankOrderedKVGrad, kv_prefix
from ds_tsp.core.layers.attention import kernels
from ds_tsp.core.layers.attention.masked import masked_attention_backward, masked_attention_forward
from ds_tsp.core.tokens.documents import DocumentLayout
from ds_tsp.core.tokens.zigzag import zigzag_chunks

__all__ = ["window_hops", "hop_elements", "query_starts", "uses_window_path", "window_attention_forward",
           "window_attention_backward"]

KV_TAG, GRAD_TAG = 33, 34  # gloo matches p2p by tag; cp_ring's pass-KV ring uses 31, 32


def uses_window_path(window: int | None, padded_len: int) -> bool:
    """A window that hides some key of a sequence of padded_len tokens (else the layer is full attention)."""
    return window is not None and window < padded_len


@functools.lru_cache(maxsize=256)
def window_hops(window: int, cp: int, tsp: int, tsp_rank: int, chunk: int
                ) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """The hops the cp ring of TSP rank `tsp_rank` posts for a windowed layer (`chunk`: tokens per TSP chunk):
    (distance s, per receiving cp rank i the range [lo, hi) of sender (i - s) mod C's buffer it receives; (0, 0)
    when it needs none). Distances no rank of this ring needs are left out."""
    hops = []
    for s in range(1, cp):
        ranges = tuple(_needed(window, cp, tsp, chunk, query_starts(cp, i, tsp, tsp_rank, chunk), (i - s) % cp)
                       for i in range(cp))
        if any(hi > lo for lo, hi in ranges):
            hops.append((s, ranges))
    return tuple(hops)


@functools.lru_cache(maxsize=256)
def group_hops(window: int, cp: int, tsp: int, chunk: int) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """What crosses nodes per ring distance: (distance s, per receiving cp rank i (start, m)): its TSP group needs,
    of sender (i - s) mod C's buffer, the hull of what its D ranks' windows reach (window_hops of each), padded to
    D slices of m keys, [start, start + D m) inside the buffer (the padding is real keys nobody reads); TSP rank p
    of each side moves slice p, and the receiving group all-gathers the slices over TSP. (0, 0): nothing. The same
    list on every rank; distances no group needs are left out."""
    cp_chunk, hops = tsp * chunk, []
    for s in range(1, cp):
        spans = []
        for i in range(cp):
            ranges = [_needed(window, cp, tsp, chunk, query_starts(cp, i, tsp, p, chunk), (i - s) % cp)
                      for p in range(tsp)]
            ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
            if not ranges:
                spans.append((0, 0))
                continue
            lo, hi = min(lo for lo, _ in ranges), max(hi for _, hi in ranges)
            m = -(-(hi - lo) // tsp)
            spans.append((min(lo, 2 * cp_chunk - tsp * m), m))
        if any(m for _, m in spans):
            hops.append((s, tuple(spans)))
    return tuple(hops)


def query_starts(cp: int, i: int, tsp: int, tsp_rank: int, chunk: int) -> tuple[int, int]:
    """Global starts of the two query chunks (`chunk` tokens each) of TSP rank tsp_rank of cp group i."""
    first, second = zigzag_chunks(tsp, tsp_rank)
    cp_chunk = tsp * chunk
    return i * cp_chunk + first * chunk, (2 * cp - 1 - i) * cp_chunk + (second - tsp) * chunk


def _needed(window: int, cp: int, tsp: int, chunk: int, starts: tuple[int, int], r: int) -> tuple[int, int]:
    cp_chunk = tsp * chunk
    lo, hi = 2 * cp_chunk, 0
    for q0 in starts:  # the rank's query chunks [q0, q0 + chunk)
        first_key, end_key = q0 - window + 1, q0 + chunk  # every window of the chunk: keys [first, end)
        for base, g0 in _halves(cp, cp_chunk, r):
            a, b = max(g0, first_key), min(g0 + cp_chunk, end_key)
            if a < b:
                lo, hi = min(lo, base + a - g0), max(hi, base + b - g0)
    return (lo, hi) if hi > lo else (0, 0)


def _halves(cp: int, cp_chunk: int, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(buffer offset, global start) of group r's two cp chunks."""
    return (0, r * cp_chunk), (cp_chunk, (2 * cp - 1 - r) * cp_chunk)


def hop_elements(window: int, cp: int, tsp: int, chunk: int) -> tuple[list[int], list[int], list[int]]:
    """Per cp rank (every TSP rank of a group the same), per head block in forward: (exchanges posted, tokens it
    sends across nodes, tokens its group gathers over TSP (D m per received slice m)): what ds-tsp plan counts."""
    hops = group_hops(window, cp, tsp, chunk)
    calls = [sum(1 for s, spans in hops if spans[(i + s) % cp][1] or spans[i][1]) for i in range(cp)]
    sent = [sum(spans[(i + s) % cp][1] for s, spans in hops) for i in range(cp)]
    gathered = [sum(tsp * spans[i][1] for _, spans in hops) for i in range(cp)]
    return calls, sent, gathered


def _size(r: tuple[int, int]) -> int:
    return r[1] - r[0]


# ----------------------------------------------------------------------------------------------------------------
# geometry: host ints, cached per layout


class _Chunks:
    """This rank's two query chunks: (local slice, global start, own cp chunk's global start, buffer base)."""

    def __init__(self, cp: int, i: int, tsp: int, tsp_rank: int, local_len: int):
        self.c = local_len // 2
        self.cp_chunk = tsp * self.c
        t1, t2 = query_starts(cp, i, tsp, tsp_rank, self.c)
        g1, g2 = i * self.cp_chunk, (2 * cp - 1 - i) * self.cp_chunk
        self.queries = [(slice(0, self.c), t1, g1, 0), (slice(self.c, 2 * self.c), t2, g2, self.cp_chunk)]


@functools.lru_cache(maxsize=256)
def _chunk_layout(layout: DocumentLayout, start: int, length: int) -> DocumentLayout:
    """The document starts seen from the cp chunk [start, start + length), in chunk coordinates."""
    return DocumentLayout(tuple((0,) + tuple(a - start for a in row if start < a < start + length)
                                for row in layout.rows))


def _run_blocks(a: int, u0: int, u1: int, g0: int, g1: int, window: int) -> list[tuple[int, int, int, int, bool]]:
    """Queries [u0, u1) of the document starting at a against the past keys [g0, g1): (t0, t1, k0, k1, flip)."""
    lo = max(a, g0)
    if lo >= g1:
        return []
    blocks = []
    if u0 < min(u1, lo + window):
        blocks.append((u0, min(u1, lo + window), lo, g1, False))
    b0, b1 = max(u0, lo + window), min(u1, g1 + window - 1)
    if b0 < b1:
        blocks.append((b0, b1, b0 - window + 1, g1, True))
    return blocks


@functools.lru_cache(maxsize=512)
def _segment_blocks(layout: DocumentLayout, t0: int, n: int, g0: int, g1: int, window: int):
    """Per group of batch rows with the same blocks: (row slices, blocks (q0, q1, k0, k1, flip) relative to the
    query chunk start t0 and the segment start g0)."""
    by_blocks: dict[tuple, list[int]] = {}
    t1 = t0 + n
    for b, starts in enumerate(layout.rows):
        doc = max(s for s in starts if s <= t0)
        cuts = [s for s in starts if t0 < s < t1]
        blocks = []
        for a, u0, u1 in zip([doc] + cuts, [t0] + cuts, cuts + [t1]):
            blocks += [(q0 - t0, q1 - t0, k0 - g0, k1 - g0, f) for q0, q1, k0, k1, f in
                       _run_blocks(a, u0, u1, g0, g1, window)]
        by_blocks.setdefault(tuple(blocks), []).append(b)
    out = []
    for blocks, rows in by_blocks.items():
        if blocks:
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            out.append(([slice(rows[0], rows[-1] + 1)] if contiguous else [slice(b, b + 1) for b in rows], blocks))
    return tuple(out)


def _segments(cp: int, cp_chunk: int, r: int, lo: int, hi: int):
    """The global key segments of group r's buffer range [lo, hi): (buffer offset into the range, g0, g1)."""
    out = []
    for base, g in _halves(cp, cp_chunk, r):
        a, b = max(lo, base), min(hi, base + cp_chunk)
        if a < b:
            out.append((a - lo, g + a - base, g + b - base))
    return out


# ----------------------------------------------------------------------------------------------------------------
# one past segment: forward and backward


def _segment_forward(q, outs, lses, chunks: _Chunks, kv: torch.Tensor, g0: int, g1: int, layout, window, scale,
                     impl, backend):
    """Merge the keys kv [g1 - g0, B, 2, nkv, d] (global [g0, g1)) into every query chunk they are past of."""
    for k, (local, t0, _, _) in enumerate(chunks.queries):
        if g1 > t0:  # after the chunk's first query: after all of it (whole cp chunks apart)
            continue
        qc, oc, lc = q[:, local], outs[k], lses[k]
        for rows, blocks in _segment_blocks(layout, t0, chunks.c, g0, g1, window):
            for row in rows:
                for q0, q1, k0, k1, f in blocks:
                    key, value = kv_prefix(kv[k0:k1, row], k1 - k0)
                    if f:
                        o, lse = kernels.attention_forward(qc[row, q0:q1].flip(1), key.flip(1), value.flip(1),
                                                           q_start=(k1 - k0) - (q1 - q0), scale=scale,
                                                           backend=backend)
                        o, lse = o.flip(1), lse.flip(2)
                    else:
                        o, lse = impl.forward(qc[row, q0:q1], key, value, causal=False, scale=scale)
                    oc[row, q0:q1], lc[row, :, q0:q1] = kernels._merge(oc[row, q0:q1], lc[row, :, q0:q1], o, lse)


def _segment_backward(dout, q, out, lses, dq_chunks, chunks: _Chunks, kv: torch.Tensor, grad: torch.Tensor,
                      g0: int, g1: int, layout, window, scale, impl, backend):
    """Backward of _segment_forward: adds into dq_chunks and grad (kv's layout, the accumulation dtype)."""
    for k, (local, t0, _, _) in enumerate(chunks.queries):
        if g1 > t0:
            continue
        for rows, blocks in _segment_blocks(layout, t0, chunks.c, g0, g1, window):
            for row in rows:
                for q0, q1, k0, k1, f in blocks:
                    key, value = kv_prefix(kv[k0:k1, row], k1 - k0)
                    args = [dout[row, local][:, q0:q1], q[row, local][:, q0:q1], key, value,
                            out[row, local][:, q0:q1]]
                    lse = lses[k][row, :, q0:q1]
                    if f:
                        gq, gk, gv = kernels.attention_backward(*(x.flip(1) for x in args), lse.flip(2),
                                                                q_start=(k1 - k0) - (q1 - q0), scale=scale,
                                                                backend=backend)
                        gq, gk, gv = gq.flip(1), gk.flip(1), gv.flip(1)
                    else:
                        gq, gk, gv = impl.backward(*args, lse, causal=False, scale=scale)
                    dq_chunks[k][row, q0:q1] += gq
                    dk, dv = kv_prefix(grad[k0:k1, row], k1 - k0)
                    dk += gk
                    dv += gv


# ----------------------------------------------------------------------------------------------------------------
# the hops


class _Fetch:
    """The hull each group_hops hop brings this rank's group, one hop ahead: next() waits for hop h's slice, posts
    hop h+1, and gathers the group's slices over TSP into the hull [D m, B, 2, nkv, d] (None when this group
    receives nothing at that distance)."""

    def __init__(self, comm: TSPComm, cp: TSPComm, kv_all: torch.Tensor, hops, what: str):
        self.comm, self.cp, self.kv_all, self.hops, self.what, self.step = comm, cp, kv_all, hops, what, 0
        self.pending = self._post(0)

    def _post(self, h: int):
        if h >= len(self.hops):
            return None
        s, spans = self.hops[h]
        i, C, p = self.cp.rank, self.cp.size, self.comm.rank
        start, m = spans[(i + s) % C]  # what the group at distance s needs of this group's buffer: slice p of it
        send = self.kv_all[start + p * m:start + (p + 1) * m].contiguous() if m else None
        m = spans[i][1]
        recv = self.kv_all.new_empty((m, *self.kv_all.shape[1:])) if m else None
        handle = self.cp.shift_exchange(send, recv, s, KV_TAG,
                                        what=f"{self.what} cp hop {h + 1}/{len(self.hops)} (window, distance {s})")
        return handle, recv

    def next(self) -> torch.Tensor | None:
        handle, recv = self.pending
        handle.wait()
        self.step += 1
        self.pending = self._post(self.step)
        if recv is None:
            return None
        hull = recv.new_empty((self.comm.size * recv.shape[0], *recv.shape[1:]))
        self.comm.all_gather(hull, recv, what=f"{self.what} cp window slices (hop {self.step})").wait()
        return hull


def _my_range(own_hops: dict, s: int, i: int) -> tuple[int, int]:
    """This rank's range of the sender's buffer at distance s (window_hops), (0, 0) when it needs none."""
    ranges = own_hops.get(s)
    return ranges[i] if ranges is not None else (0, 0)


def window_attention_forward(q: torch.Tensor, kv_all: torch.Tensor, comm: TSPComm, cp: TSPComm, *,
                             doc_starts: DocumentLayout, window: int, scale: float, backend: str | None
                             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """cp_ring.cp_attention_forward for a windowed layer (same arguments and results; cp: comm's cp ring)."""
    chunks = _Chunks(cp.size, cp.rank, comm.size, comm.rank, q.shape[1])
    C, i, Ccp = cp.size, cp.rank, chunks.cp_chunk
    hops = group_hops(window, C, comm.size, chunks.c)
    own_hops = dict(window_hops(window, C, comm.size, comm.rank, chunks.c))
    fetch = _Fetch(comm, cp, kv_all, hops, "K/V")
    outs, lses = [], []
    for local, t0, g, base in chunks.queries:  # the own cp chunk of each query chunk, while hop 1 is in flight
        k_own, v_own = kv_prefix(kv_all[base:], t0 - g + chunks.c)
        o, lse = masked_attention_forward(q[:, local], k_own, v_own, q_start=t0 - g,
                                          doc_starts=_chunk_layout(doc_starts, g, Ccp), window=window, scale=scale,
                                          backend=backend)
        outs.append(o)
        lses.append(lse)
    impl = kernels._backend_impl(backend, q)
    own_past = kv_all[:Ccp]  # cp chunk i, past of query chunk 2
    _segment_forward(q, outs, lses, chunks, own_past, i * Ccp, (i + 1) * Ccp, doc_starts, window, scale, impl,
                     backend)
    for s, spans in hops:
        hull, (lo, hi) = fetch.next(), _my_range(own_hops, s, i)
        if hull is None or hi <= lo:
            continue
        received = hull[lo - spans[i][0]:hi - spans[i][0]]
        for offset, g0, g1 in _segments(C, Ccp, (i - s) % C, lo, hi):
            _segment_forward(q, outs, lses, chunks, received[offset:offset + g1 - g0], g0, g1, doc_starts, window,
                             scale, impl, backend)
    return torch.cat(outs, dim=1), lses


def window_attention_backward(dout: torch.Tensor, q: torch.Tensor, kv_all: torch.Tensor, out: torch.Tensor,
                              lses: list[torch.Tensor], kv_grad: RankOrderedKVGrad, comm: TSPComm, cp: TSPComm, *,
                              doc_starts: DocumentLayout, window: int, scale: float, backend: str | None
                              ) -> list[torch.Tensor]:
    """cp_ring.cp_attention_backward for a windowed layer: dq of the two query chunks; this group's dK/dV (its
    own blocks' and the other groups', sent back) added into kv_grad."""
    chunks = _Chunks(cp.size, cp.rank, comm.size, comm.rank, q.shape[1])
    C, i, Ccp, p = cp.size, cp.rank, chunks.cp_chunk, comm.rank
    hops = group_hops(window, C, comm.size, chunks.c)
    own_hops = dict(window_hops(window, C, comm.size, comm.rank, chunks.c))
    fetch = _Fetch(comm, cp, kv_all, hops, "K/V (backward)")
    acc = kernels.accumulation_dtype(q.dtype)
    own_grad = torch.zeros(kv_all.shape, dtype=acc, device=kv_all.device)  # dK/dV of this group's buffer
    dq_chunks = []
    for (local, t0, g, base), lse in zip(chunks.queries, lses):
        n_keys = t0 - g + chunks.c
        k_own, v_own = kv_prefix(kv_all[base:], n_keys)
        dq_c, dk_c, dv_c = masked_attention_backward(dout[:, local], q[:, local], k_own, v_own, out[:, local], lse,
                                                     q_start=t0 - g, doc_starts=_chunk_layout(doc_starts, g, Ccp),
                                                     window=window, scale=scale, backend=backend)
        dq_chunks.append(dq_c.to(acc))
        dk, dv = kv_prefix(own_grad[base:], n_keys)
        dk += dk_c
        dv += dv_c
    impl = kernels._backend_impl(backend, q)
    _segment_backward(dout, q, out, lses, dq_chunks, chunks, kv_all[:Ccp], own_grad[:Ccp], i * Ccp, (i + 1) * Ccp,
                      doc_starts, window, scale, impl, backend)
    returning = None  # (handle, inbox, lo, hi): the previous hop's grads coming home, behind this block
    for h, (s, spans) in enumerate(hops):
        hull, (lo, hi) = fetch.next(), _my_range(own_hops, s, i)
        share = None
        if hull is not None:  # this rank's grads of the hull, summed over the group onto slice p (reduce-scatter)
            grad = torch.zeros(hull.shape, dtype=acc, device=kv_all.device)
            if hi > lo:
                start = spans[i][0]
                for offset, g0, g1 in _segments(C, Ccp, (i - s) % C, lo, hi):
                    k0 = lo - start + offset
                    _segment_backward(dout, q, out, lses, dq_chunks, chunks, hull[k0:k0 + g1 - g0],
                                      grad[k0:k0 + g1 - g0], g0, g1, doc_starts, window, scale, impl, backend)
            share = grad.new_empty((spans[i][1], *grad.shape[1:]))
            comm.reduce_scatter(share, grad, what=f"dK/dV cp window slices (hop {h + 1})").wait()
        if returning is not None:
            _add_returned(own_grad, *returning)
        sent_start, m = spans[(i + s) % C]  # the slice this rank sent at this hop: its grads come back
        sent_lo, sent_hi = sent_start + p * m, sent_start + (p + 1) * m
        inbox = own_grad.new_empty((m, *own_grad.shape[1:])) if m else None
        handle = cp.shift_exchange(share, inbox, -s, GRAD_TAG,
                                   what=f"dK/dV cp hop {h + 1}/{len(hops)} (window, distance {s})")
        returning = (handle, inbox, sent_lo, sent_hi)
    if returning is not None:
        _add_returned(own_grad, *returning)
    dk, dv = kv_prefix(own_grad.to(kv_all.dtype), own_grad.shape[0])
    kv_grad.add(dk, dv)
    return [d.to(q.dtype) for d in dq_chunks]


def _add_returned(own_grad: torch.Tensor, handle, inbox: torch.Tensor | None, lo: int, hi: int) -> None:
    handle.wait()
    if inbox is not None:
        own_grad[lo:hi] += inbox
