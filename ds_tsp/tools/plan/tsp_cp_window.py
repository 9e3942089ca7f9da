"""The cp ring of sliding-window layers in ds-tsp plan: only the keys a window reaches travel
(ds_tsp.core.layers.attention.cp_window).

A layer whose window hides some key of the padded sequence posts, per head block, only the ring distances some
group needs (cp_window.group_hops), each carrying the hull its receiving group's windows reach, split in D slices
(one per TSP rank: each key crosses nodes once) and all-gathered over TSP on arrival: forward the K/V slice each
rank sends; backward the same K/V again plus the dK/dV of the slice it received (reduce-scattered over TSP first),
sent back (accumulation dtype). The hulls differ between cp groups (the first and last have fewer neighbours), so
the bytes are given per rank; the plan reports the busiest. Intra-node (TSP) bytes per rank: the slices' gathers
(forward, backward, the replay) and the dK/dV reduce-scatters (`intra_gather`, `intra_scatter`). The
attention a windowed layer's hops run behind is the exact count of (query, key) pairs of that rank's own blocks and
received ranges (window rule, no documents).
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.core.layers.attention.cp_window import hop_elements, query_starts, uses_window_path, window_hops
from ds_tsp.core.shape.model_shape import ModelShape


@dataclass(frozen=True)
class WindowRing:
    """The windowed layers' share of one step's cp ring (all zero when no layer's window hides a key). Per rank
    lists are indexed cp-major: cp rank i, TSP rank p at i * D + p."""

    layers: int  # windowed layers (the others take cp_ring's pass-KV ring)
    fwd_bytes: tuple[int, ...]  # per rank, summed over the windowed layers and head blocks
    bwd_bytes: tuple[int, ...]  # K/V again + dK/dV back; activation checkpointing's replayed forward included
    hop_calls: tuple[int, ...]  # exchanges per rank and step (forward), over the windowed layers and head blocks
    pairs: tuple[int, ...]  # (query, key) pairs per rank and step the hops run behind (forward, per head block)
    intra_gather: tuple[int, ...] = ()  # per rank: TSP all-gather bytes of the received slices (all passes)
    intra_scatter: tuple[int, ...] = ()  # per rank: TSP reduce-scatter bytes of their dK/dV


def window_ring(model: ModelShape, seq_padded: int, cp: int, tsp: int, kv_token_bytes: int, grad_token_bytes: int,
                *, checkpointing: bool, layer_ids: range | None = None) -> WindowRing:
    """kv_token_bytes / grad_token_bytes: one token of a head block's K/V (B x 2 nkv_b x d) in the K/V and the
    accumulation dtype; layer_ids: the decoder layers counted (a pipeline stage's; default every layer)."""
    chunk = seq_padded // (2 * cp * tsp)
    ranks = cp * tsp
    fwd, bwd, calls, pairs, layers = [0] * ranks, [0] * ranks, [0] * ranks, [0] * ranks, 0
    gathers, scatters = [0] * ranks, [0] * ranks
    for layer in (range(model.num_layers) if layer_ids is None else layer_ids) if cp > 1 else ():  # cp 1: no ring
        window = model.layer_window(layer)
        if not uses_window_path(window, seq_padded):
            continue
        layers += 1
        n_calls, sent, gathered = hop_elements(window, cp, tsp, chunk)
        passes = 2 if checkpointing else 1  # backward's K/V again (+ the replayed forward)
        for i, p in ((i, p) for i in range(cp) for p in range(tsp)):
            k = i * tsp + p
            received = gathered[i] // tsp  # the slice this rank received: its dK/dV go back
            fwd[k] += tsp * sent[i] * kv_token_bytes  # every head block of the layer
            bwd[k] += tsp * (passes * sent[i] * kv_token_bytes + received * grad_token_bytes)
            calls[k] += tsp * n_calls[i]
            pairs[k] += _overlapped_pairs(window, cp, tsp, chunk, i, p, window_hops(window, cp, tsp, p, chunk))
            gathers[k] += tsp * (1 + passes) * (tsp - 1) * received * kv_token_bytes
            scatters[k] += tsp * (tsp - 1) * received * grad_token_bytes
    return WindowRing(layers, tuple(fwd), tuple(bwd), tuple(calls), tuple(pairs), tuple(gathers), tuple(scatters))


def _size(r: tuple[int, int]) -> int:
    return r[1] - r[0]


def _overlapped_pairs(window: int, cp: int, tsp: int, chunk: int, i: int, p: int, hops) -> int:
    """(query, key) pairs of rank (i, p) the hops run behind: its own group's blocks (hop 1 is in flight) and every
    received range (the next hop is in flight)."""
    cp_chunk = tsp * chunk
    starts = query_starts(cp, i, tsp, p, chunk)
    own = (i * cp_chunk, (2 * cp - 1 - i) * cp_chunk)
    total = sum(_own_chunk_pairs(t0 - g, chunk, window) for t0, g in zip(starts, own))
    total += _pairs(starts[1], chunk, own[0], own[0] + cp_chunk, window)  # query chunk 2 x own cp chunk i
    for s, ranges in hops:
        lo, hi = ranges[i]
        r = (i - s) % cp
        for base, g in ((0, r * cp_chunk), (cp_chunk, (2 * cp - 1 - r) * cp_chunk)):
            a, b = max(lo, base), min(hi, base + cp_chunk)
            if a < b:
                total += sum(_pairs(t0, chunk, g + a - base, g + b - base, window) for t0 in starts)
    return total


def _own_chunk_pairs(x0: int, n: int, window: int) -> int:
    """Sum over x in [x0, x0 + n) of min(w, x + 1): causal keys in the window from the chunk's start."""
    ramp_end = min(x0 + n, window)  # x + 1 <= w
    ramp = (x0 + 1 + ramp_end) * (ramp_end - x0) // 2 if ramp_end > x0 else 0
    return ramp + max(0, x0 + n - max(x0, window)) * window


def _pairs(t0: int, n: int, g0: int, g1: int, window: int) -> int:
    """Sum over queries t in [t0, t0 + n) of the keys of [g0, g1) in t's window (g1 <= t0, or none)."""
    if g1 > t0:
        return 0
    full_end = min(t0 + n, g0 + window)  # queries t < g0 + w see all of [g0, g1)
    total = max(0, full_end - t0) * (g1 - g0)
    u0, u1 = max(t0, g0 + window), min(t0 + n, g1 + window - 1)  # then g1 - (t - w + 1) keys each
    if u1 > u0:
        first, last = g1 - (u0 - window + 1), g1 - (u1 - 1 - window + 1)
        total += (first + last) * (u1 - u0) // 2
    return total
