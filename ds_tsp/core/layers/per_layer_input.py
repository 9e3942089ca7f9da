"""Gemma 4's per-layer inputs (PLE) under TSP: the two matrices they add travel around the weight ring, the tokens
never leave their rank.

Shapes (rank p of D, local tokens [B, L], P = per-layer input size, N = num_layers * P; P % D == 0):
| tensor                    | shape          | this rank's part                                           |
|---------------------------|----------------|------------------------------------------------------------|
| projection W (model-wide) | [N, h]         | rows [p*N/D, (p+1)*N/D)                                    |
| gate G (per layer)        | [P, h]         | rows [p*P/D, (p+1)*P/D)    } packed in one shard           |
| projection Wp (per layer) | [h, P]         | columns [p*P/D, (p+1)*P/D) }                               |
| per-layer input e         | [B, L, P]      | local tokens, whole (each rank computes its own tokens')   |

`tsp_column_linear`: x W^T [B, L, N], each ring step filling the owner's N/D columns; backward: dx from every
shard, the weight grad riding the ring home (ds_tsp.core.comm.primitives.ring_backward).
`tsp_per_layer_gate`: y = sum_j Wp_j (gelu_tanh(x G_j^T) * e[..., j's P/D]) - the GeGLU of the MLP
(ds_tsp.core.layers.mlp) with the layer's per-layer input in place of the up projection, so it returns de too.
Only x and e are saved; backward recomputes the gate per shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import GradStep, ring_backward, ring_forward
from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION, apply_autocast
from ds_tsp.core.layers.weight_packing import PackedLayout


@dataclass(frozen=True)
class ColumnSpec:
    hidden: int
    rows_per_rank: int  # N / D output features

    @cached_property
    def layout(self) -> PackedLayout:
        return PackedLayout((("w", (self.rows_per_rank, self.hidden)),))


@dataclass(frozen=True)
class PerLayerGateSpec:
    hidden: int
    width_per_rank: int  # P / D

    @cached_property
    def layout(self) -> PackedLayout:
        p, h = self.width_per_rank, self.hidden
        return PackedLayout((("gate", (p, h)), ("proj", (h, p))))


class _TSPColumnLinear(torch.autograd.Function):
    AUTOCAST = AUTOCAST_LOW_PRECISION  # a Linear: its GEMMs run in the autocast dtype

    @staticmethod
    def forward(ctx, x, packed_shard, spec: ColumnSpec, comm: TSPComm):
        n = spec.rows_per_rank
        y = x.new_empty((*x.shape[:-1], n * comm.size))

        def step(owner, shard):
            y[..., owner * n:(owner + 1) * n] = F.linear(x, spec.layout.unpack(shard)["w"])

        ring_forward(comm, packed_shard, step)
        ctx.spec, ctx.comm = spec, comm
        ctx.save_for_backward(x, packed_shard)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, packed_shard = ctx.saved_tensors
        spec, n = ctx.spec, ctx.spec.rows_per_rank
        h = x.shape[-1]
        x2d, dy2d = x.reshape(-1, h), dy.reshape(-1, dy.shape[-1])
        dx2d = torch.zeros_like(x2d)
        need_w = ctx.needs_input_grad[1]

        def step(owner, shard):
            d_own = dy2d[:, owner * n:(owner + 1) * n]
            if not need_w:
                dx2d.addmm_(d_own, spec.layout.unpack(shard)["w"])
                return None
            # dx once the grad is on its way (ring_backward's GradStep: the grad hop travels behind its GEMM)
            return GradStep(spec.layout.pack({"w": d_own.t() @ x2d}),
                            lambda: dx2d.addmm_(d_own, spec.layout.unpack(shard)["w"]))

        if not need_w:  # a frozen shard: the weights ride the ring for dx only
            ring_forward(ctx.comm, packed_shard, step)
            return dx2d.view_as(x), None, None, None
        return dx2d.view_as(x), ring_backward(ctx.comm, packed_shard, step), None, None


class _TSPPerLayerGate(torch.autograd.Function):
    AUTOCAST = AUTOCAST_LOW_PRECISION  # two GEMMs per ring step

    @staticmethod
    def forward(ctx, x, per_layer_input, packed_shard, spec: PerLayerGateSpec, comm: TSPComm):
        y = torch.zeros_like(x)
        n = spec.width_per_rank

        def step(owner, shard):
            w = spec.layout.unpack(shard)
            act = F.gelu(F.linear(x, w["gate"]), approximate="tanh")
            y.add_(F.linear(act * per_layer_input[..., owner * n:(owner + 1) * n], w["proj"]))

        ring_forward(comm, packed_shard, step)
        ctx.spec, ctx.comm = spec, comm
        ctx.save_for_backward(x, per_layer_input, packed_shard)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, per_layer_input, packed_shard = ctx.saved_tensors
        spec, n = ctx.spec, ctx.spec.width_per_rank
        h = x.shape[-1]
        x2d, dy2d = x.reshape(-1, h), dy.reshape(-1, h)
        e2d = per_layer_input.reshape(-1, per_layer_input.shape[-1])
        dx2d, de2d = torch.zeros_like(x2d), torch.zeros_like(e2d)
        need_w = ctx.needs_input_grad[2]

        def step(owner, shard):
            w = spec.layout.unpack(shard)
            cols = slice(owner * n, (owner + 1) * n)
            gate = x2d @ w["gate"].t()
            act = F.gelu(gate, approximate="tanh")
            dgated = dy2d @ w["proj"]
            de2d[:, cols] = dgated * act
            dgate = torch.ops.aten.gelu_backward(dgated * e2d[:, cols], gate, approximate="tanh")
            if not need_w:
                dx2d.addmm_(dgate, w["gate"])
                return None
            grad = spec.layout.pack({"gate": dgate.t() @ x2d, "proj": dy2d.t() @ (act * e2d[:, cols])})
            return GradStep(grad, lambda: dx2d.addmm_(dgate, w["gate"]))  # dx behind the grad hop

        if not need_w:
            ring_forward(ctx.comm, packed_shard, step)
            grad = None
        else:
            grad = ring_backward(ctx.comm, packed_shard, step)
        return dx2d.view_as(x), de2d.view_as(per_layer_input), grad, None, None


def tsp_column_linear(x: torch.Tensor, packed_shard: torch.Tensor, spec: ColumnSpec, comm: TSPComm) -> torch.Tensor:
    """x [..., h] @ W^T [..., N] of the local tokens, W's row blocks passed around the ring."""
    return apply_autocast(_TSPColumnLinear, x.device.type, x, packed_shard, spec, comm)


def tsp_per_layer_gate(x: torch.Tensor, per_layer_input: torch.Tensor, packed_shard: torch.Tensor,
                       spec: PerLayerGateSpec, comm: TSPComm) -> torch.Tensor:
    """Gemma 4's per_layer_projection(gelu_tanh(per_layer_input_gate(x)) * per_layer_input) of the local tokens
    (x [B, L, h], per_layer_input [B, L, P]), the gate and projection slices passed around the ring."""
    return apply_autocast(_TSPPerLayerGate, x.device.type, x, per_layer_input, packed_shard, spec, comm)
