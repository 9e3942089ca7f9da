"""TRL's RLOOTrainer with TSP: `class R(TSPTrainer, RLOOTrainer)`, ready-made as ds_tsp.hf.TSPRLOOTrainer (built in
ds_tsp.integrations.trl.rloo_trainer; this module holds what differs from GRPO, and imports no trainer).

    from trl import RLOOConfig
    from ds_tsp.hf import TSPRLOOTrainer
    args = RLOOConfig(output_dir=..., deepspeed="ds_configs/tsp.json", num_generations=4, beta=0.05)
    trainer = TSPRLOOTrainer(model=hf_qwen3, reward_funcs=my_reward, args=args, train_dataset=prompts)

RLOOTrainer shares GRPOTrainer's schedule and hooks (the repeat sampler, generation batches, per-token log-probs
through the fused head, _generate_and_score_completions / _compute_loss, the module-level names TSP patches), so
TSPTrainer runs it on GRPO's machinery (ds_tsp.integrations.trl.grpo, whose docstring explains the schedule): the
reference is a second frozen TSP conversion, log-probs come whole on every TSP rank from the streaming vocab-sharded
head, generation gathers the full model on TSP rank 0 of each group (or asks a vLLM server), and the data axis is
TRL's process axis. What RLOO does differently is TRL's own code, run on those inputs:
- the KL is a reward penalty: beta x the sequence's summed log-ratio (policy - reference, first order), gathered over
  the data axis like the rewards, not a term of the loss;
- the advantage is each completion's reward minus the mean of its group's other rewards (leave-one-out), then
  optionally normalised over the gathered batch (normalize_advantages): every TSP rank computes it whole;
- the loss is per sequence (the clipped importance ratio of summed log-probs times the advantage, the micro-batch's
  mean) and TRL returns it unscaled: the Trainer divides it by the accumulation steps (num_items_in_batch unused);
- RLOOTrainer._generate_single_turn takes no num_generations and returns the completions alone.
Refused with a TSPConfigError naming them (checked before anything is built): GRPO's refusals of the options RLOO
shares (RLOOTrainer listed first, peft_config and PEFT models, vLLM colocate mode, transformers continuous batching,
use_liger_kernel, MoE router aux loss, multimodal processors, sync_ref_model under ZeRO-3), tsp.cp_size > 1, and
the two ways RLOOTrainer would load the model itself: a model given by name (TSP converts the model you pass; TRL's
model_init_kwargs would not apply) and quantization_config. DeepSpeed ZeRO-1 / 2 / 3 run on the data axis; under
ZeRO-3 load the model before creating the RLOOConfig (a model loaded while a ZeRO-3 config is alive is partitioned,
refused by name when converted).
"""
from __future__ import annotations

from pathlib import Path

from ds_tsp.core.errors import TSPConfigError


def check_rloo_arguments(model, args, given: dict) -> None:
    """RLOOTrainer options beyond GRPO's that TSP cannot honour, named (given: the other arguments, by name)."""
    if isinstance(model, (str, Path)):
        raise TSPConfigError(f"model={str(model)!r} (a name) with TSP (TSPRLOOTrainer): RLOOTrainer would load it "
                             "with RLOOConfig.model_init_kwargs (float32 unless a dtype is given), TSP converts the "
                             "model you pass; load it with AutoModelForCausalLM.from_pretrained(..., dtype=...) and "
                             "pass the model")
    if given.get("quantization_config") is not None:
        raise TSPConfigError("quantization_config= with TSP (TSPRLOOTrainer): TSP shards full-precision weights (a "
                             "quantized base needs its own kernels); train without it")
