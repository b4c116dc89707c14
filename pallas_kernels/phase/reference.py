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
from pallas_kernels.phase import common
from pallas_kernels.prefix import api as prefix_sums
from pallas_kernels.verify import reference as verify_reference
from pallas_kernels.write import reference as write_reference
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
    if loc.shape[0] <= store.PAIRWISE_MAX_ENTRIES:  # a few tokens: compare every pair (one fused kernel)
        row_rejected = jnp.any(rejected[None, :] & (row[None, :] == row[:, None]), axis=1)
    else:
        row_rejected = jnp.zeros(batch.span_lens.shape, jnp.int32).at[row].max(rejected.astype(jnp.int32))[row] != 0
    return jnp.where(covered & (batch.active[row] != 0) & ~row_rejected, loc, -1)


# The u32 words of each entry's ``Loaded.words[entry, half]``: the record read at the entry's slot (its position
# field at _POSITION), the H() of its hashed slot, the REAL_KV_HASH fold of its slot and its verify bits.
_RECORD, _POSITION, _HASH, _FOLD, _BITS = slice(0, 8), slice(2, 4), slice(8, 10), slice(10, 12), 12
_WORDS = _BITS + 1

# Entries read per loop step on CPU: the loop walks the listed entries only (fusion.leading).
_BLOCK = 64


class Loaded(NamedTuple):
    """What the phase reads of the canary buffers before its writes, and what it derives from those reads alone.

    ``words`` is u32[R + T + capacity, halves, 13], one row per entry of three lists: each request's write-chain
    seed, each written token and each verify plan entry, in that order (:func:`read_halves`). Readers index it
    directly (:meth:`seeds`, :meth:`write_kv`, :meth:`verify`), so it is computed once and no slice or split copy
    of it crosses into a loop or a conditional. Past the plan's ``active`` entries the verify rows hold zeros or
    unspecified values (no reader looks there; the bits are 0)."""

    words: jax.Array
    table: jax.Array  # i32[R + T + capacity, 6] what each entry read: see read_halves
    num_reqs: int
    num_tokens: int

    def seeds(self) -> tuple[hash64.U64, hash64.U64]:
        """(H(seed slot), the seed slot's stored position) of each request's write chain, u64 [halves, R]."""
        seeds = jnp.moveaxis(self.words[: self.num_reqs], 0, 1)
        return hash64.split(seeds[..., _HASH]), hash64.split(seeds[..., _POSITION])

    def write_kv(self, h: int) -> hash64.U64:
        """Half ``h``'s REAL_KV_HASH of each written token's slot, u64 [T]."""
        return hash64.split(self.words[self.num_reqs : self.num_reqs + self.num_tokens, h, _FOLD])

    def verify(self, h, entries) -> tuple[records.Record, hash64.U64, jax.Array, tuple[jax.Array, ...]]:
        """(stored record, H(prev), verify bits i32, (slot, prev, expected token, expected position, batch row))
        of verify plan ``entries`` of half ``h`` (arrays of one shape, or an int half): one gather of each array."""
        at = self.num_reqs + self.num_tokens + entries
        words, plan = self.words[at, h], self.table[at]
        stored = records.fields(words[..., _RECORD].reshape(*words.shape[:-1], 4, 2))
        bits = lax.bitcast_convert_type(words[..., _BITS], jnp.int32)
        return stored, hash64.split(words[..., _HASH]), bits, tuple(plan[..., c] for c in (0, 1, 2, 3, 5))

    def bits(self) -> jax.Array:
        """i32[halves, capacity] the verify bits of every plan entry."""
        words = self.words[self.num_reqs + self.num_tokens :, :, _BITS]
        return lax.bitcast_convert_type(words.T, jnp.int32)


def read_halves(
    buffers: Sequence[jax.Array],
    plan: Plan,
    loc: jax.Array,
    real_kv_sources: Sequence[Sequence[realkv.RealKvSource]] = (),
    mode: int = layout.REAL_KV_NONE,
    check_expected_token: bool | None = None,
) -> Loaded:
    """Every read of the canary buffers and the real KV that the phase makes before its writes, in one pass.

    Per entry of the seeds (R), the written tokens ``loc`` (T) and the verify plan (capacity), of every half: the
    record at its slot (the seed, the written or the verified slot), H() of the slot it hashes (the seed; the
    predecessor; a token's own slot, unread), the REAL_KV_HASH fold of its slot (with ``real_kv_sources``, one
    list per half) and, for a verify entry when ``check_expected_token`` is not None, its verify bits. On CPU the
    pass is one loop over blocks of the seeds, the written tokens and the listed verify entries only
    (:func:`fusion.leading`); lowered elsewhere, one pass over all of them.
    """
    num_reqs, num_tokens, capacity = plan.seed_slot_indices.shape[0], loc.shape[0], plan.slot_indices.shape[0]
    fold = mode != layout.REAL_KV_NONE and any(real_kv_sources)
    seeds, tokens = plan.seed_slot_indices, loc
    none = lambda like, value: jnp.full(like.shape, value, jnp.int32)  # noqa: E731
    # Per entry: the slot read, the slot hashed (a verify entry's predecessor), the expected token and position,
    # the plan entry (capacity for a seed or a token: not a verify entry, no bits) and its batch row.
    table = jnp.stack(
        [
            jnp.concatenate(column)
            for column in (
                (seeds, tokens, plan.slot_indices),
                (seeds, tokens, plan.prev_slot_indices),
                (none(seeds, -1), none(tokens, -1), plan.expected_tokens),
                (none(seeds, 0), none(tokens, 0), plan.expected_positions),
                (none(seeds, capacity), none(tokens, capacity), jnp.arange(capacity, dtype=jnp.int32)),
                (none(seeds, 0), none(tokens, 0), plan.entry_rows),
            )
        ],
        axis=1,
    )

    def read_block(rows):  # i32[B, 6] entries -> u32[B, halves, 13]
        slots, hash_slots, tokens, positions, entries = (rows[:, c] for c in range(5))
        stored = jnp.stack([buf[records.clamp_slots(slots, buf.shape[0])] for buf in buffers])  # [halves, B, 4, 2]
        chained = jnp.stack([buf[records.clamp_slots(hash_slots, buf.shape[0])] for buf in buffers])
        chain = records.record_hash(hash_slots, records.fields(chained))
        real_kv = hash64.const(0, stored[..., 0, 0])
        if fold:
            clamped = records.clamp_slots(slots, buffers[0].shape[0])
            folds = [realkv.fold_slots(sources, clamped, mode) for sources in real_kv_sources]
            real_kv = tuple(jnp.stack(parts) for parts in zip(*folds, strict=True))
        bits = jnp.zeros(stored.shape[:2], jnp.int32)
        if check_expected_token is not None:
            bits = verify_reference.loaded_bits(
                records.fields(stored),
                chain,
                real_kv,
                slots,
                tokens,
                positions,
                hash_slots,
                plan.active,
                check_expected_token=check_expected_token,
                entries=entries,
            )
        # The hash, fold and bits words share their work: computed together, not once per word (no fold: zeros).
        shared = [*chain, lax.bitcast_convert_type(bits, jnp.uint32), *(real_kv if fold else ())]
        shared = fusion.computed_together(shared)
        chain, bits, real_kv = shared[:2], shared[2], shared[3:] if fold else real_kv
        words = jnp.stack([*chain, *real_kv, bits], axis=-1)
        return jnp.moveaxis(jnp.concatenate([stored.reshape(*stored.shape[:2], 8), words], axis=-1), 1, 0)

    entry = jax.ShapeDtypeStruct((len(buffers), _WORDS), jnp.uint32)
    words = fusion.leading(read_block, table, num_reqs + num_tokens + plan.active, _BLOCK, entry)
    return Loaded(words, table, num_reqs, num_tokens)


def load_halves(buffers: Sequence[jax.Array], plan: Plan) -> Loaded:
    """:func:`read_halves` of the seeds and the verify plan entries only: the records the rows read and the
    hashes, without folds or bits (a backend that verifies in its own kernels)."""
    return read_halves(buffers, plan, jnp.zeros((0,), jnp.int32))


def loaded_after(loaded: Loaded) -> jax.Array:
    """A traced int32 zero that orders a store after the phase's reads (:func:`fusion.zero_after`)."""
    return fusion.zero_after(loaded.words)


def write_input_bits(batch: common.Batch, written: jax.Array) -> jax.Array:
    """i32[..., T] the write input assert's ``FAIL_WRITE_TOKEN | FAIL_WRITE_POSITION`` bits of the ``written``
    entries (0 when the assert is off)."""
    if batch.expected_input_ids is None:
        return jnp.zeros(written.shape, batch.input_ids.dtype)
    bits = jnp.where(written & (batch.input_ids != batch.expected_input_ids), layout.FAIL_WRITE_TOKEN, 0)
    bad_position = written & (batch.positions != batch.expected_positions)
    return bits | jnp.where(bad_position, layout.FAIL_WRITE_POSITION, 0)


def stack_halves(trees):
    """One pytree from per-half pytrees of equal structure, each leaf stacked on a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def walk_halves(loaded: Loaded, plan: Plan, batch: common.Batch, loc, enable_chain_position_assert):
    """The write chains of every half as one batched walk (``write_reference.walk_chain`` over stacked seeds)."""
    num_reqs = jnp.full((1,), batch.req_pool_indices.shape[0], jnp.int32)
    walk = jax.vmap(write_reference.walk_chain, in_axes=(0, 0, None))
    seed_hash, seed_position = loaded.seeds()
    launch = write_reference.Launch(
        plan.write_offsets,
        plan.seed_slot_indices,
        num_reqs,
        batch.input_ids,
        batch.positions,
        loc,
        enable_chain_position_assert,
    )
    return walk(seed_hash, seed_position, launch)


class RowSet(NamedTuple):
    """The candidate rows of one kind of ``m`` launches: ``flags`` bool[m, n], each launch's candidates in order,
    and ``build(launch, entry)`` (i32 arrays of one shape) -> ``(rows u32[..., 8, 2], context i32[..., 3])`` of
    any of them. A phase's rows are built only when the ring takes some (:func:`finish`)."""

    flags: jax.Array
    build: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _tagged(rows: jax.Array, tags: Sequence[int], launch: jax.Array) -> jax.Array:
    """``rows`` (built with tag 0) with each row's launch tag, ``tags[launch]`` (a tag's high word is 0), set by an
    element-wise OR that fuses with the rows' packing (an indexed update would be a kernel of its own)."""
    field, word = jnp.indices(rows.shape[-2:])
    at_tag = (field == layout.ROW_LAUNCH_TAG) & (word == 0)
    return rows | jnp.where(at_tag, jnp.asarray(tags, jnp.uint32)[launch][..., None, None], jnp.uint32(0))


def _verify_set(
    p: Prepared, loaded: Loaded, bits: jax.Array | None, halves: Sequence[int], tags: Sequence[int], check: bool
) -> RowSet:
    """The verify rows of launches that read half ``halves[j]`` of ``loaded``, one tag each, with fail ``bits``
    i32[launches, capacity] (None: ``loaded``'s own, read where the rows are built)."""
    batch = p.batch

    def build(launch, entries):
        stored, expected_chain, own_bits, at = loaded.verify(jnp.asarray(halves, jnp.int32)[launch], entries)
        slot, prev, token, position, batch_row = at
        token = token if check else jnp.full_like(entries, -1)
        entry_bits = own_bits if bits is None else bits[launch, entries]
        fields = common.verify_row(0, slot, prev, stored, expected_chain, token, entry_bits)
        context = ring.row_context(batch.req_pool_indices[batch_row], position, batch_row)
        return _tagged(ring.pack_row(fields), tags, launch), context

    return RowSet((loaded.bits() if bits is None else bits) != 0, build)


def _write_set(p: Prepared, chain: write_reference.ChainOut, tags: Sequence[int]) -> RowSet:
    """The write rows of each half's chain walk (``chain`` stacked on a leading half axis, one tag per half):
    per token an input-assert row, then a chain-position row."""
    batch, loc = p.batch, p.loc
    input_bits = write_input_bits(batch, chain.written)
    flags = jnp.stack([input_bits != 0, chain.position_assert_failed], axis=-1).reshape(len(tags), -1)

    # Per half and token, every value a row reads (u32): token, position, expected token and position (the
    # input assert's; the written ones when it is off), slot, request row, input bits, the chain's expected
    # position and prev hash. One gather of it builds any row.
    expected_ids, expected_positions = batch.input_ids, batch.positions
    if batch.expected_input_ids is not None:
        expected_ids, expected_positions = batch.expected_input_ids, batch.expected_positions
    token_rows = common.token_row(p.plan.write_offsets, jnp.arange(loc.shape[0], dtype=jnp.int32))
    request = batch.req_pool_indices[token_rows]
    shared = jnp.stack([batch.input_ids, batch.positions, expected_ids, expected_positions, loc, request], axis=-1)
    as_u32 = lambda x: lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)  # noqa: E731 (i32 under x64 too)
    per_half = [as_u32(input_bits)[..., None], chain.expected_position, chain.prev_hash]
    shared = jnp.broadcast_to(as_u32(shared), (len(tags), *shared.shape))
    values = jnp.concatenate([shared, *per_half], axis=-1)

    def build(launch, entries):
        i, is_chain_row = entries // 2, entries % 2 == 1
        at = values[launch, i]
        token, position, expected_id, expected_position, slot, request, input_bit = (
            lax.bitcast_convert_type(at[..., c], jnp.int32) for c in range(7)
        )
        expected_token = jnp.where(is_chain_row, token, expected_id)
        aux = hash64.where(is_chain_row, hash64.split(at[..., 7:9]), hash64.from_i32(expected_position))
        bits = jnp.where(is_chain_row, layout.FAIL_WRITE_POSITION, input_bit)
        prev_hash = hash64.split(at[..., 9:11])
        rows = ring.pack_row(common.write_row(0, slot, position, token, expected_token, prev_hash, aux, bits))
        aux_i32 = lax.bitcast_convert_type(aux[0], jnp.int32)
        return _tagged(rows, tags, launch), ring.row_context(request, aux_i32, i)

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


def verify_rows(p: Prepared, loaded: Loaded, h: int, bits: jax.Array, tag: int, check: bool, capacity: int):
    """The pending verify launch ``(RowSet, 0)`` of half ``h``, from its ``loaded`` records and fail ``bits``
    (``capacity``, the ring's, is :func:`finish`'s to apply)."""
    del capacity
    return _verify_set(p, loaded, bits[None], (h,), (tag,), check), 0


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
    check = batch.token_ids is not None
    loaded = read_halves(buffers, plan, loc, real_kv_sources, spec.real_kv_hash_mode, check)
    chains = walk_halves(loaded, plan, batch, loc, enable_chain_position_assert)
    verify = _verify_set(p, loaded, None, range(len(buffers)), spec.tags, check)
    write = _write_set(p, chains, spec.tags)
    target = loc + loaded_after(loaded)  # the stores wait for every record the rows read from the buffers
    written = chains.written[0]  # the halves' chains write the same tokens: one last-writer pass serves both
    new_buffers = [
        store.store(buf, target, batch.input_ids, batch.positions, prev_hash, loaded.write_kv(h), written)
        for h, (buf, prev_hash) in enumerate(zip(buffers, chains.prev_hash, strict=True))
    ]
    pending = list(p.pending) + [(rows, h) for h in range(len(buffers)) for rows in (verify, write)]
    return finish(log, p, pending, new_buffers, written, spec.tags)
