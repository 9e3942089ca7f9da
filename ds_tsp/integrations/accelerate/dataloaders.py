"""Dataloaders under TSP: samples are split over the DATA axis only, and every batch is cut to the zigzag shard.

The user's DataLoader (any dataset, sampler and collate_fn, e.g. DataCollatorWithFlattening) is re-prepared by
Accelerate's own `prepare_data_loader` with num_processes = data degree and process_index = data rank, so all TSP
ranks of a replica draw the same samples, epochs / seeds / even_batches / resume work as Accelerate does them, and
`gradient_state` still tracks the end of the data for `gather_for_metrics`. Each collated batch (HF keys) is then
shifted and cut by `ds_tsp.core.partition.shard_batch` and carries `tsp_shard`, so TSPForCausalLM knows it is sharded.
"""
from __future__ import annotations

from ds_tsp.core.comm import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.partition import shard_batch

# Keys DataCollatorWithFlattening can add for flash-attn varlen: TSP derives documents from position_ids instead.
_DERIVED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def shard_hf_batch(batch: dict, comm: TSPComm) -> dict:
    """An HF-style batch (input_ids, labels / shift_labels, position_ids, attention_mask) -> this rank's shard."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TSPConfigError("TSP dataloaders need dict batches with input_ids (and labels / position_ids / "
                             f"attention_mask), got {type(batch).__name__}")
    if "tsp_shard" in batch:
        return batch
    batch = {k: v for k, v in batch.items() if k not in _DERIVED_KEYS}
    labels, shifted = batch.pop("labels", None), batch.pop("shift_labels", None)
    if labels is not None and shifted is not None:
        raise TSPConfigError("a batch with both labels and shift_labels: keep one")
    input_ids = batch.pop("input_ids")
    out = shard_batch(input_ids, tsp=comm.size, rank=comm.rank, labels=shifted if shifted is not None else labels,
                      labels_are_shifted=shifted is not None, position_ids=batch.pop("position_ids", None),
                      attention_mask=batch.pop("attention_mask", None))
    sharded = {"input_ids": out["input_ids"], "position_ids": out["position_ids"], "tsp_shard": (comm.rank, comm.size),
               "seq_len": out["seq_len"]}
    if labels is not None or shifted is not None:
        sharded["shift_labels"] = out["shift_labels"]
    if "attention_mask" in out:
        sharded["attention_mask"] = out["attention_mask"]
    return {**batch, **sharded}  # anything else stays: the model names it if it does not take it


class TSPShardedLoader:
    """Wraps an Accelerate-prepared loader (data-axis sampling) and yields this rank's zigzag shard of each batch."""

    def __init__(self, loader, comm: TSPComm, batch_size: int | None = None):
        self.loader, self.comm = loader, comm
        self.batch_size = batch_size  # per data replica (the prepared loader reports None: it has a batch sampler)

    def __iter__(self):
        for batch in self.loader:
            yield shard_hf_batch(batch, self.comm)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):  # batch_size, dataset, sampler, set_epoch, ... of the wrapped loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
