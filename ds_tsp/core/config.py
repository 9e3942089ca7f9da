"""The "tsp" block of a DeepSpeed JSON config, validated (every error names the key and the allowed values), and
the model options it turns into.

    {"tsp": {"size": 4, "cp_size": 1, "pipeline_stages": 1, "keep_gathered_kv": false, "overlap": true,
             "activation_checkpointing": false, "timeout_s": 1800, "kernel": "auto", "lm_head_chunk_tokens": 4096,
             "moe_dispatch": "auto"}}
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
    offload_activations: bool = False  # checkpointed layer inputs wait in host memory (core/activation_offload.py)

    def __post_init__(self):
        if self.offload_activations and not self.activation_checkpointing:
            raise TSPConfigError("TSPOptions(offload_activations=True) needs activation_checkpointing=True: what "
                                 "goes to host memory is each checkpointed decoder layer's saved input")
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


# The smallest tsp.timeout_s that does not warn on a CUDA machine (see TSPConfig._gpu_timeout_floor).
GPU_TIMEOUT_FLOOR_S = 60


class TSPConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    size: int = Field(1, ge=1, description="TSP degree D: ranks that share every layer's weights and tokens")
    cp_size: int = Field(1, ge=1, description="context-parallel degree C: TSP groups (one per node) that split one "
                                              "sequence, K/V passed around a ring across nodes")
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
    offload_activations: bool = Field(False, description="with activation_checkpointing: each checkpointed layer's "
                                                         "input waits in pinned host memory until its recompute")
    allow_cross_node: bool = Field(False, description="let a TSP group span nodes (refused by default: every "
                                                      "layer's weight broadcast would cross the inter-node network)")

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self) -> "TSPConfig":
        if self.offload_activations and not self.activation_checkpointing:
            raise TSPConfigError('tsp.offload_activations=true needs tsp.activation_checkpointing=true: what goes to '
                                 'host memory is each checkpointed decoder layer\'s saved input; set "tsp": '
                                 '{"activation_checkpointing": true, "offload_activations": true}')
        if self.offload_activations and self.pipeline_stages > 1:
            raise TSPConfigError(f"tsp.offload_activations=true with tsp.pipeline_stages={self.pipeline_stages}: "
                                 "pipeline stages checkpoint through DeepSpeed's pipeline engine, which ds_tsp does not "
                                 "offload; set pipeline_stages to 1 or offload_activations to false")
        return self

    @model_validator(mode="after")
    def _cp_with_pipeline(self) -> "TSPConfig":
        if self.cp_size > 1 and self.pipeline_stages > 1:
            raise TSPConfigError(f"tsp.cp_size={self.cp_size} with tsp.pipeline_stages={self.pipeline_stages}: the "
                                 "pipeline engine does not split a sequence over cp groups; set cp_size or "
                                 "pipeline_stages to 1")
        return self

    @model_validator(mode="after")
    def _gpu_timeout_floor(self) -> "TSPConfig":
        """On a CUDA machine a timeout_s under GPU_TIMEOUT_FLOOR_S warns: NCCL collectives are timed from when they
        are queued, the host queues several layers ahead, and the first step sets up the communicators, so a few
        seconds would end a healthy long-sequence step as a stall."""
        if self.timeout_s < GPU_TIMEOUT_FLOOR_S:
            import torch

            if torch.cuda.is_available():
                import warnings

                warnings.warn(f"tsp.timeout_s={self.timeout_s} is below the GPU floor of {GPU_TIMEOUT_FLOOR_S} s: a "
                              "healthy step (queued layers, first-step communicator setup) may be reported as a "
                              f"stall; use at least {GPU_TIMEOUT_FLOOR_S} s and several step times", stacklevel=2)
        return self

    def options(self) -> TSPOptions:
        """The model options this block asks for."""
        return TSPOptions(kernel_backend=None if self.kernel == "auto" else self.kernel,
                          keep_gathered_kv=self.keep_gathered_kv, activation_checkpointing=self.activation_checkpointing,
                          recompute_projections=self.recompute_projections,
                          lm_head_chunk_tokens=self.lm_head_chunk_tokens, moe_dispatch=self.moe_dispatch,
                          offload_activations=self.offload_activations)


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
        if not first["loc"] and isinstance((first.get("ctx") or {}).get("error"), TSPConfigError):
            raise TSPConfigError(str(first["ctx"]["error"])) from None  # a check across keys names them itself
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            allowed = ", ".join(TSPConfig.model_fields)
            raise TSPConfigError(f'tsp.{key}: unknown key{_did_you_mean(key, TSPConfig.model_fields)}; allowed keys '
                                 f'are {allowed}') from None
        raise TSPConfigError(
            f'tsp.{key}={first.get("input")!r}: {first["msg"].lower()}; expected {_describe(key)}') from None


def _did_you_mean(key: str, choices) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_tsp_key(ds_config: dict) -> None:
    """A top-level key that looks like "tsp" but is not ("tps", "TSP", "tsp_size") is an error: DeepSpeed ignores
    keys it does not know, so the run would silently train as plain data parallelism without TSP."""
    for key in ds_config:
        if not isinstance(key, str) or key == "tsp":
            continue
        lower = key.lower()
        if lower.startswith("tsp") or difflib.get_close_matches(lower, ["tsp"], n=1, cutoff=0.6):
            raise TSPConfigError(
                f'"{key}": unknown top-level key; did you mean \'tsp\'? DeepSpeed ignores keys it does not know, so '
                'this would train without TSP; the TSP settings are one block: "tsp": {"size": 4, ...}')


def check_deepspeed_compatible(ds_config: dict, tsp: TSPConfig) -> None:
    """Reject DeepSpeed settings that would silently replace or break the TSP layout (a misspelt "tsp" key too)."""
    check_tsp_key(ds_config)
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
