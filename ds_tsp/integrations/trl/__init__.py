"""TRL's trainers under TSP: the composed classes built on first use (composed, sft_trainer, grpo_trainer), what
TSPTrainer does for SFT (sft) and GRPO (grpo; RLOO on the same machinery: rloo), and the full weights streamed for
sampling (full_weights)."""
