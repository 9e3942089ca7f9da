"""ds_tsp.hf.TSPSFTTrainer: `class TSPSFTTrainer(TSPTrainer, SFTTrainer)`, built on first use (TRL is optional)."""
from __future__ import annotations

from ds_tsp.integrations.trl.composed import INSTALL_HINT, composed_trainer_class

__all__ = ["INSTALL_HINT", "sft_trainer_class"]


def sft_trainer_class() -> type:
    """The one TSPSFTTrainer class of this process."""
    return composed_trainer_class("SFTTrainer")
