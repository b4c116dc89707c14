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

from collections.abc import Callable, Sequence
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


class Loaded(NamedTuple):
    """What the phase reads of the canary buffers before its writes, per half stacked on a leading axis (K, V).

    Each value is computed once (materialised) for its readers; past the plan's ``active`` entries
    ``expected_chain`` holds unspecified values (no reader looks there)."""

    stored: records.Record  # the verify plan entries' records, u64 [halves, capacity]
    expected_chain: hash64.U64  # H(prev) of each entry, u64 [halves, capacity]
    seed_hash: hash64.U64  # H(seed slot) of each request's write chain, u64 [halves, R]
    seed_position: hash64.U64  # the seed slots' stored positions, u64 [halves, R]


# Plan entries hashed (or folded) per loop step on CPU: the loop walks the listed entries only (fusion.leading).
_BLOCK = 64


def stack_halves(trees):
    """One pytree from per-half pytrees of equal structure, each leaf stacked on a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def half(tree, h: int):
    """Half ``h`` of a pytree stacked by :func:`stack_halves`."""
    return jax.tree.map(lambda leaf: leaf[h], tree)


def load_halves(buffers: Sequence[jax.Array], plan: Plan) -> Loaded:
    """Reads every canary record the phase needs before its writes, and hashes the write chains' seeds and the
    listed verify entries' predecessors of all halves in one ``mix3`` pass (a loop over the listed entries only)."""
    stored = jnp.stack([buf[records.clamp_slots(plan.slot_indices, buf.shape[0])] for buf in buffers])
    stored = fusion.computed_once(stored, plan.active)  # read by the bits and the rows: gathered once
    num_reqs = plan.seed_slot_indices.shape[0]

    def hash_block(slots):  # i32[B] -> u32[B, halves, 2]
        loaded = stack_halves([records.load(buf, slots) for buf in buffers])
        return jnp.moveaxis(hash64.join(records.record_hash(slots, loaded)), 1, 0)

    hashed = jnp.concatenate([plan.seed_slot_indices, plan.prev_slot_indices])
    hashes = jnp.moveaxis(fusion.leading(hash_block, hashed, num_reqs + plan.active, _BLOCK), 0, 1)
    seed_position = stack_halves([records.load(buf, plan.seed_slot_indices)[1] for buf in buffers])
    return Loaded(
        records.fields(stored),
        hash64.split(hashes[:, num_reqs:]),
        hash64.split(hashes[:, :num_reqs]),
        seed_position,
    )


def loaded_after(loaded: Loaded) -> jax.Array:
    """A traced int32 zero that orders a store after the phase's reads (:func:`fusion.zero_after`)."""
    return fusion.zero_after(loaded.stored[0][0]) + fusion.zero_after(loaded.expected_chain[0])


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
    [halves, capacity] and [halves, T]. One fold per half over both slot lists (a loop over the written and the
    listed entries only, computed once for its two readers, the verify bits and the store); past the plan's
    ``active`` entries the verify folds hold unspecified values."""
    num_tokens, capacity = loc.shape[0], plan.slot_indices.shape[0]
    if mode == layout.REAL_KV_NONE or not any(real_kv_sources):
        zero = jnp.zeros((len(real_kv_sources), capacity + num_tokens), jnp.uint32)
        folds = (zero, zero)
    else:

        def fold_block(slots):  # i32[B] -> u32[B, halves, 2]
            return jnp.stack([hash64.join(realkv.fold_slots(sources, slots, mode)) for sources in real_kv_sources], 1)

        slots = records.clamp_slots(jnp.concatenate([loc, plan.slot_indices]), group_slots)
        folds = hash64.split(jnp.moveaxis(fusion.leading(fold_block, slots, num_tokens + plan.active, _BLOCK), 0, 1))
    return tuple(f[:, num_tokens:] for f in folds), tuple(f[:, :num_tokens] for f in folds)


def verify_bits(loaded: Loaded, real_kv: hash64.U64, plan: Plan, *, check_expected_token: bool) -> jax.Array:
    """i32[halves, capacity] each half's verify bits of the plan's entries (0 past its ``active`` ones): a loop
    over the listed entries only, computed once for the row count and the rows."""

    def bits_block(t):  # i32[B] plan entries -> i32[B, halves]
        at = lambda u: (u[0][:, t], u[1][:, t])  # noqa: E731
        bits = verify_reference.loaded_bits(
            tuple(at(field) for field in loaded.stored),
            at(loaded.expected_chain),
            at(real_kv),
            plan.slot_indices[t],
            plan.expected_tokens[t],
            plan.expected_positions[t],
            plan.prev_slot_indices[t],
            plan.active,
            check_expected_token=check_expected_token,
            entries=t,
        )
        return bits.T

    entries = jnp.arange(plan.slot_indices.shape[0], dtype=jnp.int32)
    return fusion.leading(bits_block, entries, plan.active, _BLOCK).T


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


class RowSet(NamedTuple):
    """The candidate rows of one kind of ``m`` launches: ``flags`` bool[m, n], each launch's candidates in order,
    and ``build(launch, entry)`` (i32 arrays of one shape) -> ``(rows u32[..., 8, 2], context i32[..., 3])`` of
    any of them. A phase's rows are built only when the ring takes some (:func:`finish`)."""

    flags: jax.Array
    build: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _tagged(rows: jax.Array, tags: Sequence[int], launch: jax.Array) -> jax.Array:
    """``rows`` (built with tag 0) with each row's launch tag, ``tags[launch]`` (a tag's high word is 0)."""
    return rows.at[..., layout.ROW_LAUNCH_TAG, 0].set(jnp.asarray(tags, jnp.uint32)[launch])


def _verify_set(p: Prepared, loaded: Loaded, bits: jax.Array, tags: Sequence[int], check: bool) -> RowSet:
    """The verify rows of each half (``loaded`` and ``bits`` i32[halves, capacity] stacked, one tag per half)."""
    batch, plan = p.batch, p.plan

    def build(launch, entries):
        at = lambda u: (u[0][launch, entries], u[1][launch, entries])  # noqa: E731
        slot, prev = plan.slot_indices[entries], plan.prev_slot_indices[entries]
        token = plan.expected_tokens[entries] if check else jnp.full_like(entries, -1)
        stored = tuple(at(field) for field in loaded.stored)
        fields = common.verify_row(0, slot, prev, stored, at(loaded.expected_chain), token, bits[launch, entries])
        batch_row = plan.entry_rows[entries]
        context = ring.row_context(batch.req_pool_indices[batch_row], plan.expected_positions[entries], batch_row)
        return _tagged(ring.pack_row(fields), tags, launch), context

    return RowSet(bits != 0, build)


def _write_set(p: Prepared, chain: write_reference.ChainOut, tags: Sequence[int]) -> RowSet:
    """The write rows of each half's chain walk (``chain`` stacked on a leading half axis, one tag per half):
    per token an input-assert row, then a chain-position row."""
    batch, loc = p.batch, p.loc
    input_bits = write_input_bits(batch, chain.written)
    flags = jnp.stack([input_bits != 0, chain.position_assert_failed], axis=-1).reshape(len(tags), -1)

    def build(launch, entries):
        i, is_chain_row = entries // 2, entries % 2 == 1
        token, position = batch.input_ids[i], batch.positions[i]
        expected_token, input_aux = token, hash64.from_i32(position)
        if batch.expected_input_ids is not None:
            expected_token = jnp.where(is_chain_row, token, batch.expected_input_ids[i])
            input_aux = hash64.from_i32(batch.expected_positions[i])
        aux = hash64.where(is_chain_row, hash64.split(chain.expected_position[launch, i]), input_aux)
        bits = jnp.where(is_chain_row, layout.FAIL_WRITE_POSITION, input_bits[launch, i])
        prev_hash = hash64.split(chain.prev_hash[launch, i])
        rows = ring.pack_row(common.write_row(0, loc[i], position, token, expected_token, prev_hash, aux, bits))
        batch_row = common.token_row(p.plan.write_offsets, i)
        aux_i32 = lax.bitcast_convert_type(aux[0], jnp.int32)
        return _tagged(rows, tags, launch), ring.row_context(batch.req_pool_indices[batch_row], aux_i32, i)

    return RowSet(flags, build)


class Prepared(NamedTuple):
    """What every backend's phase starts from (:func:`prepare`)."""

    batch: common.Batch  # padded to one token at least, with its rows' roles
    plan: Plan
    loc: jax.Array  # i32[T] each token's slot in the group; -1 where it is skipped
    pending: list  # the INVALID_INPUT rows, ``(RowSet, launch)`` per set, placed before the launches'


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
    tag, pending = spec.tags[0], []
    if input_issues is not None:
        build = lambda _, entries: _input_issue_rows(input_issues, entries, tag)  # noqa: E731
        pending.append((RowSet((input_issues[0] != 0)[None], build), 0))
    if spec.check_table:
        build = lambda _, entries: _table_rows(batch, plan, entries, tag, group_slots)  # noqa: E731
        pending.append((RowSet((plan.table_problems != 0)[None], build), 0))
    return Prepared(batch, plan, loc, pending)


def verify_rows(p: Prepared, loaded: Loaded, bits: jax.Array, tag: int, check: bool, capacity: int):
    """The pending verify launch ``(RowSet, 0)`` of one half, from its ``loaded`` records and fail ``bits``
    (``capacity``, the ring's, is :func:`finish`'s to apply)."""
    del capacity
    return _verify_set(p, stack_halves([loaded]), bits[None], (tag,), check), 0


def write_rows(p: Prepared, chain: write_reference.ChainOut, tag: int, capacity: int):
    """The pending write launch ``(RowSet, 0)`` of one half, from its chain walk."""
    del capacity
    return _write_set(p, stack_halves([chain]), (tag,)), 0


def _place(log: common.Log, pending: list) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """``ring.place`` of every pending launch's candidates at once, each kind's rows built once for all its
    launches."""

    def build(at):  # the rows of the candidates ``at`` (every pending launch's, in ring order)
        tables = {}
        for rows, _ in pending:
            if id(rows) not in tables:
                launch, entry = jnp.indices(rows.flags.shape, jnp.int32)
                tables[id(rows)] = rows.build(launch, entry)
        table = [jax.tree.map(lambda x, j=j: x[j], tables[id(rows)]) for rows, j in pending]
        return tuple(jnp.concatenate(parts)[at] for parts in zip(*table, strict=True))

    flags = jnp.concatenate([rows.flags[launch] for rows, launch in pending])
    return ring.place(log.ring, log.context, log.write_index, flags, build)


def finish(
    log: common.Log, p: Prepared, pending: list, buffers: Sequence[jax.Array], written: jax.Array, tags: Sequence[int]
) -> tuple[tuple[jax.Array, ...], common.Log, jax.Array]:
    """Places the phase's rows in order (``pending``: ``(RowSet, launch)`` per launch, in ring order) and bumps
    its counters (a verify and a write per tag; ``written`` is a half's bool[T] written tokens)."""
    placed, context, write_index = _place(log, pending)
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
    group_slots = buffers[0].shape[0]
    loaded = load_halves(buffers, plan)
    verify_kv, write_kv = fold_halves(real_kv_sources, plan, loc, spec.real_kv_hash_mode, group_slots)
    bits = verify_bits(loaded, verify_kv, plan, check_expected_token=batch.token_ids is not None)
    chains = walk_halves(loaded, plan, batch, loc, enable_chain_position_assert)
    verify = _verify_set(p, loaded, bits, spec.tags, batch.token_ids is not None)
    write = _write_set(p, chains, spec.tags)
    target = loc + loaded_after(loaded)  # the stores wait for every record the rows read from the buffers
    written = chains.written[0]  # the halves' chains write the same tokens: one last-writer pass serves both
    new_buffers = [
        store.store(buf, target, batch.input_ids, batch.positions, prev_hash, half(write_kv, h), written)
        for h, (buf, prev_hash) in enumerate(zip(buffers, chains.prev_hash, strict=True))
    ]
    pending = list(p.pending) + [(rows, h) for h in range(len(buffers)) for rows in (verify, write)]
    return finish(log, p, pending, new_buffers, written, spec.tags)

