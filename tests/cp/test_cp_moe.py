"""Mixture-of-experts layers under the cp axis: exact against transformers' own models in float64.

One spawn of 4 gloo ranks at (D, C) = (2, 2) (tsp innermost: TSP groups {0, 1}, {2, 3}; cp rings {0, 2}, {1, 3}).
The tiny Qwen3-MoE of tests/helpers/hf_tiny.py (layer 0 dense through mlp_only_layers, layer 1 sparse: 8 experts, top-2,
4 per rank, output_router_logits with router_aux_loss_coef 0.05) and its Mixtral (4 experts, top-2, renormalised;
sliding_window None here, windows under cp are tests/cp/test_cp_window.py's) are loaded by slices as
ds_tsp.hf.TSPForCausalLM on the cp runtime and called as transformers' model on the FULL batch (it shards over cp
then TSP itself), on
- a right-padded batch (attention_mask; S=29, so zigzag padding to 32 too), and
- a packed batch (position_ids restarting per document, documents spanning the cp chunks; S=30),
with both moe_dispatch schedules. Gradients are averaged over the data group (data x cp), as the data-parallel engine
does. Loss, aux loss and EVERY gradient agree with transformers to 1e-10 norm-wise relative (measured ~1e-15);
transformers' aux loss accumulates in float32, so the reference takes its formula in float64
(ds_tsp.tools.hf_reference.load_balancing_loss), as tests/moe/test_hf_moe.py does. The router logits returned with
output_router_logits=True (gathered over TSP and cp) equal transformers' to 1e-12. GPT-OSS runs too, with its
sliding window (attention sinks on both cp attention paths).

The same rank spawn records one training step of the ShardedCausalLM (forward, backward) and replays it under
NCCL's queueing rules (tests/helpers/nccl_rules.py): the aux loss's counts all-reduced over the TSP group, then the cp group,
in the same order on every rank; host reads: the input check's one, plus one per sparse layer forward (the MoE
layer's row counts, as under TSP alone; tests/reliability/test_host_syncs.py), none in backward.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import packed_batch, save_tiny_checkpoint, shift, tiny_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

D, C = 2, 2
TOL = 1e-10
DISPATCHES = ("ring", "all_to_all")
# tests/helpers/hf_tiny.py's MoE families; Mixtral without its sliding window (windows under cp:
# tests/cp/test_cp_window.py); GPT-OSS with its own (window 5 < a cp chunk of 8: its sliding layer takes cp_window,
# its full layer the cp ring, the attention sinks applied after either's merge)
FAMILIES = {"qwen3_moe": {}, "mixtral": {"sliding_window": None}, "gpt_oss": {}}
PACKED_DOCUMENTS = [[7, 12, 11], [16, 14]]  # cp chunks of the padded 32: [0, 8) [8, 16) [16, 24) [24, 32)
RECORDED = {"qwen3_moe": 1, "gpt_oss": 2}  # families whose step is recorded: their sparse layers


def padded_batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 29), generator=g)
    mask = torch.ones(2, 29, dtype=torch.long)
    mask[1, -6:] = 0  # right padding on row 1
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def batches(vocab: int) -> dict[str, dict]:
    packed = packed_batch(vocab, PACKED_DOCUMENTS, seed=5)
    return {"padded": padded_batch(vocab),
            "packed": {k: packed[k] for k in ("input_ids", "labels", "position_ids")}}


def _runs(directories: dict[str, str]) -> dict:
    import torch.distributed as dist

    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.tools.verify import average_grads_over_data, run_cp_case

    out, runtimes = {"rank": dist.get_rank()}, {}
    for family, directory in directories.items():
        vocab = json.loads(open(f"{directory}/config.json").read())["vocab_size"]
        for dispatch in DISPATCHES:
            runtime = runtimes[family, dispatch] = build_runtime(
                parse_tsp_config({"size": D, "cp_size": C, "moe_dispatch": dispatch}))
            model = TSPForCausalLM.from_pretrained(directory, runtime.comm, dtype=torch.float64,
                                                   options=runtime.options, data_group=runtime.data_group)
            for name, batch in batches(vocab).items():
                model.zero_grad(set_to_none=True)
                # padded: router logits returned too (True); packed: the config's output_router_logits (aux only)
                result = model(**batch, output_router_logits=True if name == "padded" else None)
                result.loss.backward()
                average_grads_over_data(model.tsp, runtime.data_group)
                grads = model.tsp.full_state_dict(grads=True)
                out[(family, dispatch, name)] = {
                    "loss": float(result.loss.detach()), "aux_loss": float(result.aux_loss.detach()),
                    "grads": grads if dist.get_rank() == 0 else None,
                    "router_logits": [t.clone() for t in result.router_logits] if result.router_logits else None}
    out["recorded"] = {}
    for family in RECORDED:  # GPT-OSS: sinks on both cp attention paths, biased experts
        vocab = json.loads(open(f"{directories[family]}/config.json").read())["vocab_size"]
        out["recorded"].update({(family, dispatch): _recorded_step(directories[family], runtimes[family, dispatch],
                                                                   vocab) for dispatch in DISPATCHES})
    directory = directories["qwen3_moe"]
    out["verify"] = run_cp_case(verify_case(directory), D, C)  # what ds-tsp verify --hf-model DIR --cp 2 runs
    out["measured"] = {dispatch: _measure_for_plan(dispatch) for dispatch in DISPATCHES}
    # tsp.cp_comm "all_to_all" on GPT-OSS: experts, attention sinks, a sliding and a full layer, heads over cp
    out["verify_all_to_all"] = run_cp_case(verify_case(directories["gpt_oss"]), D, C, {"cp_comm": "all_to_all"})
    return out


# Qwen3-MoE-like, as the checkpoint (layer 0 dense), with output_router_logits: the aux counts' cp all-reduce runs.
# top_k = E (as tests/tools/test_plan_moe.py): every token meets every expert, so all_to_all's rows are the plan's exactly
# (the plan assumes even routing)
PLAN_SHAPE = dict(vocab_size=91, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, qk_norm=True, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=12,
                  dense_mlp_layers=(0,), output_router_logits=True, router_aux_loss_coef=0.05)
PLAN_SEQ, PLAN_BATCH = 30, 2


def _measure_for_plan(dispatch: str) -> dict:
    """One fp32 ShardedCausalLM step at (D, C) = (2, 2): both communicators' counter bytes, params and grads."""
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    runtime = build_runtime(parse_tsp_config({"size": D, "cp_size": C, "moe_dispatch": dispatch}))
    comm, groups = runtime.comm, runtime.groups
    model = ShardedCausalLM(ModelShape(**PLAN_SHAPE), comm, options=runtime.options, data_group=runtime.data_group)
    model.init_weights_(0, std=0.2)
    ids = torch.randint(0, PLAN_SHAPE["vocab_size"], (PLAN_BATCH, PLAN_SEQ), generator=torch.Generator().manual_seed(0))
    b = shard_batch(ids, tsp=D, rank=groups.tsp_rank, cp=C, cp_rank=groups.cp_rank)
    comm.counter.reset()
    comm.cp.counter.reset()
    model(b["input_ids"], b["shift_labels"], b["position_ids"], seq_len=b["seq_len"]).backward()
    return {"tsp": dict(comm.counter.bytes), "cp": dict(comm.cp.counter.bytes),
            "params": sum(p.numel() * p.element_size() for p in model.parameters()),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())}


def verify_case(directory: str):
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.verify import VerifyCase

    shape = ModelShape.from_hf_config(json.loads(open(f"{directory}/config.json").read()))
    return VerifyCase(shape=shape, seq=30, batch=2, dtype="float64", seed=4, documents=3, hf_model=directory)


def _recorded_step(directory: str, runtime, vocab: int) -> dict:
    """One ShardedCausalLM step (the packed batch) recorded for the NCCL-rules replay and counted for host reads."""
    from sync_counter import SyncCounter

    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.hf import TSPForCausalLM

    comm, groups = runtime.comm, runtime.groups
    model = label_modules(TSPForCausalLM.from_pretrained(directory, comm, dtype=torch.float64,
                                                         options=runtime.options,
                                                         data_group=runtime.data_group).tsp)
    batch = batches(vocab)["packed"]
    local = shard_batch(batch["input_ids"], tsp=D, rank=groups.tsp_rank, cp=C, cp_rank=groups.cp_rank,
                        labels=batch["labels"], position_ids=batch["position_ids"])
    with comm.recording() as rec:
        with SyncCounter() as forward:
            loss = model(local["input_ids"], local["shift_labels"], local["position_ids"], seq_len=local["seq_len"])
        with SyncCounter() as backward:
            loss.backward()
    return {"ops": rec.ops, "syncs": {phase: [(e.kind, e.op, e.region, e.where) for e in counter.events]
                                      for phase, counter in (("forward", forward), ("backward", backward))}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_moe")
    directories = {family: str(save_tiny_checkpoint(root / family, tiny_config(family, **overrides)))
                   for family, overrides in FAMILIES.items()}
    return directories, run_on_local_ranks(_runs, D * C, directories, timeout_s=300)


def _reference(directory: str, name: str):
    from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference

    model = load_hf_reference(directory, torch.float64)
    batch = batches(model.config.vocab_size)[name]
    aux = {}
    if name == "padded":
        mask = batch["attention_mask"]
        real = mask.bool()  # no target for a padded query nor a padded target (tests/moe/test_hf_moe.py)
        next_real = torch.cat((real[:, 1:], torch.zeros_like(real[:, :1])), dim=1)
        targets = shift(batch["labels"]).masked_fill(~(real & next_real), -100)
        loss, grads = hf_loss_and_grads(model, batch["input_ids"], targets, attention_mask=mask, aux_out=aux)
        with torch.no_grad():
            aux["router_logits"] = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False,
                                         output_router_logits=True).router_logits
        aux["real_tokens"] = mask.reshape(-1).bool()
    else:
        loss, grads = hf_loss_and_grads(model, batch["input_ids"], shift(batch["labels"]),
                                        documents=PACKED_DOCUMENTS, aux_out=aux)
    return loss, aux, canonical_state_dict(grads, ModelShape.from_hf_config(model.config).moe_family)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["padded", "packed"])
def test_cp_moe_matches_transformers_fp64(runs, family, name):
    directories, results = runs
    ref_loss, aux, ref_grads = _reference(directories[family], name)
    assert float(aux["aux_loss"]) > 1.0  # E * sum f_e P_e >= 1: the aux term is there
    for dispatch in DISPATCHES:
        got = results[0][(family, dispatch, name)]
        assert set(got["grads"]) == set(ref_grads), (dispatch, name)
        errors = {n: _rel(got["grads"][n], g) for n, g in ref_grads.items()}
        worst = max(errors, key=errors.get)
        assert _rel(got["loss"], ref_loss) < TOL, (dispatch, name, got["loss"], float(ref_loss))
        assert _rel(got["aux_loss"], aux["aux_loss"]) < TOL, (dispatch, name, got["aux_loss"], float(aux["aux_loss"]))
        assert errors[worst] < TOL, (dispatch, name, worst, errors[worst])
        # Qwen3-MoE mlp.gate, Mixtral's router, GPT-OSS's mlp.router
        router = [n for n in ref_grads if n.endswith((".gate.weight", ".router.weight"))]
        assert router and all(float(ref_grads[n].norm()) > 0 for n in router)  # the routers' grads are compared
        for r in results:  # every rank reports the same loss and aux loss
            mine = r[(family, dispatch, name)]
            assert (mine["loss"], mine["aux_loss"]) == (got["loss"], got["aux_loss"])
        if name == "padded":  # output_router_logits=True: the whole batch's, in transformers' order
            want, real = aux["router_logits"], aux["real_tokens"]  # padded queries' hidden states are arbitrary
            for r in results:
                mine = r[(family, dispatch, name)]["router_logits"]
                sparse = {"qwen3_moe": 1, "mixtral": 2, "gpt_oss": 2}[family]
                assert len(mine) == len(want) == sparse, (dispatch, mine, want)
                for layer, (m, w) in enumerate(zip(mine, want)):  # one per sparse layer
                    assert m.shape == w.shape and _rel(m[real], w[real]) < 1e-12, (dispatch, layer)


def test_cp_moe_aux_statistics_cover_the_whole_sequence(runs):
    """Without the cp all-reduce each cp group would see only its half of the sequence: the aux loss differs from
    the half-sequence statistic, so the test above could fail if the counts were reduced over TSP alone."""
    from ds_tsp.tools.hf_reference import load_balancing_loss, load_hf_reference

    directories, results = runs
    model = load_hf_reference(directories["qwen3_moe"], torch.float64)
    batch = batches(model.config.vocab_size)["padded"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                       output_router_logits=True).router_logits
    from ds_tsp.core.tokens.zigzag import cp_zigzag_positions, padded_length

    S = batch["input_ids"].shape[1]
    padded = padded_length(S, 2 * D * C)
    group0 = torch.cat([cp_zigzag_positions(padded, D, p, C, 0) for p in range(D)])
    group0 = group0[group0 < S]
    rows = torch.arange(2)[:, None] * S + group0[None]
    half = load_balancing_loss(model, [logits[0][rows.reshape(-1)]], batch["attention_mask"][:, group0])
    full = load_balancing_loss(model, list(logits), batch["attention_mask"])
    assert _rel(half, full) > 1e-3
    assert _rel(results[0][("qwen3_moe", "ring", "padded")]["aux_loss"], full) < TOL


@pytest.mark.parametrize("family", RECORDED)
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_cp_moe_step_obeys_nccl_rules(runs, dispatch, family):
    from nccl_rules import check

    _, results = runs
    ops = [r["recorded"][family, dispatch]["ops"] for r in results]
    report = check(ops)
    assert report.ok and report.completed == report.total == sum(len(o) for o in ops), report
    assert {o["group"] for rank_ops in ops for o in rank_ops} == {(0, 1), (2, 3), (0, 2), (1, 3)}
    for rank_ops in ops:
        aux = [o["what"] for o in rank_ops if o["what"] and o["what"].startswith("moe aux loss counts")]
        assert aux == ["moe aux loss counts", "moe aux loss counts over cp"], aux
        assert any(o["kind"] == "p2p" and "cp hop" in o["what"] for o in rank_ops)


@pytest.mark.parametrize("family", RECORDED)
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_cp_moe_step_host_reads(runs, dispatch, family):
    _, results = runs
    for r in results:
        syncs = r["recorded"][family, dispatch]["syncs"]
        forward, backward = syncs["forward"], syncs["backward"]
        assert [e[:2] for e in forward if e[2] == "input_checks"] == [("read", "tolist")], forward
        layers = [e for e in forward if e[2] != "input_checks"]  # per sparse layer: its row counts, once
        assert len(layers) == RECORDED[family], forward
        assert all(e[:3] == ("read", "tolist", "layers") and "core/layers/moe/" in e[3] for e in layers), forward
        assert backward == [], backward


def test_verify_hf_model_under_cp(runs):
    """ds-tsp verify --hf-model DIR --tsp 2 --cp 2 --dtype float64 --documents 3 (its run_cp_case, in this module's
    spawn): loss, aux loss and every gradient against transformers, within the float64 tolerance."""
    _, results = runs
    report = results[0]["verify"]
    assert all(r["verify"] is None for r in results[1:])  # the report is rank 0's
    assert (report["tsp"], report["cp"], report["reference"], report["ok"]) == (2, 2, "transformers", True), report
    assert report["aux_rel_err"] < TOL and report["aux_loss"] > 1.0, report
    assert report["loss_rel_err"] < TOL and report["grad_rel_err"] < TOL, report


@pytest.mark.slow
def test_verify_cli_hf_model_tsp2_cp2(tmp_path, capsys):
    from ds_tsp.tools.cli import main

    directory = str(save_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe"))
    assert main(["verify", "--hf-model", directory, "--tsp", "2", "--cp", "2", "--dtype", "float64", "--documents",
                 "3", "--seq", "30", "--timeout", "300"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["tsp"], report["cp"], report["ok"], report["reference"]) == (2, 2, True, "transformers"), report
    assert report["aux_rel_err"] < TOL, report


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_plan_cp_moe_equals_the_counters_of_a_real_step(runs, dispatch):
    """ds-tsp plan --cp 2 for the MoE shape: the TSP group's bytes are TSP's MoE plan at the group's tokens
    (tsp_counter_bytes: every kind, exactly) plus the cp blocks' reassembly over TSP, the cp communicator's whole
    counter is the plan's inter-node bytes:
    the attention ring's, the aux counts' all-reduce over cp and the input check's all-gather over cp (each kind
    exactly); params and grads per rank equal the model's."""
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.plan import PlanInput, tsp_counter_bytes
    from ds_tsp.tools.plan.tsp_cp import group_input, plan_tsp_cp

    _, results = runs
    inp = PlanInput(model=ModelShape(**PLAN_SHAPE), seq=PLAN_SEQ, batch=PLAN_BATCH, degree=D, dtype="fp32",
                    moe_dispatch=dispatch)
    plan = plan_tsp_cp(inp, C)
    assert plan.layout == "tsp_cp" and plan.moe["schedule"] == dispatch and plan.moe["experts_per_rank"] == 2
    aux, check = plan.cp["moe_aux_cp_bytes_per_step"], plan.cp["input_check_cp_bytes_per_step"]
    assert aux == 2 * 5 * 4 * (C - 1) // C  # (E + 1) fp32 counts, all-reduced over C
    assert check == (C - 1) * D * (7 + 1024) * 8  # the TSP group's int64 payloads from the other cp group
    ring = [t.bytes for t in plan.layer_fwd_terms + plan.layer_bwd_terms if t.kind == "cp_ring"]
    ring = sum(ring) * PLAN_SHAPE["num_layers"]
    assert plan.cp["inter_node_bytes_per_step"] == ring + aux + check
    assert plan.cp["inter_node_bytes_per_rank"] == [ring + aux + check] * (C * D)
    tsp = tsp_counter_bytes(group_input(inp, C))
    for kind, n in plan.cp["intra_node_cp_bytes_by_kind"].items():  # + the cp blocks' reassembly over TSP
        tsp[kind] = tsp.get(kind, 0) + n
    for r in results:
        measured = r["measured"][dispatch]
        assert measured["tsp"] == tsp, (r["rank"], measured["tsp"], tsp)
        assert measured["cp"] == {"ring": ring, "all_reduce": aux, "all_gather": check}, (r["rank"], measured["cp"])
        assert (measured["params"], measured["grads"]) == (plan.params_bytes, plan.grads_bytes), r["rank"]
    # the rest is the gradient sync over data x cp (C = 2 cp groups, data 1): 2 (C-1)/C x the gradient bytes
    assert plan.comm_bytes_per_step - plan.cp["inter_node_bytes_per_step"] - sum(tsp.values()) == \
        2 * (C - 1) * plan.grads_bytes // C


def test_plan_cli_cp_moe(tmp_path, capsys):
    from ds_tsp.tools.cli import main

    assert main(["plan", "--model", "8b", "--num-experts", "64", "--top-k", "4", "--moe-ffn", "1024", "--seq", "1m",
                 "--tsp", "8", "--cp", "4", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "C=4 (cp ring across nodes)" in out and "64 experts (8/rank) top-4" in out, out
    assert "MoE under cp" not in out  # flags make no router logits: no aux loss, nothing over cp
    tiny_config("qwen3_moe").to_json_file(tmp_path / "config.json")  # output_router_logits: the aux counts over cp
    assert main(["plan", "--hf-config", str(tmp_path / "config.json"), "--seq", "4k", "--tsp", "2", "--cp", "2",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"] == "tsp_cp" and plan["moe"]["experts_per_rank"] == 4, plan
    assert plan["cp"]["moe_aux_cp_bytes_per_step"] == 9 * 4 and any("MoE under cp" in n for n in plan["notes"])


# --- device-correct by construction: an MoE cp step on the meta device ------------------------------------------------
def run_meta_cp_moe() -> list[str]:
    """Rank 1 of a fake world of 4 ((D, C) = (2, 2)) runs the Qwen3-MoE through the HF face on `meta` (ring dispatch,
    bfloat16 grouped GEMMs: what needs no host read; right padding; the aux loss and its cp all-reduces): every
    tensor it creates stays there (tests/model/test_meta_device.py's recorder). Returns what it found off the device."""
    import torch.distributed as dist
    from hf_tiny import tiny_config
    from test_meta_device import META, DeviceRecorder, _meta_batch
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.hf import TSPForCausalLM

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=1, world_size=4)
    tsp_group, _, cp_group, _ = (dist.new_group(r) for r in ([0, 1], [2, 3], [1, 3], [0, 2]))
    comm = TSPComm(tsp_group, cp=TSPComm(cp_group))
    config = tiny_config("qwen3_moe", moe_intermediate_size=16)  # grouped GEMM: 16-byte aligned expert rows
    model = TSPForCausalLM(config, comm, dtype=torch.bfloat16, device=META, options=TSPOptions(moe_dispatch="ring"))
    with DeviceRecorder() as rec:
        out = model(**_meta_batch("padding"))
        assert out.aux_loss is not None and out.aux_loss.device == META
        out.loss.backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())
    return rec.found


def test_cp_moe_step_creates_nothing_off_device():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_cp_moe as t; found = t.run_meta_cp_moe(); "
            "print('\\n'.join(found)); print('done'); sys.exit(1 if found else 0)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]


def _router_softmax_in_float64(self, hidden_states):
    # Qwen3MoeTopKRouter.forward with the softmax in the logits' dtype (transformers': float32)
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True) if self.norm_topk_prob else top, idx


def test_router_grads_depend_on_the_loss_scale_only_through_float32(tmp_path, monkeypatch):
    """Why verify's reference takes the data group's loss scale (the odd-ring test below): transformers' own float64
    Qwen3-MoE, single device, the gradients of n x loss divided by n. n = 2: bitwise the same; n = 3: the router's
    grad moves by ~5e-9 relative (what (D, C) = (2, 3) or (1, 3) showed against the unscaled reference), and so do
    the grads upstream of it; with the router's softmax in float64 instead of float32 the same n = 3 agrees to 1e-13:
    the float32 softmax's rounding of n x its gradient is the whole difference, not the cp schedule."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference

    model = load_hf_reference(save_tiny_checkpoint(tmp_path / "qwen3_moe", tiny_config("qwen3_moe")), torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))

    def errors(scale: float) -> dict[str, float]:
        _, plain = hf_loss_and_grads(model, ids, shift(ids))
        _, scaled = hf_loss_and_grads(model, ids, shift(ids), loss_scale=scale)
        return {n: _rel(scaled[n], g) for n, g in plain.items()}

    assert max(errors(2.0).values()) == 0.0  # a power of two scales every rounding alike
    odd = errors(3.0)
    router = "model.layers.1.mlp.gate.weight"
    assert 1e-9 < odd[router] < 1e-7 and max(odd, key=odd.get) == router, odd
    monkeypatch.setattr(Qwen3MoeTopKRouter, "forward", _router_softmax_in_float64)
    assert max(errors(3.0).values()) < 1e-13


def _verify_at(directories: dict[str, str], tsp: int, cp: int) -> dict:
    from ds_tsp.tools.verify import run_cp_case

    return {family: run_cp_case(verify_case(directory), tsp, cp) for family, directory in directories.items()}


@pytest.mark.slow
def test_moe_under_cp_is_exact_on_an_odd_ring_of_tsp_groups(tmp_path):
    """(D, C) = (2, 3) (6 ranks): the cp ring's 1/D shares over three groups of two, with each MoE family (GPT-OSS:
    its window layer on cp_window's hulls), loss, aux loss and every gradient against transformers.
    The reference's gradients are those of 3 x loss, / 3 (verify's loss_scale: the data group's size), as the
    data-parallel average computes them: transformers' float32 router softmax (Qwen3-MoE, Mixtral) rounds 3 x its
    gradient differently, which alone moves the routers' grads by 5e-9 / 3e-8 relative
    (test_router_grads_depend_on_the_loss_scale_only_through_float32)."""
    directories = {family: str(save_tiny_checkpoint(tmp_path / family, tiny_config(family, **overrides)))
                   for family, overrides in FAMILIES.items()}
    reports = run_on_local_ranks(_verify_at, 6, directories, 2, 3, timeout_s=600)[0]
    bad = {family: {k: r[k] for k in ("loss_rel_err", "grad_rel_err", "worst_grad", "aux_rel_err", "ok")}
           for family, r in reports.items()
           if not ((r["tsp"], r["cp"], r["reference"], r["ok"]) == (2, 3, "transformers", True)
                   and max(r["loss_rel_err"], r["grad_rel_err"], r["aux_rel_err"]) < TOL)}
    assert not bad, bad


def test_verify_hf_model_under_cp_all_to_all(runs):
    """The same check of GPT-OSS (MoE, sinks, a sliding and a full layer) under tsp.cp_comm "all_to_all"."""
    report = runs[1][0]["verify_all_to_all"]
    assert (report["tsp"], report["cp"], report["reference"], report["ok"]) == (2, 2, "transformers", True), report
    assert report["loss_rel_err"] < TOL and report["grad_rel_err"] < TOL, report
