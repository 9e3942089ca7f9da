"""transformers' own model under PyTorch FSDP2 data parallelism (torch.distributed.fsdp.fully_shard) on D ranks, each
rank running a WHOLE sequence of S tokens (its own sample), no sequence parallelism.

The second peer a hybrid-model user has beside hf_zero3_dp (ds_tsp.tools.bench.zero3_dp), with torch alone: every
decoder layer and the root are fully_shard units over one mesh axis of D ranks, so params, grads and AdamW's state
are 1/D per rank; a layer's params are all-gathered when it runs (forward and again in backward) and its grads
reduce-scattered (averaged over the ranks' samples). Activations are the full sequence's on every rank (O(S) per
rank against TSP's O(S/D)). It runs any model the bench builds from the shape (ds_tsp.tools.bench.common.
build_hf_model: HF Llama / Qwen2, or a hybrid --hf-config's Qwen3.5 / Qwen3-Next with its Gated DeltaNet torch
kernels, or an MoE one's Qwen3-MoE / Mixtral). tokens_per_step = D x B x S: compare tokens/s, and per-rank peak
at the same S.
Comm bytes: CollectiveBytes during the tracked step (FSDP2's c10d all-gathers and reduce-scatters).
"""
from __future__ import annotations

import dataclasses

import torch

from ds_tsp.tools.bench.common import build_hf_model, global_batch, rank_and_world, token_loss_sum, valid_tokens
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.measure import Workload

SETUP = ("transformers' model from the shape (SDPA; a hybrid config: its Gated DeltaNet layers' torch kernels) + "
         "torch FSDP2 (fully_shard per decoder layer and the root) data parallel over D ranks, each rank a whole "
         "sequence; torch AdamW")


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.cfg = cfg
        self.rank, self.world = rank_and_world()
        mesh = init_device_mesh("cpu", (self.world,))
        self.model = build_hf_model(cfg)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

    def workload(self, seq: int) -> Workload:
        # every rank its own sample (data parallel): the seed differs per rank
        ids, labels, positions = global_batch(dataclasses.replace(self.cfg, seed=self.cfg.seed + self.rank), seq)
        n_valid = valid_tokens(labels)

        def step():
            logits = self.model(input_ids=ids, position_ids=positions).logits  # [B, S, V]: the whole sequence
            loss = token_loss_sum(logits, labels) / n_valid
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return Workload(step=step, tokens_per_step=self.world * self.cfg.batch * seq, modules=[self.model],
                        optimizers=[self.optimizer])


def build(cfg: BenchConfig, options: dict) -> Session:
    if cfg.vision is not None:  # a vision-language model (ds_tsp.tools.bench.vision)
        from ds_tsp.tools.bench.vision import HFSession

        return HFSession(cfg, options, "fsdp2")
    return Session(cfg, options)
