"""Model families as adapters (ds_tsp.core.shape.families): every family reads its own transformers config class,
defaults included, into the same ModelShape as its config.json; what a family does not compute is refused by name;
Ministral 3's position-scaled queries are transformers' formula and really change the model.

The families' numerics against transformers' own models (float64, D = 2 and 4, save round trips) are in
tests/model/test_hf_families.py, tests/moe/test_hf_moe.py and tests/hybrid/test_hybrid_models.py.
"""
from __future__ import annotations

import pkgutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import save_tiny_checkpoint, shift  # noqa: E402

from ds_tsp import ModelShape, TSPConfigError  # noqa: E402
from ds_tsp.core.shape import families  # noqa: E402
from ds_tsp.core.shape.families import ARCHITECTURES, FAMILIES, WRAPPERS, family_of  # noqa: E402
from ds_tsp.core.shape.hf_config import config_dict_from_shape  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
EXTRA = {"phi3": dict(pad_token_id=0),  # its class default 32000 is past this tiny vocabulary
         "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
         "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
         "qwen3_5_moe_text": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
         "qwen3_5_text": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                              linear_value_head_dim=8),
         "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=8, linear_value_head_dim=8)}


def test_each_adapter_module_is_registered_once():
    modules = {m.name for m in pkgutil.iter_modules(families.__path__)} - {"base"}
    registered = {f.read.__module__.rsplit(".", 1)[1] for f in FAMILIES}
    assert registered == modules, "a family module that FAMILIES does not list (or the reverse)"
    types = [t for f in FAMILIES for t in f.architectures]
    assert len(types) == len(set(types)) == len(ARCHITECTURES)
    assert set(WRAPPERS.values()) <= set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_a_family_reads_its_config_class_and_its_config_json_alike(model_type):
    config = transformers.AutoConfig.for_model(model_type, **SIZES, **EXTRA.get(model_type, {}))
    assert ARCHITECTURES[model_type] in {a for a in dir(transformers) if a.endswith("ForCausalLM")}
    from_object, from_json = ModelShape.from_hf_config(config), ModelShape.from_hf_config(config.to_dict())
    assert from_object == from_json
    assert (from_object.num_layers, from_object.num_heads, from_object.dim_per_head) == (2, 4, 8)


def test_an_unknown_family_is_one_error_naming_every_supported_one():
    with pytest.raises(TSPConfigError, match=r"model_type='gpt2' is not supported; TSP converts llama, "):
        ModelShape.from_hf_config({"model_type": "gpt2", **SIZES})
    with pytest.raises(TSPConfigError, match="ministral3"):
        family_of("falcon_h1")


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu", "hidden_act='gelu' on a ministral3 config"),
    ("num_local_experts", 8, "num_local_experts=8 on a ministral3 config"),
    ("mlp_bias", True, "mlp_bias=True on a ministral3 config"),
    ("attention_dropout", 0.1, "attention_dropout=0.1"),
])
def test_ministral3_refuses_what_it_does_not_compute(field, value, match):
    config = transformers.Ministral3Config(**SIZES).to_dict()
    with pytest.raises(TSPConfigError, match=match):
        ModelShape.from_hf_config({**config, field: value})


def test_ministral3_defaults_are_its_config_class_defaults():
    shape = ModelShape.from_hf_config({"model_type": "ministral3", **SIZES})  # a config.json with no rope block
    assert shape == ModelShape.from_hf_config(transformers.Ministral3Config(**SIZES))
    assert (shape.query_scale_beta, shape.query_scale_period, shape.rope_scaling.rope_type) == (0.1, 16384, "yarn")
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "llama_4_scaling_beta": 0.1}
    with pytest.raises(TSPConfigError, match="llama_4_scaling_beta=0.1 without original_max_position_embeddings"):
        ModelShape.from_hf_config({"model_type": "ministral3", **SIZES, "rope_parameters": rope})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_query_scale_is_transformers_formula_bit_for_bit(dtype):
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    from ds_tsp.core.tokens.rope import query_scale

    positions = torch.arange(0, 200).view(2, 100)
    want = get_llama_4_attn_scale(positions, 0.1, 16).to(dtype)  # [B, 1, L, 1]: transformers' head-major layout
    assert torch.equal(query_scale(positions, 0.1, 16, dtype), want.transpose(1, 2))


def test_a_bare_ministral3_shape_saves_as_ministral3():
    shape = ModelShape.from_hf_config(transformers.Ministral3Config(**SIZES, sliding_window=7))
    config = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert type(config).__name__ == "Ministral3Config" and ModelShape.from_hf_config(config) == shape


def test_the_query_scale_changes_the_model(tmp_path, monkeypatch):
    """The positive control of the Ministral 3 rows of tests/model/test_hf_families.py: the same checkpoint with
    the query scale left out is measurably another model, with it the loss is transformers' (D=1, float64)."""
    from ds_tsp.core.tokens import positions
    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference

    directory = save_tiny_checkpoint(tmp_path / "ministral3", "ministral3")
    ids = torch.randint(0, 85, (1, 29), generator=torch.Generator().manual_seed(0))
    ref_loss, _ = hf_loss_and_grads(load_hf_reference(directory, torch.float64), ids, shift(ids))

    def tsp_loss() -> float:
        model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
        return float(model(input_ids=ids, labels=ids).loss.detach())

    assert abs(tsp_loss() - float(ref_loss)) < 1e-12 * float(ref_loss)
    monkeypatch.setattr(positions, "query_scale", lambda p, beta, period, dtype: torch.ones_like(p, dtype=dtype)[
        :, :, None, None])
    assert abs(tsp_loss() - float(ref_loss)) > 1e-6 * float(ref_loss)  # measured 2.1e-6 (tiny weights)


def test_a_bare_phi3_shape_saves_as_phi3():
    shape = ModelShape.from_hf_config(transformers.Phi3Config(**{**SIZES, "head_dim": None}, pad_token_id=0,
                                                               sliding_window=5))
    assert shape.fused_qkv and shape.fused_gate_up and shape.head_dim is None
    config = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert type(config).__name__ == "Phi3Config" and ModelShape.from_hf_config(config) == shape


def test_phi3_refuses_dropout_by_name():
    base = transformers.Phi3Config(**SIZES, pad_token_id=0).to_dict()
    with pytest.raises(TSPConfigError, match="resid_pdrop=0.1 on a phi3 config"):
        ModelShape.from_hf_config({**base, "resid_pdrop": 0.1})


def test_phi3_longrope_follows_the_whole_batchs_longest_position(tmp_path):
    """longrope's factors switch on the batch's longest position (original context 16 here). Packed documents of
    4 and 20 tokens at D=2: rank 1 holds positions 2..13 only and would pick the short factors alone; the step's
    longest position, gathered over the group, gives every rank the long ones, as transformers on the packed batch.
    Loss and every gradient against transformers (float64), and a positive control: the short factors differ."""
    from local_ranks import run_on_local_ranks

    from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference

    directory = save_tiny_checkpoint(tmp_path / "phi3", "phi3")
    ids = torch.randint(0, 79, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = load_hf_reference(directory, torch.float64)
    ref_loss, ref_grads = hf_loss_and_grads(reference, ids, shift(ids), documents=[[4, 20]])
    loss, grads = run_on_local_ranks(_packed_loss_and_grads, 2, str(directory), ids, [4, 20])[0]
    assert abs(float(loss) - float(ref_loss)) < 1e-12 * float(ref_loss)
    assert max(float((grads[n] - g).norm() / g.norm()) for n, g in ref_grads.items()) < 1e-10
    alone = run_on_local_ranks(_packed_loss_and_grads, 2, str(directory), ids, [4, 20], True)[0][0]
    assert abs(float(alone) - float(ref_loss)) > 1e-6 * float(ref_loss)  # measured 8.0e-5: rank 1's short factors


@pytest.mark.parametrize("wrapper", ["gemma3", "mistral3"])
def test_a_multimodal_checkpoint_trains_as_its_language_model(tmp_path, wrapper):
    """Gemma3ForConditionalGeneration / Mistral3ForConditionalGeneration checkpoints (the Hub's
    language_model.model.* names, a vision tower and a projector beside them) load by slices as their language
    model at D=2: loss and every gradient equal transformers' multimodal model's on text (float64, packed
    documents), no vision tensor is read, and the save is the text model, which transformers reloads with the
    multimodal model's logits."""
    from hf_tiny import save_tiny_multimodal_checkpoint
    from local_ranks import run_on_local_ranks

    from ds_tsp.checkpoint.hf.language_model_names import language_model_tensors
    from ds_tsp.tools.hf_reference import hf_logits, hf_loss_and_grads, load_hf_reference, patch_float64_

    directory = save_tiny_multimodal_checkpoint(tmp_path / wrapper, wrapper)
    reference = load_hf_reference(directory, torch.float64)
    assert type(reference).__name__.endswith("ForConditionalGeneration")
    ids = torch.randint(0, reference.config.text_config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = hf_loss_and_grads(reference, ids, shift(ids), documents=[[9, 15]])
    ref_grads = language_model_tensors(ref_grads)
    loss, grads = run_on_local_ranks(_packed_loss_and_grads, 2, str(directory), ids, [9, 15], False,
                                     str(tmp_path / "saved"))[0]
    assert set(grads) == set(ref_grads) and not any("vision" in n or "projector" in n for n in grads)
    assert abs(float(loss) - float(ref_loss)) < 1e-12 * float(ref_loss)
    assert max(float((grads[n] - g).norm() / g.norm()) for n, g in ref_grads.items()) < 1e-10
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="sdpa")
    assert type(text).__name__ == {"gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM"}[wrapper]
    patch_float64_(text)
    assert float((hf_logits(text, ids) - hf_logits(reference, ids)).norm() / hf_logits(reference, ids).norm()) < 1e-13


def _packed_loss_and_grads(directory: str, ids: torch.Tensor, documents: list[int], local_longest: bool = False,
                           save_to: str | None = None):
    from ds_tsp.core.tokens import positions
    from ds_tsp.core.tokens.documents import documents_of_lengths
    from ds_tsp.hf import TSPForCausalLM

    if local_longest:  # the positive control: each rank's own longest position, as a rank alone would take it
        positions.longest_position = lambda position_ids, comm: position_ids.max() + 1
    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
    out = model(input_ids=ids, labels=ids, position_ids=documents_of_lengths(documents)[None])
    out.loss.backward()
    if save_to is not None:
        model.save_pretrained(save_to)
    return out.loss.detach(), model.tsp.full_state_dict(grads=True)


@pytest.mark.parametrize("degree", [1, 2])
def test_the_padding_row_gets_no_gradient_as_in_transformers(tmp_path, degree):
    """transformers' embedding is nn.Embedding(padding_idx=config.pad_token_id): that row's grad is zero however
    often the token occurs. The batch here is full of the pad token (0) so a missing zeroing cannot hide."""
    from local_ranks import run_on_local_ranks

    from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference

    directory = save_tiny_checkpoint(tmp_path / "phi3", "phi3")
    ids = torch.randint(0, 79, (2, 24), generator=torch.Generator().manual_seed(0))
    ids[:, ::3] = 0
    _, ref_grads = hf_loss_and_grads(load_hf_reference(directory, torch.float64), ids, shift(ids))
    grads = run_on_local_ranks(_embedding_grad, degree, str(directory), ids)[0]
    want = ref_grads["model.embed_tokens.weight"]
    assert torch.count_nonzero(want[0]) == 0 and torch.count_nonzero(grads[0]) == 0
    assert float((grads - want).norm() / want.norm()) < 1e-12


def _embedding_grad(directory: str, ids: torch.Tensor) -> torch.Tensor:
    from ds_tsp.hf import TSPForCausalLM

    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
    model(input_ids=ids, labels=ids).loss.backward()
    return model.tsp.full_state_dict(grads=True)["model.embed_tokens.weight"]


@pytest.mark.parametrize("family, kept", [("phi3", "model.layers.0.self_attn.qkv_proj.weight"),
                                          ("glm4_moe", "model.layers.1.mlp.gate.e_score_correction_bias")])
def test_tsp_trainer_on_a_new_family_equals_the_plain_trainer(tmp_path, family, kept):
    """New families through what users put on it: examples/hf_trainer.py on a tiny dense Phi-3 (fused projections, a
    padding row, partial rotary, a window) and a tiny GLM-4.5 MoE (grouped sigmoid routing with its correction bias
    buffer, shared experts, a dense first layer, q/k/v biases, q/k norms, partial rotary): TSPTrainer at TSP=2
    against the plain Trainer, per logged step (fp32, 1e-5), and the TSP save reloads in plain transformers as the
    same model (`kept`: a tensor only that family's layout has)."""
    pytest.importorskip("deepspeed")
    from test_hf_trainer import ROOT, _assert_steps_match, _run, _steps

    directory = save_tiny_checkpoint(tmp_path / family, family)
    common = ["--model_name_or_path", str(directory), "--max_steps", "3", "--global_batch", "2", "--lr", "3e-3"]
    reference = _run(tmp_path / "ref", *common)
    tsp = _run(tmp_path / "tsp", "--ds_config", str(ROOT / "ds_configs" / "tsp.json"), *common, processes=2)
    _assert_steps_match(_steps(tsp), _steps(reference))
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tsp").state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref").state_dict()
    assert set(saved) == set(want) and kept in saved
    for name, value in want.items():
        assert (saved[name] - value).norm() <= 1e-4 * value.norm(), name


def test_a_bare_gemma3_shape_saves_as_gemma3():
    config = transformers.Gemma3TextConfig(**{**SIZES, "num_hidden_layers": 3}, sliding_window=5,
                                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                           query_pre_attn_scalar=12)
    shape = ModelShape.from_hf_config(config)
    assert (shape.sandwich_norms, shape.mlp_activation, shape.attention_scale, shape.sliding_rope_theta) == (
        True, "gelu_tanh", 12 ** -0.5, 10000.0)
    assert shape.layer_rope(0) == "sliding" and shape.layer_rope(1) == "full"
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert type(again).__name__ == "Gemma3TextConfig" and ModelShape.from_hf_config(again) == shape


@pytest.mark.parametrize("field, value, match", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True"),
    ("hidden_activation", "relu", "hidden_activation='relu'"),
])
def test_gemma3_refuses_what_it_does_not_compute(field, value, match):
    config = transformers.Gemma3TextConfig(**SIZES).to_dict()
    with pytest.raises(TSPConfigError, match=match):
        ModelShape.from_hf_config({**config, field: value})


def test_gemma3_reads_its_final_logit_softcapping():
    config = transformers.Gemma3TextConfig(**SIZES, final_logit_softcapping=30.0)
    shape = ModelShape.from_hf_config(config)
    assert shape.final_logit_softcapping == 30.0 == ModelShape.from_hf_config(config.to_dict()).final_logit_softcapping
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert again.final_logit_softcapping == 30.0 and ModelShape.from_hf_config(again) == shape
    with pytest.raises(TSPConfigError, match="final_logit_softcapping=30.0: only the Gemma families"):
        config_dict_from_shape(ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                                          num_heads=4, num_kv_heads=2, final_logit_softcapping=30.0), torch.float32)


def test_gemma3_multimodal_refuses_the_cap_its_model_never_applies():
    config = transformers.Gemma3Config(text_config={**SIZES, "final_logit_softcapping": 30.0})
    for form in (config, config.to_dict()):
        with pytest.raises(TSPConfigError, match="Gemma3ForConditionalGeneration.*never applies it"):
            ModelShape.from_hf_config(form)
    from ds_tsp.core.shape.hf_config import config_from_dict

    with pytest.raises(TSPConfigError, match="final_logit_softcapping=30.0 in a gemma3"):
        config_from_dict(config.to_dict())


GEMMA4 = dict(**SIZES, global_head_dim=16, sliding_window=5, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=64, layer_types=["sliding_attention", "full_attention"])


def test_gemma4_reads_the_full_layers_head_dim_rope_and_per_layer_inputs():
    config = transformers.Gemma4TextConfig(**GEMMA4, final_logit_softcapping=15.0)
    shape = ModelShape.from_hf_config(config)
    assert (shape.dim_per_head, shape.full_head_dim, shape.layer_head_dim(0), shape.layer_head_dim(1)) == (8, 16, 8, 16)
    assert (shape.value_norm, shape.layer_scalars, shape.attention_scale, shape.zero_centred_norms) == (
        True, True, 1.0, False)
    assert (shape.per_layer_input_size, shape.per_layer_input_vocab_size, shape.final_logit_softcapping) == (
        8, 64, 15.0)
    assert (shape.rope_theta, shape.rope_scaling.rope_type, shape.sliding_rope_theta) == (1e6, "proportional", 1e4)
    # config.json as transformers 5 writes it (per_layer_config), and as an older one (global_head_dim) alike
    written = config.to_dict()
    assert "per_layer_config" in written and ModelShape.from_hf_config(written) == shape
    older = {k: v for k, v in written.items() if k != "per_layer_config"}
    assert ModelShape.from_hf_config({**older, "global_head_dim": 16}) == shape
    assert ModelShape.from_hf_config(older).full_head_dim == 512  # Gemma4TextConfig's default
    # no per-layer inputs: hidden_size_per_layer_input 0 (or null)
    for off in (0, None):
        plain = ModelShape.from_hf_config({**written, "hidden_size_per_layer_input": off})
        assert (plain.per_layer_input_size, plain.per_layer_input_vocab_size) == (0, 0)


def test_gemma4_keys_as_values_on_the_full_layers():
    config = transformers.Gemma4TextConfig(**GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1)
    shape = ModelShape.from_hf_config(config)
    assert (shape.full_values_from_keys, shape.full_num_kv_heads) == (True, 1)
    assert [shape.layer_kv_heads(i) for i in (0, 1)] == [2, 1]
    assert [shape.layer_values_from_keys(i) for i in (0, 1)] == [False, True]
    older = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
    assert ModelShape.from_hf_config({**older, "global_head_dim": 16, "num_global_key_value_heads": 1}) == shape
    # transformers applies num_global_key_value_heads only with attention_k_eq_v
    plain = ModelShape.from_hf_config({**older, "global_head_dim": 16, "num_global_key_value_heads": 1,
                                       "attention_k_eq_v": False})
    assert (plain.full_values_from_keys, plain.full_num_kv_heads) == (False, None)
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert again.attention_k_eq_v and ModelShape.from_hf_config(again) == shape
    for tsp in (1, 2, 4):
        shape.check_tsp_degree(tsp)


def test_gemma4_proportional_rope_is_transformers_own():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ds_tsp.core.tokens.rope import inv_freq

    config = transformers.Gemma4TextConfig(**{**GEMMA4, "global_head_dim": 32})
    shape = ModelShape.from_hf_config(config)
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type="full_attention")
    got = inv_freq(shape.full_rotary_dim, shape.rope_theta, shape.rope_scaling)
    assert torch.equal(got, want) and int((want == 0).sum()) == 12  # 4 of the 16 frequencies rotate


def test_a_bare_gemma4_shape_saves_as_gemma4():
    config = transformers.Gemma4TextConfig(**GEMMA4, final_logit_softcapping=15.0)
    shape = ModelShape.from_hf_config(config)
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert type(again).__name__ == "Gemma4TextConfig" and ModelShape.from_hf_config(again) == shape
    assert again.per_layer_config[1].head_dim == 16 and again.per_layer_config[0].head_dim == 8


@pytest.mark.parametrize("field, value, match", [
    ("num_kv_shared_layers", 1, "kv_shared_layers=1: layer 1 has no earlier layer of its type"),
    ("enable_moe_block", True, "enable_moe_block=True"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention='all'"),
    ("hidden_activation", "silu", "hidden_activation='silu'"),
    ("per_layer_config", {"1": {"head_dim": 16, "intermediate_size": 32}}, r"overrides \['intermediate_size'\]"),
    ("per_layer_config", {"0": {"num_key_value_heads": 1}}, "one pair for all the full layers"),
    ("per_layer_config", {"0": {"head_dim": 16}, "1": {"head_dim": 16}}, "the sliding layers' from head_dim"),
    ("vocab_size_per_layer_input", 60, "vocab_size_per_layer_input=60 < vocab_size=64"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}, "one block per layer type"),
])
def test_gemma4_refuses_what_it_does_not_compute(field, value, match):
    config = transformers.Gemma4TextConfig(**GEMMA4).to_dict()
    with pytest.raises(TSPConfigError, match=match):
        ModelShape.from_hf_config({**config, field: value})


def test_gemma4_multimodal_config_reads_as_its_text_config():
    config = transformers.Gemma4Config(text_config=GEMMA4)
    want = ModelShape.from_hf_config(transformers.Gemma4TextConfig(**GEMMA4))
    assert ModelShape.from_hf_config(config) == ModelShape.from_hf_config(config.to_dict()) == want


def test_gemma4_per_layer_inputs_split_over_ranks_and_only_tsp_plans_them():
    from ds_tsp.tools.plan import PlanInput, PlanInputError
    from ds_tsp.tools.plan.layouts import plan_layouts

    shape = ModelShape.from_hf_config(transformers.Gemma4TextConfig(**{**GEMMA4, "hidden_size_per_layer_input": 6}))
    shape.check_tsp_degree(2)
    with pytest.raises(TSPConfigError, match="per_layer_input_size=6 is not divisible by tsp=4"):
        shape.check_tsp_degree(4)
    inp = PlanInput(model=shape, seq=32, degree=2)
    assert [p.layout for p in plan_layouts(inp, ["tsp"])] == ["tsp"]  # counted exactly: tests/tools/test_plan.py
    with pytest.raises(PlanInputError, match=r"layout \['ulysses'\]: .*planned for tsp only"):
        plan_layouts(inp, ["tsp", "ulysses"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_the_embedding_scale_is_rounded_as_transformers_holds_it(dtype):
    from ds_tsp.model.modules.vocab import _in_dtype

    for hidden in (32, 640, 1152, 1536, 2304, 2560, 3840, 5376):
        value = hidden ** 0.5  # transformers: a scalar buffer made in the model's dtype
        assert _in_dtype(value, dtype) == float(torch.tensor(value, dtype=torch.float64).to(dtype)), hidden


def test_olmo3_reads_olmo3config_defaults_and_a_legacy_rope_scaling_on_the_full_layers_only():
    shape = ModelShape.from_hf_config({"model_type": "olmo3", **SIZES, "num_hidden_layers": 8})
    assert shape == ModelShape.from_hf_config(transformers.Olmo3Config(**{**SIZES, "num_hidden_layers": 8}))
    assert (shape.projection_qk_norm, shape.post_norms, shape.qk_norm, shape.rope_theta, shape.rms_norm_eps,
            shape.pad_token_id, shape.tie_word_embeddings) == (True, True, False, 500000.0, 1e-5, 1, False)
    assert shape.attention_windows == (4096, 4096, 4096, None) * 2 and shape.sliding_rope_theta == 0.0
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "attention_factor": 1.2}
    legacy = {"model_type": "olmo3", **SIZES, "num_hidden_layers": 4, "rope_theta": 5e5, "rope_scaling": yarn,
              "max_position_embeddings": 65536}
    shape = ModelShape.from_hf_config(legacy)
    config = transformers.Olmo3Config(**{k: v for k, v in legacy.items() if k != "model_type"})
    assert config.rope_parameters["sliding_attention"]["rope_type"] == "default"  # transformers' own reading
    assert shape == ModelShape.from_hf_config(config) == ModelShape.from_hf_config(config.to_dict())
    assert (shape.rope_scaling.rope_type, shape.sliding_rope_theta, shape.sliding_rope_scaling) == ("yarn", 5e5, None)
    assert shape.layer_rope(0) == "sliding" and shape.layer_rope(3) == "full"


def test_a_bare_olmo3_shape_saves_as_olmo3():
    config = transformers.Olmo3Config(**{**SIZES, "num_hidden_layers": 3}, sliding_window=5,
                                      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 1e6}})
    shape = ModelShape.from_hf_config(config)
    assert (shape.sliding_rope_theta, shape.rope_theta, shape.rope_scaling.rope_type) == (1e4, 1e6, "linear")
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert type(again).__name__ == "Olmo3Config" and ModelShape.from_hf_config(again) == shape


@pytest.mark.parametrize("field, value, match", [
    ("attention_bias", True, "attention_bias=True on a olmo3 config"),
    ("attention_dropout", 0.1, "attention_dropout=0.1"),
    ("hidden_act", "gelu", "hidden_act='gelu' on a olmo3 config"),
    ("num_experts", 8, "num_experts=8 on a olmo3 config"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0}, "rope_parameters=.* nest it"),
    ("layer_types", ["sliding_attention", "chunked_attention"], "chunked_attention"),
])
def test_olmo3_refuses_what_it_does_not_compute(field, value, match):
    config = transformers.Olmo3Config(**SIZES).to_dict()
    with pytest.raises(TSPConfigError, match=match):
        ModelShape.from_hf_config({**config, field: value})


def test_gpt_oss_reads_its_defaults_and_saves_as_gpt_oss():
    shape = ModelShape.from_hf_config({"model_type": "gpt_oss", **SIZES, "num_hidden_layers": 4,
                                       "num_local_experts": 4, "num_experts_per_tok": 2})
    assert (shape.attention_sinks, shape.qkv_bias, shape.attention_out_bias, shape.moe_biases) == (True,) * 4
    assert (shape.expert_activation, shape.moe_routing, shape.swiglu_alpha, shape.swiglu_limit) == (
        "clamped_swiglu", "topk_softmax", 1.702, 7.0)
    assert shape.attention_windows == (128, None, 128, None) and shape.moe_family == "gpt_oss"
    assert (shape.rope_theta, shape.rms_norm_eps, shape.moe_intermediate_size) == (150000.0, 1e-5, 64)
    s = shape.rope_scaling  # GptOssConfig's yarn block for a config.json that gives none
    assert (s.rope_type, s.factor, s.original_max_position_embeddings, s.truncate) == ("yarn", 32.0, 4096, False)
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert type(again).__name__ == "GptOssConfig" and ModelShape.from_hf_config(again) == shape


def test_gpt_oss_yarn_without_truncation_is_transformers_rope():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ds_tsp.core.tokens.rope import attention_scaling, inv_freq

    config = transformers.GptOssConfig(head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                       hidden_size=32)  # the released yarn block
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    shape = ModelShape.from_hf_config(config)
    assert torch.equal(inv_freq(64, shape.rope_theta, shape.rope_scaling), want)
    assert attention_scaling(shape.rope_scaling) == want_scale
    truncated = ModelShape.from_hf_config(transformers.GptOssConfig(
        head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        rope_parameters={**config.rope_parameters, "truncate": True}))
    assert not torch.equal(inv_freq(64, truncated.rope_theta, truncated.rope_scaling), want)  # truncate is read


@pytest.mark.parametrize("field, value, match", [
    ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config on a gpt_oss config: .* dequantize"),
    ("attention_dropout", 0.1, "attention_dropout=0.1"),
    ("num_local_experts", 0, "num_local_experts=0: GPT-OSS has experts on every layer"),
    ("layer_types", ["sliding_attention", "chunked_attention"], r"layer_types contains \['chunked_attention'\]"),
])
def test_gpt_oss_refuses_what_it_does_not_compute(field, value, match):
    config = {"model_type": "gpt_oss", **SIZES, "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(TSPConfigError, match=match):
        ModelShape.from_hf_config({**config, field: value})


GLM = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2)


def test_glm4_moe_reads_its_config_class_defaults_and_saves_as_glm4_moe():
    shape = ModelShape.from_hf_config({"model_type": "glm4_moe", **SIZES})  # a config.json naming only sizes
    assert shape == ModelShape.from_hf_config(transformers.Glm4MoeConfig(**SIZES))
    assert (shape.partial_rotary_factor, shape.num_experts, shape.num_experts_per_tok, shape.dense_mlp_layers,
            shape.shared_expert_intermediate_size, shape.shared_expert_gate, shape.moe_routing, shape.norm_topk_prob,
            shape.rms_norm_eps, shape.qkv_bias, shape.qk_norm, shape.output_router_logits, shape.mtp_layers) == (
        0.5, 128, 8, (0,), 1408, False, "sigmoid_grouped", True, 1e-5, False, False, False, 1)
    config = transformers.Glm4MoeConfig(**SIZES, **GLM, attention_bias=True, use_qk_norm=True, n_shared_experts=2,
                                        routed_scaling_factor=2.5, first_k_dense_replace=2, num_nextn_predict_layers=0,
                                        output_router_logits=True)  # transformers adds no aux loss: none here either
    shape = ModelShape.from_hf_config(config)
    assert (shape.qkv_bias, shape.qk_norm, shape.moe_groups, shape.moe_topk_groups, shape.routed_scaling_factor,
            shape.shared_expert_intermediate_size, shape.dense_mlp_layers, shape.moe_family) == (
        True, True, 4, 2, 2.5, 32, (0, 1), "glm4_moe")
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert type(again).__name__ == "Glm4MoeConfig" and ModelShape.from_hf_config(again) == shape


@pytest.mark.parametrize("field, value, match", [
    ("n_group", 3, "moe_groups=3 for num_experts=8"),
    ("n_group", 8, "groups of at least 2"),
    ("topk_group", 5, "moe_topk_groups=5 of moe_groups=4"),
    ("n_shared_experts", 0, "n_shared_experts=0 on a glm4_moe config"),
    ("sliding_window", 7, "sliding_window=7 on a glm4_moe config"),
    ("hidden_act", "gelu", "hidden_act='gelu' on a glm4_moe config"),
    ("attention_dropout", 0.1, "attention_dropout=0.1"),
])
def test_glm4_moe_refuses_what_it_does_not_compute(field, value, match):
    config = transformers.Glm4MoeConfig(**SIZES, **GLM).to_dict()
    with pytest.raises(TSPConfigError, match=match):
        ModelShape.from_hf_config({**config, field: value})


@pytest.mark.parametrize("field", ["qk_norm", "qkv_bias", "attn_output_gate", "fused_qkv"])
def test_the_whole_projection_qk_norm_refuses_what_it_is_not_built_with(field):
    shape = ModelShape.from_hf_config(transformers.Olmo3Config(**SIZES))
    with pytest.raises(TSPConfigError, match=f"projection_qk_norm with {field}"):
        ModelShape(**{**shape.to_dict(), "rope_scaling": shape.rope_scaling, field: True})


def test_glm4_moe_checkpoint_mtp_layers_are_skipped_as_transformers_skips_them(tmp_path):
    """GLM-4.5 checkpoints store num_nextn_predict_layers multi-token-prediction layers after the decoder's;
    transformers' causal LM does not load them and neither does TSP, while an unknown tensor elsewhere is refused."""
    import json

    from safetensors.torch import load_file, save_file

    from ds_tsp.hf import TSPForCausalLM

    directory = save_tiny_checkpoint(tmp_path / "glm", "glm4_moe")
    tensors = load_file(directory / "model.safetensors")
    save_file({**tensors, "model.layers.3.eh_proj.weight": torch.zeros(32, 64)}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
    assert torch.equal(model.tsp.full_state_dict()["model.layers.2.mlp.gate.e_score_correction_bias"],
                       tensors["model.layers.2.mlp.gate.e_score_correction_bias"].double())
    ids = torch.randint(0, 71, (1, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids, output_router_logits=True)  # as transformers: the logits, no aux loss
    assert out.aux_loss is None and [tuple(r.shape) for r in out.router_logits] == [(12, 8), (12, 8)]
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(TSPConfigError, match="model.layers.3.eh_proj.weight"):
        TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)


def test_attention_sinks_without_gpt_oss_experts_have_no_checkpoint_family():
    shape = ModelShape(**{k: v for k, v in SIZES.items() if k in ("vocab_size", "hidden_size", "intermediate_size")},
                       num_layers=2, num_heads=4, num_kv_heads=2, attention_sinks=True)
    with pytest.raises(TSPConfigError, match="attention_sinks / attention_out_bias: GPT-OSS"):
        config_dict_from_shape(shape, torch.float32)
    with pytest.raises(TSPConfigError, match="moe_biases=True.* come together, in a shape with experts"):
        ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   moe_biases=True)


def test_gemma4_multimodal_checkpoint_trains_its_language_model(tmp_path):
    """A Gemma4ForConditionalGeneration checkpoint (language model under model.language_model., a vision tower
    beside it) loads by slices as its language model: loss and gradients equal transformers' multimodal model's on
    text, and it saves as Gemma4ForCausalLM."""
    from hf_tiny import FAMILIES, init_tiny_weights_

    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.tools.hf_reference import hf_loss_and_grads, patch_float64_

    text = {k: v for k, v in FAMILIES["gemma4"].items() if k != "model_type"}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
    config = transformers.Gemma4Config(text_config={**text, "num_hidden_layers": 2, "num_attention_heads": 4},
                                       vision_config=vision, audio_config=None)
    hf = init_tiny_weights_(transformers.Gemma4ForConditionalGeneration(config).to(torch.float64))
    hf.save_pretrained(tmp_path / "mm")
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "mm", dtype=torch.float64,
                                                                     attn_implementation="sdpa")
    patch_float64_(hf)
    ids = torch.randint(0, 93, (2, 13), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = hf_loss_and_grads(hf, ids, shift(ids))
    model = TSPForCausalLM.from_pretrained(tmp_path / "mm", dtype=torch.float64)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = model.tsp.full_state_dict(grads=True)
    assert abs(float(loss.detach()) - float(ref_loss)) < 1e-12 * float(ref_loss)
    for name, grad in grads.items():
        want = ref_grads[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name]
        assert (grad - want).norm() <= 1e-10 * want.norm().clamp_min(1e-30), name
    model.save_pretrained(tmp_path / "text")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float64)
    assert type(again).__name__ == "Gemma4ForCausalLM"


def test_gemma4_kv_sharing_reads_its_source_layers_and_refuses_what_it_cannot_run(tmp_path):
    config = transformers.Gemma4TextConfig(**{**GEMMA4, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                                              "use_double_wide_mlp": True, "layer_types": [
                                                  "sliding_attention", "full_attention"] * 2})
    shape = ModelShape.from_hf_config(config)
    assert [shape.kv_source(i) for i in range(4)] == [None, None, 0, 1]
    assert [shape.exports_kv(i) for i in range(4)] == [True, True, False, False]
    assert [shape.layer_intermediate_size(i) for i in range(4)] == [64, 64, 128, 128]
    assert ModelShape.from_hf_config(config.to_dict()) == shape
    again = transformers.AutoConfig.for_model(**config_dict_from_shape(shape, torch.float32))
    assert (again.num_kv_shared_layers, again.use_double_wide_mlp) == (2, True)
    assert ModelShape.from_hf_config(again) == shape
    with pytest.raises(TSPConfigError, match="layer 2 has no earlier layer of its type"):
        ModelShape.from_hf_config({**{k: v for k, v in config.to_dict().items() if k != "per_layer_config"},
                                   "global_head_dim": 16, "layer_types": ["full_attention", "full_attention",
                                                                          "sliding_attention", "full_attention"]})
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.model.causal_lm import ShardedCausalLM

    with pytest.raises(TSPConfigError, match="kv_shared_layers=2 with activation_checkpointing"):
        ShardedCausalLM(shape, TSPComm.single(), options=TSPOptions(activation_checkpointing=True), device="meta")


def test_gemma4_kv_sharing_checkpoint_may_keep_the_projections_transformers_ignores(tmp_path):
    """Checkpoints may keep k_proj / v_proj / k_norm of the KV-sharing layers (transformers ignores them on load):
    TSP loads them alike, and still refuses any other unknown tensor."""
    from safetensors.torch import load_file, save_file

    from ds_tsp.hf import TSPForCausalLM

    directory = save_tiny_checkpoint(tmp_path / "g4", "gemma4_kv_shared")
    tensors = load_file(directory / "model.safetensors")
    extra = {"model.layers.2.self_attn.k_proj.weight": torch.zeros(16, 32),
             "model.layers.2.self_attn.k_norm.weight": torch.ones(16)}
    save_file({**tensors, **extra}, directory / "model.safetensors", metadata={"format": "pt"})
    model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)
    assert "model.layers.2.self_attn.k_proj.weight" not in model.tsp.hf_shapes()
    save_file({**tensors, "model.layers.1.self_attn.v_proj.weight": torch.zeros(16, 32)},
              directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TSPConfigError, match="model.layers.1.self_attn.v_proj.weight"):
        TSPForCausalLM.from_pretrained(directory, dtype=torch.float64)

