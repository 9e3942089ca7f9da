"""Top-k routing exactly as transformers computes it, and this rank's routed rows sorted by expert.

transformers (Qwen3MoeTopKRouter, MixtralTopKRouter): logits = x W_router^T in x.dtype; probabilities =
softmax(logits) in float32 (also for a float64 model); top-k of the probabilities (torch.topk: ties broken the same
way); renormalised to sum 1 if norm_topk_prob (Mixtral always); cast to the logits' dtype. Plain autograd ops, so
the router gradient flows through the routing weights exactly as in transformers. (Mixtral keeps the weights in
float32 and lets the product promote; for float32 / float64 models that is the same number.)

GLM-4.5 (Glm4MoeTopkRouter, moe_routing "sigmoid_grouped", route_sigmoid_grouped): logits in float32 (x and the
router weight cast), scores = sigmoid(logits); the CHOICE uses scores + the correction bias (a buffer, no gradient):
the experts split into `groups` groups, each scored by the sum of its two best corrected scores, the `topk_groups`
best groups kept, the top-k corrected scores inside them chosen (torch.topk in the same calls, so ties fall the
same way); the weights are the UNcorrected scores of the chosen experts, renormalised (+ 1e-20) if norm_topk_prob,
times routed_scaling_factor. The router gradient flows through the gathered scores. A float64 model routes in
float64 (transformers' float64 reference is patched to match: ds_tsp.tools.hf_reference); no host read.

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


def route_sigmoid_grouped(x2d: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                          groups: int, topk_groups: int, norm_topk_prob: bool, scaling: float):
    """x2d [N, h], router_weight [E, h], correction_bias [E] -> (router_logits [N, E] in float32 (float64 for a float64
    model), routing weights [N, k] in x.dtype, expert ids [N, k]): GLM-4.5's grouped sigmoid routing."""
    wide = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    logits = F.linear(x2d.to(wide), router_weight.to(wide))
    scores = logits.sigmoid()
    choice = scores.detach() + correction_bias.to(wide)
    n, e = choice.shape
    group_scores = choice.view(n, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, groups]
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    kept = kept.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)
    top_i = torch.topk(choice.masked_fill(~kept, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_i)
    if norm_topk_prob:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, (top_w * scaling).to(x2d.dtype), top_i


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
