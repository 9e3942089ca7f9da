"""tsp.cp_comm "auto" (the default): per attention layer and sequence length, the cp schedule with less exposed
inter-node time (ds_tsp.core.layers.attention.cp_cost).

- the decision's cases: MHA, where the all-to-all sends fewer bytes, takes it below the length from which attention
  hides the ring and the ring from there; GQA / MQA, where the ring sends fewer, the ring at every length; head
  blocks the all-to-all refuses and sliding-window layers the ring (never an error); given values pass through, an
  unknown one names tsp.cp_comm; the config's default is "auto";
- the cost is the plan's: each schedule's bytes per layer x the attention layers (+ the input check) equal
  `ds-tsp plan --cp C`'s inter-node bytes per step for the ring and the all-to-all (bf16 + checkpointing, fp32 +
  keep_gathered_kv, MQA replicated); `ds-tsp plan` under "auto" plans the schedule the function names;
- the model under "auto" (in tests/cp/test_cp.py's 4-rank spawn, (D, C) = (2, 2), float64): a windowed layer on the
  ring beside a full MHA layer on the all-to-all, loss and EVERY gradient within 1e-10 of one device; the cp
  communicator's counter of a step equals the cost function's bytes for the schedule it names (all-to-all for MHA
  with keep_gathered_kv, ring for GQA), so each layer ran what the function chose;
- CLI: plan --cp-comm auto (JSON and text), verify / bench accept auto.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch

from ds_tsp.core.config import parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.attention.cp_cost import (
    CPLayerShape,
    all_to_all_bytes_per_layer,
    choose_cp_comm,
    cp_costs,
    describe_choice,
    ring_bytes_per_layer,
    ring_from_seq,
)
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.verify import VerifyCase

TOL = 1e-10
MHA = CPLayerShape(heads_per_block=4, kv_heads_per_block=4, kv_replicas=1, head_dim=128, tsp=8, cp=4, dtype_bytes=2,
                   activation_checkpointing=True)


def _shape(heads, kv, **kw):
    return ModelShape(**{"vocab_size": 61, "hidden_size": 8 * heads, "intermediate_size": 48, "num_layers": 2,
                         "num_heads": heads, "num_kv_heads": kv, **kw})


def test_mha_takes_the_all_to_all_until_attention_hides_the_ring():
    start = ring_from_seq(MHA)
    step = 2 * MHA.tsp * MHA.cp
    assert 0 < start < 1 << 20 and start % step == 0
    short = cp_costs(MHA, step)
    assert short["all_to_all"]["bytes"] < short["ring"]["bytes"]  # fewer bytes, and nothing hides the ring yet
    assert choose_cp_comm("auto", MHA, step) == "all_to_all"
    assert choose_cp_comm("auto", MHA, start - step) == "all_to_all"
    assert choose_cp_comm("auto", MHA, start) == "ring"
    long = cp_costs(MHA, 1 << 20)
    assert long["ring"]["exposed_seconds"] == 0 < long["all_to_all"]["exposed_seconds"]
    assert choose_cp_comm("auto", MHA, 1 << 20) == "ring"
    assert f"all_to_all below {start} tokens" in describe_choice("auto", MHA)


@pytest.mark.parametrize("kv, replicas", [(1, 1), (1, 2)])  # GQA 4:1 per block; MQA (kv replicated over blocks)
def test_gqa_and_mqa_take_the_ring_at_every_length(kv, replicas):
    gqa = replace(MHA, kv_heads_per_block=kv, kv_replicas=replicas)
    assert ring_from_seq(gqa) == 0
    for seq in (64, 1 << 14, 1 << 20):
        cost = cp_costs(gqa, seq)
        assert cost["ring"]["bytes"] < cost["all_to_all"]["bytes"]
        assert choose_cp_comm("auto", gqa, seq) == "ring"
    assert describe_choice("auto", gqa).startswith("ring (auto: its exposed")


def test_refused_heads_and_windows_take_the_ring():
    odd = replace(MHA, heads_per_block=3, kv_heads_per_block=3)  # 3 heads do not split over cp 4
    assert all_to_all_bytes_per_layer(odd, 1 << 12) is None and cp_costs(odd, 64)["all_to_all"] is None
    assert choose_cp_comm("auto", odd, 64) == "ring" and "does not split over cp_size=4" in describe_choice("auto", odd)
    assert choose_cp_comm("auto", MHA, 64, window=128) == "ring"  # MHA would take the all-to-all at 64 tokens
    assert choose_cp_comm("auto", replace(MHA, cp=1), 64) == "ring"
    with pytest.raises(TSPConfigError, match=r"tsp.cp_comm='all_to_all' with tsp.cp_size=4"):
        from ds_tsp.core.layers.attention.cp_all_to_all import check_all_to_all_heads

        check_all_to_all_heads(3, 3, 4)  # what the explicit all-to-all says for the same block


def test_given_schedules_pass_and_unknown_ones_name_the_field():
    assert choose_cp_comm("ring", MHA, 64) == "ring" and choose_cp_comm("all_to_all", MHA, 1 << 20) == "all_to_all"
    with pytest.raises(TSPConfigError, match=r"tsp.cp_comm='ulysses'"):
        choose_cp_comm("ulysses", MHA, 64)
    assert parse_tsp_config({"cp_size": 2}).cp_comm == "auto"
    assert parse_tsp_config({"cp_size": 2, "cp_comm": "ring"}).options().cp_comm == "ring"
    with pytest.raises(TSPConfigError, match=r"tsp.cp_comm='ulysses'.*'auto'.*'ring'.*'all_to_all'"):
        parse_tsp_config({"cp_size": 2, "cp_comm": "ulysses"})


PLAN_CASES = [  # (model, plan input options, cp)
    (_shape(8, 8, num_layers=3), {"dtype": "bf16", "activation_checkpointing": True}, 2),
    (_shape(8, 4), {"dtype": "fp32", "keep_gathered_kv": True}, 4),
    (_shape(8, 1), {"dtype": "fp32"}, 2),  # MQA: the kv head replicated
]


@pytest.mark.parametrize("index", range(len(PLAN_CASES)))
def test_cost_is_the_plans_inter_node_bytes(index):
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.tsp_cp import plan_tsp_cp
    from ds_tsp.tools.plan.tsp_cp_all_to_all import plan_tsp_cp_all_to_all
    from ds_tsp.tools.plan.tsp_cp_auto import cp_layer_shape, plan_tsp_cp_auto

    model, options, C = PLAN_CASES[index]
    for seq in (40, 1000):
        inp = PlanInput(model=model, seq=seq, batch=2, degree=2, **options)
        shape, layers = cp_layer_shape(inp, C), model.num_layers
        plans = {"ring": plan_tsp_cp(inp, C), "all_to_all": plan_tsp_cp_all_to_all(inp, C)}
        S = plans["ring"].cp["seq_padded"]
        check = plans["ring"].cp["input_check_cp_bytes_per_step"]
        assert plans["ring"].cp["inter_node_bytes_per_step"] == layers * ring_bytes_per_layer(shape, S, 2) + check
        assert plans["all_to_all"].cp["inter_node_bytes_per_step"] == \
            layers * all_to_all_bytes_per_layer(shape, S, 2) + check
        auto = plan_tsp_cp_auto(inp, C)
        want = choose_cp_comm("auto", shape, S)
        assert auto.cp["cp_comm"] == auto.cp["cp_comm_auto"]["chosen"] == want
        assert auto.cp["inter_node_bytes_per_step"] == plans[want].cp["inter_node_bytes_per_step"]
        assert auto.cp["cp_comm_auto"]["per_layer"]["ring"]["bytes"] * layers + check == \
            plans["ring"].cp["inter_node_bytes_per_step"]
        # the decision weighs the all-to-all's exposed time as the plan reports it (its exchanges pipelined)
        exposed = auto.cp["cp_comm_auto"]["per_layer"]["all_to_all"]
        if exposed is not None:
            assert exposed["exposed_seconds"] < exposed["seconds"]
            check_s = check / (plans["all_to_all"].cp["inter_node_gbps"] * 1e9 / 8)  # the input check waits too
            assert exposed["exposed_seconds"] * layers + check_s == pytest.approx(
                plans["all_to_all"].cp["cp_all_to_all_exposed_seconds_per_step"], rel=1e-2)


def test_plan_cli_auto(capsys):
    from ds_tsp.tools.cli import main

    argv = ["plan", "--model", "8b", "--tsp", "8", "--cp", "4", "--activation-checkpointing", "--kv-heads", "32"]
    chosen = {}
    for seq in ("16k", "1m"):  # MHA: the all-to-all at 16K, the ring behind 1M tokens' attention
        assert main([*argv, "--seq", seq, "--json"]) == 0
        cp = json.loads(capsys.readouterr().out)["cp"]
        assert cp["cp_comm_requested"] == "auto" and cp["cp_comm"] == cp["cp_comm_auto"]["chosen"]
        chosen[seq] = cp["cp_comm"]
        costs = cp["cp_comm_auto"]["per_layer"]
        assert costs["ring"]["bytes"] > costs["all_to_all"]["bytes"]  # both figures beside the choice
    assert chosen == {"16k": "all_to_all", "1m": "ring"}
    assert main([*argv, "--seq", "16k"]) == 0  # the default is auto
    out = capsys.readouterr().out
    assert "cp schedule (cp_comm auto): all_to_all at seq 16384" in out and "C=4 (cp all-to-all" in out
    assert main([*argv[:-2], "--seq", "1m", "--cp-comm", "auto"]) == 0  # 8b (GQA): the ring at every length
    assert "ring (auto: its exposed inter-node time is the lesser at every length)" in capsys.readouterr().out
    assert main([*argv, "--seq", "16k", "--cp-comm", "ring", "--json"]) == 0  # as before: no auto keys
    assert "cp_comm_auto" not in json.loads(capsys.readouterr().out)["cp"]


def test_verify_and_bench_accept_auto():
    from ds_tsp.tools.bench.cp_flags import cp_comms
    from ds_tsp.tools.cli import build_parser

    args = build_parser().parse_args(["verify", "--tsp", "2", "--cp", "2", "--cp-comm", "auto"])
    assert args.cp_comm == "auto" and build_parser().parse_args(["verify"]).cp_comm == "auto"
    bench = build_parser().parse_args(["bench", "--tsp", "2", "--cp", "2", "--cp-comm", "ring,auto"])
    assert cp_comms(bench) == ["ring", "auto"]
    with pytest.raises(ValueError, match="--cp-comm: unknown"):
        cp_comms(build_parser().parse_args(["bench", "--tsp", "2", "--cp", "2", "--cp-comm", "ulysses"]))


# --- multi-rank (tests/cp/test_cp.py's 4-rank spawn) ---------------------------------------------------------------
MIXED = VerifyCase(shape=_shape(4, 4, attention_windows=(5, None)), seq=37, batch=2, dtype="float64", seed=31,
                   documents=3)
KEEP = {"keep_gathered_kv": True}  # float64 MHA at C = 2: the all-to-all's bytes fall below the ring's with it


def _counted_step(shape: ModelShape, options: dict) -> dict:
    """One forward + backward under "auto": the cp communicator's bytes, and what each layer says it runs."""
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM
    from ds_tsp.model.modules.attention import cp_schedules_at

    runtime = build_runtime(parse_tsp_config({"size": 2, "cp_size": 2, **options}))
    logged = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("ds_tsp")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        model = ShardedCausalLM(shape, runtime.comm, dtype=torch.float64, options=runtime.options,
                                data_group=runtime.data_group).init_weights_(5)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(1))
    batch = shard_batch(ids, tsp=2, rank=runtime.groups.tsp_rank, cp=2, cp_rank=runtime.groups.cp_rank)
    runtime.comm.cp.counter.reset()
    model(batch["input_ids"], batch["shift_labels"], batch["position_ids"]).backward()
    return {"cp_bytes": dict(runtime.comm.cp.counter.bytes), "logged": logged,
            "chosen": cp_schedules_at(model.model.layers, 40, torch.float64)}


def cp_auto_at_2x2() -> dict:
    """What tests/cp/test_cp.py's 4-rank spawn runs for this module."""
    from ds_tsp.tools.verify import run_cp_case

    return {"mixed": run_cp_case(MIXED, 2, 2, KEEP), "mha": _counted_step(_shape(4, 4), KEEP),
            "gqa": _counted_step(_shape(4, 2), {})}


@pytest.fixture(scope="module")
def at_2x2():
    from test_cp import spawn_at_2x2

    return [r["cp_auto"] for r in spawn_at_2x2()]


def test_auto_mixed_model_is_exact_in_float64(at_2x2):
    report = at_2x2[0]["mixed"]
    assert report["cp_comm"] == "auto" and report["cp_comm_chosen"] == {"ring": [0], "all_to_all": [1]}
    assert report["loss_rel_err"] < TOL and report["grad_rel_err"] < TOL, report


@pytest.mark.parametrize("name, heads, kv, want", [("mha", 4, 4, "all_to_all"), ("gqa", 4, 2, "ring")])
def test_auto_runs_the_schedule_the_function_names(at_2x2, name, heads, kv, want):
    from ds_tsp.tools.plan.tsp_comm import input_check_cp_bytes

    shape = CPLayerShape(heads // 2, max(kv // 2, 1), max(2 // kv, 1), 8, 2, 2, 8,
                         keep_gathered_kv=name == "mha")
    assert choose_cp_comm("auto", shape, 40) == want
    cost = {"ring": ring_bytes_per_layer(shape, 40, 2), "all_to_all": all_to_all_bytes_per_layer(shape, 40, 2)}
    line = f"cp schedule (tsp.cp_comm, K/V in float64): layers 0-1: {describe_choice('auto', shape)}"
    assert at_2x2[0][name]["logged"] == [line]  # once, at build, on global rank 0 only
    assert all(r[name]["logged"] == [] for r in at_2x2[1:])
    for r in at_2x2:
        assert r[name]["chosen"] == {want: [0, 1]}
        assert r[name]["cp_bytes"] == {want: 2 * cost[want], "all_gather": input_check_cp_bytes(2, 2)}, r[name]


@pytest.mark.slow
def test_verify_cli_auto_float64(capsys):
    """`ds-tsp verify --cp-comm auto`: MHA over C = 4 groups (D = 1) runs the all-to-all, exact; its report names the
    schedule each layer ran."""
    from ds_tsp.tools.cli import main

    assert main(["verify", "--tsp", "1", "--cp", "4", "--cp-comm", "auto", "--dtype", "float64", "--documents", "3",
                 "--kv-heads", "4", "--seq", "50", "--timeout", "300"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["cp"], report["cp_comm"], report["ok"]) == (4, "auto", True), report
    assert report["cp_comm_chosen"] == {"all_to_all": [0, 1]} and report["grad_rel_err"] < TOL, report


@pytest.mark.slow
def test_bench_auto_row_names_the_schedule_and_its_plan(tmp_path, capsys):
    """`ds-tsp bench --tsp 2 --cp 2 --cp-comm all_to_all,auto --layouts tsp_cp`: the auto row names the schedule the
    model ran (cp_comm_chosen, the function's choice for the bench's float32 shape) and its cp bytes are that
    schedule's plan."""
    from ds_tsp.tools.bench.cli import build_parser

    tiny = ["--layers", "1", "--hidden", "32", "--heads", "4", "--ffn", "64", "--vocab", "64"]  # test_bench_cp's

    out = tmp_path / "bench"
    args = build_parser().parse_args(["--tsp", "2", "--cp", "2", "--cp-comm", "all_to_all,auto", "--layouts",
                                      "tsp_cp", "--quick", "--seq", "32", "--steps", "1", "--quiet", "--out", str(out),
                                      *tiny])
    assert args.run(args) == 0, capsys.readouterr().err[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["cp_comm"] for r in rows] == ["all_to_all", "auto"]
    auto = rows[1]
    options = auto["tsp_options"]
    shape = CPLayerShape(2, 2, 1, 8, 2, 2, 4, bool(auto["activation_checkpointing"]), options["keep_gathered_kv"])
    assert auto["cp_comm_chosen"] == choose_cp_comm("auto", shape, 32)
    assert auto["ok"] and auto["comm_cp_ring_bytes"] == auto["plan_cp_ring_bytes"] > 0, auto
