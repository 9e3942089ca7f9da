"""Shape of a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3; Qwen3-MoE and Mixtral with experts),
independent of how it is parallelised. The MoE fields' rules live in ds_tsp.core.moe_shape."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.moe_shape import MOE_MODEL_TYPES, check_moe_degree, check_moe_fields, moe_fields_from_config
from ds_tsp.core.rope import RopeScaling


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2-style bias on q/k/v projections (o_proj has none)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k (weights [head_dim]) before RoPE
    rope_scaling: RopeScaling | None = None  # None: default RoPE
    attention_windows: tuple[int | None, ...] | None = None  # per layer: sliding window, None = full attention
    # Mixture of experts (num_experts 0: dense). Sparse layers route each token to num_experts_per_tok of
    # num_experts SwiGLU experts of width moe_intermediate_size; dense_mlp_layers keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top_k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum 1 (Mixtral: always)
    dense_mlp_layers: tuple[int, ...] = ()  # Qwen3-MoE's mlp_only_layers / decoder_sparse_step, resolved
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False  # transformers adds router_aux_loss_coef * aux loss only when true

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TSPConfigError(f"{name}={value!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise TSPConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}: "
                "grouped-query attention needs every kv head to serve the same number of query heads")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise TSPConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}: "
                "choose a hidden size that is a multiple of the head count, or set head_dim explicitly")
        if self.dim_per_head % 2:
            raise TSPConfigError(f"head_dim={self.dim_per_head} must be even for rotary embeddings")
        if self.attention_windows is not None:
            if len(self.attention_windows) != self.num_layers:
                raise TSPConfigError(f"attention_windows has {len(self.attention_windows)} entries for "
                                     f"num_layers={self.num_layers}: give one (int or None) per layer")
            bad = [w for w in self.attention_windows if w is not None and (not isinstance(w, int) or w < 1)]
            if bad:
                raise TSPConfigError(f"sliding_window={bad[0]!r}: a window is a positive number of tokens")
        if isinstance(self.dense_mlp_layers, list):  # from a JSON manifest
            object.__setattr__(self, "dense_mlp_layers", tuple(self.dense_mlp_layers))
        check_moe_fields(self)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the sparse experts MLP (else the dense SwiGLU of intermediate_size)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def moe_family(self) -> str | None:
        """The transformers family whose checkpoint names an MoE model uses: Qwen3-MoE has q/k norms, Mixtral not."""
        return None if self.num_experts == 0 else "qwen3_moe" if self.qk_norm else "mixtral"

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of decoder layer `layer` (HF: key s visible to query t iff t - window < s <= t)."""
        return None if self.attention_windows is None else self.attention_windows[layer]

    def check_tsp_degree(self, tsp: int) -> None:
        """Raise unless every sharded dimension splits evenly over `tsp` ranks."""
        if tsp < 1:
            raise TSPConfigError(f"tsp={tsp}: the TSP degree must be >= 1")
        if self.num_heads % tsp:
            raise TSPConfigError(
                f"num_heads={self.num_heads} is not divisible by tsp={tsp}: every rank owns num_heads/tsp query "
                f"heads; pick tsp among {_divisors(self.num_heads)}")
        if self.num_kv_heads % tsp and tsp % self.num_kv_heads:
            raise TSPConfigError(
                f"num_kv_heads={self.num_kv_heads} and tsp={tsp} do not divide each other: every rank owns "
                "num_kv_heads/tsp kv heads, or (when num_kv_heads < tsp) one kv head replicated on tsp/num_kv_heads "
                f"ranks; pick tsp among {sorted(set(_divisors(self.num_kv_heads)) | set(_multiples(self.num_kv_heads, self.num_heads)))}")
        check_moe_degree(self, tsp)
        has_dense_mlp = not all(self.is_moe_layer(i) for i in range(self.num_layers))
        if has_dense_mlp and self.intermediate_size % tsp:
            raise TSPConfigError(
                f"intermediate_size={self.intermediate_size} is not divisible by tsp={tsp}: every rank owns "
                f"intermediate_size/tsp MLP columns; pick tsp among {_divisors(self.intermediate_size)}")

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        """From a transformers Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral config (object or config.json dict).

        Strict: every config field that would change the computation and that TSP does not implement is one
        TSPConfigError naming the field (never silently ignored). No transformers import.
        """
        return _shape_from_config(config)

    def kv_replicas(self, tsp: int) -> int:
        """How many TSP ranks share one kv head (1 unless num_kv_heads < tsp, e.g. MQA)."""
        return max(tsp // self.num_kv_heads, 1)

    def to_dict(self) -> dict:
        return asdict(self)


SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
# Defaults of the transformers config classes for the fields below, for config.json dicts that omit them.
_SLIDING_DEFAULTS = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "qwen3_moe": 4096}
_HEAD_DIM_DEFAULTS = {"qwen3": 128}  # Qwen3Config's default; others (Qwen3-MoE, Mixtral too): hidden / heads
_EPS_DEFAULTS = {"mixtral": 1e-5}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def _getter(config):
    if isinstance(config, dict):
        return lambda key, default=None: config.get(key, default)
    return lambda key, default=None: getattr(config, key, default)


def _shape_from_config(config) -> ModelShape:
    get = _getter(config)
    model_type = get("model_type", "llama")
    if model_type not in SUPPORTED_HF_MODEL_TYPES:
        raise TSPConfigError(f"model_type={model_type!r} is not supported; TSP converts "
                             f"{', '.join(SUPPORTED_HF_MODEL_TYPES)} (Llama-family: RMSNorm, RoPE, SwiGLU)")
    for key in _MOE_FIELDS if model_type not in MOE_MODEL_TYPES else ():
        if get(key):
            raise TSPConfigError(f"{key}={get(key)!r}: mixture-of-experts MLPs are not supported; TSP shards a "
                                 "dense SwiGLU MLP")
    if get("hidden_act", "silu") != "silu":
        raise TSPConfigError(f"hidden_act={get('hidden_act')!r} is not supported: TSP's gated MLP is SwiGLU (silu)")
    if get("mlp_bias", False):
        raise TSPConfigError("mlp_bias=True is not supported: TSP's MLP has no biases")
    if get("attention_bias", False):
        raise TSPConfigError(f"attention_bias=True on a {model_type} config adds an o_proj bias, which TSP does not "
                             "support (Qwen2's q/k/v-only bias is supported)")
    if float(get("attention_dropout", 0.0) or 0.0) > 0:
        raise TSPConfigError(f"attention_dropout={get('attention_dropout')}: TSP attention has no dropout; set it "
                             "to 0.0")
    if (get("pretraining_tp", 1) or 1) > 1:
        raise TSPConfigError(f"pretraining_tp={get('pretraining_tp')}: the sliced-projection emulation is not "
                             "supported; set pretraining_tp to 1")
    theta, scaling = _rope_from_config(get, 1e6 if model_type == "mixtral" else 10000.0)
    heads = get("num_attention_heads")
    layers = get("num_hidden_layers")
    moe = moe_fields_from_config(get, model_type, layers) if model_type in MOE_MODEL_TYPES else {}
    return ModelShape(vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
                      intermediate_size=get("intermediate_size"), num_layers=layers, num_heads=heads,
                      num_kv_heads=get("num_key_value_heads") or heads,
                      head_dim=get("head_dim", _HEAD_DIM_DEFAULTS.get(model_type)),
                      rope_theta=theta, rms_norm_eps=float(get("rms_norm_eps", _EPS_DEFAULTS.get(model_type, 1e-6))),
                      tie_word_embeddings=bool(get("tie_word_embeddings", False)), qkv_bias=model_type == "qwen2",
                      qk_norm=model_type in ("qwen3", "qwen3_moe"), rope_scaling=scaling,
                      attention_windows=_windows_from_config(get, model_type, layers), **moe)


def _rope_from_config(get, default_theta: float = 10000.0) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's rope_parameters or the older rope_theta + rope_scaling."""
    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise TSPConfigError("rope_parameters is nested per layer type: per-layer RoPE is not supported")
    theta = float(params.get("rope_theta") or get("rope_theta") or default_theta)
    partial = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise TSPConfigError(f"partial_rotary_factor={partial}: partial rotary embeddings are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    allowed = {f for f in RopeScaling.__dataclass_fields__ if f not in ("rope_type", "max_position_embeddings")}
    kwargs = {k: v for k, v in params.items() if k in allowed}
    if rope_type in ("llama3", "yarn") and kwargs.get("original_max_position_embeddings") is None:
        kwargs["original_max_position_embeddings"] = get("original_max_position_embeddings") or get(
            "max_position_embeddings")
    return theta, RopeScaling(rope_type=rope_type, max_position_embeddings=get("max_position_embeddings"), **kwargs)


def _windows_from_config(get, model_type: str, layers: int) -> tuple[int | None, ...] | None:
    """Per-layer sliding windows, as each family's transformers model applies them."""
    if model_type in ("mistral", "mixtral", "qwen3_moe"):  # one window on every layer, when set
        if model_type == "qwen3_moe":  # Qwen3MoeConfig drops the window unless use_sliding_window
            window = get("sliding_window", _SLIDING_DEFAULTS[model_type]) if get("use_sliding_window", False) else None
        else:
            window = get("sliding_window", _SLIDING_DEFAULTS.get(model_type))
        return None if window is None else (window,) * layers
    if model_type not in ("qwen2", "qwen3"):
        if get("sliding_window") is not None:
            raise TSPConfigError(f"sliding_window={get('sliding_window')} on a {model_type} config: its "
                                 "transformers model does not apply it; remove it")
        return None
    window = get("sliding_window", _SLIDING_DEFAULTS[model_type]) if get("use_sliding_window", False) else None
    layer_types = get("layer_types")
    if layer_types is None:
        first = get("max_window_layers", 28)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise TSPConfigError(f"layer_types contains {unknown}: only full_attention and sliding_attention layers "
                             "are supported")
    if len(layer_types) != layers:
        raise TSPConfigError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={layers}")
    if "sliding_attention" in layer_types and window is None:
        raise TSPConfigError("layer_types has sliding_attention layers but sliding_window is None (or "
                             "use_sliding_window is false): set both, or make every layer full_attention")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return windows if any(w is not None for w in windows) else None


def _multiples(n: int, limit: int) -> list[int]:
    return [m for m in range(n, limit + 1, n) if limit % m == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
