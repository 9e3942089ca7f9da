"""Baseline: the whole HF Llama on one process, torch AdamW. Memory and speed of doing nothing parallel."""
from __future__ import annotations

import torch

from ds_tsp.tools.bench.common import build_hf_model, global_batch, token_loss_sum, valid_tokens
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.measure import Workload

SETUP = "HF LlamaForCausalLM (SDPA, fp32) on one process; torch.optim.AdamW; full logits + cross-entropy"


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        self.cfg = cfg
        self.model = build_hf_model(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

    def workload(self, seq: int) -> Workload:
        ids, labels, positions = global_batch(self.cfg, seq)
        n_valid = valid_tokens(labels)

        def step():
            logits = self.model(input_ids=ids, position_ids=positions).logits
            loss = token_loss_sum(logits, labels) / n_valid
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return Workload(step=step, tokens_per_step=ids.numel(), modules=[self.model], optimizers=[self.optimizer])


def build(cfg: BenchConfig, options: dict) -> Session:
    return Session(cfg, options)
