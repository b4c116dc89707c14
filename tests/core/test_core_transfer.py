"""``snapshot_records`` / ``restore_and_verify``: records that travel with their KV, checked against a host oracle."""

import jax
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import FailReason
from tests.core.canary_testlib import (
    TAG_TAIL,
    buf_from_records,
    empty_records,
    host_fold,
    i32,
    new_buf,
    new_state,
    oracle_write,
    random_source,
    records,
    slot_hash,
)

PAGE, BYTES = 4, 32
OLD, NEW = [5, 6, 7], [20, 21, 22]
CHAIN = [(-1, [(5, 100, 0), (6, 101, 1), (7, 102, 2)])]
jit_restore = jax.jit(kc.restore_and_verify, static_argnames=("tag", "real_kv_hash_mode", "backend"))


def _kv():
    """A real-KV source over 64 slots, and a copy in which OLD's KV rows were moved to NEW (the transfer)."""
    src = random_source(np.random.default_rng(0), np.uint8, pages=16, page_size=PAGE, bytes_per_token=BYTES)
    raw = np.asarray(src.data).copy()
    for old, new in zip(OLD, NEW, strict=True):
        raw[new // PAGE, (new % PAGE) * BYTES : (new % PAGE + 1) * BYTES] = raw[
            old // PAGE, (old % PAGE) * BYTES : (old % PAGE + 1) * BYTES
        ]
    moved = kc.RealKvSource(jax.numpy.asarray(raw), page_size=PAGE, num_bytes_per_token=BYTES)
    return src, moved


def _written():
    src, moved = _kv()
    recs, _, _ = oracle_write(empty_records(), CHAIN, real_kv=lambda s: host_fold([src], s, 2))
    return recs, src, moved


def _restore(snapshot, sources, slots=NEW, prevs=(-1, 20, 21), positions=(0, 1, 2)):
    return jit_restore(new_state(), new_buf(), snapshot, i32(slots), i32(prevs), i32(positions), tag=TAG_TAIL,
                       real_kv_sources=sources, real_kv_hash_mode="all", backend="xla")  # fmt: skip


def test_snapshot_gathers_the_slots_records_and_zeros_for_padding():
    recs, _, _ = _written()
    snap = jax.jit(kc.snapshot_records)(buf_from_records(recs), i32([7, 0, 5, -1, 64]))
    assert records(snap) == [recs[7], [0] * 4, recs[5], [0] * 4, [0] * 4]


def test_remapped_records_keep_their_chain_hash_and_verify_clean():
    recs, _, moved = _written()
    snap = kc.snapshot_records(buf_from_records(recs), i32(OLD))
    buf, state = _restore(snap, (moved,))
    assert not kc.read_violations(state.violation_log).is_errored
    got = records(buf)
    assert [got[s] for s in NEW] == [recs[s] for s in OLD]  # byte for byte: no field names the slot
    assert [slot_hash(got, s) for s in NEW] == [slot_hash(recs, s) for s in OLD]
    assert all(got[s] == [0] * 4 for s in range(len(got)) if s not in NEW)


def test_restore_records_stores_unchecked_and_skips_padding():
    recs, _, _ = _written()
    snap = kc.snapshot_records(buf_from_records(recs), i32(OLD))
    got = records(jax.jit(kc.restore_records)(new_buf(), snap, i32([20, 0, 22])))
    assert (got[20], got[22]) == (recs[5], recs[7])  # the padding entry's record (slot 6's) went nowhere
    assert all(got[s] == [0] * 4 for s in range(len(got)) if s not in (20, 22))
    with pytest.raises(ValueError, match=r"slots\[0\] = 64 is out of range"):
        kc.restore_records(new_buf(), snap[:1], i32([64]))
    with pytest.raises(ValueError, match=r"records"):
        kc.restore_records(new_buf(), snap, i32([20]))


@pytest.mark.parametrize(
    "fault, slot, reason",
    [
        ("flipped_record", 21, FailReason.VERIFY_CHAIN_HASH_MISMATCH),  # a PREV_HASH byte changed on the host
        ("kv_not_moved", 20, FailReason.VERIFY_REAL_KV_HASH_MISMATCH),  # the KV at the new slots is not the page's
        ("wrong_slots", 22, FailReason.VERIFY_REAL_KV_HASH_MISMATCH),  # records landed in swapped slots: not their KV
    ],
)
def test_a_transfer_gone_wrong_is_named(fault, slot, reason):
    recs, src, moved = _written()
    snap = np.asarray(kc.snapshot_records(buf_from_records(recs), i32(OLD))).copy()
    sources, slots = (moved,), NEW
    if fault == "flipped_record":
        snap[1, 2, 0] ^= 0xFF
    elif fault == "kv_not_moved":
        sources = (src,)
    else:
        slots = [20, 22, 21]
    _, state = _restore(jax.numpy.asarray(snap), sources, slots=slots)
    first = kc.read_violations(state.violation_log).first_violation
    assert (first.slot_idx, first.fail_reason & reason) == (slot, reason), first


def test_misuse_is_named():
    recs, _, moved = _written()
    snap = kc.snapshot_records(buf_from_records(recs), i32(OLD))
    with pytest.raises(ValueError, match=r"slots\[1\] = 64 is out of range: the buffer has 64 slots"):
        kc.snapshot_records(new_buf(), i32([3, 64]))
    with pytest.raises(ValueError, match=r"records"):
        _restore(snap[:2], (moved,))
    with pytest.raises(ValueError, match="the same length"):
        _restore(snap, (moved,), prevs=(-1, 20))
    with pytest.raises(ValueError, match=r"prev_slots\[2\] = 99 is out of range"):
        kc.restore_and_verify(new_state(), new_buf(), snap, i32(NEW), i32([-1, 20, 99]), i32([0, 1, 2]), tag=TAG_TAIL)
