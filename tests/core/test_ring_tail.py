"""The weight ring's backward hides its last grad hop: each ring step of the gated MLP, of Gemma's per-layer input
projections and of the MoE expert ring that sends a grad (every step but the first, whose grad stays home) posts
its weight grad's hop BEFORE its dx GEMM runs (ring_backward's GradStep), so the final hop to the owner travels
behind a GEMM. Recorded on a one-process ring stand-in (D=2, the
hops loop back): only the order is checked here; the numerics are the layers' exactness tests'."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_tsp.core.layers.mlp import MLPSpec, tsp_gated_mlp
from ds_tsp.core.layers.per_layer_input import ColumnSpec, PerLayerGateSpec, tsp_column_linear, tsp_per_layer_gate


class _Done:
    def wait(self) -> None:
        return None


class _LoopRing:
    """Rank 0 of 2 whose ring hops come back to itself; it logs each hop as it is posted."""

    rank, size, context, recorder, grad_bucket = 0, 2, "", None, None

    def __init__(self, events: list):
        self.events = events
        self.counter = type("Counter", (), {"add": staticmethod(lambda *a: None)})()

    def ring_exchange(self, send, recv, tag, what=None):
        self.events.append(what)
        recv.copy_(send)
        return _Done()


class _LogAddmm(TorchDispatchMode):
    """Logs every in-place addmm (the layers' dx GEMMs: dx2d.addmm_)."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.addmm_:
            self.events.append("dx")
        return func(*args, **(kwargs or {}))


def _backward_events(layer) -> list:
    events = []
    comm = _LoopRing(events)
    y = layer(comm)
    events.clear()  # forward's weight hops
    with _LogAddmm(events):
        y.pow(2).sum().backward()
    return [e for e in events if e == "dx" or e.startswith("grad hop")]


def _assert_each_dx_after_its_grad_hop(events):
    # step 0 (the own shard) keeps its grad home: no hop; step 1's hop, the last one to the owner, before its dx
    assert events == ["dx", "grad hop 1/1", "dx"], events


def test_gated_mlp_backward_sends_each_grad_before_its_dx():
    spec = MLPSpec(hidden=4, ffn_per_rank=3)
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    shard = torch.randn(spec.layout.numel, dtype=torch.float64, requires_grad=True)
    _assert_each_dx_after_its_grad_hop(_backward_events(lambda comm: tsp_gated_mlp(x, shard, spec, comm)))


def test_column_linear_backward_sends_each_grad_before_its_dx():
    spec = ColumnSpec(hidden=4, rows_per_rank=3)
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    shard = torch.randn(spec.layout.numel, dtype=torch.float64, requires_grad=True)
    _assert_each_dx_after_its_grad_hop(_backward_events(lambda comm: tsp_column_linear(x, shard, spec, comm)))


def test_per_layer_gate_backward_sends_each_grad_before_its_dx():
    spec = PerLayerGateSpec(hidden=4, width_per_rank=3)
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    e = torch.randn(1, 5, 6, dtype=torch.float64, requires_grad=True)
    shard = torch.randn(spec.layout.numel, dtype=torch.float64, requires_grad=True)
    _assert_each_dx_after_its_grad_hop(_backward_events(lambda comm: tsp_per_layer_gate(x, e, shard, spec, comm)))


def test_moe_expert_ring_backward_sends_each_grad_before_its_rows_dx(monkeypatch):
    """The expert ring: each step's expert weight grads are sent before its rows' dx GEMMs run
    (experts_backward(rows_later=True) hands them back as a callable), on both expert-GEMM paths."""
    import ds_tsp.core.layers.moe.layer as moe
    import ds_tsp.core.layers.moe.ring as ring
    from ds_tsp.core.layers.moe.layer import MoESpec, tsp_moe_mlp

    spec = MoESpec(hidden=8, moe_ffn=4, num_experts=4, experts_per_rank=2, top_k=4, norm_topk_prob=True)
    real = ring.experts_backward
    for path in ("loop", "grouped"):
        events = []

        def logged(*args, **kwargs):
            drows, dw, grads = real(*args, **kwargs)
            if not kwargs.get("rows_later"):
                return drows, dw, grads
            return (lambda: events.append("dx") or drows()), dw, grads

        monkeypatch.setattr(ring, "experts_backward", logged)
        monkeypatch.setattr(moe, "select_expert_gemm", lambda *_: path)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 5, 8, generator=g, requires_grad=True)  # top_k = all 4 experts: both owners get rows
        router = torch.randn(4, 8, generator=g, requires_grad=True)
        experts = torch.randn(spec.layout.numel, generator=g, requires_grad=True)
        comm = _LoopRing(events)
        y, _ = tsp_moe_mlp(x, router, experts, spec, comm, dispatch="ring")
        events.clear()
        y.pow(2).sum().backward()
        _assert_each_dx_after_its_grad_hop([e for e in events if e == "dx" or e.startswith("grad hop")])
