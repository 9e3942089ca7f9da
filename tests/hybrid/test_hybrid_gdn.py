"""Hybrid models end to end: Qwen3.5, Qwen3-Next (dense and with experts) and Qwen3.5-MoE, against transformers' own
Qwen3_5ForCausalLM / Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM in float64 (delta rule, gates and norms widened to
float64 by ds_tsp.tools.hf_reference; packed documents run one by one, what transformers' kernels do with
cu_seq_lens; padded rows against the unpadded run).

The models: a linear_attention layer (TSPGatedDeltaNet) then a gated full-attention layer (Qwen3.5-MoE: two
full-attention layers); the MoE ones add experts with a shared expert and the aux loss (layer 0 of Qwen3-Next
dense via mlp_only_layers). ONE 4-rank spawn, every model loaded BY SLICES from transformers' safetensors:
| D | ranks | cases                                                                                              |
|---|-------|----------------------------------------------------------------------------------------------------|
| 4 | world | qwen3_5 packed (S = 24: chunks of 3 < conv kernel 4, documents cross ranks), qwen3_next plain (S = 29, zigzag padding), qwen3_next_moe packed, qwen3_5_moe plain; each then saved |
| 2 | 0, 1  | qwen3_5 left/right padding, qwen3_5_moe packed; then `ds-tsp verify`'s run_case (3 documents)      |
| 2 | 2, 3  | qwen3_next packed, qwen3_next_moe plain                                                            |
and D=1 in this process (qwen3_5 plain, qwen3_next_moe packed). Loss and every gradient within 1e-10 (norm-wise
relative; measured ~1e-14). Saves reload in transformers with identical tensors; per-rank parameters are 1/D of
every sharded tensor plus the replicated norms, routers and shared-expert gates; host syncs stay within the
budgets of tests/reliability/test_host_syncs.py; a meta-device step creates nothing off the device.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import shift  # noqa: E402
from hybrid_tiny import (  # noqa: E402
    assert_matches,
    expected_per_rank_parameters,
    hybrid_config,
    packed_inputs,
    padding_inputs,
    plain_inputs,
    rel,
    save_checkpoint,
    tsp_step,
)
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict  # noqa: E402
from ds_tsp.tools.hf_reference import hf_logits, hf_loss_and_grads, load_hf_reference  # noqa: E402

# family -> layer_types: Qwen3.5-MoE runs full-attention layers in the multi-rank cases (its Gated DeltaNet is
# Qwen3.5's layer, proven there; the D=1 test below runs it with Qwen3.5-MoE's Gated DeltaNet layers)
FAMILIES = {"qwen3_5": ("linear_attention", "full_attention"), "qwen3_next": ("linear_attention", "full_attention"),
            "qwen3_next_moe": ("linear_attention", "full_attention"), "qwen3_5_moe": ("full_attention",) * 2}
D4_CASES = [("qwen3_5", "packed"), ("qwen3_next", "plain"), ("qwen3_next_moe", "packed"), ("qwen3_5_moe", "plain")]
HALF_CASES = ([("qwen3_5", "padding"), ("qwen3_5_moe", "packed")], [("qwen3_next", "packed"),
                                                                  ("qwen3_next_moe", "plain")])
VERIFY_SEQ, VERIFY_DOCUMENTS = 24, 3


def _inputs(batch: str) -> dict:
    return {"packed": packed_inputs, "plain": plain_inputs, "padding": lambda: padding_inputs()[1]}[batch]()


def _spawned(checkpoints: dict, save_root: str) -> dict:
    """D=4 on the world (each case then saved: a collective over the world); D=2 on both halves at once (different
    cases, host syncs counted); then `ds-tsp verify`'s run_case on half [0, 1] (transformers as the reference)."""
    import torch.distributed as dist

    from ds_tsp.tools.cli import _shape_from_checkpoint
    from ds_tsp.tools.verify import VerifyCase, run_case

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {}
    for family, batch in D4_CASES:
        model, results[(family, batch, 4)] = tsp_step(checkpoints[family], _inputs(batch))
        model.save_pretrained(f"{save_root}/{family}", max_shard_size="16KB")
    syncs = []
    for family, batch in HALF_CASES[rank // 2]:
        _, results[(family, batch, 2)] = tsp_step(checkpoints[family], _inputs(batch), halves[rank // 2], syncs)
    report = None
    if rank < 2:
        case = VerifyCase(shape=_shape_from_checkpoint(checkpoints["qwen3_5"]), batch=2, seq=VERIFY_SEQ,
                          dtype="float64", documents=VERIFY_DOCUMENTS, hf_model=checkpoints["qwen3_5"])
        report = run_case(case, halves[0])
    gathered = [None] * 4
    dist.all_gather_object(gathered, (results, syncs))
    if rank != 0:
        return None
    return {**gathered[2][0], **gathered[0][0], "syncs": {r: gathered[r][1] for r in range(4)}, "verify": report}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_gdn")
    return {f: save_checkpoint(root / f, hybrid_config(f, layer_types=types)) for f, types in FAMILIES.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {family: load_hf_reference(directory, torch.float64) for family, directory in checkpoints.items()}


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    saved = tmp_path_factory.mktemp("hybrid_gdn_saved")
    return run_on_local_ranks(_spawned, 4, checkpoints, str(saved), timeout_s=600)[0], saved


def _reference(model, batch: str):
    """transformers' loss and grads of `batch` (padding: the unpadded rows; MoE experts under checkpoint names)."""
    if batch == "padding":
        ids = padding_inputs()[0]
        loss, grads = hf_loss_and_grads(model, ids, shift(ids.clone()))
    else:
        inputs = _inputs(batch)
        documents = {"documents": inputs["documents"]} if "documents" in inputs else {}
        loss, grads = hf_loss_and_grads(model, inputs["input_ids"], shift(inputs["labels"]), **documents)
    return loss, canonical_state_dict(grads, "qwen3_moe")  # transformers' fused experts -> checkpoint names


def test_d1_matches_transformers(checkpoints, references):
    syncs = []
    for family, batch in (("qwen3_5", "plain"), ("qwen3_next_moe", "packed")):
        _, got = tsp_step(checkpoints[family], _inputs(batch), syncs=syncs)
        assert_matches(got, _reference(references[family], batch), (family, batch, 1))
    _assert_sync_budget(syncs, steps=2)


def test_speed_mode_matches_transformers(checkpoints, references):
    """TSPOptions.speed(): the Gated DeltaNet layers keep every block's forward for backward; same loss and grads,
    no host sync added."""
    from ds_tsp.core.config import TSPOptions

    syncs = []
    for family, batch in (("qwen3_5", "packed"), ("qwen3_next_moe", "plain")):
        _, got = tsp_step(checkpoints[family], _inputs(batch), syncs=syncs, options=TSPOptions.speed())
        assert_matches(got, _reference(references[family], batch), (family, batch, "speed"))
    _assert_sync_budget(syncs, steps=2)


def _assert_sync_budget(syncs: list, steps: int) -> None:
    """tests/reliability/test_host_syncs.py's budgets: one read per step in the input check; inside the layers only the MoE
    dispatch's count read (one per sparse layer forward, none in backward); nothing in attention or Gated DeltaNet."""
    checks = [e for e in syncs if e[2] == "input_checks"]
    assert [e[:2] for e in checks] == [("read", "tolist")] * steps, checks
    others = [e for e in syncs if e[2] != "input_checks"]
    assert all(e[:2] == ("read", "tolist") and "core/layers/moe/" in e[3] for e in others), others


@pytest.mark.parametrize("family, batch, degree", [(f, b, 4) for f, b in D4_CASES] +
                         [(f, b, 2) for half in HALF_CASES for f, b in half])
def test_tsp_matches_transformers(runs, references, family, batch, degree):
    results, _ = runs
    assert_matches(results[(family, batch, degree)], _reference(references[family], batch), (family, batch, degree))


def test_one_host_read_per_step_at_d2(runs):
    """Gated attention, Gated DeltaNet and MoE layers at D=2, padded and packed: within the host-sync budgets."""
    results, _ = runs
    for rank, syncs in results["syncs"].items():
        _assert_sync_budget(syncs, steps=2)


def test_verify_reports_ok_with_documents(runs):
    """`ds-tsp verify --hf-model DIR --dtype float64 --documents 3` (its run_case, on ranks 0 and 1): transformers'
    own model is the reference, every document run alone; ok within 1e-10."""
    report = runs[0]["verify"]
    assert report["ok"] and report["reference"] == "transformers" and report["documents"] == VERIFY_DOCUMENTS
    assert report["loss_rel_err"] < 1e-10 and report["grad_rel_err"] < 1e-10


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])  # MoE meta steps: tests/model/test_meta_device.py
@pytest.mark.parametrize("kind", ["plain", "padding", "checkpointing"])
def test_meta_step_creates_nothing_off_device(family, kind):
    from test_meta_device import _meta_step

    from ds_tsp.core.comm.communicator import TSPComm

    found = _meta_step(hybrid_config(family), TSPComm.single(), kind)
    assert not found, "\n".join(found)


def test_documents_really_reset_the_linear_state(references):
    """Running the packed rows whole (one document per row) is far from the per-document reference: a Gated
    DeltaNet that carried its state or conv across a document start could not pass the packed cases above."""
    data = packed_inputs()
    per_document = _reference(references["qwen3_5"], "packed")
    whole = hf_loss_and_grads(references["qwen3_5"], data["input_ids"], shift(data["labels"]),
                              position_ids=data["position_ids"], attention_mask=torch.ones_like(data["input_ids"]))
    assert rel(whole[0], per_document[0]) > 1e-4


def test_the_shared_expert_and_the_aux_loss_really_count(references):
    """Zeroing the shared expert's down projection, or turning the aux loss off, moves the loss far beyond 1e-10:
    the MoE comparisons above see both."""
    model = references["qwen3_5_moe"]
    loss, _ = _reference(model, "plain")
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "shared_expert.down_proj" in n}
    params = dict(model.named_parameters())
    try:
        with torch.no_grad():
            for n in saved:
                params[n].zero_()
        without_shared, _ = _reference(model, "plain")
    finally:
        with torch.no_grad():
            for n, value in saved.items():
                params[n].copy_(value)
    model.config.output_router_logits = False
    try:
        without_aux, _ = _reference(model, "plain")
    finally:
        model.config.output_router_logits = True
    assert rel(without_shared, loss) > 1e-6 and rel(without_aux, loss) > 1e-6


def test_per_rank_parameters_are_one_dth_of_the_sharded_tensors(runs, references):
    results, _ = runs
    for key, got in results.items():
        if isinstance(key, tuple):
            family, batch, degree = key
            assert got[2] == expected_per_rank_parameters(references[family], degree), key


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_pretrained_reloads_in_transformers(runs, references, family):
    _, saved = runs
    reloaded = load_hf_reference(saved / family, torch.float64)
    assert type(reloaded).__name__ == type(references[family]).__name__
    original = dict(references[family].state_dict())
    assert reloaded.state_dict().keys() == original.keys()
    differ = [k for k, v in reloaded.state_dict().items() if not torch.equal(v, original[k])]
    assert not differ, differ
    ids = plain_inputs()["input_ids"]
    assert rel(hf_logits(reloaded, ids), hf_logits(references[family], ids)) < 1e-13


def test_plan_reads_a_hybrid_config_as_the_model_does_not_as_llama_layers(tmp_path):
    """The planner's reader gives the model's own hybrid shape (layer_types, linear_* fields, gated attention);
    tests/tools/test_plan_hybrid.py checks the plan rows against measured steps."""
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.plan import shape_from_hf_config

    config = hybrid_config("qwen3_5")
    (tmp_path / "config.json").write_text(config.to_json_string())
    shape = shape_from_hf_config(tmp_path)
    assert shape == ModelShape.from_hf_config(config.to_dict())
    assert shape.layer_types == ("linear_attention", "full_attention") and shape.attn_output_gate


def test_qwen3_5_moe_with_gated_deltanet_layers_loads_and_agrees(tmp_path):
    """Qwen3.5-MoE's Gated DeltaNet (transformers' Qwen3_5MoeGatedDeltaNet, Qwen3.5's checkpoint layout) at D=1,
    against transformers' model widened to float64 (ds_tsp.tools.gdn_reference covers its class): 1e-10."""
    directory = save_checkpoint(tmp_path / "qwen3_5_moe_gdn", hybrid_config("qwen3_5_moe"))
    reference = load_hf_reference(directory, torch.float64)
    _, got = tsp_step(directory, packed_inputs())
    loss, grads = _reference(reference, "packed")
    assert rel(got[0], loss) < 1e-10
    assert max(rel(got[1][name], g) for name, g in grads.items()) < 1e-10
