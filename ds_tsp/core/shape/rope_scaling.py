"""The RoPE scaling block of an HF config (rope_parameters / rope_scaling): which rope types TSP computes, and the
keys each one reads. The frequencies themselves are ds_tsp.core.tokens.rope's."""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.core.errors import TSPConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


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
    max_position_embeddings: int | None = None  # yarn and longrope infer factor from it when factor is None
    # longrope (Phi-3 / Phi-3.5 128k): per-frequency divisors, the long ones when the batch's longest position
    # passes original_max_position_embeddings, the short ones otherwise
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # proportional (Gemma 4's full layers): the first int(partial_rotary_factor * head_dim // 2) frequencies of the
    # whole head's rotation, the others 0 (those dims pass through), all divided by factor (default 1)
    partial_rotary_factor: float | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise TSPConfigError(f"rope_parameters.rope_type={self.rope_type!r} is not supported; ds_tsp implements "
                                 f"{', '.join(ROPE_TYPES)} (as transformers computes them)")
        need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"),
                "yarn": ("original_max_position_embeddings",),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(self.rope_type, ())
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise TSPConfigError(f"rope_parameters (rope_type={self.rope_type!r}) lacks {', '.join(missing)}: "
                                 "the checkpoint's config.json must give them")
        if self.rope_type in ("yarn", "longrope") and self.factor is None and self.max_position_embeddings is None:
            raise TSPConfigError(f"rope_parameters (rope_type={self.rope_type!r}) has no factor and the config no "
                                 "max_position_embeddings to infer it from")
        if self.rope_type == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise TSPConfigError(f"rope_parameters: short_factor has {len(self.short_factor)} entries and long_factor "
                                 f"{len(self.long_factor)}: both give one divisor per rotary frequency")

    @property
    def switches_with_length(self) -> bool:
        """Whether the frequencies depend on the batch's longest position (longrope's short / long factors)."""
        return self.rope_type == "longrope"
