"""Records that travel with their KV: ``snapshot_records`` of a set of slots, ``restore_and_verify`` into other slots.

When an engine moves KV out of the device pool and back (a host-memory backup, a prefill-to-decode hand-off), the
pages come back in new slots whose records were never written. Carry the records with the pages instead: snapshot
them where the KV leaves, restore them where it lands. The chain hash ``H(s) = mix3(PREV_HASH, TOKEN, POSITION)``
names no slot, so records moved to other slots keep their chain; the verify that follows the restore checks the new
mapping: each slot's predecessor along the new slots, its position, and (with sources) its KV bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core._constants import RealKvHashMode
from kvcanary_jax.core._ops import _host_arrays_to_jax, canary_verify
from kvcanary_jax.core._plans import VerifyPlan
from kvcanary_jax.core._state import CanaryDeviceState
from pallas_kernels import mesh, realkv, validate


def _in_pool(slots: jax.Array, num_slots: int) -> jax.Array:
    return (slots >= 1) & (slots < num_slots)


def _check_concrete_slots(name: str, slots, num_slots: int) -> None:
    """A host (non-traced) slot list must be padding (<= 0) or in the pool; traced ones are the verify's to catch."""
    try:
        host = np.asarray(slots)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced (under jit): a snapshot of such a slot is all zeros, whose restore fails its verify
    bad = host >= num_slots
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {int(host[i])} is out of range: the buffer has {num_slots} slots")


@mesh.entry_point("canary_buf", "slots")
def snapshot_records(canary_buf: jax.Array, slots: jax.Array) -> jax.Array:
    """The records of ``slots``, to travel with their KV.

    Args:
      canary_buf: u32[num_slots, 4, 2] records of one endpoint (e.g. a TAIL buffer, whose records carry real KV).
      slots: i32[n] slots; padding entries (<= 0), and traced slots past the buffer, give all-zero records.

    Returns:
      u32[n, 4, 2]: each slot's TOKEN, POSITION, PREV_HASH and REAL_KV_HASH, as stored.

    Raises:
      ValueError, TypeError: for a buffer or slots of the wrong shape or dtype, or a host slot past the buffer.
    """
    canary_buf, slots = _host_arrays_to_jax((canary_buf, slots))
    num_slots = validate.canary_buffer(canary_buf)
    validate.array("slots", slots, dtype=jnp.int32, ndim=1)
    _check_concrete_slots("slots", slots, num_slots)
    index = jnp.where(_in_pool(slots, num_slots), slots, num_slots)
    return canary_buf.at[index].get(mode="fill", fill_value=0)


@mesh.entry_point("canary_buf", "records", "slots")
def restore_records(canary_buf: jax.Array, records: jax.Array, slots: jax.Array) -> jax.Array:
    """Stores snapshot ``records`` at new ``slots``, unchecked: the first verify that reads the slots checks them.

    An engine that already verifies every slot a forward reads (chain, position, token, real KV, with the request
    named) only needs the records in place before that forward; :func:`restore_and_verify` also checks them at once.

    Args:
      canary_buf: u32[num_slots, 4, 2]; donate it under ``jax.jit`` so the store is in place.
      records: u32[n, 4, 2] from :func:`snapshot_records`.
      slots: i32[n] the new slots; padding entries (<= 0), and traced slots past the buffer, are not stored.

    Returns:
      The new buffer.

    Raises:
      ValueError, TypeError: for arrays of the wrong shape or dtype (named), or a host slot past the buffer.
    """
    canary_buf, records, slots = _host_arrays_to_jax((canary_buf, records, slots))
    num_slots = validate.canary_buffer(canary_buf)
    validate.array("slots", slots, dtype=jnp.int32, ndim=1)
    validate.array("records", records, dtype=jnp.uint32, shape=(slots.shape[0], 4, 2))
    _check_concrete_slots("slots", slots, num_slots)
    return canary_buf.at[jnp.where(_in_pool(slots, num_slots), slots, num_slots)].set(records, mode="drop")


@mesh.entry_point("state", "canary_buf", "records", "slots", "prev_slots", "positions")
def restore_and_verify(
    state: CanaryDeviceState,
    canary_buf: jax.Array,
    records: jax.Array,
    slots: jax.Array,
    prev_slots: jax.Array,
    positions: jax.Array,
    *,
    tag: int,
    real_kv_sources: Sequence[realkv.RealKvSource] = (),
    real_kv_hash_mode: RealKvHashMode | int | str = RealKvHashMode.NONE,
    backend: str = "auto",
) -> tuple[jax.Array, CanaryDeviceState]:
    """Stores snapshot ``records`` at new ``slots``, then verifies those slots as :func:`canary_verify` does.

    Each restored slot is checked against the new mapping: its PREV_HASH against ``H(prev_slots[i])`` (a slot
    restored in the same call, or one already in the buffer), its POSITION against ``positions[i]``, and, with
    sources, its REAL_KV_HASH against the KV bytes now at the slot. A record changed on the way, records landed in
    the wrong slots, or KV that is not the snapshot's become violations (rows in entry order, under ``tag``).

    Args:
      state: the device state.
      canary_buf: u32[num_slots, 4, 2]; donate it under ``jax.jit`` so the store is in place.
      records: u32[n, 4, 2] from :func:`snapshot_records`.
      slots: i32[n] the new slots; padding entries (<= 0) are neither stored nor verified.
      prev_slots: i32[n] each slot's predecessor in the new mapping: -1 at a chain head, 0 to skip the chain check.
      positions: i32[n] the position each new slot must hold.
      tag: static launch tag of the verify (a :class:`CanaryLaunchTag`), stamped into rows and counters.
      real_kv_sources, real_kv_hash_mode, backend: as :func:`canary_verify`'s.

    Returns:
      ``(canary_buf, state)``.

    Raises:
      ValueError, TypeError: for arrays of the wrong shape or dtype (named), a host slot past the buffer, or the
      arguments :func:`canary_verify` refuses.
    """
    canary_buf, records, slots, prev_slots, positions = _host_arrays_to_jax(
        (canary_buf, records, slots, prev_slots, positions)
    )
    num_slots = validate.canary_buffer(canary_buf)
    entries = {"slots": slots, "prev_slots": prev_slots, "positions": positions}
    for name, x in entries.items():
        validate.array(name, x, dtype=jnp.int32, ndim=1)
    n = validate.same_length(entries)
    validate.array("records", records, dtype=jnp.uint32, shape=(n, 4, 2))
    _check_concrete_slots("slots", slots, num_slots)
    _check_concrete_slots("prev_slots", prev_slots, num_slots)
    if not n:
        raise ValueError("slots needs at least one entry (shapes are static: pad it with slot 0)")
    new_buf = restore_records(canary_buf, records, slots)
    plan = VerifyPlan(
        slot_indices=jnp.where(_in_pool(slots, num_slots), slots, 0),
        expected_tokens=jnp.full((n,), -1, jnp.int32),
        expected_positions=positions,
        prev_slot_indices=prev_slots,
        num_valid=jnp.full((1,), n, jnp.int32),
        enable=jnp.ones((1,), jnp.int32),
    )
    state = canary_verify(state, new_buf, plan, tag=tag, real_kv_sources=real_kv_sources,
                          real_kv_hash_mode=real_kv_hash_mode, backend=backend)  # fmt: skip
    return new_buf, state
