"""TSP attention as a sharded piece: head block p of q/k/v/o packed in one parameter (ds_tsp.core.layers.attention
runs it; GPT-OSS's per-head sinks ride in it too), the replicated q/k norms beside it (Qwen3's per head, OLMo's
over the whole projection) and GPT-OSS's o_proj bias (a replicated [h] vector, added once per token after the
locally accumulated output projection)."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import replicated_param
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.grads.clip import mark_sharded
from ds_tsp.core.layers.attention.cp_all_to_all import check_all_to_all_heads
from ds_tsp.core.layers.attention.cp_cost import CPLayerShape, choose_cp_comm, describe_choice
from ds_tsp.core.layers.attention.tsp_attention import AttentionSpec, attention_compute_dtype, tsp_attention
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.positions import RopeTables
from ds_tsp.model.modules.piece import ShardedPiece
from ds_tsp.model.modules.slices import HFRanges, HFSlice


class HeadNorm(nn.Module):
    """A q_norm / k_norm weight, replicated on every rank: Qwen3's [head_dim] shared by every head, or OLMo's
    [heads * head_dim] over the whole projection (each head block uses its slice)."""

    def __init__(self, size: int, dtype, device, zero_centred: bool = False):
        super().__init__()
        # zero-centred (Qwen3.5): the norm scales by 1 + weight, so the identity is 0
        self.weight = nn.Parameter((torch.zeros if zero_centred else torch.ones)(size, dtype=dtype, device=device))


class TSPAttention(ShardedPiece):
    PIECES = {"wq": "q_proj.weight", "wk": "k_proj.weight", "wv": "v_proj.weight", "wo": "o_proj.weight",
              "bq": "q_proj.bias", "bk": "k_proj.bias", "bv": "v_proj.bias", "sinks": "sinks"}

    def __init__(self, shape: ModelShape, comm: TSPComm, options, dtype, device, layer: int = 0):
        super().__init__()
        # Gemma 4: the full layers' own head_dim and kv heads
        self.comm, self.num_heads, self.num_kv_heads = comm, shape.num_heads, shape.layer_kv_heads(layer)
        self.fused = shape.fused_qkv  # Phi-3: q, k, v rows in one qkv_proj tensor
        head_dim = shape.layer_head_dim(layer)
        self.spec = AttentionSpec(hidden=shape.hidden_size, heads_per_block=shape.num_heads // comm.size,
                                  kv_heads_per_block=max(self.num_kv_heads // comm.size, 1),
                                  head_dim=head_dim, qkv_bias=shape.qkv_bias,
                                  kv_replicas=max(comm.size // self.num_kv_heads, 1),
                                  kernel_backend=None if options.kernel == "auto" else options.kernel,
                                  keep_gathered_kv=options.keep_gathered_kv,
                                  recompute_projections=options.recompute_projections,
                                  window=shape.layer_window(layer),
                                  qk_norm_eps=(shape.rms_norm_eps if shape.qk_norm or shape.projection_qk_norm
                                               else None),
                                  norm_zero_centred=shape.zero_centred_norms, output_gate=shape.attn_output_gate,
                                  softmax_scale=shape.attention_scale, projection_norm=shape.projection_qk_norm,
                                  value_norm_eps=shape.rms_norm_eps if shape.value_norm else None,
                                  values_from_keys=shape.layer_values_from_keys(layer), sinks=shape.attention_sinks,
                                  cp_comm="all_to_all" if options.cp_comm == "all_to_all" else "ring",
                                  kv_role=("import" if shape.kv_source(layer) is not None else
                                           "export" if shape.exports_kv(layer) else "own"))
        if self.spec.kv_role != "own" and comm.cp is not None:
            raise TSPConfigError(f"kv_shared_layers={shape.kv_shared_layers} with tsp.cp_size={comm.cp.size}: Gemma "
                                 "4's shared K/V are not carried around the cp ring; use cp_size 1")
        if comm.cp is not None and options.cp_comm == "all_to_all":  # the block's heads split evenly over cp
            check_all_to_all_heads(self.spec.heads_per_block, self.spec.kv_heads_per_block, comm.cp.size,
                                   f" (layer {layer})")
        # cp_comm "auto": the schedule chosen per forward from the sequence length (cp_cost.choose_cp_comm)
        self.cp_comm = options.cp_comm if comm.cp is not None else "ring"
        self._checkpointed = options.activation_checkpointing
        self._a2a_spec = None  # the same layer's spec under the all-to-all, where "auto" may choose it
        if self.cp_comm == "auto" and self.spec.window is None and self.cp_shape(dtype).splits_over_cp():
            self._a2a_spec = replace(self.spec, cp_comm="all_to_all")
        self.packed_shard = mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))
        self.lora = None  # a ds_tsp.model.peft.lora.ShardLoRA when PEFT LoRA targets this layer's attention
        if shape.qk_norm:
            self.q_norm = HeadNorm(head_dim, dtype, device, shape.zero_centred_norms)
            if self.spec.kv_role != "import":  # a KV-sharing layer normalises no keys of its own
                self.k_norm = HeadNorm(head_dim, dtype, device, shape.zero_centred_norms)
        elif shape.projection_qk_norm:  # OLMo: over the whole q / k projection
            self.q_norm = HeadNorm(shape.num_heads * shape.dim_per_head, dtype, device)
            self.k_norm = HeadNorm(shape.num_kv_heads * shape.dim_per_head, dtype, device)
        self.o_proj_bias = (nn.Parameter(torch.zeros(shape.hidden_size, dtype=dtype, device=device))
                            if shape.attention_out_bias else None)

    def cp_shape(self, dtype: torch.dtype) -> CPLayerShape:
        """This layer's cp traffic shape (cp_cost) with K/V sent in `dtype`."""
        s = self.spec
        return CPLayerShape(s.heads_per_block, s.kv_heads_per_block, s.kv_replicas, s.head_dim, self.comm.size,
                            self.comm.cp.size, torch.finfo(dtype).bits // 8, self._checkpointed, s.keep_gathered_kv)

    def cp_choice(self, dtype: torch.dtype) -> str:
        """Which schedule this layer runs, as one line (cp_cost.describe_choice; "ring" without a cp axis)."""
        if self.comm.cp is None:
            return "ring"
        return describe_choice(self.cp_comm, self.cp_shape(dtype), window=self.spec.window)

    def schedule_at(self, seq: int, dtype: torch.dtype) -> str:
        """The cp schedule this layer runs for a padded sequence of `seq` tokens whose K/V travel in `dtype`:
        "all_to_all" or "ring" (also without a cp axis)."""
        if self._a2a_spec is None:
            return self.spec.cp_comm
        return choose_cp_comm("auto", self.cp_shape(dtype), seq, window=self.spec.window)

    def spec_for(self, x: torch.Tensor) -> AttentionSpec:
        """The spec this input runs: under cp_comm "auto" the schedule choose_cp_comm names for its sequence length
        (the global padded one: local tokens x D x C) in the dtype its K/V travel in. Shapes only: every rank
        alike."""
        if self._a2a_spec is None:
            return self.spec
        seq = x.shape[1] * self.comm.size * self.comm.cp.size
        chosen = self.schedule_at(seq, attention_compute_dtype(x.device.type, x.dtype))
        return self._a2a_spec if chosen == "all_to_all" else self.spec

    def forward(self, x, rope: RopeTables, doc_starts=None, kv_in=None):
        """The attention output; kv_role "export": (output, its K/V for the KV-sharing layers), "import": kv_in
        is such an export."""
        qk = None
        if self.spec.qk_norm_eps is not None:
            k_norm = None if self.spec.kv_role == "import" else replicated_param(self.k_norm.weight, self.comm)
            qk = (replicated_param(self.q_norm.weight, self.comm), k_norm)
        y = tsp_attention(x, self.weight_shard(), rope.cos, rope.sin, self.spec_for(x), self.comm, qk_norm=qk,
                          doc_starts=doc_starts, q_scale=rope.q_scale, kv_in=kv_in)
        y, kv = y if self.spec.kv_role == "export" else (y, None)
        y = y if self.o_proj_bias is None else y + replicated_param(self.o_proj_bias, self.comm)
        return y if kv is None else (y, kv)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        s, h = self.spec, self.spec.hidden
        q, kv = self.num_heads * s.head_dim, self.num_kv_heads * s.head_dim
        if self.fused:
            return {"qkv_proj.weight": (q + 2 * kv, h), "o_proj.weight": (h, q)}
        q_rows = 2 * q if s.output_gate else q  # gated attention: [q, gate] rows per head
        shapes = {"q_proj.weight": (q_rows, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
                  "o_proj.weight": (h, q)}
        if s.qkv_bias:
            shapes.update({"q_proj.bias": (q_rows,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
        if s.sinks:
            shapes["sinks"] = (self.num_heads,)
        return _without_values(shapes, s)

    def hf_keys(self) -> dict[str, str | tuple[str, ...]]:
        return {"qkv_proj.weight": ("wq", "wk", "wv"), "o_proj.weight": "wo"} if self.fused else super().hf_keys()

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice | HFRanges]:
        p = self.comm.rank if rank is None else rank
        q, kv = self.spec.heads_per_block * self.spec.head_dim, self.spec.kv_heads_per_block * self.spec.head_dim
        pk = p // self.spec.kv_replicas  # the kv head block this rank's query heads read
        qr = 2 * q if self.spec.output_gate else q  # gated: the block's heads' [q, gate] rows are contiguous
        if self.fused:  # rows [0, Q) q, [Q, Q + KV) k, [Q + KV, Q + 2 KV) v
            Q, KV = self.num_heads * self.spec.head_dim, self.num_kv_heads * self.spec.head_dim
            return {"qkv_proj.weight": HFRanges(((0, p * q, q), (0, Q + pk * kv, kv), (0, Q + KV + pk * kv, kv))),
                    "o_proj.weight": (1, p * q, q)}
        slices = {"q_proj.weight": (0, p * qr, qr), "k_proj.weight": (0, pk * kv, kv),
                  "v_proj.weight": (0, pk * kv, kv), "o_proj.weight": (1, p * q, q)}
        if self.spec.qkv_bias:
            slices.update({"q_proj.bias": (0, p * qr, qr), "k_proj.bias": (0, pk * kv, kv),
                           "v_proj.bias": (0, pk * kv, kv)})
        if self.spec.sinks:
            nq = self.spec.heads_per_block
            slices["sinks"] = (0, p * nq, nq)
        return _without_values(slices, self.spec)

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        views = [self.spec.layout.unpack(s) for s in shards]
        kv_owners = views[::self.spec.kv_replicas]  # one copy of each replicated kv head

        def cat(key, dim=0):
            return torch.cat([v[key] for v in (kv_owners if key[1] in "kv" else views)], dim=dim)

        if self.fused:
            return {"qkv_proj.weight": torch.cat((cat("wq"), cat("wk"), cat("wv"))), "o_proj.weight": cat("wo", 1)}
        full = {"q_proj.weight": cat("wq"), "o_proj.weight": cat("wo", 1)}
        if self.spec.kv_role != "import":
            full["k_proj.weight"] = cat("wk")
        if self.spec.kv_role != "import" and not self.spec.values_from_keys:
            full["v_proj.weight"] = cat("wv")
        if self.spec.qkv_bias:
            full.update({"q_proj.bias": cat("bq"), "k_proj.bias": cat("bk"), "v_proj.bias": cat("bv")})
        if self.spec.sinks:
            full["sinks"] = cat("sinks")
        return full

    def extra_repr(self) -> str:
        s = self.spec
        window = f", window={s.window}" if s.window is not None else ""
        return (f"heads/block={s.heads_per_block}, kv_heads/block={s.kv_heads_per_block}, head_dim={s.head_dim}"
                f"{window}, tsp_rank={self.comm.rank}/{self.comm.size}")


def _without_values(per_name: dict, spec: AttentionSpec) -> dict:
    """Gemma 4's key-equals-value layers have no v_proj in their checkpoint, its KV-sharing layers neither k_proj."""
    gone = ("k_proj.", "v_proj.") if spec.kv_role == "import" else ("v_proj.",) if spec.values_from_keys else ()
    return {n: v for n, v in per_name.items() if not n.startswith(gone)} if gone else per_name


def cp_choices(layers, dtype: torch.dtype) -> dict[str, list[int]]:
    """{which schedule and why (cp_cost.describe_choice): the decoder layer indices that run it} for the attention
    layers among `layers` (TSPDecoderLayers) with a cp axis; {} without one."""
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, TSPAttention) and attn.comm.cp is not None:
            out.setdefault(attn.cp_choice(dtype), []).append(getattr(layer, "index", i))
    return out


def cp_schedules_at(layers, seq: int, dtype: torch.dtype) -> dict[str, list[int]]:
    """{"ring" / "all_to_all": the decoder layer indices whose attention runs it} for a padded sequence of `seq`
    tokens sent in `dtype` (cp_comm "auto" resolved); {} without a cp axis."""
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, TSPAttention) and attn.comm.cp is not None:
            out.setdefault(attn.schedule_at(seq, dtype), []).append(getattr(layer, "index", i))
    return out


def log_cp_choices(layers, dtype: torch.dtype) -> None:
    """The cp schedule of every attention layer, logged once (global rank 0) at model build: "ds_tsp" logger,
    INFO."""
    choices = cp_choices(layers, dtype)
    if choices and (not dist.is_initialized() or dist.get_rank() == 0):
        # the weights' dtype: under autocast the forward decides on the autocast dtype's bytes (spec_for)
        layers_line = "; ".join(f"layers {_ranges(idx)}: {what}" for what, idx in choices.items())
        logging.getLogger("ds_tsp").info("cp schedule (tsp.cp_comm, K/V in %s): %s",
                                         str(dtype).removeprefix("torch."), layers_line)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
