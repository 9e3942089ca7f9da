"""The cp ring's per-(chunk, foreign group) document runs (ds_tsp.core.layers.attention.cp_ring._runs): searched by
bisect and cached per step, equal to a scan of every document start on random packed layouts; and cached (the
forward, recompute and backward of every layer ask the same)."""
from __future__ import annotations

import random

from ds_tsp.core.layers.attention import cp_ring
from ds_tsp.core.tokens.documents import DocumentLayout


def _scanned(layout, batch, t0, n_queries, r, cp, cp_chunk, n_keys):
    """Every start looked at, per row (the definition)."""
    groups: dict[tuple, list[int]] = {}
    t1 = t0 + n_queries
    for b, starts in enumerate(layout.rows):
        doc = max(s for s in starts if s <= t0)
        cuts = [t0] + [s for s in starts if t0 < s < t1] + [t1]
        docs = [doc] + [s for s in starts if t0 < s < t1]
        runs = tuple((u0 - t0, u1 - t0, k0) for a, u0, u1 in zip(docs, cuts, cuts[1:])
                     if (k0 := cp_ring._buffer_offset(a, r, cp, cp_chunk)) < n_keys)
        groups.setdefault(runs, []).append(b)
    return {runs: rows for runs, rows in groups.items() if runs}


def _rows(slices) -> list[int]:
    return [b for s in slices for b in range(s.start, s.stop)]


def test_runs_equal_a_scan_of_every_start():
    rng = random.Random(0)
    for _ in range(300):
        cp, tsp, c = rng.randint(2, 4), rng.randint(1, 3), rng.randint(1, 6)
        cp_chunk = tsp * c
        seq = 2 * cp * cp_chunk
        batch = rng.randint(1, 3)
        layout = DocumentLayout(tuple(tuple(sorted({0, *rng.sample(range(1, seq), rng.randint(0, min(8, seq - 1)))}))
                                      for _ in range(batch)))
        t0, r = rng.randrange(seq - c + 1), rng.randrange(cp)
        n_keys = rng.choice([cp_chunk, 2 * cp_chunk])
        got = cp_ring._document_runs(layout, batch, t0, c, r, cp, cp_chunk, n_keys)
        want = _scanned(layout, batch, t0, c, r, cp, cp_chunk, n_keys)
        assert {runs: _rows(slices) for slices, runs in got} == want, (layout, t0, c, r, cp, cp_chunk, n_keys)


def test_runs_are_computed_once_per_step():
    layout = DocumentLayout(((0, 5, 9), (0, 3)))
    cp_ring._document_runs.cache_clear()
    first = cp_ring._document_runs(layout, 2, 4, 4, 1, 2, 8, 16)
    again = cp_ring._document_runs(DocumentLayout(((0, 5, 9), (0, 3))), 2, 4, 4, 1, 2, 8, 16)  # the next layer's
    assert again is first and cp_ring._document_runs.cache_info().hits == 1
