"""A misspelt "tsp" never trains silently: DeepSpeed ignores top-level keys it does not know, so `"tps": {"size": 2}`
would run as plain data parallelism with exit 0. A top-level key close to "tsp" is an error that says "did you mean
'tsp'?", in every entry point that reads a DeepSpeed config (ds_tsp.initialize, the Accelerate and HF Trainer
integrations); an unknown key inside the block names its closest allowed key."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ds_tsp.core.config import check_tsp_key, parse_tsp_config
from ds_tsp.core.errors import TSPConfigError

# real DeepSpeed top-level keys (and a few unknown ones far from "tsp"): never mistaken for it
DEEPSPEED_KEYS = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10, "optimizer": {}, "scheduler": {}, "fp16": {}, "bf16": {}, "amp": {},
                  "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, "activation_checkpointing": {},
                  "tensor_parallel": {}, "sequence_parallel_size": 1, "pipeline": {}, "wall_clock_breakdown": False,
                  "aio": {}, "flops_profiler": {}, "comms_logger": {}, "data_types": {}, "tensorboard": {},
                  "wandb": {}, "checkpoint": {}, "compile": {}, "zero_allow_untested_optimizer": True,
                  "communication_data_type": "fp32", "prescale_gradients": False, "seed": 0, "tsp": {"size": 2}}


@pytest.mark.parametrize("key", ["tps", "TSP", "Tsp", "tsp_size", "tsps", "tsp2", "tp"])
def test_a_top_level_key_close_to_tsp_is_an_error(key):
    with pytest.raises(TSPConfigError, match=rf"^\"{key}\": unknown top-level key; did you mean 'tsp'\?") as err:
        check_tsp_key({"train_batch_size": 8, key: {"size": 2}})
    assert "would train without TSP" in str(err.value)


def test_deepspeed_keys_are_not_mistaken_for_tsp():
    check_tsp_key(DEEPSPEED_KEYS)


@pytest.mark.parametrize("key, closest", [("sise", "size"), ("pipeline_stage", "pipeline_stages"),
                                          ("overlapp", "overlap"), ("time_out_s", "timeout_s"),
                                          ("moe_dispatcher", "moe_dispatch")])
def test_an_unknown_key_in_the_block_names_the_closest(key, closest):
    with pytest.raises(TSPConfigError, match=rf"^tsp\.{key}: unknown key \(did you mean '{closest}'\?\); allowed keys "
                                             r"are size, "):
        parse_tsp_config({key: 2})


def test_an_unknown_key_far_from_every_key_just_lists_them():
    with pytest.raises(TSPConfigError, match=r"^tsp\.colour: unknown key; allowed keys are size, "):
        parse_tsp_config({"colour": 2})


def test_initialize_rejects_a_misspelt_block_before_any_launch():
    pytest.importorskip("deepspeed")
    import ds_tsp
    from ds_tsp.core.shape.model_shape import ModelShape

    shape = ModelShape(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(TSPConfigError, match="did you mean 'tsp'"):
        ds_tsp.initialize(model=shape, config={"train_batch_size": 2, "tps": {"size": 2}})


def test_the_trainer_and_accelerate_integrations_reject_it_too(tmp_path):
    pytest.importorskip("transformers")
    from ds_tsp.integrations.accelerate.launch_config import _tsp_block_of
    from ds_tsp.integrations.hf_trainer import _tsp_block

    bad = {"train_batch_size": 2, "tps": {"size": 2}}
    with pytest.raises(TSPConfigError, match="did you mean 'tsp'"):
        _tsp_block(SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=bad)))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(TSPConfigError, match="did you mean 'tsp'"):
        _tsp_block_of(str(path), None)
    with pytest.raises(TSPConfigError, match="did you mean 'tsp'"):
        _tsp_block_of(None, SimpleNamespace(hf_ds_config=SimpleNamespace(config=bad)))
