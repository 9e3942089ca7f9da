"""Causal attention restricted to documents (packed sequences) and an optional sliding window.

Geometry is that of `kernels.attention_forward`: q [B, Lq, Hq, d] holds global positions q_start..q_start+Lq-1,
k, v [B, Lk, Hkv, d] the causal prefix 0..Lk-1 (Lk == q_start + Lq). Row b packs documents starting at the
global positions `doc_starts[b]` (the first is 0; starts >= Lk are ignored). Query t of document [a, next) sees
key s iff

    a <= s <= t        and, when `window` w is not None,        s > t - w   (transformers' `sliding_window`)

No [Lq, Lk] mask or temporary is built. The rule is cut into blocks that the unmasked / causal kernel calls
compute exactly, and blocks of the same queries are merged by log-sum-exp. Each document is tiled into tiles of
w tokens aligned to its start (a single tile without a window, or when w >= the document's length). Query
t = T + x of the tile starting at T sees every key T..t of its own tile and, of the previous tile (keys
T - w + y), those with y > x: an anti-causal triangle. Example w = 5 (# = visible):

                 previous tile       own tile
                 y=0 1  2  3  4      0  1  2  3  4
        x = 0     .  #  #  #  #      #  .  .  .  .
        x = 1     .  .  #  #  #      #  #  .  .  .     own tile: a causal prefix block,
        x = 2     .  .  .  #  #      #  #  #  .  .     attention_forward(q[t0:t1], k[T:t1], q_start=t0 - T)
        x = 3     .  .  .  .  #      #  #  #  #  .
        x = 4     .  .  .  .  .      #  #  #  #  #     previous tile: reversing the order of BOTH its queries
                                                       and keys turns the triangle into a causal block

The query rows of one tile that lie in [q_start, Lk) form a piece [t0, t1) (it may start mid-tile when the query
chunk does). Its reversed block holds the rows with x < w - 1 (the last row of a tile sees nothing before it)
over the keys [t0 - w + 1, T) - the window of the piece's first query, cut at the tile start.

Backward runs the same blocks through `kernels.attention_backward` with the MERGED out / lse sliced to the block
(flipped like it): by the kernels' contract each call returns that block's exact partial gradients, which are
flipped back and added up (dq over the blocks of a row, dk / dv over the blocks that read a key).

Batch rows with the same layout are computed together in one call per block; kernel calls are per tile, so tiny
windows over long chunks mean many small calls (correct, but slow). Where the backend has a varlen entry point
(CUDA: flash-attn, or torch's own flash kernel) the whole chunk is ONE call instead
(ds_tsp/core/layers/attention/varlen.py: same definition, same (out, lse) contract); the decomposition stays for the CPU
and as the reference.
"""
from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch

from ds_tsp.core.layers.attention import kernels, varlen

# DocumentLayout and single_documents: the names the pre-release path ds_tsp.document_attention gave (ds_tsp/_moved.py)
from ds_tsp.core.tokens.documents import DocumentLayout, LayoutCut, document_layout, single_documents  # noqa: F401


class _Block(NamedTuple):
    """Queries [t0, t1) against keys [k0, k1), global positions; `flip`: both taken in reverse order."""
    t0: int
    t1: int
    k0: int
    k1: int
    flip: bool


def needs_masking(doc_starts, window, key_len: int) -> bool:
    """False when plain causal attention over `key_len` keys is exact: single documents, no effective window."""
    _check_window(window)
    return document_layout(doc_starts).cut(key_len).masked(window, key_len)


def masked_attention_forward(q, k, v, *, q_start: int, doc_starts, window: int | None, scale: float,
                             backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Document-masked (and sliding-window) causal attention. Returns (out, lse); see the module doc.
    doc_starts: a DocumentLayout (validated once per step by the caller) or per-row sequences (validated here)."""
    layouts = _check_inputs(q, k, v, q_start, doc_starts, window)
    Lk = k.shape[1]
    if not layouts.masked(window, Lk):
        return kernels.attention_forward(q, k, v, q_start=q_start, scale=scale, backend=backend)
    kernels._backend_impl(backend, q)  # a bad backend must fail even when there are no blocks (Lq == 0)
    packed = _varlen(backend, q, layouts, window, q_start, Lk)
    if packed is not None:
        return varlen.forward(q, k, v, *packed, scale=scale)
    B, Lq, Hq, _ = q.shape
    out = q.new_empty(q.shape)
    lse = torch.empty(B, Hq, Lq, dtype=kernels._lse_dtype(q.dtype), device=q.device)
    for idx, starts in _groups(layouts, q.device):
        qg, kg, vg, og, lg = q[idx], k[idx], v[idx], out[idx], lse[idx]  # views when idx is a slice
        for blk in _blocks(starts, window, q_start, Lk):
            r0, r1 = blk.t0 - q_start, blk.t1 - q_start
            o, l = kernels.attention_forward(
                _cut(qg, r0, r1, blk.flip), _cut(kg, blk.k0, blk.k1, blk.flip), _cut(vg, blk.k0, blk.k1, blk.flip),
                q_start=_block_q_start(blk), scale=scale, backend=backend)
            if blk.flip:  # always follows the causal-prefix block of the same piece: merge into it
                o, l = kernels._merge(og[:, r0:r1], lg[..., r0:r1], o.flip(1), l.flip(2))
            og[:, r0:r1], lg[..., r0:r1] = o, l
        if not isinstance(idx, slice):
            out[idx], lse[idx] = og, lg
    return out, lse


def masked_attention_backward(dout, q, k, v, out, lse, *, q_start: int, doc_starts, window: int | None,
                              scale: float, backend: str | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of masked_attention_forward, given the (out, lse) it returned (same arguments)."""
    pieces = kernels.KVPieces()
    dq = masked_attention_backward_pieces(dout, q, k, v, out, lse, q_start=q_start, doc_starts=doc_starts,
                                          window=window, scale=scale, backend=backend, take_kv=pieces)
    return dq, *pieces.whole()


def masked_attention_backward_pieces(dout, q, k, v, out, lse, *, q_start: int, doc_starts, window: int | None,
                                     scale: float, backend: str | None, take_kv) -> torch.Tensor:
    """masked_attention_backward handing dK / dV to take_kv(key start, dk, dv) (kernels.attention_backward_pieces:
    per key block without masks, whole otherwise); returns dq."""
    layouts = _check_inputs(q, k, v, q_start, doc_starts, window)
    Lk = k.shape[1]
    if not layouts.masked(window, Lk):
        return kernels.attention_backward_pieces(dout, q, k, v, out, lse, q_start=q_start, scale=scale,
                                                 backend=backend, take_kv=take_kv)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (q.shape[0], q.shape[2], q.shape[1]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must have q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be [B, Hq, Lq]")
    kernels._backend_impl(backend, q)
    packed = _varlen(backend, q, layouts, window, q_start, Lk)
    if packed is not None:
        dq, dk, dv = varlen.backward(dout, q, k, v, out, lse, *packed, scale=scale)
        take_kv(0, dk, dv)
        return dq
    acc = kernels.accumulation_dtype(q.dtype)  # a row / key gets up to two partial gradients
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    for idx, starts in _groups(layouts, q.device):
        qg, kg, vg, dog, og, lg = q[idx], k[idx], v[idx], dout[idx], out[idx], lse[idx]
        dqg, dkg, dvg = dq[idx], dk[idx], dv[idx]
        for blk in _blocks(starts, window, q_start, Lk):
            r0, r1, f = blk.t0 - q_start, blk.t1 - q_start, blk.flip
            gq, gk, gv = kernels.attention_backward(
                _cut(dog, r0, r1, f), _cut(qg, r0, r1, f), _cut(kg, blk.k0, blk.k1, f),
                _cut(vg, blk.k0, blk.k1, f), _cut(og, r0, r1, f), _cut(lg, r0, r1, f, dim=2),
                q_start=_block_q_start(blk), scale=scale, backend=backend)
            dqg[:, r0:r1] += _cut(gq, 0, r1 - r0, f)
            dkg[:, blk.k0:blk.k1] += _cut(gk, 0, blk.k1 - blk.k0, f)
            dvg[:, blk.k0:blk.k1] += _cut(gv, 0, blk.k1 - blk.k0, f)
        if not isinstance(idx, slice):
            dq[idx], dk[idx], dv[idx] = dqg, dkg, dvg
    take_kv(0, dk.to(k.dtype), dv.to(v.dtype))
    return dq.to(q.dtype)


def _varlen(backend, q, layouts: LayoutCut, window, q_start, key_len):
    """(adapter, plan) when the backend packs the chunk's documents into one call, else None (decomposition)."""
    name = backend if backend is not None else kernels.select_backend(q.device, q.dtype, head_dim=q.shape[-1])
    impl = varlen.adapter(name)
    if impl is None:
        return None
    key = (window, q_start, q.device)
    if key not in layouts.plans:  # varlen.plan's own cache hashes every start: once per layout and chunk, here
        layouts.plans[key] = varlen.plan(layouts.rows, window, q_start, key_len, q.device)
    plan = layouts.plans[key]
    return None if plan is None else (impl, plan)


# ----------------------------------------------------------------------------------------------------------------
# decomposition


def _blocks(starts, window, q_start, key_len):
    """The blocks of one row layout: per piece its causal-prefix block, then (if any) its reversed block."""
    for a, e in zip(starts, starts[1:] + (key_len,)):
        if e <= q_start:  # the document holds no query of this chunk
            continue
        w = window if window is not None and window < e - a else e - a
        for T in range(a + (max(a, q_start) - a) // w * w, e, w):  # tiles from the one holding the first query
            t0, t1 = max(T, q_start), min(T + w, e)
            yield _Block(t0, t1, T, t1, False)
            t1r = min(t1, T + w - 1)  # rows x < w - 1 see part of the previous tile
            if T > a and t1r > t0:
                yield _Block(t0, t1r, t0 - w + 1, T, True)


def _block_q_start(blk):
    """The kernel's q_start: keys are the block's causal prefix (true reversed too, see module doc)."""
    return (blk.k1 - blk.k0) - (blk.t1 - blk.t0)


def _cut(x, lo, hi, flip, dim=1):
    """x[lo:hi] along `dim`, reversed (a copy) when `flip`."""
    x = x.narrow(dim, lo, hi - lo)
    return x.flip(dim) if flip else x


def _groups(layouts: LayoutCut, device):
    """(rows, starts) per distinct layout; rows is a slice (views, written in place) when they are contiguous."""
    for rows, starts in layouts.groups():
        if rows[-1] - rows[0] + 1 == len(rows):
            yield slice(rows[0], rows[-1] + 1), starts
        else:
            yield _row_index(rows, torch.device(device)), starts


@functools.lru_cache(maxsize=256)
def _row_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`rows` as an index tensor on `device`, built once per layout (not per layer and block) and by fills of
    one-element SLICES: torch.tensor(rows, device=) and `index[i] = r` would each be a blocking host-to-device copy
    on CUDA (an element target copies a host scalar and waits; a slice target is an asynchronous fill)."""
    with torch.inference_mode(False):  # a cached inference tensor would be unusable once autograd records
        index = torch.empty(len(rows), dtype=torch.int64, device=device)
        for i, r in enumerate(rows):
            index[i:i + 1] = r
    return index


# ----------------------------------------------------------------------------------------------------------------
# validation


def _check_inputs(q, k, v, q_start, doc_starts, window) -> LayoutCut:
    """Shapes and window (cheap) every call; the layout only when it is not a DocumentLayout already."""
    kernels._check_shapes(q, k, v, q_start)
    _check_window(window)
    return document_layout(doc_starts, q.shape[0]).cut(k.shape[1])


def _check_window(window):
    if window is None:
        return
    try:
        ok = not isinstance(window, bool) and operator.index(window) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
