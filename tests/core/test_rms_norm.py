"""The fused RMSNorm Function (ds_tsp.core.layers.norm.tsp_rms_norm) against HF's formula under plain autograd.

Reference: HF LlamaRMSNorm written out (compute in float32, or the input dtype if wider; `weight * normed.to(input
dtype)`), differentiated by autograd. Tolerances (norm-wise relative): forward bitwise equal in every dtype (the
same ops in the same order); backward float64 1e-13 (the written-out backward reorders a few sums: measured 9e-17 dx,
dweight bitwise), float32 1e-6 (measured 6e-8), bfloat16 1e-2 (measured bitwise: both round the same fp32 values).
The Function must save exactly (x, rstd [..., 1] in the compute dtype): asserted with saved_tensors_hooks.
"""
from __future__ import annotations

import pytest
import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.layers.norm import TSPRMSNorm, rms_norm, rms_norm_backward, tsp_rms_norm

EPS = 1e-6


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, verbatim apart from the float32 -> 'float32 or wider' compute dtype."""
    input_dtype = x.dtype
    h = x.to(torch.promote_types(input_dtype, torch.float32))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _inputs(dtype, shape=(2, 5, 48), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, dy


def _fwd_bwd(fn, x, w, dy):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w, EPS)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype, dx_tol, dw_tol", [(torch.float64, 1e-13, 1e-13), (torch.float32, 1e-6, 1e-6),
                                                   (torch.bfloat16, 1e-2, 1e-2)])
def test_matches_hf_formula(dtype, dx_tol, dw_tol):
    x, w, dy = _inputs(dtype)
    y, dx, dw = _fwd_bwd(tsp_rms_norm, x, w, dy)
    y_ref, dx_ref, dw_ref = _fwd_bwd(hf_rms_norm, x, w, dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    assert torch.equal(y, y_ref)  # the same ops in the same order: bitwise
    assert _rel(dx, dx_ref) < dx_tol and _rel(dw, dw_ref) < dw_tol, (_rel(dx, dx_ref), _rel(dw, dw_ref))


def test_float64_gradcheck():
    x, w, _ = _inputs(torch.float64, shape=(3, 7))
    assert torch.autograd.gradcheck(lambda a, b: tsp_rms_norm(a, b, EPS), (x, w))


def test_written_out_pair_still_matches_autograd():
    """rms_norm / rms_norm_backward (the attention Function's q/k norms) keep their semantics."""
    x, w, dy = _inputs(torch.float64, shape=(2, 3, 4, 8))
    y, dx_ref, dw_ref = _fwd_bwd(rms_norm, x, w, dy)
    assert torch.equal(y, hf_rms_norm(x, w, EPS).detach())
    dx, dw = rms_norm_backward(dy, x.detach(), w.detach(), EPS)
    assert _rel(dx, dx_ref) < 1e-13 and _rel(dw, dw_ref) < 1e-13


def _formula_backward(dy, x, rstd, weight, zero_centred):
    """The backward's formula written out of place, op for op in the order the module runs them."""
    n = x.to(rstd.dtype) * rstd
    if weight is None:
        dn = dy.to(rstd.dtype)
    elif zero_centred:
        dn = dy.to(rstd.dtype) * (1.0 + weight.to(rstd.dtype))
    else:
        dn = (dy * weight).to(rstd.dtype)
    return (rstd * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("weighted", [True, False])
def test_in_place_steps_give_the_formulas_bits_and_leave_the_inputs(dtype, weight_dtype, zero_centred, weighted):
    """The forward's weight product and the backward's row-sized steps run in place in the function's own fresh
    buffers: the same bits as the out-of-place formula (and HF's forward), and x / dy untouched, even where a
    float32 dy would be its own compute-dtype copy (no weight)."""
    x, w, dy = (t.detach() for t in _inputs(dtype, shape=(3, 7, 32)))
    w = w.to(weight_dtype) if weighted else None
    x0, dy0 = x.clone(), dy.clone()
    rstd = torch.rsqrt(x.to(torch.promote_types(dtype, torch.float32)).pow(2).mean(-1, keepdim=True) + EPS)
    y = rms_norm(x, w, EPS, zero_centred)
    if weighted and not zero_centred:
        assert torch.equal(y, hf_rms_norm(x, w, EPS)) and y.dtype == torch.result_type(w, x)
    dx, _ = rms_norm_backward(dy, x, w, EPS, zero_centred)
    assert torch.equal(dx, _formula_backward(dy, x, rstd, w, zero_centred))
    assert torch.equal(x, x0) and torch.equal(dy, dy0)


def _saved(fn, x, w) -> list[torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w, EPS)
    return saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_saves_exactly_input_and_rstd(dtype):
    x, w, _ = _inputs(dtype)
    saved = _saved(tsp_rms_norm, x, w)
    assert len(saved) == 2, [tuple(t.shape) for t in saved]
    assert saved[0] is x
    compute = torch.promote_types(dtype, torch.float32)
    assert saved[1].shape == (*x.shape[:-1], 1) and saved[1].dtype == compute
    xc = x.detach().to(compute)
    assert torch.equal(saved[1], torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + EPS))


def test_saves_a_fraction_of_plain_autograd():
    """bf16 input: plain autograd keeps an fp32 copy and the bf16 normalised output (3x the input bytes)."""
    x, w, _ = _inputs(torch.bfloat16, shape=(64, 256))
    new = sum(t.nbytes for t in _saved(tsp_rms_norm, x, w))
    old = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _saved(hf_rms_norm, x, w)}
    assert new == x.nbytes + 64 * 4
    assert sum(old.values()) >= 3 * x.nbytes, old


def test_frozen_weight_gets_no_grad_and_input_without_grad_still_gives_weight_grad():
    x, w, dy = _inputs(torch.float64)
    w_frozen = w.detach()
    tsp_rms_norm(x, w_frozen, EPS).backward(dy)
    assert x.grad is not None and w_frozen.grad is None
    x_const = x.detach()
    tsp_rms_norm(x_const, w, EPS).backward(dy)
    assert _rel(w.grad, _fwd_bwd(hf_rms_norm, x, w, dy)[2]) < 1e-13


def test_module_with_replicated_weight_at_d1():
    x, w, dy = _inputs(torch.float64)
    norm = TSPRMSNorm(x.shape[-1], EPS, TSPComm.single(), dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(w)
    xm = x.detach().clone().requires_grad_()
    norm(xm).backward(dy)
    _, dx_ref, dw_ref = _fwd_bwd(hf_rms_norm, x, w, dy)
    assert _rel(xm.grad, dx_ref) < 1e-13 and _rel(norm.weight.grad, dw_ref) < 1e-13
