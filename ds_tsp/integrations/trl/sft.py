"""TRL's SFTTrainer with TSP: `class SFTWithTSP(TSPTrainer, SFTTrainer)`, ready-made as ds_tsp.hf.TSPSFTTrainer
(built in ds_tsp.integrations.trl.sft_trainer; this module holds what TSPTrainer does for TRL, and imports no trainer).

    from trl import SFTConfig
    from ds_tsp.hf import TSPSFTTrainer
    args = SFTConfig(output_dir=..., deepspeed="ds_configs/tsp.json", packing=True)   # its "tsp" block turns TSP on
    trainer = TSPSFTTrainer(model=hf_llama, args=args, train_dataset=..., processing_class=tokenizer)

TRL keeps everything it does (dataset preparation, packing / padding-free, completion-only and assistant-only
labels, its collators, loss, metrics); TSPTrainer (listed FIRST, so it converts the model before TRL sees it) adds:
- TRL's fused LM head is not installed on the TSP model (add_fused_lm_head would replace its forward by one that
  reads the full lm_head.weight, a vocab shard here): TSPForCausalLM.forward(fused_lm_head=True) answers the same
  call through TSP's streaming head (per-token log-probs, entropy, top-1 of the whole sequence on every rank, the
  loss's gradient each rank's own share);
- the packed-document keys TRL's collators emit (cu_seq_lens_q/k, seq_idx, seq_lengths) become position_ids
  restarting per document (integrations/accelerate/dataloaders.py), checked against the batch's position_ids;
- TRL's num_tokens metric counts the tokens of the whole sequence (TRL would count this rank's shard).
GRPOTrainer, RewardTrainer and DPOTrainer compose too: ds_tsp.integrations.trl.grpo (ds_tsp.hf.TSPGRPOTrainer),
ds_tsp.integrations.trl.reward (ds_tsp.hf.TSPRewardTrainer) and ds_tsp.integrations.trl.dpo (TSPDPOTrainer);
RLOOTrainer runs on GRPO's machinery (ds_tsp.integrations.trl.rloo, ds_tsp.hf.TSPRLOOTrainer).
Refused with a TSPConfigError naming them: the other TRL trainers (KTO, GKD, ...: their
losses read full logits of several models), SFTTrainer listed before TSPTrainer, and the SFT options
that need full logits or modify the model TRL-side (peft_config, compute_loss_func, label_smoothing_factor, a
chat_template_path that adds tokens, selective activation checkpointing, MoE router aux loss).
"""
from __future__ import annotations

import contextlib
import inspect

from ds_tsp.core.errors import TSPConfigError


def _trl_trainers(cls: type) -> list[type]:
    from transformers import Trainer

    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl" and issubclass(c, Trainer)]


def check_composition(cls: type, tsp_trainer: type) -> str | None:
    """At class creation: "sft" / "grpo" / "reward" / "dpo" when `cls` composes TSPTrainer with TRL's SFTTrainer /
    GRPOTrainer / RewardTrainer / DPOTrainer (TSPTrainer first; GRPO: ds_tsp.integrations.trl.grpo, Reward:
    ds_tsp.integrations.trl.reward, DPO: ds_tsp.integrations.trl.dpo), "rloo" with RLOOTrainer
    (ds_tsp.integrations.trl.rloo); None without TRL; TSPConfigError for any other TRL trainer, or the TRL trainer
    ahead of TSPTrainer."""
    trl_classes = _trl_trainers(cls)
    if not trl_classes:
        return None
    from trl import DPOTrainer, GRPOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer

    supported = {SFTTrainer: "sft", GRPOTrainer: "grpo", RewardTrainer: "reward", DPOTrainer: "dpo",
                 RLOOTrainer: "rloo"}  # RLOO: on GRPO's machinery (ds_tsp.integrations.trl.rloo)
    others = [c for c in trl_classes if c not in supported and c.__name__ != "_BaseTrainer"]
    if others:
        name = others[0].__name__
        raise TSPConfigError(f"{cls.__name__}: TSPTrainer with TRL's {name} is not supported (SFTTrainer, "
                             "GRPOTrainer, RewardTrainer, DPOTrainer and RLOOTrainer are: ds_tsp.hf.TSPSFTTrainer, "
                             f"TSPGRPOTrainer, TSPRewardTrainer, TSPDPOTrainer, TSPRLOOTrainer): {name}'s loss reads "
                             "full-vocabulary logits (of a policy and a reference model, or of generated samples), "
                             "which TSP never builds per token")
    mro = list(cls.__mro__)
    for trainer, kind in supported.items():
        if trainer in mro and mro.index(trainer) < mro.index(tsp_trainer):
            name, ready = trainer.__name__, f"TSP{trainer.__name__}"
            raise TSPConfigError(f"class {cls.__name__}({name}, TSPTrainer): list TSPTrainer first, class "
                                 f"{cls.__name__}(TSPTrainer, {name}) (or use ds_tsp.hf.{ready}): TSP must "
                                 f"convert the model and answer TRL's fused LM head before {name} sets them up")
    kinds = {supported[c] for c in trl_classes if c in supported}
    if len(kinds) > 1:
        raise TSPConfigError(f"{cls.__name__}: {' and '.join(sorted(kinds))} trainers together; compose TSPTrainer "
                             "with one")
    return kinds.pop()


def check_sft_arguments(init, model, args, more: tuple, kwargs: dict) -> None:
    """SFTTrainer options TSP cannot honour, named (init: the bound __init__ after TSPTrainer's, SFTTrainer's)."""
    try:
        given = inspect.signature(init).bind_partial(model, args, *more, **kwargs).arguments
    except TypeError:  # a user's own __init__ signature: check the keywords only
        given = kwargs
    if given.get("peft_config") is not None:
        raise TSPConfigError("peft_config= with TSP: SFTTrainer would wrap the TSP model TRL-side; wrap the HF model "
                             "before the trainer (peft.get_peft_model(model, config)) and pass that")
    if given.get("compute_loss_func") is not None:
        raise TSPConfigError("compute_loss_func= with TSP: it needs the full logits of every token; SFTTrainer's own "
                             "loss (loss_type 'nll' or 'dft') runs through TSP's streaming LM head")
    if getattr(args, "label_smoothing_factor", 0) > 0:
        raise TSPConfigError(f"label_smoothing_factor={args.label_smoothing_factor} with TSP: label smoothing needs "
                             "the full logits of every token; leave it at 0")
    template = getattr(args, "chat_template_path", None)
    if template is not None and not str(template).endswith((".jinja", ".j2")):
        raise TSPConfigError(f"chat_template_path={template!r} with TSP: cloning a chat template adds tokens and "
                             "resizes the sharded embedding; pass a .jinja file, or a tokenizer that has the template")
    if (getattr(args, "gradient_checkpointing_kwargs", None) or {}).get("selective"):
        raise TSPConfigError("gradient_checkpointing_kwargs={'selective': True} with TSP: TSP recomputes whole "
                             "decoder layers (gradient_checkpointing=True without 'selective')")
    if getattr(args, "router_aux_loss_coef", None):
        raise TSPConfigError("router_aux_loss_coef with TSP: TSP models have no MoE router")


def prepare_model(model) -> None:
    """What SFTTrainer reads off the model before the Trainer is built: a generation_config (it mirrors pad / eos)."""
    if not hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_model_config(model.config)


@contextlib.contextmanager
def sft_init():
    """During SFTTrainer.__init__: TRL's add_fused_lm_head leaves TSP models alone (their forward has the head)."""
    import trl.trainer.sft_trainer as sft

    from ds_tsp.model.hf_causal_lm import TSPForCausalLM

    original = sft.add_fused_lm_head

    def add_fused_lm_head(model, *args, **kwargs):
        if isinstance(model, TSPForCausalLM):
            return None  # TSPForCausalLM.forward(fused_lm_head=True): the same outputs, from the vocab shards
        return original(model, *args, **kwargs)

    sft.add_fused_lm_head = add_fused_lm_head
    try:
        yield
    finally:
        sft.add_fused_lm_head = original


def batch_tokens(trainer, inputs: dict):
    """Tokens of this data replica's whole batch, as SFTTrainer counts them for num_tokens (the attention mask's
    ones, or the flattened row's length when padding-free), from this rank's TSP shard."""
    import torch
    import torch.distributed as dist

    if inputs.get("attention_mask") is not None:
        local = inputs["attention_mask"].sum().to(torch.int64)
        groups = trainer.tsp_groups
        if groups is not None and groups.layout.tsp_enabled:
            with trainer.tsp_comm.guard("num_tokens all_reduce", group=groups.tsp_group, poll=local.device):
                dist.all_reduce(local, group=groups.tsp_group)
        return local
    if inputs.get("position_ids") is not None:
        return torch.tensor(inputs.get("seq_len") or inputs["position_ids"].size(1),
                            device=inputs["position_ids"].device)
    return None


def count_train_tokens(trainer, inputs: dict, before: int) -> None:
    """After SFTTrainer.compute_loss in training: its num_tokens metric, counted over the whole sequence."""
    if not (trainer.model.training and hasattr(trainer, "_total_train_tokens") and hasattr(trainer, "_metrics")):
        return
    tokens = batch_tokens(trainer, inputs)
    if tokens is None:
        return
    total = trainer.accelerator.gather_for_metrics(tokens).sum().item()
    trainer._total_train_tokens = before + total // getattr(trainer, "_tp_size", 1)
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]
