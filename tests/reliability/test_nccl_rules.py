"""Every op a TSP training step posts, replayed under NCCL's queueing rules (tests/helpers/nccl_rules.py): no deadlock and
the same collectives on every rank, across the schedule options at D = 2, 3, 4; and the checker itself on
hand-written op lists (the bare isend-then-irecv ring that hangs NCCL, the batched ring that does not, a
collective order that differs between ranks, a subgroup collective interleaved correctly).

gloo cannot show these hangs (its sends are buffered and every op runs on its own threads), hence the replay.
Process start-up dominates, so every D and config runs in ONE 4-rank run_on_local_ranks call: D=2 on the
subgroup of ranks 2, 3 (global ranks differ from TSP ranks there), D=3 on ranks 0, 1, 2, D=4 on the world, then
TSP=2 x DP=2 under FSDP2 (two TSP groups replayed together).
"""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks
from nccl_rules import check, op, p2p, unbatched

from ds_tsp.core.comm.communicator import KV_GRAD_TAG, KV_LATE_HALF_TAG
from ds_tsp.core.config import TSPOptions

KINDS = {"broadcast", "reduce", "all_gather", "all_reduce", "p2p"}
SEQUENCE_P2P = {KV_LATE_HALF_TAG, KV_GRAD_TAG}  # the causal K/V gather's and dK/dV scatter's pieces (kv_gather)


def _carries_weights(o: dict) -> bool:
    return o["kind"] in ("broadcast", "reduce") or (o["kind"] == "p2p" and o.get("tag") not in SEQUENCE_P2P)


def _configs(D: int) -> dict[str, dict]:
    """name -> (model shape, options, overlap, batch); together they cover every option of the matrix."""
    few_kv = 1 if D < 4 else 2  # fewer kv heads than ranks: replicated kv heads
    return {
        "memory_overlap": {"kv": D, "options": TSPOptions(), "overlap": True, "weight_channel": True},
        "speed_no_overlap": {"kv": D, "options": TSPOptions.speed(), "overlap": False},
        "checkpointing_gqa_packed": {"kv": few_kv, "options": TSPOptions(activation_checkpointing=True),
                                     "overlap": True, "documents": [7, 5, 9], "weight_channel": True},
        "window_tied_small_chunks": {"kv": few_kv, "options": TSPOptions.speed(lm_head_chunk_tokens=3),
                                     "overlap": True, "windows": (5, None), "tie": True},
        # mixture of experts on layer 1 (layer 0 dense), aux loss on: each dispatch schedule in a whole step
        "moe_ring_aux": {"kv": D, "options": TSPOptions(moe_dispatch="ring"), "overlap": True, "moe": _MOE,
                         "weight_channel": True},
        "moe_all_to_all_checkpointing": {"kv": few_kv, "options": TSPOptions(moe_dispatch="all_to_all",
                                                                             activation_checkpointing=True),
                                         "overlap": True, "moe": _MOE},
        # OLMo 3: q/k norms over the whole projection (a [wq, wk] stream before the blocks and after the backward
        # loop, the grads reduced in two parts), post-norms
        "olmo3_projection_norms": {"kv": few_kv, "options": TSPOptions(), "overlap": True, "documents": [7, 5, 9],
                                   "weight_channel": True, "windows": (5, None),
                                   "shape": {"projection_qk_norm": True, "post_norms": True}},
        # GLM-4.5: grouped sigmoid routing, the shared expert's weight ring beside the experts' all-to-all
        "glm_moe_all_to_all_shared": {"kv": D, "options": TSPOptions(moe_dispatch="all_to_all"), "overlap": True,
                                      "moe": _GLM, "weight_channel": True},
        # Gemma 4: per-layer inputs (their table, projection and gates on the weight ring), the full layer's own
        # head_dim and one kv head with keys as values, soft-capped logits, under checkpointing
        "gemma4_checkpointing": {"kv": D, "options": TSPOptions(activation_checkpointing=True), "overlap": True,
                                 "windows": (5, None), "shape": _GEMMA4, "weight_channel": True},
    }


_GEMMA4 = dict(sandwich_norms=True, qk_norm=True, mlp_activation="gelu_tanh", embedding_scale=4.0, attention_scale=1.0,
               sliding_rope_theta=100.0, full_head_dim=12, full_num_kv_heads=1, full_values_from_keys=True,
               value_norm=True, layer_scalars=True, per_layer_input_size=12, per_layer_input_vocab_size=64,
               final_logit_softcapping=0.5)


_MOE = dict(num_experts=12, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
            dense_mlp_layers=(0,), router_aux_loss_coef=0.1, output_router_logits=True)
_GLM = dict(num_experts=12, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True, dense_mlp_layers=(0,),
            shared_expert_intermediate_size=12, shared_expert_gate=False, moe_routing="sigmoid_grouped", moe_groups=4,
            moe_topk_groups=2, routed_scaling_factor=2.5, qkv_bias=True, qk_norm=True, partial_rotary_factor=0.5)


GROUPS = {2: [2, 3], 3: [0, 1, 2], 4: [0, 1, 2, 3]}


def _step(D: int, group, cfg: dict, record: bool, weights=None) -> dict:
    """One training step (forward, backward, optimizer.step) from a fixed init; the ops it posts if record."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.documents import documents_of_lengths
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    comm = TSPComm(group, overlap=cfg["overlap"], weight_group=weights if cfg.get("weight_channel") else None)
    shape = ModelShape(vocab_size=61, hidden_size=16 * D, intermediate_size=12 * D, num_layers=2, num_heads=2 * D,
                       num_kv_heads=cfg["kv"], tie_word_embeddings=cfg.get("tie", False),
                       attention_windows=cfg.get("windows"), **cfg.get("moe", {}), **cfg.get("shape", {}))
    model = label_modules(ShardedCausalLM(shape, comm, options=cfg["options"], dtype=torch.float64).init_weights_(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seq = sum(cfg.get("documents", [21]))
    ids = torch.randint(0, shape.vocab_size, (2, seq), generator=torch.Generator().manual_seed(D))
    positions = documents_of_lengths(cfg["documents"])[None] if "documents" in cfg else None
    batch = shard_batch(ids, tsp=D, rank=comm.rank, position_ids=positions)
    with comm.recording() if record else nullcontext() as rec:
        loss = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        loss.backward()
        opt.step()
    return {"ops": rec.ops if record else None, "loss": loss.detach(),
            "params": [p.detach().clone() for p in model.parameters()]}


def _fsdp2_step() -> list[dict]:
    """One TSP=2 x DP=2 training step under FSDP2: the TSP ops of ranks (0, 1) and (2, 3) replayed together.

    FSDP2's own collectives (data axis) do not go through TSPComm and are not recorded."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.integrations.fsdp import shard_with_fsdp2
    from ds_tsp.model.causal_lm import ShardedCausalLM

    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=2), weight_channel=True)
    comm = TSPComm(groups.tsp_group, weight_group=groups.tsp_weight_group)
    shape = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=1)
    model = label_modules(ShardedCausalLM(shape, comm).init_weights_(3))
    shard_with_fsdp2(model, groups)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, shape.vocab_size, (2, 18), generator=torch.Generator().manual_seed(groups.data_rank))
    batch = shard_batch(ids, tsp=2, rank=comm.rank)
    with comm.recording() as rec:
        model(batch["input_ids"], batch["shift_labels"], batch["position_ids"]).backward()
        opt.step()
    return rec.ops


def _record_all() -> dict:
    """{D: {config: {"recorded": step with recording, "plain": the same step without}}} for the Ds of this rank,
    and "fsdp2": the ops of _fsdp2_step."""
    groups = {D: dist.new_group(ranks) for D, ranks in GROUPS.items()}  # every rank creates every group
    weights = {D: dist.new_group(ranks) for D, ranks in GROUPS.items()}  # TSPComm.weight_group: a second channel
    me = dist.get_rank()
    out = {D: {name: {"recorded": _step(D, groups[D], cfg, True, weights[D]),
                      "plain": _step(D, groups[D], cfg, False, weights[D])}
               for name, cfg in _configs(D).items()}
           for D, ranks in GROUPS.items() if me in ranks}
    return {**out, "fsdp2": _fsdp2_step()}


@pytest.fixture(scope="module")
def all_degrees():
    return run_on_local_ranks(_record_all, len(GROUPS[4]), timeout_s=300)


@pytest.fixture(params=sorted(GROUPS), ids=lambda d: f"D{d}")
def recorded(request, all_degrees):
    D = request.param
    return D, [all_degrees[r][D] for r in GROUPS[D]]


def test_training_step_obeys_nccl_rules(recorded):
    D, per_rank = recorded
    for name in _configs(D):
        ops = {g: r[name]["recorded"]["ops"] for g, r in zip(GROUPS[D], per_rank)}
        report = check(ops)
        assert report.ok, f"D={D} {name}:\n{report}"
        assert report.completed == report.total == sum(len(o) for o in ops.values())
        # the same collectives, in the same order, on every rank (independently of the checker); an MoE
        # all_to_all's shape is this rank's routed rows, which differ by rank (the checker matches its splits)
        sequences = [[(o["kind"], None if o["kind"] == "all_to_all" else o["shape"], o["dtype"], o.get("root"))
                      for o in rank_ops]
                     for rank_ops in ops.values()]
        assert all(s == sequences[0] for s in sequences), (D, name)
        first = ops[GROUPS[D][0]]
        assert KINDS <= {o["kind"] for o in first}, (D, name)  # every primitive was recorded
        assert all(o["group"] == tuple(GROUPS[D]) for rank_ops in ops.values() for o in rank_ops)
        # weights (shard broadcasts, grad reduces, ring hops) on their own channel when the comm has one
        want = "weights" if _configs(D)[name].get("weight_channel") else "tsp"
        assert {o["channel"] for o in first if _carries_weights(o)} == {want}, (D, name)
        assert {o["channel"] for o in first if not _carries_weights(o)} == {"tsp"}, (D, name)
        assert any(o["kind"] == "p2p" and o["what"] == "dK/dV scatter" for o in first), (D, name)
        assert all(o["layer"] for rank_ops in ops.values() for o in rank_ops), [o for o in first if not o["layer"]][:3]
        ring = [o for o in first if o["kind"] == "p2p" and o["tag"] not in SEQUENCE_P2P]
        assert any(o["layer"].endswith("mlp forward") for o in ring) and any("backward" in o["layer"] for o in ring)
        assert all(o["batched"] and {peer for _, peer in o["p2p"]} <= set(GROUPS[D]) for o in ring)
        # posted as bare isend then irecv (the old ring_exchange), the same step hangs NCCL
        old = check({g: unbatched(rank_ops) for g, rank_ops in ops.items()})
        assert old.deadlock and "p2p [send ->" in old.deadlock, (D, name)


def test_fsdp2_training_step_obeys_nccl_rules(all_degrees):
    ops = [r["fsdp2"] for r in all_degrees]
    report = check(ops)
    assert report.ok and report.completed == sum(len(o) for o in ops), report
    assert {o["group"] for rank_ops in ops for o in rank_ops} == {(0, 1), (2, 3)}
    assert {"broadcast", "all_gather", "p2p", "all_reduce"} <= {o["kind"] for o in ops[0]}
    assert check([unbatched(rank_ops) for rank_ops in ops]).deadlock


def test_recording_does_not_change_numerics(recorded):
    D, per_rank = recorded
    for name in _configs(D):
        for r in per_rank:
            rec, plain = r[name]["recorded"], r[name]["plain"]
            assert torch.equal(rec["loss"], plain["loss"]), (D, name)
            assert all(torch.equal(a, b) for a, b in zip(rec["params"], plain["params"])), (D, name)


# --- the checker on hand-written op lists ------------------------------------------------------------------------
def _ring(D: int, hops: int = 2, *, batched: bool = True) -> list[list[dict]]:
    g = range(D)
    ops = [[p2p(g, ("send", (r + 1) % D), ("recv", (r - 1) % D), what=f"weight hop {k + 1}",
                layer="model.layers.0.mlp forward") for k in range(hops)] for r in g]
    return ops if batched else [unbatched(rank_ops) for rank_ops in ops]


@pytest.mark.parametrize("D", [2, 3, 4])
def test_bare_isend_then_irecv_ring_deadlocks(D):
    report = check(_ring(D, batched=False))
    assert not report.ok and report.completed == 0
    assert report.deadlock.startswith(f"deadlock: {4 * D} ops can never run; first blocked: p2p [send -> 1] "
                                      "(weight hop 1)"), report
    assert "position 0" in report.deadlock and "layer: model.layers.0.mlp forward" in report.deadlock
    # NCCL buffers sends up to its eager size: below it the same ring runs
    assert check(_ring(D, batched=False), eager_bytes=16).ok


@pytest.mark.parametrize("D", [2, 3, 4])
def test_batched_ring_runs(D):
    report = check(_ring(D))
    assert report.ok and report.completed == report.total == 2 * D, report


def test_a_batch_is_atomic():
    """Rank 0's send is tied to rank 1's whole batch, which also needs rank 2's send; rank 2 first waits for rank
    0's next send. Op by op this would run (0->1, then 0->2, then 2->1); as batches it is a cycle."""
    g = (0, 1, 2)
    ops = [[p2p(g, ("send", 1)), p2p(g, ("send", 2))],
           [p2p(g, ("recv", 0), ("recv", 2))],
           [p2p(g, ("recv", 0)), p2p(g, ("send", 1))]]
    report = check(ops)
    assert report.deadlock and report.completed == 0, report
    ops[2] = ops[2][::-1]  # rank 2 sends first: the three first batches run together, then 0 -> 2
    assert check(ops).ok


def test_mismatched_collective_order_names_the_op():
    g = (0, 1, 2)
    ops = [[op("all_gather", g, layer="ShardedCausalLM forward"), op("broadcast", g, root=0, what="shard of block 0",
                                                                      layer="model.layers.0.self_attn forward"),
            op("all_reduce", g, layer="model.norm backward")] for _ in g]
    ops[2][1], ops[2][2] = ops[2][2], ops[2][1]
    report = check(ops)
    assert not report.ok and len(report.mismatches) == 1, report
    text = report.mismatches[0]
    assert text.startswith("collective #1 of group [0, 1, 2] differs between ranks"), text
    assert "rank 0: broadcast root 0 (shard of block 0) torch.float32[4] on rank 0, group [0, 1, 2] position 1" in text
    assert "layer: model.layers.0.self_attn forward" in text
    assert "rank 2: all_reduce torch.float32[4] on rank 2, group [0, 1, 2] position 1" in text
    assert "layer: model.norm backward" in text
    shapes = [[op("all_reduce", g)], [op("all_reduce", g)], [op("all_reduce", g, shape=(5,))]]
    assert "differs between ranks" in str(check(shapes))
    fewer = [[op("all_reduce", g), op("all_reduce", g)]] * 2 + [[op("all_reduce", g)]]
    report = check(fewer)
    assert "rank 2: posts no such collective" in str(report) and report.deadlock, report


def test_subgroup_collective_interleaved():
    """Ranks 0 and 1 all-reduce on their pair between two world collectives; rank 2 is not a member: it passes.
    Each group is its own communicator (queue): a member posting the pair op later still runs."""
    world, pair = (0, 1, 2), (0, 1)
    ops = [[op("broadcast", world, root=2), op("all_reduce", pair), op("all_gather", world)],
           [op("broadcast", world, root=2), op("all_reduce", pair), op("all_gather", world)],
           [op("broadcast", world, root=2), op("all_gather", world)]]
    report = check(ops)
    assert report.ok and report.completed == 8, report
    ops[1] = [ops[1][0], ops[1][2], ops[1][1]]  # its own queues are still in order per group: NCCL runs it
    assert check(ops).ok
    ops[2] = ops[2][::-1]  # but one group's own ops in a different order are not
    report = check(ops)
    assert not report.ok and "collective #0 of group [0, 1, 2] differs" in report.mismatches[0], report


def test_p2p_size_mismatch_is_reported():
    g = (0, 1)
    ops = [[p2p(g, ("send", 1), ("recv", 1))], [p2p(g, ("send", 0), ("recv", 0), shape=(8,))]]
    report = check(ops)
    assert any("p2p sizes differ" in m for m in report.mismatches), report


# --- the MoE MLP's two dispatch schedules (ds_tsp.core.layers.moe.layer) ----------------------------------------------
MOE_GROUPS = {2: [2, 3], 4: [0, 1, 2, 3]}


def _moe_record() -> dict:
    """{D: {dispatch: ops of one MoE forward + backward}} on this rank (routing skewed: uneven splits)."""
    from moe_reference import MoECase, tsp_case

    from ds_tsp.core.comm.communicator import TSPComm

    groups = {D: dist.new_group(ranks) for D, ranks in MOE_GROUPS.items()}
    out = {}
    for D, ranks in MOE_GROUPS.items():
        if dist.get_rank() in ranks:
            comm = TSPComm(groups[D])
            out[D] = {}
            for dispatch in ("ring", "all_to_all"):
                with comm.recording() as rec:
                    tsp_case(MoECase(skew=(1,), seed=8), comm, dispatch)
                out[D][dispatch] = rec.ops
    return out


@pytest.fixture(scope="module")
def moe_ops():
    return run_on_local_ranks(_moe_record, 4, timeout_s=300)


@pytest.mark.parametrize("D", sorted(MOE_GROUPS))
@pytest.mark.parametrize("dispatch", ["ring", "all_to_all"])
def test_moe_schedules_obey_nccl_rules(moe_ops, D, dispatch):
    ops = {g: moe_ops[g][D][dispatch] for g in MOE_GROUPS[D]}
    report = check(ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops.values()), report
    kinds = {o["kind"] for o in ops[MOE_GROUPS[D][0]]}
    if dispatch == "ring":
        assert kinds == {"p2p"}, kinds
        assert check({g: unbatched(o) for g, o in ops.items()}).deadlock  # why the hops are batched
    else:
        assert kinds == {"all_to_all"}, kinds
        # count exchange + rows out + outputs back, then rows out + grads back: 5 per rank, splits really uneven
        a2a = ops[MOE_GROUPS[D][0]]
        assert len(a2a) == 5 and any(len(set(o["in_splits"])) > 1 for o in a2a[1:]), a2a


def test_all_to_all_split_mismatch_is_reported():
    from nccl_rules import all_to_all

    g = (0, 1, 2)
    good = [all_to_all(g, [1, 2, 3], [1, 4, 0]), all_to_all(g, [4, 0, 1], [2, 0, 2]), all_to_all(g, [0, 2, 5], [3, 1, 5])]
    report = check([[o] for o in good])
    assert report.ok and report.completed == 3, report
    bad = [*good[:2], all_to_all(g, [0, 2, 5], [3, 9, 5])]
    report = check([[o] for o in bad])
    assert not report.ok and "rank 1 sends 1 rows to rank 2, which expects 9" in report.mismatches[0], report
    rows = [*good[:2], all_to_all(g, [0, 2, 5], [3, 1, 5], row=(8,))]
    assert "differs between ranks" in str(check([[o] for o in rows]))
