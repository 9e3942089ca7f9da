"""The NCCL-rules replay (tests/helpers/nccl_rules.py) of the save and load paths: a ds_tsp training checkpoint saved
and loaded, and save_pretrained, on TSP 2 (one 2-rank launch). Recorded per rank: TSPComm's ops
(comm.recording()) and, in the same post order, every torch.distributed call made elsewhere
(tests/helpers/dist_trace.py: the object collectives that agree on paths, files and outcomes). Every rank must post
the same collectives in the same order and the replay must finish: a save that let one rank skip a collective
(e.g. on a write error) would hang NCCL here even where gloo's threads hide it."""
from __future__ import annotations

import pytest
from dist_trace import traced
from local_ranks import run_on_local_ranks
from nccl_rules import check

from ds_tsp.core.shape.model_shape import ModelShape

SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _recorded_saves(directory: str) -> list[dict]:
    import torch
    import torch.distributed as dist

    from ds_tsp.checkpoint.hf.save import save_streaming
    from ds_tsp.checkpoint.training.access import OptimizerAccess
    from ds_tsp.checkpoint.training.store import CheckpointStore
    from ds_tsp.checkpoint.training.train_state import load_train_state, save_train_state
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.comm.recorder import CommRecorder
    from ds_tsp.core.parallel.topology import ParallelLayout, ProcessGroups
    from ds_tsp.model.causal_lm import ShardedCausalLM

    groups = ProcessGroups.build(ParallelLayout.from_world_size(dist.get_world_size(), tsp=dist.get_world_size()))
    comm = TSPComm(groups.tsp_group, timeout_s=60)
    model = ShardedCausalLM(SHAPE, comm).init_weights_(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    access = OptimizerAccess(optimizer, global_batch_size=2)
    store = CheckpointStore(f"{directory}/ckpt")
    rec = CommRecorder()
    with comm.recording(rec), traced(rec.ops):
        save_train_state(access, model, groups, store, 1)
        load_train_state(access, model, groups, store)
        save_streaming(model, f"{directory}/hf", "{}")
    return rec.ops


@pytest.mark.slow
def test_saves_and_loads_obey_nccl_rules(tmp_path):
    ops = run_on_local_ranks(_recorded_saves, 2, str(tmp_path), timeout_s=300)
    for rank_ops in ops:
        kinds = {o["kind"] for o in rank_ops}
        assert {"broadcast_object_list", "all_gather_object", "gather"} <= kinds, kinds
    sequence = [[(o["kind"], o["group"], o.get("root"), o["dtype"]) for o in rank_ops] for rank_ops in ops]
    assert sequence[0] == sequence[1]  # the same collectives, in the same order, on both ranks
    report = check(ops)
    assert report.ok and report.completed == report.total, report
