"""Host helpers that pick valid fault targets in a :class:`CanaryBatch` of numpy arrays, with an explicit RNG."""

from __future__ import annotations

import numpy as np

from kvcanary_jax.runtime._batch import CanaryBatch


def row_starts(batch: CanaryBatch) -> np.ndarray:
    """i64[bs] index of each row's first token entry."""
    extend = np.asarray(batch.extend_lens)
    return np.cumsum(extend) - extend


def cached_entries(batch: CanaryBatch, *, window: int = 0, lut: np.ndarray | None = None) -> np.ndarray:
    """i64[n, 3] ``(batch row, position, slot)`` of every cached position the step verifies.

    With ``window`` > 0 only the last ``window`` cached positions of each row are listed and slots are translated
    through ``lut`` (the SWA group's view). Rows with ``req_pool_indices <= 0`` are padding in every convention
    and are skipped (so a request in table row 0 is never picked as a target).
    """
    out = []
    for r, (row, prefix) in enumerate(
        zip(np.asarray(batch.req_pool_indices), np.asarray(batch.prefix_lens), strict=True)
    ):
        if row <= 0:  # padding: row 0 (reserved) or a negative row; a request in row 0 is not picked
            continue
        start = max(0, prefix - window) if window else 0
        for pos in range(start, prefix):
            slot = int(batch.req_to_token[row, pos])
            out.append((r, pos, int(lut[slot]) if lut is not None else slot))
    return np.array(out, np.int64).reshape(-1, 3)


def choose_live_slot(
    batch: CanaryBatch, rng: np.random.Generator, *, window: int = 0, lut: np.ndarray | None = None
) -> int | None:
    """A random non-padding slot that this step verifies but does not write (None if there is none)."""
    entries = cached_entries(batch, window=window, lut=lut)
    written = np.asarray(batch.out_cache_loc)
    if lut is not None:
        written = lut[np.maximum(written, 0)]
    candidates = np.setdiff1d(entries[:, 2], np.concatenate([written, [0]]))
    return int(rng.choice(candidates)) if len(candidates) else None


def choose_remap(batch: CanaryBatch, rng: np.random.Generator) -> tuple[int, int, int] | None:
    """``(pool_row, position, new_slot)``: a cached entry and a live slot holding a different position.

    A different position guarantees a POSITION mismatch (and usually CHAIN): a slot at the same position with the
    same history would be an identical, benign copy.
    """
    entries = cached_entries(batch)
    if len(entries) < 2:
        return None
    r, pos, slot = entries[rng.integers(len(entries))]
    others = entries[(entries[:, 1] != pos) & (entries[:, 2] != slot)]
    if not len(others):
        return None
    return int(batch.req_pool_indices[r]), int(pos), int(others[rng.integers(len(others)), 2])


def choose_token_swap(
    batch: CanaryBatch, rng: np.random.Generator, rows: np.ndarray | None = None
) -> tuple[int, int] | None:
    """Token entries ``(i, j)`` holding the first (sampled) token of two rows, with different token ids.

    Args:
      rows: candidate batch rows (default: every row with ``req_pool_indices > 0``).
    """
    rows = np.flatnonzero(np.asarray(batch.req_pool_indices) > 0) if rows is None else np.asarray(rows)
    starts = row_starts(batch)[rows]
    ids = np.asarray(batch.input_ids)
    pairs = [(int(a), int(b)) for a in starts for b in starts if a < b and ids[a] != ids[b]]
    return pairs[rng.integers(len(pairs))] if pairs else None
