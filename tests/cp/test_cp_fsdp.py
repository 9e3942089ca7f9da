"""The cp axis beside FSDP2 and in TSPAccelerator without DeepSpeed: {"size": 2, "cp_size": 2} on 4 gloo ranks
(D=2, C=2, data 1) trains like one process on the same batches.

- shard_with_fsdp2 on a float64 ShardedCausalLM carrying the cp ring (FSDP2's "data" sub-mesh spans data x cp: the
  cp groups' gradients are averaged like data replicas'), STEPS AdamW steps with clipping active, batches from
  TSPDataLoader (cut over cp, then TSP): every loss and clip norm within 1e-10 relative of the single-device
  ReferenceCausalLM, and the final full weights within 1e-10 norm-wise (measured ~1e-15: float64 sums reordered);
- a model built WITHOUT the cp ring on cp groups is refused by shard_with_fsdp2, naming cp_size;
- TSPAccelerator running examples/train_accelerate.py unchanged (fp32): plain (TSPAccelerator(cp_size=2): no data
  engine, backward averages the gradients over the cp groups once per optimizer step; gradient accumulation 2) and
  FSDP2 (the launcher's parallelism_config_cp_size =
  2, parallelism_config_tp_size = 2): every loss and grad norm equals the same script on one process (1e-5 / 1e-4
  relative), gather_for_metrics returns each held-out sample once, and the model the script saves with
  save_pretrained under cp loads in transformers with the one-process run's weights (1e-4 norm-wise: Adam's early
  steps magnify fp32 noise in tiny entries);
- TSPAccelerator.save_state under cp (plain, and DeepSpeed ZeRO-1 from the JSON's "tsp" block): saved after step 1,
  a fresh accelerator's load_state continues bit for bit (every logged loss and grad norm, the final weights
  torch.equal); load_state on another layout of the same 4 processes (tsp 4 x cp 1) is one clear error naming both
  layouts;
- resolve_setup: the FSDP2 launcher's parallelism_config_cp_size is tsp.cp_size; the plain setup's cp_size keyword;
  a cp_size keyword beside a DeepSpeed / FSDP2 launch config is refused by name.
One 4-rank spawn runs all of it (module fixture), one 1-rank spawn the references. The data 2 x cp 2 x tsp 2 (8
ranks) FSDP2 run is marked slow; data 2 x cp 2 x tsp 1 runs in the 4-rank spawn.
"""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402

SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
STEPS, MICRO, LR, MAX_NORM = 3, 2, 3e-3, 0.5
ACC_STEPS, ACC_SEQ = 3, 30
ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
            "ACCELERATE_MIXED_PRECISION": "no"}


def _reference_weights() -> dict[str, torch.Tensor]:
    from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

    ref = ReferenceCausalLM(SHAPE, dtype=torch.float64)
    init_weights_(ref, 0)
    return full_state_dict(ref)


def _loader(groups, micro_batch_size: int):
    from masked_patterns import MaskedPatterns

    from ds_tsp.core.tokens.loader import TSPDataLoader

    data = MaskedPatterns(vocab_size=SHAPE.vocab_size, seq_len=30, num_samples=64)
    return TSPDataLoader(data, groups, micro_batch_size=micro_batch_size, seed=0)


# --- the single-device reference ------------------------------------------------------------------------------
def _reference_run(data_size: int) -> dict:
    """One device, micro-batch MICRO x data_size (every replica's samples of a step), float64."""
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
    from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict

    ref = ReferenceCausalLM(SHAPE, dtype=torch.float64)
    ref.load_state_dict(_reference_weights())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    batches = iter(_loader(ProcessGroups(ParallelLayout(), 0, None, None, None), MICRO * data_size))
    losses, norms = [], []
    for _ in range(STEPS):
        b = next(batches)
        loss = ref(b["input_ids"], b["shift_labels"], b["position_ids"])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms, "final": full_state_dict(ref)}


# --- FSDP2 beside cp, ShardedCausalLM on raw shards --------------------------------------------------------------
def _fsdp_cp_run(data: int = 1, tsp: int = 2) -> dict:
    import torch.distributed as dist

    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.config import parse_tsp_config
    from ds_tsp.core.grads.clip import clip_grad_norm_
    from ds_tsp.core.parallel.runtime import build_runtime
    from ds_tsp.integrations.fsdp import shard_with_fsdp2
    from ds_tsp.model.causal_lm import ShardedCausalLM

    runtime = build_runtime(parse_tsp_config({"size": tsp, "cp_size": 2}))
    groups = runtime.groups
    assert groups.data_size == data, groups
    out = {}
    try:  # the model must carry the cp ring: one built on the TSP group alone is refused
        shard_with_fsdp2(ShardedCausalLM(SHAPE, TSPComm(groups.tsp_group), dtype=torch.float64), groups)
        out["without_ring"] = "accepted"
    except TSPConfigError as err:
        out["without_ring"] = str(err)
    model = ShardedCausalLM(SHAPE, runtime.comm, dtype=torch.float64)
    model.load_full_state_dict(_reference_weights())
    shard_with_fsdp2(model, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = iter(_loader(groups, MICRO))
    losses, norms = [], []
    for _ in range(STEPS):
        b = next(batches)
        share = model(b["input_ids"], b["shift_labels"], b["position_ids"])
        share.backward()
        norms.append(float(clip_grad_norm_(model, MAX_NORM, groups)))
        opt.step()
        opt.zero_grad()
        losses.append(float(model.loss_for_logging(share)))
    # the trained TSP shards (FSDP2's data x cp shards gathered) in a plain model, then the full HF-named weights
    plain = ShardedCausalLM(SHAPE, runtime.comm, dtype=torch.float64)
    local = {n: p.full_tensor() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(local[n])
    final = plain.full_state_dict()
    out.update(losses=losses, grad_norms=norms, final=final if dist.get_rank() == 0 else None,
               dtensor=all(type(p).__name__ == "DTensor" for p in model.parameters()),
               fsdp_mesh=sorted(dist.get_process_group_ranks(groups.device_mesh()["data"].get_group())))
    return out


# --- TSPAccelerator: examples/train_accelerate.py, plain and FSDP2 --------------------------------------------------
def _accelerate_loop(model_dir: str, out: str, accelerator=None, accumulation: int = 1, *extra: str) -> list[dict]:
    """examples/train_accelerate.py in this process (optionally with another Accelerator class): its per-step log
    and its eval line (printed: captured)."""
    import contextlib
    import io
    import json
    from unittest import mock

    from accelerate.state import PartialState
    from test_cp_trainers import _example, _reset_hf_state

    example = _example("train_accelerate")
    if accelerator is not None:
        example.Accelerator = accelerator
    printed = io.StringIO()
    # its end_training would destroy the launcher's process group, which the launcher destroys itself
    with contextlib.redirect_stdout(printed), mock.patch.object(PartialState, "destroy_process_group",
                                                                lambda self, group=None: None):
        log = example.main(["--model_name_or_path", model_dir, "--output_dir", out, "--max_steps", str(ACC_STEPS),
                            "--seq_len", str(ACC_SEQ), "--global_batch", "2", "--eval_samples", "3",
                            "--gradient_accumulation_steps", str(accumulation), *extra])
    evals = [json.loads(line) for line in printed.getvalue().splitlines() if '"eval_loss"' in line]
    _reset_hf_state()
    return log + evals


def _four_ranks(model_dir: str, workdir: str) -> dict:
    import os

    from ds_tsp.accelerate import TSPAccelerator

    # data 2 x cp 2 at tsp 1 on the same 4 ranks: FSDP2's mesh spans data x cp with two replicas
    result = {"fsdp": _fsdp_cp_run(), "fsdp_data2": _fsdp_cp_run(2, tsp=1)}
    # plain: two micro-batches per step, so the gradients are averaged over cp once, at the accumulation boundary;
    # save_state after step 1, then resumed by a fresh TSPAccelerator, and refused at tsp 4 x cp 1
    result["plain"] = _accelerate_loop(model_dir, f"{workdir}/plain", functools.partial(TSPAccelerator, cp_size=2),
                                       2, "--checkpoint_at", "1")
    result.update(_resume_plain_state(model_dir, workdir))
    result["deepspeed_state"] = _deepspeed_state(model_dir, workdir)
    os.environ.update(FSDP_ENV)
    result["fsdp2_accelerator"] = _accelerate_loop(model_dir, f"{workdir}/fsdp2")
    return result


def _resume_plain_state(model_dir: str, workdir: str) -> dict:
    """The plain run's save_state (step 1 of ACC_STEPS, at tsp 2 x cp 2) loaded by a fresh TSPAccelerator on the
    same layout, which trains on; and by one at tsp 4 x cp 1 (same 4 processes), which must refuse it."""
    import shutil

    import torch.distributed as dist
    from test_cp_trainers import _reset_hf_state

    from ds_tsp.accelerate import TSPAccelerator

    if dist.get_rank() == 0:
        shutil.copytree(f"{workdir}/plain/state", f"{workdir}/plain_resumed/state")
    dist.barrier()
    out = {"plain_resumed": _accelerate_loop(model_dir, f"{workdir}/plain_resumed",
                                             functools.partial(TSPAccelerator, cp_size=2), 2, "--resume")}
    try:
        _accelerate_loop(model_dir, f"{workdir}/plain_resumed", functools.partial(TSPAccelerator, cp_size=1), 2,
                         "--resume")
        out["other_layout"] = "no error"
    except TSPConfigError as err:
        out["other_layout"] = str(err)
        _reset_hf_state()
    return out


def _deepspeed_state(model_dir: str, workdir: str) -> dict:
    """TSPAccelerator under DeepSpeed (ZeRO-1 over data x cp, tsp 2 x cp 2 from the JSON's "tsp" block): save_state
    after step 1, resumed by a fresh accelerator; the same state refused by a JSON with tsp 4 x cp 1."""
    import json
    import os
    import shutil

    import torch.distributed as dist
    from test_cp_trainers import _reset_hf_state

    configs = {}
    for tsp, cp in ((2, 2), (4, 1)):
        configs[tsp] = f"{workdir}/accelerate_ds_tsp{tsp}.json"
        if dist.get_rank() == 0:
            with open(configs[tsp], "w") as f:
                json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                           "gradient_clipping": "auto", "steps_per_print": 1_000_000,
                           "zero_optimization": {"stage": 1}, "tsp": {"size": tsp, "cp_size": cp}}, f)
    dist.barrier()
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no"}
    os.environ.update(env, ACCELERATE_DEEPSPEED_CONFIG_FILE=configs[2])
    out = {"uninterrupted": _accelerate_loop(model_dir, f"{workdir}/ds", None, 1, "--checkpoint_at", "1")}
    if dist.get_rank() == 0:
        shutil.copytree(f"{workdir}/ds/state", f"{workdir}/ds_resumed/state")
    dist.barrier()
    out["resumed"] = _accelerate_loop(model_dir, f"{workdir}/ds_resumed", None, 1, "--resume")
    os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = configs[4]
    try:
        _accelerate_loop(model_dir, f"{workdir}/ds_resumed", None, 1, "--resume")
        out["other_layout"] = "no error"
    except TSPConfigError as err:
        out["other_layout"] = str(err)
        _reset_hf_state()
    for key in (*env, "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        os.environ.pop(key)
    return out


def _references(model_dir: str, workdir: str) -> dict:
    return {"fsdp": _reference_run(1), "fsdp_data2": _reference_run(2),
            "fsdp2_accelerator": _accelerate_loop(model_dir, f"{workdir}/reference"),
            "plain": _accelerate_loop(model_dir, f"{workdir}/reference_acc2", accumulation=2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ds_tsp.testing import save_tiny_llama

    workdir = tmp_path_factory.mktemp("cp_fsdp")
    model_dir = str(save_tiny_llama(workdir / "initial", seed=0))
    reference = run_on_local_ranks(_references, 1, model_dir, str(workdir), timeout_s=300, env=ENV)[0]
    cp = run_on_local_ranks(_four_ranks, 4, model_dir, str(workdir), timeout_s=400, env=ENV)
    return reference, cp, workdir


def _rel(got, want) -> float:
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return float(((got - want).abs() / want.abs()).max())


def _assert_fsdp_matches(want: dict, got: list[dict], mesh_size: int) -> None:
    assert want["grad_norms"][0] > MAX_NORM and want["losses"][-1] < want["losses"][0], want  # clipping, learning
    for rank, run in enumerate(got):
        assert run["dtensor"] and len(run["fsdp_mesh"]) == mesh_size, (rank, run["fsdp_mesh"])
        assert _rel(run["losses"], want["losses"]) < 1e-10, (rank, run["losses"], want["losses"])
        assert _rel(run["grad_norms"], want["grad_norms"]) < 1e-10, (rank, run["grad_norms"], want["grad_norms"])
    final = got[0]["final"]
    assert sorted(final) == sorted(want["final"])
    start = _reference_weights()
    for name, value in want["final"].items():
        assert not torch.equal(value, start[name]), f"{name} did not move"
        assert (final[name] - value).norm() <= 1e-10 * value.norm(), name


def test_fsdp2_beside_cp_matches_one_device_in_float64(runs):
    reference, cp, _ = runs
    _assert_fsdp_matches(reference["fsdp"], [r["fsdp"] for r in cp], mesh_size=2)  # data 1 x cp 2


def test_fsdp2_over_data2_x_cp2_matches_one_device_in_float64(runs):
    """The slow 8-rank test below at tsp 1: FSDP2 shards over data x cp (4 ranks), two data replicas of MICRO
    samples each, against one device on both replicas' samples."""
    reference, cp, _ = runs
    _assert_fsdp_matches(reference["fsdp_data2"], [r["fsdp_data2"] for r in cp], mesh_size=4)


def test_fsdp2_refuses_a_model_without_the_cp_ring(runs):
    for result in runs[1]:
        message = result["fsdp"]["without_ring"]
        assert "cp ring of size 1" in message and "tsp.cp_size=2" in message, message


@pytest.mark.parametrize("mode", ["plain", "fsdp2_accelerator"])
def test_tsp_accelerator_without_deepspeed_at_tsp2_cp2_matches_one_process(runs, mode):
    reference, cp, workdir = runs
    want = reference[mode]
    steps = [line for line in want if "step" in line]
    assert len(steps) == ACC_STEPS and steps[-1]["loss"] < steps[0]["loss"], want
    got = cp[0][mode]  # rank 0 logs (every rank computes the same global values)
    for g, w in zip([line for line in got if "step" in line], steps, strict=True):
        assert g["step"] == w["step"] and abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (mode, g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * w["grad_norm"], (mode, g, w)
    assert abs(got[-1]["eval_loss"] - want[-1]["eval_loss"]) <= 1e-5 * abs(want[-1]["eval_loss"]), (got, want)
    assert sorted(got[-1]["eval_indices"]) == want[-1]["eval_indices"], "each held-out sample once"
    # save_pretrained under cp: transformers reads it back with the one-process run's weights
    saved = transformers.AutoModelForCausalLM.from_pretrained(workdir / ("plain" if mode == "plain" else "fsdp2"))
    ref_saved = transformers.AutoModelForCausalLM.from_pretrained(workdir / ("reference_acc2" if mode == "plain"
                                                                             else "reference"))
    start = transformers.AutoModelForCausalLM.from_pretrained(workdir / "initial").state_dict()
    for name, value in ref_saved.state_dict().items():
        assert not torch.equal(value, start[name]), f"{name} did not move"
        assert (saved.state_dict()[name] - value).norm() <= 1e-4 * value.norm(), (mode, name)


def test_tsp_accelerator_save_state_under_cp_resumes_bit_identically(runs):
    """Plain TSPAccelerator(cp_size=2): save_state after step 1, a fresh accelerator's load_state, steps 2-3 equal
    the run that did not stop (losses and grad norms bit for bit; the final weights torch.equal)."""
    _, cp, workdir = runs
    uninterrupted = [line for line in cp[0]["plain"] if "step" in line]  # rank 0 logs
    resumed = [line for line in cp[0]["plain_resumed"] if "step" in line]
    assert [line["step"] for line in resumed] == list(range(2, ACC_STEPS + 1)), resumed
    assert resumed == uninterrupted[1:], (resumed, uninterrupted)  # exact float equality
    final = transformers.AutoModelForCausalLM.from_pretrained(workdir / "plain").state_dict()
    continued = transformers.AutoModelForCausalLM.from_pretrained(workdir / "plain_resumed").state_dict()
    assert sorted(final) == sorted(continued)
    for name, value in final.items():
        assert torch.equal(continued[name], value), name


def test_tsp_accelerator_load_state_at_another_layout_is_refused(runs):
    for result in runs[1]:
        message = result["other_layout"]
        assert "save_state ran at tsp=2 x cp=2 x data=1, this run is tsp=4 x cp=1 x data=1" in message, message
        assert "same layout only" in message and "ds_tsp.save_training_checkpoint" in message, message


def test_tsp_accelerator_state_under_deepspeed_and_cp(runs):
    """The same under DeepSpeed ZeRO-1 at tsp 2 x cp 2: resumed bit for bit; another layout refused by name."""
    _, cp, workdir = runs
    run = cp[0]["deepspeed_state"]
    uninterrupted = [line for line in run["uninterrupted"] if "step" in line]
    resumed = [line for line in run["resumed"] if "step" in line]
    assert len(uninterrupted) == ACC_STEPS and [line["step"] for line in resumed] == list(range(2, ACC_STEPS + 1))
    assert resumed == uninterrupted[1:], (resumed, uninterrupted)  # exact float equality
    final = transformers.AutoModelForCausalLM.from_pretrained(workdir / "ds").state_dict()
    continued = transformers.AutoModelForCausalLM.from_pretrained(workdir / "ds_resumed").state_dict()
    for name, value in final.items():
        assert torch.equal(continued[name], value), name
    for result in cp:
        message = result["deepspeed_state"]["other_layout"]
        assert "save_state ran at tsp=2 x cp=2 x data=1, this run is tsp=4 x cp=1 x data=1" in message, message


def test_launch_configs_read_cp_size():
    from ds_tsp.integrations.accelerate.launch_config import resolve_setup

    setup = resolve_setup({**FSDP_ENV, "WORLD_SIZE": "4"})
    assert setup.mode == "fsdp2" and (setup.tsp.size, setup.tsp.cp_size) == (2, 2)
    with pytest.raises(TSPConfigError, match=r"parallelism_config_cp_size=2 x .* != 8 processes.*--num_processes 4"):
        resolve_setup({**FSDP_ENV, "WORLD_SIZE": "8"})
    setup = resolve_setup({"WORLD_SIZE": "4"}, cp_size=2)
    assert setup.mode == "plain" and (setup.tsp.size, setup.tsp.cp_size) == (2, 2)
    with pytest.raises(TSPConfigError, match="cp_size=2 does not divide the 3 processes"):
        resolve_setup({"WORLD_SIZE": "3"}, cp_size=2)
    with pytest.raises(TSPConfigError, match=r"TSPAccelerator\(cp_size=\.\.\.\) with a DeepSpeed or FSDP2 launch"):
        resolve_setup({**FSDP_ENV, "WORLD_SIZE": "4"}, cp_size=2)
    with pytest.raises(TSPConfigError, match="cp_size"):
        resolve_setup({"WORLD_SIZE": "4"}, cp_size=0)


def test_trl_trainers_still_refuse_cp_naming_what_trains_with_it():
    """TSPSFTTrainer does not cut its token counts and metrics over cp yet: refused before any group is built, and
    the message names the integrations that do take cp_size."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from ds_tsp.hf import TSPSFTTrainer

    args = SimpleNamespace(label_smoothing_factor=0.0, chat_template_path=None, gradient_checkpointing_kwargs=None,
                           router_aux_loss_coef=None, device=torch.device("cpu"),
                           hf_deepspeed_config=SimpleNamespace(config={"tsp": {"size": 1, "cp_size": 2}}))
    with pytest.raises(TSPConfigError, match=r"tsp\.cp_size=2 with TSPSFTTrainer: .* TSPTrainer or TSPAccelerator "
                                             r"\(plain, FSDP2 or DeepSpeed\), ds_tsp\.initialize .*shard_with_fsdp2"):
        TSPSFTTrainer(model=None, args=args)


@pytest.mark.slow
def test_fsdp2_over_data2_x_cp2_x_tsp2_matches_one_device_in_float64():
    """8 ranks: FSDP2 shards over data x cp (4 ranks), two data replicas of MICRO samples each."""
    want = run_on_local_ranks(_reference_run, 1, 2, timeout_s=300, env=ENV)[0]
    got = run_on_local_ranks(_fsdp_cp_run, 8, 2, timeout_s=600, env=ENV)
    _assert_fsdp_matches(want, got, mesh_size=4)
