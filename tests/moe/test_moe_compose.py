"""Mixture-of-experts models composed with what users put around them, against transformers.

One spawn of 4 gloo ranks (TSP=2 x DP=2, fp32) trains the tiny Qwen3-MoE of tests/helpers/hf_tiny.py (a dense and a sparse
layer, 8 experts top-2, output_router_logits with router_aux_loss_coef) handed IN MEMORY to ds_tsp.initialize under
DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 (ZeRO-3 with activation checkpointing), and the tiny Mixtral as a
TSPForCausalLM under FSDP2 on the data axis (activation checkpointing too), STEPS AdamW steps with clipping active,
the two data replicas holding different numbers of labelled tokens.

The reference is transformers' own model on one process with the same global batches. Data parallelism averages
each replica's gradient, as DDP / DeepSpeed / FSDP do for any HF MoE model: the cross-entropy is the token-weighted
mean over the GLOBAL batch (ds_tsp scales each replica's share for it) and the load-balancing loss is each
replica's own (over its rows, all its TSP ranks' tokens), averaged over the replicas. So the reference loss is
CE(global batch) + coef * mean_r aux(rows of replica r); clipping uses the norm of its gradient. Tolerances are the
fp32 ones of tests/integrations/test_deepspeed.py and tests/integrations/test_fsdp.py: loss 1e-5 relative, clip norm 1e-4, final weights 1e-4
norm-wise (Adam's early steps magnify fp32 noise in tiny entries); measured ~1e-7.

The HF Trainer (examples/hf_trainer.py, TSPTrainer, TSP=2) and Accelerate (examples/train_accelerate.py,
TSPAccelerator, TSP=2) run with `--model_name_or_path` on the Qwen3-MoE saved locally and match their own
single-process references (the example run as a plain Trainer / a plain transformers loop) per step: loss 1e-5, Accelerate's clip norm 1e-4 (the
Trainer under ZeRO-0 logs none), the Trainer's saved weights 1e-4 norm-wise, as tests/integrations/test_hf_trainer.py.
Activation checkpointing with the aux loss against transformers in float64 is also in tests/moe/test_hf_moe.py (D=2).
A pipeline (tsp.pipeline_stages > 1) would drop the router logits between stages: refused by name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from hf_tiny import build_tiny_model, save_tiny_checkpoint, tiny_config  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
ROWS, S, STEPS = 4, 32, 2  # global batch rows (2 per data replica), sequence length (zigzag: a multiple of 2 x TSP)
LR, CLIP, WD = 3e-3, 0.5, 0.1
ZERO_RUNS = ((1, False), (2, False), (3, True))  # (ZeRO stage, activation checkpointing)


def global_batches(vocab: int):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (ROWS, S), generator=g)
        labels = ids.clone()
        labels[0, :4] = -100
        labels[1, :15] = -100  # replica 0 (rows 0-1) holds fewer labelled tokens than replica 1 (rows 2-3)
        out.append((ids, labels))
    return out


def _replica_rows(data_rank: int, data_size: int = 2) -> slice:
    rows = ROWS // data_size
    return slice(data_rank * rows, (data_rank + 1) * rows)


# --- the single-process reference: transformers' model, replica-averaged aux loss -------------------------------
def reference_loop(family: str) -> dict:
    model = build_tiny_model(family, dtype=torch.float32)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    coef = model.config.router_aux_loss_coef
    losses, norms = [], []
    for ids, labels in global_batches(model.config.vocab_size):
        out = model(input_ids=ids, labels=labels, output_router_logits=False)
        assert out.aux_loss is None
        aux = torch.stack([model(input_ids=ids[_replica_rows(r)], output_router_logits=True).aux_loss
                           for r in range(2)]).mean()
        loss = out.loss + coef * aux
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "final": model.state_dict()}


# --- 4 ranks: TSP=2 x DP=2 --------------------------------------------------------------------------------------
def _zero_run(stage: int, checkpointing: bool, save_dir: str) -> dict:
    from engine_steps import engine_steps

    import ds_tsp

    config = {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": 1,
              "steps_per_print": 10_000, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
              "zero_optimization": {"stage": stage},
              "tsp": {"size": 2, "activation_checkpointing": checkpointing}}
    hf = build_tiny_model("qwen3_moe", dtype=torch.float32)
    engine, *_ = ds_tsp.initialize(model=hf, config=config)
    mine = _replica_rows(engine.tsp_groups.data_rank)
    return engine_steps(engine, ((ids[mine], labels[mine]) for ids, labels in global_batches(hf.config.vocab_size)),
                        save_dir)


def _fsdp2_run() -> dict:
    import torch.distributed as dist
    from engine_steps import fsdp2_steps

    from ds_tsp.core.config import TSPOptions
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
    from ds_tsp.hf import TSPForCausalLM

    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=2))
    hf = build_tiny_model("mixtral", dtype=torch.float32)
    model = TSPForCausalLM.from_pretrained(hf, groups.tsp_group, options=TSPOptions(activation_checkpointing=True))
    mine = _replica_rows(groups.data_rank)
    batches = ((ids[mine], labels[mine]) for ids, labels in global_batches(hf.config.vocab_size))
    return fsdp2_steps(model, groups, batches, LR, WD, CLIP)


def _four_ranks(save_root: str) -> dict:
    out = {("zero", stage): _zero_run(stage, ac, f"{save_root}/zero{stage}") for stage, ac in ZERO_RUNS}
    out["fsdp2"] = _fsdp2_run()
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_compose")
    return run_on_local_ranks(_four_ranks, 4, str(root), timeout_s=600, env={"DS_ACCELERATOR": "cpu"}), root


@pytest.fixture(scope="module")
def references() -> dict:
    return {family: reference_loop(family) for family in ("qwen3_moe", "mixtral")}


def _rel(got, want) -> float:
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return float(((got - want).abs() / want.abs()).max())


def _assert_steps(got: dict, want: dict, what) -> None:
    assert want["norms"][0] > CLIP, "clipping must be active"
    assert _rel(got["losses"], want["losses"]) < 1e-5, (what, got["losses"], want["losses"])
    assert _rel(got["norms"], want["norms"]) < 1e-4, (what, got["norms"], want["norms"])


@pytest.mark.parametrize("stage, checkpointing", ZERO_RUNS)
def test_deepspeed_zero_tsp2_dp2_moe_matches_transformers(four_ranks, references, stage, checkpointing):
    results, root = four_ranks
    want = references["qwen3_moe"]
    for rank in range(4):  # every rank logs the same global loss and clip norm
        _assert_steps(results[rank][("zero", stage)], want, (stage, rank))
    saved = transformers.AutoModelForCausalLM.from_pretrained(root / f"zero{stage}", dtype=torch.float32)
    got, start = saved.state_dict(), build_tiny_model("qwen3_moe", dtype=torch.float32).state_dict()
    assert set(got) == set(want["final"])
    for name, value in want["final"].items():
        assert not torch.equal(got[name], start[name]), f"{name} did not move"
        assert (got[name] - value).norm() <= 1e-4 * value.norm(), name


def test_fsdp2_tsp2_dp2_mixtral_with_activation_checkpointing_matches_transformers(four_ranks, references):
    results, _ = four_ranks
    for rank in range(4):
        got = results[rank]["fsdp2"]
        assert got["dtensor"], rank
        _assert_steps(got, references["mixtral"], ("fsdp2", rank))


# --- pipeline stages: the router logits would be dropped ----------------------------------------------------------
def test_pipeline_stages_refuse_moe_with_router_aux_loss():
    import ds_tsp
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.integrations.deepspeed.pipeline import check_pipeline_moe

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "tsp": {"size": 2, "pipeline_stages": 2}}
    for family in ("qwen3_moe", "mixtral"):
        with pytest.raises(TSPConfigError, match=r"output_router_logits=True on a mixture-of-experts model .* "
                                                 r"tsp.pipeline_stages > 1.*set tsp.pipeline_stages to 1, or set "
                                                 r"output_router_logits=False"):
            ds_tsp.initialize(model=tiny_config(family), config=config)
    check_pipeline_moe(ModelShape.from_hf_config(tiny_config("qwen3_moe", output_router_logits=False)))  # no aux


# --- the HF Trainer and Accelerate examples with a local MoE checkpoint ------------------------------------------
@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("moe_ckpt") / "qwen3_moe", "qwen3_moe"))


def _json_lines(cmd: list[str]) -> list[dict]:
    from warm_python import python_exec  # the Accelerate launcher's workers fork from the warm interpreter

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**ENV, **python_exec()}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _steps_match(got: list[dict], want: list[dict], steps: int, with_norm: bool) -> None:
    got, want = [s for s in got if "step" in s], [s for s in want if "step" in s]
    assert [s["step"] for s in got] == [s["step"] for s in want] == list(range(1, steps + 1)), (got, want)
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (g, w)
        if with_norm:
            assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * abs(w["grad_norm"]), (g, w)


def test_hf_trainer_example_tsp2_trains_a_local_moe_checkpoint_like_the_plain_trainer(moe_checkpoint, tmp_path):
    script = [str(ROOT / "examples" / "hf_trainer.py"), "--model_name_or_path", moe_checkpoint, "--max_steps", "2",
              "--global_batch", "2", "--seq_len", "32"]
    from warm_python import python_command  # python, torchrun's ranks: forks of a pre-imported interpreter

    reference = _json_lines([*python_command(0), *script, "--output_dir", str(tmp_path / "ref")])
    tsp = _json_lines([*python_command(2),
                       *script, "--output_dir", str(tmp_path / "tsp"), "--ds_config",
                       str(ROOT / "ds_configs" / "tsp.json")])
    _steps_match(tsp, reference, 2, with_norm=False)  # ZeRO-0 (tsp.json): the Trainer logs no grad norm
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tsp")
    assert type(saved).__name__ == "Qwen3MoeForCausalLM"
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref").state_dict()
    for name, value in saved.state_dict().items():
        assert (value - want[name]).norm() <= 1e-4 * want[name].norm(), name


def _plain_accelerate_loop(checkpoint: str, steps: int, seq_len: int) -> list[dict]:
    """What examples/train_accelerate.py does in one process (tests/integrations/test_accelerate.py checks it is this loop):
    AdamW 3e-3 with a linear decay to half, clipping at 1.0, RepeatingPatterns batches of 4, labels = input_ids."""
    from ds_tsp.tools.synthetic import RepeatingPatterns

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.5, total_iters=steps)
    data = RepeatingPatterns(vocab_size=model.config.vocab_size, seq_len=seq_len, num_samples=4 * steps, seed=0)
    lines = []
    for step in range(steps):
        ids = torch.stack([data[4 * step + i]["input_ids"] for i in range(4)])
        loss = model(input_ids=ids, labels=ids).loss  # + coef x aux loss: output_router_logits is on
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lines.append({"step": step + 1, "loss": float(loss.detach()), "grad_norm": float(norm)})
    return lines


def test_accelerate_example_tsp2_trains_a_local_moe_checkpoint_like_one_process(moe_checkpoint, tmp_path):
    tsp = _json_lines([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(ROOT / "ds_configs" / "accelerate_tsp.yaml"), "--num_processes", "2",
                       str(ROOT / "examples" / "train_accelerate.py"), "--model_name_or_path", moe_checkpoint,
                       "--max_steps", "2", "--seq_len", "32", "--output_dir", str(tmp_path / "tsp")])
    _steps_match(tsp, _plain_accelerate_loop(moe_checkpoint, 2, 32), 2, with_norm=True)
