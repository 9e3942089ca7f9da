"""Packed documents in ONE kernel call per chunk: the varlen entry points of the CUDA flash kernels.

document_attention's decomposition launches a kernel pair per document tile (hundreds per chunk for a pack of
short documents). A varlen kernel takes every (row, document) piece at once: queries and keys stay packed along
one token axis (q [B*Lq, Hq, d], k and v [B*Lk, Hkv, d]: views when B == 1), cut into segments by cumulative
lengths. Segment i holds the queries of one document in this chunk and the keys the document has so far:

    document [a, e) of row b, e > q_start:   queries [max(a, q_start), e),  keys [a, e)
    keys [0, a) before row b's first such document: a segment with NO queries (cumulative lengths cannot skip
    keys; flash kernels write zero gradients for keys no query reads)

Causal masking aligned bottom-right inside each segment (flash-attn >= 2.1 and torch's vendored copy) is the
document mask; window_size = (w - 1, 0) is the sliding window (key s visible to query t iff t - w < s <= t). So
the call computes exactly what document_attention defines, and `tests/core/test_varlen.py` checks it against the
decomposition with a pure-torch implementation of the varlen call.

Used where the backend has a varlen entry (flash_attn: flash-attn's `_flash_attn_varlen_forward`; aten_flash:
`aten::_flash_attention_forward` with cumulative lengths and window arguments); CPU keeps the decomposition.

The plan (cumulative lengths as int32 device tensors) depends only on the layout, the window and the chunk, so it
is built once per step and cached: later layers and head blocks reuse it. The one host-to-device copy goes
through pinned memory, asynchronously: nothing in a layer waits for the device.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ds_tsp.core.layers.attention.aten import lse_from_backend, signature_problem

from . import kernels


class Plan(NamedTuple):
    seq_q: tuple[int, ...]  # queries per segment (0 for a skipped key range), in packing order
    seq_k: tuple[int, ...]  # keys per segment
    cu_q: torch.Tensor  # int32 [n + 1] on the device: 0, seq_q[0], seq_q[0] + seq_q[1], ...
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    window: tuple[int, int]  # (left, right) as flash kernels take it: (-1, -1) none, (w - 1, 0) window w


def segments(layouts, window, q_start: int, key_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(seq_q, seq_k) of a chunk: rows' documents in order; `layouts` as document_attention validates them."""
    seq_q, seq_k = [], []
    for starts in layouts:
        first = True
        for a, e in zip(starts, starts[1:] + (key_len,)):
            if e <= q_start:  # the document holds no query of this chunk
                continue
            if first and a > 0:
                seq_q.append(0)
                seq_k.append(a)
            first = False
            seq_q.append(e - max(a, q_start))
            seq_k.append(e - a)
    return tuple(seq_q), tuple(seq_k)


@functools.lru_cache(maxsize=64)
def plan(layouts: tuple, window: int | None, q_start: int, key_len: int, device: torch.device) -> Plan | None:
    """The varlen arguments of a chunk, or None where one call cannot express it: no query, or no segment with two
    queries (flash kernels then reinterpret the packed queries as one per sequence, which skipped key ranges
    break)."""
    seq_q, seq_k = segments(layouts, window, q_start, key_len)
    if not seq_q or max(seq_q) < 2:
        return None
    cu_q, cu_k = [0], [0]
    for nq, nk in zip(seq_q, seq_k):
        cu_q.append(cu_q[-1] + nq)
        cu_k.append(cu_k[-1] + nk)
    with torch.inference_mode(False):  # a cached inference tensor would be unusable once autograd records
        cu = _to_device(cu_q + cu_k, device)
    n = len(cu_q)
    return Plan(seq_q, seq_k, cu[:n], cu[n:], max(seq_q), max(seq_k), (-1, -1) if window is None else (window - 1, 0))


def _to_device(values, device):
    host = torch.tensor(values, dtype=torch.int32, device="cpu")
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)  # async: the copy is queued, the host goes on
    return host.to(device)


# ----------------------------------------------------------------------------------------------------------------
# the call: pack, run the adapter, unpack; the segment LSE layouts are converted here and nowhere else


def forward(q, k, v, impl, p: Plan, *, scale: float):
    """(out [B, Lq, Hq, d], lse [B, Hq, Lq]) of the chunk: kernels.attention_forward's contract."""
    B, Lq, _, d = q.shape
    out, raw = impl.forward(_packed(q), _packed(k), _packed(v), p, scale)
    impl.padded_lse = raw.dim() == 3
    return out[..., :d].unflatten(0, (B, Lq)), _lse_rows(raw, p, B, Lq)


def backward(dout, q, k, v, out, lse, impl, p: Plan, *, scale: float):
    """(dq, dk, dv) of `forward`, from the (out, lse) it returned."""
    B, Lq, _, d = q.shape
    Lk = k.shape[1]
    dq, dk, dv = impl.backward(_packed(dout), _packed(q), _packed(k), _packed(v), _packed(out),
                               _lse_raw(lse, p, impl.padded_lse), p, scale)
    return dq[..., :d].unflatten(0, (B, Lq)), dk[..., :d].unflatten(0, (B, Lk)), dv[..., :d].unflatten(0, (B, Lk))


def _packed(x):
    """[B, L, H, d] -> [B*L, H, d8]: head_dim padded to a multiple of 8 (flash kernels need it), unit last stride."""
    x = kernels._pad8(x.flatten(0, 1))
    return x if x.stride(-1) == 1 else x.contiguous()


def _lse_rows(raw, p, B, Lq):
    """The backend's LSE as [B, Hq, Lq]. Layouts: [Hq, total_q] (flash-attn >= 2.6, torch's own kernel) or
    [segments, Hq, >= max_q] padded per segment (older flash-attn, ROCm)."""
    if raw.dim() == 2:
        return raw.unflatten(1, (B, Lq)).transpose(0, 1)
    raw = lse_from_backend(raw, p.max_q)
    seg, off = _row_segments(p)
    return raw[seg, :, off].t().unflatten(1, (B, Lq)).transpose(0, 1)


def _lse_raw(lse, p, padded):
    """[B, Hq, Lq] back in the layout the backend's forward returned."""
    flat = lse.transpose(0, 1).flatten(1)  # [Hq, total_q]: a view of what _lse_rows returned in the first layout
    if not padded:
        return flat if flat.is_contiguous() else flat.contiguous()
    seg, off = _row_segments(p)
    raw = lse.new_zeros(len(p.seq_q), lse.shape[1], p.max_q)
    raw[seg, :, off] = flat.t()
    return raw


def _row_segments(p):
    """(segment, offset in it) of every packed query row, from the device's cumulative lengths: no host data."""
    cu = p.cu_q.long()
    rows = torch.arange(sum(p.seq_q), device=cu.device)
    seg = torch.searchsorted(cu[1:], rows, right=True)  # empty segments end where they start: never chosen
    return seg, rows - cu[seg]


# ----------------------------------------------------------------------------------------------------------------
# adapters: the two varlen entry points


class FlashAttnVarlen:
    """flash-attn 2.x `_flash_attn_varlen_forward` / `_backward`, arguments by name (their signatures changed
    across 2.x: window_size tuple -> window_size_left/right, softcap, block_table; 8 outputs up to 2.6, 4 after)."""

    padded_lse = False

    def __init__(self, module=None):
        self._module = module

    def module(self):
        return self._module or kernels._flash_attn_module()

    def problem(self) -> str | None:
        m = self.module()
        if m is None or not hasattr(m, "_flash_attn_varlen_forward"):
            return "flash-attn has no _flash_attn_varlen_forward"
        return None

    @staticmethod
    def _args(p, scale):
        left, right = p.window
        return dict(kernels._FLASH_STATIC_ARGS, cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k, max_seqlen_q=p.max_q,
                    max_seqlen_k=p.max_k, softmax_scale=scale, causal=True, window_size=p.window,
                    window_size_left=left, window_size_right=right, block_table=None, leftpad_k=None,
                    seqused_k=None, zero_tensors=False)

    def forward(self, q, k, v, p, scale):
        res = kernels._call_by_name(self.module()._flash_attn_varlen_forward, dict(self._args(p, scale), q=q, k=k, v=v))
        return (res[0], res[1]) if len(res) == 4 else (res[0], res[5])

    def backward(self, dout, q, k, v, out, lse, p, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernels._call_by_name(self.module()._flash_attn_varlen_backward,
                              dict(self._args(p, scale), dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq,
                                   dk=dk, dv=dv))
        return dq, dk, dv


class AtenVarlen:
    """torch's `aten::_flash_attention_forward` / `_backward` with cumulative lengths, called by position."""

    FORWARD, BACKWARD = "_flash_attention_forward", "_flash_attention_backward"
    FORWARD_PARAMS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                      "return_debug_mask")
    BACKWARD_PARAMS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                       "max_k", "dropout_p", "is_causal", ("philox_seed", "rng_state"), ("philox_offset", "unused"))
    KEYWORDS = ("scale", "window_size_left", "window_size_right")
    padded_lse = False

    def __init__(self, ops=None):
        self._ops = ops  # (forward, backward) callables; None: torch.ops.aten's

    def _calls(self):
        if self._ops:
            return self._ops
        return tuple(getattr(torch.ops.aten, name).default for name in (self.FORWARD, self.BACKWARD))

    def problem(self) -> str | None:
        return _aten_varlen_problem(self.FORWARD_PARAMS, self.BACKWARD_PARAMS, self.KEYWORDS)

    def forward(self, q, k, v, p, scale):
        res = self._calls()[0](q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, True, False, scale=scale,
                               window_size_left=p.window[0], window_size_right=p.window[1])
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, p, scale):
        unused = torch.empty(0, dtype=torch.int64, device=q.device)  # rng values: read only with dropout
        return self._calls()[1](dout, q, k, v, out, lse, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, True, unused, unused,
                                scale=scale, window_size_left=p.window[0], window_size_right=p.window[1])[:3]


@functools.lru_cache(maxsize=None)
def _aten_varlen_problem(forward_params, backward_params, keywords):
    for name, params, n in ((AtenVarlen.FORWARD, forward_params, 2), (AtenVarlen.BACKWARD, backward_params, 3)):
        packet = getattr(torch.ops.aten, name, None)
        problem = signature_problem(None if packet is None else packet.default._schema, params, keywords, n)
        if problem:
            return f"aten.{name}: {problem}"
    return None


# kernels backend -> its varlen adapter; backends not listed (cpu_flash, math) use the decomposition.
ADAPTERS = {"flash_attn": FlashAttnVarlen(), "aten_flash": AtenVarlen()}


def adapter(backend: str):
    """The varlen adapter of a kernels backend, or None (not provided, or not usable with this install)."""
    impl = ADAPTERS.get(backend)
    return impl if impl is not None and impl.problem() is None else None
