"""ds_tsp.hf.TSPDPOTrainer: `class TSPDPOTrainer(TSPTrainer, DPOTrainer)`, built on first use (TRL is optional)."""
from __future__ import annotations

from ds_tsp.integrations.trl.composed import INSTALL_HINT, composed_trainer_class

__all__ = ["INSTALL_HINT", "dpo_trainer_class"]


def dpo_trainer_class() -> type:
    """The one TSPDPOTrainer class of this process."""
    return composed_trainer_class("DPOTrainer")
