"""TSPTrainer's resume_from_checkpoint refuses an HF `checkpoint-N` whose save was interrupted (no readable
trainer_state.json, which the Trainer writes last) by name, with the previous complete checkpoint to use, before the
Trainer reads anything; complete checkpoints and everything else go to the Trainer unchanged."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.integrations.trainer_resume import check_resume


def _checkpoint(root: Path, step: int, complete: bool = True, state: str | None = None) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        (path / "trainer_state.json").write_text(state if state is not None else json.dumps({"global_step": step}))
    return path


def test_an_interrupted_checkpoint_is_refused_with_the_previous_complete_one(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, state='{"global_step": 1')  # cut inside trainer_state.json: unreadable
    last = _checkpoint(tmp_path, 14, complete=False)
    (tmp_path / "checkpoint-99-tmp").mkdir()  # not the Trainer's name: transformers ignores it, so do we
    with pytest.raises(TSPConfigError) as refused:
        check_resume(True, tmp_path)
    text = str(refused.value)
    assert f"resume_from_checkpoint=True picks {last}" in text and "trainer_state.json" in text, text
    assert f"resume_from_checkpoint='{tmp_path / 'checkpoint-10'}'" in text, text  # 12 is incomplete too
    with pytest.raises(TSPConfigError, match=re.escape(f"resume_from_checkpoint='{tmp_path / 'checkpoint-12'}'")):
        check_resume(str(tmp_path / "checkpoint-12"), tmp_path)
    check_resume(str(tmp_path / "checkpoint-10"), tmp_path)  # complete: the Trainer's
    check_resume(tmp_path / "checkpoint-2", tmp_path)


def test_no_complete_checkpoint_before_it_says_so_and_other_cases_are_the_trainers(tmp_path):
    _checkpoint(tmp_path, 5, complete=False)
    with pytest.raises(TSPConfigError, match="no complete checkpoint precedes it"):
        check_resume(True, tmp_path)
    for resume in (None, False, str(tmp_path / "missing"), str(tmp_path / "checkpoint-5" / "model.safetensors")):
        check_resume(resume, tmp_path)  # the Trainer's own errors (or no resume at all)
    check_resume(True, tmp_path / "empty")  # no output_dir: the Trainer's "No valid checkpoint found"


def test_tsp_trainer_train_refuses_before_the_trainer_reads_it(tmp_path, monkeypatch):
    import transformers

    from ds_tsp.integrations.hf_trainer import TSPTrainer

    called = []
    monkeypatch.setattr(transformers.Trainer, "train", lambda self, resume=None, *a, **kw: called.append(resume))
    trainer = object.__new__(TSPTrainer)
    trainer.__dict__.update(args=SimpleNamespace(output_dir=str(tmp_path)))
    _checkpoint(tmp_path, 3)
    trainer.train(resume_from_checkpoint=True)
    _checkpoint(tmp_path, 6, complete=False)
    with pytest.raises(TSPConfigError, match="checkpoint-6.*incomplete.*checkpoint-3"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(TSPConfigError, match="checkpoint-6.*incomplete"):
        trainer.train(str(tmp_path / "checkpoint-6"))
    trainer.train(str(tmp_path / "checkpoint-3"), None, ignore_keys_for_eval=["x"])
    assert called == [True, str(tmp_path / "checkpoint-3")]
