"""TSP gated MLP (SwiGLU, or GeGLU with spec.activation "gelu_tanh"): weight shards travel around a ring,
activations never leave their rank.

Rank p owns F/D intermediate columns: packed [Wg_p [F/D, h], Wu_p [F/D, h], Wd_p [h, F/D]].
At ring step k rank p holds the shard of (p - k) mod D and adds that slice's output to its local tokens:
    y_p = sum_j down_j(silu(x_p gate_j^T) * (x_p up_j^T))
By default only x_p is saved; backward recomputes the gate/up activations per shard (2 of 3 GEMMs) instead of
keeping [B, L, F] of them (recompute_projections=False keeps them), and the weight grad rides the ring home.
A frozen shard (requires_grad False, the same on every rank) computes no weight grad and sends no grad hop.

Under autocast (ds_tsp.core.layers.amp, AUTOCAST_LOW_PRECISION) x and the packed shard are cast to the autocast
dtype once, on entry: the GEMMs run in it, and the ring carries the cast shard (half the bytes of fp32 master
weights) and then its grad in that dtype; autograd casts the returned grads back to the fp32 parameters' dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import ring_backward, ring_forward
from ds_tsp.core.layers.amp import AUTOCAST_LOW_PRECISION, apply_autocast
from ds_tsp.core.layers.shard_rebuild import save_with_shard, saved_with_shard
from ds_tsp.core.layers.weight_packing import PackedLayout


@dataclass(frozen=True)
class MLPSpec:
    hidden: int
    ffn_per_rank: int  # intermediate_size / D
    recompute_projections: bool = True  # False: save every shard's gate/up pre-activations ([B, L, F] in all)
    activation: str = "silu"  # the gate's: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU, tanh-approximated GELU)

    @cached_property
    def layout(self) -> PackedLayout:
        f, h = self.ffn_per_rank, self.hidden
        return PackedLayout((("gate", (f, h)), ("up", (f, h)), ("down", (h, f))))


class _TSPGatedMLP(torch.autograd.Function):
    AUTOCAST = AUTOCAST_LOW_PRECISION  # three GEMMs per ring step: autocast's lower-precision list

    @staticmethod
    def forward(ctx, x, packed_shard, spec: MLPSpec, comm: TSPComm):
        y = torch.zeros_like(x)
        kept = []

        def step(owner, shard):
            w = spec.layout.unpack(shard)
            gate, up = F.linear(x, w["gate"]), F.linear(x, w["up"])
            y.add_(F.linear(_act(gate, spec) * up, w["down"]))
            if not spec.recompute_projections:
                kept.extend((gate, up))

        ring_forward(comm, packed_shard, step)
        ctx.spec, ctx.comm = spec, comm
        save_with_shard(ctx, packed_shard, x, *kept)  # a LoRA-merged shard: its base and factors, rebuilt in backward
        return y

    @staticmethod
    def backward(ctx, dy):
        packed_shard, (x, *kept) = saved_with_shard(ctx)
        spec = ctx.spec
        h = x.shape[-1]
        x2d, dy2d = x.reshape(-1, h), dy.reshape(-1, h)
        dx2d = torch.zeros_like(x2d)
        kept = iter(kept)  # ring order is the same as in forward: owner (p - k) mod D at step k

        def step(owner, shard):
            w = spec.layout.unpack(shard)
            if spec.recompute_projections:
                gate, up = x2d @ w["gate"].t(), x2d @ w["up"].t()
            else:
                gate, up = next(kept).reshape(-1, spec.ffn_per_rank), next(kept).reshape(-1, spec.ffn_per_rank)
            act_gate = _act(gate, spec)
            act = act_gate * up
            dact = dy2d @ w["down"]
            dgate = _act_backward(dact * up, gate, spec)
            dup = dact * act_gate
            dx2d.addmm_(dgate, w["gate"]).addmm_(dup, w["up"])
            if not need_w:
                return None
            return spec.layout.pack({"gate": dgate.t() @ x2d, "up": dup.t() @ x2d, "down": dy2d.t() @ act})

        need_w = ctx.needs_input_grad[1]
        if not need_w:  # a frozen shard: the weights ride the ring for dx, no grad buffer travels with them
            ring_forward(ctx.comm, packed_shard, step)
            return dx2d.view_as(x), None, None, None
        grad_shard = ring_backward(ctx.comm, packed_shard, step)
        return dx2d.view_as(x), grad_shard, None, None


def _act(gate: torch.Tensor, spec: MLPSpec) -> torch.Tensor:
    return F.silu(gate) if spec.activation == "silu" else F.gelu(gate, approximate="tanh")


def _act_backward(grad: torch.Tensor, gate: torch.Tensor, spec: MLPSpec) -> torch.Tensor:
    """grad * d act(g) / dg with aten's fused backward (one pass instead of several elementwise ops)."""
    if spec.activation == "silu":
        return torch.ops.aten.silu_backward(grad, gate)
    return torch.ops.aten.gelu_backward(grad, gate, approximate="tanh")


def tsp_gated_mlp(x: torch.Tensor, packed_shard: torch.Tensor, spec: MLPSpec, comm: TSPComm) -> torch.Tensor:
    """Gated MLP of the local tokens with every rank's weight slice passed around the ring."""
    return apply_autocast(_TSPGatedMLP, x.device.type, x, packed_shard, spec, comm)
