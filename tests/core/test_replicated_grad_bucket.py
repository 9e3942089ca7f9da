"""Replicated-weight grads (norms, q/k norms) are summed over the TSP group in ONE all-reduce per backward.

Per step, a model of L layers with Qwen3's q/k norms has 4L + 1 replicated weights: 4L + 1 blocking all-reduces
per use before, one bucketed all-reduce (posted by the last local grad, waited at the gate) now. Checked on 2
ranks, float64: the bucketed grads equal the per-use ones bit for bit, an AccumulateGrad hook (what DDP and
ZeRO-2 read) already sees the summed grad, accumulation over two backwards adds, and activation checkpointing
keeps one call.
"""
from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.grads.replicated import ReplicatedGradBucket
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM

LAYERS = 3
SHAPE = ModelShape(vocab_size=37, hidden_size=32, intermediate_size=32, num_layers=LAYERS, num_heads=4,
                   num_kv_heads=2, qk_norm=True)


def _step(options: TSPOptions, bucketed: bool, backwards: int = 1) -> dict:
    comm = TSPComm(dist.group.WORLD)
    model = ShardedCausalLM(SHAPE, comm, options=options, dtype=torch.float64).init_weights_(seed=3)
    with torch.no_grad():  # norm weights other than 1, different per parameter
        for i, p in enumerate(model.replicated_params().values()):
            p.add_(0.1 * (i + 1))
    ids = torch.randint(0, SHAPE.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    b = shard_batch(ids, tsp=comm.size, rank=comm.rank)
    at_hook = {}
    norm = model.model.layers[0].input_layernorm.weight  # the last one backward reaches

    def hook(p):
        at_hook.setdefault("grad", p.grad.clone())

    norm.register_post_accumulate_grad_hook(hook)
    closed = mock.patch.object(ReplicatedGradBucket, "__enter__", lambda self: self)  # per-use path
    comm.counter.reset()
    with closed if not bucketed else mock.MagicMock():
        for _ in range(backwards):
            model(b["input_ids"], b["shift_labels"], b["position_ids"]).backward()
    return {"calls": comm.counter.calls.get("replicated_grad", 0) // backwards,
            "bytes": comm.counter.bytes.get("replicated_grad", 0) // backwards,
            "grads": {n: p.grad.clone() for n, p in model.replicated_params().items()},
            "at_hook": at_hook["grad"], "final": norm.grad.clone()}


def _all():
    return {"per_use": _step(TSPOptions(), bucketed=False), "bucket": _step(TSPOptions(), bucketed=True),
            "bucket_x2": _step(TSPOptions(), bucketed=True, backwards=2),
            "checkpointed": _step(TSPOptions(activation_checkpointing=True), bucketed=True)}


def test_one_bucketed_all_reduce_per_step():
    per_rank = run_on_local_ranks(_all, 2, timeout_s=120)
    n_params = 4 * LAYERS + 1
    for r in per_rank:
        assert r["per_use"]["calls"] == n_params
        assert r["bucket"]["calls"] == 1 and r["checkpointed"]["calls"] == 1
        assert r["bucket"]["bytes"] == r["per_use"]["bytes"]  # the same volume, in one call
        for name, g in r["per_use"]["grads"].items():
            assert torch.equal(r["bucket"]["grads"][name], g), name
            assert torch.equal(r["checkpointed"]["grads"][name], g), name
            torch.testing.assert_close(r["bucket_x2"]["grads"][name], 2 * g, rtol=1e-14, atol=0)
        assert torch.equal(r["bucket"]["at_hook"], r["bucket"]["final"])  # hooks read the summed grad
    for name, g in per_rank[0]["bucket"]["grads"].items():  # replicas stay identical
        assert torch.equal(per_rank[1]["bucket"]["grads"][name], g), name
