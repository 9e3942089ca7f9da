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
in-memory layout; GPT-OSS's (ExpertGLU "clamped_swiglu") interleave gate / up rows (0::2 / 1::2) and add biases
gate_up_bias [E_r, 2F] and down_bias [E_r, h]. The expert output returned is UNWEIGHTED (callers multiply by the
routing weight), so the routing-weight gradient is dot(dy_row, out_row) = dot(dy_row @ W_down, act_row)
(+ dot(dy_row, b_down) with biases; no third GEMM in backward).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ExpertGLU:
    """The experts' gated unit on the gate_up projection gu [M, 2F]:
    "silu": SwiGLU, gate = columns [0, F), up = [F, 2F) (Qwen3-MoE, Mixtral);
    "clamped_swiglu": GPT-OSS's, gate / up interleaved (columns 0::2 / 1::2, its checkpoint's order) and
        gate = min(gate, limit), up = clamp(up, -limit, limit), act = (up + 1) * gate * sigmoid(alpha * gate)
        (torch.clamp's gradient: 1 where the bound is not exceeded, bounds included)."""

    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def split(self, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.activation == "clamped_swiglu":
            return gu[:, 0::2], gu[:, 1::2]
        f = gu.shape[1] // 2
        return gu[:, :f], gu[:, f:]

    def forward(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = self.split(gu)
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def backward(self, dact: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(act, d gu in gu's column order) from d act."""
        gate, up = self.split(gu)
        if self.activation == "silu":
            silu_gate = F.silu(gate)
            # aten's fused silu_backward, as in the dense MLP; both halves written straight into d gu (no cat)
            dgu = gu.new_empty(gu.shape)
            f = gate.shape[1]
            torch.ops.aten.silu_backward.grad_input(dact * up, gate, grad_input=dgu[:, :f])
            torch.mul(dact, silu_gate, out=dgu[:, f:])
            return silu_gate * up, dgu
        gc, uc = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        sig = torch.sigmoid(gc * self.alpha)
        glu = gc * sig
        dgate = dact * (uc + 1) * (sig + gc * self.alpha * sig * (1 - sig)) * (gate <= self.limit)
        dup = dact * glu * ((up >= -self.limit) & (up <= self.limit))
        return (uc + 1) * glu, torch.stack((dgate, dup), dim=-1).reshape(gu.shape)


def _row_experts(groups: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert (local index) from the grouped path's device offsets (cumulative row ends); no host read.
    Clamped for the meta device's static windows, whose rows past the offsets compute nothing."""
    index = torch.searchsorted(groups, torch.arange(rows, device=groups.device, dtype=groups.dtype), right=True)
    return index.clamp(max=groups.numel() - 1)


def experts_forward(rows: torch.Tensor, w: dict, groups: Groups, glu: ExpertGLU = ExpertGLU(),
                    keep_projections: bool = False):
    """rows [M, h] sorted by expert; w: the unpacked experts (gate_up [E_r, 2F, h], down [E_r, h, F], and with
    biases gate_up_bias [E_r, 2F], down_bias [E_r, h]) -> (unweighted outputs [M, h], the gate/up pre-activations
    [M, 2F] if keep_projections else None). groups: list = loop over host counts, tensor = one grouped GEMM per
    projection."""
    gate_up, down = w["gate_up"], w["down"]
    b_gu, b_down = w.get("gate_up_bias"), w.get("down_bias")
    f = down.shape[-1]
    if isinstance(groups, torch.Tensor):
        gu = _gmm(rows, gate_up.transpose(-2, -1), groups)
        if b_gu is not None:
            experts = _row_experts(groups, rows.shape[0])
            gu = gu + b_gu[experts]
        out = _gmm(glu.forward(gu), down.transpose(-2, -1), groups)
        if b_down is not None:
            out = out + b_down[experts]
        return out, (gu if keep_projections else None)
    _check_covered(groups, rows)
    # every row belongs to one expert, so each GEMM writes its rows' slice of the outputs in place (out=): no
    # zero-filled buffer, no per-expert result copied into it
    out = rows.new_empty(rows.shape)
    gu_all = rows.new_empty((rows.shape[0], 2 * f)) if keep_projections else None
    for j, a, b in _bounds(groups):
        gu = torch.mm(rows[a:b], gate_up[j].t(), out=gu_all[a:b] if keep_projections else None)
        if b_gu is not None:
            gu += b_gu[j]
        torch.mm(glu.forward(gu), down[j].t(), out=out[a:b])
        if b_down is not None:
            out[a:b] += b_down[j]
    return out, gu_all


def _check_covered(groups: list, rows: torch.Tensor) -> None:
    """The loop path writes each expert's rows in place: the host counts must cover the rows exactly (no row left
    unwritten), as the callers size them."""
    if sum(groups) != rows.shape[0]:
        raise ValueError(f"expert row counts sum to {sum(groups)}, rows are {rows.shape[0]}: each row must belong to "
                         "exactly one expert")


def experts_backward(rows: torch.Tensor, dy_rows: torch.Tensor, weights: torch.Tensor, w: dict, groups: Groups,
                     glu: ExpertGLU = ExpertGLU(), *, projections: torch.Tensor | None = None,
                     need_weight_grad: bool = True, grad_into: dict | None = None, rows_later: bool = False):
    """Backward of out_row * weight_row, recomputing the activations (unless `projections` kept them).

    rows [M, h], dy_rows [M, h] (the layer's output grad at each row's token), weights [M] (routing weights), w as
    experts_forward's. Returns (d rows [M, h], d weights [M], {name of w: its grad} or None if not need_weight_grad).
    grad_into: {name of w: a tensor of its shape} (the views of a packed grad buffer, PackedLayout.unpack) that the
    weight grads are written into, every element (the loop path's GEMMs write there directly), and returned.
    rows_later: d rows comes back as a callable that runs its GEMMs (dgu W_gate_up) when called, after the weight
    grads are done: the weight ring sends those first and computes d rows while they travel (each expert's dgu
    is kept until then: [M, 2F] in all, as the grouped path holds anyway).
    """
    gate_up, down = w["gate_up"], w["down"]
    b_gu, b_down = w.get("gate_up_bias"), w.get("down_bias")
    biased = b_gu is not None
    if isinstance(groups, torch.Tensor):
        experts = _row_experts(groups, rows.shape[0]) if biased else None
        if projections is not None:
            gu = projections
        else:
            gu = _gmm(rows, gate_up.transpose(-2, -1), groups)
            gu = gu if not biased else gu + b_gu[experts]
        g = _gmm(dy_rows, down, groups)  # dy_row @ W_down: [M, F]
        dact = g * weights[:, None]
        act, dgu = glu.backward(dact, gu)
        dw = (g * act).sum(-1)
        if biased:  # out = act @ W_down^T + b_down: the routing weight multiplies the bias too
            dw = dw + (dy_rows * b_down[experts]).sum(-1)
        if rows_later:
            drows = functools.partial(_gmm, dgu, gate_up, groups)
        else:
            drows = _gmm(dgu, gate_up, groups)
        if not need_weight_grad:
            return drows, dw, None
        dy_w = dy_rows * weights[:, None]
        # [E_r, 2F, h], [E_r, h, F]
        grads = {"gate_up": _gmm(dgu.t(), rows, groups), "down": _gmm(dy_w.t(), act, groups)}
        if biased:
            grads["gate_up_bias"] = torch.zeros_like(b_gu).index_add_(0, experts, dgu)
            grads["down_bias"] = torch.zeros_like(b_down).index_add_(0, experts, dy_w)
        if grad_into is not None:
            for name, g_w in grads.items():
                grad_into[name].copy_(g_w)
            grads = grad_into
        return drows, dw, grads
    _check_covered(groups, rows)
    # in place, like experts_forward: each expert's GEMMs write its rows of d rows and its slice of the weight grads
    drows = rows.new_empty(rows.shape)
    kept_dgu = []  # rows_later: (expert, first row, last row, its dgu)
    dw = rows.new_empty(rows.shape[0])
    grads = None
    if need_weight_grad:
        grads = grad_into if grad_into is not None else {name: torch.empty_like(t) for name, t in w.items()}
        hit = {j for j, _, _ in _bounds(groups)}
        for j in range(len(groups)):
            if j not in hit:  # no row met expert j: its grads are zero
                for g_w in grads.values():
                    g_w[j].zero_()
    for j, a, b in _bounds(groups):
        x_j, dy_j, w_j = rows[a:b], dy_rows[a:b], weights[a:b, None]
        gu = (projections[a:b] if projections is not None
              else F.linear(x_j, gate_up[j], b_gu[j] if biased else None))
        g = dy_j @ down[j]
        act, dgu = glu.backward(g * w_j, gu)
        torch.sum(g * act, -1, out=dw[a:b])
        if biased:
            dw[a:b] += dy_j @ b_down[j]
        if rows_later:
            kept_dgu.append((j, a, b, dgu))
        else:
            torch.mm(dgu, gate_up[j], out=drows[a:b])
        if need_weight_grad:
            dy_wj = dy_j * w_j
            torch.mm(dgu.t(), x_j, out=grads["gate_up"][j])
            torch.mm(dy_wj.t(), act, out=grads["down"][j])
            if biased:
                torch.sum(dgu, 0, out=grads["gate_up_bias"][j])
                torch.sum(dy_wj, 0, out=grads["down_bias"][j])
    if rows_later:
        def later() -> torch.Tensor:
            for j, a, b, dgu in kept_dgu:
                torch.mm(dgu, gate_up[j], out=drows[a:b])
            return drows

        return later, dw, grads
    return drows, dw, grads
