"""The baseline every user has: transformers' own model under DeepSpeed ZeRO-3 data parallelism on D ranks, each rank
running a WHOLE sequence of S tokens (its own sample), no sequence parallelism.

It runs any model the bench builds from the shape (ds_tsp.tools.bench.common.build_hf_model: HF Llama / Qwen2, or,
for a hybrid --hf-config, transformers' Qwen3.5 / Qwen3-Next with its Gated DeltaNet layers; for a mixture-of-experts
one, transformers' Qwen3-MoE / Mixtral with its own experts), which is why it is the hybrid and MoE models' peer:
DeepSpeed's Ulysses wraps the attention function only (ds_tsp.tools.bench.hybrid says why it
cannot run a Gated DeltaNet layer). ZeRO-3 partitions params, grads and optimizer state 1/D and gathers each layer's
weights when used; activations are the full sequence's on every rank (O(S) per rank against TSP's O(S/D)).
tokens_per_step = D x B x S (every rank its own sample): compare tokens/s, and per-rank peak at the same S.
Comm bytes: CollectiveBytes during the tracked step (DeepSpeed's eager c10d ops).
"""
from __future__ import annotations

import dataclasses

from ds_tsp.tools.bench.common import (
    build_hf_model,
    global_batch,
    rank_and_world,
    require,
    token_loss_sum,
    valid_tokens,
)
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.deepspeed_common import ds_config, init_distributed, torch_optimizers
from ds_tsp.tools.bench.measure import Workload

SETUP = ("transformers' model from the shape (SDPA; a hybrid config: its Gated DeltaNet layers' torch kernels) + "
         "deepspeed.initialize with ZeRO-{stage} data parallel over D ranks, each rank a whole sequence; torch AdamW")


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        self.cfg = cfg
        self.stage = int(options["zero_stage"])
        deepspeed = init_distributed()
        require("transformers")
        self.rank, self.world = rank_and_world()
        model = build_hf_model(cfg)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(cfg, zero_stage=self.stage))

    def workload(self, seq: int) -> Workload:
        # every rank its own sample (data parallel): the seed differs per rank
        ids, labels, positions = global_batch(dataclasses.replace(self.cfg, seed=self.cfg.seed + self.rank), seq)
        n_valid = valid_tokens(labels)
        engine = self.engine

        def step():
            logits = engine(input_ids=ids, position_ids=positions).logits  # [B, S, V]: the whole sequence
            loss = token_loss_sum(logits, labels) / n_valid
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return Workload(step=step, tokens_per_step=self.world * self.cfg.batch * seq, modules=[engine.module],
                        optimizers=torch_optimizers(engine), framework_state=[engine.optimizer])


def build(cfg: BenchConfig, options: dict) -> Session:
    if cfg.vision is not None:  # a vision-language model (ds_tsp.tools.bench.vision)
        from ds_tsp.tools.bench.vision import HFSession

        return HFSession(cfg, options, "zero3")
    return Session(cfg, options)
