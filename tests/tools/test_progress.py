"""Progress while long work runs: `ds-tsp bench`'s events and printer (lines always, a rich bar on a terminal only),
and the HF checkpoint load/save bar (global rank 0 on a terminal only; never stdout)."""
from __future__ import annotations

import io
import pickle

import pytest

from ds_tsp.checkpoint.hf.load import progress_on_rank0
from ds_tsp.tools.bench.progress import GroupStart, Probe, ProgressPrinter, RunDone, SearchDone, SearchStart, Step
from ds_tsp.tools.cli_types import MIB


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


_OK = {"layout": "tsp", "seq": 512, "ok": True, "peak_bytes_per_rank": 3 * MIB, "step_s": 0.25, "tokens_per_s": 2048,
       "exposed_comm_fraction": 0.5}
_FAILED = {"layout": "ulysses_zero3", "label": "ulysses_zero3", "seq": 512, "ok": False,
           "error": "Traceback ...\nRuntimeError: out of memory\n"}


def _lines(stream: io.StringIO) -> list[str]:
    return [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()]  # drop the "[  0.0s]" prefix


def test_events_are_frozen_and_survive_the_queue():
    event = Step("tsp", 512, "timed", 1, 3, 0.5)
    assert pickle.loads(pickle.dumps(event)) == event
    with pytest.raises(AttributeError):
        event.i = 2  # type: ignore[misc]


def test_lines_without_a_terminal_and_no_bar():
    stream = io.StringIO()
    with ProgressPrinter(2, stream) as printer:
        assert printer._progress is None  # a pipe or a CI log: lines only
        for event in (GroupStart("tsp", (512, 1024), 2), Step("tsp", 512, "warmup", 0, 1, None),
                      Step("tsp", 512, "warmup", 1, 1, 1.5), Step("tsp", 512, "timed", 1, 3, 0.25),
                      Step("tsp", 512, "other", 1, 3, 0.1), RunDone(_OK), RunDone(_FAILED)):
            printer(event)
    assert _lines(stream) == [
        "[0/2] tsp: starting 2 rank(s) for S=[512, 1024]",
        "    tsp S=512: warmup ...",
        "    tsp S=512: warmup 1/1 (1.50 s)",
        "    tsp S=512: timed 1/3 (0.25 s)",
        "[1/2] tsp S=512: ok  peak 3.0 MiB/rank, 0.250 s/step, 2048 tokens/s, exposed comm 50%",
        "[2/2] ulysses_zero3 S=512: FAILED  RuntimeError: out of memory",
    ]


def test_max_seq_lines():
    stream = io.StringIO()
    budget = 2 * MIB
    with ProgressPrinter(1, stream) as printer:
        printer(SearchStart("tsp", "none", budget))
        printer(Probe("tsp", "none", 256, MIB, budget))
        printer(Probe("tsp", "none", 512, 3 * MIB, budget))
        printer(SearchDone("tsp", "none", {"max_seq": 256, "group_wall_s": 4.2, "ok": True}))
    assert _lines(stream) == ["tsp (checkpointing none): searching, budget 2 MiB/rank",
                              "    tsp (checkpointing none) S=256: peak 1.0 MiB/rank fits",
                              "    tsp (checkpointing none) S=512: peak 3.0 MiB/rank over",
                              "tsp (checkpointing none): max S = 256 (4.2 s)"]
    assert printer.done == 1


def test_a_bar_on_a_terminal_with_the_lines_above_it():
    stream = _Terminal()
    with ProgressPrinter(1, stream) as printer:
        assert printer._progress is not None
        printer(GroupStart("tsp", (512,), 2))
        printer(RunDone(_OK))
        assert printer._progress.tasks[0].completed == 1
    text = stream.getvalue()
    assert "starting 2 rank(s)" in text and "[1/1] tsp S=512: ok" in text and "ds-tsp bench" in text


def test_checkpoint_progress_only_on_rank0_of_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    never = lambda: pytest.fail("the total is counted only for a bar that shows")  # noqa: E731
    with progress_on_rank0("loading ckpt", never) as advance:  # pytest captures stderr: not a terminal, no bar
        advance()
    assert capsys.readouterr() == ("", "")
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("RANK", "1")
    with progress_on_rank0("loading ckpt", never) as advance:  # a terminal, but not global rank 0
        advance()
    assert terminal.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    with progress_on_rank0("loading ckpt", lambda: 3) as advance:
        for _ in range(3):
            advance()
    assert "loading ckpt" in terminal.getvalue() and capsys.readouterr().out == ""
