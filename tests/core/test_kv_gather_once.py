"""GQA/MQA with fewer kv heads than ranks: each kv head's K/V is gathered (and its grad scattered) ONCE per layer.

One attention layer, forward + backward, bytes from CommCounter. With n_kv kv heads, B rows, padded S, head dim d
and b bytes per element, the logical K/V volume rank p sends is, in zigzag chunks of c = S/(2D) tokens
(n_kv * 2 * B * c * d * b bytes each) and attention being causal (rank q never reads global chunks 2D-q .. 2D-1;
ds_tsp.core.comm.kv_gather):
    all-gather:     D-1+p chunks   its first half to the D-1 other ranks, its second half to the p ranks before it;
                                   forward, again in backward unless keep_gathered_kv
    reduce-scatter: 2D-2-p chunks  backward, dK/dV back to the token owners: first halves to every other rank,
                                   second halves to the ranks q > p whose keys this rank's queries read
(2(D-1) chunks, rho = (D-1)/D of the sequence, at most; 3/4 of that over all ranks.)
plus, when kv_replicas = D/n_kv > 1, the all-gather of the kv weight grads that sums them over the replicas
(D * (2*d*h) * b * rho: weights, not activations). Gathering per head block instead would count D/n_kv times more.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.positions import RopeTables
from ds_tsp.core.tokens.rope import rope_cos_sin
from ds_tsp.core.tokens.zigzag import zigzag_positions
from ds_tsp.model.modules.attention import TSPAttention

B, S, HEAD_DIM, HEADS = 2, 32, 8, 8  # S a multiple of 2D for D in (2, 4)


def _one_layer(group, n_kv: int, keep_gathered_kv: bool) -> dict:
    comm = TSPComm(group)
    shape = ModelShape(vocab_size=16, hidden_size=HEADS * HEAD_DIM, intermediate_size=16, num_layers=1,
                       num_heads=HEADS, num_kv_heads=n_kv)
    attn = TSPAttention(shape, comm, TSPOptions(keep_gathered_kv=keep_gathered_kv), torch.float32, None)
    gen = torch.Generator().manual_seed(comm.rank)
    with torch.no_grad():
        attn.packed_shard.normal_(0, 0.1, generator=gen)
    L = S // comm.size
    x = torch.randn(B, L, shape.hidden_size, generator=gen, requires_grad=True)
    positions = zigzag_positions(S, comm.size, comm.rank).expand(B, L)
    cos, sin = rope_cos_sin(positions, HEAD_DIM, shape.rope_theta, torch.float32)
    comm.counter.reset()
    attn(x, RopeTables(cos, sin)).square().sum().backward()
    return dict(comm.counter.bytes)


def _expected(D: int, n_kv: int, keep_gathered_kv: bool, p: int) -> dict:
    b, h = 4, HEADS * HEAD_DIM
    chunk = n_kv * 2 * B * (S // (2 * D)) * HEAD_DIM * b
    kv = chunk * (2 * D - 2 - p)
    gather = chunk * (D - 1 + p) * (1 if keep_gathered_kv else 2)
    if D > n_kv:  # the replica sum of the kv weight grads (one kv head of wk and wv per rank)
        gather += D * 2 * HEAD_DIM * h * b * (D - 1) // D
    return {"all_gather": gather, "reduce_scatter": kv}


CASES = [(4, 1, False), (4, 1, True), (4, 2, False), (4, 2, True), (2, 2, False), (2, 2, True)]  # (D, n_kv, keep)


def _measure_all():
    """4 ranks: D=4 on the world, D=2 on the pairs {0, 1} and {2, 3} (one launch keeps start-up cost low)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: dist.group.WORLD, 2: pairs[dist.get_rank() // 2]}
    return [_one_layer(groups[D], n_kv, keep) for D, n_kv, keep in CASES]


def test_each_kv_head_is_gathered_once():
    per_rank = run_on_local_ranks(_measure_all, 4, timeout_s=120)
    for rank, measured in enumerate(per_rank):
        for (D, n_kv, keep), counted in zip(CASES, measured):
            want = _expected(D, n_kv, keep, rank % D)  # D=2 on the pairs {0, 1}, {2, 3}
            got = {k: counted.get(k, 0) for k in want}
            assert got == want, (rank, D, n_kv, keep, got, want)
