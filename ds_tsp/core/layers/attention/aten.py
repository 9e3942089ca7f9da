"""torch's own fused flash attention as a kernels.py backend: ONE adapter for the CPU op and the CUDA op.

    cpu_flash   aten::_scaled_dot_product_flash_attention_for_cpu (+ _backward)
    aten_flash  aten::_scaled_dot_product_flash_attention (+ _backward): CUDA, fp16/bf16, sm80+

Both take [B, H, L, d] (a transpose of the kernels' [B, L, H, d]: no copy), return the natural-log log-sum-exp
[B, H, L] in float32 (float64 for float64 inputs on the CPU) and take it back in backward. What differs (op names,
argument lists, extra outputs such as the CUDA op's cum_seq / max / rng values, head_dim padding) sits in one
`OpTable` per device type; the GQA handling and the LSE layout are shared, so the CPU tests run the code the
CUDA backend runs.

GQA without copying K/V per group where the geometry allows: the unmasked block folds the g query heads of a kv
head into the query length ([B, Hkv, g*Lq, d]). The causal block cannot (folding would change the rows'
positions), so it repeats the short diagonal K/V slice (Lq keys) and sums dk / dv back over the group.

Every op is called by POSITION with the names pinned in its table: `signature_problem` compares them with the
schema torch exposes, so an upgrade that renames or reorders an argument turns the backend off (math, with a
warning naming the op) instead of passing a value to the wrong parameter; tests/core/test_aten_flash.py pins the
schemas of the supported torch range.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def _grouped(x, hkv):
    """[B, L, Hq, d] -> view [B, Hkv, g, L, d]."""
    B, L, H, d = x.shape
    return x.view(B, L, hkv, H // hkv, d).permute(0, 2, 3, 1, 4)


def _ungroup(x):
    """[B, Hkv, g, L, d] -> [B, L, Hkv*g, d]."""
    B, hkv, g, L, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(B, L, hkv * g, d)


def _fold(x, hkv):
    """[B, Lq, Hq, d] -> [B, Hkv, g*Lq, d]."""
    B, L, H, d = x.shape
    return _grouped(x, hkv).reshape(B, hkv, (H // hkv) * L, d)


def _unfold(x, g):
    """[B, Hkv, g*Lq, d] -> [B, Lq, Hkv*g, d]."""
    B, hkv, gl, d = x.shape
    return _ungroup(x.view(B, hkv, g, gl // g, d))


# ----------------------------------------------------------------------------------------------------------------
# op tables


@dataclass(frozen=True)
class OpTable:
    """One device's ops. A parameter name may be a tuple: the names it has had across the supported torch range
    (a rename is harmless while the position holds, values being passed positionally)."""
    forward: str
    backward: str
    forward_params: tuple  # positional parameters passed, in order
    backward_params: tuple
    forward_returns: int  # at least this many outputs; out and lse are the first two
    forward_tail: tuple = ()  # constant arguments after (q, k, v, dropout_p, is_causal)
    backward_takes_meta: bool = False  # backward wants cum_seq_q/k, max_q/k and the rng values back (CUDA)
    head_dim_multiple: int = 1  # head_dim is zero-padded to this (the CUDA kernel takes multiples of 8)
    lse_multiple: int = 1  # the backend's LSE length is a multiple of this (re-padded for its backward)

    def forward_args(self, q, k, v, causal):
        return (q, k, v, 0.0, causal) + self.forward_tail

    def backward_args(self, dout, q, k, v, out, lse, causal):
        if not self.backward_takes_meta:
            return (dout, q, k, v, out, lse, 0.0, causal)
        # No dropout: the rng values are never read, and cum_seq None selects the dense (not varlen) kernel.
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        return (dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, unused, unused)


_QKV = ("query", "key", "value")
CPU_OPS = OpTable(
    forward="_scaled_dot_product_flash_attention_for_cpu",
    backward="_scaled_dot_product_flash_attention_for_cpu_backward",
    forward_params=_QKV + ("dropout_p", "is_causal"),
    backward_params=("grad_out",) + _QKV + ("out", "logsumexp", "dropout_p", "is_causal"),
    forward_returns=2,
)
CUDA_OPS = OpTable(
    forward="_scaled_dot_product_flash_attention",
    backward="_scaled_dot_product_flash_attention_backward",
    forward_params=_QKV + ("dropout_p", "is_causal", "return_debug_mask"),
    backward_params=("grad_out",) + _QKV + ("out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                                            "dropout_p", "is_causal", ("philox_seed", "rng_state"),
                                            ("philox_offset", "unused")),
    forward_returns=9,  # output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng (2 values), debug mask
    forward_tail=(False,),  # return_debug_mask
    backward_takes_meta=True,
    head_dim_multiple=8,
)

def _op(name):
    packet = getattr(torch.ops.aten, name, None)
    return None if packet is None else packet.default


def signature_problem(schema, params, keywords=("scale",), min_returns=3) -> str | None:
    """Why calling `schema` positionally with `params` (then `keywords` by name) would be wrong, or None."""
    if schema is None:
        return f"torch {torch.__version__} has no such op"
    positional = [a for a in schema.arguments if not a.kwarg_only]
    names = [a.name for a in positional]
    for i, want in enumerate(params):
        options = (want,) if isinstance(want, str) else want
        if i >= len(names) or names[i] not in options:
            return f"{schema.name} argument {i} is {names[i] if i < len(names) else 'missing'!r}, not {want!r}"
    if any(not a.has_default_value() for a in positional[len(params):]):
        return f"{schema.name} needs arguments ds_tsp does not pass: {names[len(params):]}"
    kw = {a.name for a in schema.arguments if a.kwarg_only}
    if not set(keywords) <= kw:
        return f"{schema.name} lacks keyword arguments {sorted(set(keywords) - kw)}"
    required = [a.name for a in schema.arguments if a.kwarg_only and not a.has_default_value()]
    if set(required) - set(keywords):
        return f"{schema.name} needs keyword arguments ds_tsp does not pass: {sorted(set(required) - set(keywords))}"
    if len(schema.returns) < min_returns:
        return f"{schema.name} returns {len(schema.returns)} values, ds_tsp reads {min_returns}"
    return None


@functools.lru_cache(maxsize=None)
def table_problem(table: OpTable) -> str | None:
    """Why this torch cannot run `table`'s ops through the adapter (missing op, changed schema), or None."""
    for name, params, n in ((table.forward, table.forward_params, table.forward_returns),
                            (table.backward, table.backward_params, 3)):
        op = _op(name)
        problem = signature_problem(None if op is None else op._schema, params, min_returns=n)
        if problem:
            return f"aten.{name}: {problem}"
    return None


# ----------------------------------------------------------------------------------------------------------------
# LSE layout: the only place that knows how a backend lays it out


def lse_from_backend(lse, rows):
    """The backend's LSE as [B, H, rows]: a trailing [..., 1] (cuDNN-style) dropped, row padding (lengths rounded
    up to a block multiple by some kernels) cut off."""
    if lse.dim() == 4 and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    return lse[..., :rows] if lse.shape[-1] != rows else lse


def lse_to_backend(lse, multiple):
    """[B, H, rows] back in the backend's padded length (pad rows are never read), contiguous: the CUDA kernels
    read it through a bare pointer, and document attention hands in row slices."""
    rows = lse.shape[-1]
    pad = -rows % multiple
    return torch.nn.functional.pad(lse, (0, pad)) if pad else lse.contiguous()


def _pad_head(x, multiple):
    d = x.shape[-1]
    return x if d % multiple == 0 else torch.nn.functional.pad(x, (0, multiple - d % multiple))


# ----------------------------------------------------------------------------------------------------------------
# the adapter


class AtenFlash:
    """forward / backward of one kernels.py block (see its module doc) through an OpTable's aten ops."""

    def __init__(self, table: OpTable, ops=None):
        self.table = table
        self._ops = ops  # (forward, backward) callables; None: torch.ops.aten's, looked up at call time

    def _calls(self):
        return self._ops or (_op(self.table.forward), _op(self.table.backward))

    def _run_forward(self, q, k, v, causal, scale):
        """[B, H, L, d] in -> (out [B, H, Lq, d], lse [B, H, Lq])."""
        d, m = q.shape[-1], self.table.head_dim_multiple
        res = self._calls()[0](*self.table.forward_args(_pad_head(q, m), _pad_head(k, m), _pad_head(v, m), causal),
                               scale=scale)
        return res[0][..., :d], lse_from_backend(res[1], q.shape[2])

    def _run_backward(self, dout, q, k, v, out, lse, causal, scale):
        d, m = q.shape[-1], self.table.head_dim_multiple
        args = self.table.backward_args(*(_pad_head(x, m) for x in (dout, q, k, v, out)),
                                        lse_to_backend(lse, self.table.lse_multiple), causal)
        dq, dk, dv = self._calls()[1](*args, scale=scale)[:3]
        return dq[..., :d], dk[..., :d], dv[..., :d]

    def forward(self, q, k, v, *, causal, scale):
        B, Lq, Hq, _ = q.shape
        hkv = k.shape[2]
        g = Hq // hkv
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, Lk, d]
        if not causal:
            o, lse = self._run_forward(_fold(q, hkv), kt, vt, False, scale)
            return _unfold(o, g), lse.reshape(B, Hq, Lq)
        if g > 1:
            kt, vt = kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1)
        o, lse = self._run_forward(q.transpose(1, 2), kt, vt, True, scale)
        return o.transpose(1, 2), lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        B, Lq, Hq, d = q.shape
        hkv = k.shape[2]
        g = Hq // hkv
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        if not causal:
            dq, dk, dv = self._run_backward(_fold(dout, hkv), _fold(q, hkv), kt, vt, _fold(out, hkv),
                                            lse.reshape(B, hkv, g * Lq), False, scale)
            return _unfold(dq, g), dk.transpose(1, 2), dv.transpose(1, 2)
        if g > 1:
            kt, vt = kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1)
        dq, dk, dv = self._run_backward(dout.transpose(1, 2), q.transpose(1, 2), kt, vt, out.transpose(1, 2), lse,
                                        True, scale)
        if g > 1:
            Lk = k.shape[1]
            dk = dk.reshape(B, hkv, g, Lk, d).sum(2)
            dv = dv.reshape(B, hkv, g, Lk, d).sum(2)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
