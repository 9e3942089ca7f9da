"""What every sharded piece of a TSP model shares: its packed parameter, read from and written to the HF tensors'
slices it owns (the protocol ds_tsp.model.modules.decoder's docstring tables), and LoRA on top when attached."""
from __future__ import annotations

import torch
from torch import nn


class ShardedPiece(nn.Module):
    PIECES: dict[str, str] = {}  # packed-layout piece -> HF tensor name (relative)

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's packed shard from HF-named full tensors (relative names)."""
        return self.pack_slices({name: full[name].narrow(dim, start, length)
                                 for name, (dim, start, length) in self.hf_slices().items()})

    def pack_slices(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.spec.layout.pack({key: pieces[name] for key, name in self.PIECES.items() if name in pieces})

    def hf_targets(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the packed parameter that each HF slice fills, so a checkpoint reads straight into it."""
        views = self.spec.layout.unpack(packed)
        return {name: views[key] for key, name in self.PIECES.items() if key in views}

    def weight_shard(self) -> torch.Tensor:
        """What the layer's Function streams: the packed parameter, or with LoRA base + delta (differentiable)."""
        lora = getattr(self, "lora", None)
        return self.packed_shard if lora is None else lora(self.packed_shard)
