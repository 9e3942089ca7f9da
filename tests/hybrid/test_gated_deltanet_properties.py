"""Gated DeltaNet under TSP, single process: the kernel, drawn cases at D = 1..4, the checkpoint protocol, errors,
host syncs and the meta device.

The D ranks run as threads (tests/helpers/thread_comm.py: the same collectives, met at a barrier), so hypothesis can draw
sequence lengths, document splits, D, head counts and conv kernels cheaply; every case is compared (output, dx and
every weight grad) with transformers' layer in float64 (tests/hybrid/test_gated_deltanet.py: hf_layer; 1e-10). The same
harness shows the comparison fails when one piece of the schedule is broken on purpose (no halo, chunks composed in
rank order instead of sequence order, document resets ignored). The backward's work is counted (each head block
walks its chunk kernels and projections once) and the overlap order checked (a transition gather waited only after
the next block's chunks, a transition-grad reduce-scatter after the out projection's weight grad).
"""
from __future__ import annotations

import dataclasses
import threading
import types

import pytest
import torch
from hypothesis import strategies as st
from property_cases import draw_cases
from test_gated_deltanet import TOL, hf_layer, tsp_layer, tsp_shape
from thread_comm import run_threads

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.linear_attention import scan as linear_attention_scan
from ds_tsp.core.layers.linear_attention.delta_rule import chunk_gated_delta_rule, l2_normalize
from ds_tsp.core.tokens.zigzag import shard, unshard
from ds_tsp.model.state_dict import load_slices, read_from_full
from ds_tsp.tools.gdn_reference import _widened, reference_with_documents

H, DK, DV = 8, 2, 3  # tiny dims: the drawn cases are about lengths, documents and degrees


def _case_errors(D, fmt, nk, nv, kernel, S, docs, seed, backend=None, keep=False, frozen=False) -> dict:
    """max |TSP - transformers| over y, dx and every weight grad for one drawn case (D threads); backend: force
    the delta-rule backend ("fla": through the FLA adapter, with the stand-in installed by the caller); keep: the
    speed mode (every block's forward kept for backward); frozen: the shard frozen (y and dx only)."""
    ref, config = hf_layer(fmt, nk, nv, seed, kernel=kernel, hidden=H, dk=DK, dv=DV)
    g = torch.Generator().manual_seed(seed)
    B = len(docs)
    x = torch.randn(B, S, H, dtype=torch.float64, generator=g)
    dy = torch.randn(B, S, H, dtype=torch.float64, generator=g)

    def rank(comm):
        layer = tsp_layer(ref, config, fmt, comm, kernel=kernel, hidden=H, dk=DK, dv=DV)
        if backend is not None:
            layer.spec = dataclasses.replace(layer.spec, delta_rule_backend=backend)
        layer.spec = dataclasses.replace(layer.spec, keep_activations=keep)
        layer.packed_shard.requires_grad_(not frozen)
        x_local = shard(x, D, comm.rank).requires_grad_()
        y = layer(x_local, docs)
        y.backward(shard(dy, D, comm.rank))
        return layer, y.detach(), x_local.grad, layer.packed_shard.grad, layer.norm.weight.grad, comm.posted

    out = run_threads(D, rank)
    layer = out[0][0]
    xr = x.clone().requires_grad_()
    y_ref = reference_with_documents(ref, xr, docs)
    names, params = zip(*ref.named_parameters())
    grads = torch.autograd.grad(y_ref, (xr, *params), dy)
    errors = {"y": (unshard([o[1] for o in out]) - y_ref).abs().max().item(),
              "dx": (unshard([o[2] for o in out]) - grads[0]).abs().max().item()}
    assert all(o[5] == out[0][5] for o in out), "ranks posted different collectives"
    if frozen:
        return errors
    full = layer.unshard([o[3] for o in out])
    full["norm.weight"] = out[0][4]
    errors.update({n: (full[n] - gr).abs().max().item() for n, gr in zip(names, grads[1:])})
    assert all(o[5] == out[0][5] for o in out), "ranks posted different collectives"
    return errors


@st.composite
def cases(draw):
    # sampled_from lists lead with what matters most: hypothesis starts from (and shrinks toward) the first entry
    D = draw(st.sampled_from([2, 4, 3, 1]))
    nk = D * draw(st.sampled_from([1, 2]))
    nv = nk * draw(st.sampled_from([2, 1]))
    kernel = draw(st.sampled_from([4, 3, 2, 1]))
    c = draw(st.sampled_from([2, 1, 3, 5]))  # zigzag chunk length: shorter than the halo (K-1) or not
    S = 2 * D * c
    rows = []
    for _ in range(draw(st.sampled_from([2, 1]))):
        cuts = draw(st.sets(st.integers(1, S - 1), max_size=4)) if S > 1 else set()
        rows.append(tuple(sorted({0, *cuts})))
    return dict(D=D, fmt=draw(st.sampled_from(["qwen3_5", "qwen3_next"])), nk=nk, nv=nv, kernel=kernel, S=S,
                docs=tuple(rows), seed=draw(st.integers(0, 99)))


# derandomized, spread over shapes (tests/property_cases.draw_cases), plus the case that once found a bug: rank 1's
# chunks both start documents, so its output needs no state, yet it must still post the transitions' grad
# reduce-scatter that rank 0 waits for
DRAWN = draw_cases(cases(), 16) + [dict(D=2, fmt="qwen3_5", nk=2, nv=2, kernel=2, S=4, docs=((0, 1, 2),), seed=0)]


def _case_id(case: dict) -> str:
    return f"D{case['D']}-{case['fmt']}-k{case['kernel']}-S{case['S']}-docs{len(sum(case['docs'], ()))}"


@pytest.mark.parametrize("case", DRAWN, ids=_case_id)
def test_drawn_cases_match_transformers(case):
    errors = _case_errors(**case)
    assert max(errors.values()) < TOL, (case, errors)


@pytest.mark.parametrize("case", DRAWN[::3] + [BROKEN := dict(D=2, fmt="qwen3_5", nk=2, nv=4, kernel=4, S=12,
                                                              docs=((0, 5), (0,)), seed=7)], ids=_case_id)
def test_speed_mode_keeps_every_block_and_still_matches_transformers(case):
    """TSPOptions.speed() (recompute_projections off): each head block's projections and chunk graph are kept from
    forward, backward recomputes nothing and re-gathers nothing; y, dx and every weight grad as transformers'."""
    errors = _case_errors(**case, keep=True)
    assert max(errors.values()) < TOL, (case, errors)


def test_speed_mode_with_a_frozen_shard():
    errors = _case_errors(**BROKEN, keep=True, frozen=True)
    assert max(errors.values()) < TOL, errors


def test_the_draw_covers_degrees_formats_short_chunks_and_document_starts():
    assert {1, 2, 3, 4} <= {c["D"] for c in DRAWN}
    assert {"qwen3_5", "qwen3_next"} <= {c["fmt"] for c in DRAWN}
    assert any(c["S"] // (2 * c["D"]) < c["kernel"] - 1 for c in DRAWN)  # a chunk shorter than the conv halo
    assert any(c["nv"] > c["nk"] for c in DRAWN) and any(c["nk"] > c["D"] for c in DRAWN)
    assert any(len(row) > 2 for c in DRAWN for row in c["docs"])



def test_the_reference_comparison_catches_a_missing_halo(monkeypatch):
    real = linear_attention_scan.conv_halo
    monkeypatch.setattr("ds_tsp.core.layers.linear_attention.gated_deltanet.conv_halo",
                        lambda x, comm, halo: torch.zeros_like(real(x, comm, halo)))
    assert max(_case_errors(**BROKEN).values()) > 1e-3


def test_the_reference_comparison_catches_chunks_composed_out_of_order(monkeypatch):
    monkeypatch.setattr(linear_attention_scan, "global_chunk_slot", lambda g, tsp: (g // 2, g % 2))
    assert max(_case_errors(**BROKEN).values()) > 1e-3


def test_the_reference_comparison_catches_ignored_document_starts(monkeypatch):
    real = linear_attention_scan.chunk_plans
    monkeypatch.setattr("ds_tsp.core.layers.linear_attention.gated_deltanet.chunk_plans",
                        lambda rows, *args: real(((0,),) * len(rows), *args))
    assert max(_case_errors(**BROKEN).values()) > 1e-3


def test_the_sequence_start_is_no_cut():
    """Global token 0 starts the state from zero and its conv taps read the zero halo, so its chunk takes the
    plain path: no reset, no tap mask, no document offset for FLA; a later start in the same chunk still cuts.
    (Exactness of both paths: the drawn cases against transformers, whose rows all start documents at 0.)"""
    plain = linear_attention_scan.chunk_plans(((0,),), 0, 2, 16, 4, torch.float64, torch.device("cpu"))
    assert [(p.reset, p.tap_mask, p.starts_in_chunk) for p in plain] == [(None, None, ((),))] * 2
    first, _ = linear_attention_scan.chunk_plans(((0, 5),), 0, 2, 16, 4, torch.float64, torch.device("cpu"))
    assert first.starts_in_chunk == ((5,),) and first.reset.nonzero().tolist() == [[0, 5]]
    cut_taps = [(t, s) for t, s in first.tap_mask[0].eq(0).nonzero().tolist()]  # (token, tap) reading before 5
    assert cut_taps == [(5, 1), (5, 2), (5, 3), (6, 2), (6, 3), (7, 3)]


def test_kernel_matches_transformers_recurrence_from_any_start_state():
    """o = o_local + q_eff S0 and S_end = M S0 + U against transformers' torch_recurrent_gated_delta_rule (float64)
    for sub-chunk sizes that divide T, do not, and exceed it."""
    rec = _widened("transformers.models.qwen3_5.modeling_qwen3_5")["torch_recurrent_gated_delta_rule"]
    g = torch.Generator().manual_seed(0)
    N, T, Hh, dk, dv = 2, 13, 3, 4, 5
    q, k = (torch.randn(N, T, Hh, dk, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(N, T, Hh, dv, dtype=torch.float64, generator=g)
    decay = -2 * torch.rand(N, T, Hh, dtype=torch.float64, generator=g)
    beta = torch.rand(N, T, Hh, dtype=torch.float64, generator=g)
    s0 = torch.randn(N, Hh, dk, dv, dtype=torch.float64, generator=g)
    o_ref, s_ref = rec(q, k, v, decay, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    for chunk in (1, 4, 13, 64):
        o_local, q_eff, m, u = chunk_gated_delta_rule(t(l2_normalize(q) * dk ** -0.5), t(l2_normalize(k)), t(v),
                                                      t(decay), t(beta), chunk)
        assert (t(o_local + q_eff @ s0) - o_ref).abs().max() < 1e-12
        assert (m @ s0 + u - s_ref).abs().max() < 1e-12


# --- checkpoint protocol ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("D", [1, 2, 4])
def test_slices_load_and_unshard_round_trip_transformers_state_dict(fmt, D):
    """Every rank loads its slices through load_slices (the checkpoint reader's path) from transformers' state
    dict; unshard of all ranks gives back every tensor bit for bit, and per-rank bytes are exactly 1/D of the
    sharded tensors plus the replicated norm weight."""
    ref, config = hf_layer(fmt, 4, 8, 5, hidden=H, dk=DK, dv=DV)
    full = {k: v.detach() for k, v in ref.state_dict().items()}
    layers = []
    for p in range(D):
        comm = types.SimpleNamespace(rank=p, size=D)
        layer = tsp_layer(ref, config, fmt, comm, hidden=H, dk=DK, dv=DV)
        fresh = tsp_layer(ref, config, fmt, comm, hidden=H, dk=DK, dv=DV)
        with torch.no_grad():
            fresh.packed_shard.zero_()
            fresh.norm.weight.zero_()
        load_slices(fresh.sharded_modules(), fresh.replicated_params(), read_from_full(full))
        assert torch.equal(fresh.packed_shard, layer.packed_shard)  # load_slices == shard_full
        layers.append(fresh)
    back = layers[0].unshard([m.packed_shard.detach() for m in layers])
    back.update({n: p.detach() for n, p in layers[0].replicated_params().items()})
    assert set(back) == set(full) and set(layers[0].hf_shapes()) | {"norm.weight"} == set(full)
    assert all(torch.equal(back[n], full[n]) for n in full)
    sharded = sum(t.numel() for n, t in full.items() if n != "norm.weight") * 8
    assert all(m.parameter_bytes() == {"sharded": sharded // D, "replicated": DV * 8} for m in layers)


def test_head_counts_that_do_not_split_name_the_fields_and_the_degrees_that_fit():
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.model.modules.gated_deltanet import TSPGatedDeltaNet

    shape = tsp_shape(4, 8, "qwen3_5", 1e-6)
    with pytest.raises(TSPConfigError, match=r"tsp=3 does not divide linear_num_key_heads=4 .*"
                                             r"linear_num_value_heads=8.*degrees that fit: \[1, 2, 4\]"):
        TSPGatedDeltaNet(shape, types.SimpleNamespace(rank=0, size=3), TSPOptions(), torch.float64, "cpu")
    both = "linear_num_(value_heads=6.*linear_num_key_heads=4|key_heads=4.*linear_num_value_heads=6)"
    with pytest.raises(TSPConfigError, match=both):
        TSPGatedDeltaNet(tsp_shape(4, 6, "qwen3_5", 1e-6), types.SimpleNamespace(rank=0, size=1), TSPOptions(),
                         torch.float64, "cpu")
    with pytest.raises(TSPConfigError, match="hf_format='llama'"):
        TSPGatedDeltaNet(shape, types.SimpleNamespace(rank=0, size=1), TSPOptions(), torch.float64, "cpu",
                         hf_format="llama")


# --- device discipline -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [None, "fla"])
def test_forward_and_backward_have_no_host_sync(backend, monkeypatch):
    """Counted as tests/reliability/test_host_syncs.py counts a training step: no value read, no host data turned into a
    tensor, no element assignment `t[i] = v`, no data-dependent op, at D=2 (threads) with packed documents; "fla":
    through the FLA adapter (the stand-in reads cu_seqlens on the host unless given cu_seqlens_cpu, as FLA does;
    one chunk of rank 0 has no document start: FLA's plain batch)."""
    from sync_counter import SyncCounter

    from ds_tsp.core.layers.linear_attention import delta_rule_fla

    if backend == "fla":
        monkeypatch.setattr(delta_rule_fla, "_fla_status", lambda: (fake_fla_chunk_gated_delta_rule, None))
    ref, config = hf_layer("qwen3_5", 2, 4, 3, hidden=H, dk=DK, dv=DV)
    x = torch.randn(2, 12, H, dtype=torch.float64)

    def rank(comm):
        layer = tsp_layer(ref, config, "qwen3_5", comm, hidden=H, dk=DK, dv=DV)
        layer.spec = dataclasses.replace(layer.spec, delta_rule_backend=backend)
        x_local = shard(x, 2, comm.rank).requires_grad_()
        with SyncCounter() as syncs:
            layer(x_local, ((0, 5), (0, 1, 9))).sum().backward()
        return list(syncs.events)

    events = run_threads(2, rank)
    assert events == [[], []], events


def test_forward_and_backward_run_on_the_meta_device():
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.model.modules.gated_deltanet import TSPGatedDeltaNet

    layer = TSPGatedDeltaNet(tsp_shape(2, 4, "qwen3_next", 1e-6, hidden=H, dk=DK, dv=DV), TSPComm.single(),
                             TSPOptions(), torch.float32, "meta", hf_format="qwen3_next")
    x = torch.empty(2, 10, H, device="meta", requires_grad=True)
    y = layer(x, ((0, 3), (0,)))
    y.sum().backward()
    assert y.shape == x.shape and y.device.type == "meta"
    assert x.grad.device.type == layer.packed_shard.grad.device.type == "meta"


def test_bfloat16_autocast_runs_the_delta_rule_in_float32():
    """Under CPU bf16 autocast the projections run in bf16 and the delta rule in float32: the result stays within
    bf16 rounding of the float32 layer (2e-2 relative), and the grads reach the float32 parameters."""
    from ds_tsp.core.comm.communicator import TSPComm

    ref, config = hf_layer("qwen3_5", 2, 4, 11, hidden=H, dk=DK, dv=DV)
    layer = tsp_layer(ref.float(), config, "qwen3_5", TSPComm.single(), hidden=H, dk=DK, dv=DV)
    layer.float()
    x = torch.randn(2, 12, H)
    exact = layer(x, ((0, 5), (0,))).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, ((0, 5), (0,)))
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16
    assert ((y.float() - exact).abs().max() / exact.abs().max()) < 2e-2
    assert layer.packed_shard.grad.dtype == torch.float32 and layer.packed_shard.grad.abs().max() > 0


def test_float32_matches_transformers_own_float32_layer():
    """float32 at D=2 against transformers' unpatched float32 layer (its own casts): within float32 noise."""
    ref64, config = hf_layer("qwen3_next", 2, 4, 13, hidden=H, dk=DK, dv=DV)
    stock = type(ref64)(config, 0)  # a fresh instance: transformers' own forward, no float64 patch
    stock.load_state_dict({k: v.float() for k, v in ref64.state_dict().items()})
    x = torch.randn(2, 12, H)

    def rank(comm):
        layer = tsp_layer(ref64, config, "qwen3_next", comm, hidden=H, dk=DK, dv=DV).float()
        return layer(shard(x, 2, comm.rank), None).detach()

    y = unshard(run_threads(2, rank))
    y_ref = stock(x).detach()
    assert ((y - y_ref).abs().max() / y_ref.abs().max()) < 1e-5


def test_a_frozen_shard_reduces_nothing_and_still_gives_dx():
    """requires_grad False on the packed shard (alike on every rank): the blocks are still re-broadcast for dx, but
    no weight grad is computed or reduced to the owners; dx still matches transformers."""
    ref, config = hf_layer("qwen3_5", 2, 4, 17, hidden=H, dk=DK, dv=DV)
    x = torch.randn(1, 8, H, dtype=torch.float64)
    docs = ((0, 3),)

    def rank(comm):
        layer = tsp_layer(ref, config, "qwen3_5", comm, hidden=H, dk=DK, dv=DV)
        layer.packed_shard.requires_grad_(False)
        x_local = shard(x, 2, comm.rank).requires_grad_()
        layer(x_local, docs).sum().backward()
        return x_local.grad, layer.packed_shard.grad, [kind for kind, _ in comm.posted]

    out = run_threads(2, rank)
    xr = x.clone().requires_grad_()
    reference_with_documents(ref, xr, docs).sum().backward()
    assert (unshard([o[0] for o in out]) - xr.grad).abs().max() < TOL
    assert all(o[1] is None and "reduce" not in o[2] and "broadcast" in o[2] for o in out)


# --- the CUDA kernel adapter (flash-linear-attention), with a stand-in for FLA ------------------------------------
def fake_fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                    use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False,
                                    cu_seqlens_cpu=None):
    """FLA's documented contract (fla/ops/gated_delta_rule/chunk.py), computed by transformers' own recurrence
    (float64-widened): [B, T, H, *] inputs, one initial state per row; with cu_seqlens B == 1 and one initial state
    per sequence, whose lengths it reads from cu_seqlens_cpu when given (FLA >= 0.4.2), else from the device
    tensor (a host read, as FLA does)."""
    assert q.dtype == k.dtype == v.dtype and not head_first and not use_qk_l2norm_in_kernel
    rec = _widened("transformers.models.qwen3_5.modeling_qwen3_5")["torch_recurrent_gated_delta_rule"]
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        assert initial_state.shape[0] == q.shape[0] and cu_seqlens_cpu is None
        o, ht = rec(q * scale * k.shape[-1] ** 0.5, k, v, g, beta, initial_state=initial_state,
                    output_final_state=True)
        return o, (ht if output_final_state else None)
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    assert cu_seqlens_cpu is None or (cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.shape == cu_seqlens.shape)
    assert q.shape[0] == 1 and initial_state.shape[0] == len(bounds) - 1
    outs, finals = [], []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, ht = rec(q[:, lo:hi] * scale * k.shape[-1] ** 0.5, k[:, lo:hi], v[:, lo:hi], g[:, lo:hi],
                    beta[:, lo:hi], initial_state=initial_state[n:n + 1], output_final_state=True)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)


def test_fla_adapter_gives_the_torch_kernels_transition_and_outputs():
    """One FLA call with v extended by dk zero columns and h0 = [0 | I] gives o_local, q_eff, M and U of the torch
    kernel, rows with different document layouts (a start at offset 0, several starts, none) in one call."""
    from ds_tsp.core.layers.linear_attention.delta_rule_fla import fla_chunk_transition

    g = torch.Generator().manual_seed(3)
    B, Hh, c, dk, dv = 3, 2, 9, 3, 4
    q = l2_normalize(torch.randn(B, Hh, c, dk, dtype=torch.float64, generator=g)) * dk ** -0.5
    k = l2_normalize(torch.randn(B, Hh, c, dk, dtype=torch.float64, generator=g))
    v = torch.randn(B, Hh, c, dv, dtype=torch.float64, generator=g)
    decay = -torch.rand(B, Hh, c, dtype=torch.float64, generator=g)
    beta = torch.rand(B, Hh, c, dtype=torch.float64, generator=g)
    for starts in (((0, 4), (2, 3, 8), ()), ((), (), ())):  # varlen; no start anywhere: FLA's plain batch
        reset = torch.zeros(B, c, dtype=torch.float64)
        for b, row in enumerate(starts):
            reset[b, list(row)] = 1
        want = chunk_gated_delta_rule(q, k, v, decay, beta, 4, reset)
        got = fla_chunk_transition(fake_fla_chunk_gated_delta_rule, q, k, v, decay, beta, starts, torch.float64)
        for name, a, b in zip(("o_local", "q_eff", "M", "U"), got, want):
            assert a.shape == b.shape and (a - b).abs().max() < 1e-12, (starts, name)


def test_layer_through_the_fla_adapter_matches_transformers(monkeypatch):
    from ds_tsp.core.layers.linear_attention import delta_rule_fla as gated_delta_rule_fla

    monkeypatch.setattr(gated_delta_rule_fla, "_fla_status", lambda: (fake_fla_chunk_gated_delta_rule, None))
    errors = _case_errors(D=2, fmt="qwen3_next", nk=2, nv=4, kernel=4, S=8, docs=((0, 3), (0,)), seed=19,
                          backend="fla")
    assert max(errors.values()) < TOL, errors


def test_fla_is_selected_on_cuda_in_half_precision_and_its_absence_is_said_once(monkeypatch):
    from ds_tsp.core.layers.linear_attention import delta_rule_fla as fla

    monkeypatch.setattr(fla, "_fla_status", lambda: (fake_fla_chunk_gated_delta_rule, None))
    monkeypatch.setattr(fla, "_WARNED", set())
    assert fla.select_delta_rule_backend("cuda", torch.bfloat16) == "fla"
    with pytest.warns(RuntimeWarning, match="pure-torch chunk kernel on CUDA: the model runs in torch.float32 and "
                                            "flash-linear-attention takes only .* train in bfloat16"):
        assert fla.select_delta_rule_backend("cuda", torch.float32) == "torch"  # FLA refuses float32
    assert fla.select_delta_rule_backend("cpu", torch.bfloat16) == "torch"
    assert fla.select_delta_rule_backend("cpu", torch.float32) == "torch"  # the CPU: nothing to say
    monkeypatch.setattr(fla, "_fla_status", lambda: (None, "flash-linear-attention is not installed (test)"))
    monkeypatch.setattr(fla, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="pure-torch chunk kernel on CUDA: flash-linear-attention is not "):
        assert fla.select_delta_rule_backend("cuda", torch.float16) == "torch"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fla.select_delta_rule_backend("cuda", torch.float16) == "torch"  # said once
    with pytest.raises(RuntimeError, match="'fla' requested but flash-linear-attention is not installed"):
        fla.fla_kernel()


# --- work per head block in backward ------------------------------------------------------------------------
class _Probe(torch.autograd.Function):
    """Identity whose backward records one call: how many autograd passes reach a tensor."""

    @staticmethod
    def forward(ctx, t, calls: list, name: str):
        ctx.calls, ctx.name = calls, name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.calls.append(ctx.name)
        return grad, None, None


def test_backward_runs_the_delta_rule_and_the_projections_once_per_head_block(monkeypatch):
    """Per head block the torch delta rule runs both local chunks in one call, and the backward pulls its grads
    through it and through the q/k/v/a/b projections ONCE (the state hand-off's cotangents and the output's in one
    pass), at D=2 with packed documents; the result still matches transformers."""
    from ds_tsp.core.layers.linear_attention import gated_deltanet as gdn

    calls = []
    real_rule, real_projections = gdn.chunk_gated_delta_rule, gdn._projections

    def rule(q, k, *args):  # k: every output of the rule (o_local, q_eff, M, U) depends on it
        calls.append("delta rule forward")
        return real_rule(q, _Probe.apply(k, calls, "delta rule backward"), *args)

    def projections(w, spec):
        qkv, z, b, a = real_projections(w, spec)
        return _Probe.apply(qkv, calls, "qkv projection backward"), z, b, a

    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", rule)
    monkeypatch.setattr(gdn, "_projections", projections)
    case = dict(D=2, fmt="qwen3_5", nk=2, nv=4, kernel=4, S=12, docs=((0, 5), (0,)), seed=7)
    errors = _case_errors(**case)
    assert max(errors.values()) < TOL, errors
    D, ranks = 2, 2
    # forward and its recompute in backward: 2 D blocks per rank, both local chunks in one call
    assert calls.count("delta rule forward") == 2 * D * ranks  # both local chunks in one call
    assert calls.count("delta rule backward") == D * ranks, calls
    assert calls.count("qkv projection backward") == D * ranks, calls


@pytest.mark.parametrize("keep", [False, True], ids=["memory_optimal", "speed"])
def test_each_transition_gather_is_waited_after_the_next_blocks_chunks(monkeypatch, keep):
    """Forward: block j's transition gather is posted, block j+1's chunks run, then it is waited (it travels behind
    them); backward: block j's re-gather is posted, block j-1's projection GEMMs run, then it is waited (the first
    block's has nothing before it), and each block's transition-grad reduce-scatter is waited after the out
    projection's weight grad. Speed mode re-gathers nothing: block j-1's projection GEMMs run between block j's
    grad scatter and its wait instead. D=3 threads; the posted collectives stay the same on every rank
    (_case_errors checks)."""
    from ds_tsp.core.layers.linear_attention import gated_deltanet as gdn

    events = {}
    real_local, real_keep, real_projection_grads = gdn._block_local, gdn._keep_block, gdn._projection_grads
    real_gather, real_scatter = gdn.TransitionGather, gdn.TransitionGradScatter
    real_grad = torch.autograd.grad
    log = lambda what: events.setdefault(threading.get_ident(), []).append(what)  # noqa: E731

    class Gather(real_gather):
        def __init__(self, *args):
            log("gather post")
            super().__init__(*args)

        def wait(self):
            log("gather wait")
            return super().wait()

    class Scatter(real_scatter):
        def __init__(self, *args):
            log("scatter post")
            super().__init__(*args)

        def wait(self):
            log("scatter wait")
            return super().wait()

    def block_local(*args):
        log("chunks")
        return real_local(*args)

    def keep_block(*args):  # the backward's recompute of a block
        log("chunks")
        return real_keep(*args)

    def projection_grads(*args):
        log("projection grads")
        return real_projection_grads(*args)

    def grad(outputs, inputs, *args, **kwargs):
        if isinstance(inputs, torch.Tensor):  # the one call with a single input: the out projection's weight grad
            log("out weight grad")
        return real_grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(gdn, "_block_local", block_local)
    monkeypatch.setattr(gdn, "_keep_block", keep_block)
    monkeypatch.setattr(gdn, "_projection_grads", projection_grads)
    monkeypatch.setattr(gdn, "TransitionGather", Gather)
    monkeypatch.setattr(gdn, "TransitionGradScatter", Scatter)
    monkeypatch.setattr(gdn.torch.autograd, "grad", grad)
    errors = _case_errors(D=3, fmt="qwen3_5", nk=3, nv=3, kernel=3, S=12, docs=((0, 5),), seed=4, keep=keep)
    assert max(errors.values()) < TOL, errors
    assert len(events) == 3
    for per_rank in events.values():
        forward, backward = per_rank[:9], per_rank[9:]
        assert forward == ["chunks", "gather post", "chunks", "gather post", "gather wait", "chunks", "gather post",
                           "gather wait", "gather wait"], per_rank
        if keep:  # nothing recomputed or re-gathered
            block = ["scatter post", "out weight grad", "projection grads", "scatter wait"]
            assert backward == [block[0], block[1], block[3], *block * 2, "projection grads"], per_rank
            continue
        block = ["chunks", "gather post", "projection grads", "gather wait", "scatter post", "out weight grad",
                 "scatter wait"]
        assert backward == [*block[:2], *block[3:], *block * 2, "projection grads"], per_rank


def test_host_values_reach_cuda_in_one_non_blocking_copy_from_pinned_memory(monkeypatch):
    """The FLA adapter's varlen plan (cu_seqlens, reads, last) goes to a CUDA device in one copy the host does not
    wait for (the pinned, non_blocking copy the sync counter lets pass); the CUDA calls are recorded, not run."""
    from ds_tsp.core.layers.linear_attention.delta_rule_fla import _on_device

    calls, real_to = [], torch.Tensor.to

    def to(self, *args, **kwargs):
        calls.append(("to", args, kwargs))
        return real_to(self, "cpu", copy=True)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin_memory") or self)
    monkeypatch.setattr(torch.Tensor, "to", to)
    host = torch.tensor([0, 3, 5])
    assert torch.equal(_on_device(host, torch.device("cuda")), host)
    assert calls == ["pin_memory", ("to", (torch.device("cuda"),), {"non_blocking": True})]


def test_fla_compiles_before_the_layer_posts_anything_once_per_shape_class(monkeypatch):
    """The first call of a shape class runs FLA's plain and variable-length variants, forward and backward, before
    the layer's first collective (its conv halo's gather); a second call, and a second layer of the same shape,
    warm nothing; the output is the same."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.layers.linear_attention import delta_rule_fla
    from ds_tsp.core.layers.linear_attention import gated_deltanet as gdn

    events = []

    def fla(q, *args, cu_seqlens=None, **kwargs):
        events.append("fla varlen" if cu_seqlens is not None else "fla batch")
        return fake_fla_chunk_gated_delta_rule(q, *args, cu_seqlens=cu_seqlens, **kwargs)

    def halo(*args):
        events.append("halo")
        return real_halo(*args)

    real_halo, real_grad = gdn.conv_halo, torch.autograd.grad
    monkeypatch.setattr(delta_rule_fla, "_fla_status", lambda: (fla, None))
    monkeypatch.setattr(gdn, "conv_halo", halo)
    ref, config = hf_layer("qwen3_5", 2, 4, 3, hidden=H, dk=DK, dv=DV)
    layers = [tsp_layer(ref, config, "qwen3_5", TSPComm.single(), hidden=H, dk=DK, dv=DV) for _ in range(2)]
    for layer in layers:
        layer.spec = dataclasses.replace(layer.spec, delta_rule_backend="fla")
    x = torch.randn(2, 12, H, dtype=torch.float64)
    y = [layer(x, ((0, 5), (0,))) for layer in (*layers, layers[0])]
    assert events[:3] == ["fla batch", "fla varlen", "halo"], events
    assert events.count("fla batch") + events.count("fla varlen") == 2 + 3 * 2, events  # then 2 chunks a call
    assert torch.equal(y[0], y[2]) and torch.equal(y[0], y[1])
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: events.append("backward") or real_grad(*a, **k))
    assert delta_rule_fla.warm_up(fla, 8, 2, 3, torch.device("cpu"), torch.float64)  # a new shape class
    assert events[-4:] == ["fla batch", "backward", "fla varlen", "backward"], events
