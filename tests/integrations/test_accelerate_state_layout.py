"""The layout record of TSPAccelerator.save_state, in one process (the 4-rank save / resume / refusal under cp, plain
and DeepSpeed, is in tests/cp/test_cp_fsdp.py): a matching record passes, another layout is refused naming both, a
state saved before the record existed is left to the per-rank checks, a damaged record is named; load_state finds
the directory Accelerate's automatic checkpoint naming would load (the newest by number, not by name)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("accelerate")

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.integrations.accelerate.state_layout import LAYOUT_FILE, check_layout, layout_record, write_layout  # noqa: E402


def test_layout_record_round_trip_and_refusal(tmp_path):
    saved = layout_record(tsp=2, cp=2, data=1)
    write_layout(tmp_path, saved, writer=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LAYOUT_FILE]  # the temporary file is renamed away
    check_layout(tmp_path, saved)
    with pytest.raises(TSPConfigError, match=r"ran at tsp=2 x cp=2 x data=1, this run is tsp=2 x cp=1 x data=2: .*"
                                             r"same layout only.*cp_size=2.*ds_tsp\.save_training_checkpoint"):
        check_layout(tmp_path, layout_record(tsp=2, cp=1, data=2))


def test_state_without_a_record_and_a_damaged_record(tmp_path):
    check_layout(tmp_path, layout_record(tsp=4, cp=1, data=1))  # saved before the record: nothing to compare
    (tmp_path / LAYOUT_FILE).write_text("{not json")
    with pytest.raises(TSPConfigError, match=f"{LAYOUT_FILE} is unreadable .*damaged"):
        check_layout(tmp_path, layout_record(tsp=4, cp=1, data=1))


def test_load_state_checks_the_directory_accelerate_loads(tmp_path):
    from ds_tsp.integrations.accelerate.accelerator import TSPAccelerator

    for step in (2, 10, 9):
        (tmp_path / "checkpoints" / f"checkpoint_{step}").mkdir(parents=True)
    automatic = SimpleNamespace(project_configuration=SimpleNamespace(automatic_checkpoint_naming=True),
                                project_dir=str(tmp_path))
    assert TSPAccelerator._saved_state_dir(automatic, None) == tmp_path / "checkpoints" / "checkpoint_10"
    assert TSPAccelerator._saved_state_dir(automatic, str(tmp_path / "x")) == tmp_path / "x"
    manual = SimpleNamespace(project_configuration=SimpleNamespace(automatic_checkpoint_naming=False))
    assert TSPAccelerator._saved_state_dir(manual, None) is None
