"""The "tsp" block of a DeepSpeed JSON config, validated (every error names the key and the allowed values), and
the model options it turns into.

    {"tsp": {"size": 4, "cp_size": 1, "pipeline_stages": 1, "keep_gathered_kv": false, "overlap": true,
             "activation_checkpointing": false, "timeout_s": 1800, "kernel": "auto", "lm_head_chunk_tokens": 4096,
             "moe_dispatch": "auto"}}
"""
from __future__ import annotations

import difflib
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ds_tsp.core.errors import TSPConfigError

# The smallest tsp.timeout_s that does not warn on a CUDA machine (see TSPConfig._gpu_timeout_floor).
GPU_TIMEOUT_FLOOR_S = 60


_UNSET = object()  # a key named without a value (an unknown key); None is a value a block can give


class _Checked(BaseModel):
    """A pydantic model whose every validation error is ONE TSPConfigError naming the key, its value and what is
    allowed (a check across keys names them itself). `_key` says how a key is written in the message."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise TSPConfigError(self._explain(err)) from None

    @classmethod
    def _key(cls, key: str, value: Any = _UNSET) -> str:
        """How a message names `key` (set to `value`, where given)."""
        raise NotImplementedError

    @classmethod
    def _setting(cls, key: str, value: Any) -> str:
        """How a message names another key's wanted value."""
        raise NotImplementedError

    @classmethod
    def keys(cls) -> list[str]:
        """Every key, this class's own first (a "tsp" block's launch keys before the schedule's)."""
        own = [k for k in vars(cls).get("__annotations__", {}) if k in cls.model_fields]
        return own + [k for k in cls.model_fields if k not in own]

    @classmethod
    def _explain(cls, err: ValidationError) -> str:
        first = err.errors()[0]
        if not first["loc"] and isinstance((first.get("ctx") or {}).get("error"), TSPConfigError):
            return str(first["ctx"]["error"])
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            return (f"{cls._key(key)}: unknown key{_did_you_mean(key, cls.model_fields)}; "
                    f"allowed keys are {', '.join(cls.keys())}")
        return f"{cls._key(key, first.get('input'))}: {first['msg'].lower()}; expected {_describe(cls, key)}"


class ScheduleOptions(_Checked):
    """What the model's TSP schedule does, declared once: TSPConfig (the "tsp" block) holds these keys beside the
    launch keys, and TSPOptions (what a model is built with) holds exactly these. The defaults are the
    memory-optimal schedule."""

    kernel: Literal["auto", "flash_attn", "aten_flash", "cpu_flash", "math"] = Field(
        "auto", description="attention kernel: \"auto\" takes flash-attn (else torch's fused attention) on CUDA "
                            "and the CPU flash kernel on the CPU")
    keep_gathered_kv: bool = Field(False, description="keep gathered K/V for backward: O(S) memory, no re-gather")
    recompute_projections: bool = Field(True, description="recompute local q/k/v and MLP gate/up (and each Gated "
                                                          "DeltaNet head block's forward) in backward instead of "
                                                          "saving them")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer in backward")
    lm_head_chunk_tokens: int = Field(4096, ge=1, description="tokens per logits tile of the LM head loss: "
                                                              "bounds its largest transient to [tokens, V/D]")
    moe_dispatch: Literal["auto", "all_to_all", "ring"] = Field(
        "auto", description="mixture-of-experts layers: experts travel the ring (\"ring\"), routed tokens travel "
                            "(\"all_to_all\"), or per batch shape the one sending fewer bytes (\"auto\")")
    cp_comm: Literal["auto", "ring", "all_to_all"] = Field(
        "auto", description="with tsp.cp_size > 1: each head block's K/V pass around the cp ring (\"ring\"), "
                            "its heads are scattered over the cp groups by all-to-all (\"all_to_all\"), or per "
                            "attention layer and sequence length the one with less exposed inter-node time "
                            "(\"auto\", ds_tsp.core.layers.attention.cp_cost)")
    offload_activations: bool = Field(False, description="with activation_checkpointing: each checkpointed layer's "
                                                         "input waits in pinned host memory until its recompute")

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self):
        if self.offload_activations and not self.activation_checkpointing:
            raise TSPConfigError(
                f"{self._key('offload_activations', True)} needs {self._setting('activation_checkpointing', True)}: "
                "what goes to host memory is each checkpointed decoder layer's saved input; "
                f"{self._both_hint()}")
        return self

    @classmethod
    def _both_hint(cls) -> str:
        raise NotImplementedError


class TSPOptions(ScheduleOptions):
    """How the TSP schedule trades memory for speed, as a model is built with it (`TSPConfig.options()` gives the
    one a "tsp" block asks for). Keyword-only, frozen; `replace(**changes)` gives a validated copy."""

    @model_validator(mode="before")
    @classmethod
    def _kernel_backend_is_kernel(cls, data):
        if isinstance(data, dict) and "kernel_backend" in data:
            from ds_tsp.core.deprecation import warn_moved

            data = dict(data)
            backend = data.pop("kernel_backend")
            warn_moved("TSPOptions(kernel_backend=...)", "TSPOptions(kernel=...) (None is \"auto\")")
            if "kernel" not in data:
                data["kernel"] = "auto" if backend is None else backend
        return data

    @property
    def kernel_backend(self) -> str | None:
        """Deprecated name of `kernel` (None for "auto")."""
        from ds_tsp.core.deprecation import warn_moved

        warn_moved("TSPOptions.kernel_backend", "TSPOptions.kernel (\"auto\" where it said None)")
        return None if self.kernel == "auto" else self.kernel

    @classmethod
    def _key(cls, key: str, value: Any = _UNSET) -> str:
        return f"TSPOptions({key})" if value is _UNSET else f"TSPOptions({key}={value!r})"

    @classmethod
    def _setting(cls, key: str, value: Any) -> str:
        return f"{key}={value!r}"

    @classmethod
    def _both_hint(cls) -> str:
        return "pass TSPOptions(activation_checkpointing=True, offload_activations=True)"

    @classmethod
    def speed(cls, **overrides) -> "TSPOptions":
        """The speed mode: keep gathered K/V and every local projection; O(S) per layer instead of O(S/D)."""
        return cls(**{"keep_gathered_kv": True, "recompute_projections": False, **overrides})

    def replace(self, **changes) -> "TSPOptions":
        """A copy with `changes`, validated like a new TSPOptions."""
        return type(self)(**{**self.model_dump(), **changes})


# the values of the moe_dispatch key, for readers outside pydantic (the planner's own inputs)
MOE_DISPATCHES = get_args(ScheduleOptions.model_fields["moe_dispatch"].annotation)


class TSPConfig(ScheduleOptions):
    """The "tsp" block: the launch keys below, and the schedule keys of ScheduleOptions."""

    size: int = Field(1, ge=1, description="TSP degree D: ranks that share every layer's weights and tokens")
    cp_size: int = Field(1, ge=1, description="context-parallel degree C: TSP groups (one per node) that split one "
                                              "sequence, K/V passed around a ring across nodes")
    pipeline_stages: int = Field(1, ge=1, description="pipeline stages on the outer axis (ZeRO <= 1 with > 1)")
    overlap: bool = Field(True, description="prefetch the next shard / K/V while computing on the current one")
    timeout_s: int = Field(1800, ge=1, description="collective timeout; a failed rank never hangs the others")
    on_nonfinite: Literal["error", "skip"] = Field("error", description="a NaN/inf loss or gradient: stop with the "
                                                                        "step and parameter, or skip that step")
    allow_cross_node: bool = Field(False, description="let a TSP group span nodes (refused by default: every "
                                                      "layer's weight broadcast would cross the inter-node network)")

    @classmethod
    def _key(cls, key: str, value: Any = _UNSET) -> str:
        return f"tsp.{key}" if value is _UNSET else cls._setting(key, value)

    @classmethod
    def _setting(cls, key: str, value: Any) -> str:
        return f"tsp.{key}={str(value).lower() if isinstance(value, bool) else repr(value)}"

    @classmethod
    def _both_hint(cls) -> str:
        return 'set "tsp": {"activation_checkpointing": true, "offload_activations": true}'

    @model_validator(mode="after")
    def _offload_without_pipeline(self) -> "TSPConfig":
        if self.offload_activations and self.pipeline_stages > 1:
            raise TSPConfigError(f"tsp.offload_activations=true with tsp.pipeline_stages={self.pipeline_stages}: "
                                 "pipeline stages checkpoint through DeepSpeed's pipeline engine, which ds_tsp does "
                                 "not offload; set pipeline_stages to 1 or offload_activations to false")
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
        return TSPOptions(**{key: getattr(self, key) for key in ScheduleOptions.model_fields})


def _describe(model: type[BaseModel], field: str) -> str:
    info = model.model_fields[field]
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
    return TSPConfig(**block)


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
