"""TSPAccelerator's per-rank state (save_state / load_state outside DeepSpeed) is safetensors + JSON and loading never
unpickles: a round trip restores a model's and an Adam optimizer's state exactly (int keys, tuple betas, scalar
steps) and the next step is bit-identical; a pickle payload planted in a state directory (as the old per-rank .pt,
or in place of the safetensors file) never runs and is one TSPConfigError naming what to do. In one process, on
plain modules: the multi-rank save / resume runs are tests/cp/test_cp_fsdp.py and tests/integrations/test_accelerate.py.
"""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from ds_tsp.checkpoint.local_state import load_model_local, load_optimizer_local  # noqa: E402
from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.integrations.accelerate.accelerator import (  # noqa: E402
    convert_pickled_state,
    read_rank_state,
    write_rank_state,
)


class Payload:
    """Unpickling it creates `marker`: the proof that a file was unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    for _ in range(2):
        _step(model, optimizer)
    return model, optimizer


def _step(model, optimizer):
    optimizer.zero_grad()
    model(torch.arange(8.0).reshape(2, 4)).pow(2).sum().backward()
    optimizer.step()


def test_round_trip_is_exact_and_the_next_step_bit_identical(tmp_path):
    model, optimizer = _trained()
    write_rank_state(tmp_path, 1, [model], [optimizer])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tsp_state_rank1.json", "tsp_state_rank1.safetensors"]
    fresh, fresh_opt = _trained(seed=1)
    state = read_rank_state(tmp_path, 1, "cpu")
    load_model_local(fresh, state["models"][0])
    load_optimizer_local(fresh_opt, state["optimizers"][0])
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.9) and set(fresh_opt.state_dict()["state"]) == {0, 1, 2, 3}
    for a, b in zip(optimizer.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _step(model, optimizer)
    _step(fresh, fresh_opt)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_a_state_that_is_not_tensors_and_numbers_is_refused_at_save(tmp_path):
    model, optimizer = _trained()
    optimizer.param_groups[0]["callback"] = object()
    with pytest.raises(TSPConfigError, match=r"tsp_state_rank0\.optimizers\[0\]\.param_groups\[0\]\.callback is "
                                             r"a object: .*nothing is pickled"):
        write_rank_state(tmp_path, 0, [model], [optimizer])
    assert not (tmp_path / "tsp_state_rank0.json").exists()


def test_a_planted_pickle_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    payload = pickle.dumps(Payload(marker))
    # an earlier version's pickled state: refused by name, not opened
    (tmp_path / "tsp_state_rank0.pt").write_bytes(payload)
    with pytest.raises(TSPConfigError, match=r"tsp_state_rank0\.pt is a pickled TSPAccelerator state .* not loaded.*"
                                             r"arbitrary code.*convert_pickled_state"):
        read_rank_state(tmp_path, 0, "cpu")
    # the payload in place of the safetensors file, beside a valid record: a header error, not an unpickling
    write_rank_state(tmp_path, 1, [nn.Linear(2, 2)], [])
    (tmp_path / "tsp_state_rank1.safetensors").write_bytes(payload)
    with pytest.raises(TSPConfigError, match=r"cannot read .*tsp_state_rank1\.safetensors as safetensors"):
        read_rank_state(tmp_path, 1, "cpu")
    # and as the record: JSON only
    (tmp_path / "tsp_state_rank1.json").write_bytes(payload)
    with pytest.raises(TSPConfigError, match=r"tsp_state_rank1\.json is unreadable"):
        read_rank_state(tmp_path, 1, "cpu")
    assert not marker.exists(), "a pickle in the state directory was unpickled"
    # the control: the same bytes do run when unpickled, so the test could fail
    pickle.loads(payload)
    assert marker.exists()


def test_a_trusted_pickled_state_converts_once(tmp_path):
    model, optimizer = _trained()
    pickled = {"models": [model.state_dict()], "optimizers": [optimizer.state_dict()]}
    torch.save(pickled, tmp_path / "tsp_state_rank0.pt")
    assert [p.name for p in convert_pickled_state(tmp_path)] == ["tsp_state_rank0.pt"]
    state = read_rank_state(tmp_path, 0, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(state["models"][0].values(), model.state_dict().values()))
    assert json.loads((tmp_path / "tsp_state_rank0.json").read_text())["format"].startswith("ds_tsp-")
