"""Keep docs/api.md equal to what the public faces export.

    python -m ds_tsp.tools.api_doc --check      # exit 1 and print a diff when docs/api.md differs from the faces
    python -m ds_tsp.tools.api_doc --write      # rewrite docs/api.md

docs/api.md has one section per public face (ds_tsp, ds_tsp.hf, ds_tsp.accelerate, ds_tsp.testing) and one entry
per name of its `__all__`, in `__all__` order: the name's kind (class, function or constant), its signature
(`inspect.signature`, where it has one) and the first paragraph of its own docstring. The text is deterministic: no
memory addresses, no absolute paths. ds_tsp.hf's trainers import transformers, accelerate and TRL, so generate it in
an environment with the test extras installed (`pip install -e ".[test,deepspeed,hf]"`). Works on a source checkout
(the repository root holds docs/), not on an installed wheel.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any

FACES = ("ds_tsp", "ds_tsp.hf", "ds_tsp.accelerate", "ds_tsp.testing")
API_DOC = "docs/api.md"
COMMAND = "python -m ds_tsp.tools.api_doc --write"
WIDE = 110  # a signature longer than this is written one parameter per line
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class FaceImportError(RuntimeError):
    """A public name could not be imported (an optional dependency is missing)."""


def default_root() -> Path:
    """The source checkout this package sits in."""
    return Path(__file__).resolve().parents[2]


def _clean(text: str) -> str:
    """Drop what differs between runs and machines: object addresses, the checkout's and the home directory's paths."""
    text = ADDRESS.sub("", text)
    text = text.replace(str(default_root()), "<checkout>")
    home = os.path.expanduser("~")
    return text.replace(home, "~") if home not in ("", "/", "~") else text


def kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "constant"


def _annotation(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _parameter(p: inspect.Parameter) -> str:
    text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
    if p.annotation is not p.empty:
        text += ": " + _annotation(p.annotation)
    if p.default is not p.empty:
        text += (" = " if p.annotation is not p.empty else "=") + repr(p.default)
    return text


def signature(name: str, obj: Any) -> str | None:
    """`name(params) -> return`, as inspect.signature gives it (string annotations unquoted); None without one."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # constants, and classes whose signature inspect cannot read
        return None
    parts, previous = [], None
    for p in sig.parameters.values():
        if previous == p.POSITIONAL_ONLY and p.kind != p.POSITIONAL_ONLY:
            parts.append("/")
        if p.kind == p.KEYWORD_ONLY and previous not in (p.KEYWORD_ONLY, p.VAR_POSITIONAL):
            parts.append("*")
        parts.append(_clean(_parameter(p)))
        previous = p.kind
    if previous == inspect.Parameter.POSITIONAL_ONLY:
        parts.append("/")
    returns = ""
    if sig.return_annotation is not sig.empty:
        returns = " -> " + _clean(_annotation(sig.return_annotation))
    one_line = f"{name}({', '.join(parts)}){returns}"
    if len(one_line) <= WIDE:
        return one_line
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


def _own_docstring(obj: Any) -> str | None:
    """The object's own docstring: a class's from its own body, never one inherited from transformers or TRL."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        if isinstance(doc, str) and doc.startswith(f"{obj.__name__}("):
            doc = None  # the signature dataclasses write as the docstring of a class without one
        if doc is None and "__init__" in obj.__dict__:  # else its own __init__'s
            doc = getattr(obj.__dict__["__init__"], "__doc__", None)
    elif callable(obj) or inspect.ismodule(obj):
        doc = getattr(obj, "__doc__", None)
    else:
        return None  # a constant's __doc__ is its type's
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def first_paragraph(obj: Any) -> str | None:
    doc = _own_docstring(obj)
    if doc is None:
        return None
    paragraph = doc.split("\n\n")[0]
    return _clean(" ".join(line.strip() for line in paragraph.splitlines()))


def _value(obj: Any) -> str:
    text = _clean(repr(obj))
    return text if len(text) <= WIDE else f"a {type(obj).__name__}"


def entry(face: str, name: str, obj: Any) -> str:
    what = kind(obj)
    lines = [f"### `{face}.{name}`", "", f"*{what}*", ""]
    sig = signature(name, obj) if what != "constant" else None
    if what == "constant":
        lines += ["```", f"{name} = {_value(obj)}", "```", ""]
    elif sig is not None:
        lines += ["```", sig, "```", ""]
    if what != "constant":
        lines.append(first_paragraph(obj) or "(no docstring)")
    return "\n".join(lines) + "\n"


def _face_objects(face: str) -> list[tuple[str, Any]]:
    module = importlib.import_module(face)
    objects = []
    for name in module.__all__:
        try:
            objects.append((name, getattr(module, name)))
        except ImportError as exc:  # TSPSFTTrainer / TSPGRPOTrainer without TRL, TSPTrainer without transformers
            raise FaceImportError(f"cannot import {face}.{name} ({exc}): docs/api.md documents every public name, so "
                                  "generate it with the test extras installed (pip install -e '.[test,deepspeed,hf]')"
                                  ) from exc
    return objects


def render() -> str:
    """docs/api.md's text, from the faces as they are imported now."""
    sections = [
        "# Public API reference\n",
        "Every name the four public faces export (their `__all__`, in that order), with its kind, its signature and "
        "the first paragraph of its docstring.\n",
        f"Generated by `{COMMAND}` from the code; do not edit by hand: tests/meta/test_api_doc.py fails when this file "
        "is stale. Every other module path is internal and may move ([python_api.md](python_api.md)).\n",
    ]
    for face in FACES:
        objects = _face_objects(face)
        summary = first_paragraph(importlib.import_module(face))
        sections.append(f"## `{face}`\n")
        if summary:
            sections.append(summary + "\n")
        sections.append(", ".join(f"[`{name}`](#{_anchor(face, name)})" for name, _ in objects) + "\n")
        sections += [entry(face, name, obj) for name, obj in objects]
    return "\n".join(sections)


def _anchor(face: str, name: str) -> str:
    """GitHub's anchor of the heading '### `face.name`': lower case, punctuation but - and _ dropped."""
    return re.sub(r"[^a-z0-9_\- ]", "", f"{face}.{name}".lower()).replace(" ", "-")


def stale_diff(root: Path) -> list[str]:
    """The unified diff from docs/api.md to what render() gives; empty when the file is current."""
    path = root / API_DOC
    current = path.read_text() if path.is_file() else ""
    fresh = render()
    if current == fresh:
        return []
    return list(difflib.unified_diff(current.splitlines(keepends=True), fresh.splitlines(keepends=True),
                                     fromfile=f"{API_DOC} (committed)", tofile=f"{API_DOC} (from the code)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 and print a diff when docs/api.md is stale")
    mode.add_argument("--write", action="store_true", help="rewrite docs/api.md from the public faces")
    parser.add_argument("--root", type=Path, default=default_root(), help="the source checkout (default: %(default)s)")
    args = parser.parse_args(argv)
    if not (args.root / "docs").is_dir():
        print(f"api_doc: error: --root {args.root} has no docs/: run it on a source checkout", file=sys.stderr)
        return 2
    try:
        if args.check:
            diff = stale_diff(args.root)
            if diff:
                sys.stdout.writelines(diff)
                print(f"api_doc: stale: {API_DOC} ({COMMAND})", file=sys.stderr)
            return 1 if diff else 0
        (args.root / API_DOC).write_text(render())
    except FaceImportError as exc:
        print(f"api_doc: error: {exc}", file=sys.stderr)
        return 2
    print(f"api_doc: wrote {API_DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
