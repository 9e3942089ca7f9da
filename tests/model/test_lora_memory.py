"""PEFT LoRA keeps no second copy of the weight shards from forward to backward (ds_tsp.model.peft.lora,
ds_tsp.core.layers.shard_rebuild).

ShardLoRA hands the attention / MLP Function base + delta, a fresh shard-sized tensor. The Function saves the base
parameter and the factors instead and merges again in backward. Measured as tests/model/test_memory.py measures
saved-for-backward bytes (a saved_tensors_hooks pack hook over the forward; each storage counted once), counting
what the saved set adds to the model's own memory (storages that are not parameters): with LoRA on every projection
that is at most what the same model without LoRA adds plus the factors' bytes (a ZeRO-3 run keeps the gathered
factors), and no saved tensor is a shard-sized tensor outside the parameters. Before, each adapted piece saved its
merged shard (here 72 KiB at D = 1 against 16 KiB of factors: the bound fails by the shards' bytes). D = 1 in
process and D = 2 (gloo); the loss and grads against single-device PEFT are tests/model/test_lora.py's (float64, 1e-10).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_tiny import build_tiny_model, randomize_lora_  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.comm.communicator import TSPComm  # noqa: E402

B, S = 1, 24
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(lora: bool):
    model = build_tiny_model("llama", dtype=torch.float32)
    if not lora:
        return model
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0))
    return randomize_lora_(wrapped)


def _saved(lora: bool, group) -> dict:
    from ds_tsp.hf import TSPForCausalLM

    source = _model(lora)
    ids = torch.randint(0, source.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    model = TSPForCausalLM.from_pretrained(source, group)
    core = model.tsp
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in core.parameters()}
    shard_sizes = {p.numel() for _, _, p in core.sharded_modules()}
    fresh_shards = [tuple(t.shape) for ptr, t in saved.items() if t.numel() in shard_sizes and ptr not in params]
    out.loss.backward()  # the rebuilt shards serve backward
    factor_bytes = sum(p.numel() * p.element_size() for _, p, _ in core.lora_tensors())
    # what the saved set adds to the model's own memory: storages that are not parameters (nor views of them)
    added = sum(t.untyped_storage().nbytes() for ptr, t in saved.items() if ptr not in params)
    return {"bytes": added, "fresh_shards": fresh_shards,
            "factor_bytes": factor_bytes, "pieces": len(shard_sizes),
            "lora_grads": sum(int(p.grad is not None) for _, p, _ in core.lora_tensors())}


def _both(group=None) -> dict:
    import torch.distributed as dist

    group = TSPComm.single() if group is None and not dist.is_initialized() else (group or dist.group.WORLD)
    return {lora: _saved(lora, group) for lora in (False, True)}


@pytest.mark.parametrize("tsp", [1, 2])
def test_lora_saves_no_merged_shard(tsp):
    runs = [_both()] if tsp == 1 else run_on_local_ranks(_both, tsp, timeout_s=300)
    for rank, r in enumerate(runs):
        plain, lora = r[False], r[True]
        assert lora["factor_bytes"] > 0 and lora["lora_grads"] > 0 and plain["factor_bytes"] == 0
        assert lora["fresh_shards"] == [], (rank, lora["fresh_shards"])
        extra = lora["bytes"] - plain["bytes"]
        print(f"D={tsp} rank {rank}: saved {plain['bytes']} B without LoRA, {lora['bytes']} B with "
              f"(+{extra}); factors {lora['factor_bytes']} B")
        assert extra <= lora["factor_bytes"], (rank, extra, lora["factor_bytes"])
