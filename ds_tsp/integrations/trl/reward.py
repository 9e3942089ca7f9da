"""TRL's RewardTrainer with TSP: `class R(TSPTrainer, RewardTrainer)`, ready-made as ds_tsp.hf.TSPRewardTrainer (built
in ds_tsp.integrations.trl.reward_trainer; this module holds what TSPTrainer does for it, and imports no trainer).

    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig
    from ds_tsp.hf import TSPRewardTrainer
    model = AutoModelForSequenceClassification.from_pretrained("local/base", num_labels=1)
    args = RewardConfig(output_dir=..., deepspeed="ds_configs/tsp.json")   # its "tsp" block turns TSP on
    trainer = TSPRewardTrainer(model=model, args=args, train_dataset=preferences, processing_class=tokenizer)

TRL keeps everything it does (dataset preparation, its preference collator, the Bradley-Terry loss with margin and
center_rewards_coefficient, its metrics); TSPTrainer (listed first) adds:
- the sequence-classification model becomes a ds_tsp.hf.TSPForSequenceClassification on the TSP group: it takes
  the FULL batch on every rank (it zigzag-shards inside), so the train / eval loaders keep TSPAccelerator's
  data-axis sampling and are never cut; its rewards [B, 1] are the same on every rank, and backward gives each rank
  its share of the gradients;
- TRL's metrics need nothing more: TSPAccelerator.gather / gather_for_metrics gather over the data axis (one copy
  per TSP group), so num_tokens, rewards, accuracy and margin count each row once, and TRL's `_tp_size` stays 1
  (Accelerate builds no parallelism_config under TSP).
Refused with a TSPConfigError naming them: a model given as a string (load it with
AutoModelForSequenceClassification first), a model that is not a sequence classifier, peft_config= or a PEFT
model, quantization_config=, a chat_template_path that adds tokens, and tsp.cp_size > 1.
"""
from __future__ import annotations

import inspect

from ds_tsp.core.errors import TSPConfigError


def check_reward_arguments(init, model, args, more: tuple, kwargs: dict) -> None:
    """RewardTrainer options TSP cannot honour, named (init: the bound __init__ after TSPTrainer's)."""
    try:
        given = inspect.signature(init).bind_partial(model, args, *more, **kwargs).arguments
    except TypeError:  # a user's own __init__ signature: check the keywords only
        given = {"model": model, **kwargs}
    model = given.get("model")
    if isinstance(model, str):
        raise TSPConfigError(f"model={model!r} (a string) with TSP: load it first, AutoModelForSequenceClassification"
                             f".from_pretrained({model!r}, num_labels=1), and pass the model (or a local checkpoint "
                             "through ds_tsp.hf.TSPForSequenceClassification.from_pretrained)")
    if given.get("peft_config") is not None or hasattr(model, "peft_config"):
        raise TSPConfigError("peft_config= (or a PEFT model) with TSPRewardTrainer: a LoRA reward model (its score "
                             "head in modules_to_save) is not supported under TSP; train the full model (pass the "
                             "plain ...ForSequenceClassification, no peft_config)")
    if given.get("quantization_config") is not None:
        raise TSPConfigError("quantization_config= with TSP: TSP shards full-precision weights; pass an unquantized "
                             "model")
    template = getattr(args, "chat_template_path", None)
    if template is not None and not str(template).endswith((".jinja", ".j2")):
        raise TSPConfigError(f"chat_template_path={template!r} with TSP: cloning a chat template adds tokens and "
                             "resizes the sharded embedding; pass a .jinja file, or a tokenizer that has the template")


def to_reward_model(model, runtime):
    """The user's in-memory transformers ...ForSequenceClassification (or a TSPForSequenceClassification already
    built for this degree) as a TSPForSequenceClassification on the runtime's TSP group."""
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.model.convert import _checkpointing_enabled, to_tsp_model
    from ds_tsp.model.hf_sequence_classification import TSPForSequenceClassification

    if isinstance(model, TSPForSequenceClassification):
        return to_tsp_model(model, runtime.comm, options=runtime.options, data_group=runtime.data_group, hf_face=True)
    if not type(model).__name__.endswith("ForSequenceClassification") or not hasattr(model, "config"):
        raise TSPConfigError(f"model={type(model).__name__} with TSPRewardTrainer: pass a transformers "
                             "...ForSequenceClassification (AutoModelForSequenceClassification.from_pretrained(..., "
                             "num_labels=1)) or a ds_tsp.hf.TSPForSequenceClassification")
    converted = TSPForSequenceClassification.from_pretrained(model, runtime.comm, options=runtime.options,
                                                             data_group=runtime.data_group)
    if _checkpointing_enabled(model):
        converted.gradient_checkpointing_enable()
    return label_modules(converted)
