"""The "tsp" block of a DeepSpeed JSON config, validated: every error names the key and the allowed values.

    {"tsp": {"size": 4, "pipeline_stages": 1, "keep_gathered_kv": false, "overlap": true,
             "activation_checkpointing": false, "timeout_s": 1800, "kernel": "auto", "lm_head_chunk_tokens": 4096}}
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ds_tsp.errors import TSPConfigError


class TSPConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    size: int = Field(1, ge=1, description="TSP degree D: ranks that share every layer's weights and tokens")
    pipeline_stages: int = Field(1, ge=1, description="pipeline stages on the outer axis (ZeRO <= 1 with > 1)")
    keep_gathered_kv: bool = Field(False, description="keep gathered K/V for backward: O(S) memory, no re-gather")
    recompute_projections: bool = Field(True, description="recompute local q/k/v and MLP gate/up in backward "
                                                          "instead of saving them")
    overlap: bool = Field(True, description="prefetch the next shard / K/V while computing on the current one")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer in backward")
    timeout_s: int = Field(1800, ge=1, description="collective timeout; a failed rank never hangs the others")
    kernel: Literal["auto", "flash_attn", "cpu_flash", "math"] = Field("auto", description="attention kernel")
    lm_head_chunk_tokens: int = Field(4096, ge=1, description="tokens per logits tile of the LM head loss: "
                                                              "bounds its largest transient to [tokens, V/D]")
    on_nonfinite: Literal["error", "skip"] = Field("error", description="a NaN/inf loss or gradient: stop with the "
                                                                        "step and parameter, or skip that step")


def _describe(field: str) -> str:
    info = TSPConfig.model_fields[field]
    annotation = info.annotation
    allowed = getattr(annotation, "__args__", None)
    if allowed and all(isinstance(a, str) for a in allowed):
        kind = "one of " + ", ".join(repr(a) for a in allowed)
    elif annotation is bool:
        kind = "true or false"
    else:
        bounds = [m.ge for m in info.metadata if hasattr(m, "ge")]
        kind = f"an integer >= {bounds[0]}" if bounds else annotation.__name__
    return f"{kind} (default {info.default!r}): {info.description}"


def parse_tsp_config(block: Any) -> TSPConfig:
    """Validate a "tsp" block (a dict, None for defaults, or a TSPConfig)."""
    if isinstance(block, TSPConfig):
        return block
    if block is None:
        return TSPConfig()
    if not isinstance(block, dict):
        raise TSPConfigError(f'"tsp" must be an object like {{"size": 4}}, got {type(block).__name__}')
    try:
        return TSPConfig(**block)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            allowed = ", ".join(TSPConfig.model_fields)
            raise TSPConfigError(f'tsp.{key}: unknown key; allowed keys are {allowed}') from None
        raise TSPConfigError(
            f'tsp.{key}={first.get("input")!r}: {first["msg"].lower()}; expected {_describe(key)}') from None
