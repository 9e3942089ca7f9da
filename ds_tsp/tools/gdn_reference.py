"""transformers' Gated DeltaNet (Qwen3.5 / Qwen3-Next) as a float64 reference, and packed documents run one by one.

transformers narrows the layer to float32 in four places: the gate `g = -A_log.float().exp() * softplus(a.float() +
dt_bias)`, the chunked / recurrent delta rule (`.to(torch.float32)` of q, k, v, beta, g), and the gated RMSNorm
(`hidden_states.to(torch.float32)`, `gate.to(torch.float32)`). `float64_gated_deltanet_` rebuilds those functions
from transformers' OWN source text with the float32 casts widened to float64 and binds them to one module instance
(nothing global changes; other instances keep transformers' code). The text is read from the installed modeling
file, so the reference follows transformers' code, not a copy of it.

transformers' pure-torch path ignores `cu_seq_lens` (only the flash-linear-attention kernels honour it), so
`reference_with_documents` runs each packed document as its own sequence (state and conv start from zero at every
document start): what the kernels compute with cu_seqlens.
"""
from __future__ import annotations

import ast
import functools
import importlib
import types
from collections.abc import Sequence

import torch

_FAMILIES = {"Qwen3_5GatedDeltaNet": "transformers.models.qwen3_5.modeling_qwen3_5",
             "Qwen3NextGatedDeltaNet": "transformers.models.qwen3_next.modeling_qwen3_next",
             "Qwen3_5MoeGatedDeltaNet": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"}


def _widen(text: str) -> str:
    return text.replace("torch.float32", "torch.float64").replace(".float()", ".double()")


@functools.lru_cache(maxsize=None)
def _widened(module_name: str) -> dict:
    """{name: function} of the module's delta rules, gated-norm forward and layer forward, rebuilt from its source
    with float32 widened to float64 (decorators dropped: they only route to hub kernels)."""
    mod = importlib.import_module(module_name)
    with open(mod.__file__, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    wanted = {"torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"}
    namespace = dict(vars(mod))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            exec(compile(_widen(ast.get_source_segment(source, node)), mod.__file__, "exec"), namespace)
            found[node.name] = namespace[node.name]
        if isinstance(node, ast.ClassDef) and node.name.endswith(("GatedDeltaNet", "RMSNormGated")):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    text = "\n".join(line[4:] for line in ast.get_source_segment(source, item, padded=True)
                                     .splitlines())
                    local: dict = {}
                    exec(compile(_widen(text), mod.__file__, "exec"), namespace, local)
                    found[f"{node.name}.forward"] = local["forward"]
    missing = wanted - set(found)
    if missing:
        raise RuntimeError(f"{module_name} has no {sorted(missing)}: transformers changed; update gdn_reference")
    return found


def float64_gated_deltanet_(module: torch.nn.Module) -> torch.nn.Module:
    """Make one Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet instance compute float64 end to end (in place)."""
    cls = type(module).__name__
    if cls not in _FAMILIES:
        raise TypeError(f"float64_gated_deltanet_ takes {sorted(_FAMILIES)}, got {cls}")
    fns = _widened(_FAMILIES[cls])
    module.forward = types.MethodType(fns[f"{cls}.forward"], module)
    module.norm.forward = types.MethodType(fns[f"{type(module.norm).__name__}.forward"], module.norm)
    return module


def reference_with_documents(module: torch.nn.Module, x: torch.Tensor,
                             doc_starts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """module(x) with every packed document of every row run as its own sequence (fresh state and conv).

    x: [B, S, hidden]; doc_starts: per row, the token indices where documents start (beginning with 0), or None
    for one document per row."""
    if doc_starts is None:
        return module(x)
    rows = []
    for b, starts in enumerate(doc_starts):
        ends = list(starts[1:]) + [x.shape[1]]
        rows.append(torch.cat([module(x[b:b + 1, s:e]) for s, e in zip(starts, ends)], dim=1))
    return torch.cat(rows, dim=0)
