"""Byte layout: canary buffers, rings and counters are SGLang's int64 tensors as (lo, hi) uint32 pairs; constants."""

import dataclasses
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax.core import _constants as constants
from tests.core.canary_testlib import (
    NUM_SLOTS,
    RING,
    TAG_HEAD,
    TAG_TAIL,
    buf_from_records,
    empty_records,
    jit_verify,
    jit_write,
    new_buf,
    new_state,
    ring_rows,
    verify_plan,
    write_batch,
)


def test_canary_buffer_bytes_are_sglangs_uint8_records():
    items = [(1, -7, 0), (2, 2**31 - 1, 1), (3, 5, -2), (NUM_SLOTS - 1, 0, 3)]
    plan, ids, pos, loc = write_batch([(-1, items)])
    buf, _ = jit_write(new_state(), new_buf(), plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")
    assert buf.shape == (NUM_SLOTS, 4, 2) and buf.dtype == jnp.uint32
    as_bytes = np.asarray(buf).view(np.uint8).reshape(NUM_SLOTS, constants.CANARY_SLOT_BYTES)
    records = kc.records_as_int64(buf)
    assert records.shape == (NUM_SLOTS, 4) and records.dtype == np.int64
    for slot, token, position in items:
        tok, p, prev_hash, real_kv = (int(v) for v in records[slot])
        assert (tok, p, real_kv) == (token, position, 0)  # int32 inputs are sign-extended to int64
        # SGLang's record: four little-endian int64 at byte offsets 0/8/16/24.
        assert as_bytes[slot].tobytes() == struct.pack("<4q", token, position, prev_hash, 0)
    assert int(records[1][2]) == kc.ANCHOR_HASH - 2**64  # the head's PREV_HASH, as SGLang's signed int64
    assert not as_bytes[0].any() and not as_bytes[4].any()
    np.testing.assert_array_equal(records, np.asarray(buf).view(np.int64)[..., 0])  # SPEC §2's host recipe


def test_records_as_int64_round_trips_host_layouts():
    recs = empty_records()
    recs[3] = [-1, 2**63 - 1, -(2**63), 12345]
    buf = buf_from_records(recs)
    np.testing.assert_array_equal(kc.records_as_int64(buf)[3], np.array(recs[3], np.int64))
    np.testing.assert_array_equal(kc.records_as_int64(np.asarray(buf)), kc.records_as_int64(buf))
    lo_hi = np.asarray(buf)[3, 0]
    assert lo_hi.tolist() == [0xFFFFFFFF, 0xFFFFFFFF]  # (lo, hi) of -1


def test_ring_and_counter_bytes_are_int64():
    state = jit_verify(new_state(), new_buf(), verify_plan([5, 6], [1, 1], [0, 0]), tag=TAG_TAIL,
                       check_expected_token=False, backend="xla")  # fmt: skip
    log = state.violation_log
    ring = np.asarray(log.violation_ring)
    assert ring.shape == (RING, kc.VIOLATION_FIELDS, 2) and ring.dtype == np.uint32
    assert log.violation_write_index.shape == (1,) and log.violation_write_index.dtype == jnp.int32
    as_int64 = ring.view(np.int64)[..., 0]
    np.testing.assert_array_equal(as_int64[:2], kc.read_violations(log).rows)
    assert ring_rows(state)[0] == [TAG_TAIL, 5, 0, 0, -1, 0, 0, 2]
    kernel = np.asarray(state.kernel_run_counters)
    assert kernel.shape == (kc.NUM_LAUNCH_TAGS, 2) and kernel.dtype == np.uint32
    assert kernel.view(np.int64)[:, 0].tolist() == [1 if t == TAG_TAIL else 0 for t in range(kc.NUM_LAUNCH_TAGS)]


def test_state_allocation_shapes_and_pytree():
    config = kc.CanaryConfig(ring_capacity=8, enable_verify_token_assert=True)
    state = kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=3, max_context_len=5)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype.name), state)
    assert shapes == kc.CanaryDeviceState(
        violation_log=kc.ViolationLog(
            violation_ring=((8, 8, 2), "uint32"),
            violation_write_index=((1,), "int32"),
            violation_context=((8, 3), "int32"),  # ours: request row, expected position, batch entry per row
        ),
        kernel_run_counters=((12, 2), "uint32"),
        slot_run_counters=((12, 2), "uint32"),
        enable_chain_position_assert=((1,), "int32"),
        req_to_verify_expected_tokens=((3, 5), "int32"),
    )
    assert state.enable_chain_position_assert.tolist() == [1]  # on after allocate, like SGLang
    assert (np.asarray(state.req_to_verify_expected_tokens) == -1).all()
    assert not np.asarray(state.violation_log.violation_ring).any()
    assert (np.asarray(state.violation_log.violation_context) == -1).all()
    assert len(jax.tree.leaves(state)) == 7
    plain = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig())
    assert plain.req_to_verify_expected_tokens is None and len(jax.tree.leaves(plain)) == 6
    assert plain.violation_log.ring_capacity == 1024 and plain.num_tags == 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.kernel_run_counters = None


def test_constants_are_sglangs():
    assert kc.NUM_LAUNCH_TAGS == 12 and kc.VIOLATION_FIELDS == 8 and kc.CANARY_FIELDS_PER_SLOT == 4
    sglang_reasons = [
        ("VERIFY_CHAIN_HASH_MISMATCH", 1), ("VERIFY_POSITION_MISMATCH", 2), ("VERIFY_REAL_KV_HASH_MISMATCH", 4),
        ("WRITE_TOKEN_MISMATCH", 8), ("WRITE_POSITION_MISMATCH", 16), ("VERIFY_TOKEN_MISMATCH", 32),
    ]  # fmt: skip
    reasons = [(r.name, int(r)) for r in kc.FailReason]
    assert reasons[:6] == sglang_reasons
    assert all(value > 32 for _, value in reasons[6:])  # our own bits (if any) come after SGLang's
    assert [t.name for t in kc.CanaryLaunchTag] == [
        f"{when}_{half}_{pool}" for pool in ("FULL", "SWA") for when in ("HEAD", "TAIL", "SWEEP") for half in "KV"
    ]
    assert [int(t) for t in kc.CanaryLaunchTag] == list(range(12))
    assert [(m.name, int(m)) for m in kc.RealKvHashMode] == [("NONE", 0), ("PARTIAL", 1), ("ALL", 2)]
    assert (int(kc.PoolKind.FULL), int(kc.PoolKind.SWA)) == (0, 1)
    assert constants.CANARY_FIELD_PREV_HASH == 2 and constants.VIOLATION_FIELD_EXPECTED_AUX == 6


def test_real_kv_source_is_a_pytree_with_static_metadata():
    source = kc.RealKvSource(jnp.zeros((8, 64), jnp.bfloat16), page_size=4, num_bytes_per_token=32, read_bytes=16)
    (path, leaf), *rest = jax.tree_util.tree_flatten_with_path(source)[0]
    assert rest == [] and leaf is source.data and jax.tree_util.keystr(path) == ".data"
    # Mapping to non-array leaves (shapes, None) must not re-run the constructor's checks.
    shapes = jax.tree.map(lambda x: x.shape, source)
    assert (shapes.data, shapes.page_size, shapes.num_bytes_per_token, shapes.read_bytes) == ((8, 64), 4, 32, 16)
    assert jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(source), [None]).data is None
    other = kc.RealKvSource(jnp.ones((8, 64), jnp.bfloat16), page_size=4, num_bytes_per_token=32, read_bytes=16)
    assert jax.tree_util.tree_structure(other) == jax.tree_util.tree_structure(source)
    assert jax.tree_util.tree_structure(kc.RealKvSource(source.data)) != jax.tree_util.tree_structure(source)
    total = jax.jit(lambda s: s.data.astype(jnp.float32).sum() + s.read_bytes)(other)
    assert float(total) == 8 * 64 + 16
