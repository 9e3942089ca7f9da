"""ds_tsp.hf.TSPGRPOTrainer: `class TSPGRPOTrainer(TSPTrainer, GRPOTrainer)`, built on first use (TRL is optional).

It sits above both hf_trainer (TSPTrainer) and trl_grpo (what TSPTrainer does for GRPO), as sft_trainer does for SFT."""
from __future__ import annotations

import functools

INSTALL_HINT = "pip install 'ds_tsp[trl]'"


@functools.cache
def grpo_trainer_class() -> type:
    """The one TSPGRPOTrainer class of this process."""
    try:
        from trl import GRPOTrainer
    except ImportError as err:
        raise ImportError(f"ds_tsp.hf.TSPGRPOTrainer needs TRL: {INSTALL_HINT}") from err
    from ds_tsp.integrations.hf_trainer import TSPTrainer

    class TSPGRPOTrainer(TSPTrainer, GRPOTrainer):
        """TRL's GRPOTrainer under TSP (see ds_tsp.integrations.trl_grpo)."""

    TSPGRPOTrainer.__module__ = "ds_tsp.hf"
    TSPGRPOTrainer.__qualname__ = "TSPGRPOTrainer"
    return TSPGRPOTrainer
