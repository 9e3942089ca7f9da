"""The vocab-sharded embedding's table grad is accumulated in float32 within each ring step (bf16 table).

A batch where one token id repeats hundreds of times: a bf16 grad row that adds each occurrence in bf16 rounds at
every add (once the row is large, small contributions vanish). Expected, exactly (torch.equal): per ring step the
fp32 index_add_ of this rank's rows cast to bf16 once; across ranks the grad ring sums those bf16 contributions in
bf16 (the ring carries the parameter dtype), which for D = 2 is one bf16 add of two terms.

CUDA's index_add_ on a bf16 tensor is atomic adds in bf16 (rounds at every add), but the CPU kernel accumulates in
fp32 internally, so on the CPU a bf16 index_add_ would pass unnoticed. The step therefore runs under
`Bf16AtomicIndexAdd`, which gives every bf16 index_add_ the GPU's per-add rounding (index_put_ with accumulate, which
rounds per add on the CPU); fp32 index_add_ is untouched. The naive bf16 accumulation of the same data must differ
measurably from the expected grad (relative error > 1e-3 on the frequent row), so a bf16 accumulation fails the test.
"""
from __future__ import annotations

import pytest
import torch
from local_ranks import run_on_local_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.layers.vocab.embedding import tsp_embedding

V, H, TOKENS, FREQUENT = 11, 16, 600, 3


class Bf16AtomicIndexAdd(TorchDispatchMode):
    """bf16 index_add_ along dim 0 rounded at every add, as CUDA's atomics do; other dtypes run unchanged."""

    OPS = {torch.ops.aten.index_add_.default, torch.ops.aten.index_add.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS and args[0].dtype == torch.bfloat16:
            self_, dim, index, source = args[:4]
            assert dim == 0 and kwargs.get("alpha", 1) == 1, (dim, kwargs)
            out = self_ if func is torch.ops.aten.index_add_.default else self_.clone()
            return out.index_put_((index,), source, accumulate=True)
        return func(*args, **kwargs)


def _local_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, TOKENS] ids (token FREQUENT about 90% of them) and the upstream grad [1, TOKENS, H] in bf16."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, V, (1, TOKENS), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.9] = FREQUENT
    dout = (torch.randn(1, TOKENS, H, generator=g) + 0.3).to(torch.bfloat16)
    return ids, dout


def _table(rows: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(rows, H, generator=g).to(torch.bfloat16).requires_grad_()


def _grad_of_own_shard(comm: TSPComm) -> torch.Tensor:
    rows = -(-V // comm.size)
    shard = _table(rows, comm.rank)
    ids, dout = _local_batch(comm.rank)
    with Bf16AtomicIndexAdd():
        tsp_embedding(ids, shard, comm).backward(dout)
    return shard.grad


def _on_world():
    import torch.distributed as dist

    return _grad_of_own_shard(TSPComm(dist.group.WORLD))


def _per_rank_full_grad(rank: int, padded: int, accumulate: torch.dtype) -> torch.Tensor:
    """One rank's contribution to the whole padded table, accumulated in `accumulate`, then cast to bf16."""
    ids, dout = _local_batch(rank)
    grad = torch.zeros(padded, H, dtype=accumulate)
    with Bf16AtomicIndexAdd():
        grad.index_add_(0, ids.reshape(-1), dout.reshape(-1, H).to(accumulate))
    return grad.to(torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("tsp", [1, 2])
def test_bf16_table_grad_is_fp32_accumulated(tsp):
    rows = -(-V // tsp)
    got = [_grad_of_own_shard(TSPComm.single())] if tsp == 1 else run_on_local_ranks(_on_world, tsp, timeout_s=120)
    per_rank = {acc: [_per_rank_full_grad(r, rows * tsp, acc) for r in range(tsp)]
                for acc in (torch.float32, torch.bfloat16)}
    expected, naive = per_rank[torch.float32][0], per_rank[torch.bfloat16][0]
    for r in range(1, tsp):  # the grad ring adds the ranks' bf16 contributions in bf16
        expected, naive = expected + per_rank[torch.float32][r], naive + per_rank[torch.bfloat16][r]
    for p, grad in enumerate(got):
        assert grad.dtype == torch.bfloat16
        mine = slice(p * rows, (p + 1) * rows)
        assert torch.equal(grad, expected[mine]), (p, _rel(grad, expected[mine]))
    owner = FREQUENT // rows
    frequent_row = slice(FREQUENT, FREQUENT + 1)
    # the naive bf16 accumulation is measurably off on the frequent token's row: the test can fail
    assert _rel(naive[frequent_row], expected[frequent_row]) > 1e-3, _rel(naive[frequent_row], expected[frequent_row])
    assert torch.equal(got[owner][FREQUENT - owner * rows], expected[FREQUENT])


def test_the_emulation_rounds_bf16_adds_and_leaves_fp32_alone():
    index, src = torch.zeros(1000, dtype=torch.long), torch.full((1000, 2), 0.01)
    with Bf16AtomicIndexAdd():
        bf16 = torch.zeros(1, 2, dtype=torch.bfloat16).index_add_(0, index, src.to(torch.bfloat16))
        fp32 = torch.zeros(1, 2).index_add_(0, index, src)
    assert float(bf16[0, 0]) == 4.0  # 4 + 0.01 rounds back to 4 in bf16: the sum stalls
    assert float(torch.zeros(1, 2, dtype=torch.bfloat16).index_add_(0, index, src.to(torch.bfloat16))[0, 0]) == 10.0
    assert torch.equal(fp32, torch.zeros(1, 2).index_add_(0, index, src))
