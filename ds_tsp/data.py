"""Batches for TSP training: data-parallel sampling over the data axis only, zigzag shards over the TSP axis.

Every TSP rank of a data replica draws the SAME samples (the sampler sees only the data axis) and keeps its
zigzag shard of them; labels are shifted before the sequence is cut, so no token's target is lost at a shard edge.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler

from ds_tsp.errors import TSPConfigError
from ds_tsp.partition import shard_batch
from ds_tsp.topology import ProcessGroups


def _stack(samples: list[dict], key: str) -> torch.Tensor | None:
    if key not in samples[0]:
        return None
    return torch.stack([torch.as_tensor(s[key], dtype=torch.long) for s in samples])


class TSPDataLoader:
    """Iterate micro-batches of this rank's zigzag shard: dicts with input_ids, shift_labels, position_ids.

    Samples are dicts with "input_ids" [S] and optionally "labels" [S] (unshifted, -100 ignored),
    "position_ids" [S] (restarting per packed document) and "attention_mask" [S]; all samples of a micro-batch
    must have the same length. Batches also carry "tsp_shard" = (tsp rank, tsp size) and "seq_len", so
    `ds_tsp.hf.TSPForCausalLM(**batch)` knows they are already sharded.
    """

    def __init__(self, dataset: Dataset, groups: ProcessGroups, *, micro_batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, pad_token_id: int = 0):
        if micro_batch_size < 1:
            raise TSPConfigError(f"micro_batch_size={micro_batch_size}: must be >= 1")
        self.dataset, self.groups, self.pad_token_id = dataset, groups, pad_token_id
        self.sampler = DistributedSampler(dataset, num_replicas=groups.data_size, rank=groups.data_rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batches = BatchSampler(self.sampler, micro_batch_size, drop_last=drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict]:
        for indices in self.batches:
            samples = [self.dataset[i] for i in indices]
            batch = shard_batch(_stack(samples, "input_ids"), tsp=self.groups.tsp_size, rank=self.groups.tsp_rank,
                                labels=_stack(samples, "labels"), position_ids=_stack(samples, "position_ids"),
                                attention_mask=_stack(samples, "attention_mask"), pad_token_id=self.pad_token_id)
            out = {k: batch[k] for k in ("input_ids", "shift_labels", "position_ids", "attention_mask") if k in batch}
            out.update(tsp_shard=(self.groups.tsp_rank, self.groups.tsp_size), seq_len=batch["seq_len"])
            yield out


def pipeline_batches(loader) -> Iterator[tuple]:
    """Adapt TSP micro-batches to DeepSpeed's PipelineEngine: ((input_ids, position_ids, shift_labels), labels)."""
    while True:
        for batch in loader:
            yield (batch["input_ids"], batch["position_ids"], batch["shift_labels"]), batch["shift_labels"]
