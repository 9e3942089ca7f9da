"""The "tsp" block of a DeepSpeed JSON config, validated (every error names the key and the allowed values), and
the model options it turns into.

    {"tsp": {"size": 4, "pipeline_stages": 1, "keep_gathered_kv": false, "overlap": true,
             "activation_checkpointing": false, "timeout_s": 1800, "kernel": "auto", "lm_head_chunk_tokens": 4096,
             "moe_dispatch": "auto"}}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ds_tsp.core.errors import TSPConfigError

MOE_DISPATCHES = ("auto", "all_to_all", "ring")


@dataclass(frozen=True)
class TSPOptions:
    """How the TSP schedule trades memory for speed; the defaults are the memory-optimal schedule."""

    kernel_backend: str | None = None  # None: flash-attn on CUDA when importable, the CPU flash kernel on CPU
    keep_gathered_kv: bool = False  # keep each block's gathered K/V for backward: O(S) memory, no re-gather
    activation_checkpointing: bool = False  # save only each decoder layer's input; recompute the layer in backward
    recompute_projections: bool = True  # recompute cheap local q/k/v and MLP gate/up GEMMs in backward
    lm_head_chunk_tokens: int = 4096  # LM head + loss builds logits [<= this many tokens, V/D] at a time
    moe_dispatch: str = "auto"  # MoE layers: "ring" (experts travel), "all_to_all" (tokens travel), "auto" per batch

    def __post_init__(self):
        n = self.lm_head_chunk_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TSPConfigError(f"TSPOptions(lm_head_chunk_tokens={n!r}): must be an integer >= 1 (tokens per "
                                 "logits tile of the LM head loss)")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise TSPConfigError(f"TSPOptions(moe_dispatch={self.moe_dispatch!r}): must be one of "
                                 f"{', '.join(map(repr, MOE_DISPATCHES))}")

    @classmethod
    def speed(cls, **overrides) -> "TSPOptions":
        """The speed mode: keep gathered K/V and every local projection; O(S) per layer instead of O(S/D)."""
        return cls(**{"keep_gathered_kv": True, "recompute_projections": False, **overrides})


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
    kernel: Literal["auto", "flash_attn", "aten_flash", "cpu_flash", "math"] = Field("auto", description="attention kernel")
    lm_head_chunk_tokens: int = Field(4096, ge=1, description="tokens per logits tile of the LM head loss: "
                                                              "bounds its largest transient to [tokens, V/D]")
    on_nonfinite: Literal["error", "skip"] = Field("error", description="a NaN/inf loss or gradient: stop with the "
                                                                        "step and parameter, or skip that step")
    moe_dispatch: Literal["auto", "all_to_all", "ring"] = Field(
        "auto", description="mixture-of-experts layers: experts travel the ring (\"ring\"), routed tokens travel "
                            "(\"all_to_all\"), or per batch shape the one sending fewer bytes (\"auto\")")

    def options(self) -> TSPOptions:
        """The model options this block asks for."""
        return TSPOptions(kernel_backend=None if self.kernel == "auto" else self.kernel,
                          keep_gathered_kv=self.keep_gathered_kv, activation_checkpointing=self.activation_checkpointing,
                          recompute_projections=self.recompute_projections,
                          lm_head_chunk_tokens=self.lm_head_chunk_tokens, moe_dispatch=self.moe_dispatch)


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


def check_deepspeed_compatible(ds_config: dict, tsp: TSPConfig) -> None:
    """Reject DeepSpeed settings that would silently replace or break the TSP layout."""
    autotp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 1)
    if tsp.size > 1 and autotp and autotp > 1:
        raise TSPConfigError(
            f'tensor_parallel.autotp_size={autotp} together with tsp.size={tsp.size}: DeepSpeed AutoTP replaces the '
            'model-parallel unit that TSP provides; remove "tensor_parallel" (TSP already shards the weights)')
    sp = ds_config.get("sequence_parallel_size", 1)
    if tsp.size > 1 and sp and sp > 1:
        raise TSPConfigError(
            f"sequence_parallel_size={sp} together with tsp.size={tsp.size}: DeepSpeed's Ulysses sequence "
            "parallelism and TSP both shard the sequence; remove sequence_parallel_size")
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if tsp.pipeline_stages > 1 and stage > 1:
        raise TSPConfigError(
            f"zero_optimization.stage={stage} with tsp.pipeline_stages={tsp.pipeline_stages}: DeepSpeed's pipeline "
            "engine supports ZeRO stage 0 or 1 only; lower the stage or set pipeline_stages to 1")
