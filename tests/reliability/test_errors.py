"""Bad input gets one clear error naming the field and the fix; a bad shard on one rank fails every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.topology import ParallelLayout
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM

SHAPE = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("changes, tsp, field", [
    ({"num_heads": 6, "hidden_size": 36, "num_kv_heads": 6}, 4, "num_heads"),
    ({"num_heads": 12, "hidden_size": 48, "num_kv_heads": 3}, 2, "num_kv_heads"),
    ({"intermediate_size": 66}, 4, "intermediate_size"),
])
def test_degree_must_divide_the_model(changes, tsp, field):
    with pytest.raises(TSPConfigError, match=field) as err:
        ModelShape(**{**SHAPE, **changes}).check_tsp_degree(tsp)
    assert "pick tsp among" in str(err.value)


def test_hidden_must_divide_by_heads():
    with pytest.raises(TSPConfigError, match="hidden_size=30 is not divisible by num_heads=4"):
        ModelShape(**{**SHAPE, "hidden_size": 30})


def test_world_size_must_fit_the_layout():
    with pytest.raises(TSPConfigError, match="tsp"):
        ParallelLayout.from_world_size(6, tsp=4)


@pytest.mark.parametrize("seq, message", [(0, "empty sequence"), (1, "at least 2 tokens")])
def test_too_short_sequences(seq, message):
    with pytest.raises(TSPConfigError, match=message):
        shard_batch(torch.zeros(1, seq, dtype=torch.long), tsp=2, rank=0)


def test_missing_position_ids():
    model = ShardedCausalLM(ModelShape(**SHAPE), TSPComm.single())
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(TSPConfigError, match="position_ids is missing"):
        model(ids, ids, None)


def _bad_token_on_rank_one():
    comm = TSPComm(dist.group.WORLD)
    model = ShardedCausalLM(ModelShape(**SHAPE), comm)
    ids = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = shard_batch(ids, tsp=comm.size, rank=comm.rank)
    if comm.rank == 1:
        batch["input_ids"][0, 0] = 32  # only rank 1 sees the bad id; every rank must still fail
    try:
        model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
    except TSPConfigError as err:
        return str(err)
    return None


def test_token_id_out_of_vocab_fails_every_rank():
    messages = run_on_local_ranks(_bad_token_on_rank_one, 2, timeout_s=60)
    assert all(m is not None and "vocab_size=32" in m and "input_ids" in m for m in messages), messages
