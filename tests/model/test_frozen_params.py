"""requires_grad of an HF model carried to its TSP shards, and frozen shards costing no weight-gradient traffic.

- Conversion (D=1, no launch): each shard takes its HF tensors' flag; a shard mixing frozen and trainable tensors
  is one error naming them; a checkpoint directory loads all trainable; an optimizer built on the trainable
  parameters only is rebound (what the Trainer builds), one missing a trainable parameter is refused; a training
  checkpoint holds only the trainable parameters.
- TSP=2 against transformers' own model, float64, two frozen sets: the trainable tensors' gradients equal the
  reference's (1e-10 norm-wise relative), every frozen shard's `.grad` stays None, and the weight-grad
  collectives (attention reduces, ring grad hops, the replicated-grad all-reduce) run for trainable shards only.
- ds_tsp.initialize (DeepSpeed ZeRO-2 and ZeRO-3, TSP=2, fp32) from an HF model with a frozen set against a plain
  single-process AdamW loop with the same set: losses and clipping norms equal (1e-5 / 1e-4), the frozen tensors
  bit-identical to the start, the trainable ones moved like the reference's. The same with a PEFT LoRA model
  (ZeRO-2 and ZeRO-3): the saved adapter equals the reference PEFT loop's.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import build_tiny_model, save_tiny_checkpoint, shift  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.comm.communicator import TSPComm  # noqa: E402
from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.model.convert import parameter_names, rebind_optimizer, to_tsp_model  # noqa: E402
from ds_tsp.tools.hf_reference import hf_loss_and_grads, patch_float64_  # noqa: E402

# HF name prefixes left trainable; everything else is frozen.
SETS = {"attn1_head": ("model.layers.1.self_attn.", "model.layers.1.input_layernorm", "model.layers.1.post_",
                       "lm_head"),
        "mlp0_embed": ("model.layers.0.mlp.", "model.embed_tokens")}
B, S = 2, 30
LR, CLIP, STEPS = 3e-3, 0.5, 3


def frozen_model(set_name: str, dtype=torch.float64):
    model = build_tiny_model("llama", dtype=dtype)  # untied: embedding and head are separate shards
    if set_name == "lora":  # PEFT freezes the base; factors seeded (PEFT's B = 0 would leave A's first grad 0)
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                              "down_proj"]))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        return model
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(SETS[set_name]))
    return model


def batches(vocab: int, n: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (B, S), generator=g) for _ in range(n)]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# --- conversion, no launch ------------------------------------------------------------------------------------------
def test_flags_carried_mixed_shard_refused_and_directory_all_trainable(tmp_path):
    model = to_tsp_model(frozen_model("attn1_head"), TSPComm.single(), hf_face=True)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["tsp.lm_head.vocab_shard", "tsp.model.layers.1.input_layernorm.weight",
                         "tsp.model.layers.1.post_attention_layernorm.weight",
                         "tsp.model.layers.1.self_attn.packed_shard"]
    mixed = frozen_model("attn1_head")
    mixed.model.layers[1].self_attn.k_proj.weight.requires_grad_(False)
    with pytest.raises(TSPConfigError, match=r"k_proj.weight frozen but .*q_proj.weight.* trainable.*freeze or "
                                             r"unfreeze the whole model.layers.1.self_attn"):
        to_tsp_model(mixed, TSPComm.single(), hf_face=True)
    directory = save_tiny_checkpoint(tmp_path / "ck", "llama")
    assert all(p.requires_grad for p in to_tsp_model(str(directory), TSPComm.single(), hf_face=True).parameters())


def test_optimizer_on_trainable_parameters_only_is_rebound():
    hf = frozen_model("mlp0_embed", torch.float32)
    optimizer = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=LR)
    names = parameter_names(hf)
    model = to_tsp_model(hf, TSPComm.single(), hf_face=True)
    rebind_optimizer(optimizer, names, model)
    ids = batches(hf.config.vocab_size, 1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    want = {id(model.tsp.model.layers[0].mlp.packed_shard), id(model.tsp.model.embed_tokens.vocab_shard)}
    assert {id(p) for p in optimizer.state} == want, "optimizer state for the trainable shards only"
    hf = frozen_model("mlp0_embed", torch.float32)
    short = torch.optim.AdamW([hf.model.embed_tokens.weight], lr=LR)
    with pytest.raises(TSPConfigError, match=r"does not cover tsp.model.layers.0.mlp.packed_shard \(1 trainable"):
        rebind_optimizer(short, parameter_names(hf), to_tsp_model(hf, TSPComm.single(), hf_face=True))


def test_training_checkpoints_hold_only_trainable_parameters():
    """Frozen tensors (LoRA's base included) have no optimizer state and come from the model a resume loads: the
    checkpoint lists only the trainable ones, and which of them every TSP rank writes (tests/test_frozen_lora_
    compose.py resumes such checkpoints)."""
    from ds_tsp.checkpoint.training.train_state import saved_parameters, sharded_ids

    model = to_tsp_model(frozen_model("mlp0_embed"), TSPComm.single(), hf_face=True).tsp
    assert [n for n, _ in saved_parameters(model)] == ["model.embed_tokens.vocab_shard",
                                                       "model.layers.0.mlp.packed_shard"]
    model = to_tsp_model(frozen_model("lora"), TSPComm.single(), hf_face=True).tsp
    saved = saved_parameters(model)
    assert len(saved) == 12 and all(".lora." in n for n, _ in saved), saved  # q, v, down x 2 layers x (A, B)
    cut = sharded_ids(model)
    per_rank = sorted(n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n, p in saved if id(p) in cut)
    assert per_rank == sorted(["q_proj.lora_B", "v_proj.lora_B", "down_proj.lora_A"] * 2), per_rank


# --- TSP=2 ------------------------------------------------------------------------------------------------------------
WEIGHT_GRAD_OPS = ("grad of block", "grad hop", "replicated weight grads")


def _fp64_grads_and_traffic(set_name: str) -> dict:
    import torch.distributed as dist

    hf = frozen_model(set_name)
    model = to_tsp_model(hf, TSPComm(dist.group.WORLD), hf_face=True)
    ids = batches(hf.config.vocab_size, 1)[0]
    with model.tsp.comm.recording() as rec:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    traffic = sorted({(op["what"].split(" (")[0].rstrip(" 0123456789/"), op["layer"].rsplit(" ", 1)[0])
                      for op in rec.ops if (op["what"] or "").startswith(WEIGHT_GRAD_OPS)})
    grads = {n: p.grad is not None for n, p in model.named_parameters()}
    return {"loss": out.loss.detach(), "grads": model.tsp.full_state_dict(grads=True), "has_grad": grads,
            "traffic": traffic}


def _deepspeed_steps(stage: int, set_name: str, save_dir: str) -> dict:
    from engine_steps import engine_steps

    import ds_tsp

    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": True}},
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "tsp": {"size": 2}}
    hf = frozen_model(set_name, torch.float32)
    engine, *_ = ds_tsp.initialize(model=hf, config=config)
    return engine_steps(engine, ((ids, ids) for ids in batches(hf.config.vocab_size, STEPS)), save_dir)


def _tsp2(save_root: str) -> dict:
    out = {name: _fp64_grads_and_traffic(name) for name in SETS}
    out.update({("ds", stage): _deepspeed_steps(stage, "attn1_head", f"{save_root}/zero{stage}") for stage in (2, 3)})
    out.update({("lora", stage): _deepspeed_steps(stage, "lora", f"{save_root}/lora{stage}") for stage in (2, 3)})
    return out


@pytest.fixture(scope="module")
def tsp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    return run_on_local_ranks(_tsp2, 2, str(root), timeout_s=600, env={"DS_ACCELERATOR": "cpu"})[0], root


@pytest.mark.parametrize("set_name", sorted(SETS))
def test_tsp2_trainable_grads_exact_frozen_get_none_and_no_grad_traffic(tsp2, set_name):
    got = tsp2[0][set_name]
    reference = frozen_model(set_name)
    patch_float64_(reference)
    ids = batches(reference.config.vocab_size, 1)[0]
    ref_loss, ref_grads = hf_loss_and_grads(reference, ids, shift(ids))
    assert _rel(got["loss"], ref_loss) < 1e-10
    trainable = {n for n, p in reference.named_parameters() if p.requires_grad}
    for name in trainable:
        assert _rel(got["grads"][name], ref_grads[name]) < 1e-10, name
    frozen_tsp = {n for n, has in got["has_grad"].items() if not has}
    expected_traffic = {
        "attn1_head": [("grad hop", "tsp.lm_head"), ("grad of block", "tsp.model.layers.1.self_attn"),
                       ("replicated weight grads", "TSPForCausalLM")],
        "mlp0_embed": [("grad hop", "tsp.model.embed_tokens"), ("grad hop", "tsp.model.layers.0.mlp")]}[set_name]
    assert got["traffic"] == expected_traffic, got["traffic"]
    assert len(frozen_tsp) == len(got["has_grad"]) - {"attn1_head": 4, "mlp0_embed": 2}[set_name], frozen_tsp


def _reference_loop(set_name: str):
    model = frozen_model(set_name, torch.float32)
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
    return losses, norms, model.state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_ds_initialize_trains_exactly_the_unfrozen_tensors(tsp2, stage):
    results, root = tsp2
    got = results[("ds", stage)]
    losses, norms, final = _reference_loop("attn1_head")
    assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=0), (got, losses)
    assert norms[0] > CLIP, "clipping is active"
    assert torch.allclose(torch.tensor(got["norms"]), torch.tensor(norms), rtol=1e-4, atol=0), (got, norms)
    saved = transformers.AutoModelForCausalLM.from_pretrained(root / f"zero{stage}", dtype=torch.float32).state_dict()
    start = frozen_model("attn1_head", torch.float32)
    for name, p in start.named_parameters():
        if p.requires_grad:
            assert not torch.equal(saved[name], p.detach()), f"{name} is trainable and did not move"
            assert (saved[name] - final[name]).norm() <= 1e-4 * final[name].norm(), name
        else:
            assert torch.equal(saved[name], p.detach()), f"{name} is frozen and moved"


@pytest.mark.parametrize("stage", [2, 3])
def test_ds_initialize_trains_a_peft_lora_model_like_peft(tsp2, stage):
    results, root = tsp2
    losses, norms, final = _reference_loop("lora")
    got = results[("lora", stage)]
    assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=0), (got, losses)
    assert torch.allclose(torch.tensor(got["norms"]), torch.tensor(norms), rtol=1e-4, atol=0), (got, norms)
    from safetensors.torch import load_file

    saved = load_file(root / f"lora{stage}" / "adapter_model.safetensors")
    want = {k.replace(".default.", "."): v for k, v in final.items() if "lora_" in k}
    assert set(saved) == set(want) and len(want) == 2 * 3 * 2
    for name, value in want.items():
        assert (saved[name] - value).norm() <= 1e-4 * value.norm(), name


# --- mixture of experts: in-memory names (fused experts, Mixtral's mlp. block) differ from the checkpoint's --------
MOE_FROZEN = {  # family -> (frozen HF parameter suffix, the TSP parameter of layer 1 that must be frozen with it)
    ("qwen3_moe", "experts"): ((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"), "mlp.experts_shard"),
    ("qwen3_moe", "router"): ((".mlp.gate.weight",), "mlp.gate.weight"),
    ("mixtral", "experts"): ((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"), "mlp.experts_shard"),
    ("mixtral", "router"): ((".mlp.gate.weight",), "mlp.gate.weight"),
}


def _moe_model(family: str, frozen: tuple[str, ...]):
    model = build_tiny_model(family, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(not (name.startswith("model.layers.1.") and name.endswith(frozen)))
    return model


@pytest.mark.parametrize("family, what", sorted(MOE_FROZEN))
def test_moe_frozen_experts_or_router_carry_and_optimizer_rebinds_every_moe_param(family, what):
    """Frozen experts (fused gate_up_proj + down_proj) or a frozen router of layer 1 stay frozen on the TSP shard: no
    grad, no optimizer state; every other TSP parameter trains. The optimizer built on the HF model's trainable
    parameters (in-memory names) is rebound to exactly the trainable TSP parameters."""
    frozen, tsp_name = MOE_FROZEN[(family, what)]
    hf = _moe_model(family, frozen)
    assert sum(not p.requires_grad for p in hf.parameters()) == len(frozen)
    optimizer = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=LR)
    names = parameter_names(hf)
    model = to_tsp_model(hf, TSPComm.single(), hf_face=True)
    frozen_tsp = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen_tsp == [f"tsp.model.layers.1.{tsp_name}"], frozen_tsp
    rebind_optimizer(optimizer, names, model)
    rebound = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert rebound == {id(p) for p in model.parameters() if p.requires_grad}
    ids = batches(hf.config.vocab_size, 1)[0]
    out = model(input_ids=ids, labels=ids)
    assert out.aux_loss is not None  # output_router_logits: the router gets a gradient from the aux loss too
    out.loss.backward()
    optimizer.step()
    params = dict(model.named_parameters())
    assert params[frozen_tsp[0]].grad is None and id(params[frozen_tsp[0]]) not in {id(p) for p in optimizer.state}
    assert {id(p) for p in optimizer.state} == rebound, "state for every trainable shard, the MoE ones included"
    for name in ("tsp.model.layers.1.mlp.experts_shard", "tsp.model.layers.1.mlp.gate.weight"):
        if name != frozen_tsp[0]:
            assert params[name].grad is not None and params[name].grad.norm() > 0, name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_mixed_frozen_experts_and_unmappable_params_are_errors(family):
    half = _moe_model(family, (".mlp.experts.down_proj",))  # gate_up trains, down frozen: one packed shard
    with pytest.raises(TSPConfigError, match=r"model.layers.1.mlp.experts.down_proj frozen but "
                                             r"model.layers.1.mlp.experts.gate_up_proj trainable.*"
                                             r"`for p in layer.mlp.experts.parameters\(\)"):
        to_tsp_model(half, TSPComm.single(), hf_face=True)
    extra = build_tiny_model(family, dtype=torch.float32)  # a parameter no TSP parameter holds: named, not ignored
    extra.model.layers[1].mlp.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(2), requires_grad=False))
    with pytest.raises(TSPConfigError, match=r"model.layers.1.mlp.extra_scale \(1 HF parameters\) has no TSP "
                                             r"counterpart"):
        to_tsp_model(extra, TSPComm.single(), hf_face=True)
    hf = build_tiny_model(family, dtype=torch.float32)
    model = to_tsp_model(hf, TSPComm.single(), hf_face=True)
    stray = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW(list(hf.parameters()) + [stray], lr=LR)
    with pytest.raises(TSPConfigError, match=r"parameter 'model.layers.1.mlp.stray' has no TSP counterpart"):
        rebind_optimizer(optimizer, {**parameter_names(hf), id(stray): "model.layers.1.mlp.stray"}, model)
