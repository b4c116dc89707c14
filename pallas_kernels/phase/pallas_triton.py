"""Fused phase kernels (Pallas Triton): one phase of a group (K and V together) in two launches.

The single ops pay ~50 small kernels per decode step (plan build, prefix sums, row gathers, appends, counter
bumps; ``benchmarks/RESULTS.md``). Here a phase is:

  * ``kvcanary_phase_check``: programs ``[0, R)`` walk one request's write chain each (K and V side by side; the
    seed records are read before any store, as the write op reads the pre-launch buffer; with
    ``skip_bad_requests`` a first pass over its slots decides whether it writes at all), programs ``[R, R + B)``
    verify one block of plan entries each, for every half. The plan is built in-kernel from the batch (request
    lookup, ``req_to_token`` gathers, window), so it is never materialised. Outputs: each verify block's flag
    count per half (and, with ``check_table``, its count of table values the pools cannot hold), each request's
    row count per half and written count, the chain's per-token results, and a stash where a block with flags
    writes its verify rows, packed, in its own region (nothing is written there by a clean block).
  * ``kvcanary_phase_ring_store``, programs ``[0, B + R)``: every verify block or request with flags writes its
    rows straight into the ring at ``index + rank``; the rank is the flag counts of the launches and programs
    before it (SGLang's order: verify K, write K, verify V, write V; plan-entry order within a launch), so the
    ring is byte-identical to the single launches'. Verify rows are copied from the stash, write rows built from
    the chain's results, so no program reads a canary buffer. The ``INVALID_INPUT`` rows come first: program 0
    places the caller's ``input_issues``, then every block with table issues places theirs (recomputed from the
    table). Clean programs only read their counts and exit. Program 0 also advances the write index and bumps
    the counters (and the verify-overflow count).
  * the same launch, the programs after those: per block of tokens, fold the real KV and store the records of
    both halves in place, with the write op's deterministic last-writer rule. Sharing the launch with the ring is
    safe because the ring reads no record; a third launch would cost a dependent launch's 3-5 us at decode sizes.

With ``checks`` (the runner's batches), the rows' roles (``active``, ``span_lens``) are not inputs: every program
that needs them derives them from the batch (``triton_common.roles``, the batch checks' own rules, carried over
the rows it scans anyway), and a HEAD's check launch also runs the batch checks' programs, whose candidates the
ring places first. The step then has no launch of its own for the checks (a dependent launch's 3-5 us).

No XLA loop, prefix sum or scatter is left in the step (only ``store.last_writer``'s sort for more than
``PAIRWISE_MAX_TOKENS`` tokens, as in the write op).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import compat, hash64, kernel_io, layout, records
from pallas_kernels.batch_checks import pallas_triton as batch_checks
from pallas_kernels.phase import common
from pallas_kernels.phase import triton_common as tc
from pallas_kernels.write import reference as write_reference
from pallas_kernels.write import store

Config = tc.Config
PAIRWISE_MAX_TOKENS = 512  # as the write op (write/pallas_triton.py): pairwise scan below, sort above
_INT32_MAX = 2**31 - 1


def heuristic(capacity: int, num_tokens: int) -> Config:
    """128 plan entries and up to 128 tokens per program on 4 warps (the verify and write ops' measured best)."""
    return Config(
        verify_block=min(128, compat.next_power_of_2(capacity)),
        store_block=min(128, compat.next_power_of_2(num_tokens)),
        dedupe="pairwise" if num_tokens <= PAIRWISE_MAX_TOKENS else "sort",
    )


# -- kvcanary_phase_check ----------------------------------------------------------------------------------------


def _walk(inp: tc.Inputs, r, outs, st: tc.Static) -> None:
    """Request ``r``'s write chain for every half: per token, the PREV_HASH to store, the chain-position assert
    and the input assert; then its row and written counts. The last request also zeroes the flags of the
    tokens no request covers."""
    count_ref, prev_hash_ref, expected_ref, flags_ref = outs
    start, count, own, active = tc.write_span(inp, r, st)
    prefix, rpi = inp.prefix[r], inp.rpi[r]
    num_rows, max_context = inp.rtt.shape
    seed = common.seed_slot(
        inp.rtt[common.jnp_index(rpi, num_rows), jnp.clip(prefix - 1, 0, max_context - 1)],
        (active != 0) & (prefix > 0) & (own > 0),
        *tc.lut_reader(inp),
        full_slots=st.full_slots,
        group_slots=st.group_slots,
    )
    check = (seed >= 0) & (inp.cpa[0] != 0) & (count > 0)
    writes = jnp.bool_(True)
    if st.skip_bad_requests:  # a partial write would trip the chain-position assert on the token after a gap
        writes = (active != 0) & ~tc.rejects_a_slot(inp, start, count, st)
    carry = []
    for buf in inp.bufs:
        record = kernel_io.load_record(buf, records.clamp_slots(seed, buf.shape[0]))
        chain = hash64.where(seed < 0, hash64.anchor_hash(seed), records.chain_hash(record))
        carry += [*chain, *record[1], jnp.int32(0)]  # running hash, running position, rows
    carry.append(jnp.int32(0))  # written entries

    def step(j, carry):
        i = start + j
        slot, token, position = tc.translate(inp, inp.loc[i]), inp.ids[i], inp.positions[i]
        live = writes & (slot >= 0) & (slot < st.group_slots)  # common.write_slots: skipped, or outside the pool
        input_bits = jnp.int32(0)
        if st.has_inputs:
            input_bits = jnp.where(live & (token != inp.exp_ids[i]), jnp.int32(layout.FAIL_WRITE_TOKEN), 0)
            input_bits |= jnp.where(live & (position != inp.exp_pos[i]), jnp.int32(layout.FAIL_WRITE_POSITION), 0)
        out = []
        for h in range(st.halves):
            lo_hash, hi_hash, lo_pos, hi_pos, rows = carry[5 * h : 5 * h + 5]
            running, previous = (lo_hash, hi_hash), (lo_pos, hi_pos)
            expected, failed = write_reference.position_assert(previous, position, live, check)
            prev_hash_ref[h, i, 0], prev_hash_ref[h, i, 1] = running
            expected_ref[h, i, 0], expected_ref[h, i, 1] = expected
            flags_ref[h, i] = (
                jnp.where(live, jnp.int32(common.FLAG_WRITTEN), 0)
                | jnp.where(failed, jnp.int32(common.FLAG_CHAIN_POSITION), 0)
                | input_bits
            )
            rows = rows + (input_bits != 0).astype(jnp.int32) + failed.astype(jnp.int32)
            running, previous = write_reference.advance(running, previous, token, position, live)
            out += [*running, *previous, rows]
        return (*out, carry[-1] + live.astype(jnp.int32))

    carry = lax.fori_loop(jnp.int32(0), count, step, tuple(carry))
    for h in range(st.halves):
        count_ref[h, r] = carry[5 * h + 4]
    count_ref[st.halves, r] = carry[-1]

    @pl.when(r == st.num_reqs - 1)
    def _zero_uncovered():  # unwritten outputs are garbage (pallas_notes §9, pitfall 8)
        end, chunk = start + count, st.config.token_chunk

        def body(c, _):
            i = end + c * chunk + tc.arange(chunk)  # lanes past T are masked and out of range
            for h in range(st.halves):
                flags = jnp.zeros((chunk,), jnp.int32)
                plt.store(flags_ref.at[jnp.full((chunk,), h, jnp.int32), i], flags, mask=i < st.num_tokens)
            return c  # a traced carry: a constant one does not lower (scf.yield of a literal)

        lax.fori_loop(jnp.int32(0), (st.num_tokens - end + chunk - 1) // chunk, body, jnp.int32(0))


def _check_kernel(*refs, st: tc.Static):
    """Chain walks (programs < R), then verify blocks: each block's flag count per half (and its table issues).
    With ``st.run_checks``, the batch checks' programs come before them all: started first, their serial loops
    over the rows overlap the rest instead of ending the launch."""
    inp, (vcount_ref, *outs) = tc.take(refs, st)  # vcount i32[H (+1), B]; see _walk for the chain outputs
    stash_end = 5 + st.has_context
    chain_outs, stash = outs[:4], outs[4:stash_end]  # stash: verify rows u32[H * B * block, 16] (and context)
    num_reqs, block = st.num_reqs, st.config.verify_block
    pid = pl.program_id(0)
    if st.run_checks:
        first = batch_checks.num_programs(st.checks)

        @pl.when(pid < first)
        def _batch_checks():
            row_refs = (inp.rpi, inp.prefix, inp.extend)
            batch_checks.program(row_refs, inp.loc, None, outs[stash_end:], pid, st.checks)

        pid = pid - first  # negative for the checks' programs: neither a walk nor a block

    @pl.when((pid >= 0) & (pid < num_reqs))
    def _chain():
        _walk(inp, pid, chain_outs, st)

    b = pid - num_reqs

    @pl.when((pid >= num_reqs) & (pid < num_reqs + st.num_blocks))
    def _verify():
        t = b * block + tc.arange(block)
        req, start, total = tc.locate(inp, t, st)
        active = jnp.where(total > st.capacity, 0, total)
        listed = jnp.minimum(total, st.capacity)  # the table issues are checked even when the verify overflows
        busy = b * block < (listed if st.check_table else active)

        @pl.when(busy)
        def _check():
            values = tc.table_values(inp, t, req, start, st)
            entries = tc.plan_entries(inp, t, req, values, active, st)
            folds = tc.entry_folds(inp, entries, st)
            for h in range(st.halves):
                bits, stored, chain = tc.check_half(inp, h, entries, folds[h], st)
                flagged = (bits != 0).astype(jnp.int32)
                count = jnp.sum(flagged, dtype=jnp.int32)
                vcount_ref[h, b] = count

                @pl.when(count > 0)
                def _stash(h=h, bits=bits, stored=stored, chain=chain, flagged=flagged):
                    _stash_verify_rows(inp, h, b, entries, (bits, stored, chain), flagged, stash, st)
            if st.check_table:
                problem, _ = tc.table_problems(inp, t, values, listed, st)
                vcount_ref[st.halves, b] = jnp.sum((problem != 0).astype(jnp.int32), dtype=jnp.int32)

        @pl.when(jnp.logical_not(busy))
        def _idle():
            for h in range(vcount_ref.shape[0]):
                vcount_ref[h, b] = jnp.int32(0)


def _stash_verify_rows(inp, h: int, b, entries, checked, flagged, stash, st: tc.Static) -> None:
    """Writes block ``b``'s flagged verify rows of half ``h``, packed in entry order, at the start of the block's
    region of the stash. The ring placement copies them from there: it runs in the store's launch, whose record
    stores may already have overwritten what this kernel read from the canary buffers."""
    bits, stored, chain = checked
    block = st.config.verify_block
    rows_ref, context_ref = stash[0], (stash[1] if st.has_context else None)
    size = rows_ref.shape[0]
    target = jnp.where(flagged != 0, _stash_row(h, b, jnp.cumsum(flagged, dtype=jnp.int32) - flagged, st), size)
    token = entries.token if st.has_pool else jnp.full((block,), -1, jnp.int32)
    fields = common.verify_row(st.tags[h], entries.slot, entries.prev, stored, chain, token, bits)
    context = (inp.rpi[entries.req], entries.position, entries.req)
    tc.store_row(rows_ref, target, flagged != 0, fields, context_ref, context)


def _stash_row(h: int, b, k, st: tc.Static):
    """Row of the stash holding the k-th flagged verify row of block ``b``, half ``h``."""
    return (h * st.num_blocks + b) * st.config.verify_block + k


# -- kvcanary_phase_ring_store -----------------------------------------------------------------------------------


def _ring_store_kernel(*refs, st: tc.Static):
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
    source = jnp.where(ok, _stash_row(h, b, k, st), 0)
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


# -- entry point -------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "config", "checks", "report_checks"))
def phase(
    buffers, log, batch, enable_chain_position_assert, real_kv_sources, input_issues=None, *, spec, interpret=False,
    config=None, checks=None, report_checks=False,
):  # fmt: skip
    """``reference.phase`` (the contract) in two Pallas launches (see the module docstring); ``interpret`` runs
    them in Pallas interpret mode (any platform), ``config`` is their launch shapes (``heuristic`` when None).

    ``checks`` (a ``batch_checks.pallas_triton.Static``, for a batch of at least one token): the rows' roles are
    the batch checks' of the batch, derived in every program that needs them (``batch.active`` and
    ``batch.span_lens`` are not read); with ``report_checks``, the check launch also runs the batch checks'
    programs and their candidates are ``input_issues`` (which must be None), with no launch of their own."""
    batch = common.with_roles(common.pad_tokens(batch))
    num_reqs, num_tokens = batch.req_pool_indices.shape[0], batch.input_ids.shape[0]
    group_slots = buffers[0].shape[0]
    halves = len(buffers)
    config = config or heuristic(spec.verify_capacity, num_tokens)
    sources = tuple(tuple(s) if spec.real_kv_hash_mode != layout.REAL_KV_NONE else () for s in real_kv_sources)
    num_issues = 0 if input_issues is None else input_issues.shape[1]
    if report_checks:
        num_issues = batch_checks.out_shapes(checks)[-1].shape[1]
    st = tc.Static(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        tags=spec.tags,
        specs=tuple(kernel_io.source_specs(s) for s in sources),
        mode=spec.real_kv_hash_mode,
        capacity=spec.verify_capacity,
        window=spec.window,
        token_offset=spec.token_offset,
        has_lut=batch.full_to_swa_index_mapping is not None,
        has_pool=batch.token_ids is not None,
        has_inputs=batch.expected_input_ids is not None,
        config=config,
        full_slots=spec.full_slots or group_slots,
        group_slots=group_slots,
        has_context=log.context is not None,
        check_table=spec.check_table,
        skip_bad_requests=spec.skip_bad_requests,
        num_issues=num_issues,
        count_overflows=log.verify_overflows is not None,
        checks=checks,
        run_checks=report_checks,
    )
    inputs = tc.input_arrays(batch, enable_chain_position_assert, buffers, sources, st, interpret=interpret)
    num_blocks = st.num_blocks
    i32, u32 = jnp.int32, jnp.uint32
    call = functools.partial(compat.triton_call, num_warps=config.num_warps, num_stages=config.num_stages)

    chain_outs = (
        jax.ShapeDtypeStruct((halves + 1, num_reqs), i32),  # rows per request and half; written per request
        jax.ShapeDtypeStruct((halves, num_tokens, 2), u32),  # PREV_HASH to store
        jax.ShapeDtypeStruct((halves, num_tokens, 2), u32),  # chain-position assert's expected position
        jax.ShapeDtypeStruct((halves, num_tokens), i32),  # common.FLAG_* | input-assert bits
    )
    ring_rows = log.ring.reshape(log.ring.shape[0], -1)  # u32[capacity, 16]
    stash_rows = halves * num_blocks * config.verify_block  # written only where a verify entry is flagged
    stash = (jax.ShapeDtypeStruct((stash_rows, ring_rows.shape[1]), u32),)
    if log.context is not None:
        stash += (jax.ShapeDtypeStruct((stash_rows, log.context.shape[1]), i32),)
    batch_outs = batch_checks.out_shapes(checks) if report_checks else ()
    checked = call(
        functools.partial(_check_kernel, st=st),
        out_shape=(
            jax.ShapeDtypeStruct((halves + spec.check_table, num_blocks), i32), *chain_outs, *stash, *batch_outs
        ),
        grid=(num_reqs + num_blocks + (batch_checks.num_programs(checks) if report_checks else 0),),
        name=f"kvcanary_phase_check_block={config.verify_block}",
        interpret=interpret,
    )(*inputs)
    if report_checks:  # the batch checks' candidates: the rows' INVALID_INPUT rows, placed first
        input_issues, checked = checked[-1], checked[: len(checked) - len(batch_outs)]

    flags = checked[4]
    winner = ()
    if config.dedupe == "sort":
        loc = common.translate(batch.out_cache_loc, *common.lut_reader(batch.full_to_swa_index_mapping))
        written = (flags[0] & common.FLAG_WRITTEN) != 0
        winner = (store.last_writer(loc, written, buffers[0].shape[0]).astype(i32),)
    context = () if log.context is None else (log.context,)
    issues = () if input_issues is None else (input_issues,)
    overflows = () if log.verify_overflows is None else (log.verify_overflows,)
    rows = tuple(kernel_io.record_rows(b) for b in buffers)
    aliased = (ring_rows, *context, *rows)  # updated in place: the ring (and its context), the canary buffers
    state = (log.write_index, log.kernel_run_counters, log.slot_run_counters, *overflows)
    leading = (
        *tc.input_arrays(batch, enable_chain_position_assert, (), sources, st, interpret=interpret), *checked, *issues,
        *winner,
    )  # fmt: skip
    out_shape = (
        jax.ShapeDtypeStruct(ring_rows.shape, u32),
        *(jax.ShapeDtypeStruct(c.shape, i32) for c in context),
        jax.ShapeDtypeStruct((1,), i32),
        jax.ShapeDtypeStruct(log.kernel_run_counters.shape, u32),
        jax.ShapeDtypeStruct(log.slot_run_counters.shape, u32),
        jax.ShapeDtypeStruct((1,), i32),
        *(jax.ShapeDtypeStruct((1,), i32) for _ in overflows),
        *(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows),
    )
    first_state = len(leading) + len(aliased)
    aliases = {len(leading) + k: k for k in range(1 + len(context))}
    aliases.update({len(leading) + 1 + len(context) + h: len(out_shape) - halves + h for h in range(halves)})
    if overflows:  # only program 0 reads the count, so it may be updated in place too (no copy into the donated one)
        aliases[first_state + 3] = len(out_shape) - halves - 1
    out = call(
        functools.partial(_ring_store_kernel, st=st),
        out_shape=out_shape,
        grid=(num_blocks + num_reqs + pl.cdiv(num_tokens, config.store_block),),
        name=f"kvcanary_phase_ring_store_block={config.store_block}_{config.dedupe}",
        interpret=interpret,
        input_output_aliases=aliases,
    )(*leading, *aliased, *state)
    ring_rows, context, rest = out[0], out[1 : 1 + len(context)], out[1 + len(context) :]
    write_index, kernel_counters, slot_counters, enable, *rest = rest
    overflows, new_rows = rest[: len(overflows)], rest[len(overflows) :]
    new_log = common.Log(
        ring=ring_rows.reshape(log.ring.shape),
        write_index=write_index,
        kernel_run_counters=kernel_counters,
        slot_run_counters=slot_counters,
        context=context[0] if context else None,
        verify_overflows=overflows[0] if overflows else None,
    )
    return tuple(r.reshape(b.shape) for r, b in zip(new_rows, buffers, strict=True)), new_log, enable
