"""A DeepSpeed engine's (or FSDP2's) training steps on TSP shards, as the composition tests run them
(tests/model/test_frozen_params.py, tests/moe/test_moe_compose.py, tests/hybrid/test_hybrid_compose.py). A helper module, not a test
file."""
from __future__ import annotations


def engine_steps(engine, batches, save_dir: str) -> dict:
    """One engine step per (ids, labels) of this data replica (full length, sharded here for this TSP rank); then
    the consolidated model is saved to save_dir and the engine destroyed. {"losses", "norms"} per step."""
    from ds_tsp.checkpoint.consolidated import save_consolidated
    from ds_tsp.core.tokens.zigzag import shard_batch

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


def full_weights(engine) -> dict:
    """Collective over the TSP group: the engine's model gathered into HF-named full tensors; with pipeline stages,
    only this rank's stage (its embedding / decoder layers / norm and head)."""
    from ds_tsp.model.state_dict import gather_pieces

    if engine.tsp_model is not None:
        return engine.tsp_model.full_state_dict()
    full = {}
    for layer in engine.module.forward_funcs:
        full.update(gather_pieces(*layer.tsp_pieces(), layer.comm))
    return full


def train_from_shape(shape, configs: list[dict], steps: int, num_samples: int, final: bool = False) -> list[dict]:
    """ds_tsp.initialize once per config on `shape` (reference weights, seed 0; MaskedPatterns of length 30), then
    `steps` engine steps from the engine's own loader: [{"losses", "grad_norms"}] per config, and with final=True
    "final": the trained weights, full and HF-named."""
    from masked_patterns import MaskedPatterns

    import ds_tsp
    from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

    ref = ReferenceCausalLM(shape)
    init_weights_(ref, 0)
    full = full_state_dict(ref)
    data = MaskedPatterns(vocab_size=shape.vocab_size, seq_len=30, num_samples=num_samples)
    runs = []
    for cfg in configs:
        engine, _, loader, _ = ds_tsp.initialize(model=shape, config=cfg, training_data=data, state_dict=full)
        batches, losses, norms = iter(loader), [], []
        for _ in range(steps):
            b = next(batches)
            loss = engine(b["input_ids"], b["shift_labels"], b["position_ids"])
            engine.backward(loss)
            engine.step()
            losses.append(float(engine.tsp_model.loss_for_logging(loss)))
            norms.append(float(engine.get_global_grad_norm()))
        runs.append({"losses": losses, "grad_norms": norms, **({"final": full_weights(engine)} if final else {})})
        engine.destroy()
    return runs


def fsdp2_steps(model, groups, batches, lr: float, weight_decay: float, clip: float) -> dict:
    """ds_tsp.shard_with_fsdp2 on a TSPForCausalLM, then one AdamW step with TSP-aware clipping per (ids, labels) of
    this data replica (full length: the HF face shards them). {"losses", "norms", "dtensor"}: dtensor says every
    parameter became an FSDP2 DTensor."""
    import torch

    from ds_tsp.core.grads.clip import clip_grad_norm_
    from ds_tsp.integrations.fsdp import shard_with_fsdp2

    shard_with_fsdp2(model, groups)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses, norms = [], []
    for ids, labels in batches:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        norms.append(float(clip_grad_norm_(model, clip, groups)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    return {"losses": losses, "norms": norms,
            "dtensor": all(type(p).__name__ == "DTensor" for p in model.parameters())}
