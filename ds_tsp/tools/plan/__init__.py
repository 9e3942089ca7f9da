"""Analytic per-rank memory and communication of TSP and its peers, for one model, sequence and layout.

Layouts (D = the degree of the one parallel axis, `PlanInput.degree`):

| layout             | weights per rank             | tokens per rank      | per-layer traffic (per rank)           |
|--------------------|------------------------------|----------------------|----------------------------------------|
| tsp                | 1/D (head block, F/D, V/D)   | S/D (zigzag)         | shard broadcast + MLP ring, K/V gather |
| tp                 | 1/D (Megatron, no SP)        | S (replicated)       | 2 all-reduces of B*S*h each way        |
| tp_sp              | 1/D (Megatron seq. parallel) | S/D outside attn/MLP | 4 all-gathers/reduce-scatters each way |
| ulysses            | 1/(D*dp) (ZeRO-3)            | S/D                  | 4 all-to-alls + ZeRO-3 layer gather    |
| ulysses_replicated | whole model                  | S/D                  | 4 all-to-alls (grads all-reduced)      |
| fsdp_cp            | 1/(D*dp) (FSDP)              | S/D (zigzag)         | ring K/V passes + FSDP layer gather    |
| autotp             | 1/D layers, embedding whole  | S (replicated)       | 2 all-reduces each way, logits gather  |

TSP with a context-parallel ring across nodes (tsp.cp_size = C: C TSP groups share each sequence) is planned by
tsp_cp.py (`ds-tsp plan --cp C`, layout "tsp_cp": TSP at S/C tokens per group plus the cp ring's inter-node bytes
and buffers; `--recommend --cp auto` picks D and C).

One file per layout family, each formula beside its layer: tsp.py (+ tsp_comm.py; hybrid.py: the Gated DeltaNet
layers of hybrid models), tp.py (tp, autotp),
tp_sp.py, ulysses.py (ulysses, ulysses_replicated), fsdp_cp.py. Shared terms: shape_terms.py (model element
counts, pipeline stages), activation_terms.py (what a layer saves), comm_terms.py (collective accounting),
memory.py (state and the peak over phases), peer_stage.py, assemble.py. recommend.py picks a layout for a GPU.
Model inputs: inputs.py (PlanInput, PRESETS), shapes.py (HF config.json, shape overrides).

`comm_bytes_per_step` is one forward and backward of ONE micro-batch of `batch` sequences on the busiest stage,
plus one gradient synchronisation over dp (grads in `dtype`) and the pipeline hops of that micro-batch: what every
TSP rank moves on CUDA; on CPU tensors the causal K/V gather and dK/dV scatter send less on some ranks (each kind's
figure is its busiest rank's; ds_tsp.tools.plan.tsp_comm.at_rank gives each rank's).
Peaks are checked against `ds-tsp bench`'s MemTracker readings (tests/fixtures/plan_bench.json, within 10%).
"""
from __future__ import annotations

from ds_tsp.tools.plan.fsdp_cp import plan_fsdp_cp
from ds_tsp.tools.plan.inputs import DTYPE_BYTES, PRESETS, PlanInput, PlanInputError
from ds_tsp.tools.plan.layouts import DEFAULT_LAYOUTS, LAYOUTS, plan_layouts
from ds_tsp.tools.plan.recommend import Recommendation, recommend
from ds_tsp.tools.plan.result import CommTerm, LayoutPlan
from ds_tsp.tools.plan.shapes import shape_from_hf_config, shape_with
from ds_tsp.tools.plan.tp import megatron_tp_example, plan_autotp, plan_tp
from ds_tsp.tools.plan.tp_sp import plan_tp_sp
from ds_tsp.tools.plan.tsp import plan_tsp
from ds_tsp.tools.plan.tsp_comm import tsp_counter_bytes
from ds_tsp.tools.plan.ulysses import plan_ulysses, plan_ulysses_replicated

__all__ = ["PRESETS", "LAYOUTS", "DEFAULT_LAYOUTS", "DTYPE_BYTES", "PlanInput", "PlanInputError", "CommTerm",
           "LayoutPlan", "shape_from_hf_config", "shape_with", "plan_tsp", "plan_tp", "plan_tp_sp", "plan_ulysses",
           "plan_ulysses_replicated", "plan_fsdp_cp", "plan_autotp", "plan_layouts", "tsp_counter_bytes",
           "megatron_tp_example", "recommend", "Recommendation"]
