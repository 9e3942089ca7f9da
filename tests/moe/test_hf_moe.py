"""Qwen3-MoE, Mixtral and GPT-OSS as TSPForCausalLM families, against transformers' OWN model in float64.

Tiny checkpoints (tests/helpers/hf_tiny.py MOE_FAMILIES): Qwen3-MoE with a dense layer (mlp_only_layers=[0]) and a sparse
one (8 experts, top-2, norm_topk_prob False, expert width 12 which D=4 does not divide), Mixtral with a sliding
window (4 experts, top-2), both with output_router_logits (the loss carries router_aux_loss_coef x the load-balancing
loss). One spawn of 4 ranks: each family is loaded BY SLICES (every rank reads only its own experts' tensors, checked
by recording the reads), run on the same right-padded batch (S=29: zigzag padding too) at D=4 with both dispatch
schedules and at D=2 with activation checkpointing, and saved with save_pretrained. Loss, aux loss and every
gradient agree with transformers to 1e-10 (norm-wise relative; measured ~1e-15): transformers' routers softmax in
float32 and ds_tsp routes with the same float32 probabilities; its aux loss accumulates in float32, so the reference
takes the same formula in float64 (ds_tsp.tools.hf_reference.load_balancing_loss). The saved checkpoint has
transformers' layout and loads in plain transformers with identical tensors and logits; a fused-layout checkpoint
(experts.gate_up_proj / down_proj) loads too. GPT-OSS (attention sinks, o_proj bias, biased clamped-SwiGLU experts
held fused: each rank reads its experts' rows of every fused tensor) also runs packed documents at D=1, 2 and 4
against transformers running every document alone.
GLM-4.5 (3 layers, a dense first one; 8 experts in 4 groups, 2 kept, top-2, a shared expert, a correction bias that
changes the choice of about half the tokens, routed_scaling_factor 2.5; no aux loss, as in transformers) takes the
same runs, and packed documents at D=1, 2 and 4 too; its routers compute in float64 on both sides (transformers'
float32 router patched by ds_tsp.tools.hf_reference), so it also agrees to 1e-10.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MOE_FAMILIES, packed_batch, save_tiny_checkpoint, shift  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict  # noqa: E402
from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.hf_reference import (  # noqa: E402
    hf_logits,
    hf_loss_and_grads,
    load_hf_reference,
    patch_float64_,
    reference_attention,
)

B, S = 2, 29
TOL = 1e-10
# (degree, moe_dispatch, activation checkpointing) per family
RUNS = ((4, "ring", False), (4, "all_to_all", False), (2, "auto", True))
# GLM-4.5 on packed documents: (degree, moe_dispatch)
PACKED = "glm4_moe"
PACKED_RUNS = ((1, "auto"), (2, "ring"), (4, "all_to_all"))
DOCUMENTS = ((7, 12, 10), (29,))
# GPT-OSS also runs packed documents (its sliding layer's window 5 is shorter than a rank's chunk from D=2) at D=1,
# 2 and 4; the boundaries fall inside zigzag chunks
PACKED_FAMILIES, DOCS = ("gpt_oss",), [[7, 12, 10], [5, 24]]


def _experts(name: str) -> int:
    config = MOE_FAMILIES[name]
    return config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]


def make_batch(vocab_size: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab_size, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -6:] = 0  # right padding on row 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, labels, mask


def reference_targets(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """shift_labels as TSP builds them: no target for a padded query nor a padded target."""
    real = mask.bool()
    next_real = torch.cat((real[:, 1:], real.new_zeros(B, 1)), dim=1)
    return shift(labels).masked_fill(~(real & next_real), -100)


def _record_reads():
    """Wrap CheckpointReader.read to record every tensor name read on this rank, with its (dim, start, length)."""
    from ds_tsp.checkpoint.safetensors.reader import CheckpointReader

    names, original = [], CheckpointReader.read

    def read(self, name, dim=None, start=0, length=None, **kwargs):
        names.append((name, dim, start, length))
        return original(self, name, dim, start, length, **kwargs)

    CheckpointReader.read = read
    return names, lambda: setattr(CheckpointReader, "read", original)


def _tsp_runs(checkpoints: dict[str, str], save_root: str) -> dict:
    import torch.distributed as dist

    from ds_tsp.core.config import TSPOptions
    from ds_tsp.hf import TSPForCausalLM

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    results = {}
    for name, directory in checkpoints.items():
        vocab = json.loads(open(f"{directory}/config.json").read())["vocab_size"]
        ids, labels, mask = make_batch(vocab)
        for degree, dispatch, ac in RUNS:
            group = dist.group.WORLD if degree == 4 else halves[rank // 2]
            reads, restore = _record_reads()
            try:
                model = TSPForCausalLM.from_pretrained(directory, group, dtype=torch.float64, options=TSPOptions(
                    moe_dispatch=dispatch, activation_checkpointing=ac))
            finally:
                restore()
            out = model(input_ids=ids, labels=labels, attention_mask=mask)
            out.loss.backward()
            grads = model.tsp.full_state_dict(grads=True)
            aux = None if out.aux_loss is None else out.aux_loss.detach()
            results[(name, degree, dispatch)] = (out.loss.detach(), aux, grads if rank == 0 else None,
                                                 sorted(set(r for r in reads if ".experts." in r[0])))
            if degree == 4 and dispatch == "ring":
                model.save_pretrained(f"{save_root}/{name}", max_shard_size="16KB")
        if name == PACKED:
            batch = packed_batch(vocab, DOCUMENTS, seed=5)
            for degree, dispatch in PACKED_RUNS:
                group = {1: singles[rank], 2: halves[rank // 2], 4: dist.group.WORLD}[degree]
                model = TSPForCausalLM.from_pretrained(directory, group, dtype=torch.float64,
                                                       options=TSPOptions(moe_dispatch=dispatch))
                out = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"])
                out.loss.backward()
                grads = model.tsp.full_state_dict(grads=True)
                results[("packed", degree, dispatch)] = (out.loss.detach(), grads if rank == 0 else None)
        if name in PACKED_FAMILIES:
            data = packed_batch(vocab, DOCS, seed=5)
            for degree, group in ((1, singles[rank]), (2, halves[rank // 2]), (4, dist.group.WORLD)):
                model = TSPForCausalLM.from_pretrained(directory, group, dtype=torch.float64)
                out = model(input_ids=data["input_ids"], labels=data["labels"], position_ids=data["position_ids"])
                out.loss.backward()
                grads = model.tsp.full_state_dict(grads=True)
                results[(name, degree, "packed")] = (out.loss.detach(), out.aux_loss.detach(), grads)
    fused = f"{save_root}/fused"
    model = TSPForCausalLM.from_pretrained(fused, dist.group.WORLD, dtype=torch.float64)
    results["fused"] = model.tsp.full_state_dict()
    return results


def _write_fused(source: str, target) -> str:
    """The Qwen3-MoE checkpoint with experts in transformers' fused in-memory layout (what its state_dict holds)."""
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    target.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(open(f"{source}/config.json").read())
    return str(target)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    checkpoints = {name: str(save_tiny_checkpoint(root / "in" / name, name)) for name in MOE_FAMILIES}
    _write_fused(checkpoints["qwen3_moe"], root / "out" / "fused")
    results = run_on_local_ranks(_tsp_runs, 4, checkpoints, str(root / "out"), timeout_s=600)
    return checkpoints, results, root / "out"


@pytest.mark.parametrize("name", sorted(MOE_FAMILIES))
def test_matches_transformers_fp64_with_aux_loss(runs, name):
    checkpoints, results, _ = runs
    reference = load_hf_reference(checkpoints[name], torch.float64)
    ids, labels, mask = make_batch(reference.config.vocab_size)
    aux = {}
    ref_loss, ref_grads = hf_loss_and_grads(reference, ids, reference_targets(labels, mask), attention_mask=mask,
                                            aux_out=aux)
    ref_grads = canonical_state_dict(ref_grads, ModelShape.from_hf_config(reference.config).moe_family)
    with_aux = name != "glm4_moe"  # transformers' GLM-4.5 adds no load-balancing loss
    assert ("aux_loss" in aux) == with_aux
    assert not with_aux or float(aux["aux_loss"]) > 1.0  # E * sum f_e P_e >= 1: the aux term is there
    for degree, dispatch, _ in RUNS:
        loss, aux_loss, grads, _ = results[0][(name, degree, dispatch)]
        assert set(grads) == set(ref_grads), (name, degree, dispatch)
        errors = {n: _rel(grads[n], g) for n, g in ref_grads.items()}
        worst = max(errors, key=errors.get)
        assert _rel(loss, ref_loss) < TOL, (name, degree, dispatch, float(loss), float(ref_loss))
        assert (aux_loss is None) if not with_aux else _rel(aux_loss, aux["aux_loss"]) < TOL, (name, degree, dispatch)
        assert errors[worst] < TOL, (name, degree, dispatch, worst, errors[worst])
        for r in range(1, 4):  # every rank reports the same loss and aux loss
            assert torch.equal(results[r][(name, degree, dispatch)][0], loss)


def test_glm4_moe_packed_documents_at_d1_d2_d4(runs):
    """Packed documents (positions restarting per document): every degree equals transformers running each
    document on its own, loss and every gradient (the router's through the gathered sigmoid scores) to 1e-10."""
    checkpoints, results, _ = runs
    reference = load_hf_reference(checkpoints[PACKED], torch.float64)
    batch = packed_batch(reference.config.vocab_size, DOCUMENTS, seed=5)
    ref_loss, ref_grads = hf_loss_and_grads(reference, batch["input_ids"], shift(batch["labels"]),
                                            documents=batch["documents"])
    ref_grads = canonical_state_dict(ref_grads, "glm4_moe")
    assert float(ref_grads["model.layers.1.mlp.gate.weight"].norm()) > 1e-5  # the router really trains
    for degree, dispatch in PACKED_RUNS:
        loss, grads = results[0][("packed", degree, dispatch)]
        assert set(grads) == set(ref_grads), degree
        errors = {n: _rel(grads[n], g) for n, g in ref_grads.items()}
        worst = max(errors, key=errors.get)
        assert _rel(loss, ref_loss) < TOL, (degree, float(loss), float(ref_loss))
        assert errors[worst] < TOL, (degree, dispatch, worst, errors[worst])


def test_glm4_moe_correction_bias_changes_the_choice():
    """The tiny GLM-4.5's correction bias is no bystander: without it, other experts win for many tokens."""
    from hf_tiny import build_tiny_model

    from ds_tsp.core.layers.moe.routing import route_sigmoid_grouped

    gate = build_tiny_model("glm4_moe", dtype=torch.float64).model.layers[1].mlp.gate
    x = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    chosen = [route_sigmoid_grouped(x, gate.weight, bias, 2, 4, 2, True, 2.5)[2].sort(-1)[0]
              for bias in (gate.e_score_correction_bias, torch.zeros(8, dtype=torch.float64))]
    assert (chosen[0] != chosen[1]).any(-1).float().mean() > 0.2
    assert torch.equal(chosen[0], gate(x)[2].sort(-1)[0])  # transformers' own router chooses the same


@pytest.mark.parametrize("name", sorted(MOE_FAMILIES))
def test_each_rank_reads_only_its_experts(runs, name):
    _, results, _ = runs
    experts = _experts(name)
    for rank in range(4):
        for degree, dispatch, _ in RUNS:
            read = results[rank][(name, degree, dispatch)][3]
            p = rank if degree == 4 else rank % 2
            first, count = p * experts // degree, experts // degree
            if name == "gpt_oss":  # fused [E, ...] tensors: this rank's experts' rows of each, nothing else
                assert read and {(dim, start, length) for _, dim, start, length in read} == {(0, first, count)}
                continue
            mine = {str(i) for i in range(first, first + count)}
            assert read and {n.split(".experts.")[1].split(".")[0] for n, *_ in read} == mine, (rank, degree, read)


@pytest.mark.parametrize("name", sorted(MOE_FAMILIES))
def test_save_pretrained_round_trip_in_plain_transformers(runs, name):
    checkpoints, _, saved_root = runs
    saved = saved_root / name
    assert (saved / "model.safetensors.index.json").is_file()
    index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    original_index = _names(checkpoints[name])
    assert set(index) == original_index  # transformers' own saved layout, name for name
    original = load_hf_reference(checkpoints[name], torch.float64)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        saved, attn_implementation=reference_attention(original.config.model_type), experts_implementation="eager")
    assert type(reloaded) is type(original) and reloaded.dtype == torch.float64
    want, got = original.state_dict(), reloaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    patch_float64_(reloaded)
    ids, _, _ = make_batch(original.config.vocab_size)
    assert _rel(hf_logits(reloaded, ids), hf_logits(original, ids)) < 1e-13


@pytest.mark.parametrize("name", PACKED_FAMILIES)
def test_packed_documents_at_d1_d2_d4_equal_each_document_alone(runs, name):
    checkpoints, results, _ = runs
    reference = load_hf_reference(checkpoints[name], torch.float64)
    data = packed_batch(reference.config.vocab_size, DOCS, seed=5)
    aux = {}
    ref_loss, ref_grads = hf_loss_and_grads(reference, data["input_ids"], shift(data["labels"]),
                                            documents=data["documents"], aux_out=aux)
    for degree in (1, 2, 4):
        loss, aux_loss, grads = results[0][(name, degree, "packed")]
        errors = {n: _rel(grads[n], g) for n, g in ref_grads.items()}
        worst = max(errors, key=errors.get)
        assert set(grads) == set(ref_grads) and _rel(loss, ref_loss) < TOL, (name, degree, float(loss))
        assert _rel(aux_loss, aux["aux_loss"]) < TOL, (name, degree)
        assert errors[worst] < TOL, (name, degree, worst, errors[worst])


def test_fused_layout_checkpoint_loads(runs):
    checkpoints, results, _ = runs
    from ds_tsp.checkpoint.safetensors.reader import CheckpointReader

    reader = CheckpointReader(checkpoints["qwen3_moe"])  # the per-expert original the fused one was made from
    want = {n: reader.read(n, dtype=torch.float64) for n in reader.names()}
    got = results[0]["fused"]
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _names(directory: str) -> set[str]:
    from ds_tsp.checkpoint.safetensors.reader import CheckpointReader

    return set(CheckpointReader(directory).names())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


# --- config rules ------------------------------------------------------------------------------------------

def _config(name: str, **changes) -> dict:
    from hf_tiny import tiny_config

    return {**tiny_config(name).to_dict(), **changes}


def test_shape_from_configs():
    qwen = ModelShape.from_hf_config(_config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2,
                                             num_hidden_layers=4))
    assert [qwen.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob,
            qwen.moe_family, qwen.qk_norm, qwen.output_router_logits) == (8, 2, 12, False, "qwen3_moe", True, True)
    mixtral = ModelShape.from_hf_config(_config("mixtral"))
    assert mixtral.moe_family == "mixtral" and mixtral.norm_topk_prob and mixtral.dense_mlp_layers == ()
    assert mixtral.moe_intermediate_size == 16 and mixtral.attention_windows == (5, 5)
    # Qwen3-MoE drops its sliding window unless use_sliding_window (as Qwen3MoeConfig does)
    assert ModelShape.from_hf_config(_config("qwen3_moe", sliding_window=7)).attention_windows is None
    assert ModelShape.from_hf_config(_config("qwen3_moe", sliding_window=7,
                                             use_sliding_window=True)).attention_windows == (7, 7)


@pytest.mark.parametrize("name, changes, field", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    # GLM-4.5's grouped, scaled routing and shared experts are not Qwen3-MoE's or Mixtral's: still refused there
    ("qwen3_moe", {"n_group": 4}, "n_group"),
    ("qwen3_moe", {"first_k_dense_replace": 1}, "first_k_dense_replace"),
    ("mixtral", {"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ("mixtral", {"n_shared_experts": 1}, "n_shared_experts"),
])
def test_unsupported_moe_fields_refused(name, changes, field):
    with pytest.raises(TSPConfigError, match=field):
        ModelShape.from_hf_config(_config(name, **changes))


def test_experts_not_divisible_by_tsp_refused():
    shape = ModelShape.from_hf_config(_config("qwen3_moe", num_local_experts=6))
    shape.check_tsp_degree(2)  # 6 experts over 2 ranks; expert width 12 need not divide anything
    with pytest.raises(TSPConfigError, match=r"num_experts=6 is not divisible by tsp=4.*\[1, 2, 3, 6\]"):
        shape.check_tsp_degree(4)
