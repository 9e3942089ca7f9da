"""Speed mode's Gated DeltaNet memory: what one head block keeps from forward for backward, traced, not modelled.

With recompute_projections off (TSPOptions.speed()) every head block keeps its projections and the whole graph of
its conv and chunked delta rule (ds_tsp.core.layers.linear_attention.gated_deltanet._keep_block). That graph saves
many intermediate tensors (the sub-chunks' decay, system and intra matrices among them), so instead of a formula
that would drift from the kernel, the block's forward runs once under FakeTensorMode at the plan's shapes (no
memory, no compute) and the storages its graph saves are summed (each storage once). Without packed documents:
their masks add O(B L K) and O(B L) per block.
"""
from __future__ import annotations

import functools

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


@functools.lru_cache(maxsize=64)
def kept_block_bytes(batch: int, local_len: int, hidden: int, key_heads: int, value_heads: int, key_dim: int,
                     value_dim: int, conv_kernel: int, dtype: str) -> int:
    """Bytes one Gated DeltaNet head block keeps for backward in speed mode on one rank (key_heads / value_heads:
    the block's, local_len: the rank's tokens L)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ds_tsp.core.layers.linear_attention.gated_deltanet import GatedDeltaNetSpec, kept_tensors
    from ds_tsp.core.layers.linear_attention.scan import ChunkPlan

    spec = GatedDeltaNetSpec(hidden=hidden, key_heads_per_block=key_heads, value_heads_per_block=value_heads,
                             key_head_dim=key_dim, value_head_dim=value_dim, conv_kernel=conv_kernel, norm_eps=1e-6,
                             delta_rule_backend="torch")
    dt = getattr(torch, _DTYPES.get(dtype, dtype))
    plans = (ChunkPlan(0, None, None, ((),) * batch),) * 2
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
        return t

    with FakeTensorMode():
        x = torch.empty(batch, local_len, hidden, dtype=dt)
        halo = torch.empty(batch, 2, max(conv_kernel - 1, 0), hidden, dtype=dt)
        shard = torch.empty(spec.layout.numel, dtype=dt)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kept = kept_tensors(x, halo, spec.layout.unpack(shard), spec, plans)
        for t in kept:
            pack(t)
    return sum(seen.values())
