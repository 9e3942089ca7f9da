"""Memory assembly shared by every layout: model state per rank and the peak over the phases of one step.

    peak = params + optimizer + framework + max over phases (activations alive + grads alive + transients)

- params in `dtype`; optimizer AdamW with 2 fp32 states (m, v) = 8 B/param, plus a 4 B fp32 master copy when
  dtype is bf16/fp16 (mixed precision as DeepSpeed and Megatron do it).
- framework: persistent buffers a framework keeps beside them (DeepSpeed's flat fp32 partitions and gradient
  buckets); 0 for plain torch layouts.
- grads: torch layouts create them during backward (the optimizer zeroes with set_to_none), so a phase counts
  only the grads produced before it; DeepSpeed keeps its gradient buffers for the whole step (`persistent`).
- activations: everything saved for backward of the micro-batches in flight; a backward phase no longer holds
  what the parts above it saved.
Phases (the ones that can be the maximum): the LM head's backward (every activation alive, almost no grads yet),
the top decoder layer's forward and backward, and the end of backward (every grad, no activation). This is an
estimate of an allocator's peak reading (no fragmentation, no CUDA context / workspace).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ds_tsp.tools.plan.inputs import ADAM_STATE_BYTES, MASTER_BYTES, PlanInput
from ds_tsp.tools.plan.shape_terms import ceil_div


@dataclass(frozen=True)
class Phase:
    transient: int  # temporaries of this phase only
    activations: int  # saved-for-backward bytes still alive
    grads: int  # grads alive


@dataclass
class StageMemory:
    """One pipeline stage's memory: state, saved activations and the phases whose maximum is its peak."""

    params: int
    grads: int
    optimizer: int
    activations: int
    phases: dict[str, Phase]
    framework: int = 0
    step_terms: list = field(default_factory=list)  # CommTerms of this stage's step besides the layers

    @property
    def phase_bytes(self) -> dict[str, int]:
        return {name: p.activations + p.grads + p.transient for name, p in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        live = self.phase_bytes
        return max(live, key=live.get)

    @property
    def peak(self) -> int:
        return self.params + self.optimizer + self.framework + self.phase_bytes[self.peak_phase]


def optimizer_bytes_per_param(inp: PlanInput) -> int:
    return ADAM_STATE_BYTES + (MASTER_BYTES if inp.dtype_bytes < 4 else 0)


def zero_divs(inp: PlanInput) -> dict:
    """ZeRO-1 partitions the optimizer over dp, ZeRO-2 the grads too."""
    return {"grads_div": inp.dp if inp.zero_stage >= 2 else 1, "opt_div": inp.dp if inp.zero_stage >= 1 else 1}


def state(inp: PlanInput, params: int, *, grads_div: int = 1, opt_div: int = 1) -> dict:
    """params / grads / optimizer bytes of `params` elements held by this rank."""
    b = inp.dtype_bytes
    return {"params": params * b, "grads": ceil_div(params, grads_div) * b,
            "optimizer": ceil_div(params, opt_div) * optimizer_bytes_per_param(inp)}


@dataclass(frozen=True)
class StackPhases:
    """What the generic phase list needs from a layout (bytes per rank, one micro-batch unless said)."""

    layers: int
    in_flight: int
    per_layer: int  # saved by one layer without checkpointing
    layer_input: int  # one layer's input (what checkpointing keeps)
    other_act: int  # saved outside the layers but not by the LM head (ids, cos/sin, embedding)
    head_act: int  # saved by the final norm + LM head + loss (0 on a stage without the head)
    layer_grads: int  # one layer's grads
    head_grads: int  # grads of the LM head + final norm
    total_grads: int
    transients: dict[str, int]  # phase name -> temporaries; names starting "lm_head" only with the head
    persistent_grads: bool = False
    # DeepSpeed ZeRO-1/2: the reduce bucket appears when the first grad (the LM head's) is ready: that moment's
    # temporaries (bucket, logits grad, input grad), with the loss's saved log-softmax (`loss_saved`) gone
    head_grad_transient: int = 0
    loss_saved: int = 0


def stack_phases(inp: PlanInput, s: StackPhases) -> tuple[int, dict[str, Phase]]:
    """(activations, phases) of a stack of decoder layers under an LM head, for the generic phase list.

    Forward phases see every layer's activations but the head's; the LM head's backward sees all of them; a
    layer's backward sees the layers below it (the top one is the worst: grads are few yet); with activation
    checkpointing the layer being recomputed holds its full set on top of the kept inputs."""
    ac = inp.activation_checkpointing
    kept = s.layers * (s.layer_input if ac else s.per_layer)
    recompute = s.per_layer if ac else 0
    acts = (kept + s.other_act + s.head_act) * s.in_flight
    below_head = acts - s.head_act
    pg = s.total_grads if s.persistent_grads else 0
    phases = {}
    for name, transient in s.transients.items():
        if name.startswith("lm_head"):
            grads = pg or (s.head_grads if name.endswith("bwd") else 0)
            phases[name] = Phase(transient, acts + (0 if name.endswith("bwd") else -s.head_act), grads)
        elif name.endswith("bwd"):
            phases[name] = Phase(transient, below_head + recompute, pg or (s.head_grads + s.layer_grads))
        else:
            phases[name] = Phase(transient, below_head - (0 if ac else s.per_layer * s.in_flight), pg)
    if s.head_grad_transient and s.head_act:
        phases["lm_head_grad"] = Phase(s.head_grad_transient, acts - s.loss_saved, pg + s.head_grads)
    phases["end_of_backward"] = Phase(0, 0, s.total_grads)
    return acts, phases
