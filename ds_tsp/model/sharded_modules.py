"""The TSP model's nn.Modules: one per sharded piece, each knowing which slices of the HF tensors it owns.

Every sharded module answers three questions for checkpoints, so loading reads ONLY this rank's slices and saving
reassembles one module at a time:

    hf_shapes()       {HF tensor name (relative): full shape}            what the checkpoint must contain
    hf_slices()       {name: (dim, start, length)}                       the part of each tensor this rank owns
    hf_targets(p)     {name: view of parameter p}                        where each slice lands (read in place)
    pack_slices(d)    {name: sliced tensor} -> this rank's packed shard  (shard_full = pack_slices of narrowed)
    unshard(shards)   every rank's packed shard -> {name: full tensor}
(A tensor a rank owns several ranges of gives HFRanges, a tuple of (dim, start, length), in hf_slices and a tuple
of views in hf_targets: ds_tsp.model.hf_slices.)

| module (HF prefix)                | parameter        | this rank's part                                      |
|-----------------------------------|------------------|-------------------------------------------------------|
| model.embed_tokens / lm_head      | vocab_shard      | vocab rows [p*Vd, (p+1)*Vd), zero past V              |
| model.layers.i.self_attn          | packed_shard     | q heads of block p, its kv heads, o_proj columns      |
| model.layers.i.self_attn.q/k_norm | weight           | replicated [head_dim] (Qwen3), grads summed           |
| model.layers.i.mlp                | packed_shard     | gate/up rows and down columns [p*F/D, (p+1)*F/D)      |
| model.layers.i.linear_attn        | (its own)        | Gated DeltaNet heads of block p (hybrid models)       |
| model.layers.i.mlp (MoE layer)    | experts_shard    | experts [p*E/D, (p+1)*E/D) whole; router replicated   |
(the MoE block: ds_tsp.model.sharded_moe.TSPSparseMoE; its HF names carry their block prefix, Mixtral's
block_sparse_moe., so its entry in sharded_modules has the layer prefix.)
"""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.core.comm import TSPComm
from ds_tsp.core.comm_primitives import replicated_param
from ds_tsp.core.functions.attention import AttentionSpec, tsp_attention
from ds_tsp.core.functions.embedding import tsp_embedding
from ds_tsp.core.functions.lm_head_logits import tsp_selected_logits
from ds_tsp.core.functions.lm_head_loss import tsp_lm_head_loss
from ds_tsp.core.functions.lm_head_token_stats import tsp_token_stats
from ds_tsp.core.functions.mlp import MLPSpec, tsp_gated_mlp
from ds_tsp.core.functions.norm import TSPRMSNorm
from ds_tsp.core.grad_norm import mark_sharded
from ds_tsp.core.shape import ModelShape
from ds_tsp.model.hf_slices import HFRanges
from ds_tsp.model.sharded_moe import TSPSparseMoE, shared_expert_shape

HFSlice = tuple[int, int, int]  # (dim, start, length) of a full HF tensor


class _ShardedPiece(nn.Module):
    PIECES: dict[str, str] = {}  # packed-layout piece -> HF tensor name (relative)

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's packed shard from HF-named full tensors (relative names)."""
        return self.pack_slices({name: full[name].narrow(dim, start, length)
                                 for name, (dim, start, length) in self.hf_slices().items()})

    def pack_slices(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.spec.layout.pack({key: pieces[name] for key, name in self.PIECES.items() if name in pieces})

    def hf_targets(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the packed parameter that each HF slice fills, so a checkpoint reads straight into it."""
        views = self.spec.layout.unpack(packed)
        return {name: views[key] for key, name in self.PIECES.items() if key in views}

    def weight_shard(self) -> torch.Tensor:
        """What the layer's Function streams: the packed parameter, or with LoRA base + delta (differentiable)."""
        lora = getattr(self, "lora", None)
        return self.packed_shard if lora is None else lora(self.packed_shard)


class HeadNorm(nn.Module):
    """Qwen3's q_norm / k_norm: one RMSNorm weight [head_dim] shared by every head, replicated on every rank."""

    def __init__(self, head_dim: int, dtype, device, zero_centred: bool = False):
        super().__init__()
        # zero-centred (Qwen3.5): the norm scales by 1 + weight, so the identity is 0
        self.weight = nn.Parameter((torch.zeros if zero_centred else torch.ones)(head_dim, dtype=dtype, device=device))


class TSPAttention(_ShardedPiece):
    PIECES = {"wq": "q_proj.weight", "wk": "k_proj.weight", "wv": "v_proj.weight", "wo": "o_proj.weight",
              "bq": "q_proj.bias", "bk": "k_proj.bias", "bv": "v_proj.bias"}

    def __init__(self, shape: ModelShape, comm: TSPComm, options, dtype, device, layer: int = 0):
        super().__init__()
        self.comm, self.num_heads, self.num_kv_heads = comm, shape.num_heads, shape.num_kv_heads
        self.spec = AttentionSpec(hidden=shape.hidden_size, heads_per_block=shape.num_heads // comm.size,
                                  kv_heads_per_block=max(shape.num_kv_heads // comm.size, 1),
                                  head_dim=shape.dim_per_head, qkv_bias=shape.qkv_bias,
                                  kv_replicas=shape.kv_replicas(comm.size),
                                  kernel_backend=options.kernel_backend,
                                  keep_gathered_kv=options.keep_gathered_kv,
                                  recompute_projections=options.recompute_projections,
                                  window=shape.layer_window(layer),
                                  qk_norm_eps=shape.rms_norm_eps if shape.qk_norm else None,
                                  norm_zero_centred=shape.zero_centred_norms, output_gate=shape.attn_output_gate)
        self.packed_shard = mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))
        self.lora = None  # a ds_tsp.model.lora.ShardLoRA when PEFT LoRA targets this layer's attention
        if shape.qk_norm:
            self.q_norm = HeadNorm(shape.dim_per_head, dtype, device, shape.zero_centred_norms)
            self.k_norm = HeadNorm(shape.dim_per_head, dtype, device, shape.zero_centred_norms)

    def forward(self, x, cos, sin, doc_starts=None):
        qk = None
        if self.spec.qk_norm_eps is not None:
            qk = (replicated_param(self.q_norm.weight, self.comm), replicated_param(self.k_norm.weight, self.comm))
        return tsp_attention(x, self.weight_shard(), cos, sin, self.spec, self.comm, qk_norm=qk, doc_starts=doc_starts)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        s, h = self.spec, self.spec.hidden
        q, kv = self.num_heads * s.head_dim, self.num_kv_heads * s.head_dim
        q_rows = 2 * q if s.output_gate else q  # gated attention: [q, gate] rows per head
        shapes = {"q_proj.weight": (q_rows, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
                  "o_proj.weight": (h, q)}
        if s.qkv_bias:
            shapes.update({"q_proj.bias": (q_rows,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
        return shapes

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice]:
        p = self.comm.rank if rank is None else rank
        q, kv = self.spec.heads_per_block * self.spec.head_dim, self.spec.kv_heads_per_block * self.spec.head_dim
        pk = p // self.spec.kv_replicas  # the kv head block this rank's query heads read
        qr = 2 * q if self.spec.output_gate else q  # gated: the block's heads' [q, gate] rows are contiguous
        slices = {"q_proj.weight": (0, p * qr, qr), "k_proj.weight": (0, pk * kv, kv),
                  "v_proj.weight": (0, pk * kv, kv), "o_proj.weight": (1, p * q, q)}
        if self.spec.qkv_bias:
            slices.update({"q_proj.bias": (0, p * qr, qr), "k_proj.bias": (0, pk * kv, kv),
                           "v_proj.bias": (0, pk * kv, kv)})
        return slices

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        views = [self.spec.layout.unpack(s) for s in shards]
        kv_owners = views[::self.spec.kv_replicas]  # one copy of each replicated kv head

        def cat(key, dim=0):
            return torch.cat([v[key] for v in (kv_owners if key[1] in "kv" else views)], dim=dim)

        full = {"q_proj.weight": cat("wq"), "k_proj.weight": cat("wk"), "v_proj.weight": cat("wv"),
                "o_proj.weight": cat("wo", 1)}
        if self.spec.qkv_bias:
            full.update({"q_proj.bias": cat("bq"), "k_proj.bias": cat("bk"), "v_proj.bias": cat("bv")})
        return full

    def extra_repr(self) -> str:
        s = self.spec
        window = f", window={s.window}" if s.window is not None else ""
        return (f"heads/block={s.heads_per_block}, kv_heads/block={s.kv_heads_per_block}, head_dim={s.head_dim}"
                f"{window}, tsp_rank={self.comm.rank}/{self.comm.size}")


class TSPGatedMLP(_ShardedPiece):
    PIECES = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device, recompute_projections: bool = True):
        super().__init__()
        self.comm, self.intermediate_size = comm, shape.intermediate_size
        self.spec = MLPSpec(hidden=shape.hidden_size, ffn_per_rank=shape.intermediate_size // comm.size,
                            recompute_projections=recompute_projections)
        self.packed_shard = mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))
        self.lora = None  # a ds_tsp.model.lora.ShardLoRA when PEFT LoRA targets this layer's MLP

    def forward(self, x):
        return tsp_gated_mlp(x, self.weight_shard(), self.spec, self.comm)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = self.spec.hidden, self.intermediate_size
        return {"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)}

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice]:
        p, f = self.comm.rank if rank is None else rank, self.spec.ffn_per_rank
        return {"gate_proj.weight": (0, p * f, f), "up_proj.weight": (0, p * f, f),
                "down_proj.weight": (1, p * f, f)}

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        views = [self.spec.layout.unpack(s) for s in shards]
        return {"gate_proj.weight": torch.cat([v["gate"] for v in views]),
                "up_proj.weight": torch.cat([v["up"] for v in views]),
                "down_proj.weight": torch.cat([v["down"] for v in views], dim=1)}

    def extra_repr(self) -> str:
        return f"ffn/rank={self.spec.ffn_per_rank}, tsp_rank={self.comm.rank}/{self.comm.size}"


class TSPVocabShard(_ShardedPiece):
    """Rows [p*Vd, (p+1)*Vd) of a vocab table padded to D*Vd rows (embedding or LM head)."""

    def __init__(self, vocab_size: int, hidden: int, comm: TSPComm, dtype, device):
        super().__init__()
        self.comm, self.vocab_size, self.hidden = comm, vocab_size, hidden
        self.rows = -(-vocab_size // comm.size)
        self.vocab_shard = mark_sharded(nn.Parameter(torch.zeros(self.rows, hidden, dtype=dtype, device=device)))

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.vocab_size, self.hidden)}

    def hf_slices(self) -> dict[str, HFSlice]:
        start = min(self.comm.rank * self.rows, self.vocab_size)
        return {"weight": (0, start, min(self.rows, self.vocab_size - start))}

    def pack_slices(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = pieces["weight"]
        if rows.shape[0] == self.rows:
            return rows
        return torch.cat((rows, rows.new_zeros(self.rows - rows.shape[0], rows.shape[1])))  # past V: zeros

    def hf_targets(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        packed[self.hf_slices()["weight"][2]:].zero_()  # rows past V stay zero
        return {"weight": packed[:self.hf_slices()["weight"][2]]}

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight": torch.cat(shards)[:self.vocab_size]}

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows/rank={self.rows}, tsp_rank={self.comm.rank}/{self.comm.size}"


class TSPVocabEmbedding(TSPVocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return tsp_embedding(input_ids, self.vocab_shard, self.comm)


class TSPLMHeadLoss(TSPVocabShard):
    """LM head fused with the loss. Tied: owns no weight and reads the embedding's shard (which ZeRO-3 must then
    treat as an external parameter of this module)."""

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device, tied_to: TSPVocabShard | None = None,
                 chunk_tokens: int = 4096):
        super().__init__(shape.vocab_size, shape.hidden_size, comm, dtype, device)
        self.chunk_tokens = chunk_tokens  # tokens per logits tile: bounds the loss's largest transient
        self.tied = tied_to is not None
        if self.tied:
            del self.vocab_shard
            self._tied_to = [tied_to]  # a list: not a submodule, so the tied weight is listed once

    @property
    def weight(self) -> nn.Parameter:
        return self._tied_to[0].vocab_shard if self.tied else self.vocab_shard

    def forward(self, h, shift_labels=None, n_valid_total=None, *, select=None, token_stats=False):
        """The loss share; or, with select=(local_index, slots, k), the [B, k, V] logits of k positions; or, with
        token_stats=True, per-token (log_prob, entropy, is_top1, label_mask) [4, B, L] (a module call each time,
        so ZeRO-3 gathers the weight for all three)."""
        if token_stats:
            return tsp_token_stats(h, self.weight, shift_labels, self.vocab_size, self.comm,
                                   chunk_tokens=self.chunk_tokens)
        if select is not None:
            local_index, slots, k = select
            return tsp_selected_logits(h, self.weight, local_index, slots, k, self.vocab_size, self.comm)
        return tsp_lm_head_loss(h, self.weight, shift_labels, n_valid_total, self.vocab_size, self.comm,
                                chunk_tokens=self.chunk_tokens)


def _gated_deltanet(shape: ModelShape, comm: TSPComm, options, dtype, device, layer: int) -> nn.Module:
    """The Gated DeltaNet token mixer of a hybrid model's linear_attention layer (imported here: only hybrid models
    need it)."""
    try:
        from ds_tsp.model.sharded_gated_deltanet import TSPGatedDeltaNet
    except ImportError as err:
        from ds_tsp.core.errors import TSPConfigError

        raise TSPConfigError(
            f"layer_types[{layer}]='linear_attention': the Gated DeltaNet layer (ds_tsp.model.sharded_gated_deltanet)"
            f" is not available in this ds_tsp ({err}); only hybrid configs whose layers are all full_attention "
            "run") from err
    return TSPGatedDeltaNet(shape, comm, options, dtype, device, layer=layer, hf_format=shape.hybrid_family)


class TSPDecoderLayer(nn.Module):
    """Pre-norm decoder layer. Token mixer: `self_attn` (TSPAttention), or `linear_attn` (Gated DeltaNet) where the
    shape's layer_types says linear_attention (Qwen3.5 / Qwen3-Next)."""

    def __init__(self, shape: ModelShape, comm: TSPComm, options, dtype, device, layer: int = 0):
        super().__init__()
        centred = shape.zero_centred_norms
        self.input_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device, centred)
        self.is_linear_attention = shape.layer_type(layer) == "linear_attention"
        if self.is_linear_attention:
            self.linear_attn = _gated_deltanet(shape, comm, options, dtype, device, layer)
        else:
            self.self_attn = TSPAttention(shape, comm, options, dtype, device, layer)
        self.post_attention_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device,
                                                   centred)
        self.is_moe = shape.is_moe_layer(layer)
        if self.is_moe:
            shared = (TSPGatedMLP(shared_expert_shape(shape), comm, dtype, device, options.recompute_projections)
                      if shape.shared_expert_intermediate_size else None)  # Qwen3-Next / Qwen3.5-MoE
            self.mlp = TSPSparseMoE(shape, comm, options, dtype, device, shared_expert=shared)
        else:
            self.mlp = TSPGatedMLP(shape, comm, dtype, device, options.recompute_projections)

    def forward(self, h, cos, sin, doc_starts=None, *, with_router: bool = False):
        """The layer's output; with_router: (output, router logits [B*L, E] or None for a dense MLP). Callers go
        through the module (`layer(..., with_router=True)`), never a bound method: FSDP2 and ZeRO-3 gather the
        layer's parameters in its forward hooks."""
        if self.is_linear_attention:
            h = h + self.linear_attn(self.input_layernorm(h), doc_starts)
        else:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, doc_starts)
        router_logits = None
        if self.is_moe:
            y, router_logits = self.mlp(self.post_attention_layernorm(h))
        else:
            y = self.mlp(self.post_attention_layernorm(h))
        return (h + y, router_logits) if with_router else h + y

    def sharded_modules(self, prefix: str = "") -> list[tuple[str, "_ShardedPiece", nn.Parameter]]:
        """(HF name prefix, sharded piece, its parameter) of this layer, in checkpoint order."""
        mlp = ((prefix, self.mlp, self.mlp.experts_shard) if self.is_moe
               else (f"{prefix}mlp.", self.mlp, self.mlp.packed_shard))
        mlps = [mlp]
        if self.is_moe and self.mlp.shared_expert is not None:  # Qwen3-Next / Qwen3.5-MoE
            mlps.append((f"{prefix}mlp.shared_expert.", self.mlp.shared_expert, self.mlp.shared_expert.packed_shard))
        if self.is_linear_attention:  # the Gated DeltaNet lists its own sharded pieces
            return [*self.linear_attn.sharded_modules(f"{prefix}linear_attn."), *mlps]
        return [(f"{prefix}self_attn.", self.self_attn, self.self_attn.packed_shard), *mlps]

    def replicated_params(self, prefix: str = "") -> dict[str, nn.Parameter]:
        """HF-named params every rank holds whole (their grads are summed over the TSP group)."""
        out = {f"{prefix}input_layernorm.weight": self.input_layernorm.weight,
               f"{prefix}post_attention_layernorm.weight": self.post_attention_layernorm.weight}
        if self.is_linear_attention:
            out.update(self.linear_attn.replicated_params(f"{prefix}linear_attn."))
        elif self.self_attn.spec.qk_norm_eps is not None:
            out[f"{prefix}self_attn.q_norm.weight"] = self.self_attn.q_norm.weight
            out[f"{prefix}self_attn.k_norm.weight"] = self.self_attn.k_norm.weight
        if self.is_moe:
            out[prefix + self.mlp.router_name()] = self.mlp.gate.weight
            if self.mlp.shared_expert_gate is not None:
                out[f"{prefix}mlp.shared_expert_gate.weight"] = self.mlp.shared_expert_gate.weight
        return out


@torch.no_grad()
def load_slices(sharded: list[tuple[str, "_ShardedPiece", nn.Parameter]], replicated: dict[str, nn.Parameter],
                read_into) -> None:
    """Fill every shard with read_into(hf_name, dim, start, length, out): copy that slice into `out`, a view of the
    parameter (dim None: the whole tensor). Only this rank's slices are requested, and they land in place."""
    for prefix, module, param in sharded:
        targets = module.hf_targets(param.data)
        for name, where in module.hf_slices().items():
            if isinstance(where, HFRanges):  # several ranges of one tensor, one view each
                for (dim, start, length), out in zip(where, targets[name], strict=True):
                    read_into(prefix + name, dim, start, length, out)
                continue
            dim, start, length = where
            read_into(prefix + name, dim, start, length, targets[name])
    for name, param in replicated.items():
        read_into(name, None, 0, None, param.data)


def read_from_full(full: dict[str, torch.Tensor]):
    """A read_into for load_slices over an HF-named full state dict."""
    def read_into(name, dim, start, length, out):
        out.copy_(full[name] if dim is None else full[name].narrow(dim, start, length))

    return read_into
