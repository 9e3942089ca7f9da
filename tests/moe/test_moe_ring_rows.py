"""The expert ring's row work per step (ds_tsp.core.layers.moe.ring): rows sorted by owner once per layer, each
step touching exactly the current owner's rows, forward and backward, on both expert-GEMM paths (D = 2, gloo).

A spy (a TorchDispatchMode switched on only inside the ring's step callbacks) records every aten op a step runs
and the rows it touches: a gather's or GEMM's or elementwise op's leading dim (the trailing dim of a transposed
[width, rows] operand), a weight-grad GEMM's reduction rows, an index_add_'s index length. Weight-side tensors
(the [E_r, ...] expert views and grads, the flat packed shard and its parts, the int32 offsets) have no row dim and
are skipped. The crafted routing (E = 4, top_k = 3, E_r = 2) gives per-owner counts 7 / 11 and 9 / 9, none equal
to a width (1, F = 8, 2F = h = 16) or to the old static window N x min(top_k, E_r) = 12 or all N x top_k = 18.
- grouped path: every row op of every step touches exactly the owner's count, and its GEMMs compute exactly it
  (the last device offset); before, each step gathered a static window of 12 (or all 18) rows.
- loop path: the same, except that the per-expert GEMM blocks touch that expert's rows (they sum to the owner's).
On the meta device (no host read) each step's rows are the static window N x min(top_k, E_r) instead.
The numerics of both paths against transformers are tests/moe/test_moe_core.py's; the one host read per layer is
tests/reliability/test_host_syncs.py's.
"""
from __future__ import annotations

import torch
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import TSPComm

E, K, H, F, N = 4, 3, 16, 8, 6  # experts, top_k, hidden, per-expert width, local tokens
D = 2
E_R = E // D
# each local token's top-3 experts: (0, 1, 2) puts 2 rows on owner 0, (1, 2, 3) and (0, 2, 3) 2 rows on owner 1
PREFERENCES = {0: [(0, 1, 2)] + [(1, 2, 3)] * 5, 1: [(0, 1, 2), (0, 2, 3)] * 3}
WIDTHS = (1, F, 2 * F, H)  # a row-shaped tensor is [rows, width] (or transposed)
# element counts of weight-side tensors: the packed shard, its two parts, one expert's two matrices
WEIGHT_SIZES = {E_R * 3 * F * H, E_R * 2 * F * H, E_R * H * F, 2 * F * H, H * F}


def expert_counts(rank: int) -> list[int]:
    counts = [0] * E
    for experts in PREFERENCES[rank]:
        for e in experts:
            counts[e] += 1
    return counts


def owner_counts(rank: int) -> list[int]:
    counts = expert_counts(rank)
    return [sum(counts[p * E_R:(p + 1) * E_R]) for p in range(D)]


def _rows_touched(func, args, out) -> list[int]:
    """Rows each row-shaped tensor of one aten op covers (module doc); [] for weight-side ops."""
    name = str(func)
    if name.startswith("aten.index_add_"):
        return [args[2].numel(), args[3].shape[0]]  # the scatter's index and source rows (self: the layer's y)
    if name.startswith("aten._grouped_mm") and out.dim() == 3:
        return [args[1].shape[0]]  # a weight grad: the reduction runs over the rows
    found = []
    for t in out if isinstance(out, (tuple, list)) else [out]:
        if not isinstance(t, torch.Tensor) or t.dim() not in (1, 2) or t.dtype == torch.int32:
            continue  # expert views / grads (3-d), the device offsets (int32)
        if t.numel() in WEIGHT_SIZES:
            continue  # the packed shard, its parts, the packed grads; one expert's matrices (the loop path)
        found.append(t.shape[1] if name.startswith(("aten.t.", "aten.transpose")) else t.shape[0])
    return found


def _spec(top_k: int, tsp: int):
    from ds_tsp.core.layers.moe.layer import MoESpec

    return MoESpec(hidden=H, moe_ffn=F, num_experts=E, experts_per_rank=E // tsp, top_k=top_k, norm_topk_prob=True)


def _inputs(rank: int, preferences: dict) -> tuple:
    """rank's tokens routed as preferences[rank] says (router = identity on the first E features: logits = x[:E]),
    the router, rank's packed experts (float32)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, N, H, generator=g)
    x[0, :, :E] = 0.0
    for t, experts in enumerate(preferences[rank]):
        for j, e in enumerate(experts):
            x[0, t, e] = 3.0 - j
    router = torch.zeros(E, H)
    router[:, :E] = torch.eye(E)
    experts = 0.3 * torch.randn(_spec(len(preferences[rank][0]), D).layout.numel, generator=g)
    return x, router, experts


def _layer(rank: int, comm, path: str, preferences: dict = PREFERENCES) -> tuple[list[dict], tuple]:
    """One forward + backward of the ring: (per step {"owner", "phase", "rows": [...], "ops": [...], "gemm": [...]},
    (y, x grad, experts grad))."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ds_tsp.core.layers.moe.layer as moe
    import ds_tsp.core.layers.moe.ring as ring
    from ds_tsp.core.comm.primitives import GradStep
    from ds_tsp.core.layers.moe.layer import tsp_moe_mlp

    spec = _spec(len(preferences[rank][0]), D)
    x, router, experts = (t.requires_grad_(True) for t in _inputs(rank, preferences))
    steps = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            step = steps[-1]
            step["ops"].append(str(func))
            step["rows"] += _rows_touched(func, args, out)
            if str(func).startswith("aten._grouped_mm"):
                step["gemm"].append(int(args[2][-1]))  # rows the kernel computes: the last device offset
            return out

    def spied(phase, step_fn):
        def run(owner, shard):
            steps.append({"phase": phase, "owner": owner, "rows": [], "ops": [], "gemm": []})
            with Spy():
                result = step_fn(owner, shard)
            if not isinstance(result, GradStep):
                return result

            def after():  # the step's dx, run once its grad is sent (before the next step): the same record
                with Spy():
                    result.after()
            return GradStep(result.contribution, after)
        return run

    saved = (ring.ring_forward, ring.ring_backward, moe.select_expert_gemm)
    phase = ["forward"]
    try:
        ring.ring_forward = lambda c, shard, fn: saved[0](c, shard, spied(phase[0], fn))
        ring.ring_backward = lambda c, shard, fn: saved[1](c, shard, spied("backward", fn))
        moe.select_expert_gemm = lambda *_: path
        y, _ = tsp_moe_mlp(x, router, experts, spec, comm, dispatch="ring")
        phase[0] = "backward"  # frozen experts would run ring_forward in backward; these are trainable
        y.square().sum().backward()
    finally:
        ring.ring_forward, ring.ring_backward, moe.select_expert_gemm = saved
    return steps, (y.detach(), x.grad, experts.grad)


def _both() -> dict:
    comm = TSPComm(torch.distributed.group.WORLD)
    return {path: _layer(comm.rank, comm, path)[0] for path in ("loop", "grouped")}


def test_each_ring_step_touches_exactly_its_owners_rows():
    for rank, result in enumerate(run_on_local_ranks(_both, D, timeout_s=180)):
        counts, per_expert = owner_counts(rank), expert_counts(rank)
        # the crafted counts are unambiguous: no owner count is a width or an old window, no row tensor's size a
        # weight tensor's
        assert not {N * min(K, E_R), N * K, *WIDTHS} & set(counts)
        assert not {n * w for n in counts + per_expert for w in WIDTHS} & WEIGHT_SIZES
        owners = [(rank - s) % D for s in range(D)]  # ring order: owner (p - s) mod D at step s
        for path, steps in result.items():
            assert [(s["phase"], s["owner"]) for s in steps] == [(p, o) for p in ("forward", "backward")
                                                                 for o in owners], (rank, path, steps)
            for s in steps:
                c = counts[s["owner"]]
                ops = s["ops"]
                # the step really gathers, scatters and runs the activation (the spy saw the row work)
                assert {"aten.index_select.default", "aten.index_add_.default", "aten.silu.default"} <= set(ops), ops
                if path == "grouped":
                    assert set(s["rows"]) == {c}, (rank, s["phase"], s["owner"], c, s["rows"])
                    assert s["gemm"] and set(s["gemm"]) == {c}, (rank, s["owner"], s["gemm"])
                    assert sum(op.startswith("aten._grouped_mm") for op in ops) == (2 if s["phase"] == "forward"
                                                                                   else 5)
                else:
                    own = set(per_expert[s["owner"] * E_R:(s["owner"] + 1) * E_R])
                    assert c in s["rows"] and set(s["rows"]) <= {c} | own, (rank, s["owner"], c, own, s["rows"])
                    assert not s["gemm"]


def test_meta_fallback_is_the_static_window():
    """Meta has no counts to read: _StepRows gives every owner the window owner_row_bound = N x min(top_k, E_r)
    sorted rows (shapes only; meta computes nothing), and reads nothing."""
    from sync_counter import SyncCounter

    from ds_tsp.core.layers.moe.ring import _StepRows, owner_row_bound
    from ds_tsp.core.layers.moe.routing import ExpertOrder

    top_i = torch.empty(N, K, dtype=torch.long, device="meta")
    with SyncCounter() as syncs:
        steps = _StepRows(ExpertOrder.of(top_i, E), E_R, "grouped")
        got = [steps.of(owner) for owner in range(D)]
    assert not syncs.events, syncs.events
    window = owner_row_bound(N, K, E_R)
    assert window == N * E_R < N * K  # top_k > E_r: shorter than all rows
    for rows, offsets in got:
        assert rows.shape == (window,) and rows.is_meta
        assert offsets.shape == (E_R,) and offsets.dtype == torch.int32 and offsets.is_meta


# top-1 routing where rank 0 sends nothing to owner 1's experts (2, 3): its owner-1 steps have no rows
EMPTY_OWNER = {0: [(0,), (1,), (0,), (1,), (0,), (0,)], 1: [(0,), (2,), (3,), (1,), (2,), (3,)]}


def _empty_owner() -> dict:
    """Per path: the steps, and (y, x grad, own experts grad) of the D=2 ring and of the same global batch on one
    rank (the reference: both ranks' tokens, all experts, the same GEMM path)."""
    import ds_tsp.core.layers.moe.layer as moe

    comm = TSPComm(torch.distributed.group.WORLD)
    out = {}
    for path in ("loop", "grouped"):
        steps, got = _layer(comm.rank, comm, path, EMPTY_OWNER)
        parts = [_inputs(r, EMPTY_OWNER) for r in range(D)]
        shards = [_spec(1, D).layout.unpack(p[2]) for p in parts]
        full = _spec(1, 1).layout.pack({k: torch.cat([w[k] for w in shards]) for k in ("gate_up", "down")})
        x = torch.cat([p[0] for p in parts], dim=1).requires_grad_(True)
        full.requires_grad_(True)
        select = moe.select_expert_gemm
        moe.select_expert_gemm = lambda *_: path
        try:
            y, _ = moe.tsp_moe_mlp(x, parts[0][1], full, _spec(1, 1), TSPComm.single(), dispatch="ring")
            y.square().sum().backward()
        finally:
            moe.select_expert_gemm = select
        own = slice(comm.rank * N, (comm.rank + 1) * N)
        grads = _spec(1, 1).layout.unpack(full.grad)
        mine = slice(comm.rank * E_R, (comm.rank + 1) * E_R)
        want_experts = _spec(1, D).layout.pack({k: grads[k][mine] for k in ("gate_up", "down")})
        out[path] = (steps, got, (y.detach()[:, own], x.grad[:, own], want_experts))
    return out


def test_an_owner_with_no_rows_costs_its_steps_no_row_work():
    """The step bounds are host numbers, so an owner none of this rank's rows meet costs nothing: no gather, GEMM
    or scatter (backward hands the ring a zero grad contribution); the results equal one rank's over the global
    batch (float32; the D=2 and D=1 runs sum the same terms in another order: 1e-5)."""
    for rank, result in enumerate(run_on_local_ranks(_empty_owner, D, timeout_s=180)):
        for path, (steps, got, want) in result.items():
            for s in steps:
                empty = rank == 0 and s["owner"] == 1
                assert ("aten.index_select.default" in s["ops"]) != empty, (rank, path, s)
                if empty:
                    assert set(s["rows"]) <= {0} and not s["gemm"], (path, s)  # an empty slice of the order
            assert any(rank == 0 and s["owner"] == 1 for s in steps) == (rank == 0)
            for name, a, b in zip(("y", "x grad", "experts grad"), got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{path} {n}: {m}")
