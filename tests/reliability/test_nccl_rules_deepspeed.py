"""The NCCL-rules replay (tests/helpers/nccl_rules.py) of one DeepSpeed training step through ds_tsp.initialize, for the two
configurations tests/reliability/test_nccl_rules.py leaves out: pipeline stages x TSP (2 stages x TSP 2 on 4 ranks, ZeRO-1,
two micro-batches per train_batch) and ZeRO-3 on the data axis (TSP 2 x DP 2). Both run in ONE 4-rank launch.

What is recorded per rank: every op the step posts through the engine's one TSPComm (comm.recording()), and, in the
same post order, every torch.distributed call made elsewhere (tests/helpers/dist_trace.py: DeepSpeed's pipeline sends,
ZeRO-3's gathers and reduce-scatters, the grad-norm all-reduce, ds_tsp's own data-axis reductions), tagged
source="outside". The TSPComm ops must replay cleanly (no deadlock, the same collectives on every member of a TSP
group); under pipeline stages each stage's TSP group posts its own layers' ops and is a queue of its own, so the
test also checks that the two stages' TSP groups really differ and each is internally identical.
"""
from __future__ import annotations

import math

import pytest

pytest.importorskip("deepspeed")

from dist_trace import traced
from local_ranks import run_on_local_ranks
from masked_patterns import MaskedPatterns
from nccl_rules import check, unbatched

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.reference_model import (
    ReferenceCausalLM,
    full_state_dict,
    init_weights_,
)

SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
ENV = {"DS_ACCELERATOR": "cpu"}
TSP_GROUPS = [(0, 1), (2, 3)]  # tsp innermost: the same groups under both layouts


def _config(*, zero: int, pipeline_stages: int = 1, micro_batch: int = 2, accumulation: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 10_000, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": zero}, "gradient_clipping": 0.5,
            "tsp": {"size": 2, "pipeline_stages": pipeline_stages}}


PIPELINE = _config(zero=1, pipeline_stages=2, micro_batch=1, accumulation=2)  # two micro-batches: a 1F1B schedule
ZERO3 = _config(zero=3)


def _the_comm(engine):
    """The one TSPComm every layer shares (the pipeline engine has no tsp_model: ask the stage's modules)."""
    from ds_tsp.core.comm.communicator import TSPComm

    comms = {id(m.comm): m.comm for m in engine.module.modules() if isinstance(getattr(m, "comm", None), TSPComm)}
    assert len(comms) == 1, f"{len(comms)} TSPComm objects in the stage"
    comm = next(iter(comms.values()))
    assert engine.tsp_model is None or engine.tsp_model.comm is comm
    return comm


def _recorded_steps() -> dict:
    """One full training step of each configuration; this rank's ops (TSPComm's and, tagged, everything else's)."""
    import torch.distributed as dist

    import ds_tsp
    from ds_tsp.core.comm.recorder import CommRecorder
    from ds_tsp.core.tokens.loader import pipeline_batches

    ref = ReferenceCausalLM(SHAPE)
    init_weights_(ref, 0)
    full = full_state_dict(ref)
    data = MaskedPatterns(vocab_size=SHAPE.vocab_size, seq_len=30, num_samples=32)
    out = {}

    engine, _, loader, _ = ds_tsp.initialize(model=SHAPE, config=PIPELINE, training_data=data, state_dict=full)
    comm, batches = _the_comm(engine), pipeline_batches(loader)
    rec = CommRecorder()
    with comm.recording(rec), traced(rec.ops):
        loss = engine.train_batch(batches)
    out["pipeline"] = {"ops": rec.ops, "tsp_group": tuple(dist.get_process_group_ranks(comm.group)),
                       "stage": engine.stage_id, "steps": engine.global_steps, "loss": float(loss)}
    engine.destroy()

    engine, _, loader, _ = ds_tsp.initialize(model=SHAPE, config=ZERO3, training_data=data, state_dict=full)
    comm, batch = _the_comm(engine), next(iter(loader))
    rec = CommRecorder()
    with comm.recording(rec), traced(rec.ops):
        loss = engine(batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        engine.backward(loss)
        engine.step()
    out["zero3"] = {"ops": rec.ops, "tsp_group": tuple(dist.get_process_group_ranks(comm.group)),
                    "steps": engine.global_steps, "loss": float(loss)}
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def recorded():
    return run_on_local_ranks(_recorded_steps, 4, timeout_s=300, env=ENV)


def _tsp_ops(ops: list[dict]) -> list[dict]:
    return [o for o in ops if o.get("source") != "outside"]


def _sequence(ops: list[dict]) -> list[tuple]:
    """What every member of a group must post identically (p2p peers differ by rank and are left out)."""
    return [(o["kind"], o["shape"], o["dtype"], o.get("root"), o["what"], o["layer"]) for o in ops]


def _layers(ops: list[dict], kind: str, what: str = "") -> set[str]:
    return {o["layer"] for o in ops if o["kind"] == kind and what in (o["what"] or "")}


TSP_KINDS = {"broadcast", "reduce", "all_gather", "all_reduce", "p2p"}  # the dK/dV scatter: p2p (kv_gather)


def _check_tsp_recording(name: str, recorded: list[dict]) -> dict[int, list[dict]]:
    """The checks both configurations share; returns {rank: TSPComm ops}."""
    ops = {r: _tsp_ops(res[name]["ops"]) for r, res in enumerate(recorded)}
    for r, res in enumerate(recorded):  # one whole step ran: the optimizer stepped, on a finite loss
        assert res[name]["steps"] == 1 and math.isfinite(res[name]["loss"]), (name, r, res[name]["steps"])
    for r, rank_ops in ops.items():
        group = recorded[r][name]["tsp_group"]
        assert group == TSP_GROUPS[r // 2], (name, r, group)
        assert rank_ops, f"{name}: rank {r} recorded no TSPComm op"
        assert all(o["group"] == group for o in rank_ops), (name, r)  # only its own TSP group
        assert TSP_KINDS <= {o["kind"] for o in rank_ops}, (name, r, {o["kind"] for o in rank_ops})
        assert all(o["layer"] for o in rank_ops), (name, r, [o for o in rank_ops if not o["layer"]][:3])
        ring = [o for o in rank_ops if o["kind"] == "p2p"]
        assert all(o["batched"] and {peer for _, peer, *_ in o["p2p"]} == set(group) - {r} for o in ring), (name, r)
        assert any(o["what"].startswith("weight hop") for o in ring) and any(o["what"].startswith("grad hop")
                                                                              for o in ring), (name, r)
        assert any(o["layer"].endswith("mlp forward") for o in ring) and any(o["layer"].endswith("mlp backward")
                                                                              for o in ring), (name, r)
        assert _layers(rank_ops, "all_gather", "K/V gather"), (name, r)  # K/V
        assert _layers(rank_ops, "p2p", "dK/dV scatter"), (name, r)  # dK/dV, to the ranks whose keys it read
        assert _layers(rank_ops, "broadcast", "shard of block"), (name, r)  # attention weight shards
        assert _layers(rank_ops, "reduce", "grad of block"), (name, r)
    # the members of each TSP group post the same collectives and ring hops in the same order (independently of
    # the checker, which compares collectives only)
    for a, b in TSP_GROUPS:
        assert _sequence(ops[a]) == _sequence(ops[b]), (name, a, b)
    report = check(ops)
    assert report.ok, f"{name}:\n{report}"
    assert report.completed == report.total == sum(len(o) for o in ops.values()), report
    # can fail: the same step with every ring batch posted as bare isend then irecv hangs NCCL ...
    old = check({r: unbatched(rank_ops) for r, rank_ops in ops.items()})
    assert old.deadlock and "p2p [send ->" in old.deadlock, (name, old)
    # ... and one member of the second TSP group missing its last collective is reported
    last = max(i for i, o in enumerate(ops[3]) if o["kind"] != "p2p")
    short = check({**ops, 3: ops[3][:last] + ops[3][last + 1:]})
    assert not short.ok and any("rank 3: posts no such collective" in m for m in short.mismatches), short
    assert "group [0, 1]" not in "".join(short.mismatches), short  # the first TSP group is unaffected
    return ops


def test_pipeline_stages_step_obeys_nccl_rules(recorded):
    """2 stages x TSP 2: ranks (0, 1) run the embedding and layer 0, ranks (2, 3) layer 1 and the head; each stage
    posts different TSP ops on its own TSP group (its own NCCL communicator), and both micro-batches' forward and
    backward appear."""
    assert [r["pipeline"]["stage"] for r in recorded] == [0, 0, 1, 1]
    ops = _check_tsp_recording("pipeline", recorded)
    first, second = ops[0], ops[2]
    assert _sequence(first) != _sequence(second)  # the two groups really post different steps
    # vocab rings: the embedding's on stage 0 (PipelineModule layer "0"), the LM head's on stage 1 (layer "3")
    assert _layers(first, "p2p", "weight hop") >= {"0 forward", "1.mlp forward"}, _layers(first, "p2p")
    assert _layers(second, "p2p", "weight hop") >= {"3.lm_head forward", "2.mlp forward"}, _layers(second, "p2p")
    assert not any("lm_head" in o["layer"] for o in first) and not any(o["layer"].startswith("1") for o in second)
    for rank_ops in (first, second):  # two micro-batches: each MLP ring runs twice forward, twice backward
        for direction in ("forward", "backward"):
            hops = [o for o in rank_ops if o["kind"] == "p2p" and o["what"].startswith("weight hop")
                    and o["layer"].endswith(f"mlp {direction}")]
            assert len(hops) == 2, (direction, hops)
    # the token count for the loss is summed over the TSP group on the last stage only
    assert any(o["kind"] == "all_reduce" and o["dtype"] == "torch.int64" for o in second)
    assert not any(o["kind"] == "all_reduce" and o["dtype"] == "torch.int64" for o in first)


def test_zero3_step_obeys_nccl_rules(recorded):
    """TSP 2 x DP 2 under ZeRO-3: both TSP groups post the whole model's TSP ops (ZeRO-3 gathers the data-axis
    partitions of each TSP shard outside TSPComm)."""
    ops = _check_tsp_recording("zero3", recorded)
    rank_ops = ops[0]
    assert _layers(rank_ops, "p2p", "weight hop") >= {"model.embed_tokens forward", "lm_head forward",
                                                      "model.layers.0.mlp forward", "model.layers.1.mlp forward"}
    assert _layers(rank_ops, "p2p", "grad hop") >= {"model.embed_tokens backward", "lm_head backward",
                                                    "model.layers.0.mlp backward", "model.layers.1.mlp backward"}
    assert {f"model.layers.{i}.self_attn {d}" for i in (0, 1) for d in ("forward", "backward")} <= _layers(
        rank_ops, "all_gather", "K/V gather")


def test_collectives_outside_tspcomm(recorded):
    """What DeepSpeed (and ds_tsp outside TSPComm) posts in the same step, replayed together with the TSPComm ops
    in each rank's post order. Approximate: NCCL gives torch's unbatched send / recv a communicator per rank pair
    (here: the group they name), and order between communicators is not modelled; DeepSpeed picks some paths by
    backend (gloo here)."""
    for name in ("pipeline", "zero3"):
        ops = [r[name]["ops"] for r in recorded]
        report = check(ops)
        assert report.ok and report.completed == report.total == sum(len(o) for o in ops), f"{name}:\n{report}"
    outside = {name: [[o for o in r[name]["ops"] if o.get("source") == "outside"] for r in recorded]
               for name in ("pipeline", "zero3")}
    # pipeline: activations and their grads between stages (rank r <-> r +- 2), not through TSPComm
    for r, rank_ops in enumerate(outside["pipeline"]):
        peers = {peer for o in rank_ops if o["kind"] == "p2p" for _, peer, *_ in o["p2p"]}
        assert peers == {(r + 2) % 4}, (r, peers)
    # ZeRO-3: parameter all-gathers and the gradient reduce-scatter on the data axis ((0, 2), (1, 3))
    for r, rank_ops in enumerate(outside["zero3"]):
        data = (r % 2, r % 2 + 2)
        kinds = {o["kind"] for o in rank_ops if o["group"] == data}
        assert {"all_gather", "reduce_scatter"} <= kinds, (r, kinds)
        # DeepSpeed's grad-norm all-reduce runs on the TSP group (the mpu's model-parallel group): the same
        # communicator as TSPComm's ops, posted from outside it
        on_tsp = [o for o in rank_ops if o["group"] == TSP_GROUPS[r // 2]]
        assert on_tsp and all(o["kind"] == "all_reduce" and o["caller"].startswith("deepspeed") for o in on_tsp), on_tsp
