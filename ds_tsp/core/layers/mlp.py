"""TSP gated MLP (SwiGLU, or GeGLU with spec.activation "gelu_tanh"): weight shards travel around a ring,
activations never leave their rank.

Rank p owns F/D intermediate columns: packed [Wg_p [F/D, h], Wu_p [F/D, h], Wd_p [h, F/D]].
At ring step k rank p holds the shard of (p - k) mod D and adds that slice's output to its local tokens:
    y_p = sum_j down_j(silu(x_p gate_j^T) * (x_p up_j^T))
By default only x_p is saved; backward recomputes the gate/up activations per shard (1 of 3 GEMMs) instead of
keeping [B, L, F] of them (recompute_projections=False keeps them), and the weight grad rides the ring home.
Gate and up are adjacent rows of the packed shard, so each is ONE GEMM with both (x [Wg; Wu]^T forward, and in
backward dx += [dgate | dup] [Wg; Wu] and the weight grad [dgate | dup]^T x, written straight into the packed grad):
twice the columns per GEMM and half the calls, which is what small shards (large D) are short of. In backward each
ring step computes its weight grad first and its dx GEMM once that grad is on its way (ring_backward's GradStep), so
the last grad hop to the owner travels behind a GEMM instead of being waited bare.
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
from ds_tsp.core.comm.primitives import GradStep, ring_backward, ring_forward
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
        f = spec.ffn_per_rank

        def step(owner, shard):
            w_gate_up, w_down = _gate_up_and_down(shard, spec)
            gate_up = F.linear(x, w_gate_up)  # one GEMM for both projections: [B, L, 2 F/D]
            y.add_(F.linear(_act(gate_up[..., :f], spec) * gate_up[..., f:], w_down))
            if not spec.recompute_projections:
                kept.append(gate_up)

        ring_forward(comm, packed_shard, step)
        ctx.spec, ctx.comm = spec, comm
        save_with_shard(ctx, packed_shard, x, *kept)  # a LoRA-merged shard: its base and factors, rebuilt in backward
        return y

    @staticmethod
    def backward(ctx, dy):
        packed_shard, (x, *kept) = saved_with_shard(ctx)
        spec = ctx.spec
        h, f = x.shape[-1], spec.ffn_per_rank
        x2d, dy2d = x.reshape(-1, h), dy.reshape(-1, h)
        dx2d = torch.zeros_like(x2d)
        kept = iter(kept)  # ring order is the same as in forward: owner (p - k) mod D at step k

        def step(owner, shard):
            w_gate_up, w_down = _gate_up_and_down(shard, spec)
            gate_up = x2d @ w_gate_up.t() if spec.recompute_projections else next(kept).reshape(-1, 2 * f)
            gate, up = gate_up[:, :f], gate_up[:, f:]
            act_gate = _act(gate, spec)
            act = act_gate * up
            dact = dy2d @ w_down
            d_gate_up = torch.empty_like(gate_up)  # [dgate | dup], so dx and the weight grad are one GEMM each
            _act_backward(dact * up, gate, spec, out=d_gate_up[:, :f])
            torch.mul(dact, act_gate, out=d_gate_up[:, f:])
            del act_gate, dact
            if not need_w:
                dx2d.addmm_(d_gate_up, w_gate_up)
                return None
            grad = torch.empty_like(shard)  # packed in the shard's layout: gate | up rows, then down
            grad_gate_up, grad_down = _gate_up_and_down(grad, spec)
            torch.mm(d_gate_up.t(), x2d, out=grad_gate_up)
            torch.mm(dy2d.t(), act, out=grad_down)
            # dx after the grad is sent: the grad hop (the last one to the owner too) travels behind its GEMM
            return GradStep(grad, lambda: dx2d.addmm_(d_gate_up, w_gate_up))

        need_w = ctx.needs_input_grad[1]
        if not need_w:  # a frozen shard: the weights ride the ring for dx, no grad buffer travels with them
            ring_forward(ctx.comm, packed_shard, step)
            return dx2d.view_as(x), None, None, None
        grad_shard = ring_backward(ctx.comm, packed_shard, step)
        return dx2d.view_as(x), grad_shard, None, None


def _gate_up_and_down(shard: torch.Tensor, spec: MLPSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed shard: [Wg; Wu] [2 F/D, h] (gate and up are adjacent in the layout) and Wd [h, F/D]."""
    f, h = spec.ffn_per_rank, spec.hidden
    return shard[:2 * f * h].view(2 * f, h), shard[2 * f * h:].view(h, f)


def _act(gate: torch.Tensor, spec: MLPSpec) -> torch.Tensor:
    return F.silu(gate) if spec.activation == "silu" else F.gelu(gate, approximate="tanh")


def _act_backward(grad: torch.Tensor, gate: torch.Tensor, spec: MLPSpec, out: torch.Tensor) -> torch.Tensor:
    """grad * d act(g) / dg into `out` with aten's fused backward (one pass instead of several elementwise ops)."""
    if spec.activation == "silu":
        return torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=out)
    return torch.ops.aten.gelu_backward.grad_input(grad, gate, approximate="tanh", grad_input=out)


def tsp_gated_mlp(x: torch.Tensor, packed_shard: torch.Tensor, spec: MLPSpec, comm: TSPComm) -> torch.Tensor:
    """Gated MLP of the local tokens with every rank's weight slice passed around the ring."""
    return apply_autocast(_TSPGatedMLP, x.device.type, x, packed_shard, spec, comm)
