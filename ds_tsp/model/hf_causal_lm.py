"""`TSPForCausalLM`: the TSP model with the face of a transformers causal LM.

    model = TSPForCausalLM.from_pretrained("path/to/llama-3.2-1b", tsp_group=group)   # reads only this rank's slices
    out = model(input_ids=ids, labels=ids, attention_mask=mask)                      # the FULL batch, on every rank
    out.loss.backward()                                                              # each rank: its own shard grads
    model.save_pretrained("out/", max_shard_size="2GB")                              # HF layout, streamed

Inputs are either the full-length batch (every TSP rank passes the same batch; the model keeps its zigzag part:
token ids are tiny) or a batch TSPDataLoader already sharded (it carries "tsp_shard"), so `model(**batch)` works
with both. `loss` is the global token-mean loss on every rank, what a single device prints; its backward gives each
rank exactly its share of the gradients. There is no KV cache: this is a training / scoring model.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.config import TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.shape.hf_config import config_json, generation_config_json, import_transformers, load_config
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.zigzag import shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.model.fused_lm_head import FusedLMHeadCall
from ds_tsp.model.loss import gathered_router_logits, sequence_aux_loss

# Keyword arguments HF code passes that change nothing here when they have these values.
_HARMLESS_KWARGS = {"use_cache": (None, False), "return_dict": (None, True), "output_attentions": (None, False),
                    "output_hidden_states": (None, False), "past_key_values": (None,), "cache": (None,),
                    "inputs_embeds": (None,), "cache_position": (None,)}


_POSITIONAL_ERROR = (
    "TSPForCausalLM.forward got {n} positional arguments: only input_ids is taken positionally (transformers' own "
    "positional order puts attention_mask second, a shard's order shift_labels: a guess would train on the wrong "
    "targets). Pass keywords: input_ids=, labels= (full batch, unshifted), shift_labels= (with a TSPDataLoader "
    "batch), position_ids=, attention_mask=, logits_to_keep=; a batch dict as model(**batch) / engine(**batch)")

_GENERATE_ERROR = (
    "TSPForCausalLM does not generate: TSP trains and scores (no KV cache; every step is a collective over the "
    "TSP group). To sample: model.save_pretrained(dir) and load dir in transformers "
    "(AutoModelForCausalLM.from_pretrained(dir).generate(...)) or a serving engine (vLLM, TGI, SGLang); for a quick "
    "greedy sample under TSP, loop model(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1) and append the "
    "token (docs/huggingface.md, 'Sampling'; it recomputes the whole prefix each step)")


def as_comm(tsp_group) -> TSPComm:
    """A TSPComm from a TSPComm, a process group, or None (the whole world when one is initialised)."""
    if isinstance(tsp_group, TSPComm):
        return tsp_group
    if tsp_group is None:
        return TSPComm(dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None)
    return TSPComm(tsp_group)


def _resolve_dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = getattr(torch, stored, None)
        return stored if isinstance(stored, torch.dtype) else torch.float32
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise TSPConfigError(f"dtype={dtype!r}: pass a torch dtype, its name (\"bfloat16\") or \"auto\"")


class NoGenerationConfig(TSPConfigError, AttributeError):
    """model.generation_config read before a TSP trainer set it (hasattr / getattr with a default still answer)."""


class TSPForCausalLM(nn.Module):
    """The TSP model with the face of a transformers causal LM: `from_pretrained` reads only this rank's slices,
    the call takes the full batch (or a TSPDataLoader shard) by keyword and returns the global loss, and
    `save_pretrained` streams the plain HF layout back. It trains and scores; it does not generate."""

    main_input_name = "input_ids"
    accepts_loss_kwargs = True  # the Trainer passes num_items_in_batch
    # the fields TRL's add_fused_lm_head(model, outputs=...) asked for (ds_tsp.integrations.trl records them here):
    # "mean_logits" / "log_sum_sq_probs" make the fused head carry those two extra per-token statistics
    fused_lm_head_outputs: tuple[str, ...] = ("log_probs",)

    def __init__(self, config, tsp_group=None, *, options: TSPOptions = TSPOptions(),
                 dtype: torch.dtype = torch.float32, device=None, data_group=None):
        super().__init__()
        self.config = config
        self.generation_config_json: str | None = None  # the source's generation_config.json, written back on save
        self.tsp = ShardedCausalLM(ModelShape.from_hf_config(config), as_comm(tsp_group), options=options,
                               dtype=dtype, device=device, data_group=data_group)

    def __getattr__(self, name: str):
        if name == "generation_config":  # set by TSPTrainer composed with TRL; read first by a bare SFTTrainer
            raise NoGenerationConfig(
                "TSPForCausalLM has no generation_config: TRL's SFTTrainer needs the TSP composition, "
                "ds_tsp.hf.TSPSFTTrainer (or class X(TSPTrainer, SFTTrainer)), to train a TSP model; a bare "
                "SFTTrainer would feed it whole, unsharded batches. For generation, see the sampling loop of "
                "docs/huggingface.md")
        return super().__getattr__(name)

    # --- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained, tsp_group=None, *, dtype="auto", torch_dtype=None,
                        options: TSPOptions = TSPOptions(), device=None, data_group=None) -> "TSPForCausalLM":
        """From a LOCAL HF checkpoint directory (each rank reads only its slices) or an in-memory HF model.

        An in-memory model's requires_grad carries to the shards (ds_tsp.model.trainability; a directory loads all
        trainable); a PEFT LoRA model (get_peft_model) keeps its base frozen and trains its adapter, folded into the
        shards (ds_tsp.model.peft.lora), and save_pretrained then writes the adapter as PEFT does.

        dtype "auto" keeps the checkpoint's dtype (config.json's), as transformers 5 does; collective-free.
        """
        from ds_tsp.checkpoint.hf.load import load_sharded

        if torch_dtype is not None:
            dtype = torch_dtype
        if isinstance(pretrained, (str, Path)):
            config = load_config(pretrained)
            model = cls(config, tsp_group, options=options, dtype=_resolve_dtype(dtype, config), device=device,
                        data_group=data_group)
            load_sharded(model.tsp, pretrained)
            model.generation_config_json = generation_config_json(pretrained)  # written back by save_pretrained
            return model
        if hasattr(pretrained, "config") and hasattr(pretrained, "state_dict"):  # a transformers (or PEFT) model
            from ds_tsp.model.trainability import load_hf_model

            if dtype in (None, "auto"):
                dtype = next(iter(pretrained.parameters())).dtype
            model = cls(pretrained.config, tsp_group, options=options, dtype=_resolve_dtype(dtype, pretrained.config),
                        device=device, data_group=data_group)
            # Weights, requires_grad and a PEFT LoRA adapter (whose base_model.model. names it maps back)
            hf_model = load_hf_model(model.tsp, pretrained)
            model.generation_config_json = generation_config_json(hf_model)
            return model
        raise TSPConfigError(f"from_pretrained({type(pretrained).__name__}): pass a local checkpoint directory or a "
                             "transformers Llama / Mistral / Qwen2 / Qwen3 model")

    @classmethod
    def from_config(cls, config, tsp_group=None, *, seed: int = 0, **kwargs) -> "TSPForCausalLM":
        """A fresh model (shards initialised in place by ShardedCausalLM.init_weights_, no full weight ever built)."""
        model = cls(config, tsp_group, **kwargs)
        model.tsp.init_weights_(seed)
        return model

    # --- HF-like surface --------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.tsp.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tsp.dtype

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters of the full model, as transformers counts them (tied weights once)."""
        return self.tsp.num_parameters(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute every decoder layer in backward (the Trainer calls this for gradient_checkpointing=True; from
        transformers 5.25 with its every_n_layers / offload, which TSP honours at their defaults only)."""
        if every_n_layers not in (None, 1) or offload:
            raise TSPConfigError(f"activation checkpointing with every_n_layers={every_n_layers}, offload={offload}: "
                                 "TSP recomputes every decoder layer; for host offload use the \"tsp\" block's "
                                 "offload_activations")
        self.tsp.options = self.tsp.options.replace(activation_checkpointing=True)

    def gradient_checkpointing_disable(self) -> None:
        """No recompute, so nothing to offload either (offload_activations goes off with it)."""
        self.tsp.options = self.tsp.options.replace(activation_checkpointing=False, offload_activations=False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.tsp.options.activation_checkpointing

    @classmethod
    def can_generate(cls) -> bool:
        """False: TSP trains and scores. A generating transformers pipeline (text-generation) asks this while it is
        built and would otherwise fail on its own missing attributes: it gets the generate() error instead."""
        if sys._getframe(1).f_globals.get("__name__", "").startswith("transformers.pipelines"):
            raise TSPConfigError(_GENERATE_ERROR)
        return False

    def generate(self, *args, **kwargs):
        """Not supported: one TSPConfigError saying how to sample (save_pretrained + transformers / a serving
        engine, or the logits_to_keep=1 greedy loop of docs/huggingface.md)."""
        raise TSPConfigError(_GENERATE_ERROR)

    # --- forward ----------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, *args, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, logits_to_keep: int = 0,
                tsp_shard: tuple[int, int] | None = None, seq_len: int | None = None,
                num_items_in_batch: torch.Tensor | int | None = None, output_router_logits: bool | None = None,
                **kwargs):
        """transformers' causal-LM call. Returns CausalLMOutputWithPast(loss, logits); for a mixture-of-experts model
        MoeCausalLMOutputWithPast(loss, aux_loss, logits, router_logits).

        TRL's fused LM head call (fused_lm_head=True, with GRPO's temperature=) is answered by
        ds_tsp.model.fused_lm_head: a FusedLMHeadOutput instead of logits.

        Only input_ids may be passed positionally; everything else by keyword (model(**batch) for a batch dict).

        labels: HF convention (shifted inside); shift_labels: already shifted (DeepSpeed ALST convention).
        attention_mask: 1 real / 0 padding (left or right); padded tokens are neither keys nor targets.
        position_ids restarting at 0 mark packed documents (DataCollatorWithFlattening); attention stays inside.
        logits_to_keep=k: full-vocab logits of the last k positions, gathered from the vocab shards (logits of
        every position are only built when k = the sequence length). Without labels, logits_to_keep is required.
        num_items_in_batch (the Trainer's): labelled tokens of the whole accumulated batch over all ranks; the
        loss is then token sum / num_items_in_batch, its value this data replica's part (summed over the TSP group),
        as transformers' models do per process.
        output_router_logits (MoE; None: the config's): as transformers, aux_loss = the load-balancing loss of the
        whole batch (value: the group's, gradient: this rank's share), and with labels the loss gets
        router_aux_loss_coef * aux_loss. router_logits (one [batch * seq_len, E] per sparse layer, gathered from every
        rank, detached: a collective and O(tokens x E) memory) only when output_router_logits=True is passed here.
        """
        if args:  # transformers' own positional order differs (attention_mask second): never guess
            raise TSPConfigError(_POSITIONAL_ERROR.format(n=1 + len(args)))
        fused = FusedLMHeadCall.pop_from(kwargs)  # TRL's options, None for every other caller
        if fused is not None and {"mean_logits", "log_sum_sq_probs"} & set(self.fused_lm_head_outputs):
            fused = FusedLMHeadCall(fused.temperature, logit_stats=True)
        self._check_kwargs(kwargs)
        if input_ids is None:
            raise TSPConfigError("input_ids is required (inputs_embeds is not supported: the embedding is sharded)")
        batch, seq_len = self._local_batch(input_ids, labels, shift_labels, position_ids, attention_mask,
                                           tsp_shard, seq_len)
        has_targets = batch["shift_labels"] is not None
        if not has_targets and not logits_to_keep:
            raise TSPConfigError("pass labels / shift_labels for the loss, or logits_to_keep=k for the logits of the "
                                 "last k positions: the logits of every position are never built unless asked for "
                                 "(logits_to_keep=seq_len asks for them)")
        if not isinstance(logits_to_keep, int):
            raise TSPConfigError(f"logits_to_keep={type(logits_to_keep).__name__}: only an int (the last k "
                                 "positions) is supported")
        if fused is not None:
            fused.check(has_targets, logits_to_keep)
        moe = self.tsp.shape.num_experts > 0
        want_router = moe and (output_router_logits if output_router_logits is not None
                               else self.tsp.shape.output_router_logits)
        router_logits = [] if want_router else None
        h, n_valid = self.tsp.final_hidden(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                           batch["shift_labels"], router_logits)
        # GLM-4.5's grouped sigmoid routing has no load-balancing loss in transformers: its router logits only
        has_aux = self.tsp.shape.moe_routing != "sigmoid_grouped"
        aux_share = (self.tsp.aux_loss_share(router_logits, tuple(batch["input_ids"].shape), batch["attention_mask"],
                                             seq_len) if router_logits and has_aux else None)
        if fused is not None:
            return fused.answer(self.tsp, h, batch, seq_len, num_items_in_batch, aux_share)
        loss = logits = None
        if has_targets and num_items_in_batch is not None:
            if isinstance(num_items_in_batch, torch.Tensor):
                total = num_items_in_batch.to(device=h.device, dtype=n_valid.dtype).reshape(())
            else:  # a fill on the device: as_tensor of a python int would be a host-to-device copy
                total = torch.full((), num_items_in_batch, dtype=n_valid.dtype, device=h.device)
            share = self.tsp.head_loss(h, batch["shift_labels"], total, batch["attention_mask"])
            # a share of the sequence's token sum / num_items (cp groups summed, as the Trainer scales): the aux
            # share of the sequence likewise, not counted per cp group
            loss = self.tsp.tsp_group_loss(self._with_aux(share, aux_share))
        elif has_targets:
            share = self.tsp.head_loss(h, batch["shift_labels"], n_valid, batch["attention_mask"])
            loss = self.tsp.global_loss(self._with_aux(share, None if aux_share is None else
                                                       self.tsp.aux_in_mean_loss(aux_share)))
        if logits_to_keep:
            logits = self.tsp.last_logits(h, seq_len, logits_to_keep)
        outputs = import_transformers().modeling_outputs
        if not moe:
            return outputs.CausalLMOutputWithPast(loss=loss, logits=logits)
        gathered = (gathered_router_logits(router_logits, self.tsp.comm, batch["input_ids"].shape, seq_len)
                    if router_logits and output_router_logits else None)
        return outputs.MoeCausalLMOutputWithPast(
            loss=loss, logits=logits, router_logits=gathered,
            aux_loss=None if aux_share is None else sequence_aux_loss(aux_share, self.tsp.comm))

    def _with_aux(self, share: torch.Tensor, aux_share: torch.Tensor | None) -> torch.Tensor:
        """The loss share plus, for MoE with router logits, router_aux_loss_coef x the aux loss share (as transformers
        adds it: after the token mean, not scaled by num_items_in_batch)."""
        return share if aux_share is None else share + self.tsp.shape.router_aux_loss_coef * aux_share

    def add_model_tags(self, tags: list[str] | str) -> None:
        """transformers' model tags (TRL adds its own): kept on the model, as PreTrainedModel keeps them."""
        tags = [tags] if isinstance(tags, str) else list(tags)
        self.model_tags = list(dict.fromkeys([*(getattr(self, "model_tags", None) or []), *tags]))

    def _check_kwargs(self, kwargs: dict) -> None:
        for key, value in kwargs.items():
            if key not in _HARMLESS_KWARGS:
                raise TSPConfigError(f"{key}= is not supported by TSPForCausalLM.forward; accepted: input_ids, "
                                     "labels, position_ids, attention_mask, shift_labels, logits_to_keep")
            if not any(value is v or value == v for v in _HARMLESS_KWARGS[key]):
                raise TSPConfigError(f"{key}={value!r} is not supported (TSP trains and scores: no KV cache, no "
                                     "per-layer outputs); leave it at its default")

    def _local_batch(self, input_ids, labels, shift_labels, position_ids, attention_mask, tsp_shard, seq_len):
        """This rank's zigzag shard of the batch, and the global (unpadded) sequence length."""
        comm = self.tsp.comm
        if tsp_shard is not None:
            if tuple(tsp_shard) != (comm.rank, comm.size):
                raise TSPConfigError(f"tsp_shard={tuple(tsp_shard)}: the batch was sharded for TSP rank "
                                     f"{tsp_shard[0]} of {tsp_shard[1]} but this model is rank {comm.rank} of "
                                     f"{comm.size}; build the loader on the same TSP group")
            if labels is not None:
                raise TSPConfigError("labels= with an already-sharded batch: TSPDataLoader shifts labels before "
                                     "cutting the sequence; pass its shift_labels")
            return {"input_ids": input_ids, "shift_labels": shift_labels, "position_ids": position_ids,
                    "attention_mask": attention_mask}, seq_len or input_ids.shape[1] * comm.size * comm.cp_size
        targets = shift_labels if shift_labels is not None else labels
        if labels is not None and shift_labels is not None:
            raise TSPConfigError("pass labels (HF convention, shifted inside) or shift_labels (pre-shifted), not both")
        if shift_labels is not None and comm.size > 1:  # never shard a shard: shift_labels need the loader's marker
            raise TSPConfigError(
                f"shift_labels without tsp_shard at tsp={comm.size}: a TSPDataLoader shard that lost its tsp_shard "
                "marker looks exactly like a full pre-shifted batch, and sharding it again would train on the wrong "
                "tokens. Pass the loader's batch whole (model(**batch): it carries tsp_shard and seq_len), or a "
                "full-length batch with labels= (unshifted: the model shifts and shards it)")
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
            raise TSPConfigError("input_ids has one dim: pass [batch, seq] (input_ids.unsqueeze(0))")
        full = shard_batch(input_ids, tsp=comm.size, rank=comm.rank, labels=targets, position_ids=position_ids,
                           labels_are_shifted=shift_labels is not None, attention_mask=attention_mask,
                           # check_values: ShardedCausalLM's input check reads the same facts, once
                           check_values=False, cp=comm.cp_size, cp_rank=comm.cp_rank)
        return {"input_ids": full["input_ids"], "shift_labels": full["shift_labels"] if targets is not None else None,
                "position_ids": full["position_ids"], "attention_mask": full.get("attention_mask")}, full["seq_len"]

    # --- saving -----------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | Path, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None, **kwargs) -> Path | None:
        """Collective: write the standard HF layout (config.json, safetensors shards + index) that plain
        transformers loads. Global rank 0 writes; modules are gathered to it one at a time, except MoE experts,
        which each TSP rank of the writing replica streams itself into the same temporary directory (a
        filesystem the TSP ranks share, as loading assumes). Returns the directory on the writer, None elsewhere."""
        from ds_tsp.checkpoint.hf.save import save_streaming

        unsupported = {k: v for k, v in kwargs.items()
                       if not (k == "safe_serialization" and v) and not (k == "is_main_process")}
        if unsupported:
            raise TSPConfigError(f"save_pretrained: {', '.join(unsupported)} not supported (ds_tsp always writes "
                                 "safetensors; the writer is global rank 0)")
        dtype = dtype or self.dtype
        generation = getattr(self, "generation_config_json", None)
        return save_streaming(self.tsp, save_directory, config_json(self.config, dtype),
                              max_shard_size=max_shard_size, dtype=dtype,
                              extra_files={"generation_config.json": generation} if generation else None)

    def extra_repr(self) -> str:
        return f"model_type={self.config.model_type}, tsp={self.tsp.comm.size}"
