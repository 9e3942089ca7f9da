"""What a step derives from its position_ids once, for every decoder layer: RoPE tables (and each query's scale,
where the family scales queries by position) and packed-document starts.

position_ids are GLOBAL positions of this rank's zigzag tokens (restarting at 0 where a packed document starts).
RoPE needs only the local ones; finding the documents needs the whole sequence, so it costs one all-gather over the
TSP group (and one more over the cp ring with a cp axis). The causal LM does both once in its forward; a pipeline
stage, which receives position_ids as an activation, asks a `StepPositions` shared by its layers, which pays once
per micro-batch, not once per layer.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape, RopeScaling
from ds_tsp.core.tokens.documents import DocumentLayout, document_layout, document_starts
from ds_tsp.core.tokens.rope import query_scale, rope_cos_sin
from ds_tsp.core.tokens.zigzag import cp_unshard, unshard


class RopeTables(NamedTuple):
    """What every attention layer of one step rotates its local queries and keys with."""

    cos: torch.Tensor  # [B, L, rotary_dim]
    sin: torch.Tensor
    q_scale: torch.Tensor | None = None  # [B, L, 1, 1] each query's scale after RoPE (Ministral 3); None: 1


class StepRope(NamedTuple):
    """Every layer's RoPE tables of one step: the full-attention layers', and the sliding-window layers' own where
    the shape gives them another theta (Gemma 3's local base) or another head_dim (Gemma 4)."""

    full: RopeTables
    sliding: RopeTables | None = None

    def for_layer(self, shape: ModelShape, layer: int) -> RopeTables:
        return self.sliding if shape.layer_rope(layer) == "sliding" else self.full


def longrope_inv_freqs(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """float32 [2, head_dim // 2] on the host: longrope's inverse frequencies with its short factors and with its
    long ones, computed as transformers computes them at init (float32, on the host)."""
    if len(scaling.short_factor) != head_dim // 2:
        raise TSPConfigError(f"rope_parameters.short_factor has {len(scaling.short_factor)} entries: longrope needs "
                             f"one per rotary frequency, rotary dim {head_dim} // 2 = {head_dim // 2}")
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    factors = torch.tensor((scaling.short_factor, scaling.long_factor), dtype=torch.float32, device="cpu")
    return 1.0 / (factors * powers)


class StepRopes:
    """Builds each step's StepRope for one model (ModelShape.layer_rope picks a layer's tables). What a rope type
    needs beyond the positions is made here once: longrope's short and long frequencies, on the host, copied to
    the step's device without blocking (pinned on CUDA) and kept per device."""

    def __init__(self, shape: ModelShape, comm: TSPComm):
        self.shape, self.comm = shape, comm
        scaling = shape.rope_scaling
        self.switches = scaling is not None and scaling.switches_with_length
        if shape.sliding_rope_scaling is not None and shape.sliding_rope_scaling.switches_with_length:
            raise TSPConfigError("a longrope scaling of the sliding-window layers' RoPE is not supported; give them "
                                 "a rope type that does not switch with the batch's length")
        self._host = longrope_inv_freqs(shape.rotary_dim, shape.rope_theta, scaling) if self.switches else None
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def _longrope(self, device: torch.device) -> torch.Tensor | None:
        if self._host is None:
            return None
        if device not in self._on_device:
            host = self._host.pin_memory() if device.type == "cuda" else self._host
            self._on_device[device] = host.to(device, non_blocking=True)
        return self._on_device[device]

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> StepRope:
        """The step's tables for every layer. Collective over the TSP group (and cp) only for a rope that switches
        with the batch's longest position (longrope)."""
        shape = self.shape
        longest = longest_position(position_ids, self.comm) if self.switches else None
        cos, sin = rope_cos_sin(position_ids, shape.full_rotary_dim, shape.rope_theta, dtype, shape.rope_scaling,
                                longest, self._longrope(position_ids.device))
        scale = (query_scale(position_ids, shape.query_scale_beta, shape.query_scale_period, dtype)
                 if shape.query_scale_beta else None)
        full = RopeTables(cos, sin, scale)
        if not any(shape.layer_rope(i) == "sliding" for i in range(shape.num_layers)):
            return StepRope(full)
        # their own theta (Gemma 3, 4), or only their own head_dim
        theta, scaling = ((shape.sliding_rope_theta, shape.sliding_rope_scaling) if shape.sliding_rope_theta
                          else (shape.rope_theta, shape.rope_scaling))
        cos, sin = rope_cos_sin(position_ids, shape.rotary_dim, theta, dtype, scaling)
        return StepRope(full, RopeTables(cos, sin, full.q_scale))


def longest_position(position_ids: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """0-d: the longest position + 1 of the whole batch (every rank's shard, every cp group's), on the device: one
    all-gather of one int64 per axis, no host read (transformers' longrope takes max(position_ids) + 1)."""
    longest = position_ids.max().reshape(1) + 1
    for axis in (comm, comm.cp_axis() if comm.cp is not None else None):
        if axis is not None and axis.size > 1:
            gathered = torch.empty((axis.size, 1), dtype=longest.dtype, device=longest.device)
            axis.all_gather(gathered, longest, what="longest position (longrope)").wait()
            longest = gathered.max().reshape(1)
    return longest[0]


def global_positions(position_ids: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """[B, S] positions in sequence order from every rank's zigzag shard [B, S/D] (collective over the group). With a
    cp axis the shard is [B, S/(C D)] and the TSP group's gather is gathered once more over the cp ring: a cp group's
    two chunks are not adjacent, so the TSP group's positions alone would show a document break between them."""
    if comm.size == 1 and comm.cp is None:
        return position_ids
    if comm.size > 1:
        gathered = torch.empty((comm.size, *position_ids.shape), dtype=position_ids.dtype,
                               device=position_ids.device)
        comm.all_gather(gathered, position_ids.contiguous()).wait()
    else:
        gathered = position_ids[None]
    if comm.cp is None:
        return unshard(list(gathered.unbind(0)), dim=1)
    cp = comm.cp_axis()
    everyone = torch.empty((cp.size, *gathered.shape), dtype=gathered.dtype, device=gathered.device)
    cp.all_gather(everyone, gathered.contiguous(), what="positions over cp").wait()
    return cp_unshard([list(group.unbind(0)) for group in everyone.unbind(0)], dim=1)


class StepPositions:
    """(StepRope, doc_starts) of the position_ids last seen, recomputed only when a different tensor arrives.
    doc_starts is a DocumentLayout (validated here, once per micro-batch, not by every layer) or None."""

    def __init__(self, shape: ModelShape, comm: TSPComm):
        self.shape, self.comm = shape, comm
        self.ropes = StepRopes(shape, comm)
        self._key: tuple | None = None
        self._value: tuple[StepRope, DocumentLayout | None] | None = None

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype):
        # Identity and version, not values: comparing values would read the tensor on the host.
        key = (position_ids, position_ids._version, dtype)
        if self._key is None or self._key[0] is not position_ids or self._key[1:] != key[1:]:
            rope = self.ropes(position_ids, dtype)
            doc_starts = document_starts(global_positions(position_ids, self.comm))
            doc_starts = None if doc_starts is None else document_layout(doc_starts, position_ids.shape[0])
            self._key, self._value = key, (rope, doc_starts)
        return self._value
