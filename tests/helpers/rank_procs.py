"""Rank processes started as on separate nodes: plain Popen with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT, stdout and stderr to files (no pipe can fill and block a rank). A helper module, not a test file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Ranks:
    def __init__(self, tmp_path: Path, world: int, argv: list[str], env: dict | None = None, tag: str = "rank"):
        from ds_tsp.core.parallel.launch import free_port

        port = free_port()
        self.tmp, self.tag, self.procs, self.files = tmp_path, tag, [], []
        for r in range(world):
            rank_env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                        "DS_ACCELERATOR": "cpu",
                        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})}
            out, err = open(self._path(r, "out"), "w"), open(self._path(r, "err"), "w")
            self.files += [out, err]
            self.procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=out, stderr=err,
                                               cwd=REPO, start_new_session=True))

    def _path(self, r: int, kind: str) -> Path:
        return self.tmp / f"{self.tag}{r}.{kind}"

    def out(self, r: int) -> str:
        return self._path(r, "out").read_text()

    def err(self, r: int) -> str:
        return self._path(r, "err").read_text()

    def wait_for(self, text: str, ranks: list[int] | None = None, deadline_s: float = 120) -> None:
        """Until every rank in `ranks` (default all) printed `text` on stdout; fails if one exits first."""
        ranks = list(range(len(self.procs))) if ranks is None else ranks
        deadline = time.monotonic() + deadline_s
        while not all(text in self.out(r) for r in ranks):
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            assert not dead, f"rank {dead[0]} exited early ({self.procs[dead[0]].returncode}):\n{self.err(dead[0])[-3000:]}"
            assert time.monotonic() < deadline, f"ranks did not print {text!r}:\n{self.err(ranks[0])[-3000:]}"
            time.sleep(0.02)

    def wait_exit(self, r: int, limit_s: float) -> float | None:
        """Seconds until rank r exited, or None if it is still running after limit_s."""
        start = time.monotonic()
        while self.procs[r].poll() is None:
            if time.monotonic() - start > limit_s:
                return None
            time.sleep(0.02)
        return time.monotonic() - start

    def wait_all(self, limit_s: float) -> list[int]:
        for r in range(len(self.procs)):
            assert self.wait_exit(r, limit_s) is not None, f"rank {r} still running after {limit_s} s"
        return [p.returncode for p in self.procs]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)

    def cleanup(self) -> None:
        """SIGCONT, SIGKILL and reap every process started, whatever the assertions did."""
        for p in self.procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                pass
        for f in self.files:
            f.close()


def survivor_reports_the_stall(ranks: Ranks, limit_s: float, stalling: int = 1) -> tuple[str, float]:
    """Rank `stalling` (1, or 0 where only the root's peer waits, e.g. a broadcast from rank 0) prints STALLING and
    stalls; the other rank must exit within limit_s with the watchdog's exit code, one line of its report on
    stderr and never "NOT STALLED" on stdout. (that line, seconds the survivor took); cleans up."""
    from ds_tsp.core.reliability.stall_message import MESSAGE_PREFIX
    from ds_tsp.core.reliability.watchdog import EXIT_CODE

    survivor = 1 - stalling
    try:
        ranks.wait_for("STALLING", ranks=[stalling], deadline_s=180)
        took = ranks.wait_exit(survivor, limit_s)
        err = ranks.err(survivor)
        assert took is not None, f"rank {survivor} still waits {limit_s} s after rank {stalling} stalled:\n" \
                                 f"{err[-3000:]}"
        assert ranks.procs[survivor].returncode == EXIT_CODE, err
        messages = [line for line in err.splitlines() if line.startswith(MESSAGE_PREFIX)]
        assert len(messages) == 1, err
        assert "NOT STALLED" not in ranks.out(survivor)
        return messages[0], took
    finally:
        ranks.cleanup()
