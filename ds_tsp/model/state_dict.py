"""The sharded-piece protocol of a TSP model: its tensors named as the HF checkpoint names them, and how each rank
reads, initialises and gathers its shards of them.

A model answers it by holding `self.model` (embed_tokens, layers, norm), `self.lm_head` (None: no LM head),
`self.comm` and `self.shape`, and inheriting ShardedStateDict. Checkpoint code (ds_tsp.checkpoint) and the
conversions use only these methods, never the model classes:
    sharded_modules()    (HF prefix, piece with hf_slices / pack_slices / unshard, its parameter), checkpoint order
    replicated_params()  HF-named parameters every rank holds whole (norms, routers)
    replicated_buffers() HF-named buffers the checkpoint carries, every rank whole (GLM-4.5's router bias, Gemma 4's
                         layer scalars)
    lora_tensors()       PEFT-named LoRA factors and how each is cut
    hf_shapes()          every HF tensor's full shape
    load_slices() / load_full_state_dict() / full_state_dict() / init_weights_() / num_parameters()
"""
from __future__ import annotations

import zlib
from math import prod

import torch
from torch import nn

from ds_tsp.checkpoint.hf.moe_names import canonical_state_dict
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.model.modules.slices import HFRanges
from ds_tsp.model.modules.vocab import TSPVocabShard

__all__ = ["ShardedStateDict", "gather_pieces", "load_slices", "read_from_full"]


class ShardedStateDict:
    """Mixin: the sharded-piece protocol over self.model / self.lm_head / self.comm / self.shape."""

    def sharded_modules(self) -> list[tuple[str, nn.Module, nn.Parameter]]:
        """(HF name prefix, module with hf_slices/pack_slices/unshard, its parameter), in checkpoint order."""
        out = [("model.embed_tokens.", self.model.embed_tokens, self.model.embed_tokens.vocab_shard)]
        if getattr(self.model, "per_layer_inputs", None) is not None:  # Gemma 4's per-layer input table
            out += self.model.per_layer_inputs.sharded_modules("model.")
        for i, layer in enumerate(self.model.layers):
            out += layer.sharded_modules(f"model.layers.{i}.")
        if self.lm_head is not None and not self.lm_head.tied:
            out.append(("lm_head.", self.lm_head, self.lm_head.vocab_shard))
        return out

    def replicated_params(self) -> dict[str, nn.Parameter]:
        """HF-named params every rank holds whole: the norms (and Qwen3's q/k norms)."""
        out = {}
        if getattr(self.model, "per_layer_inputs", None) is not None:
            out.update(self.model.per_layer_inputs.replicated_params("model."))
        for i, layer in enumerate(self.model.layers):
            out.update(layer.replicated_params(f"model.layers.{i}."))
        out["model.norm.weight"] = self.model.norm.weight
        return out

    def replicated_buffers(self) -> dict[str, torch.Tensor]:
        """HF-named buffers every rank holds whole that the checkpoint carries (GLM-4.5's e_score_correction_bias,
        Gemma 4's layer_scalar): read and saved with the parameters, no gradient."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            out.update(layer.replicated_buffers(f"model.layers.{i}."))
        return out

    def lora_tensors(self) -> list[tuple[str, nn.Parameter, tuple[int, tuple[int, ...]] | None]]:
        """(PEFT key less its base_model.model. prefix, this rank's LoRA factor, (dim, start of every TSP rank) when
        the factor is sharded or None when replicated) of every LoRA factor (ds_tsp.model.peft.lora); [] without
        LoRA."""
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
        # ZeRO-3 empties a partitioned parameter's .data and keeps its whole shape aside (ds_shape)
        shapes.update({name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in self.replicated_params().items()})
        shapes.update({name: tuple(b.shape) for name, b in self.replicated_buffers().items()})
        return shapes

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False,
                       per_rank: bool = False) -> int:
        """Parameters of the FULL model, as transformers (and peft, LoRA factors included) count them;
        per_rank=True counts this rank's storage."""
        if per_rank:
            return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)
        buffers = self.replicated_buffers()
        shapes = {k: v for k, v in self.hf_shapes().items() if k not in buffers}
        if only_trainable:  # a shard trains iff every HF tensor in it does (ds_tsp.model.trainability)
            live = {prefix + n for prefix, module, p in self.sharded_modules() if p.requires_grad
                    for n in module.hf_shapes()}
            live |= {n for n, p in self.replicated_params().items() if p.requires_grad}
            shapes = {k: v for k, v in shapes.items() if k in live}
        if exclude_embeddings:  # transformers drops nn.Embedding weights only: an untied lm_head (a Linear) counts
            shapes = {k: v for k, v in shapes.items() if not k.startswith("model.embed_tokens.")}
        lora = sum(p.numel() if cut is None else p.numel() // p.shape[cut[0]] * (max(cut[1]) + p.shape[cut[0]])
                   for _, p, cut in self.lora_tensors() if p.requires_grad or not only_trainable)
        return sum(prod(v) for v in shapes.values()) + lora

    @torch.no_grad()
    def init_weights_(self, seed: int = 0, std: float = 0.02) -> "ShardedStateDict":
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
                is_bias = piece.startswith("b") or piece in ("gate_up_bias", "down_bias")  # GPT-OSS's experts
                views[piece].copy_(torch.zeros(shape) if is_bias else normal(f"{name}{piece}{owner}", shape))
        # norms 1 (zero-centred norms 0: the same identity scale); MoE routers N(0, std), same on every rank; biases
        # (GPT-OSS's o_proj and router biases) 0
        norm_init = 0.0 if self.shape.zero_centred_norms else 1.0
        for name, param in self.replicated_params().items():
            if name.endswith(".bias"):
                param.zero_()
            else:
                param.fill_(norm_init) if param.dim() == 1 else param.copy_(normal(name, param.shape))
        return self

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Take this rank's shards from an HF-named full state dict (every rank passes the same dict): the checkpoint
        layout or an in-memory model's (MoE experts fused, ds_tsp.checkpoint.hf.moe_names)."""
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
        load_slices(self.sharded_modules(), {**self.replicated_params(), **self.replicated_buffers()}, read_into)

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Collective: gather every shard into HF-named full tensors (params, or their .grad with grads=True)."""
        full = gather_pieces(self.sharded_modules(), self.replicated_params(), self.comm, grads=grads)
        if not grads:
            full.update({k: b.detach().clone() for k, b in self.replicated_buffers().items()})
        if self.lm_head is not None and self.lm_head.tied:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        return full


@torch.no_grad()
def gather_pieces(sharded: list[tuple[str, nn.Module, nn.Parameter]], replicated: dict[str, nn.Parameter], comm,
                  grads: bool = False) -> dict[str, torch.Tensor]:
    """Collective over comm: the pieces (a model's, or one pipeline stage's) gathered one tensor at a time into
    HF-named full tensors; their .grad with grads=True (zeros where a parameter has none)."""
    def value(param):
        t = param.grad if grads else param
        return torch.zeros_like(param) if t is None else t.detach()

    full = {}
    for prefix, module, param in sharded:
        local = value(param).contiguous()
        if comm.size > 1:
            gathered = torch.empty((comm.size, *local.shape), dtype=local.dtype, device=local.device)
            comm.all_gather(gathered, local).wait()
            shards = list(gathered.unbind(0))
        else:
            shards = [local]
        full.update({prefix + k: v for k, v in module.unshard(shards).items()})
    full.update({k: value(p).clone() for k, p in replicated.items()})
    return full


@torch.no_grad()
def load_slices(sharded: list[tuple[str, nn.Module, nn.Parameter]], replicated: dict[str, nn.Parameter],
                read_into) -> None:
    """Fill every shard with read_into(hf_name, dim, start, length, out): copy that slice into `out`, a view of the
    parameter (dim None: the whole tensor). Only this rank's slices are requested, and they land in place."""
    for prefix, module, param in sharded:
        targets = module.hf_targets(param.data)
        for name, where in module.hf_slices().items():
            if isinstance(where, HFRanges):  # several ranges of one tensor, one view each
                for (dim, start, length), out in zip(where, targets[name], strict=True):
                    read_into(prefix + name, dim, start, length, out)
                continue
            dim, start, length = where
            read_into(prefix + name, dim, start, length, targets[name])
    for name, param in replicated.items():
        read_into(name, None, 0, None, param.data)


def read_from_full(full: dict[str, torch.Tensor]):
    """A read_into for load_slices over an HF-named full state dict."""
    def read_into(name, dim, start, length, out):
        out.copy_(full[name] if dim is None else full[name].narrow(dim, start, length))

    return read_into
