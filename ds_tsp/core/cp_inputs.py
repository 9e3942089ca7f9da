"""What the model's input check adds with a cp axis: the whole sequence's facts.

Every layer kind runs under cp: dense, mixture-of-experts (experts dispatched inside each TSP group, as TSP alone;
the load-balancing loss's counts reduced over cp x TSP, ds_tsp.core.functions.moe_aux), sliding-window
(ds_tsp.core.cp_window) and hybrid (Gated DeltaNet: ds_tsp.core.linear_attention_scan) models.

The input check gathers a fixed-size payload over the TSP group (ds_tsp.model.sharded_causal_lm._check_inputs).
With cp groups (tsp.cp_size > 1) the packed-document layout is a fact of the whole sequence, so the TSP group's
gathered payloads are all-gathered once more over the cp ring's group (`over_cp`) and decoded with the two-level
chunk map (`held_chunks`): every rank gets the GLOBAL DocumentLayout, which ds_tsp.core.cp_ring maps to each
group's buffers. One more small all-gather per step, no extra host read.
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.partition import cp_global_chunks, cp_unshard

__all__ = ["over_cp", "held_chunks", "full_fields"]


def over_cp(comm: TSPComm, gathered: torch.Tensor) -> torch.Tensor:
    """The TSP group's gathered [D, ...] tensor, all-gathered over the cp ring's group: [C * D, ...], cp-major."""
    cp = comm.cp_axis()
    out = torch.empty((cp.size, *gathered.shape), dtype=gathered.dtype, device=gathered.device)
    cp.all_gather(out, gathered.contiguous(), what="input check over cp").wait()
    return out.reshape(cp.size * gathered.shape[0], *gathered.shape[1:])


def held_chunks(comm: TSPComm) -> list[tuple[int, int]]:
    """The two global chunks (of 2 * C * D) of every rank of the sequence, cp-major (what over_cp returns)."""
    C, D = comm.cp.size, comm.size
    return [cp_global_chunks(D, p, C, i) for i in range(C) for p in range(D)]


def full_fields(comm: TSPComm, gathered: torch.Tensor) -> torch.Tensor:
    """Every rank's [fields, B, L] gathered over TSP ([D, fields, B, L]) and cp, back in global order:
    [fields, B, S_pad]."""
    everyone = over_cp(comm, gathered).view(comm.cp.size, comm.size, *gathered.shape[1:])
    return cp_unshard([list(group.unbind(0)) for group in everyone.unbind(0)], dim=2)


def check_cp_integration(cp_size: int, where: str) -> None:
    """An integration that does not split sequences over cp groups yet refuses cp_size > 1 before any group is built
    (its batches, token counts and metrics would be cut for TSP alone)."""
    if cp_size > 1:
        raise TSPConfigError(
            f"tsp.cp_size={cp_size} with {where}: its batches, token counts and metrics are not split over cp "
            "groups yet; train with TSPTrainer or TSPAccelerator (plain, FSDP2 or DeepSpeed), ds_tsp.initialize "
            "(DeepSpeed ZeRO 0-3 over data x cp) or ds_tsp.shard_with_fsdp2 (FSDP2 over data x cp), or set cp_size "
            "to 1")
