"""Dataloaders under TSP: samples are split over the DATA axis only, and every batch is cut to the zigzag shard.

The user's DataLoader (any dataset, sampler and collate_fn, e.g. DataCollatorWithFlattening) is re-prepared by
Accelerate's own `prepare_data_loader` with num_processes = data degree and process_index = data rank, so all TSP
ranks of a replica draw the same samples, epochs / seeds / even_batches / resume work as Accelerate does them, and
`gradient_state` still tracks the end of the data for `gather_for_metrics`. Each collated batch (HF keys) is then
shifted and cut by `ds_tsp.core.tokens.zigzag.shard_batch` and carries `tsp_shard`, so TSPForCausalLM knows it is
sharded.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.tokens.zigzag import shard_batch

# Keys flattening collators add for varlen kernels (transformers' DataCollatorWithFlattening, TRL's padding-free and
# packing collator, a packed dataset's seq_lengths). TSP reads packed documents from position_ids restarting at 0
# (core/tokens/documents.py): each key is turned into such position_ids, or checked against the batch's position_ids.
_DOCUMENT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "seq_lengths")
# varlen buffer sizes, implied by cu_seq_lens: nothing left to honour once the documents are known
_KERNEL_SIZE_KEYS = ("max_length_q", "max_length_k")


def _document_break(positions: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: a document starts here (transformers' rule: position_ids do not continue by +1)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def _positions_from(key: str, value, shape: tuple[int, int]) -> torch.Tensor:
    """[B, S] position_ids restarting at 0 per document, from one packed-document key (on the host)."""
    rows, length = shape
    if key.startswith("cu_seq_lens"):
        cu = torch.as_tensor(value).reshape(-1).to("cpu", torch.int64)
        sizes = cu.diff()
        if rows != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != length or bool((sizes < 1).any()):
            raise TSPConfigError(f"{key}={cu.tolist()}: TSP honours cumulative document lengths of ONE flattened row "
                                 f"(0, ..., {length}) for a padding-free batch [1, seq]; the batch has input_ids "
                                 f"{list(shape)}")
        return torch.cat([torch.arange(int(n)) for n in sizes])[None]
    if key == "seq_idx":
        idx = torch.as_tensor(value).to("cpu", torch.int64)
        idx = idx.expand(rows, length) if idx.dim() == 2 and idx.shape == (1, length) else idx
        if tuple(idx.shape) != (rows, length):
            raise TSPConfigError(f"seq_idx has shape {list(idx.shape)} but input_ids {list(shape)}: one document "
                                 "index per token")
        starts = torch.ones_like(idx, dtype=torch.bool)
        starts[:, 1:] = idx[:, 1:] != idx[:, :-1]
        column = torch.arange(length).expand(rows, length)
        return column - torch.cummax(torch.where(starts, column, torch.zeros_like(column)), dim=1).values
    # seq_lengths: document lengths per row (a list per row, or a [B, n] tensor padded with 0); one flattened row
    # may carry several examples' lists. Tokens past the documents are padding, position 0 each (as TRL pads).
    lists = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    lists = [[int(n) for n in (row if isinstance(row, (list, tuple)) else [row]) if int(n) > 0] for row in lists]
    if rows == 1 and len(lists) > 1:
        lists = [[n for row in lists for n in row]]
    if len(lists) != rows or any(sum(row) > length for row in lists):
        raise TSPConfigError(f"seq_lengths={lists}: expected the document lengths of each of the {rows} rows, each "
                             f"summing to at most {length} tokens (input_ids {list(shape)})")
    out = torch.zeros(rows, length, dtype=torch.int64)
    for b, row in enumerate(lists):
        out[b, :sum(row)] = torch.cat([torch.arange(n) for n in row]) if row else out[b, :0]
    return out


def packed_document_positions(batch: dict) -> dict:
    """The batch with its packed-document keys (cu_seq_lens_q/k, seq_idx, seq_lengths) turned into position_ids
    restarting at 0 per document, what the model's packed-document path reads; when the batch carries position_ids
    too, every key must mark the same document starts (else a TSPConfigError naming it). max_length_q/k (kernel
    buffer sizes) go with them. One host read of the small index tensors per batch."""
    given = {k: batch[k] for k in _DOCUMENT_KEYS if batch.get(k) is not None}
    batch = {k: v for k, v in batch.items() if k not in _DOCUMENT_KEYS + _KERNEL_SIZE_KEYS}
    if not given:
        return batch
    input_ids = batch["input_ids"]
    shape = tuple(input_ids.shape)
    derived = {key: _positions_from(key, value, shape) for key, value in given.items()}
    if batch.get("position_ids") is not None:
        reference, name = batch["position_ids"].to("cpu").expand(shape), "position_ids"
    else:
        name, reference = next(iter(derived.items()))
        batch["position_ids"] = reference.to(input_ids.device)
    for key, positions in derived.items():
        if not torch.equal(_document_break(positions), _document_break(reference)):
            raise TSPConfigError(f"{key} and {name} mark different packed-document starts; pass consistent keys "
                                 "(TSP attends within the documents position_ids restarting at 0 mark)")
    return batch


def shard_hf_batch(batch: dict, comm: TSPComm) -> dict:
    """An HF-style batch (input_ids, labels / shift_labels, position_ids, attention_mask) -> this rank's shard."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TSPConfigError("TSP dataloaders need dict batches with input_ids (and labels / position_ids / "
                             f"attention_mask), got {type(batch).__name__}")
    if "tsp_shard" in batch:
        return batch
    batch = packed_document_positions(batch)
    labels, shifted = batch.pop("labels", None), batch.pop("shift_labels", None)
    if labels is not None and shifted is not None:
        raise TSPConfigError("a batch with both labels and shift_labels: keep one")
    input_ids = batch.pop("input_ids")
    out = shard_batch(input_ids, tsp=comm.size, rank=comm.rank, labels=shifted if shifted is not None else labels,
                      labels_are_shifted=shifted is not None, position_ids=batch.pop("position_ids", None),
                      attention_mask=batch.pop("attention_mask", None),
                      cp=comm.cp_size, cp_rank=comm.cp_rank)
    sharded = {"input_ids": out["input_ids"], "position_ids": out["position_ids"], "tsp_shard": (comm.rank, comm.size),
               "seq_len": out["seq_len"]}
    if labels is not None or shifted is not None:
        sharded["shift_labels"] = out["shift_labels"]
    if "attention_mask" in out:
        sharded["attention_mask"] = out["attention_mask"]
    return {**batch, **sharded}  # anything else stays: the model names it if it does not take it


def guarded_batches(loader, comm: TSPComm | None):
    """The batches of an Accelerate-prepared loader, each fetch bounded by comm's timeout_s with the watchdog's one
    line: Accelerate posts world collectives there (the sampler generator's RNG broadcast when an epoch starts, the
    dispatcher's batch broadcast). Errors of the data pipeline itself propagate as they are."""
    import torch.distributed as dist

    if comm is None or not dist.is_initialized() or dist.get_world_size() == 1:
        yield from loader
        return
    batches = iter(loader)
    while True:
        with comm.guard("the data loader's batch fetch (Accelerate's RNG-state / batch broadcast)",
                        group=dist.group.WORLD, context="data loading", comm_errors_only=True):
            try:
                batch = next(batches)
            except StopIteration:
                return
        yield batch


class _PreparedLoaderView:
    """A view of an Accelerate-prepared loader: its length and attributes (batch_size, dataset, sampler, set_epoch,
    ...) are the wrapped loader's; subclasses say what each batch becomes."""

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class WholeBatchLoader(_PreparedLoaderView):
    """An Accelerate-prepared loader whose batches stay whole (data-axis sampled, never cut: GRPO / RLOO prompt
    rows, reward / DPO / VLM batches), each fetch bounded like TSPShardedLoader's (guarded_batches)."""

    def __init__(self, loader, comm: TSPComm | None):
        self.loader, self.comm = loader, comm

    def __iter__(self):
        yield from guarded_batches(self.loader, self.comm)


class TSPShardedLoader(_PreparedLoaderView):
    """Wraps an Accelerate-prepared loader (data-axis sampling) and yields this rank's zigzag shard of each batch."""

    def __init__(self, loader, comm: TSPComm, batch_size: int | None = None, whole=None):
        self.loader, self.comm = loader, comm
        self.batch_size = batch_size  # per data replica (the prepared loader reports None: it has a batch sampler)
        # whole() True: the batches stay whole (a vision-language model shards its tokens itself); read per epoch
        self.whole = whole

    def __iter__(self):
        whole = self.whole is not None and self.whole()
        for batch in guarded_batches(self.loader, self.comm):
            yield batch if whole else shard_hf_batch(batch, self.comm)
