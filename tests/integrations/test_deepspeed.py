"""DeepSpeed integration: DP x TSP training equals single-rank training on the same global batches (ZeRO 1/2/3,
gradient clipping active, replicas holding different numbers of labelled tokens), pipeline stages x TSP equal a
single rank, and incompatible configurations fail with one clear error.

Tolerance: per-step loss within 1e-5 relative, grad norm 1e-4 (fp32; sharded sums are reordered, ~1e-7 here); final
weights 1e-5 relative per tensor (AdamW steps near-zero gradients by +-lr on last-bit rounding, ~1e-6 here).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from engine_steps import full_weights, train_from_shape  # noqa: E402
from local_ranks import run_on_local_ranks  # noqa: E402
from masked_patterns import MaskedPatterns  # noqa: E402

from ds_tsp.core.errors import TSPConfigError  # noqa: E402
from ds_tsp.core.shape.model_shape import ModelShape  # noqa: E402
from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_  # noqa: E402

SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
STEPS = 5
ENV = {"DS_ACCELERATOR": "cpu"}


def ds_config(tsp: int, stage: int, pipeline_stages: int = 1, micro_batch: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
            "gradient_clipping": 0.5, "tsp": {"size": tsp, "pipeline_stages": pipeline_stages}, **extra}


def _train(configs: list[dict], steps: int = STEPS, final: bool = False, shape: ModelShape = SHAPE) -> list[dict]:
    """Train once per config in this process group; per-step global losses and grad norms (and final weights)."""
    return train_from_shape(shape, configs, steps, num_samples=64, final=final)


@pytest.fixture(scope="module")
def reference_run():
    """One rank, micro-batch 4: the single-device run on the same global batches (the data sampler deals
    shuffled indices round-robin, so 2 replicas x 2 samples see the same 4 samples per step)."""
    return run_on_local_ranks(_train, 1, [ds_config(1, 1, micro_batch=4)], timeout_s=300, env=ENV)[0][0]


def test_tsp2_dp2_zero_stages_match_reference(reference_run):
    runs = run_on_local_ranks(_train, 4, [ds_config(2, s) for s in (1, 2, 3)], timeout_s=600, env=ENV)[0]
    ref = torch.tensor(reference_run["losses"])
    assert ref[-1] < ref[0], "the reference must actually learn, or equal losses prove nothing"
    for stage, run in zip((1, 2, 3), runs):
        got = torch.tensor(run["losses"])
        assert torch.allclose(got, ref, rtol=1e-5, atol=0), (stage, run["losses"], reference_run["losses"])
        # clipping at 0.5 is active (norms above it) and computed over the same global gradient
        norms, ref_norms = torch.tensor(run["grad_norms"]), torch.tensor(reference_run["grad_norms"])
        assert (ref_norms > 0.5).any()
        assert torch.allclose(norms, ref_norms, rtol=1e-4), (stage, run["grad_norms"], reference_run["grad_norms"])


def test_tsp4_with_kv_heads_shared_by_ranks_matches_reference(reference_run):
    """num_kv_heads=2 < D=4: each kv head lives on its group's leader only, so DeepSpeed's clipping norm (summed over
    the TSP-sharded elements of every rank) counts it once; it did count each replica before."""
    run = run_on_local_ranks(_train, 4, [ds_config(4, 2, micro_batch=4)], timeout_s=600, env=ENV)[0][0]
    assert torch.allclose(torch.tensor(run["grad_norms"]), torch.tensor(reference_run["grad_norms"]), rtol=1e-5), run
    assert torch.allclose(torch.tensor(run["losses"]), torch.tensor(reference_run["losses"]), rtol=1e-5), run


@pytest.mark.parametrize("extra, match", [
    ({"tensor_parallel": {"autotp_size": 2}}, "autotp_size"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
    ({"tsp": {"size": 2, "pipeline_stages": 2}, "zero_optimization": {"stage": 2}}, "pipeline engine"),
    ({"tsp": {"size": 2, "sise": 1}}, r"tsp\.sise: unknown key"),
    ({"tsp": {"size": 0}}, r"tsp\.size=0"),
    ({"tsp": {"size": 2, "kernel": "fa3"}}, r"tsp\.kernel='fa3'.*'flash_attn'"),
    ({"tsp": {"size": 2, "keep_gathered_kv": "yes"}}, r"tsp\.keep_gathered_kv='yes'.*true or false"),
])
def test_incompatible_or_bad_config_fails_clearly(extra, match):
    import ds_tsp

    cfg = {**ds_config(2, 1), **extra}
    with pytest.raises(TSPConfigError, match=match):
        ds_tsp.initialize(model=SHAPE, config=cfg)


def _train_pipeline(cfg: dict, steps: int = STEPS, shape: ModelShape = SHAPE) -> dict:
    import torch.distributed as dist

    import ds_tsp
    from ds_tsp.core.tokens.loader import pipeline_batches

    ref = ReferenceCausalLM(shape)
    init_weights_(ref, 0)
    data = MaskedPatterns(vocab_size=shape.vocab_size, seq_len=30, num_samples=64)
    engine, _, loader, _ = ds_tsp.initialize(model=shape, config=cfg, training_data=data,
                                             state_dict=full_state_dict(ref))
    batches = pipeline_batches(loader)
    losses, norms = [], []
    for _ in range(steps):
        share = engine.train_batch(batches)
        dist.all_reduce(share, group=engine.tsp_groups.tsp_group)
        losses.append(float(share))
        norms.append(float(engine.get_global_grad_norm()))
    out = {"losses": losses, "grad_norms": norms, "final": full_weights(engine)}
    engine.destroy()
    return out


def _train_pipeline_and_a_planted_defect(cfg: dict) -> dict:
    """The pipeline run, then the same run clipping each stage by its own norm (DeepSpeed's model-parallel group
    narrowed to the TSP group): the negative control the comparison must catch."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    honest = _train_pipeline(cfg)
    whole = PipelineParallelGrid.get_model_parallel_group
    PipelineParallelGrid.get_model_parallel_group = PipelineParallelGrid.get_slice_parallel_group
    try:
        return {"honest": honest, "per_stage_clipping": _train_pipeline(cfg)}
    finally:
        PipelineParallelGrid.get_model_parallel_group = whole


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _pipeline_differences(runs: list[dict], reference: dict) -> list:
    """What differs between the ranks' runs and one rank's: losses (1e-5), clip norms (1e-4: fp32 sums reordered
    over stages and TSP shards, ~1e-7 seen) per step, and the final weights of both stages together (1e-5 relative
    per tensor: AdamW turns last-bit rounding of near-zero gradients into +-lr steps, 1.2e-6 seen). Empty if equal."""
    out, stages = [], {}
    for rank, run in enumerate(runs):
        if not torch.allclose(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=1e-5):
            out.append(("losses", rank, run["losses"], reference["losses"]))
        if not torch.allclose(torch.tensor(run["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-4):
            out.append(("grad_norms", rank, run["grad_norms"], reference["grad_norms"]))
        for name, value in run["final"].items():  # both TSP ranks of a stage gather the same full tensors
            if not torch.equal(stages.setdefault(name, value), value):
                out.append(("tsp ranks disagree", rank, name))
    want = {k: v for k, v in reference["final"].items() if not (SHAPE.tie_word_embeddings and k == "lm_head.weight")}
    if set(stages) != set(want):
        return out + [("weights held", sorted(set(stages) ^ set(want)))]
    return out + [("final weight", k, _rel(stages[k], v)) for k, v in want.items() if _rel(stages[k], v) >= 1e-5]


def test_pipeline_stages_times_tsp_match_single_rank():
    """Pipeline stages 2 x TSP 2 equal one rank (_pipeline_differences); clipping each stage by its own norm instead
    of the global one (losses ~1e-4 off, final weights ~1e-2, norms at once) is caught."""
    reference = run_on_local_ranks(_train, 1, [ds_config(1, 1)], STEPS, True, timeout_s=300, env=ENV)[0][0]
    assert (torch.tensor(reference["grad_norms"]) > 0.5).any(), "clipping must be active, or the norms prove nothing"
    got = run_on_local_ranks(_train_pipeline_and_a_planted_defect, 4, ds_config(2, 1, pipeline_stages=2),
                             timeout_s=300, env=ENV)
    assert _pipeline_differences([r["honest"] for r in got], reference) == []
    planted = _pipeline_differences([r["per_stage_clipping"] for r in got], reference)
    assert {"grad_norms", "final weight"} <= {d[0] for d in planted}, planted


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_next_moe"])
def test_zero3_gathers_what_a_layer_reads_with_the_layer(family):
    """ZeRO-3 makes a parameter whole only inside the hooks of a module it belongs or is registered to; a TSP layer
    reads parameters held by children it never calls (the q/k norms, the MoE router and shared-expert gates, the
    Gated DeltaNet norm), also in its checkpointed recompute and in the backward of its autograd Functions.
    register_zero3_fetches registers every parameter of each decoder layer's subtree with the layer, and a tied
    head's weight (the embedding's shard) with the head. (The TRL RL tests run this under real ZeRO-3.)"""
    import deepspeed
    from hf_tiny import tiny_config
    from hybrid_tiny import hybrid_config

    from ds_tsp.hf import TSPForCausalLM
    from ds_tsp.integrations.deepspeed.zero3_fetch import register_zero3_fetches
    from ds_tsp.model.modules.decoder import TSPDecoderLayer

    config = hybrid_config(family) if family == "qwen3_next_moe" else tiny_config(family)
    model = TSPForCausalLM.from_config(config, seed=0)
    assert register_zero3_fetches(model, deepspeed) > 0
    layers = [m for m in model.modules() if isinstance(m, TSPDecoderLayer)]
    assert len(layers) == config.num_hidden_layers
    names = {id(p): n for n, p in model.named_parameters()}
    for layer in layers:
        own = {id(p) for p in layer.parameters(recurse=False)}
        registered = {id(p) for _, p in layer.ds_external_parameters()}
        assert registered == {id(p) for p in layer.parameters()} - own
    read_by_parents = {"qwen3": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
                       "qwen3_moe": ("self_attn.q_norm.weight", "mlp.gate.weight"),
                       "qwen3_next_moe": ("linear_attn.norm.weight", "mlp.shared_expert_gate.weight")}[family]
    registered_names = {names[key].split(".", 4)[-1] for layer in layers for key, _ in layer.ds_external_parameters()}
    assert set(read_by_parents) <= registered_names, sorted(registered_names)
    head = model.tsp.lm_head
    if head.tied:
        assert [p for _, p in head.ds_external_parameters()] == [model.tsp.model.embed_tokens.vocab_shard]


def test_zero3_gathers_a_sequence_classifiers_score_head_with_the_classifier():
    """The classifier's forward reads its core's score head (the core's own forward never runs): it is registered
    with the classifier. (tests/integrations/test_reward_trainer.py runs TSPRewardTrainer under real ZeRO-3.)"""
    import deepspeed
    from hf_tiny import tiny_config

    from ds_tsp.hf import TSPForSequenceClassification
    from ds_tsp.integrations.deepspeed.zero3_fetch import register_zero3_fetches

    model = TSPForSequenceClassification.from_config(tiny_config("llama", num_labels=1, pad_token_id=0), seed=0)
    assert register_zero3_fetches(model, deepspeed) > 0
    assert [p for _, p in model.ds_external_parameters()] == [model.tsp.score]


WINDOWED = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      attention_windows=(8, None))


@pytest.mark.slow
@pytest.mark.parametrize("cp_comm, shape, tsp", [("ring", SHAPE, 1), ("all_to_all", SHAPE, 1), ("ring", WINDOWED, 1),
                                                 ("ring", SHAPE, 2)],
                         ids=["ring", "all_to_all", "ring_sliding_window", "ring_tsp2_data1"])
def test_pipeline_stages_times_data_times_cp_match_single_rank(cp_comm, shape, tsp):
    """(PP, D, C) = (2, 2, 2) on 8 ranks (tsp 1): each stage's layers pass K/V over the cp groups (the ring, or the
    all-to-all schedule; a sliding-window layer on stage 0), each cp group of a replica holds its zigzag chunks of
    the replica's micro-batch, and DeepSpeed's data axis (data x cp) averages the gradients; equal to one rank on the
    same global batches of 4 (_pipeline_differences: losses 1e-5, clip norms 1e-4, final weights 1e-5). Without the
    stage's position_ids gathered over cp (a document break read between a cp group's two chunks) the losses are
    6e-5 off: caught. ring_tsp2_data1: (PP, D, C, TSP) = (2, 1, 2, 2), TSP groups of 2 inside each stage and cp
    group, against one rank at micro-batch 2."""
    data = 2 // tsp
    reference = run_on_local_ranks(_train, 1, [ds_config(1, 1, micro_batch=2 * data)], STEPS, True, shape,
                                   timeout_s=300, env=ENV)[0][0]
    assert (torch.tensor(reference["grad_norms"]) > 0.5).any(), "clipping must be active, or the norms prove nothing"
    cfg = ds_config(tsp, 1, pipeline_stages=2)
    cfg["tsp"].update(cp_size=2, cp_comm=cp_comm)
    got = run_on_local_ranks(_train_pipeline, 8, cfg, STEPS, shape, timeout_s=600, env=ENV)
    assert _pipeline_differences(got, reference) == []


def _train_family(cfg: dict, family: str, steps: int = STEPS) -> dict:
    """A tiny transformers model of `family` (MoE without the aux loss, or the Qwen3.5 hybrid), trained by
    ds_tsp.initialize from its weights: the pipeline engine when cfg has stages, else the plain engine."""
    import torch.distributed as dist
    import transformers
    from hf_tiny import init_tiny_weights_, tiny_config
    from hybrid_tiny import hybrid_config

    import ds_tsp
    from ds_tsp.core.tokens.loader import pipeline_batches

    config = (hybrid_config(family, tie_word_embeddings=False) if family.startswith("qwen3_5") else
              tiny_config(family, output_router_logits=False, tie_word_embeddings=False))
    model = init_tiny_weights_(transformers.AutoModelForCausalLM.from_config(config).float(), 0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = MaskedPatterns(vocab_size=config.vocab_size, seq_len=30, num_samples=64)
    engine, _, loader, _ = ds_tsp.initialize(model=config, config=cfg, training_data=data, state_dict=state)
    losses, norms = [], []
    if cfg["tsp"].get("pipeline_stages", 1) > 1:
        batches = pipeline_batches(loader)
        for _ in range(steps):
            share = engine.train_batch(batches)
            dist.all_reduce(share, group=engine.tsp_groups.tsp_group)
            losses.append(float(share))
            norms.append(float(engine.get_global_grad_norm()))
    else:
        batches = iter(loader)
        for _ in range(steps):
            b = next(batches)
            loss = engine(b["input_ids"], b["shift_labels"], b["position_ids"])
            engine.backward(loss)
            engine.step()
            losses.append(float(engine.tsp_model.loss_for_logging(loss)))
            norms.append(float(engine.get_global_grad_norm()))
    out = {"losses": losses, "grad_norms": norms, "final": full_weights(engine)}
    engine.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5"])
def test_pipeline_stages_times_cp_on_moe_and_hybrid(family):
    """(PP, C) = (2, 2) on 4 ranks against the plain engine on one rank (itself checked against transformers in
    tests/moe and tests/hybrid), same weights and batches: MoE without the aux loss (qwen3_moe) and the Qwen3.5 hybrid
    (a Gated DeltaNet layer on stage 0, gated attention on stage 1). SGD, clipping active: per-step loss 1e-5, clip
    norm 1e-4, final weights 1e-5 (_pipeline_differences). (Under AdamW the hybrid's final weights differ up to 6e-5:
    its cp chunk-state sums reorder float32 rounding, which AdamW turns into +-lr steps on near-zero gradients;
    losses and norms agree there too.)"""
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}
    reference = run_on_local_ranks(_train_family, 1, {**ds_config(1, 1), **sgd}, family, timeout_s=300, env=ENV)[0]
    assert reference["losses"][-1] < reference["losses"][0] and max(reference["grad_norms"]) > 0.5, reference
    cfg = {**ds_config(1, 1, pipeline_stages=2), **sgd}
    cfg["tsp"]["cp_size"] = 2
    got = run_on_local_ranks(_train_family, 4, cfg, family, timeout_s=600, env=ENV)
    diffs = _pipeline_differences(got, reference)
    assert diffs == [], "\n".join(map(str, diffs))
