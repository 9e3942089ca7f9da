"""flash-linear-attention's chunk_gated_delta_rule as the chunk kernel of TSP Gated DeltaNet (CUDA, fp16 / bf16).

TSP needs more from a chunk than its output: o_local, q_eff, and the transition (M, U)
(ds_tsp.core.layers.linear_attention.delta_rule). FLA's kernel returns an output and a final state from a given initial
state, and the recurrence is linear in (v, initial state), so ONE call yields all four: append dk zero columns to v and
start from h0 = [0 | I] ([dk, dv + dk]):

    output      = [o_local | q_eff]        (the I columns carry q_t^T P_t, P_t the transition up to token t)
    final state = [U       | M    ]        (U: the end state from zero; M = P_T acting on I)

Packed documents run as FLA's variable-length sequences (cu_seqlens over the B rows flattened, one sequence per
document piece of a chunk); a piece after a document start starts from h0 = 0, so it contributes neither q_eff nor
M, exactly as the torch kernel's resets. No host sync: the plan is built on the host and copied once (pinned,
non_blocking), its host copy passed as cu_seqlens_cpu where FLA takes it (else FLA reads cu_seqlens back itself),
and a chunk where no row starts a document runs as FLA's plain batch, without cu_seqlens.
The value width grows from dv to dv + dk: about twice the kernel's work,
still far below the pure-torch path on a GPU.

Selection (`select_delta_rule_backend`, like ds_tsp.core.layers.attention.kernels.select_backend): "fla" on CUDA for
fp16 / bf16 when `fla` imports (FLA refuses float32); "torch" everywhere else (float32 / float64: the exact path). On
CUDA without FLA, or in float32 / float64 (which FLA refuses), it says so once per process and reason, with the fix
(pip install flash-linear-attention; train in bfloat16): the torch kernel is launch-bound on a GPU. `warm_up` compiles
FLA's kernels for a shape class with a tiny call before the layer posts its first collective (Triton's first-call
JIT and autotune would otherwise run inside a head block while the other ranks wait). Never run on a GPU here: the
adapter is tested on the CPU against the torch kernel with a stand-in that follows FLA's documented contract.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import torch

BACKENDS = ("fla", "torch")
_HALF = (torch.float16, torch.bfloat16)


def _import_fla():
    return importlib.import_module("fla.ops.gated_delta_rule")


@functools.lru_cache(maxsize=None)
def _fla_status():
    """(fla's chunk_gated_delta_rule or None, why not)."""
    try:
        return _import_fla().chunk_gated_delta_rule, None
    except ImportError as err:
        return None, f"flash-linear-attention is not installed ({err}); pip install flash-linear-attention"
    except Exception as err:  # noqa: BLE001 - a wheel that fails to load (triton / CUDA mismatch): do not use it
        return None, f"flash-linear-attention fails to load: {type(err).__name__}: {err}"


_WARNED: set = set()


def _say_once(why: str) -> None:
    if why not in _WARNED:  # the layer runs per block and layer: say it once per process and reason
        _WARNED.add(why)
        warnings.warn(f"ds_tsp Gated DeltaNet uses its pure-torch chunk kernel on CUDA: {why}", RuntimeWarning,
                      stacklevel=4)


def select_delta_rule_backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """"fla" or "torch" for the Gated DeltaNet chunk kernel on tensors of `device` / `dtype` (the layer's input).
    On CUDA the pure-torch kernel is launch-bound (a Python loop of small GEMMs per 64-token sub-chunk): choosing
    it there is said once per process and reason, with the fix."""
    if torch.device(device).type != "cuda":
        return "torch"
    if dtype not in _HALF:
        _say_once(f"the model runs in {dtype} and flash-linear-attention takes only float16 / bfloat16; the torch "
                  "kernel is exact but launch-bound on a GPU (a Python loop of small GEMMs per 64-token sub-chunk): "
                  "train in bfloat16 (bf16 weights or autocast) with flash-linear-attention installed for its fused "
                  "kernel")
        return "torch"
    fn, why = _fla_status()
    if fn is None:
        _say_once(why)
        return "torch"
    return "fla"


_WARM: set = set()


def warm_up(fn, heads: int, dk: int, dv: int, device: torch.device, kernel_dtype: torch.dtype) -> bool:
    """Compile FLA's forward and backward kernels for one shape class (value heads, dk, dv, device, dtype) with a
    tiny call of each variant the layer uses (plain batch and variable-length), once per process. Triton's
    first-call JIT and autotune then run here, before the layer posts a collective, instead of inside a head block
    while the other ranks already wait on its transitions. True when this call did the work."""
    key = (fn, heads, dk, dv, torch.device(device), kernel_dtype)
    if key in _WARM:
        return False
    _WARM.add(key)
    c, cd = 128, torch.float32  # two of FLA's 64-token chunks; the compute dtype the layer hands the adapter
    with torch.enable_grad():
        leaves = [torch.zeros(1, heads, c, d, dtype=cd, device=device, requires_grad=True) for d in (dk, dk, dv)]
        leaves += [torch.zeros(1, heads, c, dtype=cd, device=device, requires_grad=True) for _ in range(2)]
        for starts in (((),), ((c // 2,),)):  # plain batch, then variable-length (cu_seqlens)
            outs = fla_chunk_transition(fn, *leaves, starts, kernel_dtype)
            torch.autograd.grad(sum(o.float().sum() for o in outs), leaves, allow_unused=True)
    return True


def fla_kernel():
    """FLA's chunk_gated_delta_rule (raises with the install hint when it is not importable)."""
    fn, why = _fla_status()
    if fn is None:
        raise RuntimeError(f"delta rule backend 'fla' requested but {why}")
    return fn


@functools.lru_cache(maxsize=None)
def _takes_host_cu(fn) -> bool:
    """Whether FLA's `fn` takes cu_seqlens_cpu (the host copy it reads lengths from instead of the device tensor:
    FLA >= 0.4.2; older ones would raise on it or swallow it unread)."""
    try:
        return "cu_seqlens_cpu" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or wrapped callable without a signature: pass only what all take
        return False


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` in ONE copy that does not wait: from pinned memory, non_blocking, on CUDA."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device, copy=True)  # never the host tensor itself, also on the CPU: the two stay apart


@functools.lru_cache(maxsize=16)
def _varlen_plan(doc_starts_in_chunk: tuple[tuple[int, ...], ...], chunk_len: int, device: torch.device):
    """(cu_seqlens [N+1] int64 on `device`, the same on the host, reads_start [N] float32 (1: the piece continues
    the chunk's incoming document), last [B] int64 (index of each row's last piece)) for rows flattened back to
    back; built on the host and copied in ONE non-blocking copy, once per layout (no host sync: an element
    assignment `t[i] = v` on a CUDA tensor would wait for each value). doc_starts_in_chunk: per row, the chunk
    offsets where documents start."""
    bounds, reads, last = [0], [], []
    for b, starts in enumerate(doc_starts_in_chunk):
        cuts = sorted({0, chunk_len, *starts})
        for i, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
            bounds.append(b * chunk_len + hi)
            reads.append(int(i == 0 and 0 not in starts))
        last.append(len(reads) - 1)
    with torch.inference_mode(False):  # a cached inference tensor would be unusable once autograd records
        host = torch.tensor(bounds + reads + last, dtype=torch.int64, device="cpu")
        on_device = _on_device(host, torch.device(device))
        cu, reads_t, last_t = on_device.split([len(bounds), len(reads), len(last)])
    return cu, host[:len(bounds)], reads_t.to(torch.float32), last_t


def fla_chunk_transition(fn, q, k, v, g, beta, doc_starts_in_chunk: tuple[tuple[int, ...], ...], kernel_dtype):
    """(o_local, q_eff, M, U) as ds_tsp.core.layers.linear_attention.delta_rule.chunk_gated_delta_rule returns them,
    from one call of FLA's chunk_gated_delta_rule `fn`. q, k, v: [B, H, c, d] (q normalized and scaled, k normalized),
    g, beta: [B, H, c], all in the compute dtype; kernel_dtype: what q, k, v enter FLA as (the layer's fp16 / bf16).

    A chunk where no row starts a document runs as FLA's plain batch (B sequences, no cu_seqlens: nothing for FLA
    to read on the host); otherwise as variable-length sequences with the host copy of cu_seqlens passed along
    where FLA takes it (cu_seqlens_cpu), so it never reads the device tensor back."""
    B, H, c, dk = k.shape
    dv = v.shape[-1]
    v_ext = torch.cat([v, v.new_zeros(B, H, c, dk)], dim=-1)
    eye = torch.eye(dk, dtype=torch.float32 if kernel_dtype in _HALF else q.dtype, device=q.device)
    if not any(doc_starts_in_chunk):
        rows = lambda t: t.transpose(1, 2)  # noqa: E731 [B, c, H, .]
        h0 = torch.cat([eye.new_zeros(B, H, dk, dv), eye.expand(B, H, dk, dk)], dim=-1)
        o, ht = fn(rows(q).to(kernel_dtype), rows(k).to(kernel_dtype), rows(v_ext).to(kernel_dtype), rows(g),
                   rows(beta).to(kernel_dtype), scale=1.0, initial_state=h0, output_final_state=True,
                   use_qk_l2norm_in_kernel=False)
        o = o.transpose(1, 2).to(q.dtype)
        state = ht.to(q.dtype)
        return o[..., :dv], o[..., dv:], state[..., dv:], state[..., :dv]
    cu, cu_host, reads, last = _varlen_plan(doc_starts_in_chunk, c, q.device)
    flat = lambda t: t.transpose(1, 2).reshape(1, B * c, *t.shape[1:2], *t.shape[3:])  # noqa: E731 [1, B c, H, .]
    h0 = torch.cat([eye.new_zeros(reads.shape[0], H, dk, dv),
                    eye.expand(reads.shape[0], H, dk, dk) * reads.to(eye.dtype)[:, None, None, None]], dim=-1)
    host_cu = {"cu_seqlens_cpu": cu_host} if _takes_host_cu(fn) else {}
    o, ht = fn(flat(q).to(kernel_dtype), flat(k).to(kernel_dtype), flat(v_ext).to(kernel_dtype),
               flat(g.unsqueeze(-1)).squeeze(-1), flat(beta.unsqueeze(-1)).squeeze(-1).to(kernel_dtype),
               scale=1.0, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu,
               **host_cu)
    o = o.reshape(B, c, H, dv + dk).transpose(1, 2).to(q.dtype)
    state = ht.index_select(0, last).to(q.dtype)  # [B, H, dk, dv + dk]: each row's last piece
    return o[..., :dv], o[..., dv:], state[..., dv:], state[..., :dv]
