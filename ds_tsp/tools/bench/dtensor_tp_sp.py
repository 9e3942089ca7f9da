"""Megatron-style TP + sequence parallel on one axis of D ranks, with PyTorch DTensor (torchtitan's Llama plan).

Per decoder layer: RMSNorms run SequenceParallel on tokens [B, S/D, h]; before attention and the MLP the
sequence is all-gathered (PrepareModuleInput Shard(1) -> Replicate), q/k/v and gate/up are ColwiseParallel
(heads / MLP columns split D ways), o_proj and down_proj are RowwiseParallel and reduce-scatter back to Shard(1).
Embedding: RowwiseParallel (vocab rows) with Shard(1) output; lm_head: ColwiseParallel with vocab-sharded logits
and loss_parallel() cross-entropy (no full logits on any rank). Every rank feeds the full token ids.
Comm bytes: CollectiveBytes over DTensor's functional collectives during the tracked step (logical volume).
"""
from __future__ import annotations

import torch

from ds_tsp.tools.bench.common import build_hf_model, global_batch, rank_and_world, valid_tokens
from ds_tsp.tools.bench.config import BenchConfig
from ds_tsp.tools.bench.measure import Workload

SETUP = ("HF LlamaForCausalLM + torch.distributed.tensor.parallel (ColwiseParallel/RowwiseParallel/"
         "SequenceParallel, loss_parallel); torch.optim.AdamW")


def parallelize(model, mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })


class Session:
    def __init__(self, cfg: BenchConfig, options: dict):
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg = cfg
        _, world = rank_and_world()
        shape = cfg.shape
        if shape.num_heads % world or shape.num_kv_heads % world or shape.intermediate_size % world \
                or shape.vocab_size % world:
            raise ValueError(f"DTensor TP needs heads, kv heads, MLP width and vocab divisible by D={world}")
        self.mesh = init_device_mesh("cpu", (world,))
        self.model = build_hf_model(cfg)
        parallelize(self.model, self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

    def workload(self, seq: int) -> Workload:
        from torch.distributed.tensor.parallel import loss_parallel

        _, world = rank_and_world()
        if seq % world:
            raise ValueError(f"sequence parallel needs S={seq} divisible by D={world}")
        ids, labels, positions = global_batch(self.cfg, seq)
        n_valid = valid_tokens(labels)

        def step():
            hidden = self.model.model(input_ids=ids, position_ids=positions).last_hidden_state
            logits = self.model.lm_head(hidden)  # DTensor [B, S, V] sharded on the vocab
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                         ignore_index=-100, reduction="sum") / n_valid
                loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss.detach().full_tensor()

        return Workload(step=step, tokens_per_step=ids.numel(), modules=[self.model], optimizers=[self.optimizer])


def build(cfg: BenchConfig, options: dict) -> Session:
    return Session(cfg, options)
