"""The TSP model's nn.Modules: one per sharded piece, each knowing which slices of the HF tensors it owns.

Every sharded module answers three questions for checkpoints, so loading reads ONLY this rank's slices and saving
reassembles one module at a time:

    hf_shapes()       {HF tensor name (relative): full shape}            what the checkpoint must contain
    hf_slices()       {name: (dim, start, length)}                       the part of each tensor this rank owns
    hf_targets(p)     {name: view of parameter p}                        where each slice lands (read in place)
    pack_slices(d)    {name: sliced tensor} -> this rank's packed shard  (shard_full = pack_slices of narrowed)
    unshard(shards)   every rank's packed shard -> {name: full tensor}
(A tensor a rank owns several ranges of gives HFRanges, a tuple of (dim, start, length), in hf_slices and a tuple
of views in hf_targets: ds_tsp.model.modules.slices.)

| module (HF prefix)                | parameter        | this rank's part                                      |
|-----------------------------------|------------------|-------------------------------------------------------|
| model.embed_tokens / lm_head      | vocab_shard      | vocab rows [p*Vd, (p+1)*Vd), zero past V              |
| model.layers.i.self_attn          | packed_shard     | q heads of block p, its kv heads, o_proj columns      |
| model.layers.i.self_attn.q/k_norm | weight           | replicated [head_dim] (Qwen3), grads summed           |
| model.layers.i.mlp                | packed_shard     | gate/up rows and down columns [p*F/D, (p+1)*F/D)      |
| model.layers.i.linear_attn        | (its own)        | Gated DeltaNet heads of block p (hybrid models)       |
| model.layers.i.mlp (MoE layer)    | experts_shard    | experts [p*E/D, (p+1)*E/D) whole; router replicated   |
(the MoE block: ds_tsp.model.modules.moe.TSPSparseMoE; its HF names carry their block prefix, Mixtral's
block_sparse_moe., so its entry in sharded_modules has the layer prefix.)
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.norm import TSPRMSNorm
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.positions import RopeTables

# The pre-release path ds_tsp.modules is this module (ds_tsp/_moved.py): the other names it exported stay reachable.
from ds_tsp.model.modules.attention import (
    HeadNorm,  # noqa: E402,F401,I001
    TSPAttention,
)
from ds_tsp.model.modules.gated_deltanet import TSPGatedDeltaNet
from ds_tsp.model.modules.mlp import TSPGatedMLP
from ds_tsp.model.modules.moe import TSPSparseMoE, shared_expert_shape
from ds_tsp.model.modules.per_layer_input import TSPPerLayerGate
from ds_tsp.model.modules.piece import ShardedPiece
from ds_tsp.model.modules.vocab import TSPLMHeadLoss, TSPVocabEmbedding, TSPVocabShard  # noqa: E402,F401
from ds_tsp.model.state_dict import load_slices, read_from_full  # noqa: E402,F401


class TSPDecoderLayer(nn.Module):
    """Pre-norm decoder layer. Token mixer: `self_attn` (TSPAttention), or `linear_attn` (Gated DeltaNet) where the
    shape's layer_types says linear_attention (Qwen3.5 / Qwen3-Next). With the shape's sandwich_norms (Gemma 3) each
    sublayer's output is normed too, under transformers' names:
        h = h + post_attention_layernorm(attn(input_layernorm(h)))
        h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    (without them post_attention_layernorm is the MLP's input norm, Llama's name for it). With post_norms (OLMo 2/3)
    only the outputs are normed, and there is no input_layernorm:
        h = h + post_attention_layernorm(attn(h))
        h = h + post_feedforward_layernorm(mlp(h))
    Gemma 4 then adds the layer's per-layer input (per_layer_input_size) and scales the whole output by the
    checkpoint's layer_scalar:
        h = h + post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(h)) * per_layer_input))
        h = h * layer_scalar"""

    def __init__(self, shape: ModelShape, comm: TSPComm, options, dtype, device, layer: int = 0):
        super().__init__()
        centred = shape.zero_centred_norms
        self.post_norms = shape.post_norms
        if not self.post_norms:
            self.input_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device, centred)
        self.is_linear_attention = shape.layer_type(layer) == "linear_attention"
        if self.is_linear_attention:
            self.linear_attn = TSPGatedDeltaNet(shape, comm, options, dtype, device, layer=layer,
                                                hf_format=shape.hybrid_family)
        else:
            self.self_attn = TSPAttention(shape, comm, options, dtype, device, layer)
        self.post_attention_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device,
                                                   centred)
        self.sandwich = shape.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device,
                                                        centred)
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device,
                                                         centred)
        self.is_moe = shape.is_moe_layer(layer)
        if self.is_moe:
            shared = (TSPGatedMLP(shared_expert_shape(shape), comm, dtype, device, options.recompute_projections)
                      if shape.shared_expert_intermediate_size else None)  # Qwen3-Next, Qwen3.5-MoE, GLM-4.5
            self.mlp = TSPSparseMoE(shape, comm, options, dtype, device, shared_expert=shared)
        else:
            wide = shape.layer_intermediate_size(layer)  # Gemma 4's double-wide MLPs on the KV-sharing layers
            self.mlp = TSPGatedMLP(shape if wide == shape.intermediate_size else replace(shape, intermediate_size=wide),
                                   comm, dtype, device, options.recompute_projections)
        self.index, self.kv_source = layer, shape.kv_source(layer)
        self.per_layer_gate = None
        if shape.per_layer_input_size:
            self.per_layer_gate = TSPPerLayerGate(shape, comm, dtype, device)
            self.post_per_layer_input_norm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device,
                                                        centred)
        # a checkpoint value that never trains (transformers: a persistent buffer), the same on every rank
        self.layer_scalar = (nn.Buffer(torch.ones(1, dtype=dtype, device=device)) if shape.layer_scalars else None)

    def forward(self, h, rope: RopeTables, doc_starts=None, *, with_router: bool = False, per_layer_input=None,
                shared_kv: dict | None = None):
        """The layer's output; with_router: (output, router logits [B*L, E] or None for a dense MLP). rope: the
        step's RoPE tables (ds_tsp.core.tokens.positions.StepRopes). Callers go
        through the module (`layer(..., with_router=True)`), never a bound method: FSDP2 and ZeRO-3 gather the
        layer's parameters in its forward hooks. shared_kv (Gemma 4's KV sharing): layer index -> the K/V that layer
        exported; a layer that exports adds its own, a KV-sharing layer reads its source's."""
        if self.is_linear_attention:
            h = h + self.linear_attn(self.input_layernorm(h), doc_starts)
        elif self.post_norms:
            h = h + self.post_attention_layernorm(self.self_attn(h, rope, doc_starts))
        elif self.sandwich:
            h = h + self.post_attention_layernorm(self._attention(self.input_layernorm(h), rope, doc_starts,
                                                                  shared_kv))
        else:
            h = h + self.self_attn(self.input_layernorm(h), rope, doc_starts)
        router_logits = None
        mlp_in = (h if self.post_norms else self.pre_feedforward_layernorm(h) if self.sandwich
                  else self.post_attention_layernorm(h))
        if self.is_moe:
            y, router_logits = self.mlp(mlp_in)
        else:
            y = self.mlp(mlp_in)
        if self.sandwich or self.post_norms:
            y = self.post_feedforward_layernorm(y)
        h = h + y
        if self.per_layer_gate is not None:
            h = h + self.post_per_layer_input_norm(self.per_layer_gate(h, per_layer_input))
        if self.layer_scalar is not None:
            h = h * self.layer_scalar
        return (h, router_logits) if with_router else h

    def _attention(self, x, rope, doc_starts, shared_kv):
        role = self.self_attn.spec.kv_role
        if role == "own":
            return self.self_attn(x, rope, doc_starts)
        if shared_kv is None:
            raise TSPConfigError("a Gemma 4 KV-sharing model's layers run in order with one shared_kv dict")
        if role == "import":
            return self.self_attn(x, rope, doc_starts, kv_in=shared_kv[self.kv_source])
        y, shared_kv[self.index] = self.self_attn(x, rope, doc_starts)
        return y

    def sharded_modules(self, prefix: str = "") -> list[tuple[str, "ShardedPiece", nn.Parameter]]:
        """(HF name prefix, sharded piece, its parameter) of this layer, in checkpoint order."""
        mlp = ((prefix, self.mlp, self.mlp.experts_shard) if self.is_moe
               else (f"{prefix}mlp.", self.mlp, self.mlp.packed_shard))
        mlps = [mlp]
        if self.is_moe and self.mlp.shared_expert is not None:  # Qwen3-Next, Qwen3.5-MoE, GLM-4.5
            mlps.append((prefix + self.mlp.names.shared_expert(), self.mlp.shared_expert,
                         self.mlp.shared_expert.packed_shard))
        if self.per_layer_gate is not None:  # Gemma 4: per_layer_input_gate and per_layer_projection
            mlps.append((prefix, self.per_layer_gate, self.per_layer_gate.packed_shard))
        if self.is_linear_attention:  # the Gated DeltaNet lists its own sharded pieces
            return [*self.linear_attn.sharded_modules(f"{prefix}linear_attn."), *mlps]
        return [(f"{prefix}self_attn.", self.self_attn, self.self_attn.packed_shard), *mlps]

    def replicated_params(self, prefix: str = "") -> dict[str, nn.Parameter]:
        """HF-named params every rank holds whole (their grads are summed over the TSP group)."""
        out = {} if self.post_norms else {f"{prefix}input_layernorm.weight": self.input_layernorm.weight}
        out[f"{prefix}post_attention_layernorm.weight"] = self.post_attention_layernorm.weight
        if self.per_layer_gate is not None:
            out[f"{prefix}post_per_layer_input_norm.weight"] = self.post_per_layer_input_norm.weight
        if self.sandwich:
            out[f"{prefix}pre_feedforward_layernorm.weight"] = self.pre_feedforward_layernorm.weight
        if self.sandwich or self.post_norms:
            out[f"{prefix}post_feedforward_layernorm.weight"] = self.post_feedforward_layernorm.weight
        if self.is_linear_attention:
            out.update(self.linear_attn.replicated_params(f"{prefix}linear_attn."))
        elif self.self_attn.spec.qk_norm_eps is not None:
            out[f"{prefix}self_attn.q_norm.weight"] = self.self_attn.q_norm.weight
            if self.self_attn.spec.kv_role != "import":  # a KV-sharing layer has no k_norm
                out[f"{prefix}self_attn.k_norm.weight"] = self.self_attn.k_norm.weight
        if not self.is_linear_attention and self.self_attn.o_proj_bias is not None:  # GPT-OSS
            out[f"{prefix}self_attn.o_proj.bias"] = self.self_attn.o_proj_bias
        if self.is_moe:
            out.update({prefix + name: p for name, p in self.mlp.router_params().items()})
            if self.mlp.shared_expert_gate is not None:
                out[f"{prefix}mlp.shared_expert_gate.weight"] = self.mlp.shared_expert_gate.weight
        return out

    def replicated_buffers(self, prefix: str = "") -> dict:
        """HF-named buffers every rank holds whole that the checkpoint carries (GLM-4.5's router correction bias,
        Gemma 4's layer_scalar): read and saved like the replicated params, never trained."""
        out = self.mlp.replicated_buffers(prefix) if self.is_moe else {}
        if self.layer_scalar is not None:  # Gemma 4
            out[f"{prefix}layer_scalar"] = self.layer_scalar
        return out
