"""Shape of a causal LM, independent of how it is parallelised: a pre-norm decoder with RoPE attention and gated MLPs,
and the fields each family's mechanisms add (experts, hybrid layers, windows, position-scaled queries). The MoE
fields' rules live in ds_tsp.core.shape.moe; reading a transformers config into a shape is each family's adapter
(ds_tsp.core.shape.families)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.moe import check_moe_degree, check_moe_fields
from ds_tsp.core.shape.rope_scaling import ROPE_TYPES, RopeScaling  # noqa: F401 - ModelShape's field type


@dataclass(frozen=True)
class ModelShape:
    """The shape of a causal LM, independent of how it is parallelised: sizes, heads, RoPE, norms, and the MoE and
    hybrid fields. `ModelShape.from_hf_config(config)` reads a transformers config (refusing what TSP does not
    compute exactly); `check_tsp_degree(D)` says whether D ranks can share it."""

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
    # Hybrid models (Qwen3.5, Qwen3-Next): per-layer token mixer, "full_attention" or "linear_attention" (Gated
    # DeltaNet, ds_tsp.model.modules.gated_deltanet); None: every layer full attention. The linear_* fields shape
    # the Gated DeltaNet layers (all 0 when there are none).
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Gated attention (Qwen3.5 / Qwen3-Next full-attention layers): q_proj emits [q, gate] per head and the
    # attention output is multiplied by sigmoid(gate) before o_proj.
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(head_dim * factor) dims of every head
    # Qwen3.5 / Qwen3-Next RMSNorm (decoder norms, final norm, q/k norms): weights stored zero-centred, the norm
    # computes x_hat * (1 + w) in float32 and casts after (Llama: w * x_hat.to(dtype)).
    zero_centred_norms: bool = False
    hybrid_family: str | None = None  # "qwen3_5" | "qwen3_next": the checkpoint layout of a hybrid model's layers
    # Qwen3-Next / Qwen3.5-MoE: every sparse MoE block adds a shared expert (a dense SwiGLU of this width, sharded
    # 1/D like the MLP) scaled by sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True  # False (GLM-4.5): the shared expert's output is added unscaled, no gate
    # How a token picks its experts (ds_tsp.core.layers.moe.routing): "softmax_topk" (Qwen3-MoE, Mixtral: a float32
    # softmax over every expert, then the top-k), "topk_softmax" (GPT-OSS: the softmax over the top-k logits, in
    # their dtype) or "sigmoid_grouped" (GLM-4.5: sigmoid scores, the experts CHOSEN by scores + a per-expert
    # correction bias buffer within the moe_topk_groups best of moe_groups expert groups, weighted by the
    # uncorrected scores times routed_scaling_factor)
    moe_routing: str = "softmax_topk"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # GLM-4.5's multi-token-prediction layers, stored after the decoder layers (model.layers.{num_layers + i}.):
    # transformers' causal LM neither loads nor computes them (its assisted decoding builds them apart), so TSP
    # neither reads nor saves them
    mtp_layers: int = 0
    # Ministral 3 (transformers' llama_4_scaling_beta): each query, after RoPE, is scaled by
    # 1 + query_scale_beta * log(1 + floor(position / query_scale_period)) (1 below the first period); 0: off
    query_scale_beta: float = 0.0
    query_scale_period: int = 0
    # Phi-3's checkpoint layout: q, k, v rows fused in qkv_proj and gate, up rows in gate_up_proj (the math is
    # Llama's; only where each rank's slices lie in the checkpoint changes)
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # transformers' embedding is nn.Embedding(padding_idx=config.pad_token_id): that row never gets a gradient
    pad_token_id: int | None = None
    # Gemma 3: the gated MLP's activation ("silu": SwiGLU; "gelu_tanh": GeGLU with tanh-approximated GELU), the
    # embedding output scaled (by sqrt(hidden), rounded to the model's dtype as transformers does), a norm on each
    # sublayer's output too (sandwich norms: post_attention_layernorm, pre_/post_feedforward_layernorm), the
    # softmax scale (None: head_dim ** -0.5) and the RoPE of the sliding-window layers (theta 0: the full layers')
    mlp_activation: str = "silu"
    embedding_scale: float = 1.0
    sandwich_norms: bool = False
    attention_scale: float | None = None
    sliding_rope_theta: float = 0.0
    sliding_rope_scaling: RopeScaling | None = None
    # OLMo 2 / OLMo 3: q_norm / k_norm over a token's WHOLE q / k projection (weights [num_heads * head_dim] and
    # [num_kv_heads * head_dim]), not per head; and norms on each sublayer's output only (post_attention_layernorm,
    # post_feedforward_layernorm; no input norms): h = h + norm(attn(h)); h = h + norm(mlp(h))
    projection_qk_norm: bool = False
    post_norms: bool = False
    # GPT-OSS: a learned logit per query head in every attention softmax's denominator (attention sinks, sharded
    # with the head blocks) and a bias on o_proj too (added once per token after the output projection); its MoE
    # experts: biases on the router and on every expert's gate_up / down, the clamped SwiGLU (gate <= limit,
    # |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate)) with gate / up interleaved in gate_up, and routing
    # moe_routing "topk_softmax" (softmax over the top-k logits, in their dtype)
    attention_sinks: bool = False
    attention_out_bias: bool = False
    moe_biases: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Gemma 4: the full-attention layers' own head_dim (transformers' global_head_dim; None: head_dim, the sliding
    # layers'), every v head RMS-normalised without a weight (v_norm), each layer's output scaled by its
    # checkpoint's layer_scalar (a buffer), per-layer inputs (PLE: a [per_layer_input_vocab_size, num_layers *
    # per_layer_input_size] table sharded like the vocabulary, a projection of the embeddings, and per layer a
    # gate and projection of that layer's slice into the residual; 0: none), and the logits soft-capped as
    # cap * tanh(logits / cap) (Gemma 3 too; None: off)
    full_head_dim: int | None = None
    # Gemma 4's attention_k_eq_v: the full-attention layers' kv heads (num_global_key_value_heads; None:
    # num_kv_heads), and their values are the keys' raw projection (no v_proj: v = v_norm(k_proj(x)))
    full_num_kv_heads: int | None = None
    full_values_from_keys: bool = False
    value_norm: bool = False
    layer_scalars: bool = False
    per_layer_input_size: int = 0
    per_layer_input_vocab_size: int = 0
    final_logit_softcapping: float | None = None
    # Gemma 4's num_kv_shared_layers: the last kv_shared_layers layers attend over the K/V of the last earlier layer
    # of their type (no k/v projections of their own); double_wide_shared_mlp (use_double_wide_mlp): their MLPs are
    # 2 * intermediate_size wide
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False

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
        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers < 0:
            raise TSPConfigError(f"mtp_layers={self.mtp_layers!r}: a number of checkpoint layers (>= 0)")
        self._check_hybrid_fields()
        if self.pad_token_id is not None and (not isinstance(self.pad_token_id, int) or
                                              isinstance(self.pad_token_id, bool) or
                                              not 0 <= self.pad_token_id < self.vocab_size):
            raise TSPConfigError(f"pad_token_id={self.pad_token_id!r}: the embedding's padding row must be a token id "
                                 f"in [0, vocab_size={self.vocab_size}) (or None)")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise TSPConfigError(f"mlp_activation={self.mlp_activation!r}: TSP's gated MLP computes "
                                 f"{', '.join(MLP_ACTIVATIONS)}")
        if self.mlp_activation != "silu" and (self.num_experts or self.has_linear_attention):
            raise TSPConfigError(f"mlp_activation={self.mlp_activation!r} with experts or linear attention: those "
                                 "blocks are SwiGLU (silu) only")
        self._check_gpt_oss_fields()
        if self.sliding_rope_theta and self.attention_windows is None:
            raise TSPConfigError("sliding_rope_theta without sliding-window layers: it is the RoPE of those layers")
        self._check_olmo_fields()
        self._check_gemma4_fields()
        if self.fused_qkv and (self.qkv_bias or self.attn_output_gate):
            raise TSPConfigError("fused_qkv with q/k/v bias or gated attention: Phi-3's fused qkv_proj has neither")
        if self.query_scale_beta:
            if not self.query_scale_beta > 0 or not isinstance(self.query_scale_period, int) or \
                    isinstance(self.query_scale_period, bool) or self.query_scale_period < 1:
                raise TSPConfigError(f"query_scale_beta={self.query_scale_beta}, query_scale_period="
                                     f"{self.query_scale_period!r}: a position-scaled query needs beta > 0 and a "
                                     "period >= 1 (the rope's original_max_position_embeddings)")

    def _check_olmo_fields(self) -> None:
        if self.projection_qk_norm:
            others = {"qk_norm": self.qk_norm, "qkv_bias": self.qkv_bias, "attn_output_gate": self.attn_output_gate,
                      "fused_qkv": self.fused_qkv, "query_scale_beta": self.query_scale_beta,
                      "num_experts": self.num_experts, "layer_types": self.layer_types}
            clash = [name for name, value in others.items() if value]
            if clash:
                raise TSPConfigError(f"projection_qk_norm with {', '.join(clash)}: the whole-projection q/k norm "
                                     "(OLMo 2/3) is implemented for dense attention without q/k/v bias, gates, "
                                     "per-head norms, fused projections or scaled queries")
        if self.post_norms and (self.sandwich_norms or self.has_linear_attention):
            raise TSPConfigError("post_norms with sandwich_norms or linear attention: OLMo's post-norm layer has "
                                 "norms on the sublayer outputs only, and full attention")

    def _check_gpt_oss_fields(self) -> None:
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise TSPConfigError(f"expert_activation={self.expert_activation!r}: TSP's experts compute "
                                 f"{', '.join(EXPERT_ACTIVATIONS)}")
        gpt_oss = (self.moe_biases, self.expert_activation == "clamped_swiglu", self.moe_routing == "topk_softmax")
        if any(gpt_oss) and not (all(gpt_oss) and self.num_experts):
            raise TSPConfigError(f"moe_biases={self.moe_biases}, expert_activation={self.expert_activation!r}, "
                                 f"moe_routing={self.moe_routing!r}: these are GPT-OSS's experts (one checkpoint "
                                 "layout, gate/up interleaved) and come together, in a shape with experts")
        if any(gpt_oss) and (self.has_linear_attention or self.shared_expert_intermediate_size or self.qk_norm):
            raise TSPConfigError("GPT-OSS experts (moe_biases, clamped_swiglu) with linear attention, a shared "
                                 "expert or q/k norms: no transformers family has that combination")
        if self.expert_activation == "clamped_swiglu" and not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise TSPConfigError(f"swiglu_alpha={self.swiglu_alpha}, swiglu_limit={self.swiglu_limit}: the clamped "
                                 "SwiGLU needs both > 0")
        if (self.attention_sinks or self.attention_out_bias) and self.has_linear_attention:
            raise TSPConfigError("attention_sinks / attention_out_bias with linear attention: hybrid models have "
                                 "neither")

    def _check_hybrid_fields(self) -> None:
        if isinstance(self.layer_types, list):  # from a JSON manifest
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise TSPConfigError(f"layer_types has {len(self.layer_types)} entries for num_layers="
                                     f"{self.num_layers}: give one per layer")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise TSPConfigError(f"layer_types contains {unknown}: hybrid models take {', '.join(LAYER_TYPES)}")
            if self.attention_windows is not None:
                raise TSPConfigError("layer_types with sliding windows: hybrid models have no sliding attention")
        if self.has_linear_attention:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise TSPConfigError(f"{name}={value!r}: must be a positive integer when layer_types has "
                                         "linear_attention layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise TSPConfigError(
                    f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                    f"linear_num_key_heads={self.linear_num_key_heads}: every key head serves the same number of "
                    "value heads")
        if self.hybrid_family not in (None, "qwen3_5", "qwen3_next"):
            raise TSPConfigError(f"hybrid_family={self.hybrid_family!r}: must be None, 'qwen3_5' or 'qwen3_next'")
        if self.has_linear_attention and self.hybrid_family is None:
            raise TSPConfigError("layer_types has linear_attention layers but hybrid_family is None: set "
                                 "hybrid_family='qwen3_5' or 'qwen3_next' (the Gated DeltaNet checkpoint layout)")
        if not 0 < self.partial_rotary_factor <= 1:
            raise TSPConfigError(f"partial_rotary_factor={self.partial_rotary_factor}: must be in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise TSPConfigError(f"partial_rotary_factor={self.partial_rotary_factor} gives a rotary dim "
                                 f"{self.rotary_dim} of head_dim={self.dim_per_head}: it must be even and >= 2")

    def _check_gemma4_fields(self) -> None:
        if not isinstance(self.kv_shared_layers, int) or not 0 <= self.kv_shared_layers < self.num_layers:
            raise TSPConfigError(f"kv_shared_layers={self.kv_shared_layers!r}: between 0 and num_layers - 1 (some "
                                 "earlier layer must compute the K/V the shared ones read)")
        if self.kv_shared_layers:
            if self.qkv_bias or self.fused_qkv or self.has_linear_attention or self.projection_qk_norm or \
                    not self.sandwich_norms:
                raise TSPConfigError("kv_shared_layers with q/k/v bias, fused projections, linear attention, "
                                     "whole-projection q/k norms or without sandwich norms: Gemma 4's K/V-sharing "
                                     "layers are Gemma's")
            missing = [i for i in range(self.num_layers - self.kv_shared_layers, self.num_layers)
                       if self.kv_source(i) is None]
            if missing:
                raise TSPConfigError(f"kv_shared_layers={self.kv_shared_layers}: layer {missing[0]} has no earlier "
                                     "layer of its type (sliding or full) to read K/V from")
        if self.full_head_dim is not None and (not isinstance(self.full_head_dim, int) or self.full_head_dim < 2 or
                                               self.full_head_dim % 2):
            raise TSPConfigError(f"full_head_dim={self.full_head_dim!r}: an even head size (or None)")
        if self.full_head_dim is not None and (self.has_linear_attention or self.attn_output_gate):
            raise TSPConfigError("full_head_dim with linear attention or gated attention: only Gemma 4's sliding and "
                                 "full softmax-attention layers have head sizes of their own")
        if self.full_num_kv_heads is not None and (not isinstance(self.full_num_kv_heads, int) or
                                                   self.full_num_kv_heads < 1 or
                                                   self.num_heads % self.full_num_kv_heads):
            raise TSPConfigError(f"full_num_kv_heads={self.full_num_kv_heads!r}: a positive divisor of num_heads="
                                 f"{self.num_heads} (or None)")
        if self.full_values_from_keys and (self.fused_qkv or self.has_linear_attention or self.projection_qk_norm):
            raise TSPConfigError("full_values_from_keys with fused projections, linear attention or whole-projection "
                                 "q/k norms: Gemma 4's key-equals-value layers have none of them")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise TSPConfigError(f"final_logit_softcapping={self.final_logit_softcapping}: a positive cap (or None)")
        for name in ("per_layer_input_size", "per_layer_input_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TSPConfigError(f"{name}={value!r}: a size >= 0")
        if bool(self.per_layer_input_size) != bool(self.per_layer_input_vocab_size):
            raise TSPConfigError(f"per_layer_input_size={self.per_layer_input_size} with per_layer_input_vocab_size="
                                 f"{self.per_layer_input_vocab_size}: per-layer inputs need both (or neither)")
        if self.per_layer_input_size and (self.num_experts or self.has_linear_attention or
                                          self.mlp_activation != "gelu_tanh"):
            raise TSPConfigError("per_layer_input_size with experts, linear attention or a silu MLP: per-layer "
                                 "inputs are Gemma 4's (gelu_pytorch_tanh gate, dense layers)")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of every head RoPE rotates (the first ones; transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def full_rotary_dim(self) -> int:
        """Dims RoPE rotates in the full-attention layers (their own head_dim where the shape gives one)."""
        return int((self.full_head_dim or self.dim_per_head) * self.partial_rotary_factor)

    def layer_head_dim(self, layer: int) -> int:
        """head_dim of decoder layer `layer`: full_head_dim on the full-attention layers of a shape that has one."""
        return self.full_head_dim if self.full_head_dim and self.layer_window(layer) is None else self.dim_per_head

    def kv_source(self, layer: int) -> int | None:
        """The earlier layer whose K/V decoder layer `layer` attends over (Gemma 4's KV sharing: the last layer of its
        type before the shared ones), or None when it projects its own."""
        first_shared = self.num_layers - self.kv_shared_layers
        if not self.kv_shared_layers or layer < first_shared:
            return None
        sliding = self.layer_window(layer) is not None
        return next((j for j in range(first_shared - 1, -1, -1) if (self.layer_window(j) is not None) == sliding),
                    None)

    def exports_kv(self, layer: int) -> bool:
        """Whether a later layer reads decoder layer `layer`'s K/V (kv_source)."""
        return any(self.kv_source(i) == layer for i in range(self.num_layers - self.kv_shared_layers, self.num_layers))

    def layer_intermediate_size(self, layer: int) -> int:
        """MLP width of decoder layer `layer`: doubled on Gemma 4's KV-sharing layers under double_wide_shared_mlp."""
        wide = self.double_wide_shared_mlp and self.kv_source(layer) is not None
        return 2 * self.intermediate_size if wide else self.intermediate_size

    def layer_kv_heads(self, layer: int) -> int:
        """kv heads of decoder layer `layer`: full_num_kv_heads on the full-attention layers of a shape that has
        them."""
        return self.full_num_kv_heads if self.full_num_kv_heads and self.layer_window(layer) is None else \
            self.num_kv_heads

    def layer_values_from_keys(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s values are its keys' raw projection (Gemma 4's full layers, k_eq_v)."""
        return self.full_values_from_keys and self.layer_window(layer) is None

    def layer_type(self, layer: int) -> str:
        """The token mixer of decoder layer `layer`: "full_attention" or "linear_attention" (Gated DeltaNet)."""
        return "full_attention" if self.layer_types is None else self.layer_types[layer]

    @property
    def has_linear_attention(self) -> bool:
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the sparse experts MLP (else the dense SwiGLU of intermediate_size)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def moe_family(self) -> str | None:
        """The transformers family whose checkpoint names an MoE model uses: GLM-4.5 routes by grouped sigmoid
        scores, GPT-OSS's experts are clamped SwiGLUs with biases, Qwen3-MoE has q/k norms, Mixtral not."""
        if self.num_experts == 0:
            return None
        if self.moe_routing == "sigmoid_grouped":
            return "glm4_moe"
        if self.expert_activation == "clamped_swiglu":  # GPT-OSS: fused 3D experts with biases
            return "gpt_oss"
        return "qwen3_moe" if self.qk_norm else "mixtral"

    def layer_rope(self, layer: int) -> str:
        """Which RoPE decoder layer `layer` rotates with: "sliding" (its own theta, Gemma 3) or "full"."""
        own = self.sliding_rope_theta or self.full_head_dim  # their theta, or their head_dim, differs
        return "sliding" if own and self.layer_window(layer) is not None else "full"

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
        for layer in range(self.num_layers) if self.full_num_kv_heads else ():
            kv = self.layer_kv_heads(layer)
            if kv % tsp and tsp % kv:
                raise TSPConfigError(
                    f"full_num_kv_heads={kv} and tsp={tsp} do not divide each other: every rank owns "
                    "full_num_kv_heads/tsp kv heads of a full-attention layer, or one replicated on "
                    f"tsp/full_num_kv_heads ranks; pick tsp among "
                    f"{sorted(set(_divisors(kv)) | set(_multiples(kv, self.num_heads)))}")
        if self.num_kv_heads % tsp and tsp % self.num_kv_heads:
            raise TSPConfigError(
                f"num_kv_heads={self.num_kv_heads} and tsp={tsp} do not divide each other: every rank owns "
                "num_kv_heads/tsp kv heads, or (when num_kv_heads < tsp) one kv head replicated on tsp/num_kv_heads "
                "ranks; pick tsp among "
                f"{sorted(set(_divisors(self.num_kv_heads)) | set(_multiples(self.num_kv_heads, self.num_heads)))}")
        check_moe_degree(self, tsp)
        if self.per_layer_input_size % tsp:
            raise TSPConfigError(
                f"per_layer_input_size={self.per_layer_input_size} is not divisible by tsp={tsp}: every rank owns "
                "per_layer_input_size/tsp columns of each layer's per-layer input gate; pick tsp among "
                f"{_divisors(self.per_layer_input_size)}")
        if self.has_linear_attention:
            for name in ("linear_num_key_heads", "linear_num_value_heads"):
                heads = getattr(self, name)
                if heads % tsp:
                    fits = sorted(set(_divisors(self.linear_num_key_heads)) & set(_divisors(self.num_heads)))
                    raise TSPConfigError(
                        f"{name}={heads} is not divisible by tsp={tsp}: every rank owns {name}/tsp Gated DeltaNet "
                        f"heads (key and value heads both split over the TSP ranks); pick tsp among {fits}")
        shared = self.shared_expert_intermediate_size
        if self.num_experts and shared % tsp:
            raise TSPConfigError(
                f"shared_expert_intermediate_size={shared} is not divisible by tsp={tsp}: every rank owns "
                f"shared_expert_intermediate_size/tsp shared-expert columns; pick tsp among {_divisors(shared)}")
        has_dense_mlp = not all(self.is_moe_layer(i) for i in range(self.num_layers))
        if has_dense_mlp and self.intermediate_size % tsp:
            raise TSPConfigError(
                f"intermediate_size={self.intermediate_size} is not divisible by tsp={tsp}: every rank owns "
                f"intermediate_size/tsp MLP columns; pick tsp among {_divisors(self.intermediate_size)}")

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        """From a transformers config (object or config.json dict) of a family TSP converts
        (ds_tsp.core.shape.families: one adapter per family; a multimodal config is read through its text_config).

        Strict: every config field that would change the computation and that TSP does not implement is one
        TSPConfigError naming the field (never silently ignored). No transformers import.
        """
        from ds_tsp.core.shape.families import shape_fields

        return cls(**shape_fields(config))

    def kv_replicas(self, tsp: int) -> int:
        """How many TSP ranks share one kv head (1 unless num_kv_heads < tsp, e.g. MQA)."""
        return max(tsp // self.num_kv_heads, 1)

    def to_dict(self) -> dict:
        return asdict(self)


LAYER_TYPES = ("full_attention", "linear_attention")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


def _multiples(n: int, limit: int) -> list[int]:
    return [m for m in range(n, limit + 1, n) if limit % m == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
