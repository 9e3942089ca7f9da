"""PEFT LoRA on TSP shards: the base weights stay packed, sharded and frozen; the adapter's delta is folded into the
shard each autograd Function streams, so the hand-written backward needs no change.

For a targeted linear W [out, in] PEFT computes y = x W^T + s * (x A^T) B^T (A [r, in], B [out, r], s = lora_alpha
/ r, or / sqrt(r) with use_rslora): the effective weight is W + s * B @ A. A rank owns a slice of W (the base
piece's hf_slices), and holds the factors so that its slice of the delta needs no communication:

| base slice of this rank                        | sharded factor (1/D)   | replicated factor            | delta   |
|------------------------------------------------|------------------------|------------------------------|---------|
| rows: q/k/v_proj, gate/up_proj (dim 0)         | B rows of the slice    | A [r, in]                    | s B_p A |
| columns: o_proj, down_proj (dim 1)             | A columns of the slice | B [out, r]                   | s B A_p |
| several row ranges: Gated DeltaNet in_proj_qkv | none                   | A [r, in] and B [out, r]     | s B_p A |

Gated DeltaNet layers (ds_tsp.model.modules.gated_deltanet) take LoRA on their linears the same way: in_proj_z /
_b / _a, Qwen3-Next's in_proj_qkvz / in_proj_ba (rows of the rank's heads) and out_proj (its columns). Qwen3.5's
in_proj_qkv gives a rank three row ranges (its q, k and v heads); there both factors stay whole on every rank (B
is [out, r]: small) and B_p is those rows of B, so the local part of B's gradient is zero outside them and the
replicated factor's group sum below is exact.

`ShardLoRA(base)` returns base + the packed deltas as one differentiable tensor, marked so the Function rebuilds it
in backward from the base and the factors instead of keeping this second copy of the shard (core.functions.
shard_rebuild). The Function's backward hands the
owner its shard's gradient G_p, already summed over the TSP group, and autograd turns it into s G_p A^T (B_p) or
s B^T G_p (A_p) locally; the replicated factor's local part s B_p^T G_p (or s G_p A_p^T) is one rank's share of
its gradient, so it is summed over the TSP group like the norm weights' (comm.replicated_param, bucketed).
Shared kv heads (num_kv_heads < D): as for the base weights, only the kv group leader's B copy is read and trained.
Only vanilla LoRA is exact here; every other PEFT option or method is refused by name (check_peft_model).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re

import torch
from torch import nn

from ds_tsp.core.comm.primitives import replicated_param
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.grads.clip import mark_sharded
from ds_tsp.core.layers.shard_rebuild import attach_rebuild
from ds_tsp.model.modules.attention import TSPAttention
from ds_tsp.model.modules.gated_deltanet import TSPGatedDeltaNet
from ds_tsp.model.modules.mlp import TSPGatedMLP
from ds_tsp.model.modules.slices import HFRanges
from ds_tsp.model.peft.lora_moe import check_no_expert_lora

TARGETS = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
                     r"linear_attn\.(in_proj_(qkv|z|b|a|qkvz|ba)|out_proj))$")
# LoraConfig fields that may differ from their defaults: bookkeeping, which modules get LoRA and with which rank
# and alpha (read per module from the layers themselves, so rank_pattern / alpha_pattern / use_rslora are exact),
# and options that only act on targets refused anyway (fan_in_fan_out: Conv1D; ensure_weight_tying: embeddings).
_ALLOWED_FIELDS = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                   "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout",
                   "use_rslora", "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern",
                   "alpha_pattern", "runtime_config", "megatron_core", "qalora_group_size", "fan_in_fan_out",
                   "ensure_weight_tying"}
_PLAIN_INITS = (True, False, "gaussian")  # random or zero starts; the others rewrite the base weights


class LoRAFactors(nn.Module):
    """One targeted linear's factors as this rank holds them: lora_A [r, in] and lora_B [out, r], one of them cut
    along `dim` (the base slice's dim: 0 cuts B's rows, 1 cuts A's columns) at `starts[rank]`. `rows` (the base
    slice is several row ranges (start, length)): both factors whole, the delta uses those rows of B."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dim: int, starts: tuple[int, ...],
                 rows: tuple[tuple[int, int], ...] | None = None):
        super().__init__()
        self.lora_A, self.lora_B = nn.Parameter(lora_a), nn.Parameter(lora_b)
        self.scaling, self.dim, self.starts, self.rows = float(scaling), dim, tuple(starts), rows
        self.sharded = None if rows is not None else "lora_B" if dim == 0 else "lora_A"
        if self.sharded is not None:
            mark_sharded(getattr(self, self.sharded))

    def keep_initial(self) -> None:
        """Frozen copies of the factors as they are now, what initial=True reads (DPO's reference adapter: TRL's
        "ref" copy of a PEFT model's adapter). Non-persistent buffers: outside the state dict, the optimizer and
        the saved adapter, but moved and cast with the module."""
        self.register_buffer("initial_A", self.lora_A.detach().clone(), persistent=False)
        self.register_buffer("initial_B", self.lora_B.detach().clone(), persistent=False)

    def forward(self, comm, initial: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this rank's slice of the delta s * B @ A, and detached A, B as it used them). A module call, so ZeRO-3
        gathers the factors; the detached aliases keep the values backward rebuilds the shard from even after
        ZeRO-3 releases the parameters (factor-sized; without ZeRO-3 they share the parameters' storage).
        initial=True: the frozen copies of keep_initial instead (no gradient; a replicated one is the same on every
        rank, as the factor was when copied)."""
        if initial:
            a, b = self.initial_A, self.initial_B
        else:
            a = self.lora_A if self.sharded == "lora_A" else replicated_param(self.lora_A, comm)
            b = self.lora_B if self.sharded == "lora_B" else replicated_param(self.lora_B, comm)
        if self.rows is not None:  # this rank's rows of the whole B, in the packed shard's order
            b = torch.cat([b.narrow(0, start, length) for start, length in self.rows])
        return _delta(a, b, self.scaling), a.detach(), b.detach()

    def extra_repr(self) -> str:
        return f"r={self.lora_A.shape[0]}, scaling={self.scaling}, sharded={self.sharded}"


class ShardLoRA(nn.Module):
    """The LoRA factors of one packed shard (a layer's attention, MLP or Gated DeltaNet)."""

    def __init__(self, piece: TSPAttention | TSPGatedMLP | TSPGatedDeltaNet, factors: dict[str, LoRAFactors]):
        super().__init__()
        for proj, f in factors.items():  # registered by projection name: parameters read like PEFT's (q_proj.lora_A)
            self.add_module(proj, f)
        self.layout, self.comm = piece.spec.layout, piece.comm
        self.targets = {key: name[:-len(".weight")] for key, name in piece.PIECES.items()
                        if name.endswith(".weight") and name[:-len(".weight")] in factors}
        self.mode = "on"  # ADAPTER_MODES; set by adapter_mode()

    def forward(self, base: torch.Tensor) -> torch.Tensor:
        """base + this rank's packed LoRA deltas (differentiable in the factors; in base's dtype). The result is a
        fresh shard-sized tensor: it carries a rebuild recipe (ds_tsp.core.layers.shard_rebuild), so the
        attention / MLP Function saves the base parameter and the factors, not this second copy of the shard, and
        merges again in backward (the same ops on the same values: bit for bit the forward's shard).
        mode "off": the base parameter itself (PEFT's disable_adapter); "initial": the deltas of the factors'
        frozen copies (LoRAFactors.keep_initial)."""
        if self.mode == "off":
            return base
        deltas, factors, plan = {}, [], []
        for key, _ in self.layout.pieces:
            proj = self.targets.get(key)
            if proj is not None:
                f = getattr(self, proj)
                deltas[key], a, b = f(self.comm, initial=self.mode == "initial")
                factors += [a, b]
                plan.append((key, f.scaling))
        merged = _merge(self.layout, base, deltas)
        device = base.device.type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) \
            if torch.amp.is_autocast_available(device) else None
        rebuild = functools.partial(_rebuild, self.layout, tuple(plan), autocast)
        return attach_rebuild(merged, rebuild, base, *factors)


ADAPTER_MODES = ("on", "off", "initial")


def lora_pieces(core: nn.Module) -> list[ShardLoRA]:
    """Every ShardLoRA of `core` (a ShardedCausalLM), in module order; [] without LoRA."""
    return [piece.lora for _, piece, _ in core.sharded_modules() if getattr(piece, "lora", None) is not None]


def keep_initial_adapter(core: nn.Module) -> None:
    """Frozen copies of every LoRA factor of `core` as it is now, for adapter_mode(core, "initial")."""
    for lora in lora_pieces(core):
        for f in lora.children():
            f.keep_initial()


@contextlib.contextmanager
def adapter_mode(core: nn.Module, mode: str):
    """Within: every LoRA adapter of `core` off (the frozen base weights, as PEFT's disable_adapter computes) or
    at its keep_initial copy ("initial"); back on after. The same forward otherwise: nothing is rebuilt, and the
    base shards stay shared with the trained model."""
    if mode not in ADAPTER_MODES:
        raise TSPConfigError(f"adapter_mode({mode!r}): one of {ADAPTER_MODES}")
    pieces = lora_pieces(core)
    if mode == "initial" and any(not hasattr(f, "initial_A") for lora in pieces for f in lora.children()):
        raise TSPConfigError("adapter_mode('initial') before keep_initial_adapter(): no copy of the initial adapter")
    for lora in pieces:
        lora.mode = mode
    try:
        yield
    finally:
        for lora in pieces:
            lora.mode = "on"


def _delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return (b @ a).mul(scaling)


def _merge(layout, base: torch.Tensor, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
    """The packed shard with each targeted piece's delta added (in base's dtype), one flat tensor."""
    views = layout.unpack(base)
    return torch.cat([(views[key] if key not in deltas else views[key] + deltas[key].to(base.dtype)).reshape(-1)
                      for key, _ in layout.pieces])


def _rebuild(layout, plan: tuple, autocast, base: torch.Tensor, *factors: torch.Tensor) -> torch.Tensor:
    """ShardLoRA.forward's merged shard again, from the saved base and factors, under forward's autocast state
    (the delta GEMM would otherwise round differently): the same values bit for bit."""
    device = base.device.type
    state = torch.autocast(device, enabled=autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
    with state:
        deltas = {key: _delta(factors[2 * i], factors[2 * i + 1], scaling) for i, (key, scaling) in enumerate(plan)}
        return _merge(layout, base, deltas)


# --- from a PEFT model ----------------------------------------------------------------------------------------------
def peft_adapter(model) -> tuple[nn.Module, str, object] | None:
    """(base transformers model, adapter name, LoraConfig) of a PEFT model TSP can train exactly; None for a plain
    model. Every option or method not implemented exactly is one TSPConfigError naming it."""
    if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
        return None
    configs = dict(model.peft_config)
    if len(configs) != 1:
        raise TSPConfigError(f"the PEFT model has {len(configs)} adapters ({', '.join(configs)}): TSP trains one; "
                             "delete the others (model.delete_adapter) before converting")
    adapter, config = next(iter(configs.items()))
    method = str(getattr(config.peft_type, "value", config.peft_type))
    if method != "LORA":
        raise TSPConfigError(f"PEFT method {method} ({type(config).__name__}) is not supported under TSP: only LoRA "
                             "(LoraConfig) is")
    check_no_expert_lora(model.get_base_model(), config, adapter)  # before the generic checks: named for MoE
    _check_lora_config(config)
    base = model.get_base_model()
    for name, module in base.named_modules():
        if hasattr(module, "lora_A") and adapter in getattr(module, "r", {}):
            _check_lora_layer(name, module, adapter)
    return base, adapter, config


def _check_lora_config(config) -> None:
    if config.lora_dropout:
        raise TSPConfigError(f"LoraConfig(lora_dropout={config.lora_dropout}): dropout on the LoRA input is not "
                             "supported under TSP (the delta is folded into the weight shard); use lora_dropout=0")
    if config.bias != "none":
        raise TSPConfigError(f"LoraConfig(bias={config.bias!r}) is not supported under TSP: use bias='none'")
    if config.init_lora_weights not in _PLAIN_INITS:
        raise TSPConfigError(f"LoraConfig(init_lora_weights={config.init_lora_weights!r}) is not supported under "
                             "TSP (it rewrites the base weights, which a saved adapter would not carry): use True, "
                             "False or 'gaussian'")
    for field in dataclasses.fields(config):
        if field.name in _ALLOWED_FIELDS or not field.init:
            continue
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        value = getattr(config, field.name)
        if value != default and not (isinstance(value, (dict, list, set)) and not value and not default):
            raise TSPConfigError(f"LoraConfig({field.name}={value!r}) is not supported under TSP: leave "
                                 f"{field.name} at its default ({default!r}); TSP implements plain LoRA (r, "
                                 "lora_alpha, use_rslora, target_modules of q/k/v/o and gate/up/down_proj)")


def _check_lora_layer(name: str, module: nn.Module, adapter: str) -> None:
    from peft.tuners.lora.layer import Linear

    if not TARGETS.match(name):
        fused = " (Phi-3's fused qkv_proj / gate_up_proj are not LoRA targets in this version; o_proj and down_proj " \
                "are)" if name.endswith(("qkv_proj", "gate_up_proj")) else ""
        raise TSPConfigError(f"LoRA on {name!r} is not supported under TSP{fused}: target only the decoder layers' "
                             "q/k/v/o_proj, gate/up/down_proj and the Gated DeltaNet's in_proj_* / out_proj "
                             "(target_modules)")
    what = None
    if type(module) is not Linear:
        what = f"a {type(module).__name__} LoRA layer"
    elif adapter in getattr(module, "lora_variant", {}):
        what = f"the LoRA variant {type(module.lora_variant[adapter]).__name__} (use_dora and the like)"
    elif module.merged_adapters or module.disable_adapters:
        what = "a merged or disabled adapter"
    elif module.lora_B[adapter].bias is not None or module.fan_in_fan_out:
        what = "lora_bias / fan_in_fan_out"
    elif not isinstance(module.lora_dropout[adapter], nn.Identity):
        what = "LoRA dropout"
    if what is not None:
        raise TSPConfigError(f"{name}: {what} is not supported under TSP (plain LoRA only)")


@torch.no_grad()
def attach_lora(core: nn.Module, base: nn.Module, adapter: str) -> int:
    """Give every sharded attention / MLP / Gated DeltaNet piece of `core` (a ShardedCausalLM) whose HF linears carry
    LoRA layers in `base` its ShardLoRA: this rank's slices of the factors as TSP rank 0 holds them (collective over
    the TSP group), requires_grad as in PEFT. Returns the pieces adapted."""
    modules = dict(base.named_modules())
    comm, adapted = core.comm, 0
    for prefix, piece, shard in core.sharded_modules():
        if not isinstance(piece, (TSPAttention, TSPGatedMLP, TSPGatedDeltaNet)):
            continue
        factors = {}
        for name, where in piece.hf_slices().items():
            proj = name[:-len(".weight")]
            layer = modules.get(prefix + proj)
            if not name.endswith(".weight") or layer is None or not hasattr(layer, "lora_A"):
                continue
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            full_a, full_b = (t.detach().to(shard.device, copy=True).contiguous() for t in (a, b))
            if comm.size > 1:  # PEFT draws lora_A at random: ranks that did not seed alike must not disagree
                for t in (full_a, full_b):
                    comm.broadcast(t, src=0, what=f"{prefix}{proj} LoRA factor").wait()
            if isinstance(where, HFRanges):  # row ranges (in_proj_qkv: q, k, v heads): both factors whole
                if any(dim != 0 for dim, _, _ in where):  # no such target today; B's rows are what ranges select
                    raise TSPConfigError(f"LoRA on {prefix}{proj}: its shard is column ranges, not supported")
                f = LoRAFactors(full_a.clone(), full_b.clone(), layer.scaling[adapter], 0, (),
                                rows=tuple((start, length) for _, start, length in where))
            else:
                dim, start, length = where
                starts = tuple(piece.hf_slices(rank)[name][1] for rank in range(comm.size))
                cut_a, cut_b = (full_a, full_b.narrow(0, start, length)) if dim == 0 else \
                    (full_a.narrow(1, start, length), full_b)
                f = LoRAFactors(cut_a.clone(), cut_b.clone(), layer.scaling[adapter], dim, starts)
            f.lora_A.requires_grad_(a.requires_grad)
            f.lora_B.requires_grad_(b.requires_grad)
            factors[proj] = f
        if factors:
            piece.lora = ShardLoRA(piece, factors)
            adapted += 1
    return adapted


def adapter_config_json(config, base_name_or_path: str | None = None) -> str:
    """adapter_config.json as PeftModel.save_pretrained writes it (sets as lists, inference_mode true)."""
    out = config.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = sorted(value)
    out["inference_mode"] = True
    if base_name_or_path and not out.get("base_model_name_or_path"):
        out["base_model_name_or_path"] = base_name_or_path
    return json.dumps(out, indent=2, sort_keys=True)
