"""ds_tsp.core.layers.attention.varlen: packed documents in one varlen kernel call per chunk.

No GPU here, so the varlen kernels are replaced by `reference_varlen_*` below: a pure-torch, segment-by-segment
definition of what flash kernels' varlen entry points compute (causal aligned bottom-right inside each segment,
window (left, right)). Checked on the CPU:
  (a) the arguments (cumulative lengths, max lengths, window) describe exactly the document/window mask, for random
      packed layouts, every zigzag chunk at D = 1..4, with and without sliding windows: the same (query, key)
      pairs as document_attention's decomposition and as the dense definition;
  (b) the reference run on those arguments equals the decomposition in float64 (out, lse, dq, dk, dv), through both
      adapters (flash-attn 2.7 / 2.5 signatures, torch's aten op) and both LSE layouts;
  (c) the launch count per chunk: the decomposition's kernel calls vs one varlen call;
  and that a step reads nothing back from the device, and the real aten varlen op's meta kernel takes the arguments.
"""
from __future__ import annotations

import random

import pytest
import torch
from sync_counter import SyncCounter
from test_document_attention import SCALE, dense_mask, make_inputs

from ds_tsp.core.layers.attention import kernels, varlen
from ds_tsp.core.layers.attention import masked as document_attention
from ds_tsp.core.tokens.zigzag import zigzag_chunks

# ----------------------------------------------------------------------------------------------------------------
# the reference varlen call (what a flash varlen kernel computes), in float64


def _spans(cu):
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _visible(nq, nk, left):
    """[nq, nk] mask of one segment: row i sits at key position i + nk - nq (bottom-right), sees keys <= it and,
    with a window, >= it - left."""
    pos = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    return (j <= pos) & ((j >= pos - left) if left >= 0 else True)


def reference_varlen_forward(q, k, v, cu_q, cu_k, scale, left):
    """out [total_q, Hq, d], lse [Hq, total_q] (natural log)."""
    g = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"))
    for (q0, q1), (k0, k1) in zip(_spans(cu_q), _spans(cu_k)):
        if q1 == q0:
            continue
        kk, vv = k[k0:k1].repeat_interleave(g, 1), v[k0:k1].repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
        s = s.masked_fill(~_visible(q1 - q0, k1 - k0, left), float("-inf"))
        lse[:, q0:q1] = s.logsumexp(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    return out, lse


def reference_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, left):
    """Flash-style backward from the saved out and lse: P = exp(S - lse), dS = P * (dP - rowsum(dO * O))."""
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(_spans(cu_q), _spans(cu_k)):
        if q1 == q0:
            continue
        kk, vv = k[k0:k1].repeat_interleave(g, 1), v[k0:k1].repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
        p = torch.exp(s - lse[:, q0:q1, None]) * _visible(q1 - q0, k1 - k0, left)
        do, o = dout[q0:q1], out[q0:q1]
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * o).sum(-1).t()[:, :, None])
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        n = k1 - k0
        dk[k0:k1] = (torch.einsum("hqk,qhd->khd", ds, q[q0:q1]) * scale).reshape(n, hkv, g, -1).sum(2)
        dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, do).reshape(n, hkv, g, -1).sum(2)
    return dq, dk, dv


# ---- fakes of the two entry points, with the real signatures, on top of the reference ----------------------------

CALLS = []


def _check(q, cu_q, cu_k, max_q, max_k):
    assert q.shape[-1] % 8 == 0 and cu_q.dtype == cu_k.dtype == torch.int32
    assert max_q == max(b - a for a, b in _spans(cu_q)) and max_k == max(b - a for a, b in _spans(cu_k))


def aten_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                 scale=None, window_size_left=None, window_size_right=None):
    CALLS.append("forward")
    _check(query, cum_seq_q, cum_seq_k, max_q, max_k)
    assert dropout_p == 0.0 and is_causal and not return_debug_mask and window_size_right in (0, -1)
    out, lse = reference_varlen_forward(query, key, value, cum_seq_q, cum_seq_k, scale, window_size_left)
    return out, lse, torch.empty(2), torch.empty(()), torch.empty(0)


def aten_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                  is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    CALLS.append("backward")
    _check(query, cum_seq_q, cum_seq_k, max_q, max_k)
    assert logsumexp.shape == (query.shape[1], query.shape[0])
    return reference_varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, scale,
                                     window_size_left)


def _padded(lse, cu_q, max_q):
    """[H, total_q] -> [segments, H, max_q]: the per-segment padded layout of older flash-attn."""
    spans = _spans(cu_q)
    raw = lse.new_zeros(len(spans), lse.shape[0], max_q)
    for i, (a, b) in enumerate(spans):
        raw[i, :, :b - a] = lse[:, a:b]
    return raw


def _unpadded(raw, cu_q):
    return torch.cat([raw[i, :, :b - a] for i, (a, b) in enumerate(_spans(cu_q))], dim=1)


class FlashAttn27:
    @staticmethod
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                   seqused_k=None, zero_tensors=False):
        CALLS.append("forward")
        _check(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert causal and dropout_p == 0.0 and softcap == 0.0 and not return_softmax
        out, lse = reference_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_size_left)
        return out, lse, None, torch.empty(2)

    @staticmethod
    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                    window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                    zero_tensors=False):
        CALLS.append("backward")
        grads = reference_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                          window_size_left)
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)


class FlashAttn25:
    """8 outputs, window_size as a tuple, LSE padded per segment [segments, H, max_seqlen_q]."""

    @staticmethod
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size, alibi_slopes, return_softmax, block_table):
        CALLS.append("forward")
        _check(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse = reference_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_size[0])
        return out, q, k, v, out, _padded(lse, cu_seqlens_q, max_seqlen_q), None, torch.empty(2)

    @staticmethod
    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    alibi_slopes, deterministic, rng_state=None):
        CALLS.append("backward")
        assert softmax_lse.shape == (len(_spans(cu_seqlens_q)), q.shape[1], max_seqlen_q)
        grads = reference_varlen_backward(dout, q, k, v, out, _unpadded(softmax_lse, cu_seqlens_q), cu_seqlens_q,
                                          cu_seqlens_k, softmax_scale, window_size[0])
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)


ADAPTERS = {"aten": lambda: varlen.AtenVarlen(ops=(aten_forward, aten_backward)),
            "flash_attn_2.7": lambda: varlen.FlashAttnVarlen(module=FlashAttn27),
            "flash_attn_2.5": lambda: varlen.FlashAttnVarlen(module=FlashAttn25)}


@pytest.fixture
def packed_math(monkeypatch):
    """backend='math' routed through a varlen adapter (the CPU backends have none): returns a setter."""
    def use(name):
        monkeypatch.setitem(varlen.ADAPTERS, "math", ADAPTERS[name]())
    CALLS.clear()
    return use


# ----------------------------------------------------------------------------------------------------------------
# layouts


def random_layouts(rng, B, S):
    rows = []
    for _ in range(B):
        cuts = rng.sample(range(1, S), rng.randint(0, min(12, S - 1)))
        rows.append((0,) + tuple(sorted(cuts)))
    if B > 1 and rng.random() < 0.3:
        rows[-1] = rows[0]
    return rows


def chunks(D, c):
    """(q_start, key_len) of every zigzag chunk of a sequence of 2*D*c tokens, over all ranks."""
    return [(g * c, (g + 1) * c) for p in range(D) for g in zigzag_chunks(D, p)]


def _cut(layouts, key_len):
    return tuple(tuple(s for s in row if s < key_len) for row in layouts)


# ---- (a) the arguments describe the document / window mask ------------------------------------------------------


def varlen_pairs(p, B, Lq, Lk, q_start):
    """(row, query position, key position) pairs a varlen call with plan `p` computes."""
    pairs, q0, k0 = set(), 0, 0
    for nq, nk in zip(p.seq_q, p.seq_k):
        vis = _visible(nq, nk, p.window[0])
        for i, j in vis.nonzero().tolist():
            b, t = divmod(q0 + i, Lq)
            kb, s = divmod(k0 + j, Lk)
            assert kb == b, "a segment crosses batch rows"
            pairs.add((b, q_start + t, s))
        q0, k0 = q0 + nq, k0 + nk
    return pairs


def decomposition_pairs(layouts, window, q_start, Lk):
    pairs = []
    for b, starts in enumerate(layouts):
        for blk in document_attention._blocks(starts, window, q_start, Lk):
            for t in range(blk.t0, blk.t1):
                i = t - blk.t0
                if blk.flip:  # both orders reversed: query t sees keys k0 + i .. k1 - 1
                    lo, hi = blk.k0 + i, blk.k1
                else:  # a causal prefix block: query i sees its first q_start + i + 1 keys
                    lo, hi = blk.k0, blk.k0 + document_attention._block_q_start(blk) + i + 1
                pairs += [(b, t, s) for s in range(lo, hi)]
    assert len(pairs) == len(set(pairs)), "a (query, key) pair computed twice"
    return set(pairs)


@pytest.mark.parametrize("D", [1, 2, 3, 4])
def test_plan_matches_the_decomposition(D):
    rng = random.Random(D)
    checked = 0
    for trial in range(25):
        B, c = rng.randint(1, 3), rng.randint(2, 7)
        layouts = random_layouts(rng, B, 2 * D * c)
        window = rng.choice([None, 1, 2, 3, 5, 8, 40])
        for q_start, Lk in chunks(D, c):
            rows = _cut(layouts, Lk)
            p = varlen.plan(rows, window, q_start, Lk, torch.device("cpu"))
            seq_q, seq_k = varlen.segments(rows, window, q_start, Lk)
            assert sum(seq_q) == B * (Lk - q_start) and sum(seq_k) == B * Lk
            if p is None:  # only when no document holds two queries of the chunk
                assert max(seq_q) < 2
                continue
            assert (p.seq_q, p.seq_k) == (seq_q, seq_k)
            assert p.cu_q.tolist() == [sum(seq_q[:i]) for i in range(len(seq_q) + 1)]
            assert p.cu_k.tolist() == [sum(seq_k[:i]) for i in range(len(seq_k) + 1)]
            assert (p.max_q, p.max_k) == (max(seq_q), max(seq_k))
            assert p.window == ((-1, -1) if window is None else (window - 1, 0))
            dense = {(b, q_start + t, s) for b in range(B) for t, s in
                     dense_mask(rows[b], window, q_start, Lk).nonzero().tolist()}
            assert varlen_pairs(p, B, Lk - q_start, Lk, q_start) == dense, (rows, window, q_start)
            if document_attention.needs_masking(rows, window, Lk):
                assert decomposition_pairs(rows, window, q_start, Lk) == dense
            checked += 1
    assert checked > 40


def test_plan_is_cached_per_layout():
    rows = ((0, 5, 9),)
    a = varlen.plan(rows, 3, 4, 12, torch.device("cpu"))
    assert varlen.plan(rows, 3, 4, 12, torch.device("cpu")) is a  # later layers reuse it
    assert varlen.plan(rows, None, 4, 12, torch.device("cpu")) is not a


# ---- (b) numerics: the reference varlen call on those arguments == the decomposition ----------------------------


def _both(q, k, v, dout, **kw):
    out, lse = document_attention.masked_attention_forward(q, k, v, **kw)
    return (out, lse) + document_attention.masked_attention_backward(dout, q, k, v, out, lse, **kw)


@pytest.mark.parametrize("name", list(ADAPTERS))
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
def test_varlen_equals_decomposition_float64(name, heads, packed_math):
    rng = random.Random(7)
    runs = 0
    for D in (1, 2, 4):
        for _ in range(4):
            B, c = rng.randint(1, 3), rng.randint(3, 6)
            layouts = random_layouts(rng, B, 2 * D * c)
            window = rng.choice([None, 2, 3, 7])
            for q_start, Lk in chunks(D, c):
                rows = _cut(layouts, Lk)
                if varlen.plan(rows, window, q_start, Lk, torch.device("cpu")) is None:
                    continue
                q, k, v, dout = make_inputs(B, Lk - q_start, q_start, *heads, seed=runs)
                kw = dict(q_start=q_start, doc_starts=rows, window=window, scale=SCALE)
                want = _both(q, k, v, dout, backend="cpu_flash", **kw)  # no adapter: the decomposition
                packed_math(name)
                n_calls = len(CALLS)
                got = _both(q, k, v, dout, backend="math", **kw)
                masked = document_attention.needs_masking(rows, window, Lk)  # else the plain kernel runs
                assert len(CALLS) - n_calls == (2 if masked else 0)  # one varlen forward, one backward
                for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                    assert a.shape == b.shape and a.dtype == b.dtype, label
                    err = (a - b).abs().max().item() if a.numel() else 0.0
                    assert err < 1e-12, (label, err, rows, window, q_start)
                runs += 1
    assert runs > 10


def test_no_varlen_on_cpu_backends():
    assert varlen.adapter("cpu_flash") is None and varlen.adapter("math") is None
    if kernels._flash_attn_module() is None:
        assert varlen.adapter("flash_attn") is None
    assert isinstance(varlen.adapter("aten_flash"), varlen.AtenVarlen)  # this torch has the op and window args


# ---- (c) launch count ---------------------------------------------------------------------------------------------


class _Counting:
    def __init__(self, impl):
        self.impl, self.calls = impl, 0

    def forward(self, *a, **kw):
        self.calls += 1
        return self.impl.forward(*a, **kw)

    def backward(self, *a, **kw):
        self.calls += 1
        return self.impl.backward(*a, **kw)


def launch_counts(monkeypatch, D, S, docs, window, seed=0):
    """Per chunk of every rank: (documents with queries in it, kernel calls of the decomposition, of the varlen
    path), forward + backward, one row of `docs` documents."""
    rng = random.Random(seed)
    rows = [(0,) + tuple(sorted(rng.sample(range(1, S), docs - 1)))]
    counter = _Counting(kernels._IMPLS["cpu_flash"])
    monkeypatch.setitem(kernels._IMPLS, "cpu_flash", counter)
    monkeypatch.setitem(varlen.ADAPTERS, "math", ADAPTERS["aten"]())
    result = []
    for q_start, Lk in chunks(D, S // (2 * D)):
        r = _cut(rows, Lk)
        q, k, v, dout = make_inputs(1, Lk - q_start, q_start, 2, 1)
        kw = dict(q_start=q_start, doc_starts=r, window=window, scale=SCALE)
        counter.calls, CALLS[:] = 0, []
        _both(q, k, v, dout, backend="cpu_flash", **kw)
        _both(q, k, v, dout, backend="math", **kw)
        n_docs = sum(n > 0 for n in varlen.segments(r, window, q_start, Lk)[0])
        result.append((n_docs, counter.calls, len(CALLS)))
    return result


@pytest.mark.parametrize("window", [None, 16])
def test_launch_count_200_documents(monkeypatch, window):
    counts = launch_counts(monkeypatch, D=4, S=4096, docs=200, window=window)
    assert all(n == 2 for _, _, n in counts)  # varlen: one forward and one backward call per chunk
    # the decomposition: at least one forward and one backward kernel call per document (tile) in the chunk
    assert all(calls >= 2 * docs for docs, calls, _ in counts), counts
    assert sum(calls for _, calls, _ in counts) > 20 * sum(n for _, _, n in counts)


# ---- host syncs and the real op's meta kernel ------------------------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_real_aten_varlen_op_on_meta_and_no_host_sync(heads, monkeypatch):
    """torch's own _flash_attention_forward / _backward, dispatched to their meta kernels, through document
    attention: names, positions and returned layouts as the adapter uses them; and once the plan exists (the
    first layer of a step), a layer reads nothing back from the device."""
    monkeypatch.setitem(varlen.ADAPTERS, "math", varlen.AtenVarlen())
    varlen.plan.cache_clear()  # a fresh step
    meta = torch.device("meta")
    Lq, q_start, Hq, Hkv = 16, 17, *heads
    q = torch.empty(2, Lq, Hq, 12, dtype=torch.bfloat16, device=meta)  # head_dim 12: padded to 16
    k = v = torch.empty(2, q_start + Lq, Hkv, 12, dtype=torch.bfloat16, device=meta)
    kw = dict(q_start=q_start, doc_starts=[(0, 5, 20, 27), (0, 30)], window=4, scale=SCALE, backend="math")
    with SyncCounter() as first:
        out, lse, *grads = _both(q, k, v, q, **kw)
    assert out.shape == q.shape and lse.shape == (2, Hq, Lq) and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.device == meta for g in grads)
    assert first.events and all("varlen.py" in e.where and "_to_device" in e.where for e in first.events), \
        first.events  # building the plan: the cumulative lengths, one copy
    with SyncCounter() as later:
        _both(q, k, v, q, **kw)
    assert not later.events, later.events
