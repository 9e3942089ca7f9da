"""Gemma 4's per-layer inputs (PLE) as sharded pieces (ds_tsp.core.layers.per_layer_input runs them):

| module (HF prefix)                       | parameter    | this rank's part                                   |
|------------------------------------------|--------------|----------------------------------------------------|
| model.embed_tokens_per_layer             | vocab_shard  | vocab rows, like the embedding (TSPVocabEmbedding) |
| model.per_layer_model_projection         | packed_shard | rows [p*N/D, (p+1)*N/D) of [N, h], N = layers * P  |
| model.per_layer_projection_norm          | weight       | replicated [P], grads summed                       |
| model.layers.i.per_layer_input_gate /    | packed_shard | gate rows and projection columns                   |
|   per_layer_projection                   |              | [p*P/D, (p+1)*P/D)                                 |
| model.layers.i.post_per_layer_input_norm | weight       | replicated [h], grads summed                       |
"""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.grads.clip import mark_sharded
from ds_tsp.core.layers.norm import TSPRMSNorm
from ds_tsp.core.layers.per_layer_input import ColumnSpec, PerLayerGateSpec, tsp_column_linear, tsp_per_layer_gate
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.model.modules.piece import ShardedPiece
from ds_tsp.model.modules.slices import HFSlice
from ds_tsp.model.modules.vocab import TSPVocabEmbedding


class TSPColumnLinear(ShardedPiece):
    """A bias-free Linear [N, h] whose output rows are split over the TSP ranks (per_layer_model_projection)."""

    PIECES = {"w": "weight"}

    def __init__(self, out_features: int, hidden: int, comm: TSPComm, dtype, device):
        super().__init__()
        self.comm, self.out_features = comm, out_features
        self.spec = ColumnSpec(hidden=hidden, rows_per_rank=out_features // comm.size)
        self.packed_shard = mark_sharded(nn.Parameter(torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))

    def forward(self, x):
        return tsp_column_linear(x, self.packed_shard, self.spec, self.comm)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.out_features, self.spec.hidden)}

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice]:
        p, n = self.comm.rank if rank is None else rank, self.spec.rows_per_rank
        return {"weight": (0, p * n, n)}

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight": torch.cat([self.spec.layout.unpack(s)["w"] for s in shards])}

    def extra_repr(self) -> str:
        return f"rows/rank={self.spec.rows_per_rank}, tsp_rank={self.comm.rank}/{self.comm.size}"


class TSPPerLayerGate(ShardedPiece):
    """A decoder layer's per_layer_input_gate [P, h] and per_layer_projection [h, P], sharded over P."""

    PIECES = {"gate": "per_layer_input_gate.weight", "proj": "per_layer_projection.weight"}

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device):
        super().__init__()
        self.comm, self.width = comm, shape.per_layer_input_size
        self.spec = PerLayerGateSpec(hidden=shape.hidden_size, width_per_rank=self.width // comm.size)
        self.packed_shard = mark_sharded(nn.Parameter(torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))

    def forward(self, x, per_layer_input):
        return tsp_per_layer_gate(x, per_layer_input, self.packed_shard, self.spec, self.comm)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        h, w = self.spec.hidden, self.width
        return {"per_layer_input_gate.weight": (w, h), "per_layer_projection.weight": (h, w)}

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice]:
        p, n = self.comm.rank if rank is None else rank, self.spec.width_per_rank
        return {"per_layer_input_gate.weight": (0, p * n, n), "per_layer_projection.weight": (1, p * n, n)}

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        views = [self.spec.layout.unpack(s) for s in shards]
        return {"per_layer_input_gate.weight": torch.cat([v["gate"] for v in views]),
                "per_layer_projection.weight": torch.cat([v["proj"] for v in views], dim=1)}

    def extra_repr(self) -> str:
        return f"width/rank={self.spec.width_per_rank}, tsp_rank={self.comm.rank}/{self.comm.size}"


class PerLayerInputs(nn.Module):
    """The model-wide half of PLE: every layer's input [B, L, num_layers, P] of the local tokens, from their ids
    and their (scaled) embeddings, as transformers' Gemma4TextModel.get_per_layer_inputs + project_per_layer_inputs:
        ((norm(per_layer_model_projection(embeds) * h ** -0.5) + embed_tokens_per_layer(ids)) * 2 ** -0.5"""

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device):
        super().__init__()
        self.layers, self.width, self.hidden = shape.num_layers, shape.per_layer_input_size, shape.hidden_size
        self.embed_tokens_per_layer = TSPVocabEmbedding(shape.per_layer_input_vocab_size, self.layers * self.width,
                                                        comm, dtype, device, padding_idx=shape.pad_token_id,
                                                        scale=self.width ** 0.5)
        self.per_layer_model_projection = TSPColumnLinear(self.layers * self.width, self.hidden, comm, dtype, device)
        self.per_layer_projection_norm = TSPRMSNorm(self.width, shape.rms_norm_eps, comm, dtype, device)

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        split = (*input_ids.shape, self.layers, self.width)
        projected = self.per_layer_model_projection(embeds) * self.hidden ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(split))
        return (projected + self.embed_tokens_per_layer(input_ids).reshape(split)) * 2.0 ** -0.5

    def sharded_modules(self, prefix: str = "model.") -> list[tuple[str, ShardedPiece, nn.Parameter]]:
        return [(f"{prefix}embed_tokens_per_layer.", self.embed_tokens_per_layer,
                 self.embed_tokens_per_layer.vocab_shard),
                (f"{prefix}per_layer_model_projection.", self.per_layer_model_projection,
                 self.per_layer_model_projection.packed_shard)]

    def replicated_params(self, prefix: str = "model.") -> dict[str, nn.Parameter]:
        return {f"{prefix}per_layer_projection_norm.weight": self.per_layer_projection_norm.weight}
