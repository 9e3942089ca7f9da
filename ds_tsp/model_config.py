"""Shape of a Llama-family causal LM (Llama, Mistral, Qwen2), independent of how it is parallelised."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ds_tsp.errors import TSPConfigError


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

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

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
        if self.intermediate_size % tsp:
            raise TSPConfigError(
                f"intermediate_size={self.intermediate_size} is not divisible by tsp={tsp}: every rank owns "
                f"intermediate_size/tsp MLP columns; pick tsp among {_divisors(self.intermediate_size)}")

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        """From a transformers Llama/Mistral/Qwen2 config (object or config.json dict); no transformers import."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        model_type = get("model_type", "llama")
        if model_type not in SUPPORTED_HF_MODEL_TYPES:
            raise TSPConfigError(f"model_type={model_type!r} is not supported; TSP converts "
                                 f"{', '.join(SUPPORTED_HF_MODEL_TYPES)} (Llama-family: RMSNorm, RoPE, SwiGLU)")
        rope = get("rope_parameters") or get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type != "default":
            raise TSPConfigError(f"rope type {rope_type!r} is not supported yet; only default RoPE")
        if get("mlp_bias", False):
            raise TSPConfigError("mlp_bias=True is not supported: TSP's MLP has no biases")
        qkv_bias = bool(get("attention_bias", False)) or model_type == "qwen2"
        if qkv_bias and model_type != "qwen2":
            raise TSPConfigError("attention_bias=True on a Llama config adds an o_proj bias, which TSP does not "
                                 "support; Qwen2's q/k/v-only bias is supported")
        theta = get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
        heads = get("num_attention_heads")
        return cls(vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
                   intermediate_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
                   num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads, head_dim=get("head_dim"),
                   rope_theta=float(theta), rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)), qkv_bias=qkv_bias)

    def kv_replicas(self, tsp: int) -> int:
        """How many TSP ranks share one kv head (1 unless num_kv_heads < tsp, e.g. MQA)."""
        return max(tsp // self.num_kv_heads, 1)

    def to_dict(self) -> dict:
        return asdict(self)


SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _multiples(n: int, limit: int) -> list[int]:
    return [m for m in range(n, limit + 1, n) if limit % m == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
