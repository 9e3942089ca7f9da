"""DeepSpeed AutoTP training ("tensor_parallel": {"autotp_size": D}) with ZeRO-1, on D ranks.

AutoTP shards the HF model by its base_model_tp_plan: q/k/v and gate/up column-parallel, o_proj and down_proj
row-parallel with an all-reduce of [B, S, h] after each (Megatron TP without sequence parallelism). Every rank
sees the FULL sequence (the TP group must feed identical batches), so activations outside the sharded linears
are not divided. ZeRO-1's data-parallel group is world / D = 1 here: optimizer state is not partitioned further.
Comm bytes: CollectiveBytes during the tracked step.
"""
from __future__ import annotations

from ds_tsp.tools.bench.common import build_hf_model, global_batch, rank_and_world, token_loss_sum, valid_tokens
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.deepspeed_common import ds_config, init_distributed, torch_optimizers
from ds_tsp.tools.bench.measure import Workload

SETUP = ("HF LlamaForCausalLM (SDPA) + deepspeed.initialize with tensor_parallel.autotp_size=D and ZeRO-{stage}; "
         "torch AdamW; full sequence on every rank")


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        self.cfg = cfg
        self.stage = int(options["zero_stage"])
        deepspeed = init_distributed()
        _, self.world = rank_and_world()
        model = build_hf_model(cfg)
        config = ds_config(cfg, zero_stage=self.stage, extra={"tensor_parallel": {"autotp_size": self.world}})
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def workload(self, seq: int) -> Workload:
        ids, labels, positions = global_batch(self.cfg, seq)
        n_valid = valid_tokens(labels)
        engine = self.engine

        def step():
            logits = engine(input_ids=ids, position_ids=positions).logits
            loss = token_loss_sum(logits, labels) / n_valid
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return Workload(step=step, tokens_per_step=ids.numel(), modules=[engine.module],
                        optimizers=torch_optimizers(engine), framework_state=[engine.optimizer])


def build(cfg: BenchConfig, options: dict) -> Session:
    return Session(cfg, options)
