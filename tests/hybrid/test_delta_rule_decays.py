"""The chunk kernel's decays (delta_rule.flushed_exp, pairwise_decay): the exp bit for bit above the dtype's floor
and exactly 0 below it, exact zeros where a token may not read another, and the kernel with strongly decaying heads
(most pairwise decays below the dtype's smallest normal number) against transformers' recurrence, values and
grads, in float64 and float32."""
from __future__ import annotations

import math

import pytest
import torch

from ds_tsp.core.layers.linear_attention.delta_rule import (
    chunk_gated_delta_rule,
    flushed_exp,
    l2_normalize,
    pairwise_decay,
)
from ds_tsp.tools.gdn_reference import _widened


def _masked_exp(cum, cut):
    return (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(cut, float("-inf")).exp()


def _cums(dtype, per_token: float, seed: int = 0):
    """[2, 3, 4, 16] running sums of log decays in [-per_token, 0] per token (a zero for padding at the end)."""
    g = torch.Generator().manual_seed(seed)
    steps = -per_token * torch.rand(2, 3, 4, 16, dtype=torch.float64, generator=g)
    steps[..., -3:] = 0
    return steps.cumsum(-1).to(dtype)


def _floor(dtype) -> float:
    """Below this the decays are flushed to 0: 2 exp(-0.9 ln(1 / smallest normal)), 1.5e-34 in float32."""
    return 2 * math.exp(-0.9 * -math.log(torch.finfo(dtype).tiny))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_token", [0.5, 40.0, 400.0])
@pytest.mark.parametrize("documents", [False, True])
def test_pairwise_decay_is_the_masked_exp_above_its_floor_and_zero_below(dtype, per_token, documents):
    cum = _cums(dtype, per_token)
    cut = torch.ones(16, 16, dtype=torch.bool).triu(1)
    if documents:  # a second document from token 5 in every other sub-chunk
        seg = torch.zeros(2, 1, 4, 16, dtype=torch.int32)
        seg[:, :, ::2, 5:] = 1
        cut = cut | (seg.unsqueeze(-1) != seg.unsqueeze(-2))
    got, want = pairwise_decay(cum, cut), _masked_exp(cum, cut)
    cut = cut.expand_as(got)
    assert torch.isfinite(got).all()
    assert (got[cut] == 0).all()  # exact zeros: no read of a later token or another document
    kept_got, kept_want = got[~cut], want[~cut]
    above = kept_want > _floor(dtype)
    assert torch.equal(kept_got[above], kept_want[above])  # the same exp, bit for bit
    assert (kept_got[~above] == 0).all()
    if per_token >= (40 if dtype == torch.float32 else 400):  # the case the floor is for: many kept pairs below the
        assert (~above).float().mean() > 0.25  # dtype's smallest normal number, most of them denormal or 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flushed_exp_is_the_exp_above_its_floor_and_zero_below(dtype):
    x = -torch.linspace(0, 1000, 4001, dtype=torch.float64).to(dtype)
    got, want = flushed_exp(x), x.exp()
    above = want > _floor(dtype)
    assert torch.equal(got[above], want[above]) and (got[~above] == 0).all() and (want[~above] <= _floor(dtype)).all()
    assert flushed_exp(torch.tensor([-3.0], dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_pairwise_decay_in_other_dtypes_is_the_masked_exp():
    cum = _cums(torch.bfloat16, 40.0)
    cut = torch.ones(16, 16, dtype=torch.bool).triu(1)
    assert torch.equal(pairwise_decay(cum, cut), _masked_exp(cum, cut))


def _strong_case(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    N, T, Hh, dk, dv = 2, 40, 3, 4, 5
    q, k = (torch.randn(N, T, Hh, dk, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(N, T, Hh, dv, dtype=torch.float64, generator=g)
    # transformers' init draws A in (0, 16] and dt_bias = 1: log decays down to about -20 per token; heads here
    # from -0.1 to -60 per token, so a 16-token sub-chunk spans exponents far below float32's and float64's floors
    scale = torch.tensor([0.1, 20.0, 60.0], dtype=torch.float64)
    decay = -scale * torch.rand(N, T, Hh, dtype=torch.float64, generator=g)
    beta = torch.rand(N, T, Hh, dtype=torch.float64, generator=g)
    s0 = torch.randn(N, Hh, dk, dv, dtype=torch.float64, generator=g)
    return [t.to(dtype) for t in (q, k, v, decay, beta, s0)]


def _kernel(q, k, v, decay, beta, s0, chunk):
    dk = q.shape[-1]
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    o_local, q_eff, m, u = chunk_gated_delta_rule(t(l2_normalize(q) * dk ** -0.5), t(l2_normalize(k)), t(v),
                                                  t(decay), t(beta), chunk)
    return t(o_local + q_eff @ s0), m @ s0 + u


def _recurrence(q, k, v, decay, beta, s0):
    rec = _widened("transformers.models.qwen3_5.modeling_qwen3_5")["torch_recurrent_gated_delta_rule"]
    return rec(q, k, v, decay, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)


def _values_and_grads(fn, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, s = fn(*leaves)
    g = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, dtype=torch.float64, generator=g).to(o.dtype)
    ds = torch.randn(s.shape, dtype=torch.float64, generator=g).to(s.dtype)
    grads = torch.autograd.grad((o, s), leaves, (do, ds))
    return [o.detach(), s.detach(), *grads]


@pytest.mark.parametrize("chunk", [16, 64])
def test_strongly_decaying_heads_match_transformers_recurrence_in_float64(chunk):
    """Values and the grads of q, k, v, the log decays, beta and the start state: 1e-12 (as the mild case in
    test_gated_deltanet_properties.py)."""
    inputs = _strong_case(torch.float64)
    got = _values_and_grads(lambda *a: _kernel(*a, chunk), inputs)
    want = _values_and_grads(_recurrence, inputs)
    for name, a, b in zip(("o", "S_end", "dq", "dk", "dv", "dg", "dbeta", "dS0"), got, want):
        assert (a - b).abs().max() < 1e-12 * max(1.0, b.abs().max().item()), name


def test_strongly_decaying_heads_in_float32_match_the_float64_recurrence():
    """float32 kernel (the compute dtype of every low-precision model) against the float64 recurrence: within
    float32 noise, values and grads, no inf or NaN anywhere."""
    got = _values_and_grads(lambda *a: _kernel(*a, 16), _strong_case(torch.float32))
    want = _values_and_grads(_recurrence, _strong_case(torch.float64))
    for name, a, b in zip(("o", "S_end", "dq", "dk", "dv", "dg", "dbeta", "dS0"), got, want):
        assert torch.isfinite(a).all(), name
        assert ((a.double() - b).abs().max() / b.abs().max()) < 2e-5, name


def test_the_decays_grads_are_the_exps_where_nothing_is_flushed():
    """The hand-written backwards (each saves only its result) against finite differences, document cuts
    included."""
    cum = _cums(torch.float64, 0.5)[:1, :2, :2, :8].clone().requires_grad_()
    seg = torch.zeros(1, 1, 2, 8, dtype=torch.int32)
    seg[..., 3:] = 1
    cut = torch.ones(8, 8, dtype=torch.bool).triu(1) | (seg.unsqueeze(-1) != seg.unsqueeze(-2))
    assert torch.autograd.gradcheck(lambda c: pairwise_decay(c, cut), (cum,))
    assert torch.autograd.gradcheck(flushed_exp, (cum,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernel_hands_its_products_no_denormal_decay(dtype, monkeypatch):
    """Every decay the kernel computes (from the sub-chunk start, whose last is the whole sub-chunk's, to its end,
    and every pair) goes through flushed_exp / pairwise_decay, and with heads decaying up to 60 per token none is
    denormal: the CPU's slow path for every product and solve that reads them."""
    from ds_tsp.core.layers.linear_attention import delta_rule

    seen = []

    def spy(fn):
        def wrapped(*args):
            out = fn(*args)
            seen.append((fn.__name__, out.detach()))
            return out
        return wrapped

    monkeypatch.setattr(delta_rule, "flushed_exp", spy(delta_rule.flushed_exp))
    monkeypatch.setattr(delta_rule, "pairwise_decay", spy(delta_rule.pairwise_decay))
    q, k, v, decay, beta, s0 = _strong_case(dtype)
    _kernel(q, k, v, decay, beta, s0, 16)
    assert [name for name, _ in seen] == ["flushed_exp"] * 2 + ["pairwise_decay"]
    tiny = torch.finfo(dtype).tiny
    for name, out in seen:
        assert not ((out != 0) & (out.abs() < tiny)).any(), name
    if dtype == torch.float32:  # the case this is for: beside the 120 of 256 pairs cut (later tokens), a good
        assert (seen[-1][1] == 0).float().mean() > 0.55  # share of the kept ones flushed
