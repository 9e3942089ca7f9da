"""Hybrid models (Qwen3.5, Qwen3-Next with experts and a shared expert) composed with what users put around them
(DeepSpeed ZeRO-1/2/3, FSDP2, TSPTrainer, TSPAccelerator, activation checkpointing, frozen params),
against transformers' own model.

The models are tests/helpers/hybrid_tiny.py's: a Gated DeltaNet layer then a gated full-attention layer; "qwen3_next_moe"
keeps layer 0 dense (mlp_only_layers) and gives layer 1 4 experts (top-2) plus a shared expert with its sigmoid gate,
output_router_logits with router_aux_loss_coef 0.05. Every model is loaded by transformers from a tiny checkpoint
and handed IN MEMORY to ds_tsp (ds_tsp.initialize, TSPForCausalLM.from_pretrained, to_tsp_model, TSPAccelerator).

ONE spawn of 4 gloo ranks (TSP=2 x data 2) runs, each against a single-process run of transformers' own model:
- ds_tsp.initialize ZeRO-1, ZeRO-2, ZeRO-3 + activation checkpointing, fp32, STEPS AdamW steps with clipping
  active, both models: losses 1e-5, clip norms 1e-4, the consolidated save's weights 1e-4;
- FSDP2 on the data axis (shard_with_fsdp2) + activation checkpointing (+ offload_activations on the MoE), both
  models: losses 1e-5, clip norms 1e-4;
- TSPAccelerator (examples/train_accelerate.py in-process; DeepSpeed ZeRO-2 via the launcher's environment, its
  FSDP2 plugin under --runslow), qwen3_5: every step's loss 1e-5 and clip norm 1e-4 of the same loop in plain
  transformers;
- ds_tsp.initialize ZeRO-2 (qwen3_5) / ZeRO-3 (qwen3_next_moe) with frozen Gated DeltaNet (+ attention) tensors:
  the reference with the same tensors frozen; frozen tensors bit-identical to the start, the rest 1e-4;
- tsp.pipeline_stages 2 x TSP 2 (ZeRO-1; the Gated DeltaNet on stage 0), qwen3_5: losses 1e-5;
- ds_tsp.initialize ZeRO-3 + checkpointing on a PEFT LoRA qwen3_5 (Gated DeltaNet in_proj_* / out_proj, q_proj,
  down_proj): PEFT's loop, losses 1e-5, clip norms 1e-4, the saved adapter 1e-4;
and on each TSP group alone (ranks [0, 1] and [2, 3], float64, the two models at once):
- activation checkpointing (qwen3_5 plain rows; qwen3_next_moe packed documents + offload_activations): loss and
  EVERY gradient within 1e-10 of transformers (measured ~1e-15);
- frozen Gated DeltaNet (qwen3_5: the whole linear_attn; qwen3_next_moe: its projections, conv, A_log and dt_bias
  with the gated norm trainable, plus the whole self_attn of layer 1): trainable grads 1e-10, frozen shards' .grad
  None, no weight-grad collective for a frozen layer, the step's recorded collectives replayed under NCCL's rules;
- PEFT LoRA on the Gated DeltaNet's linears (qwen3_5: in_proj_qkv, whose rank slice is three row ranges, _z, _b,
  _a, out_proj; qwen3_next_moe: in_proj_qkvz, _ba, out_proj, use_rslora): loss and every factor's gradient 1e-10
  of PEFT, the NCCL-rules replay, the adapter after one AdamW step = PEFT's (1e-8) with PEFT's logits (1e-10).

Data parallelism averages each replica's gradient, as DDP / DeepSpeed / FSDP do for any HF MoE model: the cross
entropy is the token-weighted mean over the GLOBAL batch and the load-balancing loss is each replica's own,
averaged over the replicas (tests/moe/test_moe_compose.py explains it), so the MoE reference loss is
CE(global batch) + coef * mean_r aux(rows of replica r). The dense TSPAccelerator run needs no such split.
fp32 tolerances are tests/moe/test_moe_compose.py's (Adam's early steps magnify fp32 noise in tiny entries).
Freezing part of a Gated DeltaNet's tensors (e.g. A_log alone) is one clear error (its tensors are one packed shard
per rank) and a LoRA-merged Gated DeltaNet shard is not kept for backward: both tested below without a launch.
TSPTrainer on a hybrid: tests/hybrid/test_hybrid_models.py (slow). The default suite runs all of the above but the FSDP2
plugin run (~26 s of rank CPU on 2 cores, ~40 s with the references).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from engine_steps import full_weights  # noqa: E402
from hf_tiny import shift  # noqa: E402
from hybrid_tiny import VOCAB, hybrid_config, packed_inputs, plain_inputs, rel, save_checkpoint  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402
from nccl_rules import check  # noqa: E402
from test_cp_trainers import _example, _reset_hf_state  # noqa: E402
from test_moe_compose import _assert_steps, _plain_accelerate_loop, _rel, _replica_rows  # noqa: E402

from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict  # noqa: E402
from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.tools.hf_reference import hf_loss_and_grads, load_hf_reference  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_next_moe")
ROWS, S, STEPS = 4, 32, 2  # global rows (2 per data replica); S a multiple of 2 x TSP (zigzag)
LR, CLIP, WD = 3e-3, 0.5, 0.1
ZERO_RUNS = ((1, False), (2, False), (3, True))  # (ZeRO stage, activation checkpointing)
ACC_STEPS, ACC_SEQ = 3, 32

# frozen sets: HF parameter name prefixes (and, optionally, names kept trainable inside them)
FROZEN = {
    "qwen3_5": (("model.layers.0.linear_attn.",), ()),  # the whole Gated DeltaNet layer, its gated norm too
    "qwen3_next_moe": (("model.layers.0.linear_attn.", "model.layers.1.self_attn."),
                       ("model.layers.0.linear_attn.norm.weight",)),  # projections, conv, A_log, dt_bias frozen
}
FROZEN_STAGES = {"qwen3_5": 2, "qwen3_next_moe": 3}
# PEFT LoRA on the Gated DeltaNet's linears (Qwen3.5's in_proj_qkv: three row ranges per rank) and attention / MLP
LORA = {"qwen3_5": dict(r=2, lora_alpha=4, target_modules=["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                            "out_proj", "q_proj", "down_proj"]),
        "qwen3_next_moe": dict(r=3, lora_alpha=5, use_rslora=True,
                               target_modules=["in_proj_qkvz", "in_proj_ba", "out_proj", "o_proj"])}
LORA_STAGE, LORA_LR = 3, 1e-2


def freeze_(model, family: str):
    prefixes, kept = FROZEN[family]
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(prefixes) or name in kept)
    return model


def load(directory: str, dtype=torch.float32, frozen: bool = False):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return freeze_(model, _family_of(directory)) if frozen else model


def lora_model(directory: str, dtype=torch.float32):
    """The family's PEFT LoRA model, factors drawn at random (PEFT's B = 0 would leave A's first gradient 0);
    float64: transformers' model widened exact (ds_tsp.tools.hf_reference)."""
    import peft
    from hf_tiny import randomize_lora_

    base = load_hf_reference(directory, torch.float64) if dtype == torch.float64 else load(directory)
    config = peft.LoraConfig(lora_dropout=0.0, **LORA[_family_of(directory)])
    return randomize_lora_(peft.get_peft_model(base, config))


def global_batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, S), generator=g)
        labels = ids.clone()
        labels[0, :4] = -100
        labels[1, :15] = -100  # replica 0 (rows 0-1) holds fewer labelled tokens than replica 1 (rows 2-3)
        out.append((ids, labels))
    return out


# --- single-process references -----------------------------------------------------------------------------------
def reference_loop(directory: str, frozen: bool = False, lora: bool = False) -> dict:
    """transformers' model, AdamW with clipping on the trainable parameters; MoE: replica-averaged aux loss."""
    model = lora_model(directory) if lora else load(directory, frozen=frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LORA_LR if lora else LR, weight_decay=WD)
    moe = getattr(model.config, "output_router_logits", False)
    losses, norms = [], []
    for ids, labels in global_batches():
        out = model(input_ids=ids, labels=labels, output_router_logits=False) if moe else \
            model(input_ids=ids, labels=labels)
        loss = out.loss
        if moe:
            aux = torch.stack([model(input_ids=ids[_replica_rows(r)], output_router_logits=True).aux_loss
                               for r in range(2)]).mean()
            loss = loss + model.config.router_aux_loss_coef * aux
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "final": model.state_dict()}


# --- 4 ranks: TSP=2 x data 2 ---------------------------------------------------------------------------------------
def _zero_run(directory: str, stage: int, checkpointing: bool, save_dir: str, frozen: bool = False,
              lora: bool = False) -> dict:
    from engine_steps import engine_steps

    import ds_tsp

    lr = LORA_LR if lora else LR
    config = {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": 1,
              "steps_per_print": 10_000, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": WD, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "tsp": {"size": 2, "activation_checkpointing": checkpointing}}
    model = lora_model(directory) if lora else load(directory, frozen=frozen)
    engine, *_ = ds_tsp.initialize(model=model, config=config)
    mine = _replica_rows(engine.tsp_groups.data_rank)
    return engine_steps(engine, ((ids[mine], labels[mine]) for ids, labels in global_batches()), save_dir)


def _fsdp2_run(directory: str, offload: bool) -> dict:
    import torch.distributed as dist
    from engine_steps import fsdp2_steps

    from ds_tsp.core.config import TSPOptions
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
    from ds_tsp.hf import TSPForCausalLM

    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=2))
    options = TSPOptions(activation_checkpointing=True, offload_activations=offload)
    model = TSPForCausalLM.from_pretrained(load(directory), groups.tsp_group, options=options)
    mine = _replica_rows(groups.data_rank)
    return fsdp2_steps(model, groups, ((ids[mine], labels[mine]) for ids, labels in global_batches()), LR, WD, CLIP)


def _pipeline_run(directory: str) -> dict:
    """tsp.pipeline_stages 2 x TSP 2 (ZeRO-1, data 1; stage 0: embedding + the Gated DeltaNet layer, stage 1: the
    gated attention layer + head): the global loss and clip norm of every step, this stage's final weights."""
    import torch.distributed as dist

    import ds_tsp
    from ds_tsp.core.tokens.zigzag import shard_batch

    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
              "gradient_clipping": CLIP, "zero_optimization": {"stage": 1}, "tsp": {"size": 2, "pipeline_stages": 2}}
    engine, *_ = ds_tsp.initialize(model=load(directory), config=config)
    groups = engine.tsp_groups

    def feed():
        for ids, labels in global_batches():
            b = shard_batch(ids, tsp=groups.tsp_size, rank=groups.tsp_rank, labels=labels)
            yield (b["input_ids"], b["position_ids"], b["shift_labels"]), b["shift_labels"]

    batches, losses, norms = feed(), [], []
    for _ in range(STEPS):
        share = engine.train_batch(batches)  # this TSP rank's share of the loss, on the last stage
        dist.all_reduce(share, group=groups.tsp_group)
        losses.append(float(share))
        norms.append(float(engine.get_global_grad_norm()))
    mixers = [type(layer.linear_attn if layer.is_linear_attention else layer.self_attn).__name__
              for layer in engine.module.forward_funcs if hasattr(layer, "is_linear_attention")]
    final = full_weights(engine)  # this stage's layers, full and HF-named
    engine.destroy()
    return {"losses": losses, "norms": norms, "final": final, "stage": groups.pipe_rank, "mixers": mixers}


def _accelerate_run(directory: str, out: str, env: dict) -> list[dict]:
    """examples/train_accelerate.py in this rank under the environment `accelerate launch` would export."""
    import contextlib
    import io
    import os
    from unittest import mock

    from accelerate.state import PartialState

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        # its end_training would destroy the launcher's process group, which the launcher destroys itself
        with contextlib.redirect_stdout(io.StringIO()), mock.patch.object(
                PartialState, "destroy_process_group", lambda self, group=None: None):
            return _example("train_accelerate").main(
                ["--model_name_or_path", directory, "--output_dir", out, "--max_steps", str(ACC_STEPS),
                 "--seq_len", str(ACC_SEQ), "--global_batch", "4"])
    finally:
        _reset_hf_state()
        os.environ.clear()
        os.environ.update(saved)


def _float64_step(directory: str, group, inputs: dict, frozen: bool = False, **options) -> dict:
    """One float64 TSP step on `group`: loss, HF-named grads, which shards got no grad, the recorded ops."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import TSPOptions
    from ds_tsp.model.convert import to_tsp_model

    model = to_tsp_model(load(directory, torch.float64, frozen), TSPComm(group), options=TSPOptions(**options),
                         dtype=torch.float64, hf_face=True)
    batch = {k: v for k, v in inputs.items() if k != "documents"}
    with model.tsp.comm.recording() as rec:
        out = model(**batch)
        out.loss.backward()
    return {"loss": out.loss.detach(), "grads": model.tsp.full_state_dict(grads=True),
            "no_grad": sorted(n for n, p in model.named_parameters() if p.grad is None), "ops": rec.ops}


def _lora_step(directory: str, group, perturb: bool) -> dict:
    """float64 PEFT LoRA on `group`: loss, every factor's gradient and, after one AdamW step of the optimizer built
    on the PEFT model (rebound), the factors and the logits (factors gathered whole on TSP rank 0)."""
    from ds_tsp.checkpoint.hf.peft_adapter import gather_adapter
    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.model.convert import parameter_names, rebind_optimizer

    source = lora_model(directory, torch.float64)
    if perturb:  # as if unseeded: the TSP model takes its TSP rank 0's adapter
        with torch.no_grad():
            for name, p in source.named_parameters():
                if "lora_" in name:
                    p.add_(0.01)
    model = TSPForCausalLM.from_pretrained(source, group)
    inputs = plain_inputs()
    with model.tsp.comm.recording() as rec:
        out = model(**inputs)
        out.loss.backward()
    grads = dict(gather_adapter(model.tsp, grads=True))
    lora = {id(p) for _, p, _ in model.tsp.lora_tensors()}
    non_lora = sorted(n for n, p in model.named_parameters() if p.grad is not None and id(p) not in lora)
    optimizer = torch.optim.AdamW([p for p in source.parameters() if p.requires_grad], lr=LORA_LR)
    rebind_optimizer(optimizer, parameter_names(source), model)
    optimizer.step()
    return {"loss": out.loss.detach(), "grads": grads, "non_lora_grads": non_lora, "ops": rec.ops,
            "factors": dict(gather_adapter(model.tsp)),
            "logits": model(input_ids=inputs["input_ids"], logits_to_keep=inputs["input_ids"].shape[1]).logits.detach(),
            "state": len(optimizer.state) == len(lora)}


def _four_ranks(checkpoints: dict, root: str, slow: bool) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for family, directory in checkpoints.items():
        for stage, ac in ZERO_RUNS:
            out[("zero", family, stage)] = _zero_run(directory, stage, ac, f"{root}/{family}_zero{stage}")
        out[("fsdp2", family)] = _fsdp2_run(directory, offload=family == "qwen3_next_moe")
        stage = FROZEN_STAGES[family]
        out[("frozen", family)] = _zero_run(directory, stage, False, f"{root}/{family}_frozen", frozen=True)
    out["pipeline"] = _pipeline_run(checkpoints["qwen3_5"])
    out["lora_zero"] = _zero_run(checkpoints["qwen3_5"], LORA_STAGE, True, f"{root}/lora_zero", lora=True)
    ds_config = Path(root) / "accelerate_ds.json"
    if rank == 0:
        ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
                                         "gradient_clipping": "auto", "steps_per_print": 1_000_000,
                                         "zero_optimization": {"stage": 2}, "tsp": {"size": 2}}))
    dist.barrier()
    out["accelerate_ds"] = _accelerate_run(checkpoints["qwen3_5"], f"{root}/acc_ds", {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_config),
        "ACCELERATE_MIXED_PRECISION": "no"})
    if slow:  # the FSDP2 plugin adds ~13 s of CPU over the 4 ranks
        out["accelerate_fsdp2"] = _accelerate_run(checkpoints["qwen3_5"], f"{root}/acc_fsdp2", {
            "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
            "ACCELERATE_MIXED_PRECISION": "no"})

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    family = FAMILIES[rank // 2]
    directory, group = checkpoints[family], halves[rank // 2]
    if family == "qwen3_5":
        out["ac64"] = _float64_step(directory, group, plain_inputs(), activation_checkpointing=True)
    else:
        out["ac64"] = _float64_step(directory, group, packed_inputs(), activation_checkpointing=True,
                                    offload_activations=True)
    out["frozen64"] = _float64_step(directory, group, plain_inputs(), frozen=True)
    out["lora64"] = _lora_step(directory, group, perturb=rank % 2 == 1)
    out["family"] = family
    gathered = [None] * 4
    dist.all_gather_object(gathered, out)
    return gathered if rank == 0 else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_compose")
    return {family: save_checkpoint(root / family, hybrid_config(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def four_ranks(checkpoints, tmp_path_factory, request):
    from conftest import _run_slow

    root = tmp_path_factory.mktemp("hybrid_compose_runs")
    results = run_on_local_ranks(_four_ranks, 4, checkpoints, str(root), _run_slow(request.config), timeout_s=900,
                                 env={"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"})[0]
    return results, root


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    return {family: reference_loop(directory) for family, directory in checkpoints.items()}


def _assert_saved(directory: Path, want: dict, start: dict) -> None:
    """The consolidated save reloads in transformers with the reference's final weights (1e-4 norm-wise); a tensor
    that trains moved, a frozen one (requires_grad False at the start) is bit-identical to the start."""
    saved = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    got = saved.state_dict()
    assert set(got) == set(want["final"])
    for name, value in want["final"].items():
        if start[name].requires_grad:
            assert not torch.equal(got[name], start[name].detach()), f"{name} did not move"
            assert (got[name] - value).norm() <= 1e-4 * value.norm(), name
        else:
            assert torch.equal(got[name], start[name].detach()), f"{name} is frozen and moved"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stage, checkpointing", ZERO_RUNS)
def test_deepspeed_zero_tsp2_dp2_matches_transformers(four_ranks, references, checkpoints, family, stage,
                                                      checkpointing):
    results, root = four_ranks
    for rank in range(4):  # every rank logs the same global loss and clip norm
        _assert_steps(results[rank][("zero", family, stage)], references[family], (family, stage, rank))
    start = dict(load(checkpoints[family]).named_parameters())
    _assert_saved(root / f"{family}_zero{stage}", references[family], start)


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_tsp2_dp2_with_activation_checkpointing_matches_transformers(four_ranks, references, family):
    """qwen3_next_moe also offloads the checkpointed layer inputs to host memory (offload_activations)."""
    results, _ = four_ranks
    for rank in range(4):
        got = results[rank][("fsdp2", family)]
        assert got["dtensor"], rank
        _assert_steps(got, references[family], ("fsdp2", family, rank))


@pytest.mark.parametrize("setup", ["accelerate_ds", pytest.param("accelerate_fsdp2", marks=pytest.mark.slow)])
def test_tsp_accelerator_tsp2_dp2_trains_a_hybrid_like_one_process(four_ranks, checkpoints, setup):
    """TSPAccelerator under DeepSpeed ZeRO-2 and under its FSDP2 plugin (tsp 2 x data 2): every step's global loss
    and clip norm equal the same loop in plain transformers."""
    results, _ = four_ranks
    want = _plain_accelerate_loop(checkpoints["qwen3_5"], ACC_STEPS, ACC_SEQ)
    assert want[0]["grad_norm"] > 1.0, "clipping must be active"
    for rank in range(4):
        got = results[rank][setup]
        assert [g["step"] for g in got] == [w["step"] for w in want], (got, want)
        for g, w in zip(got, want):
            assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (setup, rank, g, w)
            assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * abs(w["grad_norm"]), (setup, rank, g, w)


@pytest.mark.parametrize("family", FAMILIES)
def test_deepspeed_trains_exactly_the_unfrozen_tensors(four_ranks, checkpoints, family):
    results, root = four_ranks
    want = reference_loop(checkpoints[family], frozen=True)
    for rank in range(4):
        _assert_steps(results[rank][("frozen", family)], want, ("frozen", family, rank))
    start = dict(load(checkpoints[family], frozen=True).named_parameters())
    assert sum(not p.requires_grad for p in start.values()) >= 6
    _assert_saved(root / f"{family}_frozen", want, start)


def _float64_reference(directory: str, inputs: dict, frozen: bool = False):
    model = freeze_(load_hf_reference(directory, torch.float64), _family_of(directory)) if frozen else \
        load_hf_reference(directory, torch.float64)
    documents = {"documents": inputs["documents"]} if "documents" in inputs else {}
    loss, grads = hf_loss_and_grads(model, inputs["input_ids"], shift(inputs["labels"]), **documents)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    grads = {n: g for n, g in grads.items() if n in trainable}
    return loss, canonical_state_dict(grads, "qwen3_moe")  # transformers' fused experts -> checkpoint names


def _family_of(directory: str) -> str:
    return Path(directory).name


def _ranks_of(results, family: str) -> list[int]:
    return [r for r in range(4) if results[r]["family"] == family]


def _assert_exact(got: dict, want, what) -> None:
    loss, grads = want
    assert rel(got["loss"], loss) < 1e-10, (what, float(got["loss"]), float(loss))
    errors = {n: rel(got["grads"][n], g) for n, g in grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-10, (what, worst, errors[worst])


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_float64_every_gradient_matches_transformers(four_ranks, checkpoints, family):
    """qwen3_5: checkpointing on plain rows; qwen3_next_moe: packed documents, checkpointed inputs offloaded."""
    results, _ = four_ranks
    inputs = plain_inputs() if family == "qwen3_5" else packed_inputs()
    want = _float64_reference(checkpoints[family], inputs)
    assert set(want[1]) == set(canonical_state_dict(load(checkpoints[family]).state_dict(), "qwen3_moe"))
    for rank in _ranks_of(results, family):
        _assert_exact(results[rank]["ac64"], want, (family, rank))


WEIGHT_GRAD_OPS = ("grad of block", "grad hop", "replicated weight grads")


def _weight_grad_layers(ops: list[dict]) -> set[str]:
    return {op["layer"].rsplit(" ", 1)[0] for op in ops if (op["what"] or "").startswith(WEIGHT_GRAD_OPS)}


@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_gated_deltanet_float64_grads_none_and_no_weight_grad_collectives(four_ranks, checkpoints, family):
    results, _ = four_ranks
    ranks = _ranks_of(results, family)
    want = _float64_reference(checkpoints[family], plain_inputs(), frozen=True)
    frozen_layers = {"qwen3_5": {"tsp.model.layers.0.linear_attn"},
                     "qwen3_next_moe": {"tsp.model.layers.0.linear_attn", "tsp.model.layers.1.self_attn"}}[family]
    for rank in ranks:
        got = results[rank]["frozen64"]
        _assert_exact(got, want, (family, rank))
        frozen = {"qwen3_5": ["tsp.model.layers.0.linear_attn.norm.weight",
                              "tsp.model.layers.0.linear_attn.packed_shard"],
                  "qwen3_next_moe": ["tsp.model.layers.0.linear_attn.packed_shard",
                                     "tsp.model.layers.1.self_attn.k_norm.weight",
                                     "tsp.model.layers.1.self_attn.packed_shard",
                                     "tsp.model.layers.1.self_attn.q_norm.weight"]}[family]
        assert got["no_grad"] == frozen, got["no_grad"]
        # the same layers post their weight-grad collectives when they train (the checkpointed step above)
        trained = _weight_grad_layers(results[rank]["ac64"]["ops"])
        assert frozen_layers <= trained, trained
        assert not frozen_layers & _weight_grad_layers(got["ops"]), _weight_grad_layers(got["ops"])
    for key in ("frozen64", "ac64"):
        report = check({r: results[r][key]["ops"] for r in ranks})
        assert report.ok and report.completed == report.total, (family, key, str(report))


# --- no launch --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("frozen", ["A_log", "in_proj_qkv.weight"])
def test_freezing_part_of_a_gated_deltanet_is_one_clear_error(checkpoints, frozen):
    """A rank's Gated DeltaNet tensors are one packed shard: freezing some of them (A_log alone, in_proj_qkv
    alone) cannot be carried and is refused by name; freezing them all (the gated norm apart) works (above)."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.model.convert import to_tsp_model

    model = load(checkpoints["qwen3_5"])
    getattr(model.model.layers[0].linear_attn, frozen.split(".")[0])
    for name, p in model.named_parameters():
        p.requires_grad_(name != f"model.layers.0.linear_attn.{frozen}")
    with pytest.raises(TSPConfigError, match=rf"model.layers.0.linear_attn.{frozen} frozen but .* trainable.*"
                                             r"Gated DeltaNet's in_proj_\*, conv1d, A_log, dt_bias and out_proj "
                                             r"into one.*freeze or unfreeze the whole model.layers.0.linear_attn"):
        to_tsp_model(model, TSPComm.single(), hf_face=True)


# --- PEFT LoRA on the Gated DeltaNet's linears ----------------------------------------------------------------------
def _tsp_rank0(results, family: str) -> int:
    return _ranks_of(results, family)[0]  # global 0 or 2: TSP rank 0 of its half, where the gathers land


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_gated_deltanet_float64_matches_peft(four_ranks, checkpoints, family):
    """TSP=2, float64: the loss and every LoRA factor's gradient (the Gated DeltaNet's in_proj_* / out_proj and
    the attention / MLP ones) within 1e-10 of PEFT on transformers' model; the frozen base gets no gradient; the
    step's collectives pass the NCCL-rules replay. After one AdamW step of the optimizer built on the PEFT model
    (rebound to the TSP factors), the gathered adapter equals PEFT's own step (1e-8: Adam's first step divides by
    |g|) and, loaded into plain PEFT, gives the TSP model's logits (1e-10)."""
    import peft

    results, _ = four_ranks
    got = results[_tsp_rank0(results, family)]["lora64"]
    reference = lora_model(checkpoints[family], torch.float64)
    inputs = plain_inputs()
    ref_loss, ref_grads = hf_loss_and_grads(reference, inputs["input_ids"], shift(inputs["labels"]))
    want = {n.replace(".default.", "."): g for n, g in ref_grads.items() if "lora_" in n}
    assert sum(".linear_attn." in n for n in want) == {"qwen3_5": 10, "qwen3_next_moe": 6}[family]
    assert rel(got["loss"], ref_loss) < 1e-10
    assert set(got["grads"]) == set(want)
    errors = {n: rel(got["grads"][n], g) for n, g in want.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-10, (worst, errors[worst])
    assert min(float(g.norm()) for g in want.values()) > 0, "every LoRA factor has a gradient to compare"
    assert got["non_lora_grads"] == [] and got["state"]
    report = check({r: results[r]["lora64"]["ops"] for r in _ranks_of(results, family)})
    assert report.ok and report.completed == report.total, str(report)
    # one AdamW step on PEFT's own model (hf_loss_and_grads left its gradients in .grad)
    torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LORA_LR).step()
    stepped = peft.utils.get_peft_model_state_dict(reference)
    assert set(stepped) == set(got["factors"])
    assert max(rel(got["factors"][k], v) for k, v in stepped.items()) < 1e-8
    loaded = lora_model(checkpoints[family], torch.float64)
    peft.set_peft_model_state_dict(loaded, got["factors"])
    from ds_tsp.tools.hf_reference import hf_logits

    logits = hf_logits(loaded, inputs["input_ids"])
    assert rel(got["logits"], logits) < 1e-10
    assert rel(logits, hf_logits(lora_model(checkpoints[family], torch.float64), inputs["input_ids"])) > 1e-6


def test_deepspeed_zero3_trains_gated_deltanet_lora_like_peft(four_ranks, checkpoints):
    """ds_tsp.initialize on the PEFT LoRA Qwen3.5 (ZeRO-3, activation checkpointing, tsp 2 x data 2, fp32): losses
    and clip norms equal PEFT's single-process loop (1e-5 / 1e-4); the saved adapter equals its factors (1e-4)."""
    from safetensors.torch import load_file

    results, root = four_ranks
    want = reference_loop(checkpoints["qwen3_5"], lora=True)
    for rank in range(4):
        _assert_steps(results[rank]["lora_zero"], want, ("lora", rank))
    saved = load_file(root / "lora_zero" / "adapter_model.safetensors")
    final = {k.replace(".default.", "."): v for k, v in want["final"].items() if "lora_" in k}
    assert set(saved) == set(final) and any(".linear_attn.in_proj_qkv." in k for k in saved)
    for name, value in final.items():
        assert (saved[name] - value).norm() <= 1e-4 * value.norm(), name


def test_pipeline_stages_train_a_hybrid_like_transformers(four_ranks, references):
    """tsp.pipeline_stages 2 x TSP 2 on Qwen3.5 (the Gated DeltaNet layer on stage 0, the gated attention on stage
    1): every step's global loss (1e-5) and clip norm (1e-4) equal transformers' loop, and the two stages' final
    weights its final weights (1e-5 norm-wise per tensor: AdamW amplifies last-bit rounding, ~1e-6 seen). (A MoE
    hybrid with the aux loss is refused under pipeline stages by name, as every MoE model:
    tests/moe/test_moe_compose.py.)"""
    results, _ = four_ranks
    want = references["qwen3_5"]
    stages, final = {}, {}
    for rank in range(4):
        got = results[rank]["pipeline"]
        _assert_steps(got, want, ("pipeline", rank))
        stages[got["stage"]] = got["mixers"]
        final.update(got["final"])
    assert stages == {0: ["TSPGatedDeltaNet"], 1: ["TSPAttention"]}, stages
    assert set(final) == set(want["final"]), sorted(set(final) ^ set(want["final"]))
    worst = max((float((final[k] - v).norm() / v.norm()), k) for k, v in want["final"].items())
    assert worst[0] < 1e-5, worst


def test_gated_deltanet_lora_keeps_no_merged_shard_for_backward(checkpoints):
    """D=1: the Gated DeltaNet Function saves the base shard and the factors of a LoRA-merged shard (rebuilt in
    backward, ds_tsp.core.layers.shard_rebuild), not the merged shard-sized tensor (tests/model/test_lora_memory.py's
    measure); its factors still get their gradients."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.hf import TSPForCausalLM

    model = TSPForCausalLM.from_pretrained(lora_model(checkpoints["qwen3_5"]), TSPComm.single())
    gdn = model.tsp.model.layers[0].linear_attn
    assert gdn.lora is not None
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t
        return t

    inputs = plain_inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert gdn.packed_shard.untyped_storage().data_ptr() in saved  # the hook saw the Function save its base shard
    merged = [tuple(t.shape) for ptr, t in saved.items() if t.numel() == gdn.packed_shard.numel() and ptr not in params]
    assert merged == [], merged
    out.loss.backward()
    factors = [p for name, p, _ in model.tsp.lora_tensors() if ".linear_attn." in name]
    assert len(factors) == 10 and all(p.grad is not None and p.grad.norm() > 0 for p in factors)
