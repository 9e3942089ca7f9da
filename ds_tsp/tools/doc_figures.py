"""Keep the figures README.md and docs/*.md quote equal to their committed sources.

    python -m ds_tsp.tools.doc_figures --check      # exit 1, naming each block whose text differs from its source
    python -m ds_tsp.tools.doc_figures --write      # rewrite every block from its source
    python -m ds_tsp.tools.doc_figures --measure    # rerun the deterministic documented commands into docs/results/

A quoted figure lives between `<!-- figures:NAME ... -->` and `<!-- /figures:NAME -->`; `doc_figure_blocks.BLOCKS`
says which files each block is rendered from. Benchmark figures come from the `ds-tsp bench` results under
docs/bench/ (rerun the bench to change them, then --write). The demo's and `ds-tsp verify`'s outputs are
deterministic (every figure but a wall time), so --measure reruns those commands and stores their stdout as
docs/results/*.json; tests/meta/test_doc_figures.py runs them again and compares. Works on a source checkout (the
repository root holds README.md and docs/), not on an installed wheel.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ds_tsp.tools.doc_figure_blocks import BLOCKS

BLOCK = re.compile(r"<!-- figures:(?P<name>[a-z0-9-]+)(?: [^\n]*?)? -->\n(?P<body>.*?)\n<!-- /figures:(?P=name) -->",
                   re.DOTALL)
# The deterministic commands the docs show (the demo: README.md; verify: docs/cli.md): results file -> (the command
# as the docs print it, its argv here).
MEASURED = {
    "docs/results/demo_tsp2.json": ("python examples/demo_train.py", ["examples/demo_train.py"]),
    "docs/results/demo_tsp1.json": ("python examples/demo_train.py --tsp 1", ["examples/demo_train.py", "--tsp", "1"]),
    "docs/results/verify_tsp3.json": (
        "ds-tsp verify --tsp 3 --heads 6 --kv-heads 3 --hidden 96 --ffn 192 --dtype float64",
        ["-m", "ds_tsp", "verify", "--tsp", "3", "--heads", "6", "--kv-heads", "3", "--hidden", "96", "--ffn", "192",
         "--dtype", "float64"]),
}
# What CI and the README's quick start run with; launcher variables are dropped so the commands start their own ranks.
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def documents(root: Path) -> list[str]:
    """The files that may hold figures blocks: README.md and docs/*.md."""
    return ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))]


def default_root() -> Path:
    """The source checkout this package sits in."""
    return Path(__file__).resolve().parents[2]


def opening(name: str) -> str:
    sources = ", ".join(BLOCKS[name][0])
    return f"<!-- figures:{name} from {sources}; python -m ds_tsp.tools.doc_figures rewrites this block -->"


def render(name: str, root: Path) -> str:
    if name not in BLOCKS:
        raise KeyError(f"figures block {name!r} has no renderer; known blocks: {', '.join(BLOCKS)}")
    sources, renderer = BLOCKS[name]
    return renderer({path: json.loads((root / path).read_text()) for path in sources})


def blocks_in(text: str) -> list[tuple[str, str]]:
    """(name, body) of every figures block of a document, in order."""
    return [(m.group("name"), m.group("body")) for m in BLOCK.finditer(text)]


def rewrite(text: str, root: Path) -> str:
    return BLOCK.sub(lambda m: f"{opening(m.group('name'))}\n{render(m.group('name'), root)}\n"
                               f"<!-- /figures:{m.group('name')} -->", text)


def stale_blocks(root: Path) -> list[str]:
    """'file: block' for every block whose text (or opening marker) differs from what its sources render."""
    stale = []
    for doc in documents(root):
        text = (root / doc).read_text()
        for m in BLOCK.finditer(text):
            if rewrite(m.group(0), root) != m.group(0):
                stale.append(f"{doc}: {m.group('name')}")
    return stale


def run_measured(results_file: str, root: Path) -> dict:
    """Run one of MEASURED's commands from the repository root; its JSON stdout lines and wall time."""
    command, argv = MEASURED[results_file]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | ENV
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{command} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return {"command": command, "machine": f"{os.cpu_count()} CPU cores",
            "date": datetime.date.today().isoformat(), "wall_s": round(wall_s, 1),
            "stdout": [line for line in proc.stdout.splitlines() if line.startswith("{")]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when a block differs from its source")
    mode.add_argument("--write", action="store_true", help="rewrite every block from its source")
    mode.add_argument("--measure", action="store_true", help="rerun the documented deterministic commands into "
                      "docs/results/*.json, then rewrite the blocks")
    parser.add_argument("--root", type=Path, default=default_root(), help="the source checkout (default: %(default)s)")
    args = parser.parse_args(argv)
    if not (args.root / "README.md").is_file():
        print(f"doc_figures: error: --root {args.root} has no README.md: run it on a source checkout",
              file=sys.stderr)
        return 2
    if args.check:
        stale = stale_blocks(args.root)
        for entry in stale:
            print(f"doc_figures: stale: {entry} (python -m ds_tsp.tools.doc_figures --write)", file=sys.stderr)
        return 1 if stale else 0
    if args.measure:
        for results_file in MEASURED:
            result = run_measured(results_file, args.root)
            (args.root / results_file).parent.mkdir(parents=True, exist_ok=True)
            (args.root / results_file).write_text(json.dumps(result, indent=1) + "\n")
            print(f"doc_figures: wrote {results_file} ({result['wall_s']} s)")
    for doc in documents(args.root):
        path = args.root / doc
        if blocks_in(path.read_text()):
            path.write_text(rewrite(path.read_text(), args.root))
    print(f"doc_figures: blocks rewritten; {len(stale_blocks(args.root))} stale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
