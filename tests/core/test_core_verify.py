"""canary_verify: every fail bit alone and combined, the skips (slot 0, prev 0), the anchor, enable and clamping.

Buffers are built on the host from the oracle's records, so these tests do not depend on canary_write.
"""

import itertools

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import testing
from tests.core.canary_testlib import (
    NUM_SLOTS,
    RING,
    TAG_TAIL,
    VCAP,
    buf_from_records,
    counters,
    empty_records,
    host_fold,
    jit_verify,
    new_state,
    oracle_verify,
    oracle_write,
    random_source,
    ring_rows,
    signed_row,
    slot_hash,
    verify_plan,
    write_index,
)

CHAIN, POSITION, REAL_KV, TOKEN = 1, 2, 4, 32
SLOTS = [3, 7, 5, 9, 12, 2]  # scattered slots of one request, positions 0..5
TOKENS = [11, -4, 2**31 - 1, 0, 77, -(2**31)]  # negative tokens are sign-extended
PREVS = [-1] + SLOTS[:-1]
POSITIONS = list(range(len(SLOTS)))


def _chain_records():
    recs, rows, _ = oracle_write(empty_records(), [(-1, list(zip(SLOTS, TOKENS, POSITIONS, strict=True)))])
    assert not rows
    return recs


def _verify(recs, plan, *, check_token=True, state=None, **kwargs):
    state = new_state() if state is None else state
    return jit_verify(
        state, buf_from_records(recs), plan, tag=TAG_TAIL, check_expected_token=check_token, backend="xla", **kwargs
    )


def test_clean_chain_is_silent_and_counted():
    state = _verify(_chain_records(), verify_plan(SLOTS, POSITIONS, PREVS, TOKENS))
    assert write_index(state) == 0 and ring_rows(state) == []
    kernel, slots = counters(state)
    assert kernel[TAG_TAIL] == 1 and slots[TAG_TAIL] == len(SLOTS)
    assert sum(kernel) == 1 and sum(slots) == len(SLOTS)  # only the launch's own tag moves


@pytest.mark.parametrize(
    "bits", [sum(c) for n in range(1, 5) for c in itertools.combinations([CHAIN, POSITION, REAL_KV, TOKEN], n)]
)
def test_each_bit_alone_and_combined(bits):
    """Provoke exactly ``bits`` at entry 2 (through the plan, or the REAL_KV field, which is outside the chain)."""
    recs = _chain_records()
    k, slot = 2, SLOTS[2]
    prevs, positions, tokens = list(PREVS), list(POSITIONS), list(TOKENS)
    if bits & CHAIN:
        prevs[k] = SLOTS[0]  # wrong predecessor: H(prev) != stored PREV_HASH
    if bits & POSITION:
        positions[k] = 40
    if bits & REAL_KV:
        recs[slot][3] = 0x1234  # no sources: the fold is 0
    if bits & TOKEN:
        tokens[k] = 555
    state = _verify(recs, verify_plan(SLOTS, positions, prevs, tokens))
    token, position, prev_hash, _ = recs[slot]
    expected_chain = slot_hash(recs, prevs[k])
    want = signed_row([TAG_TAIL, slot, position, token, tokens[k], prev_hash, expected_chain, bits])
    assert ring_rows(state) == [want]
    assert write_index(state) == 1
    assert oracle_verify(recs, SLOTS, positions, prevs, tokens, check_token=True)[0] == [want]
    report = kc.read_violations(state.violation_log)
    assert report.first_violation.fail_reason == kc.FailReason(bits)
    assert report.first_violation.launch_tag is kc.CanaryLaunchTag.TAIL_K_FULL


def test_tampered_token_shows_as_chain_at_next_entry_only():
    recs = _chain_records()
    recs[SLOTS[2]][0] = 999  # the token is inside H(slot), so only the successor's check sees it
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, PREVS, TOKENS), check_token=False)
    rows = ring_rows(state)
    assert [(r[1], r[7]) for r in rows] == [(SLOTS[3], CHAIN)]
    assert rows[0][4] == -1  # expected_token is -1 when the token check is off
    assert rows[0][6] == testing.to_signed(slot_hash(recs, SLOTS[2]))
    assert rows[0][5] == testing.to_signed(recs[SLOTS[3]][2])
    # With the source-of-truth check on, the tampered slot itself is caught too.
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, PREVS, TOKENS), check_token=True)
    assert [(r[1], r[4], r[7]) for r in ring_rows(state)] == [
        (SLOTS[2], TOKENS[2], TOKEN),
        (SLOTS[3], TOKENS[3], CHAIN),
    ]


def test_tampered_position_shows_position_here_and_chain_next():
    recs = _chain_records()
    recs[SLOTS[4]][1] = 123
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, PREVS, TOKENS))
    rows = ring_rows(state)
    assert [(r[1], r[2], r[7]) for r in rows] == [(SLOTS[4], 123, POSITION), (SLOTS[5], 5, CHAIN)]


def test_tampered_prev_hash_shows_chain_here_and_next():
    recs = _chain_records()
    recs[SLOTS[1]][2] ^= 1 << 63
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, PREVS, TOKENS))
    assert [(r[1], r[7]) for r in ring_rows(state)] == [(SLOTS[1], CHAIN), (SLOTS[2], CHAIN)]


def test_slot0_entries_are_skipped_but_counted():
    recs = _chain_records()
    recs[0] = [5, 6, 7, 8]  # garbage in the padding slot's record
    slots = SLOTS[:3] + [0, 0] + SLOTS[3:]
    positions = POSITIONS[:3] + [17, 18] + POSITIONS[3:]
    prevs = PREVS[:3] + [SLOTS[0], -1] + PREVS[3:]
    tokens = TOKENS[:3] + [1, 2] + TOKENS[3:]
    state = _verify(recs, verify_plan(slots, positions, prevs, tokens))
    assert ring_rows(state) == []
    assert counters(state)[1][TAG_TAIL] == len(slots)


def test_prev_zero_is_unreachable_chain_check_skipped():
    recs = _chain_records()
    recs[SLOTS[3]][2] = 0xBAD  # would be a chain mismatch if the predecessor were known
    prevs = list(PREVS)
    prevs[3] = 0
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, prevs, TOKENS))
    # Entry 3 is silent; entry 4 checks H(slot 3), which the tamper did change.
    assert [(r[1], r[7]) for r in ring_rows(state)] == [(SLOTS[4], CHAIN)]
    # An unreachable entry's row carries expected_aux = its stored chain hash.
    positions = list(POSITIONS)
    positions[3] = 99
    state = _verify(recs, verify_plan(SLOTS, positions, prevs, TOKENS))
    rows = ring_rows(state)
    assert rows[0][1] == SLOTS[3] and rows[0][7] == POSITION
    assert rows[0][5] == rows[0][6] == 0xBAD


def test_prev_minus_one_is_the_anchor():
    recs = _chain_records()
    prevs = list(PREVS)
    prevs[2] = -1  # claims slot 5 heads a chain: expected hash is the anchor hash
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, prevs, TOKENS))
    rows = ring_rows(state)
    assert [(r[1], r[7]) for r in rows] == [(SLOTS[2], CHAIN)]
    assert rows[0][6] == testing.to_signed(kc.ANCHOR_HASH)
    # The real head stores the anchor hash itself.
    assert recs[SLOTS[0]][2] == kc.ANCHOR_HASH


def test_enable_zero_checks_nothing_but_counts_the_launch():
    recs = _chain_records()
    recs[SLOTS[1]][0] = 1  # a real violation, ignored while disabled
    plan = verify_plan(SLOTS, POSITIONS, PREVS, TOKENS, enable=0)
    state = _verify(recs, plan)
    assert write_index(state) == 0
    kernel, slots = counters(state)
    assert kernel[TAG_TAIL] == 1 and slots[TAG_TAIL] == 0


@pytest.mark.parametrize(("num_valid", "active"), [(-3, 0), (0, 0), (3, 3), (VCAP + 5, VCAP)])
def test_num_valid_is_clamped(num_valid, active):
    recs = _chain_records()
    recs[SLOTS[4]][1] = 50  # tampered entry 4 (and, through the chain, entry 5)
    plan = verify_plan(SLOTS, POSITIONS, PREVS, TOKENS, num_valid=num_valid)
    state = _verify(recs, plan)
    want, counted = oracle_verify(recs, SLOTS, POSITIONS, PREVS, TOKENS, num_valid=num_valid, check_token=True)
    assert counted == active
    assert ring_rows(state) == want
    assert len(want) == (2 if active > 5 else 0)
    assert counters(state)[1][TAG_TAIL] == active


def test_token_check_skips_minus_one_and_reports_minus_one_when_off():
    recs = _chain_records()
    tokens = list(TOKENS)
    tokens[1] = -1  # unknown source-of-truth token: never a VERIFY_TOKEN mismatch
    recs[SLOTS[1]][0] = 4242
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, PREVS, tokens), check_token=True)
    assert [(r[1], r[4], r[7]) for r in ring_rows(state)] == [(SLOTS[2], tokens[2], CHAIN)]
    state = _verify(recs, verify_plan(SLOTS, POSITIONS, PREVS, [1] * len(SLOTS)), check_token=False)
    assert [(r[1], r[4], r[7]) for r in ring_rows(state)] == [(SLOTS[2], -1, CHAIN)]


def test_random_buffers_and_plans_match_the_oracle():
    """Differential test: random (partly corrupted) records and random plans, rows compared field by field."""
    rng = np.random.default_rng(2024)
    recs = _chain_records()
    bits_seen, lengths = 0, []
    for trial in range(12):
        noisy = [list(r) for r in recs]
        for slot in rng.choice(NUM_SLOTS, size=4, replace=False):
            field = int(rng.integers(0, 4))
            noisy[slot][field] = int(rng.integers(0, 2**64, dtype=np.uint64))
        n = int(rng.integers(0, VCAP + 1))
        slots = rng.integers(0, NUM_SLOTS, size=n).tolist()
        chain = rng.integers(0, len(SLOTS), size=n)
        slots = [SLOTS[c] if rng.random() < 0.5 else s for c, s in zip(chain, slots, strict=True)]
        positions = [int(c) if rng.random() < 0.9 else int(rng.integers(-5, 5)) for c in chain]
        prevs = [PREVS[c] if rng.random() < 0.7 else int(rng.choice([-1, 0] + SLOTS)) for c in chain]
        tokens = [TOKENS[c] if rng.random() < 0.8 else int(rng.integers(-2, 3)) for c in chain]
        check = bool(trial % 2)
        plan = verify_plan(slots, positions, prevs, tokens)
        got = jit_verify(
            new_state(), buf_from_records(noisy), plan, tag=TAG_TAIL, check_expected_token=check, backend="xla"
        )
        want, counted = oracle_verify(noisy, slots, positions, prevs, tokens, check_token=check)
        assert ring_rows(got) == want[:RING], trial
        assert write_index(got) == len(want)
        assert counters(got)[1][TAG_TAIL] == counted
        for row in want:
            bits_seen |= row[7]
        lengths.append(len(want))
    assert bits_seen == CHAIN | POSITION | REAL_KV | TOKEN  # every bit was exercised
    assert min(lengths) < RING < max(lengths)  # trials below and beyond the ring's capacity


@pytest.mark.parametrize("mode", [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL], ids=["partial", "all"])
def test_real_kv_bytes_changed_after_write(mode):
    """Records written with the sources' fold verify clean; a changed KV byte is REAL_KV at that slot only."""
    rng = np.random.default_rng(5)
    sources = (
        random_source(rng, jnp.bfloat16, pages=NUM_SLOTS // 4, page_size=4, bytes_per_token=48, read_bytes=32),
        random_source(rng, np.int8, pages=NUM_SLOTS, page_size=1, bytes_per_token=16, pad_bytes=16),
    )
    fold = lambda slot: host_fold(sources, slot, mode)  # noqa: E731
    recs, _, _ = oracle_write(empty_records(), [(-1, list(zip(SLOTS, TOKENS, POSITIONS, strict=True)))], real_kv=fold)
    plan = verify_plan(SLOTS, POSITIONS, PREVS, TOKENS)
    clean = _verify(recs, plan, real_kv_sources=sources, real_kv_hash_mode=mode)
    assert ring_rows(clean) == []
    assert all(recs[s][3] == fold(s) != 0 for s in SLOTS)

    def flip(byte):  # flip one byte of slot SLOTS[3]'s bytes in source 0 (page SLOTS[3] // 4, token SLOTS[3] % 4)
        raw = np.asarray(sources[0].data).view(np.uint8).copy()
        raw[SLOTS[3] // 4, (SLOTS[3] % 4) * 48 + byte] ^= 0xFF
        data = jnp.asarray(raw.view(jnp.bfloat16))
        return (kc.RealKvSource(data, page_size=4, num_bytes_per_token=48, read_bytes=32), sources[1])

    inside = _verify(recs, plan, real_kv_sources=flip(3), real_kv_hash_mode=mode)
    assert [(r[1], r[7]) for r in ring_rows(inside)] == [(SLOTS[3], REAL_KV)]
    assert ring_rows(inside)[0][6] == testing.to_signed(slot_hash(recs, SLOTS[2]))  # aux is still the chain hash
    beyond_partial = _verify(recs, plan, real_kv_sources=flip(20), real_kv_hash_mode=mode)
    assert len(ring_rows(beyond_partial)) == (1 if mode == kc.RealKvHashMode.ALL else 0)
    beyond_read_bytes = _verify(recs, plan, real_kv_sources=flip(40), real_kv_hash_mode=mode)
    assert ring_rows(beyond_read_bytes) == []


class VerifyVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_verify_with_and_without_jit(self):
        recs = _chain_records()
        recs[SLOTS[2]][1] = 9
        verify = self.variant(kc.canary_verify, static_argnames=("tag", "check_expected_token", "backend"))
        state = verify(
            new_state(),
            buf_from_records(recs),
            verify_plan(SLOTS, POSITIONS, PREVS, TOKENS),
            tag=TAG_TAIL,
            check_expected_token=True,
            backend="xla",
        )
        want, _ = oracle_verify(recs, SLOTS, POSITIONS, PREVS, TOKENS, check_token=True)
        assert [(r[1], r[7]) for r in want] == [(SLOTS[2], POSITION), (SLOTS[3], CHAIN)]
        assert ring_rows(state) == want
        assert counters(state)[0][TAG_TAIL] == 1
