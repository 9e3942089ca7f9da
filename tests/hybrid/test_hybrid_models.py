"""Qwen3.5's gated attention alone under TSP (every layer full_attention), against transformers' own
Qwen3_5ForCausalLM, float64; and the hybrid config parsing.

The gated full-attention layer (q_proj emits [q, gate] per head, output * sigmoid(gate) before o_proj; partial
rotary on the first half of every head; zero-centred (1 + w) q/k norms and decoder norms) runs through the TSP
attention: D=1 (loss and every gradient within 1e-10, measured ~1e-15), config parsing and its errors, mrope = plain
RoPE for text positions (bit for bit), a multimodal checkpoint loaded as its language model; one 4-rank spawn: D=2
(both halves, different cases) and D=4 for a plain batch, packed documents and left/right padding, the D=4 save
reloaded by transformers, per-rank parameter counts; and TSPTrainer at TSP=2 against the plain Trainer
(examples/hf_trainer.py, fp32, 1e-5). (The hybrid models of tests/hybrid/test_hybrid_gdn.py, whose second layer is
this gated attention, run it at D=2 and D=4 too.)
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import shift  # noqa: E402,I001
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

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.hf_reference import hf_logits, hf_loss_and_grads, load_hf_reference  # noqa: E402


def gated_config(**overrides):
    """Every layer full attention: the gated attention alone (q gate, partial rotary 0.5 with an mrope section)."""
    return hybrid_config("qwen3_5", layer_types=("full_attention",) * 2, **overrides)


def _spawned(directory: str, save_root: str) -> dict:
    """D=4 on the world (plain batch, then saved); D=2 on two halves: [0, 1] plain + packed, [2, 3] padding."""
    import torch.distributed as dist

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {}
    model, results[("plain", 4)] = tsp_step(directory, plain_inputs())
    model.save_pretrained(save_root, max_shard_size="24KB")  # collective over the world
    if rank < 2:
        _, results[("plain", 2)] = tsp_step(directory, plain_inputs(), halves[0])
        _, results[("packed", 2)] = tsp_step(directory, packed_inputs(), halves[0])
    else:
        _, results[("padding", 2)] = tsp_step(directory, padding_inputs()[1], halves[1])
    gathered = [None] * 4
    dist.all_gather_object(gathered, results)
    return {**gathered[2], **gathered[0]} if rank == 0 else None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "gated", gated_config())


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_hf_reference(checkpoint, torch.float64)


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    saved = tmp_path_factory.mktemp("qwen3_5_saved") / "d4"
    return run_on_local_ranks(_spawned, 4, checkpoint, str(saved), timeout_s=600)[0], str(saved)


def test_shape_from_a_qwen3_5_config():
    shape = ModelShape.from_hf_config(gated_config().to_dict())
    assert shape.attn_output_gate and shape.zero_centred_norms and shape.qk_norm
    assert shape.rotary_dim == 8 and shape.layer_types == ("full_attention",) * 2
    # a multimodal Qwen3_5ForConditionalGeneration config.json: its text_config
    outer = transformers.Qwen3_5Config(text_config=gated_config().to_dict()).to_dict()
    assert ModelShape.from_hf_config(outer) == shape
    # defaults: layer_types from full_attention_interval, partial rotary 0.25
    hybrid = ModelShape.from_hf_config(transformers.Qwen3_5TextConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4))
    assert hybrid.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert hybrid.rotary_dim == 4 and hybrid.linear_conv_kernel_dim == 4 and hybrid.hybrid_family == "qwen3_5"


def test_config_errors_name_the_field():
    moe = ModelShape.from_hf_config(transformers.Qwen3NextConfig(num_hidden_layers=2, shared_expert_intermediate_size=6,
                                                                 num_experts=8, num_experts_per_tok=2,
                                                                 linear_num_key_heads=4))
    assert moe.shared_expert_intermediate_size == 6 and moe.norm_topk_prob and moe.num_experts == 8
    moe.check_tsp_degree(2)
    with pytest.raises(TSPConfigError, match=r"shared_expert_intermediate_size=6 is not divisible by tsp=4"):
        moe.check_tsp_degree(4)
    assert ModelShape.from_hf_config(transformers.Qwen3_5MoeTextConfig(num_hidden_layers=2)).norm_topk_prob
    shape = ModelShape.from_hf_config(transformers.Qwen3_5TextConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4))
    shape.check_tsp_degree(2)
    with pytest.raises(TSPConfigError, match=r"linear_num_key_heads=2 is not divisible by tsp=4.*\[1, 2\]"):
        shape.check_tsp_degree(4)
    with pytest.raises(TSPConfigError, match="partial_rotary_factor"):  # still refused outside the hybrid families
        ModelShape.from_hf_config({"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 16,
                                   "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})


def test_mrope_reduces_to_plain_rope_for_text_positions():
    """transformers' interleaved mrope, given 2-D text positions (its 3 rows equal), is plain RoPE on the rotary
    dims: ds_tsp's rope_cos_sin of rotary_dim gives the same cos/sin, bit for bit in float32."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from ds_tsp.core.tokens.rope import rope_cos_sin

    config = gated_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                           "mrope_interleaved": True})
    rotary = Qwen3_5TextRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 2, 3, 7, 100, 5000], [3, 0, 1, 2, 9, 11, 12]])
    x = torch.zeros(1, dtype=torch.float32)
    hf_cos, hf_sin = rotary(x, positions[None].expand(3, -1, -1))
    shape = ModelShape.from_hf_config(config)
    cos, sin = rope_cos_sin(positions, shape.rotary_dim, shape.rope_theta, torch.float32)
    assert hf_cos.shape == cos.shape == (2, 7, 8)
    assert torch.equal(hf_cos, cos) and torch.equal(hf_sin, sin)
    # distinct rows (a vision grid) would differ: the reduction really depends on the rows being equal
    grid = torch.stack((positions, positions + 1, positions + 2))
    assert not torch.equal(rotary(x, grid)[0], cos)


def test_d1_matches_transformers(checkpoint, reference):
    inputs = plain_inputs()
    _, got = tsp_step(checkpoint, inputs)
    assert_matches(got, hf_loss_and_grads(reference, inputs["input_ids"], shift(inputs["labels"])), "D=1")


def test_d2_and_d4_match_transformers(runs, reference):
    results, _ = runs
    inputs = plain_inputs()
    ref = hf_loss_and_grads(reference, inputs["input_ids"], shift(inputs["labels"]))
    for degree in (2, 4):
        assert_matches(results[("plain", degree)], ref, ("plain", degree))


def test_packed_documents_equal_each_document_alone(runs, reference):
    results, _ = runs
    data = packed_inputs()
    per_document = hf_loss_and_grads(reference, data["input_ids"], shift(data["labels"]), documents=data["documents"])
    assert_matches(results[("packed", 2)], per_document, "packed")
    crossing = hf_loss_and_grads(reference, data["input_ids"], shift(data["labels"]),
                                 position_ids=data["position_ids"], attention_mask=torch.ones_like(data["input_ids"]))
    assert rel(crossing[0], per_document[0]) > 1e-4  # attention across documents would not pass above


def test_left_and_right_padding_equal_the_unpadded_run(runs, reference):
    results, _ = runs
    ids, _ = padding_inputs()
    assert_matches(results[("padding", 2)], hf_loss_and_grads(reference, ids, shift(ids.clone())), "padding")


def test_per_rank_parameters_are_one_dth_of_the_sharded_tensors(runs, reference):
    """Counted from transformers' own tensors (hybrid_tiny.expected_per_rank_parameters): q_proj with its gate rows,
    o, MLP 1/D; k/v 1/min(D, kv heads); vocab tables ceil(V/D) rows; norms whole."""
    results, _ = runs
    for degree, key in ((4, ("plain", 4)), (2, ("plain", 2))):
        assert results[key][2] == expected_per_rank_parameters(reference, degree), degree


def test_save_pretrained_reloads_in_transformers_with_identical_logits(runs, reference, checkpoint):
    _, saved = runs
    config = json.loads(open(f"{saved}/config.json").read())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    reloaded = load_hf_reference(saved, torch.float64)
    assert type(reloaded).__name__ == "Qwen3_5ForCausalLM"
    original = dict(reference.state_dict())
    assert reloaded.state_dict().keys() == original.keys()
    differ = [k for k, v in reloaded.state_dict().items() if not torch.equal(v, original[k])]
    assert not differ, differ
    ids = plain_inputs()["input_ids"]
    # identical tensors; logits to rounding (the reload's multi-file tensors may take other GEMM paths)
    assert rel(hf_logits(reloaded, ids), hf_logits(reference, ids)) < 1e-13


def test_a_multimodal_checkpoint_loads_as_its_language_model(checkpoint, reference, tmp_path):
    """A Qwen3_5ForConditionalGeneration-style checkpoint (model.language_model.* names, a vision tower, an mtp
    head) loads by slices as its language model; only the language model's tensors are read."""
    from safetensors.torch import load_file, save_file

    from ds_tsp.hf import TSPForCausalLM

    tensors = load_file(f"{checkpoint}/model.safetensors")
    renamed = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.blocks.0.norm1.weight"] = torch.ones(4)
    renamed["mtp.fc.weight"] = torch.ones(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    outer = transformers.Qwen3_5Config(text_config=json.loads(open(f"{checkpoint}/config.json").read()))
    (tmp_path / "config.json").write_text(outer.to_json_string())
    model = TSPForCausalLM.from_pretrained(str(tmp_path), None, dtype=torch.float64)
    assert model.config.model_type == "qwen3_5_text"
    inputs = plain_inputs()
    out = model(**inputs)
    ref_loss, _ = hf_loss_and_grads(reference, inputs["input_ids"], shift(inputs["labels"]))
    assert rel(out.loss.detach(), ref_loss) < 1e-12


def test_in_memory_model_and_lora_on_the_gated_attention(tmp_path):
    """to_tsp_model of an in-memory hybrid model (a Gated DeltaNet layer, then gated attention) wrapped in PEFT LoRA
    on q_proj (its [q, gate] rows) / k_proj / o_proj: loss and every LoRA factor's gradient equal transformers' at
    D=1; LoRA on the Gated DeltaNet's depthwise conv1d is one clear error."""
    peft = pytest.importorskip("peft")
    from hf_tiny import randomize_lora_

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.model.convert import to_tsp_model
    from ds_tsp.tools.hf_reference import patch_float64_

    config = hybrid_config("qwen3_5")
    directory = save_checkpoint(tmp_path / "hybrid", config)
    base = load_hf_reference(directory, torch.float64)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj", "o_proj"]))
    randomize_lora_(wrapped)
    patch_float64_(wrapped)
    model = to_tsp_model(wrapped, TSPComm.single(), dtype=torch.float64)
    inputs = plain_inputs()
    out = model(**inputs)
    out.loss.backward()
    ref_loss, ref_grads = hf_loss_and_grads(wrapped, inputs["input_ids"], shift(inputs["labels"]))
    assert rel(out.loss.detach(), ref_loss) < 1e-10
    factors = {name: p.grad for name, p, _ in model.tsp.lora_tensors()}
    assert len(factors) == 6
    for name, grad in ref_grads.items():
        if "lora_" in name:
            key = name.replace("base_model.model.", "").replace(".default", "")
            assert rel(factors[key], grad) < 1e-10, key
    # LoRA on the Gated DeltaNet's linears: tests/hybrid/test_hybrid_compose.py; its depthwise conv1d stays refused (PEFT
    # takes it only with r a multiple of the 64 channels)
    gdn_lora = peft.get_peft_model(load_hf_reference(directory, torch.float64),
                                   peft.LoraConfig(r=64, target_modules=["conv1d"]))
    with pytest.raises(TSPConfigError, match="LoRA on 'model.layers.0.linear_attn.conv1d' is not supported"):
        to_tsp_model(gdn_lora, TSPComm.single(), dtype=torch.float64)


def test_tsp_trainer_equals_the_plain_trainer_on_a_hybrid_model(tmp_path):
    """examples/hf_trainer.py on a tiny Qwen3.5 (a Gated DeltaNet layer, then gated attention), fp32: TSPTrainer at
    TSP=2 (torchrun's ranks, tsp.json) logs the plain single-process Trainer's losses per step (1e-5; measured ~1e-7).
    Unpacked rows: transformers' pure-torch Gated DeltaNet ignores packed-document boundaries (only
    flash-linear-attention honours cu_seq_lens), so a packed plain Trainer on CPU is not the reference TSP matches."""
    pytest.importorskip("deepspeed")
    from test_hf_trainer import ROOT, _assert_steps_match, _run, _steps

    directory = save_checkpoint(tmp_path / "qwen3_5", hybrid_config("qwen3_5"))
    common = ["--model_name_or_path", directory, "--max_steps", "3", "--global_batch", "2", "--lr", "3e-3"]
    reference = _run(tmp_path / "ref", *common)
    tsp = _run(tmp_path / "tsp", "--ds_config", str(ROOT / "ds_configs" / "tsp.json"), *common, processes=2)
    _assert_steps_match(_steps(tsp), _steps(reference))
