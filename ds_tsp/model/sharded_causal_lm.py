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
import zlib
from math import prod

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_tsp.checkpoint.moe_names import canonical_state_dict
from ds_tsp.core.activation_offload import ActivationOffload
from ds_tsp.core.comm import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.cp_inputs import full_fields, held_chunks, over_cp
from ds_tsp.core.document_attention import DocumentLayout, document_layout
from ds_tsp.core.documents import OVERFLOW, decode_layout, document_starts, shard_layout
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.functions.norm import TSPRMSNorm
from ds_tsp.core.partition import cp_zigzag_positions, unshard, zigzag_chunks, zigzag_positions
from ds_tsp.core.replicated_grads import ReplicatedGradBucket
from ds_tsp.core.rope import rope_cos_sin
from ds_tsp.core.shape import ModelShape
from ds_tsp.model.sharded_modules import (  # noqa: F401
    HeadNorm,
    TSPAttention,
    TSPDecoderLayer,
    TSPGatedMLP,
    TSPLMHeadLoss,
    TSPVocabEmbedding,
    TSPVocabShard,
    load_slices,
    mark_sharded,
    read_from_full,
)

_CHECK_COUNTS = 7  # the counts heading input_check_payload (ds_tsp.tools.plan.tsp_comm repeats the number)


def normalise_over_data(n_valid_tsp: torch.Tensor, data_group: dist.ProcessGroup | None,
                        comm: TSPComm) -> torch.Tensor:
    """Loss denominator: labelled tokens of the whole data x TSP batch / data size (see set_data_parallel_group).
    The all-reduce is guarded by `comm`'s watchdog: a stalled data replica is reported, not waited for forever."""
    if data_group is None or dist.get_world_size(data_group) == 1:
        return n_valid_tsp
    total = n_valid_tsp.clone()
    with comm.guard("token count all_reduce over data", group=data_group):
        dist.all_reduce(total, group=data_group)
    # float64: an int64 count / 3 (data x cp of 3) would divide in float32, 2e-8 off in a float64 loss
    return total.to(torch.float64) / dist.get_world_size(data_group)


def count_valid_tokens(shift_labels: torch.Tensor, comm: TSPComm, data_group=None) -> torch.Tensor:
    """normalise_over_data of the labelled tokens of this TSP group (for stages that see only the labels)."""
    n_valid = (shift_labels != -100).sum().to(torch.int64)
    comm.all_reduce(n_valid).wait()
    return normalise_over_data(n_valid, data_group, comm)


class _Backbone(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, options: TSPOptions, dtype, device):
        super().__init__()
        self.embed_tokens = TSPVocabEmbedding(shape.vocab_size, shape.hidden_size, comm, dtype, device)
        self.layers = nn.ModuleList(TSPDecoderLayer(shape, comm, options, dtype, device, layer=i)
                                    for i in range(shape.num_layers))
        self.norm = TSPRMSNorm(shape.hidden_size, shape.rms_norm_eps, comm, dtype, device, shape.zero_centred_norms)


class ShardedCausalLM(nn.Module):
    def __init__(self, shape: ModelShape, comm: TSPComm, *, options: TSPOptions = TSPOptions(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 data_group: dist.ProcessGroup | None = None):
        super().__init__()
        shape.check_tsp_degree(comm.size)
        self.shape, self.comm, self.options = shape, comm, options
        self.model = _Backbone(shape, comm, options, dtype, device)
        self.lm_head = TSPLMHeadLoss(shape, comm, dtype, device,
                                     tied_to=self.model.embed_tokens if shape.tie_word_embeddings else None,
                                     chunk_tokens=options.lm_head_chunk_tokens)
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
        from ds_tsp.core.functions.moe import moe_aux_loss_share

        mask, (B, L) = attention_mask, local_shape
        cp = self.comm.cp
        padded = L * self.comm.size * (cp.size if cp is not None else 1)
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
        return aux_share if self.comm.cp is None else aux_share * self.comm.cp.size

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
                     router_logits: list | None = None):
        """(final-norm hidden states of the local tokens [B, L, h], loss denominator or None without labels).

        router_logits: a list that receives every sparse layer's router logits [B*L, E] (local tokens, in layer
        order), differentiable, also through activation checkpointing."""
        n_valid, doc_starts = self._check_inputs(input_ids, shift_labels, position_ids, attention_mask)
        if n_valid is not None:
            # float32 at least: bf16 would round token counts above 256
            n_valid = normalise_over_data(n_valid, self.data_group, self.comm)
            n_valid = n_valid.to(torch.promote_types(self.dtype, torch.float32))
        cos, sin = rope_cos_sin(position_ids, self.shape.rotary_dim, self.shape.rope_theta, self.dtype,
                                self.shape.rope_scaling)
        # One all-reduce for every norm weight's grad, posted by the last one's backward (see replicated_grads);
        # opened before the embedding so that its backward ring overlaps the bucket's all-reduce.
        replicated = [*self.replicated_params().values(), *(p for _, p, cut in self.lora_tensors() if cut is None)]
        with ReplicatedGradBucket(self.comm, replicated):
            h = self.model.embed_tokens(input_ids)
            last = len(self.model.layers) - 1
            for i, layer in enumerate(self.model.layers):
                if self.options.activation_checkpointing and torch.is_grad_enabled():
                    # the router logits leave the checkpointed region as an output, so they carry its recompute;
                    # offload_activations: the saved input h waits in host memory (core/activation_offload.py)
                    with (self.activation_offload.saved_input(h, layer=i, last=i == last)
                          if self.options.offload_activations else contextlib.nullcontext()):
                        h, logits = checkpoint(layer, h, cos, sin, doc_starts, with_router=True, use_reentrant=False)
                else:
                    h, logits = layer(h, cos, sin, doc_starts, with_router=True)
                if logits is not None and router_logits is not None:
                    router_logits.append(logits)
            return self.model.norm(h), n_valid

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def input_check_payload(self, input_ids, shift_labels, position_ids, attention_mask) -> torch.Tensor:
        """What this rank sends in the input check's one all-gather: int64 [_CHECK_COUNTS + LAYOUT_SLOTS], a size
        that never depends on the inputs (labelled tokens, bad ids, batch, length, mask given, document breaks,
        bad mask values, then the shard's document layout). No host read."""
        B, local_len = input_ids.shape
        dev = input_ids.device

        def fill(value: int) -> torch.Tensor:  # a fill kernel; torch.tensor(value, device=) copies from the host
            return torch.full((), value, dtype=torch.int64, device=dev)

        n_bad = ((input_ids < 0) | (input_ids >= self.shape.vocab_size)).sum()
        n_valid = (shift_labels != -100).sum() if shift_labels is not None else fill(0)
        n_bad_mask = (((attention_mask != 0) & (attention_mask != 1)).sum() if attention_mask is not None
                      else fill(0))
        n_breaks, layout = shard_layout(position_ids, attention_mask)
        head = torch.stack([n_valid, n_bad, fill(B), fill(local_len), fill(int(attention_mask is not None)), n_breaks,
                            n_bad_mask])
        return torch.cat((head, layout))

    def _check_inputs(self, input_ids, shift_labels, position_ids, attention_mask) -> tuple[torch.Tensor | None,
                                                                                             DocumentLayout | None]:
        """Validate on every rank at once (ONE all-gather of a fixed-size payload, ONE host read) so a bad shard
        fails every rank and none hangs; the same gather tells every rank where packed documents start.

        The payload's size never depends on the inputs (ds_tsp.core.documents.shard_layout), so ranks with
        different shapes meet in the same gather and need no size agreement first. Only a rank with more document
        breaks than documents.LAYOUT_SLOTS costs a second gather and read (of the positions themselves). On the
        meta device nothing is read: the checks are skipped and every row is one document.

        Returns (labelled tokens of the whole TSP group or None without labels, document starts or None). The
        starts are validated here, once per step, into a DocumentLayout every layer's kernels take as it is.
        """
        if position_ids is None:
            raise TSPConfigError(
                "position_ids is missing: TSP ranks hold non-contiguous zigzag chunks, so RoPE needs the GLOBAL "
                "position of every local token; build the batch with ds_tsp.shard_batch")
        if input_ids.dim() != 2:
            raise TSPConfigError(f"input_ids must be [batch, local_seq], got shape {tuple(input_ids.shape)}")
        for name, t in (("shift_labels", shift_labels), ("position_ids", position_ids),
                        ("attention_mask", attention_mask)):
            if t is not None and t.shape != input_ids.shape:
                raise TSPConfigError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}: "
                                     "pass the same zigzag shard of every field")
        B, local_len = input_ids.shape
        dev = input_ids.device
        local = self.input_check_payload(input_ids, shift_labels, position_ids, attention_mask)
        if self.comm.size > 1:
            everyone = torch.empty(self.comm.size, local.numel(), dtype=torch.int64, device=dev)
            self.comm.all_gather(everyone, local).wait()
        else:
            everyone = local[None]
        total = everyone[:, 0].sum() if shift_labels is not None else None
        if self.comm.cp is not None:  # the whole sequence's payloads (ds_tsp.core.cp_inputs); total stays the group's
            everyone = over_cp(self.comm, everyone)
        if dev.type == "meta":
            return total, None
        rows = everyone.tolist()  # the one device-to-host read: everything below works on host ints
        shapes = [row[2:5] for row in rows]
        if any(s != shapes[0] for s in shapes):
            raise TSPConfigError(
                f"local shapes [batch, seq] differ across TSP ranks, or attention_mask is given on some ranks "
                f"only ([batch, seq, has mask] per rank: {shapes}): every rank must hold its zigzag shard (two equal "
                "chunks) of the same batch: use ds_tsp.shard_batch")
        n_bad_total = sum(row[1] for row in rows)
        if n_bad_total > 0:
            raise TSPConfigError(
                f"input_ids: {n_bad_total} token id(s) are outside [0, vocab_size={self.shape.vocab_size}):"
                " check the tokenizer matches the model's vocab_size")
        if any(row[6] for row in rows):
            raise TSPConfigError("attention_mask must hold only 0 (padding) and 1 (real token)")
        if local_len % 2 or local_len == 0:
            raise TSPConfigError(
                f"local shapes [batch, seq] differ across TSP ranks or are odd: {[s[:2] for s in shapes]}; every "
                "rank must hold its zigzag shard (two equal chunks) of the same batch: use ds_tsp.shard_batch")
        if shift_labels is not None and sum(row[0] for row in rows) == 0:
            raise TSPConfigError("shift_labels: no token has a target (all -100) in the whole TSP group; "
                                 "a batch needs at least one labelled token")
        doc_starts = decode_layout([row[_CHECK_COUNTS:] for row in rows], [row[5] for row in rows], B, local_len,
                                   held_chunks=held_chunks(self.comm) if self.comm.cp is not None else None)
        if doc_starts is OVERFLOW:  # more document breaks than slots on some rank: gather the positions themselves
            fields = [position_ids] + ([attention_mask] if attention_mask is not None else [])
            data = torch.stack([f.to(device=dev, dtype=torch.int64) for f in fields])  # [fields, B, L]
            if self.comm.size > 1:
                gathered = torch.empty((self.comm.size, *data.shape), dtype=torch.int64, device=dev)
                self.comm.all_gather(gathered, data).wait()
            else:
                gathered = data[None]
            full = (unshard(list(gathered.unbind(0)), dim=2) if self.comm.cp is None
                    else full_fields(self.comm, gathered))  # [fields, B, S]
            doc_starts = document_starts(full[0], full[1] if attention_mask is not None else None)
        return total, (None if doc_starts is None else document_layout(doc_starts, B))

    def global_loss(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The global mean loss as its value, this rank's share as its gradient (so backward stays exact).

        What an HF causal LM returns as `loss`: every rank prints what a single device would, and calling
        backward on it on every rank gives each rank exactly its own share of the gradients.
        """
        return loss_share + (self.loss_for_logging(loss_share) - loss_share).detach()

    def tsp_group_loss(self, loss_share: torch.Tensor) -> torch.Tensor:
        """Value: the shares summed over the TSP group (this data replica's part); gradient: this rank's share."""
        total = loss_share.detach().clone()
        if self.comm.size > 1:
            with self.comm.guard("loss all_reduce", context=self.comm.context or "loss for logging"):
                dist.all_reduce(total, group=self.comm.group)
        return loss_share + (total - loss_share).detach()

    def loss_for_logging(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The global mean loss (TSP shares summed, data replicas averaged), detached, identical on all ranks."""
        total = loss_share.detach().clone()
        context = self.comm.context or "loss for logging"
        if self.comm.size > 1:
            with self.comm.guard("loss all_reduce", context=context):
                dist.all_reduce(total, group=self.comm.group)
        if self.data_group is not None and self.data_size > 1:
            with self.comm.guard("loss all_reduce over data", group=self.data_group, context=context):
                dist.all_reduce(total, group=self.data_group)
            total /= self.data_size
        return total

    # --- conversion to / from full (HF-named) state dicts ---------------------------------------------------
    def sharded_modules(self) -> list[tuple[str, TSPVocabShard | TSPAttention | TSPGatedMLP, nn.Parameter]]:
        """(HF name prefix, module with hf_slices/pack_slices/unshard, its parameter), in checkpoint order."""
        out = [("model.embed_tokens.", self.model.embed_tokens, self.model.embed_tokens.vocab_shard)]
        for i, layer in enumerate(self.model.layers):
            out += layer.sharded_modules(f"model.layers.{i}.")
        if not self.lm_head.tied:
            out.append(("lm_head.", self.lm_head, self.lm_head.vocab_shard))
        return out

    def replicated_params(self) -> dict[str, nn.Parameter]:
        """HF-named params every rank holds whole: the norms (and Qwen3's q/k norms)."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            out.update(layer.replicated_params(f"model.layers.{i}."))
        out["model.norm.weight"] = self.model.norm.weight
        return out

    def lora_tensors(self) -> list[tuple[str, nn.Parameter, tuple[int, tuple[int, ...]] | None]]:
        """(PEFT key less its base_model.model. prefix, this rank's LoRA factor, (dim, start of every TSP rank) when
        the factor is sharded or None when replicated) of every LoRA factor (ds_tsp.model.lora); [] without LoRA."""
        out = []
        for prefix, piece, _ in self.sharded_modules():
            lora = getattr(piece, "lora", None)
            for proj, f in (lora.named_children() if lora is not None else ()):
                for which in ("lora_A", "lora_B"):
                    out.append((f"{prefix}{proj}.{which}.weight", getattr(f, which),
                                (f.dim, f.starts) if which == f.sharded else None))
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every HF tensor of this model (tied models list no lm_head.weight, like HF's files)."""
        shapes = {prefix + k: v for prefix, module, _ in self.sharded_modules() for k, v in module.hf_shapes().items()}
        shapes.update({name: tuple(p.shape) for name, p in self.replicated_params().items()})
        return shapes

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False,
                       per_rank: bool = False) -> int:
        """Parameters of the FULL model, as transformers (and peft, LoRA factors included) count them;
        per_rank=True counts this rank's storage."""
        if per_rank:
            return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)
        shapes = self.hf_shapes()
        if only_trainable:  # a shard trains iff every HF tensor in it does (ds_tsp.model.trainability)
            live = {prefix + n for prefix, module, p in self.sharded_modules() if p.requires_grad
                    for n in module.hf_shapes()}
            live |= {n for n, p in self.replicated_params().items() if p.requires_grad}
            shapes = {k: v for k, v in shapes.items() if k in live}
        if exclude_embeddings:
            shapes = {k: v for k, v in shapes.items() if not k.startswith(("model.embed_tokens.", "lm_head."))}
        lora = sum(p.numel() if cut is None else p.numel() // p.shape[cut[0]] * (max(cut[1]) + p.shape[cut[0]])
                   for _, p, cut in self.lora_tensors() if p.requires_grad or not only_trainable)
        return sum(prod(v) for v in shapes.values()) + lora

    @torch.no_grad()
    def init_weights_(self, seed: int = 0, std: float = 0.02) -> "ShardedCausalLM":
        """Initialise shards in place without ever building a full weight: N(0, std) matrices, zero biases and
        padded vocab rows, unit norms. Each piece draws from a generator keyed by (seed, name, piece, owner block),
        so data-parallel replicas and replicated kv heads agree; the values differ from a single-device init."""
        def normal(key: str, shape) -> torch.Tensor:
            g = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
            return torch.randn(shape, generator=g, dtype=torch.float64).mul_(std)

        rank = self.comm.rank
        for name, module, param in self.sharded_modules():
            if isinstance(module, TSPVocabShard):
                param.copy_(normal(f"{name}{rank}", param.shape))
                first_pad = module.vocab_size - rank * module.rows
                if first_pad < module.rows:
                    param[max(first_pad, 0):] = 0
                continue
            layout = module.spec.layout
            views = layout.unpack(param)
            kv_owner = rank // getattr(module.spec, "kv_replicas", 1)
            for piece, shape in layout.pieces:
                owner = kv_owner if piece in ("wk", "wv") else rank
                views[piece].copy_(torch.zeros(shape) if piece.startswith("b") else normal(f"{name}{piece}{owner}", shape))
        # norms 1 (zero-centred norms 0: the same identity scale); MoE routers N(0, std), same on every rank
        norm_init = 0.0 if self.shape.zero_centred_norms else 1.0
        for name, param in self.replicated_params().items():
            param.fill_(norm_init) if param.dim() == 1 else param.copy_(normal(name, param.shape))
        return self

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Take this rank's shards from an HF-named full state dict (every rank passes the same dict): the checkpoint
        layout or an in-memory model's (MoE experts fused, ds_tsp.checkpoint.moe_names)."""
        full = canonical_state_dict(full, self.shape.moe_family)
        self.load_slices(read_from_full(full), names=full.keys())

    @torch.no_grad()
    def load_slices(self, read_into, names) -> None:
        """Fill every shard with read_into(hf_name, dim, start, length, out): copy that slice into `out` (a view of
        the parameter; dim None: the whole tensor).

        Only this rank's slices are ever requested and they land in place, so a checkpoint reader can load a model
        no rank could hold with no transient copy. `names` are the tensor names available: a missing one is one
        clear error naming it.
        """
        available = set(names)
        missing = [n for n in self.hf_shapes() if n not in available]
        if missing:
            raise TSPConfigError(
                f"the checkpoint has no tensor {missing[0]!r} ({len(missing)} missing): it does not match a "
                f"{self.shape.num_layers}-layer Llama-family model of this config (tie_word_embeddings="
                f"{self.shape.tie_word_embeddings}, qkv_bias={self.shape.qkv_bias}, qk_norm={self.shape.qk_norm})")
        load_slices(self.sharded_modules(), self.replicated_params(), read_into)

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Collective: gather every shard into HF-named full tensors (params, or their .grad with grads=True)."""
        def value(param):
            t = param.grad if grads else param
            return torch.zeros_like(param) if t is None else t.detach()

        full = {}
        for prefix, module, param in self.sharded_modules():
            local = value(param).contiguous()
            if self.comm.size > 1:
                gathered = torch.empty((self.comm.size, *local.shape), dtype=local.dtype, device=local.device)
                self.comm.all_gather(gathered, local).wait()
                shards = list(gathered.unbind(0))
            else:
                shards = [local]
            full.update({prefix + k: v for k, v in module.unshard(shards).items()})
        full.update({k: value(p).clone() for k, p in self.replicated_params().items()})
        if self.lm_head.tied:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        return full
