"""ds_tsp.hf.TSPRewardTrainer: `class TSPRewardTrainer(TSPTrainer, RewardTrainer)`, built on first use (TRL is
optional)."""
from __future__ import annotations

from ds_tsp.integrations.trl.composed import INSTALL_HINT, composed_trainer_class

__all__ = ["INSTALL_HINT", "reward_trainer_class"]


def reward_trainer_class() -> type:
    """The one TSPRewardTrainer class of this process."""
    return composed_trainer_class("RewardTrainer")
