"""Local causal attention with log-sum-exp: forward and backward as plain functions.

The TSP attention layer calls these from its own autograd.Function: it saves `out` and `lse` (both O(local
tokens)) in forward and hands them back to `attention_backward`, so K/V never need to be kept or recomputed.

Geometry (one call)::

    q    [B, Lq, Hq, d]    queries at global positions q_start .. q_start+Lq-1
    k, v [B, Lk, Hkv, d]   keys at positions 0 .. Lk-1, Lk == q_start + Lq (the causal prefix of the chunk)
    out  [B, Lq, Hq, d]    query t attends keys 0..t (causal mask aligned bottom-right)
    lse  opaque            log-sum-exp of the scaled scores; only ever passed back to attention_backward

Query head i reads kv head i // (Hq // Hkv) (GQA; MQA when Hkv == 1).

No [Lq, Lk] mask is ever built. The keys split into two blocks::

    keys [0, q_start)              seen by every query: no mask             -> (o1, lse1)
    keys [q_start, q_start + Lq)   square and causal (top-left == bottom-right) -> (o2, lse2)
    lse = logaddexp(lse1, lse2);  out = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)

Backward runs each block's kernel backward with the MERGED out and lse: a flash backward forms
P = exp(S * scale - lse) and Dv = rowsum(dout * out), so with the final values each call returns the exact
partial gradients; dq = dq1 + dq2 and dk, dv are the two blocks concatenated on the sequence dim.

Backends (`select_backend`, first usable wins):

    "flash_attn"  CUDA sm80+, fp16/bf16, head_dim <= 256, flash-attn 2.x importable (GQA native). Never run on
                  a GPU yet (developed without one); only its argument adapter is tested, with a fake module.
    "aten_flash"  the same CUDA cases without a working flash-attn: torch's own flash kernel,
                  aten::_scaled_dot_product_flash_attention and its _backward (ds_tsp/core/layers/attention/aten.py).
    "cpu_flash"   CPU, float64/float32/bfloat16/float16: aten::_scaled_dot_product_flash_attention_for_cpu
                  and its _backward, through the SAME adapter as aten_flash (only the op table differs).
    "math"        pure torch, any device and dtype; the readable definition and the fallback. On CUDA it upcasts
                  to fp32 and builds [B, H, 256, Lk] temporaries, so falling to it there warns once per reason.

Every backend returns lse as [B, Hq, Lq] in float32 (float64 for float64 inputs), but that is a detail: the
contract is that `attention_backward` must use the SAME backend as the `attention_forward` that produced
`lse` (pass the same `backend=` override, or none on both with the same device and dtype).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import torch

from ds_tsp.core.layers.attention.aten import CPU_OPS, CUDA_OPS, AtenFlash, _grouped, _ungroup, table_problem

BACKENDS = ("flash_attn", "aten_flash", "cpu_flash", "math")

_HALF = (torch.float16, torch.bfloat16)
_MATH_BLOCK_ROWS = 256  # query rows per block in the math backend: temporaries are [B, H, 256, Lk]


# ----------------------------------------------------------------------------------------------------------------
# public API


def select_backend(device: torch.device | str, dtype: torch.dtype, *, head_dim: int | None = None) -> str:
    """The backend attention_forward / attention_backward use for tensors on `device` with `dtype`."""
    device = torch.device(device)
    if device.type == "cuda":
        backend, why = _cuda_choice(device, dtype, head_dim)
        if backend == "math":
            _warn_math(why, "CUDA")
        return backend
    if device.type == "cpu" and dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        why = table_problem(CPU_OPS)
        if why is None:
            return "cpu_flash"
        _warn_math(why, "CPU")
    return "math"


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, scale: float,
                      backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q (positions q_start..) over the key prefix k, v. Returns (out, lse); see module doc."""
    _check_shapes(q, k, v, q_start)
    impl = _backend_impl(backend, q)
    B, Lq, Hq, d = q.shape
    if Lq == 0:
        return q.new_empty(q.shape), torch.empty(B, Hq, 0, dtype=_lse_dtype(q.dtype), device=q.device)
    if q_start == 0:
        return impl.forward(q, k, v, causal=True, scale=scale)
    o1, lse1 = impl.forward(q, k[:, :q_start], v[:, :q_start], causal=False, scale=scale)
    o2, lse2 = impl.forward(q, k[:, q_start:], v[:, q_start:], causal=True, scale=scale)
    return _merge(o1, lse1, o2, lse2)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, *, q_start: int, scale: float,
                       backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention_forward; `out`, `lse` are what it returned (same backend!)."""
    pieces = KVPieces()
    dq = attention_backward_pieces(dout, q, k, v, out, lse, q_start=q_start, scale=scale, backend=backend,
                                   take_kv=pieces)
    return dq, *pieces.whole()


class KVPieces:
    """A take_kv that keeps the key blocks' dK / dV in order; whole() concatenates them along the keys."""

    def __init__(self):
        self.dk, self.dv = [], []

    def __call__(self, start: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.dk.append(dk)
        self.dv.append(dv)

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.dk) == 1:
            return self.dk[0], self.dv[0]
        return torch.cat(self.dk, dim=1), torch.cat(self.dv, dim=1)


def attention_backward_pieces(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, *, q_start: int, scale: float,
                              backend: str | None, take_kv) -> torch.Tensor:
    """attention_backward with dK / dV handed over per key block as each kernel returns it: take_kv(key start,
    dk, dv) (keys [0, q_start), then [q_start, q_start + Lq)); returns dq. The caller adds each block where it
    belongs, so no [B, Lk] dK / dV is concatenated and the first block's are gone before the second kernel runs."""
    _check_shapes(q, k, v, q_start)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    impl = _backend_impl(backend, q)
    if q.shape[1] == 0:
        take_kv(0, torch.zeros_like(k), torch.zeros_like(v))
        return torch.zeros_like(q)
    if q_start == 0:
        dq, dk, dv = impl.backward(dout, q, k, v, out, lse, causal=True, scale=scale)
        take_kv(0, dk, dv)
        return dq
    dq1, dk, dv = impl.backward(dout, q, k[:, :q_start], v[:, :q_start], out, lse, causal=False, scale=scale)
    take_kv(0, dk, dv)
    del dk, dv
    dq2, dk, dv = impl.backward(dout, q, k[:, q_start:], v[:, q_start:], out, lse, causal=True, scale=scale)
    take_kv(q_start, dk, dv)
    return (dq1.float() + dq2.float()).to(q.dtype) if q.dtype in _HALF else dq1 + dq2


# ----------------------------------------------------------------------------------------------------------------
# shared plumbing


def _check_shapes(q, k, v, q_start):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B, Lq, Hq, d] and k, v [B, Lk, Hkv, d] (equal); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, Lq, Hq, d = q.shape
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if Hq % k.shape[2]:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={k.shape[2]}")
    if q_start < 0 or k.shape[1] != q_start + Lq:
        raise ValueError(f"keys must be the causal prefix of the queries: Lk={k.shape[1]} != q_start={q_start} + "
                         f"Lq={Lq}")


def _backend_impl(backend, q):
    if backend is None:
        backend = select_backend(q.device, q.dtype, head_dim=q.shape[-1])
    if backend not in _IMPLS:
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS} or None (automatic)")
    if backend == "cpu_flash" and q.device.type != "cpu":
        raise ValueError(f"backend='cpu_flash' needs CPU tensors, got {q.device}")
    if backend in ("flash_attn", "aten_flash") and (q.device.type != "cuda" or q.dtype not in _HALF):
        raise ValueError(f"backend={backend!r} needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
    return _IMPLS[backend]


def _cuda_choice(device, dtype, head_dim):
    """(backend, why not a fused kernel) on a CUDA device."""
    if dtype not in _HALF:
        return "math", f"dtype {dtype} (the fused kernels take float16 / bfloat16)"
    if head_dim is not None and head_dim > 256:
        return "math", f"head_dim {head_dim} > 256"
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError) as err:  # no driver / device: keep the reason, do not crash selection
        return "math", f"no usable CUDA device ({err})"
    if major < 8:
        return "math", f"compute capability {major}.{minor} < 8.0 (flash kernels need Ampere or newer)"
    if _flash_attn_module() is not None:
        return "flash_attn", None
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    aten_why = table_problem(CUDA_OPS) or (None if available() else "this torch build has no flash attention")
    if aten_why is None:
        return "aten_flash", None
    return "math", f"flash-attn unusable ({_flash_attn_status()[1]}) and torch's flash kernel too ({aten_why})"


_WARNED: set = set()


def _warn_math(why, where):
    if why not in _WARNED:  # attention runs per block, layer and chunk: say it once per process and reason
        _WARNED.add(why)
        warnings.warn(f"ds_tsp attention falls back to the pure-torch 'math' kernel on {where}: {why}. It computes "
                      "in fp32 blocks of [B, H, 256, Lk] and is several times slower than a flash kernel.",
                      RuntimeWarning, stacklevel=3)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial gradients of one tensor are summed (several blocks, hops or chunks): float32 for half precision,
    the dtype itself otherwise (float64 stays exact)."""
    return torch.float32 if dtype in _HALF else dtype


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(o1, lse1, o2, lse2):
    """Combine two softmax blocks over disjoint keys. o: [B, Lq, H, d]; lse: [B, H, Lq] (float32 or wider)."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).transpose(1, 2).unsqueeze(-1)  # [B, Lq, H, 1]
    w2 = torch.exp(lse2 - lse).transpose(1, 2).unsqueeze(-1)
    acc = lse.dtype
    out = o1.to(acc) * w1 + o2.to(acc) * w2
    return out.to(o1.dtype), lse


# ----------------------------------------------------------------------------------------------------------------
# math backend: pure torch, blocked over queries. Layout inside: [B, Hkv, g, L, d] with g = Hq // Hkv.


class _Math:
    @staticmethod
    def _scores(qb, k, r0, r1, causal, scale):
        """Scaled scores of query rows [r0, r1) against the keys they may see, and that key count."""
        n_keys = r1 if causal else k.shape[-2]  # causal blocks are square: row r sees keys 0..r
        s = torch.matmul(qb, k[..., :n_keys, :].transpose(-1, -2)) * scale  # [B, Hkv, g, r1-r0, n_keys]
        if causal:
            rows = torch.arange(r0, r1, device=qb.device)
            cols = torch.arange(n_keys, device=qb.device)
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        return s, n_keys

    @staticmethod
    def forward(q, k, v, *, causal, scale):
        acc = _lse_dtype(q.dtype)
        hkv = k.shape[2]
        qg = _grouped(q.to(acc), hkv)
        kg = k.to(acc).transpose(1, 2).unsqueeze(2)  # [B, Hkv, 1, Lk, d]
        vg = v.to(acc).transpose(1, 2).unsqueeze(2)
        Lq = q.shape[1]
        out = torch.empty_like(qg)
        lse = qg.new_empty(qg.shape[:-1])  # [B, Hkv, g, Lq]
        for r0 in range(0, Lq, _MATH_BLOCK_ROWS):
            r1 = min(r0 + _MATH_BLOCK_ROWS, Lq)
            s, n = _Math._scores(qg[..., r0:r1, :], kg, r0, r1, causal, scale)
            lse_b = torch.logsumexp(s, dim=-1)
            out[..., r0:r1, :] = torch.matmul(torch.exp(s - lse_b.unsqueeze(-1)), vg[..., :n, :])
            lse[..., r0:r1] = lse_b
        B, _, Hq, _ = q.shape
        return _ungroup(out).to(q.dtype), lse.reshape(B, Hq, Lq)

    @staticmethod
    def backward(dout, q, k, v, out, lse, *, causal, scale):
        acc = _lse_dtype(q.dtype)
        B, Lq, Hq, d = q.shape
        hkv = k.shape[2]
        g = Hq // hkv
        qg = _grouped(q.to(acc), hkv)
        dog = _grouped(dout.to(acc), hkv)
        og = _grouped(out.to(acc), hkv)
        lseg = lse.to(acc).reshape(B, hkv, g, Lq)
        kg = k.to(acc).transpose(1, 2).unsqueeze(2)
        vg = v.to(acc).transpose(1, 2).unsqueeze(2)
        dq = torch.empty_like(qg)
        dk = torch.zeros(B, hkv, k.shape[1], d, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        for r0 in range(0, Lq, _MATH_BLOCK_ROWS):
            r1 = min(r0 + _MATH_BLOCK_ROWS, Lq)
            qb, dob = qg[..., r0:r1, :], dog[..., r0:r1, :]
            s, n = _Math._scores(qb, kg, r0, r1, causal, scale)
            p = torch.exp(s - lseg[..., r0:r1].unsqueeze(-1))  # [B, Hkv, g, rows, n]
            dp = torch.matmul(dob, vg[..., :n, :].transpose(-1, -2))
            dv_rows = (dob * og[..., r0:r1, :]).sum(-1, keepdim=True)  # rowsum(dO * O)
            ds = p * (dp - dv_rows)
            dq[..., r0:r1, :] = torch.matmul(ds, kg[..., :n, :]) * scale
            rows = g * (r1 - r0)  # fold the query group into the rows: the matmul sums over it
            dv[..., :n, :] += torch.matmul(p.reshape(B, hkv, rows, n).transpose(-1, -2), dob.reshape(B, hkv, rows, d))
            dk[..., :n, :] += torch.matmul(ds.reshape(B, hkv, rows, n).transpose(-1, -2),
                                           qb.reshape(B, hkv, rows, d)) * scale
        return (_ungroup(dq).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype))


# ----------------------------------------------------------------------------------------------------------------
# flash_attn backend (CUDA). UNTESTED HERE: no GPU in this repository's CI. Layout [B, L, H, d] natively, GQA
# native, causal=True aligned bottom-right. `_flash_attn_forward` / `_flash_attn_backward` changed signatures
# across 2.x (window_size tuple -> window_size_left/right, softcap, alibi_slopes, deterministic; forward returns
# 8 values up to 2.6 and 4 from 2.7 on; head_dim padding moved from C++ to Python), so arguments are passed by
# name from the installed signature and head_dim is padded to a multiple of 8 here.


def _import_flash_attn():
    return importlib.import_module("flash_attn.flash_attn_interface")


@functools.lru_cache(maxsize=None)
def _flash_attn_status():
    """(flash_attn_interface or None, why not). Loading fails in more ways than ImportError: a wheel built for
    another torch / CUDA raises OSError or RuntimeError from its extension."""
    try:
        return _import_flash_attn(), None
    except ImportError as err:
        return None, f"not importable: {err}"
    except Exception as err:  # noqa: BLE001 - any failure to load means: do not use it
        return None, f"fails to load: {type(err).__name__}: {err}"


def _flash_attn_module():
    return _flash_attn_status()[0]


def _call_by_name(fn, values):
    """Call a flash-attn private function with the arguments its installed signature names."""
    python_fn = getattr(fn, "_init_fn", fn)  # flash-attn >= 2.7 wraps them in torch.library.custom_op
    params = inspect.signature(python_fn).parameters
    kwargs = {}
    for name, param in params.items():
        if name in values:
            kwargs[name] = values[name]
        elif param.default is inspect.Parameter.empty:
            raise RuntimeError(f"unsupported flash-attn version: {python_fn.__name__} needs argument {name!r}; "
                               "this adapter maps the flash-attn 2.x signatures by argument name "
                               "(untested on GPU here)")
    return fn(**kwargs)


_FLASH_STATIC_ARGS = dict(dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1,
                          softcap=0.0, alibi_slopes=None, return_softmax=False, deterministic=False, rng_state=None)


def _pad8(x):
    """Head dim padded to a multiple of 8, last dim contiguous (flash-attn takes any other strides: the K/V prefix
    views of the global-order buffer are read in place, not copied)."""
    d = x.shape[-1]
    x = x if d % 8 == 0 else torch.nn.functional.pad(x, (0, 8 - d % 8))
    return x if x.stride(-1) == 1 else x.contiguous()


class _FlashAttn:
    @staticmethod
    def forward(q, k, v, *, causal, scale):
        fa = _flash_attn_module()
        d = q.shape[-1]
        res = _call_by_name(fa._flash_attn_forward, dict(_FLASH_STATIC_ARGS, q=_pad8(q), k=_pad8(k),
                                                         v=_pad8(v), softmax_scale=scale, causal=causal))
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out[..., :d], lse[..., :q.shape[1]]

    @staticmethod
    def backward(dout, q, k, v, out, lse, *, causal, scale):
        fa = _flash_attn_module()
        d = q.shape[-1]
        q8, k8, v8 = _pad8(q), _pad8(k), _pad8(v)
        dq, dk, dv = torch.empty_like(q8), torch.empty_like(k8), torch.empty_like(v8)
        _call_by_name(fa._flash_attn_backward, dict(_FLASH_STATIC_ARGS, dout=_pad8(dout), q=q8, k=k8, v=v8,
                                                    out=_pad8(out), softmax_lse=lse.contiguous(),
                                                    dq=dq, dk=dk, dv=dv, softmax_scale=scale, causal=causal))
        return dq[..., :d], dk[..., :d], dv[..., :d]


_IMPLS = {"flash_attn": _FlashAttn, "aten_flash": AtenFlash(CUDA_OPS), "cpu_flash": AtenFlash(CPU_OPS), "math": _Math}
