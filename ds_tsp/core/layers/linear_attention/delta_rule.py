"""The gated delta rule of Gated DeltaNet in pure torch, chunked, in the "transition" form a sequence split needs.

Per value head, with the state S [dk, dv] (o_t and S_t as transformers' torch_recurrent_gated_delta_rule):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T          o_t = S_t^T q_t

S_t is affine in the state a piece of the sequence starts from. `chunk_gated_delta_rule` returns, for a piece of T
tokens, everything needed to finish it later from ANY start state S0, without rerunning it:

    o       = o_local + q_eff @ S0            o_local [T, dv]: the output from S0 = 0;   q_eff [T, dk]
    S_end   = M @ S0 + U                      M [dk, dk], U [dk, dv]: the piece's affine state transition

so a sequence cut over ranks is computed in parallel, the (M, U) of every piece composed in sequence order
((M2, U2) o (M1, U1) = (M2 M1, M2 U1 + U2)), and each piece's output corrected by one GEMM with its start state.

Inside a piece the work runs in sub-chunks of `chunk_size` tokens with the WY/UT form transformers' and FLA's
chunked kernels use (per sub-chunk n: the unit-lower-triangular system of the decayed beta k k^T gives
U_wy = T^-1 (beta v) and W = T^-1 (beta k exp(cumsum g))):

    o_n      = intra_n U_wy + (q_n exp(cum) - intra_n W) S_n            intra_n = (q k^T * decay) lower incl. diag
    S_{n+1}  = (exp(cum_last) I - k_end^T W) S_n + k_end^T U_wy          k_end = k exp(cum_last - cum)

Everything is differentiable by autograd (no in-place writes to saved tensors; the decays' exps are two small
Functions that save only their results) and runs in the dtype it is given: callers pass float32 for low-precision
models (as transformers and FLA do: the M chain must not run in bf16) and float64 to prove exactness. Decays below
the dtype's floor are flushed to 0 (flushed_exp: within 1.5e-34 in float32, 2.6e-277 in float64), which keeps the
CPU's exp and every later product off their slow underflow and denormal paths. No host sync: shapes only.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' and FLA's l2norm of q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _exp_bound(dtype: torch.dtype) -> float:
    """0.9 ln(1 / the dtype's smallest normal): 78.6 in float32, 637 in float64."""
    return 0.9 * -math.log(torch.finfo(dtype).tiny)


def _flushed_exp_(x: torch.Tensor, bound: float) -> torch.Tensor:
    """In place: exp of x clamped to [-bound, bound], and every result below 2 exp(-bound) set to exactly 0."""
    return F.threshold_(x.clamp_(min=-bound, max=bound).exp_(), 2 * math.exp(-bound), 0.0)


class _FlushedExp(torch.autograd.Function):
    """flushed_exp; saves only its result (the grad of x is the grad times it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bound: float):
        y = _flushed_exp_(x.clone(), bound)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        return grad * y, None


class _PairwiseDecay(torch.autograd.Function):
    """flushed exp(cum_i - cum_j) * keep_ij; saves only its result (one [..., C, C] tensor, allocated once)."""

    @staticmethod
    def forward(ctx, cum: torch.Tensor, keep: torch.Tensor, bound: float):
        decay = _flushed_exp_(cum.unsqueeze(-1) - cum.unsqueeze(-2), bound).mul_(keep)
        ctx.save_for_backward(decay)
        return decay

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (decay,) = ctx.saved_tensors
        d_exponent = grad * decay  # exponent_ij = cum_i - cum_j
        return d_exponent.sum(dim=-1) - d_exponent.sum(dim=-2), None, None


def flushed_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for the decays of a sub-chunk (x <= 0), flushed to 0 below 2 exp(-bound) (bound: 78.6 in float32,
    637 in float64): the exact value to within 1.5e-34 absolute in float32 (2.6e-277 in float64), far below either
    dtype's resolution of any O(1) term a decay weighs, and its grad likewise (0 where flushed).

    On the CPU an exp that underflows costs up to 14x one that does not, a -inf input 2x, and every later product
    with a denormal decay is slow as well (the triangular solves 1.6x): heads that forget fast (transformers' A_log
    init in (0, 16], and the trained checkpoints it leads to) underflow over most of each 64-token sub-chunk. The
    clamp keeps the exp off its slow path and the flush leaves exact zeros instead of denormals. Other dtypes (the
    kernel computes in float32 or float64) take the plain exp."""
    if x.dtype not in (torch.float32, torch.float64):
        return x.exp()
    return _FlushedExp.apply(x, _exp_bound(x.dtype))


def pairwise_decay(cum: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """[..., C, C]: exp(cum_i - cum_j) where token i reads token j (flushed as flushed_exp), exactly 0 where `cut`
    (j after i, or another document). cum: [..., C] running sums of log decays (<= 0); cut: bool, broadcastable to
    [..., C, C]. The cut entries' exponents (positive, up to overflow) are clamped too, so the mask's zeros are
    exact; one [..., C, C] tensor is allocated and saved for backward."""
    if cum.dtype not in (torch.float32, torch.float64):
        return (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(cut, float("-inf")).exp()
    return _PairwiseDecay.apply(cum, (~cut).to(cum.dtype), _exp_bound(cum.dtype))


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk_size: int = 64, reset: torch.Tensor | None = None):
    """(o_local [N, H, T, dv], q_eff [N, H, T, dk], M [N, H, dk, dk], U [N, H, dk, dv]) of one piece (see above).

    q, k: [N, H, T, dk] (q already l2-normalized and scaled by dk^-0.5, k l2-normalized), v: [N, H, T, dv],
    g (log decay, <= 0) and beta: [N, H, T]. One dtype for all (the compute dtype).
    reset: [N, T], 1 where a packed document starts (the state entering that token is discarded), 0 elsewhere; or
    None (no document starts). Resets are exact, not approximated by a large decay: inside a sub-chunk they cut
    the pairwise decays between documents and the reads of (and contributions to) the sub-chunk's boundary states,
    so rows with different document layouts run in one batch. A reset at token 0 makes the whole piece independent
    of its start state (q_eff = 0, M = 0).
    """
    N, H, T, dk = k.shape
    dv = v.shape[-1]
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:  # padded tokens: k = v = beta = 0 and g = 0, so their transition is the identity
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // C
    q, k, v = (t.reshape(N, H, n, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(N, H, n, C), beta.reshape(N, H, n, C)

    cum = g.cumsum(dim=-1)
    cut = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)  # [C, C]: j after i
    from_start = flushed_exp(cum)  # decay from the sub-chunk's start state to token i
    to_end = flushed_exp(cum[..., -1:] - cum)  # decay from token j to the sub-chunk's end state
    gamma = from_start[..., -1]  # start state -> end state
    if reset is not None:  # segment index inside each sub-chunk: a document start opens a new one
        if pad:
            reset = torch.nn.functional.pad(reset, (0, pad))
        seg = reset.to(torch.int32).reshape(N, 1, n, C).cumsum(dim=-1)
        cut = cut | (seg.unsqueeze(-1) != seg.unsqueeze(-2))  # [N, 1, n, C, C]: other documents
        reads_start, reaches_end = seg == 0, seg == seg[..., -1:]
        from_start = from_start * reads_start
        to_end = to_end * reaches_end
        gamma = gamma * reads_start[..., -1]
    decay = pairwise_decay(cum, cut)  # [.., C, C]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # only its strict lower triangle is read (unitriangular)
    u_wy = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * from_start.unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    k_end_t = (k * to_end.unsqueeze(-1)).transpose(-1, -2)

    o_sub = intra @ u_wy  # [N, H, n, C, dv]: each sub-chunk from a zero state
    q_sub = q * from_start.unsqueeze(-1) - intra @ w  # [N, H, n, C, dk]: its read of the sub-chunk's start state
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    m_sub = gamma[..., None, None] * eye - k_end_t @ w  # [N, H, n, dk, dk]
    u_sub = k_end_t @ u_wy  # [N, H, n, dk, dv]

    # The sub-chunks' transitions (M | U) composed in order, from sub-chunk 0's: T_i = M_i T_{i-1} + (0 | U_i),
    # one GEMM per step; then every sub-chunk's read of the state it starts from (q_sub_i T_{i-1} = its q_eff | its
    # output's correction) in ONE batched GEMM after the loop.
    m_and_u = torch.cat([m_sub, u_sub], dim=-1)  # [N, H, n, dk, dk + dv]
    zero_and_u = torch.nn.functional.pad(u_sub, (dk, 0))
    transition = m_and_u[:, :, 0]
    before = []  # T_0 .. T_{n-2}: what sub-chunks 1 .. n-1 start from
    for i in range(1, n):
        before.append(transition)
        transition = m_sub[:, :, i] @ transition + zero_and_u[:, :, i]
    if before:
        reads = q_sub[:, :, 1:] @ torch.stack(before, dim=2)  # [N, H, n-1, C, dk + dv]
        q_eff = torch.cat([q_sub[:, :, :1], reads[..., :dk]], dim=2)
        o_sub = torch.cat([o_sub[:, :, :1], o_sub[:, :, 1:] + reads[..., dk:]], dim=2)
    else:
        q_eff = q_sub
    o_local = o_sub.reshape(N, H, n * C, dv)[:, :, :T]
    q_eff = q_eff.reshape(N, H, n * C, dk)[:, :, :T]
    return o_local, q_eff, transition[..., :dk], transition[..., dk:]
