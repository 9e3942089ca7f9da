"""The public surface: the names each face exports (a name that disappears fails here), `import ds_tsp` staying
light, and the previous release's import paths still working with one DeprecationWarning each, naming the new import.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

# The contract: add freely, never remove (a removal goes through a deprecation release, see CHANGELOG).
PUBLIC = {
    "ds_tsp": {
        "__version__", "initialize", "save_training_checkpoint", "load_training_checkpoint",
        "init_from_env", "run_on_local_ranks", "local_device", "exit_rank", "TSPComm", "ParallelLayout",
        "ProcessGroups", "TSPConfig", "TSPOptions", "parse_tsp_config", "TSPConfigError", "TSPNonFiniteError",
        "shard_batch", "TSPDataLoader", "pipeline_batches", "ModelShape", "ShardedCausalLM", "to_tsp_model",
        "load_ds_config", "shard_with_fsdp2", "clip_grad_norm_", "save_consolidated", "load_consolidated",
        "run_main", "reserve_stdout", "emit", "json_stream",
    },
    "ds_tsp.hf": {"TSPForCausalLM", "TSPTrainer", "TSPSFTTrainer", "TSPGRPOTrainer", "TSPRewardTrainer",
               "TSPRLOOTrainer"},
    "ds_tsp.accelerate": {"TSPAccelerator"},
    "ds_tsp.testing": {"ReferenceCausalLM", "full_state_dict", "init_weights_", "RepeatingPatterns", "save_tiny_llama",
                       "TOLERANCE"},
}

# import path of the previous release's README -> the object it must still give (as the public face names it)
OLD_PATHS = {
    "ds_tsp.comm.TSPComm": "ds_tsp.TSPComm",
    "ds_tsp.launch.init_from_env": "ds_tsp.init_from_env",
    "ds_tsp.launch.run_on_local_ranks": "ds_tsp.run_on_local_ranks",
    "ds_tsp.model.TSPCausalLM": "ds_tsp.ShardedCausalLM",
    "ds_tsp.model_config.ModelShape": "ds_tsp.ModelShape",
    "ds_tsp.partition.shard_batch": "ds_tsp.shard_batch",
    "ds_tsp.reference.ReferenceCausalLM": "ds_tsp.testing.ReferenceCausalLM",
    "ds_tsp.reference.full_state_dict": "ds_tsp.testing.full_state_dict",
    "ds_tsp.reference.init_weights_": "ds_tsp.testing.init_weights_",
    "ds_tsp.checkpoint.save_consolidated": "ds_tsp.save_consolidated",
    "ds_tsp.data.pipeline_batches": "ds_tsp.pipeline_batches",
    "ds_tsp.verify.TOLERANCE": "ds_tsp.testing.TOLERANCE",
    "ds_tsp.integrations.fsdp.clip_grad_norm_": "ds_tsp.clip_grad_norm_",
}


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_is_exported_and_resolves():
    for face, names in PUBLIC.items():
        module = importlib.import_module(face)
        missing = names - set(module.__all__)
        assert not missing, f"{face} lost public names {sorted(missing)}"
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{face}.{name}"
    assert {"TSPComm", "ShardedCausalLM"} <= set(dir(importlib.import_module("ds_tsp")))


def test_import_ds_tsp_stays_light():
    """The faces load what they export on first use: `import ds_tsp` brings no DeepSpeed, transformers or model."""
    code = ("import sys, ds_tsp; heavy = [m for m in ('deepspeed', 'transformers', 'accelerate', "
            "'ds_tsp.model.causal_lm') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_old_paths_are_the_same_objects_with_one_warning_each():
    """In a fresh interpreter: each old path gives the public object itself, warning once (not once per import)."""
    lines = ["import importlib, warnings", "warnings.simplefilter('always')", "seen = []",
             "with warnings.catch_warnings(record=True) as caught:", "    warnings.simplefilter('always')"]
    for old, new in OLD_PATHS.items():
        module, _, name = old.rpartition(".")
        lines.append(f"    from {module} import {name} as a")
        lines.append(f"    from {module} import {name} as b  # a second import warns no more")
        face, _, public = new.rpartition(".")
        lines.append(f"    assert a is b is getattr(importlib.import_module({face!r}), {public!r}), {old!r}")
    lines += ["for w in caught:", "    assert w.category is DeprecationWarning, w",
              "    print(f'{w.filename}|{w.message}')"]
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, env=ENV,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    warned = out.stdout.splitlines()
    old_modules = {old.rpartition(".")[0] for old in OLD_PATHS} - {"ds_tsp.model", "ds_tsp.checkpoint",
                                                                   "ds_tsp.integrations.fsdp"}
    expected = old_modules | {"ds_tsp.model.TSPCausalLM", "ds_tsp.checkpoint.save_consolidated",
                              "ds_tsp.integrations.fsdp.clip_grad_norm_"}
    said = [line.split("|", 1)[1].split(" moved:")[0] for line in warned]
    assert sorted(said) == sorted(expected), warned  # one each
    for line in warned:
        filename, message = line.split("|", 1)
        assert filename == "<string>", line  # attributed to the importing line, not importlib or ds_tsp
        assert "use " in message and "removed in ds_tsp 0.3.0" in message, line
    assert any("from ds_tsp import TSPComm" in line for line in warned)
    assert any("from ds_tsp.testing import ReferenceCausalLM, full_state_dict, init_weights_" in line
               for line in warned)


def test_old_module_is_not_loaded_twice():
    """A moved package's submodule comes from the alias too, so classes keep one identity."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("ds_tsp.plan.cli")
        launch = importlib.import_module("ds_tsp.launch")
    assert old is importlib.import_module("ds_tsp.tools.plan.cli")
    assert launch is importlib.import_module("ds_tsp.core.parallel.launch")
    assert launch.__spec__.name == "ds_tsp.core.parallel.launch"  # the module keeps its own spec


def test_python_m_old_cli_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "ds_tsp.cli", "--help"], capture_output=True, text=True, env=ENV,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "usage: ds-tsp" in out.stdout, out.stderr
    warned = [line for line in out.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(warned) == 1 and "ds_tsp.cli moved: use ds-tsp" in warned[0], out.stderr


def _run_old_readme_block(path: str) -> tuple[str, list[str]]:
    import contextlib
    import io

    import torch.distributed as dist

    out = io.StringIO()
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # the harness's group outlives the block
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
            warnings.simplefilter("default")
            exec(compile(Path(path).read_text(), path, "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        dist.destroy_process_group = destroy
    return out.getvalue(), [f"{w.category.__name__}: {w.message}" for w in caught]


def test_old_readme_script_runs_unchanged():
    """The previous README's API block, verbatim, on 2 ranks: the loss it promised, one warning per moved import."""
    from ds_tsp import run_on_local_ranks

    script = str(ROOT / "tests" / "fixtures" / "old_readme_api.py")
    per_rank = run_on_local_ranks(_run_old_readme_block, 2, script, timeout_s=300, env={"DS_ACCELERATOR": "cpu"})
    for rank, (stdout, warned) in enumerate(per_rank):
        assert stdout.split() == [str(rank), "5.5577392578125"], stdout  # the old README's figure
        moved = [w for w in warned if w.startswith("DeprecationWarning")]
        assert len(moved) == 6 and all(" moved: use " in w for w in moved), warned  # its six import lines


def _ds_tsp_imports(code: str) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ds_tsp":
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "ds_tsp"]
    return found


def test_docs_and_examples_import_only_the_faces():
    """What users copy (the Python blocks of README.md and docs/*.md, examples/) names only public faces, so no
    internal move breaks it."""
    import re

    faces = set(PUBLIC)
    sources = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.DOTALL)):
            sources[f"{doc.relative_to(ROOT)} block {i}"] = block
    assert len(sources) >= 5, sources  # README's and docs' blocks were found
    sources.update({str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))})
    inner = {name: sorted(set(_ds_tsp_imports(code)) - faces) for name, code in sources.items()}
    assert not {k: v for k, v in inner.items() if v}, inner


def test_every_moved_path_points_at_a_module_that_exists():
    """An internal regroup that drops a module a deprecated path aliases breaks `import ds_tsp.<old>` silently
    until someone imports it: every alias target must still be found."""
    from ds_tsp._moved import MOVED_MODULES

    missing = {old: new for old, new in MOVED_MODULES.items() if importlib.util.find_spec(new) is None}
    assert not missing, f"deprecated paths aliasing modules that no longer exist: {missing}"


def test_public_functions_show_their_real_signatures():
    """help() and inspect.signature on the faces' functions show their parameters, not a (*args, **kwargs) wrapper."""
    import inspect

    import ds_tsp

    wrappers = []
    for name in ds_tsp.__all__:
        value = getattr(ds_tsp, name)
        if inspect.isfunction(value):
            kinds = [p.kind for p in inspect.signature(value).parameters.values()]
            if kinds[:2] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
                wrappers.append(name)
    assert not wrappers, f"(*args, **kwargs) wrappers in the public face: {wrappers}"
    assert "config" in inspect.signature(ds_tsp.initialize).parameters
    assert "save_dir" in inspect.signature(ds_tsp.save_training_checkpoint).parameters
    assert "save_dir" in inspect.signature(ds_tsp.load_training_checkpoint).parameters
