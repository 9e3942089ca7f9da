"""config.json and generation_config.json survive TSPForCausalLM.save_pretrained: reloaded with plain transformers,
every config field equals the source's (token ids, max_position_embeddings, rope, windows ...), dtype excepted when
the save changes it; generation_config.json is written when the source had one (a directory's file verbatim, an
in-memory model's generation_config). D=1, in this process."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import build_tiny_model, tiny_config  # noqa: E402

from ds_tsp.hf import TSPForCausalLM  # noqa: E402

IDS = dict(max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
VOLATILE = ("_name_or_path", "transformers_version")


def _fields(directory, drop=("dtype",)) -> dict:
    values = transformers.AutoConfig.from_pretrained(directory).to_dict()
    return {k: v for k, v in values.items() if k not in (*VOLATILE, *drop)}


@pytest.mark.parametrize("family", ["llama3_tied", "qwen2_sliding", "mistral"])
def test_save_pretrained_keeps_the_source_config(tmp_path, family):
    hf = build_tiny_model(tiny_config(family, **IDS))
    hf.generation_config.max_new_tokens = 7  # a field only generation_config.json carries
    hf.save_pretrained(tmp_path / "src")
    for how, source in (("dir", str(tmp_path / "src")), ("memory", hf)):
        model = TSPForCausalLM.from_pretrained(source)
        model.save_pretrained(tmp_path / how)
        saved = _fields(tmp_path / how, drop=())
        assert saved == _fields(tmp_path / "src", drop=()), how
        assert saved["max_position_embeddings"] == 256 and saved["eos_token_id"] == 2, how
        generation = transformers.GenerationConfig.from_pretrained(tmp_path / how)
        assert generation.to_dict() == transformers.GenerationConfig.from_pretrained(tmp_path / "src").to_dict()
        assert generation.max_new_tokens == 7
    assert (tmp_path / "dir" / "generation_config.json").read_text() == \
        (tmp_path / "src" / "generation_config.json").read_text()  # a directory's file is copied verbatim


def test_saved_dtype_is_the_one_written(tmp_path):
    build_tiny_model(tiny_config("llama", **IDS)).save_pretrained(tmp_path / "src")
    model = TSPForCausalLM.from_pretrained(tmp_path / "src")
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert _fields(tmp_path / "bf16") == _fields(tmp_path / "src")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert reloaded.dtype == torch.bfloat16


def test_no_generation_config_without_a_source(tmp_path):
    model = TSPForCausalLM.from_config(tiny_config("llama"))
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    assert not (tmp_path / "out" / "generation_config.json").exists()
