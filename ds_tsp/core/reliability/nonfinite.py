"""NaN / inf losses and gradients: detected on every rank in the same step, then fail loudly or skip the step.

Gradients are watched by a hook on every parameter that ORs `~isfinite(grad).all()` into a flag tensor as the
grads are produced (before DeepSpeed, FSDP or the TSP rings move them), so there is no device-to-host sync during
backward. `check(loss, step)` is the one collective: the flags and the loss flag are max-reduced over the whole
job, so every rank takes the same decision. That all-reduce is guarded like every TSP collective (the model's
`comm` gives timeout_s): a stalled or dead rank ends the others with the watchdog's one line naming it, never
gloo's raw timeout traceback. The default raises TSPNonFiniteError naming the step and the first
offending parameter; with the "tsp" block's `"on_nonfinite": "skip"` it returns False instead (the caller zeroes
the grads and does not step, so weights and optimizer state are untouched) and says so on rank 0's stderr.

    guard = NonFiniteGuard(model, policy="skip")
    loss = model(...); loss.backward()
    if guard.check(loss, step): optimizer.step()
    optimizer.zero_grad()
"""
from __future__ import annotations

import sys
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.core.errors import TSPConfigError, TSPNonFiniteError
from ds_tsp.core.reliability.watchdog import guard

POLICIES = ("error", "skip")


class NonFiniteGuard:
    def __init__(self, model: nn.Module, *, policy: str = "error", group=None, comm=None):
        """comm: the TSPComm whose timeout_s (and layer context) bounds the check's all-reduce; default the
        model's own (the first module holding one)."""
        if policy not in POLICIES:
            raise TSPConfigError(f"on_nonfinite={policy!r}: choose one of {POLICIES}")
        self.policy, self.group = policy, group
        self.comm = comm if comm is not None else next(
            (m.comm for m in model.modules() if hasattr(getattr(m, "comm", None), "timeout_s")), None)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        device = named[0][1].device if named else torch.device("cpu")
        self.flags = torch.zeros(len(named) + 1, dtype=torch.uint8, device=device)  # last slot: the loss
        self._handles = [p.register_hook(partial(self._watch, i)) for i, (_, p) in enumerate(named)]
        self.skipped_steps: list[int] = []

    def _watch(self, index: int, grad: torch.Tensor) -> None:
        bad = ~torch.isfinite(grad).all()
        self.flags[index].bitwise_or_(bad.to(torch.uint8))

    def check(self, loss: torch.Tensor | float, step: int) -> bool:
        """Collective over the job (or `group`): True when this step's loss and every gradient are finite."""
        loss = torch.as_tensor(loss, device=self.flags.device).detach()
        self.flags[-1].bitwise_or_((~torch.isfinite(loss).all()).to(torch.uint8))
        flags = self.flags.clone()
        self.flags.zero_()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            # over the whole job: the peers named in a stall report are the group's other ranks (world by default)
            group = self.group if self.group is not None else dist.group.WORLD
            timeout_s = self.comm.timeout_s if self.comm is not None else None
            with guard("non-finite check all_reduce", timeout_s=timeout_s, group=group, comm=self.comm,
                       context=f"step {step} non-finite check"):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
                finite = not bool(flags.any())  # the host sync: on NCCL the wait happens here, so inside the guard
        else:
            finite = not bool(flags.any())
        if finite:
            return True
        bad = flags[:-1].nonzero()
        what = ["the loss is non-finite" if flags[-1] else "the loss is finite"]
        if bad.numel():
            what.append(f"first non-finite gradient: {self.names[int(bad[0])]} ({bad.numel()} parameters)")
        message = f"step {step}: non-finite values ({'; '.join(what)})"
        if self.policy == "error":
            raise TSPNonFiniteError(message + '; set the "tsp" block\'s "on_nonfinite": "skip" to skip such steps')
        self.skipped_steps.append(step)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"ds_tsp: {message}: step skipped, weights and optimizer state untouched", file=sys.stderr,
                  flush=True)
        return False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
