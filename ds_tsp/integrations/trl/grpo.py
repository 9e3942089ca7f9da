"""TRL's GRPOTrainer with TSP: `class G(TSPTrainer, GRPOTrainer)`, ready-made as ds_tsp.hf.TSPGRPOTrainer (built in
ds_tsp.integrations.trl.grpo_trainer; this module holds what TSPTrainer does for GRPO, and imports no trainer).

    from trl import GRPOConfig
    from ds_tsp.hf import TSPGRPOTrainer
    args = GRPOConfig(output_dir=..., deepspeed="ds_configs/tsp.json", num_generations=8, beta=0.04)
    trainer = TSPGRPOTrainer(model=hf_qwen3, reward_funcs=my_reward, args=args, train_dataset=prompts)

TRL keeps its loop (sampling prompts, generating, rewards, group advantages, the loss types, num_iterations with
the importance ratio, beta KL against a reference model, metrics); TSPTrainer (listed first) changes:
- policy and reference are TSP models on the same TSP group: the reference is a second TSP conversion of the model
  you pass (frozen, never wrapped by DeepSpeed: it has no optimizer state), not a reload by name;
- per-token log-probs and entropies (policy, old policy, reference) come from TSP's streaming vocab-sharded head:
  `model(..., fused_lm_head=True, temperature=T)` on the whole prompt + completion, every rank getting the whole
  [B, completion] log-probs (no [tokens, vocab] logits, no full LM-head weight); the loss computed from them has the
  group's value on every rank and back-propagates only each rank's share;
- generation without vLLM (what TRL does with ZeRO-3's unwrap_model_for_generation): TSP rank 0 of each group
  gathers the full weights from the shards one module at a time into a plain transformers model
  (ds_tsp.integrations.trl.full_weights), generates, broadcasts the completions and its random-generator state to its
  group (so every rank shuffles and scores the same batch), and drops the model. Memory: the whole model plus the
  generation's KV cache on one rank per group, for the duration of generate; the other ranks hold nothing extra;
- vLLM server mode: the weight sync streams full tensors from the shards module by module to global rank 0, which
  forwards them to the server (no rank holds the full model); the completions of TSP rank 0 are broadcast to its
  group (every rank asks the server, as TRL's processes do, the group keeps its leader's);
- the data axis is TRL's process axis: rewards, advantages and their per-process slice, metrics, num_items_in_batch
  (every TSP rank holds the whole completion mask, so tokens are counted over the data axis, once each) and the
  dapo / cispo / vespo normaliser (num_items / data replicas) use the data rank and size, never the world's; seeds
  are TRL's per-process seeds of the data rank, so a TSP run samples what a plain run with as many processes does.
Refused with a TSPConfigError naming them (checked before anything is built): GRPOTrainer listed first, peft_config
and PEFT models, vLLM colocate mode, transformers continuous batching, cast_lm_head_to_fp32, the entropy bonus
(entropy_coef / use_adaptive_entropy: TSP's entropy carries no gradient), MoE router aux loss, use_liger_kernel,
tools / environment_factory / rollout_func, multimodal processors, sync_ref_model under ZeRO-3.
TRL's RLOOTrainer runs on this same machinery (ds_tsp.integrations.trl.rloo says what differs): its module has the
names patched here, and the trainer's kind ("grpo" / "rloo": TSPTrainer._tsp_online_rl) picks the module and the
public name.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.integrations.trl.arguments import bind_by_name

# The online-RL trainers' __init__ and generation / scoring steps look these names up in their own module's
# namespace (create_model_from_path, add_fused_lm_head, prepare_deepspeed / prepare_fsdp, gather, gather_object)
TRL_MODULES = {"grpo": "trl.trainer.grpo_trainer", "rloo": "trl.trainer.rloo_trainer"}
PUBLIC_NAMES = {"grpo": "TSPGRPOTrainer", "rloo": "TSPRLOOTrainer"}


def _refuse(option: str, why: str, kind: str = "grpo") -> None:
    raise TSPConfigError(f"{option} with TSP ({PUBLIC_NAMES[kind]}): {why}")


def trainer_name(trainer) -> str:
    """The public name of an online-RL TSPTrainer (TSPGRPOTrainer / TSPRLOOTrainer), for its errors."""
    return PUBLIC_NAMES[trainer._tsp_online_rl]


def keyword_arguments(init, model, args, more: tuple, kwargs: dict, kind: str = "grpo") -> tuple:
    """(model, args, the other arguments by name) of a GRPOTrainer / RLOOTrainer call: their positional order is
    (model, reward_funcs, args, ...), where TSPTrainer's own signature reads (model, args, ...)."""
    return bind_by_name(init, model, args, more, kwargs, PUBLIC_NAMES[kind],
                        "model=, reward_funcs=, args=, train_dataset=, ...")


def check_grpo_arguments(model, args, given: dict, kind: str = "grpo") -> None:
    """GRPOTrainer options TSP cannot honour, named (given: the other arguments of the call, by name); RLOOTrainer's
    options of the same names (kind "rloo") are refused alike, naming TSPRLOOTrainer."""
    refuse = functools.partial(_refuse, kind=kind)
    if given.get("peft_config") is not None or hasattr(model, "peft_config"):
        refuse("peft_config= / a PEFT model", "generation without vLLM would need the adapter merged into a "
               "gathered copy of the weights, which the generation path does not build; train full weights, or "
               "merge the adapter (merge_and_unload) first (TSPDPOTrainer trains adapters)")
    for key in ("tools", "environment_factory", "rollout_func"):
        if given.get(key):
            refuse(f"{key}=", "multi-turn and custom rollouts generate outside TSP's group-consistent sampling "
                   "(every rank of a TSP group must score the same completions); use reward functions on "
                   "single-turn completions")
    processing = given.get("processing_class")
    if processing is not None and not hasattr(processing, "convert_tokens_to_ids"):
        refuse(f"processing_class={type(processing).__name__}", "TSP models are text-only; pass a tokenizer")
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", "server") != "server":
        refuse(f"vllm_mode={args.vllm_mode!r}", "colocated vLLM would hold the full model in every process; use "
               "vllm_mode='server' (the weight sync streams full tensors from the shards), or use_vllm=False")
    if getattr(args, "use_transformers_continuous_batching", False):
        refuse("use_transformers_continuous_batching=True", "generation gathers the full model on one rank per "
               "TSP group and calls generate(); set it to False")
    if getattr(args, "cast_lm_head_to_fp32", False):
        refuse("cast_lm_head_to_fp32=True", "TSP's streaming head keeps the LM head as vocab shards (there is no "
               "lm_head module to cast) and computes its log-softmax statistics in float32 already; set it False")
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False):
        refuse("entropy_coef / use_adaptive_entropy", "the entropy bonus needs the entropy's gradient, and TSP's "
               "streaming head returns the entropy as a metric (no gradient); set entropy_coef=0.0, "
               "use_adaptive_entropy=False (top_entropy_quantile masking is supported)")
    if getattr(args, "use_liger_kernel", False):
        refuse("use_liger_kernel=True", "Liger patches transformers modules, which a TSP model does not run")
    if getattr(args, "router_aux_loss_coef", None):
        refuse("router_aux_loss_coef", "TSP's fused head has no MoE router aux loss; set it to 0.0")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "output_router_logits") and \
            getattr(args, "router_aux_loss_coef", None) is None and getattr(config, "router_aux_loss_coef", 0.0):
        refuse("a mixture-of-experts model", "TRL would add the router aux loss, which TSP's fused head does not "
               f"compute; pass {type(args).__name__}(router_aux_loss_coef=0.0)")
    if getattr(args, "sync_ref_model", False):
        plugin = getattr(args, "deepspeed_plugin", None)
        if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
            refuse("sync_ref_model=True under ZeRO-3", "TRL mixes gathered parameters on global rank 0 only, but "
                   "every TSP rank holds a different shard; use ZeRO-2, or sync_ref_model=False")


def data_axis_batches(args, data_size: int) -> None:
    """GRPOConfig derives generation_batch_size = per_device_train_batch_size x world size x steps_per_generation;
    the ranks of a TSP group share one batch, so under TSP the processes that sample prompts are the data replicas:
    per_device_train_batch_size x data replicas x steps_per_generation (steps_per_generation is kept)."""
    generation = args.per_device_train_batch_size * data_size * args.steps_per_generation
    if generation % args.num_generations:
        raise TSPConfigError(f"generation batch {generation} (per_device_train_batch_size "
                             f"{args.per_device_train_batch_size} x {data_size} data replicas x steps_per_generation "
                             f"{args.steps_per_generation}; TSP ranks share one batch) is not divisible by "
                             f"num_generations={args.num_generations}: raise per_device_train_batch_size or "
                             "steps_per_generation")
    args.generation_batch_size = generation


def reference_model(model, args, runtime, to_tsp_model):
    """GRPO's reference: a second, frozen TSP conversion of what the user passed (None when beta is 0)."""
    if getattr(args, "beta", 0.0) == 0.0:
        return None
    ref = to_tsp_model(model, runtime.comm, options=runtime.options, data_group=runtime.data_group, hf_face=True)
    ref.requires_grad_(False)
    return ref.eval()


@contextlib.contextmanager
def grpo_init(ref_model, kind: str = "grpo"):
    """During GRPOTrainer.__init__: its reference model is `ref_model` (TRL would reload the policy by name), TRL's
    fused LM head is not installed on TSP models (their forward has one), and the reference is not wrapped by
    DeepSpeed / FSDP (it is frozen and already sharded over the TSP group). Likewise RLOOTrainer's (kind "rloo")."""
    import importlib

    from ds_tsp.model.hf_causal_lm import TSPForCausalLM

    grpo = importlib.import_module(TRL_MODULES[kind])
    originals = {name: getattr(grpo, name) for name in
                 ("create_model_from_path", "add_fused_lm_head", "prepare_deepspeed", "prepare_fsdp")}

    def create_model_from_path(*args, **kwargs):
        if ref_model is None:
            raise TSPConfigError(f"{PUBLIC_NAMES[kind]} was asked for a reference model although beta is 0 "
                                 "(internal)")
        return ref_model

    def skip_tsp(name):
        def wrapper(model, *args, **kwargs):
            if isinstance(model, TSPForCausalLM):
                return None if name == "add_fused_lm_head" else model
            return originals[name](model, *args, **kwargs)
        return wrapper

    grpo.create_model_from_path = create_model_from_path
    for name in ("add_fused_lm_head", "prepare_deepspeed", "prepare_fsdp"):
        setattr(grpo, name, skip_tsp(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(grpo, name, fn)


def after_init(trainer) -> None:
    """TRL's per-process seed, for the data rank (all ranks of a TSP group draw alike); the vLLM weight sync."""
    from accelerate.utils import set_seed

    set_seed(trainer.args.seed + data_rank(trainer))
    if trainer.ref_model is not None:
        # TRL's reference under DeepSpeed runs in the engine's half dtype (prepare_deepspeed): the same here
        half = (torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else None) \
            if trainer.is_deepspeed_enabled else None
        trainer.ref_model.to(trainer.args.device, dtype=half)
    if getattr(trainer, "use_vllm", False):
        from ds_tsp.integrations.trl.full_weights import sync_vllm_server

        generation, metadata = trainer.vllm_generation, {"list": None}

        def sync_weights():
            metadata["list"] = sync_vllm_server(tsp_model(trainer), generation.vllm_client, metadata["list"])

        generation.sync_weights = sync_weights


# --- the data axis is TRL's process axis -----------------------------------------------------------------------
def data_rank(trainer) -> int:
    groups = trainer.tsp_groups
    return groups.data_rank if groups is not None else 0


def data_size(trainer) -> int:
    groups = trainer.tsp_groups
    return groups.data_size if groups is not None else 1


class DataAxisAccelerator:
    """The trainer's TSPAccelerator as GRPO's bookkeeping must see it: process_index / num_processes are the data
    rank / degree (TRL slices the gathered advantages by them and divides token counts by them), reduce sums over
    the data axis; gather is TSPAccelerator's (data axis) already; everything else is the accelerator's."""

    def __init__(self, accelerator, trainer):
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_trainer", trainer)

    @property
    def process_index(self) -> int:
        return data_rank(self._trainer)

    @property
    def num_processes(self) -> int:
        return data_size(self._trainer)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        out = tensor.clone()
        group = self._trainer.tsp_groups.data_group if data_size(self._trainer) > 1 else None
        if group is not None:
            with self._trainer.tsp_comm.guard("GRPO reduce over data", group=group, poll=out.device):
                dist.all_reduce(out, group=group)
        if reduction == "mean":
            out = out / data_size(self._trainer)
        return out * scale if scale != 1.0 else out

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def __setattr__(self, name, value):
        setattr(self._accelerator, name, value)


@contextlib.contextmanager
def data_axis(trainer):
    """For one GRPO step (generate + score, or the loss): the accelerator seen through DataAxisAccelerator, and
    TRL's module-level gather / gather_object over the data axis (they would gather every TSP rank's copy)."""
    import importlib

    grpo = importlib.import_module(TRL_MODULES[trainer._tsp_online_rl])
    accelerator = trainer.accelerator
    original_gather, original_gather_object = grpo.gather, grpo.gather_object

    def gather_object(obj):
        if data_size(trainer) == 1:
            return obj if isinstance(obj, list) else [obj]
        parts = [None] * data_size(trainer)
        with trainer.tsp_comm.guard("GRPO gather_object over data", group=trainer.tsp_groups.data_group):
            dist.all_gather_object(parts, obj, group=trainer.tsp_groups.data_group)
        return [x for part in parts for x in (part if isinstance(part, list) else [part])]

    trainer.accelerator = DataAxisAccelerator(accelerator, trainer)
    grpo.gather, grpo.gather_object = accelerator.gather, gather_object
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        grpo.gather, grpo.gather_object = original_gather, original_gather_object


# --- the model calls ------------------------------------------------------------------------------------------
def tsp_model(trainer):
    from ds_tsp.model.hf_causal_lm import TSPForCausalLM

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if not isinstance(model, TSPForCausalLM):
        raise TSPConfigError(f"{trainer_name(trainer)}'s model is a {type(model).__name__}, not a TSP model (internal)")
    return model


def completion_logps(trainer, model, input_ids, attention_mask, logits_to_keep: int, batch_size=None,
                     compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GRPOTrainer._get_per_token_logps_and_entropies through TSP's streaming head: [B, logits_to_keep] log-probs
    (and entropies) of the completion tokens under logits / temperature, whole on every TSP rank.

    The head answers in pre-shifted order ([B, S]: position j scores token j + 1, the last position nothing), so the
    completion's K tokens are positions S-1-K .. S-2; transformers' fused head ([B, S-1]) keeps its last K."""
    batch_size = batch_size or input_ids.size(0)
    seq_len = input_ids.size(1)
    window = slice(seq_len - 1 - logits_to_keep, seq_len - 1)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100  # only the completion tokens are scored
        with trainer.accelerator.autocast():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True,
                        temperature=trainer.temperature)
        logps.append(out.log_probs[:, window])
        if compute_entropy:
            entropies.append(out.entropy[:, window])
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None)


def _broadcast_from_leader(trainer, payload):
    """payload of TSP rank 0, on every rank of its group (a host-side object: completions are token-id lists)."""
    comm = tsp_model(trainer).tsp.comm
    if comm.size == 1:
        return payload
    box = [payload if comm.rank == 0 else None]
    # the group waits here while its leader generates: timeout_s must exceed one generation
    with comm.guard("GRPO completions broadcast from TSP rank 0", context="generation"):
        dist.broadcast_object_list(box, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    return box[0]


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def generate(trainer, prompt_ids: list[list[int]]) -> list[list[int]]:
    """TRL's regular (no vLLM) generation of GRPOTrainer._generate_single_turn, with the full model gathered on
    TSP rank 0 of each group; the completions (cut after the first EOS) and that rank's generator state are
    broadcast to the group."""
    from trl.trainer.utils import pad

    from ds_tsp.integrations.trl.full_weights import gathered_hf_model

    model = tsp_model(trainer)
    device = trainer.accelerator.device
    dtype = generation_dtype(trainer.args, model.tsp.dtype)
    completions = None
    kv = kv_cache_bytes(model.config, len(prompt_ids), max(map(len, prompt_ids), default=0) +
                        (trainer.generation_config.max_new_tokens or 0), dtype)
    with gathered_hf_model(model, device, dtype, kv, f"of KV cache for {len(prompt_ids)} sequences") as hf_model:
        if hf_model is not None:
            tensors = [torch.tensor(ids) for ids in prompt_ids]
            pad_id, multiple = trainer._tokenizer.pad_token_id, trainer.pad_to_multiple_of
            inputs = {"input_ids": pad(tensors, padding_value=pad_id, padding_side="left",
                                       pad_to_multiple_of=multiple).to(device),
                      "attention_mask": pad([torch.ones_like(t) for t in tensors], padding_value=0,
                                            padding_side="left", pad_to_multiple_of=multiple).to(device)}
            # under mixed precision the copy is in the generation dtype and runs under its autocast, as the
            # accelerator's autocast runs a plain model's forward; synced_gpus=False: under ZeRO-3 transformers would
            # sync every decoding step over the world, but this whole copy generates on TSP rank 0 of each group alone
            low = dtype in (torch.bfloat16, torch.float16)
            with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=low):
                out = hf_model.generate(**inputs, generation_config=trainer.generation_config, synced_gpus=False)
            completion_ids = out[:, inputs["input_ids"].size(1):].cpu()
            is_eos = torch.isin(completion_ids, torch.tensor(trainer.eos_token_ids))
            eos_idx = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), completion_ids.size(1))
            keep = torch.arange(completion_ids.size(1))[None] <= eos_idx[:, None]
            completions = [c[m].tolist() for c, m in zip(completion_ids, keep, strict=True)]
    payload = _broadcast_from_leader(trainer, None if completions is None else (completions, _rng_state(device)))
    completions, state = payload
    _set_rng_state(state, device)
    return completions


def generation_dtype(args, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the generation copy: the mixed-precision dtype (bf16 / fp16) when the run trains in one, not the
    fp32 master weights (half the memory, the fast GEMMs); else the model's own."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return model_dtype


def kv_cache_bytes(config, sequences: int, tokens: int, dtype: torch.dtype) -> int:
    """An upper estimate of HF generate's KV cache: every layer keeps K and V for every token of every sequence."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return (2 * text.num_hidden_layers * kv_heads * head_dim * sequences * tokens *
            torch.empty((), dtype=dtype).element_size())


def broadcast_vllm_completions(trainer, completion_ids, logprobs):
    """Under vLLM every rank asked the server for its (identical) prompts; the group keeps its leader's samples."""
    return _broadcast_from_leader(trainer, (completion_ids, logprobs))


def unsharded(loader):
    """GRPO's loaders yield lists of prompt rows (strings), never token batches: keep the data-axis sampling of
    TSPAccelerator.prepare, drop the zigzag cut (completions are scored whole-batch through the TSP model); each
    batch fetch stays bounded by timeout_s (Accelerate's RNG-state and batch broadcasts)."""
    from ds_tsp.integrations.accelerate.dataloaders import TSPShardedLoader, WholeBatchLoader

    return WholeBatchLoader(loader.loader, loader.comm) if isinstance(loader, TSPShardedLoader) else loader
