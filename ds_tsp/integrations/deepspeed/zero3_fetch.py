"""What DeepSpeed ZeRO-3 gathers with each module of a TSP model.

ZeRO-3 makes a parameter whole in the forward and backward pre-hooks of the module that owns it (or that it was
registered with, register_external_parameter) and partitions it again after (its .data an empty tensor), so a
parameter read anywhere else is whole only by chance. TSP modules read parameters held by children they never call:
the attention's q/k norms (HeadNorm holds a weight and has no forward), the MoE router and shared-expert gates, the
Gated DeltaNet's output norm, and a tied LM head the embedding's vocab shard. DeepSpeed's own discovery of such reads
(its parameter getter) works only while DeepSpeedEngine.forward runs: it misses a forward through the unwrapped
model (TRL's no-grad log-prob passes), registers what the TSP model lists at its top level with the top module (whose
backward hooks see only tensors, lists and dicts in its output, not TRL's fused-head output), and nothing runs it in
backward, where activation checkpointing recomputes a layer and the layers' autograd Functions read their saved
parameters. So each decoder layer is ZeRO-3's unit here: every parameter of its subtree is registered with it, whole
from the layer's forward pre-hook (its checkpointed recompute included) and from its backward pre-hook until its
post-hooks; the layer's own children keep their hooks. A layer's parameters are 1/D of the layer on each TSP rank,
so the unit gathered over the data axis is 1/D of one layer. The sequence classifier's forward scores the pooled
token with its core's score head (a parameter of the core, whose own forward it never calls): the head is
registered with the classifier, whose hooks see its logits, so it is whole there also through the unwrapped model.
"""
from __future__ import annotations

from torch import nn


def register_zero3_fetches(model: nn.Module, deepspeed) -> int:
    """Register, for ZeRO-3, every parameter a TSP decoder layer reads with that layer, a tied LM head's weight
    (the embedding's vocab shard) with the head, and a sequence classifier's score head with the classifier; call
    before deepspeed.initialize. Returns how many were registered (the same parameter registered twice with a module
    counts once in DeepSpeed)."""
    from ds_tsp.model.hf_sequence_classification import TSPForSequenceClassification
    from ds_tsp.model.modules.decoder import TSPDecoderLayer
    from ds_tsp.model.modules.vocab import TSPLMHeadLoss

    registered = 0
    for module in model.modules():
        if isinstance(module, TSPDecoderLayer):
            own = {id(p) for p in module.parameters(recurse=False)}
            for param in module.parameters():
                if id(param) not in own:
                    deepspeed.zero.register_external_parameter(module, param)
                    registered += 1
        elif isinstance(module, TSPForSequenceClassification):
            deepspeed.zero.register_external_parameter(module, module.tsp.score)
            registered += 1
        elif isinstance(module, TSPLMHeadLoss) and module.tied:
            deepspeed.zero.register_external_parameter(module, module.weight)
            registered += 1
    return registered
