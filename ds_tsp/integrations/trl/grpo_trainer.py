"""ds_tsp.hf.TSPGRPOTrainer: `class TSPGRPOTrainer(TSPTrainer, GRPOTrainer)`, built on first use (TRL is optional)."""
from __future__ import annotations

from ds_tsp.integrations.trl.composed import INSTALL_HINT, composed_trainer_class

__all__ = ["INSTALL_HINT", "grpo_trainer_class"]


def grpo_trainer_class() -> type:
    """The one TSPGRPOTrainer class of this process."""
    return composed_trainer_class("GRPOTrainer")
