"""What the planner is asked: the model, the sequence, the layout's degrees and options (validated, frozen)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ds_tsp.core.config import MOE_DISPATCHES
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAM_STATE_BYTES = 8  # AdamW exp_avg + exp_avg_sq in fp32
MASTER_BYTES = 4  # fp32 master weights under bf16/fp16 mixed precision

# Llama-family shapes. "zyphra-7b" is the 7B dense of Zyphra's TSP blog (h 4096, 32 layers, MHA, SwiGLU); the blog
# gives neither the MLP width nor the vocabulary, so Llama-2-7B's (11008, 32000) are assumed.
PRESETS: dict[str, ModelShape] = {
    "7b": ModelShape(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                     num_kv_heads=32, rms_norm_eps=1e-5),
    "8b": ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5),
    "70b": ModelShape(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                      num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5),
    "zyphra-7b": ModelShape(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                            num_heads=32, num_kv_heads=32, rms_norm_eps=1e-5),
}


class PlanInputError(TSPConfigError):
    """Bad planner input; `field` names the PlanInput field (the CLI maps it to its flag)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class PlanInput:
    """What the planner needs. `seq` is the global sequence length per sample, `batch` the micro-batch size.

    degree: D of the one parallel axis (TSP degree, TP degree, Ulysses / context-parallel degree).
    dp, pp: data-parallel and pipeline degrees (world size = degree * dp * pp).
    zero_stage: ZeRO stage over the dp axis for tsp / tp / tp_sp / ulysses_replicated (0, 1 or 2).
    keep_gathered_kv: TSP keeps each block's gathered K/V for backward (ds_tsp.model.causal_lm.TSPOptions).
    recompute_projections: False = TSP saves local q (k/v) per block and the MLP gate/up (TSPOptions.speed()).
    lm_head_chunk_tokens: TSP's LM head + loss works on at most this many local tokens at a time
        (TSPOptions.lm_head_chunk_tokens), bounding its logits transient to chunk x V/D.
    zero_bucket_elements: DeepSpeed's reduce_bucket_size (its default 5e8; ds-tsp bench uses 5e6), a buffer
        ZeRO-2/3 keeps for the whole run.
    moe_dispatch: TSP's mixture-of-experts schedule (TSPOptions.moe_dispatch): "auto", "ring" or "all_to_all".
    moe_load: the busiest expert's routed rows over its even-routing share (>= 1; 1 = even routing): its GEMM
        block, and its owner's rows (the ring's rows per step, the rows all_to_all delivers), are planned with it,
        capped at what one expert / owner can receive (ds_tsp.tools.plan.moe_terms).
    offload_activations: TSP keeps each checkpointed layer input in host memory (TSPOptions.offload_activations;
        needs activation_checkpointing; ds_tsp.tools.plan.offload).
    """

    model: ModelShape
    seq: int
    batch: int = 1
    degree: int = 1
    dp: int = 1
    pp: int = 1
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    keep_gathered_kv: bool = False
    recompute_projections: bool = True
    zero_stage: int = 0
    lm_head_chunk_tokens: int = 4096
    zero_bucket_elements: int = 500_000_000
    moe_dispatch: str = "auto"
    moe_load: float = 1.0
    offload_activations: bool = False

    def __post_init__(self):
        for name in ("seq", "batch", "degree", "dp", "pp", "lm_head_chunk_tokens", "zero_bucket_elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanInputError(name, f"{name}={value!r}: must be an integer >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise PlanInputError("dtype", f"dtype={self.dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
        if self.zero_stage not in (0, 1, 2):
            raise PlanInputError("zero_stage", f"zero_stage={self.zero_stage!r}: choose 0, 1 or 2 (ZeRO-3 is the "
                                               "ulysses / fsdp_cp layouts)")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise PlanInputError("moe_dispatch", f"moe_dispatch={self.moe_dispatch!r}: choose one of "
                                                 f"{', '.join(MOE_DISPATCHES)}")
        if isinstance(self.moe_load, bool) or not isinstance(self.moe_load, (int, float)) or \
                not 1 <= self.moe_load < float("inf"):
            raise PlanInputError("moe_load", f"moe_load={self.moe_load!r}: must be a finite number >= 1 (1 = even "
                                             "routing; 2 plans the busiest expert at twice its share of the rows)")
        if self.offload_activations and not self.activation_checkpointing:
            raise PlanInputError("offload_activations", "offload_activations needs activation_checkpointing: what "
                                                        "goes to host memory is each checkpointed layer's input")
        if self.offload_activations and self.pp > 1:
            raise PlanInputError("offload_activations", f"offload_activations with pp={self.pp}: pipeline stages are "
                                                        "not offloaded (tsp.pipeline_stages must be 1)")
        m = self.model
        if m.kv_shared_layers and self.activation_checkpointing:  # as ds_tsp.model.causal_lm refuses it
            raise PlanInputError("activation_checkpointing", f"kv_shared_layers={m.kv_shared_layers} with "
                                 "activation_checkpointing: the K/V a layer exports to the KV-sharing layers would "
                                 "leave its checkpointed region; turn activation checkpointing off for Gemma 4 E2B / "
                                 "E4B")
        gemma4 = (m.full_head_dim or m.full_num_kv_heads or m.full_values_from_keys or m.per_layer_input_size or
                  m.kv_shared_layers)
        if gemma4 and (self.pp > 1 or m.num_experts or m.layer_types is not None):
            raise PlanInputError("model", "full_head_dim / full_num_kv_heads / full_values_from_keys / "
                                          "per_layer_input_size / kv_shared_layers (Gemma 4's full layers' own "
                                          "attention shape, its per-layer inputs, KV sharing) with pp > 1, experts "
                                          "or hybrid layers: the planner counts them for one TSP stage of dense "
                                          "layers only; measure with ds-tsp bench instead")
        if self.pp > self.model.num_layers:
            raise PlanInputError("pp", f"pp={self.pp} exceeds num_layers={self.model.num_layers}: every pipeline "
                                       f"stage needs at least one layer; pick pp <= {self.model.num_layers}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def world_size(self) -> int:
        return self.degree * self.dp * self.pp

    def to_dict(self) -> dict:
        out = asdict(self)
        out["model"] = self.model.to_dict()
        return out
