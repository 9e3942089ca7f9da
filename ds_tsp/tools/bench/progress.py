"""Progress lines on stderr while the benchmark runs (one per phase change and per timed step)."""
from __future__ import annotations

import sys
import threading
import time

MIB = 2 ** 20


class ProgressPrinter:
    """Callable for runner.run_layouts(on_event=...); thread-safe (rank 0's events arrive on a pump thread)."""

    def __init__(self, total_runs: int, stream=None):
        self.total, self.done = total_runs, 0
        self.stream = stream or sys.stderr
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def _say(self, text: str) -> None:
        with self._lock:
            print(f"[{time.monotonic() - self._start:6.1f}s] {text}", file=self.stream, flush=True)

    def __call__(self, event: tuple) -> None:
        kind = event[0]
        if kind == "start":
            _, layout, seqs, world = event
            self._say(f"[{self.done}/{self.total}] {layout}: starting {world} rank(s) for S={list(seqs)}")
        elif kind == "done":
            r = event[1]
            self.done += 1
            head = f"[{self.done}/{self.total}] {r.get('label', r['layout'])} S={r['seq']}"
            if r.get("ok"):
                extra = "" if r.get("exposed_comm_fraction") is None else \
                    f", exposed comm {100 * r['exposed_comm_fraction']:.0f}%"
                self._say(f"{head}: ok  peak {r['peak_bytes_per_rank'] / MIB:.1f} MiB/rank, "
                          f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s{extra}")
            else:
                last = [ln for ln in str(r.get("error", "")).strip().splitlines() if ln.strip()]
                self._say(f"{head}: FAILED  {last[-1][:200] if last else ''}")
        else:
            layout, seq, phase, i, n, seconds = event
            if seconds is None and i == 0:
                self._say(f"    {layout} S={seq}: {phase} ...")
            elif phase == "timed" or (phase == "warmup" and i == n):
                self._say(f"    {layout} S={seq}: {phase} {i}/{n} ({seconds:.2f} s)")
