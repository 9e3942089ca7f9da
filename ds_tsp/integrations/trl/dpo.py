"""TRL's DPOTrainer with TSP: `class D(TSPTrainer, DPOTrainer)`, ready-made as ds_tsp.hf.TSPDPOTrainer (built in
ds_tsp.integrations.trl.dpo_trainer; this module holds what TSPTrainer does for DPO, and imports no trainer).

    from trl import DPOConfig
    from ds_tsp.hf import TSPDPOTrainer
    args = DPOConfig(output_dir=..., deepspeed="ds_configs/tsp.json", beta=0.1, loss_type=["sigmoid"])
    trainer = TSPDPOTrainer(model=hf_qwen3, args=args, train_dataset=preferences, processing_class=tokenizer)

TRL keeps everything it does (dataset preparation, its preference collator, every loss type and weighted
combination, f-divergences, ld_alpha, WPO weighting, precompute_ref_log_probs, sync_ref_model, its metrics); what
TSPTrainer (listed first) changes:
- layout: every TSP rank takes the collated batch whole ([chosen; rejected] rows, B x S token ids: the loaders keep
  TSPAccelerator's data-axis sampling and are never cut) and the TSP model zigzag-shards each row over the group
  inside its forward, so every layer holds 1/D of every chosen and rejected sequence, whatever their lengths;
- per-token statistics come from TSP's streaming vocab-sharded head (`model(..., fused_lm_head=True)`, no
  [tokens, vocab] logits and no full LM-head weight anywhere): log-probs (with gradient), entropy, top-1 and, as
  TRL's add_fused_lm_head(outputs=...) asks, the mean logit over the vocabulary (each vocab shard's sum, summed
  around the ring, / V: exact, so logits/chosen and logits/rejected are the plain trainer's) and log sum p^2 (WPO);
  they are all-gathered over the TSP group (a few floats per token) into the [B, S - 1] order of TRL's fused head,
  and TRL's own code sums them per sequence: the loss has the group's value on every rank and back-propagates only
  each rank's tokens (the gather's backward keeps this rank's slice);
- the reference model is a second, frozen TSP conversion of the model you pass (or of your ref_model), never
  wrapped by DeepSpeed (no optimizer state), not a reload by name; with precompute_ref_log_probs none is built
  (TRL scores the dataset with the policy before training, as it does);
- metrics: TSPAccelerator.gather / gather_for_metrics gather over the data axis (one copy per TSP group), so
  rewards/*, logps/*, logits/*, entropy, mean_token_accuracy and num_tokens count each pair once and TRL's
  `_tp_size` stays 1; num_items_in_batch is None, as DPOTrainer's batches carry no labels;
- padding_free: TRL 1.16 turns it off itself (padded batches, a warning); so does the TSP run, identically;
- PEFT LoRA (ds_tsp.model.peft.lora) with ref_model=None: as DPOTrainer, peft_config= wraps the model in a fresh
  adapter and the reference is the adapter-disabled base, and a PEFT model's reference is its adapter as it was
  before training (TRL copies it to a frozen "ref" adapter; TSP keeps frozen copies of this rank's factor slices).
  No second model: AdapterReference runs the policy's own TSP forward with its adapter off (or at that copy),
  through the same streaming head; also with precompute_ref_log_probs (whose cache key tells the two apart). An
  explicit ref_model (a PEFT one too) is converted like any reference. save_model writes the adapter as PEFT does
  (without TRL's "ref" subfolder).
Refused with a TSPConfigError naming them: DPOTrainer listed first, peft_config= with a PEFT model or a checkpoint
directory, sync_ref_model with an adapter (DPOTrainer refuses it too), quantization_config=, vision processors,
compute_metrics and predict() (TRL recomputes full logits for them), use_liger_kernel, activation_offloading, a
mixture-of-experts router aux loss, sync_ref_model under ZeRO-3, and tsp.cp_size > 1. Under ZeRO-3, pass the model
(and a ref_model) as its checkpoint directory, or load it before the ZeRO-3 TrainingArguments (a PEFT model): a
transformers model loaded after them has partitioned weights (refused by name when converted).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib

import torch

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.integrations.trl.arguments import bind_by_name

# DPOTrainer.__init__ looks these up in its own module's namespace
_DPO_MODULE = "trl.trainer.dpo_trainer"


def _refuse(option: str, why: str) -> None:
    raise TSPConfigError(f"{option} with TSP (TSPDPOTrainer): {why}")


def keyword_arguments(init, model, args, more: tuple, kwargs: dict) -> tuple:
    """(model, args, the other arguments by name) of a DPOTrainer call: its positional order is (model, ref_model,
    args, ...), where TSPTrainer's own signature reads (model, args, ...)."""
    return bind_by_name(init, model, args, more, kwargs, "TSPDPOTrainer",
                        "model=, ref_model=, args=, train_dataset=, ...")


def check_dpo_arguments(model, args, given: dict) -> None:
    """DPOTrainer options TSP cannot honour, named (given: the other arguments of the call, by name)."""
    peft_config, peft_model = given.get("peft_config"), hasattr(model, "peft_config")
    if peft_config is not None and peft_model:
        _refuse("peft_config= with a PEFT model", "DPOTrainer refuses it too: pass the PEFT model alone, or its "
                "merged base (merge_and_unload) with peft_config=")
    if peft_config is not None and not hasattr(model, "state_dict"):
        _refuse(f"peft_config= with model={model!r}", "the adapter is added to a loaded transformers model: load it "
                "(AutoModelForCausalLM.from_pretrained) and pass that, or wrap it yourself (peft.get_peft_model)")
    if (peft_config is not None or peft_model) and getattr(args, "sync_ref_model", False):
        _refuse("sync_ref_model=True with a PEFT adapter", "the reference is the policy's own base weights (or its "
                "initial adapter), not a separate model to mix into (DPOTrainer refuses it too); set "
                "sync_ref_model=False")
    if given.get("quantization_config") is not None:
        _refuse("quantization_config=", "TSP shards full-precision weights; pass an unquantized model")
    processing = given.get("processing_class")
    if processing is not None and not hasattr(processing, "convert_tokens_to_ids"):
        _refuse(f"processing_class={type(processing).__name__}", "TSP models are text-only; pass a tokenizer")
    if given.get("compute_metrics") is not None:
        _refuse("compute_metrics=", "DPOTrainer recomputes the full [B, S, V] logits of every eval batch for it "
                "(deprecated in TRL); its logged eval metrics (rewards/*, logps/*, logits/*) need none: drop it")
    if getattr(args, "use_liger_kernel", False):
        _refuse("use_liger_kernel=True", "Liger patches transformers modules, which a TSP model does not run")
    if getattr(args, "activation_offloading", False):
        _refuse("activation_offloading=True", "TRL's offloading hooks wrap transformers modules; use the TSP "
                "config's offload_activations (with gradient_checkpointing) instead")
    if getattr(args, "router_aux_loss_coef", None):
        _refuse("router_aux_loss_coef", "TSP's fused head has no MoE router aux loss; set it to 0.0")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "output_router_logits") and \
            getattr(args, "router_aux_loss_coef", None) is None and getattr(config, "router_aux_loss_coef", 0.0):
        _refuse("a mixture-of-experts model", "DPO would add the router aux loss, which TSP's fused head does not "
                "compute; pass DPOConfig(router_aux_loss_coef=0.0)")
    template = getattr(args, "chat_template_path", None)
    if template is not None and not str(template).endswith((".jinja", ".j2")):
        _refuse(f"chat_template_path={template!r}", "cloning a chat template adds tokens and resizes the sharded "
                "embedding; pass a .jinja file, or a tokenizer that has the template")
    if getattr(args, "sync_ref_model", False):
        plugin = getattr(args, "deepspeed_plugin", None)
        if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
            _refuse("sync_ref_model=True under ZeRO-3", "TRL mixes gathered parameters on global rank 0 only, but "
                    "every TSP rank holds a different shard; use ZeRO-1/2, or sync_ref_model=False")


def peft_policy(model, given: dict, args) -> tuple[object, str | None]:
    """(the model to convert, how the reference reads its adapter: ADAPTER_MODES' "off" / "initial", or None for
    a separate reference). As DPOTrainer does with ref_model=None: peft_config= wraps the model in a fresh adapter
    (taken out of the call: TRL would wrap the TSP model) and the reference is the adapter-disabled base; a PEFT
    model trains its adapter and the reference is that adapter as it was before training (TRL's "ref" copy)."""
    config = given.pop("peft_config", None)
    if config is not None:
        import peft

        plugin = getattr(args, "deepspeed_plugin", None)  # as DPOTrainer: under ZeRO-3 the adapter keeps the
        zero3 = plugin is not None and getattr(plugin, "zero_stage", 0) == 3  # model's dtype (one dtype to gather)
        model = peft.get_peft_model(model, config, **({"autocast_adapter_dtype": False} if zero3 else {}))
    if not hasattr(model, "peft_config") or given.get("ref_model") is not None:
        return model, None
    return model, "off" if config is not None else "initial"


def reference_model(model, given: dict, args, runtime, to_tsp_model, adapter: str | None = None):
    """DPO's reference as TSP: the user's ref_model converted, else a second frozen conversion of the model (None
    with precompute_ref_log_probs, where TRL scores the dataset with the policy before training; None with an
    adapter reference, which AdapterReference builds on the converted policy)."""
    source = given.get("ref_model")
    if source is None and (adapter is not None or getattr(args, "precompute_ref_log_probs", False)):
        return None
    if source is None:
        source = model
    ref = to_tsp_model(source, runtime.comm, options=runtime.options, data_group=runtime.data_group, hf_face=True)
    if ref is model:  # an already-built TSPForCausalLM converts to itself: it cannot also be the frozen reference
        what = "ref_model= is the policy model itself" if given.get("ref_model") is not None else \
            "model= is a TSPForCausalLM and no ref_model= was given"
        raise TSPConfigError(f"TSPDPOTrainer: {what}; the reference must be a separate frozen model: pass the "
                             "transformers model or its checkpoint directory as model= (the reference is then a "
                             "second TSP conversion of it), or a separate ref_model=")
    ref.requires_grad_(False)
    return ref.eval()


class AdapterReference:
    """DPO's reference for a LoRA policy and ref_model=None, computed as DPOTrainer does for a PEFT model: the
    policy's own TSP forward with its adapter off (the frozen base shards, as PEFT's disable_adapter) or at its
    frozen initial copy ("initial": TRL's "ref" adapter), through the same streaming vocab-sharded head; no second
    copy of the base weights. TRL calls it as its ref_model (under no_grad); the fused head answers log-probs only,
    as TRL asks of a reference."""

    def __init__(self, policy, mode: str):
        from ds_tsp.model.peft.lora import keep_initial_adapter, lora_pieces

        if not lora_pieces(policy.tsp):
            raise TSPConfigError("TSPDPOTrainer: the PEFT model has no LoRA layer TSP adapts (internal)")
        self.policy, self.mode = policy, mode
        self.fused_lm_head_outputs = ("log_probs",)
        # the full-model size of the initial copy: DPOTrainer's PEFT model holds it as a second adapter, which the
        # Trainer's flop count (6 x tokens x parameters) includes
        self.copied_parameters = 0
        if mode == "initial":
            keep_initial_adapter(policy.tsp)
            self.copied_parameters = sum(p.numel() if cut is None else p.numel() // p.shape[cut[0]] *
                                         (max(cut[1]) + p.shape[cut[0]]) for _, p, cut in policy.tsp.lora_tensors())

    def __call__(self, *args, **kwargs):
        from ds_tsp.model.peft.lora import adapter_mode

        policy = self.policy
        own = policy.__dict__.get("fused_lm_head_outputs")
        policy.fused_lm_head_outputs = self.fused_lm_head_outputs
        try:
            with adapter_mode(policy.tsp, self.mode):
                return policy(*args, **kwargs)
        finally:
            if own is None:
                del policy.fused_lm_head_outputs
            else:
                policy.fused_lm_head_outputs = own

    def __getattr__(self, name):  # what TRL reads of a reference (modules() for dropout, config, device, ...)
        if name == "policy":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.policy, name)

    def to(self, *args, **kwargs):  # the policy moves with the trainer
        return self

    def eval(self):
        return self


def reference_adapter_flops(trainer, inputs) -> int:
    """What the Trainer's flop count adds for DPOTrainer's "ref" adapter (a PEFT model's initial copy), as the
    plain trainer counts it; 0 otherwise."""
    ref = trainer.ref_model
    if not isinstance(ref, AdapterReference) or "input_ids" not in inputs:
        return 0
    return 6 * inputs["input_ids"].numel() * ref.copied_parameters


def adapter_reference(model, ref_model, adapter: str | None):
    """The reference TRL gets: `ref_model`, or with an adapter reference (peft_policy) an AdapterReference on the
    converted policy."""
    return ref_model if adapter is None else AdapterReference(model, adapter)


@contextlib.contextmanager
def dpo_init(ref_model):
    """During DPOTrainer.__init__: its reference model is `ref_model` (TRL would reload the policy by name), TRL's
    fused LM head is not installed on TSP models (their forward has one: the outputs TRL asks for are recorded on
    the model), and the TSP models are not wrapped by DeepSpeed / FSDP for the reference (frozen, already sharded
    over the TSP group)."""
    from ds_tsp.model.hf_causal_lm import TSPForCausalLM

    dpo = importlib.import_module(_DPO_MODULE)
    originals = {name: getattr(dpo, name) for name in
                 ("create_model_from_path", "add_fused_lm_head", "prepare_deepspeed", "prepare_fsdp", "hash_module")}
    ours = (TSPForCausalLM, AdapterReference)

    def create_model_from_path(*args, **kwargs):
        if ref_model is None:
            raise TSPConfigError("DPOTrainer asked for a reference model TSP did not build (internal)")
        return ref_model

    def add_fused_lm_head(model, *args, outputs=("log_probs",), **kwargs):
        if not isinstance(model, ours):
            return originals["add_fused_lm_head"](model, *args, outputs=outputs, **kwargs)
        model.fused_lm_head_outputs = tuple(outputs)
        return None

    def skip_tsp(name):
        def wrapper(model, *args, **kwargs):
            return model if isinstance(model, ours) else originals[name](model, *args, **kwargs)
        return wrapper

    def hash_module(module):  # precompute's cache key: an adapter reference is not the policy's own scores
        if not isinstance(module, AdapterReference):
            return originals["hash_module"](module)
        return hashlib.sha256(f"{originals['hash_module'](module.policy)}/adapter {module.mode}".encode()).hexdigest()

    dpo.create_model_from_path, dpo.add_fused_lm_head = create_model_from_path, add_fused_lm_head
    dpo.hash_module = hash_module
    for name in ("prepare_deepspeed", "prepare_fsdp"):
        setattr(dpo, name, skip_tsp(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dpo, name, fn)


def after_init(trainer) -> None:
    """The reference beside the policy, in the engine's half dtype under DeepSpeed (as TRL's prepare_deepspeed)."""
    if trainer.ref_model is not None and not isinstance(trainer.ref_model, AdapterReference):
        half = (torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else None) \
            if trainer.is_deepspeed_enabled else None
        trainer.ref_model.to(trainer.args.device, dtype=half)


# --- the model calls ------------------------------------------------------------------------------------------
class TRLShapedFusedHead:
    """A model (or DeepSpeed engine) whose fused-head answers have TRL's shape: TSP's fused head returns per-token
    fields [B, S] in pre-shifted order (position j scores token j + 1, the last position nothing); TRL's, called with
    unshifted labels, returns [B, S - 1] and DPOTrainer slices it from the right. Everything else is the model's."""

    def __init__(self, model):
        object.__setattr__(self, "_model", model)

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        if not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
            return out
        per_token = {f.name: getattr(out, f.name)[:, :-1] for f in dataclasses.fields(out)
                     if f.name != "loss" and isinstance(getattr(out, f.name), torch.Tensor)
                     and getattr(out, f.name).dim() == 2}
        return dataclasses.replace(out, **per_token)

    def __getattr__(self, name):
        return getattr(self._model, name)


@contextlib.contextmanager
def trl_shaped_models(trainer, model):
    """For one DPO loss (or reference) computation: `model` and the trainer's ref_model seen through
    TRLShapedFusedHead."""
    ref = trainer.ref_model
    if ref is not None:
        trainer.ref_model = TRLShapedFusedHead(ref)
    try:
        yield TRLShapedFusedHead(model)
    finally:
        trainer.ref_model = ref


@contextlib.contextmanager
def unsharded_loaders(trainer):
    """During precompute_ref_log_probs: the accelerator's prepared loaders keep the data-axis sampling and drop the
    zigzag cut (the TSP model takes DPO's batches whole)."""
    from ds_tsp.integrations.trl.grpo import unsharded

    accelerator = trainer.accelerator
    prepare, own = accelerator.prepare, "prepare" in vars(accelerator)  # an instance attribute already: restore it

    def prepare_unsharded(*objects, **kwargs):
        result = prepare(*objects, **kwargs)
        return unsharded(result) if len(objects) == 1 else tuple(unsharded(r) for r in result)

    accelerator.prepare = prepare_unsharded
    try:
        yield
    finally:
        if own:
            accelerator.prepare = prepare
        else:
            del accelerator.prepare
