"""FSDP2 on the data axis x TSP on the tsp axis (ds_tsp.integrations.fsdp): TSP=2 x DP=2 (4 gloo ranks) trains like
one device on the same global batches, and `clip_grad_norm_` returns the full model's grad norm.

* fp32, untied and tied embeddings: per-step loss (`loss_for_logging`) within 1e-5 relative of
  ds_tsp.tools.reference_model.ReferenceCausalLM for STEPS steps of AdamW, clipping at MAX_NORM active (the clip norm within
  1e-4 relative of torch.nn.utils.clip_grad_norm_ on the reference), data replicas holding different numbers of
  labelled tokens. Measured: loss ~1e-7, norm ~1e-7 (fp32 sums reordered).
* bf16 MixedPrecisionPolicy (param_dtype bf16, reduce_dtype fp32, fp32 sharded master weights). The tolerance
  comes from the reference's own mixed-precision distance (fp32 master weights, bf16 forward/backward copy):
  measured loss <= 7e-5, clip norm <= 2e-3 relative to fp32 over 4 steps. ds_tsp additionally returns the loss
  SHARE in the param dtype (bf16: up to 2^-9 relative rounding per share), so its loss is compared after reducing
  the shares in fp32 (reduced in bf16, as loss_for_logging(share) does, the logged loss is off by up to ~5e-3);
  measured: loss <= 1.6e-3, norm <= 1.3e-3. Tolerances: BF16_LOSS_RTOL, BF16_NORM_RTOL (below); the reference's
  own distance must stay 5x below them.
* clip_grad_norm_ on a plain TSP=2 model (no data engine) and on a TSPForCausalLM from a tiny HF checkpoint (plain
  and under FSDP2) equals the single-device norm in float64 (1e-12; ~1e-16 measured), for p=2, inf and 1, and the
  clipped gradients equal the reference's clipped gradients.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from local_ranks import run_on_local_ranks
from masked_patterns import MaskedPatterns

from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.loader import TSPDataLoader
from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

pytest.importorskip("torch.distributed.fsdp")

SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
TIED = replace(SHAPE, tie_word_embeddings=True)
STEPS = 4
MAX_NORM = 0.5
LR = 3e-3
BF16_LOSS_RTOL = 1e-2  # ~5 x 2^-9: bf16 rounding of the loss shares plus mixed-precision drift (module docstring)
BF16_NORM_RTOL = 2e-2  # 10x the reference's own bf16-vs-fp32 clip-norm distance (1.9e-3)
HF_ROWS, HF_SEQ = 4, 22


def _loader(groups: ProcessGroups, micro_batch_size: int) -> TSPDataLoader:
    data = MaskedPatterns(vocab_size=SHAPE.vocab_size, seq_len=30, num_samples=64)
    return TSPDataLoader(data, groups, micro_batch_size=micro_batch_size, seed=0)


def _reference_weights(shape: ModelShape) -> dict[str, torch.Tensor]:
    ref = ReferenceCausalLM(shape)
    init_weights_(ref, 0)
    return full_state_dict(ref)


# --- the single-device reference -----------------------------------------------------------------------------
def _reference_run(shape: ModelShape, compute_dtype: torch.dtype | None = None) -> dict:
    """One device, micro-batch 4 = the 2 replicas x 2 samples of each step (the sampler deals shuffled indices
    round-robin). compute_dtype: forward/backward on a copy in that dtype, fp32 master weights and optimizer
    (what FSDP2's MixedPrecisionPolicy does)."""
    groups = ProcessGroups(ParallelLayout(), 0, None, None, None)  # 1-rank layout for the loader: no collectives
    ref = ReferenceCausalLM(shape)
    ref.load_state_dict(_reference_weights(shape))
    work = ReferenceCausalLM(shape, dtype=compute_dtype) if compute_dtype is not None else ref
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    batches = iter(_loader(groups, 4))
    losses, norms = [], []
    for _ in range(STEPS):
        b = next(batches)
        if work is not ref:
            work.load_state_dict(ref.state_dict())
        loss = work(b["input_ids"], b["shift_labels"], b["position_ids"])
        loss.backward()
        if work is not ref:
            for p, q in zip(ref.parameters(), work.parameters()):
                p.grad, q.grad = q.grad.float(), None
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms}


# --- 4 ranks: TSP=2 x DP=2 under FSDP2 -------------------------------------------------------------------------
def _fsdp_train(shape: ModelShape, groups: ProcessGroups, param_dtype: torch.dtype | None = None) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.grads.clip import clip_grad_norm_, is_tsp_sharded
    from ds_tsp.integrations.fsdp import shard_with_fsdp2
    from ds_tsp.model.causal_lm import ShardedCausalLM

    model = ShardedCausalLM(shape, TSPComm(groups.tsp_group))
    model.load_full_state_dict(_reference_weights(shape))
    expected_marks = {n for n, p in model.named_parameters() if is_tsp_sharded(p)}
    mp = None if param_dtype is None else MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard_with_fsdp2(model, groups, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = iter(_loader(groups, 2))
    losses, norms, n_valid = [], [], []
    for _ in range(STEPS):
        b = next(batches)
        share = model(b["input_ids"], b["shift_labels"], b["position_ids"])
        share.backward()
        norms.append(float(clip_grad_norm_(model, MAX_NORM, groups)))
        opt.step()
        opt.zero_grad()
        # bf16: the share is bf16 (the model returns it in the param dtype); sum the shares in fp32
        losses.append(float(model.loss_for_logging(share.float())))
        n_valid.append(int((b["shift_labels"] != -100).sum()))
    params = dict(model.named_parameters())
    return {"losses": losses, "grad_norms": norms, "n_valid": n_valid,
            "dtensor": all(type(p).__name__ == "DTensor" for p in params.values()),
            "marks_kept": {n for n, p in params.items() if is_tsp_sharded(p)} == expected_marks == set(
                model.tsp_sharded_param_names) and len(expected_marks) > 0,
            "shard_dtype": str(params["model.norm.weight"].dtype)}


def _hf_batch(vocab: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (HF_ROWS, HF_SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, :12] = -100  # replicas (rows 0-1 vs 2-3) hold different numbers of targets
    return ids, labels


def _hf_step(directory: str | None, groups: ProcessGroups, fsdp: bool) -> dict | None:
    """One forward/backward of TSPForCausalLM (float64, HF call) on this replica's rows, then the clip norms."""
    if directory is None:  # transformers is not installed
        return None
    from ds_tsp.core.grads.clip import clip_grad_norm_
    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.integrations.fsdp import shard_with_fsdp2

    model = TSPForCausalLM.from_pretrained(directory, groups.tsp_group, dtype=torch.float64)
    if fsdp:
        shard_with_fsdp2(model, groups)
    ids, labels = _hf_batch(model.config.vocab_size)
    rows = HF_ROWS // groups.data_size
    mine = slice(groups.data_rank * rows, (groups.data_rank + 1) * rows)
    out = model(input_ids=ids[mine], labels=labels[mine])
    out.loss.backward()
    norms = {"inf": float(clip_grad_norm_(model, 1e9, groups, norm_type=math.inf)),
             "1": float(clip_grad_norm_(model, 1e9, groups, norm_type=1)),
             "2": float(clip_grad_norm_(model, MAX_NORM, groups))}
    clipped = None if fsdp else model.tsp.full_state_dict(grads=True)
    return {"loss": float(out.loss.detach()), "norms": norms, "clipped": clipped,
            "after": float(clip_grad_norm_(model, 1e9, groups))}


def _fsdp_ranks(hf_directory: str | None) -> dict:
    import torch.distributed as dist

    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=2))
    return {"untied": _fsdp_train(SHAPE, groups), "tied": _fsdp_train(TIED, groups),
            "bf16": _fsdp_train(SHAPE, groups, torch.bfloat16), "hf": _hf_step(hf_directory, groups, fsdp=True)}


# --- 2 ranks: plain TSP=2 (no data engine), float64 ---------------------------------------------------------
def _plain_ranks(hf_directory: str | None, batch: dict) -> dict:
    import torch.distributed as dist

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.grads.clip import clip_grad_norm_
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=2))
    out = {}
    for name, shape in (("untied", SHAPE), ("tied", TIED)):
        model = ShardedCausalLM(shape, TSPComm(groups.tsp_group), dtype=torch.float64)
        model.load_full_state_dict(_reference_weights(shape))
        local = shard_batch(batch["input_ids"], tsp=2, rank=groups.tsp_rank, labels=batch["shift_labels"],
                            position_ids=batch["position_ids"], labels_are_shifted=True)
        norms = {}
        for norm_type in (math.inf, 1.0, 2.0):  # inf and 1 first with a huge max_norm: no clipping
            model.zero_grad(set_to_none=True)
            model(local["input_ids"], local["shift_labels"], local["position_ids"]).backward()
            max_norm = MAX_NORM if norm_type == 2.0 else 1e9
            norms[str(norm_type)] = float(clip_grad_norm_(model, max_norm, groups, norm_type=norm_type))
        out[name] = {"norms": norms, "clipped": model.full_state_dict(grads=True)}
    out["hf"] = _hf_step(hf_directory, groups, fsdp=False)
    return out


# --- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory) -> str | None:
    """A tiny Llama checkpoint; None without transformers (the HF parts are then skipped, the rest still runs)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from hf_tiny import save_tiny_checkpoint

    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("fsdp_hf") / "llama", "llama"))


@pytest.fixture(scope="module")
def hf_reference(hf_directory) -> dict:
    """transformers' own model (float64): loss, clip norms (inf, 1, 2) and the clipped grads on the full batch."""
    if hf_directory is None:
        pytest.skip("transformers is not installed")
    from hf_tiny import shift

    from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference

    model = load_hf_reference(hf_directory, torch.float64)
    ids, labels = _hf_batch(model.config.vocab_size)
    loss, _ = hf_loss_and_grads(model, ids, shift(labels))
    params = list(model.parameters())
    norms = {"inf": float(torch.nn.utils.clip_grad_norm_(params, 1e9, norm_type=math.inf)),
             "1": float(torch.nn.utils.clip_grad_norm_(params, 1e9, norm_type=1)),
             "2": float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))}
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": float(loss), "norms": norms, "clipped": clipped}


@pytest.fixture(scope="module")
def fsdp_runs(hf_directory) -> dict:
    return run_on_local_ranks(_fsdp_ranks, 4, hf_directory, timeout_s=300)


@pytest.fixture(scope="module")
def reference_runs() -> dict:
    return {"untied": _reference_run(SHAPE), "tied": _reference_run(TIED),
            "bf16": _reference_run(SHAPE, torch.bfloat16)}


def _rel(got, ref) -> torch.Tensor:
    got, ref = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    return (got - ref).abs() / ref.abs()


# --- tests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_fsdp2_tsp2_dp2_matches_single_device(fsdp_runs, reference_runs, name):
    ref = reference_runs[name]
    assert ref["losses"][-1] < ref["losses"][0], "the reference must learn, or equal losses prove nothing"
    assert max(ref["grad_norms"]) > MAX_NORM, "clipping must be active"
    for rank, run in enumerate(fsdp_runs):
        got = run[name]
        assert got["dtensor"] and got["marks_kept"], (rank, got)
        assert _rel(got["losses"], ref["losses"]).max() < 1e-5, (rank, got["losses"], ref["losses"])
        assert _rel(got["grad_norms"], ref["grad_norms"]).max() < 1e-4, (rank, got["grad_norms"], ref["grad_norms"])
    # the two data replicas (ranks 0 and 2) held different numbers of labelled tokens
    assert fsdp_runs[0][name]["n_valid"] != fsdp_runs[2][name]["n_valid"]


def test_fsdp2_bf16_mixed_precision_within_bf16_tolerance(fsdp_runs, reference_runs):
    ref32, ref16 = reference_runs["untied"], reference_runs["bf16"]
    own_loss = _rel(ref16["losses"], ref32["losses"]).max()
    own_norm = _rel(ref16["grad_norms"], ref32["grad_norms"]).max()
    assert own_loss < BF16_LOSS_RTOL / 5 and own_norm < BF16_NORM_RTOL / 5, (own_loss, own_norm)
    for rank, run in enumerate(fsdp_runs):
        got = run["bf16"]
        assert got["shard_dtype"] == "torch.float32" and got["marks_kept"], got  # fp32 master weights
        assert all(math.isfinite(x) for x in got["losses"] + got["grad_norms"])
        assert got["losses"][-1] < got["losses"][0]
        assert _rel(got["losses"], ref32["losses"]).max() < BF16_LOSS_RTOL, (rank, got["losses"], ref32["losses"])
        assert _rel(got["grad_norms"], ref32["grad_norms"]).max() < BF16_NORM_RTOL, (rank, got["grad_norms"])


def test_fsdp2_hf_checkpoint_clip_norm_matches_transformers(fsdp_runs, hf_reference):
    """TSPForCausalLM (HF call signature, loaded by slices) under FSDP2: norms equal transformers' (float64)."""
    for rank, run in enumerate(fsdp_runs):
        got = run["hf"]
        assert abs(got["loss"] - hf_reference["loss"]) <= 1e-12 * hf_reference["loss"], (rank, got["loss"])
        for key, ref in hf_reference["norms"].items():
            assert abs(got["norms"][key] - ref) <= 1e-12 * ref, (rank, key, got["norms"][key], ref)
        assert abs(got["after"] - MAX_NORM) < 1e-6, got["after"]  # the DTensor grads really were scaled


def _max_rel_err(got: dict, ref: dict) -> float:
    return max(float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-300)) for k in ref)


def test_clip_grad_norm_plain_tsp2_and_hf_equal_single_device(hf_directory, request):
    """No data engine: the norm and the clipped grads of a TSP=2 model (untied, tied, and a TSPForCausalLM from a
    tiny HF checkpoint) equal the single-device ones, float64."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, SHAPE.vocab_size, (2, 22), generator=g)
    shift_labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], -100)), 1)
    shift_labels[0, :7] = -100
    batch = {"input_ids": ids, "shift_labels": shift_labels, "position_ids": torch.arange(22).expand(2, 22)}
    got = run_on_local_ranks(_plain_ranks, 2, hf_directory, batch, timeout_s=300)
    for name, shape in (("untied", SHAPE), ("tied", TIED)):
        ref = ReferenceCausalLM(shape, dtype=torch.float64)
        ref.load_state_dict({k: v.double() for k, v in _reference_weights(shape).items()})
        norms = {}
        for norm_type in (math.inf, 1.0, 2.0):
            ref.zero_grad(set_to_none=True)
            ref(ids, shift_labels, batch["position_ids"]).backward()
            max_norm = MAX_NORM if norm_type == 2.0 else 1e9
            norms[str(norm_type)] = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type))
        clipped = {n: p.grad for n, p in ref.named_parameters()}
        if shape.tie_word_embeddings:
            clipped["lm_head.weight"] = clipped["model.embed_tokens.weight"]
        for rank, run in enumerate(got):
            for key, value in norms.items():
                assert abs(run[name]["norms"][key] - value) <= 1e-12 * value, (name, rank, key, run[name], value)
            assert _max_rel_err(run[name]["clipped"], clipped) < 1e-12, name
    if hf_directory is None:
        pytest.skip("transformers is not installed: the TSPForCausalLM part did not run")
    hf_reference = request.getfixturevalue("hf_reference")
    for rank, run in enumerate(got):
        hf = run["hf"]
        for key, ref in hf_reference["norms"].items():
            assert abs(hf["norms"][key] - ref) <= 1e-12 * ref, (rank, key, hf["norms"][key], ref)
        assert _max_rel_err(hf["clipped"], hf_reference["clipped"]) < 1e-12


def test_clip_grad_norm_rejects_bad_norm_type():
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.core.grads.clip import clip_grad_norm_

    groups = ProcessGroups(ParallelLayout(), 0, None, None, None)
    for bad in (0.0, -1.0, float("nan"), float("-inf")):
        with pytest.raises(TSPConfigError, match="norm_type"):
            clip_grad_norm_(torch.nn.Linear(2, 2), 1.0, groups, norm_type=bad)


def test_shard_with_fsdp2_rejects_non_tsp_models():
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.integrations.fsdp import shard_with_fsdp2

    groups = ProcessGroups(ParallelLayout(), 0, None, None, None)
    with pytest.raises(TSPConfigError, match="not a ds_tsp model"):
        shard_with_fsdp2(torch.nn.Linear(2, 2), groups)
