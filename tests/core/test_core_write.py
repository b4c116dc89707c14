"""canary_write: chain seeding, skipped entries, the input and chain-position asserts, row order, real-KV folds."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import testing
from tests.core.canary_testlib import (
    NUM_SLOTS,
    NUM_TOKENS,
    RING,
    TAG_HEAD,
    TAG_TAIL,
    WCAP,
    buf_from_records,
    counters,
    empty_records,
    host_fold,
    i32,
    jit_verify,
    jit_write,
    new_buf,
    new_state,
    oracle_write,
    padded,
    random_source,
    records,
    ring_rows,
    slot_hash,
    verify_plan,
    write_batch,
    write_index,
)

WRITE_TOKEN, WRITE_POSITION = 8, 16
PREFIX = [(4, 40, 0), (9, 41, 1), (6, 42, 2)]  # (slot, token, position) already cached for one request


def _prefix_records():
    recs, _, _ = oracle_write(empty_records(), [(-1, PREFIX)])
    return recs


def _write(recs, requests, *, state=None, expected=None, **kwargs):
    """Runs the jitted write from ``recs``; returns (records, rows, state)."""
    plan, ids, pos, loc = write_batch(requests, num_valid_reqs=kwargs.pop("num_valid_reqs", None))
    if expected is not None:
        kwargs["expected_input_tokens"] = padded([e[0] for e in expected], NUM_TOKENS, 0)
        kwargs["expected_input_positions"] = padded([e[1] for e in expected], NUM_TOKENS, 0)
    state = new_state() if state is None else state
    buf, state = jit_write(state, buf_from_records(recs), plan, ids, pos, loc, tag=TAG_HEAD, backend="xla", **kwargs)
    return records(buf), ring_rows(state), state


def test_chain_seeded_from_seed_slot():
    recs = _prefix_records()
    new = [(20, 43, 3), (21, 44, 4)]
    got, rows, state = _write(recs, [(6, new)])
    assert rows == []
    assert got[20][2] == slot_hash(recs, 6)  # the first new entry continues the cached chain
    assert got[21][2] == testing.mix3(got[20][2], 43, 3)
    assert got == oracle_write(recs, [(6, new)])[0]
    assert counters(state)[1][TAG_HEAD] == 2 and counters(state)[0][TAG_HEAD] == 1
    # The continued chain verifies clean end to end.
    slots = [s for s, _, _ in PREFIX + new]
    verified = jit_verify(
        new_state(),
        buf_from_records(got),
        verify_plan(slots, range(5), [-1] + slots[:-1]),
        tag=TAG_TAIL,
        check_expected_token=False,
        backend="xla",
    )
    assert write_index(verified) == 0


def test_negative_out_cache_loc_is_skipped_and_does_not_advance_the_chain():
    items = [(10, 1, 0), (-1, 2, 1), (11, 3, 1), (-7, 4, 2), (12, 5, 2)]
    got, rows, state = _write(empty_records(), [(-1, items)])
    assert rows == []
    assert got[10][2] == kc.ANCHOR_HASH
    assert got[11][2] == testing.mix3(got[10][2], 1, 0)  # the skipped entry left no trace in the chain
    assert got[12][2] == testing.mix3(got[11][2], 3, 1)
    untouched = [s for s in range(NUM_SLOTS) if s not in (10, 11, 12)]
    assert all(got[s] == [0, 0, 0, 0] for s in untouched)
    assert counters(state)[1][TAG_HEAD] == 3  # written entries only
    assert got == oracle_write(empty_records(), [(-1, items)])[0]


def test_input_assert_rows():
    items = [(10, 1, 0), (11, 2, 1), (12, 3, 2), (13, 4, 3), (-1, 5, 4)]
    expected = [(1, 0), (9, 1), (3, 7), (8, 8), (0, 0)]  # ok, token, position, both, skipped (never checked)
    got, rows, state = _write(empty_records(), [(-1, items)], expected=expected)
    h = [got[s][2] for s in (10, 11, 12, 13)]
    assert rows == [
        [TAG_HEAD, 11, 1, 2, 9, testing.to_signed(h[1]), 1, WRITE_TOKEN],
        [TAG_HEAD, 12, 2, 3, 3, testing.to_signed(h[2]), 7, WRITE_POSITION],
        [TAG_HEAD, 13, 3, 4, 8, testing.to_signed(h[3]), 8, WRITE_TOKEN | WRITE_POSITION],
    ]
    # The chain advanced on the actual values: the records are those of an unchecked write.
    assert got == oracle_write(empty_records(), [(-1, items)])[0]
    report = kc.read_violations(state.violation_log)
    assert [v.fail_reason for v in report.violations] == [
        kc.FailReason.WRITE_TOKEN_MISMATCH,
        kc.FailReason.WRITE_POSITION_MISMATCH,
        kc.FailReason.WRITE_TOKEN_MISMATCH | kc.FailReason.WRITE_POSITION_MISMATCH,
    ]


def test_chain_position_assert():
    recs = _prefix_records()  # seed slot 6 holds position 2
    items = [(20, 1, 3), (21, 2, 5), (-1, 9, 9), (22, 3, 6), (23, 4, 6)]
    got, rows, _ = _write(recs, [(6, items)])
    h = {s: testing.to_signed(got[s][2]) for s in (21, 23)}
    assert rows == [
        [TAG_HEAD, 21, 5, 2, 2, h[21], 4, WRITE_POSITION],  # 3 -> 5: expected 4
        [TAG_HEAD, 23, 6, 4, 4, h[23], 7, WRITE_POSITION],  # 6 -> 6: expected 7 (the skipped entry is ignored)
    ]
    assert oracle_write(recs, [(6, items)])[1] == rows
    assert got == oracle_write(recs, [(6, items)])[0]  # the chain still advances on the actual values


def test_chain_position_assert_gating():
    recs = _prefix_records()
    jump = [(20, 1, 10)]  # position 10 after the seed's 2
    assert len(_write(recs, [(6, jump)])[1]) == 1
    off = dataclasses.replace(new_state(), enable_chain_position_assert=i32([0]))  # warm-up / capture
    assert _write(recs, [(6, jump)], state=off)[1] == []
    assert _write(recs, [(-1, jump)])[1] == []  # no seed: nothing to compare with
    other = dataclasses.replace(new_state(), enable_chain_position_assert=i32([7]))  # any non-zero value is on
    assert len(_write(recs, [(6, jump)], state=other)[1]) == 1


def test_input_assert_row_comes_before_chain_position_row():
    recs = _prefix_records()
    items = [(20, 1, 3), (21, 2, 9), (22, 3, 10)]
    expected = [(1, 3), (5, 4), (3, 10)]
    got, rows, _ = _write(recs, [(6, items)], expected=expected)
    h21 = testing.to_signed(got[21][2])
    assert rows == [
        [TAG_HEAD, 21, 9, 2, 5, h21, 4, WRITE_TOKEN | WRITE_POSITION],
        [TAG_HEAD, 21, 9, 2, 2, h21, 4, WRITE_POSITION],
    ]
    assert oracle_write(recs, [(6, items)], expected=expected)[1] == rows


def test_rows_are_request_major_and_requests_past_num_valid_are_not_written():
    recs = _prefix_records()
    requests = [(6, [(20, 1, 3), (21, 2, 7)]), (-1, [(30, 5, 0)]), (9, [(31, 6, 5), (32, 7, 0)]), (6, [(33, 1, 3)])]
    got, rows, state = _write(recs, requests, num_valid_reqs=3)
    assert [r[1] for r in rows] == [21, 31, 32]
    assert got[33] == [0, 0, 0, 0]
    want_recs, want_rows, written = oracle_write(recs, requests, num_valid_reqs=3)
    assert (got, rows) == (want_recs, want_rows)
    assert counters(state)[1][TAG_HEAD] == written == 5


def test_duplicate_slots_last_writer_wins():
    requests = [(-1, [(10, 1, 0), (11, 2, 1), (10, 3, 2)]), (-1, [(11, 4, 0)])]
    got, _, state = _write(empty_records(), requests)
    assert got[10][:2] == [3, 2] and got[11][:2] == [4, 0]
    assert got == oracle_write(empty_records(), requests)[0]
    assert counters(state)[1][TAG_HEAD] == 4


def test_random_writes_match_the_oracle():
    """Differential test: random requests (skips, jumps, token/position mismatches) vs. SGLang's write reference."""
    rng = np.random.default_rng(11)
    base = _prefix_records()
    seen = set()
    for trial in range(10):
        requests, expected, free = [], [], list(rng.permutation(np.arange(13, NUM_SLOTS)))
        budget = NUM_TOKENS
        for _ in range(int(rng.integers(1, WCAP + 1))):
            n = int(rng.integers(0, min(8, budget) + 1))
            budget -= n
            seed = int(rng.choice([-1, 4, 9, 6]))
            start = 0 if seed < 0 else base[seed][1] + 1
            items = []
            for k in range(n):
                slot = int(free.pop()) if rng.random() < 0.85 else -1
                position = start + k + (int(rng.integers(-2, 3)) if rng.random() < 0.2 else 0)
                items.append((slot, int(rng.integers(-(2**31), 2**31)), position))
                expected.append((items[-1][1] if rng.random() < 0.8 else 0, position if rng.random() < 0.8 else -1))
            requests.append((seed, items))
        use_expected = expected if trial % 2 else None
        got, rows, state = _write(base, requests, expected=use_expected)
        want_recs, want_rows, written = oracle_write(base, requests, expected=use_expected)
        assert got == want_recs, trial
        assert rows == want_rows[:RING], trial
        assert write_index(state) == len(want_rows)
        assert counters(state)[1][TAG_HEAD] == written
        seen |= {(r[7], r[3] == r[4]) for r in want_rows}
    # Input-assert rows of each kind, and chain-position rows (expected_token == actual token), were exercised.
    assert {(WRITE_TOKEN, False), (WRITE_POSITION, True), (WRITE_TOKEN | WRITE_POSITION, False)} <= seen


# Real-KV covering set: 1-4 sources; dtypes bf16, float8_e4m3fn, int8, float32, uint8; page sizes 1/4/16; both modes;
# read_bytes below bytes_per_token; page rows padded beyond page_size * bytes_per_token.
_REAL_KV_CASES = {
    "1src-partial-u8-ps1": (kc.RealKvHashMode.PARTIAL, [(np.uint8, 1, 32, None, 0)]),
    "1src-all-bf16-ps4": (kc.RealKvHashMode.ALL, [(jnp.bfloat16, 4, 32, None, 0)]),
    "2src-all-f8-ps16-i8-ps1": (
        kc.RealKvHashMode.ALL,
        [(jnp.float8_e4m3fn, 16, 16, None, 0), (np.int8, 1, 64, 48, 16)],
    ),
    "3src-partial-f32-bf16-u8": (
        kc.RealKvHashMode.PARTIAL,
        [(np.float32, 4, 32, None, 0), (jnp.bfloat16, 16, 16, None, 32), (np.uint8, 1, 16, None, 0)],
    ),
    "4src-all-mixed": (
        kc.RealKvHashMode.ALL,
        [
            (np.int8, 16, 32, 16, 0),
            (np.float32, 1, 48, 32, 0),
            (jnp.float8_e4m3fn, 4, 16, None, 16),
            (jnp.bfloat16, 4, 64, 64, 0),
        ],
    ),
}


_WRITE_CASES = ("3src-partial-f32-bf16-u8", "4src-all-mixed")  # together: every dtype and page size, both modes


@pytest.mark.parametrize("case", list(_REAL_KV_CASES))
def test_real_kv_fold_matches_host_fold_of_the_bytes(case):
    """Records holding the host fold of the bytes verify clean (device fold == host fold); a wrong one is caught."""
    mode, specs = _REAL_KV_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    sources = tuple(
        random_source(
            rng, dtype, pages=-(-NUM_SLOTS // ps), page_size=ps, bytes_per_token=bpt, read_bytes=rb, pad_bytes=pad
        )
        for dtype, ps, bpt, rb, pad in specs
    )
    fold = lambda slot: host_fold(sources, slot, mode)  # noqa: E731
    slots = [1, 2, 3, 4, 5, 15, 16, 17, 31, 33, NUM_SLOTS - 1]
    items = [(s, 100 + k, k) for k, s in enumerate(slots)]
    recs = oracle_write(empty_records(), [(-1, items)], real_kv=fold)[0]
    assert len({recs[s][3] for s in slots}) == len(slots)  # distinct bytes, distinct folds
    plan = verify_plan(slots, range(len(slots)), [-1] + slots[:-1])
    recs[slots[4]][3] ^= 1 << 40  # one wrong REAL_KV_HASH: the only row
    state = jit_verify(
        new_state(),
        buf_from_records(recs),
        plan,
        tag=TAG_TAIL,
        real_kv_sources=sources,
        real_kv_hash_mode=mode,
        check_expected_token=False,
        backend="xla",
    )
    assert [(r[1], r[7]) for r in ring_rows(state)] == [(slots[4], 4)]
    if case in _WRITE_CASES:
        got, rows, _ = _write(empty_records(), [(-1, items)], real_kv_sources=sources, real_kv_hash_mode=mode)
        assert rows == []
        assert [got[s][3] for s in slots] == [fold(s) for s in slots]


def test_real_kv_none_mode_folds_nothing():
    rng = np.random.default_rng(0)
    source = random_source(rng, np.uint8, pages=NUM_SLOTS, page_size=1, bytes_per_token=32)
    recs = oracle_write(empty_records(), [(-1, [(3, 1, 0), (4, 2, 1)])])[0]
    recs[4][3] = 1
    state = jit_verify(
        new_state(),
        buf_from_records(recs),
        verify_plan([3, 4], [0, 1], [-1, 3]),
        tag=TAG_TAIL,
        real_kv_sources=(source,),
        real_kv_hash_mode=kc.RealKvHashMode.NONE,
        check_expected_token=False,
        backend="xla",
    )
    assert [(r[1], r[7]) for r in ring_rows(state)] == [(4, 4)]


class WriteVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_write_with_and_without_jit(self):
        recs = _prefix_records()
        requests = [(6, [(20, 1, 3), (-1, 0, 0), (21, 2, 9)]), (-1, [(22, 5, 0)])]
        plan, ids, pos, loc = write_batch(requests)
        write = self.variant(kc.canary_write, static_argnames=("tag", "backend"))
        buf, state = write(new_state(), buf_from_records(recs), plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")
        want_recs, want_rows, written = oracle_write(recs, requests)
        assert records(buf) == want_recs
        assert ring_rows(state) == want_rows and len(want_rows) == 1
        assert counters(state)[1][TAG_HEAD] == written == 3
        assert new_buf().shape == buf.shape
