"""The TSP MoE MLP (ds_tsp.core.layers.moe.layer) against transformers' own Qwen3MoeSparseMoeBlock and
MixtralSparseMoeBlock, both dispatch schedules, D = 1, 2, 4 (gloo, float64): y, router_logits, dx, the router
grad (summed over ranks, as replicated_param does) and every expert weight grad (each rank's experts concatenated)
within 1e-10 norm-wise relative error (measured ~3e-16). Also: the aux-loss shares against transformers'
load_balancing_loss_func over the global batch (with and without an attention mask), the bytes formula against
CommCounter, the expert-GEMM selection (mocked CUDA / grouped_mm) and the grouped path's numerics on the CPU.

Process start-up dominates, so every multi-rank check runs in ONE 4-rank run_on_local_ranks call: D=2 on the
subgroups (0, 1) and (2, 3), D=4 on the world.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks
from moe_reference import MoECase, assemble, inputs, reference, tsp_case, worst

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.moe import experts as moe_experts
from ds_tsp.core.layers.moe.layer import choose_moe_dispatch, moe_aux_loss_share, moe_bytes_per_layer, tsp_moe_mlp
from ds_tsp.core.tokens.zigzag import shard

pytest.importorskip("transformers")

TOL = 1e-10  # float64, norm-wise relative (ds_tsp.tools.verify's tolerance)
DISPATCHES = ("ring", "all_to_all")
CASES = {
    "qwen3": MoECase(),
    "qwen3_no_norm": MoECase(norm_topk_prob=False, top_k=3, seed=1),
    "mixtral": MoECase(family="mixtral", seed=2),
    "qwen3_skewed": MoECase(top_k=1, skew=(0, 5), seed=3, chunk=2),  # idle experts, most rows on two
    "qwen3_one_expert_rank": MoECase(top_k=1, one_expert_rank=1, seed=4),
}
GROUPS = {2: [[0, 1], [2, 3]], 4: [[0, 1, 2, 3]]}


def _equivalence(comm) -> dict:
    out = {}
    for name, case in CASES.items():
        for dispatch in DISPATCHES:
            for recompute in (True, False):
                out[name, dispatch, recompute] = tsp_case(case, comm, dispatch, recompute)
    return out


def _bytes(comm) -> dict:
    """CommCounter after one forward + backward with every token sent to every expert (top_k = E: exactly
    tokens x top_k x (D-1)/D rows leave each rank, the formula's assumption)."""
    out = {}
    case = MoECase(num_experts=4, top_k=4, seed=5)
    for dispatch in DISPATCHES:
        comm.counter.reset()
        tsp_case(case, comm, dispatch)
        out[dispatch] = dict(comm.counter.bytes)
    return out


def _aux_inputs(tsp: int, rank: int):
    g = torch.Generator().manual_seed(7)
    batch, seq, experts = 2, 4 * tsp, 6
    logits = [torch.randn(batch, seq, experts, generator=g, dtype=torch.float64) for _ in range(2)]  # 2 layers
    mask = (torch.rand(batch, seq, generator=g) > 0.3).long()
    mask[0, :3] = 0  # left padding
    local = [shard(t, tsp, rank).reshape(-1, experts).clone().requires_grad_(True) for t in logits]
    return logits, mask, local, shard(mask, tsp, rank).reshape(-1), experts


def _aux(comm) -> dict:
    out = {}
    for masked in (False, True):
        _, _, local, mask, experts = _aux_inputs(comm.size, comm.rank)
        share = moe_aux_loss_share(local, experts, 2, comm, token_mask=mask if masked else None)
        share.backward()
        out[masked] = {"share": share.detach(), "grads": [t.grad for t in local]}
    return out


GROUPED_CASE = MoECase(hidden=16, ffn=8, num_experts=8, top_k=2, skew=(3,), seed=6)


def _grouped_vs_loop(comm) -> dict:
    """float32 results of both dispatches on the loop path and on the grouped path forced (this torch runs grouped
    GEMMs on the CPU in float32): device offsets, the ring's rotated rows and masked tail, idle experts."""
    import ds_tsp.core.layers.moe.layer as moe

    if moe_experts._grouped_mm_fn() is None:
        return {}
    out = {}
    select = moe.select_expert_gemm
    try:
        for path in ("loop", "grouped"):
            moe.select_expert_gemm = lambda device, dtype, *_, path=path: path
            for dispatch in DISPATCHES:
                out[path, dispatch] = tsp_case(GROUPED_CASE, comm, dispatch, dtype=torch.float32)
    finally:
        moe.select_expert_gemm = select
    return out


def _all() -> dict:
    groups = {d: [dist.new_group(r) for r in rs] for d, rs in GROUPS.items()}  # every rank creates every group
    me = dist.get_rank()
    out = {}
    for d, rs in GROUPS.items():
        for ranks, group in zip(rs, groups[d]):
            if me in ranks:
                comm = TSPComm(group)
                out[d] = {"equivalence": _equivalence(comm), "bytes": _bytes(comm), "aux": _aux(comm),
                          "grouped": _grouped_vs_loop(comm)}
    return out


@pytest.fixture(scope="module")
def ranks():
    """{D: [per TSP rank of the first group: result]}; D=1 in this process."""
    results = run_on_local_ranks(_all, 4, timeout_s=600)
    comm = TSPComm.single()
    out = {1: [{"equivalence": _equivalence(comm), "bytes": _bytes(comm), "aux": _aux(comm),
                "grouped": _grouped_vs_loop(comm)}]}
    for d, rs in GROUPS.items():
        out[d] = [results[r][d] for r in rs[0]]
        if d == 2:  # the second pair ran the same cases: it must agree bit for bit
            twin = [results[r][d] for r in rs[1]]
            for a, b in zip(out[d], twin):
                for key, res in a["equivalence"].items():
                    assert all(torch.equal(res[k], b["equivalence"][key][k]) for k in res), key
    return out


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers_block(ranks, tsp, name):
    ref = reference(CASES[name], tsp)
    for dispatch in DISPATCHES:
        for recompute in (True, False):
            got = assemble([r["equivalence"][name, dispatch, recompute] for r in ranks[tsp]])
            err, key = worst(got, ref)
            assert err <= TOL, (name, tsp, dispatch, recompute, key, err)


def test_idle_experts_and_one_expert_rank_really_happen():
    """The skewed case leaves experts without a row and the one-expert case routes a whole shard to one expert."""
    from ds_tsp.core.layers.moe.routing import route

    for name, tsp in (("qwen3_skewed", 4), ("qwen3_one_expert_rank", 2)):
        case = CASES[name]
        from moe_reference import hf_block

        block = hf_block(case)
        x = shard(inputs(case, tsp)["x"], tsp, 1).reshape(-1, case.hidden)
        top_i = route(x, block.gate.weight.detach(), case.top_k, True)[2]
        used = top_i.unique().numel()
        assert used < case.num_experts, (name, used)
        if name == "qwen3_one_expert_rank":
            assert used == 1


@pytest.mark.parametrize("tsp", [1, 2, 4])
def test_bytes_formula_equals_the_counter(ranks, tsp):
    case = MoECase(num_experts=4, top_k=4, seed=5)
    tokens = case.batch * case.seq(tsp) // tsp
    want = moe_bytes_per_layer(tokens, case.hidden, case.ffn, case.num_experts, case.top_k, tsp, 8)
    for r in ranks[tsp]:
        for dispatch in DISPATCHES:
            counted = r["bytes"][dispatch]
            assert sum(counted.values()) == want[dispatch], (tsp, dispatch, counted, want)
            assert set(counted) <= {dispatch}, counted  # nothing else moves
            if tsp > 1:
                assert counted[dispatch] > 0


def _hf_aux(logits: list[torch.Tensor], experts: int, mask):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    leaves = [t.reshape(-1, experts).clone().requires_grad_(True) for t in logits]
    loss = load_balancing_loss_func(tuple(leaves), experts, 2, mask)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _aux_f64(logits: list[torch.Tensor], experts: int, mask):
    """transformers' formula transcribed in float64 (its own function accumulates in float32)."""
    leaves = [t.reshape(-1, experts).clone().requires_grad_(True) for t in logits]
    m = torch.ones(leaves[0].shape[0], dtype=torch.float64) if mask is None else mask.reshape(-1).double()
    counts = torch.zeros(experts, dtype=torch.float64)
    probs_sum = torch.zeros(experts, dtype=torch.float64)
    rows = 0.0
    for t in leaves:
        p = torch.softmax(t, -1)
        sel = torch.topk(p, 2, dim=-1).indices
        counts = counts + torch.zeros(experts, dtype=torch.float64).scatter_add(0, sel.reshape(-1),
                                                                              m[:, None].expand(-1, 2).reshape(-1))
        probs_sum = probs_sum + (p * m[:, None]).sum(0)
        rows = rows + m.sum()
    loss = experts * ((counts / rows) * (probs_sum / rows)).sum()
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_shares_sum_to_transformers(ranks, tsp, masked):
    logits, mask, _, _, experts = _aux_inputs(tsp, 0)
    mask = mask if masked else None
    total = sum(r["aux"][masked]["share"] for r in ranks[tsp])
    # the ranks' local logits grads, put back in global order
    n_layers = len(logits)
    local_grads = [[r["aux"][masked]["grads"][i] for r in ranks[tsp]] for i in range(n_layers)]
    from ds_tsp.core.tokens.zigzag import unshard

    b = logits[0].shape[0]
    glob = [unshard([g.view(b, -1, experts) for g in layer]).reshape(-1, experts) for layer in local_grads]
    hf_loss, hf_grads = _hf_aux(logits, experts, mask)
    f64_loss, f64_grads = _aux_f64(logits, experts, mask)
    # against transformers' own function: float32 accumulation there bounds the agreement
    assert float(total) == pytest.approx(float(hf_loss), rel=1e-6)
    assert all(float((g - h).norm() / h.norm()) < 1e-6 for g, h in zip(glob, hf_grads))
    # against the same formula in float64: exact
    assert float(total) == pytest.approx(float(f64_loss), rel=1e-12)
    assert all(float((g - h).norm() / h.norm()) < 1e-12 for g, h in zip(glob, f64_grads))


# --- dispatch choice ----------------------------------------------------------------------------------------------
def test_choose_dispatch_takes_the_cheaper_and_refuses_unknown():
    args = dict(hidden=64, moe_ffn=128, num_experts=8, top_k=2, tsp=4, dtype_bytes=2)
    short = choose_moe_dispatch("auto", tokens_per_rank=16, **args)
    long = choose_moe_dispatch("auto", tokens_per_rank=1 << 16, **args)
    assert (short, long) == ("all_to_all", "ring")
    for tokens in (16, 1 << 16):
        cost = moe_bytes_per_layer(tokens, **args)
        assert choose_moe_dispatch("auto", tokens, **args) == min(cost, key=lambda k: (cost[k], k != "ring"))
    assert choose_moe_dispatch("ring", 16, **args) == "ring"
    assert choose_moe_dispatch("all_to_all", 1 << 16, **args) == "all_to_all"
    assert choose_moe_dispatch("auto", 16, **{**args, "tsp": 1}) == "ring"  # a tie: the ring (its bytes do not grow with S)
    with pytest.raises(TSPConfigError, match="moe_dispatch='fast'"):
        choose_moe_dispatch("fast", 16, **args)
    with pytest.raises(TSPConfigError, match="num_experts=6 on tsp=4"):
        moe_bytes_per_layer(16, 64, 128, 6, 2, 4, 2)


def test_bad_calls_name_the_field():
    case = MoECase()
    from moe_reference import spec_of

    spec = spec_of(case, 1)
    x = torch.randn(1, 4, case.hidden, dtype=torch.float64)
    router = torch.randn(case.num_experts, case.hidden, dtype=torch.float64)
    shard_ = torch.randn(spec.layout.numel, dtype=torch.float64)
    with pytest.raises(TSPConfigError, match="moe_dispatch='auto'"):
        tsp_moe_mlp(x, router, shard_, spec, TSPComm.single(), dispatch="auto")
    with pytest.raises(TSPConfigError, match="experts_shard has 3 elements"):
        tsp_moe_mlp(x, router, shard_[:3], spec, TSPComm.single(), dispatch="ring")
    from dataclasses import replace

    with pytest.raises(TSPConfigError, match="num_experts=8 with experts_per_rank=4"):
        tsp_moe_mlp(x, router, shard_, replace(spec, experts_per_rank=4), TSPComm.single(), dispatch="ring")


# --- expert GEMM selection and the grouped path ------------------------------------------------------------------
def test_selection_with_and_without_grouped_mm(monkeypatch):
    sel = moe_experts.select_expert_gemm
    assert sel("cpu", torch.bfloat16) == "loop" and sel("cpu", torch.float64) == "loop"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sel("cuda", torch.bfloat16) == "grouped"
    assert sel("cuda", torch.float32) == "loop"  # the grouped kernels take bf16
    assert sel("meta", torch.bfloat16) == "grouped" and sel("meta", torch.float32) == "loop"
    # row strides must be multiples of 16 bytes for the grouped kernels: 8 bf16 elements
    assert sel("cuda", torch.bfloat16, 64, 32) == "grouped" and sel("meta", torch.bfloat16, 64, 32) == "grouped"
    assert sel("cuda", torch.bfloat16, 64, 12) == "loop" and sel("meta", torch.bfloat16, 36, 32) == "loop"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert sel("cuda", torch.bfloat16) == "loop"

    def no_driver(device=None):
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_driver)
    assert sel("cuda", torch.bfloat16) == "loop"
    monkeypatch.setattr(moe_experts, "_grouped_mm_fn", lambda: None)  # a torch without grouped GEMMs
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sel("cuda", torch.bfloat16) == "loop" and sel("meta", torch.bfloat16) == "loop"


@pytest.mark.skipif(moe_experts._grouped_mm_fn() is None, reason="this torch has no grouped GEMM")
@pytest.mark.parametrize("tsp", [1, 2, 4])
def test_grouped_path_matches_the_loop_on_cpu(ranks, tsp):
    """float32 on both paths: 1e-6 relative (bit-identical here: 0.0 seen; the margin lets another BLAS block the
    same products differently); against transformers within 1e-5."""
    ref = reference(GROUPED_CASE, tsp)
    for dispatch in DISPATCHES:
        loop = assemble([r["grouped"]["loop", dispatch] for r in ranks[tsp]])
        grouped = assemble([r["grouped"]["grouped", dispatch] for r in ranks[tsp]])
        for k in loop:
            assert torch.allclose(grouped[k], loop[k], rtol=1e-6, atol=0), (tsp, dispatch, k)
        assert worst(grouped, ref)[0] < 1e-5, (tsp, dispatch, worst(grouped, ref))
