"""How a script started by a launcher ends on bad input: one line, printed once, exit code 2.

    if __name__ == "__main__":
        run_main(main, "train.py")   # stdout kept for JSON lines, a TSPConfigError -> one line, exit 2

Under torchrun / the deepspeed launcher / accelerate launch every rank reads the same config and input and raises
the same TSPConfigError (input errors found while training are made to fail every rank at once). Left alone, each
rank prints its full traceback and the launcher adds its summary: 64-108 lines for one mistake. Here the message is
printed as one line, by the first rank of the node to report it (the others stay quiet), and every rank exits 2.
A rank whose error differs from the others' (say, a checkpoint file only it reads) still prints its own.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ds_tsp.core.errors import config_error_in

EXIT_USAGE = 2


def report_error(prog: str, message: str) -> None:
    """`prog: error: message` on stderr as one line; under a launcher only the first rank of this node that reports
    this same line prints it."""
    line = f"{prog}: error: {' '.join(str(message).split())}"
    if _first_to_report(line):
        print(line, file=sys.stderr, flush=True)


def _first_to_report(line: str) -> bool:
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "MASTER_PORT" in os.environ  # torchrun, deepspeed, accelerate
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or not launched:
        return True
    # The ranks of one launch on one node share their parent (the launcher: its pid and start time name this run of
    # it) and the rendezvous; a marker file named after those and the line is created by exactly one of them
    # (O_EXCL is atomic). The markers are empty files in the temp directory, one per reported error, removed an
    # hour later by the next report.
    launch = [str(os.getppid()), _start_time(os.getppid()), os.environ.get("TORCHELASTIC_RUN_ID", ""),
              os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), line]
    key = hashlib.sha256("\0".join(launch).encode()).hexdigest()[:20]
    markers = Path(tempfile.gettempdir())
    try:
        os.close(os.open(markers / f"ds_tsp-reported-{key}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # cannot tell (a read-only temp dir): printing twice beats printing nothing
        return True
    _sweep(markers)
    return True


def _sweep(markers: Path, older_than_s: float = 3600.0) -> None:
    """Remove markers of launches that ended long ago (their ranks all reported within seconds)."""
    now = time.time()
    for old in markers.glob("ds_tsp-reported-*"):
        try:
            if now - old.stat().st_mtime > older_than_s:
                old.unlink()
        except OSError:  # another rank swept it first
            pass


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), "" elsewhere: with the pid, one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def run_main(main: Callable[[], Any], prog: str, *, json_stdout: bool = True) -> NoReturn:
    """Run a launched script's `main()` and end the process: exit code main's int (0 for anything else), or 2
    after one line for a ds_tsp configuration / input error. `json_stdout`: stdout keeps only the JSON records the
    script emits (ds_tsp.tools.json_stdout); the rest goes to stderr. Ends through exit_rank (no interpreter
    finalization, where torch's gloo backend can abort); other exceptions propagate with their traceback."""
    from ds_tsp.core.parallel.launch import exit_rank

    if json_stdout:
        from ds_tsp.tools.json_stdout import reserve_stdout

        reserve_stdout()
    try:
        code = main()
    except Exception as exc:
        error = config_error_in(exc)
        if error is None:
            raise
        report_error(prog, str(error))
        # Straight out, without destroying the process group: another rank may be inside a collective with us,
        # and the launcher stops the others once one rank has exited non-zero.
        sys.stdout.flush()
        os._exit(EXIT_USAGE)
    exit_rank(code if isinstance(code, int) and not isinstance(code, bool) else 0)
