"""save_pretrained: atomic (a failing save leaves the previous checkpoint untouched on every rank's view, and every
rank raises instead of hanging), and under ZeRO-3 (DP=2 x TSP=2, parameters partitioned over the data axis) it
writes the HF layout that plain transformers loads with the trained weights.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import save_tiny_checkpoint  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402


def _save_twice_second_fails(source: str, target: str) -> str:
    from ds_tsp.checkpoint.safetensors import writer as safetensors_io
    from ds_tsp.hf import TSPForCausalLM

    model = TSPForCausalLM.from_pretrained(source)
    model.save_pretrained(target, max_shard_size="8KB")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the second save would write different weights
    original = safetensors_io.StreamingCheckpointWriter._write_shard
    written = []

    def fail_after_two_shards(self, tensors):
        if len(written) == 2:
            raise OSError("No space left on device (simulated)")
        written.append(1)
        return original(self, tensors)

    safetensors_io.StreamingCheckpointWriter._write_shard = fail_after_two_shards
    try:
        model.save_pretrained(target, max_shard_size="8KB")
    except TSPConfigError as exc:
        return str(exc)
    return "no error"


def test_failed_save_leaves_previous_checkpoint_and_fails_every_rank(tmp_path):
    source = save_tiny_checkpoint(tmp_path / "src", "llama")
    target = tmp_path / "out"
    messages = run_on_local_ranks(_save_twice_second_fails, 2, str(source), str(target), timeout_s=120)
    for message in messages:  # both ranks got the writer's error, none hung in a collective
        assert "No space left on device" in message and "untouched" in message, message
    saved = transformers.AutoModelForCausalLM.from_pretrained(target).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(source).state_dict()
    for name, value in want.items():
        assert torch.equal(saved[name], value), name  # the first save, not a mix with the failed second one
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _zero3_train_and_save(source: str, target: str) -> dict:
    import deepspeed

    import ds_tsp
    from ds_tsp.tools.synthetic import RepeatingPatterns

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
              "tsp": {"size": 2}}
    data = RepeatingPatterns(vocab_size=70, seq_len=24, num_samples=16)
    engine, _, loader, _ = ds_tsp.initialize(model=source, config=config, training_data=data)
    batch = next(iter(loader))
    out = engine(**batch, logits_to_keep=3)
    engine.backward(out.loss)
    engine.step()
    model = engine.module
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        trained = model.tsp.full_state_dict()
    probe = torch.randint(0, 70, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = engine(input_ids=probe, logits_to_keep=19).logits
    model.save_pretrained(target, max_shard_size="20KB")
    return {"trained": trained, "logits": logits, "probe": probe}


def test_save_pretrained_under_zero3(tmp_path):
    pytest.importorskip("deepspeed")
    source = save_tiny_checkpoint(tmp_path / "src", "llama")
    result = run_on_local_ranks(_zero3_train_and_save, 4, str(source), str(tmp_path / "out"), timeout_s=300,
                                env={"DS_ACCELERATOR": "cpu"})[0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    before = transformers.AutoModelForCausalLM.from_pretrained(source).state_dict()
    changed = 0
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, result["trained"][name]), name
        changed += not torch.equal(value, before[name])
    assert changed > 0, "the optimizer step changed the weights that were saved"
    with torch.no_grad():
        logits = reloaded(input_ids=result["probe"]).logits
    torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-5)


def _save_onto_a_file(source: str, target: str) -> str:
    from ds_tsp.hf import TSPForCausalLM

    model = TSPForCausalLM.from_pretrained(source)
    try:
        model.save_pretrained(target)
    except TSPConfigError as exc:
        return str(exc)
    return "no error"


def test_writer_that_cannot_open_fails_every_rank_at_the_start(tmp_path):
    """The writer (global rank 0) cannot even open (the target is a file): every rank raises its reason at the first
    collective of the save instead of waiting in a gather the writer never joins."""
    source = save_tiny_checkpoint(tmp_path / "src", "llama")
    target = tmp_path / "a_file"
    target.write_text("not a checkpoint")
    for message in run_on_local_ranks(_save_onto_a_file, 2, str(source), str(target), timeout_s=120):
        assert "could not start" in message and "not a plain directory" in message, message
    assert target.read_text() == "not a checkpoint"


def test_a_module_without_tsp_shards_is_refused(tmp_path):
    """What a DeepSpeed PipelineModule (tsp.pipeline_stages > 1) is to save_streaming: no sharded_modules()."""
    from ds_tsp.checkpoint.hf.save import save_streaming

    with pytest.raises(TSPConfigError, match=r"Linear is not a TSP model.*PipelineModule.*pipeline_stages=1"):
        save_streaming(torch.nn.Linear(2, 2), tmp_path / "out", "{}")
    assert not (tmp_path / "out").exists()
