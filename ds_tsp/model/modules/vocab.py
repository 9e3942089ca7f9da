"""The vocab-sharded ends as sharded pieces: the embedding and the LM head hold vocab rows [p*Vd, (p+1)*Vd) of V,
zero past V (ds_tsp.core.layers.vocab streams them around the ring)."""
from __future__ import annotations

import math
import struct

import torch
from torch import nn

from ds_tsp.core.comm.communicator import TSPComm
from ds_tsp.core.grads.clip import mark_sharded
from ds_tsp.core.layers.vocab.embedding import tsp_embedding
from ds_tsp.core.layers.vocab.logits import tsp_selected_logits
from ds_tsp.core.layers.vocab.loss import tsp_lm_head_loss
from ds_tsp.core.layers.vocab.token_stats import tsp_token_stats
from ds_tsp.core.shape.model_shape import ModelShape
from ds_tsp.model.modules.piece import ShardedPiece
from ds_tsp.model.modules.slices import HFSlice


class TSPVocabShard(ShardedPiece):
    """Rows [p*Vd, (p+1)*Vd) of a vocab table padded to D*Vd rows (embedding or LM head)."""

    def __init__(self, vocab_size: int, hidden: int, comm: TSPComm, dtype, device):
        super().__init__()
        self.comm, self.vocab_size, self.hidden = comm, vocab_size, hidden
        self.rows = -(-vocab_size // comm.size)
        self.vocab_shard = mark_sharded(nn.Parameter(torch.zeros(self.rows, hidden, dtype=dtype, device=device)))

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.vocab_size, self.hidden)}

    def hf_slices(self) -> dict[str, HFSlice]:
        start = min(self.comm.rank * self.rows, self.vocab_size)
        return {"weight": (0, start, min(self.rows, self.vocab_size - start))}

    def pack_slices(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = pieces["weight"]
        if rows.shape[0] == self.rows:
            return rows
        return torch.cat((rows, rows.new_zeros(self.rows - rows.shape[0], rows.shape[1])))  # past V: zeros

    def hf_targets(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        packed[self.hf_slices()["weight"][2]:].zero_()  # rows past V stay zero
        return {"weight": packed[:self.hf_slices()["weight"][2]]}

    def unshard(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight": torch.cat(shards)[:self.vocab_size]}

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows/rank={self.rows}, tsp_rank={self.comm.rank}/{self.comm.size}"


class TSPVocabEmbedding(TSPVocabShard):
    """The embedding; padding_idx: the row transformers' nn.Embedding never updates (config.pad_token_id); scale:
    the output's factor (Gemma: sqrt(hidden)), rounded to the output's dtype first, as transformers multiplies."""

    def __init__(self, vocab_size: int, hidden: int, comm: TSPComm, dtype, device, padding_idx: int | None = None,
                 scale: float = 1.0):
        super().__init__(vocab_size, hidden, comm, dtype, device)
        self.padding_idx, self.scale = padding_idx, scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = tsp_embedding(input_ids, self.vocab_shard, self.comm, self.padding_idx)
        return out if self.scale == 1.0 else out * _in_dtype(self.scale, out.dtype)


def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded once to `dtype`, as transformers holds it (a scalar buffer made in the model's dtype); pure host
    arithmetic: no tensor, no sync."""
    if dtype == torch.float32:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", value))[0]
    if dtype == torch.bfloat16:  # 8 significant bits, round half to even (Python's round)
        mantissa, exponent = math.frexp(value)
        return math.ldexp(round(mantissa * 256) / 256, exponent)
    return value


class TSPLMHeadLoss(TSPVocabShard):
    """LM head fused with the loss. Tied: owns no weight and reads the embedding's shard (which ZeRO-3 must then
    treat as an external parameter of this module)."""

    def __init__(self, shape: ModelShape, comm: TSPComm, dtype, device, tied_to: TSPVocabShard | None = None,
                 chunk_tokens: int = 4096):
        super().__init__(shape.vocab_size, shape.hidden_size, comm, dtype, device)
        self.chunk_tokens = chunk_tokens  # tokens per logits tile: bounds the loss's largest transient
        self.softcap = shape.final_logit_softcapping  # Gemma: logits are cap * tanh(logits / cap)
        self.tied = tied_to is not None
        if self.tied:
            del self.vocab_shard
            self._tied_to = [tied_to]  # a list: not a submodule, so the tied weight is listed once

    @property
    def weight(self) -> nn.Parameter:
        return self._tied_to[0].vocab_shard if self.tied else self.vocab_shard

    def forward(self, h, shift_labels=None, n_valid_total=None, *, select=None, token_stats=False,
                logit_stats=False):
        """The loss share; or, with select=(local_index, slots, k), the [B, k, V] logits of k positions; or, with
        token_stats=True, per-token (log_prob, entropy, is_top1, label_mask) [4, B, L], and with logit_stats=True
        also (mean_logit, log_sum_sq_probs): [6, B, L] (a module call each time, so ZeRO-3 gathers the weight for
        all three)."""
        if token_stats:
            return tsp_token_stats(h, self.weight, shift_labels, self.vocab_size, self.comm,
                                   chunk_tokens=self.chunk_tokens, softcap=self.softcap, logit_stats=logit_stats)
        if select is not None:
            local_index, slots, k = select
            logits = tsp_selected_logits(h, self.weight, local_index, slots, k, self.vocab_size, self.comm)
            # every rank holds the same [B, k, V]: the cap is elementwise, autograd differentiates it
            return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap
        return tsp_lm_head_loss(h, self.weight, shift_labels, n_valid_total, self.vocab_size, self.comm,
                                chunk_tokens=self.chunk_tokens, softcap=self.softcap)
