"""The expert GEMMs of one rank: SwiGLU experts over token rows sorted by expert, forward and recomputing backward.

Rows arrive sorted by expert (the experts a rank holds at one time, in expert order). Two ways to run them:
- "grouped": one torch grouped GEMM per projection (`torch.nn.functional.grouped_mm` / `torch._grouped_mm`), the
  group boundaries given as DEVICE offsets (int32 cumulative row ends): no host sync here. Callers hand exactly
  the rows the offsets cover (offsets[-1] == rows; the ring and all_to_all size their rows by the layer's one host
  read), so no row is left undefined. Only the meta device, which computes nothing, passes a longer window.
- "loop": one GEMM per expert over host row counts (a Python list the caller read once per layer forward).
select_expert_gemm picks one like ds_tsp.core.layers.attention.kernels.select_backend picks attention: grouped on CUDA
bf16 where torch ships the kernel, and on the meta device (bf16) where no count can be read; the loop everywhere else.

Weights: gate_up [E_r, 2F, h] (gate = rows [0, F), up = rows [F, 2F)) and down [E_r, h, F], transformers' fused
in-memory layout. The expert output returned is UNWEIGHTED (callers multiply by the routing weight), so the
routing-weight gradient is dot(dy_row, out_row) = dot(dy_row @ W_down, act_row) (no third GEMM in backward).
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F

# host row counts per expert (loop) or device int32 cumulative row ends per expert (grouped)
Groups = Union[list, torch.Tensor]


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


def select_expert_gemm(device: torch.device | str, dtype: torch.dtype, hidden: int | None = None,
                       ffn: int | None = None) -> str:
    """"grouped" or "loop" for expert weights on `device` with `dtype` (see module doc). hidden / ffn: the GEMM
    widths; the grouped kernels need every row stride a multiple of 16 bytes, else the loop runs."""
    device = torch.device(device)
    if dtype != torch.bfloat16 or _grouped_mm_fn() is None:
        return "loop"
    width_bytes = [n * torch.finfo(dtype).bits // 8 for n in (hidden, ffn) if n is not None]
    if any(b % 16 for b in width_bytes):
        return "loop"
    if device.type == "meta":
        return "grouped"  # torch registers meta kernels for bf16 grouped GEMMs; a meta step cannot read counts
    if device.type != "cuda":
        return "loop"
    try:
        major, _ = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError):  # no driver / device: the loop always works
        return "loop"
    # torch._grouped_mm before torch.nn.functional.grouped_mm existed was Hopper-only; the newer one runs on sm80+
    return "grouped" if major >= 9 or (major >= 8 and hasattr(F, "grouped_mm")) else "loop"


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_fn()(a, b, offs=offs)


def _bounds(counts: list) -> list[tuple[int, int, int]]:
    out, start = [], 0
    for j, n in enumerate(counts):
        if n:
            out.append((j, start, start + n))
        start += n
    return out


def experts_forward(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, groups: Groups,
                    keep_projections: bool = False):
    """rows [M, h] sorted by expert -> (unweighted outputs [M, h], the gate/up pre-activations [M, 2F] if
    keep_projections else None). groups: list = loop over host counts, tensor = one grouped GEMM per projection."""
    f = down.shape[-1]
    if isinstance(groups, torch.Tensor):
        gu = _gmm(rows, gate_up.transpose(-2, -1), groups)
        act = F.silu(gu[:, :f]) * gu[:, f:]
        out = _gmm(act, down.transpose(-2, -1), groups)
        return out, (gu if keep_projections else None)
    out = torch.zeros_like(rows)
    gu_all = rows.new_zeros((rows.shape[0], 2 * f)) if keep_projections else None
    for j, a, b in _bounds(groups):
        gu = F.linear(rows[a:b], gate_up[j])
        out[a:b] = F.linear(F.silu(gu[:, :f]) * gu[:, f:], down[j])
        if keep_projections:
            gu_all[a:b] = gu
    return out, gu_all


def experts_backward(rows: torch.Tensor, dy_rows: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, groups: Groups, *, projections: torch.Tensor | None = None,
                     need_weight_grad: bool = True):
    """Backward of out_row * weight_row, recomputing the activations (unless `projections` kept them).

    rows [M, h], dy_rows [M, h] (the layer's output grad at each row's token), weights [M] (routing weights).
    Returns (d rows [M, h], d weights [M], d gate_up, d down) -- the last two None if not need_weight_grad.
    """
    f = down.shape[-1]
    grouped = isinstance(groups, torch.Tensor)
    if grouped:
        gu = projections if projections is not None else _gmm(rows, gate_up.transpose(-2, -1), groups)
        g = _gmm(dy_rows, down, groups)  # dy_row @ W_down: [M, F]
        gate, up = gu[:, :f], gu[:, f:]
        silu_gate = F.silu(gate)
        act = silu_gate * up
        dw = (g * act).sum(-1)
        dact = g * weights[:, None]
        dgu = torch.cat([torch.ops.aten.silu_backward(dact * up, gate), dact * silu_gate], dim=1)
        drows = _gmm(dgu, gate_up, groups)
        if not need_weight_grad:
            return drows, dw, None, None
        d_gate_up = _gmm(dgu.t(), rows, groups)  # [E_r, 2F, h]
        d_down = _gmm((dy_rows * weights[:, None]).t(), act, groups)  # [E_r, h, F]
        return drows, dw, d_gate_up, d_down
    drows = torch.zeros_like(rows)
    dw = rows.new_zeros(rows.shape[0])
    d_gate_up = torch.zeros_like(gate_up) if need_weight_grad else None
    d_down = torch.zeros_like(down) if need_weight_grad else None
    for j, a, b in _bounds(groups):
        x_j, dy_j, w_j = rows[a:b], dy_rows[a:b], weights[a:b, None]
        gu = projections[a:b] if projections is not None else F.linear(x_j, gate_up[j])
        gate, up = gu[:, :f], gu[:, f:]
        silu_gate = F.silu(gate)
        act = silu_gate * up
        g = dy_j @ down[j]
        dw[a:b] = (g * act).sum(-1)
        dact = g * w_j
        # aten's fused silu_backward, as in the dense MLP
        dgu = torch.cat([torch.ops.aten.silu_backward(dact * up, gate), dact * silu_gate], dim=1)
        drows[a:b] = dgu @ gate_up[j]
        if need_weight_grad:
            d_gate_up[j] = dgu.t() @ x_j
            d_down[j] = (dy_j * w_j).t() @ act
    return drows, dw, d_gate_up, d_down
