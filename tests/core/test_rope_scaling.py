"""RoPE frequencies and cos/sin equal transformers' own, rope type by rope type (float32 bit for bit)."""
from __future__ import annotations

import pytest
import torch

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.model_shape import ModelShape, RopeScaling
from ds_tsp.core.tokens.positions import longrope_inv_freqs
from ds_tsp.core.tokens.rope import rope_cos_sin

transformers = pytest.importorskip("transformers")

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0,
             "beta_slow": 1.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "truncate": False},
}


def hf_config(rope: dict | None, head_dim: int = 32, theta: float = 5000.0):
    params = {"rope_type": "default", "rope_theta": theta, **(rope or {})}
    return transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                                    max_position_embeddings=256, rope_parameters=params)


@pytest.mark.parametrize("name", ROPE)
def test_cos_sin_equal_transformers(name):
    config = hf_config(ROPE[name])
    shape = ModelShape.from_hf_config(config)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 5, 63, 64, 200, 4095]])
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(positions, shape.dim_per_head, shape.rope_theta, torch.float32, shape.rope_scaling)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin), name
    # float64 angles from the same (float32) frequencies: what the float64-patched HF reference computes
    cos64, _ = rope_cos_sin(positions, shape.dim_per_head, shape.rope_theta, torch.float64, shape.rope_scaling)
    freqs = positions[..., None].double() * rotary.inv_freq.double()
    expected = torch.cat((freqs, freqs), -1).cos() * rotary.attention_scaling
    assert torch.equal(cos64, expected), name
    if name != "default":
        plain, _ = rope_cos_sin(positions, shape.dim_per_head, shape.rope_theta, torch.float32)
        assert not torch.equal(plain, cos), f"{name} scaling changed nothing"


def test_old_style_rope_scaling_dict():
    cfg = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0, "max_position_embeddings": 512,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}}
    shape = ModelShape.from_hf_config(cfg)
    assert shape.rope_theta == 500000.0 and shape.rope_scaling.rope_type == "llama3"
    assert shape.rope_scaling == ModelShape.from_hf_config(transformers.LlamaConfig(**cfg)).rope_scaling


@pytest.mark.parametrize("rope, field", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "rope_type='longrope'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_rope_is_one_clear_error(rope, field):
    cfg = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_parameters": {"rope_theta": 1e4, **rope}}
    with pytest.raises(TSPConfigError, match=field.replace("(", r"\(")):
        ModelShape.from_hf_config(cfg)


def test_missing_llama3_keys():
    with pytest.raises(TSPConfigError, match="low_freq_factor"):
        RopeScaling(rope_type="llama3", factor=8.0)


@pytest.mark.parametrize("last_position", [15, 16, 40])  # longest 16 <= original 16: short factors; 17, 41: long
def test_longrope_switches_factors_as_transformers_does(last_position):
    """Phi-3's longrope: the frequencies follow the whole batch's longest position (transformers' max(position_ids)
    + 1 against original_max_position_embeddings), and its attention factor scales cos and sin."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.25, 1.5, 2.0], "long_factor": [1.5, 3.0, 5.0, 8.0]}
    config = transformers.Phi3Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     original_max_position_embeddings=16, rope_parameters=rope, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)
    shape = ModelShape.from_hf_config(config)
    assert shape.rope_scaling.rope_type == "longrope" and shape == ModelShape.from_hf_config(config.to_dict())
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    positions = torch.tensor([[0, 3, 9, last_position], [1, 2, 5, 7]])
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    tables = longrope_inv_freqs(shape.rotary_dim, shape.rope_theta, shape.rope_scaling)
    assert torch.equal(tables[0], rotary.original_inv_freq)  # transformers' init: the short factors

    def cos_of(rows, longest=None):
        return rope_cos_sin(rows, shape.rotary_dim, shape.rope_theta, torch.float32, shape.rope_scaling, longest,
                            tables)

    cos, sin = cos_of(positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    # a shard of the batch gets the batch's longest position from outside: the row alone would pick other factors
    alone, _ = cos_of(positions[1:])
    given, _ = cos_of(positions[1:], longest=torch.tensor(last_position + 1))
    assert torch.equal(given, hf_cos[1:])
    assert torch.equal(alone, given) == (last_position < 16)


def test_longrope_needs_one_factor_per_rotary_frequency():
    scaling = RopeScaling(rope_type="longrope", short_factor=(1.0, 2.0), long_factor=(1.0, 2.0),
                          original_max_position_embeddings=16, max_position_embeddings=64)
    with pytest.raises(TSPConfigError, match="short_factor has 2 entries: longrope needs one per rotary frequency"):
        longrope_inv_freqs(8, 10000.0, scaling)
