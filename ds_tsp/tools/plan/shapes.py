"""Model shapes for the planner: from a Hugging Face config.json, and with single fields overridden (CLI flags)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.plan.inputs import PlanInputError

# override name -> ModelShape field; the CLI names the flag --hidden, --heads, ... after the key
SHAPE_FIELDS = {"hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
                "ffn": "intermediate_size", "layers": "num_layers", "vocab": "vocab_size"}


def shape_from_hf_config(path_or_dict: str | Path | dict) -> ModelShape:
    """ModelShape from a Hugging Face config.json (path, its directory, or the parsed dict); no transformers import.

    Reads hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default:
    num_attention_heads), head_dim (default hidden/heads), vocab_size, tie_word_embeddings (default False),
    attention_bias (or model_type qwen2: bias on q/k/v), rope_theta, rms_norm_eps. A multimodal config's
    text_config is used when the top level has no hidden_size. A family TSP converts (ds_tsp.core.shape.families)
    is read by ModelShape.from_hf_config, its own strict reader (experts, hybrid layers, windows, ...); another
    model_type is planned as the Llama-shaped decoder those fields describe, unless it names experts.
    """
    if isinstance(path_or_dict, dict):
        cfg, where = path_or_dict, "config"
    else:
        path = Path(path_or_dict)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanInputError("hf_config", f"{path}: no such file; pass a config.json or its directory") from None
        except json.JSONDecodeError as exc:
            raise PlanInputError("hf_config", f"{path}: not valid JSON ({exc})") from None
        where = str(path)
    from ds_tsp.core.shape.families import MODEL_TYPES
    from ds_tsp.tools.plan.moe_shapes import refuse_foreign_moe

    if cfg.get("model_type") in MODEL_TYPES:  # a family TSP converts: its own strict reader (every field it reads)
        try:
            return ModelShape.from_hf_config(cfg)
        except TSPConfigError as exc:
            raise PlanInputError("hf_config", f"{where}: {exc}") from None
    refuse_foreign_moe(cfg, where)
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                     cfg["text_config"].get("tie_word_embeddings"))}
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if not isinstance(cfg.get(k), int)]
    if missing:
        raise PlanInputError("hf_config", f"{where}: missing or non-integer {missing}; a Llama/Mistral/Qwen2-style "
                                          "config.json has all of " + ", ".join(required))
    heads = cfg["num_attention_heads"]
    try:
        return ModelShape(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or None,
            rope_theta=float(cfg.get("rope_theta") or 10000.0), rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings") or False),
            qkv_bias=bool(cfg.get("attention_bias") or cfg.get("model_type") == "qwen2"))
    except TSPConfigError as exc:
        raise PlanInputError("hf_config", f"{where}: {exc}") from None


def shape_with(base: ModelShape | None, overrides: dict[str, int | None]) -> ModelShape:
    """`base` with the given fields replaced (keys of SHAPE_FIELDS; None = keep). Without a base every field must
    be given. Errors are PlanInputError whose `field` is the override key to blame."""
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(SHAPE_FIELDS))
    if unknown:
        raise PlanInputError(unknown[0], f"unknown shape field {unknown[0]!r}; choose among {sorted(SHAPE_FIELDS)}")
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanInputError(key, f"{key}={value!r}: must be an integer >= 1")
    if base is None:
        missing = [k for k in SHAPE_FIELDS if k not in given and k != "kv_heads"]  # kv heads default to heads
        if missing:
            raise PlanInputError(missing[0], f"incomplete shape: {', '.join(missing)} not given (and no model to "
                                             "take them from)")
        fields = {SHAPE_FIELDS[k]: v for k, v in given.items()}
        fields.setdefault("num_kv_heads", fields["num_heads"])
        return _checked(lambda: ModelShape(**fields), given)
    fields = {SHAPE_FIELDS[k]: v for k, v in given.items()}
    if "heads" in given and "kv_heads" not in given and base.num_heads == base.num_kv_heads:
        fields["num_kv_heads"] = given["heads"]  # an MHA model stays MHA when only --heads changes
    if ("hidden" in given or "heads" in given) and base.head_dim is not None:
        fields["head_dim"] = None  # a derived head_dim follows the new hidden / heads
    if "layers" in given and base.layer_types is not None and given["layers"] <= base.num_layers:
        fields["layer_types"] = base.layer_types[:given["layers"]]  # a hybrid model's first N layers
    if "layers" in given and base.dense_mlp_layers:  # an MoE model's dense layers among the first N
        fields["dense_mlp_layers"] = tuple(i for i in base.dense_mlp_layers if i < given["layers"])
    return _checked(lambda: replace(base, **fields), given)


def _checked(build, given: dict[str, int]) -> ModelShape:
    """Build the shape; a ModelShape error becomes a PlanInputError naming the override that caused it."""
    try:
        return build()
    except TSPConfigError as exc:
        text = str(exc)
        blame = [key for key, name in SHAPE_FIELDS.items() if key in given and text.startswith(name)]
        if text.startswith("head_dim"):  # derived from hidden / heads
            blame += [key for key in ("hidden", "heads") if key in given]
        blame += [key for key, name in SHAPE_FIELDS.items() if key in given and name in text]
        raise PlanInputError(blame[0] if blame else "model", text) from None
