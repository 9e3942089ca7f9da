"""Property test (hypothesis) of the TSP MoE MLP: random expert counts, top-k, shapes and routings, both dispatch
schedules, against transformers' own sparse MoE block on one device (float64, norm-wise relative error <= 1e-10).

hypothesis draws CASES_PER_DEGREE cases per D (times HYPOTHESIS_PROFILE=long's 5) in the parent (draw_cases: derandomized, a
fixed example count, generate phase only, so the cost is fixed): E a multiple of D (up to 4 experts per rank),
top_k 1..E, Qwen3-MoE (norm_topk_prob either way) or Mixtral, hidden / F, batch 1..2, 1..3 tokens per zigzag
chunk, router rows boosted for some experts (others get no row), or one rank whose tokens all route to the same
experts (a single one at top_k 1). D=1 runs here; D=2 and D=4 in ONE 4-rank gloo launch (D=2 on ranks 0, 1).
A failure lists every failing case (its repr reproduces it).
"""
from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import strategies as st
from local_ranks import run_on_local_ranks
from moe_reference import MoECase, assemble, reference, tsp_case, worst
from property_cases import draw_cases, profile_scale

from ds_tsp.core.comm.communicator import TSPComm

pytest.importorskip("transformers")

TOL = 1e-10
CASES_PER_DEGREE = 8
DISPATCHES = ("ring", "all_to_all")


def moe_cases(tsp: int):
    @st.composite
    def strategy(draw):
        experts = tsp * draw(st.integers(1, 4))
        top_k = draw(st.integers(1, experts))
        skew = tuple(sorted(draw(st.sets(st.integers(0, experts - 1), max_size=2))))
        return MoECase(family=draw(st.sampled_from(["qwen3_moe", "mixtral"])), num_experts=experts, top_k=top_k,
                       norm_topk_prob=draw(st.booleans()), hidden=draw(st.sampled_from([4, 8, 12])),
                       ffn=draw(st.sampled_from([2, 4, 6])), seed=draw(st.integers(0, 2 ** 16)),
                       batch=draw(st.integers(1, 2)), chunk=draw(st.integers(1, 3)), skew=skew,
                       one_expert_rank=draw(st.sampled_from([-1, -1, tsp - 1])))

    return strategy()


CASES = {d: draw_cases(moe_cases(d), CASES_PER_DEGREE) for d in (1, 2, 4)}


def _run(cases: dict) -> dict:
    pair = dist.new_group([0, 1])
    out = {}
    if dist.get_rank() in (0, 1):
        out[2] = [{d: tsp_case(c, TSPComm(pair), d) for d in DISPATCHES} for c in cases[2]]
    out[4] = [{d: tsp_case(c, TSPComm(dist.group.WORLD), d) for d in DISPATCHES} for c in cases[4]]
    return out


@pytest.fixture(scope="module")
def results():
    ranks = run_on_local_ranks(_run, 4, CASES, timeout_s=600)
    single = TSPComm.single()
    return {1: [[{d: tsp_case(c, single, d) for d in DISPATCHES}] for c in CASES[1]],
            2: [[ranks[r][2][i] for r in (0, 1)] for i in range(len(CASES[2]))],
            4: [[ranks[r][4][i] for r in range(4)] for i in range(len(CASES[4]))]}


@pytest.mark.parametrize("tsp", [1, 2, 4])
def test_moe_matches_single_device_reference(results, tsp):
    failing = []
    for case, per_rank in zip(CASES[tsp], results[tsp]):
        ref = reference(case, tsp)
        for dispatch in DISPATCHES:
            err, key = worst(assemble([r[dispatch] for r in per_rank]), ref)
            if not err <= TOL:
                failing.append((case.num_experts * case.top_k, f"{dispatch} {key} {err:.2e}: {case!r}"))
    assert not failing, "\n".join(text for _, text in sorted(failing))
    assert len(CASES[tsp]) == CASES_PER_DEGREE * profile_scale()
