"""The peers' per-stage memory: model state held per rank plus the generic layer-stack phases."""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.tools.plan.inputs import PlanInput
from ds_tsp.tools.plan.memory import StackPhases, StageMemory, optimizer_bytes_per_param, stack_phases
from ds_tsp.tools.plan.shape_terms import Stage, ceil_div


@dataclass(frozen=True)
class PeerParams:
    """Elements one rank holds: per layer, the embedding, the LM head + final norm."""

    layer: int
    embed: int
    head: int

    def of_stage(self, inp: PlanInput, stage: Stage) -> tuple[int, int]:
        """(all params, LM head + final norm params) of this rank on `stage`."""
        params = stage.layers * self.layer + (self.embed if stage.embed else 0)
        head = self.head if stage.head and not (inp.model.tie_word_embeddings and stage.embed) else 0
        return params + head, head


@dataclass(frozen=True)
class PeerState:
    """How a framework keeps grads and optimizer state: divisors over the ranks that share them, fp32 grad
    buffers for the whole step (DeepSpeed), and extra persistent bytes per param held (framework copies)."""

    grads_div: int = 1
    opt_div: int = 1
    grad_bytes: int | None = None  # None: dtype
    persistent_grads: bool = False
    framework_per_param: float = 0.0  # bytes per held param (divided by opt_div) kept by the framework
    framework_fixed: int = 0  # e.g. ZeRO-3's reduce bucket
    backward_bucket: int = 0  # ZeRO-1/2's reduce bucket: allocated when backward produces its first grad


def peer_stage(inp: PlanInput, stage: Stage, *, params: PeerParams, how: PeerState, per_layer: int,
               layer_input: int, other_act: int, head_act: int, transients: dict[str, int], step_terms: list,
               head_grad_transient: int = 0, loss_saved: int = 0) -> StageMemory:
    """head_grad_transient / loss_saved: see StackPhases (used with how.backward_bucket)."""
    b = inp.dtype_bytes
    n, head_n = params.of_stage(inp, stage)
    gb = b if how.grad_bytes is None else how.grad_bytes
    grads = ceil_div(n, how.grads_div) * gb
    optimizer = ceil_div(n, how.opt_div) * optimizer_bytes_per_param(inp)
    framework = int(ceil_div(n, how.opt_div) * how.framework_per_param) + how.framework_fixed
    acts, phases = stack_phases(inp, StackPhases(
        layers=stage.layers, in_flight=stage.in_flight, per_layer=per_layer, layer_input=layer_input,
        other_act=other_act if stage.embed else 0, head_act=head_act if stage.head else 0,
        layer_grads=ceil_div(params.layer, how.grads_div) * gb, head_grads=ceil_div(head_n, how.grads_div) * gb,
        total_grads=grads,
        transients={k: v + (how.backward_bucket if k == "layer_bwd" else 0) for k, v in transients.items()
                    if stage.head or not k.startswith("lm_head")},
        persistent_grads=how.persistent_grads,
        head_grad_transient=(how.backward_bucket + head_grad_transient) if how.backward_bucket else 0,
        loss_saved=loss_saved))
    return StageMemory(params=n * b, grads=grads, optimizer=optimizer, activations=acts, phases=phases,
                       framework=framework, step_terms=list(step_terms))
