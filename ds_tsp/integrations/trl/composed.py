"""The TRL trainers composed with TSPTrainer (`class TSP<X>(TSPTrainer, <X>)`), each built once, on first use:
TRL is optional, so nothing here imports it at module load. It sits above hf_trainer (TSPTrainer) and what
TSPTrainer does for each TRL trainer (sft, grpo, reward, dpo, rloo), so those read one way: hf_trainer -> sft / grpo /
reward / dpo / rloo."""
from __future__ import annotations

import functools

INSTALL_HINT = "pip install 'ds_tsp[trl]'"
# TRL trainer -> (the public name under ds_tsp.hf, the module that says what TSPTrainer does for it)
COMPOSED = {"SFTTrainer": ("TSPSFTTrainer", "ds_tsp.integrations.trl.sft"),
            "GRPOTrainer": ("TSPGRPOTrainer", "ds_tsp.integrations.trl.grpo"),
            "RewardTrainer": ("TSPRewardTrainer", "ds_tsp.integrations.trl.reward"),
            "DPOTrainer": ("TSPDPOTrainer", "ds_tsp.integrations.trl.dpo"),
            "RLOOTrainer": ("TSPRLOOTrainer", "ds_tsp.integrations.trl.rloo")}


@functools.cache
def composed_trainer_class(trl_trainer: str) -> type:
    """The one `TSP<trl_trainer>` class of this process (ds_tsp.hf.TSPSFTTrainer, TSPGRPOTrainer, TSPRewardTrainer)."""
    name, adapter = COMPOSED[trl_trainer]
    try:
        import trl
    except ImportError as err:
        raise ImportError(f"ds_tsp.hf.{name} needs TRL: {INSTALL_HINT}") from err
    from ds_tsp.integrations.hf_trainer import TSPTrainer

    composed = type(name, (TSPTrainer, getattr(trl, trl_trainer)),
                    {"__doc__": f"TRL's {trl_trainer} under TSP (see {adapter}).", "__module__": "ds_tsp.hf"})
    composed.__qualname__ = name
    return composed
