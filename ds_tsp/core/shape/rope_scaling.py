"""The RoPE scaling block of an HF config (rope_parameters / rope_scaling): which rope types TSP computes, and the
keys each one reads. The frequencies themselves are ds_tsp.core.tokens.rope's."""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.core.errors import TSPConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class RopeScaling:
    """A rope_parameters / rope_scaling block of an HF config (only the keys its rope type reads)."""

    rope_type: str = "default"
    factor: float | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    max_position_embeddings: int | None = None  # yarn infers factor from it when factor is None
    # proportional (Gemma 4's full layers): the first int(partial_rotary_factor * head_dim // 2) frequencies of the
    # whole head's rotation, the others 0 (those dims pass through), all divided by factor (default 1)
    partial_rotary_factor: float | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise TSPConfigError(f"rope_parameters.rope_type={self.rope_type!r} is not supported; ds_tsp implements "
                                 f"{', '.join(ROPE_TYPES)} (as transformers computes them)")
        need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"),
                "yarn": ("original_max_position_embeddings",)}.get(self.rope_type, ())
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise TSPConfigError(f"rope_parameters (rope_type={self.rope_type!r}) lacks {', '.join(missing)}: "
                                 "the checkpoint's config.json must give them")
        if self.rope_type == "yarn" and self.factor is None and self.max_position_embeddings is None:
            raise TSPConfigError("rope_parameters (rope_type='yarn') has no factor and the config no "
                                 "max_position_embeddings to infer it from")
