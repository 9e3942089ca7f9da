"""tests/helpers/warm_python.py, the launcher the trainer tests start their worker scripts with, behaves as `python
SCRIPT` and `torchrun --standalone --nproc_per_node N SCRIPT` do for what those tests read: argv, the caller's
environment and working directory, __name__ == "__main__", the script's folder first on sys.path, torchrun's rank
variables and a working gloo group, stdout / stderr, atexit handlers, exit codes; a failing rank fails the launch
and the other ranks are stopped; a script that imports nothing new starts in well under a second."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from warm_python import python_command

SCRIPT = r'''
import atexit, json, os, sys
what = sys.argv[1]
rank = int(os.environ.get("RANK", "-1"))
if what == "report":
    import torch
    import torch.distributed as dist
    total = None
    if rank >= 0:
        dist.init_process_group("gloo")
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        total = float(t)
        dist.destroy_process_group()
    # one write per line: the ranks share one pipe (print() writes the text and its newline separately)
    sys.stdout.write(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
                                 "probe": os.environ.get("WARM_PROBE"), "rank": rank,
                                 "world": os.environ.get("WORLD_SIZE"), "local_rank": os.environ.get("LOCAL_RANK"),
                                 "total": total, "threads": torch.get_num_threads()}) + "\n")
    atexit.register(lambda: sys.stdout.write(f"atexit ran {rank}\n"))
    if rank < 0:
        sys.stdout.write("unflushed")  # written at exit, as a fresh interpreter would
elif what == "exit3":
    sys.exit(3)
elif what == "fail":
    if rank == 1:
        raise ValueError("planted failure")
    import time
    time.sleep(120)
'''


def _run(tmp_path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    return subprocess.run([*python_command(nproc), str(script), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path / "elsewhere", env={**os.environ, "WARM_PROBE": "seen"})


def test_a_script_runs_as_under_python_and_torchrun(tmp_path):
    python_command(0)  # the server is up before the clock starts
    start = time.monotonic()
    plain = _run(tmp_path, 0, "report", "x y")
    assert plain.returncode == 0, plain.stderr
    assert time.monotonic() - start < 30  # a fresh interpreter importing torch takes several seconds of CPU
    lines = plain.stdout.splitlines()
    report = json.loads(lines[0])
    assert report == {"argv": ["report", "x y"], "cwd": str(tmp_path / "elsewhere"), "name": "__main__",
                      "path0": str(tmp_path), "probe": "seen", "rank": -1, "world": None, "local_rank": None,
                      "total": None, "threads": 1}, report
    assert lines[1:] == ["unflushedatexit ran -1"], lines
    ranks = _run(tmp_path, 2, "report")
    assert ranks.returncode == 0, ranks.stderr
    reports = sorted((json.loads(line) for line in ranks.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    assert [(r["rank"], r["world"], r["local_rank"], r["total"]) for r in reports] == [(0, "2", "0", 3.0),
                                                                                      (1, "2", "1", 3.0)]
    assert ranks.stdout.count("atexit ran") == 2


def test_exit_codes_and_a_failing_rank_stop_the_launch(tmp_path):
    assert _run(tmp_path, 0, "exit3").returncode == 3
    start = time.monotonic()
    failed = _run(tmp_path, 3, "fail")
    assert failed.returncode == 1 and "ValueError: planted failure" in failed.stderr, failed.stderr
    assert time.monotonic() - start < 60, "the ranks left running were not stopped"  # they sleep 120 s


def test_the_spawn_switch_gives_the_original_commands(monkeypatch):
    monkeypatch.setenv("DS_TSP_SUITE_SPAWN", "1")
    assert python_command(0) == [sys.executable]
    assert python_command(2) == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "2"]
