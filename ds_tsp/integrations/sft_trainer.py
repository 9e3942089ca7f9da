"""ds_tsp.hf.TSPSFTTrainer: `class TSPSFTTrainer(TSPTrainer, SFTTrainer)`, built on first use (TRL is optional).

It sits above both hf_trainer (TSPTrainer) and trl (what TSPTrainer does for TRL), so those two read one way:
hf_trainer -> trl."""
from __future__ import annotations

import functools

INSTALL_HINT = "pip install 'ds_tsp[trl]'"


@functools.cache
def sft_trainer_class() -> type:
    """The one TSPSFTTrainer class of this process."""
    try:
        from trl import SFTTrainer
    except ImportError as err:
        raise ImportError(f"ds_tsp.hf.TSPSFTTrainer needs TRL: {INSTALL_HINT}") from err
    from ds_tsp.integrations.hf_trainer import TSPTrainer

    class TSPSFTTrainer(TSPTrainer, SFTTrainer):
        """TRL's SFTTrainer under TSP (see ds_tsp.integrations.trl)."""

    TSPSFTTrainer.__module__ = "ds_tsp.hf"
    TSPSFTTrainer.__qualname__ = "TSPSFTTrainer"
    return TSPSFTTrainer
