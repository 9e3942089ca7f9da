"""TSP primitives moved with exact, coordinate-encoded data (value = f(sender, position)), both directions."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from comm_autograd import all_gather_sequence, broadcast_shard
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import CommCounter, TSPComm
from ds_tsp.core.comm.primitives import (
    GradStep,
    ShardStream,
    replicated_param,
    ring_backward,
    ring_forward,
)
from ds_tsp.core.reliability.stall_message import Blocked

N = 6  # elements per shard


def _coded(owner: int, n: int = N, salt: float = 0.0) -> torch.Tensor:
    """Shard content that names its owner and every position: 1000*owner + index (+ salt)."""
    return 1000.0 * owner + torch.arange(n, dtype=torch.float64) + salt


def _every_shard(comm, own):
    """(j, shard j) for every head block, taken as the attention loop takes them (two blocks posted ahead)."""
    shards = ShardStream(comm, own)
    for j in range(comm.size):
        shards.next_block(j)
        yield j, shards.take(j)


def _primitives():
    comm = TSPComm(dist.group.WORLD)
    p, D = comm.rank, comm.size
    out = {}

    # shard broadcast: every rank sees owner j's shard at iteration j, in order, and prefetch keeps it exact
    seen = [(j, shard.clone()) for j, shard in _every_shard(comm, _coded(p))]
    out["broadcast_order"] = [j for j, _ in seen]
    out["broadcast_exact"] = all(torch.equal(s, _coded(j)) for j, s in seen)

    # differentiable broadcast: grad of owner = sum over ranks of their (coded) upstream grads
    owner = D - 1
    shard = _coded(p).requires_grad_()
    got = broadcast_shard(shard, owner, comm)
    got.backward(torch.full((N,), p + 1.0, dtype=torch.float64))  # rank r sends grad r+1
    out["bcast_fwd_exact"] = torch.equal(got.detach(), _coded(owner))
    out["bcast_grad"] = None if shard.grad is None else shard.grad.clone()

    # sequence all-gather: rank order in forward; reduce-scatter (sum) in backward
    local = (_coded(p).view(2, 3)).requires_grad_()
    gathered = all_gather_sequence(local, comm)
    out["gather_exact"] = all(torch.equal(gathered[r].detach(), _coded(r).view(2, 3)) for r in range(D))
    upstream = torch.stack([torch.full((2, 3), 10.0 * p + r, dtype=torch.float64) for r in range(D)])
    gathered.backward(upstream)
    out["gather_grad"] = local.grad.clone()

    # weight ring forward: at step k rank p holds the shard of (p - k) mod D, exactly
    held = []
    ring_forward(comm, _coded(p), lambda o, s: held.append((o, s.clone())))
    out["ring_owners"] = [o for o, _ in held]
    out["ring_exact"] = all(torch.equal(s, _coded(o)) for o, s in held)

    # weight ring backward: rank r adds 1000 (r+1) + owner; the owner receives each rank's part exactly once
    own_grad = ring_backward(comm, _coded(p), lambda o, s: torch.full_like(s, 1000.0 * (p + 1) + o))
    out["ring_grad"] = own_grad.clone()

    # replicated parameter: identity forward, summed grads backward
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (replicated_param(w, comm) * (p + 1)).sum().backward()
    out["replicated_grad"] = w.grad.clone()
    out["counter"] = comm.counter.snapshot()

    # ring_backward with GradStep: each step's `after` runs once that step's grad hop is posted (the last one's
    # too, so it hides the final hop), before the next step; the grads are the same as with bare contributions
    events = []

    def step(o, s):
        events.append(("step", len(rec.ops)))
        return GradStep(torch.full_like(s, 1000.0 * (p + 1) + o), lambda: events.append(("after", len(rec.ops))))

    with comm.recording() as rec:
        out["ring_grad_after"] = ring_backward(comm, _coded(p), step).clone()
    out["ring_after_events"] = events
    out["ring_after_ops"] = [o["what"] for o in rec.ops]

    # reduce-scatter (gloo: point-to-point pieces, added up at wait): piece r of rank q is 1000 q + 10 r + position;
    # rank p gets sum_q (1000 q + 10 p + position), also with overlap off (waited where posted)
    for overlap in (True, False):
        comm.overlap = overlap
        full = torch.stack([1000.0 * p + 10.0 * r + torch.arange(N, dtype=torch.float64) for r in range(D)])
        got = torch.full((N,), -1.0, dtype=torch.float64)
        with comm.recording() as rec:
            handle = comm.reduce_scatter(got, full.t().contiguous().t(), what="coded pieces")  # non-contiguous
        if not overlap:
            out["rs_on_return"] = got.clone()
        handle.wait()
        out[f"rs_{overlap}"] = got.clone()
        out[f"rs_ops_{overlap}"] = [(o["kind"], o["what"]) for o in rec.ops]
    # all-gather (gloo: point-to-point pieces straight into their slots): rank q's piece is 1000 q + position
    for overlap in (True, False):
        comm.overlap = overlap
        local = (1000.0 * p + torch.arange(2 * N, dtype=torch.float64)).view(2, N).t()  # non-contiguous
        got = torch.full((D, N, 2), -1.0, dtype=torch.float64)
        with comm.recording() as rec:
            handle = comm.all_gather(got, local, what="coded gather")
        handle.wait()
        out[f"ag_{overlap}"] = got.clone()
        out[f"ag_ops_{overlap}"] = [(o["kind"], o["what"]) for o in rec.ops]
    comm.overlap = True
    return out


@pytest.fixture(scope="module")
def primitives_on():
    cache = {}

    def run(tsp):
        if tsp not in cache:
            cache[tsp] = run_on_local_ranks(_primitives, tsp, timeout_s=120)
        return cache[tsp]
    return run


@pytest.mark.parametrize("tsp", [3, 4])
def test_primitives_exact(tsp, primitives_on):
    results = primitives_on(tsp)
    total = sum(range(1, tsp + 1))
    for p, r in enumerate(results):
        assert r["broadcast_order"] == list(range(tsp)) and r["broadcast_exact"]
        assert r["bcast_fwd_exact"]
        if p == tsp - 1:
            assert torch.equal(r["bcast_grad"], torch.full((N,), float(total), dtype=torch.float64))
        else:
            assert r["bcast_grad"] is None
        assert r["gather_exact"]
        # rank p's local grad = sum over ranks q of upstream_q[p] = sum_q (10 q + p)
        expected = float(sum(10 * q + p for q in range(tsp)))
        assert torch.equal(r["gather_grad"], torch.full((2, 3), expected, dtype=torch.float64))
        assert r["ring_owners"] == [(p - k) % tsp for k in range(tsp)] and r["ring_exact"]
        assert torch.equal(r["ring_grad"], torch.full((N,), 1000.0 * total + tsp * p, dtype=torch.float64))
        assert torch.equal(r["replicated_grad"], torch.full((3,), float(total), dtype=torch.float64))
        assert torch.equal(r["ring_grad_after"], r["ring_grad"])
        ops = r["ring_after_ops"]
        assert len(r["ring_after_events"]) == 2 * tsp
        # D-1 grad hops: step 0's contribution (this rank's own shard) stays home and is added last
        assert [o for o in ops if o.startswith("grad hop")] == [f"grad hop {k}/{tsp - 1}" for k in range(1, tsp)]
        for k in range(tsp):  # step k, then its grad hop (none for step 0), then its `after`
            step_at, after_at = r["ring_after_events"][2 * k][1], r["ring_after_events"][2 * k + 1][1]
            assert r["ring_after_events"][2 * k][0] == "step" and r["ring_after_events"][2 * k + 1][0] == "after"
            hops = [i for i, o in enumerate(ops) if o.startswith("grad hop") and step_at <= i < after_at]
            # the hop is out when `after` runs (so it travels behind it), the last one's too
            assert hops == ([] if k == 0 else [ops.index(f"grad hop {k}/{tsp - 1}")]), (k, ops, r["ring_after_events"])
        expected = sum(1000.0 * q for q in range(tsp)) + tsp * (10.0 * p + torch.arange(N, dtype=torch.float64))
        for overlap in (True, False):
            assert torch.equal(r[f"rs_{overlap}"], expected), (overlap, r[f"rs_{overlap}"], expected)
            assert r[f"rs_ops_{overlap}"] == [("reduce_scatter", "coded pieces")]  # recorded as what it is
        assert torch.equal(r["rs_on_return"], expected)  # overlap off: summed before the call returns
        gathered = torch.stack([(1000.0 * q + torch.arange(2 * N, dtype=torch.float64)).view(2, N).t()
                                for q in range(tsp)])
        for overlap in (True, False):
            assert torch.equal(r[f"ag_{overlap}"], gathered), (overlap, r[f"ag_{overlap}"])
            assert r[f"ag_ops_{overlap}"] == [("all_gather", "coded gather")]


def test_byte_counters_follow_the_formula(primitives_on):
    """Over a full head-block loop every rank receives D-1 shards; a ring pass sends D-1 shards."""
    results = primitives_on(4)
    elem = 8  # float64
    for p, r in enumerate(results):
        c = r["counter"]["bytes"]
        # ShardStream (3 foreign shards) + differentiable broadcast (1 unless owner)
        assert c["broadcast"] == elem * N * (3 + (0 if p == 3 else 1))
        # ring_forward (3 hops) + ring_backward (3 weight hops + 3 grad hops: a reduce-scatter's bytes)
        assert c["ring"] == elem * N * (3 + 3 + 3)


def test_counter_charges_each_wait_to_its_collective():
    """CommCounter.add_wait (what Handle.wait calls): the total, and per collective under a label with every number
    written #, so the blocks and hops of one collective add up; reset forgets both."""
    counter = CommCounter()
    counter.add_wait(0.5, Blocked(None, "ring", ("ring", 0, 1), "grad hop 1/3"))
    counter.add_wait(0.25, Blocked(None, "ring", ("ring", 0, 1), "grad hop 2/3"))
    counter.add_wait(0.125, Blocked(None, "broadcast", ("src", 1), "shard of block 1"))
    counter.add_wait(0.0625, Blocked(None, "all_reduce", ("group",)))
    counter.add_wait(0.03125, None)
    assert counter.wait_s == 0.96875
    assert counter.snapshot()["wait_by"] == {"ring: grad hop #/#": 0.75, "broadcast: shard of block #": 0.125,
                                             "all_reduce": 0.0625, "unlabelled": 0.03125}
    counter.reset()
    assert counter.wait_s == 0.0 and counter.wait_by_collective() == {}


def test_degree_one_is_local():
    comm = TSPComm.single()
    assert [j for j, _ in _every_shard(comm, _coded(0))] == [0]
    held = []
    ring_forward(comm, _coded(0), lambda o, s: held.append(o))
    assert held == [0]
    assert torch.equal(ring_backward(comm, _coded(0), lambda o, s: 2 * s), 2 * _coded(0))
    assert comm.counter.total_bytes == 0
