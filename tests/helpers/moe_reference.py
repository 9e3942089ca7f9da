"""transformers' own sparse MoE blocks as the single-device reference for the TSP MoE MLP (a helper module for the
tests/moe/test_moe_*.py files; nothing here is collected).

A case is (family, E, top_k, norm_topk_prob, hidden, F, seed, tokens); the reference block is built from a tiny
config in float64 with random weights (transformers leaves the fused expert weights uninitialised and the Qwen3
router at zero). `tsp_case` runs one rank's share through ds_tsp.core.layers.moe.layer.tsp_moe_mlp and returns its
local outputs and grads; `assemble` puts the ranks' pieces back together for comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_tsp.core.tokens.zigzag import shard, unshard


@dataclass(frozen=True)
class MoECase:
    family: str = "qwen3_moe"  # or "mixtral"
    num_experts: int = 8
    top_k: int = 2
    norm_topk_prob: bool = True
    hidden: int = 16
    ffn: int = 8
    seed: int = 0
    batch: int = 2
    chunk: int = 3  # tokens per zigzag chunk: S = 2 * D * chunk
    skew: tuple = ()  # experts whose router rows are boosted: most tokens go there (some experts get none)
    one_expert_rank: int = -1  # this rank's tokens all route to one expert (top_k == 1 then) -- x made so

    def seq(self, tsp: int) -> int:
        return 2 * tsp * self.chunk


def hf_block(case: MoECase):
    """transformers' sparse MoE block for `case`, float64, random weights (seeded)."""
    if case.family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(hidden_size=case.hidden, intermediate_size=case.ffn, num_local_experts=case.num_experts,
                               num_experts_per_tok=case.top_k, router_jitter_noise=0.0)
        block = MixtralSparseMoeBlock(config)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=case.hidden, moe_intermediate_size=case.ffn, num_experts=case.num_experts,
                                num_experts_per_tok=case.top_k, norm_topk_prob=case.norm_topk_prob)
        block = Qwen3MoeSparseMoeBlock(config)
    block = block.to(torch.float64)
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        for e in case.skew:
            block.gate.weight[e] *= 4.0
    return block


def inputs(case: MoECase, tsp: int) -> dict[str, torch.Tensor]:
    """Global x [B, S, h], dy [B, S, h], d router_logits [B, S, E] (seeded, float64)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    s = case.seq(tsp)
    x = torch.randn(case.batch, s, case.hidden, generator=g, dtype=torch.float64)
    if case.one_expert_rank >= 0:  # every token of that rank's shard = a positive multiple of one vector
        scale = torch.rand(case.batch, s, 1, generator=g, dtype=torch.float64) + 0.5
        one = scale * torch.randn(case.hidden, generator=g, dtype=torch.float64)
        x = torch.where(_held_by(case, tsp, min(case.one_expert_rank, tsp - 1))[None, :, None], one, x)
    return {"x": x, "dy": torch.randn(x.shape, generator=g, dtype=torch.float64),
            "dlogits": torch.randn(case.batch, s, case.num_experts, generator=g, dtype=torch.float64)}


def _held_by(case: MoECase, tsp: int, rank: int) -> torch.Tensor:
    """[S] bool: the global positions rank `rank` holds."""
    held = torch.zeros(case.seq(tsp), dtype=torch.bool)
    held[shard(torch.arange(case.seq(tsp))[None], tsp, rank)[0]] = True
    return held


def reference(case: MoECase, tsp: int) -> dict[str, torch.Tensor]:
    """transformers' y, router_logits and every gradient of sum(y * dy) + sum(logits * dlogits)."""
    block = hf_block(case)
    data = inputs(case, tsp)
    x = data["x"].clone().requires_grad_(True)
    y = block(x)
    logits = block.gate(x.reshape(-1, case.hidden))[0]
    ((y * data["dy"]).sum() + (logits * data["dlogits"].reshape(logits.shape)).sum()).backward()
    return {"y": y.detach(), "logits": logits.detach().view(case.batch, -1, case.num_experts), "dx": x.grad,
            "d_router": block.gate.weight.grad, "d_gate_up": block.experts.gate_up_proj.grad,
            "d_down": block.experts.down_proj.grad}


def spec_of(case: MoECase, tsp: int, recompute: bool = True):
    from ds_tsp.core.layers.moe.layer import MoESpec

    return MoESpec(hidden=case.hidden, moe_ffn=case.ffn, num_experts=case.num_experts,
                   experts_per_rank=case.num_experts // tsp, top_k=case.top_k,
                   norm_topk_prob=case.norm_topk_prob or case.family == "mixtral", recompute_projections=recompute)


def tsp_case(case: MoECase, comm, dispatch: str, recompute: bool = True, dtype=torch.float64) -> dict:
    """One rank's share: local y, logits and grads (the router grad unsummed: the caller sums over ranks)."""
    from ds_tsp.core.layers.moe.layer import tsp_moe_mlp

    tsp, rank = comm.size, comm.rank
    spec = spec_of(case, tsp, recompute)
    block = hf_block(case)
    e_r = spec.experts_per_rank
    own = slice(rank * e_r, (rank + 1) * e_r)
    packed = spec.layout.pack({"gate_up": block.experts.gate_up_proj[own].detach(),
                               "down": block.experts.down_proj[own].detach()}).to(dtype).requires_grad_(True)
    router = block.gate.weight.detach().clone().to(dtype).requires_grad_(True)
    data = {k: shard(v, tsp, rank).to(dtype) for k, v in inputs(case, tsp).items()}
    x = data["x"].clone().requires_grad_(True)
    y, logits = tsp_moe_mlp(x, router, packed, spec, comm, dispatch=dispatch)
    ((y * data["dy"]).sum() + (logits * data["dlogits"].reshape(logits.shape)).sum()).backward()
    d = spec.layout.unpack(packed.grad)
    return {"y": y.detach(), "logits": logits.detach().view(case.batch, -1, case.num_experts), "dx": x.grad,
            "d_router": router.grad, "d_gate_up": d["gate_up"], "d_down": d["down"]}


def assemble(parts: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's tsp_case result (rank order) -> the global tensors reference() returns."""
    return {"y": unshard([p["y"] for p in parts]), "logits": unshard([p["logits"] for p in parts]),
            "dx": unshard([p["dx"] for p in parts]), "d_router": sum(p["d_router"] for p in parts),
            "d_gate_up": torch.cat([p["d_gate_up"] for p in parts]), "d_down": torch.cat([p["d_down"] for p in parts])}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of a against the reference b."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def worst(got: dict, ref: dict) -> tuple[float, str]:
    errs = {k: rel_err(got[k], ref[k]) for k in ref}
    key = max(errs, key=errs.get)
    return errs[key], key
