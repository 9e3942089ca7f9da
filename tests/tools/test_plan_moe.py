"""`ds-tsp plan` on mixture-of-experts shapes: per-rank params / grads equal a real TSP MoE model's (D = 1, 2, 4),
the comm formula equals CommCounter per kind for both schedules (EXACT: top_k = num_experts sends every token to every
expert, so the all_to_all rows equal the plan's even-routing count), saved activations against saved-tensor hooks
(within 10%, as tests/tools/test_plan.py: the ring's row order lives on its ctx, not in saved_tensors), the CLI flags
and --hf-config on config.json files written by transformers. GLM-4.5's sparse layers (grouped sigmoid routing, the
ungated shared expert's ring and shard, q/k/v bias, partial rotary, a dense first layer) are planned the same way."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from local_ranks import run_on_local_ranks

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.layers.moe.cost import choose_moe_dispatch, moe_bytes_per_layer
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.tools.cli import build_parser
from ds_tsp.tools.plan import PlanInput, PlanInputError, plan_tsp, tsp_counter_bytes

SCHEDULES = ("ring", "all_to_all")
# Qwen3-MoE-like (q/k norms), layer 1 dense (mixed sparse / dense stack), vocab 99 and seq 30 padded.
SHAPE = ModelShape(vocab_size=99, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=4,
                   qk_norm=True, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=24,
                   norm_topk_prob=True, dense_mlp_layers=(1,))
# GLM-4.5-like: every expert chosen (top_k = E, both groups kept) for exact all_to_all rows, a shared expert
GLM = ModelShape(vocab_size=99, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=4,
                 qk_norm=True, qkv_bias=True, partial_rotary_factor=0.5, num_experts=4, num_experts_per_tok=4,
                 moe_intermediate_size=24, norm_topk_prob=True, dense_mlp_layers=(0,),
                 shared_expert_intermediate_size=24, shared_expert_gate=False, moe_routing="sigmoid_grouped",
                 moe_groups=2, moe_topk_groups=2, routed_scaling_factor=2.5)
# GPT-OSS-like: attention sinks in the packed attention shards, the o_proj bias and the routers' biases replicated
# (in the bucket), expert biases riding the ring, top-k-then-softmax routing saving less, a sliding layer
GPT_OSS = ModelShape(vocab_size=99, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                     qkv_bias=True, attention_out_bias=True, attention_sinks=True, attention_windows=(5, None),
                     num_experts=4, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True,
                     moe_biases=True, expert_activation="clamped_swiglu", moe_routing="topk_softmax")
SHAPES = {"qwen3_moe": SHAPE, "gpt_oss": GPT_OSS, "glm": GLM}
SEQ, BATCH = 30, 2
CASES = {f"{s}{'_ac' if ac else ''}": (s, ac, "qwen3_moe") for s in SCHEDULES for ac in (False, True)}
CASES.update({f"gpt_oss_{s}": (s, False, "gpt_oss") for s in SCHEDULES})
CASES.update({f"glm_{s}": (s, False, "glm") for s in SCHEDULES})
UNCHECKPOINTED = [n for n, (_, ac, _) in CASES.items() if not ac]  # the cases D=1 and D=4 run


def _measure(names: list[str]) -> dict:
    """On every rank, per case: counter bytes per kind, saved-for-backward bytes, params and grads bytes."""
    out = {}
    for name in names:
        schedule, ac, shape = CASES[name]
        comm = TSPComm(dist.group.WORLD)
        model = ShardedCausalLM(SHAPES[shape], comm,
                                options=TSPOptions(moe_dispatch=schedule, activation_checkpointing=ac))
        model.init_weights_(0, std=0.2)
        ids = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        b = shard_batch(ids, tsp=comm.size, rank=comm.rank)
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = max(saved.get(t.untyped_storage().data_ptr(), 0),
                                                        t.untyped_storage().nbytes())
            return t

        comm.counter.reset()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(b["input_ids"], b["shift_labels"], b["position_ids"])
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        loss.backward()
        out[name] = {"bytes": dict(comm.counter.bytes), "saved": sum(v for k, v in saved.items() if k not in own),
                     "params": sum(p.numel() * p.element_size() for p in model.parameters()),
                     "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())}
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    return {world: run_on_local_ranks(_measure, world, list(CASES) if world == 2 else UNCHECKPOINTED,
                                      timeout_s=240) for world in (1, 2, 4)}


def _input(name: str, world: int) -> PlanInput:
    schedule, ac, shape = CASES[name]
    return PlanInput(model=SHAPES[shape], seq=SEQ, batch=BATCH, degree=world, dtype="fp32", moe_dispatch=schedule,
                     activation_checkpointing=ac)


@pytest.mark.parametrize("world", (1, 2, 4))
def test_params_and_grads_equal_the_model_per_rank(measured, world):
    for per_rank in measured[world]:
        for name, m in per_rank.items():
            plan = plan_tsp(_input(name, world))
            assert m["params"] == plan.params_bytes and m["grads"] == plan.grads_bytes, (name, m, plan.params_bytes)
    # what TSP's MoE is for: 1/D of the experts and attention per rank, router and norms replicated
    h, e, f = SHAPE.hidden_size, SHAPE.num_experts, SHAPE.moe_intermediate_size
    experts = 2 * e * 3 * f * h * 4  # two sparse layers, fp32
    one = plan_tsp(_input("ring", 1)).params_bytes
    if world > 1:
        assert one - plan_tsp(_input("ring", world)).params_bytes >= experts * (world - 1) // world


@pytest.mark.parametrize("world,name", [(2, n) for n in CASES] + [(4, n) for n in UNCHECKPOINTED])
def test_comm_formula_equals_counters_for_both_schedules(measured, world, name):
    inp = _input(name, world)
    predicted = tsp_counter_bytes(inp)
    for rank, per_rank in enumerate(measured[world]):  # the later ranks move less of the causal K/V (at_rank)
        want = tsp_counter_bytes(inp, rank=rank)
        assert per_rank[name]["bytes"] == want, (rank, per_rank[name]["bytes"], want)
    plan = plan_tsp(inp)
    assert plan.comm_bytes_per_step == sum(predicted.values())
    # bytes per sparse layer: moe_bytes_per_layer's, the planned schedule's inside the layer terms
    L = -(-SEQ // (2 * world)) * 2
    cost = moe_bytes_per_layer(BATCH * L, 32, 24, 4, 4, world, 4, biases=CASES[name][2] == "gpt_oss")
    assert plan.moe["bytes_per_layer"] == cost and plan.moe["schedule"] == CASES[name][0]
    moe_terms = [t for t in (*plan.layer_fwd_terms, *plan.layer_bwd_terms)
                 if t.name.startswith(("MoE", "recompute: MoE"))]
    recomputed = sum(t.bytes for t in moe_terms if t.name.startswith("recompute"))
    assert sum(t.bytes for t in moe_terms) - recomputed == cost[CASES[name][0]]


@pytest.mark.parametrize("world,name", [(w, n) for w in (2, 4) for n in UNCHECKPOINTED])
def test_activation_bytes_match_saved_tensors(measured, world, name):
    plan = plan_tsp(_input(name, world))
    saved = max(per_rank[name]["saved"] for per_rank in measured[world])
    assert abs(saved - plan.activations_bytes) <= 0.10 * saved, (saved, plan.activations_bytes)


def test_auto_is_choose_moe_dispatch_and_both_peaks_reported():
    for seq, want in ((1024, "all_to_all"), (65536, "ring")):
        shape = ModelShape(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                           num_kv_heads=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
        plan = plan_tsp(PlanInput(model=shape, seq=seq, degree=2, dtype="bf16"))
        assert plan.moe["auto"] == plan.moe["schedule"] == want
        assert want == choose_moe_dispatch("auto", seq // 2, 256, 256, 8, 2, 2, 2)
        assert set(plan.moe["peak_bytes"]) == set(SCHEDULES)
        assert plan.peak_bytes_per_rank == plan.moe["peak_bytes"][want]


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(["plan", *argv])  # the real ds-tsp parser: its one-line errors
    return args.run(args)


def _tiny_hf_config(tmp_path, family: str) -> str:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          decoder_sparse_step=2, norm_topk_prob=True)
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    cfg.save_pretrained(tmp_path / family)
    return str(tmp_path / family / "config.json")


@pytest.mark.parametrize("family,experts,top_k,ffn,sparse", [("qwen3_moe", 8, 2, 32, 2), ("mixtral", 4, 2, 96, 4)])
def test_cli_reads_an_moe_config_written_by_transformers(tmp_path, capsys, family, experts, top_k, ffn, sparse):
    path = _tiny_hf_config(tmp_path, family)
    assert _run(["--hf-config", path, "--seq", "4k", "--tsp", "2", "--json"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()  # MoE: tsp only by default
    out = json.loads(line)
    model = out["input"]["model"]
    assert (model["num_experts"], model["num_experts_per_tok"], model["moe_intermediate_size"]) == (experts, top_k, ffn)
    assert out["layout"] == "tsp" and out["moe"]["auto"] in SCHEDULES
    assert out["moe"]["bytes_per_layer"] == moe_bytes_per_layer(2048, 64, ffn, experts, top_k, 2, 2)
    assert any(f"{sparse} of 4 layers sparse" in note for note in out["notes"])
    assert _run(["--hf-config", path, "--seq", "4k", "--tsp", "2", "--moe-dispatch", "ring"]) == 0
    text = capsys.readouterr().out
    assert "MoE ring: bytes / sparse layer MiB" in text and "MoE auto -> / planned" in text


def test_cli_moe_flags_on_a_preset(capsys):
    assert _run(["--model", "7b", "--layers", "4", "--num-experts", "8", "--top-k", "2", "--moe-ffn", "2048",
                 "--seq", "8k", "--tsp", "8", "--moe-dispatch", "all_to_all", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["input"]["moe_dispatch"] == "all_to_all" and out["moe"]["schedule"] == "all_to_all"
    assert out["moe"]["experts_per_rank"] == 1 and out["moe"]["expert_params_per_layer"] == 3 * 2048 * 4096


@pytest.mark.parametrize("argv,flag", [
    (["--num-experts", "6", "--tsp", "4"], "--tsp"),  # experts do not split over D
    (["--top-k", "2"], "--top-k"),  # no experts
    (["--moe-load", "2"], "--moe-load"),  # no experts: nothing it could plan
    (["--num-experts", "8", "--top-k", "9"], "--top-k"),
    (["--num-experts", "8", "--layout", "tsp,ulysses"], "--layout"),  # peers refuse MoE shapes
])
def test_cli_bad_moe_flags_exit_2_naming_them(capsys, argv, flag):
    assert _run(["--model", "7b", "--seq", "4k", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds-tsp plan: error: {flag}") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,flag", [(["--moe-ffn", "x"], "--moe-ffn"), (["--num-experts", "-1"], "--num-experts"),
                                       (["--moe-load", "0.5"], "--moe-load")])
def test_cli_malformed_moe_number_is_one_line_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        _run(["--model", "7b", "--seq", "4k", "--num-experts", "8", *argv])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert any(f"error: argument {flag}: {m} (see" in line for m in (
        "'x' is not an integer; write e.g. 4096, 128k or 1m", "-1 must be >= 0", "0.5 must be >= 1.0")), line


def test_foreign_moe_config_refused(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
                                "n_routed_experts": 8}))
    assert _run(["--hf-config", str(path)]) == 2
    assert "n_routed_experts=8" in capsys.readouterr().err


def test_ring_rows_per_step_are_the_owners_rows():
    """The ring's row work per step (ds_tsp.core.layers.moe.ring): both GEMM paths slice exactly the owner's rows
    (host bounds, one read per layer forward), planned at the balanced R/D = T x top_k / D; no static window in the
    bf16 (grouped) plan's rows or transients. The host reads: 1 per sparse layer forward, 2 with activation
    checkpointing (the recompute reads again), either schedule; the note says so."""
    for experts, top_k in ((16, 2), (8, 4)):  # E_r = 8 >= k; E_r = 4 = k
        shape = ModelShape(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                           num_kv_heads=8, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=128)
        plans = {dt: plan_tsp(PlanInput(model=shape, seq=8192, degree=2, dtype=dt, moe_dispatch="ring"))
                 for dt in ("bf16", "fp32")}
        T = 8192 // 2
        for dt, plan in plans.items():
            b = {"bf16": 2, "fp32": 4}[dt]
            assert plan.moe["ring_rows_per_step"] == T * top_k // 2, (dt, plan.moe)  # R / D, not a window of R
            assert plan.moe["ring_row_bytes_per_step"] == T * top_k // 2 * (2 * (3 * 256 + 3 * 128) * b + 16)
            assert plan.moe["host_reads_per_layer"] == 1
            assert any(f"ring rows per step {T * top_k // 2} of {T * top_k}" in note and
                       "host reads: 1 per sparse layer forward" in note for note in plan.notes), plan.notes
    for schedule in ("ring", "all_to_all"):
        plan = plan_tsp(PlanInput(model=shape, seq=8192, degree=2, dtype="bf16", moe_dispatch=schedule,
                                  activation_checkpointing=True))
        assert plan.moe["host_reads_per_layer"] == 2
        assert any("host reads: 1 + 1 recompute per sparse layer forward" in note for note in plan.notes), plan.notes


def test_moe_load_scales_the_busiest_expert_and_its_owner_up_to_their_caps():
    """--moe-load L: the busiest expert at L x its even share R/E (the loop path's GEMM block, at most T rows), its
    owner at (L + E_r - 1) / E_r x R/D rows per ring step (at most T min(top_k, E_r)) and as many times R rows
    delivered by all_to_all; bytes stay at even routing; L < 1 is refused naming the field."""
    shape = ModelShape(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                       num_kv_heads=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    T, R = 8192 // 2, 8192 // 2 * 2

    def plan(load, schedule="ring"):
        return plan_tsp(PlanInput(model=shape, seq=8192, degree=2, dtype="fp32", moe_dispatch=schedule,
                                  moe_load=load))

    even, skewed, capped = plan(1), plan(3), plan(100)
    assert even.moe["ring_rows_per_step"] == R // 2
    assert skewed.moe["ring_rows_per_step"] == (3 + 4 - 1) * R // 2 // 4  # E_r = 4: 1.5 x R/D
    assert capped.moe["ring_rows_per_step"] == T * 2  # every row of every token meets the one owner
    assert even.moe["bytes_per_layer"] == skewed.moe["bytes_per_layer"]
    assert even.transients["mlp_bwd"] < skewed.transients["mlp_bwd"] < capped.transients["mlp_bwd"]
    assert plan(1, "all_to_all").transients["mlp_bwd"] < plan(3, "all_to_all").transients["mlp_bwd"]
    assert any("R/D x 1.5, the busiest expert at --moe-load 3 x its share" in n for n in skewed.notes), skewed.notes
    with pytest.raises(PlanInputError, match="moe_load"):
        PlanInput(model=shape, seq=8192, degree=2, moe_load=0.9)


def _peaks_and_busiest_expert(cases):
    """Per case: this rank's MemTracker peak of one bench step and the largest per-expert row count this rank routed
    in that step (the ring reads the counts once per layer forward: _StepRows)."""
    from ds_tsp.core.layers.moe import ring
    from ds_tsp.tools.bench import tsp
    from ds_tsp.tools.bench.config import BenchConfig
    from ds_tsp.tools.bench.measure import tracked_step

    counts = []
    original = ring._StepRows.__init__

    def recording(self, plan, experts_per_rank, path):
        original(self, plan, experts_per_rank, path)
        counts.append(max(plan.counts.tolist()))

    ring._StepRows.__init__ = recording
    out = []
    for shape, seq, schedule in cases:
        cfg = BenchConfig(layout="tsp", seqs=(seq,), tsp=dist.get_world_size(), shape=shape, moe_dispatch=schedule)
        workload = tsp.build(cfg, {"mode": "memory"}).workload(seq)
        workload.step()
        counts.clear()
        out.append((tracked_step(workload)["peak_bytes"], max(counts, default=0)))
    return out


def test_plan_at_the_measured_routing_load_covers_the_measured_peak():
    """At random init the routing is skewed (here one expert meets ~3.8x its share and its owner ~1.7x): the
    even-routing plan is short of MemTracker's peak. Planned at the measured busiest-expert load (--moe-load) the
    ring is within -3% / +8% of it, the all_to_all over it by at most 25% (the owner's other experts planned at their
    even share)."""
    shape = ModelShape(vocab_size=512, num_layers=2, hidden_size=256, intermediate_size=704, num_heads=4,
                       num_kv_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
    seq = 2048
    cases = [(shape, seq, "ring"), (shape, seq, "all_to_all")]
    ranks = run_on_local_ranks(_peaks_and_busiest_expert, 2, cases, timeout_s=300)
    even_share = seq // 2 * 2 / 8  # T x top_k / E rows per expert
    load = max(busiest for rank in ranks for _, busiest in rank[:1]) / even_share  # the ring's step counted them
    assert load > 2, load
    for i, (_, _, schedule) in enumerate(cases):
        measured = max(rank[i][0] for rank in ranks)
        at_even, at_load = (plan_tsp(PlanInput(model=shape, seq=seq, degree=2, dtype="fp32", moe_dispatch=schedule,
                                               moe_load=value)).peak_bytes_per_rank for value in (1, load))
        assert at_even < 0.97 * measured, (schedule, at_even, measured)
        top = 1.08 if schedule == "ring" else 1.25
        assert 0.97 * measured <= at_load <= top * measured, (schedule, at_load, measured, load)
