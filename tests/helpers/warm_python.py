"""Worker scripts started as forks of one pre-imported interpreter instead of fresh `python` / `torchrun` processes.

The trainer tests run their worker (the test file itself, or an example) as `python FILE ...` for the plain
reference and `python -m torch.distributed.run --standalone --nproc_per_node N FILE ...` for the TSP runs. Each of
those processes imports torch, transformers, DeepSpeed, TRL, datasets and ds_tsp before its first line: ~8 s of CPU
per rank on the suite's machine (2.4 s more for torchrun's own agent), several times per test, on 2 cores.
`python_command(nproc)` returns the argv prefix that replaces them: a small client (this file, run as a script) asks
the session's server, which imported PRELOAD once, to fork one child per rank. Each child is a new process (its own
pid, gloo group, RNG, memory) that installs what a fresh interpreter would have had -- the caller's environment, its
working directory, stdin/stdout/stderr, sys.argv, sys.path[0] = the script's folder and the PYTHONPATH entries --
and runs the script as __main__; it then exits as the interpreter would (see _exit_as_python).
With nproc >= 1 the client is the launcher: torchrun's variables per rank (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR / MASTER_PORT, TORCHELASTIC_*), rank 0 hosting the store; when a
rank fails the others are killed and the client exits non-zero, as torchrun does; killing the client kills its ranks.
nproc = 0 is plain `python FILE`.

Tests of the launchers themselves (examples/train.py under torchrun, the README's command lines, test_launch.py)
keep the real commands. DS_TSP_SUITE_SPAWN=1 (the switch local_ranks.py also reads) makes python_command() return
the original commands, to rule the server out when a worker misbehaves and to time the difference.
A helper module, not a test file.
"""
from __future__ import annotations

import array
import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Imported once, in the server. A module that is missing or fails to import is skipped (its workers import it then).
PRELOAD = ["torch", "torch.distributed", "numpy", "safetensors.torch", "tokenizers", "transformers", "deepspeed",
           "accelerate", "datasets", "peft", "ds_tsp", "ds_tsp.hf", "ds_tsp.testing", "ds_tsp.model.causal_lm",
           "transformers.trainer", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.mixtral.modeling_mixtral",
           "trl", "trl.trainer.sft_trainer", "trl.trainer.grpo_trainer", "trl.trainer.dpo_trainer",
           "trl.trainer.rloo_trainer", "trl.trainer.reward_trainer"]
_SERVER: dict = {}


def _recv_message(conn: socket.socket, with_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One newline-ended JSON message (and up to with_fds file descriptors sent with its first byte)."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        if with_fds and not fds:
            chunk, got, _, _ = socket.recv_fds(conn, 1 << 16, with_fds)
            fds = list(got)
        else:
            chunk = conn.recv(1 << 16)
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


# --- the server ----------------------------------------------------------------------------------------------
def _child(request: dict, fds: list[int], closing: list[socket.socket]) -> None:
    """In the forked child: become what `python SCRIPT ARGS` with the request's environment would have been."""
    import runpy

    for s in closing:
        s.close()
    os.setsid()  # one process group per rank: the server kills it whole when its client goes away
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _stdout_as_python(request.get("unbuffered", False) or bool(os.environ.get("PYTHONUNBUFFERED")))
    if "OMP_NUM_THREADS" in os.environ:  # read by torch when it loaded, in the server
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    argv = request["argv"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:1] = [os.getcwd(), *extra]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
        runpy.run_path(argv[0], run_name="__main__")


def _stdout_as_python(unbuffered: bool) -> None:
    """sys.stdout as `python [-u]` builds it for the child's fd 1 (the server's was built for its log file):
    unbuffered under -u (what torchrun passes its workers) or PYTHONUNBUFFERED, else block-buffered (line-buffered
    on a terminal). Two ranks writing JSON lines to one pipe interleave whole lines only when unbuffered."""
    import io

    old = sys.stdout
    old.flush()
    raw = io.FileIO(1, "w", closefd=False)
    if unbuffered:
        sys.stdout = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True)
    else:
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(raw), encoding=old.encoding, errors=old.errors,
                                      line_buffering=raw.isatty())


def _exit_as_python(request: dict, fds: list[int], closing: list[socket.socket]) -> None:
    """Runs the child and exits as the interpreter would: its exit code (1 and the traceback for an exception), the
    non-daemon threads joined, the atexit handlers run, stdout / stderr flushed. What is then skipped is the
    teardown of every module (seconds with this heap on a loaded machine), as multiprocessing's children skip it."""
    import atexit
    import threading
    import traceback

    code = 0
    try:
        _child(request, fds, closing)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # what Py_FinalizeEx does first
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def serve(path: str) -> None:
    """Preloads, then forks one child per request until the parent (the pytest session) is gone."""
    import gc
    import importlib
    import warnings

    parent = os.getppid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a worker that needs it imports it (and fails) itself
                pass
    # The preloaded objects live as long as any child: out of the collector's sight, a child's collections (its
    # interpreter's final ones above all, ~7 s with this heap on a loaded machine) no longer walk them.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client connects only once the server is ready
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while os.getppid() == parent:
        readable, _, _ = select.select([listener, *children.values()], [], [], 0.05)
        for conn in readable:
            if conn is listener:
                conn, _ = listener.accept()
                request, fds = _recv_message(conn, with_fds=3)
                if request is None:
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _exit_as_python(request, fds, [listener, conn, *children.values()])
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                _send(conn, {"pid": pid})
            else:  # a client hung up (or was killed): its rank goes too
                pid = next(p for p, c in children.items() if c is conn)
                if not conn.recv(1):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- the client ----------------------------------------------------------------------------------------------
def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"warm-{os.getpid()}", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


def client(path: str, nproc: int, argv: list[str]) -> int:
    """Starts max(nproc, 1) ranks of argv through the server; the first non-zero exit code (0 when all exit 0).
    A leading -u (torchrun's workers get one, see python_exec()) is python's; torchrun's ranks run with it too."""
    unbuffered = nproc > 0 or argv[:1] == ["-u"]
    argv = argv[1:] if argv[:1] == ["-u"] else argv
    port = 0
    if nproc:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    conns = []
    for rank in range(max(nproc, 1)):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        env = {**os.environ, **(_rank_env(rank, nproc, port) if nproc else {})}
        message = (json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "unbuffered": unbuffered}) + "\n"
                   ).encode()
        conn.sendmsg([message[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        conn.sendall(message[1:])
        reply, _ = _recv_message(conn)
        assert reply is not None and "pid" in reply, "the warm_python server went away"
        conns.append(conn)
    codes: dict[socket.socket, int] = {}
    while len(codes) < len(conns):
        readable, _, _ = select.select([c for c in conns if c not in codes], [], [])
        for conn in readable:
            reply, _ = _recv_message(conn)
            codes[conn] = -signal.SIGKILL if reply is None else reply["returncode"]
            if codes[conn] != 0:  # as torchrun: one rank failed, the others are stopped
                for other in conns:
                    if other not in codes:
                        other.close()
                        codes[other] = -signal.SIGKILL
    failed = [codes[c] for c in conns if codes[c] != 0]
    return 0 if not failed else (failed[0] if failed[0] > 0 else 1)


# --- what the tests call -------------------------------------------------------------------------------------
def _server_path() -> str:
    """The session's server socket, started on the first call (from the pytest process: the server exits with
    it)."""
    if "path" in _SERVER:
        return _SERVER["path"]
    folder = tempfile.mkdtemp(prefix="ds_tsp_warm_")
    if len(folder) > 80 and os.path.isdir("/tmp"):  # a unix socket's path is limited to ~107 bytes
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="ds_tsp_warm_", dir="/tmp")
    path = os.path.join(folder, "server.sock")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    log = open(os.path.join(folder, "server.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path], env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

    def stop() -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()  # the server's CPU and its ranks' is counted in the session's (time -v, rusage)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        assert proc.poll() is None, f"the warm_python server exited: {open(log.name).read()[-3000:]}"
        assert time.monotonic() < deadline, "the warm_python server did not start"
        time.sleep(0.05)
    _SERVER["path"] = path
    return path


def python_exec() -> dict[str, str]:
    """Environment for a launcher built on torch.distributed.run (`accelerate launch`): its workers, started as
    `$PYTHON_EXEC -u SCRIPT ...` with the launcher's rank variables, fork from the server too. Empty (the launcher
    starts fresh interpreters) under DS_TSP_SUITE_SPAWN=1."""
    if os.environ.get("DS_TSP_SUITE_SPAWN") == "1":
        return {}
    path = _server_path()
    wrapper = os.path.join(os.path.dirname(path), "python")
    if not os.path.exists(wrapper):
        with open(wrapper + ".tmp", "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(__file__)}" --socket "{path}" --nproc 0 '
                    '"$@"\n')
        os.chmod(wrapper + ".tmp", 0o755)
        os.rename(wrapper + ".tmp", wrapper)
    return {"PYTHON_EXEC": wrapper}


def python_command(nproc: int = 0, fresh: bool = False) -> list[str]:
    """The argv prefix that runs `PREFIX SCRIPT ARGS...` as `python SCRIPT ARGS` (nproc 0) or as `torchrun
    --standalone --nproc_per_node NPROC SCRIPT ARGS` (nproc >= 1), forked from the session's server (see above).
    fresh: those very commands. For a run whose wrapper must act before the libraries are imported (traced_run.py:
    modules imported inside dist_trace's `traced` bind its wrappers, the server's were imported before it)."""
    if fresh or os.environ.get("DS_TSP_SUITE_SPAWN") == "1":
        return [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]
    return [sys.executable, os.path.abspath(__file__), "--socket", _server_path(), "--nproc", str(nproc)]


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        assert sys.argv[1] == "--socket" and sys.argv[3] == "--nproc", sys.argv
        sys.exit(client(sys.argv[2], int(sys.argv[4]), sys.argv[5:]))
