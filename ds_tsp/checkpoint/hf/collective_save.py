"""What every collective save shares (the HF checkpoint of hf_save, the PEFT adapter of peft_adapter): this rank's
whole TSP shard under ZeRO-3 / FSDP2, who writes, and the outcome agreed by every rank so that a failure on the
writer raises the same error everywhere instead of stranding the others in their next collective."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.reliability.watchdog import guarded

CONTEXT = "save"  # the layer a stalled collective's report names


@contextlib.contextmanager
def whole_on_this_rank(param: torch.nn.Parameter, comm=None, what: str = "save: data-axis gather of a shard"):
    """This rank's whole TSP shard for the duration: under ZeRO-3 (partitioned over the data axis) gathered, under
    FSDP2 (a DTensor sharded over the data mesh) its full_tensor(); both collective over the data axis, bounded by
    comm's timeout_s when a comm is given."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with contextlib.ExitStack() as stack:
            with guarded(comm, what, context=CONTEXT):
                stack.enter_context(deepspeed.zero.GatheredParameters([param], modifier_rank=None))
            yield param.detach()
    elif hasattr(param, "full_tensor"):
        with guarded(comm, what, context=CONTEXT):
            whole = param.detach().full_tensor()
        yield whole
    else:
        yield param.detach()


def is_writer() -> bool:
    """Global rank 0 writes every checkpoint file (and is TSP rank 0 of its group, where the gathers land)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def agree_on_outcome(failure: str | None, directory: Path, comm=None) -> None:
    """Collective over every rank: the writer's failure (or None) broadcast, raised on every rank alike."""
    outcome = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        with guarded(comm, "save_pretrained: broadcast of the outcome", context=CONTEXT):
            dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise TSPConfigError(f"save_pretrained({str(directory)!r}) failed on {outcome[0]}; the previous checkpoint "
                             "there (if any) is untouched")
