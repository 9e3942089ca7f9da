"""The aten_flash backend: schema pins, the shared adapter (fake op tables, the real ops' meta kernels) and the
backend selection on (mocked) CUDA.

The adapter calls torch's private attention ops by POSITION. The pins below are the schemas of this torch; a
tuple lists the names a parameter has had in the supported range (torch 2.11's flash backward called the rng
values philox_seed / philox_offset, 2.13's _flash_attention_backward calls them rng_state / unused; the forward's
returns were renamed the same way, and are read by position). A torch that renames, reorders or adds a required
argument fails here, and at run time `table_problem` turns the backend off with a warning naming the op.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import warnings

import pytest
import torch
from test_kernels import CASES, run_case

from ds_tsp.core.layers.attention import aten as aten_attention
from ds_tsp.core.layers.attention import kernels, varlen
from ds_tsp.core.layers.attention.aten import CPU_OPS, CUDA_OPS, AtenFlash, signature_problem, table_problem

QKV = ["query", "key", "value"]
RNG = [("philox_seed", "rng_state"), ("philox_offset", "unused")]
# op: (positional parameter names, keyword-only names the adapter uses, number of returns, names of returns 0 and 1)
PINS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        QKV + ["dropout_p", "is_causal"], ["scale"], 2, ("output", "logsumexp")),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        ["grad_out"] + QKV + ["out", "logsumexp", "dropout_p", "is_causal"], ["scale"], 3, None),
    "_scaled_dot_product_flash_attention": (
        QKV + ["dropout_p", "is_causal", "return_debug_mask"], ["scale"], 9, ("output", "logsumexp")),
    "_scaled_dot_product_flash_attention_backward": (
        ["grad_out"] + QKV + ["out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                              "is_causal"] + RNG, ["scale"], 3, None),
    "_flash_attention_forward": (
        QKV + ["cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "return_debug_mask"],
        ["scale", "window_size_left", "window_size_right"], 5, ("output", "softmax_logsumexp")),
    "_flash_attention_backward": (
        ["grad_out"] + QKV + ["out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                              "is_causal"] + RNG, ["scale", "window_size_left", "window_size_right"], 3, None),
}


def _matches(name, want):
    return name in ((want,) if isinstance(want, str) else want)


@pytest.mark.parametrize("op", list(PINS))
def test_schema_pins(op):
    schema = getattr(torch.ops.aten, op).default._schema
    params, keywords, n_returns, return_names = PINS[op]
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    assert len(positional) == len(params) and all(map(_matches, positional, params)), str(schema)
    assert set(keywords) <= {a.name for a in schema.arguments if a.kwarg_only}, str(schema)
    assert len(schema.returns) == n_returns, str(schema)
    assert all(str(r.type) == "Tensor" for r in schema.returns[:2]), str(schema)
    if return_names:
        assert tuple(r.name for r in schema.returns[:2]) == return_names, str(schema)


def test_adapter_tables_agree_with_the_pins():
    """What the adapter passes is a prefix of the pinned parameters (the rest have defaults), on this torch."""
    for table in (CPU_OPS, CUDA_OPS):
        for op, params in ((table.forward, table.forward_params), (table.backward, table.backward_params)):
            assert list(params) == PINS[op][0][:len(params)], op
        assert table_problem(table) is None
    assert list(varlen.AtenVarlen.FORWARD_PARAMS) == PINS["_flash_attention_forward"][0]
    assert list(varlen.AtenVarlen.BACKWARD_PARAMS) == PINS["_flash_attention_backward"][0]
    assert varlen.AtenVarlen().problem() is None


@pytest.mark.parametrize("schema, problem", [
    ("aten::f(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, *, float? scale=None)"
     " -> (Tensor output, Tensor logsumexp)", None),
    ("aten::f(Tensor query, Tensor key, Tensor value, bool is_causal=False, float dropout_p=0., *, float? scale=None)"
     " -> (Tensor output, Tensor logsumexp)", "argument 3 is 'is_causal'"),
    ("aten::f(Tensor q, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, *, float? scale=None)"
     " -> (Tensor output, Tensor logsumexp)", "argument 0 is 'q'"),
    ("aten::f(Tensor query, Tensor key, Tensor value, float dropout_p, bool is_causal, Tensor extra, *, "
     "float? scale=None) -> (Tensor output, Tensor logsumexp)", "needs arguments ds_tsp does not pass: ['extra']"),
    ("aten::f(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, *, "
     "float? softmax_scale=None) -> (Tensor output, Tensor logsumexp)", "lacks keyword arguments ['scale']"),
    ("aten::f(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, *, float? scale=None)"
     " -> Tensor", "returns 1 values"),
    ("aten::f(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, *, float? scale=None,"
     " int mode) -> (Tensor output, Tensor logsumexp)", "needs keyword arguments ds_tsp does not pass: ['mode']"),
])
def test_signature_problem_catches_changes(schema, problem):
    got = signature_problem(torch._C.parse_schema(schema), CPU_OPS.forward_params, min_returns=2)
    assert got == problem if problem is None else problem in got


# ---- the shared adapter with a fake CUDA op table (CPU numerics underneath) --------------------------------------


def _fake_cuda_ops(lse_pad=1, trailing_one=False, seen=None):
    """Functions with the CUDA ops' signatures, computing with the CPU op; the LSE comes back padded to a multiple
    of `lse_pad` (with junk in the pad) and / or with a trailing [..., 1] dim, as some kernels return it."""
    cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        assert dropout_p == 0.0 and return_debug_mask is False and query.shape[-1] % 8 == 0
        assert query.shape[1] == key.shape[1], "the CUDA op gets Hq == Hkv from the adapter, like the CPU op"
        out, lse = cpu_fwd(query, key, value, dropout_p, is_causal, scale=scale)
        L = lse.shape[-1]
        lse = torch.cat([lse, lse.new_full(lse.shape[:-1] + (-L % lse_pad,), 1e4)], dim=-1)
        if trailing_one:
            lse = lse.unsqueeze(-1)
        seen.append(("forward", is_causal, tuple(query.shape), tuple(key.shape)))
        return out, lse, None, None, query.shape[2], key.shape[2], torch.empty(2), torch.empty(()), torch.empty(0)

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, philox_seed, philox_offset, *, scale=None):
        assert cum_seq_q is None and cum_seq_k is None and (max_q, max_k) == (query.shape[2], key.shape[2])
        assert logsumexp.shape[-1] % lse_pad == 0 and logsumexp.shape[-1] >= max_q
        assert logsumexp.is_contiguous()  # the CUDA kernel reads it through a bare pointer
        seen.append(("backward", is_causal))
        return cpu_bwd(grad_out, query, key, value, out, logsumexp[..., :max_q], dropout_p, is_causal, scale=scale)

    return forward, backward


@pytest.mark.parametrize("lse_pad, trailing_one", [(1, False), (128, False), (16, True)])
@pytest.mark.parametrize("case", CASES[1:5] + [(2, 5, 6, 4, 2, 12)],
                         ids=lambda c: "B{}_Lq{}_qs{}_Hq{}_Hkv{}_d{}".format(*c))
def test_cuda_table_adapter_float64_exact(case, lse_pad, trailing_one, monkeypatch):
    seen = []
    table = dataclasses.replace(CUDA_OPS, lse_multiple=lse_pad)
    impl = AtenFlash(table, ops=_fake_cuda_ops(lse_pad, trailing_one, seen))
    monkeypatch.setitem(kernels._IMPLS, "math", impl)  # route backend="math" through the CUDA adapter
    errs = run_case("math", case, torch.float64)
    assert max(errs.values()) < 1e-12, errs
    B, Lq, q_start, Hq, Hkv, d = case
    d8 = -(-d // 8) * 8
    if q_start:  # the unmasked block folds the query group into the rows: K/V not repeated
        assert ("forward", False, (B, Hkv, Hq // Hkv * Lq, d8), (B, Hkv, q_start, d8)) in seen
    assert ("forward", True, (B, Hq, Lq, d8), (B, Hq, Lq, d8)) in seen  # diagonal: the short K/V slice repeated
    assert sum(s[0] == "backward" for s in seen) == sum(s[0] == "forward" for s in seen)


def test_cuda_table_adapter_under_document_attention(monkeypatch):
    """The decomposition hands the kernels row slices of the merged out / lse: exact, and contiguous LSE."""
    from test_document_attention import run

    monkeypatch.setitem(kernels._IMPLS, "math", AtenFlash(CUDA_OPS, ops=_fake_cuda_ops(seen=[])))
    for rows, window, q_start, Lq in (([(0, 10, 30, 33, 40)], 7, 32, 16),
                                      ([(0, 3, 9), (0, 12), (0, 3, 9)], 4, 0, 16)):
        errs = run("math", rows, window, q_start, Lq)
        assert max(errs.values()) < 1e-12, errs


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
def test_real_cuda_ops_take_the_arguments_on_meta(heads):
    """torch's _scaled_dot_product_flash_attention and _backward, dispatched to their meta kernels."""
    meta = torch.device("meta")
    Hq, Hkv = heads
    q = torch.empty(2, 5, Hq, 12, dtype=torch.bfloat16, device=meta)
    k = torch.empty(2, 9, Hkv, 12, dtype=torch.bfloat16, device=meta)
    impl = kernels._IMPLS["aten_flash"]
    for causal, kk in ((False, k[:, :4]), (True, k[:, 4:])):
        out, lse = impl.forward(q, kk, kk, causal=causal, scale=0.3)
        assert out.shape == q.shape and lse.shape == (2, Hq, 5) and lse.dtype == torch.float32
        grads = impl.backward(out, q, kk, kk, out, lse, causal=causal, scale=0.3)
        assert [g.shape for g in grads] == [q.shape, kk.shape, kk.shape]


def test_lse_layouts():
    lse = torch.arange(24.0).view(1, 2, 12)
    assert aten_attention.lse_from_backend(lse, 12) is lse
    assert torch.equal(aten_attention.lse_from_backend(lse, 5), lse[..., :5])
    assert torch.equal(aten_attention.lse_from_backend(lse.unsqueeze(-1), 12), lse)
    padded = aten_attention.lse_to_backend(lse[..., :5], 16)
    assert padded.shape == (1, 2, 16) and torch.equal(padded[..., :5], lse[..., :5])


# ---- selection on CUDA (mocked) --------------------------------------------------------------------------------


@pytest.fixture
def cuda(monkeypatch):
    """A mocked sm90 device, torch built with flash attention, flash-attn absent; returns a configurator."""
    monkeypatch.setattr(kernels, "_WARNED", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    kernels._flash_attn_status.cache_clear()

    def flash_attn(outcome):
        def load():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        monkeypatch.setattr(kernels, "_import_flash_attn", load)
        kernels._flash_attn_status.cache_clear()

    flash_attn(ImportError("No module named 'flash_attn'"))
    yield flash_attn
    kernels._flash_attn_status.cache_clear()


def _select(dtype=torch.bfloat16, head_dim=128):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = kernels.select_backend("cuda", dtype, head_dim=head_dim)
    return backend, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_cuda_without_flash_attn_uses_aten_flash(cuda):
    assert _select() == ("aten_flash", [])
    assert _select(torch.float16, 256) == ("aten_flash", [])


@pytest.mark.parametrize("error", [ImportError("undefined symbol: _ZN3c10"), OSError("libcudart.so.11: cannot open"),
                                   RuntimeError("CUDA error: no kernel image")])
def test_cuda_with_broken_flash_attn_uses_aten_flash(cuda, error):
    cuda(error)
    assert _select() == ("aten_flash", [])
    why = kernels._flash_attn_status()[1]
    assert why.startswith("not importable" if isinstance(error, ImportError) else f"fails to load: {type(error).__name__}")
    assert str(error) in why


def test_cuda_with_flash_attn_uses_it(cuda):
    cuda(types.SimpleNamespace(_flash_attn_forward=None))
    assert _select() == ("flash_attn", [])


def test_cuda_old_gpu_falls_to_math_with_one_warning(cuda, monkeypatch):
    cuda(types.SimpleNamespace(_flash_attn_forward=None))  # present, but the GPU is too old for it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    backend, warned = _select()
    assert backend == "math" and len(warned) == 1 and "compute capability 7.5" in warned[0]
    assert _select() == ("math", [])  # once per process


def test_cuda_fp32_falls_to_math_with_the_reason(cuda):
    backend, warned = _select(torch.float32)
    assert backend == "math" and len(warned) == 1 and "torch.float32" in warned[0]
    backend, warned = _select(head_dim=320)
    assert backend == "math" and len(warned) == 1 and "head_dim 320" in warned[0]


def test_cuda_without_any_flash_kernel_names_both_reasons(cuda, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    backend, warned = _select()
    assert backend == "math" and len(warned) == 1
    assert "No module named 'flash_attn'" in warned[0] and "no flash attention" in warned[0]


def test_cuda_with_a_renamed_op_falls_to_math(cuda, monkeypatch):
    monkeypatch.setattr(kernels, "table_problem", lambda table: "aten.x: argument 3 is 'renamed', not 'dropout_p'")
    backend, warned = _select()
    assert backend == "math" and "renamed" in warned[0]


def test_real_import_failure_is_caught(monkeypatch):
    """The real import path, with flash_attn made unimportable (None in sys.modules raises ImportError)."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    kernels._flash_attn_status.cache_clear()
    try:
        module, why = kernels._flash_attn_status()
        assert module is None and "not importable" in why
    finally:
        kernels._flash_attn_status.cache_clear()


def test_aten_flash_needs_cuda_half_tensors():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="aten_flash.*CUDA"):
        kernels.attention_forward(q, q, q, q_start=0, scale=1.0, backend="aten_flash")
