"""LM head + loss tiled over tokens (TSPOptions.lm_head_chunk_tokens): exact, and its largest transient shrinks.

Exactness: float64, a tile size that divides neither the local token count nor anything else, a vocabulary that
needs padding to a multiple of D, and ignored (-100) labels; loss and both grads against plain cross-entropy.
Memory: MemTracker peak over forward + backward of the loss at V=8192, S=2048, D=2 (1024 local tokens, vocab
shard 4096 rows): untiled the [1024, 4096] float32 logits (16 MiB) are live; tiles of 256 tokens bound that to
[256, 4096] (4 MiB; the softmax is formed in place and each tile is freed before the next is built).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.vocab.loss import tsp_lm_head_loss

UNTILED = 1 << 30


def _inputs(V, tokens_per_rank, h, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(D * tokens_per_rank, h, generator=gen, dtype=dtype)
    rows = -(-V // D)
    w = torch.zeros(D * rows, h, dtype=dtype)
    w[:V] = torch.randn(V, h, generator=gen, dtype=dtype) * 0.3
    labels = torch.randint(0, V, (D * tokens_per_rank,), generator=gen)
    labels[::5] = -100
    return x, w, labels, rows


def _share(comm, x, w, labels, rows):
    """This rank's tokens (contiguous rows: the head does not care about the zigzag order) and vocab shard."""
    p, n = comm.rank, x.shape[0] // comm.size
    x_p = x[p * n:(p + 1) * n].clone().view(1, n, -1).requires_grad_()
    w_p = w[p * rows:(p + 1) * rows].clone().requires_grad_()
    return x_p, w_p, labels[p * n:(p + 1) * n].view(1, n), (labels != -100).sum().to(x.dtype)


def _exactness(comm):
    V, n, h, D = 61, 26, 16, comm.size  # 61 rows pad to 62; 26 local tokens, tiles of 7 (and 1, and untiled)
    x, w, labels, rows = _inputs(V, n, h, D, torch.float64)
    xr, wr = x.clone().requires_grad_(), w[:V].clone().requires_grad_()
    ref = F.cross_entropy(xr @ wr.t(), labels, ignore_index=-100)
    ref.backward()
    p = comm.rank
    out = []
    for chunk in (7, 1, UNTILED):
        x_p, w_p, labels_p, n_valid = _share(comm, x, w, labels, rows)
        loss = tsp_lm_head_loss(x_p, w_p, labels_p, n_valid, V, comm, chunk_tokens=chunk)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=comm.group)
        dw_ref = torch.zeros_like(w_p)
        dw_ref[:max(min(rows, V - p * rows), 0)] = wr.grad[p * rows:(p + 1) * rows]
        out.append({"loss": (total - ref.detach()).abs().item() / ref.item(),
                    "dx": ((x_p.grad[0] - xr.grad[p * n:(p + 1) * n]).norm() / xr.grad.norm()).item(),
                    "dw": ((w_p.grad - dw_ref).norm() / wr.grad.norm()).item()})
    return out


def _loss_peak(comm, chunk):
    from torch.distributed._tools.mem_tracker import MemTracker

    V, S, h = 8192, 2048, 64
    x, w, labels, rows = _inputs(V, S // comm.size, h, comm.size, torch.float32)
    x_p, w_p, labels_p, n_valid = _share(comm, x, w, labels, rows)
    tracker = MemTracker()
    with tracker:  # only what the loss allocates: inputs exist already
        tsp_lm_head_loss(x_p, w_p, labels_p, n_valid, V, comm, chunk_tokens=chunk).backward()
    return max(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())


def _on_ranks():
    comm = TSPComm(dist.group.WORLD)
    return {"exact": _exactness(comm), "peak_tiled": _loss_peak(comm, 256), "peak_untiled": _loss_peak(comm, UNTILED)}


def test_tiled_head_is_exact_and_bounds_the_transient():
    per_rank = run_on_local_ranks(_on_ranks, 2, timeout_s=120)
    for rank, r in enumerate(per_rank):
        for chunk, errs in zip((7, 1, "untiled"), r["exact"]):
            assert max(errs.values()) < 1e-12, (rank, chunk, errs)
        # untiled: the whole [1024, 4096] fp32 logits (16 MiB); tiled: a quarter of it plus O(S h + V/D h) state
        mib = 2 ** 20
        assert r["peak_untiled"] > 16 * mib, r
        assert r["peak_tiled"] < r["peak_untiled"] / 2, r
    print({k: v for k, v in per_rank[0].items() if k.startswith("peak")})


def test_chunk_option_is_checked():
    with pytest.raises(TSPConfigError, match="lm_head_chunk_tokens"):
        TSPOptions(lm_head_chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        tsp_lm_head_loss(torch.zeros(1, 2, 4), torch.zeros(3, 4), torch.zeros(1, 2, dtype=torch.long),
                         torch.tensor(2.0), 3, TSPComm.single(), chunk_tokens=0)
