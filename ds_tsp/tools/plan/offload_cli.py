"""What `ds-tsp plan` prints for offloaded activations: the host-memory and PCIe lines of a LayoutPlan."""
from __future__ import annotations

_GIB = 2 ** 30


def offload_lines(plan) -> list[str]:
    """The host-memory and PCIe lines of a plan with offload (what `ds-tsp plan --offload-activations` prints)."""
    o = plan.offload
    if not o:
        return []
    hidden = o["pcie_seconds_per_layer"] <= o["compute_seconds_per_layer_fwd"]
    return [f"host memory (offloaded layer inputs): {plan.host_bytes_per_rank / _GIB:.2f} GiB per rank, "
            f"{o['host_bytes_per_node'] / _GIB:.2f} GiB ({o['host_bytes_per_node'] / 1e12:.2f} TB) per node of "
            f"{o['gpus_per_node']} GPUs; {o['offloaded_layers']} layer inputs of {o['layer_input_bytes'] / _GIB:.2f} "
            f"GiB, at most {o['device_held_layer_inputs']} on the device",
            f"PCIe at {o['pcie_gb_per_s_per_direction']:g} GB/s per direction: {o['pcie_seconds_per_step']:.2f} s per "
            f"step each way ({o['pcie_bytes_per_step_per_direction'] / 1e9:.1f} GB) against ~"
            f"{o['compute_seconds_per_step']:.1f} s of compute at {o['gpu_tflops']:g} TFLOP/s; per layer "
            f"{o['pcie_seconds_per_layer'] * 1e3:.1f} ms of copy vs {o['compute_seconds_per_layer_fwd'] * 1e3:.1f} ms "
            f"of forward: {'hidden behind compute' if hidden else 'NOT hidden: the copies stall the step'}"]
