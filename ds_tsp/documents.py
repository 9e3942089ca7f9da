"""Where packed documents start: the one rule TSP attention, its tests and the data path share.

transformers' convention (DataCollatorWithFlattening, and masking_utils.find_packed_sequence_indices): a new
document starts wherever position_ids do not continue by +1, e.g. [0 1 2 0 1 0 1 2 3] holds documents of 3, 2
and 4 tokens. Padding (attention_mask == 0) is cut off as documents of its own, so real tokens never attend to
padded keys; only left or right padding is accepted (a zero between ones would hide keys INSIDE a document, which
documents cannot express). Nothing here builds an [S, S] mask: the attention kernels take the start indices.
"""
from __future__ import annotations

import torch

from ds_tsp.errors import TSPConfigError

DocStarts = tuple[tuple[int, ...], ...]  # per batch row: sorted global token indices, the first is 0


def document_starts(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DocStarts | None:
    """Document starts of global [B, S] position_ids (and 0/1 attention_mask); None when every row is one document.

    One device-to-host copy of the boundaries per call (the kernels slice by python ints).
    """
    if position_ids.dim() != 2:
        raise TSPConfigError(f"position_ids has shape {list(position_ids.shape)}: expected [batch, seq]")
    breaks = torch.zeros_like(position_ids, dtype=torch.bool)
    breaks[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None:
        mask = attention_mask.to(torch.bool)
        _check_contiguous_padding(mask)
        breaks[:, 1:] |= mask[:, 1:] != mask[:, :-1]
    if not bool(breaks.any()):
        return None
    rows, cols = breaks.nonzero(as_tuple=True)
    starts: list[list[int]] = [[0] for _ in range(position_ids.shape[0])]
    for r, c in zip(rows.tolist(), cols.tolist()):
        starts[r].append(c)
    return tuple(tuple(s) for s in starts)


def _check_contiguous_padding(mask: torch.Tensor) -> None:
    """Every row must be (0*)(1+)(0*): left padding, right padding, or both."""
    rises = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0].long()
    bad = (rises > 1).nonzero()
    if bad.numel():
        row = int(bad[0])
        raise TSPConfigError(
            f"attention_mask row {row} has padding between real tokens: only left or right padding is supported; "
            "to pack several documents in one row, concatenate them without padding and let position_ids restart at "
            "0 for each (transformers' DataCollatorWithFlattening does this)")


def documents_of_lengths(lengths: list[int], device=None) -> torch.Tensor:
    """position_ids [sum(lengths)] of documents of these lengths packed back to back (restarting at 0)."""
    if not lengths or any(n < 1 for n in lengths):
        raise TSPConfigError(f"document lengths {lengths}: every document needs at least one token")
    return torch.cat([torch.arange(n, device=device) for n in lengths])
