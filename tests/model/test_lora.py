"""PEFT LoRA under TSP against single-device PEFT on transformers' own model (float64, 1e-10 norm-wise relative; a
correct schedule measures ~1e-15): the loss and every LoRA gradient at D=1, 2 and 4 (D=4 shares each of the 2 kv
heads between 2 ranks), a model with every projection targeted (Llama) and one with q/v only, use_rslora, biases
and Qwen3's q/k norms (Qwen2 and Qwen3 tiny models). One 4-rank launch runs every degree; it also builds the
optimizer on the PEFT model's trainable parameters (rebind_optimizer, as TSPAccelerator does), steps it, and
saves the adapter, which plain peft loads onto the plain transformers model with the TSP model's logits. Odd ranks
hold a different adapter (as an unseeded PEFT init would): the TSP model takes its TSP rank 0's.
Options TSP does not implement exactly are refused by name (no launch).
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_tiny import build_tiny_model, randomize_lora_, shift  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.comm.communicator import TSPComm  # noqa: E402
from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.tools.hf_reference import hf_logits, hf_loss_and_grads, patch_float64_  # noqa: E402

B, S = 2, 29
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {"llama": ("llama", dict(r=4, lora_alpha=8, target_modules=ALL)),
         "qwen2_qv": ("qwen2", dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj"], use_rslora=True)),
         "qwen3_ov": ("qwen3", dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj", "k_proj"])),
         # OLMo 3: LoRA on the q/k rows its whole-projection norms stream apart from the rest of the shard
         "olmo3_qk": ("olmo3", dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "up_proj"]))}


def peft_model(case: str):
    """The case's tiny float64 model (patched exact) with LoRA factors drawn at random (B is zero at PEFT's init,
    which would leave A's gradient zero and prove little)."""
    family, config = CASES[case]
    model = build_tiny_model(family, dtype=torch.float64)
    patch_float64_(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **config))
    return randomize_lora_(wrapped)


def make_batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.15] = -100
    return ids, labels


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _tsp_runs(save_root: str) -> dict | None:
    import torch.distributed as dist

    from ds_tsp.checkpoint.hf.peft_adapter import gather_adapter
    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.model.convert import parameter_names, rebind_optimizer
    from ds_tsp.model.peft.lora import adapter_mode, keep_initial_adapter

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {}
    for case in CASES:
        source = peft_model(case)
        if rank % 2:  # as if unseeded: every TSP group's rank 0 (global 0 and 2) holds the reference's adapter
            with torch.no_grad():
                for name, p in source.named_parameters():
                    if "lora_" in name:
                        p.add_(0.01 * rank)
        ids, labels = make_batch(source.config.vocab_size)
        for degree, group in ((4, dist.group.WORLD), (2, halves[rank // 2]), (1, TSPComm.single())):
            if degree == 1 and case != "llama":
                continue
            model = TSPForCausalLM.from_pretrained(source, group)
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            grads = dict(gather_adapter(model.tsp, grads=True))
            lora = {id(p) for _, p, _ in model.tsp.lora_tensors()}
            moved = sorted(n for n, p in model.named_parameters() if p.grad is not None and id(p) not in lora)
            counts = [sum(p.numel() for _, p, cut in model.tsp.lora_tensors() if (cut is None) == replicated)
                      for replicated in (False, True)]
            entry = {"loss": out.loss.detach(), "grads": grads, "non_lora_grads": moved, "counts": counts,
                     "num_parameters": (model.num_parameters(only_trainable=True), model.num_parameters())}
            if degree == 4:  # the optimizer a script builds on the PEFT model, rebound; then the saved adapter
                keep_initial_adapter(model.tsp)
                optimizer = torch.optim.AdamW([p for p in source.parameters() if p.requires_grad], lr=1e-2)
                rebind_optimizer(optimizer, parameter_names(source), model)
                optimizer.step()
                with torch.no_grad():  # DPO's references (ds_tsp.integrations.trl.dpo.AdapterReference)
                    entry["modes"] = {"stepped": model(input_ids=ids, labels=labels).loss}
                    for mode in ("off", "initial"):
                        with adapter_mode(model.tsp, mode):
                            entry["modes"][mode] = model(input_ids=ids, labels=labels).loss
                entry["state"] = sorted((id(p) in lora, s["exp_avg"].numel()) for p, s in optimizer.state.items())
                entry["n_lora"] = len(lora)
                model.save_pretrained(f"{save_root}/{case}")
                entry["logits"] = model(input_ids=ids, logits_to_keep=S).logits.detach()
            if rank == 0:
                results[(case, degree)] = entry
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return run_on_local_ranks(_tsp_runs, 4, str(root), timeout_s=600)[0], root


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_lora_grads_match_single_device_peft_fp64(runs, case):
    results, _ = runs
    reference = peft_model(case)
    ids, labels = make_batch(reference.config.vocab_size)
    ref_loss, ref_grads = hf_loss_and_grads(reference, ids, shift(labels))
    want = {n.replace(".default.", "."): g for n, g in ref_grads.items() if "lora_" in n}
    degrees = (1, 2, 4) if case == "llama" else (2, 4)
    for degree in degrees:
        got = results[(case, degree)]
        assert _rel(got["loss"], ref_loss) < 1e-10, (case, degree)
        assert set(got["grads"]) == set(want), (case, degree)
        errors = {n: _rel(got["grads"][n], g) for n, g in want.items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-10, (case, degree, worst, errors[worst])
        assert min(float(g.norm()) for g in want.values()) > 0, "every LoRA factor has a gradient to compare"
        assert got["non_lora_grads"] == [], "the frozen base gets no gradient"
        assert got["num_parameters"] == reference.get_nb_trainable_parameters(), "full-model counts, as peft's"


def test_per_rank_lora_parameters_and_optimizer_state(runs):
    results, _ = runs
    # Tiny Llama, r=4, 2 layers, h=32, 4 heads of 8 (2 kv heads), F=64. Replicated per layer: A of q/k/v/gate/up
    # (5 x 4x32) + B of o/down (2 x 32x4) = 896. Sharded per layer: B of q (32x4), k, v (16x4), gate, up (64x4),
    # A of o (4x32), down (4x64) = 1152 at D=1, /D after; at D=4 each rank keeps one whole kv head (B: 8x4, not 4x4).
    expected = {1: (2 * 1152, 2 * 896), 2: (2 * 576, 2 * 896), 4: (2 * 320, 2 * 896)}
    for degree, counts in expected.items():
        assert tuple(results[("llama", degree)]["counts"]) == counts, degree
    for case in CASES:
        got = results[(case, 4)]
        assert all(is_lora for is_lora, _ in got["state"]) and len(got["state"]) == got["n_lora"], case


@pytest.mark.parametrize("case", sorted(CASES))
def test_saved_adapter_loads_in_plain_peft_with_the_tsp_logits(runs, case):
    results, root = runs
    saved = root / case
    assert sorted(p.name for p in saved.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    reference = peft_model(case)
    keys = set(peft.utils.get_peft_model_state_dict(reference))
    from safetensors import safe_open

    with safe_open(saved / "adapter_model.safetensors", "pt") as f:
        assert set(f.keys()) == keys
        assert all(k.startswith("base_model.model.model.layers.") and k.endswith(("lora_A.weight", "lora_B.weight"))
                   for k in keys), keys  # PEFT's key names (peft maps them onto the base model by these)
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == CASES[case][1]["r"]
    base = build_tiny_model(CASES[case][0], dtype=torch.float64)
    patch_float64_(base)
    loaded = peft.PeftModel.from_pretrained(base, saved)
    ids, _ = make_batch(reference.config.vocab_size)
    logits = hf_logits(loaded, ids)
    assert _rel(results[(case, 4)]["logits"], logits) < 1e-10
    assert _rel(logits, hf_logits(reference, ids)) > 1e-6, "the optimizer step moved the adapter"


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_off_and_initial_modes_after_a_step(runs, case):
    """After the optimizer step, at D=4: adapter_mode "off" scores as PEFT's disable_adapter (the frozen base),
    "initial" as the adapter before the step (its keep_initial copy), and both differ from the stepped model."""
    results, _ = runs
    reference = peft_model(case)
    ids, labels = make_batch(reference.config.vocab_size)
    with reference.disable_adapter():  # the frozen base: nothing to differentiate
        logits = hf_logits(reference, ids)
    base_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift(labels).flatten(), ignore_index=-100)
    modes = results[(case, 4)]["modes"]
    assert _rel(modes["off"], base_loss) < 1e-10, case
    assert _rel(modes["initial"], results[(case, 4)]["loss"]) < 1e-10, case
    assert min(_rel(modes["stepped"], modes[m]) for m in ("off", "initial")) > 1e-8, (case, modes)
    assert _rel(modes["off"], modes["initial"]) > 1e-8, (case, modes)  # randomize_lora_: B is not zero


def _convert(model):
    from ds_tsp.model.convert import to_tsp_model

    return to_tsp_model(model, TSPComm.single(), hf_face=True)


@pytest.mark.parametrize("config, match", [
    (dict(lora_dropout=0.1), r"lora_dropout=0.1"),
    (dict(use_dora=True), r"use_dora=True"),
    (dict(bias="all"), r"bias='all'"),
    (dict(modules_to_save=["lm_head"]), r"modules_to_save"),
    (dict(target_modules=["q_proj", "lm_head"]), r"'lm_head'"),
    (dict(init_lora_weights="pissa"), r"init_lora_weights='pissa'"),
    (dict(layer_replication=[[0, 2]]), r"layer_replication"),
])
def test_unsupported_lora_options_are_named(config, match):
    model = build_tiny_model("llama", dtype=torch.float32)
    options = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **config}
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**options))
    with pytest.raises(TSPConfigError, match=match):
        _convert(wrapped)


def test_other_peft_methods_and_several_adapters_are_refused():
    model = build_tiny_model("llama", dtype=torch.float32)
    with pytest.raises(TSPConfigError, match="PEFT method IA3"):
        _convert(peft.get_peft_model(model, peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[])))
    model = build_tiny_model("llama", dtype=torch.float32)
    with pytest.raises(TSPConfigError, match="PEFT method PREFIX_TUNING"):
        _convert(peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)))
    model = build_tiny_model("llama", dtype=torch.float32)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    wrapped.add_adapter("second", peft.LoraConfig(r=2, target_modules=["v_proj"]))
    with pytest.raises(TSPConfigError, match="2 adapters"):
        _convert(wrapped)
