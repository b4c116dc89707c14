"""The phase's check launch (``kvcanary_phase_check``, Pallas Triton): per request its write chain walked, per
block of plan entries its verify, and with ``run_checks`` the batch checks' programs first (``pallas_triton``'s
docstring tells the phase's two launches)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import hash64, kernel_io, layout, records
from pallas_kernels.batch_checks import pallas_triton as batch_checks
from pallas_kernels.phase import common
from pallas_kernels.phase import triton_common as tc
from pallas_kernels.write import reference as write_reference


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


def kernel(*refs, st: tc.Static):
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
    target = jnp.where(flagged != 0, tc.stash_row(h, b, jnp.cumsum(flagged, dtype=jnp.int32) - flagged, st), size)
    token = entries.token if st.has_pool else jnp.full((block,), -1, jnp.int32)
    fields = common.verify_row(st.tags[h], entries.slot, entries.prev, stored, chain, token, bits)
    context = (inp.rpi[entries.req], entries.position, entries.req)
    tc.store_row(rows_ref, target, flagged != 0, fields, context_ref, context)
