"""Flat packed shards: one buffer per rank per layer, so one collective moves a rank's whole shard."""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Named 2-D/1-D pieces laid out back to back in one flat tensor."""

    pieces: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(prod(shape) for _, shape in self.pieces)

    def unpack(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views into `flat` (no copy)."""
        views, offset = {}, 0
        for name, shape in self.pieces:
            n = prod(shape)
            views[name] = flat[offset:offset + n].view(shape)
            offset += n
        return views

    def pack(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        missing = [name for name, _ in self.pieces if name not in tensors]
        if missing:
            raise KeyError(f"missing packed pieces {missing}")
        return torch.cat([tensors[name].reshape(-1) for name, _ in self.pieces])
