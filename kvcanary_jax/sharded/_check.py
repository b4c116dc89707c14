"""The TP cross-shard chain check: TP shards must write the same chain fields for this step's slots.

Cross-shard violation rows use SGLang's row layout with one bit of ours, ``FailReason.SHARD_CHAIN_MISMATCH``:
``launch_tag`` is the TAIL tag, ``slot_idx`` the written slot, ``position``/``stored_token``/``stored_chain_hash``
this shard's record, ``expected_token``/``expected_aux`` the consensus record's TOKEN and PREV_HASH, and
``fail_reason_bits`` is ``SHARD_CHAIN_MISMATCH | (consensus_tp_index << 32)``: the high word names the peer (the
core reader keeps only the low word as the fail reason).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kvcanary_jax.core import _ring
from kvcanary_jax.core._constants import FailReason
from kvcanary_jax.core._state import CanaryDeviceState
from kvcanary_jax.sharded._layout import MeshLayout
from pallas_kernels import hash64, layout, records, ring, validate

PEER_SHIFT = 32  # the peer's TP index lives in the high word of fail_reason_bits


def cross_shard_check(
    state: CanaryDeviceState, canary_buf: jax.Array, out_cache_loc: jax.Array, *, mesh_layout: MeshLayout, tag: int
) -> CanaryDeviceState:
    """Inside ``shard_map``: checks that TP shards wrote the same chain for this step's slots.

    Each TP shard all-gathers TOKEN, POSITION and PREV_HASH of the records at ``out_cache_loc`` (slots > 0). Per
    entry the consensus is the value most shards hold, ties going to the lowest TP index; a shard holding another
    value appends a ``SHARD_CHAIN_MISMATCH`` row naming the consensus shard (see the module docstring). With two
    shards a disagreement is therefore always reported by the second. Counters are left alone: this is not one of
    SGLang's launches. Without a ``tp_axis`` there is nothing to compare and ``state`` is returned unchanged.

    Args:
      state: this device's state (a :func:`local` view).
      canary_buf: u32[num_slots, 4, 2] this device's TAIL buffer, after this step's TAIL write.
      out_cache_loc: i32[T] slots written this step (the same on every TP shard).
      mesh_layout: the layout; its ``tp_axis`` is the axis compared over.
      tag: static TAIL launch tag stamped into the rows.

    Returns:
      The state with one row per disagreeing entry, in entry order.
    """
    validate.instance("mesh_layout", mesh_layout, MeshLayout)
    num_slots = validate.canary_buffer(canary_buf)
    validate.array("out_cache_loc", out_cache_loc, dtype=jnp.int32, ndim=1)
    tag = validate.static_int("tag", int(tag) if isinstance(tag, int) else tag, maximum=state.num_tags)
    if mesh_layout.tp_axis is None:
        return state
    num_entries = out_cache_loc.shape[0]
    live = (out_cache_loc > layout.PADDING_SLOT) & (out_cache_loc < num_slots)
    mine = canary_buf[records.clamp_slots(out_cache_loc, num_slots), : layout.FIELD_REAL_KV_HASH]  # u32[T, 3, 2]
    shards = lax.all_gather(mine, mesh_layout.tp_axis)  # u32[tp, T, 3, 2]
    agree = jnp.all(shards[:, None] == shards[None, :], axis=(-2, -1))  # bool[tp, tp, T]
    consensus = jnp.argmax(jnp.sum(agree, axis=1), axis=0).astype(jnp.int32)  # i32[T]; argmax: lowest index wins
    entries = jnp.arange(num_entries)
    flags = live & ~agree[lax.axis_index(mesh_layout.tp_axis), consensus, entries]
    peer = shards[consensus, entries]  # u32[T, 3, 2]

    def build_rows(entry):
        token, position, prev_hash = (hash64.split(mine[entry, f]) for f in range(3))
        peer_token, _, peer_prev_hash = (hash64.split(peer[entry, f]) for f in range(3))
        bits = (
            jnp.full_like(entry, int(FailReason.SHARD_CHAIN_MISMATCH), dtype=jnp.uint32),
            consensus[entry].astype(jnp.uint32),
        )
        rows = ring.pack_row(
            [
                hash64.const(tag, entry),
                hash64.from_i32(out_cache_loc[entry]),
                position,
                token,
                peer_token,
                prev_hash,
                peer_prev_hash,
                bits,
            ]
        )
        unknown = jnp.full_like(entry, -1)
        return rows, ring.row_context(unknown, lax.bitcast_convert_type(position[0], jnp.int32), entry)

    log = _ring.append(state.violation_log, flags, build_rows)
    return dataclasses.replace(state, violation_log=log)
