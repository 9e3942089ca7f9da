"""Progress of `ds-tsp bench` on stderr while it runs: the events, and the printer that shows them.

Events come from the driver (a group starts, a result is in, a --max-seq search starts or ends) and, through a queue,
from each group's rank 0 (a step of a phase, a probed length): small frozen dataclasses, picklable for the queue.

ProgressPrinter writes one line per event worth a line, prefixed with the seconds since it started, always: CI logs
read them. When stderr is a terminal it also keeps a rich progress bar under the lines: runs (or searches) done of
the total, and what is running now. `--quiet` shows neither.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from ds_tsp.tools.cli_types import MIB


@dataclass(frozen=True)
class GroupStart:
    """A layout's process group is starting, for these sequence lengths."""

    layout: str
    seqs: tuple[int, ...]
    world: int


@dataclass(frozen=True)
class Step:
    """Rank 0 of a group: step i of n of a phase ("warmup", "timed", ...); seconds None when the phase begins."""

    layout: str
    seq: int
    phase: str
    i: int
    n: int
    seconds: float | None


@dataclass(frozen=True)
class RunDone:
    """One (layout, S) result object, ok or not (runner.aggregate / runner.failure)."""

    result: dict


@dataclass(frozen=True)
class SearchStart:
    """--max-seq: one (layout, checkpointing) search begins."""

    layout: str
    checkpointing: str
    budget_bytes: int


@dataclass(frozen=True)
class Probe:
    """--max-seq, rank 0 of a group: one probed length and its peak (max over ranks)."""

    layout: str
    checkpointing: str
    seq: int
    peak_bytes: int
    budget_bytes: int


@dataclass(frozen=True)
class SearchDone:
    """--max-seq: one search's results.json row."""

    layout: str
    checkpointing: str
    row: dict


def _line(event, done: int, total: int) -> str | None:
    """The log line of an event (None: not worth one); done counts the finished runs, this one included."""
    if isinstance(event, GroupStart):
        return f"[{done}/{total}] {event.layout}: starting {event.world} rank(s) for S={list(event.seqs)}"
    if isinstance(event, Step):
        if event.seconds is None and event.i == 0:
            return f"    {event.layout} S={event.seq}: {event.phase} ..."
        if event.phase == "timed" or (event.phase == "warmup" and event.i == event.n):
            return f"    {event.layout} S={event.seq}: {event.phase} {event.i}/{event.n} ({event.seconds:.2f} s)"
        return None
    if isinstance(event, RunDone):
        r = event.result
        head = f"[{done}/{total}] {r.get('label', r['layout'])} S={r['seq']}"
        if r.get("ok"):
            extra = "" if r.get("exposed_comm_fraction") is None else \
                f", exposed comm {100 * r['exposed_comm_fraction']:.0f}%"
            return (f"{head}: ok  peak {r['peak_bytes_per_rank'] / MIB:.1f} MiB/rank, {r['step_s']:.3f} s/step, "
                    f"{r['tokens_per_s']:.0f} tokens/s{extra}")
        last = [ln for ln in str(r.get("error", "")).strip().splitlines() if ln.strip()]
        return f"{head}: FAILED  {last[-1][:200] if last else ''}"
    if isinstance(event, SearchStart):
        return (f"{event.layout} (checkpointing {event.checkpointing}): searching, budget "
                f"{event.budget_bytes / MIB:.0f} MiB/rank")
    if isinstance(event, Probe):
        verdict = "fits" if event.peak_bytes <= event.budget_bytes else "over"
        return (f"    {event.layout} (checkpointing {event.checkpointing}) S={event.seq}: peak "
                f"{event.peak_bytes / MIB:.1f} MiB/rank {verdict}")
    if isinstance(event, SearchDone):
        row = event.row
        return (f"{event.layout} (checkpointing {event.checkpointing}): max S = {row['max_seq'] or 'none'} "
                f"({row['group_wall_s']} s)" + ("" if row["ok"] else f"  {str(row['error'])[-200:]}"))
    return None


def _status(event) -> str | None:
    """What the bar says is running now (None: unchanged)."""
    if isinstance(event, GroupStart):
        return f"{event.layout}: starting {event.world} rank(s)"
    if isinstance(event, Step):
        return f"{event.layout} S={event.seq}: {event.phase} {event.i}/{event.n}"
    if isinstance(event, (SearchStart, Probe)):
        seq = f" S={event.seq}" if isinstance(event, Probe) else ""
        return f"{event.layout} (checkpointing {event.checkpointing}){seq}"
    return None


class ProgressPrinter:
    """on_event for runner.run_layouts / max_seq.run_max_seq; a context manager (the bar lives inside it).
    Thread-safe: rank 0's events arrive on the pump thread. bar None: a bar exactly when the stream is a terminal."""

    def __init__(self, total: int, stream=None, *, bar: bool | None = None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self._bar_wanted = _is_terminal(self.stream) if bar is None else bar
        self._progress = self._task = None
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def __enter__(self) -> ProgressPrinter:
        if self._bar_wanted:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]ds-tsp bench"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.description}"),
                                      console=Console(file=self.stream), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("", total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __call__(self, event) -> None:
        with self._lock:
            if isinstance(event, (RunDone, SearchDone)):
                self.done += 1
            line = _line(event, self.done, self.total)
            if line is not None:
                text = f"[{time.monotonic() - self._start:6.1f}s] {line}"
                if self._progress is not None:  # above the bar, which rich redraws below it
                    self._progress.console.print(text, markup=False, highlight=False)
                else:
                    print(text, file=self.stream, flush=True)
            if self._progress is not None:
                status = _status(event)
                self._progress.update(self._task, completed=self.done,
                                      **({} if status is None else {"description": status}))


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
