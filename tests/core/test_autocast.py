"""A training step of ShardedCausalLM with fp32 master weights under `torch.autocast("cpu", dtype=torch.bfloat16)`.

The custom Functions declare torch.amp.custom_fwd / custom_bwd through ds_tsp.core.layers.amp: the gated MLP and
the LM head (GEMM-heavy) cast their inputs to bf16 once and run their GEMMs in bf16, forward and backward; norms,
the embedding lookup and the cross-entropy stay fp32. At D = 1 (in process) and D = 2 (gloo), one step, checked for:

(a) every GEMM (aten mm / addmm / bmm ...) issued from layers/mlp.py or layers/vocab/loss.py read bf16 operands, forward and
    backward (a TorchDispatchMode records each GEMM's operand dtypes and the ds_tsp file it ran in); the same step
    without autocast records fp32 there, so the recorder can fail. At D = 2 the weight ring moves the cast shards:
    ring bytes drop by exactly 2 bytes per element of every MLP / LM head hop, the recorded MLP hops are bf16 and
    the embedding's fp32, and the recorded ops pass the NCCL replay (tests/helpers/nccl_rules.py); no host sync outside
    the input check (tests/helpers/sync_counter.py).
(b) the loss is finite and within LOSS_TOL (relative) of the single-device fp32 reference,
(c) every parameter grad is fp32 (autograd casts the Functions' bf16 grads back) and within GRAD_TOL (norm-wise
    relative, per HF tensor) of the fp32 reference grads, and at least one grad is further than the fp32 noise
    floor FP32_FLOOR from it (bf16 really ran; the same step without autocast stays under it).
    Tolerances: bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3). Autocast keeps the weights, the
    residual stream, norms and softmax in fp32, so its error is that of a few bf16 GEMM roundings. Measured (this
    file's shape, seeds 0, 1, 3, D = 1 and 2, CPU, torch 2.13): loss 4e-7 .. 1.8e-5 (a mean: roundings cancel);
    grads 1.9e-3 .. 9e-3, up to 2.1e-2 for the small k_proj biases (2.6e-2 with the attention Function also under
    AUTOCAST_LOW_PRECISION, simulated). GRAD_TOL is ds_tsp.tools.verify's bfloat16 tolerance 5e-2 (about 2x the
    worst measured); LOSS_TOL = 5e-4 (25x). fp32 step of the same code: loss <= 6e-8,
    grads <= 1.5e-6, under FP32_FLOOR = 1e-5.
(d) without autocast nothing changes: the helper returns the Function class itself, and a float64 model gives the
    bitwise same loss and grads inside an autocast region (autocast never casts float64) as outside it; the float64
    exactness tests (tests/model/test_model_equivalence.py, test_bf16.py, test_meta_device.py) cover the rest.
Also the helper itself: custom_fwd / custom_bwd on the right device type, the autocast state restored in backward,
memoised subclasses, and the LM head's token count never cast to bf16.
"""
from __future__ import annotations

import math

import pytest
import torch
from local_ranks import run_on_local_ranks
from nccl_rules import check
from package_frames import package_frames
from property_cases import ModelCase, ModelShape, Row, build_batch, make_weights, reference_loss_and_grads, rel_err
from sync_counter import SyncCounter
from torch.utils._python_dispatch import TorchDispatchMode

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.layers import amp
from ds_tsp.tools.verify import TOLERANCE

LOSS_TOL, GRAD_TOL, FP32_FLOOR = 5e-4, TOLERANCE["bfloat16"], 1e-5
SHAPE = ModelShape(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   qkv_bias=True)
CASES = {tsp: ModelCase(tsp=tsp, shape=SHAPE, rows=(Row(docs=(29,)), Row(docs=(12, 17))), seed=3, dtype="float32")
         for tsp in (1, 2)}
aten = torch.ops.aten
GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addmm_, aten.mv, aten.addmv, aten.dot, aten.matmul}
BF16_FILES = ("core/layers/mlp.py", "core/layers/vocab/loss.py", "core/layers/attention/tsp_attention.py")


class GemmDtypes(TorchDispatchMode):
    """Records (ds_tsp file the GEMM ran in, operand dtypes) of every GEMM-family aten op."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in GEMMS:
            frames = package_frames()  # by the package directory, not "/ds_tsp/" (a clone's name and its .venv)
            where = frames[-1][0] if frames else "<outside ds_tsp>"
            self.seen.append((where, tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))

    def dtypes_in(self, file: str) -> set[str]:
        return {d for where, dtypes in self.seen if ("/" + where).endswith("/" + file) for d in dtypes}


def _model(case: ModelCase, comm: TSPComm, dtype: torch.dtype, weights: dict):
    from ds_tsp.core.reliability.watchdog import label_modules
    from ds_tsp.model.causal_lm import ShardedCausalLM

    model = label_modules(ShardedCausalLM(case.shape, comm, options=case.options, dtype=dtype))
    model.load_full_state_dict({k: v.to(dtype) for k, v in weights.items()})
    return model


def _batch(case: ModelCase, comm: TSPComm) -> tuple:
    from ds_tsp.core.tokens.zigzag import shard_batch

    b = shard_batch(tsp=comm.size, rank=comm.rank, **build_batch(case))
    return b["input_ids"], b["shift_labels"], b["position_ids"], b.get("attention_mask")


def _step(case: ModelCase, group, weights: dict, autocast: bool, dtype=torch.float32) -> dict:
    """One forward + backward; autocast (bf16) around the forward only, as torch.amp's recipe has it."""
    comm = TSPComm(group)
    model = _model(case, comm, dtype, weights)
    args = _batch(case, comm)
    fwd, bwd = GemmDtypes(), GemmDtypes()
    with comm.recording() as rec:
        with fwd, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            share = model(*args)
        with bwd:
            share.backward()
    ring_bytes = comm.counter.bytes["ring"]
    loss = model.loss_for_logging(share)
    grads = model.full_state_dict(grads=True)
    return {"loss": loss, "share_dtype": share.dtype, "grads": grads,
            "param_grad_dtypes": {n: p.grad.dtype for n, p in model.named_parameters()},
            "fwd": fwd.seen, "bwd": bwd.seen, "ring_bytes": ring_bytes, "ops": rec.ops}


def _syncs(case: ModelCase, group, weights: dict) -> list[tuple]:
    """Host syncs of the autocast step (as tests/reliability/test_host_syncs.py counts them): (region, op, where)."""
    comm = TSPComm(group)
    model = _model(case, comm, torch.float32, weights)
    args = _batch(case, comm)
    with SyncCounter() as syncs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            share = model(*args)
        share.backward()
    return [(e.region, e.op, e.where) for e in syncs.events]


def _all_steps(case: ModelCase, weights: dict, world: bool) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD if world else None
    return {"autocast": _step(case, group, weights, True), "fp32": _step(case, group, weights, False),
            "syncs": _syncs(case, group, weights)}


@pytest.fixture(scope="module")
def runs() -> dict:
    """{D: {"ranks": per rank {"autocast", "fp32", "syncs"}, "reference": fp32 single-device (loss, grads)}}."""
    out = {}
    for tsp, case in CASES.items():
        weights = make_weights(case, torch.float32)
        ranks = ([_all_steps(case, weights, False)] if tsp == 1
                 else run_on_local_ranks(_all_steps, tsp, case, weights, True, timeout_s=300))
        out[tsp] = {"ranks": ranks, "reference": reference_loss_and_grads(case, torch.float32, weights)}
    return out


@pytest.mark.parametrize("tsp", sorted(CASES))
def test_mlp_and_lm_head_gemms_run_in_bf16(runs, tsp):
    for r in runs[tsp]["ranks"]:
        for phase in ("fwd", "bwd"):
            ac, fp = GemmDtypes(), GemmDtypes()
            ac.seen, fp.seen = r["autocast"][phase], r["fp32"][phase]
            for file in BF16_FILES:
                assert ac.dtypes_in(file) == {"torch.bfloat16"}, (tsp, phase, file, ac.dtypes_in(file))
                assert fp.dtypes_in(file) == {"torch.float32"}, (tsp, phase, file, fp.dtypes_in(file))


@pytest.mark.parametrize("tsp", sorted(CASES))
def test_loss_and_fp32_grads_close_to_fp32_reference(runs, tsp):
    ref_loss, ref_grads = runs[tsp]["reference"]
    for r in runs[tsp]["ranks"]:
        ac, fp = r["autocast"], r["fp32"]
        assert ac["share_dtype"] == torch.float32 and math.isfinite(float(ac["loss"]))
        assert set(ac["param_grad_dtypes"].values()) == {torch.float32}, ac["param_grad_dtypes"]
        assert rel_err(ac["loss"], ref_loss) < LOSS_TOL, rel_err(ac["loss"], ref_loss)
        assert rel_err(fp["loss"], ref_loss) < FP32_FLOOR  # the fp32 step of the same code is exact to fp32
    first = runs[tsp]["ranks"][0]
    grads, fp32_grads = first["autocast"]["grads"], first["fp32"]["grads"]
    errs = {name: rel_err(grads[name], g) for name, g in ref_grads.items()}
    assert all(grads[name].dtype == torch.float32 for name in ref_grads)
    assert max(errs.values()) < GRAD_TOL, errs
    assert max(errs.values()) > FP32_FLOOR, errs  # bf16 ran somewhere
    assert max(rel_err(fp32_grads[name], g) for name, g in ref_grads.items()) < FP32_FLOOR


def test_ring_carries_bf16_shards_and_obeys_nccl_rules(runs):
    D, ranks = 2, runs[2]["ranks"]
    shape, rows = SHAPE, -(-SHAPE.vocab_size // D)
    hops = 3 * (D - 1)  # per ring layer: forward D-1 weight hops; backward D-1 weight hops and D-1 grad hops
    mlp_numel = 3 * shape.hidden_size * shape.intermediate_size // D
    saved = 2 * hops * (shape.num_layers * mlp_numel + rows * shape.hidden_size)  # 4 -> 2 bytes per element
    for r in ranks:
        assert r["fp32"]["ring_bytes"] - r["autocast"]["ring_bytes"] == saved, (r["fp32"]["ring_bytes"],
                                                                                r["autocast"]["ring_bytes"], saved)
        ring = [o for o in r["autocast"]["ops"] if o["kind"] == "p2p"]
        dtypes = {(o["layer"].rsplit(".", 1)[-1].split()[0], o["dtype"]) for o in ring}
        assert ("mlp", "torch.bfloat16") in dtypes and ("lm_head", "torch.bfloat16") in dtypes, dtypes
        assert ("embed_tokens", "torch.float32") in dtypes and ("mlp", "torch.float32") not in dtypes, dtypes
    report = check([r["autocast"]["ops"] for r in ranks])
    assert report.ok and report.completed == report.total, report


@pytest.mark.parametrize("tsp", sorted(CASES))
def test_no_host_sync_outside_the_input_check(runs, tsp):
    for r in runs[tsp]["ranks"]:
        assert [e for e in r["syncs"] if e[0] != "input_checks"] == []
        assert len(r["syncs"]) == 1, r["syncs"]


def test_float64_is_bitwise_unchanged_inside_autocast():
    case = ModelCase(tsp=1, shape=SHAPE, rows=(Row(docs=(21,)),), seed=5, dtype="float64")
    weights = make_weights(case, torch.float64)
    inside = _step(case, None, weights, True, torch.float64)
    outside = _step(case, None, weights, False, torch.float64)
    assert torch.equal(inside["loss"], outside["loss"])
    assert all(torch.equal(inside["grads"][n], g) for n, g in outside["grads"].items())
    assert {d for _, dtypes in inside["fwd"] + inside["bwd"] for d in dtypes} == {"torch.float64"}


# --- the helper on its own ------------------------------------------------------------------------------------

class _Probe(torch.autograd.Function):
    """Records the dtypes it receives and the autocast state in forward and backward."""

    seen: list

    @staticmethod
    def forward(ctx, x, w, count):
        _Probe.seen.append(("forward", x.dtype, w.dtype, count.dtype, torch.is_autocast_enabled("cpu")))
        return (x * w.sum(0)).sum(-1) / count  # no GEMM: autocast itself would change nothing here

    @staticmethod
    def backward(ctx, dy):
        _Probe.seen.append(("backward", dy.dtype, torch.is_autocast_enabled("cpu")))
        return torch.ones(2, 3, dtype=dy.dtype), torch.ones(3, 3, dtype=dy.dtype), None


class _LowPrecisionProbe(_Probe):
    AUTOCAST = amp.AUTOCAST_LOW_PRECISION


class _KeepDtypeProbe(_Probe):
    AUTOCAST = amp.AUTOCAST_KEEP_DTYPE


@pytest.mark.parametrize("cls, fwd, bwd", [
    (_LowPrecisionProbe, ("forward", torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
     ("backward", torch.bfloat16, False)),  # the output was bf16, so is its grad
    (_KeepDtypeProbe, ("forward", torch.float32, torch.float32, torch.float32, True),
     ("backward", torch.float32, True)),
])
def test_helper_casts_and_restores_autocast_state(cls, fwd, bwd):
    _Probe.seen = []
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = amp.apply_autocast(cls, "cpu", x, w, torch.tensor(2.0))
    y.sum().backward()  # outside the autocast region: custom_bwd restores forward's state
    assert _Probe.seen == [fwd, bwd], _Probe.seen
    assert x.grad.dtype == w.grad.dtype == torch.float32  # autograd casts grads back to the fp32 inputs


def test_helper_returns_the_class_itself_without_autocast_and_memoises_the_variants():
    cls = _LowPrecisionProbe
    assert amp.autocast_function(cls, "cpu") is cls
    assert amp.autocast_function(cls, "meta") is cls  # no autocast on meta
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert amp.autocast_function(cls, "cpu") is cls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        variant = amp.autocast_function(cls, "cpu")
        assert variant is not cls and issubclass(variant, cls) and amp.autocast_function(cls, "cpu") is variant
        assert amp.autocast_function(cls, "cuda") is cls  # autocast is on for cpu only
    with torch.autocast("cpu", dtype=torch.float16):
        assert amp.autocast_function(cls, "cpu") not in (cls, variant)  # keyed by the cast dtype


def test_helper_refuses_a_function_without_a_policy():
    with pytest.raises(TypeError, match="AUTOCAST"):
        amp.apply_autocast(_Probe, "cpu", torch.ones(2, 3), torch.ones(3, 3), torch.tensor(1.0))


def test_lm_head_loss_divides_by_the_exact_token_count_under_autocast():
    """257 valid tokens: a count cast to bf16 would be 256."""
    from ds_tsp.core.layers.vocab.loss import tsp_lm_head_loss

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 257, 8, generator=g), torch.randn(13, 8, generator=g)
    labels = torch.randint(0, 13, (1, 257), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total = tsp_lm_head_loss(x, w, labels, torch.tensor(1.0), 13, TSPComm.single())
        mean = tsp_lm_head_loss(x, w, labels, torch.tensor(257.0), 13, TSPComm.single())
    assert total.dtype == mean.dtype == torch.float32
    assert torch.equal(mean, total / 257) and not torch.equal(mean, total / 256)
