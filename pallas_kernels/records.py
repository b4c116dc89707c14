"""Canary records: a slot's four u64 fields in a ``u32[num_slots, 4, 2]`` buffer, and the chain hash H(slot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import hash64, layout

Record = tuple[hash64.U64, hash64.U64, hash64.U64, hash64.U64]  # token, position, prev_hash, real_kv_hash


def clamp_slots(slots: jax.Array, num_slots: int) -> jax.Array:
    """Clamps slot indices into the buffer so a stray index reads a real (checked) record, never garbage."""
    return jnp.clip(slots, 0, num_slots - 1)


def load(canary_buf: jax.Array, slots: jax.Array) -> Record:
    """Gathers the records of ``slots`` (any shape) from ``u32[num_slots, 4, 2]``."""
    return fields(canary_buf[clamp_slots(slots, canary_buf.shape[0])])


def fields(rec: jax.Array) -> Record:
    """The four u64 fields of records already gathered, ``u32[..., 4, 2]``."""
    return tuple(hash64.split(rec[..., f, :]) for f in range(layout.CANARY_FIELDS_PER_SLOT))


def pack(token: hash64.U64, position: hash64.U64, prev_hash: hash64.U64, real_kv: hash64.U64) -> jax.Array:
    """Stacks four u64 fields into the ``u32[..., 4, 2]`` record layout."""
    return jnp.stack([hash64.join(f) for f in (token, position, prev_hash, real_kv)], axis=-2)


def chain_hash(record: Record) -> hash64.U64:
    """H(s) = mix3(PREV_HASH, TOKEN, POSITION) of a loaded record (REAL_KV_HASH stays out of the chain)."""
    token, position, prev_hash, _ = record
    return hash64.mix3(prev_hash, token, position)


def record_hash(slots: jax.Array, record: Record) -> hash64.U64:
    """H(slot) of already loaded records, with H(s) = splitmix64(anchor) for a chain head (s < 0)."""
    return hash64.where(slots < 0, hash64.anchor_hash(slots), chain_hash(record))


def slot_hash(canary_buf: jax.Array, slots: jax.Array) -> hash64.U64:
    """H(slot), with H(s) = splitmix64(anchor) for a chain head (s < 0)."""
    return record_hash(slots, load(canary_buf, slots))
