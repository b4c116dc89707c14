"""The ring append used by every op: a deterministic emulation of SGLang's atomic fill-once append.

SGLang reserves ``idx = atomicAdd(index, 1)`` and writes row ``idx`` only if ``idx < capacity``. Here the
reservation is a prefix sum over each launch's violation flags, so rows land in launch order and, within a launch,
in flag (plan-entry) order on every backend. An append has two halves, so that several launches share one prefix
sum and one ring update (the decode step's launches are many and small):

* :func:`first_rows` builds, per launch, its violation count and the rows of its first ``capacity`` flags
  (the exclusive prefix sum plus ``mode="drop"`` scatter of SPEC §2, over every launch at once);
* :func:`place` writes those rows at the ring's write index, launch after launch, and advances the index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvcanary_jax.state import ViolationLog
from pallas_kernels import hash64

_INT32_MAX = jnp.iinfo(jnp.int32).max

RowBuilder = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class PendingRows:
    """One launch's violations, ready to place.

    Attributes:
      count: i32[] flags the launch set (the write index grows by this much).
      rows: u32[capacity, 8, 2]; row k belongs to the launch's k-th set flag, for k < min(count, capacity).
    """

    count: jax.Array
    rows: jax.Array


def pack_row(fields) -> jax.Array:
    """Eight u64 fields (each a (lo, hi) pair) to a ``u32[..., 8, 2]`` violation row."""
    return jnp.stack([hash64.join(f) for f in fields], axis=-2)


def first_rows(launches: Sequence[tuple[jax.Array, RowBuilder]], capacity: int) -> list[PendingRows]:
    """Counts each launch's flags and builds the rows of its first ``capacity`` ones, with one prefix sum for all.

    SPEC's reservation, batched: an exclusive prefix sum over every launch's flags gives each flag its rank in its
    launch, and one scatter with ``mode="drop"`` (sentinel = out of range) puts the entry ids of each launch's first
    ``capacity`` flags in rank order. The rows are then materialized (an optimization barrier), so a caller may
    overwrite the buffers that ``build_rows`` read without XLA copying them to keep the old bytes.

    Args:
      launches: ``(flags, build_rows)`` per launch: bool flags in append order, and a map from i32[capacity] entry
        ids to u32[capacity, 8, 2] rows.
      capacity: the ring's row count.

    Returns:
      One :class:`PendingRows` per launch, in order.
    """
    flat = [flags.reshape(-1) for flags, _ in launches]
    sizes = [f.shape[0] for f in flat]
    ones = jnp.concatenate(flat).astype(jnp.int32)
    set_before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ones)])  # set flags before each entry
    bounds = np.cumsum([0, *sizes])  # static launch boundaries
    at_bounds = set_before[bounds]
    counts = at_bounds[1:] - at_bounds[:-1]
    launch = jnp.concatenate([jnp.full((n,), i, jnp.int32) for i, n in enumerate(sizes)])
    rank = set_before[:-1] - at_bounds[:-1][launch]  # exclusive prefix sum within the launch
    dropped = len(sizes) * capacity
    target = jnp.where((ones != 0) & (rank < capacity), launch * capacity + rank, dropped)
    local = jnp.arange(ones.shape[0], dtype=jnp.int32) - jnp.asarray(bounds[:-1], jnp.int32)[launch]
    entries = jnp.zeros((dropped,), jnp.int32).at[target].set(local, mode="drop").reshape(len(sizes), capacity)
    pending = []
    for i, ((_, build_rows), size) in enumerate(zip(launches, sizes, strict=True)):
        rows = build_rows(entries[i]) if size else jnp.zeros((capacity, 8, 2), jnp.uint32)
        pending.append(PendingRows(counts[i], rows))
    rows = lax.optimization_barrier(tuple(p.rows for p in pending))
    return [PendingRows(p.count, r) for p, r in zip(pending, rows, strict=True)]


def after(*rows: jax.Array) -> jax.Array:
    """A traced int32 zero that depends on ring rows (``u32[capacity, 8, 2]``: pending rows or the ring itself).

    Rows gather records from a canary buffer; adding this zero to a later in-place store's slots makes the store
    wait for them, so XLA neither schedules the gather after the store nor copies the whole buffer to keep its old
    bytes. Word [0, 7, 0] is a row's fail bits, always < 2^31, and XLA cannot fold the shift to a constant.
    """
    zero = jnp.zeros((), jnp.int32)
    for r in rows:
        zero = zero + lax.shift_right_logical(r[0, 7, 0], jnp.uint32(31)).astype(jnp.int32)
    return zero


def _saturating_add(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b`` for non-negative int32s, stopping at 2^31 - 1 instead of wrapping."""
    return a + jnp.minimum(b, _INT32_MAX - a)


def place(log: ViolationLog, pending: Sequence[PendingRows]) -> ViolationLog:
    """Writes the launches' rows at the write index, in launch order, where the fill-once ring has room.

    Returns:
      The updated log; the index grows by every launch's count, saturating at 2^31 - 1 instead of wrapping.
    """
    capacity = log.ring_capacity
    row = jnp.arange(capacity, dtype=jnp.int32)
    ring, start = log.violation_ring, log.violation_write_index[0]
    for p in pending:
        k = row - start  # ring row start + k holds the launch's k-th row
        fresh = (k >= 0) & (k < p.count)
        ring = jnp.where(fresh[:, None, None], p.rows[jnp.clip(k, 0, capacity - 1)], ring)
        start = _saturating_add(start, p.count)
    return ViolationLog(violation_ring=ring, violation_write_index=start.reshape(1).astype(jnp.int32))


def append(log: ViolationLog, flags: jax.Array, build_rows: RowBuilder) -> ViolationLog:
    """Appends one launch's rows (one per set flag, in flag order) to the fill-once ring.

    Args:
      log: the ring and its write index.
      flags: bool[N] in append order.
      build_rows: maps i32[capacity] entry ids to u32[capacity, 8, 2] rows; only rows of landing ids are kept.

    Returns:
      The updated log.
    """
    return place(log, first_rows([(flags, build_rows)], log.ring_capacity))
