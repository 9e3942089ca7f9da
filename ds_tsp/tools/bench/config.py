"""The benchmark's inputs: which layouts exist, and one run's settings (plain, picklable, torch-free)."""
from __future__ import annotations

from dataclasses import dataclass

from ds_tsp.core.shape.model_shape import ModelShape

# "Model M" of docs/benchmarks.md (Llama, hidden 256, 4 layers, 8 heads MHA, MLP 704): the default, so that a plain
# `ds-tsp bench` is comparable with the published tables, and small enough for minutes per layout on 2 CPU cores.
DEFAULT_SHAPE = ModelShape(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                           num_kv_heads=8)
# DeepSpeed's 5e8-element default buckets alone show ~1.9 GB in MemTracker on this model: use 5e6 elements.
DEFAULT_DS_BUCKET = 5_000_000


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    module: str  # ds_tsp.tools.bench.<module> exposes build(cfg, options) -> Session
    title: str  # what the table and plots call it
    options: tuple[tuple[str, object], ...] = ()
    single_rank: bool = False  # runs on one process instead of D
    requires: tuple[str, ...] = ()  # importable packages the layout needs
    data_parallel: bool = False  # every rank runs its own sequences (tokens per step: ranks x batch x S)
    named_only: bool = False  # runs when --layouts names it, never as part of "all"

    @property
    def option_dict(self) -> dict:
        return dict(self.options)


LAYOUTS: dict[str, LayoutSpec] = {spec.name: spec for spec in (
    LayoutSpec("single", "single", "single device (HF Llama)", single_rank=True, requires=("transformers",)),
    LayoutSpec("tsp", "tsp", "TSP memory-optimal", options=(("mode", "memory"),)),
    LayoutSpec("tsp_speed", "tsp", "TSP speed mode", options=(("mode", "speed"),)),
    # the schedule between the two: local projections kept (no recompute), gathered K/V re-gathered (O(S/D) memory)
    LayoutSpec("tsp_kept_projections", "tsp", "TSP projections kept", options=(("mode", "projections"),),
               named_only=True),
    # C TSP groups of D ranks (--tsp D --cp C; ds_tsp.tools.bench.tsp_cp), on C x D ranks; only with --cp >= 2
    LayoutSpec("tsp_cp", "tsp_cp", "TSP x cp ring", options=(("mode", "memory"),)),
    LayoutSpec("dtensor_tp_sp", "dtensor_tp_sp", "TP+SP (DTensor)", requires=("transformers",)),
    LayoutSpec("ulysses_zero3", "ulysses", "Ulysses + ZeRO-3", options=(("zero_stage", 3),),
               requires=("deepspeed", "transformers")),
    LayoutSpec("ulysses_zero1", "ulysses", "Ulysses + ZeRO-1", options=(("zero_stage", 1),),
               requires=("deepspeed", "transformers")),
    # transformers' own model, ZeRO-3 data parallel, a whole sequence per rank: the hybrid models' peer (not in
    # "all" for other models; ds_tsp.tools.bench.hybrid)
    LayoutSpec("hf_zero3_dp", "zero3_dp", "HF model + ZeRO-3 DP (whole S per rank)", options=(("zero_stage", 3),),
               data_parallel=True,
               requires=("deepspeed", "transformers")),
    LayoutSpec("autotp_zero1", "autotp", "AutoTP + ZeRO-1", options=(("zero_stage", 1),),
               requires=("deepspeed", "transformers")),
    # transformers' own model, torch FSDP2 data parallel, a whole sequence per rank: the hybrid models' second
    # peer; runs when named (not in "all")
    LayoutSpec("hf_fsdp2_dp", "fsdp2_dp", "HF model + FSDP2 DP (whole S per rank)", requires=("transformers",),
               data_parallel=True, named_only=True),
)}

INSTALL_HINT = {
    "deepspeed": "pip install 'ds_tsp[deepspeed]' (deepspeed>=0.16)",
    "transformers": "pip install 'ds_tsp[hf]' (transformers>=4.45)",
    "matplotlib": "pip install 'ds_tsp[bench]' (matplotlib>=3.7)",
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything one layout's ranks need (sent to spawned processes, so keep it plain)."""

    layout: str
    seqs: tuple[int, ...]
    tsp: int = 4
    batch: int = 1
    shape: ModelShape = DEFAULT_SHAPE
    steps: int = 3
    warmup: int = 1
    activation_checkpointing: str = "none"  # "none" | "peers" (HF gradient checkpointing) | "all" (TSP too)
    seed: int = 0
    lr: float = 1e-4
    ds_bucket_elements: int = DEFAULT_DS_BUCKET
    profile: bool = False  # --profile: one extra profiled step per S (ds_tsp.tools.bench.profile), every layout
    moe_dispatch: str = "auto"  # TSP layouts on an MoE shape: TSPOptions.moe_dispatch ("auto", "ring", "all_to_all")
    cp: int = 1  # layout tsp_cp: C TSP groups of D = tsp ranks (world C x D); 1 for every other layout
    cp_comm: str = "ring"  # layout tsp_cp: tsp.cp_comm, the cp ring or the all-to-all ("ring" for the others)
    vision: object | None = None  # --images / --videos: ds_tsp.tools.bench.vision.VisionBench (a VLM's step)

    def checkpointing(self) -> bool:
        """Whether this run uses activation checkpointing (peers with "peers"/"all", TSP only with "all")."""
        if self.spec.module == "tsp":
            return self.activation_checkpointing == "all"
        return self.activation_checkpointing in ("peers", "all")

    @property
    def label(self) -> str:
        """The layout's name in tables: an MoE run adds its schedule (one layout, several schedules per run)."""
        label = f"{self.layout}[{self.moe_dispatch}]" if self.runs_moe_dispatch else self.layout
        return label if self.cp_comm == "ring" else f"{label}[{self.cp_comm}]"  # the cp schedule, where not the ring

    @property
    def runs_moe_dispatch(self) -> bool:
        """A TSP layout on an MoE shape: it runs moe_dispatch's schedule (transformers' own model runs its own)."""
        return bool(self.shape.num_experts) and self.spec.module in ("tsp", "tsp_cp")

    @property
    def spec(self) -> LayoutSpec:
        return LAYOUTS[self.layout]

    @property
    def world(self) -> int:
        return 1 if self.spec.single_rank else self.tsp * self.cp
