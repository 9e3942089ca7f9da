"""Loading HF checkpoints by slices: measured host memory at D=4, dtypes, and one clear error per bad input.

Memory: a ~170 MB fp32 Llama checkpoint saved by transformers with an index (several shards). Every one of 4 ranks
measures its peak resident memory (host_memory.HostMemoryPeak: VmHWM reset at entry, anonymous and file
pages both counted) while TSPForCausalLM.from_pretrained builds the model and reads its slices. It must stay below
40% of the checkpoint (ideal: 25% for the shards); on the same rank the full-copy path (every tensor loaded, then
sharded) is measured too and needs 100%+, which shows the meter sees what it should.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import save_tiny_checkpoint, tiny_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.hf import TSPForCausalLM  # noqa: E402

BIG = dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=3, num_attention_heads=12,
           num_key_value_heads=4)


def _checkpoint_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors"))


def _measure_loading(directory: str) -> dict:
    from host_memory import HostMemoryPeak, release_free_memory
    from safetensors.torch import load_file

    from ds_tsp.core.shape.hf_config import load_config

    load_config(directory)  # imports transformers' config modules outside the measured block
    with HostMemoryPeak() as sliced:
        model = TSPForCausalLM.from_pretrained(directory, dtype=torch.float32)
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    probe = model.tsp.model.layers[1].mlp.packed_shard.detach().clone()
    del model
    release_free_memory()
    with HostMemoryPeak() as full_copy:
        files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
        full = {}
        for f in files:
            full.update({k: v.clone() for k, v in load_file(os.path.join(directory, f)).items()})
        model = TSPForCausalLM(load_config(directory), dtype=torch.float32)
        model.tsp.load_full_state_dict(full)
    assert torch.equal(model.tsp.model.layers[1].mlp.packed_shard, probe)
    return {"sliced": sliced.peak_bytes, "full_copy": full_copy.peak_bytes, "shards": shard_bytes,
            "method": sliced.method}


def test_sharded_loading_peak_host_memory_at_d4(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "big", tiny_config("llama", **BIG), max_shard_size="20MB")
    assert (directory / "model.safetensors.index.json").is_file()
    size = _checkpoint_bytes(directory)
    assert size > 150e6
    reports = run_on_local_ranks(_measure_loading, 4, str(directory), timeout_s=300)
    for rank, r in enumerate(reports):
        print(f"rank {rank}: sliced {r['sliced'] / size:.1%} of the checkpoint ({r['sliced'] / 2**20:.1f} MiB, "
              f"shards {r['shards'] / size:.1%}), full-copy path {r['full_copy'] / size:.1%} [{r['method']}]")
        assert r["sliced"] < 0.40 * size, (rank, r, size)
        assert r["full_copy"] > 1.0 * size, (rank, r, size)


def _load_and_report(directory: str, dtype) -> dict:
    model = TSPForCausalLM.from_pretrained(directory, dtype=dtype)
    return {"dtype": model.dtype, "full": model.tsp.full_state_dict()}


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_exactly(tmp_path, stored):
    directory = save_tiny_checkpoint(tmp_path / "ck", "qwen3", dtype=stored, max_shard_size="16KB")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory)
    want = hf.state_dict()
    auto = run_on_local_ranks(_load_and_report, 2, str(directory), "auto", timeout_s=120)[0]
    assert auto["dtype"] == stored  # "auto" keeps the checkpoint's dtype, as transformers 5 does
    wide = run_on_local_ranks(_load_and_report, 2, str(directory), torch.float64, timeout_s=120)[0]
    assert wide["dtype"] == torch.float64
    for name, value in want.items():
        assert torch.equal(auto["full"][name], value), name
        assert torch.equal(wide["full"][name], value.double()), name


def test_model_surface_like_hf(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama3_tied")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model = TSPForCausalLM.from_pretrained(directory)
    assert model.num_parameters() == hf.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == hf.num_parameters(exclude_embeddings=True)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.config.model_type == "llama" and model.config.rope_parameters["rope_type"] == "llama3"
    untied = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=False))
    assert TSPForCausalLM.from_pretrained(untied).num_parameters(exclude_embeddings=True) == \
        untied.num_parameters(exclude_embeddings=True)  # the lm_head counts (the Trainer's total_flos)
    from_memory = TSPForCausalLM.from_pretrained(hf)  # an in-memory HF model, as before
    for a, b in zip(model.parameters(), from_memory.parameters()):
        assert torch.equal(a, b)


# --- one clear error per bad input --------------------------------------------------------------------------

def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type='dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
])
def test_unsupported_config_fields(tmp_path, changes, field):
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama")
    _edit_config(directory, **changes)
    with pytest.raises(TSPConfigError, match=field):
        TSPForCausalLM.from_pretrained(directory)


def test_unsupported_model_type(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama")
    _edit_config(directory, model_type="gpt2")
    with pytest.raises(TSPConfigError, match="model_type='gpt2'"):
        TSPForCausalLM.from_pretrained(directory)


def test_checkpoint_shapes_that_do_not_match_the_config(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama")
    _edit_config(directory, intermediate_size=96)
    with pytest.raises(TSPConfigError, match=r"gate_proj.weight' has shape \[64, 32\] but config.json implies "
                                             r"\[96, 32\]"):
        TSPForCausalLM.from_pretrained(directory)


def test_checkpoint_with_tensors_the_config_lacks(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "ck", "qwen2")
    _edit_config(directory, model_type="llama", architectures=["LlamaForCausalLM"])  # llama has no q/k/v bias
    with pytest.raises(TSPConfigError, match=r"k_proj.bias.*is not part of the model"):
        TSPForCausalLM.from_pretrained(directory)


def test_missing_shard_file(tmp_path):
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama", max_shard_size="16KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (directory / victim).unlink()
    with pytest.raises(TSPConfigError, match=victim):
        TSPForCausalLM.from_pretrained(directory)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(TSPConfigError, match="config.json"):
        TSPForCausalLM.from_pretrained(tmp_path / "nothing")
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama")
    shutil.copytree(directory, tmp_path / "weights_only")
    (tmp_path / "weights_only" / "config.json").unlink()
    with pytest.raises(TSPConfigError, match="config.json"):
        TSPForCausalLM.from_pretrained(tmp_path / "weights_only")
