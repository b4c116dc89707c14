"""Pure-jnp verify: the specification of the per-entry fail bits, the default off-GPU, and the test oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import hash64, layout, realkv, records


def entry_bits(
    stored: records.Record,
    expected_chain: hash64.U64,
    reachable: jax.Array,
    expected_tokens: jax.Array,
    expected_positions: jax.Array,
    real_kv: hash64.U64,
    *,
    check_expected_token: bool,
) -> jax.Array:
    """The verify bits of entries whose stored record, expected chain and real-KV fold are already loaded."""
    token, position, prev_hash, stored_kv = stored
    bits = jnp.where(reachable & hash64.ne(prev_hash, expected_chain), layout.FAIL_VERIFY_CHAIN_HASH, 0)
    bits |= jnp.where(hash64.ne(position, hash64.from_i32(expected_positions)), layout.FAIL_VERIFY_POSITION, 0)
    bits |= jnp.where(hash64.ne(stored_kv, real_kv), layout.FAIL_VERIFY_REAL_KV_HASH, 0)
    if check_expected_token:
        token_bad = (expected_tokens != -1) & hash64.ne(token, hash64.from_i32(expected_tokens))
        bits |= jnp.where(token_bad, layout.FAIL_VERIFY_TOKEN, 0)
    return bits.astype(jnp.int32)


def verify_bits(
    canary_buf, slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_active, *,
    real_kv_sources, real_kv_hash_mode, check_expected_token,
) -> jax.Array:  # fmt: skip
    """``api.verify``'s bits (the contract is there), from checked arguments, ``num_active`` already clamped (0 when
    the plan is disabled): i32[capacity] OR of ``FAIL_VERIFY_*`` bits, 0 past it and for padding slot 0."""
    stored = records.load(canary_buf, slot_indices)
    expected_chain = records.slot_hash(canary_buf, prev_slot_indices)
    slots = records.clamp_slots(slot_indices, canary_buf.shape[0])
    real_kv = realkv.fold_slots(real_kv_sources, slots, real_kv_hash_mode)
    return loaded_bits(
        stored,
        expected_chain,
        real_kv,
        slot_indices,
        expected_tokens,
        expected_positions,
        prev_slot_indices,
        num_active,
        check_expected_token=check_expected_token,
    )


def loaded_bits(
    stored: records.Record,
    expected_chain: hash64.U64,
    real_kv: hash64.U64,
    slot_indices: jax.Array,
    expected_tokens: jax.Array,
    expected_positions: jax.Array,
    prev_slot_indices: jax.Array,
    num_active: jax.Array,
    *,
    check_expected_token: bool,
    entries: jax.Array | None = None,
) -> jax.Array:
    """:func:`verify_bits` of already loaded plan entries: ``stored`` (``records.load`` of the slots),
    ``expected_chain`` (``records.slot_hash`` of the predecessors) and ``real_kv`` (the folded KV) may carry
    leading axes (e.g. the K and V halves stacked) over the plan's ``[capacity]``; the bits get them too.
    ``entries`` (i32[n]) are the given entries' indices in the plan when they are some of its entries (default:
    all of them, in order)."""
    if entries is None:
        entries = jnp.arange(slot_indices.shape[0])
    live = (entries < num_active) & (slot_indices != layout.PADDING_SLOT)
    reachable = prev_slot_indices != 0  # prev == 0: padding/evicted predecessor, chain unknowable
    bits = entry_bits(
        stored,
        expected_chain,
        reachable,
        expected_tokens,
        expected_positions,
        real_kv,
        check_expected_token=check_expected_token,
    )
    return jnp.where(live, bits, 0)
