"""Hugging Face models in and out: HF-shaped TSP model, sharded loading, streaming save, Trainer, TRL's SFTTrainer,
GRPOTrainer, RewardTrainer, DPOTrainer and RLOOTrainer.

    from ds_tsp.hf import TSPForCausalLM, TSPTrainer, TSPSFTTrainer   # TSPSFTTrainer: (TSPTrainer, trl.SFTTrainer)
    from ds_tsp.hf import TSPGRPOTrainer                              # (TSPTrainer, trl.GRPOTrainer): RL under TSP
    from ds_tsp.hf import TSPRewardTrainer                            # (TSPTrainer, trl.RewardTrainer): reward models
    from ds_tsp.hf import TSPDPOTrainer                               # (TSPTrainer, trl.DPOTrainer): preferences
    from ds_tsp.hf import TSPRLOOTrainer                              # (TSPTrainer, trl.RLOOTrainer): RLOO under TSP
    model = TSPForCausalLM.from_pretrained("local/llama-3.2-1b", tsp_group=group)
    scorer = TSPForSequenceClassification.from_pretrained("local/reward-model", tsp_group=group)
    vlm = TSPForConditionalGeneration.from_pretrained("local/qwen3.5-vl", tsp_group=group)   # images under TSP
"""
from ds_tsp.model.hf_causal_lm import TSPForCausalLM
from ds_tsp.model.hf_conditional_generation import TSPForConditionalGeneration
from ds_tsp.model.hf_sequence_classification import TSPForSequenceClassification

__all__ = ["TSPForCausalLM", "TSPForSequenceClassification", "TSPTrainer", "TSPSFTTrainer", "TSPGRPOTrainer",
           "TSPRewardTrainer", "TSPDPOTrainer", "TSPForConditionalGeneration", "TSPRLOOTrainer"]


def __getattr__(name):  # TSPTrainer imports transformers' Trainer and accelerate: only when asked for
    if name == "TSPTrainer":
        from ds_tsp.integrations.hf_trainer import TSPTrainer

        return TSPTrainer
    if name == "TSPSFTTrainer":  # ImportError with the install hint when trl is missing
        from ds_tsp.integrations.trl.sft_trainer import sft_trainer_class

        return sft_trainer_class()
    if name == "TSPGRPOTrainer":  # ImportError with the install hint when trl is missing
        from ds_tsp.integrations.trl.grpo_trainer import grpo_trainer_class

        return grpo_trainer_class()
    if name == "TSPRewardTrainer":  # ImportError with the install hint when trl is missing
        from ds_tsp.integrations.trl.reward_trainer import reward_trainer_class

        return reward_trainer_class()
    if name == "TSPDPOTrainer":  # ImportError with the install hint when trl is missing
        from ds_tsp.integrations.trl.dpo_trainer import dpo_trainer_class

        return dpo_trainer_class()
    if name == "TSPRLOOTrainer":  # ImportError with the install hint when trl is missing
        from ds_tsp.integrations.trl.rloo_trainer import rloo_trainer_class

        return rloo_trainer_class()
    raise AttributeError(f"module 'ds_tsp.hf' has no attribute {name!r}")
