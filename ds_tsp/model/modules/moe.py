"""The sparse MoE block of a Qwen3-MoE / Mixtral / GLM-4.5 decoder layer under TSP: rank p owns experts
[p*E_r, (p+1)*E_r) whole (E_r = E/D), packed in one flat parameter, and the router [E, h] replicated.

| parameter            | shape                          | sharding                                                   |
|----------------------|--------------------------------|------------------------------------------------------------|
| mlp.gate.weight      | [E, h]                         | replicated, grads summed over the TSP group               |
| (GPT-OSS) mlp.router.weight, .bias [E] | [E, h], [E]  | replicated, grads summed over the TSP group               |
| (GPT-OSS) experts_shard | + gate_up_bias [E_r, 2F], down_bias [E_r, h] | its fused [E, ...] tensors' rows of rank p |
| mlp.experts_shard    | [E_r * (2F*h + h*F)]           | experts of rank p: gate_up [E_r, 2F, h], down [E_r, h, F] |
| mlp.shared_expert    | packed_shard [3 * h * Fs/D]    | Qwen3-Next / Qwen3.5-MoE: a TSPGatedMLP of width Fs, 1/D   |
| mlp.shared_expert_gate.weight | [1, h]                | replicated, grads summed over the TSP group               |
| mlp.gate.e_score_correction_bias | [E]                | GLM-4.5: a replicated buffer (float32; float64 models: 64) |

Checkpoint names are the ones transformers writes (ds_tsp.checkpoint.hf.moe_names: one tensor per expert, Mixtral's
under block_sparse_moe.); this rank's slices are the whole tensors of ITS experts only, so loading and saving move
1/D of the layer. The forward returns (y, router_logits); ds_tsp.core.layers.moe.layer does the routing and dispatch.
With a shared expert (ModelShape.shared_expert_intermediate_size > 0), y += sigmoid(x @ shared_expert_gate.T) *
shared_expert(x), as transformers' Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock; the shared expert is its own
sharded piece (TSPDecoderLayer.sharded_modules lists it under `mlp.shared_expert.`). GLM-4.5's shared experts
(`mlp.shared_experts.`) have no gate: y += shared_expert(x), and its router routes by grouped sigmoid scores with the
correction bias buffer (ds_tsp.core.layers.moe.routing).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ds_tsp.checkpoint.hf.moe_names import GPT_OSS_EXPERTS, MoENames
from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.comm.primitives import replicated_param
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.grads.clip import mark_sharded
from ds_tsp.core.layers.moe.experts import ExpertGLU
from ds_tsp.core.layers.moe.layer import MoESpec, choose_moe_dispatch, moe_compute_dtype, tsp_moe_mlp
from ds_tsp.core.shape.model_shape import ModelShape

HFSlice = tuple[int, int, int]


class Router(nn.Module):
    """The replicated router (transformers' `gate`, GPT-OSS's `router`): logits = x @ weight.T (+ bias), weight
    [E, h], bias [E] (GPT-OSS). With correction_bias (GLM-4.5) it holds the choice bias buffer
    e_score_correction_bias [E], in float32 as transformers keeps it (float64 in a float64 model)."""

    def __init__(self, num_experts: int, hidden: int, dtype, device, bias: bool = False,
                 correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device)) if bias else None
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=wide, device=device)
                             if correction_bias else None)


class TSPSparseMoE(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, options, dtype, device,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        self.comm, self.dispatch = comm, options.moe_dispatch
        self.names = MoENames(shape.moe_family)
        self.spec = MoESpec(hidden=shape.hidden_size, moe_ffn=shape.moe_intermediate_size,
                            num_experts=shape.num_experts, experts_per_rank=shape.num_experts // comm.size,
                            top_k=shape.num_experts_per_tok, norm_topk_prob=shape.norm_topk_prob,
                            recompute_projections=options.recompute_projections,
                            glu=ExpertGLU(shape.expert_activation, shape.swiglu_alpha, shape.swiglu_limit),
                            biases=shape.moe_biases, routing=shape.moe_routing, groups=shape.moe_groups,
                            topk_groups=shape.moe_topk_groups, scaling=shape.routed_scaling_factor)
        self.fused = shape.moe_family == "gpt_oss"  # one [E, ...] tensor per kind in the checkpoint (moe_names)
        self.gate = Router(shape.num_experts, shape.hidden_size, dtype, device, bias=shape.moe_biases,
                           correction_bias=shape.moe_routing == "sigmoid_grouped")
        self.experts_shard = mark_sharded(nn.Parameter(
            torch.zeros(self.spec.layout.numel, dtype=dtype, device=device)))
        self.lora = None  # LoRA does not target experts (no per-expert linear modules in transformers 5)
        # Qwen3-Next / Qwen3.5-MoE / GLM-4.5: the caller builds the shared expert (a TSPGatedMLP of
        # shared_expert_intermediate_size, see shared_expert_shape), this block owns its [1, h] gate (none: GLM)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shape.shared_expert_intermediate_size:
            if shared_expert is None:
                raise TSPConfigError("shared_expert_intermediate_size > 0 needs the shared expert module: build "
                                     "TSPSparseMoE through TSPDecoderLayer (ds_tsp.model.modules.decoder)")
            if shape.shared_expert_gate:
                self.shared_expert_gate = Router(1, shape.hidden_size, dtype, device)  # [1, h], replicated

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, h] -> (y [B, L, h], router_logits [B*L, E]); dispatch "auto" resolved for this batch shape
        (the same answer on every rank: it depends only on shapes)."""
        s = self.spec
        # bytes in the dtype the dispatch really sends (the autocast dtype under autocast)
        sent = moe_compute_dtype(x.device.type, x.dtype)
        dispatch = choose_moe_dispatch(self.dispatch, x.shape[0] * x.shape[1], s.hidden, s.moe_ffn, s.num_experts,
                                       s.top_k, self.comm.size, torch.finfo(sent).bits // 8, s.biases)
        bias = None if self.gate.bias is None else replicated_param(self.gate.bias, self.comm)
        y, logits = tsp_moe_mlp(x, replicated_param(self.gate.weight, self.comm), self.experts_shard, s, self.comm,
                                dispatch=dispatch, correction_bias=self.gate.e_score_correction_bias,
                                router_bias=bias)
        if self.shared_expert_gate is not None:
            scale = torch.sigmoid(F.linear(x, replicated_param(self.shared_expert_gate.weight, self.comm)))
            y = y + scale * self.shared_expert(x)
        elif self.shared_expert is not None:  # GLM-4.5: added unscaled
            y = y + self.shared_expert(x)
        return y, logits

    # --- checkpoint protocol (ds_tsp.model.modules.decoder) -------------------------------------------------
    def _experts(self, rank: int) -> range:
        e = self.spec.experts_per_rank
        return range(rank * e, (rank + 1) * e)

    def router_name(self) -> str:
        return self.names.router()

    def replicated_buffers(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """HF-named buffers every rank holds whole, read from and saved to the checkpoint (GLM-4.5's bias)."""
        bias = self.gate.e_score_correction_bias
        return {} if bias is None else {prefix + self.names.correction_bias(): bias}

    def router_params(self) -> dict[str, nn.Parameter]:
        """The router's HF-named (relative to the layer) replicated params."""
        out = {self.names.router(): self.gate.weight}
        if self.gate.bias is not None:
            out[self.names.router_bias()] = self.gate.bias
        return out

    # GPT-OSS: rank p's part of every fused tensor is its experts' rows [p*E_r, (p+1)*E_r) of dim 0, and each is a
    # view of the packed experts (gate_up / down transposed per expert, the biases as they are)
    def _fused_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f, e = self.spec.hidden, self.spec.moe_ffn, self.spec.num_experts
        kinds = {"gate_up_proj": (e, h, 2 * f), "down_proj": (e, f, h), "gate_up_proj_bias": (e, 2 * f),
                 "down_proj_bias": (e, h)}
        return {self.names.fused(k): kinds[k] for k in GPT_OSS_EXPERTS}

    def _fused_views(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        views = self.spec.layout.unpack(packed)
        return {self.names.fused("gate_up_proj"): views["gate_up"].transpose(1, 2),
                self.names.fused("down_proj"): views["down"].transpose(1, 2),
                self.names.fused("gate_up_proj_bias"): views["gate_up_bias"],
                self.names.fused("down_proj_bias"): views["down_bias"]}

    def _fused_pack(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.spec.layout.pack({
            "gate_up": pieces[self.names.fused("gate_up_proj")].transpose(1, 2),
            "down": pieces[self.names.fused("down_proj")].transpose(1, 2),
            "gate_up_bias": pieces[self.names.fused("gate_up_proj_bias")],
            "down_bias": pieces[self.names.fused("down_proj_bias")]})

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.fused:
            return self._fused_shapes()
        h, f = self.spec.hidden, self.spec.moe_ffn
        shapes = {}
        for i in range(self.spec.num_experts):
            shapes.update({self.names.expert(i, 0): (f, h), self.names.expert(i, 1): (f, h),
                           self.names.expert(i, 2): (h, f)})
        return shapes

    def hf_slices(self, rank: int | None = None) -> dict[str, HFSlice]:
        """The whole tensors of this rank's experts (and nothing of the others')."""
        p = self.comm.rank if rank is None else rank
        if self.fused:
            e = self.spec.experts_per_rank
            return {name: (0, p * e, e) for name in self._fused_shapes()}
        h, f = self.spec.hidden, self.spec.moe_ffn
        return {self.names.expert(i, w): (0, 0, f if w < 2 else h) for i in self._experts(p) for w in range(3)}

    def hf_targets(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.fused:
            return self._fused_views(packed)
        views, f = self.spec.layout.unpack(packed), self.spec.moe_ffn
        out = {}
        for j, i in enumerate(self._experts(self.comm.rank)):
            out[self.names.expert(i, 0)] = views["gate_up"][j, :f]
            out[self.names.expert(i, 1)] = views["gate_up"][j, f:]
            out[self.names.expert(i, 2)] = views["down"][j]
        return out

    def pack_slices(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.fused:
            return self._fused_pack(pieces)
        experts = self._experts(self.comm.rank)
        gate_up = torch.stack([torch.cat((pieces[self.names.expert(i, 0)], pieces[self.names.expert(i, 1)]))
                               for i in experts])
        down = torch.stack([pieces[self.names.expert(i, 2)] for i in experts])
        return self.spec.layout.pack({"gate_up": gate_up, "down": down})

    def shard_full(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.pack_slices({name: full[name] for name in self.hf_slices()})

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's packed experts -> one tensor per expert (GPT-OSS: per kind), in transformers' saved layout."""
        if self.fused:
            per_rank = [self._fused_views(shard) for shard in shards]
            return {name: torch.cat([views[name] for views in per_rank]) for name in self._fused_shapes()}
        f, out = self.spec.moe_ffn, {}
        for rank, shard in enumerate(shards):
            views = self.spec.layout.unpack(shard)
            for j, i in enumerate(self._experts(rank)):
                out[self.names.expert(i, 0)] = views["gate_up"][j, :f]
                out[self.names.expert(i, 1)] = views["gate_up"][j, f:]
                out[self.names.expert(i, 2)] = views["down"][j]
        return out

    def extra_repr(self) -> str:
        s = self.spec
        return (f"experts={s.num_experts} ({s.experts_per_rank}/rank), top_k={s.top_k}, moe_ffn={s.moe_ffn}, "
                f"dispatch={self.dispatch}, tsp_rank={self.comm.rank}/{self.comm.size}")


def shared_expert_shape(shape: ModelShape) -> ModelShape:
    """The shape whose dense MLP is the shared expert (its width: shared_expert_intermediate_size)."""
    return dataclasses.replace(shape, intermediate_size=shape.shared_expert_intermediate_size)
