"""Zigzag partitioner: exact placement on coordinate-encoded data, round trips, labels, validation messages."""
from __future__ import annotations

import pytest
import torch

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.tokens.zigzag import (
    global_to_rank_order_index,
    pad_to,
    padded_length,
    rank_order_to_global_index,
    shard,
    shard_batch,
    shift_labels,
    unshard,
    zigzag_positions,
)

IGNORE = -100


def encoded(batch: int, seq: int, extra: tuple[int, ...] = ()) -> torch.Tensor:
    """[batch, seq, *extra] with value = global position * 1000 + batch index (same across extra dims)."""
    pos = torch.arange(seq).view(1, seq)
    b = torch.arange(batch).view(batch, 1)
    x = pos * 1000 + b
    return x.view(batch, seq, *([1] * len(extra))).expand(batch, seq, *extra).clone()


@pytest.mark.parametrize(("seq_len", "tsp", "expected"), [(1, 1, 2), (2, 1, 2), (3, 1, 4), (8, 2, 8), (9, 2, 12),
                                                          (7, 4, 8), (17, 4, 24), (5, 3, 6)])
def test_padded_length(seq_len, tsp, expected):
    assert padded_length(seq_len, tsp) == expected


def test_zigzag_positions_example():
    # S_pad = 8, D = 2, c = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(4, 1, 0).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("tsp", [1, 2, 3, 4, 5])
def test_zigzag_positions_partition_and_balance(tsp):
    padded = 2 * tsp * 3
    c = padded // (2 * tsp)
    held = [zigzag_positions(padded, tsp, p) for p in range(tsp)]
    assert sorted(torch.cat(held).tolist()) == list(range(padded))
    # causal work of chunk i is ~(i+1): every rank holds chunks p and 2D-1-p, so it does 2D+1 units.
    for p, pos in enumerate(held):
        chunks = sorted({int(g) // c for g in pos})
        assert chunks == sorted({p, 2 * tsp - 1 - p})
        assert sum(i + 1 for i in (p, 2 * tsp - 1 - p)) == 2 * tsp + 1


@pytest.mark.parametrize("tsp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seq_len", [1, 7, 13, 20])
def test_shard_places_exact_positions_and_round_trips(tsp, seq_len):
    x = encoded(3, seq_len, (2,))
    padded = padded_length(seq_len, tsp)
    xp = pad_to(x, padded, -1)
    assert xp.shape == (3, padded, 2)
    assert torch.equal(xp[:, :seq_len], x) and bool((xp[:, seq_len:] == -1).all())
    shards = [shard(xp, tsp, p) for p in range(tsp)]
    for p, s in enumerate(shards):
        assert s.shape == (3, padded // tsp, 2)
        pos = zigzag_positions(padded, tsp, p)
        for b in range(3):
            for j, g in enumerate(pos.tolist()):
                want = g * 1000 + b if g < seq_len else -1
                assert s[b, j, 0].item() == want and s[b, j, 1].item() == want
    assert torch.equal(unshard(shards), xp)


def test_shard_along_other_dim():
    x = encoded(2, 8).t().contiguous()  # [S, B]
    shards = [shard(x, 2, p, dim=0) for p in range(2)]
    assert shards[1][:, 1].tolist() == [2001, 3001, 4001, 5001]
    assert torch.equal(unshard(shards, dim=0), x)


@pytest.mark.parametrize("tsp", [1, 2, 3, 4, 5])
def test_rank_order_index_inverts_all_gather(tsp):
    padded = 2 * tsp * 2
    x = encoded(2, padded)
    gathered = torch.cat([shard(x, tsp, p) for p in range(tsp)], dim=1)  # what an all-gather produces
    to_global = rank_order_to_global_index(padded, tsp)
    to_rank = global_to_rank_order_index(padded, tsp)
    assert torch.equal(gathered.index_select(1, to_global), x)
    assert torch.equal(x.index_select(1, to_rank), gathered)
    assert torch.equal(to_global[to_rank], torch.arange(padded))
    assert torch.equal(to_rank[to_global], torch.arange(padded))


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, IGNORE], [6, 7, 8, IGNORE]]
    assert shift_labels(labels, ignore_index=-1)[:, -1].tolist() == [-1, -1]
    assert labels.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]  # not modified in place


@pytest.mark.parametrize("tsp", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len", [2, 5, 16, 23])
def test_shard_batch_layout_and_targets(tsp, seq_len):
    batch = 2
    ids = encoded(batch, seq_len) + 7  # distinct, non-negative ids
    parts = [shard_batch(ids, tsp=tsp, rank=p, pad_token_id=3) for p in range(tsp)]
    padded = padded_length(seq_len, tsp)
    for p, part in enumerate(parts):
        assert part["seq_len"] == seq_len and part["padded_len"] == padded
        pos = zigzag_positions(padded, tsp, p)
        for key in ("input_ids", "shift_labels", "position_ids"):
            assert part[key].shape == (batch, padded // tsp) and part[key].dtype == torch.long
        # position ids are the global positions, continuing S, S+1, ... on the padding
        assert torch.equal(part["position_ids"], pos.expand(batch, -1))
        for b in range(batch):
            for j, g in enumerate(pos.tolist()):
                if g < seq_len:
                    assert part["input_ids"][b, j] == g * 1000 + b + 7
                    want = (g + 1) * 1000 + b + 7 if g + 1 < seq_len else IGNORE
                    assert part["shift_labels"][b, j] == want
                else:
                    assert part["input_ids"][b, j] == 3 and part["shift_labels"][b, j] == IGNORE
    # every original target (the token at t+1, for t < S-1) appears exactly once across ranks
    all_targets = torch.cat([part["shift_labels"] for part in parts], dim=1)
    for b in range(batch):
        got = sorted(t for t in all_targets[b].tolist() if t != IGNORE)
        assert got == ids[b, 1:].tolist()


def test_shard_batch_explicit_labels_positions_and_preshifted():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    labels = torch.tensor([[IGNORE, IGNORE, 22, 23, 24]])  # prompt masked out
    pos = torch.tensor([[0, 1, 2, 0, 1]])  # e.g. packed sequences
    part = shard_batch(ids, tsp=2, rank=0, labels=labels, position_ids=pos)
    # padded to 8, rank 0 holds positions 0, 1, 6, 7
    assert part["input_ids"].tolist() == [[10, 11, 0, 0]]
    assert part["shift_labels"].tolist() == [[IGNORE, 22, IGNORE, IGNORE]]
    assert part["position_ids"].tolist() == [[0, 1, 6, 7]]
    part1 = shard_batch(ids, tsp=2, rank=1, labels=labels, position_ids=pos)
    assert part1["shift_labels"].tolist() == [[23, 24, IGNORE, IGNORE]]
    assert part1["position_ids"].tolist() == [[2, 0, 1, 5]]

    pre = shard_batch(ids, tsp=1, rank=0, labels=shift_labels(labels), labels_are_shifted=True)
    assert pre["shift_labels"].tolist() == [[IGNORE, 22, 23, 24, IGNORE, IGNORE]]
    # [1, S] position ids broadcast over the batch, like HF's default
    two = shard_batch(ids.expand(2, -1), tsp=1, rank=0, position_ids=torch.arange(5).unsqueeze(0))
    assert two["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]] * 2


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(TSPConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_validation_messages_name_the_field():
    ids = torch.arange(8).view(1, 8)
    assert "input_ids" in _message(shard_batch, torch.arange(8), tsp=2, rank=0)
    assert "[batch, seq]" in _message(shard_batch, torch.arange(8), tsp=2, rank=0)
    assert "empty" in _message(shard_batch, torch.zeros(1, 0, dtype=torch.long), tsp=2, rank=0)
    assert "at least 2 tokens" in _message(shard_batch, torch.tensor([[5]]), tsp=2, rank=0)
    assert "labels" in _message(shard_batch, ids, tsp=2, rank=0, labels=torch.arange(7).view(1, 7))
    assert "position_ids" in _message(shard_batch, ids, tsp=2, rank=0, position_ids=torch.arange(8).view(2, 4))
    msg = _message(shard_batch, ids - 1, tsp=2, rank=0)
    assert "input_ids" in msg and "-1" in msg
    msg = _message(shard_batch, ids, tsp=2, rank=2)
    assert "rank=2" in msg and "tsp=2" in msg
    assert "rank=-1" in _message(shard_batch, ids, tsp=2, rank=-1)
    assert "tsp=0" in _message(shard_batch, ids, tsp=0, rank=0)
    assert "input_ids" in _message(shard_batch, ids.float(), tsp=2, rank=0)
    assert "pad_token_id" in _message(shard_batch, ids, tsp=2, rank=0, pad_token_id=-1)
    assert "labels_are_shifted" in _message(shard_batch, ids, tsp=2, rank=0, labels_are_shifted=True)
    assert "empty" in _message(padded_length, 0, 2)
    assert "tsp=0" in _message(padded_length, 4, 0)
    assert "2*tsp=4" in _message(shard, torch.zeros(1, 6), 2, 0)
    assert "padded_len=6" in _message(zigzag_positions, 6, 2, 0)
    assert "padded_len=4" in _message(pad_to, torch.zeros(1, 6), 4, 0)
    assert "shards" in _message(unshard, [torch.zeros(1, 4), torch.zeros(1, 2)])
    assert "shards" in _message(unshard, [])
