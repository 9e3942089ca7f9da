"""Device-correct by construction: a training step creates every tensor on its input's device.

Run on the `meta` device (no values, no kernels), a step of TSPForCausalLM must never create a tensor anywhere
else: a CPU tensor in a CUDA step is either a crash ("Expected all tensors to be on the same device") or a hidden
host-to-device copy. The recorder below sees every aten op's outputs (forward and autograd's backward) and every
tensor made from host data (torch.tensor / as_tensor of lists or numbers, which dispatch nothing on meta). Value
reads raise on meta by themselves, so the same run also proves the input checks skip them there.

D=1 runs every family (Llama-3 rope, Qwen2 bias, Qwen3 q/k norms, Mistral sliding window, tied and untied heads)
plus packed documents, padding and logits_to_keep; GLM-4.5's experts (grouped sigmoid routing with its correction
bias, shared experts) run as the meta device runs MoE: ring dispatch, bfloat16 weights, grouped expert GEMMs.
D=2..4 run the same step as one rank of torch's fake process group ("fake" backend for cpu and meta: collectives
complete at once and move nothing), which is all a meta step needs. A static guard then keeps factory calls without
device= out of the core.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from hf_tiny import tiny_config  # noqa: E402
from package_frames import package_frames  # noqa: E402

from ds_tsp.core.comm.communicator import TSPComm  # noqa: E402
from ds_tsp.core.config import TSPOptions  # noqa: E402
from ds_tsp.core.layers.attention import masked as document_attention  # noqa: E402
from ds_tsp.hf import TSPForCausalLM, TSPForSequenceClassification  # noqa: E402

META = torch.device("meta")
B, S = 2, 16


def _where() -> str:
    frames = package_frames()  # by the package directory, not "/ds_tsp/" (a clone's name and its .venv)
    return " <- ".join(f"{path}:{f.lineno} {f.name}" for path, f in reversed(frames[-3:]))


class _Outputs(TorchDispatchMode):
    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        devices = {t.device for t in flat if isinstance(t, torch.Tensor)}
        if devices - {META}:
            self.found.append(f"{func} -> {sorted(map(str, devices))} at {_where()}")
        return out


class _HostData(TorchFunctionMode):
    FACTORIES = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}

    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES:
            data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
            if not isinstance(data, torch.Tensor):
                self.found.append(f"{func.__name__}(host data) at {_where()}")
        return func(*args, **kwargs)


class DeviceRecorder:
    """`with DeviceRecorder() as rec:` ... `rec.found`: every tensor the block created off the meta device."""

    def __init__(self):
        self.found: list[str] = []

    def __enter__(self):
        self._modes = (_HostData(self.found), _Outputs(self.found))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


def _meta_batch(kind: str) -> dict:
    ids = torch.empty(B, S, dtype=torch.long, device=META)
    batch = {"input_ids": ids, "labels": torch.empty_like(ids)}
    if kind == "packed":  # restarting positions: the layout itself is a value, which meta cannot read
        batch["position_ids"] = torch.empty_like(ids)
    if kind == "padding":
        batch["attention_mask"] = torch.empty_like(ids)
    if kind == "logits_to_keep":
        batch["logits_to_keep"] = 3
    if kind == "classifier":  # a sequence classifier pools each row's last non-pad token: labels are per row
        batch.update(attention_mask=torch.empty_like(ids), labels=torch.empty(B, dtype=torch.long, device=META))
    return batch


# MoE on meta: ring dispatch with bfloat16 weights, whose grouped expert GEMMs (hidden and expert width multiples of
# 16) read no per-expert counts (ds_tsp.core.layers.moe.layer)
# (GPT-OSS's expert width is intermediate_size: 16, bf16 rows of 32 bytes)
OVERRIDES = {"glm4_moe": dict(hidden_size=64, moe_intermediate_size=32), "gpt_oss": dict(intermediate_size=16)}


def _meta_step(config, comm, kind: str) -> list[str]:
    moe = getattr(config, "num_experts_per_tok", None) is not None
    options = TSPOptions(activation_checkpointing=kind in ("checkpointing", "offload"),
                         offload_activations=kind == "offload", **({"moe_dispatch": "ring"} if moe else {}))
    dtype = torch.bfloat16 if moe else torch.float32
    if kind == "classifier":
        config = copy.deepcopy(config)
        config.num_labels, config.pad_token_id = 3, 0
        model = TSPForSequenceClassification(config, comm, dtype=dtype, device=META, options=options)
    else:
        model = TSPForCausalLM(config, comm, dtype=dtype, device=META, options=options)
    batch = _meta_batch(kind)
    with DeviceRecorder() as rec:
        out = model(**batch)
        total = out.loss if out.logits is None else out.loss + out.logits.sum()
        total.backward()
    assert total.device == META
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.device == META for g in grads), "every parameter gets a meta grad"
    return rec.found


CASES = [("llama3_tied", "plain"), ("llama", "plain"), ("qwen2", "plain"), ("qwen3", "plain"),
         ("mistral", "plain"), ("qwen2_sliding", "plain"), ("llama", "packed"), ("llama", "padding"),
         ("llama3_tied", "logits_to_keep"), ("llama", "logits_to_keep"), ("llama", "checkpointing"),
         ("llama", "offload"),  # offload: checkpointed layer inputs in a meta "host" pool (core/activation_offload)
         ("ministral3", "plain"), ("phi3", "plain"),  # position-scaled queries; fused projections, a padding row
         ("gemma3", "plain"),  # sandwich norms, GeGLU, scaled embeddings, per-layer-type RoPE
         ("olmo3", "plain"),  # whole-projection q/k norms (their extra shard streams), post-norms
         ("glm4_moe", "packed"),  # grouped sigmoid routing, its bias buffer, shared experts, q/k/v bias, partial rotary
         ("gpt_oss", "packed"),  # attention sinks, o_proj bias, biased clamped-SwiGLU experts (bf16, grouped GEMMs)
         ("llama", "classifier"),  # TSPForSequenceClassification: the pooled token found over the group
         ("gemma4", "plain"), ("gemma4_kv_shared", "padding")]  # Gemma 4 E2B / E4B's KV sharing  # per-layer head_dim, v norms, layer scalars, per-layer inputs, soft-capped logits


@pytest.mark.parametrize("family, kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_step_at_d1_creates_nothing_off_device(family, kind):
    found = _meta_step(tiny_config(family, **OVERRIDES.get(family, {})), TSPComm.single(), kind)
    assert not found, "\n".join(found)


@contextlib.contextmanager
def _fake_world():
    """This process as rank 1 of a fake world of 4 (torch's fake backend: collectives move no data, which a meta
    step does not need): {D: the TSP group of ranks 0..D-1}. Needs a process with no process group yet."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    finally:
        dist.destroy_process_group()


def _run_in_fresh_process(runner: str) -> str:
    """stdout of `runner()` (a function of this module returning its problems) in a fresh interpreter: an earlier
    test in this session may have left a process group up. Fails on any problem found."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_meta_device as t; "
            f"found = t.{runner}(); print('\\n'.join(found)); print('done'); sys.exit(1 if found else 0)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


MULTI = [(2, "qwen3", "packed"), (2, "mistral", "padding"), (3, "llama6", "logits_to_keep"),
         (4, "llama3_tied", "plain"), (4, "qwen2", "logits_to_keep"), (2, "ministral3", "packed"), (4, "phi3", "plain"),
         (2, "gemma3", "packed"), (4, "olmo3", "packed"), (4, "glm4_moe", "plain"), (4, "gpt_oss", "padding"),
         (4, "qwen3", "classifier"), (2, "gemma4", "packed")]


def run_multi() -> list[str]:
    """Each MULTI case as rank 1 of a fake world of 4."""
    with _fake_world() as groups:
        problems = []
        for tsp, family, kind in MULTI:
            config = (tiny_config("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                                  intermediate_size=96) if family == "llama6"
                      else tiny_config(family, **OVERRIDES.get(family, {})))
            comm = TSPComm(groups[tsp])
            assert comm.size == tsp and comm.rank == 1
            problems += [f"D={tsp} {family} {kind}: {f}" for f in _meta_step(config, comm, kind)]
        print("cases", len(MULTI))
        return problems


def test_steps_at_higher_degrees_create_nothing_off_device():
    assert f"cases {len(MULTI)}" in _run_in_fresh_process("run_multi")


def test_document_attention_with_layouts_creates_nothing_off_device():
    """Meta cannot locate documents from values, so hand document attention a layout: non-adjacent rows share one
    (an index tensor), windows tile documents, and forward and backward stay on the device."""
    Lq, q_start, H, d = 12, 8, 2, 4
    q = torch.empty(3, Lq, H, d, device=META)
    k = v = torch.empty(3, q_start + Lq, H, d, device=META)
    kw = dict(q_start=q_start, doc_starts=[(0, 5, 11), (0,), (0, 5, 11)], window=4, scale=0.5)
    with DeviceRecorder() as rec:
        out, lse = document_attention.masked_attention_forward(q, k, v, **kw)
        grads = document_attention.masked_attention_backward(torch.empty_like(out), q, k, v, out, lse, **kw)
    assert not rec.found, "\n".join(rec.found)
    assert all(g.device == META for g in grads)


def test_the_recorder_catches_a_host_tensor():
    with DeviceRecorder() as rec:
        x = torch.empty(3, device=META)
        _ = x + torch.zeros(())  # the mixed-device bug of _check_inputs, in small
        _ = torch.tensor([1, 2], device=META)
    assert len(rec.found) == 2 and "zeros" in rec.found[0] and "tensor(host data)" in rec.found[1], rec.found


# --- static guard: no tensor factory without device= in the core ------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[2] / "ds_tsp"
FILES = sorted([*PACKAGE.glob("core/**/*.py"), *PACKAGE.glob("model/**/*.py")])
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "range", "tensor", "as_tensor", "randn", "rand", "randint",
             "randperm", "normal", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor", "from_numpy",
             "frombuffer"}
# Files on the step's hot path: not even torch.tensor(data, device=...) there (a blocking host-to-device copy).
HOT = ("core/layers/", "core/tokens/rope.py", "model/modules/")
# (file, function) of the hot path that copies host data on purpose: the varlen plan's cu_seqlens, built once per
# document layout and kept in its cache, pinned and copied without blocking (tests/core/test_varlen.py counts them)
HOT_COPIES = {("core/layers/attention/varlen.py", "_to_device"),
              # FLA's varlen plan: built on the host (FLA takes that copy too), then ONE pinned non_blocking copy
              ("core/layers/linear_attention/delta_rule_fla.py", "_varlen_plan")}
# (file, enclosing function, factory): host tensors by design. Each says why; remove an entry once it is gone.
ALLOWED = {
    # seeded CPU generators make the same values on every device and rank; the result is copied into the param
    ("model/state_dict.py", "normal", "randn"): "seeded CPU generator",
    # zero biases copied into the (device) parameter once at init, never in a step
    ("model/state_dict.py", "init_weights_", "zeros"): "init-time host zeros, copied into the param",
    # the data loader collates on the host; the training loop moves batches to the device
    ("core/tokens/loader.py", "_stack", "as_tensor"): "host-side collate",
    # rank arithmetic of the process layout, never a device tensor
    ("core/parallel/topology.py", "mesh_ranks", "arange"): "host-side rank grid",
}


def _factory_calls(path: Path):
    """(enclosing function, factory name, line, has device=) of every torch factory call in the file."""
    tree = ast.parse(path.read_text())
    imported = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "torch" for a in node.names if a.name in FACTORIES}
    out = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                f = child.func
                factory = (f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                           and f.value.id == "torch" and f.attr in FACTORIES else
                           imported.get(f.id) if isinstance(f, ast.Name) else None)
                if factory:
                    keys = {k.arg for k in child.keywords}
                    out.append((function, factory, child.lineno, "device" in keys or None in keys))
            visit(child, name)

    visit(tree, "<module>")
    return out


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_core_factories_name_their_device(path):
    rel = str(path.relative_to(PACKAGE))
    bad = [f"{rel}:{line} torch.{factory}(...) in {fn}() without device="
           for fn, factory, line, has_device in _factory_calls(path)
           if not has_device and (rel, fn, factory) not in ALLOWED]
    if rel.startswith(HOT):
        bad += [f"{rel}:{line} torch.{factory}(...) in {fn}(): host data copied to the device on the hot path"
                for fn, factory, line, _ in _factory_calls(path)
                if factory in ("tensor", "as_tensor") and (rel, fn) not in HOT_COPIES]
    assert not bad, "tensors must follow their input's device (device=x.device):\n" + "\n".join(bad)


def test_guard_allow_list_is_current():
    calls = {(str(p.relative_to(PACKAGE)), fn, factory) for p in FILES for fn, factory, _, _ in _factory_calls(p)}
    assert not set(ALLOWED) - calls, f"stale allow-list entries: {set(ALLOWED) - calls}"


def test_guard_catches_a_missing_device(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom torch import zeros\n\ndef f(x):\n    return torch.arange(3) + zeros(2) + "
                   "torch.ones(1, device=x.device)\n")
    assert [(fn, factory, ok) for fn, factory, _, ok in _factory_calls(bad)] == [
        ("f", "arange", False), ("f", "zeros", False), ("f", "ones", True)]


# --- MoE MLP (ds_tsp.core.layers.moe.layer): the ring schedule on meta; the host-reading paths refused ---------------
def _moe_meta_step(comm, dispatch: str = "ring", dtype=torch.bfloat16) -> list[str]:
    """Forward + backward of two MoE layers (8 experts, top-2) plus the aux-loss share, all tensors on meta."""
    from ds_tsp.core.layers.moe.layer import MoESpec, moe_aux_loss_share, tsp_moe_mlp

    spec = MoESpec(hidden=16, moe_ffn=8, num_experts=8, experts_per_rank=8 // comm.size, top_k=2, norm_topk_prob=True)
    x = torch.empty(B, S // comm.size, 16, device=META, dtype=dtype, requires_grad=True)
    router = torch.empty(8, 16, device=META, dtype=dtype, requires_grad=True)
    experts = torch.empty(spec.layout.numel, device=META, dtype=dtype, requires_grad=True)
    with DeviceRecorder() as rec:
        h, logits = x, []
        for _ in range(2):
            h, lg = tsp_moe_mlp(h, router, experts, spec, comm, dispatch=dispatch)
            logits.append(lg)
        (h.sum() + moe_aux_loss_share(logits, 8, 2, comm)).backward()
    assert all(t.grad is not None and t.grad.device == META for t in (x, router, experts))
    return rec.found


def test_moe_ring_step_creates_nothing_off_device():
    found = _moe_meta_step(TSPComm.single())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("dispatch, dtype", [("all_to_all", torch.bfloat16), ("ring", torch.float32)])
def test_moe_paths_that_read_counts_are_refused_on_meta(dispatch, dtype):
    """all_to_all needs its split sizes on the host, and the loop GEMMs (non-bf16) their bounds: meta has none."""
    from ds_tsp.core.errors import TSPConfigError

    with pytest.raises(TSPConfigError, match=f"moe_dispatch='{dispatch}'.*meta device"):
        _moe_meta_step(TSPComm.single(), dispatch, dtype)


def run_moe_multi() -> list[str]:
    """The ring schedule as rank 1 of a fake world of 4 at D=2 and D=4."""
    with _fake_world() as groups:
        return [f"D={tsp}: {f}" for tsp in (2, 4) for f in _moe_meta_step(TSPComm(groups[tsp]))]


def test_moe_ring_at_higher_degrees_creates_nothing_off_device():
    _run_in_fresh_process("run_moe_multi")


# --- mixture of experts (Qwen3-MoE, Mixtral) ---------------------------------------------------------------------
# A meta step cannot read per-expert row counts, so it runs what needs none: the "ring" dispatch with bfloat16
# experts (one grouped GEMM per projection, device offsets); the aux loss (output_router_logits in the tiny
# configs) is in the loss. "all_to_all" and the loop GEMMs read counts on the host by design (one read per layer).
# torch's grouped GEMM wants 16-byte aligned rows: the expert width is 16 here (the tiny checkpoint's 12 is not).
MOE_CASES = [("qwen3_moe", "plain"), ("mixtral", "padding"), ("qwen3_moe", "checkpointing"), ("mixtral", "packed")]


def _moe_config(family: str):
    return tiny_config(family, **({"moe_intermediate_size": 16} if family == "qwen3_moe" else {}))


def _meta_moe_step(config, comm, kind: str) -> list[str]:
    model = TSPForCausalLM(config, comm, dtype=torch.bfloat16, device=META, options=TSPOptions(
        moe_dispatch="ring", activation_checkpointing=kind == "checkpointing"))
    with DeviceRecorder() as rec:
        out = model(**_meta_batch(kind))
        assert out.aux_loss is not None and out.aux_loss.device == META
        out.loss.backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters()), "every param gets a grad"
    return rec.found


@pytest.mark.parametrize("family, kind", MOE_CASES, ids=[f"{f}-{k}" for f, k in MOE_CASES])
def test_moe_step_at_d1_creates_nothing_off_device(family, kind):
    found = _meta_moe_step(_moe_config(family), TSPComm.single(), kind)
    assert not found, "\n".join(found)


def run_multi_moe() -> list[str]:
    """MOE_CASES at D=2 and D=4 as rank 1 of a fake world of 4."""
    with _fake_world() as groups:
        return [f"D={tsp} {family} {kind}: {f}" for tsp in (2, 4) for family, kind in MOE_CASES
                for f in _meta_moe_step(_moe_config(family), TSPComm(groups[tsp]), kind)]


def test_moe_steps_at_higher_degrees_create_nothing_off_device():
    _run_in_fresh_process("run_multi_moe")
