"""Checkpoint names of mixture-of-experts weights: the layout transformers writes, and the others it reads.

ds_tsp's MoE modules speak ONE layout, the one `save_pretrained` of transformers 5 writes (one tensor per expert):

    Qwen3-MoE  model.layers.{l}.mlp.gate.weight [E, h]              mlp.experts.{i}.{gate,up,down}_proj.weight
    Mixtral    model.layers.{l}.block_sparse_moe.gate.weight [E, h]  block_sparse_moe.experts.{i}.{w1,w3,w2}.weight
    GLM-4.5    Qwen3-MoE's names, plus mlp.gate.e_score_correction_bias [E] (a buffer) and the shared experts'
               mlp.shared_experts.{gate,up,down}_proj.weight (Qwen3-Next / Qwen3.5-MoE: mlp.shared_expert.)

transformers also loads (and ds_tsp therefore accepts) the per-expert tensors under the other block prefix / names
(Mixtral's under `mlp.` too) and its fused in-memory layout (`mlp.experts.gate_up_proj` [E, 2F, h], gate = rows
[0, F), up = rows [F, 2F); `mlp.experts.down_proj` [E, h, F]; router `mlp.gate.weight`), which is also what an
in-memory model's state_dict holds. `Aliases` maps each canonical name to where it lives in a given set of names,
so loading reads only this rank's experts from any of these layouts.

GPT-OSS checkpoints hold every layer's experts fused, and that is its canonical layout (no aliases):

    GPT-OSS    model.layers.{l}.mlp.router.{weight [E, h], bias [E]}
               mlp.experts.gate_up_proj [E, h, 2F] (gate / up interleaved: columns 0::2 / 1::2),
               mlp.experts.gate_up_proj_bias [E, 2F], mlp.experts.down_proj [E, F, h], mlp.experts.down_proj_bias [E, h]
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_PROJ_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2"),
               "glm4_moe": ("gate_proj", "up_proj", "down_proj")}
_BLOCK = {"qwen3_moe": "mlp.", "mixtral": "block_sparse_moe.", "glm4_moe": "mlp.", "gpt_oss": "mlp."}
GPT_OSS_EXPERTS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
_WHICH = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}
_FUSED = re.compile(r"^(.*\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROUTER = re.compile(r"^(.*\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.gate\.weight$")


@dataclass(frozen=True)
class MoENames:
    """Canonical names (relative to `model.layers.{l}.`) of one family's MoE block."""

    family: str  # "qwen3_moe" | "mixtral" | "glm4_moe" | "gpt_oss"

    @property
    def block(self) -> str:
        return _BLOCK[self.family]

    def router(self) -> str:
        return f"{self.block}router.weight" if self.family == "gpt_oss" else f"{self.block}gate.weight"

    def router_bias(self) -> str:
        """GPT-OSS's router bias (the other families' routers have none)."""
        return f"{self.block}router.bias"

    def fused(self, which: str) -> str:
        """GPT-OSS: one tensor of every expert, which in GPT_OSS_EXPERTS."""
        return f"{self.block}experts.{which}"

    def correction_bias(self) -> str:
        """GLM-4.5's per-expert choice bias (a buffer of the router)."""
        return f"{self.block}gate.e_score_correction_bias"

    def shared_expert(self) -> str:
        """Prefix of the shared expert's gate/up/down_proj."""
        return f"{self.block}shared_experts." if self.family == "glm4_moe" else f"{self.block}shared_expert."

    def expert(self, i: int, which: int) -> str:
        """which: 0 gate, 1 up, 2 down."""
        return f"{self.block}experts.{i}.{_PROJ_NAMES[self.family][which]}.weight"


@dataclass(frozen=True)
class Source:
    """Where a canonical tensor lives: `name` whole, or row block [row, row + rows) of expert `expert` of a fused
    one."""

    name: str
    expert: int | None = None
    row: int = 0
    rows: int | None = None


def aliases(family: str | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, Source]:
    """Canonical name -> Source for every MoE tensor of `shapes` (name -> shape) not already canonical."""
    if family in (None, "gpt_oss"):  # GPT-OSS's fused experts are its canonical names
        return {}
    names, out = MoENames(family), {}
    for name, shape in shapes.items():
        if m := _FUSED.match(name):
            layer, kind = m.groups()
            f = shape[1] // 2 if kind == "gate_up_proj" else None
            for i in range(shape[0]):
                if kind == "gate_up_proj":
                    out[layer + names.expert(i, 0)] = Source(name, i, 0, f)
                    out[layer + names.expert(i, 1)] = Source(name, i, f, f)
                else:
                    out[layer + names.expert(i, 2)] = Source(name, i)
        elif m := _PER_EXPERT.match(name):
            layer, i, proj = m.groups()
            out[layer + names.expert(int(i), _WHICH[proj])] = Source(name)
        elif m := _ROUTER.match(name):
            out[m.group(1) + names.router()] = Source(name)
    return {k: v for k, v in out.items() if v.name != k}


def source_shape(source: Source, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The canonical tensor's shape, from its source's."""
    if source.expert is None:
        return tuple(shape)
    inner = tuple(shape[1:])
    return inner if source.rows is None else (source.rows, *inner[1:])


def take(source: Source, tensor: torch.Tensor) -> torch.Tensor:
    """The canonical tensor as a view of its source tensor."""
    if source.expert is None:
        return tensor
    t = tensor[source.expert]
    return t if source.rows is None else t.narrow(0, source.row, source.rows)


def canonical_state_dict(full: dict[str, torch.Tensor], family: str | None) -> dict[str, torch.Tensor]:
    """An HF-named state dict (checkpoint or in-memory layout) with its MoE tensors under canonical names (views)."""
    table = aliases(family, {k: tuple(v.shape) for k, v in full.items()})
    if not table:
        return full
    used = {s.name for s in table.values()}
    out = {k: v for k, v in full.items() if k not in used}
    out.update({k: take(s, full[s.name]) for k, s in table.items()})
    return out


class AliasedReader:
    """A CheckpointReader seen under canonical MoE names: names(), `in`, shape() and read() as CheckpointReader's.

    A fused source is read one expert at a time (dim 0, the expert) and the canonical rows cut from it."""

    def __init__(self, reader, family: str | None):
        self.reader = reader
        self.table = aliases(family, {n: tuple(reader.shape(n)) for n in reader.names()})
        used = {s.name for s in self.table.values()}
        self._names = [n for n in reader.names() if n not in used] + list(self.table)

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.table or (name in self.reader and name in self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        source = self.table.get(name)
        return self.reader.shape(name) if source is None else source_shape(source, self.reader.shape(source.name))

    def read(self, name: str, dim: int | None = None, start: int = 0, length: int | None = None, *,
             out: torch.Tensor) -> torch.Tensor:
        source = self.table.get(name)
        if source is None:
            return self.reader.read(name, dim, start, length, out=out)
        if source.expert is None:
            return self.reader.read(source.name, dim, start, length, out=out)
        block = torch.empty((1, *self.reader.shape(source.name)[1:]), dtype=out.dtype)  # one expert of the source
        self.reader.read(source.name, 0, source.expert, 1, out=block)
        piece = take(Source(source.name, 0, source.row, source.rows), block)
        with torch.no_grad():
            out.copy_(piece if dim is None else piece.narrow(dim, start, length))
        return out
