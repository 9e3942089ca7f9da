"""TSPOptions and the "tsp" block declare each schedule field and rule once (ds_tsp.core.config.ScheduleOptions), and
the old name of the kernel knob keeps working with one DeprecationWarning."""
from __future__ import annotations

import warnings

import pytest

from ds_tsp import TSPConfig, TSPConfigError, TSPOptions
from ds_tsp.core.config import ScheduleOptions


def test_one_declaration_of_each_schedule_field():
    assert set(TSPOptions.model_fields) == set(ScheduleOptions.model_fields)
    assert set(ScheduleOptions.model_fields) < set(TSPConfig.model_fields)
    for name, field in ScheduleOptions.model_fields.items():  # the same object: nothing re-declared
        assert TSPConfig.model_fields[name].default == field.default == TSPOptions.model_fields[name].default, name


def test_a_block_gives_the_options_it_names():
    block = {"size": 2, "kernel": "math", "keep_gathered_kv": True, "activation_checkpointing": True,
             "offload_activations": True, "lm_head_chunk_tokens": 64, "moe_dispatch": "ring"}
    options = TSPConfig(**block).options()
    assert options == TSPOptions(**{k: v for k, v in block.items() if k != "size"})
    assert TSPConfig().options() == TSPOptions()


def test_the_cross_field_rule_is_named_in_each_voice():
    with pytest.raises(TSPConfigError, match=r"^tsp\.offload_activations=true needs tsp\.activation_checkpointing=true"):
        TSPConfig(offload_activations=True)
    with pytest.raises(TSPConfigError, match=r"^TSPOptions\(offload_activations=True\) needs activation_checkpointing"):
        TSPOptions(offload_activations=True)


@pytest.mark.parametrize("bad, field", [({"lm_head_chunk_tokens": 0}, "lm_head_chunk_tokens"),
                                         ({"lm_head_chunk_tokens": True}, "lm_head_chunk_tokens"),
                                         ({"kernel": "triton"}, "kernel"), ({"moe_dispatch": "x"}, "moe_dispatch"),
                                         ({"keep_gathred_kv": True}, "keep_gathred_kv")])
def test_a_bad_option_is_one_error_naming_it(bad, field):
    with pytest.raises(TSPConfigError, match=rf"^TSPOptions\({field}[=)]"):
        TSPOptions(**bad)


def test_replace_validates_like_a_new_options():
    options = TSPOptions(activation_checkpointing=True, offload_activations=True)
    assert options.replace(keep_gathered_kv=True).keep_gathered_kv
    with pytest.raises(TSPConfigError, match="needs activation_checkpointing"):
        options.replace(activation_checkpointing=False)
    with pytest.raises(ValueError, match="frozen"):
        TSPOptions().kernel = "math"


def test_kernel_backend_is_the_old_name_of_kernel(monkeypatch):
    monkeypatch.setattr("ds_tsp.core.deprecation._warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert TSPOptions(kernel_backend="math").kernel == "math"
        assert TSPOptions(kernel_backend=None).kernel == "auto"
        assert TSPOptions(kernel="cpu_flash").kernel_backend == "cpu_flash"
        assert TSPOptions().kernel_backend is None
    moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(moved) == 2 and all("kernel" in m and "0.3.0" in m for m in moved), moved
