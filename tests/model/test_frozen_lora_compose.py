"""Frozen parameters and PEFT LoRA through the rest of ds_tsp: training checkpoints, pipeline stages, FSDP2, MoE.

- ds_tsp training checkpoints (DeepSpeed ZeRO-1, fp32) of a model with a frozen set and of a LoRA model: the files
  hold only the trainable tensors (LoRA: the adapter's factors and their Adam moments, never the frozen base);
  resuming on the same layout (TSP=2; LoRA also under ZeRO-3) continues bit-identically (losses equal as floats);
  resuming on another layout (TSP=2 x DP=1 -> TSP=1 x DP=2, same global batch) continues within the
  resharded-resume tolerance of tests/checkpoint/test_training_checkpoint.py (first two steps 1e-5 relative, later ones 4x
  the distance of two uninterrupted runs on the two layouts, or 1e-5; measured: resumed == uninterrupted on the
  new layout, ~1e-7 from the old). A resume whose frozen set differs is one error naming it.
- Pipeline stages (pipe=2 x TSP=2) from an HF model with frozen tensors on both stages: losses within 1e-5
  relative of the single-device AdamW loop (as tests/model/test_frozen_params.py's), frozen parameters carry no gradient
  and no optimizer state and stay bit-identical; a stage with nothing to train is one error on every rank; a PEFT
  LoRA model is refused by name (no launch).
- FSDP2 on the data axis (TSP=2 x DP=2) with the frozen set and with LoRA: losses within 1e-5 relative and clip
  norms within 1e-4 of single-device transformers / PEFT, the LoRA factors after STEPS within 1e-4 (norm-wise) of
  PEFT's, every trainable shard moved and every frozen one bit-identical.
- LoRA on mixture-of-experts experts (Qwen3-MoE target_modules gate/up/down_proj, which PEFT turns into
  target_parameters on the fused experts; Mixtral target_parameters) is refused by name; LoRA on an MoE model's
  attention converts.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("deepspeed")

from engine_steps import full_weights  # noqa: E402
from hf_tiny import build_tiny_model  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402
from masked_patterns import MaskedPatterns  # noqa: E402
from test_frozen_params import CLIP, LR, STEPS, _reference_loop, batches, frozen_model  # noqa: E402

from ds_tsp.core.comm.communicator import TSPComm  # noqa: E402
from ds_tsp.core.errors import TSPConfigError  # noqa: E402

ENV = {"DS_ACCELERATOR": "cpu"}
KINDS = ("attn1_head", "lora")  # frozen: embedding and layer 0 frozen, layer 1's attention + norms + head train
CK_STEPS, SAVE_AT = 5, 2


# --- training checkpoints -------------------------------------------------------------------------------------------
def _ck_config(tsp: int, micro_batch: int, stage: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "steps_per_print": 10_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 4}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": CLIP, "tsp": {"size": tsp}}


def _ck_engine(kind: str, cfg: dict):
    import ds_tsp

    hf = frozen_model(kind, torch.float32)
    data = MaskedPatterns(vocab_size=hf.config.vocab_size, seq_len=32, num_samples=64)
    engine, _, loader, _ = ds_tsp.initialize(model=hf, config=cfg, training_data=data)
    return engine, loader


def _ck_steps(engine, batches_, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        share = engine(**next(batches_))  # an in-memory HF model: the engine trains its core (loss share)
        engine.backward(share)
        engine.step()
        losses.append(float(engine.tsp_model.loss_for_logging(share)))
    return losses


def _checkpoints(directory: str) -> dict:
    """Per kind: uninterrupted TSP=2 run saving at SAVE_AT; resumes on TSP=2 and on TSP=1 x DP=2; an uninterrupted
    TSP=1 x DP=2 run; what the checkpoint holds; the error of a resume with another frozen set."""
    import ds_tsp

    same, other = _ck_config(2, 4), _ck_config(1, 2)
    out = {}
    zero3 = _ck_config(2, 4, stage=3)  # LoRA under ZeRO-3 (factors partitioned over the data axis): same layout
    engine, loader = _ck_engine("lora", zero3)
    it = iter(loader)
    first = _ck_steps(engine, it, SAVE_AT)
    ds_tsp.save_training_checkpoint(engine, f"{directory}/lora_zero3", SAVE_AT, loader=loader)
    rest = _ck_steps(engine, it, CK_STEPS - SAVE_AT)
    engine.destroy()
    engine, loader = _ck_engine("lora", zero3)
    step = ds_tsp.load_training_checkpoint(engine, f"{directory}/lora_zero3", loader=loader)
    out["lora_zero3"] = {"uninterrupted": first + rest, "same": _ck_steps(engine, iter(loader), CK_STEPS - step)}
    engine.destroy()
    for kind in KINDS:
        where = f"{directory}/{kind}"
        engine, loader = _ck_engine(kind, same)
        it = iter(loader)
        first = _ck_steps(engine, it, SAVE_AT)
        path = ds_tsp.save_training_checkpoint(engine, where, SAVE_AT, loader=loader)
        rest = _ck_steps(engine, it, CK_STEPS - SAVE_AT)
        trainable = sorted(n for n, p in engine.tsp_model.named_parameters() if p.requires_grad)
        engine.destroy()
        entry = {"uninterrupted": first + rest, "trainable": trainable,
                 "tensors": sorted(json.loads((path / "manifest.json").read_text())["shards"]["0"])}
        for name, cfg in (("same", same), ("other", other)):
            engine, loader = _ck_engine(kind, cfg)
            step = ds_tsp.load_training_checkpoint(engine, where, loader=loader)
            entry[name] = _ck_steps(engine, iter(loader), CK_STEPS - step)
            engine.destroy()
        engine, loader = _ck_engine(kind, other)
        entry["other_uninterrupted"] = _ck_steps(engine, iter(loader), CK_STEPS)
        engine.destroy()
        out[kind] = entry
    engine, loader = _ck_engine("mlp0_embed", same)  # another frozen set than the checkpoint's
    try:
        ds_tsp.load_training_checkpoint(engine, f"{directory}/attn1_head", loader=loader)
        out["foreign"] = "no error"
    except TSPConfigError as err:
        out["foreign"] = str(err)
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    return run_on_local_ranks(_checkpoints, 2, str(tmp_path_factory.mktemp("frozen_ck")), timeout_s=600, env=ENV)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_holds_only_trainable_tensors(checkpoint_runs, kind):
    got = checkpoint_runs[0][kind]
    saved = sorted({t.split("::")[0] for t in got["tensors"]})
    assert saved == got["trainable"], (saved, got["trainable"])
    assert {t.split("::")[1] for t in got["tensors"] if "::" in t} == {"exp_avg", "exp_avg_sq"}
    if kind == "lora":  # the adapter only: 3 targets x 2 layers x (A, B), nothing of the frozen base
        assert len(saved) == 12 and all(".lora." in n for n in saved), saved
    else:
        assert not any("embed_tokens" in n or "layers.0." in n for n in saved), saved


@pytest.mark.parametrize("kind", [*KINDS, "lora_zero3"])
def test_resume_same_layout_is_bit_identical(checkpoint_runs, kind):
    for rank, runs in enumerate(checkpoint_runs):
        got = runs[kind]
        assert got["same"] == got["uninterrupted"][SAVE_AT:], (rank, got)  # exact float equality
        assert got["uninterrupted"][-1] < got["uninterrupted"][0]


@pytest.mark.parametrize("kind", KINDS)
def test_resume_on_another_layout_within_reshard_tolerance(checkpoint_runs, kind):
    got = checkpoint_runs[0][kind]
    want = torch.tensor(got["uninterrupted"][SAVE_AT:], dtype=torch.float64)
    rel = ((torch.tensor(got["other"], dtype=torch.float64) - want).abs() / want).tolist()
    noise = ((torch.tensor(got["other_uninterrupted"][SAVE_AT:], dtype=torch.float64) - want).abs() / want).tolist()
    print(f"{kind}: resumed on TSP=1 x DP=2 vs uninterrupted TSP=2 (relative): {rel}; two layouts: {noise}")
    assert max(rel[:2]) < 1e-5, rel
    assert all(r <= max(4 * n, 1e-5) for r, n in zip(rel, noise)), (rel, noise)


def test_resume_with_another_frozen_set_is_one_error(checkpoint_runs):
    for runs in checkpoint_runs:
        assert "which is frozen (requires_grad=False) or absent in this model: freeze the same parameters" in \
            runs["foreign"], runs["foreign"]


# --- pipeline stages and FSDP2: one 4-rank launch -----------------------------------------------------------------
# Trainable on both stages (stage 0: embedding + layer 0, stage 1: layer 1 + head): layer 0's MLP, layer 1's
# attention, the head; frozen: the embedding, the norms, layer 0's attention, layer 1's MLP.
PIPE_TRAINABLE = ("model.layers.0.mlp.", "model.layers.1.self_attn.", "lm_head")


def pipe_model():
    model = build_tiny_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(PIPE_TRAINABLE))
    return model


def _pipe_reference_loop() -> dict:
    """The single-device AdamW loop of tests/model/test_frozen_params.py on pipe_model(): losses, clip norms, final
    weights."""
    model = pipe_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for ids in batches(model.config.vocab_size, STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "final": model.state_dict()}


def _pipeline_frozen() -> dict:
    import torch.distributed as dist

    import ds_tsp
    from ds_tsp.core.tokens.zigzag import shard_batch

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": True}},
              "gradient_clipping": CLIP, "zero_optimization": {"stage": 1},
              "tsp": {"size": 2, "pipeline_stages": 2}}
    try:  # stage 0 (embedding, layer 0) entirely frozen
        ds_tsp.initialize(model=frozen_model("attn1_head", torch.float32), config=config)
        refused = "no error"
    except TSPConfigError as err:
        refused = str(err)
    hf = pipe_model()
    engine, *_ = ds_tsp.initialize(model=hf, config=config)
    groups = engine.tsp_groups
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    def feed():
        for ids in batches(hf.config.vocab_size, STEPS):
            b = shard_batch(ids, tsp=groups.tsp_size, rank=groups.tsp_rank, labels=ids)
            yield (b["input_ids"], b["position_ids"], b["shift_labels"]), b["shift_labels"]

    it, losses, norms = feed(), [], []
    for _ in range(STEPS):
        share = engine.train_batch(it)
        dist.all_reduce(share, group=groups.tsp_group)
        losses.append(float(share))
        norms.append(float(engine.get_global_grad_norm()))
    from deepspeed.utils import safe_get_full_optimizer_state  # ZeRO-1 keys its state by flat partitions

    params = {n: {"trainable": p.requires_grad, "grad": p.grad is not None,
                  "state": safe_get_full_optimizer_state(p, "exp_avg") is not None,
                  "moved": not torch.equal(p.detach(), start[n])} for n, p in engine.module.named_parameters()}
    final = full_weights(engine)  # this stage's layers, full and HF-named
    engine.destroy()
    return {"losses": losses, "norms": norms, "final": final, "params": params, "stage": groups.pipe_rank,
            "refused": refused}


def _fsdp_frozen(kind: str, groups) -> dict:
    from ds_tsp.core.grads.clip import clip_grad_norm_
    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.integrations.fsdp import shard_with_fsdp2

    hf = frozen_model(kind, torch.float32)
    model = TSPForCausalLM.from_pretrained(hf, groups.tsp_group)
    shard_with_fsdp2(model, groups)
    start = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for ids in batches(hf.config.vocab_size, STEPS):
        mine = ids[groups.data_rank:groups.data_rank + 1]  # B=2 rows: one per data replica
        out = model(input_ids=mine, labels=mine)
        out.loss.backward()
        norms.append(float(clip_grad_norm_(model, CLIP, groups)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    from ds_tsp.checkpoint.hf.peft_adapter import gather_adapter

    adapter = dict(gather_adapter(model.tsp))  # the full factors on TSP rank 0 (collective)
    moved = {n: (p.requires_grad, not torch.equal(p.detach().to_local(), start[n]))
             for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "adapter": adapter, "moved": moved}


def _four_ranks() -> dict:
    import torch.distributed as dist

    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups

    out = {"pipeline": _pipeline_frozen()}
    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=2))
    for kind in KINDS:
        out[("fsdp", kind)] = _fsdp_frozen(kind, groups)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_local_ranks(_four_ranks, 4, timeout_s=600, env=ENV)


def test_pipeline_stages_carry_frozen_parameters_like_single_device(four_ranks):
    """Losses (1e-5) and clip norms (1e-4) every step, and the final weights of both stages (1e-5 norm-wise per
    tensor: AdamW amplifies last-bit rounding; frozen ones bit-identical) equal the single-device loop."""
    want = _pipe_reference_loop()
    assert want["norms"][0] > CLIP, "clipping must be active, or the norms prove nothing"
    stages, final = set(), {}
    for rank, run in enumerate(four_ranks):
        got = run["pipeline"]
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=0), \
            (rank, got)
        assert torch.allclose(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-4), \
            (rank, got["norms"], want["norms"])
        for name, p in got["params"].items():
            if p["trainable"]:
                assert p["state"] and p["moved"], (rank, name, p)
            else:  # no gradient, no optimizer state, not moved
                assert not (p["state"] or p["grad"] or p["moved"]), (rank, name, p)
        stages.add((got["stage"], tuple(sorted(n for n, p in got["params"].items() if p["trainable"]))))
        final.update(got["final"])
    assert len(stages) == 2 and all(trainable for _, trainable in stages), stages
    assert sum(len(trainable) for _, trainable in stages) == 3, stages  # layer 0's MLP | layer 1's attention, head
    start = pipe_model()
    assert set(final) == set(want["final"]), sorted(set(final) ^ set(want["final"]))
    for name, p in start.named_parameters():
        if p.requires_grad:
            assert (final[name] - want["final"][name]).norm() < 1e-5 * want["final"][name].norm(), name
        else:
            assert torch.equal(final[name], p.detach()), name


def test_pipeline_stage_with_nothing_to_train_is_one_error_on_every_rank(four_ranks):
    for run in four_ranks:
        assert "pipeline stage 0 of 2 holds only frozen parameters (requires_grad=False)" in \
            run["pipeline"]["refused"], run["pipeline"]["refused"]


def test_pipeline_stages_refuse_a_lora_model_by_name():
    import ds_tsp

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "tsp": {"size": 2, "pipeline_stages": 2}}
    with pytest.raises(TSPConfigError, match=r"PEFT \(LoRA\) model with tsp.pipeline_stages > 1 is not supported.*"
                                             r"tsp.pipeline_stages=1.*merge_and_unload"):
        ds_tsp.initialize(model=frozen_model("lora", torch.float32), config=config)


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_frozen_and_lora_match_single_device_peft(four_ranks, kind):
    losses, norms, final = _reference_loop(kind)
    assert norms[0] > CLIP or kind == "lora", "clipping is active (the LoRA run's norms stay below CLIP)"
    for rank, run in enumerate(four_ranks):
        got = run[("fsdp", kind)]
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=0), (rank, got)
        assert torch.allclose(torch.tensor(got["norms"]), torch.tensor(norms), rtol=1e-4, atol=0), (rank, got)
        trainable_moved = {n: moved for n, (trainable, moved) in got["moved"].items() if trainable}
        assert all(trainable_moved.values()) and len(trainable_moved) == {"lora": 12, "attn1_head": 4}[kind], got
        assert not any(moved for trainable, moved in got["moved"].values() if not trainable), got["moved"]
    if kind == "lora":  # the adapter after STEPS, as PEFT's
        adapter = four_ranks[0][("fsdp", kind)]["adapter"]
        want = {k.replace(".default.", "."): v for k, v in final.items() if "lora_" in k}
        assert set(adapter) == set(want) and len(want) == 12
        for name, value in want.items():
            assert (adapter[name] - value).norm() <= 1e-4 * value.norm(), name


# --- LoRA on mixture-of-experts experts --------------------------------------------------------------------------
@pytest.mark.parametrize("family, lora", [
    ("qwen3_moe", dict(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])),
    ("mixtral", dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))])
def test_lora_on_moe_experts_is_refused_by_name(family, lora):
    from ds_tsp.model.convert import to_tsp_model

    model = peft.get_peft_model(build_tiny_model(family), peft.LoraConfig(r=2, **lora))
    with pytest.raises(TSPConfigError, match=r"LoRA on mixture-of-experts experts \(model.layers.\d.mlp.experts.*"
                                             r"target_parameters=.*gate_up_proj.*is not supported under TSP.*"
                                             r"Target the attention projections and dense MLPs only"):
        to_tsp_model(model, TSPComm.single(), hf_face=True)


def test_lora_on_moe_attention_converts():
    from ds_tsp.model.convert import to_tsp_model

    model = peft.get_peft_model(build_tiny_model("qwen3_moe"), peft.LoraConfig(r=2, target_modules=["q_proj",
                                                                                                    "o_proj"]))
    tsp = to_tsp_model(model, TSPComm.single(), hf_face=True)
    assert len(tsp.tsp.lora_tensors()) == 2 * 2 * 2  # q and o, 2 layers, A and B
