"""Module paths of the pre-release layout, still importable: `import ds_tsp.launch` gives ds_tsp.core.parallel.launch
(the same module object, so classes and state are shared) with one DeprecationWarning naming the new import. Packages
move whole: `ds_tsp.plan.cli` is ds_tsp.tools.plan.cli. `python -m ds_tsp.cli` runs ds_tsp.tools.cli.

Prefer the public faces (ds_tsp, ds_tsp.hf, ds_tsp.accelerate, ds_tsp.testing) to any module path."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from ds_tsp.core.deprecation import warn_moved

# old module (or package) -> where it lives now; listed in CHANGELOG with the release it goes away in
MOVED_MODULES = {
    "ds_tsp.launch": "ds_tsp.core.parallel.launch",
    "ds_tsp.comm": "ds_tsp.core.comm.communicator",
    "ds_tsp.partition": "ds_tsp.core.tokens.zigzag",
    "ds_tsp.model_config": "ds_tsp.core.shape.model_shape",
    "ds_tsp.config": "ds_tsp.core.config",
    "ds_tsp.errors": "ds_tsp.core.errors",
    "ds_tsp.data": "ds_tsp.core.tokens.loader",
    "ds_tsp.topology": "ds_tsp.core.parallel.topology",
    "ds_tsp.watchdog": "ds_tsp.core.reliability.watchdog",
    "ds_tsp.kernels": "ds_tsp.core.layers.attention.kernels",
    "ds_tsp.rope": "ds_tsp.core.tokens.rope",
    "ds_tsp.nonfinite": "ds_tsp.core.reliability.nonfinite",
    "ds_tsp.document_attention": "ds_tsp.core.layers.attention.masked",
    "ds_tsp.replicated_grads": "ds_tsp.core.grads.replicated",
    "ds_tsp.layers": "ds_tsp.core.layers",
    "ds_tsp.layers.packing": "ds_tsp.core.layers.weight_packing",
    "ds_tsp.durable_io": "ds_tsp.checkpoint.safetensors.durable",
    "ds_tsp.training_checkpoint": "ds_tsp.checkpoint.training",
    "ds_tsp.modules": "ds_tsp.model.modules.decoder",
    "ds_tsp.reference": "ds_tsp.tools.reference_model",
    "ds_tsp.synthetic": "ds_tsp.tools.synthetic",
    "ds_tsp.verify": "ds_tsp.tools.verify",
    "ds_tsp.cli": "ds_tsp.tools.cli",
    "ds_tsp.plan_cli": "ds_tsp.tools.plan.cli",
    "ds_tsp.plan_recommend_cli": "ds_tsp.tools.plan.cli",
    "ds_tsp.plan": "ds_tsp.tools.plan",
    "ds_tsp.bench": "ds_tsp.tools.bench",
}


# the public faces that export what an internal module defines, for the warning's advice
_TESTING_FACE = {"ds_tsp.tools.reference_model", "ds_tsp.tools.synthetic", "ds_tsp.tools.verify"}


def advice(new: str, root_names: dict[str, str]) -> str:
    """What to import instead of a moved module: its public names from their face, else the module's new path.
    root_names: ds_tsp's public name -> its defining module."""
    import ds_tsp.testing

    if new in _TESTING_FACE:
        module = importlib.import_module(new)
        names = [n for n in ds_tsp.testing.__all__ if getattr(module, n, None) is getattr(ds_tsp.testing, n)
                 and getattr(getattr(ds_tsp.testing, n), "__module__", new) == new]
        return f"from ds_tsp.testing import {', '.join(names)}"
    names = [n for n, home in root_names.items() if home == new]
    if names:
        return f"from ds_tsp import {', '.join(names)}"
    return f"{new} (an internal module: it may move again)"


def new_name(old: str) -> str | None:
    """Where an old module path lives now (a submodule of a moved package included), or None."""
    if old in MOVED_MODULES:
        return MOVED_MODULES[old]
    head, _, tail = old.rpartition(".")
    while head:
        if head in MOVED_MODULES:
            return f"{MOVED_MODULES[head]}.{old[len(head) + 1:]}"
        head, _, _ = head.rpartition(".")
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the new module itself (no second copy), warning once."""

    def __init__(self, old: str, new: str, root_names: dict[str, str]):
        self.old, self.new, self.root_names = old, new, root_names
        self._spec = None

    def create_module(self, spec):
        warn_moved(self.old, advice(self.new, self.root_names))
        module = importlib.import_module(self.new)
        self._spec = module.__spec__  # the import system overwrites it with the alias spec: restored below
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._spec

    def get_code(self, fullname):  # runpy (python -m ds_tsp.cli) runs the new module's code as __main__
        warn_moved(self.old, "ds-tsp (the command), or python -m ds_tsp" if self.new == "ds_tsp.tools.cli"
                   else f"python -m {self.new}", as_main=True)
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)

    def is_package(self, fullname) -> bool:
        spec = importlib.util.find_spec(self.new)
        return spec.submodule_search_locations is not None


class _MovedFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root_names: dict[str, str]):
        self.root_names = root_names

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("ds_tsp."):
            return None
        new = new_name(fullname)
        if new is None or importlib.util.find_spec(new) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, new, self.root_names))


def install(root_names: dict[str, str]) -> None:
    """Put the finder first (a moved package's submodules would otherwise load twice through its __path__).
    root_names: ds_tsp's public name -> its defining module (for the warnings' advice)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder(root_names))
