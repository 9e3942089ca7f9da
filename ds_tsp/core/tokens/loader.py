"""Batches for TSP training: data-parallel sampling over the data axis only, zigzag shards over the TSP axis
(and, with a cp axis, over the cp groups first: ds_tsp.core.tokens.zigzag).

Every TSP rank of a data replica draws the SAME samples (the sampler sees only the data axis) and keeps its
zigzag shard of them; labels are shifted before the sequence is cut, so no token's target is lost at a shard edge.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.topology import ProcessGroups
from ds_tsp.core.tokens.zigzag import shard_batch


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

    device: where the batch tensors are put (None: left on the CPU). `ds_tsp.initialize` passes the engine's
    device: DeepSpeed's engine does not move inputs, and the model's input check is a collective on its (NCCL
    under a launcher) group, which takes no CPU tensor.
    """

    def __init__(self, dataset: Dataset, groups: ProcessGroups, *, micro_batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, pad_token_id: int = 0,
                 device: torch.device | str | None = None):
        if micro_batch_size < 1:
            raise TSPConfigError(f"micro_batch_size={micro_batch_size}: must be >= 1")
        self.dataset, self.groups, self.pad_token_id = dataset, groups, pad_token_id
        self.sampler = DistributedSampler(dataset, num_replicas=groups.data_size, rank=groups.data_rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batches = BatchSampler(self.sampler, micro_batch_size, drop_last=drop_last)
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.device = None if device is None else torch.device(device)
        self._yielded = 0  # micro-batches handed out in this epoch (the position a checkpoint records)
        self._resume_at = 0  # micro-batches the next iteration skips (set by load_state_dict)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.sampler.epoch:
            self._yielded = self._resume_at = 0
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    # --- position, for checkpoints (layout-independent: counted in samples of the whole data axis) -------------
    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "samples_in_epoch": self._yielded * self._samples_per_batch(),
                "seed": self.seed, "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples"):
            mine = self.seed if key == "seed" else len(self.dataset)
            if state.get(key) != mine:
                raise TSPConfigError(f"the checkpoint's data loader had {key}={state.get(key)!r}, this one {mine!r}: "
                                     "resume with the same dataset and seed, or the data order cannot continue")
        per_batch = self._samples_per_batch()
        if state["samples_in_epoch"] % per_batch:
            raise TSPConfigError(
                f"the checkpoint stopped {state['samples_in_epoch']} samples into epoch {state['epoch']}, not a "
                f"multiple of this layout's {per_batch} samples per micro-batch round (micro_batch_size "
                f"{self.micro_batch_size} x data degree {self.groups.data_size}): pick a micro batch that divides it")
        self.sampler.set_epoch(state["epoch"])
        self._yielded = self._resume_at = state["samples_in_epoch"] // per_batch

    def _samples_per_batch(self) -> int:
        return self.micro_batch_size * self.groups.data_size

    def __iter__(self) -> Iterator[dict]:
        start, self._resume_at = self._resume_at, 0
        self._yielded = start
        for indices in itertools.islice(self.batches, start, None):
            self._yielded += 1
            samples = [self.dataset[i] for i in indices]
            batch = shard_batch(_stack(samples, "input_ids"), tsp=self.groups.tsp_size, rank=self.groups.tsp_rank,
                                labels=_stack(samples, "labels"), position_ids=_stack(samples, "position_ids"),
                                attention_mask=_stack(samples, "attention_mask"), pad_token_id=self.pad_token_id,
                                cp=getattr(self.groups, "cp_size", 1), cp_rank=getattr(self.groups, "cp_rank", 0))
            out = {k: batch[k] if self.device is None else batch[k].to(self.device)
                   for k in ("input_ids", "shift_labels", "position_ids", "attention_mask") if k in batch}
            out.update(tsp_shard=(self.groups.tsp_rank, self.groups.tsp_size), seq_len=batch["seq_len"])
            yield out


def pipeline_batches(loader) -> Iterator[tuple]:
    """Adapt TSP micro-batches to DeepSpeed's PipelineEngine: ((input_ids, position_ids, shift_labels), labels)."""
    while True:
        for batch in loader:
            yield (batch["input_ids"], batch["position_ids"], batch["shift_labels"]), batch["shift_labels"]
