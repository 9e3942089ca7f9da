"""The loss reductions of a TSP model: what each rank's share of the loss is divided by, and what it is shown as.

A rank's loss share is its tokens' part of the mean loss over the global batch (data x TSP, and cp): the shares of
a TSP group sum to the group's part, and data-parallel engines average the groups' gradients. These functions give
the denominator (labelled tokens over data x TSP), the values every rank logs (the global mean, the TSP group's
sum), and the MoE aux loss and router logits over the whole sequence. Each reduction keeps the gradient of the
share itself (value + (total - value).detach()), so backward stays exact.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_tsp.core.comm.communicator import TSPComm

__all__ = ["normalise_over_data", "count_valid_tokens", "global_loss", "tsp_group_loss", "loss_for_logging",
           "sequence_aux_loss", "gathered_router_logits"]


def normalise_over_data(n_valid_tsp: torch.Tensor, data_group: dist.ProcessGroup | None,
                        comm: TSPComm) -> torch.Tensor:
    """Loss denominator: labelled tokens of the whole data x TSP batch / data size (see set_data_parallel_group).
    The all-reduce is guarded by `comm`'s watchdog: a stalled data replica is reported, not waited for forever."""
    if data_group is None or dist.get_world_size(data_group) == 1:
        return n_valid_tsp
    total = n_valid_tsp.clone()
    with comm.guard("token count all_reduce over data", group=data_group, poll=total.device):
        dist.all_reduce(total, group=data_group)
    # float64: an int64 count / 3 (data x cp of 3) would divide in float32, 2e-8 off in a float64 loss
    return total.to(torch.float64) / dist.get_world_size(data_group)


def count_valid_tokens(shift_labels: torch.Tensor, comm: TSPComm, data_group=None) -> torch.Tensor:
    """normalise_over_data of the labelled tokens of this TSP group (for stages that see only the labels)."""
    n_valid = (shift_labels != -100).sum().to(torch.int64)
    comm.all_reduce(n_valid).wait()
    return normalise_over_data(n_valid, data_group, comm)


def tsp_group_loss(loss_share: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """Value: the shares summed over the TSP group (this data replica's part); gradient: this rank's share."""
    total = loss_share.detach().clone()
    if comm.size > 1:
        with comm.guard("loss all_reduce", context=comm.context or "loss for logging", poll=total.device):
            dist.all_reduce(total, group=comm.group)
    return loss_share + (total - loss_share).detach()


def loss_for_logging(loss_share: torch.Tensor, comm: TSPComm, data_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global mean loss (TSP shares summed, data replicas averaged), detached, identical on all ranks."""
    total = loss_share.detach().clone()
    context = comm.context or "loss for logging"
    if comm.size > 1:
        with comm.guard("loss all_reduce", context=context, poll=total.device):
            dist.all_reduce(total, group=comm.group)
    data_size = dist.get_world_size(data_group) if data_group is not None else 1
    if data_size > 1:
        with comm.guard("loss all_reduce over data", group=data_group, context=context, poll=total.device):
            dist.all_reduce(total, group=data_group)
        total /= data_size
    return total


def global_loss(loss_share: torch.Tensor, comm: TSPComm, data_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global mean loss as its value, this rank's share as its gradient (so backward stays exact).

    What an HF causal LM returns as `loss`: every rank prints what a single device would, and calling
    backward on it on every rank gives each rank exactly its own share of the gradients.
    """
    return loss_share + (loss_for_logging(loss_share, comm, data_group) - loss_share).detach()


def sequence_aux_loss(aux_share: torch.Tensor, comm: TSPComm) -> torch.Tensor:
    """Value: the MoE aux loss of this data replica's batch (the shares summed over the TSP group and, with a cp
    axis, the cp groups); gradient: this rank's share in the mean loss's convention (x cp_size: the data-parallel
    engine averages gradients over the cp groups, whose shares together make the sequence's loss)."""
    if comm.cp is None:
        return tsp_group_loss(aux_share, comm)
    total = tsp_group_loss(aux_share, comm).detach().clone()
    with comm.guard("aux loss all_reduce over cp", group=comm.cp.group, context=comm.context or "loss for logging",
                    poll=total.device):
        dist.all_reduce(total, group=comm.cp.group)
    scaled = aux_share * comm.cp_size
    return scaled + (total - scaled).detach()


@torch.no_grad()
def gathered_router_logits(router_logits: list, comm: TSPComm, local_shape, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Every sparse layer's router logits of the whole batch, [batch * seq_len, E] in sequence order as
    transformers returns them (all-gathered over the TSP group and, with a cp axis, the cp groups; zigzag undone,
    padding cut)."""
    from ds_tsp.core.tokens.input_check import over_cp
    from ds_tsp.core.tokens.zigzag import cp_unshard, unshard

    B, L = local_shape
    out = []
    for logits in router_logits:
        local = logits.detach().reshape(B, L, -1).contiguous()
        everyone = local[None]
        if comm.size > 1:
            everyone = torch.empty((comm.size, *local.shape), dtype=local.dtype, device=local.device)
            comm.all_gather(everyone, local).wait()
        if comm.cp is None:
            full = unshard(list(everyone.unbind(0)), dim=1)
        else:  # [C * D, B, L, E], cp-major
            groups = over_cp(comm, everyone).view(comm.cp.size, comm.size, *local.shape)
            full = cp_unshard([list(group.unbind(0)) for group in groups.unbind(0)], dim=1)
        out.append(full[:, :seq_len].reshape(B * seq_len, -1))
    return tuple(out)
