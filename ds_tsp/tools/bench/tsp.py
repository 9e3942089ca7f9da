"""TSP: ds_tsp's ShardedCausalLM on D ranks (1/D of every weight, zigzag 1/D of the tokens), torch AdamW.

Modes: memory-optimal (TSPOptions(), the default), speed (TSPOptions.speed(): keeps each head block's gathered
K/V and the local projections for backward, O(S) memory, no re-gather) and, between them, projections kept
(TSPOptions(recompute_projections=False): no recomputed GEMM, the K/V re-gathered, O(S/D) memory). An MoE shape
runs cfg.moe_dispatch's schedule (ds_tsp.tools.bench.moe_report sets it beside the plan's "auto" choice). The
schedule already saves only O(S/D) per layer, so activation checkpointing applies to TSP only with
`--activation-checkpointing all`. Comm bytes come from the model's own CommCounter (logical volume, see
ds_tsp.core.comm.communicator); its wait_s per step is the exposed (not overlapped) communication.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.tools.bench.common import global_batch, options_record, tsp_options
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.measure import Workload

SETUP = "ds_tsp ShardedCausalLM on one TSP group of D ranks; torch.optim.AdamW; streaming vocab-sharded loss"


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        self.cfg = cfg
        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        # weights on their own communicator, as a CUDA training run gets them (ProcessGroups.build); kept on the
        # CPU too so the bench measures the same schedule
        weights = dist.new_group(list(range(dist.get_world_size()))) if group is not None else None
        self.comm = TSPComm(group, weight_group=weights)
        self.options = tsp_options(options["mode"], cfg.activation_checkpointing == "all", cfg.moe_dispatch)
        self.model = ShardedCausalLM(cfg.shape, self.comm, options=self.options)
        # No rank ever builds the full model; the cost of a step does not depend on the values.
        self.model.init_weights_(cfg.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

    def workload(self, seq: int) -> Workload:
        ids, labels, _ = global_batch(self.cfg, seq)
        batch = shard_batch(ids, tsp=self.comm.size, rank=self.comm.rank, labels=labels, labels_are_shifted=True)
        args = (batch["input_ids"], batch["shift_labels"], batch["position_ids"])

        def step():
            loss = self.model(*args)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss.detach()  # this rank's share; the shares sum to the mean loss

        return Workload(step=step, tokens_per_step=ids.numel(), modules=[self.model], optimizers=[self.optimizer],
                        tsp_counter=self.comm.counter, loss_reduce="sum",
                        info={"tsp_options": options_record(self.options)})


def build(cfg: BenchConfig, options: dict) -> Session:
    if cfg.vision is not None:  # a vision-language model (ds_tsp.tools.bench.vision)
        from ds_tsp.tools.bench.vision import TSPSession

        return TSPSession(cfg, options)
    return Session(cfg, options)
