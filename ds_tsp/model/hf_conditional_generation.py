"""`TSPForConditionalGeneration`: multimodal Qwen3.5 (transformers' Qwen3_5ForConditionalGeneration, or
Qwen3_5MoeForConditionalGeneration: a vision tower feeding the hybrid Gated DeltaNet / gated-attention language
model, dense or with experts) and Qwen3-VL (Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration:
Qwen3's layer, dense or with experts, under mrope, the tower's DeepStack features added to the first layers) under
TSP, with images and videos.

    model = TSPForConditionalGeneration.from_pretrained("local/qwen3.5-vl", tsp_group=group)
    out = model(**processor_batch, labels=labels)    # input_ids, attention_mask, pixel_values, image_grid_thw,
    out.loss.backward()                              # (pixel_values_videos, video_grid_thw,) mm_token_type_ids:
                                                     # the FULL batch, on every TSP rank
    model.save_pretrained("out/")                    # the Qwen3_5ForConditionalGeneration layout, streamed

What runs where (D = TSP degree):
* the language model is ShardedCausalLM (1/D of every weight and 1/D of the tokens, zigzag);
* the vision tower is transformers' own module, replicated on the TSP group; each rank encodes a contiguous 1/D of
  the images (balanced by patch count) and an all-to-all brings each vision token's embedding to the rank holding
  that token (ds_tsp.core.layers.vision); the tower's weight grads are summed over the group inside backward;
  under DeepSpeed ZeRO-3 the tower is partitioned over the data group like the language model's shards, gathered by
  ZeRO-3's hooks, and every rank runs it twice per step (images, videos: a placeholder item where it has none);
* positions: the 3-D mrope positions of the whole batch by transformers' get_rope_index rule
  (ds_tsp.core.tokens.mrope), computed once per step and sharded with the tokens; a batch with no grid takes
  transformers' text positions (0..S-1 on all three rows).
Host reads: input_ids, mm_token_type_ids, attention_mask and the grids are read on the host once per step at this
model's entry (a loader hands them there; device tensors are copied once) to plan the routing and the positions;
nothing inside the layers reads a device value. (transformers' vision tower reads its grid on the host itself.)

The loss is the one a single device computes (token mean over labels != -100, labels shifted inside), and its
backward gives every rank its share of every gradient, the vision tower's (summed, whole) included, so a plain
torch optimizer over model.parameters() trains it exactly.

Videos (pixel_values_videos, video_grid_thw) take the same path as images: their frames (temporal patches) are
the items each rank encodes, so one long video is shared by the ranks (the tower attends within a frame and repeats
a video's patch positions per frame, so a (t, h, w) video encodes exactly as t (1, h, w) items); the frames'
language-model positions restart h and w per frame (the timestamps between frames are text).

Packed documents: position_ids [B, S] counting from 0 per document (DataCollatorWithFlattening's); attention and
the Gated DeltaNet state stay inside each document and the multimodal positions restart per document, so the
loss is that of every document run alone (transformers' own call, given 2-D position_ids, would instead put text
positions on the vision tokens).

Qwen3.5-MoE: E/D whole experts per rank as in TSPForCausalLM; with output_router_logits (the config's) the loss
adds router_aux_loss_coef x transformers' load-balancing loss of the whole batch, aux_loss returned beside it.

Qwen3-VL's DeepStack features (one per deepstack_visual_indexes entry) ride as more columns of the same rows in the
embeddings' all-to-all, and are added to the outputs of layers 0 .. k-1 at the vision rows (index_add on the same
local rows), as transformers' _deepstack_process adds them.

Not handled yet, each refused by name: 3-D position_ids, a cp axis,
TSPDataLoader shards (tsp_shard), TRL's fused head, frozen tower weights of an in-memory model.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from ds_tsp.core.config import TSPOptions
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.layers.vision import all_to_all_rows, encode_replicated, scatter_vision_rows
from ds_tsp.core.shape.hf_config import import_transformers, language_model_config
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.core.tokens.mrope import mrope_cos_sin, mrope_positions
from ds_tsp.core.tokens.positions import RopeTables, StepRope
from ds_tsp.core.tokens.vision_route import frame_items, plan_vision_route
from ds_tsp.core.tokens.zigzag import pad_to, shard, shard_batch
from ds_tsp.model.causal_lm import ShardedCausalLM
from ds_tsp.model.hf_causal_lm import _HARMLESS_KWARGS, TSPForCausalLM, _resolve_dtype, as_comm
from ds_tsp.model.loss import sequence_aux_loss

# model_type -> the transformers class whose checkpoints and call this face reproduces
ARCHITECTURES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                 "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
# multimodal families on the way, refused by name until their exactness proof lands
NOT_YET: dict[str, str] = {}
# multimodal model_type -> (the text family whose layer its language model is, fields its model fixes): Qwen3-VL's
# text model is Qwen3's layer, Qwen3-VL-MoE's Qwen3-MoE's with the top-k weights always renormalised
_TEXT_AS = {"qwen3_vl": ("qwen3", {}), "qwen3_vl_moe": ("qwen3_moe", {"norm_topk_prob": True})}
_VISION_PREFIX = "model.visual."
_LM_PREFIX = "model.language_model."


def check_multimodal_family(model_type: str | None) -> None:
    if model_type in ARCHITECTURES:
        return
    if model_type in NOT_YET:
        raise TSPConfigError(f"model_type={model_type!r}: {NOT_YET[model_type]} is not supported by "
                             "TSPForConditionalGeneration yet; train its language model with TSPForCausalLM "
                             "(text only) or use a qwen3_5 checkpoint")
    raise TSPConfigError(f"model_type={model_type!r}: TSPForConditionalGeneration takes "
                         f"{', '.join(ARCHITECTURES)} checkpoints (multimodal); for a text model use TSPForCausalLM")


def _text_config(config):
    """The language model's config: the wrapper's text_config (with its dtype and tie_word_embeddings)."""
    if config.model_type not in _TEXT_AS:
        return language_model_config(config)
    import copy

    text = copy.deepcopy(config.text_config)
    for key in ("dtype", "tie_word_embeddings"):
        if getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def multimodal_shape(values: dict) -> ModelShape:
    """The language model's ModelShape from a multimodal checkpoint's config.json values (collective-free)."""
    check_multimodal_family(values.get("model_type"))
    config = import_transformers().AutoConfig.for_model(**values)
    return _text_shape(config, _text_config(config))


def _text_shape(config, text) -> ModelShape:
    """The language model's ModelShape; Qwen3-VL's text model is Qwen3's layer (q/k norms) under mrope, read as
    such (its rope_parameters' mrope fields are honoured here, by mrope_cos_sin)."""
    if config.model_type not in _TEXT_AS:
        return ModelShape.from_hf_config(text)
    family, fixed = _TEXT_AS[config.model_type]
    return ModelShape.from_hf_config({**text.to_dict(), **fixed, "model_type": family})


def _count_from_zero(documents: torch.Tensor) -> bool:
    """Whether every packed document's positions (host [B, S]) start at 0 (they continue by +1 by definition)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1] + 1
    return bool((documents[starts] == 0).all())


class _SaveView:
    """What save_streaming reads, under Qwen3_5ForConditionalGeneration's names: the language model's shards and
    norms under model.language_model., the lm_head as is, the vision tower's weights under model.visual."""

    def __init__(self, model: "TSPForConditionalGeneration"):
        self.tsp, self.visual, self.comm = model.tsp, model.visual, model.tsp.comm
        self.lora_adapter_config = None

    @staticmethod
    def _rename(name: str) -> str:
        return _LM_PREFIX + name[len("model."):] if name.startswith("model.") else name

    def sharded_modules(self):
        return [(self._rename(prefix), module, param) for prefix, module, param in self.tsp.sharded_modules()]

    def replicated_params(self):
        out = {self._rename(k): v for k, v in self.tsp.replicated_params().items()}
        out.update({_VISION_PREFIX + k: v for k, v in self.visual.named_parameters()})
        return out

    def replicated_buffers(self):
        return {self._rename(k): v for k, v in self.tsp.replicated_buffers().items()}


class TSPForConditionalGeneration(nn.Module):
    """A multimodal Qwen3.5 under TSP with the face of transformers' Qwen3_5ForConditionalGeneration: the call
    takes the processor's full batch by keyword and returns the single-device loss (module docstring)."""

    main_input_name = "input_ids"
    accepts_loss_kwargs = False  # per instance: the transformers class's own (see __init__)

    def __init__(self, config, tsp_group=None, *, options: TSPOptions = TSPOptions(),
                 dtype: torch.dtype = torch.float32, device=None, data_group=None):
        super().__init__()
        check_multimodal_family(getattr(config, "model_type", None))
        self.config = config
        text = _text_config(config)
        self.tsp = ShardedCausalLM(_text_shape(config, text), as_comm(tsp_group), options=options, dtype=dtype,
                                   device=device, data_group=data_group)
        if self.tsp.comm.cp is not None:
            raise TSPConfigError(f"tsp.cp_size={self.tsp.comm.cp.size} with TSPForConditionalGeneration: a cp axis "
                                 "is not supported for multimodal models yet; use cp_size 1")
        # built whole, as the language model's shards are, also under a live HF ZeRO-3 config (TrainingArguments(
        # deepspeed=<stage 3>)), whose zero.Init would partition it at construction: DeepSpeed partitions it over
        # the data group at deepspeed.initialize, after the checkpoint's weights are in
        transformers = import_transformers()
        whole = getattr(transformers.modeling_utils, "set_zero3_state", contextlib.nullcontext)
        with whole():
            vision = transformers.AutoModel.from_config(config.vision_config, attn_implementation="sdpa")
        self.visual = vision.to(device=device, dtype=dtype)
        # the data group a replicated tower's grads are averaged over in backward (set by shard_with_fsdp2, whose
        # FSDP2 averages the language model's and leaves the tower whole); None: an engine (DeepSpeed) or nothing
        self.tower_data_group = None
        if options.activation_checkpointing:
            self._checkpoint_tower(True)
        rope = dict(getattr(text, "rope_parameters", None) or {})
        self.mrope_section = tuple(rope.get("mrope_section", (11, 11, 10)))  # transformers' default
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        # Qwen3-VL: the tower's DeepStack features, added to the outputs of the first len(...) layers at the vision
        # rows; they travel in the same all-to-all as the embeddings (k more row widths)
        self.deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
        # what the Trainer reads to pass num_items_in_batch (False for these transformers classes: the plain Trainer
        # averages their per-micro-batch means); the call itself takes num_items_in_batch either way
        self.accepts_loss_kwargs = getattr(getattr(import_transformers(), ARCHITECTURES[config.model_type], None),
                                           "accepts_loss_kwargs", True)

    # --- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained, tsp_group=None, *, dtype="auto", torch_dtype=None,
                        options: TSPOptions = TSPOptions(), device=None,
                        data_group=None) -> "TSPForConditionalGeneration":
        """From a LOCAL checkpoint directory (each rank reads only its slices of the language model, and the vision
        tower whole) or an in-memory transformers Qwen3_5ForConditionalGeneration. dtype "auto": the checkpoint's."""
        from ds_tsp.checkpoint.hf.load import load_sharded
        from ds_tsp.checkpoint.safetensors.reader import CheckpointReader

        if torch_dtype is not None:
            dtype = torch_dtype
        if isinstance(pretrained, (str, Path)):
            path = Path(pretrained) / "config.json"
            if not path.is_file():
                raise TSPConfigError(f"{path} does not exist: from_pretrained takes a local checkpoint directory")
            values = json.loads(path.read_text())
            check_multimodal_family(values.get("model_type"))
            config = import_transformers().AutoConfig.for_model(**values)
            model = cls(config, tsp_group, options=options, dtype=_resolve_dtype(dtype, config), device=device,
                        data_group=data_group)
            load_sharded(model.tsp, pretrained)
            reader = CheckpointReader(pretrained)
            with torch.no_grad(), reader.reading():
                for name, param in model.visual.named_parameters():
                    if _VISION_PREFIX + name not in reader:
                        raise TSPConfigError(f"{pretrained}: {_VISION_PREFIX + name} is missing: the checkpoint has "
                                             "no complete vision tower")
                    reader.read(_VISION_PREFIX + name, out=param.data)
            return model
        if hasattr(pretrained, "config") and hasattr(pretrained, "state_dict"):
            from ds_tsp.checkpoint.hf.language_model_names import language_model_tensors

            check_multimodal_family(getattr(pretrained.config, "model_type", None))
            frozen = [n for n, p in pretrained.named_parameters() if not p.requires_grad]
            if frozen:
                raise TSPConfigError(f"an in-memory model with frozen parameters ({frozen[0]}, ...): requires_grad "
                                     "is not carried to TSPForConditionalGeneration yet; freeze after loading")
            if dtype in (None, "auto"):
                dtype = next(iter(pretrained.parameters())).dtype
            model = cls(pretrained.config, tsp_group, options=options,
                        dtype=_resolve_dtype(dtype, pretrained.config), device=device, data_group=data_group)
            state = {k: v.detach() for k, v in pretrained.state_dict().items()}
            model.tsp.load_full_state_dict(language_model_tensors(state))
            model.visual.load_state_dict({k[len(_VISION_PREFIX):]: v for k, v in state.items()
                                          if k.startswith(_VISION_PREFIX)})
            return model
        raise TSPConfigError(f"from_pretrained({type(pretrained).__name__}): pass a local checkpoint directory or a "
                             "transformers Qwen3_5ForConditionalGeneration")

    @property
    def device(self) -> torch.device:
        return self.tsp.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tsp.dtype

    # activation checkpointing (the Trainer calls these): the language model's decoder layers as TSPForCausalLM, and
    # the vision tower's blocks by transformers' own checkpointing, as the plain model's gradient_checkpointing_enable
    # does (at long video lengths the tower's activations can exceed the language model's)
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        TSPForCausalLM.gradient_checkpointing_enable(self, gradient_checkpointing_kwargs, every_n_layers, offload)
        self._checkpoint_tower(True)

    def gradient_checkpointing_disable(self) -> None:
        TSPForCausalLM.gradient_checkpointing_disable(self)
        self._checkpoint_tower(False)

    is_gradient_checkpointing = TSPForCausalLM.is_gradient_checkpointing

    def _checkpoint_tower(self, on: bool) -> None:
        if on:  # non-reentrant: the recompute sees the same grid-derived kwargs, no grad-requiring input needed
            self.visual.activation_checkpointing_enable({"use_reentrant": False})
        elif self.visual.is_activation_checkpointing:
            self.visual.activation_checkpointing_disable()

    # --- forward ----------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, *args, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                mm_token_type_ids: torch.Tensor | None = None, logits_to_keep: int = 0,
                num_items_in_batch: torch.Tensor | int | None = None, **kwargs):
        """transformers' Qwen3_5ForConditionalGeneration call on the full batch (every TSP rank passes the same):
        CausalLMOutputWithPast(loss, logits). labels are unshifted (shifted inside); logits only for
        logits_to_keep=k (the last k positions); num_items_in_batch as TSPForCausalLM takes it."""
        self._check_call(args, kwargs, input_ids, labels, position_ids, pixel_values, image_grid_thw,
                         pixel_values_videos, video_grid_thw, logits_to_keep)
        comm, shape = self.tsp.comm, self.tsp.shape
        ids = input_ids.cpu()  # the step's one host read of the token ids (module docstring)
        modalities = []  # (pixels, grid, placeholder mask [B, S], grid field), in transformers' scatter order
        for pixels, grid, token_id, names in ((pixel_values, image_grid_thw, self.config.image_token_id,
                                               ("pixel_values", "image_grid_thw", "image")),
                                              (pixel_values_videos, video_grid_thw, self.config.video_token_id,
                                               ("pixel_values_videos", "video_grid_thw", "video"))):
            tokens = ids == token_id
            n = int(tokens.sum())
            if pixels is None and n:
                raise ValueError(f"input_ids holds {n} {names[2]} tokens ({names[2]}_token_id {token_id}) but "
                                 f"{names[0]} is None: pass the processor's {names[0]} and {names[1]}")
            if grid is not None and mm_token_type_ids is None:
                raise ValueError(f"{names[1]} without mm_token_type_ids: the processor returns it with input_ids, "
                                 "and the multimodal positions are computed from it")
            if pixels is not None:
                modalities.append((pixels, grid, tokens, names[1]))
        full = shard_batch(input_ids, tsp=comm.size, rank=comm.rank, labels=labels, attention_mask=attention_mask,
                           position_ids=position_ids, check_values=False)
        padded = full["padded_len"]
        documents = None if position_ids is None else position_ids.cpu().expand(ids.shape)
        if modalities:  # transformers' get_rope_index rule, on the host, for the whole batch (per packed document)
            positions = mrope_positions(mm_token_type_ids, self.spatial_merge_size, image_grid_thw, video_grid_thw,
                                        attention_mask=attention_mask, documents=documents)
            if documents is not None and not _count_from_zero(documents):
                raise TSPConfigError("position_ids with vision tokens: packed documents' position_ids must count "
                                     "0, 1, 2, ... from each document's start (DataCollatorWithFlattening's); the "
                                     "multimodal positions are derived from where they restart")
        elif documents is not None:  # transformers' text positions: the caller's on all three rows
            positions = documents.expand(3, *ids.shape)
        else:
            positions = torch.arange(ids.shape[1], device="cpu").expand(3, *ids.shape)
        local = shard(pad_to(positions, padded, 0, dim=2), comm.size, comm.rank, dim=2).to(input_ids.device)
        cos, sin = mrope_cos_sin(local, shape.full_rotary_dim, shape.rope_theta, self.dtype, self.mrope_section,
                                 shape.rope_scaling)
        zero3 = any(hasattr(p, "ds_id") for p in self.visual.parameters())  # every step runs the tower (below)
        # a tower under ZeRO-3 or averaged over the data group runs every step: its collectives span other batches
        every_step = zero3 or self.tower_data_group is not None
        embeds, after_layer = (self._vision_embeds(modalities, padded, zero3, every_step) if modalities or every_step
                               else (None, None))
        shift_labels = full["shift_labels"] if labels is not None else None
        mask = full.get("attention_mask")
        # Qwen3.5-MoE: transformers' load-balancing loss over the whole batch when the config asks for it
        router_logits = [] if shape.num_experts and shape.output_router_logits else None
        h, n_valid = self.tsp.final_hidden(full["input_ids"], full["position_ids"], mask, shift_labels,
                                           router_logits, ropes=StepRope(RopeTables(cos, sin)), embeds=embeds,
                                           after_layer=after_layer)
        aux_share = (self.tsp.aux_loss_share(router_logits, tuple(full["input_ids"].shape), mask, full["seq_len"])
                     if router_logits else None)
        coef = shape.router_aux_loss_coef
        loss = logits = None
        if shift_labels is not None and num_items_in_batch is not None:
            total = (num_items_in_batch.to(device=h.device, dtype=n_valid.dtype).reshape(())
                     if isinstance(num_items_in_batch, torch.Tensor)
                     else torch.full((), num_items_in_batch, dtype=n_valid.dtype, device=h.device))
            share = self.tsp.head_loss(h, shift_labels, total, mask)
            loss = self.tsp.tsp_group_loss(share if aux_share is None else share + coef * aux_share)
        elif shift_labels is not None:
            share = self.tsp.head_loss(h, shift_labels, n_valid, mask)
            if aux_share is not None:
                share = share + coef * self.tsp.aux_in_mean_loss(aux_share)
            loss = self.tsp.global_loss(share)
        if logits_to_keep:
            logits = self.tsp.last_logits(h, full["seq_len"], logits_to_keep)
        outputs = import_transformers().modeling_outputs
        if aux_share is None:
            return outputs.CausalLMOutputWithPast(loss=loss, logits=logits)
        return outputs.MoeCausalLMOutputWithPast(loss=loss, logits=logits,
                                                 aux_loss=sequence_aux_loss(aux_share, self.tsp.comm))

    def _vision_embeds(self, modalities, padded_len, zero3: bool = False, every_step: bool = False):
        """The embedding hook: per modality (images, then videos, as transformers scatters them), this rank encodes
        its run of items, the all-to-all routes every vision token's embedding to the rank holding it, and they
        replace the placeholders' text embeddings. Every route is planned and copied to the device here, at the
        model's entry, before the layers run.

        zero3 (the tower partitioned by DeepSpeed ZeRO-3 over the data group): ZeRO-3's gathers are collectives
        over ranks holding other batches, so every rank runs the tower exactly twice per step, once per modality
        (images, videos), whatever its batch holds: a rank with nothing of a modality to encode runs one smallest
        item, a (1, m, m) grid of zero pixels, and keeps none of it (zero grads).

        every_step (ZeRO-3, or a replicated tower averaged over the data group beside FSDP2): the tower's backward
        collectives span the data group, so every rank runs encode_replicated once per modality whatever its batch
        holds (a missing one with nothing to encode: zero grads, the same all-reduces)."""
        comm, device = self.tsp.comm, self.device
        vision_dtype = next(self.visual.parameters()).dtype
        m = self.spatial_merge_size
        unit = torch.tensor([[1, m, m]], device="cpu")  # a host grid, like the ones routes are planned from
        v = self.config.vision_config
        width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        placeholder = (torch.zeros((m * m, width), dtype=vision_dtype, device=device), unit.to(device),
                       self._tower_inputs(unit, device)) if zero3 else None
        plans, absent = [], []
        if every_step:
            present = {field for *_, field in modalities}
            absent = [field for field in ("image_grid_thw", "video_grid_thw") if field not in present]
        for pixels, grid, tokens, field in modalities:
            grid = frame_items(grid)  # video frames are the items: one long video is shared by the ranks
            route = plan_vision_route(tokens, grid, self.spatial_merge_size, padded_len, comm.size, comm.rank,
                                      field=field)
            (first, end), (lo, hi) = route.items, route.patches
            part = ((pixels[lo:hi].to(device=device, dtype=vision_dtype), grid[first:end].to(device),
                     self._tower_inputs(grid[first:end], device)) if route.encodes else None)
            plans.append((part, route.send_order.to(device), route.local_index.to(device), route))

        def encoder(part):
            def encode():
                if part is None:
                    return None
                out = self.visual(part[0], grid_thw=part[1], **part[2])
                # Qwen3-VL: the DeepStack features ride along as more columns of the same rows
                return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1) if self.deepstack \
                    else out.pooler_output
            return encode

        added = []  # (DeepStack rows [n, k, h], their local index) per modality

        def embeds(h):
            hidden = h.shape[-1]
            empty = torch.zeros((0, hidden * (1 + self.deepstack)), dtype=vision_dtype, device=device)
            stand_in = None if placeholder is None else encoder(placeholder)
            for _ in absent:  # the modality the batch lacks still runs encode_replicated once (docstring)
                h = h + encode_replicated(self.visual, encoder(None), empty, comm, placeholder=stand_in,
                                          data_group=self.tower_data_group).sum()
            for part, send_order, local_index, route in plans:
                encoded = encode_replicated(self.visual, encoder(part), empty, comm, placeholder=stand_in,
                                            data_group=self.tower_data_group)
                rows = all_to_all_rows(encoded[send_order], comm, route.in_splits, route.out_splits)
                h = scatter_vision_rows(h, rows[:, :hidden], local_index)
                if self.deepstack:
                    added.append((rows[:, hidden:].reshape(-1, self.deepstack, hidden), local_index))
            return h

        def after_layer(i, h):
            if i >= self.deepstack:
                return h
            B, L, hidden = h.shape
            flat = h.reshape(B * L, hidden)
            for rows, local_index in added:
                flat = flat.index_add(0, local_index, rows[:, i].to(h.dtype))
            return flat.view(B, L, hidden)

        return embeds, after_layer if self.deepstack else None

    def _tower_inputs(self, grid: torch.Tensor, device) -> dict:
        """What transformers' vision tower derives from its grid by host reads, computed here on the host with its
        own helpers and handed to it precomputed (its kwargs): patch positions, attention segments, position-table
        interpolation. (Its sdpa path still splits the segments by one host read per block.)"""
        from transformers import vision_utils

        grid, visual = grid.cpu(), self.visual
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.spatial_merge_size)
        cu_seqlens = vision_utils.get_vision_cu_seqlens(grid)
        return {"interp_indices": indices.to(device), "interp_weights": weights.to(device),
                "position_ids": vision_utils.get_vision_position_ids(grid, visual.spatial_merge_size).to(device),
                "cu_seqlens": cu_seqlens.to(device), "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max())}

    def _check_call(self, args, kwargs, input_ids, labels, position_ids, pixel_values, image_grid_thw,
                    pixel_values_videos, video_grid_thw, logits_to_keep) -> None:
        if args:
            raise TSPConfigError(f"TSPForConditionalGeneration.forward got {1 + len(args)} positional arguments: "
                                 "pass everything after input_ids by keyword (model(**batch))")
        for key, value in kwargs.items():
            if key == "tsp_shard":
                raise TSPConfigError("tsp_shard=: TSPForConditionalGeneration takes the processor's full batch on "
                                     "every TSP rank (TSPDataLoader shards are not supported for multimodal models)")
            if key not in _HARMLESS_KWARGS or not any(value is v or value == v for v in _HARMLESS_KWARGS[key]):
                raise TSPConfigError(f"{key}= is not supported by TSPForConditionalGeneration.forward; accepted: "
                                     "input_ids, labels, attention_mask, pixel_values, image_grid_thw, "
                                     "mm_token_type_ids, logits_to_keep, num_items_in_batch")
        if input_ids is None or input_ids.dim() != 2:
            raise TSPConfigError("input_ids [batch, seq] is required (inputs_embeds is not supported: the "
                                 "embedding is sharded)")
        if position_ids is not None and position_ids.dim() != 2:
            raise TSPConfigError(f"position_ids with {position_ids.dim()} dims: TSPForConditionalGeneration computes "
                                 "the multimodal (3-row) positions itself by transformers' get_rope_index rule; pass "
                                 "[batch, seq] text positions (restarting at 0 per packed document) or none")
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw come together (the processor returns both)")
        if (pixel_values_videos is None) != (video_grid_thw is None):
            raise ValueError("pixel_values_videos and video_grid_thw come together (the processor returns both)")
        if labels is None and not logits_to_keep:
            raise TSPConfigError("pass labels for the loss, or logits_to_keep=k for the logits of the last k "
                                 "positions")

    # --- state --------------------------------------------------------------------------------------------------
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Collective: every weight (or its grad, grads=True) whole, under Qwen3_5ForConditionalGeneration's
        names."""
        view = _SaveView(self)
        out = {view._rename(k): v for k, v in self.tsp.full_state_dict(grads=grads).items()}
        for name, p in self.visual.named_parameters():
            t = p.grad if grads else p
            out[_VISION_PREFIX + name] = torch.zeros_like(p) if t is None else t.detach().clone()
        return out

    def save_pretrained(self, save_directory: str | Path, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None, **kwargs) -> Path | None:
        """Collective: the Qwen3_5ForConditionalGeneration layout (config.json, safetensors) that plain transformers
        loads, written by global rank 0. Returns the directory there, None elsewhere."""
        import copy

        from ds_tsp.checkpoint.hf.save import save_streaming

        unsupported = {k for k, v in kwargs.items() if not (k == "safe_serialization" and v)}
        if unsupported:
            raise TSPConfigError(f"save_pretrained: {', '.join(sorted(unsupported))} not supported")
        dtype = dtype or self.dtype
        config = copy.deepcopy(self.config)
        config.architectures = [ARCHITECTURES[config.model_type]]
        config.dtype = dtype
        return save_streaming(_SaveView(self), save_directory, config.to_json_string(use_diff=False),
                              max_shard_size=max_shard_size, dtype=dtype)

    def extra_repr(self) -> str:
        return f"model_type={self.config.model_type}, tsp={self.tsp.comm.size}"
