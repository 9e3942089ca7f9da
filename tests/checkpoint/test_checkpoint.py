"""Checkpoints: DeepSpeed save/load resumes with identical losses; the consolidated safetensors export reloads
at another TSP degree (D=2 -> 1 and 4) and in plain transformers with the same loss (fp32, 1e-5 relative)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from local_ranks import run_on_local_ranks  # noqa: E402
from test_deepspeed import ENV, SHAPE, ds_config  # noqa: E402

from ds_tsp.core.tokens.zigzag import shard_batch, shift_labels  # noqa: E402
from ds_tsp.tools.synthetic import RepeatingPatterns  # noqa: E402

DATA = dict(vocab_size=SHAPE.vocab_size, seq_len=30, num_samples=64)


def eval_batch() -> torch.Tensor:
    data = RepeatingPatterns(**DATA)
    return torch.stack([data[i]["input_ids"] for i in range(4)])


@torch.no_grad()
def eval_loss(model) -> float:
    ids = eval_batch()
    b = shard_batch(ids, tsp=model.comm.size, rank=model.comm.rank)
    return float(model.loss_for_logging(model(b["input_ids"], b["shift_labels"], b["position_ids"])))


def _train_save_resume(ckpt_dir: str, export_dir: str) -> dict:
    import ds_tsp
    from ds_tsp.checkpoint.consolidated import save_consolidated
    from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

    ref = ReferenceCausalLM(SHAPE)
    init_weights_(ref, 0)
    data = RepeatingPatterns(**DATA)
    cfg = ds_config(2, 1)

    def step(engine, b):
        loss = engine(b["input_ids"], b["shift_labels"], b["position_ids"])
        engine.backward(loss)
        engine.step()
        return float(engine.tsp_model.loss_for_logging(loss))

    engine, _, loader, _ = ds_tsp.initialize(model=SHAPE, config=cfg, training_data=data,
                                             state_dict=full_state_dict(ref))
    batches = list(loader)[:5]
    for b in batches[:3]:
        step(engine, b)
    engine.save_checkpoint(ckpt_dir, tag="step3")
    save_consolidated(engine.tsp_model, export_dir)
    exported_loss = eval_loss(engine.tsp_model)
    continued = [step(engine, b) for b in batches[3:]]
    engine.destroy()

    engine, _, _, _ = ds_tsp.initialize(model=SHAPE, config=cfg, training_data=data, seed=123)
    engine.load_checkpoint(ckpt_dir, tag="step3")
    resumed = [step(engine, b) for b in batches[3:]]
    return {"continued": continued, "resumed": resumed, "exported_loss": exported_loss}


def _reload_at_degree(export_dir: str) -> float:
    import torch.distributed as dist

    from ds_tsp.checkpoint.consolidated import load_consolidated
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.model.causal_lm import ShardedCausalLM

    shape, full = load_consolidated(export_dir)
    comm = TSPComm(dist.group.WORLD if dist.is_initialized() else None)
    model = ShardedCausalLM(shape, comm)
    model.load_full_state_dict(full)
    return eval_loss(model)


def test_resume_and_reload_at_other_degrees(tmp_path):
    ckpt, export = str(tmp_path / "ds"), str(tmp_path / "hf")
    result = run_on_local_ranks(_train_save_resume, 4, ckpt, export, timeout_s=600, env=ENV)[0]
    assert result["resumed"] == result["continued"], result  # identical, bit for bit

    at_d1 = _reload_at_degree(export)
    at_d4 = run_on_local_ranks(_reload_at_degree, 4, export, timeout_s=120)[0]
    for loss in (at_d1, at_d4):
        assert abs(loss - result["exported_loss"]) <= 1e-5 * result["exported_loss"], (loss, result)

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export)
    ids = eval_batch()
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shift_labels(ids).flatten(),
                                                ignore_index=-100)
    assert abs(float(hf_loss) - result["exported_loss"]) <= 1e-5 * result["exported_loss"]
