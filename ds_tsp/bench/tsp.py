"""TSP: ds_tsp's TSPCausalLM on D ranks (1/D of every weight, zigzag 1/D of the tokens), torch AdamW.

Modes: memory-optimal (TSPOptions(), the default) and speed (TSPOptions.speed(): keeps each head block's gathered
K/V and the local projections for backward, O(S) memory, no re-gather; TSPOptions(keep_gathered_kv=True) on
versions without it). The schedule already saves only O(S/D) per layer, so activation checkpointing applies to
TSP only with `--activation-checkpointing all`. Comm bytes come from the model's own CommCounter (logical
volume, see ds_tsp.comm); its wait_s per step is the exposed (not overlapped) communication.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ds_tsp.bench.common import global_batch
from ds_tsp.bench.config import BenchConfig
from ds_tsp.bench.measure import Workload
from ds_tsp.comm import TSPComm
from ds_tsp.model import TSPCausalLM, TSPOptions
from ds_tsp.partition import shard_batch

SETUP = "ds_tsp TSPCausalLM on one TSP group of D ranks; torch.optim.AdamW; streaming vocab-sharded loss"


def tsp_options(mode: str, activation_checkpointing: bool) -> TSPOptions:
    fields = {f.name for f in dataclasses.fields(TSPOptions)}
    extra = {"activation_checkpointing": True} if activation_checkpointing else {}
    if extra and "activation_checkpointing" not in fields:
        raise ValueError("this ds_tsp version's TSPOptions has no activation_checkpointing")
    if mode == "memory":
        return TSPOptions(**extra)
    if hasattr(TSPOptions, "speed"):
        return TSPOptions.speed(**extra)
    return TSPOptions(keep_gathered_kv=True, **extra)


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        self.cfg = cfg
        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        self.comm = TSPComm(group)
        self.options = tsp_options(options["mode"], cfg.activation_checkpointing == "all")
        self.model = TSPCausalLM(cfg.shape, self.comm, options=self.options)
        self._init_weights()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Random N(0, 0.02) shards (each rank its own stream), norms 1: the cost of a step does not depend on
        # the values, and no rank ever builds the full model.
        gen = torch.Generator().manual_seed(self.cfg.seed * 1000 + self.comm.rank)
        for name, param in self.model.named_parameters():
            if getattr(param, "tsp_sharded", False):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.02)

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
                        info={"tsp_options": dataclasses.asdict(self.options)})


def build(cfg: BenchConfig, options: dict) -> Session:
    return Session(cfg, options)
