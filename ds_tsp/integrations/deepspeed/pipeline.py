"""Pipeline stages of TSP blocks on the outer axis: a DeepSpeed PipelineModule built from LayerSpecs.

Each stage builds only its own layers. Activations between stages are (hidden [B, L, h], position_ids [B, L],
shift_labels [B, L]) for this rank's zigzag shard: the integer tensors ride along so every stage has the global
positions for RoPE and the last one the targets. DeepSpeed's PipeModelDataParallelTopology orders ranks
(pipe, data, model) with model innermost, which is exactly ds_tsp's (pipe, data, tsp), so its model-parallel
slice of each stage is the TSP group.

With a cp axis (pipe, data, cp, tsp) DeepSpeed's data axis is data x cp: the rank order is the same, so its data
groups are ds_tsp's data groups (data x cp), over which it averages gradients and the reported loss. The stages'
TSP layers get the cp ring through `comm` (TSPComm.cp), the loader cuts each micro-batch into the cp group's zigzag
chunks (shard_batch with cp), position_ids carry the global positions, and the loss denominator counts labelled
tokens over data x cp (count_valid_tokens over groups.data_group), so averaging over data x cp is exact. Every layer
kind takes the cp axis as on one stage (attention, sliding windows, Gated DeltaNet, experts without the aux loss).

Mixture-of-experts layers run as on one stage, but the stage-to-stage activations carry no router logits, so the
load-balancing loss (output_router_logits) cannot reach the last stage: refused (check_pipeline_moe) rather than
trained without it. An in-memory MoE model's state dict (fused experts) is read under its checkpoint names.

Frozen parameters of an in-memory HF model (requires_grad=False) are carried to the stage that holds them
(ds_tsp.model.trainability), so they get no gradient and no optimizer state. A stage whose parameters are all
frozen (e.g. a frozen embedding and first layers) is one error on every rank: DeepSpeed builds an optimizer per
stage and cannot build one over nothing (and would call .backward() on an output without a graph). A PEFT (LoRA)
model is refused by name (check_pipeline_source): the stages are built from base weights and carry no adapter.
"""
from __future__ import annotations

import torch
from torch import nn

from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict
from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.norm import TSPRMSNorm
from ds_tsp.core.parallel.topology import ProcessGroups
from ds_tsp.core.reliability.watchdog import guarded
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.positions import StepPositions
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.model.loss import count_valid_tokens
from ds_tsp.model.modules.decoder import TSPDecoderLayer
from ds_tsp.model.modules.vocab import TSPLMHeadLoss, TSPVocabEmbedding
from ds_tsp.model.state_dict import load_slices, read_from_full
from ds_tsp.model.trainability import base_parameters, carry_requires_grad


class EmbeddingPipe(TSPVocabEmbedding):
    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device):
        super().__init__(shape.vocab_size, shape.hidden_size, comm, dtype, device, padding_idx=shape.pad_token_id,
                         scale=shape.embedding_scale)

    def forward(self, inputs):
        input_ids, position_ids, shift_labels = inputs
        return super().forward(input_ids), position_ids, shift_labels

    def tsp_pieces(self):
        return [("model.embed_tokens.", self, self.vocab_shard)], {}

    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        load_slices(*self.tsp_pieces(), read_from_full(full))


class DecoderPipe(TSPDecoderLayer):
    def __init__(self, shape: ModelShape, comm: TSPComm, options: TSPOptions, dtype, device, index: int,
                 positions: StepPositions):
        super().__init__(shape, comm, options, dtype, device, layer=index)
        self.shape, self.index, self.positions, self.comm = shape, index, positions, comm

    def forward(self, inputs):
        h, position_ids, shift_labels = inputs
        # The stage's layers share one StepPositions: one positions gather per micro-batch, not one per layer.
        ropes, doc_starts = self.positions(position_ids, h.dtype)
        return super().forward(h, ropes.for_layer(self.shape, self.index), doc_starts), position_ids, shift_labels

    def tsp_pieces(self):
        prefix = f"model.layers.{self.index}."
        return self.sharded_modules(prefix), self.replicated_params(prefix)

    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        pieces, replicated = self.tsp_pieces()  # and the buffers the checkpoint carries (GLM-4.5's router bias)
        load_slices(pieces, {**replicated, **self.replicated_buffers(f"model.layers.{self.index}.")},
                    read_from_full(full))


class NormHeadLossPipe(nn.Module):
    """Final norm + LM head + loss share; returns a scalar (the pipeline's loss_fn passes it through)."""

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device, data_group, chunk_tokens: int = 4096):
        super().__init__()
        self.comm, self.data_group = comm, data_group
        self.norm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device, shape.zero_centred_norms)
        self.lm_head = TSPLMHeadLoss(shape, comm, dtype, device, chunk_tokens=chunk_tokens)

    def forward(self, inputs):
        h, _, shift_labels = inputs
        n_valid = count_valid_tokens(shift_labels, self.comm, self.data_group).to(
            torch.promote_types(h.dtype, torch.float32))
        return self.lm_head(self.norm(h), shift_labels, n_valid)

    def tsp_pieces(self):
        return [("lm_head.", self.lm_head, self.lm_head.vocab_shard)], {"model.norm.weight": self.norm.weight}

    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        load_slices(*self.tsp_pieces(), read_from_full(full))


def unpartitioned_pipeline_config(pipeline: dict | None) -> dict:
    """DeepSpeed's pipeline partitions stage-to-stage activations over the model-parallel group, assuming (as in
    Megatron TP) that every model-parallel rank holds the same activation. TSP ranks hold different tokens, so
    each must send its own whole shard."""
    pipeline = dict(pipeline or {})
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipeline.get(key):
            raise TSPConfigError(f"pipeline.{key}=true with TSP: stage activations differ across TSP ranks and "
                                 f"cannot be partitioned over them; remove pipeline.{key}")
        pipeline[key] = False
    return pipeline


def check_pipeline_moe(shape: ModelShape) -> None:
    """An MoE model whose loss adds the router aux loss cannot be split into stages (the logits stay behind)."""
    if shape.num_experts and shape.output_router_logits:
        raise TSPConfigError(
            f"output_router_logits=True on a mixture-of-experts model ({shape.moe_family}, num_experts="
            f"{shape.num_experts}) with tsp.pipeline_stages > 1: the pipeline passes only hidden states between "
            "stages, so the router logits, and with them the load-balancing aux loss (router_aux_loss_coef), would be "
            "silently dropped; set tsp.pipeline_stages to 1, or set output_router_logits=False in the model config "
            "to train without the aux loss")


def check_pipeline_source(model) -> None:
    """A PEFT (LoRA) model cannot be split into stages: refused by name before any process group is built."""
    if hasattr(model, "peft_config"):
        raise TSPConfigError(
            "a PEFT (LoRA) model with tsp.pipeline_stages > 1 is not supported: the pipeline stages are built from "
            "the base weights and carry no LoRA adapter; train LoRA with tsp.pipeline_stages=1 (TSP x data, with "
            "ZeRO or FSDP2 on the data axis for memory), or merge the adapter first (model.merge_and_unload()) to "
            "train the whole model in stages")


def carry_stage_requires_grad(module: nn.Module, source: nn.Module, shape: ModelShape, options: TSPOptions) -> None:
    """requires_grad of the in-memory HF model's parameters onto this stage's TSP parameters (the other stages'
    HF parameters are held there, not orphans)."""
    sharded, replicated = [], {}
    for layer in module.forward_funcs:
        if hasattr(layer, "tsp_pieces"):
            pieces, norms = layer.tsp_pieces()
            sharded += pieces
            replicated.update(norms)
    every = set(ShardedCausalLM(shape, TSPComm.single(), options=options, device="meta").hf_shapes())
    carry_requires_grad(sharded, replicated, base_parameters(source), shape.moe_family, held_elsewhere=every)


def _carry_on_every_stage(module: nn.Module, source: nn.Module, shape: ModelShape, options: TSPOptions,
                          groups: ProcessGroups, comm: TSPComm | None = None) -> None:
    """carry_stage_requires_grad, then one error on every rank alike (collective over the job, once at build
    time) when a stage failed or has nothing to train."""
    import torch.distributed as dist

    error = None
    try:
        carry_stage_requires_grad(module, source, shape, options)
        if not any(p.requires_grad for p in module.parameters()):
            error = (f"pipeline stage {groups.pipe_rank} of {groups.pipe_size} holds only frozen parameters "
                     "(requires_grad=False): DeepSpeed builds one optimizer per stage and cannot build one with "
                     "nothing to train; unfreeze a parameter of its layers, use fewer tsp.pipeline_stages so every "
                     "stage holds a trainable layer, or use tsp.pipeline_stages=1")
    except TSPConfigError as err:
        error = str(err)
    everyone = [None] * dist.get_world_size()
    with guarded(comm, "setup: pipeline stages' trainable-parameter check (all_gather_object)", context="setup"):
        dist.all_gather_object(everyone, error)
    first = next((e for e in everyone if e), None)
    if first is not None:
        raise TSPConfigError(first)


def _loss_passthrough(loss_share, _labels):
    return loss_share


def build_pipeline_module(shape: ModelShape, groups: ProcessGroups, comm: TSPComm, options: TSPOptions, *,
                          dtype=torch.float32, device=None, state_dict=None, seed: int = 0,
                          source: nn.Module | None = None):
    """A PipelineModule [embedding, decoder layers..., norm+head+loss] split over groups.pipe_size stages.
    source: the in-memory HF model the weights come from, whose requires_grad each stage takes."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if shape.tie_word_embeddings:
        raise TSPConfigError("tie_word_embeddings=True with tsp.pipeline_stages > 1 is not supported: the tied "
                             "embedding and LM head live on different stages; untie them or use one stage")
    check_pipeline_moe(shape)
    if shape.per_layer_input_size or shape.layer_scalars or shape.kv_shared_layers:
        raise TSPConfigError("Gemma 4 (per_layer_input_size / layer_scalars / kv_shared_layers) with "
                             "tsp.pipeline_stages > 1 is not supported: every layer reads the token ids' per-layer "
                             "inputs, later ones earlier layers' K/V; use one stage")
    if shape.num_layers < groups.pipe_size:
        raise TSPConfigError(f"tsp.pipeline_stages={groups.pipe_size} exceeds num_layers={shape.num_layers}")
    specs = [LayerSpec(EmbeddingPipe, shape, comm, dtype, device)]
    positions = StepPositions(shape, comm)  # each stage builds only its own layers, so a stage shares one
    specs += [LayerSpec(DecoderPipe, shape, comm, options, dtype, device, i, positions)
              for i in range(shape.num_layers)]
    specs.append(LayerSpec(NormHeadLossPipe, shape, comm, dtype, device, groups.data_group,
                           options.lm_head_chunk_tokens))
    # DeepSpeed's data axis is ds_tsp's data x cp (data-major, cp next to tsp: the same rank order), so the engine
    # reduces gradients, the loss it reports and the clip norm's data part over both
    topology = PipeModelDataParallelTopology(num_pp=groups.pipe_size, num_mp=groups.tsp_size,
                                             num_dp=groups.data_size * groups.cp_size)
    # checkpointing: the decoder layers only (as ShardedCausalLM); DeepSpeed's default, every module with parameters,
    # would run its reentrant checkpoint over the embedding, whose integer inputs need no grad: its output would
    # have no grad_fn and the first stage's backward would fail
    module = PipelineModule(layers=specs, topology=topology, loss_fn=_loss_passthrough,
                            partition_method="type:DecoderPipe", checkpointable_layers=["DecoderPipe"],
                            activation_checkpoint_interval=1 if options.activation_checkpointing else 0)
    if state_dict is None:
        raise TSPConfigError("pipeline stages need the initial weights: pass state_dict= (HF-named full weights)")
    state_dict = canonical_state_dict(state_dict, shape.moe_family)  # an in-memory MoE model's fused experts
    for layer in module.forward_funcs:
        if hasattr(layer, "load_full"):
            layer.load_full(state_dict)
    if source is not None:
        check_pipeline_source(source)
        _carry_on_every_stage(module, source, shape, options, groups, comm)
    return module
