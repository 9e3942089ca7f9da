"""ds_tsp.core.comm.kv_gather moves data only: checked exactly with coordinate-encoded values (each element says which
token, batch row, k/v slot, head and dim it is) at D = 1, 2, 3, 4 -- the gathered buffer is the global-order K/V,
and the rank-ordered dK/dV reduce-scatter hands every rank the sum of all ranks' grads for its own tokens, whether
each key prefix's grads come whole (add) or in the kernels' key blocks (take). Causal (the plain TSP path): the
buffer is the prefix of the keys the rank reads, exactly, and each rank counts the chunks it sends, those alone."""
from __future__ import annotations

import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

B, C, N, E = 2, 3, 2, 2  # batch rows, tokens per zigzag chunk, kv heads, head dim
GROUPS = {2: [2, 3], 3: [0, 1, 2], 4: [0, 1, 2, 3]}


def _coded(S: int, slot: int, rank_tag: int = 0) -> torch.Tensor:
    """[B, S, N, E]: 1e6*rank_tag + 1e5*slot + 1e4*b + 10*t + ... distinct exact integers (float64)."""
    b = torch.arange(B, dtype=torch.float64)[:, None, None, None]
    t = torch.arange(S, dtype=torch.float64)[None, :, None, None]
    h = torch.arange(N, dtype=torch.float64)[None, None, :, None]
    e = torch.arange(E, dtype=torch.float64)[None, None, None, :]
    return 1e6 * rank_tag + 1e5 * slot + 1e4 * b + 10 * t + 3 * h + e


def _local(full: torch.Tensor, D: int, rank: int) -> torch.Tensor:
    from ds_tsp.core.tokens.zigzag import zigzag_chunks

    return torch.cat([full[:, g * C:(g + 1) * C] for g in zigzag_chunks(D, rank)], dim=1)


def _check(D: int, group, pieces: bool, causal: bool) -> None:
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.comm.kv_gather import GlobalKVGather, RankOrderedKVGrad, kv_prefix, local_from_chunks, local_kv
    from ds_tsp.core.tokens.zigzag import zigzag_chunks

    comm = TSPComm(group)
    p, S = comm.rank, 2 * D * C
    k_full, v_full = _coded(S, 0), _coded(S, 1)
    chunks = local_kv(_local(k_full, D, p), _local(v_full, D, p))
    assert torch.equal(local_from_chunks(chunks, 0), _local(k_full, D, p))
    assert torch.equal(local_from_chunks(chunks, 1), _local(v_full, D, p))
    buffer = GlobalKVGather(comm, chunks, causal=causal).wait()
    reads = (2 * D - p) * C if causal else S  # rank p's last query is in global chunk 2D-1-p
    assert buffer.shape[0] == reads, (D, p, causal, tuple(buffer.shape))
    for end in (C, S // 2, reads):
        k, v = kv_prefix(buffer, end)
        assert torch.equal(k, k_full[:, :end]) and torch.equal(v, v_full[:, :end]), (D, p, end)
    chunk_bytes = C * B * 2 * N * E * 8
    # sent: the first half to every other rank; the second half to the ranks that read it (causal: q < p only)
    want_gathered = (D - 1) * chunk_bytes + (p if causal else D - 1) * chunk_bytes
    assert comm.counter.bytes["all_gather"] == want_gathered, (D, p, causal, dict(comm.counter.bytes))
    # dK/dV: rank r adds grads for the key prefixes its two query chunks see (coded by r); twice for chunk 0's keys
    acc = RankOrderedKVGrad(buffer, D, chunk=C, causal=causal)
    ends = [(g + 1) * C for g in zigzag_chunks(D, p)]
    for end in ends:
        dk, dv = _coded(S, 0, p + 1)[:, :end], _coded(S, 1, p + 1)[:, :end]
        if pieces:  # as the kernels hand them over: the keys before the query chunk, then its own
            start = end - C
            acc.take(0, dk[:, :start], dv[:, :start])
            acc.take(start, dk[:, start:], dv[:, start:])
        else:
            acc.add(dk, dv)
    mine, handle = acc.scatter(comm)
    handle.wait()
    # sent: every other rank's first half; second halves only to the ranks whose chunk this rank's queries read
    want_sent = (D - 1) * chunk_bytes + (sum(1 for q in range(D) if q > p) if causal else D - 1) * chunk_bytes
    assert comm.counter.bytes["reduce_scatter"] == want_sent, (D, p, causal, dict(comm.counter.bytes))
    want_k, want_v = torch.zeros_like(k_full), torch.zeros_like(v_full)
    for r in range(D):
        for end in ((g + 1) * C for g in zigzag_chunks(D, r)):
            want_k[:, :end] += _coded(S, 0, r + 1)[:, :end]
            want_v[:, :end] += _coded(S, 1, r + 1)[:, :end]
    assert torch.equal(local_from_chunks(mine, 0), _local(want_k, D, p)), (D, p)
    assert torch.equal(local_from_chunks(mine, 1), _local(want_v, D, p)), (D, p)


def _all():
    groups = {D: dist.new_group(r) for D, r in GROUPS.items()}
    me = dist.get_rank()
    for pieces, causal in ((False, False), (True, False), (False, True), (True, True)):
        if me == 0:
            _check(1, None, pieces, causal)
        for D, ranks in GROUPS.items():
            if me in ranks:
                _check(D, groups[D], pieces, causal)
    return True


def test_global_order_gather_and_rank_order_scatter_are_exact():
    assert all(run_on_local_ranks(_all, 4, timeout_s=180))


def test_rank_ordered_grad_takes_whole_chunks_in_key_order_only():
    from ds_tsp.core.comm.kv_gather import RankOrderedKVGrad

    acc = RankOrderedKVGrad(torch.zeros(2 * 2 * C, B, 2, N, E, dtype=torch.float64), 2)
    grad = _coded(4 * C, 0)
    for start, n in ((C, C), (0, C - 1), (1, C)):  # a gap before the first key added; part of a chunk; unaligned
        try:
            acc.take(start, grad[:, :n], grad[:, :n])
        except ValueError as err:
            assert "whole chunks" in str(err)
        else:
            raise AssertionError(f"take({start}, {n} keys) was accepted")
    acc.take(0, grad[:, :C], grad[:, :C])
    acc.take(C, grad[:, C:3 * C], grad[:, C:3 * C])  # from the first key not added yet: accepted
