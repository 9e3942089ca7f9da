"""TSP with offload of checkpointed activations (TSPOptions.offload_activations; ds_tsp.core.activation_offload).

With activation checkpointing each decoder layer keeps only its input x = [B, S/D, h] (T = B*S/D local tokens,
T*h*b bytes). With offload:
- device: at most two layer inputs at once (the last layer's, which is never offloaded, and one in flight: being
  copied out in forward; in backward the one in use and the next one prefetched), instead of all L;
- host, per rank: the other L-1 inputs, (L-1)*T*h*b, in a pool allocated once (pinned); per node: that times the
  GPUs of the node (--gpus-per-node);
- PCIe, per rank and step: every offloaded input goes down once (forward) and up once (backward): (L-1)*T*h*b per
  direction, at PCIE_GB_PER_S (55 GB/s per direction, PCIe Gen5 x16 as measured, not its 64 GB/s nominal). The
  copies run on a side stream while the next layer computes, so they cost nothing while one layer input's copy
  (T*h*b / PCIe) is shorter than one layer's compute; the plan reports both.
- compute, per rank and step (to set the PCIe time against): FLOPs at --gpu-tflops sustained (default 400 TFLOP/s,
  about 40% of an H100's dense bf16 peak). Per layer forward 2*T*W (W the layer's weight elements: every rank runs
  its tokens through every weight, the shards travel) + causal attention 2*B*S^2*nq*d/D (QK^T and PV over the
  lower triangle, the zigzag split balances it); backward 2x forward; checkpointing recomputes forward once more.
  LM head: 2*T*V*h forward, 3x for the step. An estimate for the ratio, not a benchmark.
"""
from __future__ import annotations

from dataclasses import replace

from ds_tsp.tools.cli_types import GIB
from ds_tsp.tools.plan.inputs import PlanInput

PCIE_GB_PER_S = 55.0  # per direction, per GPU
DEFAULT_GPU_TFLOPS = 400.0  # sustained bf16 per GPU: ~40% of an H100's 989 TFLOP/s dense peak
DEFAULT_GPUS_PER_NODE = 8


def device_held_inputs(layers: int) -> int:
    """Layer inputs on the device at once with offload: the last layer's and one in flight (see the docstring)."""
    return min(layers, 2)


def layer_input_bytes(inp: PlanInput, g) -> int:
    return inp.batch * g.L * g.dims.h * inp.dtype_bytes


def host_bytes_per_rank(inp: PlanInput, g) -> int:
    """The host pool: every checkpointed layer input but the last one's."""
    return (inp.model.num_layers - 1) * layer_input_bytes(inp, g) if inp.offload_activations else 0


def step_flops(inp: PlanInput, g) -> tuple[float, float]:
    """(FLOPs of one decoder layer's forward, of the whole training step) per rank (see the module docstring)."""
    m, dims = inp.model, g.dims
    T = inp.batch * g.L
    mlp = m.num_experts_per_tok * m.moe_intermediate_size if m.num_experts else dims.F
    weights = dims.attn(dims.nq, dims.nkv) + 3 * dims.h * mlp
    # a hybrid model's Gated DeltaNet layers are linear in S: the quadratic term is the full-attention layers'
    # (averaged per layer; their chunked recurrence's FLOPs are left out, so compute is underestimated there)
    full = sum(t == "full_attention" for t in m.layer_types) / dims.layers if m.layer_types else 1.0
    layer_fwd = 2.0 * T * weights + full * 2.0 * inp.batch * g.S_pad ** 2 * dims.nq * dims.d / g.D
    layer_passes = 4 if inp.activation_checkpointing else 3  # forward, backward (2x), the recompute
    head = 2.0 * T * dims.V * dims.h * 3
    return layer_fwd, layer_passes * layer_fwd * dims.layers + head


def offload_summary(inp: PlanInput, g, *, gpu_tflops: float = DEFAULT_GPU_TFLOPS,
                    gpus_per_node: int = DEFAULT_GPUS_PER_NODE, pcie_gb_per_s: float = PCIE_GB_PER_S) -> dict:
    """Host memory, PCIe and compute figures of one step with offload (module docstring)."""
    x = layer_input_bytes(inp, g)
    host = host_bytes_per_rank(inp, g)
    layer_fwd, step = step_flops(inp, g)
    rate = pcie_gb_per_s * 1e9
    return {"pcie_gb_per_s_per_direction": pcie_gb_per_s, "gpu_tflops": gpu_tflops, "gpus_per_node": gpus_per_node,
            "layer_input_bytes": x, "offloaded_layers": inp.model.num_layers - 1,
            "device_held_layer_inputs": device_held_inputs(inp.model.num_layers),
            "host_bytes_per_rank": host, "host_bytes_per_node": host * gpus_per_node,
            "pcie_bytes_per_step_per_direction": host, "pcie_seconds_per_step": host / rate,
            "pcie_seconds_per_layer": x / rate, "compute_seconds_per_step": step / (gpu_tflops * 1e12),
            "compute_seconds_per_layer_fwd": layer_fwd / (gpu_tflops * 1e12)}


def offload_note(inp: PlanInput, g) -> str:
    x = layer_input_bytes(inp, g)
    return (f"offload_activations: {inp.model.num_layers - 1} of {inp.model.num_layers} checkpointed layer inputs "
            f"({x / GIB:.2f} GiB each) in host memory, at most {device_held_inputs(inp.model.num_layers)} on the "
            "device")


def with_offload(plan, inp: PlanInput, g, **rates):
    """`plan` with its host-memory and PCIe fields filled when inp.offload_activations."""
    if not inp.offload_activations:
        return plan
    summary = offload_summary(inp, g, **rates)
    return replace(plan, host_bytes_per_rank=summary["host_bytes_per_rank"], offload=summary)
