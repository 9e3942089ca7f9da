"""What a model family adapter declares, and the config reading the Llama-shaped families share.

A family adapter (one module of this folder) turns its transformers config into ModelShape fields: which fields
it reads, their defaults (the transformers config class's, for a config.json that omits them), and every field
that would change the computation in a way TSP does not implement, refused by name. The shared TSP layers do the
rest; a family that brings a new mechanism adds a ModelShape field for it, read here and honoured by the layers.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.rope_scaling import RopeScaling


class HFConfig:
    """A transformers config (object) or its config.json (dict), read by key with the config class's defaults."""

    def __init__(self, config):
        self.raw = config
        self._get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)

    def get(self, key: str, default=None):
        return self._get(key, default)

    @property
    def model_type(self) -> str | None:
        return self.get("model_type")

    def refuse(self, key: str, why: str, allowed=(None, 0, 0.0, False)) -> None:
        """A field whose value here (other than `allowed`) would change the model in a way TSP does not compute."""
        value = self.get(key)
        if value not in allowed:
            raise TSPConfigError(f"{key}={value!r} on a {self.model_type} config: {why}")


    def with_values(self, **values) -> "HFConfig":
        """This config (as its config.json dict) with `values` set: how a family hands the shared readers the
        fields it has normalised (a rope block of one layer type, a default filled in)."""
        raw = self.raw if isinstance(self.raw, dict) else self.raw.to_dict()
        return HFConfig({**raw, **values})


ReadShape = Callable[[HFConfig], dict]


@dataclass(frozen=True)
class Family:
    """One transformers model family: the text model_types it reads (-> the ForCausalLM class a saved checkpoint
    names), the multimodal model_types whose text_config holds its language model, and its config reader."""

    architectures: dict[str, str]
    read: ReadShape
    wrappers: dict[str, str] = field(default_factory=dict)  # multimodal model_type -> its text model_type
    # the text_config of a wrapper, checked for what the multimodal model computes otherwise than the ForCausalLM
    # TSP trains and saves (None: nothing differs)
    check_wrapped: Callable[[HFConfig], None] | None = None


# --- the Llama-shaped decoder every family starts from ------------------------------------------------------------

def decoder_fields(cfg: HFConfig, *, head_dim: int | None = None, eps: float = 1e-6, theta: float = 10000.0,
                   partial_rotary: bool = False, act: str | None = "silu", pad_token_id: int | None = None) -> dict:
    """The fields of a pre-norm decoder with RoPE attention and a gated MLP (Llama's), with the defaults of the
    family's config class; the common fields TSP does not compute are refused here.
    partial_rotary: the family reads partial_rotary_factor (else refused); act: the MLP activation it has (None:
    the family reads its activation field itself);
    pad_token_id: the config class's default (the embedding row that never gets a gradient)."""
    if act is not None and cfg.get("hidden_act", act) != act:
        raise TSPConfigError(f"hidden_act={cfg.get('hidden_act')!r} on a {cfg.model_type} config: its gated MLP is "
                             f"{act} under TSP; a checkpoint with another activation is another model")
    cfg.refuse("mlp_bias", "TSP's MLP has no biases")
    cfg.refuse("attention_bias", "it adds an o_proj bias, which TSP does not support (Qwen2's q/k/v-only bias is "
                                 "supported)")
    if float(cfg.get("attention_dropout", 0.0) or 0.0) > 0:
        raise TSPConfigError(f"attention_dropout={cfg.get('attention_dropout')}: TSP attention has no dropout; set it "
                             "to 0.0")
    if (cfg.get("pretraining_tp", 1) or 1) > 1:
        raise TSPConfigError(f"pretraining_tp={cfg.get('pretraining_tp')}: the sliced-projection emulation is not "
                             "supported; set pretraining_tp to 1")
    rope_theta, scaling = rope_fields(cfg, theta, partial_rotary)
    heads = cfg.get("num_attention_heads")
    return dict(vocab_size=cfg.get("vocab_size"), hidden_size=cfg.get("hidden_size"),
                intermediate_size=cfg.get("intermediate_size"), num_layers=cfg.get("num_hidden_layers"),
                num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim", head_dim), rope_theta=rope_theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", eps)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope_scaling=scaling,
                pad_token_id=cfg.get("pad_token_id", pad_token_id))


def dense_only(cfg: HFConfig) -> None:
    """A dense family's config naming experts is another model: refused, never read as dense."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        cfg.refuse(key, "mixture-of-experts MLPs are not part of this family; TSP would shard a dense MLP")


def rope_fields(cfg: HFConfig, default_theta: float = 10000.0, partial_allowed: bool = False,
                extra_keys: tuple[str, ...] = ()) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's rope_parameters or the older rope_theta + rope_scaling.
    partial_allowed: the family reads partial_rotary_factor (elsewhere it is refused); extra_keys: keys of
    rope_parameters the family reads itself (ignored here)."""
    params = {k: v for k, v in dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).items()
              if k not in extra_keys}
    if any(isinstance(v, dict) for v in params.values()):
        raise TSPConfigError("rope_parameters is nested per layer type: per-layer RoPE is not supported")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or default_theta)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not partial_allowed:
        raise TSPConfigError(f"partial_rotary_factor={partial}: partial rotary embeddings are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    allowed = {f for f in RopeScaling.__dataclass_fields__ if f not in ("rope_type", "max_position_embeddings")}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k in allowed}
    if rope_type in ("llama3", "yarn", "longrope") and kwargs.get("original_max_position_embeddings") is None:
        kwargs["original_max_position_embeddings"] = (cfg.get("original_max_position_embeddings")
                                                      or cfg.get("max_position_embeddings"))
    return theta, RopeScaling(rope_type=rope_type, max_position_embeddings=cfg.get("max_position_embeddings"),
                              **kwargs)


def uniform_window(cfg: HFConfig, layers: int, default: int | None = None, enabled: bool = True):
    """One sliding window on every layer (Mistral, Mixtral), when the config sets one."""
    window = cfg.get("sliding_window", default) if enabled else None
    return None if window is None else (window,) * layers


def no_window(cfg: HFConfig) -> None:
    """A family whose transformers model applies no sliding window: a config that sets one is refused."""
    if cfg.get("sliding_window") is not None:
        raise TSPConfigError(f"sliding_window={cfg.get('sliding_window')} on a {cfg.model_type} config: its "
                             "transformers model does not apply it; remove it")


def layer_type_windows(cfg: HFConfig, layers: int, window: int | None, layer_types=None):
    """Per-layer windows from layer_types ("sliding_attention" layers get `window`), None when every layer is full."""
    layer_types = cfg.get("layer_types") if layer_types is None else layer_types
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
