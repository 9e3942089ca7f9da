"""Pipeline stages with activation checkpointing (`"tsp": {"pipeline_stages": 2, "activation_checkpointing": true}`).

DeepSpeed's PipelineModule checkpoints every module with parameters unless told which: its reentrant checkpoint of
the embedding stage (integer inputs, none requiring grad) returned an output without a grad_fn, and the first
stage's backward failed ("element 0 of tensors does not require grad"). The stages now checkpoint the decoder
layers only (checkpointable_layers=["DecoderPipe"]), as ShardedCausalLM does on one stage. Checked on a Qwen3.5
hybrid at (PP, TSP) = (2, 2), SGD, 3 steps: losses, clip norms and each stage's final weights equal the same run
without checkpointing (1e-6 relative: the recompute repeats the same float32 arithmetic), and every rank's TSP
counter of a step equals `ds-tsp plan`'s per-stage bytes with the recompute (hybrid_counter_bytes), both runs.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
from local_ranks import run_on_local_ranks  # noqa: E402

LAYERS = ("linear_attention", "full_attention", "linear_attention")
ENV = {"DS_ACCELERATOR": "cpu"}


def _config():
    from hybrid_tiny import hybrid_config

    return hybrid_config("qwen3_5", layer_types=LAYERS, num_hidden_layers=3)


def _train(checkpointing: bool) -> dict:
    import torch.distributed as dist
    import transformers
    from engine_steps import full_weights
    from hf_tiny import init_tiny_weights_
    from masked_patterns import MaskedPatterns

    import ds_tsp
    from ds_tsp.core.tokens.loader import pipeline_batches

    config = _config()
    model = init_tiny_weights_(transformers.AutoModelForCausalLM.from_config(config).float(), 0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = MaskedPatterns(vocab_size=config.vocab_size, seq_len=30, num_samples=64)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5,
           "tsp": {"size": 2, "pipeline_stages": 2, "activation_checkpointing": checkpointing}}
    engine, _, loader, _ = ds_tsp.initialize(model=config, config=cfg, training_data=data, state_dict=state)
    batches = pipeline_batches(loader)
    losses, norms, counted = [], [], None
    for step in range(3):
        engine.tsp_comm.counter.reset()
        share = engine.train_batch(batches)
        if step == 0:
            counted = dict(engine.tsp_comm.counter.bytes)
        dist.all_reduce(share, group=engine.tsp_groups.tsp_group)
        losses.append(float(share))
        norms.append(float(engine.get_global_grad_norm()))
    out = {"stage": engine.stage_id, "losses": losses, "grad_norms": norms, "bytes": counted,
           "final": full_weights(engine)}
    engine.destroy()
    return out


def _runs() -> dict:
    return {ac: _train(ac) for ac in (False, True)}


@pytest.mark.slow
def test_pipeline_stages_with_activation_checkpointing_match_and_equal_the_plan():
    from ds_tsp.core.shape.model_shape import ModelShape
    from ds_tsp.tools.plan import PlanInput
    from ds_tsp.tools.plan.hybrid import hybrid_counter_bytes
    from ds_tsp.tools.plan.shape_terms import stages

    got = run_on_local_ranks(_runs, 4, timeout_s=900, env=ENV)
    shape = ModelShape.from_hf_config(_config().to_dict())
    for rank in got:
        plain, checkpointed = rank[False], rank[True]
        # the steps move the weights (every loss differs) and the clipping is active
        assert len(set(plain["losses"])) == 3 and max(plain["grad_norms"]) > 0.5, plain
        assert torch.allclose(torch.tensor(checkpointed["losses"]), torch.tensor(plain["losses"]), rtol=1e-6)
        assert torch.allclose(torch.tensor(checkpointed["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-6)
        for name, value in plain["final"].items():
            assert torch.allclose(checkpointed["final"][name], value, rtol=1e-6, atol=1e-7), name
        for ac, run in ((False, plain), (True, checkpointed)):
            inp = PlanInput(model=shape, seq=30, batch=2, degree=2, dtype="fp32", pp=2, activation_checkpointing=ac)
            assert run["bytes"] == hybrid_counter_bytes(inp, stages(inp)[run["stage"]]), (ac, run["stage"])
