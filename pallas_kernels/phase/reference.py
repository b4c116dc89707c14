"""Pure-jnp fused phase: the specification of one HEAD or TAIL phase of a group, the default off-GPU, the oracle.

A phase is SGLang's launch sequence for one group: build the verify and write plans from the batch, then per half
(K, then V) verify the cached slots and write this step's records. Its effects on the shared state are those of
the launches run one at a time in the order verify K, write K, verify V, write V: each launch's rows land in the
fill-once ring in plan-entry order, a verify's rows are read from the buffer as it stood before the phase's writes,
and every launch bumps its tag's counters (the phase also counts a verify overflow, when given a count).
``INVALID_INPUT`` rows, when asked for, come before them all: the caller's ``input_issues``, then the plan's table
values the pools cannot hold (``check_table``). This file states that directly, from the verify, write and store
references; the Triton kernels of ``pallas_triton`` must give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import fusion, hash64, layout, realkv, records, ring
from pallas_kernels import prefix as prefix_sums
from pallas_kernels.phase import common
from pallas_kernels.verify import reference as verify_reference
from pallas_kernels.write import reference as write_reference
from pallas_kernels.write import store

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
    req = jnp.clip(jnp.searchsorted(starts, t, side="right", method="scan_unrolled") - 1, 0, num_reqs - 1)
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
        write_offsets=jnp.concatenate([jnp.zeros((1,), jnp.int32), prefix_sums.inclusive_sum(batch.span_lens)]),
        seed_slot_indices=seed.astype(jnp.int32),
        entry_rows=req.astype(jnp.int32),
        positions=pos,
        raw_slots=raw,
        table_problems=jnp.where(t < num_valid, problem, 0),
        table_values=value,
    )


def first_flagged(flags: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(count i32[], entries i32[capacity]): how many flags are set, and the first ``capacity`` of them in order."""
    (entries,) = jnp.nonzero(flags, size=capacity, fill_value=0)
    return jnp.sum(flags, dtype=jnp.int32), entries.astype(jnp.int32)


def _table_rows(batch: common.Batch, plan: Plan, entries, tag: int, group_slots: int):
    """(rows, context) of the ``INVALID_INPUT`` rows of table-issue ``entries``."""
    batch_row, position = plan.entry_rows[entries], plan.positions[entries]
    request = batch.req_pool_indices[batch_row]
    issue = common.table_issue(
        plan.table_problems[entries],
        plan.table_values[entries],
        plan.raw_slots[entries],
        position,
        batch_row,
        request,
        has_lut=batch.full_to_swa_index_mapping is not None,
        group_slots=group_slots,
    )
    return ring.pack_row(common.input_row(tag, **issue)), ring.row_context(request, position, batch_row)


def _input_issue_rows(input_issues: jax.Array, entries, tag: int):
    """(rows, context) of the caller's ``input_issues`` columns ``entries``."""
    at = dict(zip(common.INPUT_ISSUE_FIELDS, input_issues[:, entries], strict=True))
    return ring.pack_row(common.input_row(tag, **at)), ring.row_context(at["request"], at["position"], at["entry"])


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
    rejects = jnp.zeros(batch.span_lens.shape, jnp.int32).at[row].max(rejected.astype(jnp.int32))
    return jnp.where(covered & (batch.active[row] != 0) & (rejects[row] == 0), loc, -1)


def _verify_rows(batch: common.Batch, plan: Plan, loaded: Loaded, bits, entries, tag: int, check: bool):
    """(rows, context) of verify flag ``entries``, from one half's loaded plan entries."""
    at = lambda u: (u[0][entries], u[1][entries])  # noqa: E731
    slot, prev = plan.slot_indices[entries], plan.prev_slot_indices[entries]
    token = plan.expected_tokens[entries] if check else jnp.full_like(entries, -1)
    stored = tuple(at(field) for field in loaded.stored)
    fields = common.verify_row(tag, slot, prev, stored, at(loaded.expected_chain), token, bits[entries])
    batch_row = plan.entry_rows[entries]
    context = ring.row_context(batch.req_pool_indices[batch_row], plan.expected_positions[entries], batch_row)
    return ring.pack_row(fields), context


class Loaded(NamedTuple):
    """What the phase reads of the canary buffers before its writes, per half stacked on a leading axis (K, V)."""

    stored: records.Record  # the verify plan entries' records, u64 [halves, capacity]
    expected_chain: hash64.U64  # H(prev) of each entry, u64 [halves, capacity]
    seed_hash: hash64.U64  # H(seed slot) of each request's write chain, u64 [halves, R]
    seed_position: hash64.U64  # the seed slots' stored positions, u64 [halves, R]


def stack_halves(trees):
    """One pytree from per-half pytrees of equal structure, each leaf stacked on a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def half(tree, h: int):
    """Half ``h`` of a pytree stacked by :func:`stack_halves`."""
    return jax.tree.map(lambda leaf: leaf[h], tree)


def load_halves(buffers: Sequence[jax.Array], plan: Plan) -> Loaded:
    """Reads every canary record the phase needs before its writes, and hashes the verify entries' predecessors
    and the write chains' seeds of all halves in one ``mix3`` pass over the stacked records."""
    stored = stack_halves([records.load(buf, plan.slot_indices) for buf in buffers])
    hashed = jnp.concatenate([plan.prev_slot_indices, plan.seed_slot_indices])
    hashed_records = stack_halves([records.load(buf, hashed) for buf in buffers])
    hashes = hash64.join(records.record_hash(hashed, hashed_records))
    # Read by the bits, each half's rows and the chain walk: computed once, not once per reader.
    hashes = fusion.computed_once(hashes, plan.active)
    capacity = plan.slot_indices.shape[0]
    seed_position = tuple(word[:, capacity:] for word in hashed_records[1])
    return Loaded(stored, hash64.split(hashes[:, :capacity]), hash64.split(hashes[:, capacity:]), seed_position)


def write_input_bits(batch: common.Batch, written: jax.Array) -> jax.Array:
    """i32[..., T] the write input assert's ``FAIL_WRITE_TOKEN | FAIL_WRITE_POSITION`` bits of the ``written``
    entries (0 when the assert is off)."""
    if batch.expected_input_ids is None:
        return jnp.zeros(written.shape, batch.input_ids.dtype)
    bits = jnp.where(written & (batch.input_ids != batch.expected_input_ids), layout.FAIL_WRITE_TOKEN, 0)
    bad_position = written & (batch.positions != batch.expected_positions)
    return bits | jnp.where(bad_position, layout.FAIL_WRITE_POSITION, 0)


def fold_halves(real_kv_sources, plan: Plan, loc: jax.Array, mode: int, group_slots: int):
    """(verify, write): each half's REAL_KV_HASH of the verify plan's slots and of the written slots, u64
    [halves, capacity] and [halves, T]. One fold per half over both slot lists, computed once for its two readers
    (the verify bits and the store)."""
    slots = records.clamp_slots(jnp.concatenate([plan.slot_indices, loc]), group_slots)
    folds = stack_halves([hash64.join(realkv.fold_slots(sources, slots, mode)) for sources in real_kv_sources])
    folds = fusion.computed_once(folds, plan.active)
    capacity = plan.slot_indices.shape[0]
    return hash64.split(folds[:, :capacity]), hash64.split(folds[:, capacity:])


def walk_halves(loaded: Loaded, plan: Plan, batch: common.Batch, loc, enable_chain_position_assert):
    """The write chains of every half as one batched walk (``write_reference.walk_chain`` over stacked seeds)."""
    num_reqs = jnp.full((1,), batch.req_pool_indices.shape[0], jnp.int32)
    walk = jax.vmap(write_reference.walk_chain, in_axes=(0, 0) + (None,) * 7)
    return walk(
        loaded.seed_hash,
        loaded.seed_position,
        plan.write_offsets,
        plan.seed_slot_indices,
        num_reqs,
        batch.input_ids,
        batch.positions,
        loc,
        enable_chain_position_assert,
    )


def _write_rows(batch: common.Batch, plan: Plan, loc, chain, input_bits, entries, tag: int):
    """(rows, context) of flag ``entries`` of ``[T, 2]`` flags (input-assert row, then chain-position row, per
    token)."""
    i, is_chain_row = entries // 2, entries % 2 == 1
    token, position = batch.input_ids[i], batch.positions[i]
    expected_token, input_aux = token, hash64.from_i32(position)
    if batch.expected_input_ids is not None:
        expected_token = jnp.where(is_chain_row, token, batch.expected_input_ids[i])
        input_aux = hash64.from_i32(batch.expected_positions[i])
    aux = hash64.where(is_chain_row, hash64.split(chain.expected_position[i]), input_aux)
    bits = jnp.where(is_chain_row, layout.FAIL_WRITE_POSITION, input_bits[i])
    prev_hash = hash64.split(chain.prev_hash[i])
    rows = ring.pack_row(common.write_row(tag, loc[i], position, token, expected_token, prev_hash, aux, bits))
    batch_row = common.token_row(plan.write_offsets, i)
    return rows, ring.row_context(batch.req_pool_indices[batch_row], lax.bitcast_convert_type(aux[0], jnp.int32), i)


class Prepared(NamedTuple):
    """What every backend's phase starts from (:func:`prepare`)."""

    batch: common.Batch  # padded to one token at least, with its rows' roles
    plan: Plan
    loc: jax.Array  # i32[T] each token's slot in the group; -1 where it is skipped
    pending: list  # the INVALID_INPUT rows, ``(count, rows, context)`` per set, placed before the launches'


def prepare(
    buffers: Sequence[jax.Array],
    log: common.Log,
    batch: common.Batch,
    input_issues: jax.Array | None,
    spec: common.PhaseSpec,
) -> Prepared:
    """The plan, the written slots and the ``INVALID_INPUT`` rows of a phase (arguments as in :func:`phase`)."""
    batch = common.with_roles(common.pad_tokens(batch))  # the write chain needs at least one token
    group_slots = buffers[0].shape[0]
    full_slots = spec.full_slots or group_slots
    plan = build_plan(
        batch,
        capacity=spec.verify_capacity,
        window=spec.window,
        token_offset=spec.token_offset,
        full_slots=full_slots,
        group_slots=group_slots,
    )
    gather_lut, lut_size = common.lut_reader(batch.full_to_swa_index_mapping)
    loc = batch.out_cache_loc
    if spec.skip_bad_requests:
        loc = skip_rejected_requests(
            batch, plan.write_offsets, gather_lut, lut_size, full_slots=full_slots, group_slots=group_slots
        )
    loc = common.write_slots(loc, gather_lut, lut_size, group_slots)
    capacity, pending = log.ring.shape[0], []
    if input_issues is not None:
        count, entries = first_flagged(input_issues[0] != 0, capacity)
        pending.append((count, *_input_issue_rows(input_issues, entries, spec.tags[0])))
    if spec.check_table:
        count, entries = first_flagged(plan.table_problems != 0, capacity)
        pending.append((count, *_table_rows(batch, plan, entries, spec.tags[0], group_slots)))
    return Prepared(batch, plan, loc, pending)


def verify_rows(p: Prepared, loaded: Loaded, bits: jax.Array, tag: int, check: bool, capacity: int):
    """``(count, rows, context)`` of one half's verify launch, from its ``loaded`` records and fail ``bits``;
    materialised behind a barrier, so that XLA does not fuse the row gathers into the ring update, after the
    store."""
    count, entries = first_flagged(bits != 0, capacity)
    return lax.optimization_barrier((count, *_verify_rows(p.batch, p.plan, loaded, bits, entries, tag, check)))


def write_rows(p: Prepared, chain: write_reference.ChainOut, tag: int, capacity: int):
    """``(count, rows, context)`` of one half's write launch, from its chain walk."""
    input_bits = write_input_bits(p.batch, chain.written)
    flags = jnp.stack([input_bits != 0, chain.position_assert_failed], axis=-1).reshape(-1)
    count, entries = first_flagged(flags, capacity)
    return (count, *_write_rows(p.batch, p.plan, p.loc, chain, input_bits, entries, tag))


def finish(
    log: common.Log, p: Prepared, pending: list, buffers: Sequence[jax.Array], written: jax.Array, tags: Sequence[int]
) -> tuple[tuple[jax.Array, ...], common.Log, jax.Array]:
    """Places the phase's rows in order and bumps its counters (a verify and a write per tag; ``written`` is a
    half's bool[T] written tokens)."""
    placed, context, write_index = ring.place(log.ring, log.context, log.write_index, pending)
    entries = p.plan.active + jnp.sum(written, dtype=jnp.int32)
    overflows = log.verify_overflows
    if overflows is not None:
        overflows = common.count_overflow(overflows, p.plan.enable == 0)
    new_log = common.Log(
        ring=placed,
        write_index=write_index,
        kernel_run_counters=ring.bump(log.kernel_run_counters, {tag: jnp.int32(2) for tag in tags}),
        slot_run_counters=ring.bump(log.slot_run_counters, {tag: entries for tag in tags}),
        context=context,
        verify_overflows=overflows,
    )
    return tuple(buffers), new_log, p.plan.enable


def phase(
    buffers: Sequence[jax.Array],
    log: common.Log,
    batch: common.Batch,
    enable_chain_position_assert: jax.Array,
    real_kv_sources: Sequence[Sequence[realkv.RealKvSource]],
    input_issues: jax.Array | None,
    spec: common.PhaseSpec,
) -> tuple[tuple[jax.Array, ...], common.Log, jax.Array]:
    """One phase of one group: per half, verify the plan's cached slots, then write this step's records.

    Args:
      buffers: per half (K, then V), u32[num_slots, 4, 2] canary buffers (one or two).
      log: the ring, write index and counters (:class:`common.Log`).
      batch: the step's arrays (:class:`common.Batch`); the token check is on when ``batch.token_ids`` is given,
        the write input assert when ``batch.expected_input_ids`` is.
      enable_chain_position_assert: i32[1].
      real_kv_sources: per half, the sources folded into REAL_KV_HASH (empty on HEAD phases).
      input_issues: i32[8, n] ``INVALID_INPUT`` candidates the caller checked (rows ``common.INPUT_ISSUE_FIELDS``;
        problem 0: none), placed first, in order, tagged ``spec.tags[0]``; or None.
      spec: the static arguments (:class:`common.PhaseSpec`).

    Returns:
      ``(buffers, log, enable)``: the new buffers and log, and i32[1] 0 when the verify plan overflowed.
    """
    p = prepare(buffers, log, batch, input_issues, spec)
    batch, plan, loc = p.batch, p.plan, p.loc
    group_slots, capacity = buffers[0].shape[0], log.ring.shape[0]
    loaded = load_halves(buffers, plan)
    verify_kv, write_kv = fold_halves(real_kv_sources, plan, loc, spec.real_kv_hash_mode, group_slots)
    bits = verify_reference.loaded_bits(
        loaded.stored,
        loaded.expected_chain,
        verify_kv,
        plan.slot_indices,
        plan.expected_tokens,
        plan.expected_positions,
        plan.prev_slot_indices,
        plan.active,
        check_expected_token=batch.token_ids is not None,
    )
    chains = walk_halves(loaded, plan, batch, loc, enable_chain_position_assert)
    pending, new_buffers = list(p.pending), []
    for h, (buf, tag) in enumerate(zip(buffers, spec.tags, strict=True)):
        verify = verify_rows(p, half(loaded, h), bits[h], tag, batch.token_ids is not None, capacity)
        chain = half(chains, h)
        pending += [verify, write_rows(p, chain, tag, capacity)]
        target = loc + ring.after(verify[1])  # the store waits for the verify rows read from this buffer
        new_buffers.append(
            store.store(buf, target, batch.input_ids, batch.positions, chain.prev_hash, half(write_kv, h), chain.written)
        )
    return finish(log, p, pending, new_buffers, chains.written[-1], spec.tags)
