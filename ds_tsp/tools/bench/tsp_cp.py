"""Layout `tsp_cp`: C TSP groups of D ranks share each sequence (tsp.cp_size = C), K/V around the cp ring.

The groups come from the one setup path a training run takes (ds_tsp.core.parallel.runtime.build_runtime on
{"size": D, "cp_size": C}: TSP groups innermost, the cp ring across them, weights on their own communicator). Each
TSP group holds S/C tokens (zigzag over the 2C cp chunks, then TSP's zigzag inside: partition.shard_batch) and 1/D
of every weight, replicated over cp. After backward every gradient is averaged over the cp ring in ONE flat
all-reduce (what DDP / ZeRO-1 over data x cp does; posted after backward, so not overlapped with it as DDP's
buckets would be), then torch AdamW steps, as in the `tsp` layout.

Bytes per step come from two CommCounters, read as one (`TSPAndCpCounters`): the TSP group's (weights, K/V
gathers, the input check; intra-node in a real run) under their usual kinds, and the cp ring's (the inter-node
traffic) prefixed "cp:": "cp:ring" (K/V and dK/dV hops, ds_tsp.core.layers.attention.cp_ring), "cp:all_gather" (the
input check's whole-sequence facts; a hybrid model's Gated DeltaNet halo and transitions too, with their
"cp:reduce_scatter", ds_tsp.core.layers.linear_attention.scan) and "cp:grad_sync" (the gradient all-reduce above).
"""
from __future__ import annotations

import torch

from ds_tsp.core.comm.communicator import CommCounter
from ds_tsp.core.config import parse_tsp_config
from ds_tsp.core.grads.data_parallel import average_grads
from ds_tsp.core.parallel.runtime import build_runtime
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.tools.bench.common import global_batch, options_record, tsp_options
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.measure import Workload

SETUP = ("ds_tsp ShardedCausalLM on C TSP groups of D ranks (build_runtime, tsp.cp_size=C; K/V around the cp "
         "ring); grads averaged over cp in one flat all-reduce; torch.optim.AdamW")
CP_PREFIX = "cp:"  # keys of the cp ring's counter in the combined by-kind bytes


class TSPAndCpCounters:
    """The TSP group's and the cp ring's CommCounters, reset and read together (measure.py's tsp_counter
    protocol: reset() and snapshot()); the cp ring's kinds carry CP_PREFIX."""

    def __init__(self, tsp: CommCounter, cp: CommCounter):
        self.tsp, self.cp = tsp, cp

    def reset(self) -> None:
        self.tsp.reset()
        self.cp.reset()

    def snapshot(self) -> dict:
        tsp, cp = self.tsp.snapshot(), self.cp.snapshot()
        return {"bytes": {**tsp["bytes"], **{CP_PREFIX + k: v for k, v in cp["bytes"].items()}},
                "calls": {**tsp["calls"], **{CP_PREFIX + k: v for k, v in cp["calls"].items()}},
                "total_bytes": tsp["total_bytes"] + cp["total_bytes"], "wait_s": tsp["wait_s"] + cp["wait_s"],
                "wait_by": {**tsp["wait_by"], **{CP_PREFIX + k: v for k, v in cp["wait_by"].items()}}}


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        self.cfg = cfg
        checkpointing = cfg.activation_checkpointing == "all"
        runtime = build_runtime(parse_tsp_config({"size": cfg.tsp, "cp_size": cfg.cp, "cp_comm": cfg.cp_comm,
                                                  "activation_checkpointing": checkpointing}))
        self.groups, self.comm = runtime.groups, runtime.comm
        # the `tsp` layout's options exactly (memory-optimal), so tsp_cp and tsp run the same schedule per group
        self.options = tsp_options(options["mode"], checkpointing, cfg.moe_dispatch).replace(cp_comm=cfg.cp_comm)
        self.model = ShardedCausalLM(cfg.shape, self.comm, options=self.options, data_group=runtime.data_group)
        # weights keyed by (seed, piece, owner block): every cp group holds the same 1/D shards
        self.model.init_weights_(cfg.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.counters = TSPAndCpCounters(self.comm.counter, self.comm.cp.counter)

    def average_grads_over_cp(self) -> None:
        """Mean of every gradient over the cp ring (weights are replicated over cp): one flat all-reduce."""
        average_grads(self.model.parameters(), self.cfg.cp,
                      lambda flat: self.comm.cp.all_reduce(flat, kind="grad_sync", what="grads over cp").wait())

    def workload(self, seq: int) -> Workload:
        ids, labels, _ = global_batch(self.cfg, seq)
        batch = shard_batch(ids, tsp=self.cfg.tsp, rank=self.groups.tsp_rank, labels=labels, labels_are_shifted=True,
                            cp=self.cfg.cp, cp_rank=self.groups.cp_rank)
        args = (batch["input_ids"], batch["shift_labels"], batch["position_ids"])
        cp = self.cfg.cp

        def step():
            loss = self.model(*args)
            loss.backward()
            self.average_grads_over_cp()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            # this rank's share: a TSP group's shares sum to its tokens' loss over (all tokens / C), so the C*D
            # shares / C sum to the mean loss
            return loss.detach() / cp

        return Workload(step=step, tokens_per_step=ids.numel(), modules=[self.model], optimizers=[self.optimizer],
                        tsp_counter=self.counters, loss_reduce="sum",
                        info={"tsp_options": options_record(self.options), **self._cp_comm_chosen(args[0])})

    def _cp_comm_chosen(self, ids) -> dict:
        """cp_comm "auto": {"cp_comm_chosen": the schedule every attention layer runs at this row's length} (one
        name where all agree, else {schedule: layers})."""
        if self.cfg.cp_comm != "auto":
            return {}
        from ds_tsp.model.modules.attention import cp_schedules_at

        chosen = cp_schedules_at(self.model.model.layers, ids.shape[1] * self.cfg.tsp * self.cfg.cp,
                                 next(self.model.parameters()).dtype)
        return {"cp_comm_chosen": next(iter(chosen)) if len(chosen) == 1 else chosen}


def build(cfg: BenchConfig, options: dict) -> Session:
    return Session(cfg, options)
