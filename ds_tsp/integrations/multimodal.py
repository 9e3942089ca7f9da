"""TSPTrainer with a vision-language model (this module holds what TSPTrainer does for it, and imports no trainer).

    model = Qwen3_5ForConditionalGeneration.from_pretrained("local/qwen3.5-vl")     # or Qwen3-VL, or MoE
    args = TrainingArguments(output_dir=..., deepspeed="ds_configs/tsp.json")     # its "tsp" block turns TSP on
    trainer = TSPTrainer(model=model, args=args, train_dataset=..., data_collator=vlm_collator)

- the model (a transformers Qwen3_5 / Qwen3_5Moe / Qwen3VL / Qwen3VLMoe ...ForConditionalGeneration in memory, its
  local checkpoint directory, or a ds_tsp.hf.TSPForConditionalGeneration) becomes a TSPForConditionalGeneration on
  the TSP group: it takes the collator's FULL batch (pixels whole) on every TSP rank and shards the tokens inside,
  so the train / eval / test loaders keep TSPAccelerator's data-axis sampling and are never cut (as for the reward
  model); each data replica's loss is its own batch's mean (no data group on the model), averaged over the
  replicas by the data engine, as the plain Trainer's DDP does;
- the loss is the plain Trainer's: the model reports the transformers class's accepts_loss_kwargs (False for these
  four: the plain Trainer passes them no num_items_in_batch and averages the micro-batches' token means over
  gradient accumulation), so TSPTrainer passes none either (a transformers whose class takes loss kwargs is
  refused by name at conversion);
- save_model writes the ForConditionalGeneration layout (TSPForConditionalGeneration.save_pretrained).
Refused with a TSPConfigError naming them: compute_loss_func= and label_smoothing_factor (they read full
logits), a VLM under TRL's SFTTrainer, GRPOTrainer, RLOOTrainer, DPOTrainer or RewardTrainer (their vision paths
are not wired to the TSP model: use TSPTrainer with a collator that builds input_ids, pixel_values, image_grid_thw,
mm_token_type_ids and labels masking the vision tokens), and tsp.cp_size > 1 (the model refuses a cp axis).
"""
from __future__ import annotations

import json
from pathlib import Path

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.model.hf_conditional_generation import ARCHITECTURES, TSPForConditionalGeneration


def is_vision_language(model) -> bool:
    """A model TSPForConditionalGeneration takes: itself, a transformers ...ForConditionalGeneration with a vision
    tower, or a local checkpoint directory whose config has a vision_config."""
    if isinstance(model, TSPForConditionalGeneration):
        return True
    if isinstance(model, (str, Path)):
        path = Path(model) / "config.json"
        return path.is_file() and "vision_config" in json.loads(path.read_text())
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "vision_config", None) is not None and \
        type(model).__name__.endswith("ForConditionalGeneration")


def check_vlm_trainer(trainer_name: str | None, model) -> None:
    """A vision-language model under a TRL composition: refused by name, with what to use instead."""
    if trainer_name is None:
        return
    kind = type(model).__name__ if not isinstance(model, (str, Path)) else repr(str(model))
    raise TSPConfigError(f"model={kind} (a vision-language model) with {trainer_name}: TRL's vision path is not wired "
                         "to TSPForConditionalGeneration under TSP; use ds_tsp.hf.TSPTrainer with a collator that "
                         "builds input_ids, pixel_values, image_grid_thw, mm_token_type_ids and labels (-100 on the "
                         "vision tokens and padding), or train the language model alone (TSPForCausalLM)")


def check_vlm_arguments(args, kwargs: dict) -> None:
    """Trainer options that read the full logits, which the TSP model never builds: refused by name."""
    if kwargs.get("compute_loss_func") is not None:
        raise TSPConfigError("compute_loss_func= with a vision-language model under TSPTrainer: it needs the full "
                             "logits of every token, which TSP never builds; use the model's own loss (no "
                             "compute_loss_func)")
    if getattr(args, "label_smoothing_factor", 0.0):
        raise TSPConfigError(f"label_smoothing_factor={args.label_smoothing_factor} with a vision-language model "
                             "under TSPTrainer: the label smoother reads the full logits, which TSP never builds; "
                             "set it to 0")


def to_vlm_model(model, runtime) -> TSPForConditionalGeneration:
    """The user's VLM as a TSPForConditionalGeneration on the runtime's TSP group (one already built: checked against
    the degree)."""
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.model.convert import _checkpointing_enabled

    if isinstance(model, TSPForConditionalGeneration):
        if model.tsp.comm.size != runtime.comm.size:
            raise TSPConfigError(f"the TSPForConditionalGeneration was built for tsp={model.tsp.comm.size} but the "
                                 f"config asks for tsp={runtime.comm.size}: pass the transformers model (or its "
                                 "checkpoint directory) instead")
        model.tsp.set_data_parallel_group(None)  # per-replica means, as below
        return label_modules(model)
    model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type") \
        if isinstance(model, (str, Path)) else getattr(model.config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise TSPConfigError(f"model_type={model_type!r}: TSPTrainer trains the vision-language models "
                             f"{', '.join(ARCHITECTURES.values())} (TSPForConditionalGeneration)")
    if not isinstance(model, (str, Path)) and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise TSPConfigError(f"{type(model).__name__}'s weights are partitioned by DeepSpeed ZeRO-3 (it was loaded "
                             "after TrainingArguments(deepspeed=<stage 3 config>)): pass the checkpoint directory, or "
                             "load the model before creating the TrainingArguments")
    # no data group: each data replica's loss is its own batch's mean, as the plain Trainer's model computes it,
    # and the data engine averages the replicas (a data group would weight them by their labelled tokens)
    converted = TSPForConditionalGeneration.from_pretrained(model, runtime.comm, options=runtime.options)
    if converted.accepts_loss_kwargs:
        raise TSPConfigError(f"{ARCHITECTURES[model_type]}.accepts_loss_kwargs is True in this transformers: the "
                             "plain Trainer would weight the micro-batches by their labelled tokens, which TSPTrainer "
                             "does not count for vision-language models yet; use transformers 5.25's behaviour (False)")
    if not isinstance(model, (str, Path)) and _checkpointing_enabled(model):
        converted.gradient_checkpointing_enable()
    return label_modules(converted)
