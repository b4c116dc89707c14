"""The fill-once ring (across launches, overflow, saturation, tag order), the host reader and SGLang's log format."""

import dataclasses
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax.core import _ring
from tests.core.canary_testlib import (
    INT32_MAX,
    RING,
    TAG_HEAD,
    TAG_TAIL,
    U64,
    VCAP,
    buf_from_records,
    empty_records,
    i32,
    jit_verify,
    jit_write,
    new_state,
    oracle_ring,
    oracle_verify,
    ring_rows,
    verify_plan,
    write_batch,
    write_index,
)

# SPEC §2 "Log line": SGLang's frozen first line.
FIRST_LINE = re.compile(
    r"^kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(-?\d+) position=(-?\d+) "
    r"stored_token=(-?\d+) expected_token=(-?\d+) stored_chain_hash=0x([0-9a-f]{16}) expected_aux=0x([0-9a-f]{16})$"
)
RECS = empty_records()


def _violations(state, slots, *, tag=TAG_TAIL):
    """One verify launch with a POSITION violation at each of ``slots`` (records are empty: position 0 != 1)."""
    n = len(slots)
    return jit_verify(
        state,
        buf_from_records(RECS),
        verify_plan(slots, [1] * n, [0] * n),
        tag=tag,
        check_expected_token=False,
        backend="xla",
    )


def _want(slots, tag=TAG_TAIL):
    n = len(slots)
    return oracle_verify(RECS, slots, [1] * n, [0] * n, tag=tag)[0]


def test_fill_once_across_launches():
    state, rows, index = new_state(), [], 0
    for launch in ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], list(range(11, 21)), [21, 22]):
        state = _violations(state, launch)
        rows, index = oracle_ring(rows, index, _want(launch), RING)
        assert ring_rows(state) == rows
        assert write_index(state) == index
    assert index == 22 and len(rows) == RING
    assert [r[1] for r in ring_rows(state)] == list(range(1, RING + 1))  # row 0 is forever the first violation


def test_overflow_inside_one_launch_keeps_entry_order():
    slots = list(range(VCAP, 0, -1))  # 32 violations, descending slots, into 16 rows
    state = _violations(new_state(), slots)
    assert write_index(state) == VCAP
    assert [r[1] for r in ring_rows(state)] == slots[:RING]
    ring_before = np.asarray(state.violation_log.violation_ring).copy()
    state = _violations(state, [3, 4, 5])
    assert write_index(state) == VCAP + 3  # dropped rows still count
    np.testing.assert_array_equal(np.asarray(state.violation_log.violation_ring), ring_before)


def test_partial_room_at_the_end_of_the_ring():
    state = _violations(new_state(), list(range(1, RING - 1)))  # 14 rows: room for 2 more
    state = _violations(state, [40, 41, 42, 43])
    assert [r[1] for r in ring_rows(state)][-3:] == [RING - 2, 40, 41]
    assert write_index(state) == RING + 2


def test_index_saturates_at_int32_max():
    state = new_state()
    log = dataclasses.replace(state.violation_log, violation_write_index=i32([INT32_MAX - 2]))
    state = dataclasses.replace(state, violation_log=log)
    state = _violations(state, [1, 2, 3, 4, 5])
    assert write_index(state) == INT32_MAX
    state = _violations(state, [6])
    assert write_index(state) == INT32_MAX  # never wraps to negative (which would read as "not errored")
    report = kc.read_violations(state.violation_log)
    assert report.is_errored and report.overflowed and report.ring_valid_count == RING
    assert not np.asarray(state.violation_log.violation_ring).any()  # the ring was "full": nothing written


def test_rows_of_several_tags_interleave_in_launch_order():
    state = new_state()
    # A write launch with a chain-position row (seed slot 0 holds position 0; the entry claims position 5).
    plan, ids, pos, loc = write_batch([(1, [(2, 9, 5)])])
    buf = buf_from_records(RECS)
    buf, state = jit_write(state, buf, plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")
    state = _violations(state, [7, 8])
    state = _violations(state, [9], tag=kc.CanaryLaunchTag.HEAD_V_FULL)
    buf, state = jit_write(state, buf, plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")
    state = _violations(state, [10])
    assert [(r[0], r[1], r[7]) for r in ring_rows(state)] == [
        (TAG_HEAD, 2, 16),
        (TAG_TAIL, 7, 2),
        (TAG_TAIL, 8, 2),
        (kc.CanaryLaunchTag.HEAD_V_FULL, 9, 2),
        (TAG_HEAD, 2, 16),
        (TAG_TAIL, 10, 2),
    ]
    report = kc.read_violations(state.violation_log)
    assert [v.tag_label for v in report.violations] == [
        "HEAD_K_FULL", "TAIL_K_FULL", "TAIL_K_FULL", "HEAD_V_FULL", "HEAD_K_FULL", "TAIL_K_FULL"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("count", "valid", "overflowed"), [(0, 0, False), (3, 3, False), (RING, RING, False), (RING + 7, RING, True)]
)
def test_read_violations_derived_fields(count, valid, overflowed):
    state = _violations(new_state(), list(range(1, count + 1))) if count else new_state()
    report = kc.read_violations(state.violation_log)
    assert report.write_index == count
    assert report.ring_capacity == RING
    assert report.is_errored == (count > 0)
    assert report.ring_valid_count == valid
    assert report.overflowed == overflowed
    assert report.rows.shape == (valid, kc.VIOLATION_FIELDS) and report.rows.dtype == np.int64
    assert len(report.violations) == valid
    if count:
        first = report.first_violation
        assert first == report.violations[0]
        assert (first.slot_idx, first.position, first.fail_reason) == (1, 0, kc.FailReason.VERIFY_POSITION_MISMATCH)
        assert all(isinstance(getattr(first, f.name), int) for f in dataclasses.fields(first)[:8])  # SGLang's
    else:
        assert report.first_violation is None and report.violations == ()


def _violation(tag, bits, **fields):
    values = dict(slot_idx=5, position=7, stored_token=-3, expected_token=42, stored_chain_hash=-2, expected_aux=8)
    values.update(fields)
    return kc.Violation(launch_tag=tag, fail_reason=kc.FailReason(bits), **values)


def test_format_first_line_matches_sglang_regex():
    v = _violation(kc.CanaryLaunchTag.TAIL_K_SWA, 1 | 2, stored_chain_hash=-2, expected_aux=0x2100)
    lines = kc.format_violation(v, total=3, overflowed=False, step=17).split("\n")
    m = FIRST_LINE.match(lines[0])
    assert m, lines[0]
    assert m.groups() == (
        "TAIL_K_SWA", "verify_chain_hash+verify_position", "5", "7", "-3", "42", "f" * 15 + "e", "0000000000002100"
    )  # fmt: skip
    assert lines[1] == "KV cache canary violation detected (kernel_kind=TAIL_K_SWA, slot_idx=5, position=7)"
    assert lines[2] == "canary_kind:       per_forward_tail_k_swa"
    assert lines[3] == "  fail_reasons: verify_chain_hash verify_position"
    assert lines[4] == "  stored:   token_id=-3   position=7 prev_hash=0xfffffffffffffffe"
    assert lines[5] == "  expected: prev_hash=0x0000000000002100"
    assert lines[6] == "  total_violations=3 ring_overflow=False step_when_pumped=17"
    # Ours, after SGLang's block: no context (no request line), the token, the likely cause.
    assert lines[7:] == [
        "  token: expected=42 found=-3",
        "  likely cause: this slot's record differs from its chain after the forward: the page table or the slot's "
        "record changed during the step",
    ]


def test_format_reason_labels_and_kinds():
    write = kc.format_violation(_violation(TAG_HEAD, 8 | 16), total=1, overflowed=True).split("\n")
    assert FIRST_LINE.match(write[0]).group(2) == "write_token+write_position"
    assert write[4:6] == [
        "  actual:   token_id=-3   position=7 prev_hash=0xfffffffffffffffe",
        "  expected: token_id=42   position=8",
    ]
    assert write[6] == "  total_violations=1 ring_overflow=True step_when_pumped=None"
    assert write[7] == "  token: expected=42 found=-3"
    token = kc.format_violation(_violation(TAG_TAIL, 4 | 32), total=1, overflowed=False).split("\n")
    assert FIRST_LINE.match(token[0]).group(2) == "verify_real_kv_hash+verify_token"
    assert token[5] == "  expected: token_id=42 prev_hash=0x0000000000000008"
    sweep = kc.format_violation(_violation(kc.CanaryLaunchTag.SWEEP_V_SWA, 0), total=1, overflowed=False)
    assert FIRST_LINE.match(sweep.split("\n")[0]).groups()[:2] == ("SWEEP_V_SWA", "none")
    assert "canary_kind:       sweep_v_swa" in sweep and "  fail_reasons: none" in sweep
    unknown = kc.format_violation(_violation(99, 2), total=1, overflowed=False)
    assert FIRST_LINE.match(unknown.split("\n")[0]).group(1) == "unknown(99)"


def test_report_of_a_real_ring_formats_and_raises():
    state = _violations(new_state(), [3, 4])
    report = kc.read_violations(state.violation_log)
    messages = report.format(step=9)
    assert len(messages) == 2 and report.format(step=9, start=1) == messages[1:]
    for message, slot in zip(messages, (3, 4), strict=True):
        m = FIRST_LINE.match(message.split("\n")[0])
        assert m.group(1, 2, 3, 4) == ("TAIL_K_FULL", "verify_position", str(slot), "0")
        assert message.split("\n")[6] == "  total_violations=2 ring_overflow=False step_when_pumped=9"
        assert "  token: found=0 (token not checked)" in message
    # Hashes are printed as u64 (SGLang's 0x%016x of the int64's bits).
    row_hash = int(report.rows[0][5]) & U64
    assert f"stored_chain_hash=0x{row_hash:016x}" in messages[0]
    err = kc.KvCanaryViolationError(report)
    assert isinstance(err, RuntimeError) and err.report is report
    assert str(err) == "\n".join(report.format())


def _spec_append(ring, index, flags, rows):
    """SPEC §2's emulation of the atomic append, literally: exclusive prefix sum, then a scatter of entry ids with
    ``mode="drop"`` and sentinel = capacity; ``rows[e]`` is entry e's row."""
    capacity = ring.shape[0]
    ones = flags.astype(np.int64)
    exclusive = np.cumsum(ones) - ones
    room = min(max(capacity - index, 0), capacity)
    target = np.where(flags & (exclusive < room), index + exclusive, capacity)
    out = ring.copy()
    for entry, row in enumerate(target):
        if row < capacity:
            out[row] = rows[entry]
    return out, min(index + int(ones.sum()), INT32_MAX)


def _launch_rows(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows and contexts for launch ``n``'s ``size`` candidates."""
    rows = (np.arange(size * 16, dtype=np.uint32).reshape(size, 8, 2) + 1000 * n).astype(np.uint32)
    context = np.stack([np.full(size, n), np.arange(size), -np.arange(size)], -1).astype(np.int32)
    return rows, context


def _row_builder(rows: jax.Array, context: jax.Array):
    return lambda entry: (rows[entry], context[entry])


# The appends run jitted, one compile per example's shapes, instead of op by op: the examples' many shapes made
# hundreds of small eager compiles.
@jax.jit
def _append_launches(log, flags, rows, contexts):
    """``_ring.append`` of each launch in turn."""
    for f, r, c in zip(flags, rows, contexts, strict=True):
        log = _ring.append(log, f, _row_builder(r, c))
    return log


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    capacity=st.integers(1, 12),
    index=st.one_of(st.integers(0, 16), st.just(INT32_MAX - 3)),
    launches=st.lists(st.lists(st.booleans(), min_size=0, max_size=16), min_size=1, max_size=3),
)
@hypothesis.example(capacity=8, index=0, launches=[[True, False, False]])  # unflagged rows after the last flag
@hypothesis.example(capacity=4, index=2, launches=[[False, True, True, True], [True] * 6])  # both paths, overflow
def test_single_appends_match_the_spec_scatter_form(capacity, index, launches):
    """``_ring.append``, one launch at a time: the direct scatter (no more flags than ring rows) and the listing
    (more) both equal SPEC's scatter."""
    log = kc.ViolationLog(
        violation_ring=jnp.full((capacity, 8, 2), 7, jnp.uint32),
        violation_write_index=jnp.asarray([index], jnp.int32),
        violation_context=jnp.full((capacity, 3), -7, jnp.int32),
    )
    want_ring, want_context, want_index = np.asarray(log.violation_ring), np.asarray(log.violation_context), index
    sources = []
    for n, flags in enumerate(launches):
        flags = np.asarray(flags, bool)
        rows, context = _launch_rows(n, flags.size)
        want_context, _ = _spec_append(want_context, want_index, flags, context)
        want_ring, want_index = _spec_append(want_ring, want_index, flags, rows)
        sources.append((flags, rows, context))
    log = _append_launches(log, *(tuple(map(jnp.asarray, x)) for x in zip(*sources, strict=True)))
    np.testing.assert_array_equal(np.asarray(log.violation_ring), want_ring)
    np.testing.assert_array_equal(np.asarray(log.violation_context), want_context)
    assert int(log.violation_write_index[0]) == want_index
