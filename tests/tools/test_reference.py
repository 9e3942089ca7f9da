"""ReferenceCausalLM == HF LlamaForCausalLM / Qwen2ForCausalLM, in loss and every parameter gradient.

To make HF a true float64 reference, the test patches (within the test only) the two places where HF narrows
float64 to float32: RMSNorm's `.to(float32)` and the rotary embedding's float32 angles (its float32 inverse
frequencies are kept: ds_tsp.core.tokens.rope computes the same ones). The loss is computed from
HF's logits in float64 (HF's loss_function upcasts with `.float()`, i.e. DOWNcasts float64); HF's own loss is
checked separately, at float32 precision, to pin the shift_labels convention.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

transformers = pytest.importorskip("transformers")

B, S = 2, 11

SHAPES = {
    "llama_gqa": ModelShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                            num_kv_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5),
    "llama_tied_mha_headdim": ModelShape(vocab_size=48, hidden_size=32, intermediate_size=40, num_layers=2,
                                         num_heads=4, num_kv_heads=4, head_dim=12, tie_word_embeddings=True),
    "llama_mqa": ModelShape(vocab_size=40, hidden_size=24, intermediate_size=32, num_layers=1, num_heads=3,
                            num_kv_heads=1),
    "qwen2_bias_gqa": ModelShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                 num_kv_heads=2, qkv_bias=True, rope_theta=1e6),
}


def hf_model(shape: ModelShape, dtype: torch.dtype):
    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                  intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                  rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps,
                  tie_word_embeddings=shape.tie_word_embeddings, hidden_act="silu", max_position_embeddings=128,
                  attn_implementation="sdpa")
    if shape.qkv_bias:
        assert shape.head_dim is None, "Qwen2Config has no head_dim"
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, head_dim=shape.dim_per_head,
                                                                       attention_bias=False, mlp_bias=False))
    return model.to(dtype)


@pytest.fixture
def hf_float64(monkeypatch):
    """Make HF Llama/Qwen2 compute in float64 end to end (patches undone after the test)."""

    def rmsnorm_forward(self, hidden_states):
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float64 if dtype == torch.float64 else torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def rotary_forward(self, x, position_ids):
        # HF's own (float32) inverse frequencies, float64 angles: what ds_tsp.core.tokens.rope computes for float64 models
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        freqs = position_ids[..., None].to(wide) * self.inv_freq.to(wide)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    for module, prefix in ((modeling_llama, "Llama"), (modeling_qwen2, "Qwen2")):
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", rmsnorm_forward)
        monkeypatch.setattr(getattr(module, f"{prefix}RotaryEmbedding"), "forward", rotary_forward)


def make_batch(shape: ModelShape, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, shape.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, shape.vocab_size, (B, S), generator=g)  # unshifted, HF `labels` convention
    labels[0, 3] = labels[1, 7] = -100
    shift_labels = torch.cat((labels[:, 1:], torch.full((B, 1), -100)), dim=1)  # target of position t
    return input_ids, labels, shift_labels


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def compare_with_hf(shape, dtype, position_offset=0):
    ref = init_weights_(ReferenceCausalLM(shape, dtype=dtype), seed=3)
    hf = hf_model(shape, dtype)
    assert set(full_state_dict(ref)) == set(hf.state_dict())
    hf.load_state_dict(full_state_dict(ref), strict=True)
    if shape.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    input_ids, labels, shift_labels = make_batch(shape)
    position_ids = torch.arange(S).expand(B, S) + position_offset

    loss = ref(input_ids, shift_labels, position_ids=position_ids)
    loss.backward()
    out = hf(input_ids=input_ids, position_ids=position_ids, labels=labels)
    hf_loss = F.cross_entropy(out.logits.flatten(0, 1).to(loss.dtype), shift_labels.flatten(), ignore_index=-100)
    hf_loss.backward()

    errors = {"loss": rel_err(loss.detach(), hf_loss.detach()),
              "hf_own_loss": rel_err(loss.detach(), out.loss.detach().to(loss.dtype))}
    ref_params, hf_params = dict(ref.named_parameters()), dict(hf.named_parameters())
    assert set(ref_params) == set(hf_params)
    for name, p in ref_params.items():
        errors[name] = rel_err(p.grad, hf_params[name].grad)
    return errors


@pytest.mark.parametrize("name", SHAPES)
def test_matches_hf_float64(name, hf_float64):
    errors = compare_with_hf(SHAPES[name], torch.float64, position_offset=5 if name == "llama_gqa" else 0)
    # HF's own loss goes through `.float()`: float32 precision, but the same shift_labels convention.
    assert errors.pop("hf_own_loss") < 1e-6
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-10, (worst, errors[worst])


def test_matches_hf_float32_unpatched():
    """Without patches HF float32 and ours agree at the float32 noise floor (same fp32 norm and rope angles): 2e-6,
    some 16 ulps of float32 over the reductions of a tiny model (2.9e-7 seen, a k_proj bias's gradient)."""
    errors = compare_with_hf(SHAPES["qwen2_bias_gqa"], torch.float32)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 2e-6, (worst, errors[worst])


def test_tied_embeddings_share_one_parameter():
    ref = ReferenceCausalLM(SHAPES["llama_tied_mha_headdim"], dtype=torch.float64)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    names = [n for n, _ in ref.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    sd = full_state_dict(ref)
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_state_dict_names():
    ref = ReferenceCausalLM(SHAPES["qwen2_bias_gqa"])
    names = set(full_state_dict(ref))
    layer = {f"model.layers.0.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    assert layer <= names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert len(names) == 3 + 2 * len(layer)


def test_full_state_dict_is_a_copy():
    ref = ReferenceCausalLM(SHAPES["llama_mqa"])
    sd = full_state_dict(ref)
    sd["model.norm.weight"].add_(1.0)
    assert not torch.equal(sd["model.norm.weight"], ref.model.norm.weight)


def test_init_is_deterministic_and_thread_independent():
    shape = SHAPES["qwen2_bias_gqa"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = full_state_dict(init_weights_(ReferenceCausalLM(shape, dtype=torch.float64), seed=7))
        torch.set_num_threads(max(2, threads))
        b = full_state_dict(init_weights_(ReferenceCausalLM(shape, dtype=torch.float64), seed=7))
    finally:
        torch.set_num_threads(threads)
    c = full_state_dict(init_weights_(ReferenceCausalLM(shape, dtype=torch.float32), seed=7))
    d = full_state_dict(init_weights_(ReferenceCausalLM(shape, dtype=torch.float64), seed=8))
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(c[name], a[name].float()), name  # same draws, rounded
        assert not torch.equal(a[name], d[name]), name
    bias = a["model.layers.1.self_attn.k_proj.bias"]
    assert bias.abs().min() > 0 and 0.01 < bias.std() < 0.04
    norm = a["model.layers.0.input_layernorm.weight"]
    assert (norm - 1).abs().max() < 0.6 and norm.std() > 0.03
    assert math.isclose(a["model.embed_tokens.weight"].std().item(), 0.02, rel_tol=0.1)


def test_loss_ignores_labels_and_handles_all_ignored():
    shape = SHAPES["llama_mqa"]
    ref = init_weights_(ReferenceCausalLM(shape, dtype=torch.float64), seed=1)
    input_ids, _, shift_labels = make_batch(shape)
    logits = ref.logits(input_ids)
    valid = shift_labels != -100
    per_token = F.cross_entropy(logits[valid], shift_labels[valid], reduction="none")
    torch.testing.assert_close(ref(input_ids, shift_labels), per_token.mean(), rtol=1e-14, atol=0)
    loss = ref(input_ids, torch.full_like(shift_labels, -100))
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="shift_labels"):
        ref(input_ids, shift_labels[:, :-1])
