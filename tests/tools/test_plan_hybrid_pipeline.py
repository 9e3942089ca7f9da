"""`ds-tsp plan --pp P` (and `--pp P --cp C`) for hybrid (Gated DeltaNet) and dense models against real pipeline stages.

Each stage is run as the pipeline builds it (ds_tsp.integrations.deepspeed.pipeline: EmbeddingPipe, DecoderPipe,
NormHeadLossPipe over one shared StepPositions) for one micro-batch, forward and backward (the first stage's output
grad a random tensor, the last stage's input a leaf that requires grad, as the received activation is): the TSP
communicator's bytes per kind equal hybrid_counter_bytes(inp, stage) EXACTLY on every rank for both stages of a
dense and an MoE hybrid, the reported stage's params and grads bytes exactly, its saved activations within 10% (the
tolerance of tests/tools/test_plan.py). Under cp (D, C) = (2, 2) the reported stage's TSP and cp communicators'
bytes equal plan_tsp_cp's rows exactly, and the other stage's the same per-layer rows times its own layers. The
pipe's p2p hops and DeepSpeed's data-parallel reduction are not on these counters (DeepSpeed posts them). One
launch of 4 ranks: a TSP group of 2 x data 2 for the cp = 1 stages, then TSP 2 x cp 2.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
from hybrid_tiny import hybrid_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.plan import PlanInput, PlanInputError, plan_tsp  # noqa: E402
from ds_tsp.tools.plan import cli as plan_cli  # noqa: E402
from ds_tsp.tools.plan.hybrid import hybrid_counter_bytes  # noqa: E402
from ds_tsp.tools.plan.moe_terms import stage_layer_ids  # noqa: E402
from ds_tsp.tools.plan.shape_terms import stages  # noqa: E402
from ds_tsp.tools.plan.tsp_comm import tsp_counter_bytes  # noqa: E402
from ds_tsp.tools.plan.tsp_cp import group_input, plan_tsp_cp  # noqa: E402
from ds_tsp.tools.plan.tsp_cp_all_to_all import plan_tsp_cp_all_to_all  # noqa: E402

LAYERS = ("linear_attention", "full_attention", "linear_attention")  # pp = 2: [GDN, full] | [GDN]
SEQ, BATCH, PP = 29, 2, 2  # seq pads to 32 (2D) at cp 1 and to 32 (2CD) at cp 2
CP_LAYERS = ("linear_attention", "full_attention", "full_attention", "linear_attention")  # [GDN, full] | [full, GDN]


def _shape(name: str) -> ModelShape:
    if name == "windowed_cp":  # a dense model with sliding-window layers: [window, full] | [window, full]
        return ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                          num_kv_heads=2, attention_windows=(12, None, 12, None))
    if name == "qwen3_dense":  # a dense model with q/k norms: the same stage rows without Gated DeltaNet layers
        return ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                          num_kv_heads=2, qk_norm=True)
    if name == "qwen3_5":
        cfg = hybrid_config("qwen3_5", layer_types=LAYERS, num_hidden_layers=3)
    elif name == "qwen3_next_moe":  # layer 0 dense (mlp_only_layers), 1 and 2 sparse; no aux loss (pp refuses it);
        # top-k = all 4 experts, so all_to_all moves the plan's even-routing rows exactly (as test_plan_hybrid_moe)
        cfg = hybrid_config("qwen3_next_moe", layer_types=LAYERS, num_hidden_layers=3, output_router_logits=False,
                            num_experts_per_tok=4)
    else:  # "qwen3_5_cp"
        cfg = hybrid_config("qwen3_5", layer_types=CP_LAYERS, num_hidden_layers=4)
    return ModelShape.from_hf_config(cfg.to_dict())


def _input(name: str, **kw) -> PlanInput:
    return PlanInput(model=_shape(name), seq=SEQ, batch=BATCH, degree=2, dtype="fp32", pp=PP, **kw)


def _stage_step(shape: ModelShape, runtime, layers, embed: bool, head: bool, checkpointing: bool = False) -> dict:
    """One micro-batch through the pipeline modules of one stage: counters, params, grads, saved bytes. With
    checkpointing each decoder layer runs under DeepSpeed's checkpoint as PipelineModule calls it."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint  # PipelineModule's default

    from ds_tsp.core.tokens.positions import StepPositions
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.integrations.deepspeed.pipeline import DecoderPipe, EmbeddingPipe, NormHeadLossPipe

    comm, groups, C = runtime.comm, runtime.groups, runtime.layout.cp
    positions = StepPositions(shape, comm)
    modules = ([EmbeddingPipe(shape, comm, torch.float32, None)] if embed else []) + \
        [DecoderPipe(shape, comm, runtime.options.replace(activation_checkpointing=checkpointing), torch.float32,
                     None, i, positions) for i in layers] + \
        ([NormHeadLossPipe(shape, comm, torch.float32, None, None)] if head else [])
    gen = torch.Generator().manual_seed(groups.tsp_rank)
    with torch.no_grad():
        for p in (p for m in modules for p in m.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    ids = torch.randint(0, shape.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    b = shard_batch(ids, tsp=comm.size, rank=groups.tsp_rank, **({"cp": C, "cp_rank": groups.cp_rank} if C > 1
                                                                   else {}))
    x = b["input_ids"] if embed else \
        torch.randn(*b["input_ids"].shape, shape.hidden_size, generator=gen).requires_grad_()
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = max(saved.get(t.untyped_storage().data_ptr(), 0),
                                                    t.untyped_storage().nbytes())
        return t

    comm.counter.reset()
    if comm.cp is not None:
        comm.cp.counter.reset()
    out = (x, b["position_ids"], b["shift_labels"])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for m in modules:
            if checkpointing and isinstance(m, DecoderPipe):
                out = checkpoint(lambda *xs, m=m: m(xs), *out)
            else:
                out = m(out)
    params = [p for m in modules for p in m.parameters()]
    own = {p.untyped_storage().data_ptr() for p in params}
    if head:
        out.backward()
    else:
        out[0].backward(torch.randn(out[0].shape, generator=gen))
    return {"tsp": dict(comm.counter.bytes), "cp": dict(comm.cp.counter.bytes) if comm.cp is not None else {},
            "ranks": (groups.cp_rank, groups.tsp_rank),
            "params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params),
            "saved": sum(n for ptr, n in saved.items() if ptr not in own)}


def _measure(shapes: dict) -> dict:
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.parallel.runtime import build_runtime

    out = {}
    for C, cp_comm in ((1, "ring"), (2, "ring"), (2, "all_to_all")):
        runtime = build_runtime(parse_tsp_config({"size": 2, "cp_size": C, "cp_comm": cp_comm}))
        for name, shape in shapes.items():
            if name.endswith("_cp") != (C == 2) or (name == "windowed_cp" and cp_comm == "all_to_all"):
                continue
            inp = PlanInput(model=shape, seq=SEQ, batch=BATCH, degree=2, dtype="fp32", pp=PP)
            for stage in stages(inp):
                key = (name, stage.name) if cp_comm == "ring" else (name, cp_comm, stage.name)
                out[key] = _stage_step(shape, runtime, stage_layer_ids(inp, stage), stage.embed, stage.head)
                if name in ("qwen3_5", "qwen3_5_cp") and cp_comm == "ring":
                    out[(name, "checkpointing", stage.name)] = _stage_step(
                        shape, runtime, stage_layer_ids(inp, stage), stage.embed, stage.head, checkpointing=True)
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    names = ("qwen3_5", "qwen3_next_moe", "qwen3_dense", "qwen3_5_cp", "windowed_cp")
    return run_on_local_ranks(_measure, 4, {n: _shape(n) for n in names}, timeout_s=300)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next_moe"])
def test_every_stage_bytes_equal_its_counter_and_the_reported_stage_its_memory(measured, name):
    inp = _input(name)
    plan = plan_tsp(inp)
    for stage in stages(inp):
        for r, rank in enumerate(measured):  # TSP rank r % 2 (innermost); the later moves less of the causal K/V
            predicted = hybrid_counter_bytes(inp, stage, rank=r % 2)
            assert rank[(name, stage.name)]["tsp"] == predicted, (stage.name, rank[(name, stage.name)]["tsp"],
                                                                  predicted)
    # the plan's step total of the busiest stage: its counter bytes + the pipe's p2p hop (DeepSpeed's, not counted)
    busiest = max(sum(hybrid_counter_bytes(inp, s).values()) + sum(t.bytes for t in plan_tsp(inp).step_terms
                                                                     if t.kind == "p2p") for s in stages(inp))
    assert plan.comm_bytes_per_step == busiest
    if name == "qwen3_5":  # activation checkpointing: each layer's forward again, its position_ids gathered again
        checkpointed = _input(name, activation_checkpointing=True)
        for stage in stages(checkpointed):
            assert all(rank[(name, "checkpointing", stage.name)]["tsp"] ==
                       hybrid_counter_bytes(checkpointed, stage, rank=r % 2) for r, rank in enumerate(measured)), (
                stage.name, measured[1][(name, "checkpointing", stage.name)]["tsp"])
    stage = next(s for s in stages(inp) if s.name == plan.stage)
    for rank in measured:
        got = rank[(name, stage.name)]
        assert got["params"] == plan.params_bytes and got["grads"] == plan.grads_bytes, (got, plan.params_bytes)
        per_micro_batch = plan.activations_bytes / stage.in_flight
        assert abs(per_micro_batch - got["saved"]) <= 0.10 * got["saved"], (per_micro_batch, got["saved"])


def test_dense_stage_bytes_equal_its_counter(measured):
    """The dense rows under pp (tsp_counter_bytes per stage): each stage's position_ids gather instead of an input
    check, the q/k norms' and the last stage's loss denominator all-reduces."""
    inp = PlanInput(model=_shape("qwen3_dense"), seq=SEQ, batch=BATCH, degree=2, dtype="fp32", pp=PP)
    for stage in stages(inp):
        assert all(rank[("qwen3_dense", stage.name)]["tsp"] == tsp_counter_bytes(inp, stage, rank=r % 2)
                   for r, rank in enumerate(measured)), (stage.name, measured[1][("qwen3_dense", stage.name)]["tsp"])
    with pytest.raises(PlanInputError, match="per stage"):
        tsp_counter_bytes(inp)

@pytest.mark.parametrize("checkpointing", [False, True])
def test_cp_stage_bytes_equal_both_counters(measured, checkpointing):
    """plan_tsp_cp under pp: the reported stage's cp communicator bytes are its rows (Gated DeltaNet gathers, the
    full-attention layers' K/V ring, the stage's position_ids over cp, under checkpointing once more per layer)
    exactly; its TSP bytes hybrid_counter_bytes at the group's tokens plus the cp pieces reassembled over TSP. The
    other stage: the same per-layer rows times its own layers."""
    inp = _input("qwen3_5_cp", activation_checkpointing=checkpointing)
    plan = plan_tsp_cp(inp, 2)
    assert plan.layout == "tsp_cp" and plan.stage in ("first", "last")
    group = group_input(inp, 2)
    types = inp.model.layer_types
    cp_rows = [(t, 1) for t in plan.layer_fwd_terms + plan.layer_bwd_terms] + [(t, 1) for t in plan.step_terms]
    cp_kinds: dict = {}
    for t, _ in cp_rows:
        if t.kind == "cp_ring" or "over cp" in t.name:
            cp_kinds[t.kind] = cp_kinds.get(t.kind, 0) + t.bytes
    assert plan.cp["inter_node_bytes_per_step"] == sum(cp_kinds.values())
    # per layer of each kind, from the plan's rows: the Gated DeltaNet's are the layer terms, the full-attention
    # layers' the step terms "full-attention layers xN: ..." (N on the reported stage)
    reported = next(s for s in stages(group) if s.name == plan.stage)
    n_full = [types[i] for i in stage_layer_ids(group, reported)].count("full_attention")
    gdn = {k: sum(t.bytes for t in plan.layer_fwd_terms + plan.layer_bwd_terms if t.kind == k and "over cp" in t.name)
           for k in ("all_gather", "reduce_scatter")}
    full_cp = sum(t.bytes for t in plan.step_terms if t.name.startswith("full-attention") and t.kind == "cp_ring")
    # (the step terms also hold the full-attention layer's own TSP rows: "full-attention layers x1: K/V ...")
    full_intra = {k: sum(t.bytes for t in plan.step_terms if t.name.startswith("full-attention") and t.kind == k
                         and "cp block" in t.name) for k in ("all_gather", "reduce_scatter")}
    gdn_intra = {k: sum(t.bytes for t in plan.step_terms if t.name.startswith("Gated DeltaNet") and t.kind == k
                        and "other cp groups" in t.name) for k in ("all_gather", "reduce_scatter")}
    n_gdn = [types[i] for i in stage_layer_ids(group, reported)].count("linear_attention")
    positions = sum(t.bytes for t in plan.step_terms if t.name.startswith("position_ids all-gather over cp"))
    again = sum(t.bytes for t in plan.step_terms if t.name.startswith("recompute: position_ids re-gather over cp"))
    assert positions > 0 and n_full and n_gdn and (again > 0) == checkpointing
    for stage in stages(group):
        kinds = [types[i] for i in stage_layer_ids(group, stage)]
        f, n = kinds.count("full_attention"), kinds.count("linear_attention")
        cp = {"ring": f * full_cp // n_full,
              "all_gather": n * gdn["all_gather"] + positions + (f + n) * again // (n_full + n_gdn),
              "reduce_scatter": n * gdn["reduce_scatter"]}
        tsp = hybrid_counter_bytes(group, stage)
        for k in ("all_gather", "reduce_scatter"):
            tsp[k] += f * full_intra[k] // n_full + n * gdn_intra[k] // n_gdn
        if stage.name == plan.stage:
            assert cp == {"ring": cp_kinds["cp_ring"], "all_gather": cp_kinds["all_gather"],
                          "reduce_scatter": cp_kinds["reduce_scatter"]}
            assert plan.cp["intra_node_cp_bytes_by_kind"] == {
                k: f * full_intra[k] // n_full + n * gdn_intra[k] // n_gdn for k in ("all_gather", "reduce_scatter")}
        for rank in measured:
            got = rank[("qwen3_5_cp", "checkpointing", stage.name) if checkpointing else ("qwen3_5_cp", stage.name)]
            assert got["cp"] == cp, (stage.name, got["cp"], cp)
            assert got["tsp"] == tsp, (stage.name, got["tsp"], tsp)


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds-tsp")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_cli_plans_hybrid_pipeline_stages_and_refuses_what_the_runtime_refuses(tmp_path, capsys):
    (tmp_path / "config.json").write_text(hybrid_config("qwen3_5", layer_types=LAYERS * 2,
                                                        num_hidden_layers=6).to_json_string())
    one = {}
    for pp in (1, 2, 3):
        assert _run_cli(["plan", "--hf-config", str(tmp_path), "--seq", "4k", "--tsp", "2", "--pp", str(pp),
                         "--json"]) == 0
        one[pp] = json.loads(capsys.readouterr().out.splitlines()[0])
    assert one[2]["layers_per_stage"] == 3 and one[3]["layers_per_stage"] == 2
    assert one[2]["params_bytes"] < one[1]["params_bytes"] and one[3]["params_bytes"] < one[2]["params_bytes"]
    names = [t["name"] for t in one[2]["step_terms"]]
    assert any(n.startswith("position_ids all-gather over TSP") for n in names)
    assert not any(n.startswith("input check") for n in names)
    assert _run_cli(["plan", "--hf-config", str(tmp_path), "--seq", "64k", "--tsp", "2", "--cp", "2", "--pp", "2",
                     "--json"]) == 0
    cp = json.loads(capsys.readouterr().out.splitlines()[0])
    assert cp["layout"] == "tsp_cp" and cp["layers_per_stage"] == 3 and cp["cp"]["inter_node_bytes_per_step"] > 0
    # refused with pipeline stages as the runtime refuses them (ds_tsp.integrations.deepspeed.pipeline)
    tied = ModelShape.from_hf_config(hybrid_config("qwen3_5", tie_word_embeddings=True).to_dict())
    with pytest.raises(PlanInputError, match="tie_word_embeddings"):
        plan_tsp(PlanInput(model=tied, seq=4096, degree=2, pp=2))
    aux = ModelShape.from_hf_config(hybrid_config("qwen3_next_moe", layer_types=LAYERS,
                                                  num_hidden_layers=3).to_dict())
    with pytest.raises(PlanInputError, match="output_router_logits"):
        plan_tsp(PlanInput(model=aux, seq=4096, degree=2, pp=2))
    with pytest.raises(PlanInputError, match="per stage"):
        hybrid_counter_bytes(_input("qwen3_5"))


def test_cp_all_to_all_stage_bytes_equal_the_cp_counter(measured):
    """plan_tsp_cp_all_to_all under pp: the reported stage's cp communicator bytes are its rows exactly (the
    full-attention layers' all-to-alls, the Gated DeltaNet gathers, the stage's position_ids over cp)."""
    inp = _input("qwen3_5_cp")
    plan = plan_tsp_cp_all_to_all(inp, 2)
    assert plan.cp["cp_comm"] == "all_to_all"
    rows: dict = {}
    for t in plan.layer_fwd_terms + plan.layer_bwd_terms + plan.step_terms:
        if t.kind == "cp_all_to_all" or "over cp" in t.name:
            kind = "all_to_all" if t.kind == "cp_all_to_all" else t.kind
            rows[kind] = rows.get(kind, 0) + t.bytes
    assert sum(rows.values()) == plan.cp["inter_node_bytes_per_step"] and set(rows) == {
        "all_to_all", "all_gather", "reduce_scatter"}
    for rank in measured:
        assert rank[("qwen3_5_cp", "all_to_all", plan.stage)]["cp"] == rows, (rank[("qwen3_5_cp", "all_to_all",
                                                                               plan.stage)]["cp"], rows)


def test_cp_windowed_stage_bytes_equal_the_cp_counter_on_every_rank(measured):
    """A sliding-window model under pp x cp: the windowed layers send only the keys their windows reach, so each
    rank's cp bytes differ; plan_tsp_cp's inter_node_bytes_per_rank (the reported stage's layers, cp-major) equals
    every rank's cp counter. Both stages hold one windowed and one full layer, so both match the reported one."""
    inp = PlanInput(model=_shape("windowed_cp"), seq=SEQ, batch=BATCH, degree=2, dtype="fp32", pp=PP)
    plan = plan_tsp_cp(inp, 2)
    assert plan.cp["windowed_layers"] == 1 and plan.layers_per_stage == 2
    per_rank = plan.cp["inter_node_bytes_per_rank"]
    assert len(set(per_rank)) > 1  # the windows' hops differ between cp ranks
    for rank in measured:
        for stage in ("first", "last"):
            got = rank[("windowed_cp", stage)]
            i, p = got["ranks"]
            assert sum(got["cp"].values()) == per_rank[i * 2 + p], (stage, got["ranks"], got["cp"], per_rank)
