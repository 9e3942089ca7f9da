"""TSPTrainer's resume_from_checkpoint: an HF Trainer `checkpoint-N` left incomplete by an interrupted save is
refused by name, before the Trainer reads anything from it.

The Trainer writes `checkpoint-N` in place: the model (save_model), the optimizer / DeepSpeed state, the RNG states,
and `trainer_state.json` LAST (Trainer._save_checkpoint). A save that a stall or a dead peer interrupted (the
watchdog ends the ranks inside it) leaves the directory without `trainer_state.json`. `resume_from_checkpoint=True`
takes the highest-numbered `checkpoint-N` directory (transformers.trainer_utils.get_last_checkpoint, which does not
look inside), so it takes the interrupted one, and the Trainer then fails deep inside its loading with a
FileNotFoundError (or loads a half-written state first). Skipping to the newest complete one would depart from
transformers' own rule (the plain Trainer resumes from the highest number or fails), so both forms are refused with
the directory and the checkpoint to resume from instead.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ds_tsp.core.errors import TSPConfigError

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint


def is_complete(checkpoint: str | os.PathLike) -> bool:
    """The Trainer finished writing it: its trainer_state.json (written last) exists and parses."""
    path = Path(checkpoint) / TRAINER_STATE_NAME
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def _step(name: str) -> int | None:
    match = _CHECKPOINT_RE.match(name)
    return int(match.group(1)) if match else None


def previous_complete(checkpoint: str | os.PathLike) -> Path | None:
    """The newest complete `checkpoint-M` beside `checkpoint` with M below its number (None: none)."""
    checkpoint = Path(checkpoint)
    step = _step(checkpoint.name)
    try:
        siblings = [p for p in checkpoint.parent.iterdir() if p.is_dir() and _step(p.name) is not None]
    except OSError:
        return None
    earlier = sorted((p for p in siblings if step is None or _step(p.name) < step), key=lambda p: _step(p.name))
    return next((p for p in reversed(earlier) if is_complete(p)), None)


def check_resume(resume_from_checkpoint, output_dir: str | os.PathLike | None) -> None:
    """Refuse a resume_from_checkpoint (True: the Trainer's pick in output_dir; a path) that names an incomplete
    `checkpoint-N`. Anything else (None, False, no checkpoint at all, a path that is not a directory) is left to
    the Trainer's own handling."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return
    if resume_from_checkpoint is True:
        if output_dir is None or not os.path.isdir(output_dir):
            return
        from transformers.trainer_utils import get_last_checkpoint

        picked = get_last_checkpoint(output_dir)  # the Trainer's own pick, exactly
        if picked is None:
            return
        how = f"resume_from_checkpoint=True picks {picked} (the highest-numbered checkpoint-N in {output_dir})"
    else:
        picked = os.fspath(resume_from_checkpoint)
        if not os.path.isdir(picked):
            return
        how = f"resume_from_checkpoint={picked!r}"
    if is_complete(picked):
        return
    previous = previous_complete(picked)
    use = (f"resume from the previous complete checkpoint, resume_from_checkpoint={str(previous)!r}, or delete "
           f"{picked} (then resume_from_checkpoint=True picks {previous.name})" if previous is not None else
           "no complete checkpoint precedes it: delete it and train without resume_from_checkpoint")
    raise TSPConfigError(f"{how}, but that checkpoint is incomplete: it has no readable {TRAINER_STATE_NAME}, which "
                         f"the Trainer writes last, so its save was interrupted (e.g. a stalled or dead rank); {use}")
