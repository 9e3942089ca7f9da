"""ds_tsp.core.layers.attention.kernels against a dense float64 reference (explicit lower-right causal mask, autograd for grads).

Tolerances: float64 ~1e-12 (measured ~1e-15), float32 1e-5 (measured ~1e-6), bf16/fp16 loose smoke checks.
"""
import pytest
import torch

from ds_tsp.core.layers.attention import kernels
from ds_tsp.core.layers.attention.kernels import attention_backward, attention_forward, select_backend

CPU_BACKENDS = ["math", "cpu_flash"]

# (B, Lq, q_start, Hq, Hkv, d): q_start == 0 (pure diagonal), q_start > 0 (prefix + diagonal), MHA / GQA / MQA,
# odd lengths, Lq < q_start and Lq > q_start, more rows than one math block (256).
CASES = [
    (2, 8, 0, 4, 4, 8),
    (2, 7, 0, 4, 2, 8),
    (2, 5, 6, 4, 2, 8),
    (1, 9, 3, 4, 1, 6),
    (2, 3, 11, 4, 1, 4),
    (1, 1, 5, 2, 2, 4),
    (1, 261, 270, 4, 2, 4),
]


def dense_attention(q, k, v, q_start, scale):
    """Textbook causal attention with an explicit boolean [Lq, Lk] mask (lower-right aligned)."""
    B, Lq, Hq, d = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(Hq // Hkv, dim=2)
    vv = v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    q_pos = q_start + torch.arange(Lq)
    visible = torch.arange(Lk)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), vv)


def make_inputs(case, seed=0):
    B, Lq, q_start, Hq, Hkv, d = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, Hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, q_start + Lq, Hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, q_start + Lq, Hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(B, Lq, Hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def reference_grads(q, k, v, dout, q_start, scale):
    """Dense float64 output and (dq, dk, dv) by autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = dense_attention(q, k, v, q_start, scale)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def run_case(backend, case, dtype):
    q, k, v, dout = (t.to(dtype) for t in make_inputs(case))
    q_start, scale = case[2], case[5] ** -0.5
    ref_out, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, dout, q_start, scale)
    out, lse = attention_forward(q, k, v, q_start=q_start, scale=scale, backend=backend)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, q_start=q_start, scale=scale, backend=backend)
    for name, got, like in (("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert got.shape == like.shape and got.dtype == dtype, (name, got.shape, got.dtype)
    return {name: rel_err(got, want) for name, got, want in
            (("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv))}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_Lq{}_qs{}_Hq{}_Hkv{}_d{}".format(*c))
def test_float64_exact(backend, case):
    errs = run_case(backend, case, torch.float64)
    assert max(errs.values()) < 1e-12, errs


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES[1:5], ids=lambda c: "B{}_Lq{}_qs{}_Hq{}_Hkv{}_d{}".format(*c))
def test_float32(backend, case):
    errs = run_case(backend, case, torch.float32)
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_half_precision_smoke(backend, dtype):
    # References use the same rounded inputs in float64: the error is the kernel's own rounding only.
    errs = run_case(backend, (2, 13, 10, 4, 2, 16), dtype)
    assert max(errs.values()) < (3e-2 if dtype == torch.bfloat16 else 5e-3), errs


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_inputs(backend):
    """The TSP layer hands in views (e.g. heads split from a projection, gathered K/V); results must not care."""
    case = (2, 6, 5, 4, 2, 8)
    q, k, v, dout = make_inputs(case, seed=1)
    q_nc = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, H, L, d] memory order
    k_nc = torch.cat((k, k), dim=-1)[..., :8]  # strided view
    v_nc = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (q_nc.is_contiguous() or k_nc.is_contiguous() or v_nc.is_contiguous())
    out, lse = attention_forward(q, k, v, q_start=5, scale=0.3, backend=backend)
    out_nc, lse_nc = attention_forward(q_nc, k_nc, v_nc, q_start=5, scale=0.3, backend=backend)
    torch.testing.assert_close(out_nc, out, rtol=0, atol=1e-14)
    grads = attention_backward(dout, q, k, v, out, lse, q_start=5, scale=0.3, backend=backend)
    dout_nc = dout.transpose(1, 2).contiguous().transpose(1, 2)
    out_nc2 = out_nc.transpose(1, 2).contiguous().transpose(1, 2)
    grads_nc = attention_backward(dout_nc, q_nc, k_nc, v_nc, out_nc2, lse_nc, q_start=5, scale=0.3, backend=backend)
    for a, b in zip(grads_nc, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_backends_agree_on_lse():
    """All CPU backends return the same log-sum-exp (the merge relies on its meaning, not just its format)."""
    q, k, v, _ = make_inputs((2, 5, 7, 4, 2, 8))
    lses = [attention_forward(q, k, v, q_start=7, scale=0.3, backend=b)[1] for b in CPU_BACKENDS]
    torch.testing.assert_close(lses[0], lses[1], rtol=0, atol=1e-13)
    # and it is the true log-sum-exp of the scaled, masked scores
    kk = k.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3
    mask = torch.arange(12)[None, :] > (7 + torch.arange(5))[:, None]
    torch.testing.assert_close(lses[0], scores.masked_fill(mask, float("-inf")).logsumexp(-1), rtol=0, atol=1e-13)


def test_empty_query_block():
    q = torch.zeros(1, 0, 2, 4, dtype=torch.float64)
    k = v = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, q_start=3, scale=0.5)
    assert out.shape == q.shape
    dq, dk, dv = attention_backward(out, q, k, v, out, lse, q_start=3, scale=0.5)
    assert dk.shape == k.shape and not dk.any() and not dv.any()


def test_select_backend():
    """CPU here; the CUDA choices (flash_attn, aten_flash, math with a warning) are in tests/core/test_aten_flash.py."""
    assert select_backend("cpu", torch.float64) == "cpu_flash"
    assert select_backend("cpu", torch.bfloat16) == "cpu_flash"
    assert select_backend("cpu", torch.complex64) == "math"
    assert select_backend("meta", torch.bfloat16) == "math"


def test_bad_inputs_raise():
    q, k, v, _ = make_inputs((1, 4, 2, 4, 2, 8))
    with pytest.raises(ValueError, match="causal prefix"):
        attention_forward(q, k, v, q_start=3, scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention_forward(q[:, :, :3], k, v, q_start=2, scale=1.0)
    with pytest.raises(ValueError, match="backend="):
        attention_forward(q, k, v, q_start=2, scale=1.0, backend="sdpa")
    with pytest.raises(ValueError, match="CUDA"):
        attention_forward(q, k, v, q_start=2, scale=1.0, backend="flash_attn")


# ---- flash_attn adapter, exercised on CPU with fakes of two flash-attn 2.x private signatures ----------------
# (No GPU here: this checks the argument mapping, head_dim padding and return unpacking, not flash-attn itself.)


def _fake_flash_module(version):
    math_impl = kernels._Math

    # lse stays float64 here (real flash-attn: float32) so the wiring can be checked to float64 exactness.
    def check(q, k, v, dropout_p, softcap=0.0, window=(-1, -1)):
        # flash-attn 2 needs the last dim contiguous and takes any other strides (the K/V prefix views)
        assert q.shape[-1] % 8 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert dropout_p == 0.0 and softcap == 0.0 and tuple(window) == (-1, -1)

    def fwd_27(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
               alibi_slopes, return_softmax):
        check(q, k, v, dropout_p, softcap, (window_size_left, window_size_right))
        out, lse = math_impl.forward(q, k, v, causal=causal, scale=softmax_scale)
        return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def fwd_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        check(q, k, v, dropout_p, window=window_size)
        out, lse = math_impl.forward(q, k, v, causal=causal, scale=softmax_scale)
        return out, q, k, v, out, lse, None, torch.empty(2, dtype=torch.int64)

    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal):
        check(q, k, v, dropout_p)
        grads = math_impl.backward(dout, q, k, v, out, softmax_lse, causal=causal, scale=softmax_scale)
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)
        return torch.empty(0)

    def bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
               window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        return bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)

    def bwd_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
               alibi_slopes, deterministic, rng_state=None):
        return bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)

    class Fake:
        _flash_attn_forward = staticmethod(fwd_27 if version == "2.7" else fwd_25)
        _flash_attn_backward = staticmethod(bwd_27 if version == "2.7" else bwd_25)

    return Fake


@pytest.mark.parametrize("version", ["2.5", "2.7"])
def test_flash_attn_adapter_with_fake_module(version, monkeypatch):
    monkeypatch.setattr(kernels, "_flash_attn_module", lambda: _fake_flash_module(version))
    monkeypatch.setitem(kernels._IMPLS, "math", kernels._FlashAttn)  # route backend="math" through the adapter
    case = (2, 5, 6, 4, 2, 12)  # head_dim 12: padded to 16 by the adapter
    errs = run_case("math", case, torch.float64)
    assert max(errs.values()) < 1e-12, errs
