"""Which TSP parameters train: `requires_grad` of an in-memory HF (or PEFT) model carried to the shards.

A TSP shard packs several HF tensors (a layer's q/k/v/o weights and biases in one attention shard, gate/up/down in
one MLP shard), and `requires_grad` belongs to the whole parameter. So a shard trains iff its HF tensors train, and
a shard whose tensors disagree cannot be honoured exactly: the frozen ones would still move under AdamW (weight
decay, or momentum from the trainable ones). That case is one error naming the tensors and the fix.

PEFT wraps the model (`base_model.model.` prefix) and each targeted linear (`q_proj.base_layer.weight`); `hf_name`
maps those names back to the plain transformers ones, so an optimizer built on a PeftModel's parameters, or a
PeftModel handed to a conversion, meets the names the checkpoint protocol knows.

A mixture-of-experts model in memory names its weights otherwise than its checkpoint does: experts fused into
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, Mixtral's block under `mlp.` where its checkpoint (and
ds_tsp's shards) say `block_sparse_moe.`. `checkpoint_names` translates with ds_tsp.checkpoint.hf.moe_names' aliases,
so a frozen expert block or router is found, never silently trained; an HF parameter no TSP parameter holds is an
error naming it.
"""
from __future__ import annotations

import re

from torch import nn

from ds_tsp.checkpoint.hf.moe_names import aliases
from ds_tsp.core.errors import TSPConfigError

_PEFT_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # lora_A.<adapter>.weight -> lora_A.weight


def hf_name(name: str) -> str:
    """The transformers name of a parameter of a transformers or PEFT model (LoRA factors: PEFT's saved key
    without the `base_model.model.` prefix, e.g. model.layers.0.self_attn.q_proj.lora_A.weight)."""
    return _ADAPTER_KEY.sub(r".\1.weight", name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."))


def base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """HF name -> parameter of the model's base weights (LoRA factors left out; tied weights under both names)."""
    return {hf_name(n): p for n, p in model.named_parameters(remove_duplicate=False)
            if not _ADAPTER_KEY.search(n)}


def checkpoint_names(shapes: dict[str, tuple[int, ...]], moe_family: str | None) -> dict[str, list[str]]:
    """HF name (in-memory layout) -> the checkpoint names ds_tsp's shards use for what it holds: itself, or for a
    fused MoE tensor every expert's tensors it holds (Mixtral's router under block_sparse_moe.). shapes: HF name ->
    shape of the names to translate; moe_family: ModelShape.moe_family (None: names are already canonical)."""
    out = {name: [] for name in shapes}
    for canonical, source in aliases(moe_family, shapes).items():
        out[source.name].append(canonical)
    return {name: held or [name] for name, held in out.items()}


def load_hf_model(core: nn.Module, hf_model: nn.Module, state_dict: dict | None = None) -> nn.Module:
    """Fill `core` (a ShardedCausalLM) from an in-memory transformers or PEFT LoRA model: this rank's slices of its
    base weights (or of `state_dict`, HF names, when given), their requires_grad, and the LoRA adapter. Returns the
    transformers model under a PEFT wrapper (the model itself otherwise)."""
    from ds_tsp.model.peft.lora import adapter_config_json, attach_lora, peft_adapter

    peft = peft_adapter(hf_model)  # (base model, adapter name, LoraConfig) of a PEFT LoRA model; None otherwise
    base = peft[0] if peft else hf_model
    if getattr(getattr(base, "config", None), "model_type", None) in ("qwen3_5", "qwen3_5_moe", "gemma4"):
        raise TSPConfigError(
            f"{type(base).__name__} (a multimodal model) in memory: TSP trains its language model; save it "
            "(save_pretrained) and pass the checkpoint directory, which loads as the language model by slices, or "
            "load the text-only ForCausalLM model")
    params = base_parameters(base)
    if state_dict is None:  # the parameters, and the buffers the checkpoint carries (GLM-4.5's router bias)
        wanted = core.replicated_buffers()
        state_dict = {n: p.detach() for n, p in params.items()}
        state_dict.update({hf_name(n): b for n, b in base.named_buffers() if hf_name(n) in wanted})
    core.load_full_state_dict(state_dict)
    carry_requires_grad(core.sharded_modules(), core.replicated_params(), params, core.shape.moe_family)
    if peft:
        attach_lora(core, base, peft[1])
        core.lora_adapter_config = adapter_config_json(peft[2], getattr(base, "name_or_path", None))
    return base


def carry_requires_grad(sharded, replicated: dict[str, nn.Parameter], source: dict[str, nn.Parameter],
                        moe_family: str | None = None, held_elsewhere: set[str] = frozenset()) -> None:
    """Set requires_grad of every TSP parameter from the HF parameters it holds a part of.

    sharded: (HF prefix, sharded piece, its parameter) as ShardedCausalLM.sharded_modules() lists them;
    replicated: HF name -> parameter; source: HF name -> the HF parameter (base_parameters), in the checkpoint or
    the in-memory layout (MoE names translated with moe_family's aliases); held_elsewhere: checkpoint names TSP
    parameters of other pipeline stages hold. An HF parameter no TSP parameter holds, or a TSP parameter none of
    whose HF tensors is in `source`, is an error naming it: its flag would be lost.
    """
    held = checkpoint_names({n: tuple(p.shape) for n, p in source.items()}, moe_family)
    by_checkpoint_name = {c: source[n] for n, names in held.items() for c in names}
    wanted = {prefix + n for prefix, module, _ in sharded for n in module.hf_shapes()} | set(replicated)
    anywhere = wanted | set(held_elsewhere)
    kept = {id(by_checkpoint_name[n]) for n in anywhere if n in by_checkpoint_name}
    orphans = [n for n, names in held.items() if not anywhere.intersection(names) and id(source[n]) not in kept]
    if orphans:  # (a tied lm_head.weight IS the embedding parameter: kept through it)
        raise TSPConfigError(f"{orphans[0]} ({len(orphans)} HF parameters) has no TSP counterpart, so its "
                             f"requires_grad={source[orphans[0]].requires_grad} cannot be carried over: convert a "
                             "transformers model of a supported family, unmodified")
    for prefix, module, param in sharded:
        names = [prefix + n for n in module.hf_shapes()]
        absent = [n for n in names if n not in by_checkpoint_name]
        if absent:
            raise TSPConfigError(f"{absent[0]} ({len(absent)} tensors of {prefix.rstrip('.')}) is not a parameter of "
                                 "the HF model converted: its requires_grad is unknown; convert the model the config "
                                 "came from, unmodified")
        frozen = [n for n in names if not by_checkpoint_name[n].requires_grad]
        if frozen and len(frozen) < len(names):
            trainable = [n for n in names if by_checkpoint_name[n].requires_grad]
            raise TSPConfigError(
                f"{prefix.rstrip('.')}: {_in_memory(frozen, held)} frozen but {_in_memory(trainable, held)} "
                "trainable. TSP packs a layer's attention weights (q/k/v/o and their biases) into one shard per "
                "rank, its MLP weights (gate/up/down) into another, a mixture-of-experts layer's experts into "
                "one and a Gated DeltaNet's in_proj_*, conv1d, A_log, dt_bias and out_proj into one, so they "
                "train or freeze together: freeze or unfreeze the whole "
                f"{prefix.rstrip('.')} (e.g. `for p in layer.{_module_of(prefix)}.parameters(): "
                "p.requires_grad_(False)`), or train a subset with LoRA (peft) instead")
        param.requires_grad_(not frozen)
    absent = [n for n in replicated if n not in by_checkpoint_name]
    if absent:
        raise TSPConfigError(f"{absent[0]} ({len(absent)} replicated parameters) is not a parameter of the HF model "
                             "converted: its requires_grad is unknown; convert the model the config came from")
    for name, param in replicated.items():
        param.requires_grad_(by_checkpoint_name[name].requires_grad)


def _module_of(prefix: str) -> str:
    """The module a shard's HF prefix names, as a decoder layer's attribute path (an MoE shard's prefix is the
    layer's own: its experts)."""
    last = prefix.split(".")[-2]
    return "mlp.experts" if last.isdigit() else last


def _in_memory(names: list[str], held: dict[str, list[str]]) -> str:
    """The HF parameter names (in-memory layout, each once) holding these checkpoint names, for error messages."""
    where = {c: n for n, cs in held.items() for c in cs}
    return ", ".join(dict.fromkeys(where.get(n, n) for n in names))
