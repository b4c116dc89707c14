"""The one ring append used by every op: a deterministic emulation of SGLang's atomic fill-once append."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvcanary_jax.state import ViolationLog
from pallas_kernels import hash64

_INT32_MAX = jnp.iinfo(jnp.int32).max


def pack_row(fields) -> jax.Array:
    """Eight u64 fields (each a (lo, hi) pair) to a ``u32[..., 8, 2]`` violation row."""
    return jnp.stack([hash64.join(f) for f in fields], axis=-2)


def append(log: ViolationLog, flags: jax.Array, build_rows: Callable[[jax.Array], jax.Array]) -> ViolationLog:
    """Appends one row per set flag, in flag order, to the fill-once ring.

    SGLang reserves ``idx = atomicAdd(index, 1)`` and writes row ``idx`` only if ``idx < capacity``. Here the
    reservation is an exclusive prefix sum over ``flags``, so row order is the flag (plan-entry) order on every
    backend. The entries that land are scattered by id with ``mode="drop"`` and sentinel = capacity, and only
    those (at most ``capacity``) get their rows built.

    Args:
      log: the ring and its write index.
      flags: bool[N] in append order.
      build_rows: maps i32[capacity] entry ids to u32[capacity, 8, 2] rows; only rows of landing ids are kept.

    Returns:
      The updated log; the index grows by the number of flags, saturating at 2^31 - 1 instead of wrapping.
    """
    capacity = log.ring_capacity
    flags = flags.reshape(-1)
    index = log.violation_write_index[0]
    ones = flags.astype(jnp.int32)
    exclusive = jnp.cumsum(ones) - ones
    count = jnp.sum(ones)
    room = jnp.clip(capacity - index, 0, capacity)
    target = jnp.where(flags & (exclusive < room), index + exclusive, capacity)
    entry = jnp.zeros((capacity,), jnp.int32).at[target].set(jnp.arange(flags.shape[0], dtype=jnp.int32), mode="drop")
    row = jnp.arange(capacity)
    fresh = (row >= index) & (row < index + jnp.minimum(count, room))
    ring = jnp.where(fresh[:, None, None], build_rows(entry), log.violation_ring)
    new_index = index + jnp.minimum(count, _INT32_MAX - index)
    return ViolationLog(violation_ring=ring, violation_write_index=new_index.reshape(1).astype(jnp.int32))
