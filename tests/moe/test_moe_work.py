"""The MoE layer's work per step, counted (one process, D = 1: the ring is one step, the all-to-all a local copy).

- FLOPs: the GEMM FLOPs `ds-tsp bench --profile` charges to layer type "moe" (ds_tsp.tools.bench.profile: the
  profiler's recorded shapes through FlopCounterMode's formulas) equal FlopCounterMode's own count of the same step,
  and are exactly 22/18 of ds_tsp.tools.bench.work's minimum (18 n k h F: forward + backward, nothing recomputed;
  the memory-optimal backward recomputes the gate/up GEMM, 4 n k h F more), 18/18 when the projections are kept.
- Copies: the loop path's expert GEMMs write their rows of the outputs, d rows and d gu, and the expert grads, in
  place (out=): no zero-filled buffer, no per-expert result copied into one, no packed grad concatenated; the
  all-to-all's travelling rows are gathered into their buffers, not concatenated. Counted by a TorchDispatchMode
  over the copy / fill ops; a defect that brings one back (torch.zeros_like + a slice copy, PackedLayout.pack of
  the grads, a torch.cat of gathered rows) fails here.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.layers.moe.layer import MoESpec, tsp_moe_mlp
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.bench.profile import counted_work, nest
from ds_tsp.tools.bench.work import minimum_work

E, K, H, F, N = 4, 2, 16, 32, 6  # every rank's rows (N k = 12) far fewer elements than one weight slab (E F H)
COPIES = ("aten.copy_", "aten.cat", "aten.stack", "aten.fill_", "aten.zero_", "aten.zeros", "aten.zeros_like",
          "aten.new_zeros", "aten.index_put_", "aten.clone")
GEMMS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


class _Writes(TorchDispatchMode):
    """Elements written by each copy / fill op, and the GEMMs run."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith(COPIES):
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.copies.append((name, first.numel() if isinstance(first, torch.Tensor) else 0))
        return out


def _layer(dispatch: str, recompute: bool = True):
    g = torch.Generator().manual_seed(0)
    spec = MoESpec(hidden=H, moe_ffn=F, num_experts=E, experts_per_rank=E, top_k=K, norm_topk_prob=True,
                   recompute_projections=recompute)
    x = torch.randn(1, N, H, generator=g, requires_grad=True)
    router = torch.randn(E, H, generator=g, requires_grad=True)
    experts = (torch.randn(spec.layout.numel, generator=g) * 0.1).requires_grad_()
    # every expert gets rows (the zero slice of an unrouted expert is a legitimate fill)
    router.data[:, :E] += 20 * torch.eye(E)
    x.data[0, :, :E] = torch.eye(E).repeat(2, 1)[:N] + torch.eye(E).roll(1, 0).repeat(2, 1)[:N]

    def run():
        y, _ = tsp_moe_mlp(x, router, experts, spec, TSPComm.single(), dispatch=dispatch)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()

    return spec, run


@pytest.mark.parametrize("dispatch", ["ring", "all_to_all"])
def test_expert_work_is_written_in_place(dispatch):
    spec, run = _layer(dispatch)
    spy = _Writes()
    with spy:
        run()
    slab = E * H * F  # the smallest of the experts' weights and grads (down: [E, h, F])
    big = [(name, n) for name, n in spy.copies if n >= slab]
    assert not big, f"copies / fills the size of an expert weight slab (the grads assembled, not written): {big}"
    # the layer's own buffers: y, dx, the routing-weight grads (N-sized) and the all-to-all's row buffers; nothing
    # proportional to the experts' width F (the per-expert outputs and gate/up grads are GEMM outputs in place)
    assert all(n < N * K * 2 * F for _, n in spy.copies), spy.copies
    # rows are gathered straight into the buffers that travel or are returned (all_to_all's send and return rows,
    # the experts' d gu): nothing row-sized is assembled by concatenation (all_to_all's two count vectors are, for
    # their one host read)
    assert [(name, n) for name, n in spy.copies if name.startswith(("aten.cat", "aten.stack")) and n >= N * K] == []


def test_experts_loop_path_runs_copy_free():
    from ds_tsp.core.layers.moe.experts import experts_backward, experts_forward

    g = torch.Generator().manual_seed(1)
    spec = MoESpec(hidden=H, moe_ffn=F, num_experts=E, experts_per_rank=E, top_k=K, norm_topk_prob=True)
    f64 = {"dtype": torch.float64, "generator": g}
    w = spec.layout.unpack(torch.randn(spec.layout.numel, **f64))
    counts = [3, 4, 2, 3]
    rows, dy = torch.randn(12, H, **f64), torch.randn(12, H, **f64)
    weights = torch.rand(12, **f64)
    grad = torch.empty(spec.layout.numel, dtype=torch.float64)
    spy = _Writes()
    with spy:
        out, _ = experts_forward(rows, w, counts)
        drows, dw, grads = experts_backward(rows, dy, weights, w, counts, grad_into=spec.layout.unpack(grad))
    assert spy.copies == []
    # the same numbers as autograd through the per-expert products (float64: the GEMMs' orders differ)
    leaves = [rows.clone().requires_grad_(), weights.clone().requires_grad_()]
    wa = {k: v.clone().requires_grad_() for k, v in w.items()}
    ref, start = [], 0
    for j, n in enumerate(counts):
        gu = leaves[0][start:start + n] @ wa["gate_up"][j].t()
        act = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
        ref.append(act @ wa["down"][j].t())
        start += n
    ref = torch.cat(ref)
    torch.testing.assert_close(out, ref.detach())
    (ref * leaves[1][:, None] * dy).sum().backward()
    torch.testing.assert_close(drows, leaves[0].grad)
    torch.testing.assert_close(dw, leaves[1].grad)
    torch.testing.assert_close(grads["gate_up"], wa["gate_up"].grad)
    torch.testing.assert_close(grads["down"], wa["down"].grad)


@pytest.mark.parametrize("dispatch, recompute", [("ring", True), ("all_to_all", True), ("ring", False)])
def test_profiled_moe_flops_match_flop_counter_and_the_minimum(dispatch, recompute):
    from torch.profiler import ProfilerActivity, profile

    spec, run = _layer(dispatch, recompute)
    run()  # warm
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    moe = counted_work(nest(prof.events()))["moe"]["gemm_flops"]
    counter = FlopCounterMode(display=False)
    with counter:
        run()
    counted = counter.get_flop_counts()["Global"]
    router = 3 * 2 * N * H * E  # the router GEMM (forward, d x, d router) runs outside the experts' Function
    assert moe == sum(v for op, v in counted.items() if str(op).startswith(GEMMS)) - router
    shape = ModelShape(vocab_size=8, hidden_size=H, intermediate_size=F, num_layers=1, num_heads=2, num_kv_heads=2,
                       num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F, norm_topk_prob=True)
    least = minimum_work(shape, seq=N, batch=1, tsp=1, moe_dispatch=dispatch)["moe"]["gemm_flops"]
    assert least == 18 * N * K * H * F
    assert moe == (22 if recompute else 18) * N * K * H * F
