"""Two of the three TSP primitives on a TSPComm (ds_tsp.core.comm.communicator), and the replicated-parameter
all-reduce.

Every primitive is a forward/backward pair built on handles, so layers can start the next transfer before
computing on the current one:

| primitive            | forward                                  | backward                                      |
|----------------------|------------------------------------------|-----------------------------------------------|
| shard broadcast      | ShardStream: rank j's packed shard to all | ShardGradReducer: weight grads summed on j   |
| weight ring          | pass shards to rank p+1, D-1 hops        | grads travel with the shard, D-1 hops home    |
| sequence all-gather  | ds_tsp.core.comm.kv_gather: K/V straight | dK/dV reduce-scattered from rank order        |
|                      | into global token order                  |                                               |

The fused layers (ds_tsp.core.layers) call these directly; every wait goes through a Handle, so it is bounded
by the comm's timeout_s (ds_tsp.core.reliability.watchdog).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ds_tsp.core.comm.communicator import Handle, TSPComm

WEIGHT_TAG = 7101
GRAD_TAG = 7102


# --- shard broadcast --------------------------------------------------------------------------------------
class ShardStream:
    """Every head block's packed shard by broadcast from its owner, posted `ahead` blocks before its block starts.

    `next_block(j)` at the start of block j forgets block j-1's shard and posts block j+ahead; `take(j)` waits for
    (and returns) a posted shard, so block j may also read block j+1's shard early (the next kv group's K/V
    projection). Live shards: at most ahead+1. The own shard is returned without a copy.
    """

    def __init__(self, comm: TSPComm, own_shard: torch.Tensor, ahead: int = 2):
        self.comm, self.own, self.ahead = comm, own_shard.detach(), ahead
        self._posted: dict[int, tuple[torch.Tensor, Handle]] = {}
        for j in range(min(ahead, comm.size)):
            self._post(j)

    def _post(self, j: int) -> None:
        what = f"shard of block {j}"
        buf = self.own if j == self.comm.rank else torch.empty_like(self.own, memory_format=torch.contiguous_format)
        self._posted[j] = buf, self.comm.broadcast(buf, src=j, what=what)

    def next_block(self, j: int) -> None:
        self._posted.pop(j - 1, None)
        if j + self.ahead < self.comm.size:
            self._post(j + self.ahead)

    def take(self, j: int) -> torch.Tensor:
        shard, handle = self._posted[j]
        handle.wait()
        return shard


class ShardGradReducer:
    """Backward dual of the shard broadcast: every rank's grad contribution for block j is summed on owner j.

    At most `in_flight` reductions stay pending (each holds a packed-shard-sized buffer), so backward keeps O(1)
    shards alive instead of one per head block.
    """

    def __init__(self, comm: TSPComm, in_flight: int = 2):
        self.comm, self.in_flight = comm, in_flight
        self._pending: list[Handle] = []
        self.own_grad: torch.Tensor | None = None

    def reduce(self, owner: int, grad_contribution: torch.Tensor) -> None:
        # A fresh buffer per block: non-owners must not reuse a reduce buffer.
        self._pending.append(self.comm.reduce(grad_contribution, dst=owner, what=f"grad of block {owner}"))
        if owner == self.comm.rank:
            self.own_grad = grad_contribution
        while len(self._pending) > self.in_flight:
            self._pending.pop(0).wait()

    def finish(self) -> torch.Tensor:
        for handle in self._pending:
            handle.wait()
        self._pending = []
        return self.own_grad


# --- weight ring --------------------------------------------------------------------------------------------
def _post_weight_hop(comm: TSPComm, shard: torch.Tensor, step: int):
    """Post the hop that brings the shard for step+1 (send to p+1, receive from p-1); nothing after the last step."""
    if step == comm.size - 1:
        return None, None
    nxt = torch.empty_like(shard, memory_format=torch.contiguous_format)
    return nxt, comm.ring_exchange(shard.contiguous(), nxt, WEIGHT_TAG, what=f"weight hop {step + 1}/{comm.size - 1}")


def ring_forward(comm: TSPComm, own_shard: torch.Tensor, step: Callable[[int, torch.Tensor], None]) -> None:
    """Call step(owner, shard) D times; at step k rank p holds the shard of (p - k) mod D.

    The next hop is posted before `step` runs, so the transfer overlaps the caller's GEMMs.
    """
    shard = own_shard.detach()
    for k in range(comm.size):
        owner = (comm.rank - k) % comm.size
        nxt, hop = _post_weight_hop(comm, shard, k)
        step(owner, shard)
        if hop is not None:
            hop.wait()
            shard = nxt


class GradStep(NamedTuple):
    """What a ring_backward step may return instead of its bare grad contribution: the contribution, and `after`,
    the step's work that the grad does not read (the layer's dx GEMM). ring_backward runs `after` once the
    contribution's grad hop is posted, so the hop travels behind it; on the last step that hides the final hop to
    the owner, which has nothing else to overlap."""
    contribution: torch.Tensor
    after: Callable[[], None]


def ring_backward(comm: TSPComm, own_shard: torch.Tensor,
                  step: Callable[[int, torch.Tensor], torch.Tensor | GradStep]) -> torch.Tensor:
    """Run the ring again; step(owner, shard) returns this rank's grad contribution for that owner's shard (or a
    GradStep: the contribution and the work to run once it is on its way).

    The grad buffer travels with the shard and every rank adds its part: a reduce-scatter folded into the ring, in
    D-1 hops (the bytes of a reduce-scatter). The owner's own contribution (step 0, its own shard) stays home: the
    buffer for owner o starts at rank o+1 (step 1), gathers ranks o+2 .. o-1 and its last hop lands on o, which adds
    its own part. Returns the summed grad of `own_shard`; every owner's sum is formed in the same order (o+1, o+2,
    .., o-1, then o). The grad hop of step k overlaps the GEMMs of step k+1 (it is only awaited when the next sum is
    formed), and a GradStep's `after` (the last hop's only cover).
    """
    if comm.size == 1:
        return _run_after(step(comm.rank, own_shard.detach()))
    shard = own_shard.detach()
    own_grad: torch.Tensor | None = None
    grad_in: torch.Tensor | None = None
    grad_hop: Handle | None = None  # the last grad hop posted: each is waited by the next step, the last one here
    for k in range(comm.size):
        owner = (comm.rank - k) % comm.size
        nxt, weight_hop = _post_weight_hop(comm, shard, k)
        result = step(owner, shard)
        contribution, after = result if isinstance(result, GradStep) else (result, None)
        if k == 0:  # this rank's part of its own grad: added when the others' sum comes home
            own_grad = contribution
        else:
            if grad_hop is not None:
                grad_hop.wait()
                contribution = contribution.add_(grad_in)  # a fresh buffer of the step's: summed in place
            grad_in = torch.empty_like(contribution)
            grad_hop = comm.ring_exchange(contribution, grad_in, GRAD_TAG,
                                          what=f"grad hop {k}/{comm.size - 1}")
        del contribution, result
        if after is not None:
            after()
            after = None  # its closure (the step's token-sized grads) must not live through the next step
        if weight_hop is not None:
            weight_hop.wait()
            shard = nxt
    grad_hop.wait()
    return own_grad.add_(grad_in)


def _run_after(result: torch.Tensor | GradStep | None) -> torch.Tensor | None:
    """A step's contribution, its `after` run first (no hop to hide it behind)."""
    if not isinstance(result, GradStep):
        return result
    result.after()
    return result.contribution


# --- replicated parameters ----------------------------------------------------------------------------------
class _ReplicatedParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, comm):
        ctx.comm = comm
        ctx.context = comm.context  # this grad is summed late in backward: report the layer that used the param
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        context = ctx.context.replace(" forward", " backward") if ctx.context else None
        ctx.comm.all_reduce(grad, kind="replicated_grad", what="replicated weight grad", context=context).wait()
        return grad, None


def replicated_param(param: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """forward: identity; backward: all-reduce (sum) over the TSP group.

    For parameters every rank holds whole (norm weights): each rank saw different tokens, so the true gradient
    is the sum of the per-rank ones, and summing keeps the replicas identical after the optimizer step.
    Inside an open ReplicatedGradBucket (ShardedCausalLM's forward) the sum joins that bucket's one all-reduce;
    otherwise (a layer called on its own, a pipeline stage, FSDP2 / ZeRO-3 params) this use reduces by itself.
    """
    if comm.grad_bucket is not None:
        bucketed = comm.grad_bucket.use(param)
        if bucketed is not None:
            return bucketed
    return _ReplicatedParam.apply(param, comm)
