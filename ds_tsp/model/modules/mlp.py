"""The gated MLP as a sharded piece: gate/up rows and down columns [p*F/D, (p+1)*F/D) packed in one parameter
(ds_tsp.core.layers.mlp passes the shards around the ring)."""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.grads.clip import mark_sharded
from ds_tsp.core.layers.mlp import MLPSpec, tsp_gated_mlp
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.model.modules.piece import ShardedPiece
from ds_tsp.model.modules.slices import HFRanges, HFSlice


class TSPGatedMLP(ShardedPiece):
    PIECES = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device, recompute_projections: bool = True):
        super().__init__()
        self.comm, self.intermediate_size = comm, shape.intermediate_size
        self.fused = shape.fused_gate_up  # Phi-3: gate and up rows in one gate_up_proj tensor
        self.spec = MLPSpec(hidden=shape.hidden_size, ffn_per_rank=shape.intermediate_size // comm.size,
                            recompute_projections=recompute_projections, activation=shape.mlp_activation)
        self.packed_shard = mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))
        self.lora = None  # a ds_tsp.model.peft.lora.ShardLoRA when PEFT LoRA targets this layer's MLP

    def forward(self, x):
        return tsp_gated_mlp(x, self.weight_shard(), self.spec, self.comm)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = self.spec.hidden, self.intermediate_size
        if self.fused:
            return {"gate_up_proj.weight": (2 * f, h), "down_proj.weight": (h, f)}
        return {"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)}

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice | HFRanges]:
        p, f = self.comm.rank if rank is None else rank, self.spec.ffn_per_rank
        if self.fused:  # rows [0, F) gate, [F, 2F) up
            F = self.intermediate_size
            return {"gate_up_proj.weight": HFRanges(((0, p * f, f), (0, F + p * f, f))),
                    "down_proj.weight": (1, p * f, f)}
        return {"gate_proj.weight": (0, p * f, f), "up_proj.weight": (0, p * f, f),
                "down_proj.weight": (1, p * f, f)}

    def hf_keys(self) -> dict[str, str | tuple[str, ...]]:
        return {"gate_up_proj.weight": ("gate", "up"), "down_proj.weight": "down"} if self.fused else super().hf_keys()

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        views = [self.spec.layout.unpack(s) for s in shards]
        gate, up = torch.cat([v["gate"] for v in views]), torch.cat([v["up"] for v in views])
        down = torch.cat([v["down"] for v in views], dim=1)
        if self.fused:
            return {"gate_up_proj.weight": torch.cat((gate, up)), "down_proj.weight": down}
        return {"gate_proj.weight": gate, "up_proj.weight": up, "down_proj.weight": down}

    def extra_repr(self) -> str:
        return f"ffn/rank={self.spec.ffn_per_rank}, tsp_rank={self.comm.rank}/{self.comm.size}"
