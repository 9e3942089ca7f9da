"""A vision tower under TSP: each rank encodes 1/D of the images, and an all-to-all brings every vision token's
embedding to the rank whose zigzag chunks hold that token.

Schedule (one modality, one step; D = TSP degree, p = this rank):
    plan  (host, once per step, identical on every rank: ds_tsp.core.tokens.vision_route): rank p encodes a
          contiguous run p of the items (images or video frames), balanced by patch count; vision token k is
          encoded by rank e(k) and lands on rank z(k), the owner of its zigzag chunk, at local row l(k).
    fwd   E_p = tower(pixels of run p)                    [tokens of run p, h]      replicated tower, local images
          R_p = all_to_all(E_p sorted by z)               [vision tokens in p's chunks, h]
          h_p[l(k)] = R_p                                  (the text embedding of those rows is replaced)
    bwd   dE_p = all_to_all back (splits swapped); tower backward on run p; the tower's weight grads summed over
          the TSP group in ONE all-reduce per dtype inside that backward, before AccumulateGrad sees them.
Bytes per rank: the rows it encodes out plus the rows it holds in, ~ (vision tokens x h) / D each way, not the
all-gather's whole set. Memory: the tower's weights are replicated (small next to the language model), its
activations are those of run p only (~1/D). Every rank runs the same Functions (an empty run included), so the
collectives are posted in the same order everywhere.
Under DeepSpeed ZeRO-3 on the data axis (the tower's weights partitioned over the data group, ds_id) the tower runs
in the step's graph instead, so that ZeRO-3's own hooks gather its weights around its forward and backward and
reduce-scatter its grads; its grads are summed over the TSP group by a hook per parameter before that (encode_zero3).
Under FSDP2 on the data axis (ds_tsp.integrations.fsdp.shard_with_fsdp2) the tower stays whole, replicated on
every rank: the same backward then also averages its grads over the data group (data_group below), so they arrive
as FSDP2 leaves the language model's, averaged over the replicas. A tower FSDP2 shards itself is refused by name.

The plan reads token ids and grids on the host: a loader hands them there (TSPForConditionalGeneration copies
device tensors to the host once at its entry); nothing inside the layers reads device values.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError


class _AllToAllRows(torch.autograd.Function):
    """forward: all-to-all of rows (in_splits out, out_splits in); backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, comm: TSPComm, in_splits: list[int], out_splits: list[int], what: str):
        ctx.comm, ctx.splits, ctx.what = comm, (in_splits, out_splits), what
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        comm.all_to_all(out, rows, out_splits, in_splits, what=what).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, what=ctx.what + " (backward)").wait()
        return back, None, None, None, None


def all_to_all_rows(rows: torch.Tensor, comm: TSPComm, in_splits: list[int], out_splits: list[int],
                    what: str = "vision embeddings") -> torch.Tensor:
    """forward: all-to-all of rows over the TSP group; backward: all-to-all of their grads back."""
    return _AllToAllRows.apply(rows, comm, in_splits, out_splits, what)


class _ReplicatedEncode(torch.autograd.Function):
    """A replicated module run on this rank's inputs: forward records its graph inside (grad enabled), backward
    takes the weight grads from it and sums them over the TSP group, so each weight's AccumulateGrad (and every
    engine hook on it) runs once with the group's sum."""

    @staticmethod
    def forward(ctx, encode: Callable[[], torch.Tensor | None], empty: torch.Tensor, comm: TSPComm, what: str,
                data_group, *params):
        with torch.enable_grad():
            out = encode()
        ctx.out, ctx.comm, ctx.what, ctx.data_group = out, comm, what, data_group
        ctx.save_for_backward(*params)
        return empty.clone() if out is None else out.detach()

    @staticmethod
    def backward(ctx, grad):
        params = ctx.saved_tensors
        out, ctx.out = ctx.out, None
        grads = (torch.autograd.grad(out, params, grad, allow_unused=True)
                 if out is not None and out.requires_grad else (None,) * len(params))
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        summed: list[torch.Tensor | None] = [None] * len(params)
        for slots in by_dtype.values():  # one all-reduce per dtype (a model normally has one)
            flat = torch.cat([(grads[i] if grads[i] is not None else torch.zeros_like(params[i])).reshape(-1)
                              for i in slots])
            ctx.comm.all_reduce(flat, kind="replicated_grad", what=ctx.what).wait()
            if ctx.data_group is not None:  # a replicated tower beside FSDP2: averaged as FSDP2 averages the rest
                with ctx.comm.guard(f"{ctx.what}: all_reduce over data", group=ctx.data_group, poll=flat.device):
                    dist.all_reduce(flat, group=ctx.data_group)
                flat.div_(dist.get_world_size(ctx.data_group))
            offset = 0
            for i in slots:
                n = params[i].numel()
                summed[i] = flat[offset:offset + n].view_as(params[i])
                offset += n
        return (None, None, None, None, None, *summed)


def encode_replicated(module: torch.nn.Module, encode: Callable[[], torch.Tensor | None], empty: torch.Tensor,
                      comm: TSPComm, what: str = "vision tower weight grads",
                      placeholder: Callable[[], torch.Tensor] | None = None, data_group=None) -> torch.Tensor:
    """encode() (this rank's part, or None for nothing: then `empty`) with the module's trainable weights' grads
    summed over the TSP group in backward. Collective in backward on every rank, an empty part included.
    data_group (a replicated tower beside FSDP2 on the data axis): the grads are then also averaged over it, in the
    same backward (a group of one rank: nothing to do).

    A tower partitioned by DeepSpeed ZeRO-3 over the data group (its parameters carry ds_id) runs in the step's
    graph instead (encode_zero3): placeholder() is what a rank with nothing to encode runs through it."""
    params = [p for p in module.parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return encode_zero3(module, encode, empty, comm, placeholder, what)
    sharded = [p for p in params if type(p) not in (torch.Tensor, torch.nn.Parameter)]
    if sharded:  # FSDP2 DTensors: FSDP2 swaps in unsharded parameters inside the forward, grads taken here miss them
        raise TSPConfigError(f"the vision tower's weights are sharded by FSDP2 ({type(sharded[0]).__name__}): "
                             "fully_shard the model with ds_tsp.integrations.fsdp.shard_with_fsdp2, which keeps the "
                             "tower whole, or use DeepSpeed ZeRO-3 (the tower partitioned over the data axis)")
    if not params or not torch.is_grad_enabled():
        with torch.no_grad():
            out = encode()
        return empty if out is None else out
    if data_group is not None and dist.get_world_size(data_group) == 1:
        data_group = None
    return _ReplicatedEncode.apply(encode, empty, comm, what, data_group, *params)


def encode_zero3(module: torch.nn.Module, encode: Callable[[], torch.Tensor | None], empty: torch.Tensor,
                 comm: TSPComm, placeholder: Callable[[], torch.Tensor] | None,
                 what: str = "vision tower weight grads") -> torch.Tensor:
    """The tower under DeepSpeed ZeRO-3 (its parameters partitioned over the data group, gathered by ZeRO-3's own
    hooks around the module's forward and backward, its grads reduce-scattered by ZeRO-3's accumulation hooks).

    - Every rank runs the tower once per call: ZeRO-3's gathers are collectives over the data group, whose ranks
      hold other batches; a rank with nothing to encode runs placeholder() (one smallest item) and keeps none of
      it (its rows are multiplied by zero into `empty`: exact zeros in every grad, the graph the same).
    - The grads are summed over the TSP group by a hook on each parameter (sum_grads_over_tsp), which runs before
      its AccumulateGrad and so before ZeRO-3's reduction: one blocking all-reduce per parameter, in the order
      autograd finishes them, which is the same on every TSP rank (the same modules, in the same order).
    """
    sum_grads_over_tsp(module, comm, what)
    out = encode()
    if out is not None:
        return out
    if placeholder is None:
        raise TSPConfigError("a vision tower under DeepSpeed ZeRO-3 with nothing to encode on this rank and no "
                             "placeholder item: every rank of the data group must run the tower")
    unused = placeholder()
    return empty + 0 * unused.sum().to(empty.dtype)


def sum_grads_over_tsp(module: torch.nn.Module, comm: TSPComm, what: str) -> None:
    """Once per module: a hook on each trainable parameter summing its grad over the TSP group (size 1: none)."""
    if comm.size == 1 or getattr(module, "_tsp_grad_sum_comm", None) is comm:
        return
    if getattr(module, "_tsp_grad_sum_comm", None) is not None:
        raise TSPConfigError("the vision tower is already summing its grads over another TSP group: build one "
                             "TSPForConditionalGeneration per tower")
    module._tsp_grad_sum_comm = comm

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, kind="replicated_grad", what=what).wait()
        return grad

    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(summed)


def scatter_vision_rows(h: torch.Tensor, rows: torch.Tensor, local_index: torch.Tensor) -> torch.Tensor:
    """h [B, L, hidden] with the rows at flat indices local_index replaced by `rows` (out of place: their text
    embeddings get no gradient, as under transformers' masked_scatter). local_index on h's device."""
    B, L, hidden = h.shape
    return h.reshape(B * L, hidden).index_copy(0, local_index, rows.to(h.dtype)).view(B, L, hidden)

