"""ds_tsp.hf.TSPRLOOTrainer: `class TSPRLOOTrainer(TSPTrainer, RLOOTrainer)`, built on first use (TRL is optional)."""
from __future__ import annotations

from ds_tsp.integrations.trl.composed import INSTALL_HINT, composed_trainer_class

__all__ = ["INSTALL_HINT", "rloo_trainer_class"]


def rloo_trainer_class() -> type:
    """The one TSPRLOOTrainer class of this process."""
    return composed_trainer_class("RLOOTrainer")
