"""The phase's ring-store launch (``kvcanary_phase_ring_store``, Pallas Triton): the flagged programs place their
rows in the ring at ``index + rank``, program 0 does the counts, and the programs after them store the records
(``pallas_triton``'s docstring tells the phase's two launches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import compat, hash64, kernel_io, layout, records
from pallas_kernels.phase import common
from pallas_kernels.phase import triton_common as tc

_INT32_MAX = 2**31 - 1


def kernel(*refs, st: tc.Static):
    """Programs ``[0, B + R)`` place the phase's rows in the ring (:func:`_ring`); the others store one block of
    tokens' records each (:func:`_store`). One launch: the ring reads no canary buffer (the verify rows come from
    the check kernel's stash), so the record stores cannot change what it places."""
    inp, rest = tc.take(refs, st, with_buffers=False)
    it = iter(rest)
    counts = [next(it) for _ in range(5)]  # vcount, req_count, prev_hash, expected, flags (the check kernel's)
    stash = [next(it) for _ in range(1 + st.has_context)]
    issues_ref = next(it) if st.num_issues else None
    winner_ref = next(it) if st.config.dedupe == "sort" else None
    for _ in range(1 + st.has_context + st.halves):  # the ring (and its context), the buffers: aliased to outputs
        next(it)
    state = [next(it) for _ in range(3 + st.count_overflows)]  # write index, counters (and overflow count)
    ring_ref = next(it)
    context_ref = next(it) if st.has_context else None
    new_state = [next(it) for _ in range(4 + st.count_overflows)]  # index, counters, enable (and overflows)
    buf_outs = [next(it) for _ in range(st.halves)]
    pid, ring_programs = pl.program_id(0), st.num_blocks + st.num_reqs

    @pl.when(pid < ring_programs)
    def _rows():
        _ring(inp, pid, counts, stash, issues_ref, state, (ring_ref, context_ref), new_state, st)

    @pl.when(pid >= ring_programs)
    def _records():
        _store(inp, pid - ring_programs, counts[4], counts[2], winner_ref, buf_outs, st)


def _ring(inp, pid, counts, stash, issues_ref, state, ring, new_state, st: tc.Static) -> None:
    """Places the rows of every flagged verify block and request in the ring; program 0 also does the counts."""
    vcount_ref, req_count_ref, prev_hash_ref, expected_ref, flags_ref = counts
    index_ref, kernel_ref, slot_ref = state[:3]
    overflows_ref = state[3] if st.count_overflows else None
    ring_ref, context_ref = ring
    index_out, kernel_out, slot_out, enable_out = new_state[:4]
    overflows_out = new_state[4] if st.count_overflows else None
    num_blocks, num_reqs, capacity = vcount_ref.shape[1], st.num_reqs, ring_ref.shape[0]
    index = index_ref[0]
    room = jnp.maximum(capacity - index, 0)  # rows placed at index + k for k < room: no int32 overflow

    def verify_total(h):
        return tc.row_sum(vcount_ref, h, num_blocks, st)

    def write_total(h):
        return tc.row_sum(req_count_ref, h, num_reqs, st)

    # The totals are functions, summed only inside the branches that need them: a clean program (the common case)
    # reads its own counts and exits, instead of first summing every block's and issue's counts.
    def issue_total():
        return tc.row_sum(issues_ref, 0, st.num_issues, st, flags=True) if st.num_issues else jnp.int32(0)

    def table_total():
        return tc.row_sum(vcount_ref, st.halves, num_blocks, st) if st.check_table else jnp.int32(0)

    def launch_base(h):
        """Rows before half h's verify: the caller's issues, the table's, then verify and write of every earlier
        half."""
        base = issue_total() + table_total()
        for g in range(h):
            base = base + verify_total(g) + write_total(g)
        return base

    if st.num_issues:

        @pl.when((pid == 0) & (room > 0))
        def _issue_rows():
            @pl.when(issue_total() > 0)
            def _place():
                _place_issue_rows(issues_ref, index, room, ring_ref, context_ref, st)

    if st.check_table:

        @pl.when((pid < num_blocks) & (room > 0) & (vcount_ref[st.halves, jnp.minimum(pid, num_blocks - 1)] > 0))
        def _table_rows():
            rel = issue_total() + tc.row_sum(vcount_ref, st.halves, pid, st)

            @pl.when(rel < room)
            def _place():
                _place_table_rows(inp, pid, rel, index, room, ring_ref, context_ref, st)

    for h in range(st.halves):

        @pl.when((pid < num_blocks) & (room > 0) & (vcount_ref[h, jnp.minimum(pid, num_blocks - 1)] > 0))
        def _verify_rows(h=h):
            rel = launch_base(h) + tc.row_sum(vcount_ref, h, pid, st)

            @pl.when(rel < room)
            def _place():
                count = vcount_ref[h, pid]
                _place_verify_rows(h, pid, rel, index, room, count, stash, ring_ref, context_ref, st)

        r = pid - num_blocks

        @pl.when((pid >= num_blocks) & (room > 0) & (req_count_ref[h, jnp.clip(r, 0, num_reqs - 1)] > 0))
        def _write_rows(h=h, r=r):
            rel = launch_base(h) + verify_total(h) + tc.row_sum(req_count_ref, h, r, st)

            @pl.when(rel < room)
            def _place():
                outs = (prev_hash_ref, expected_ref, flags_ref)
                _place_write_rows(inp, h, r, rel, index, room, outs, ring_ref, context_ref, st)

    @pl.when(pid == 0)
    def _bookkeeping():
        flagged = issue_total() + table_total()
        for h in range(st.halves):
            flagged = flagged + verify_total(h) + write_total(h)
        index_out[0] = index + jnp.minimum(flagged, _INT32_MAX - index)  # saturates instead of wrapping
        total, active = tc.verify_total(inp, st)
        overflow = total > st.capacity
        enable_out[0] = jnp.where(overflow, 0, 1).astype(jnp.int32)
        if st.count_overflows:
            overflows_out[0] = common.count_overflow(overflows_ref[0], overflow)
        written = tc.row_sum(req_count_ref, st.halves, num_reqs, st)
        _bump(kernel_ref, kernel_out, {tag: jnp.int32(2) for tag in st.tags})  # a verify and a write per tag
        _bump(slot_ref, slot_out, {tag: active + written for tag in st.tags})


def _bump(counter_ref, out_ref, increments) -> None:
    """``out = counters + increments`` on u64 (lo, hi) counters ``u32[num_tags, 2]``, every tag written."""
    num_tags = counter_ref.shape[0]
    lanes = tc.arange(compat.next_power_of_2(num_tags))
    valid = lanes < num_tags
    word = lambda w: jnp.full(lanes.shape, w, jnp.int32)  # noqa: E731
    add = jnp.zeros(lanes.shape, jnp.uint32)
    for tag, amount in increments.items():
        add = add + jnp.where(lanes == tag, amount.astype(jnp.uint32), jnp.uint32(0))
    old = tuple(plt.load(counter_ref.at[lanes, word(w)], mask=valid, other=0) for w in (0, 1))
    new = hash64.add(old, (add, jnp.zeros_like(add)))
    for w in (0, 1):
        plt.store(out_ref.at[lanes, word(w)], new[w], mask=valid)


def _place_issue_rows(issues_ref, index, room, ring_ref, context_ref, st: tc.Static) -> None:
    """Writes the caller's flagged ``input_issues`` columns' rows first in the ring, in column order."""
    chunk, capacity = st.config.token_chunk, ring_ref.shape[0]

    def body(c, done):
        j = c * chunk + tc.arange(chunk)
        m = j < st.num_issues
        at = {name: tc.load_row(issues_ref, f, j, m) for f, name in enumerate(common.INPUT_ISSUE_FIELDS)}
        flagged = (at["problem"] != 0).astype(jnp.int32)
        k = done + jnp.cumsum(flagged, dtype=jnp.int32) - flagged
        ok = (flagged != 0) & (k < room)
        fields = common.input_row(st.tags[0], **at)
        context = (at["request"], at["position"], at["entry"])
        tc.store_row(ring_ref, jnp.where(ok, index + k, capacity), ok, fields, context_ref, context)
        return done + jnp.sum(flagged, dtype=jnp.int32)

    lax.fori_loop(jnp.int32(0), jnp.int32(-(-st.num_issues // chunk)), body, jnp.int32(0))


def _place_table_rows(inp, b, rel, index, room, ring_ref, context_ref, st: tc.Static) -> None:
    """Recomputes block ``b``'s table issues and writes their ``INVALID_INPUT`` rows at ``index + rel + rank``."""
    t = b * st.config.verify_block + tc.arange(st.config.verify_block)
    req, start, total = tc.locate(inp, t, st)
    values = tc.table_values(inp, t, req, start, st)
    problem, value = tc.table_problems(inp, t, values, jnp.minimum(total, st.capacity), st)
    flagged = (problem != 0).astype(jnp.int32)
    k = rel + jnp.cumsum(flagged, dtype=jnp.int32) - flagged
    ok = (flagged != 0) & (k < room)
    request = inp.rpi[req]
    issue = common.table_issue(
        problem, value, values.raw, values.position, req, request, has_lut=st.has_lut, group_slots=st.group_slots
    )
    context = (request, values.position, req)
    fields = common.input_row(st.tags[0], **issue)
    tc.store_row(ring_ref, jnp.where(ok, index + k, ring_ref.shape[0]), ok, fields, context_ref, context)


def _place_verify_rows(h: int, b, rel, index, room, count, stash, ring_ref, context_ref, st: tc.Static) -> None:
    """Copies block ``b``'s ``count`` stashed verify rows of half ``h`` to the ring at ``index + rel + k``."""
    k = tc.arange(st.config.verify_block)
    ok = (k < count) & (rel + k < room)
    source = jnp.where(ok, tc.stash_row(h, b, k, st), 0)
    target = jnp.where(ok, index + rel + k, ring_ref.shape[0])
    pairs = [(stash[0], ring_ref)] + ([(stash[1], context_ref)] if context_ref is not None else [])
    for src_ref, dst_ref in pairs:
        for w in range(dst_ref.shape[1]):
            column = jnp.full(k.shape, w, jnp.int32)
            plt.store(dst_ref.at[target, column], plt.load(src_ref.at[source, column], mask=ok, other=0), mask=ok)


def _place_write_rows(inp, h: int, r, rel, index, room, outs, ring_ref, context_ref, st: tc.Static) -> None:
    """Writes request ``r``'s rows of half ``h`` (per token: input-assert row, then chain-position row)."""
    prev_hash_ref, expected_ref, flags_ref = outs
    start, count, _, _ = tc.write_span(inp, r, st)
    chunk, capacity, tag = st.config.token_chunk, ring_ref.shape[0], st.tags[h]
    word = lambda w: jnp.full((chunk,), w, jnp.int32)  # noqa: E731
    half = word(h)
    request = jnp.full((chunk,), inp.rpi[r], jnp.int32)

    def body(c, done):
        i = start + c * chunk + tc.arange(chunk)
        m = i < start + count
        flags = tc.load_row(flags_ref, h, i, m)
        input_bits = flags & common.INPUT_BITS
        has_input = (input_bits != 0).astype(jnp.int32)
        has_chain = ((flags & common.FLAG_CHAIN_POSITION) != 0).astype(jnp.int32)
        rows = has_input + has_chain
        first = rel + done + jnp.cumsum(rows, dtype=jnp.int32) - rows
        slot = tc.translate(inp, tc.load(inp.loc, i, m))
        token, position = tc.load(inp.ids, i, m), tc.load(inp.positions, i, m)
        prev_hash = tuple(plt.load(prev_hash_ref.at[half, i, word(w)], mask=m, other=0) for w in (0, 1))
        if st.has_inputs:
            ok = (has_input != 0) & (first < room)
            aux = hash64.from_i32(tc.load(inp.exp_pos, i, m))
            fields = common.write_row(
                tag, slot, position, token, tc.load(inp.exp_ids, i, m), prev_hash, aux, input_bits
            )
            context = (request, lax.bitcast_convert_type(aux[0], jnp.int32), i)
            tc.store_row(ring_ref, jnp.where(ok, index + first, capacity), ok, fields, context_ref, context)
        k = first + has_input
        ok = (has_chain != 0) & (k < room)
        aux = tuple(plt.load(expected_ref.at[half, i, word(w)], mask=m, other=0) for w in (0, 1))
        bits = jnp.full((chunk,), layout.FAIL_WRITE_POSITION, jnp.int32)
        fields = common.write_row(tag, slot, position, token, token, prev_hash, aux, bits)
        context = (request, lax.bitcast_convert_type(aux[0], jnp.int32), i)
        tc.store_row(ring_ref, jnp.where(ok, index + k, capacity), ok, fields, context_ref, context)
        return done + jnp.sum(rows, dtype=jnp.int32)

    lax.fori_loop(jnp.int32(0), (count + chunk - 1) // chunk, body, jnp.int32(0))


# -- kvcanary_phase_ring_store: the store programs -------------------------------------------------------------


def _overwritten_later(inp, flags_ref, entry, slot, first, st: tc.Static) -> jax.Array:
    """bool[block]: a later written token stores the same slot (its record wins, as in ``store.last_writer``);
    ``first`` is the block's first token."""
    num_tokens, cb = st.num_tokens, st.config.compare_block

    def scan(c, hit):
        other = first + c * cb + tc.arange(cb)
        valid = other < num_tokens
        other_slot = tc.translate(inp, tc.load(inp.loc, other, valid, other=-1))
        other_written = (tc.load_row(flags_ref, 0, other, valid) & common.FLAG_WRITTEN) != 0
        same = (slot[:, None] == other_slot[None, :]) & other_written[None, :] & (other[None, :] > entry[:, None])
        # max over an int32 cast, not jnp.any: Triton has no reduce_or (pallas_notes §9, pitfall 4).
        return jnp.maximum(hit, jnp.max(same.astype(jnp.int32), axis=1))

    steps = (num_tokens - first + cb - 1) // cb  # not pl.cdiv: it breaks under x64
    return lax.fori_loop(jnp.int32(0), steps, scan, jnp.zeros(entry.shape, jnp.int32)) != 0


def _store(inp, p, flags_ref, prev_hash_ref, winner_ref, outs, st: tc.Static) -> None:
    """Folds and stores token block ``p``'s records into every half's aliased ``u32[num_slots, 8]`` buffer."""
    block = st.config.store_block
    entry = p * block + tc.arange(block)
    in_range = entry < st.num_tokens  # ragged last block: no automatic bounds masks before jax 0.12
    slot = tc.translate(inp, tc.load(inp.loc, entry, in_range, other=-1))
    written = (tc.load_row(flags_ref, 0, entry, in_range) & common.FLAG_WRITTEN) != 0
    if winner_ref is None:
        winner = ~_overwritten_later(inp, flags_ref, entry, slot, p * block, st)
    else:
        winner = tc.load(winner_ref, entry, in_range) != 0
    token = hash64.from_i32(tc.load(inp.ids, entry, in_range))
    position = hash64.from_i32(tc.load(inp.positions, entry, in_range))
    folds = kernel_io.fold_halves(inp.kv, st.specs, [records.clamp_slots(slot, b.shape[0]) for b in outs], st.mode)
    for h, buf_ref in enumerate(outs):
        num_slots = buf_ref.shape[0]
        ok = written & winner & (slot < num_slots)
        half = jnp.full((block,), h, jnp.int32)
        prev_hash = tuple(
            plt.load(prev_hash_ref.at[half, entry, jnp.full((block,), w, jnp.int32)], mask=in_range, other=0)
            for w in (0, 1)
        )
        kernel_io.store_record(buf_ref, jnp.where(ok, slot, num_slots), ok, (token, position, prev_hash, folds[h]))
