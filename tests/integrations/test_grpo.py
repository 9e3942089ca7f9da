"""TRL's GRPOTrainer on TSP: ds_tsp.hf.TSPGRPOTrainer and `class G(TSPTrainer, GRPOTrainer)` at TSP=2 equal a plain
GRPOTrainer in one process with the same seed, prompts and a deterministic reward, per logged step (fp32, SGD): loss
and KL within 5e-6, entropy and grad norm 1e-5 relative, rewards, reward std and completion lengths equal (the
same completions were sampled), for
- loss_type="grpo", beta KL, num_iterations=2 (the second pass has an importance ratio != 1), sampling temperature
  0.7, gradient checkpointing, under DeepSpeed ZeRO-3 (the layers' recompute in backward reads the q/k norm weights,
  which ZeRO-3 partitions outside the hooks of the layer they are registered with);
- loss_type="dapo" (normalised by num_items_in_batch / data replicas), top_entropy_quantile masking (entropies from
  the streaming head), steps_per_generation=2 (old log-probs recomputed), sync_ref_model (the reference mixed in
  shard by shard), under ZeRO-2.
The reference model's per-token log-probs through TSP's streaming head equal transformers' logits path (1e-5) on a
left-padded prompt + right-padded completion batch; the vLLM server-mode weight sync streams, to a recording fake
client, every tensor of the HF checkpoint exactly, one module's tensors alive at a time. Options TSP cannot honour
are refused by name. TSP=2 x data 2 (4 processes) equals a plain 2-process GRPOTrainer: in the default run at the
tiniest data-axis case (dapo, 2 steps, ZeRO-2, every group of completions spanning both replicas); slow (opt-in)
with ZeRO-2 (both cases) and with ZeRO-3 (grpo).

Run as a script, this file is the worker: `python tests/integrations/test_grpo.py OUT.json MODEL TOKENIZER CASES
[DS_CONFIG]` (a case named "grpo@3" runs under the ds_zero3.json beside DS_CONFIG).
"""
from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRL_EXPERIMENTAL_SILENCE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
WORDS = [f"w{i}" for i in range(40)]
GOOD = set(WORDS[:12])
# name: GRPOConfig options
CASES = {
    "grpo": {"loss_type": "grpo", "beta": 0.05, "num_iterations": 2, "temperature": 0.7,
             "gradient_checkpointing": True},
    "dapo": {"loss_type": "dapo", "beta": 0.02, "top_entropy_quantile": 0.5, "steps_per_generation": 2,
             "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5,
             "gradient_checkpointing": False},
}
# The default-run data-axis case (TSP=2 x data 2 against 2 plain processes): 2 completions per process of one
# 4-completion group, so every group spans both data replicas (rewards gathered, advantages normalised over the
# group and sliced per process); dapo divides by num_items over the data axis; the second step reuses the first
# generation (importance ratio != 1).
DATA_CASES = {
    "dapo_dp": {"loss_type": "dapo", "beta": 0.02, "num_iterations": 2, "per_device_train_batch_size": 2,
                "max_steps": 2, "gradient_checkpointing": False},
}
OPTIONS = {**CASES, **DATA_CASES}
# the cases the TSP=2 run trains under ZeRO-3 (the rest under ZeRO-2: dapo's sync_ref_model is refused under ZeRO-3)
ZERO3 = {"grpo"}
STEPS = 3
EQUAL = ("reward", "reward_std", "completions/mean_length", "completions/max_length", "frac_reward_zero_std")
CLOSE = ("loss", "kl", "entropy")


# --- the worker ----------------------------------------------------------------------------------------------
def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over WORDS, trained locally (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(directory)


def prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))} for _ in range(n)]


def good_words(completions, **kwargs) -> list[float]:
    """Deterministic reward: the share of a completion's words in GOOD (and a small length bonus)."""
    return [sum(w in GOOD for w in c.split()) / (1 + len(c.split())) + 0.01 * len(c.split()) for c in completions]


def run_case(name: str, model_dir: str, tokenizer_dir: str, ds_config: str | None, out_dir: str):
    """One trainer; name "case@3": the case under ZeRO-3 (ds_zero3.json beside ds_config), else ds_config's."""
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    name, _, stage = name.partition("@")
    if ds_config and stage:
        ds_config = str(Path(ds_config).with_name(f"ds_zero{stage}.json"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # loaded before the config: under a ZeRO-3 config transformers would load it partitioned (zero.Init)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    options = {"per_device_train_batch_size": 4, "max_steps": STEPS, **OPTIONS[name]}
    # SGD: AdamW turns last-bit differences of near-zero gradients into +-lr steps (at data 2 the third step's grad
    # norm drifted 1.8e-5 relative under AdamW at 3e-2, ZeRO-2 and ZeRO-3 alike)
    args = GRPOConfig(output_dir=f"{out_dir}/{name}", optim="sgd", learning_rate=0.1,
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=0, logging_steps=1,
                      report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                      bf16=False, max_grad_norm=1.0, num_generations=4, max_completion_length=6,
                      deepspeed=ds_config, **options)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, padding_side="left")
    if ds_config is None:
        trainer_class = GRPOTrainer
    elif name == "grpo":  # the ready-made class
        from ds_tsp.hf import TSPGRPOTrainer as trainer_class
    else:  # the composition users write
        from ds_tsp.hf import TSPTrainer

        class GRPOWithTSP(TSPTrainer, GRPOTrainer):
            pass

        trainer_class = GRPOWithTSP
    data_replicas = world // (json.loads(Path(ds_config).read_text())["tsp"]["size"] if ds_config else 1)
    trainer = trainer_class(model=model, reward_funcs=good_words, args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_list(prompts(4 * STEPS * data_replicas, seed=1)))
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    return trainer


def ref_logps_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts + right-padded completions, as GRPO scores them: (ids, attention mask, K)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 3 + len(WORDS), (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # prompt padding (left)
    mask[1, :1] = 0
    mask[2, -2:] = 0  # completion padding (right)
    return ids.masked_fill(mask == 0, 0), mask, 7


class RecordingVLLMClient:
    """TRL's VLLMClient surface the weight sync uses; records clones and checks how many modules are alive."""

    def __init__(self):
        self.received, self.metadata, self.max_modules_alive, self.resets = {}, None, 0, 0
        self._alive: list[tuple[str, weakref.ref]] = []

    @staticmethod
    def module_of(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:4]) if parts[1] == "layers" else ".".join(parts[:2])

    def update_named_params(self, metadata, named_params) -> None:
        self.metadata = [list(m) for m in metadata]
        for name, tensor in named_params:
            gc.collect()
            alive = {module for module, ref in self._alive if ref() is not None}
            self.max_modules_alive = max(self.max_modules_alive, len(alive | {self.module_of(name)}))
            self._alive += [(self.module_of(name), weakref.ref(t)) for t in (tensor, tensor._base)
                            if t is not None]
            self.received[name] = tensor.clone()
            del tensor

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def tsp_checks(trainer, model_dir: str) -> dict:
    """On the TSP ranks: the reference's completion log-probs, and the vLLM weight stream of the reference."""
    from safetensors.torch import load_file

    from ds_tsp.integrations.trl.full_weights import sync_vllm_server

    ids, mask, k = ref_logps_batch()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, k)
    client = RecordingVLLMClient()
    metadata = sync_vllm_server(trainer.ref_model, client, None)
    sync_vllm_server(trainer.ref_model, client, metadata)  # the cached-metadata call
    out = {"ref_logps": logps.tolist(), "rank": int(os.environ["RANK"])}
    if out["rank"] == 0:
        want = load_file(str(Path(model_dir) / "model.safetensors"))
        out["stream"] = {
            "names_equal": sorted(client.received) == sorted(want),
            "all_equal": all(torch.equal(client.received[n], want[n]) for n in want if n in client.received),
            "metadata_ok": client.metadata == [[n, str(want[n].dtype).removeprefix("torch."), list(want[n].shape)]
                                               for n, *_ in client.metadata],
            "max_modules_alive": client.max_modules_alive, "resets": client.resets, "tensors": len(client.received)}
    return out


def main(out: str, model_dir: str, tokenizer_dir: str, cases: str, ds_config: str | None = None):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    results, checks = {}, None
    for name in cases.split(","):
        trainer = run_case(name, model_dir, tokenizer_dir, ds_config, str(Path(out).parent))
        name = name.partition("@")[0]
        results[name] = trainer.state.log_history
        if ds_config and name == "grpo":
            checks = tsp_checks(trainer, model_dir)
        del trainer
        unset_hf_deepspeed_config()  # the next model loads before its config: this one's ZeRO-3 must be gone
    if checks is not None:
        import torch.distributed as dist

        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, checks)
        results["checks"] = everyone
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


# --- the tests -------------------------------------------------------------------------------------------------
def _launch(out: Path, tmp: Path, cases: str, nproc: int, ds_config: Path | None = None) -> subprocess.Popen:
    from warm_python import python_command

    launch = python_command(0 if nproc == 1 else nproc)  # plain python, or torchrun's ranks (warm_python.py)
    argv = [str(out), str(tmp / "model"), str(tmp / "tokenizer"), cases] + ([str(ds_config)] if ds_config else [])
    return subprocess.Popen([*launch, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-6000:]
    return json.loads(out.read_text())


def _setup(tmp: Path, tsp_json: dict) -> None:
    from hf_tiny import save_tiny_checkpoint

    save_tiny_checkpoint(tmp / "model", "qwen3")  # q/k norms, tied embeddings, GQA, vocab 98
    save_tokenizer(tmp / "tokenizer")
    for stage in (2, 3):
        (tmp / f"ds_zero{stage}.json").write_text(json.dumps({
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "steps_per_print": 1000000, "zero_optimization": zero(stage),
            "tsp": tsp_json}))


def zero(stage: int) -> dict:
    """The ZeRO section. Under ZeRO-3 every parameter is partitioned again as soon as the module that fetched it is
    done: none persists whole however small, none is kept for a reuse DeepSpeed's trace foresees, none is prefetched.
    So a read outside the hooks that fetch a parameter fails here (with DeepSpeed's defaults the tiny model stays
    gathered once its trace is complete, and a RLOO run without the layer fetches passed)."""
    strict = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    return {"stage": stage, **(strict if stage == 3 else {})}


def _requirements():
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    _requirements()
    tmp = tmp_path_factory.mktemp("grpo")
    _setup(tmp, {"size": 2})
    reference = _launch(tmp / "ref.json", tmp, ",".join(CASES), 1)  # both at once: they share the two cores
    tsp_cases = ",".join(f"{c}@3" if c in ZERO3 else c for c in CASES)
    tsp = _launch(tmp / "tsp.json", tmp, tsp_cases, 2, tmp / "ds_zero2.json")
    return {"runs": (_finish(reference, tmp / "ref.json"), _finish(tsp, tmp / "tsp.json")), "dir": tmp}


def _logged_steps(history: list[dict]) -> list[dict]:
    return [line for line in history if "loss" in line and "train_runtime" not in line]


def _assert_same_steps(reference: list[dict], tsp: list[dict], case: str, steps: int = STEPS) -> None:
    """Every logged step: the sampled metrics (EQUAL) identical; the loss and KL within 5e-6 absolute (differences of
    fp32 log-probs of magnitude ~5, each rounded to ~5e-7; 1.3e-6 seen), the entropy and the grad norm within 1e-5
    relative (1e-7 / 1.5e-6 seen). Every metric compared must be logged: a name TRL changed fails here, never skips."""
    want, got = _logged_steps(reference), _logged_steps(tsp)
    assert len(want) == steps and [g["step"] for g in got] == [w["step"] for w in want], (got, want)
    for key in EQUAL:  # logged on generation steps (the first at least)
        assert key in want[0], f"{case}: TRL logs no {key!r} (renamed?): update EQUAL"
    for g, w in zip(got, want):
        assert set(g) == set(w), (case, sorted(set(g) ^ set(w)))
        for key in EQUAL:
            if key in w:  # generation steps only
                assert g[key] == w[key], (case, key, g, w)
        for key in CLOSE:
            assert key in w, f"{case}: TRL logs no {key!r} (renamed?): update CLOSE"
            tol = 1e-5 * abs(w[key]) if key == "entropy" else 5e-6
            assert abs(g[key] - w[key]) <= tol, (case, key, g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-5 * w["grad_norm"], (case, g, w)
    assert any(abs(w["loss"]) > 1e-3 for w in want), f"{case}: a loss that cannot tell runs apart"


def test_step_comparison_fails_on_a_renamed_metric_or_a_small_kl_error():
    """Negative controls of _assert_same_steps on a logged history: a metric TRL renamed (in both runs alike), a KL
    off by 1e-5, a grad norm off by 1e-4 relative all fail."""
    step = {"step": 1, "loss": 0.02, "kl": 0.3, "entropy": 4.5, "grad_norm": 2.0, "reward": 0.5, "reward_std": 0.1,
            "completions/mean_length": 4.0, "completions/max_length": 6.0, "frac_reward_zero_std": 0.0}
    history = [{**step, "step": i + 1} for i in range(STEPS)]
    _assert_same_steps(history, history, "unchanged")
    renamed = [{("rewards/mean" if k == "reward" else k): v for k, v in h.items()} for h in history]
    kl_off = [{**h, "kl": h["kl"] + 1e-5} for h in history]
    norm_off = [{**h, "grad_norm": h["grad_norm"] * (1 + 1e-4)} for h in history]
    for reference, tsp in ((renamed, renamed), (history, kl_off), (history, norm_off)):
        with pytest.raises(AssertionError):
            _assert_same_steps(reference, tsp, "planted")


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_with_tsp_equals_plain_grpo_trainer(grpo_runs, case):
    reference, tsp = (runs[case] for runs in grpo_runs["runs"])
    _assert_same_steps(reference, tsp, case)


def test_reference_log_probs_equal_transformers(grpo_runs):
    """TSP's streaming head on the (frozen) reference: the completion tokens' log-probs of logits / 0.7 equal
    transformers' logits path within 1e-5 (fp32), identical on both TSP ranks."""
    from transformers import AutoModelForCausalLM

    checks = grpo_runs["runs"][1]["checks"]
    ids, mask, k = ref_logps_batch()
    model = AutoModelForCausalLM.from_pretrained(grpo_runs["dir"] / "model", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1] / 0.7
    targets = ids[:, 1:]
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)[:, -k:]
    valid = mask[:, 1:][:, -k:].bool()
    for rank in checks:
        got = torch.tensor(rank["ref_logps"])
        assert got.shape == want.shape
        assert (got - want)[valid].abs().max() <= 1e-5, (got, want)
        assert torch.all(got[~valid] == 0)
    assert checks[0]["ref_logps"] == checks[1]["ref_logps"]


def test_vllm_weight_sync_streams_the_hf_checkpoint_one_module_at_a_time(grpo_runs):
    stream = next(c["stream"] for c in grpo_runs["runs"][1]["checks"] if c["rank"] == 0)
    assert stream["names_equal"] and stream["all_equal"] and stream["metadata_ok"], stream
    assert stream["max_modules_alive"] == 1 and stream["resets"] == 2 and stream["tensors"] > 10, stream


def test_grpo_tsp2_x_data2_equals_plain_two_process_grpo(tmp_path):
    """The data axis at its tiniest (DATA_CASES, ZeRO-2): 4 processes (TSP=2 x data 2) against a plain GRPOTrainer on
    2 processes, each step as in _assert_same_steps. Each group of completions spans both data replicas, so a
    reward gather, an advantage normalisation or slice, or a dapo normaliser over the wrong axis changes the logged
    rewards or the grad norm (advantages from one replica's rewards: grad norm 1.47 vs 1.97; num_items divided by
    the world size: 3.93 vs 1.97)."""
    _requirements()
    _setup(tmp_path, {"size": 2})
    (case, options), = DATA_CASES.items()
    reference = _launch(tmp_path / "ref.json", tmp_path, case, 2)
    tsp = _launch(tmp_path / "tsp.json", tmp_path, case, 4, tmp_path / "ds_zero2.json")
    runs = _finish(reference, tmp_path / "ref.json"), _finish(tsp, tmp_path / "tsp.json")
    _assert_same_steps(runs[0][case], runs[1][case], case, options["max_steps"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_tsp2_x_data2_zero_equals_plain_two_process_grpo(tmp_path, stage):
    """4 processes (TSP=2 x data 2, ZeRO-2: both cases; ZeRO-3: the grpo case) against a plain GRPOTrainer on 2
    processes (DDP): the data axis is TRL's process axis (seeds, reward gathering, advantage slices, dapo's
    normaliser)."""
    _requirements()
    _setup(tmp_path, {"size": 2})
    cases = list(CASES) if stage == 2 else sorted(ZERO3)
    reference = _launch(tmp_path / "ref.json", tmp_path, ",".join(cases), 2)
    tsp_cases = ",".join(f"{c}@{stage}" for c in cases)
    tsp = _launch(tmp_path / "tsp.json", tmp_path, tsp_cases, 4, tmp_path / "ds_zero2.json")
    runs = _finish(reference, tmp_path / "ref.json"), _finish(tsp, tmp_path / "tsp.json")
    for case in cases:
        _assert_same_steps(runs[0][case], runs[1][case], case)


# --- refusals (in-process, nothing built) ----------------------------------------------------------------------
def test_grpo_composition_and_wrong_order():
    trl = pytest.importorskip("trl")
    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPGRPOTrainer, TSPTrainer

    assert TSPGRPOTrainer.__mro__[1:3] == (TSPTrainer, trl.GRPOTrainer) and TSPGRPOTrainer._tsp_with_grpo
    composed = type("G", (TSPTrainer, trl.GRPOTrainer), {})
    assert composed._tsp_with_grpo and not composed._tsp_with_sft
    with pytest.raises(TSPConfigError, match=r"list TSPTrainer first, class Wrong\(TSPTrainer, GRPOTrainer\)"):
        type("Wrong", (trl.GRPOTrainer, TSPTrainer), {})


def test_grpo_options_tsp_cannot_honour_are_refused_by_name():
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPGRPOTrainer

    refused = [({"peft_config": object()}, {}, "peft_config="), ({"tools": [len]}, {}, "tools="),
               ({"rollout_func": len}, {}, "rollout_func="),
               ({}, {"use_vllm": True, "vllm_mode": "colocate"}, "vllm_mode='colocate'"),
               ({}, {"use_transformers_continuous_batching": True}, "use_transformers_continuous_batching"),
               ({}, {"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32"),
               ({}, {"entropy_coef": 0.01}, "entropy_coef"), ({}, {"use_adaptive_entropy": True}, "entropy_coef"),
               ({}, {"use_liger_kernel": True}, "use_liger_kernel"),
               ({}, {"router_aux_loss_coef": 0.01}, "router_aux_loss_coef"),
               ({}, {"sync_ref_model": True, "deepspeed_plugin": SimpleNamespace(zero_stage=3)}, "ZeRO-3")]
    for kwargs, options, match in refused:  # checked first thing: nothing is set up yet
        with pytest.raises(TSPConfigError, match=match):
            TSPGRPOTrainer(model=None, args=SimpleNamespace(**options), **kwargs)


def test_generation_batch_counts_data_replicas_not_tsp_ranks():
    from types import SimpleNamespace

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.integrations.trl.grpo import data_axis_batches

    args = SimpleNamespace(per_device_train_batch_size=4, steps_per_generation=2, num_generations=4,
                           generation_batch_size=32)  # GRPOConfig at 4 processes; TSP=2 leaves 2 replicas
    data_axis_batches(args, 2)
    assert args.generation_batch_size == 16
    with pytest.raises(TSPConfigError, match="num_generations=3"):
        data_axis_batches(SimpleNamespace(per_device_train_batch_size=4, steps_per_generation=1, num_generations=3,
                                          generation_batch_size=8), 1)


def test_temperature_and_checkpointing_arguments_are_checked():
    """temperature only scales the fused head's statistics (anything else is refused), and the Trainer's
    every_n_layers / offload (transformers 5.25) are honoured at their defaults only."""
    pytest.importorskip("transformers")
    from hf_tiny import tiny_config

    from ds_tsp.core.errors import TSPConfigError
    from ds_tsp.hf import TSPForCausalLM

    model = TSPForCausalLM.from_config(tiny_config("llama"), seed=0)
    ids = torch.randint(0, 70, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TSPConfigError, match="temperature=0.5: only with fused_lm_head=True"):
        model(input_ids=ids, labels=ids, temperature=0.5)
    with pytest.raises(TSPConfigError, match="temperature=0"):
        model(input_ids=ids, labels=ids, fused_lm_head=True, temperature=0)
    hot = model(input_ids=ids, labels=ids, fused_lm_head=True, temperature=2.0)
    cold = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert not torch.allclose(hot.log_probs, cold.log_probs) and torch.all(hot.entropy >= cold.entropy - 1e-6)
    model.gradient_checkpointing_enable(None, every_n_layers=1, offload=False)
    assert model.is_gradient_checkpointing
    with pytest.raises(TSPConfigError, match="every_n_layers=2"):
        model.gradient_checkpointing_enable(None, every_n_layers=2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
