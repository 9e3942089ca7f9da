"""The attention's overlap schedule (the table in ds_tsp.core.layers.attention.tsp_attention's docstring) as posted: the
recorded op order of one forward + backward equals the order the table gives, weights ride their own channel,
and the replay under NCCL's rules (tests/helpers/nccl_rules.py) finds no deadlock and one launch order on every rank;
a kv group's dK/dV reduce-scatter is out before its last block's dq tail runs.
Also the checker's cross-channel rule on hand-written ops. One 4-rank run covers D=2 (ranks 0, 1) and D=4."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks
from nccl_rules import check, op

GROUPS = {2: [0, 1], 4: [0, 1, 2, 3]}
CASES = [(2, 1, True), (2, 2, True), (4, 1, True), (4, 2, True), (4, 4, True), (4, 1, False)]  # D, kv_replicas, weights


def expected_order(D: int, replicas: int) -> list[tuple[str, str, str]]:
    """(kind, channel, what) in post order, written from the schedule table (not from the code)."""
    def bcast(j):
        return ("broadcast", "weights", f"shard of block {j}")

    def gather():  # causal: the second halves point to point, to the ranks that read them (kv_gather)
        return [("all_gather", "tsp", "K/V gather, first zigzag half"),
                ("p2p", "tsp", "K/V gather, second zigzag half")]

    def last(j):
        return j % replicas == replicas - 1

    ops = []
    for phase in ("forward", "backward"):
        ops += [bcast(0), bcast(1)] + gather()
        pending = None
        for j in range(D):
            if j + 2 < D:
                ops.append(bcast(j + 2))
            if last(j) and j + 1 < D:
                ops += gather()
            if phase == "forward":
                continue
            if pending is not None:  # the previous group's scatter is consumed after this attention backward
                ops.append(("reduce", "weights", f"grad of block {pending}"))
                pending = None
            if last(j):
                ops.append(("p2p", "tsp", "dK/dV scatter"))
                pending = j
            else:
                ops.append(("reduce", "weights", f"grad of block {j}"))
        if phase == "backward":
            ops.append(("reduce", "weights", f"grad of block {pending}"))
    if replicas > 1:
        ops.append(("all_gather", "tsp", None))  # kv weight grads to the group leaders
    return ops


def _run_case(D, replicas, weights, group, weight_group):
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.layers.attention.tsp_attention import AttentionSpec, tsp_attention
    from ds_tsp.core.tokens.rope import rope_cos_sin

    comm = TSPComm(group, weight_group=weight_group if weights else None)
    spec = AttentionSpec(hidden=8, heads_per_block=2, kv_heads_per_block=1, head_dim=4, qkv_bias=False,
                         kv_replicas=replicas)
    gen = torch.Generator().manual_seed(comm.rank)
    shard = torch.randn(spec.layout.numel, generator=gen, dtype=torch.float64, requires_grad=True)
    L = 4
    x = torch.randn(1, L, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(comm.rank * L, (comm.rank + 1) * L)[None]  # any positions: only the order matters here
    cos, sin = rope_cos_sin(positions, 4, 10000.0, torch.float64)
    import ds_tsp.core.layers.attention.tsp_attention as attention

    real, tails = attention._unproject, []

    def spy(d_roped, *args):  # backward's q grads (heads_per_block heads; k's have kv_heads_per_block)
        if d_roped.shape[2] == spec.heads_per_block:
            tails.append(len(rec.ops))  # how many ops were posted when block len(tails)'s dq tail ran
        return real(d_roped, *args)

    attention._unproject = spy
    try:
        with comm.recording() as rec:
            tsp_attention(x, shard, cos, sin, spec, comm).pow(2).sum().backward()
    finally:
        attention._unproject = real
    return rec.ops, tails


def _record_all():
    groups = {D: dist.new_group(r) for D, r in GROUPS.items()}
    weight_groups = {D: dist.new_group(r) for D, r in GROUPS.items()}
    me = dist.get_rank()
    return {case: _run_case(*case, groups[case[0]], weight_groups[case[0]]) for case in CASES
            if me in GROUPS[case[0]]}


@pytest.fixture(scope="module")
def recorded():
    return run_on_local_ranks(_record_all, 4, timeout_s=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[0]}-kvrep{c[1]}-{'weights' if c[2] else 'one_channel'}")
def test_post_order_matches_the_schedule_table(recorded, case):
    D, replicas, weights = case
    per_rank = {r: recorded[r][case][0] for r in GROUPS[D]}
    want = expected_order(D, replicas)
    if not weights:
        want = [(kind, "tsp", what) for kind, _, what in want]
    for r, ops in per_rank.items():
        assert [(o["kind"], o["channel"], o["what"]) for o in ops] == want, r
    report = check(per_rank)
    assert report.ok and report.completed == report.total, str(report)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[0]}-kvrep{c[1]}-{'weights' if c[2] else 'one_channel'}")
def test_a_groups_dkdv_scatter_travels_behind_its_last_blocks_dq_tail(recorded, case):
    """The last block of a kv group posts the group's dK/dV reduce-scatter as soon as its attention backward is
    done, before its dq tail (dx and the wq grad) runs, and no block's tail runs before its group's scatter."""
    D, replicas, _ = case
    ops, tails = recorded[GROUPS[D][0]][case]
    scatters = [i for i, o in enumerate(ops) if o["what"] == "dK/dV scatter"]
    assert len(tails) == D and len(scatters) == D // replicas
    for j, posted_before_tail in enumerate(tails):
        if j % replicas == replicas - 1:  # the group's last block: its scatter is already out
            assert scatters[j // replicas] < posted_before_tail, (j, scatters, tails)
        else:
            assert posted_before_tail <= scatters[j // replicas], (j, scatters, tails)


def test_a_different_channel_interleaving_is_reported():
    w = {"channel": "weights"}
    a = [{**op("broadcast", (0, 1), root=0), **w}, op("all_gather", (0, 1))]
    b = [op("all_gather", (0, 1)), {**op("broadcast", (0, 1), root=0), **w}]
    report = check({0: a, 1: b})
    assert not report.ok and any("interleaves the channels differently" in m for m in report.mismatches), str(report)
    assert check({0: a, 1: list(a)}).ok
