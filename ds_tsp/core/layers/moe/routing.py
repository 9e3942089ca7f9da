"""Top-k routing exactly as transformers computes it, and this rank's routed rows sorted by expert.

transformers (Qwen3MoeTopKRouter, MixtralTopKRouter): logits = x W_router^T in x.dtype; probabilities =
softmax(logits) in float32 (also for a float64 model); top-k of the probabilities (torch.topk: ties broken the same
way); renormalised to sum 1 if norm_topk_prob (Mixtral always); cast to the logits' dtype. Plain autograd ops, so
the router gradient flows through the routing weights exactly as in transformers. (Mixtral keeps the weights in
float32 and lets the product promote; for float32 / float64 models that is the same number.)

A "row" is one (token, slot) pair: rank-local flat index token * top_k + slot, N * top_k of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def route(x2d: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
          router_bias: torch.Tensor | None = None, routing: str = "softmax_topk"):
    """x2d [N, h] -> (router_logits [N, E] in x.dtype, routing weights [N, k] in x.dtype, expert ids [N, k]).
    routing "topk_softmax" (GPT-OSS's GptOssTopKRouter): logits with the router's bias, their top-k, and the
    softmax over those k values in the logits' own dtype (norm_topk_prob is implied)."""
    logits = F.linear(x2d, router_weight, router_bias)
    if routing == "topk_softmax":
        top_v, top_i = torch.topk(logits, top_k, dim=-1)
        return logits, torch.softmax(top_v, dim=-1, dtype=top_v.dtype), top_i
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_p, top_i = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    return logits, top_p.to(logits.dtype), top_i


@dataclass
class ExpertOrder:
    """This rank's rows sorted by expert (fixed size N * k; computed on the device, no host sync).

    order [N*k]: row indices (token * k + slot), stable-sorted by expert id, so expert e's rows are
    order[ends[e] - counts[e] : ends[e]], and the rows of the experts owner p holds are contiguous.
    counts [E] (int64, device): rows per expert.
    """

    order: torch.Tensor
    counts: torch.Tensor
    top_k: int

    @classmethod
    def of(cls, top_i: torch.Tensor, num_experts: int) -> "ExpertOrder":
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        return cls(order, counts, top_i.shape[-1])

    def tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """Local token index of each row index."""
        return torch.div(rows, self.top_k, rounding_mode="floor")
