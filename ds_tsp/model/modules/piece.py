"""What every sharded piece of a TSP model shares: its packed parameter, read from and written to the HF tensors'
slices it owns (the protocol ds_tsp.model.modules.decoder's docstring tables), and LoRA on top when attached."""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.model.modules.slices import HFRanges


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


class ShardedPiece(nn.Module):
    PIECES: dict[str, str] = {}  # packed-layout piece -> HF tensor name (relative)

    def hf_keys(self) -> dict[str, str | tuple[str, ...]]:
        """HF tensor name -> the packed layout's piece it fills, or the pieces (in hf_slices' order) of a tensor this
        rank reads in several ranges (a fused projection)."""
        present = {key for key, _ in self.spec.layout.pieces}
        return {name: key for key, name in self.PIECES.items() if key in present}

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's packed shard from HF-named full tensors (relative names)."""
        def cut(name, where):
            if isinstance(where, HFRanges):
                return tuple(full[name].narrow(d, a, n) for d, a, n in where)
            return full[name].narrow(*where)

        return self.pack_slices({name: cut(name, where) for name, where in self.hf_slices().items()})

    def pack_slices(self, pieces: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """This rank's packed shard from its slices ({HF name: slice, or a tuple of slices for an HFRanges name})."""
        return self.spec.layout.pack({key: t for name, keys in self.hf_keys().items() if name in pieces
                                      for key, t in zip(_as_tuple(keys), _as_tuple(pieces[name]), strict=True)})

    def hf_targets(self, packed: torch.Tensor) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        """Views of the packed parameter that each HF slice fills, so a checkpoint reads straight into it."""
        views = self.spec.layout.unpack(packed)
        return {name: tuple(views[k] for k in keys) if isinstance(keys, tuple) else views[keys]
                for name, keys in self.hf_keys().items()}

    def weight_shard(self) -> torch.Tensor:
        """What the layer's Function streams: the packed parameter, or with LoRA base + delta (differentiable)."""
        lora = getattr(self, "lora", None)
        return self.packed_shard if lora is None else lora(self.packed_shard)
