"""What the planner answers per layout: a LayoutPlan (memory fields, comm totals and their itemised CommTerms).

The JSON form (`to_dict` / `to_json`, what `ds-tsp plan --json` prints) is a contract: keys are only ever added.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CommTerm:
    """One kind of transfer: `calls` collectives of `payload_bytes` each, `bytes` per rank in total."""

    name: str
    kind: str  # CommCounter kind for TSP terms; the collective's name for the peers
    payload_bytes: int
    calls: int
    bytes: int


@dataclass(frozen=True)
class LayoutPlan:
    layout: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    transients_bytes: int
    peak_bytes_per_rank: int
    comm_bytes_per_layer_fwd: int
    comm_bytes_per_layer_bwd: int
    comm_bytes_per_step: int
    activation_bytes_per_layer: int  # saved for backward by one decoder layer without checkpointing
    stage: str  # "only" (pp=1), or the pipeline stage whose peak is reported ("first" / "last")
    layers_per_stage: int
    layer_fwd_terms: tuple[CommTerm, ...]
    layer_bwd_terms: tuple[CommTerm, ...]
    step_terms: tuple[CommTerm, ...]  # per step, besides layers_per_stage * (fwd + bwd)
    transients: dict[str, int] = field(default_factory=dict)  # phase -> its temporaries; the peak phase's is
    #                                                          transients_bytes
    notes: tuple[str, ...] = ()
    framework_bytes: int = 0  # persistent buffers outside params/grads/optimizer (DeepSpeed flat copies, buckets)
    peak_phase: str = ""  # the phase whose live set is the peak
    phase_bytes: dict[str, int] = field(default_factory=dict)  # phase -> everything live then (the max is the peak)
    # mixture of experts (TSP only; empty for a dense model): schedule planned, "auto"'s choice, bytes per sparse
    # layer of both schedules, peak per schedule (ds_tsp.tools.plan.moe_terms.moe_summary)
    moe: dict = field(default_factory=dict)
    # offload of checkpointed layer inputs (TSP with offload_activations; 0 / empty otherwise): host bytes per rank,
    # and the PCIe and compute figures of ds_tsp.tools.plan.offload.offload_summary
    host_bytes_per_rank: int = 0
    offload: dict = field(default_factory=dict)
    # a cp ring across nodes (layout "tsp_cp", ds_tsp.tools.plan.tsp_cp): inter- vs intra-node bytes per step, the
    # ring's buffers and its seconds per step against the attention seconds it overlaps; empty otherwise
    cp: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
