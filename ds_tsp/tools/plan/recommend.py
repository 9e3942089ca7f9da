"""Pick the layout for N devices of G GiB: the one that fits with the least communication per step.

Candidates: every layout of RECOMMEND_LAYOUTS, every degree D > 1 dividing N that the model's shape allows (the
rest of the devices data-parallel, dp = N/D; D = 1 would be plain data parallelism, the same for every layout,
so it is a candidate only when N = 1), with and without activation checkpointing, and for TSP two more schedules
than the memory-optimal one: speed mode (TSPOptions.speed(): gathered K/V and local projections kept for backward,
no re-gather, no recompute; it moves fewer bytes than the memory-optimal mode, so it is recommended wherever it
fits) and projections kept (TSPOptions(recompute_projections=False): the local q/k/v, MLP gate/up and Gated
DeltaNet blocks kept, the K/V re-gathered; the memory-optimal mode's bytes, O(S/D) memory, none of its recomputed
GEMMs). A candidate fits when its planned peak per rank is at most G GiB (the plan has no CUDA context / allocator
slack: leave some).

Equal work: every candidate trains the same global batch per step, `N / D_min` micro-batches of `batch`
sequences (D_min the smallest degree considered); a candidate with fewer data-parallel replicas runs the
difference as gradient-accumulation micro-steps, so its per-micro-batch traffic counts that many times and its
gradient sync once. Ties on comm go to the candidate that recomputes nothing (no activation checkpointing, TSP
with its projections kept), then to the lower peak.

With offload (`recommend(..., offload=True)`, `--offload-activations`), TSP candidates also run checkpointing with
the layer inputs in host memory: such a candidate fits when its device peak fits G and its host pool fits
`host_mem_gib` per rank (when given). Offload moves no network bytes but costs PCIe, so among candidates with the
same comm the one without offload wins; offload is recommended when it is what makes a layout fit.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ds_tsp.tools.cli_types import GIB
from ds_tsp.tools.plan.inputs import PlanInput, PlanInputError
from ds_tsp.tools.plan.layouts import LAYOUTS
from ds_tsp.tools.plan.shape_terms import gemma4_peer_refusal

RECOMMEND_LAYOUTS = ("tsp", "ulysses", "tp_sp", "fsdp_cp")


@dataclass(frozen=True)
class Candidate:
    layout: str
    degree: int
    dp: int
    activation_checkpointing: bool
    peak_bytes_per_rank: int
    comm_bytes_per_step: int  # equal work, see the module docstring
    micro_steps: int
    fits: bool
    verdict: str = ""  # "recommended", or why not
    offload_activations: bool = False
    host_bytes_per_rank: int = 0
    speed_mode: bool = False  # TSPOptions.speed(): gathered K/V and local projections kept for backward
    projections_kept: bool = False  # TSP's local projections kept for backward (speed mode keeps them too)
    gathered_kv_kept: bool = False  # TSP's gathered K/V kept for backward (speed mode, or the input's own setting)

    @property
    def label(self) -> str:
        schedule = " +speed mode" if self.speed_mode else " +projections kept" if self.projections_kept else ""
        return (f"{self.layout} D={self.degree} dp={self.dp}{schedule}"
                f"{' +activation checkpointing' if self.activation_checkpointing else ''}"
                f"{' +offload' if self.offload_activations else ''}")

    @property
    def recomputes(self) -> bool:
        """Whether its backward runs forward GEMMs again: activation checkpointing, or TSP recomputing its
        projections (the memory-optimal schedule)."""
        return self.activation_checkpointing or (self.layout == "tsp" and not self.projections_kept)

    @property
    def tsp_settings(self) -> dict:
        """The "tsp" block's schedule keys this candidate runs with (TSP layouts; {} for the defaults)."""
        return {**({"keep_gathered_kv": True} if self.gathered_kv_kept else {}),
                **({"recompute_projections": False} if self.projections_kept else {}),
                **({"activation_checkpointing": True} if self.activation_checkpointing else {}),
                **({"offload_activations": True} if self.offload_activations else {})}


@dataclass(frozen=True)
class Recommendation:
    gpu_mem_bytes: int
    devices: int
    best: Candidate | None
    rejected: tuple[Candidate, ...]
    why: str

    def to_dict(self) -> dict:
        return {"gpu_mem_bytes": self.gpu_mem_bytes, "devices": self.devices,
                "recommended": None if self.best is None else asdict(self.best), "why": self.why,
                "rejected": [asdict(c) for c in self.rejected]}


def _sync_bytes(plan) -> int:
    return sum(t.bytes for t in plan.step_terms if t.name.startswith("grad sync"))


def candidates(inp: PlanInput, devices: int, layouts=RECOMMEND_LAYOUTS, offload: bool = False) -> list[Candidate]:
    degrees = [d for d in range(2 if devices > 1 else 1, devices + 1) if devices % d == 0]
    planned = []
    memory_optimal = inp.recompute_projections and not inp.keep_gathered_kv
    # (activation checkpointing, offload, the TSP schedule's overrides): the input's schedule, and from the
    # memory-optimal one also projections kept and speed mode (both without checkpointing, which recomputes anyway)
    kept = {"recompute_projections": False}
    for name in layouts:
        variants = [(False, False, {}), (True, False, {})] + \
            ([(True, True, {})] if offload and name == "tsp" else []) + \
            ([(False, False, kept), (False, False, {**kept, "keep_gathered_kv": True})]
             if name == "tsp" and memory_optimal else [])
        for degree in degrees:
            for ac, off, schedule in variants:
                trial = replace(inp, degree=degree, dp=devices // degree, pp=1, activation_checkpointing=ac,
                                offload_activations=off, **schedule)
                try:
                    planned.append((trial, LAYOUTS[name](trial)))
                except PlanInputError:
                    continue  # the shape does not split over this degree for this layout
    if not planned:
        return []
    max_dp = max(trial.dp for trial, _ in planned)
    out = []
    for trial, plan in planned:
        micro = max_dp // trial.dp
        sync = _sync_bytes(plan)
        comm = (plan.comm_bytes_per_step - sync) * micro + sync
        out.append(Candidate(plan.layout, trial.degree, trial.dp, trial.activation_checkpointing,
                             plan.peak_bytes_per_rank, comm, micro, False,
                             offload_activations=trial.offload_activations,
                             host_bytes_per_rank=plan.host_bytes_per_rank,
                             speed_mode=not trial.recompute_projections and trial.keep_gathered_kv,
                             projections_kept=plan.layout == "tsp" and not trial.recompute_projections,
                             gathered_kv_kept=plan.layout == "tsp" and trial.keep_gathered_kv))
    return out


def _fits_but(c: Candidate, best: Candidate) -> str:
    """Why a candidate that fits lost to `best` (the sort key of recommend, in its order)."""
    if c.comm_bytes_per_step > best.comm_bytes_per_step:
        return f"fits but more comm: {c.comm_bytes_per_step / GIB:.2f} GiB/step"
    if c.offload_activations and not best.offload_activations:
        return "fits with the same comm, but offloads activations over PCIe"
    if c.recomputes and not best.recomputes:
        return "fits with the same comm, but recomputes forward GEMMs in backward"
    return f"fits with the same comm at a higher peak: {c.peak_bytes_per_rank / GIB:.2f} GiB"


def _no_fit(c: Candidate, limit: int) -> str:
    if c.peak_bytes_per_rank <= limit:  # the device fits: the host pool does not
        return f"didn't fit: needs {c.host_bytes_per_rank / GIB:.2f} GiB of host memory per rank"
    return f"didn't fit: needs {c.peak_bytes_per_rank / GIB:.2f} GiB"


def recommend(inp: PlanInput, *, gpu_mem_gib: float, devices: int, layouts=RECOMMEND_LAYOUTS,
              offload: bool = False, host_mem_gib: float | None = None) -> Recommendation:
    if not devices >= 1:
        raise PlanInputError("devices", f"devices={devices!r}: must be an integer >= 1")
    if not gpu_mem_gib > 0:
        raise PlanInputError("gpu_mem_gib", f"gpu_mem_gib={gpu_mem_gib!r}: must be > 0")
    limit = int(gpu_mem_gib * GIB)
    # only TSP's MoE / hybrid layers and Gemma 4's full layers are modelled
    if inp.model.num_experts or inp.model.layer_types is not None or gemma4_peer_refusal(inp.model):
        layouts = tuple(name for name in layouts if name == "tsp")
    host_limit = None if host_mem_gib is None else int(host_mem_gib * GIB)
    cands = [replace(c, fits=c.peak_bytes_per_rank <= limit and (host_limit is None
                                                                  or c.host_bytes_per_rank <= host_limit))
             for c in candidates(inp, devices, layouts, offload)]
    if not cands:
        raise PlanInputError("devices", f"no layout of {list(layouts)} splits this model over any degree dividing "
                                        f"{devices} devices")
    def rank(c: Candidate) -> tuple:
        return c.comm_bytes_per_step, c.offload_activations, c.recomputes, c.peak_bytes_per_rank

    fitting = sorted((c for c in cands if c.fits), key=rank)
    if not fitting:
        smallest = min(cands, key=lambda c: c.peak_bytes_per_rank)
        rejected = tuple(replace(c, verdict=_no_fit(c, limit))
                         for c in sorted(cands, key=lambda c: c.peak_bytes_per_rank))
        why = (f"nothing fits in {gpu_mem_gib:g} GiB; the smallest peak is {smallest.label} at "
               f"{smallest.peak_bytes_per_rank / GIB:.2f} GiB: add devices, shorten --seq or lower --batch")
        return Recommendation(limit, devices, None, rejected, why)
    best = replace(fitting[0], verdict="recommended")
    rest = [c for c in cands if c is not fitting[0] and c != fitting[0]]
    rejected = []
    for c in sorted(rest, key=lambda c: (False, *rank(c)) if c.fits else (True, c.peak_bytes_per_rank)):
        if c.fits:
            rejected.append(replace(c, verdict=_fits_but(c, best)))
        else:
            rejected.append(replace(c, verdict=_no_fit(c, limit)))
    n_fit = len(fitting)
    runner = f"; next: {fitting[1].label} at {fitting[1].comm_bytes_per_step / GIB:.2f} GiB/step" \
        if n_fit > 1 else ""
    why = (f"fits {gpu_mem_gib:g} GiB with {best.peak_bytes_per_rank / GIB:.2f} GiB per rank and moves the least "
           f"of the {n_fit} candidates that fit: {best.comm_bytes_per_step / GIB:.2f} GiB per rank per step "
           f"({max(c.micro_steps * c.dp for c in cands)} micro-batches of the global batch){runner}")
    return Recommendation(limit, devices, best, tuple(rejected), why)
