"""Each rank's differentiable share of transformers' load-balancing loss over the GLOBAL batch.

transformers (load_balancing_loss_func) over all sparse layers' router logits:
    loss = E * sum_e (c_e / T) * (P_e / T)
c_e: top-k assignments to expert e, P_e: summed softmax probabilities of e, T: routed rows (attention_mask-weighted),
each summed over the layers and the whole batch. c_e and T are not differentiable, so with the GLOBAL c_e and T
(one all-reduce per call) rank r's share E * sum_e c_e * P_e^(r) / T^2, with P_e^(r) over its own tokens, sums
over the TSP group to the loss, and its gradient w.r.t. its logits is the true one.
With a cp axis (tsp.cp_size = C > 1) the batch transformers sees is the whole sequence, split over C TSP groups:
c_e and T are all-reduced once more over the cp group (TSP rank p of every group), so the shares of all C x D
ranks sum to the loss of the sequence; the data axis stays as it is (each data replica's loss over its own rows,
as transformers computes it per process). Two small all-reduces, TSP then cp, in that order on every rank; no
host read.
Precision: transformers accumulates in float32; here in float32 or the logits' dtype if wider (float64 models stay
float64), so against transformers' own function the agreement is float32's.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import TSPComm


def moe_aux_loss_share(router_logits: list[torch.Tensor], num_experts: int, top_k: int, comm: TSPComm,
                       token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's differentiable share of transformers' load_balancing_loss_func over the GLOBAL batch: the shares of
    the TSP group sum to HF's value (all sparse layers' logits concatenated, as HF does; token_mask [N_local] (1 = real
    token, from attention_mask) weights the means as HF's attention_mask does). Per-expert counts (and the row
    total) are all-reduced over the TSP group and, with a cp axis, over comm.cp: the shares of every rank of the
    sequence (cp x TSP) sum to HF's value."""
    first = router_logits[0]
    acc = torch.promote_types(torch.float32, first.dtype)
    counts = torch.zeros(num_experts, dtype=acc, device=first.device)
    prob_sum = torch.zeros(num_experts, dtype=acc, device=first.device)
    rows = torch.zeros((), dtype=acc, device=first.device)
    mask = None if token_mask is None else token_mask.reshape(-1).to(acc)
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        if mask is None:
            hits = torch.ones(selected.shape, dtype=acc, device=selected.device)
            counts = counts.scatter_add(0, selected, hits)
            prob_sum = prob_sum + probs.to(acc).sum(dim=0)
            rows = rows + logits.shape[0]
        else:
            hits = mask[:, None].expand(-1, top_k).reshape(-1)
            counts = counts.scatter_add(0, selected, hits)
            prob_sum = prob_sum + (probs.to(acc) * mask[:, None]).sum(dim=0)
            rows = rows + mask.sum()
    totals = torch.cat([counts, rows.reshape(1)])
    comm.all_reduce(totals, what="moe aux loss counts").wait()
    if comm.cp is not None:  # the cp groups hold the rest of the sequence: its counts complete the statistic
        comm.cp_axis().all_reduce(totals, what="moe aux loss counts over cp").wait()
    counts, rows = totals[:-1], totals[-1]
    return num_experts * (counts * prob_sum).sum() / (rows * rows)
