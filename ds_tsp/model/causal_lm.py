"""The TSP causal LM (Llama / Mistral / Qwen2 shapes): every rank holds 1/D of every weight and 1/D of the tokens.

Parameters per rank (D = TSP degree, p = TSP rank; names keep HF's module path so conversions read top-down):
| parameter                                   | shape                        | sharding                     |
|---------------------------------------------|------------------------------|------------------------------|
| model.embed_tokens.vocab_shard              | [ceil(V/D), h]               | vocab rows of rank p         |
| model.layers.i.self_attn.packed_shard       | [attention layout numel]     | head block p (q, k, v, o)    |
| model.layers.i.mlp.packed_shard             | [3 * h * F/D]                | intermediate columns of p    |
| model.layers.i.mlp.experts_shard (MoE)      | [E/D * 3 * F_moe * h]        | experts of p, whole          |
| model.layers.i.mlp.gate.weight (MoE router) | [E, h]                       | replicated, grads summed     |
| model.layers.i.*_layernorm.weight, norm     | [h]                          | replicated, grads summed     |
| lm_head.vocab_shard (absent when tied)      | [ceil(V/D), h]               | vocab rows of rank p         |
Inputs are this rank's zigzag shard (ds_tsp.shard_batch): input_ids, shift_labels and the GLOBAL
position_ids (restarting per packed document), optionally attention_mask, each [B, S_pad/D]. forward returns this
rank's share of the mean loss (the shares sum to it); ds_tsp.hf.TSPForCausalLM is the HF-shaped face of it.
A mixture-of-experts model (Qwen3-MoE, Mixtral) whose config sets output_router_logits adds, as transformers does,
router_aux_loss_coef x this rank's share of the load-balancing loss over the whole batch (moe_aux_loss_share; with
a cp axis over the whole sequence, cp x TSP).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_tsp.core.activation_offload import ActivationOffload
from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.grads.replicated import ReplicatedGradBucket
from ds_tsp.core.layers.norm import TSPRMSNorm
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.documents import DocumentLayout
from ds_tsp.core.tokens.input_check import check_inputs, input_check_payload
from ds_tsp.core.tokens.positions import RopeTables, StepRope, StepRopes
from ds_tsp.core.tokens.zigzag import cp_zigzag_positions, zigzag_chunks, zigzag_positions
from ds_tsp.model.loss import count_valid_tokens, global_loss, loss_for_logging, normalise_over_data, tsp_group_loss
from ds_tsp.model.modules.attention import log_cp_choices
from ds_tsp.model.modules.decoder import TSPDecoderLayer
from ds_tsp.model.modules.per_layer_input import PerLayerInputs
from ds_tsp.model.modules.vocab import TSPLMHeadLoss, TSPVocabEmbedding
from ds_tsp.model.state_dict import ShardedStateDict

__all__ = ["ShardedCausalLM", "count_valid_tokens", "normalise_over_data"]


def _checkpointed_layer(layer: nn.Module, h, cos, sin, q_scale, doc_starts, per_layer_input=None):
    """A decoder layer under activation checkpointing: the step's RoPE tables go to checkpoint as its own tensor
    arguments (kept once for the recompute, and seen as such by saved-tensor hooks), not inside a tuple."""
    return layer(h, RopeTables(cos, sin, q_scale), doc_starts, with_router=True, per_layer_input=per_layer_input)


class _Backbone(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, options: TSPOptions, dtype, device):
        super().__init__()
        self.embed_tokens = TSPVocabEmbedding(shape.vocab_size, shape.hidden_size, comm, dtype, device,
                                              padding_idx=shape.pad_token_id, scale=shape.embedding_scale)
        self.layers = nn.ModuleList(TSPDecoderLayer(shape, comm, options, dtype, device, layer=i)
                                    for i in range(shape.num_layers))
        log_cp_choices(self.layers, dtype)  # tsp.cp_comm: which schedule each attention layer runs, and why
        self.norm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device, shape.zero_centred_norms)
        # Gemma 4: every layer's per-layer input, from the token ids and the embeddings
        self.per_layer_inputs = PerLayerInputs(shape, comm, dtype, device) if shape.per_layer_input_size else None


class ShardedCausalLM(ShardedStateDict, nn.Module):
    """The TSP causal LM on raw shards: this rank's zigzag shard of the batch in (ds_tsp.shard_batch or a
    TSPDataLoader batch), this rank's share of the mean loss out; every rank holds 1/D of every weight. The
    parameter table, inputs and loss convention are in this module's docstring; ds_tsp.hf.TSPForCausalLM is its HF
    face."""

    def __init__(self, shape: ModelShape, comm: TSPComm, *, options: TSPOptions = TSPOptions(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 data_group: dist.ProcessGroup | None = None, lm_head: bool = True):
        """lm_head=False: the backbone alone (a sequence classifier's, which puts its own head on final_hidden)."""
        super().__init__()
        shape.check_tsp_degree(comm.size)
        if shape.kv_shared_layers and options.activation_checkpointing:
            raise TSPConfigError(f"kv_shared_layers={shape.kv_shared_layers} with activation_checkpointing: the K/V "
                                 "a layer exports to the KV-sharing layers would leave its checkpointed region; turn "
                                 "activation checkpointing off for Gemma 4 E2B / E4B")
        self.shape, self.comm, self.options = shape, comm, options
        self._step_ropes = StepRopes(shape, comm)
        self.model = _Backbone(shape, comm, options, dtype, device)
        self.lm_head = TSPLMHeadLoss(shape, comm, dtype, device,
                                     tied_to=self.model.embed_tokens if shape.tie_word_embeddings else None,
                                     chunk_tokens=options.lm_head_chunk_tokens) if lm_head else None
        self.set_data_parallel_group(data_group)
        self.lora_adapter_config: str | None = None  # adapter_config.json of an attached PEFT LoRA adapter
        self.activation_offload = ActivationOffload()  # host pool of the checkpointed layer inputs (when offloaded)

    def set_data_parallel_group(self, data_group: dist.ProcessGroup | None) -> None:
        """Normalise the loss over the tokens of the whole data x TSP batch.

        Data-parallel engines (DeepSpeed, DDP, FSDP) AVERAGE grads over the data group, so each replica's loss is
        scaled by data_size / (valid tokens of all replicas): the average then equals the gradient of the
        token-weighted mean over the global batch, even when replicas hold different numbers of labelled tokens.
        """
        self.data_group = data_group
        self.data_size = dist.get_world_size(data_group) if data_group is not None else 1

    # --- forward ---------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, shift_labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                tsp_shard: tuple[int, int] | None = None, seq_len: int | None = None, **kwargs) -> torch.Tensor:
        """This rank's share of the mean loss (the shares of the TSP group sum to it).

        All inputs are this rank's zigzag shard [B, L]. attention_mask (1 = real token) marks left/right padding:
        padded tokens are neither keys nor queries with a target. position_ids restarting (not continuing by +1)
        start a new packed document; attention stays inside documents. A TSPDataLoader batch can be passed whole
        (model(**batch)): its tsp_shard is checked against this group, seq_len is not needed.
        """
        if kwargs:
            raise TSPConfigError(
                f"ShardedCausalLM.forward got {', '.join(k + '=' for k in kwargs)}: it takes this rank's zigzag shard "
                "(input_ids, shift_labels, position_ids, attention_mask; a TSPDataLoader batch as model(**batch)). "
                "For full batches with HF labels= use ds_tsp.hf.TSPForCausalLM")
        if shift_labels is None:
            raise TSPConfigError("shift_labels is required: ShardedCausalLM.forward(input_ids, shift_labels, "
                                 "position_ids) takes this rank's shard (ds_tsp.shard_batch or a "
                                 "TSPDataLoader batch)")
        if tsp_shard is not None and tuple(tsp_shard) != (self.comm.rank, self.comm.size):
            raise TSPConfigError(f"tsp_shard={tuple(tsp_shard)}: the batch was sharded for TSP rank {tsp_shard[0]} of "
                                 f"{tsp_shard[1]} but this model is rank {self.comm.rank} of {self.comm.size}; build "
                                 "the loader on the same TSP group")
        router_logits = [] if self.shape.num_experts and self.shape.output_router_logits else None
        h, n_valid = self.final_hidden(input_ids, position_ids, attention_mask, shift_labels, router_logits)
        share = self.head_loss(h, shift_labels, n_valid, attention_mask)
        if router_logits:
            share = share + self.shape.router_aux_loss_coef * self.aux_in_mean_loss(self.aux_loss_share(
                router_logits, tuple(input_ids.shape), attention_mask, seq_len))
        return share

    def aux_loss_share(self, router_logits: list[torch.Tensor], local_shape: tuple[int, int],
                       attention_mask: torch.Tensor | None, seq_len: int | None) -> torch.Tensor:
        """This rank's share of transformers' load-balancing loss over the whole batch (the shares of the sequence's
        ranks, TSP group x cp groups, sum to it; one all-reduce per axis). Tokens counted as transformers counts
        them: attention_mask's real tokens, or every token of the unpadded sequence (the zigzag padding past
        seq_len, which transformers never sees, left out; seq_len None: no padding). local_shape: this rank's
        [B, L]."""
        from ds_tsp.core.layers.moe.layer import moe_aux_loss_share

        mask, (B, L) = attention_mask, local_shape
        cp = self.comm.cp
        padded = L * self.comm.size * self.comm.cp_size
        if mask is None and seq_len is not None and seq_len < padded:
            device = router_logits[0].device
            real = (zigzag_positions(padded, self.comm.size, self.comm.rank, device) if cp is None else
                    cp_zigzag_positions(padded, self.comm.size, self.comm.rank, cp.size, cp.rank, device))
            mask = (real < seq_len).expand(B, L)
        return moe_aux_loss_share(router_logits, self.shape.num_experts, self.shape.num_experts_per_tok, self.comm,
                                  None if mask is None else mask.reshape(-1))

    def aux_in_mean_loss(self, aux_share: torch.Tensor) -> torch.Tensor:
        """aux_loss_share as a share of the mean loss (head_loss's convention: shares summed over the TSP group,
        averaged over data x cp). The data-parallel engine averages gradients over the cp groups, whose aux shares
        together already make the sequence's loss, so each is counted cp_size times (x 1 without a cp axis)."""
        return aux_share * self.comm.cp_size

    def head_loss(self, h: torch.Tensor, shift_labels: torch.Tensor, n_valid: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """LM head + streaming cross-entropy on final hidden states: this rank's share of the mean loss."""
        if attention_mask is not None:
            shift_labels = shift_labels.masked_fill(attention_mask == 0, -100)
        return self.lm_head(h, shift_labels, n_valid)

    def last_logits(self, h: torch.Tensor, seq_len: int, keep: int) -> torch.Tensor:
        """Full-vocab logits [B, keep, V] of global positions seq_len-keep .. seq_len-1, on every rank (collective).

        h is final_hidden's output. Only those rows of logits are built (HF's logits_to_keep).
        """
        L = h.shape[1]
        if self.comm.cp is not None:
            raise TSPConfigError(f"logits with tsp.cp_size={self.comm.cp.size}: the sequence's last tokens are spread "
                                 "over cp groups; compute logits (generation, evaluation) with cp_size 1")
        if not 1 <= keep <= seq_len <= L * self.comm.size:
            raise TSPConfigError(f"logits_to_keep={keep}: must be between 1 and the sequence length {seq_len}")
        # Which local rows hold the kept positions is known on the host (zigzag chunks are contiguous ranges): a
        # device mask and nonzero() would cost a host read per call.
        first, c = seq_len - keep, L // 2
        local_index, slots = [], []
        for i, g in enumerate(zigzag_chunks(self.comm.size, self.comm.rank)):
            lo, hi = max(first, g * c), min(seq_len, (g + 1) * c)
            if lo < hi:
                local_index.append(torch.arange(lo - g * c + i * c, hi - g * c + i * c, device=h.device))
                slots.append(torch.arange(lo - first, hi - first, device=h.device))
        if not local_index:
            local_index = slots = [torch.zeros(0, dtype=torch.int64, device=h.device)]
        return self.lm_head(h, select=(torch.cat(local_index), torch.cat(slots), keep))

    def final_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                     attention_mask: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
                     router_logits: list | None = None, *, ropes: StepRope | None = None,
                     embeds: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        """(final-norm hidden states of the local tokens [B, L, h], loss denominator or None without labels).

        router_logits: a list that receives every sparse layer's router logits [B*L, E] (local tokens, in layer
        order), differentiable, also through activation checkpointing. A multimodal model passes its own RoPE
        tables (ropes: mrope's three position rows; position_ids then only mark documents) and `embeds`, which takes
        the local token embeddings [B, L, h] and returns them with the vision rows in place; after_layer(i, h)
        returns layer i's output with what it adds (Qwen3-VL's DeepStack features at the vision rows)."""
        n_valid, doc_starts = self._check_inputs(input_ids, shift_labels, position_ids, attention_mask)
        if n_valid is not None:
            # float32 at least: bf16 would round token counts above 256
            n_valid = normalise_over_data(n_valid, self.data_group, self.comm)
            n_valid = n_valid.to(torch.promote_types(self.dtype, torch.float32))
        ropes = self._step_ropes(position_ids, self.dtype) if ropes is None else ropes
        # One all-reduce for every norm weight's grad, posted by the last one's backward (see replicated_grads);
        # opened before the embedding so that its backward ring overlaps the bucket's all-reduce.
        replicated = [*self.replicated_params().values(), *(p for _, p, cut in self.lora_tensors() if cut is None)]
        with ReplicatedGradBucket(self.comm, replicated):
            h = self.model.embed_tokens(input_ids)
            if embeds is not None:
                h = embeds(h)
            per_layer = None if self.model.per_layer_inputs is None else self.model.per_layer_inputs(input_ids, h)
            shared_kv = {} if self.shape.kv_shared_layers else None  # Gemma 4: K/V the KV-sharing layers read
            last = len(self.model.layers) - 1
            for i, layer in enumerate(self.model.layers):
                rope = ropes.for_layer(self.shape, i)
                mine = None if per_layer is None else per_layer[:, :, i]  # [B, L, P]
                if self.options.activation_checkpointing and torch.is_grad_enabled():
                    # the router logits leave the checkpointed region as an output, so they carry its recompute;
                    # offload_activations: the saved input h waits in host memory (core/activation_offload.py)
                    with (self.activation_offload.saved_input(h, layer=i, last=i == last)
                          if self.options.offload_activations else contextlib.nullcontext()):
                        h, logits = checkpoint(_checkpointed_layer, layer, h, *rope, doc_starts, mine,
                                               use_reentrant=False)
                else:
                    h, logits = layer(h, rope, doc_starts, with_router=True, per_layer_input=mine,
                                      shared_kv=shared_kv)
                if logits is not None and router_logits is not None:
                    router_logits.append(logits)
                if after_layer is not None:
                    h = after_layer(i, h)
            return self.model.norm(h), n_valid

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def input_check_payload(self, input_ids, shift_labels, position_ids, attention_mask) -> torch.Tensor:
        """What this rank sends in the input check's one all-gather (ds_tsp.core.tokens.input_check)."""
        return input_check_payload(input_ids, shift_labels, position_ids, attention_mask, self.shape.vocab_size)

    def _check_inputs(self, input_ids, shift_labels, position_ids, attention_mask) -> tuple[torch.Tensor | None,
                                                                                             DocumentLayout | None]:
        """(labelled tokens of the whole TSP group or None, document starts or None): ds_tsp.core.tokens.input_check
        validates every rank's shard at once, in one all-gather and one host read."""
        return check_inputs(self.comm, self.shape.vocab_size, input_ids, shift_labels, position_ids, attention_mask)

    def global_loss(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The global mean loss as its value, this rank's share as its gradient (ds_tsp.model.loss.global_loss)."""
        return global_loss(loss_share, self.comm, self.data_group)

    def tsp_group_loss(self, loss_share: torch.Tensor) -> torch.Tensor:
        """Value: the shares summed over the TSP group; gradient: this rank's share."""
        return tsp_group_loss(loss_share, self.comm)

    def loss_for_logging(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The global mean loss (TSP shares summed, data replicas averaged), detached, identical on all ranks."""
        return loss_for_logging(loss_share, self.comm, self.data_group)
