"""The fill-once violation ring and the launch counters, written once for both layers (SPEC §1 Ring).

A launch's rows land at the ring's write index in order where the ring has room; the index counts every row,
saturating at 2^31 - 1. The phase op places every launch of a phase with one :func:`place`, and the
SGLang-compatible single ops in ``kvcanary_jax.core`` place each launch's rows with it too, so the bytes agree by
construction.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import hash64

_INT32_MAX = 2**31 - 1


def pack_row(fields: list[hash64.U64]) -> jax.Array:
    """Eight u64 fields to ``u32[..., 8, 2]`` (the ring's row layout)."""
    return jnp.stack([hash64.join(f) for f in fields], axis=-2)


def row_context(request_row: jax.Array, expected_position: jax.Array, batch_entry: jax.Array) -> jax.Array:
    """i32[..., 3] a ring row's context (request row, expected position, batch entry) from three i32 arrays."""
    return jnp.stack([request_row, expected_position, batch_entry], axis=-1).astype(jnp.int32)


def place(
    ring: jax.Array,
    context,
    write_index: jax.Array,
    flags: jax.Array,
    build: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
):
    """Writes the row of each set flag, in flag order, at the write index where the fill-once ring has room.

    ``flags`` bool[n] holds every candidate (several launches' candidates concatenated in ring order place as
    those launches in turn). ``build(entries)`` -> ``(rows u32[m, 8, 2], context i32[m, 3])`` builds the rows of
    the candidates ``entries`` i32[m]; it is asked for one row per ring row, so a launch with many candidates builds
    no more than the ring holds. ``context`` (the ring's, or None) gets each placed row's context. The index grows by
    every set flag, saturating at 2^31 - 1: SGLang's ``atomicAdd`` reservation, in a deterministic order.

    The candidates are compacted (one stable sort), built and placed only when the ring takes some: on CPU and TPU
    behind a conditional, so a step with no violation (or a full ring) does none of that work (on GPU, always).
    Returns ``(ring, context, write_index)``.
    """
    flags = flags.reshape(-1)
    if flags.shape[0] == 0:  # a launch with no candidates (static): nothing to place, the index as it was
        return ring, context, write_index
    capacity, start = ring.shape[0], write_index[0]
    total = jnp.sum(flags, dtype=jnp.int32)

    def emit(ring, context):
        order = jnp.arange(flags.shape[0], dtype=jnp.int32)
        _, entries = lax.sort((jnp.where(flags, 0, 1).astype(jnp.int32), order), num_keys=1, is_stable=True)
        k = jnp.arange(capacity, dtype=jnp.int32) - start  # ring row start + k holds the k-th flagged candidate
        fresh = (k >= 0) & (k < total)
        rows, row_ctx = build(entries[jnp.clip(k, 0, flags.shape[0] - 1)])
        ring = jnp.where(fresh[:, None, None], rows, ring)
        if context is not None:
            context = jnp.where(fresh[:, None], row_ctx, context)
        return ring, context

    # The predicate is chosen by the platform lowered for (the rows are traced once, not once per platform):
    # always true on GPU, where XLA folds the conditional away (it would copy its predicate to the host).
    taken = (total > 0) & (start < capacity)
    same = lambda taken: taken  # noqa: E731 (one branch for CPU and TPU)
    taken = lax.platform_dependent(taken, cpu=same, tpu=same, default=jnp.ones_like)
    ring, context = lax.cond(taken, emit, lambda *x: x, ring, context)
    index = start + jnp.minimum(total, _INT32_MAX - start)
    return ring, context, index.reshape(1).astype(jnp.int32)


def bump(counters: jax.Array, increments: dict[int, jax.Array]) -> jax.Array:
    """``counters[tag] += amount`` on u64 (lo, hi) counters; amounts are non-negative int32.

    Elementwise over every tag (not one-row updates), so XLA fuses a step's bumps into one kernel.
    """
    tags = jnp.arange(counters.shape[0], dtype=jnp.int32)
    add = jnp.zeros(counters.shape[:1], jnp.uint32)
    for tag, amount in increments.items():
        add = add + jnp.where(tags == tag, jnp.asarray(amount).astype(jnp.uint32), jnp.uint32(0))
    return hash64.join(hash64.add(hash64.split(counters), (add, jnp.zeros_like(add))))


def after(rows: jax.Array) -> jax.Array:
    """A traced int32 zero that depends on ``rows`` (u32[capacity, 8, 2]: rows gathered from a canary buffer, or
    the ring itself).

    Added to the slots of the buffer's in-place store, it orders the store after the gathers (materialised behind
    an optimization barrier), so XLA neither schedules it first nor copies the whole buffer to keep its old bytes.
    Word [0, 7, 0] is a row's fail bits (< 2^31), or whatever the row gather read for an empty launch, which is
    also a fail-bits word; XLA cannot fold the shift to a constant.
    """
    return lax.shift_right_logical(rows[0, 7, 0], jnp.uint32(31)).astype(jnp.int32)
