"""Grads of replicated weights (RMSNorm weights, Qwen3's q_norm / k_norm) summed over the TSP group in ONE
all-reduce per backward instead of one blocking all-reduce per use.

Why a gate node and not a hook: DeepSpeed ZeRO-2 and DDP copy a parameter's grad into their own buckets the moment
it is accumulated (AccumulateGrad hooks), and gradient accumulation ADDS into `.grad`; both must see the already
summed grad, exactly once. So the sum has to happen before AccumulateGrad runs. While a bucket is open (one model
forward, `with ReplicatedGradBucket(comm, params):`):

    gate token  = _Gate(params...)                 one node per forward; its inputs are all bucketed params
    w_used      = _Deposit(param, token)           per use: identity forward; backward deposits the local grad
                                                   into the bucket, sends NOTHING to the param and a zero to token
    gate.backward (after every deposit, since it needs every token grad): wait for the bucket's all-reduce and
                  return the summed grads: each param's AccumulateGrad runs once, with the group sum.

The all-reduce is posted asynchronously by the LAST deposit the forward announced (counted at forward time), so it
overlaps whatever backward runs before the gate (the gate is created before the embedding, whose backward ring
therefore runs first); the gate waits on it through comm.all_reduce's Handle, so a stalled peer is reported by the
watchdog like any TSP collective. Every rank deposits in the same order (same graph), so the collective sequence
agrees.

Not bucketed (they keep comm.replicated_param's per-use blocking all-reduce): parameters that are not plain tensors
(FSDP2's sharded DTensors: FSDP2 swaps in other, unsharded, parameter objects inside each module's forward and
reduce-scatters them in that module's post-backward, before a gate at the end could run) and ZeRO-3 parameters
(`ds_id`: partitioned outside their module's forward). Activation checkpointing (non-reentrant) keeps the original
graph: the recomputed forward's nodes are never backpropagated, so they deposit nothing (and are not counted: the
bucket is closed by then).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def _bucketable(param: torch.Tensor) -> bool:
    return param.requires_grad and type(param) in (torch.Tensor, torch.nn.Parameter) and not hasattr(param, "ds_id")


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bucket, *params):
        ctx.bucket = bucket
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        return (None, *ctx.bucket.summed_grads())


class _Deposit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, token, bucket, slot: int):
        ctx.bucket, ctx.slot = bucket, slot
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        ctx.bucket.deposit(ctx.slot, grad)
        return None, torch.zeros_like(ctx.bucket.token_zero), None, None


class ReplicatedGradBucket:
    """Context manager around one forward; while open, comm.replicated_param routes bucketed params through it."""

    def __init__(self, comm, params: Iterable[torch.Tensor]):
        self.comm = comm
        self.params = [p for p in params if _bucketable(p)]
        self._slot = {id(p): i for i, p in enumerate(self.params)}
        self._previous = None
        self._open = False
        self.expected = 0  # deposits announced by this forward (one per use)
        self._reset()

    def _reset(self) -> None:
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._deposits = 0
        self._pending = None  # (flat buffers per dtype, handles) once posted

    def __enter__(self) -> "ReplicatedGradBucket":
        if self.comm.size == 1 or not self.params or not torch.is_grad_enabled():
            return self  # nothing to sum, or nothing will be backpropagated: stay closed
        self.token = _Gate.apply(self, *self.params)
        self.token_zero = torch.zeros_like(self.token)
        context = self.comm.context
        self.context = context.replace(" forward", " backward") if context else None
        self._previous, self.comm.grad_bucket, self._open = self.comm.grad_bucket, self, True
        return self

    def __exit__(self, *exc) -> None:
        if self._open:
            self.comm.grad_bucket, self._open = self._previous, False

    def use(self, param: torch.Tensor) -> torch.Tensor | None:
        """The bucketed identity of `param`, or None if it is not in this bucket (the caller reduces it itself)."""
        slot = self._slot.get(id(param)) if self._open and torch.is_grad_enabled() else None
        if slot is None:
            return None
        self.expected += 1
        return _Deposit.apply(param, self.token, self, slot)

    def deposit(self, slot: int, grad: torch.Tensor) -> None:
        self._grads[slot] = grad if self._grads[slot] is None else self._grads[slot] + grad
        self._deposits += 1
        if self._deposits == self.expected:
            self._post()  # the last local grad is in: start the one all-reduce, wait only at the gate

    def _post(self) -> None:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(self.params):
            by_dtype.setdefault(p.dtype, []).append(i)
        flats, handles = {}, []
        for dtype, slots in by_dtype.items():  # one buffer per dtype (models normally have one dtype)
            flat = torch.cat([(self._grads[i] if self._grads[i] is not None else torch.zeros_like(self.params[i]))
                              .reshape(-1).to(dtype) for i in slots])
            flats[dtype] = (slots, flat)
            handles.append(self.comm.all_reduce(flat, kind="replicated_grad", context=self.context,
                                                what=f"replicated weight grads ({len(slots)} params, one bucket)"))
        self._pending = (flats, handles)

    def summed_grads(self) -> list[torch.Tensor | None]:
        if self._pending is None:  # some announced use got no grad: post now (same on every rank)
            self._post()
        flats, handles = self._pending
        for handle in handles:
            handle.wait()
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for slots, flat in flats.values():
            offset = 0
            for i in slots:
                n = self.params[i].numel()
                if self._grads[i] is not None:  # params no use deposited into keep grad None, like autograd
                    out[i] = flat[offset:offset + n].view_as(self.params[i])
                offset += n
        self._reset()  # a second backward over a retained graph starts from zero again
        return out
