"""The fill-once violation ring's append: a deterministic emulation of SGLang's atomic append.

SGLang reserves ``idx = atomicAdd(index, 1)`` and writes row ``idx`` only if ``idx < capacity``. Here the
reservation is a prefix sum over a launch's violation flags, so rows land in flag (plan-entry) order on every
backend, and the index counts every flag, saturating at 2^31 - 1. The phase op places its launches with
``pallas_kernels.ring.place``; :func:`append` places one set of rows with it too, or scatters each straight to its
place when there are no more candidates than ring rows (the same bytes).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kvcanary_jax.core._state import ViolationLog
from pallas_kernels import prefix, ring

_INT32_MAX = jnp.iinfo(jnp.int32).max

# i32[n] entry ids -> (u32[n, 8, 2] ring rows, i32[n, 3] their context)
RowBuilder = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def append(log: ViolationLog, flags: jax.Array, build_rows: RowBuilder) -> ViolationLog:
    """Appends one set of rows (one per set flag, in flag order) to the fill-once ring.

    Up to the ring's capacity of flags, every candidate's row is built and scattered to its place. With more, the
    first ``capacity`` set flags are listed first, so that only ``capacity`` rows are built; they are materialised
    behind an optimization barrier, so a caller may overwrite the buffers ``build_rows`` read without XLA copying
    them to keep the old bytes.
    """
    flags = flags.reshape(-1)
    if flags.size <= log.ring_capacity:
        return _scatter(log, flags, *build_rows(jnp.arange(flags.size, dtype=jnp.int32)))
    (entries,) = jnp.nonzero(flags, size=log.ring_capacity, fill_value=0)
    rows, context = lax.optimization_barrier(build_rows(entries.astype(jnp.int32)))
    pending = [(jnp.sum(flags, dtype=jnp.int32), rows, context)]
    placed, ctx, index = ring.place(log.violation_ring, log.violation_context, log.violation_write_index, pending)
    return ViolationLog(violation_ring=placed, violation_write_index=index, violation_context=ctx)


def _scatter(log: ViolationLog, flags: jax.Array, rows: jax.Array, context: jax.Array) -> ViolationLog:
    """Writes the row of each set flag (``rows`` u32[n, 8, 2], ``context`` i32[n, 3], one per flag) at the write
    index in flag order where the ring has room, and advances the index (saturating): one prefix sum and one
    in-place scatter per array, whatever the ring's size."""
    ones = flags.astype(jnp.int32)
    rank = prefix.inclusive_sum(ones) - ones
    start = log.violation_write_index[0]
    room = jnp.maximum(log.ring_capacity - start, 0)
    target = jnp.where((ones != 0) & (rank < room), start + rank, log.ring_capacity)  # start + rank < capacity
    new_ring = log.violation_ring.at[target].set(rows, mode="drop")
    ctx = log.violation_context
    if ctx is not None:
        ctx = ctx.at[target].set(context, mode="drop")
    index = (start + jnp.minimum(jnp.sum(ones), _INT32_MAX - start)).reshape(1).astype(jnp.int32)
    return ViolationLog(violation_ring=new_ring, violation_write_index=index, violation_context=ctx)
