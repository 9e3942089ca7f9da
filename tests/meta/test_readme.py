"""README.md and docs/*.md as a newcomer meets them: every ```python block runs, every command line is valid, the cheap
commands run.

- The documents are README.md and docs/*.md (README first, then docs/ by name), except docs/benchmarks.md: a record
  of measured runs (shell loops over another commit's tree), whose figures tests/meta/test_doc_figures.py checks against
  their results files. A block shown on two pages (a README snippet and its page) is run and checked once.
- Python blocks run under the launch their page names: the torchrun ones together on 2 local ranks (one launch, in
  document order: the HF fine-tune, DeepSpeed, sampling, the model on raw shards), the Accelerate script with plain
  `python`. `/tmp/ft...` paths (what examples/finetune_hf.py writes) are substituted by fixtures of this test; the
  figures the docs state for a block (the raw-shards block's loss, sampling == transformers' greedy generate) are
  checked.
- Command lines (```bash blocks, `&&` chains split, `\\` continuations joined): every script and config file
  exists, every `--flag` is one the script defines, every `ds-tsp` line parses with the real parser; every ```json
  block is a valid DeepSpeed config with a "tsp" block.
- Run as written, with tiny flags added: `python examples/train.py` without a launcher, the `ds-tsp plan` lines,
  and `ds-tsp bench --max-seq` where a layout fits nothing (search stubbed: exit 0, "none", output in the cache).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = {"docs/benchmarks.md"}  # a record of measured runs: see the module docstring
FT_PATHS = re.compile(r"/tmp/ft(?:-[a-z]+)?")  # /tmp/ft (finetune_hf.py's output), /tmp/ft-tuned, /tmp/ft-accelerate
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def documents() -> dict[str, str]:
    """path -> text of every document whose blocks run: README.md first, then docs/*.md by name."""
    paths = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
    return {path: (ROOT / path).read_text() for path in paths if path not in NOT_RUN}


DOCS = documents()
ALL_TEXT = "\n".join(DOCS.values())


def fenced(language: str) -> list[tuple[str, str]]:
    """(where, body) of every ```language block, in document order; a block shown on several pages only once."""
    seen, blocks = set(), []
    for path, text in DOCS.items():
        for i, body in enumerate(re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)):
            if body not in seen:
                seen.add(body)
                blocks.append((f"{path} {language} block {i}", body))
    return blocks


def python_blocks() -> list[tuple[str, str]]:
    return fenced("python")


def command_lines() -> list[str]:
    """Every command of the ```bash blocks: continuations joined, comments dropped, `&&` chains split; each once."""
    lines = []
    for _, block in fenced("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines += [" ".join(part.split()) for part in line.split("&&")]
    return list(dict.fromkeys(lines))


# What each python block does, by a call only it makes: the launch it gets and what is checked of its output.
ROLES = {"finetune": 'save_pretrained("/tmp/ft-tuned"', "deepspeed": "ds_tsp.initialize(",
         "sampling": "logits_to_keep=1", "api": "ShardedCausalLM(", "accelerate": "TSPAccelerator"}


def role(code: str) -> str:
    (found,) = [name for name, marker in ROLES.items() if marker in code] or ["unknown"]
    return found


def substitute(text: str, paths: dict[str, str]) -> str:
    return FT_PATHS.sub(lambda m: paths[m.group(0)], text)


@pytest.fixture(scope="module")
def ft_paths(tmp_path_factory) -> dict[str, str]:
    """/tmp/ft as examples/finetune_hf.py makes it (its tiny Llama-3-style checkpoint), the rest fresh paths."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("readme")
    spec = importlib.util.spec_from_file_location("finetune_hf", ROOT / "examples" / "finetune_hf.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    finetune.tiny_llama3(str(root / "ft"))
    return {"/tmp/ft": str(root / "ft"), "/tmp/ft-tuned": str(root / "ft-tuned"),
            "/tmp/ft-accelerate": str(root / "ft-accelerate")}


def _run_blocks(blocks: list[tuple[str, str]], cwd: str) -> list[str]:
    """Body of each rank: run the blocks in one process group (as one torchrun would run each), capture stdout."""
    import torch.distributed as dist

    os.chdir(cwd)
    destroy, outputs = dist.destroy_process_group, []
    dist.destroy_process_group = lambda *args, **kwargs: None  # the harness's group outlives every block
    try:
        for name, code in blocks:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, name, "exec"), {"__name__": "__main__"})  # noqa: S102 - the docs' own code
            outputs.append(out.getvalue())
            dist.barrier()
    finally:
        dist.destroy_process_group = destroy
    return outputs


def test_every_python_block_runs(ft_paths, tmp_path):
    pytest.importorskip("deepspeed")
    from ds_tsp import run_on_local_ranks

    blocks = [(where, role(code), code) for where, code in python_blocks()]
    roles = [r for _, r, _ in blocks]
    assert sorted(roles) == sorted(ROLES), f"a new python block: give it its launch here ({blocks})"
    torchrun = [(where, substitute(code, ft_paths)) for where, r, code in blocks if r != "accelerate"]
    order = [r for r in roles if r != "accelerate"]
    assert order.index("finetune") < order.index("sampling"), order  # sampling loads what the fine-tune saved
    per_rank = run_on_local_ranks(_run_blocks, 2, torchrun, str(ROOT), timeout_s=300, env={"DS_ACCELERATOR": "cpu"})
    outputs = dict(zip(order, (list(outputs) for outputs in zip(*per_rank))))
    api, finetune, sampling, deepspeed = (outputs[r] for r in ("api", "finetune", "sampling", "deepspeed"))
    # the model on raw shards: "Both ranks print <loss>"
    claimed = re.search(r"Both ranks print ([0-9]+\.[0-9]+)", ALL_TEXT).group(1)
    assert [line.split() for line in api] == [["0", claimed], ["1", claimed]], api
    steps = [line.split() for line in finetune[0].splitlines()]
    assert len(steps) == 4 and float(steps[-1][1]) < float(steps[0][1]), finetune  # it learns
    assert (Path(ft_paths["/tmp/ft-tuned"]) / "config.json").is_file()
    # sampling: "what transformers' generate(do_sample=False) gives from /tmp/ft-tuned"
    import torch
    import transformers

    sampled = eval(sampling[0])  # noqa: S307 - the block prints a list of lists of ints
    assert sampling[0] == sampling[1] and len(sampled[0]) == 4 + 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(ft_paths["/tmp/ft-tuned"])
    hf.generation_config.eos_token_id = None  # the docs' loop does not stop at eos either
    prompt = torch.tensor([sampled[0][:4]])
    greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert greedy.tolist() == sampled
    last = [out.splitlines()[-1] for out in deepspeed]  # DeepSpeed prints a line of its own first
    assert [line.split(": loss ")[0] for line in last] == ["rank 0", "rank 1"], last  # prefixed: never one line
    losses = [float(line.split(": loss ")[1]) for line in last]
    assert losses[0] == losses[1] and losses[0] > 0  # the global loss, the same on both ranks
    # the Accelerate script, plain python: one process
    (accelerate,) = [code for _, r, code in blocks if r == "accelerate"]
    script = tmp_path / "accelerate_block.py"
    script.write_text(substitute(accelerate, ft_paths))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=ENV,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (Path(ft_paths["/tmp/ft-accelerate"]) / "model.safetensors").is_file()


def _script_and_args(command: str) -> tuple[str, list[str]] | None:
    """(script path or "ds-tsp", its arguments) of a documented command; None for setup steps."""
    words = shlex.split(command)
    if words[0] in (".", "pip") or words[:3] in (["python3", "-m", "venv"], ["python", "-m", "pytest"]):
        return None  # setup and the test suite itself
    if words[0] in ("torchrun", "deepspeed") or words[:2] == ["accelerate", "launch"]:
        words = words[2:] if words[0] == "accelerate" else words[1:]
        while words[0].startswith("--"):  # the launcher's own options (all take a value but --standalone)
            words = words[1:] if words[0] == "--standalone" else words[2:]
        words = ["python", *words]
    if words[0] == "python":
        words = words[1:]
        if words[:2] == ["-m", "ds_tsp"]:
            return "ds-tsp", words[2:]
        return words[0], words[1:]
    assert words[0] == "ds-tsp", command
    return "ds-tsp", words[1:]


def test_every_command_line_is_valid():
    from ds_tsp.tools.cli import build_parser

    checked = 0
    for command in command_lines():
        parsed = _script_and_args(command)
        if parsed is None:
            continue
        script, args = parsed
        for arg in shlex.split(command):  # configs the command names exist in the checkout
            if re.fullmatch(r"ds_configs/\S+\.(json|yaml)", arg):
                assert (ROOT / arg).is_file(), (command, arg)
        if script == "ds-tsp":
            try:
                build_parser().parse_args(args)
            except SystemExit as exc:
                raise AssertionError(f"documented command does not parse: {command}") from exc
        else:
            source = (ROOT / script).read_text()
            for flag in (a.split("=")[0] for a in args if a.startswith("--")):
                assert f'"{flag}"' in source, f"{command}: {script} has no {flag}"
        checked += 1
    assert checked >= 20, checked


def test_deepspeed_config_blocks_are_valid_tsp_configs():
    from ds_tsp.core.config import check_deepspeed_compatible, parse_tsp_config

    blocks = fenced("json")
    assert blocks
    for where, block in blocks:
        config = json.loads(block)
        assert "tsp" in config, where
        check_deepspeed_compatible(config, parse_tsp_config(config.pop("tsp")))


def test_train_example_runs_with_plain_python():
    """No launcher variables: one process, the tsp=1 reference (no mpi4py, whatever the config's size)."""
    pytest.importorskip("deepspeed")
    (command,) = [c for c in command_lines() if c.startswith("python examples/train.py")]
    args = shlex.split(command)[1:] + ["--max_steps", "2", "--seq_len", "64"]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines[1]["layout"] == {"pipe": 1, "data": 1, "tsp": 1} and "reference" in lines[0]["note"]
    assert lines[-1]["last_loss"] < lines[-1]["first_loss"]


def test_plan_commands_run(ft_paths, capsys):
    from ds_tsp.tools.cli import main

    commands = [c for c in command_lines() if c.startswith("ds-tsp plan")]
    assert len(commands) == 11, commands
    for command in commands:
        assert main(shlex.split(substitute(command, ft_paths))[1:]) == 0, command
    assert capsys.readouterr().out


def test_bench_max_seq_fitting_nothing_is_a_result(tmp_path, monkeypatch, capsys):
    """The documented --max-seq line where a layout fits nothing: exit 0, max S "none", results in the user's cache
    folder (no --out), never in the checkout. The search itself is stubbed to "every probe over the budget" (its
    measured end-to-end run is tests/tools/test_bench_max_seq.py)."""
    import ds_tsp
    from ds_tsp.tools.bench.cli import build_parser

    def nothing_fits(fn, world, cfg, budget, *args, **kwargs):
        probes = [{"seq": s, "peak_bytes_per_rank": 2 * budget, "fits": False} for s in (1024, 512, 256, 8)]
        return [{"best": None, "max_seq": None, "probes": probes, "next_probe_seq": 8,
                 "next_probe_peak_bytes": 2 * budget, "setup": ""}] * world

    launch = importlib.import_module(ds_tsp.run_on_local_ranks.__module__)  # where the bench imports it from
    monkeypatch.setattr(launch, "run_on_local_ranks", nothing_fits)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (command,) = [c for c in command_lines() if "--max-seq" in c and c.startswith("ds-tsp bench")]
    parsed = build_parser().parse_args(shlex.split(command)[2:] + ["--quiet"])
    assert parsed.run(parsed) == 0, capsys.readouterr().err[-3000:]
    out = tmp_path / "cache" / "ds_tsp" / "bench"
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 12 and all((r["max_seq"], r["fits"], r["ok"]) == (None, "none", True) for r in rows), rows
    printed = capsys.readouterr().out
    assert "| none |" in printed and str(out / "results.json") in printed


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file of the checkout, and an anchor its page has."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
