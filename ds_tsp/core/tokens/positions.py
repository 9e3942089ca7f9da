"""What a step derives from its position_ids once, for every decoder layer: RoPE tables (and each query's scale,
where the family scales queries by position) and packed-document starts.

position_ids are GLOBAL positions of this rank's zigzag tokens (restarting at 0 where a packed document starts).
RoPE needs only the local ones; finding the documents needs the whole sequence, so it costs one all-gather over the
TSP group. The causal LM does both once in its forward; a pipeline stage, which receives position_ids as an
activation, asks a `StepPositions` shared by its layers, which pays once per micro-batch, not once per layer.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.documents import DocumentLayout, document_layout, document_starts
from ds_tsp.core.tokens.rope import query_scale, rope_cos_sin
from ds_tsp.core.tokens.zigzag import unshard


class RopeTables(NamedTuple):
    """What every attention layer of one step rotates its local queries and keys with."""

    cos: torch.Tensor  # [B, L, rotary_dim]
    sin: torch.Tensor
    q_scale: torch.Tensor | None = None  # [B, L, 1, 1] each query's scale after RoPE (Ministral 3); None: 1


def rope_tables(position_ids: torch.Tensor, shape: ModelShape, dtype: torch.dtype) -> RopeTables:
    """The RoPE tables of this rank's tokens (GLOBAL position_ids [B, L]), for every layer of the step."""
    cos, sin = rope_cos_sin(position_ids, shape.full_rotary_dim, shape.rope_theta, dtype, shape.rope_scaling)
    scale = (query_scale(position_ids, shape.query_scale_beta, shape.query_scale_period, dtype)
             if shape.query_scale_beta else None)
    return RopeTables(cos, sin, scale)


class StepRope(NamedTuple):
    """Every layer's RoPE tables of one step: the full-attention layers', and the sliding-window layers' own where
    the shape gives them another theta (Gemma 3's local base) or another head_dim (Gemma 4)."""

    full: RopeTables
    sliding: RopeTables | None = None

    def for_layer(self, shape: ModelShape, layer: int) -> RopeTables:
        return self.sliding if shape.layer_rope(layer) == "sliding" else self.full


def step_rope(position_ids: torch.Tensor, shape: ModelShape, dtype: torch.dtype) -> StepRope:
    """The step's tables for every layer (ModelShape.layer_rope picks a layer's)."""
    full = rope_tables(position_ids, shape, dtype)
    if not any(shape.layer_rope(i) == "sliding" for i in range(shape.num_layers)):
        return StepRope(full)
    theta, scaling = ((shape.sliding_rope_theta, shape.sliding_rope_scaling) if shape.sliding_rope_theta
                      else (shape.rope_theta, shape.rope_scaling))
    cos, sin = rope_cos_sin(position_ids, shape.rotary_dim, theta, dtype, scaling)
    return StepRope(full, RopeTables(cos, sin, full.q_scale))


def global_positions(position_ids: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """[B, S] positions in sequence order from every rank's zigzag shard [B, S/D] (collective over the group)."""
    if comm.size == 1:
        return position_ids
    gathered = torch.empty((comm.size, *position_ids.shape), dtype=position_ids.dtype, device=position_ids.device)
    comm.all_gather(gathered, position_ids.contiguous()).wait()
    return unshard(list(gathered.unbind(0)), dim=1)


class StepPositions:
    """(StepRope, doc_starts) of the position_ids last seen, recomputed only when a different tensor arrives.
    doc_starts is a DocumentLayout (validated here, once per micro-batch, not by every layer) or None."""

    def __init__(self, shape: ModelShape, comm: TSPComm):
        self.shape, self.comm = shape, comm
        self._key: tuple | None = None
        self._value: tuple[StepRope, DocumentLayout | None] | None = None

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype):
        # Identity and version, not values: comparing values would read the tensor on the host.
        key = (position_ids, position_ids._version, dtype)
        if self._key is None or self._key[0] is not position_ids or self._key[1:] != key[1:]:
            rope = step_rope(position_ids, self.shape, dtype)
            doc_starts = document_starts(global_positions(position_ids, self.comm))
            doc_starts = None if doc_starts is None else document_layout(doc_starts, position_ids.shape[0])
            self._key, self._value = key, (rope, doc_starts)
        return self._value
