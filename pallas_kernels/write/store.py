"""Scatters the new records into the canary buffer, deterministically, whatever backend walked the chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import hash64, records

# Up to this many entries, last_writer (and the phase's rejected-request check) compares every pair: one fused
# kernel, where on CPU each sort or scatter is a kernel of its own to compile. Above, it sorts (O(T log T)).
PAIRWISE_MAX_ENTRIES = 128


def last_writer(slots: jax.Array, valid: jax.Array, num_slots: int) -> jax.Array:
    """bool[T]: entries that are the last (in entry order) valid writer of their slot.

    XLA leaves the order of duplicate scatter indices unspecified; SGLang's serial reference lets the later entry
    win. An entry wins when no later valid entry writes its slot: checked pairwise for a few entries; for more, a
    stable sort by slot puts each slot's writers in entry order, so the last of each run is the winner.
    """
    key = jnp.where(valid & (slots < num_slots), slots, num_slots)
    if key.shape[0] <= PAIRWISE_MAX_ENTRIES:
        entry = jnp.arange(key.shape[0])
        overwritten = jnp.any((key[None, :] == key[:, None]) & (entry[None, :] > entry[:, None]), axis=1)
        return (key < num_slots) & ~overwritten
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    is_last = sorted_key != jnp.concatenate([sorted_key[1:], jnp.full((1,), -1, sorted_key.dtype)])
    return jnp.zeros_like(valid).at[order].set(is_last & (sorted_key < num_slots))


def store(
    canary_buf: jax.Array,
    out_cache_loc: jax.Array,
    input_ids: jax.Array,
    positions: jax.Array,
    prev_hash: jax.Array,
    real_kv: hash64.U64,
    written: jax.Array,
) -> jax.Array:
    """Writes ``(token, position, prev_hash, real_kv)`` at each written entry's slot; slots >= num_slots drop."""
    num_slots = canary_buf.shape[0]
    winner = last_writer(out_cache_loc, written, num_slots)
    target = jnp.where(winner, out_cache_loc, num_slots)  # sentinel = size: never -1, which would wrap
    new = records.pack(hash64.from_i32(input_ids), hash64.from_i32(positions), hash64.split(prev_hash), real_kv)
    return canary_buf.at[target].set(new, mode="drop")
