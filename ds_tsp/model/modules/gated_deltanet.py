"""TSPGatedDeltaNet: a hybrid model's linear-attention layer (Qwen3.5 / Qwen3-Next `linear_attn`) as a sharded piece.

Rank p owns linear head block p: key heads [p*kb, (p+1)*kb) and the value heads that read them [p*vb, (p+1)*vb)
(kb = linear_num_key_heads/D, vb = linear_num_value_heads/D). Its packed shard
(ds_tsp.core.layers.linear_attention.gated_deltanet) holds, relative to the layer prefix
`model.layers.{i}.linear_attn.`:
| HF tensor (qwen3_5)        | this rank's part                                        | contiguous?            |
|----------------------------|---------------------------------------------------------|------------------------|
| in_proj_qkv.weight         | q rows of its key heads, k rows, v rows of its value heads | 3 ranges (HFRanges) |
| in_proj_z / _b / _a.weight | rows of its value heads                                 | yes                    |
| conv1d.weight [C, 1, K]    | q, k, v channels of its heads                           | 3 ranges (HFRanges)    |
| dt_bias, A_log [Hv]        | its value heads                                         | yes                    |
| out_proj.weight [h, Hv dv] | columns of its value heads                              | yes (dim 1)            |
| norm.weight [dv]           | replicated (every head shares it), grads summed over the group                    |
Qwen3-Next packs in_proj_qkvz ([q, k, v, z] per key head) and in_proj_ba ([b, a] per key head): a block's key heads
are consecutive groups there, so each is ONE contiguous slice, stored in the checkpoint's own row order.
A tensor whose part is several ranges says so with HFRanges (a tuple of HFSlice); hf_targets then gives one view
per range, in the same order (ds_tsp.model.modules.decoder.load_slices reads each range into its view).
"""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import replicated_param
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.grads.clip import mark_sharded
from ds_tsp.core.layers.linear_attention.gated_deltanet import HF_FORMATS, GatedDeltaNetSpec, tsp_gated_deltanet
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.documents import document_layout, single_documents
from ds_tsp.model.modules.slices import HFRanges, HFSlice


def check_linear_heads(shape: ModelShape, tsp: int) -> None:
    """One clear error when the linear heads cannot be split over `tsp` ranks."""
    nk, nv = shape.linear_num_key_heads, shape.linear_num_value_heads
    if nk < 1 or nv < 1 or nv % nk:
        raise TSPConfigError(f"linear_num_key_heads={nk}, linear_num_value_heads={nv}: Gated DeltaNet needs both "
                             ">= 1 and the value heads a multiple of the key heads (each key head serves "
                             "linear_num_value_heads / linear_num_key_heads value heads)")
    if nk % tsp:
        fits = [d for d in range(1, nk + 1) if nk % d == 0]
        raise TSPConfigError(f"tsp={tsp} does not divide linear_num_key_heads={nk} (linear_num_value_heads={nv}): "
                             "TSP splits the Gated DeltaNet key heads and their value heads over the ranks; degrees "
                             f"that fit: {fits}")


def _keeps_blocks(options) -> bool:
    """Speed mode (recompute_projections off) keeps every head block's forward for backward; not under activation
    checkpointing, whose recompute would keep a second copy while the first one (held by the graph, not by
    checkpoint's saved tensors) stays alive anyway."""
    return not options.recompute_projections and not options.activation_checkpointing


class GatedNorm(nn.Module):
    """Qwen3_5RMSNormGated's weight [head_v_dim], shared by every value head: replicated on every rank."""

    def __init__(self, dim: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))


class TSPGatedDeltaNet(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, options, dtype, device, layer: int = 0,
                 hf_format: str = "qwen3_5"):
        super().__init__()
        if hf_format not in HF_FORMATS:
            raise TSPConfigError(f"TSPGatedDeltaNet(hf_format={hf_format!r}): must be one of {HF_FORMATS}")
        check_linear_heads(shape, comm.size)
        D = comm.size
        self.comm, self.layer, self.hf_format = comm, layer, hf_format
        self.num_key_heads, self.num_value_heads = shape.linear_num_key_heads, shape.linear_num_value_heads
        self.spec = GatedDeltaNetSpec(hidden=shape.hidden_size, key_heads_per_block=self.num_key_heads // D,
                                      value_heads_per_block=self.num_value_heads // D,
                                      key_head_dim=shape.linear_key_head_dim,
                                      value_head_dim=shape.linear_value_head_dim,
                                      conv_kernel=shape.linear_conv_kernel_dim, norm_eps=shape.rms_norm_eps,
                                      hf_format=hf_format,
                                      keep_activations=_keeps_blocks(options))
        self.packed_shard = mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))
        self.norm = GatedNorm(shape.linear_value_head_dim, dtype, device)
        # packed-layout key -> the HF linear it holds (what PEFT LoRA may target; ds_tsp.model.peft.lora reads it)
        self.PIECES = {"out": "out_proj.weight", **({"qkv": "in_proj_qkv.weight", "z": "in_proj_z.weight",
                                                     "b": "in_proj_b.weight", "a": "in_proj_a.weight"}
                                                    if hf_format == "qwen3_5" else
                                                    {"qkvz": "in_proj_qkvz.weight", "ba": "in_proj_ba.weight"})}
        self.lora = None  # a ds_tsp.model.peft.lora.ShardLoRA when PEFT LoRA targets this layer's projections

    def weight_shard(self) -> torch.Tensor:
        """What the Function streams: the packed parameter, or with LoRA base + delta (differentiable)."""
        return self.packed_shard if self.lora is None else self.lora(self.packed_shard)

    def forward(self, x: torch.Tensor, doc_starts=None) -> torch.Tensor:
        """x: [B, L, h] this rank's tokens in zigzag order; doc_starts: per row the global document starts or the
        step's DocumentLayout (None: one document per row)."""
        B = x.shape[0]
        layout = single_documents(B) if doc_starts is None else document_layout(doc_starts, B)
        return tsp_gated_deltanet(x, self.weight_shard(), replicated_param(self.norm.weight, self.comm), self.spec,
                                  self.comm, layout.rows)

    # --- sharded-piece protocol (ds_tsp.model.modules.decoder) -----------------------------------------------
    def _dims(self):
        s = self.spec
        return (s.hidden, self.num_key_heads, self.num_value_heads, s.key_head_dim, s.value_head_dim, s.conv_kernel)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        h, nk, nv, dk, dv, K = self._dims()
        conv = 2 * nk * dk + nv * dv
        if self.hf_format == "qwen3_5":
            shapes = {"in_proj_qkv.weight": (conv, h), "in_proj_z.weight": (nv * dv, h),
                      "in_proj_b.weight": (nv, h), "in_proj_a.weight": (nv, h)}
        else:
            shapes = {"in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, h), "in_proj_ba.weight": (2 * nv, h)}
        return {**shapes, "conv1d.weight": (conv, 1, K), "dt_bias": (nv,), "A_log": (nv,),
                "out_proj.weight": (h, nv * dv)}

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice | HFRanges]:
        p = self.comm.rank if rank is None else rank
        s = self.spec
        h, nk, nv, dk, dv, K = self._dims()
        kb, vb = s.key_heads_per_block, s.value_heads_per_block
        qkv = HFRanges(((0, p * kb * dk, kb * dk), (0, nk * dk + p * kb * dk, kb * dk),
                        (0, 2 * nk * dk + p * vb * dv, vb * dv)))
        slices = {"conv1d.weight": qkv, "dt_bias": (0, p * vb, vb), "A_log": (0, p * vb, vb),
                  "out_proj.weight": (1, p * vb * dv, vb * dv)}
        if self.hf_format == "qwen3_5":
            slices.update({"in_proj_qkv.weight": qkv, "in_proj_z.weight": (0, p * vb * dv, vb * dv),
                           "in_proj_b.weight": (0, p * vb, vb), "in_proj_a.weight": (0, p * vb, vb)})
        else:
            slices.update({"in_proj_qkvz.weight": (0, p * kb * s.group_rows, kb * s.group_rows),
                           "in_proj_ba.weight": (0, p * 2 * vb, 2 * vb)})
        return slices

    def _views(self, packed: torch.Tensor) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        """HF name -> view(s) of a packed shard, in hf_slices' order (a tuple for HFRanges)."""
        s, v = self.spec, self.spec.layout.unpack(packed)
        kd, vd = s.key_heads_per_block * s.key_head_dim, s.value_heads_per_block * s.value_head_dim

        def qkv_ranges(t):
            return (t[:kd], t[kd:2 * kd], t[2 * kd:2 * kd + vd])

        views = {"conv1d.weight": qkv_ranges(v["conv"]), "dt_bias": v["dt_bias"], "A_log": v["A_log"],
                 "out_proj.weight": v["out"]}
        if self.hf_format == "qwen3_5":
            views.update({"in_proj_qkv.weight": qkv_ranges(v["qkv"]), "in_proj_z.weight": v["z"],
                          "in_proj_b.weight": v["b"], "in_proj_a.weight": v["a"]})
        else:
            views.update({"in_proj_qkvz.weight": v["qkvz"], "in_proj_ba.weight": v["ba"]})
        return views

    def hf_targets(self, packed: torch.Tensor) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        return self._views(packed)

    def pack_slices(self, pieces: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """This rank's packed shard from its slices (an HFRanges name: a tuple of its ranges' tensors)."""
        packed = torch.empty(self.spec.layout.numel, dtype=next(iter(_flat(pieces.values()))).dtype,
                             device=next(iter(_flat(pieces.values()))).device)
        targets = self._views(packed)
        for name, target in targets.items():
            for out, src in zip(_as_tuple(target), _as_tuple(pieces[name]), strict=True):
                out.copy_(src)
        return packed

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        def cut(name, where):
            if isinstance(where, HFRanges):
                return tuple(full[name].narrow(d, a, n) for d, a, n in where)
            d, a, n = where
            return full[name].narrow(d, a, n)

        return self.pack_slices({name: cut(name, where) for name, where in self.hf_slices().items()})

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's packed shard (rank order) -> the HF-named full tensors."""
        per_rank = [self._views(s) for s in shards]
        out = {}
        for name, shape in self.hf_shapes().items():
            t = shards[0].new_empty(shape)
            for rank, views in enumerate(per_rank):
                where = self.hf_slices(rank)[name]
                for (d, a, n), view in zip(_as_ranges(where), _as_tuple(views[name]), strict=True):
                    t.narrow(d, a, n).copy_(view)
            out[name] = t
        return out

    def sharded_modules(self, prefix: str = "") -> list[tuple[str, "TSPGatedDeltaNet", nn.Parameter]]:
        return [(prefix, self, self.packed_shard)]

    def replicated_params(self, prefix: str = "") -> dict[str, nn.Parameter]:
        return {f"{prefix}norm.weight": self.norm.weight}

    def parameter_bytes(self) -> dict[str, int]:
        """{"sharded": bytes of this rank's packed shard, "replicated": bytes of the gated-norm weight}."""
        return {"sharded": self.packed_shard.numel() * self.packed_shard.element_size(),
                "replicated": self.norm.weight.numel() * self.norm.weight.element_size()}

    def extra_repr(self) -> str:
        s = self.spec
        return (f"key_heads/block={s.key_heads_per_block}, value_heads/block={s.value_heads_per_block}, "
                f"dk={s.key_head_dim}, dv={s.value_head_dim}, conv={s.conv_kernel}, format={self.hf_format}, "
                f"tsp_rank={self.comm.rank}/{self.comm.size}")


def _as_tuple(t):
    return t if isinstance(t, tuple) else (t,)


def _as_ranges(where):
    return where if isinstance(where, HFRanges) else (where,)


def _flat(values):
    for v in values:
        yield from _as_tuple(v)
