"""The package's architecture, enforced from its imports (docs/architecture.md draws it).

Layers, bottom to top; a module may import its own layer and those below, never one above:
    core/ < checkpoint/ < model/ < integrations/ < tools/
The public facades at the package root (ds_tsp/__init__.py, __main__.py, hf.py, accelerate.py) sit above all and are
(and _moved.py, testing.py) sit above all and are imported by nobody inside the package but the root. Every import
counts, lazy ones inside functions included, for the layers and for circles: two modules that import each other,
even lazily, are one knot to untie by moving the shared piece below both.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ds_tsp"
LAYERS = ["core", "checkpoint", "model", "integrations", "tools"]
FACADES = {"ds_tsp", "ds_tsp.__main__", "ds_tsp.hf", "ds_tsp.accelerate", "ds_tsp.testing", "ds_tsp._moved"}
MAX_ROOT_ENTRIES = 15
# Inside core/, a folder is a concept; bottom to top, each imports only its own folder and those below ("" is
# core/'s root: config, errors, version, deprecation, activation offload).
CORE_FOLDERS = ["", "reliability", "comm", "parallel", "grads", "shape", "tokens", "layers"]
MAX_CORE_ROOT_MODULES = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported ds_tsp module, at module level?) for every import statement of the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "ds_tsp" or t.startswith("ds_tsp."):
                while t not in modules and "." in t:
                    t = t.rpartition(".")[0]
                found.append((t, id(node) in top_level))
    return found


def _layer(name: str) -> int:
    if name in FACADES:
        return len(LAYERS)
    return LAYERS.index(name.split(".")[1])


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for t, top in _imports(name, path, modules) if t != name and (top or not module_level_only)}
            for name, path in modules.items()}


def test_every_module_belongs_to_a_layer():
    strays = [n for n in _modules() if n not in FACADES and n.split(".")[1] not in LAYERS]
    assert not strays, f"modules outside {LAYERS}: {strays}"


def test_no_import_runs_up_a_layer():
    upward = [f"{src} -> {dst}" for src, dsts in _graph(False).items() for dst in dsts
              if src not in FACADES and (dst in FACADES or _layer(dst) > _layer(src))]
    assert not upward, "imports running up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    assert not _circles(_graph(False)), f"import circles (lazy imports included): {_circles(_graph(False))}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def _core_folder(name: str) -> int:
    parts = name.split(".")
    return CORE_FOLDERS.index(parts[2] if len(parts) > 3 else "")


def test_every_core_module_belongs_to_a_folder():
    strays = [n for n in _modules() if n.startswith("ds_tsp.core.") and len(n.split(".")) > 3
              and n.split(".")[2] not in CORE_FOLDERS]
    assert not strays, f"core modules outside {CORE_FOLDERS}: {strays}"


def test_no_core_import_runs_up_a_folder():
    core = {n for n in _modules() if n.startswith("ds_tsp.core.")}
    upward = [f"{src} -> {dst}" for src, dsts in _graph(False).items() if src in core for dst in dsts
              if dst in core and _core_folder(dst) > _core_folder(src)]
    assert not upward, "core imports running up its folders " + " < ".join(CORE_FOLDERS[1:]) + ":\n" + \
        "\n".join(sorted(upward))


def test_core_root_is_small():
    modules = sorted(p.name for p in (PACKAGE / "core").glob("*.py"))
    assert len(modules) <= MAX_CORE_ROOT_MODULES, modules


def test_package_root_is_small():
    entries = [p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"]
    assert len(entries) <= MAX_ROOT_ENTRIES, sorted(entries)


def test_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a core module importing a tool is reported."""
    fake = tmp_path / "ds_tsp"
    (fake / "core").mkdir(parents=True)
    (fake / "tools").mkdir()
    for p in ("__init__.py", "core/__init__.py", "tools/__init__.py", "tools/cli.py"):
        (fake / p).write_text("")
    (fake / "core" / "comm.py").write_text("def f():\n    from ds_tsp.tools.cli import main\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    graph = _graph(False)
    assert graph["ds_tsp.core.comm"] == {"ds_tsp.tools.cli"}
    assert _layer("ds_tsp.tools.cli") > _layer("ds_tsp.core.comm")


def test_checker_sees_a_lazy_circle(tmp_path, monkeypatch):
    """The checker itself: two modules importing each other, one of them inside a function, are a circle."""
    fake = tmp_path / "ds_tsp"
    (fake / "checkpoint").mkdir(parents=True)
    for p in ("__init__.py", "checkpoint/__init__.py"):
        (fake / p).write_text("")
    (fake / "checkpoint" / "a.py").write_text("from ds_tsp.checkpoint.b import g\n")
    (fake / "checkpoint" / "b.py").write_text("def g():\n    from ds_tsp.checkpoint.a import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _circles(_graph(False)) == [["ds_tsp.checkpoint.a", "ds_tsp.checkpoint.b"]]


def test_checker_sees_a_core_folder_running_up(tmp_path, monkeypatch):
    """The folder check itself: a comm module importing a layer is reported."""
    fake = tmp_path / "ds_tsp"
    for folder in ("core/comm", "core/layers"):
        (fake / folder).mkdir(parents=True)
    for p in ("__init__.py", "core/__init__.py", "core/comm/__init__.py", "core/layers/__init__.py",
              "core/layers/mlp.py"):
        (fake / p).write_text("")
    (fake / "core" / "comm" / "primitives.py").write_text("from ds_tsp.core.layers.mlp import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    with pytest.raises(AssertionError, match="ds_tsp.core.comm.primitives -> ds_tsp.core.layers.mlp"):
        test_no_core_import_runs_up_a_folder()
