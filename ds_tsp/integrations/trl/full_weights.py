"""The full HF weights of a TSP model, streamed from its shards one module at a time: what RL needs to sample.

`stream_full_weights(tsp_model)`: (HF name, full tensor) pairs on TSP rank 0 of every group, in checkpoint order
(the embedding, each layer's attention and MLP, the norms, an untied LM head), nothing elsewhere. Per sharded
module the TSP group gathers its packed shards to rank 0 (dist.gather, as the streaming save does; under ZeRO-3 /
FSDP2 each parameter is first made whole over the data axis for its turn), rank 0 rebuilds that module's HF tensors
and yields them, and drops them before the next module: at most one module's full tensors are alive on rank 0 (plus
whatever the consumer keeps), the other ranks only send. Collective: every rank of every group iterates to the end.

`gathered_hf_model(tsp_model, device, dtype)`: a context manager giving, on TSP rank 0 of each group, a plain
transformers model filled from that stream (None on the other ranks), dropped on exit. Memory on rank 0: the whole
model in `dtype` (the generation dtype: bf16 under bf16 mixed precision, not the fp32 master weights), built empty
(no random init) and filled tensor by tensor, for as long as the context lasts. Before anything is gathered rank 0
compares that size (plus the caller's reserve, the generation's KV cache) with the device's free memory and the
whole group refuses with one TSPConfigError when it does not fit, instead of an out-of-memory error on rank 0 while
the others wait in the gathers.

`sync_vllm_server(tsp_model, client, metadata)`: TRL's vLLM server-mode weight sync from the shards: the first call
walks the stream once for the (name, dtype, shape) list the server wants announced, then every call streams the
tensors into `client.update_named_params(metadata, iterator)` on global rank 0 (the other ranks join the gathers);
no rank ever holds the full model.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ds_tsp.checkpoint.hf.collective_save import whole_on_this_rank
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.hf_config import import_transformers


def _sharded_lm(tsp_model):
    inner = getattr(tsp_model, "tsp", tsp_model)
    if not callable(getattr(inner, "sharded_modules", None)):
        raise TSPConfigError(f"{type(tsp_model).__name__} is not a TSP model: nothing to stream full weights from")
    if getattr(inner, "lora_adapter_config", None) is not None:
        raise TSPConfigError("streaming full weights of a LoRA-folded TSP model is not supported: merge the adapter "
                             "into the base (peft merge_and_unload) before converting, or train full weights")
    if getattr(inner.shape, "num_experts", 0):
        raise TSPConfigError("streaming full weights of a mixture-of-experts TSP model is not supported (its experts "
                             "are owned by ranks, not sharded); sample from a saved checkpoint instead")
    return inner


def stream_full_weights(tsp_model) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on TSP rank 0 of every group, one module at a time; nothing on the other ranks.
    Collective over the TSP group (and the data axis under ZeRO-3 / FSDP2): every rank must exhaust it."""
    inner = _sharded_lm(tsp_model)
    comm = inner.comm
    for prefix, module, param in inner.sharded_modules():
        with whole_on_this_rank(param, comm, f"full weights: data-axis gather of {prefix}") as whole:
            shards = comm.gather_to(whole, dst=0)
        if shards is not None:
            full = module.unshard(shards)
            del shards
            for name in list(full):
                yield prefix + name, full.pop(name).detach()  # popped: the consumer holds the only reference
            del full
    for name, param in inner.replicated_params().items():
        with whole_on_this_rank(param, comm, f"full weights: data-axis gather of {name}") as whole:
            if comm.rank == 0:
                yield name, whole.detach()


GIB = 2 ** 30


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory on `device` (CUDA: cudaMemGetInfo); None where it cannot be known (the CPU: no check)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None


def full_model_bytes(config, dtype: torch.dtype) -> tuple[int, int]:
    """(parameters, bytes in `dtype`) of the transformers model `config` describes (built on meta: nothing allocated;
    a tied LM head counted once)."""
    transformers = import_transformers()
    with torch.device("meta"), _without_zero3_init():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    count = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    return count, count * torch.empty((), dtype=dtype).element_size()


def memory_refusal(config, dtype: torch.dtype, device: torch.device, reserve_bytes: int = 0,
                   reserve_what: str = "") -> str | None:
    """Why the gathered model (plus reserve_bytes) does not fit `device`'s free memory, or None."""
    free = free_device_bytes(device)
    if free is None:
        return None
    params, size = full_model_bytes(config, dtype)
    if size + reserve_bytes <= free:
        return None
    reserve = f" plus about {reserve_bytes / GIB:.2f} GiB {reserve_what}".rstrip() if reserve_bytes else ""
    return (f"GRPO generation without vLLM gathers the whole model on TSP rank 0 of each group: {params / 1e9:.2f} B "
            f"parameters in {str(dtype).removeprefix('torch.')} = {size / GIB:.2f} GiB{reserve}, but {device} has "
            f"{free / GIB:.2f} GiB free. Use vLLM server mode (use_vllm=True, vllm_mode='server': the weights "
            "stream to the server, no rank holds the full model), or a smaller generation batch "
            "(generation_batch_size, or per_device_train_batch_size x steps_per_generation) or a shorter "
            "max_completion_length")


@contextlib.contextmanager
def _without_zero3_init():
    """While a ZeRO-3 TrainingArguments is alive, transformers builds every model under deepspeed.zero.Init, which
    partitions its parameters with collectives over the whole world: the generation copy is built on TSP rank 0
    alone and must be whole there, so it is built as transformers builds models inside zero.Init (no nested one)."""
    from transformers import modeling_utils
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        yield
        return
    if not hasattr(modeling_utils, "set_zero3_state"):
        raise TSPConfigError("this transformers version has no modeling_utils.set_zero3_state, which TSP needs to "
                             "build the generation model on one rank under ZeRO-3; use transformers >= 5.0 or "
                             "ZeRO-1/2")
    with modeling_utils.set_zero3_state():
        yield


@contextlib.contextmanager
def gathered_hf_model(tsp_model, device: torch.device | None = None, dtype: torch.dtype | None = None,
                      reserve_bytes: int = 0, reserve_what: str = ""):
    """A plain transformers model with the TSP model's current weights on TSP rank 0 of each group (None
    elsewhere), in `dtype` (default the model's), for generation; dropped on exit. Collective (see
    stream_full_weights); refused on every rank of the group, before any gather, when rank 0's device lacks the
    free memory for the model plus reserve_bytes (memory_refusal)."""
    inner = _sharded_lm(tsp_model)
    comm = inner.comm
    leader = comm.rank == 0
    dtype = dtype or inner.dtype
    device = torch.device(device) if device is not None else inner.device
    refusal = memory_refusal(tsp_model.config, dtype, device, reserve_bytes, reserve_what) if leader else None
    if comm.size > 1:  # the group learns rank 0's verdict: every rank refuses together, none waits in a gather
        box = [refusal]
        with comm.guard("generation memory check broadcast from TSP rank 0", context="generation"):
            dist.broadcast_object_list(box, src=dist.get_global_rank(comm.group, 0), group=comm.group)
        refusal = box[0]
    if refusal is not None:
        raise TSPConfigError(refusal)
    hf_model = None
    if leader:
        transformers = import_transformers()
        from transformers.initialization import no_init_weights

        # fork_rng: building the model must not move this rank's generator (sampling must draw what a plain run draws)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), no_init_weights(), \
                torch.device(device), _without_zero3_init():
            hf_model = transformers.AutoModelForCausalLM.from_config(tsp_model.config, dtype=dtype)
        hf_model.tie_weights()  # from_config leaves a tied LM head apart; the stream fills the embedding once
        hf_model.eval()
        if getattr(tsp_model, "generation_config", None) is not None:
            import copy

            hf_model.generation_config = copy.deepcopy(tsp_model.generation_config)
    filled = set()
    targets = dict(hf_model.named_parameters()) if leader else {}
    with torch.no_grad():
        for name, tensor in stream_full_weights(tsp_model):
            if name not in targets:
                raise TSPConfigError(f"full weight {name!r} has no parameter in transformers' "
                                     f"{type(hf_model).__name__}: the TSP model and its config disagree")
            targets[name].copy_(tensor)
            filled.add(name)
            del tensor
    missing = set(targets) - filled
    if missing:
        raise TSPConfigError(f"the TSP model streamed no weight for {sorted(missing)[:4]}: its config does not "
                             "describe the trained model")
    try:
        yield hf_model
    finally:
        del hf_model, targets


def sync_vllm_server(tsp_model, client, metadata: list | None) -> list:
    """Push the TSP model's full weights to a TRL VLLMClient (server mode), streamed module by module from the
    shards. `metadata`: the (name, dtype, shape) list of a previous call, or None to build it (one more walk of the
    stream, as TRL does). Returns the metadata. Collective; only global rank 0 talks to the server."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    if metadata is None:
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape))
                    for name, t in stream_full_weights(tsp_model)]
    if main:
        client.update_named_params(metadata, stream_full_weights(tsp_model))
        client.reset_prefix_cache()
    else:
        for _ in stream_full_weights(tsp_model):  # take part in the gathers (TSP rank 0 of other replicas)
            pass
    return metadata
