"""DeepSpeed's own "activation_checkpointing" block, read as the "tsp" block's request.

    {"activation_checkpointing": {"cpu_checkpointing": true}, "tsp": {"activation_checkpointing": true}}

asks for the same thing as "tsp": {"activation_checkpointing": true, "offload_activations": true}: the checkpointed
decoder-layer inputs wait in host memory (ds_tsp.core.activation_offload). The TSP model checkpoints its layers
itself (torch.utils.checkpoint around each decoder layer), not through deepspeed.checkpointing, so DeepSpeed's other
keys of that block would do nothing on it: the ones that change memory or numerics are refused by name rather than
ignored. A pipeline (tsp.pipeline_stages > 1) runs DeepSpeed's own checkpointing, which reads the block itself, so
there only cpu_checkpointing is taken (and refused by TSPConfig, which does not offload pipeline stages).
"""
from __future__ import annotations

from ds_tsp.core.config import TSPConfig, parse_tsp_config
from ds_tsp.core.errors import TSPConfigError

# DeepSpeed keys of "activation_checkpointing" that would change what a deepspeed.checkpointing user keeps; the TSP
# layers do not go through deepspeed.checkpointing, so true there would be a silent no-op.
_DEEPSPEED_ONLY = ("partition_activations", "contiguous_memory_optimization")


def with_deepspeed_activation_checkpointing(tsp: TSPConfig, ds_config: dict | None) -> TSPConfig:
    """`tsp` with DeepSpeed's activation_checkpointing.cpu_checkpointing folded in as offload_activations."""
    block = (ds_config or {}).get("activation_checkpointing") or {}
    if not isinstance(block, dict):
        raise TSPConfigError(f'"activation_checkpointing" must be an object like {{"cpu_checkpointing": true}}, got '
                             f"{type(block).__name__}")
    if tsp.pipeline_stages == 1:
        for key in _DEEPSPEED_ONLY:
            if block.get(key):
                raise TSPConfigError(
                    f"activation_checkpointing.{key}=true: the TSP model checkpoints its decoder layers itself, not "
                    "through deepspeed.checkpointing, so this would do nothing (each checkpoint already holds 1/D of "
                    'the tokens); remove it, and use "tsp": {"activation_checkpointing": true, '
                    '"offload_activations": true} to move the checkpoints to host memory')
    if not block.get("cpu_checkpointing") or tsp.offload_activations:
        return tsp
    if not tsp.activation_checkpointing:
        raise TSPConfigError(
            "activation_checkpointing.cpu_checkpointing=true needs tsp.activation_checkpointing=true: ds_tsp reads it "
            "as tsp.offload_activations (each checkpointed decoder layer's input in host memory), which needs "
            'the layers checkpointed; set "tsp": {"activation_checkpointing": true}')
    return parse_tsp_config({**tsp.model_dump(), "offload_activations": True})
