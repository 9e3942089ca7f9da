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

Everything is differentiable by autograd (no in-place writes to saved tensors) and runs in the dtype it is given:
callers pass float32 for low-precision models (as transformers and FLA do: the M chain must not run in bf16) and
float64 to prove exactness. No host sync: shapes only.
"""
from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' and FLA's l2norm of q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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
    from_start = cum.exp()  # decay from the sub-chunk's start state to token i
    to_end = (cum[..., -1:] - cum).exp()  # decay from token j to the sub-chunk's end state
    gamma = cum[..., -1].exp()  # start state -> end state
    if reset is not None:  # segment index inside each sub-chunk: a document start opens a new one
        if pad:
            reset = torch.nn.functional.pad(reset, (0, pad))
        seg = reset.to(torch.int32).reshape(N, 1, n, C).cumsum(dim=-1)
        cut = cut | (seg.unsqueeze(-1) != seg.unsqueeze(-2))  # [N, 1, n, C, C]: other documents
        reads_start, reaches_end = seg == 0, seg == seg[..., -1:]
        from_start = from_start * reads_start
        to_end = to_end * reaches_end
        gamma = gamma * reads_start[..., -1]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(cut, float("-inf")).exp()  # [.., C, C]
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
