"""The TSP causal LM (Llama / Mistral / Qwen2 shapes): every rank holds 1/D of every weight and 1/D of the tokens.

Parameters per rank (D = TSP degree, p = TSP rank; names keep HF's module path so conversions read top-down):
| parameter                                   | shape                        | sharding                     |
|---------------------------------------------|------------------------------|------------------------------|
| model.embed_tokens.vocab_shard              | [ceil(V/D), h]               | vocab rows of rank p         |
| model.layers.i.self_attn.packed_shard       | [attention layout numel]     | head block p (q, k, v, o)    |
| model.layers.i.mlp.packed_shard             | [3 * h * F/D]                | intermediate columns of p    |
| model.layers.i.*_layernorm.weight, norm     | [h]                          | replicated, grads summed     |
| lm_head.vocab_shard (absent when tied)      | [ceil(V/D), h]               | vocab rows of rank p         |
Inputs are this rank's zigzag shard (ds_tsp.partition.shard_batch): input_ids, shift_labels and the GLOBAL
position_ids, each [B, S_pad/D]. forward returns this rank's share of the mean loss (the shares sum to it).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_tsp.comm import TSPComm
from ds_tsp.errors import TSPConfigError
from ds_tsp.layers.attention import AttentionSpec, tsp_attention
from ds_tsp.layers.embedding import tsp_embedding
from ds_tsp.layers.lm_head_loss import tsp_lm_head_loss
from ds_tsp.layers.mlp import MLPSpec, tsp_gated_mlp
from ds_tsp.layers.norm import TSPRMSNorm
from ds_tsp.model_config import ModelShape
from ds_tsp.rope import rope_cos_sin


@dataclass(frozen=True)
class TSPOptions:
    """How the TSP schedule trades memory for speed; the defaults are the memory-optimal schedule."""

    kernel_backend: str | None = None  # None: flash-attn on CUDA when importable, the CPU flash kernel on CPU
    keep_gathered_kv: bool = False  # keep each block's gathered K/V for backward: O(S) memory, no re-gather
    activation_checkpointing: bool = False  # save only each decoder layer's input; recompute the layer in backward
    recompute_projections: bool = True  # recompute cheap local q/k/v and MLP gate/up GEMMs in backward

    @classmethod
    def speed(cls, **overrides) -> "TSPOptions":
        """The speed mode: keep gathered K/V and every local projection; O(S) per layer instead of O(S/D)."""
        return cls(**{"keep_gathered_kv": True, "recompute_projections": False, **overrides})


def normalise_over_data(n_valid_tsp: torch.Tensor, data_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Loss denominator: labelled tokens of the whole data x TSP batch / data size (see set_data_parallel_group)."""
    if data_group is None or dist.get_world_size(data_group) == 1:
        return n_valid_tsp
    total = n_valid_tsp.clone()
    dist.all_reduce(total, group=data_group)
    return total / dist.get_world_size(data_group)


def count_valid_tokens(shift_labels: torch.Tensor, comm: TSPComm, data_group=None) -> torch.Tensor:
    """normalise_over_data of the labelled tokens of this TSP group (for stages that see only the labels)."""
    n_valid = (shift_labels != -100).sum().to(torch.int64)
    comm.all_reduce(n_valid).wait()
    return normalise_over_data(n_valid, data_group)


def _mark_sharded(param: nn.Parameter) -> nn.Parameter:
    # DeepSpeed/Megatron read these to count a sharded param on every model-parallel rank in the grad norm.
    param.tensor_model_parallel = True
    param.partition_dim = 0
    param.partition_stride = 1
    param.tsp_sharded = True
    return param


def _block(t: torch.Tensor, index: int, size: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, index * size, size)


class TSPAttention(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, options: TSPOptions, dtype, device):
        super().__init__()
        self.comm = comm
        self.spec = AttentionSpec(hidden=shape.hidden_size, heads_per_block=shape.num_heads // comm.size,
                                  kv_heads_per_block=max(shape.num_kv_heads // comm.size, 1),
                                  head_dim=shape.dim_per_head, qkv_bias=shape.qkv_bias,
                                  kv_replicas=shape.kv_replicas(comm.size),
                                  kernel_backend=options.kernel_backend,
                                  keep_gathered_kv=options.keep_gathered_kv,
                                  recompute_projections=options.recompute_projections)
        self.packed_shard = _mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))

    def forward(self, x, cos, sin):
        return tsp_attention(x, self.packed_shard, cos, sin, self.spec, self.comm)

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pack this rank's head block from HF-named full weights (q_proj.weight, ..., o_proj.weight)."""
        p, q, kv = self.comm.rank, self.spec.heads_per_block * self.spec.head_dim, \
            self.spec.kv_heads_per_block * self.spec.head_dim
        pk = p // self.spec.kv_replicas
        pieces = {"wq": _block(full["q_proj.weight"], p, q), "wk": _block(full["k_proj.weight"], pk, kv),
                  "wv": _block(full["v_proj.weight"], pk, kv), "wo": _block(full["o_proj.weight"], p, q, dim=1)}
        if self.spec.qkv_bias:
            pieces.update(bq=_block(full["q_proj.bias"], p, q), bk=_block(full["k_proj.bias"], pk, kv),
                          bv=_block(full["v_proj.bias"], pk, kv))
        return self.spec.layout.pack(pieces)

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
        return (f"heads/block={s.heads_per_block}, kv_heads/block={s.kv_heads_per_block}, head_dim={s.head_dim}, "
                f"tsp_rank={self.comm.rank}/{self.comm.size}")


class TSPGatedMLP(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device, recompute_projections: bool = True):
        super().__init__()
        self.comm = comm
        self.spec = MLPSpec(hidden=shape.hidden_size, ffn_per_rank=shape.intermediate_size // comm.size,
                            recompute_projections=recompute_projections)
        self.packed_shard = _mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))

    def forward(self, x):
        return tsp_gated_mlp(x, self.packed_shard, self.spec, self.comm)

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        p, f = self.comm.rank, self.spec.ffn_per_rank
        return self.spec.layout.pack({"gate": _block(full["gate_proj.weight"], p, f),
                                      "up": _block(full["up_proj.weight"], p, f),
                                      "down": _block(full["down_proj.weight"], p, f, dim=1)})

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        views = [self.spec.layout.unpack(s) for s in shards]
        return {"gate_proj.weight": torch.cat([v["gate"] for v in views]),
                "up_proj.weight": torch.cat([v["up"] for v in views]),
                "down_proj.weight": torch.cat([v["down"] for v in views], dim=1)}

    def extra_repr(self) -> str:
        return f"ffn/rank={self.spec.ffn_per_rank}, tsp_rank={self.comm.rank}/{self.comm.size}"


class TSPVocabShard(nn.Module):
    """Rows [p*Vd, (p+1)*Vd) of a vocab table padded to D*Vd rows (embedding or LM head)."""

    def __init__(self, vocab_size: int, hidden: int, comm: TSPComm, dtype, device):
        super().__init__()
        self.comm, self.vocab_size = comm, vocab_size
        self.rows = -(-vocab_size // comm.size)
        self.vocab_shard = _mark_sharded(nn.Parameter(torch.zeros(self.rows, hidden, dtype=dtype, device=device)))

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        table = full["weight"]
        padded = table.new_zeros(self.rows * self.comm.size, table.shape[1])
        padded[:self.vocab_size] = table
        return _block(padded, self.comm.rank, self.rows)

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

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device, tied_to: TSPVocabShard | None = None):
        super().__init__(shape.vocab_size, shape.hidden_size, comm, dtype, device)
        self.tied = tied_to is not None
        if self.tied:
            del self.vocab_shard
            self._tied_to = [tied_to]  # a list: not a submodule, so the tied weight is listed once

    @property
    def weight(self) -> nn.Parameter:
        return self._tied_to[0].vocab_shard if self.tied else self.vocab_shard

    def forward(self, h, shift_labels, n_valid_total):
        return tsp_lm_head_loss(h, self.weight, shift_labels, n_valid_total, self.vocab_size, self.comm)


class TSPDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, options: TSPOptions, dtype, device):
        super().__init__()
        self.input_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device)
        self.self_attn = TSPAttention(shape, comm, options, dtype, device)
        self.post_attention_layernorm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device)
        self.mlp = TSPGatedMLP(shape, comm, dtype, device, options.recompute_projections)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, options: TSPOptions, dtype, device):
        super().__init__()
        self.embed_tokens = TSPVocabEmbedding(shape.vocab_size, shape.hidden_size, comm, dtype, device)
        self.layers = nn.ModuleList(TSPDecoderLayer(shape, comm, options, dtype, device)
                                    for _ in range(shape.num_layers))
        self.norm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device)


class TSPCausalLM(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, *, options: TSPOptions = TSPOptions(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 data_group: dist.ProcessGroup | None = None):
        super().__init__()
        shape.check_tsp_degree(comm.size)
        self.shape, self.comm, self.options = shape, comm, options
        self.model = _Backbone(shape, comm, options, dtype, device)
        self.lm_head = TSPLMHeadLoss(shape, comm, dtype, device,
                                     tied_to=self.model.embed_tokens if shape.tie_word_embeddings else None)
        self.set_data_parallel_group(data_group)

    def set_data_parallel_group(self, data_group: dist.ProcessGroup | None) -> None:
        """Normalise the loss over the tokens of the whole data x TSP batch.

        Data-parallel engines (DeepSpeed, DDP, FSDP) AVERAGE grads over the data group, so each replica's loss is
        scaled by data_size / (valid tokens of all replicas): the average then equals the gradient of the
        token-weighted mean over the global batch, even when replicas hold different numbers of labelled tokens.
        """
        self.data_group = data_group
        self.data_size = dist.get_world_size(data_group) if data_group is not None else 1

    # --- forward ---------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, shift_labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        n_valid = normalise_over_data(self._check_inputs(input_ids, shift_labels, position_ids),
                                      self.data_group).to(self.dtype)
        cos, sin = rope_cos_sin(position_ids, self.shape.dim_per_head, self.shape.rope_theta, self.dtype)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            if self.options.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.lm_head(self.model.norm(h), shift_labels, n_valid)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def _check_inputs(self, input_ids, shift_labels, position_ids) -> torch.Tensor:
        """Validate on every rank at once (one tiny all-gather) so a bad shard fails every rank, none hangs.

        Returns the number of tokens with a target in the whole TSP group (the loss denominator).
        """
        if position_ids is None:
            raise TSPConfigError(
                "position_ids is missing: TSP ranks hold non-contiguous zigzag chunks, so RoPE needs the GLOBAL "
                "position of every local token; build the batch with ds_tsp.partition.shard_batch")
        for name, t in (("shift_labels", shift_labels), ("position_ids", position_ids)):
            if t.shape != input_ids.shape:
                raise TSPConfigError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}: "
                                     "pass the same zigzag shard of every field")
        if input_ids.dim() != 2:
            raise TSPConfigError(f"input_ids must be [batch, local_seq], got shape {tuple(input_ids.shape)}")
        local_len = input_ids.shape[1]
        n_bad = ((input_ids < 0) | (input_ids >= self.shape.vocab_size)).sum()
        n_valid = (shift_labels != -100).sum()
        stats = torch.stack([n_valid, n_bad, torch.tensor(local_len), torch.tensor(input_ids.shape[0])]).to(
            device=input_ids.device, dtype=torch.int64)
        if self.comm.size > 1:
            everyone = torch.empty(self.comm.size, 4, dtype=torch.int64, device=stats.device)
            self.comm.all_gather(everyone, stats).wait()
        else:
            everyone = stats[None]
        if everyone[:, 1].sum() > 0:
            raise TSPConfigError(
                f"input_ids: {int(everyone[:, 1].sum())} token id(s) are outside [0, vocab_size={self.shape.vocab_size}):"
                " check the tokenizer matches the model's vocab_size")
        if (everyone[:, 2] != local_len).any() or (everyone[:, 3] != input_ids.shape[0]).any() or local_len % 2:
            raise TSPConfigError(
                f"local shapes [batch, seq] differ across TSP ranks or are odd: {everyone[:, 2:].tolist()}; every rank "
                "must hold its zigzag shard (two equal chunks) of the same batch: use ds_tsp.partition.shard_batch")
        n_valid = everyone[:, 0].sum()
        if n_valid == 0:
            raise TSPConfigError("shift_labels: no token has a target (all -100) in the whole TSP group; "
                                 "a batch needs at least one labelled token")
        return n_valid

    def loss_for_logging(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The global mean loss (TSP shares summed, data replicas averaged), detached, identical on all ranks."""
        total = loss_share.detach().clone()
        if self.comm.size > 1:
            dist.all_reduce(total, group=self.comm.group)
        if self.data_group is not None and self.data_size > 1:
            dist.all_reduce(total, group=self.data_group)
            total /= self.data_size
        return total

    # --- conversion to / from full (HF-named) state dicts ---------------------------------------------------
    def _sharded_modules(self):
        """(HF name prefix, module with shard_full/unshard, its parameter)."""
        out = [("model.embed_tokens.", self.model.embed_tokens, self.model.embed_tokens.vocab_shard)]
        for i, layer in enumerate(self.model.layers):
            out.append((f"model.layers.{i}.self_attn.", layer.self_attn, layer.self_attn.packed_shard))
            out.append((f"model.layers.{i}.mlp.", layer.mlp, layer.mlp.packed_shard))
        if not self.lm_head.tied:
            out.append(("lm_head.", self.lm_head, self.lm_head.vocab_shard))
        return out

    def _replicated_params(self):
        out = {"model.norm.weight": self.model.norm.weight}
        for i, layer in enumerate(self.model.layers):
            out[f"model.layers.{i}.input_layernorm.weight"] = layer.input_layernorm.weight
            out[f"model.layers.{i}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return out

    @torch.no_grad()
    def init_weights_(self, seed: int = 0, std: float = 0.02) -> "TSPCausalLM":
        """Initialise shards in place without ever building a full weight: N(0, std) matrices, zero biases and
        padded vocab rows, unit norms. Each piece draws from a generator keyed by (seed, name, piece, owner block),
        so data-parallel replicas and replicated kv heads agree; the values differ from a single-device init."""
        def normal(key: str, shape) -> torch.Tensor:
            g = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
            return torch.randn(shape, generator=g, dtype=torch.float64).mul_(std)

        rank = self.comm.rank
        for name, module, param in self._sharded_modules():
            if isinstance(module, TSPVocabShard):
                param.copy_(normal(f"{name}{rank}", param.shape))
                first_pad = module.vocab_size - rank * module.rows
                if first_pad < module.rows:
                    param[max(first_pad, 0):] = 0
                continue
            layout = module.spec.layout
            views = layout.unpack(param)
            kv_owner = rank // getattr(module.spec, "kv_replicas", 1)
            for piece, shape in layout.pieces:
                owner = kv_owner if piece in ("wk", "wv") else rank
                views[piece].copy_(torch.zeros(shape) if piece.startswith("b") else normal(f"{name}{piece}{owner}", shape))
        for param in self._replicated_params().values():
            param.fill_(1.0)
        return self

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Take this rank's shards from an HF-named full state dict (every rank passes the same dict)."""
        for prefix, module, param in self._sharded_modules():
            sub = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
            if not sub:
                raise TSPConfigError(f"state dict has no '{prefix}*' entries; is it a Llama-family checkpoint "
                                     f"with {self.shape.num_layers} layers?")
            param.copy_(module.shard_full(sub).reshape(param.shape))
        for name, param in self._replicated_params().items():
            param.copy_(full[name])

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Collective: gather every shard into HF-named full tensors (params, or their .grad with grads=True)."""
        def value(param):
            t = param.grad if grads else param
            return torch.zeros_like(param) if t is None else t.detach()

        full = {}
        for prefix, module, param in self._sharded_modules():
            local = value(param).contiguous()
            if self.comm.size > 1:
                gathered = torch.empty((self.comm.size, *local.shape), dtype=local.dtype, device=local.device)
                self.comm.all_gather(gathered, local).wait()
                shards = list(gathered.unbind(0))
            else:
                shards = [local]
            full.update({prefix + k: v for k, v in module.unshard(shards).items()})
        full.update({k: value(p).clone() for k, p in self._replicated_params().items()})
        if self.lm_head.tied:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        return full
