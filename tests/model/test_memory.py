"""Saved-for-backward bytes per rank fall ~1/D, and nothing saved is a foreign shard or a full-sequence tensor."""
from __future__ import annotations

import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM

SEQ = 256  # global sequence: no model dimension equals it, so a saved full-sequence tensor is recognisable
SHAPE = ModelShape(vocab_size=96, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=8, num_kv_heads=4)


def _saved_for_backward():
    group = dist.group.WORLD if dist.is_initialized() else None
    comm = TSPComm(group)
    model = ShardedCausalLM(SHAPE, comm)
    ids = torch.randint(0, SHAPE.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    batch = shard_batch(ids, tsp=comm.size, rank=comm.rank)
    saved = {}

    def pack(t):
        saved[(t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    by_storage = {}
    for (ptr, _, _), t in saved.items():
        by_storage[ptr] = max(by_storage.get(ptr, 0), t.untyped_storage().nbytes())
    shard_sizes = {p.numel() for n, p in model.named_parameters() if getattr(p, "tsp_sharded", False)}
    foreign = [tuple(t.shape) for (ptr, _, _), t in saved.items() if t.numel() in shard_sizes and ptr not in own]
    full_seq = [tuple(t.shape) for t in saved.values() if SEQ in t.shape]
    loss.backward()
    return {"saved_bytes": sum(by_storage.values()), "foreign_shards": foreign, "full_sequence": full_seq}


def test_saved_bytes_fall_with_degree():
    """Every rank (not one of them): no foreign weight shard and no full-sequence tensor kept for backward, and the
    largest rank's saved bytes fall with the degree."""
    measured = {1: [_saved_for_backward()]}
    for tsp in (2, 4):
        measured[tsp] = run_on_local_ranks(_saved_for_backward, tsp, timeout_s=180)
    for tsp, ranks in measured.items():
        assert len(ranks) == tsp
        for rank, m in enumerate(ranks):
            assert m["foreign_shards"] == [], (tsp, rank, m)
            assert tsp == 1 or m["full_sequence"] == [], (tsp, rank, m)
    largest = {tsp: max(m["saved_bytes"] for m in ranks) for tsp, ranks in measured.items()}
    print(largest)
    assert largest[2] / largest[1] < 0.55, largest
    assert largest[4] / largest[1] < 0.30, largest
