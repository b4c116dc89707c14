"""The fill-once violation ring: a deterministic emulation of SGLang's atomic append.

SGLang reserves ``idx = atomicAdd(index, 1)`` and writes row ``idx`` only if ``idx < capacity``. Here the
reservation is a prefix sum over each launch's violation flags, so rows land in launch order and, within a launch,
in flag (plan-entry) order on every backend. An append has two halves, so that several launches share one prefix
sum and one ring update (the decode step's launches are many and small):

* :func:`first_entries` ranks every launch's flags with one exclusive prefix sum and lists, per launch, the entry
  ids of its first ``capacity`` set flags (the ``mode="drop"`` scatter of SPEC §2, over every launch at once);
  the caller turns those ids into rows;
* :func:`place` writes the rows at the ring's write index, launch after launch, and advances the index.

A single small set of rows (no more candidates than the ring has rows) skips the listing: :func:`scatter` puts
each flagged candidate's row straight at its place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core._state import ViolationLog
from pallas_kernels import prefix, ring

_INT32_MAX = jnp.iinfo(jnp.int32).max
pack_row = ring.pack_row  # a ring row from its eight u64 fields
context = ring.row_context  # a ring row's context (request row, expected position, batch entry)
after = ring.after  # orders an in-place store after rows gathered from the buffer


@dataclasses.dataclass(frozen=True)
class PendingRows:
    """One launch's violations, ready to place.

    Attributes:
      count: i32[] flags the launch set (the write index grows by this much).
      rows: u32[capacity, 8, 2]; row k belongs to the launch's k-th set flag, for k < min(count, capacity).
      context: i32[capacity, 3] each row's context (request row, expected position, batch entry; -1 = none).
    """

    count: jax.Array
    rows: jax.Array
    context: jax.Array


def first_entries(flags: Sequence[jax.Array], capacity: int) -> tuple[jax.Array, jax.Array]:
    """Counts each launch's set flags and lists the entry ids of its first ``capacity`` ones, in flag order.

    One exclusive prefix sum over every launch's flags gives each flag its rank in its launch, and one scatter
    with ``mode="drop"`` (sentinel = out of range) puts the entry ids of each launch's first ``capacity`` flags
    in rank order.

    Args:
      flags: per launch, bool flags in append order (any shape; flattened row-major).
      capacity: the ring's row count.

    Returns:
      ``(counts i32[L], entries i32[L, capacity])``; ``entries[i, k]`` is launch i's k-th flagged entry for
      ``k < min(counts[i], capacity)``, and 0 past that.
    """
    flat = [f.reshape(-1) for f in flags]
    sizes = [f.shape[0] for f in flat]
    ones = jnp.concatenate([*flat, jnp.zeros((0,), bool)]).astype(jnp.int32)
    set_before = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), prefix.inclusive_sum(ones)]
    )  # set flags before each entry
    bounds = np.cumsum([0, *sizes])  # static launch boundaries
    at_bounds = set_before[bounds]
    counts = at_bounds[1:] - at_bounds[:-1]
    launch = jnp.asarray(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
    rank = set_before[:-1] - at_bounds[:-1][launch]  # exclusive prefix sum within the launch
    dropped = len(sizes) * capacity
    target = jnp.where((ones != 0) & (rank < capacity), launch * capacity + rank, dropped)
    local = jnp.arange(ones.shape[0], dtype=jnp.int32) - jnp.asarray(bounds[:-1], jnp.int32)[launch]
    entries = jnp.zeros((dropped,), jnp.int32).at[target].set(local, mode="drop")
    return counts, entries.reshape(len(sizes), capacity)


def scatter(log: ViolationLog, flags: jax.Array, rows: jax.Array, context: jax.Array) -> ViolationLog:
    """Writes the row of each set flag (``rows`` u32[n, 8, 2], ``context`` i32[n, 3], one per flag) at the write
    index in flag order where the ring has room, and advances the index (saturating): one prefix sum and one
    in-place scatter per array, whatever the ring's size. The same bytes as :func:`place` of those rows."""
    ones = flags.reshape(-1).astype(jnp.int32)
    rank = prefix.inclusive_sum(ones) - ones
    start = log.violation_write_index[0]
    room = jnp.maximum(log.ring_capacity - start, 0)
    target = jnp.where((ones != 0) & (rank < room), start + rank, log.ring_capacity)  # start + rank < capacity
    new_ring = log.violation_ring.at[target].set(rows, mode="drop")
    ctx = log.violation_context
    if ctx is not None:
        ctx = ctx.at[target].set(context, mode="drop")
    index = _saturating_add(start, jnp.sum(ones)).reshape(1).astype(jnp.int32)
    return ViolationLog(violation_ring=new_ring, violation_write_index=index, violation_context=ctx)


def _saturating_add(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b`` for non-negative int32s, stopping at 2^31 - 1 instead of wrapping."""
    return a + jnp.minimum(b, _INT32_MAX - a)


def place(log: ViolationLog, pending: Sequence[PendingRows]) -> ViolationLog:
    """Writes the launches' rows at the write index, in launch order, where the fill-once ring has room
    (``pallas_kernels.ring.place``, the phase op's placement); the index saturates at 2^31 - 1."""
    rows = [(p.count, p.rows, p.context) for p in pending]
    placed, ctx, index = ring.place(log.violation_ring, log.violation_context, log.violation_write_index, rows)
    return ViolationLog(violation_ring=placed, violation_write_index=index, violation_context=ctx)
