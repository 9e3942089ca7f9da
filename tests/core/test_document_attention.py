"""ds_tsp.core.layers.attention.masked against a dense float64 reference (explicit [Lq, Lk] document / window mask,
softmax in float64, autograd for grads).

Tolerances: float64 1e-12 relative (norm-wise; measured <= 1.1e-14), float32 1e-5 (measured 3e-7), bfloat16 3e-2
(measured 5e-3). The fast path must be bitwise equal
to ds_tsp.core.layers.attention.kernels; attention must never cross a document boundary or the window (bitwise-unchanged outputs,
exactly-zero gradients).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tsp.core.layers.attention import kernels
from ds_tsp.core.layers.attention.masked import masked_attention_backward, masked_attention_forward, needs_masking

BACKENDS = ["cpu_flash", "math"]
D = 8
SCALE = D ** -0.5


# ----------------------------------------------------------------------------------------------------------------
# reference


def dense_mask(starts, window, q_start, Lk):
    """Boolean [Lq, Lk]: query t sees key s iff same document, s <= t and (window) s > t - window."""
    doc = torch.zeros(Lk, dtype=torch.long)
    for s in starts[1:]:
        doc[s:] += 1  # starts >= Lk slice nothing
    t = torch.arange(q_start, Lk)[:, None]
    s = torch.arange(Lk)[None, :]
    visible = (s <= t) & (doc[s] == doc[t])
    if window is not None:
        visible &= s > t - window
    return visible


def dense_attention(q, k, v, doc_starts, window, q_start, scale):
    B, Lq, Hq, _ = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    kk, vv = (x.repeat_interleave(Hq // Hkv, dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    mask = torch.stack([dense_mask(doc_starts[b], window, q_start, Lk) for b in range(B)])  # [B, Lq, Lk]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), vv)


def reference(q, k, v, dout, doc_starts, window, q_start):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = dense_attention(q, k, v, doc_starts, window, q_start, SCALE)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def make_inputs(B, Lq, q_start, Hq, Hkv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    Lk = q_start + Lq
    q = torch.randn(B, Lq, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Lk, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Lk, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, Lq, Hq, D, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def rel_err(a, b):
    """Norm-wise relative error; absolute where the reference is exactly zero (window 1: dq = dk = 0)."""
    a, b = a.double(), b.double()
    ref = b.norm().item()
    return (a - b).norm().item() / (ref if ref > 0 else 1.0)


def run(backend, doc_starts, window, q_start, Lq, Hq=4, Hkv=2, dtype=torch.float64, seed=0):
    """Errors of (out, dq, dk, dv) vs the dense reference, computed from the same (rounded) inputs."""
    q, k, v, dout = make_inputs(len(doc_starts), Lq, q_start, Hq, Hkv, dtype, seed)
    kw = dict(q_start=q_start, doc_starts=doc_starts, window=window, scale=SCALE, backend=backend)
    out, lse = masked_attention_forward(q, k, v, **kw)
    dq, dk, dv = masked_attention_backward(dout, q, k, v, out, lse, **kw)
    for name, got, like in (("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert got.shape == like.shape and got.dtype == dtype, (name, got.shape, got.dtype)
    assert lse.shape == (len(doc_starts), Hq, Lq)
    refs = reference(q, k, v, dout, doc_starts, window, q_start)
    return {n: rel_err(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), refs)}


# ----------------------------------------------------------------------------------------------------------------
# hand-picked layouts: (doc_starts, window, q_start, Lq)

CASES = [
    ([(0, 5, 11)], None, 0, 16),                         # three documents
    ([(0, 5, 11)], 3, 0, 16),                            # ... with a window smaller than the documents
    ([(0, 1, 2, 3, 9, 10)], None, 0, 12),                # documents of length 1
    ([(0, 1, 2, 3, 9, 10)], 3, 0, 12),
    ([(0, 4, 9)], 1, 0, 12),                             # window 1: only self
    ([(0, 7)], 100, 0, 16),                              # window larger than Lk
    ([(0, 7)], 5, 0, 16),                                # window larger than the first document only
    ([(0,)], 4, 0, 16),                                  # one document, window only
    ([(0, 10, 30, 33, 40)], None, 32, 16),               # zigzag-like chunk: query chunk mid-sequence
    ([(0, 10, 30, 33, 40)], 3, 32, 16),
    ([(0, 10, 30, 33, 40)], 7, 32, 16),                  # pieces start mid-tile
    ([(0, 32, 40)], 5, 32, 16),                          # a document starts exactly at q_start
    ([(0, 20)], 6, 32, 16),                              # chunk inside a document that began in earlier keys
    ([(0,)], 6, 32, 16),
    ([(0, 47)], None, 32, 16),                           # last query is its own document
    ([(0, 5, 60, 99)], 4, 32, 16),                       # starts >= Lk are ignored
    ([(0, 3, 9), (0, 12), (0, 3, 9), (0,)], 4, 0, 16),  # rows differ; rows 0 and 2 share a (non-contiguous) layout
    ([(0, 3, 9), (0, 3, 9), (0, 20, 41)], None, 32, 16),  # contiguous group + another layout
    ([(0, 3, 9), (0, 3, 9), (0, 20, 41)], 9, 32, 16),
    ([(0, 2)], None, 0, 1),                              # a single query (start 2 >= Lk ignored)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-w{c[1]}-qs{c[2]}-Lq{c[3]}".replace(" ", ""))
def test_float64_exact(backend, heads, case):
    doc_starts, window, q_start, Lq = case
    errs = run(backend, doc_starts, window, q_start, Lq, *heads)
    assert max(errs.values()) < 1e-12, errs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(6))
def test_float64_random_splits(backend, seed):
    """Seeded random document splits of a 48-key row, several rows, chunks at q_start 0 / 17 / 32."""
    g = torch.Generator().manual_seed(seed)
    Lk = 48
    rows = []
    for _ in range(3):
        n_cuts = int(torch.randint(0, 8, (1,), generator=g))
        rows.append((0,) + tuple(sorted(set(torch.randint(1, Lk, (n_cuts,), generator=g).tolist()))))
    for window in (None, 1, 3, 8, 64):
        for q_start in (0, 17, 32):
            errs = run(backend, rows, window, q_start, Lk - q_start, seed=seed)
            assert max(errs.values()) < 1e-12, (rows, window, q_start, errs)


@st.composite
def layouts(draw):
    Lk = draw(st.integers(1, 40))
    q_start = draw(st.integers(0, Lk - 1))
    B = draw(st.integers(1, 3))
    rows = [(0,) + tuple(sorted(draw(st.sets(st.integers(1, Lk + 3), max_size=8)))) for _ in range(B)]
    if B > 1 and draw(st.booleans()):
        rows[-1] = rows[0]  # rows sharing a layout
    window = draw(st.one_of(st.none(), st.integers(1, Lk + 2)))
    heads = draw(st.sampled_from([(4, 2), (4, 1), (2, 2)]))
    return rows, window, q_start, Lk - q_start, heads


@settings(max_examples=60, derandomize=True, deadline=None)
@given(layouts(), st.sampled_from(BACKENDS))
def test_float64_hypothesis(layout, backend):
    rows, window, q_start, Lq, heads = layout
    errs = run(backend, rows, window, q_start, Lq, *heads)
    assert max(errs.values()) < 1e-12, errs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [CASES[1], CASES[10], CASES[16]], ids=["w3", "zigzag-w7", "rows"])
def test_float32(backend, case):
    errs = run(backend, *case, dtype=torch.float32)
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [CASES[1], CASES[10], CASES[16]], ids=["w3", "zigzag-w7", "rows"])
def test_bfloat16(backend, case):
    errs = run(backend, *case, dtype=torch.bfloat16)
    assert max(errs.values()) < 3e-2, errs


# ----------------------------------------------------------------------------------------------------------------
# fast path, isolation, decomposition


@pytest.mark.parametrize("backend", BACKENDS + [None])
@pytest.mark.parametrize("doc_starts, window", [([(0,), (0,)], None), ([(0, 48), (0, 70)], 48), ([(0,), (0,)], 99)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fast_path_bitwise(backend, doc_starts, window, dtype):
    q, k, v, dout = make_inputs(2, 16, 32, 4, 2, dtype)
    assert not needs_masking(doc_starts, window, k.shape[1])
    out, lse = masked_attention_forward(q, k, v, q_start=32, doc_starts=doc_starts, window=window, scale=SCALE,
                                        backend=backend)
    want_out, want_lse = kernels.attention_forward(q, k, v, q_start=32, scale=SCALE, backend=backend)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    grads = masked_attention_backward(dout, q, k, v, out, lse, q_start=32, doc_starts=doc_starts, window=window,
                                      scale=SCALE, backend=backend)
    want = kernels.attention_backward(dout, q, k, v, out, lse, q_start=32, scale=SCALE, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))


def test_needs_masking():
    assert not needs_masking([(0,)], None, 10)
    assert not needs_masking([(0, 10, 12)], 10, 10)  # starts >= key_len ignored, window covers every key
    assert needs_masking([(0,), (0, 5)], None, 10)
    assert needs_masking([(0,)], 9, 10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 4])
def test_no_leak_across_documents(backend, window):
    """Changing another document's keys/values leaves this document's outputs bitwise equal; gradients flowing
    from this document's queries into other documents' keys are exactly zero (and so are those of keys that
    fall outside every window)."""
    doc_starts, q_start, Lq = [(0, 10, 25, 37)], 8, 32  # query chunk 8..39: docs [0,10) [10,25) [25,37) [37,40)
    q, k, v, dout = make_inputs(1, Lq, q_start, 4, 2)
    kw = dict(q_start=q_start, doc_starts=doc_starts, window=window, scale=SCALE, backend=backend)
    out, lse = masked_attention_forward(q, k, v, **kw)
    other = torch.ones(k.shape[1], dtype=torch.bool)
    other[10:25] = False  # keys outside document [10, 25)
    k2, v2 = k.clone(), v.clone()
    k2[:, other] += 3.0
    v2[:, other] -= 5.0
    out2, _ = masked_attention_forward(q, k2, v2, **kw)
    rows = slice(10 - q_start, 25 - q_start)
    assert torch.equal(out[:, rows], out2[:, rows])
    assert not torch.equal(out, out2)  # the other documents did change

    d_only = torch.zeros_like(dout)
    d_only[:, rows] = dout[:, rows]
    dq, dk, dv = masked_attention_backward(d_only, q, k, v, out, lse, **kw)
    assert torch.count_nonzero(dk[:, other]) == 0 and torch.count_nonzero(dv[:, other]) == 0
    assert torch.count_nonzero(dq[:, :rows.start]) == 0 and torch.count_nonzero(dq[:, rows.stop:]) == 0
    if window is not None:  # a single query's gradient reaches exactly the keys of its window
        d_one = torch.zeros_like(dout)
        d_one[:, 24 - q_start] = dout[:, 24 - q_start]
        _, dk_w, _ = masked_attention_backward(d_one, q, k, v, out, lse, **kw)
        seen = torch.zeros(k.shape[1], dtype=torch.bool)
        seen[21:25] = True  # query 24, window 4: keys 21..24
        assert torch.count_nonzero(dk_w[:, ~seen]) == 0 and torch.count_nonzero(dk_w[:, seen]) > 0


def test_blocks_are_small_and_batched(monkeypatch):
    """Every kernel call is batched over the rows sharing a layout and never sees more keys than the window
    (own tile) or the document; no call covers the whole [Lq, Lk] block."""
    calls = []
    real = kernels.attention_forward

    def spy(q, k, v, **kw):
        calls.append((q.shape[0], q.shape[1], k.shape[1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(kernels, "attention_forward", spy)
    q, k, v, _ = make_inputs(5, 64, 64, 4, 2)
    doc_starts = [(0, 50, 90)] * 4 + [(0, 100)]
    masked_attention_forward(q, k, v, q_start=64, doc_starts=doc_starts, window=8, scale=SCALE)
    assert calls and all(b in (4, 1) for b, _, _ in calls)
    assert sum(b == 4 for b, _, _ in calls) > 0 and max(lk for _, _, lk in calls) <= 8
    calls.clear()
    masked_attention_forward(q, k, v, q_start=64, doc_starts=doc_starts, window=None, scale=SCALE)
    assert sorted(calls) == [(1, 28, 28), (1, 36, 100), (4, 26, 40), (4, 38, 38)]


def test_empty_query_chunk():
    q, k, v, dout = make_inputs(1, 0, 12, 4, 2)
    kw = dict(q_start=12, doc_starts=[(0, 5)], window=3, scale=SCALE)
    out, lse = masked_attention_forward(q, k, v, **kw)
    assert out.shape == q.shape and lse.shape == (1, 4, 0)
    dq, dk, dv = masked_attention_backward(dout, q, k, v, out, lse, **kw)
    assert dk.shape == k.shape and torch.count_nonzero(dk) == 0 and torch.count_nonzero(dv) == 0


@pytest.mark.parametrize("doc_starts, window, match", [
    ([(0,)], None, "doc_starts has 1 rows"),
    ([(0,), (1, 4)], None, r"doc_starts\[1\] must begin with 0"),
    ([(0,), ()], None, r"doc_starts\[1\] must begin with 0"),
    ([(0, 4, 4), (0,)], None, r"doc_starts\[0\] must be strictly increasing"),
    ([(0, 6, 4), (0,)], None, r"doc_starts\[0\] must be strictly increasing"),
    ([(0, 2.5), (0,)], None, r"doc_starts\[0\] must be a sequence of ints"),
    (None, None, "doc_starts must be"),
    ([(0,), (0,)], 0, "window must be"),
    ([(0,), (0,)], -3, "window must be"),
    ([(0,), (0,)], 2.0, "window must be"),
])
def test_bad_inputs(doc_starts, window, match):
    q, k, v, dout = make_inputs(2, 8, 0, 4, 2)
    kw = dict(q_start=0, doc_starts=doc_starts, window=window, scale=SCALE)
    with pytest.raises(ValueError, match=match):
        masked_attention_forward(q, k, v, **kw)
    with pytest.raises(ValueError, match=match):
        masked_attention_backward(dout, q, k, v, q, torch.zeros(2, 4, 8), **kw)
    if match != "doc_starts has 1 rows":
        with pytest.raises(ValueError, match=match):
            needs_masking(doc_starts, window, 8)

