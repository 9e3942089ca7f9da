"""DeepSpeed Ulysses (ALST's UlyssesSPAttentionHF) on D ranks, with ZeRO-3 or ZeRO-1 over the same D ranks.

Each rank holds a contiguous 1/D of the tokens; inside attention an all-to-all trades sequence for heads (full
sequence, H/D heads), and another trades back. Weights: ZeRO-1 replicates them (optimizer state 1/D);
ZeRO-3 partitions params, grads and optimizer state 1/D and all-gathers each layer's weights when used (twice:
forward and backward) and reduce-scatters grads. Loss: HF logits of the local tokens, token-summed
cross-entropy scaled so that DeepSpeed's average over the D ranks is the global mean-loss gradient.
Comm bytes: CollectiveBytes during the tracked step (eager c10d ops of DeepSpeed and the Ulysses all-to-alls).
"""
from __future__ import annotations

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

SETUP = ("HF LlamaForCausalLM (SDPA) + deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF."
         "register_with_transformers; deepspeed.initialize(mpu=...) with ZeRO-{stage}, torch AdamW")


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        self.cfg = cfg
        self.stage = int(options["zero_stage"])
        deepspeed = init_distributed()
        require("transformers")
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        self.rank, self.world = rank_and_world()
        model = build_hf_model(cfg)
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=self.world,
            micro_batch_size=cfg.batch, seq_length_is_variable=True)
        config = ds_config(cfg, zero_stage=self.stage, extra={"sequence_parallel_size": self.world})
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                               mpu=mpu)

    def workload(self, seq: int) -> Workload:
        if seq % self.world:
            raise ValueError(f"Ulysses needs S={seq} divisible by D={self.world}")
        ids, labels, positions = global_batch(self.cfg, seq)
        n_valid = valid_tokens(labels)
        chunk = seq // self.world
        part = slice(self.rank * chunk, (self.rank + 1) * chunk)
        ids, labels, positions = ids[:, part], labels[:, part], positions[:, part]
        engine, world = self.engine, self.world

        def step():
            logits = engine(input_ids=ids, position_ids=positions).logits  # [B, S/D, V] local tokens
            loss = token_loss_sum(logits, labels) * (world / n_valid)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return Workload(step=step, tokens_per_step=self.cfg.batch * seq, modules=[engine.module],
                        optimizers=torch_optimizers(engine), framework_state=[engine.optimizer])


def build(cfg: BenchConfig, options: dict) -> Session:
    session = Session(cfg, options)
    return session
