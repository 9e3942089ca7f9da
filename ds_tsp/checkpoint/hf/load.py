"""Load a local HF safetensors checkpoint into TSP shards, each rank reading ONLY its own slices.

The model's modules say which slice of which tensor they own (ds_tsp.model.modules.decoder: hf_slices) and where it
lands (hf_targets: views of the packed parameter); CheckpointReader reads exactly those bytes, in bounded chunks,
straight into those views, casting to the model dtype. Peak host memory per rank is therefore its shards plus one chunk
of file pages, ~1/D of the checkpoint (measured in tests/checkpoint/test_hf_loading.py), where loading a full
state dict on every rank needs 100%+.

Mixture-of-experts weights are read under the names transformers writes from any layout it reads itself
(ds_tsp.checkpoint.hf.moe_names: per expert, or fused [E, ...] tensors, one expert at a time): each rank reads only its
experts.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from ds_tsp.checkpoint.hf.language_model_names import LanguageModelReader
from ds_tsp.checkpoint.hf.moe_names import AliasedReader
from ds_tsp.checkpoint.safetensors.reader import CheckpointReader
from ds_tsp.core.errors import TSPConfigError

# Buffers some older checkpoints carry; transformers recomputes them, so do we.
_RECOMPUTED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_checkpoint_matches(model: nn.Module, reader: CheckpointReader, where: str) -> None:
    """Every tensor the config implies exists with its shape, and the checkpoint holds nothing the model lacks."""
    expected = model.hf_shapes()
    for name, shape in expected.items():
        if name not in reader:
            raise TSPConfigError(f"{where}: the checkpoint has no tensor {name!r}, which its config.json implies "
                                 f"(shape {list(shape)}): the weights do not belong to this config")
        if tuple(reader.shape(name)) != tuple(shape):
            raise TSPConfigError(
                f"{where}: tensor {name!r} has shape {list(reader.shape(name))} but config.json implies {list(shape)} "
                "(from hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, "
                "vocab_size): the checkpoint does not match its config")
    tied_copy = {"lm_head.weight"} if model.shape.tie_word_embeddings else set()
    # GLM-4.5's multi-token-prediction layers follow the decoder's: transformers' causal LM skips them too
    mtp = tuple(f"model.layers.{model.shape.num_layers + i}." for i in range(model.shape.mtp_layers))
    # Gemma 4's KV-sharing layers: checkpoints may keep k/v projections and norms transformers never loads either
    layers, n_shared = model.shape.num_layers, model.shape.kv_shared_layers
    shared = tuple(f"model.layers.{i}.self_attn.{p}." for i in range(layers - n_shared, layers)
                   for p in ("k_proj", "v_proj", "k_norm", "v_norm"))
    unknown = sorted(n for n in reader.names() if n not in expected and n not in tied_copy
                     and not n.endswith(_RECOMPUTED_SUFFIXES) and not (mtp and n.startswith(mtp))
                     and not (shared and n.startswith(shared)))
    if unknown:
        raise TSPConfigError(f"{where}: tensor {unknown[0]!r} ({len(unknown)} such) is not part of the model its "
                             "config.json describes (an o_proj / mlp bias, extra heads?): TSP would ignore it, so it "
                             "refuses the checkpoint")


def load_sharded(model: nn.Module, directory: str | Path) -> None:
    """Fill `model`'s shards (and replicated norms) from the checkpoint in `directory`; every rank calls it."""
    reader = AliasedReader(CheckpointReader(directory), model.shape.moe_family)
    # a multimodal checkpoint reads as its language model; Qwen3.5's mtp head is never part of the model
    reader = LanguageModelReader(reader, hidden=("mtp.",) if model.shape.hybrid_family is not None else ())
    check_checkpoint_matches(model, reader, str(directory))
    seen: set[str] = set()

    def tensors_to_read() -> int:  # a dry pass: the names this rank will ask for (MoE: its experts only), no bytes
        names: set[str] = set()
        model.load_slices(lambda name, *_: names.add(name), names=reader.names())
        return len(names)

    with progress_on_rank0(f"loading {Path(directory).name}", tensors_to_read) as advance:
        def read_into(name, dim, start, length, out):
            reader.read(name, dim, start, length, out=out)
            if name not in seen:  # one step per tensor, however many slices of it this rank reads
                seen.add(name)
                advance()

        model.load_slices(read_into, names=reader.names())


@contextmanager
def progress_on_rank0(description: str, total: int | Callable[[], int]):
    """Yields advance(): one step of a rich progress bar of `total` (a callable: called only when the bar shows) on
    stderr, shown on global rank 0 only and only when stderr is a terminal (not in a launcher's log file, a pipe or a
    test); anywhere else advance() does nothing. stdout is never touched."""
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"
    if not (rank0 and sys.stderr.isatty()):
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress

    steps = total() if callable(total) else total
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=steps)
        yield lambda: bar.advance(task)
