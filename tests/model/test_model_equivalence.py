"""The TSP model against the single-device reference: loss and EVERY parameter gradient, for D in {1, 2, 3, 4}.

Tolerances (ds_tsp.tools.verify.TOLERANCE): float32 1e-5 relative (norm-wise, per parameter; the fp32 noise floor is
~1e-6), float64 1e-10 (a correct schedule measures ~1e-15). Each D runs all its shapes in one process group
to keep start-up cost out of the suite.
"""
from __future__ import annotations

import pytest
from local_ranks import run_on_local_ranks

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.verify import VerifyCase, run_case_on_world


def _shape(heads, kv, *, tie=False, bias=False, ffn=48, vocab=61, layers=2, head_dim=None):
    return ModelShape(vocab_size=vocab, hidden_size=8 * heads, intermediate_size=ffn, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv, tie_word_embeddings=tie, qkv_bias=bias, head_dim=head_dim)


# (name, shape, seq); seq lengths are deliberately not multiples of 2D (padding path) except where noted.
CASES = {
    1: [("mha", _shape(4, 4), 33), ("gqa_tied_bias", _shape(4, 2, tie=True, bias=True), 20)],
    2: [("mha_untied", _shape(4, 4), 37), ("gqa_bias", _shape(4, 2, bias=True), 29),
        ("mqa_tied", _shape(4, 1, tie=True), 40), ("head_dim_12", _shape(4, 2, head_dim=12), 23)],
    3: [("gqa_bias", _shape(6, 3, bias=True), 31), ("mqa_tied", _shape(6, 1, tie=True), 50),
        ("mha_batch", _shape(6, 6), 24)],
    4: [("gqa", _shape(8, 2), 45), ("mqa_bias_tied", _shape(8, 1, bias=True, tie=True), 64),
        ("kv4", _shape(4, 4, ffn=64), 19)],
}


def _run_all(cases):
    return [run_case_on_world(case) for case in cases]


@pytest.mark.parametrize("tsp", sorted(CASES))
def test_fp32_matches_single_device(tsp):
    cases = [VerifyCase(shape=shape, seq=seq, batch=2, dtype="float32", seed=tsp) for _, shape, seq in CASES[tsp]]
    reports = run_on_local_ranks(_run_all, tsp, cases, timeout_s=300)[0] if tsp > 1 else _run_all(cases)
    for (name, _, _), report in zip(CASES[tsp], reports):
        assert report["tsp"] == tsp
        assert report["loss_rel_err"] < 1e-5, (name, report)
        assert report["grad_rel_err"] < 1e-5, (name, report)


def test_fp64_is_exact_at_odd_degree():
    cases = [VerifyCase(shape=_shape(6, 3, bias=True), seq=41, batch=1, dtype="float64", seed=5)]
    report = run_on_local_ranks(_run_all, 3, cases, timeout_s=300)[0][0]
    assert report["loss_rel_err"] < 1e-12 and report["grad_rel_err"] < 1e-12, report


@pytest.mark.parametrize("options, overlap", [
    ({"keep_gathered_kv": True}, True),
    ({"activation_checkpointing": True}, True),
    ({}, False),
    ({"recompute_projections": False}, True),
    ({"keep_gathered_kv": True, "recompute_projections": False}, True),
], ids=["keep_gathered_kv", "activation_checkpointing", "no_overlap", "saved_projections", "speed"])
def test_schedule_options_are_exact(options, overlap):
    from ds_tsp.core.config import TSPOptions
    case = VerifyCase(shape=_shape(4, 2, bias=True), seq=27, batch=2, dtype="float64", seed=7)
    report = run_on_local_ranks(run_case_on_world, 2, case, TSPOptions(**options), overlap, timeout_s=120)[0]
    assert report["loss_rel_err"] < 1e-12 and report["grad_rel_err"] < 1e-12, report
