"""Pieces every layout shares: the synthetic batch, optional-dependency imports, the HF Llama peers' model."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from ds_tsp.core.config import TSPOptions
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shift_labels
from ds_tsp.tools.bench.config import INSTALL_HINT, BenchConfig


def require(package: str):
    """Import an optional dependency or fail with the install command."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(f"this layout needs {package}: {INSTALL_HINT.get(package, 'pip install ' + package)}") \
            from exc


def tsp_options(mode: str, activation_checkpointing: bool, moe_dispatch: str = "auto") -> TSPOptions:
    """A TSP layout's options from its LayoutSpec mode: "memory" (TSPOptions()), "projections"
    (recompute_projections off) or "speed" (TSPOptions.speed())."""
    extra = {"activation_checkpointing": activation_checkpointing, "moe_dispatch": moe_dispatch}
    if mode == "memory":
        return TSPOptions(**extra)
    if mode == "projections":
        return TSPOptions(recompute_projections=False, **extra)
    if mode == "speed":
        return TSPOptions.speed(**extra)
    raise ValueError(f"TSP layout mode {mode!r}: one of 'memory', 'projections', 'speed'")


def rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_batch(cfg: BenchConfig, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, shift_labels, position_ids), each [B, S]; identical on every rank (seeded), every token
    labelled except the last of each sample (causal LM)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(0, cfg.shape.vocab_size, (cfg.batch, seq), generator=gen)
    positions = torch.arange(seq).expand(cfg.batch, seq).contiguous()
    return ids, shift_labels(ids), positions


def hf_config(shape: ModelShape, max_seq: int):
    """transformers config of the same model (Llama; Qwen2 when the shape has q/k/v bias; a hybrid or
    mixture-of-experts shape's own family: Qwen3.5 / Qwen3-Next, Qwen3-MoE / Mixtral), SDPA attention."""
    transformers = require("transformers")
    if shape.layer_types is not None or shape.num_experts:  # transformers' own family of the shape, same fields
        from ds_tsp.core.shape.hf_config import config_dict_from_shape, config_from_dict

        values = {**config_dict_from_shape(shape, torch.float32), "use_cache": False}
        values["max_position_embeddings"] = max(max_seq, 2048)
        config = config_from_dict(values)
        config._attn_implementation = "sdpa"
        return config
    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                  intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                  head_dim=shape.dim_per_head, rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps,
                  tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=max(max_seq, 2048),
                  attn_implementation="sdpa", use_cache=False)
    if shape.qkv_bias:
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def build_hf_model(cfg: BenchConfig):
    """The peers' model: HF LlamaForCausalLM (a hybrid shape: its transformers family; fp32, SDPA), identical
    weights on every rank (seeded init)."""
    transformers = require("transformers")
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.shape, max(cfg.seqs)))
    model.train()
    if cfg.checkpointing():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over labelled tokens (fp32), as HF's loss computes it before dividing."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                             reduction="sum")


def valid_tokens(labels: torch.Tensor) -> int:
    return int((labels != -100).sum())


def options_record(options) -> dict:
    """A run's TSPOptions as its results record them; "kernel_backend" (the deprecated name of "kernel", None for
    "auto") stays beside it so results files read by older tooling keep their key."""
    record = options.model_dump()
    record["kernel_backend"] = None if options.kernel == "auto" else options.kernel
    return record
