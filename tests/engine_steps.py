"""A DeepSpeed engine's training steps on TSP shards, as the composition tests run them (tests/test_frozen_params.py,
tests/test_moe_compose.py). A helper module, not a test file."""
from __future__ import annotations


def engine_steps(engine, batches, save_dir: str) -> dict:
    """One engine step per (ids, labels) of this data replica (full length, sharded here for this TSP rank); then
    the consolidated model is saved to save_dir and the engine destroyed. {"losses", "norms"} per step."""
    from ds_tsp.checkpoint.consolidated import save_consolidated
    from ds_tsp.core.partition import shard_batch

    comm = engine.tsp_model.comm
    losses, norms = [], []
    for ids, labels in batches:
        b = shard_batch(ids, tsp=comm.size, rank=comm.rank, labels=labels)
        loss = engine(b["input_ids"], b["shift_labels"], b["position_ids"])
        engine.backward(loss)
        engine.step()
        losses.append(float(engine.tsp_model.loss_for_logging(loss)))
        norms.append(float(engine.get_global_grad_norm()))
    save_consolidated(engine.tsp_model, save_dir)
    engine.destroy()
    return {"losses": losses, "norms": norms}
