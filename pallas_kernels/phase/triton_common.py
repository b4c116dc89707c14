"""Ref-side pieces of the fused phase kernels: ref unpacking, the in-kernel plan, the verify of a block, row stores.

Both kernels of ``pallas_triton`` take the batch's arrays and the KV sources as their leading inputs (whole-array
refs, see ``compat.triton_call``; the check kernel the canary buffers too) and build plan entries from them with the
functions here, so the check kernel and the ring programs see identical plan entries without materialising the
plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from pallas_kernels import compat, hash64, kernel_io, realkv, records
from pallas_kernels.batch_checks import pallas_triton as batch_checks
from pallas_kernels.phase import common
from pallas_kernels.verify import reference as verify_reference


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shapes of the phase kernels (every block a power of 2).

    Attributes:
      verify_block: plan entries per verify program of the check kernel and per block program of the ring.
      store_block: tokens per store program.
      dedupe: duplicate-slot winner rule of the store: ``"pairwise"`` in-kernel, or ``"sort"``.
      req_chunk: requests compared per step of the in-kernel request lookup (after its narrowing, 0 or 1 steps
        at decode sizes; a [verify_block, req_chunk] compare, so it sets the check kernel's registers).
      sum_chunk: counts summed per step when a program adds up other programs' counts.
      token_chunk: tokens per step when the ring ranks a request's write rows.
      compare_block: later tokens per step of the pairwise winner scan.
      num_warps, num_stages: Triton launch parameters.
    """

    verify_block: int
    store_block: int
    dedupe: str
    req_chunk: int = 8
    sum_chunk: int = 1024
    token_chunk: int = 64
    compare_block: int = 64
    num_warps: int = 4
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels know statically about one phase launch."""

    num_reqs: int
    num_tokens: int
    tags: tuple[int, ...]
    specs: tuple[tuple[realkv.RealKvSource, ...], ...]  # per half, shape-only (kernel_io.source_specs)
    mode: int
    capacity: int
    window: int
    token_offset: int
    has_lut: bool
    has_pool: bool
    has_inputs: bool
    config: Config
    full_slots: int  # the FULL pool's slots: the range of req_to_token's values
    group_slots: int  # this group's slots (its canary buffers')
    has_context: bool = False  # the ring carries a context array
    check_table: bool = False  # report the listed entries' table issues (common.slot_issue) first
    skip_bad_requests: bool = False  # write nothing for a non-request row, or a request with a rejected slot
    num_issues: int = 0  # columns of the caller's input_issues (placed before everything)
    count_overflows: bool = False  # the log has a verify_overflows counter to bump
    # The batch checks' launch description when the rows' roles are derived in-kernel (:func:`roles`) from the
    # batch instead of read from ``batch.active`` and ``batch.span_lens``; None: read.
    checks: batch_checks.Static | None = None
    run_checks: bool = False  # the check kernel also runs the batch checks' programs (their candidates first)

    @property
    def halves(self) -> int:
        return len(self.tags)

    @property
    def num_blocks(self) -> int:
        """Verify blocks (programs of the check kernel after the chain walks)."""
        return -(-self.capacity // self.config.verify_block)


class Inputs(NamedTuple):
    """The leading refs every phase kernel takes (optional ones are None when absent)."""

    rpi: Any  # i32[R]
    prefix: Any  # i32[R]
    extend: Any  # i32[R] | None: extend_lens, when the roles are derived (Static.checks)
    active: Any  # i32[R] | None: nonzero for the rows that are requests, when the roles are read
    span: Any  # i32[R] | None: token entries each row owns, when the roles are read
    rtt: Any  # i32[max_reqs, max_context_len]
    ids: Any  # i32[T]
    positions: Any  # i32[T]
    loc: Any  # i32[T]
    cpa: Any  # i32[1] enable_chain_position_assert
    lut: Any  # i32[full_slots + 1] | None
    pool: Any  # i32[rows, len] | None
    pool_lens: Any  # i32[R] | None
    exp_ids: Any  # i32[T] | None
    exp_pos: Any  # i32[T] | None
    bufs: tuple  # per half u32[num_slots, 8]
    kv: tuple  # per half, the sources' dtype[pages, row_elements] refs


def input_arrays(batch: common.Batch, cpa, buffers, sources, st: Static, *, interpret: bool) -> list[jax.Array]:
    """The arrays behind :class:`Inputs`, in the order :func:`take` unpacks them; ``buffers`` may be ``()``."""
    roles = [batch.extend_lens] if st.checks is not None else [batch.active, batch.span_lens]
    arrays = [
        batch.req_pool_indices,
        batch.prefix_lens,
        *roles,
        batch.req_to_token,
        batch.input_ids,
        batch.positions,
        batch.out_cache_loc,
        cpa,
    ]
    arrays += [batch.full_to_swa_index_mapping] if batch.full_to_swa_index_mapping is not None else []
    arrays += [batch.token_ids, batch.token_ids_lens] if batch.token_ids is not None else []
    if batch.expected_input_ids is not None:
        arrays += [batch.expected_input_ids, batch.expected_positions]
    arrays += [kernel_io.record_rows(b) for b in buffers]
    arrays += [kernel_io.kv_rows(s.data, interpret=interpret) for half in sources for s in half]
    return arrays


def take(refs, st: Static, *, with_buffers: bool = True) -> tuple[Inputs, list]:
    """Splits a kernel's refs into :class:`Inputs` and the rest (its own inputs, then its outputs).

    The ring-and-store kernel takes no read-only buffers (``with_buffers=False``): it updates them in place, and an
    aliased buffer that is also read through another operand would make XLA copy it first.
    """
    it = iter(refs)
    rows = [next(it) for _ in range(2)]
    roles = [next(it), None, None] if st.checks is not None else [None, next(it), next(it)]
    fixed = rows + roles + [next(it) for _ in range(5)]
    lut = next(it) if st.has_lut else None
    pool, pool_lens = (next(it), next(it)) if st.has_pool else (None, None)
    exp_ids, exp_pos = (next(it), next(it)) if st.has_inputs else (None, None)
    bufs = tuple(next(it) for _ in range(st.halves)) if with_buffers else ()
    kv = tuple(tuple(next(it) for _ in specs) for specs in st.specs)
    return Inputs(*fixed, lut, pool, pool_lens, exp_ids, exp_pos, bufs, kv), list(it)


def arange(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def load(ref, idx: jax.Array, mask: jax.Array, other=0) -> jax.Array:
    """Masked gather from a 1-D ref."""
    return plt.load(ref.at[idx], mask=mask, other=other)


def load_row(ref, h: int, idx: jax.Array, mask: jax.Array, other=0) -> jax.Array:
    """Masked gather from row ``h`` of a 2-D ref (all-array indices: pallas_notes §2a)."""
    return plt.load(ref.at[jnp.full(idx.shape, h, jnp.int32), idx], mask=mask, other=other)


def loop(n: int, body: Callable, carry):
    """``fori_loop`` over a static trip count, unrolled when short so independent loads issue together."""
    if n <= 8:
        for c in range(n):
            carry = body(jnp.int32(c), carry)
        return carry
    return lax.fori_loop(jnp.int32(0), jnp.int32(n), body, carry)


def lut_reader(inp: Inputs):
    """``(gather_lut, lut_size)`` of ``common``'s slot formulas, reading the LUT ref; ``(None, None)`` without one."""
    return (None, None) if inp.lut is None else ((lambda i: inp.lut[i]), inp.lut.shape[0])


def translate(inp: Inputs, slots: jax.Array) -> jax.Array:
    """``common.translate`` through the LUT ref, when the group has one."""
    return common.translate(slots, *lut_reader(inp))


def row_sum(ref, h: int, upto, st: Static, *, flags: bool = False) -> jax.Array:
    """i32[]: the sum of ``ref[h, :upto]`` (a 2-D count ref), ``sum_chunk`` counts per step; with ``flags``, the
    number of nonzero values instead."""
    n = ref.shape[1]
    chunk = min(st.config.sum_chunk, compat.next_power_of_2(n))

    def body(c, acc):
        j = c * chunk + arange(chunk)
        values = load_row(ref, h, j, (j < n) & (j < upto))
        return acc + jnp.sum((values != 0).astype(jnp.int32) if flags else values, dtype=jnp.int32)

    return loop(-(-n // chunk), body, jnp.int32(0))


def roles(inp: Inputs, j: jax.Array, bound, carry, st: Static):
    """((active, span, bad), carry): the roles of rows ``j`` (consecutive; 0 from ``bound`` on), read or derived.
    Derived (``st.checks``), they are the batch checks' (``batch_checks.roles``), from the span and bad-span sums
    of the rows before ``j[0]`` (``carry``: the previous chunk's, ``(0, 0)`` for row 0); read, the carry is passed
    through and ``bad`` is 0."""
    if st.checks is None:
        m = j < bound
        return (load(inp.active, j, m), load(inp.span, j, m), jnp.zeros(j.shape, jnp.int32)), carry
    return batch_checks.roles((inp.rpi, inp.prefix, inp.extend), j, bound, carry, st.checks)


def request_sums(inp: Inputs, per_request: Callable, num_values: int, st: Static) -> tuple[jax.Array, ...]:
    """i32[] each: the sums over every row ``j`` of the ``num_values`` values ``per_request(j, active, prefix,
    span)``, ``sum_chunk`` rows per step."""
    n = st.num_reqs
    chunk = min(st.config.sum_chunk, compat.next_power_of_2(n))

    def body(c, carry):
        sums, rows_before = carry
        j = c * chunk + arange(chunk)
        m = j < n
        (active, span, _), rows_before = roles(inp, j, n, rows_before, st)
        values = per_request(j, active, load(inp.prefix, j, m), span)
        sums = tuple(s + jnp.sum(jnp.where(m, v, 0), dtype=jnp.int32) for s, v in zip(sums, values, strict=True))
        return sums, rows_before

    zero = jnp.int32(0)
    return loop(-(-n // chunk), body, ((zero,) * num_values, (zero, zero)))[0]


def verify_total(inp: Inputs, st: Static) -> tuple[jax.Array, jax.Array]:
    """(total verify entries, active entries): active is 0 when the plan overflows its capacity."""
    (total,) = request_sums(inp, lambda _, act, prefix, __: (common.verify_len(act, prefix, st.window),), 1, st)
    return total, jnp.where(total > st.capacity, 0, total)


def write_span(inp: Inputs, r, st: Static) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(start, count, span, active) of row ``r``: its tokens, clamped to the token arrays as the write op does,
    the entries it owns, and whether it is a request."""

    def per_request(j, active, _, span):
        return jnp.where(j < r, span, 0), jnp.where(j == r, span, 0), jnp.where(j == r, active, 0)

    before, own, active = request_sums(inp, per_request, 3, st)
    start = jnp.clip(before, 0, st.num_tokens)
    end = jnp.clip(before + own, 0, st.num_tokens)
    return start, jnp.maximum(end - start, 0), own, active


class Entries(NamedTuple):
    """One block of verify plan entries (i32[block] each), as ``build_plans`` would hold them."""

    t: jax.Array
    req: jax.Array  # each entry's batch row
    slot: jax.Array
    prev: jax.Array
    position: jax.Array
    token: jax.Array
    active: jax.Array  # i32[] entries to verify


def locate(inp: Inputs, t: jax.Array, st: Static):
    """(request, its first entry, total entries) of plan entries ``t`` (consecutive), without a materialised prefix
    sum.

    Entry t belongs to the request r with ``start_r <= t < end_r``, i.e. r = #requests whose end is <= t (SGLang's
    searchsorted over starts, for every t < total). The ends never decrease (``common.verify_len`` >= 0), so one
    pass over the requests, ``sum_chunk`` at a time and one scalar per request, narrows the block's entries to the
    requests ``[below, reach)`` whose ends fall inside the block: the ``below`` requests before them end at or before
    its first entry (their last end is ``base``). Only those are compared against each entry, ``req_chunk`` at a
    time as a [block, chunk] matrix: none when the block lies inside one request, the common case.
    With derived roles (``st.checks``), the pass also sums the spans and bad spans of the ``below`` requests,
    from which the compare derives the roles of the requests after them (:func:`roles`).
    """
    n = st.num_reqs
    first, last = jnp.min(t), jnp.max(t)

    def lens_of(j, bound, rows_before):
        (active, span, bad), rows_before = roles(inp, j, bound, rows_before, st)
        lens = common.verify_len(active, load(inp.prefix, j, j < bound), st.window)  # 0 where masked
        return lens, span, bad, rows_before

    wide = min(st.config.sum_chunk, compat.next_power_of_2(n))

    def scan(c, carry):
        below, reach, base, total, rows_before, rows_below = carry
        j = c * wide + arange(wide)
        m = j < n
        lens, span, bad, rows_before = lens_of(j, n, rows_before)
        ends = total + jnp.cumsum(lens, dtype=jnp.int32)
        early = (ends <= first) & m
        below = below + jnp.sum(early.astype(jnp.int32), dtype=jnp.int32)
        reach = reach + jnp.sum(((ends <= last) & m).astype(jnp.int32), dtype=jnp.int32)
        base = jnp.maximum(base, jnp.max(jnp.where(early, ends, 0)))
        rows_below = tuple(
            s + jnp.sum(jnp.where(early, x, 0), dtype=jnp.int32) for s, x in zip(rows_below, (span, bad), strict=True)
        )
        return below, reach, base, total + jnp.sum(lens, dtype=jnp.int32), rows_before, rows_below

    zero = jnp.int32(0)
    carry = (zero, zero, zero, zero, (zero, zero), (zero, zero))
    below, reach, base, total, _, rows_below = loop(-(-n // wide), scan, carry)
    chunk = min(st.config.req_chunk, compat.next_power_of_2(n))

    def near(c, carry):
        count, start, running, rows_before = carry
        j = below + c * chunk + arange(chunk)
        m = j < reach
        lens, _, _, rows_before = lens_of(j, reach, rows_before)
        ends = running + jnp.cumsum(lens, dtype=jnp.int32)
        before = (ends[None, :] <= t[:, None]) & m[None, :]
        count = count + jnp.sum(before.astype(jnp.int32), axis=1, dtype=jnp.int32)
        start = jnp.maximum(start, jnp.max(jnp.where(before, ends[None, :], 0), axis=1))
        return count, start, running + jnp.sum(lens, dtype=jnp.int32), rows_before

    steps = (reach - below + chunk - 1) // chunk
    full = lambda x: jnp.full(t.shape, x, jnp.int32)  # noqa: E731
    count, start, _, _ = lax.fori_loop(zero, steps, near, (full(below), full(base), base, rows_below))
    return jnp.minimum(count, n - 1), start, total


class TableValues(NamedTuple):
    """What plan entries read from ``req_to_token`` (i32[block] each)."""

    position: jax.Array
    raw: jax.Array  # the value at the position
    raw_prev: jax.Array  # the value at the position before (-1 for a chain head)


def table_values(inp: Inputs, t: jax.Array, req: jax.Array, start: jax.Array, st: Static) -> TableValues:
    """The table values of plan entries ``t`` of requests ``req`` (from :func:`locate`)."""
    position = common.window_start(inp.prefix[req], st.window) + t - start
    num_rows, max_context = inp.rtt.shape
    row = common.jnp_index(inp.rpi[req], num_rows)
    raw = inp.rtt[row, jnp.clip(position, 0, max_context - 1)]
    raw_prev = jnp.where(position > 0, inp.rtt[row, jnp.clip(position - 1, 0, max_context - 1)], -1)
    return TableValues(position, raw, raw_prev)


def plan_entries(inp: Inputs, t: jax.Array, req: jax.Array, values: TableValues, active, st: Static) -> Entries:
    """The plan entries ``t`` of requests ``req`` from their :func:`table_values`; entries past ``active`` are
    zeroed."""
    position = values.position
    slot, prev = common.plan_slots(
        values.raw,
        values.raw_prev,
        position,
        *lut_reader(inp),
        full_slots=st.full_slots,
        group_slots=st.group_slots,
    )
    token = jnp.full(t.shape, -1, jnp.int32)
    if st.has_pool:
        token_pos = position + st.token_offset
        known = (token_pos >= 0) & (token_pos < inp.pool_lens[req])
        pool_row = common.jnp_index(inp.rpi[req], inp.pool.shape[0])
        token = jnp.where(known, inp.pool[pool_row, jnp.clip(token_pos, 0, inp.pool.shape[1] - 1)], -1)
    used = t < active
    return Entries(
        t=t,
        req=req,
        slot=jnp.where(used, slot, 0),
        prev=jnp.where(used, prev, 0),
        position=jnp.where(used, position, 0),
        token=jnp.where(used, token, -1),
        active=active,
    )


def table_problems(inp: Inputs, t: jax.Array, values: TableValues, listed, st: Static) -> tuple[jax.Array, jax.Array]:
    """(problem, value) of ``common.slot_issue`` for plan entries ``t``; problem 0 past the first ``listed``
    entries (checked whether or not the verify overflows)."""
    problem, value = common.slot_issue(
        values.raw, *lut_reader(inp), full_slots=st.full_slots, group_slots=st.group_slots
    )
    return jnp.where(t < listed, problem, 0), value


def rejects_a_slot(inp: Inputs, start, count, st: Static) -> jax.Array:
    """bool[]: a token of ``[start, start + count)`` has a new slot the group cannot store (``common.slot_rejected``),
    ``token_chunk`` tokens per step."""
    chunk = st.config.token_chunk

    def body(c, hit):
        i = start + c * chunk + arange(chunk)
        loc = load(inp.loc, i, i < start + count, other=-1)
        rejected = common.slot_rejected(loc, *lut_reader(inp), full_slots=st.full_slots, group_slots=st.group_slots)
        return jnp.maximum(hit, jnp.max(rejected.astype(jnp.int32)))  # no reduce_or in Triton (pallas_notes §9)

    return lax.fori_loop(jnp.int32(0), (count + chunk - 1) // chunk, body, jnp.int32(0)) != 0


def entry_folds(inp: Inputs, e: Entries, st: Static, halves: Sequence[int] | None = None) -> tuple[hash64.U64, ...]:
    """The REAL_KV_HASH of the entries' slots for each of ``halves`` (default: every half), folded together."""
    halves = range(st.halves) if halves is None else halves
    slots = [records.clamp_slots(e.slot, inp.bufs[h].shape[0]) for h in halves]
    return kernel_io.fold_halves([inp.kv[h] for h in halves], [st.specs[h] for h in halves], slots, st.mode)


def check_half(inp: Inputs, h: int, e: Entries, real_kv: hash64.U64, st: Static):
    """(bits, stored record, H(prev)) of half ``h`` for a block of entries, given their :func:`entry_folds`: the
    verify kernel's check."""
    buf = inp.bufs[h]
    num_slots = buf.shape[0]
    slots = records.clamp_slots(e.slot, num_slots)
    stored = kernel_io.load_record(buf, slots)
    chain = records.record_hash(e.prev, kernel_io.load_record(buf, records.clamp_slots(e.prev, num_slots)))
    check = st.has_pool
    bits = verify_reference.entry_bits(
        stored,
        chain,
        e.prev != 0,  # prev == 0: padding/evicted predecessor, chain unknowable
        e.token if check else None,
        e.position,
        real_kv,
        check_expected_token=check,
    )
    live = (e.t < e.active) & (e.slot != 0)
    return jnp.where(live, bits, 0), stored, chain


def store_row(ring_ref, target: jax.Array, mask: jax.Array, fields: list[hash64.U64], context_ref=None, context=()):
    """Stores rows' 16 words into ``u32[capacity, 16]`` at ``target`` where ``mask`` (masked lanes out of range),
    and, given a ``i32[capacity, 3]`` context ref, the rows' three context values."""
    for f, (lo, hi) in enumerate(fields):
        for w, value in enumerate((lo, hi)):
            plt.store(ring_ref.at[target, jnp.full(target.shape, 2 * f + w, jnp.int32)], value, mask=mask)
    if context_ref is not None:
        for c, value in enumerate(context):
            plt.store(context_ref.at[target, jnp.full(target.shape, c, jnp.int32)], value, mask=mask)


def stash_row(h: int, b, k, st: Static):
    """Row of the stash holding the k-th flagged verify row of block ``b``, half ``h``."""
    return (h * st.num_blocks + b) * st.config.verify_block + k
