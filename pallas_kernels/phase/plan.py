"""The phase's plans in jnp: the verify and write plans SGLang's plan kernels build from the batch, and the tokens
a request the group cannot store leaves unwritten. ``reference.prepare`` starts every backend's phase from them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.phase import common
from pallas_kernels.prefix import api as prefix_sums
from pallas_kernels.write import store

# Up to this many batch rows, build_plan finds each entry's row by comparing it with every row's start (a
# reduction XLA:CPU compiles as one kernel), not by a binary search (a chain of gathers, each a kernel).
_COMPARE_ALL_MAX_ROWS = 32


class Plan(NamedTuple):
    """The verify and write plans of one phase (as ``kvcanary_jax.build_plans`` builds them, capacity = R)."""

    slot_indices: jax.Array  # i32[capacity]
    expected_tokens: jax.Array  # i32[capacity]
    expected_positions: jax.Array  # i32[capacity]
    prev_slot_indices: jax.Array  # i32[capacity]
    active: jax.Array  # i32[] entries to verify: all of them, or 0 when the plan overflowed
    enable: jax.Array  # i32[1] 0 when the plan overflowed its capacity
    write_offsets: jax.Array  # i32[R + 1]
    seed_slot_indices: jax.Array  # i32[R]
    entry_rows: jax.Array  # i32[capacity] each entry's batch row
    positions: jax.Array  # i32[capacity] each listed entry's position (expected_positions before the overflow)
    raw_slots: jax.Array  # i32[capacity] each listed entry's req_to_token value
    table_problems: jax.Array  # i32[capacity] common.slot_issue of the listed entries, 0 past them
    table_values: jax.Array  # i32[capacity] the value each table row names


def build_plan(
    batch: common.Batch, *, capacity: int, window: int, token_offset: int, full_slots: int, group_slots: int
) -> Plan:
    """SGLang's plan kernels in jnp (``kvcanary_jax.build_plans`` with ``write_req_capacity = R``), for the rows
    ``batch.active`` names, with the token spans ``batch.span_lens`` and the bad slots left out
    (:func:`common.plan_slots`)."""
    rpi, prefix, rtt = batch.req_pool_indices, batch.prefix_lens, batch.req_to_token
    num_reqs, max_context = rpi.shape[0], rtt.shape[1]
    gather_lut, lut_size = common.lut_reader(batch.full_to_swa_index_mapping)
    verify_lens = common.verify_len(batch.active, prefix, window)
    ends = prefix_sums.inclusive_sum(verify_lens)
    starts, total = ends - verify_lens, ends[-1]
    overflow = total > capacity
    num_valid = jnp.where(overflow, capacity, total)

    t = jnp.arange(capacity, dtype=jnp.int32)
    method = "compare_all" if num_reqs <= _COMPARE_ALL_MAX_ROWS else "scan_unrolled"
    req = jnp.clip(jnp.searchsorted(starts, t, side="right", method=method) - 1, 0, num_reqs - 1)
    pos = common.window_start(prefix, window)[req] + t - starts[req]
    row = rpi[req]
    raw = rtt[row, jnp.clip(pos, 0, max_context - 1)]
    raw_prev = jnp.where(pos > 0, rtt[row, jnp.clip(pos - 1, 0, max_context - 1)], -1)
    slot, prev = common.plan_slots(
        raw, raw_prev, pos, gather_lut, lut_size, full_slots=full_slots, group_slots=group_slots
    )
    expected_token = jnp.full_like(t, -1)
    if batch.token_ids is not None:
        pool = batch.token_ids
        token_pos = pos + token_offset
        known = (token_pos >= 0) & (token_pos < batch.token_ids_lens[req])
        expected_token = jnp.where(known, pool[row, jnp.clip(token_pos, 0, pool.shape[1] - 1)], -1)
    used = (t < num_valid) & ~overflow
    problem, value = common.slot_issue(raw, gather_lut, lut_size, full_slots=full_slots, group_slots=group_slots)

    seed = common.seed_slot(
        rtt[rpi, jnp.clip(prefix - 1, 0, max_context - 1)],
        (batch.active != 0) & (prefix > 0) & (batch.span_lens > 0),
        gather_lut,
        lut_size,
        full_slots=full_slots,
        group_slots=group_slots,
    )
    return Plan(
        slot_indices=jnp.where(used, slot, 0),
        expected_tokens=jnp.where(used, expected_token, -1),
        expected_positions=jnp.where(used, pos, 0),
        prev_slot_indices=jnp.where(used, prev, 0),
        active=jnp.where(overflow, 0, total).astype(jnp.int32),
        enable=jnp.where(overflow, 0, 1).reshape(1).astype(jnp.int32),
        write_offsets=prefix_sums.inclusive_sum(jnp.concatenate([jnp.zeros((1,), jnp.int32), batch.span_lens])),
        seed_slot_indices=seed.astype(jnp.int32),
        entry_rows=req.astype(jnp.int32),
        positions=pos,
        raw_slots=raw,
        table_problems=jnp.where(t < num_valid, problem, 0),
        table_values=value,
    )


def skip_rejected_requests(
    batch: common.Batch, write_offsets: jax.Array, gather_lut, lut_size, *, full_slots: int, group_slots: int
):
    """``batch.out_cache_loc`` with every token of a row that is not a request, and of a request with a new slot
    the group cannot store (:func:`common.slot_rejected`), skipped (-1): such a request writes nothing.
    ``write_offsets`` (i32[R + 1]) bound the rows' token spans."""
    loc = batch.out_cache_loc
    t = jnp.arange(loc.shape[0], dtype=jnp.int32)
    covered = t < write_offsets[-1]
    row = common.token_row(write_offsets, t)
    rejected = covered & common.slot_rejected(loc, gather_lut, lut_size, full_slots=full_slots, group_slots=group_slots)
    if loc.shape[0] <= store.PAIRWISE_MAX_ENTRIES:  # a few tokens: compare every pair (one fused kernel)
        row_rejected = jnp.any(rejected[None, :] & (row[None, :] == row[:, None]), axis=1)
    else:
        row_rejected = jnp.zeros(batch.span_lens.shape, jnp.int32).at[row].max(rejected.astype(jnp.int32))[row] != 0
    return jnp.where(covered & (batch.active[row] != 0) & ~row_rejected, loc, -1)
