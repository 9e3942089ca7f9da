"""GRPO without vLLM builds the generation copy in the generation dtype (bf16 under bf16 mixed precision, not the
fp32 master weights) and refuses, before anything is gathered, when rank 0's device lacks the free memory for it
(plus the KV cache), with one message naming the model size, the free memory and the options. One process (TSP 1),
the free-memory query mocked (on the CPU nothing is checked)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_tiny import tiny_config

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.integrations.trl import full_weights
from ds_tsp.integrations.trl.grpo import generation_dtype, kv_cache_bytes
from ds_tsp.model.hf_causal_lm import TSPForCausalLM


@pytest.fixture(scope="module")
def tsp_model():
    model = TSPForCausalLM(tiny_config("llama"), dtype=torch.float32)
    model.tsp.init_weights_(seed=3)
    return model


def test_the_generation_dtype_follows_mixed_precision():
    assert generation_dtype(SimpleNamespace(bf16=True, fp16=False), torch.float32) == torch.bfloat16
    assert generation_dtype(SimpleNamespace(bf16=False, fp16=True), torch.float32) == torch.float16
    assert generation_dtype(SimpleNamespace(bf16=False, fp16=False), torch.float32) == torch.float32


def test_the_copy_is_built_in_the_generation_dtype(tsp_model):
    full = dict(full_weights.stream_full_weights(tsp_model))
    with full_weights.gathered_hf_model(tsp_model, torch.device("cpu"), torch.bfloat16) as hf_model:
        params = dict(hf_model.named_parameters())
        assert {p.dtype for p in params.values()} == {torch.bfloat16}
        for name, tensor in full.items():
            assert torch.equal(params[name], tensor.to(torch.bfloat16)), name


def test_not_enough_free_memory_is_refused_before_any_gather(tsp_model, monkeypatch):
    params, size = full_weights.full_model_bytes(tsp_model.config, torch.bfloat16)
    assert size == 2 * params and params == sum(p.numel() for p in
                                                dict(full_weights.stream_full_weights(tsp_model)).values())
    gathered = []
    real_stream = full_weights.stream_full_weights
    monkeypatch.setattr(full_weights, "stream_full_weights", lambda model: gathered.append(1) or real_stream(model))
    kv = kv_cache_bytes(tsp_model.config, 8, 100, torch.bfloat16)
    cfg = tsp_model.config
    assert kv == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * 8 * 100 * 2
    monkeypatch.setattr(full_weights, "free_device_bytes", lambda device: size + kv - 1)
    with pytest.raises(TSPConfigError, match=r"gathers the whole model on TSP rank 0 .*: 0\.\d+ B parameters in "
                                             r"bfloat16 = 0\.\d+ GiB plus about 0\.\d+ GiB of KV cache for 8 "
                                             r"sequences, but cpu has 0\.\d+ GiB free\. Use vLLM server mode "
                                             r"\(use_vllm=True, vllm_mode='server'.*smaller generation batch"):
        with full_weights.gathered_hf_model(tsp_model, torch.device("cpu"), torch.bfloat16, kv,
                                            "of KV cache for 8 sequences"):
            pass
    assert not gathered  # refused before the first gather
    monkeypatch.setattr(full_weights, "free_device_bytes", lambda device: size + kv)  # it fits exactly
    with full_weights.gathered_hf_model(tsp_model, torch.device("cpu"), torch.bfloat16, kv) as hf_model:
        assert hf_model is not None
    assert gathered == [1]
