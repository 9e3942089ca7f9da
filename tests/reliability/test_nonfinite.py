"""NaN/inf loss or gradient under DeepSpeed (TSP=2 x DP=2): detected on every rank in the same step, even when only
one rank sees it. Default: every rank raises TSPNonFiniteError naming the step and the first offending parameter.
"on_nonfinite": "skip": the step is skipped with weights and optimizer state bit-identical, and training goes on
exactly as a run that never saw that batch (ZeRO 0 and 2)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from local_ranks import run_on_local_ranks  # noqa: E402
from test_deepspeed import ENV, SHAPE, ds_config  # noqa: E402


class _InfGrad(torch.autograd.Function):
    """Identity forward; an inf gradient backward (a finite loss whose backward overflows)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def _scenarios(runs: list[tuple]) -> list[dict]:
    """Several trainings in one process group (DeepSpeed start-up once)."""
    return [_train(*run) for run in runs]


def _train(stage: int, policy: str, poison: dict | None, skip_batch: int | None = None, steps: int = 4) -> dict:
    """poison: {"step": k, "rank": r, "kind": "nan_loss" | "inf_grad"}; skip_batch: leave that batch out."""
    import torch.distributed as dist
    from masked_patterns import MaskedPatterns

    import ds_tsp
    from ds_tsp.core.errors import TSPNonFiniteError
    from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

    cfg = ds_config(2, stage)
    cfg["tsp"]["on_nonfinite"] = policy
    ref = init_weights_(ReferenceCausalLM(SHAPE), 0)
    data = MaskedPatterns(vocab_size=SHAPE.vocab_size, seq_len=30, num_samples=64)
    engine, _, loader, _ = ds_tsp.initialize(model=SHAPE, config=cfg, training_data=data,
                                             state_dict=full_state_dict(ref))
    batches = [b for i, b in zip(range(steps + 1), loader) if i + 1 != skip_batch][:steps]
    rank, losses, snapshots = dist.get_rank(), [], {}
    model = engine.tsp_model
    try:
        for step, b in enumerate(batches, start=1):
            if poison and poison["step"] == step and poison["kind"] == "inf_grad" and poison["rank"] == rank:
                # an overflow inside backward: the loss stays finite, the grads flowing into layer 1's MLP are inf
                handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, out: _InfGrad.apply(out))
            loss = engine(b["input_ids"], b["shift_labels"], b["position_ids"])
            if poison and poison["step"] == step and poison["kind"] == "nan_loss" and poison["rank"] == rank:
                loss = loss * float("nan")
            engine.backward(loss)
            if poison and poison["step"] == step and poison["kind"] == "inf_grad" and poison["rank"] == rank:
                handle.remove()
            before = [p.detach().clone() for p in engine.module.parameters()]
            if engine.tsp_guard.check(loss, step):
                engine.step()
                losses.append(float(model.loss_for_logging(loss)))
            else:
                engine.zero_grad()
                snapshots["untouched"] = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    except TSPNonFiniteError as exc:
        return {"error": str(exc)}
    return {"losses": losses, "skipped": engine.tsp_guard.skipped_steps, **snapshots}


RUNS = [(2, "error", {"step": 2, "rank": 3, "kind": "nan_loss"}),
        (2, "error", {"step": 3, "rank": 1, "kind": "inf_grad"})]
for _stage in (0, 2):
    RUNS += [(_stage, "skip", {"step": 2, "rank": 2, "kind": "nan_loss"}), (_stage, "skip", None, 2, 3)]


@pytest.fixture(scope="module")
def results():
    return run_on_local_ranks(_scenarios, 4, RUNS, timeout_s=300, env=ENV)  # one DeepSpeed start-up for all


def test_every_rank_raises_naming_step_and_parameter(results):
    for nan_loss, inf_grad, *_ in results:  # every rank, also those whose own values were finite
        assert "step 2:" in nan_loss["error"] and "the loss is non-finite" in nan_loss["error"], nan_loss
        assert "step 3:" in inf_grad["error"] and "the loss is finite" in inf_grad["error"], inf_grad
        assert "first non-finite gradient: model." in inf_grad["error"], inf_grad


def test_skip_leaves_state_untouched_and_training_continues(results):
    for rank_results in results:
        skips = rank_results[2:]
        for poisoned, clean in zip(skips[::2], skips[1::2]):
            assert poisoned["skipped"] == [2] and poisoned["untouched"], poisoned
            assert poisoned["losses"] == clean["losses"], (poisoned, clean)  # == a run without batch 2, bit for bit
