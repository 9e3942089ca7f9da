"""Where each vision token's embedding is made and where it is needed under TSP: the routing plan of one modality
for one step, built on the host from the full batch's token ids and grids before the layers run (identical on every
rank). ds_tsp.core.layers.vision moves the rows by it.

Items (images, or video frames: TSPForConditionalGeneration hands a (t, h, w) video over as t (1, h, w) items) are
cut into D contiguous runs balanced by patch count; rank p encodes run p.
Vision token k (k-th in row-major order of the batch, the order in which transformers' masked_scatter fills them)
belongs to item i(k), is encoded by rank e(k) and lands on rank z(k), the owner of its zigzag chunk, at local row
l(k) of z(k)'s shard [B, S_pad / D].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def frame_items(grid: torch.Tensor) -> torch.Tensor:
    """The items a grid [n, 3] of (t, h, w) rows encodes as: each (t, h, w) row as t (1, h, w) rows, in order (on the
    host). Exact for Qwen3.5 / Qwen3-VL's tower: it attends within a frame and repeats a video's patch positions per
    frame; its pixel rows are frame-major, so the frames' patches stay contiguous."""
    grid = grid.cpu()
    return grid.repeat_interleave(grid[:, 0], dim=0).index_fill(1, torch.tensor([0], device=grid.device), 1)


@dataclass(frozen=True)
class VisionRoute:
    """One modality's plan for this rank (module docstring). Host tensors and ints only."""

    items: tuple[int, int]  # [first, end) items this rank encodes
    patches: tuple[int, int]  # their rows of pixel_values
    send_order: torch.Tensor  # int64 [rows encoded here]: the encoded rows sorted by destination rank
    in_splits: list[int]  # rows sent to each rank
    out_splits: list[int]  # rows received from each rank
    local_index: torch.Tensor  # int64 [rows received]: their flat [B * L] index in this rank's shard

    @property
    def encodes(self) -> bool:
        return self.items[0] < self.items[1]


def item_owners(patches_per_item: list[int], tsp: int) -> list[int]:
    """The rank that encodes each item: D contiguous runs of items balanced by patch count (an item goes to the
    rank whose 1/D slice of all patches holds its middle patch)."""
    total, before, owners = sum(patches_per_item), 0, []
    for n in patches_per_item:
        owners.append(min(tsp - 1, (2 * before + n) * tsp // (2 * total)) if total else 0)
        before += n
    return owners


def plan_vision_route(token_mask: torch.Tensor, grid_thw: torch.Tensor, spatial_merge_size: int, padded_len: int,
                      tsp: int, rank: int, field: str = "image_grid_thw") -> VisionRoute:
    """This rank's VisionRoute. token_mask: [B, S] bool on the host (the modality's placeholder tokens of the full,
    unpadded batch); grid_thw: [items, 3] on the host; padded_len: the zigzag-padded sequence length. A grid whose
    token count differs from the placeholders raises a ValueError naming `field`."""
    grid = grid_thw.cpu().long()
    patches = (grid[:, 0] * grid[:, 1] * grid[:, 2]).tolist()
    tokens = [n // spatial_merge_size ** 2 for n in patches]
    batch, seq = token_mask.shape
    rows, cols = token_mask.cpu().nonzero(as_tuple=True)  # row-major: transformers' fill order
    if sum(tokens) != rows.numel():
        raise ValueError(f"{field} makes {sum(tokens)} vision tokens (spatial merge {spatial_merge_size}) but "
                         f"input_ids holds {rows.numel()} placeholder tokens: the grid does not match the number of "
                         "vision tokens")
    owners = item_owners(patches, tsp)
    encoder = torch.repeat_interleave(torch.tensor(owners, dtype=torch.long, device="cpu"),
                                      torch.tensor(tokens, dtype=torch.long, device="cpu"))
    c = padded_len // (2 * tsp)
    chunk = cols // c
    dest = torch.where(chunk < tsp, chunk, 2 * tsp - 1 - chunk)
    local = torch.where(chunk < tsp, cols - chunk * c, c + cols - chunk * c)
    flat = rows * (2 * c) + local
    first = owners.index(rank) if rank in owners else next((i for i, o in enumerate(owners) if o > rank),
                                                          len(owners))
    end = first + owners.count(rank)
    token_start, token_end = sum(tokens[:first]), sum(tokens[:end])
    mine = dest[token_start:token_end]
    here = dest == rank
    return VisionRoute(items=(first, end), patches=(sum(patches[:first]), sum(patches[:end])),
                       send_order=torch.argsort(mine, stable=True),
                       in_splits=torch.bincount(mine, minlength=tsp).tolist(),
                       out_splits=torch.bincount(encoder[here], minlength=tsp).tolist(),
                       local_index=flat[here])
