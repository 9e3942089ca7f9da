"""Shared helpers of tests/core/test_properties.py and tests/core/test_bf16.py (not a test module).

A `ModelCase` is one complete configuration: TSP degree, ModelShape, and per batch row its left / right padding
(attention_mask), the lengths of the packed documents of its real tokens and the first position of its first
document (a document continued from an earlier row starts at a position > 0). Everything else (token ids,
labels, weights) follows deterministically from `seed`, so a case's repr is its reproduction:

    # repro.py, run from tests/ (spawned ranks re-import the main module, hence the guard)
    from property_cases import *
    if __name__ == "__main__":
        case = ModelCase(...)                    # the repr a failing test printed
        tsp = run_cases_on_ranks([case])[0]      # case.tsp gloo ranks (in-process for D=1)
        print(compare(case, tsp))                # {'loss': err, hf name: err, ...}

The batch follows transformers' conventions (DataCollatorWithFlattening): position_ids restart at every document
start, the first label of every document is -100, so after the global shift no token targets the next document.
Padded slots carry random token ids and random (not -100) labels: the attention_mask alone must keep them out.

The reference is ds_tsp.tools.reference_model.ReferenceCausalLM run on every document ON ITS OWN (its own position ids,
its labels shifted inside the document), padding cut off, and the loss token-weighted over all documents; it knows
nothing of zigzag, shard_batch, document_starts or attention masks.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import torch

from ds_tsp.core.config import TSPOptions
from ds_tsp.core.shape.model_shape import ModelShape, RopeScaling
from ds_tsp.core.tokens.zigzag import padded_length, shift_labels
from ds_tsp.tools.reference_model import ReferenceCausalLM, full_state_dict, init_weights_

__all__ = ["Row", "ModelCase", "ModelShape", "TSPOptions", "RopeScaling", "model_cases", "draw_cases",
           "build_batch", "make_weights", "reference_loss_and_grads", "tsp_loss_and_grads", "run_cases",
           "run_cases_on_ranks", "compare", "rel_err", "DTYPES"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
IGNORE = -100


@dataclass(frozen=True)
class Row:
    docs: tuple[int, ...]  # lengths of the packed documents of the real tokens (each >= 1)
    left: int = 0  # left padding (attention_mask 0)
    right: int = 0  # right padding
    offset: int = 0  # position id of the first token of the first document

    @property
    def length(self) -> int:
        return self.left + sum(self.docs) + self.right


@dataclass(frozen=True)
class ModelCase:
    tsp: int
    shape: ModelShape
    rows: tuple[Row, ...]
    mask: bool = False  # pass attention_mask (required when a row is padded)
    seed: int = 0
    ignore_fraction: float = 0.1
    options: TSPOptions = field(default_factory=TSPOptions)
    overlap: bool = True
    dtype: str = "float64"

    def __post_init__(self):
        lengths = {r.length for r in self.rows}
        if len(lengths) != 1:
            raise ValueError(f"rows have different lengths {sorted(lengths)}")
        if not self.mask and any(r.left or r.right for r in self.rows):
            raise ValueError("padded rows need mask=True")

    @property
    def seq(self) -> int:
        return self.rows[0].length

    @property
    def batch(self) -> int:
        return len(self.rows)

    def summary(self) -> str:
        s = self.shape
        win = "" if s.attention_windows is None else f" win={s.attention_windows}"
        flags = "".join(f" {k}" for k in ("qkv_bias", "qk_norm", "tie_word_embeddings") if getattr(s, k))
        return (f"D={self.tsp} S={self.seq} B={self.batch} h={s.hidden_size} H={s.num_heads}/{s.num_kv_heads} "
                f"d={s.dim_per_head} F={s.intermediate_size} V={s.vocab_size} L={s.num_layers}{win}{flags} "
                f"docs={[r.docs for r in self.rows]} pads={[(r.left, r.right) for r in self.rows]}")


# ----------------------------------------------------------------------------------------------------------------
# strategies (hypothesis is imported lazily so test_bf16 does not need it)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_cases(tsp: int, max_seq: int = 40):
    """Hypothesis strategy of ModelCases at TSP degree `tsp` (tiny: hidden <= 48, <= 2 layers, vocab <= 64)."""
    from hypothesis import assume
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        heads = tsp * draw(st.integers(1, 2)) if tsp > 1 else draw(st.integers(1, 4))
        kv = draw(st.sampled_from([k for k in _divisors(heads) if k % tsp == 0 or tsp % k == 0]))
        if draw(st.booleans()):  # head_dim set explicitly: hidden is free (not heads * head_dim)
            head_dim = draw(st.sampled_from([2, 4, 6, 8, 12]))
            hidden = draw(st.integers(4, 48))
        else:
            head_dim = None
            hidden = heads * draw(st.sampled_from([d for d in (2, 4, 6, 8, 12) if heads * d <= 48]))
        ffn = tsp * draw(st.integers(1, 48 // tsp))
        vocab = draw(st.integers(3, 64))  # also tiny vocabs whose last shards are all padding
        layers = draw(st.integers(1, 2))
        # sequence length: never a multiple of 2D (the padding path), sometimes shorter than 2D
        step = 2 * tsp
        # shorter than 2D in ~1/4 (some ranks then hold only padding)
        if tsp > 1 and draw(st.sampled_from(["long", "long", "short", "long"])) == "short":
            seq = draw(st.integers(2, step - 1))
        else:
            seq = step * draw(st.integers(1, max_seq // step)) + (draw(st.integers(1, step - 1)) if tsp > 1 else 1)
        windows = None
        if draw(st.booleans()):
            windows = tuple(draw(st.one_of(st.none(), st.integers(1, seq + 2))) for _ in range(layers))
        rope = draw(st.sampled_from([None, RopeScaling(rope_type="linear", factor=2.0)]))
        shape = ModelShape(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
                           num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                           rope_theta=draw(st.sampled_from([10000.0, 100.0])), rope_scaling=rope,
                           tie_word_embeddings=draw(st.booleans()), qkv_bias=draw(st.booleans()),
                           qk_norm=draw(st.booleans()), attention_windows=windows)
        shape.check_tsp_degree(tsp)

        mask = draw(st.booleans())
        chunk = padded_length(seq, tsp) // step

        def row():
            left = draw(st.integers(0, min(3, seq - 1))) if mask else 0
            right = draw(st.integers(0, min(3, seq - 1 - left))) if mask else 0
            n = seq - left - right
            k = draw(st.integers(1, min(4, n)))
            # document boundaries anywhere, or exactly on a zigzag chunk edge
            edges = [j * chunk - left for j in range(1, step) if 1 <= j * chunk - left <= n - 1]
            cut = st.integers(1, n - 1) if n > 1 else st.nothing()
            if edges:
                cut = st.one_of(cut, st.sampled_from(edges))
            cuts = sorted(draw(st.lists(cut, min_size=k - 1, max_size=k - 1, unique=True))) if k > 1 else []
            bounds = [0, *cuts, n]
            offset = draw(st.one_of(st.just(0), st.integers(1, 6)))
            return Row(docs=tuple(b - a for a, b in zip(bounds, bounds[1:])), left=left, right=right, offset=offset)

        batch = draw(st.integers(1, 3))
        first = row()
        rows = (first,) * batch if batch > 1 and draw(st.booleans()) else (first, *(row() for _ in range(batch - 1)))
        assume(any(d >= 2 for r in rows for d in r.docs))  # some token has a target
        options = TSPOptions(kernel=draw(st.sampled_from(["cpu_flash", "math"])),
                             keep_gathered_kv=draw(st.booleans()), activation_checkpointing=draw(st.booleans()),
                             recompute_projections=draw(st.booleans()))
        return ModelCase(tsp=tsp, shape=shape, rows=rows, mask=mask, seed=draw(st.integers(0, 2 ** 16)),
                         ignore_fraction=draw(st.sampled_from([0.0, 0.1, 0.3])), options=options,
                         overlap=draw(st.booleans()))

    return strategy()


# Example-count profiles: "ci" (the default run) and "long" (HYPOTHESIS_PROFILE=long: five times the examples of
# every draw_cases call, for a run before a release)
PROFILE_SCALE = {"ci": 1, "long": 5}


def profile_scale() -> int:
    import os

    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if name not in PROFILE_SCALE:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: one of {sorted(PROFILE_SCALE)}")
    return PROFILE_SCALE[name]


def draw_cases(strategy, n: int, pool: int = 4) -> list:
    """`n` examples of `strategy` (times the profile's scale: profile_scale), derandomized (the same list on every
    run for a given hypothesis version), generate phase only, no example database.

    Hypothesis generates many examples as small mutations of earlier ones; to spread the few that run, it draws
    pool * n and keeps, in generation order, first those whose ModelShape (or whole value) is new, then the rest.
    """
    from hypothesis import HealthCheck, Phase, given, settings

    n *= profile_scale()
    found: list = []

    @settings(max_examples=pool * n, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        if example not in found:
            found.append(example)

    collect()
    seen, spread, rest = set(), [], []
    for example in found:
        key = repr(getattr(example, "shape", example))
        (rest if key in seen else spread).append(example)
        seen.add(key)
    return (spread + rest)[:n]


# ----------------------------------------------------------------------------------------------------------------
# batch, reference, TSP


def build_batch(case: ModelCase) -> dict:
    """Global [B, S] input_ids, labels, position_ids (and attention_mask when case.mask), deterministic in seed."""
    g = torch.Generator().manual_seed(case.seed + 1)
    B, S, V = case.batch, case.seq, case.shape.vocab_size
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)  # padded slots keep random labels on purpose
    drop = torch.rand(B, S, generator=g) < case.ignore_fraction
    positions = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, r in enumerate(case.rows):
        n = sum(r.docs)
        real = slice(r.left, r.left + n)
        labels[b, real] = torch.where(drop[b, real], IGNORE, ids[b, real])
        pos, start = [], r.left
        for j, length in enumerate(r.docs):
            first = r.offset if j == 0 else 0
            pos.append(torch.arange(first, first + length))
            labels[b, start] = IGNORE  # DataCollatorWithFlattening: first label of every document
            start += length
        positions[b, real] = torch.cat(pos)
        # left padding continues INTO the first document's positions when it can (only the mask separates them);
        # right padding continues the last document's positions
        positions[b, :r.left] = (torch.arange(r.offset - r.left, r.offset) if r.offset >= r.left
                                 else torch.arange(r.left))
        positions[b, r.left + n:] = torch.arange(r.right) + int(positions[b, r.left + n - 1]) + 1
        mask[b, real] = 1
    # at least one labelled target: un-ignore the second token of the longest document
    if not any(bool((shift_labels(labels[b, s:s + n]) != IGNORE).any()) for b, s, n in _documents(case)):
        b, s, n = max(_documents(case), key=lambda t: t[2])
        labels[b, s + 1] = ids[b, s + 1]
    out = {"input_ids": ids, "labels": labels, "position_ids": positions}
    if case.mask:
        out["attention_mask"] = mask
    return out


def _documents(case: ModelCase):
    """(row, global start, length) of every document."""
    for b, r in enumerate(case.rows):
        start = r.left
        for n in r.docs:
            yield b, start, n
            start += n


def make_weights(case: ModelCase, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full HF-named state dict: ReferenceCausalLM's deterministic init in `dtype` (default: the case's)."""
    ref = ReferenceCausalLM(case.shape, dtype=dtype or DTYPES[case.dtype])
    init_weights_(ref, case.seed)
    return full_state_dict(ref)


def reference_loss_and_grads(case: ModelCase, dtype: torch.dtype | None = None,
                             weights: dict[str, torch.Tensor] | None = None):
    """Single device, every document on its own. (loss float64 scalar, {hf name: grad})."""
    dtype = dtype or DTYPES[case.dtype]
    data = build_batch(case)
    ref = ReferenceCausalLM(case.shape, dtype=dtype)
    ref.load_state_dict({k: v.to(dtype) for k, v in (weights or make_weights(case, dtype)).items()}, strict=False)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for b, start, n in _documents(case):
        targets = shift_labels(data["labels"][b, start:start + n])
        k = int((targets != IGNORE).sum())
        if k:
            first = case.rows[b].offset if start == case.rows[b].left else 0
            mean = ref(data["input_ids"][b, start:start + n][None], targets[None], torch.arange(first, first + n)[None])
            total, count = total + mean.double() * k, count + k
    loss = total / count
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in ref.named_parameters()}
    if case.shape.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return loss.detach(), grads


def tsp_loss_and_grads(case: ModelCase, group=None, weights: dict[str, torch.Tensor] | None = None):
    """Collective over `group`: (global loss, full HF-named gradients) on every rank."""
    from ds_tsp.core.comm.communicator import TSPComm
    from ds_tsp.core.tokens.zigzag import shard_batch
    from ds_tsp.model.causal_lm import ShardedCausalLM

    comm = TSPComm(group, overlap=case.overlap)
    dtype = DTYPES[case.dtype]
    data = build_batch(case)
    batch = shard_batch(data["input_ids"], tsp=comm.size, rank=comm.rank, labels=data["labels"],
                        position_ids=data["position_ids"], attention_mask=data.get("attention_mask"))
    model = ShardedCausalLM(case.shape, comm, options=case.options, dtype=dtype)
    model.load_full_state_dict({k: v.to(dtype) for k, v in (weights or make_weights(case, dtype)).items()})
    share = model(batch["input_ids"], batch["shift_labels"], batch["position_ids"], batch.get("attention_mask"))
    share.backward()
    return model.loss_for_logging(share), model.full_state_dict(grads=True)


def run_cases(cases: list[ModelCase], weights: list | None = None) -> list[dict]:
    """Body of every rank: each case in turn on the whole world. Rank 0 returns loss and grads, the others only
    the loss (to check every rank reports the same); an exception is returned as text, so one bad case does not
    hide the others."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    rank = dist.get_rank() if group is not None else 0
    results = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        try:
            loss, grads = tsp_loss_and_grads(case, group, None if weights is None else weights[i])
            results.append({"loss": loss, "grads": grads if rank == 0 else None, "error": None,
                            "seconds": time.perf_counter() - t0})
        except Exception:  # noqa: BLE001 - reported with the case by the parent
            results.append({"loss": None, "grads": None, "error": traceback.format_exc(),
                            "seconds": time.perf_counter() - t0})
    return results


def run_cases_on_ranks(cases: list[ModelCase], weights: list | None = None, timeout_s: float = 300) -> list[dict]:
    """All `cases` (one TSP degree) in ONE process group; per case rank 0's result plus every rank's loss."""
    from local_ranks import run_on_local_ranks

    degrees = {c.tsp for c in cases}
    if len(degrees) != 1:
        raise ValueError(f"cases mix TSP degrees {sorted(degrees)}")
    tsp = degrees.pop()
    per_rank = ([run_cases(cases, weights)] if tsp == 1
                else run_on_local_ranks(run_cases, tsp, cases, weights, timeout_s=timeout_s))
    results = per_rank[0]
    for i, result in enumerate(results):
        result["rank_losses"] = [None if r[i]["loss"] is None else float(r[i]["loss"]) for r in per_rank]
        result["rank_errors"] = [r[i]["error"] for r in per_rank if r[i]["error"]]
    return results


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| in float64.

    With `scale` (the norm of ALL reference gradients together), a reference gradient below 1e-8 * scale counts
    as zero up to rounding (q/k gradients under a window of 1, where every query sees only itself, are exactly
    zero in exact arithmetic and ~1e-16 in float64): its error is measured against `scale` instead, so rounding
    noise divided by rounding noise cannot fail a correct schedule.
    """
    a, b = a.detach().double(), b.detach().double()
    diff, ref = float((a - b).norm()), float(b.norm())
    if scale is not None and ref < 1e-8 * scale:
        return diff / scale
    return diff / ref if ref > 0 else diff


def compare(case: ModelCase, tsp: dict, reference=None) -> dict:
    """{'loss': err, hf name: err, ...} of a run_cases_on_ranks result against the reference (computed here
    unless given as (loss, grads))."""
    if tsp["rank_errors"]:
        raise AssertionError(f"{case.summary()}\n{case!r}\nTSP raised:\n{tsp['rank_errors'][0]}")
    ref_loss, ref_grads = reference if reference is not None else reference_loss_and_grads(case)
    missing = sorted(set(ref_grads) - set(tsp["grads"]))
    if missing:
        raise AssertionError(f"{case.summary()}\n{case!r}\nTSP has no gradient for {missing}")
    scale = float(torch.stack([g.double().norm() for g in ref_grads.values()]).norm())
    errs = {"loss": rel_err(tsp["loss"], ref_loss)}
    errs.update({name: rel_err(tsp["grads"][name], g, scale) for name, g in ref_grads.items()})
    return errs
