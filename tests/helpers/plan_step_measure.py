"""What the plan tests compare the plan with: one forward + backward of a ShardedCausalLM on this rank (a process
group over the TSP ranks is up), measured: comm counter bytes, saved-for-backward bytes outside the parameters,
parameter and grad bytes. A helper module, not a test file."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM


def measure_step(shape: ModelShape, seq: int, batch: int, dtype: torch.dtype = torch.float32,
                 options: dict | None = None) -> dict:
    comm = TSPComm(dist.group.WORLD)
    model = ShardedCausalLM(shape, comm, options=TSPOptions(**(options or {})), dtype=dtype)
    gen = torch.Generator().manual_seed(comm.rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    ids = torch.randint(0, shape.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    b = shard_batch(ids, tsp=comm.size, rank=comm.rank)
    saved = {}

    def pack(t):
        saved[(t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))] = t
        return t

    comm.counter.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(b["input_ids"], b["shift_labels"], b["position_ids"])
    for t in _kept_by_functions(loss):  # what a Function holds on its ctx (speed mode's kept Gated DeltaNet blocks)
        pack(t)
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    by_storage = {}  # one count per storage (views of one buffer saved several times)
    for (ptr, _, _), t in saved.items():
        if ptr not in own:
            by_storage[ptr] = max(by_storage.get(ptr, 0), t.untyped_storage().nbytes())
    loss.backward()
    return {"bytes": dict(comm.counter.bytes), "saved": sum(by_storage.values()),
            "params": sum(p.numel() * p.element_size() for p in model.parameters()),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
            "offload_host_bytes": model.activation_offload.host_bytes}  # the offload pool (0 without offload)


def _kept_by_functions(loss: torch.Tensor) -> list:
    """The tensors the Gated DeltaNet Functions of loss's graph keep on their ctx in speed mode (not saved tensors,
    so the pack hook does not see them): each kept block's leaves, results and gathered transitions."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for block in getattr(node, "kept", None) or ():
            local = block.local
            found += [t for t in (*block.leaves, *block.small, local.o_local, local.q_eff, local.transitions, local.z,
                                  block.everyone) if t is not None]
        stack += [next_node for next_node, _ in node.next_functions]
    return found
