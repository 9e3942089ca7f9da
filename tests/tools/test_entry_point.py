"""What a launched script prints: stdout keeps its JSON lines only (ds_tsp.tools.json_stdout), and a ds_tsp input
error is one line, printed once per launch, exit code 2 (ds_tsp.tools.entry_point). The examples under torchrun:
tests/meta/test_train_example.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from ds_tsp.core.errors import TSPConfigError
from ds_tsp.tools.entry_point import config_error_in, report_error


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_reserved_stdout_carries_only_the_records():
    # Python prints, a logging handler bound to sys.stdout (DeepSpeed's logger), a child process writing to fd 1
    # (a compiler DeepSpeed's op builder runs): all on stderr; the records alone on stdout.
    proc = _python("import logging, os, sys\n"
                   "from ds_tsp.tools.json_stdout import emit, reserve_stdout\n"
                   "reserve_stdout()\n"
                   "log = logging.getLogger('lib'); log.addHandler(logging.StreamHandler(sys.stdout))\n"
                   "print('noise'); log.warning('warned'); os.system('echo child')\n"
                   "emit({'step': 1}); emit({'step': 2})\n"
                   "assert reserve_stdout() is reserve_stdout()\n"
                   "emit({'step': 3})\n")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [{"step": 1}, {"step": 2}, {"step": 3}]
    for noise in ("noise", "warned", "child"):
        assert noise in proc.stderr


def test_run_main_prints_one_line_and_exits_2():
    proc = _python("from ds_tsp.core.errors import TSPConfigError\n"
                   "from ds_tsp.tools.entry_point import run_main\n"
                   "def main():\n"
                   "    try:\n"
                   "        raise TSPConfigError('tsp.size=0: must be >= 1')\n"
                   "    except TSPConfigError as e:\n"
                   "        raise RuntimeError('a library wrapped it') from e\n"
                   "run_main(main, 'script.py')\n")
    assert proc.returncode == 2
    assert proc.stderr == "script.py: error: tsp.size=0: must be >= 1\n" and proc.stdout == ""


def test_run_main_passes_other_errors_and_exit_codes_through():
    crash = _python("from ds_tsp.tools.entry_point import run_main\n"
                    "run_main(lambda: 1 / 0, 'script.py')\n")
    assert crash.returncode == 1 and "ZeroDivisionError" in crash.stderr and "Traceback" in crash.stderr
    for returned, code in (("3", 3), ("[0.5, 0.25]", 0), ("None", 0)):
        proc = _python(f"from ds_tsp.tools.entry_point import run_main\nrun_main(lambda: {returned}, 's')\n")
        assert proc.returncode == code, (returned, proc.stderr)


def test_under_a_launcher_the_line_is_printed_once(monkeypatch, capsys, tmp_path):
    # ranks of one launch share their parent (here: this process for all "ranks") and the rendezvous
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the markers
    stale = tmp_path / "ds_tsp-reported-0123"
    stale.touch()
    os.utime(stale, (0, 0))  # a marker of a launch long gone: swept by the next report
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)
    for _rank in range(2):
        report_error("train.py", "tsp.size=3: does not divide the world")
    report_error("train.py", "a message only one rank has")
    assert capsys.readouterr().err.splitlines() == ["train.py: error: tsp.size=3: does not divide the world",
                                                    "train.py: error: a message only one rank has"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)  # the next launch prints it again
    report_error("train.py", "tsp.size=3: does not divide the world")
    assert capsys.readouterr().err.count("error:") == 1
    assert not stale.exists() and len(list(tmp_path.glob("ds_tsp-reported-*"))) == 3


@pytest.mark.parametrize("world", [None, "2"])  # "2": WORLD_SIZE exported by hand, no launcher's rendezvous
def test_without_a_launcher_every_call_prints(monkeypatch, capsys, world):
    for key in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    if world:
        monkeypatch.setenv("WORLD_SIZE", world)
    report_error("ds-tsp plan", "x\n  y")
    report_error("ds-tsp plan", "x\n  y")
    assert capsys.readouterr().err == "ds-tsp plan: error: x y\n" * 2


def test_config_error_in_finds_a_wrapped_error():
    inner = TSPConfigError("bad")
    try:
        try:
            raise inner
        except TSPConfigError:
            raise KeyError("wrapped")  # noqa: B904 - implicit chaining is what is tested
    except KeyError as exc:
        assert config_error_in(exc) is inner
    assert config_error_in(ValueError("plain")) is None


@pytest.mark.parametrize("args", [["--model", "7b", "--seq", "128k", "--tsp", "8"],
                                  ["--model", "8b", "--seq", "64k", "--tsp", "8", "--num-experts", "8"]])
def test_plan_table_is_not_cut_when_piped(args):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "ds_tsp", "plan", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout, proc.stdout
    for label in ("activations GiB", "framework buffers GiB", "optimizer GiB (AdamW)", "comm / layer fwd MiB"):
        assert f"│ {label} " in proc.stdout, label
    assert "bwd)" in proc.stdout  # the transients' phase, e.g. "(attention_bwd)", whole
