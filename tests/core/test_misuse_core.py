"""Misuse of the core tier, as a new user commits it: every argument of every entry point gets a wrong type, shape,
dtype or value, and must fail with a message naming the argument and the value received. Numpy integers and arrays
are accepted wherever Python ints and jax arrays are. ``test_core_errors`` covers the first-order cases; this suite
covers the rest, and shows the correct call next to each misuse doing its job.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax.testing import expect_violation
from tests.core.canary_testlib import (
    NUM_SLOTS,
    TAG_HEAD,
    TAG_TAIL,
    VCAP,
    WCAP,
    i32,
    new_buf,
    new_state,
    verify_plan,
    write_batch,
)

# ------------------------------------------------------------------------------------------------------ CanaryConfig


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(mode=None), ValueError, r"mode must be one of .*; got mode=None"),
        (dict(mode=["raise"]), ValueError, r"got mode=\['raise'\]"),
        (dict(ring_capacity="8"), ValueError, r"ring_capacity must be an int >= 1; got ring_capacity='8'"),
        (dict(ring_capacity=8.0), ValueError, r"ring_capacity=8.0"),
        (dict(real_kv_hash_mode=None), ValueError, r"real_kv_hash_mode must be one of .*real_kv_hash_mode=None"),
        (dict(real_kv_hash_mode=1.0), ValueError, r"real_kv_hash_mode=1.0"),
        (dict(real_kv_hash_mode=True), ValueError, r"real_kv_hash_mode=True"),
        (dict(real_kv_hash_mode="everything"), ValueError, r"real_kv_hash_mode='everything'"),
        (dict(real_kv_hash_mode=-1), ValueError, r"real_kv_hash_mode=-1"),
        (dict(sweep_interval=-1), ValueError, r"sweep_interval must be an int >= 0; got sweep_interval=-1"),
        (dict(sweep_interval=True), ValueError, r"sweep_interval=True"),
        (dict(enable_write_input_assert="yes"), TypeError, r"enable_write_input_assert must be a bool; got .*='yes'"),
        (dict(enable_verify_token_assert=0), TypeError, r"enable_verify_token_assert must be a bool; got .*=0"),
        (dict(stats_every_n_steps=1.5), ValueError, r"stats_every_n_steps must be an int >= 0; got .*=1.5"),
        (dict(health_check_every_n_steps=-2), ValueError, r"health_check_every_n_steps=-2"),
        (dict(check_lag_steps=None), ValueError, r"check_lag_steps=None"),
        (dict(backend=None), ValueError, r"backend must be one of .*; got backend=None"),
        (dict(backend="XLA"), ValueError, r"got backend='XLA'"),
    ],
)
def test_canary_config_names_every_bad_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        kc.CanaryConfig(**kwargs)


def test_canary_config_takes_numpy_integers_as_python_ints():
    np_config = kc.CanaryConfig(
        ring_capacity=np.int64(8),
        real_kv_hash_mode=np.int32(1),
        sweep_interval=np.int32(2),
        stats_every_n_steps=np.uint8(0),
        health_check_every_n_steps=np.int64(5),
        check_lag_steps=np.int16(1),
    )
    config = kc.CanaryConfig(
        ring_capacity=8,
        real_kv_hash_mode="partial",
        sweep_interval=2,
        stats_every_n_steps=0,
        health_check_every_n_steps=5,
        check_lag_steps=1,
    )
    assert np_config == config and hash(np_config) == hash(config)  # one jit cache entry for both spellings
    assert type(np_config.ring_capacity) is int and np_config.real_kv_hash_mode is kc.RealKvHashMode.PARTIAL
    assert kc.CanaryDeviceState.allocate(config=np_config).violation_log.ring_capacity == 8


# ------------------------------------------------------------------------------------------ state and buffer allocation


@pytest.mark.parametrize("value", [np.int64(4), np.int32(4), np.uint16(4)])
def test_allocation_takes_numpy_integers(value):
    assert kc.ViolationLog.allocate(ring_capacity=value).ring_capacity == 4
    assert kc.allocate_canary_buffer(value).shape == (4, 4, 2)
    assert kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(), num_tags=value).num_tags == 4
    config = kc.CanaryConfig(enable_verify_token_assert=True)
    state = kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=value, max_context_len=value)
    assert state.req_to_verify_expected_tokens.shape == (4, 4)


@pytest.mark.parametrize("value", [True, 0, -3, 2.0, "4", None])
def test_allocation_refuses_non_positive_or_non_integer_sizes(value):
    with pytest.raises(ValueError, match=rf"num_slots must be a positive int; got num_slots={value!r}"):
        kc.allocate_canary_buffer(value)
    with pytest.raises(ValueError, match=rf"num_tags must be a positive int; got num_tags={value!r}"):
        kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(), num_tags=value)
    config = kc.CanaryConfig(enable_verify_token_assert=True)
    with pytest.raises(ValueError, match=rf"positive max_context_len .*got max_context_len={value!r}"):
        kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=4, max_context_len=value)


def test_state_allocation_needs_a_config():
    with pytest.raises(TypeError, match=r"config must be a CanaryConfig; got KvCanary"):
        kc.CanaryDeviceState.allocate(config=kc.KvCanary(kc.CanaryConfig(), kc.CanaryPool(num_slots=8)))
    with pytest.raises(TypeError, match=r"config must be a CanaryConfig; got str"):
        kc.CanaryDeviceState.allocate(config="raise")


# ---------------------------------------------------------------------------------------------------- host readers


@pytest.mark.parametrize(
    ("buf", "error", "pattern"),
    [
        (np.zeros((8, 8), np.uint32), ValueError,
         r"canary_buf must have shape \(\.\.\., num_slots, 4, 2\): \(lo, hi\) pairs; got canary_buf.shape=\(8, 8\)"),
        (np.zeros((8,), np.uint32), ValueError, r"canary_buf.shape=\(8,\)"),
        (np.zeros((8, 2, 4), np.uint32), ValueError, r"canary_buf.shape=\(8, 2, 4\)"),  # the (lo, hi) axis not last
        (np.zeros((8, 4, 2), np.int32), TypeError, r"canary_buf must have dtype uint32; got canary_buf.dtype=int32"),
        (np.zeros((8, 4, 2), np.float32), TypeError, r"canary_buf.dtype=float32"),
        (np.zeros((8, 4), np.int64), TypeError, r"canary_buf.dtype=int64"),  # already the int64 view
        ([[1, 2]], TypeError, r"canary_buf must be an array; got list"),
    ],
)  # fmt: skip
def test_records_as_int64_refuses_what_is_not_a_canary_buffer(buf, error, pattern):
    with pytest.raises(error, match=pattern):
        kc.records_as_int64(buf)


def test_records_as_int64_reads_numpy_and_jax_buffers_alike():
    buf = jnp.asarray(np.arange(4 * 4 * 2, dtype=np.uint32).reshape(4, 4, 2))
    np.testing.assert_array_equal(kc.records_as_int64(np.asarray(buf)), kc.records_as_int64(buf))
    assert kc.records_as_int64(buf)[1, 0] == 8 + (9 << 32)
    per_device = kc.records_as_int64(np.stack([np.asarray(buf)] * 2))  # leading mesh axes stay
    assert per_device.shape == (2, 4, 4) and (per_device[1] == kc.records_as_int64(buf)).all()


def _log(**fields):
    log = kc.ViolationLog.allocate(ring_capacity=4)
    return dataclasses.replace(log, **fields)


@pytest.mark.parametrize(
    ("log", "error", "pattern"),
    [
        (_log(violation_ring=jnp.zeros((1,), jnp.int32), violation_write_index=jnp.zeros((4, 8, 2), jnp.uint32)),
         TypeError, r"violation_ring must have dtype uint32; got violation_ring.dtype=int32"),
        (_log(violation_ring=jnp.zeros((4, 8, 2), jnp.int32)), TypeError, r"violation_ring.dtype=int32"),
        (_log(violation_ring=jnp.zeros((4, 16), jnp.uint32)), ValueError,
         r"violation_ring must have shape \(\*, 8, 2\); got violation_ring.shape=\(4, 16\)"),
        (_log(violation_write_index=jnp.int32(0)), ValueError,
         r"violation_write_index must have shape \(1,\); got violation_write_index.shape=\(\)"),
        (_log(violation_write_index=jnp.zeros((1,), jnp.float32)), TypeError, r"violation_write_index.dtype=float32"),
        (_log(violation_context=jnp.zeros((4, 2), jnp.int32)), ValueError,
         r"violation_context must have shape \(4, 3\); got violation_context.shape=\(4, 2\)"),
    ],
)  # fmt: skip
def test_read_violations_refuses_a_malformed_log(log, error, pattern):
    with pytest.raises(error, match=pattern):
        kc.read_violations(log)


def test_read_violations_reads_a_numpy_log():
    state = new_state()
    state = kc.canary_verify(state, new_buf(), verify_plan([1], [5], [-1]), tag=TAG_TAIL, backend="xla")
    host_log = jax.tree.map(np.asarray, state.violation_log)
    assert kc.read_violations(host_log).violations == kc.read_violations(state.violation_log).violations
    expect_violation(host_log, tag="TAIL_K_FULL", reason=kc.FailReason.VERIFY_POSITION_MISMATCH, slot=1)


def test_format_violation_needs_a_violation():
    report = kc.read_violations(kc.ViolationLog.allocate(ring_capacity=2))
    with pytest.raises(TypeError, match=r"violation must be a Violation \(from read_violations\); got NoneType"):
        kc.format_violation(report.first_violation, total=0, overflowed=False)
    with pytest.raises(TypeError, match=r"got ViolationReport"):
        kc.format_violation(report, total=0, overflowed=False)


# ------------------------------------------------------------------------------------------------------- build_plans


def _plans(rpi=(1, 2), prefix=(1, 0), extend=(1, 1), table=None, **kwargs):
    table = np.arange(8 * 4, dtype=np.int32).reshape(8, 4) if table is None else table
    options = dict(verify_capacity=VCAP, write_req_capacity=WCAP)
    options.update(kwargs)
    return kc.build_plans(*(np.asarray(x, np.int32) for x in (rpi, prefix, extend)), jnp.asarray(table), **options)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(table=np.zeros((8, 0), np.int32)), ValueError,
         r"req_to_token needs at least one row and one column; got req_to_token.shape=\(8, 0\)"),
        (dict(table=np.zeros((0, 4), np.int32)), ValueError, r"req_to_token.shape=\(0, 4\)"),
        (dict(swa_window_size=2, full_to_swa_index_mapping=jnp.zeros((0,), jnp.int32)), ValueError,
         r"full_to_swa_index_mapping needs at least one entry; got full_to_swa_index_mapping.shape=\(0,\)"),
        (dict(req_to_verify_expected_tokens=jnp.zeros((8, 0), jnp.int32), expected_tokens_valid_lens=i32([1, 1])),
         ValueError, r"req_to_verify_expected_tokens needs at least one row and one column; got .*shape=\(8, 0\)"),
        (dict(verify_capacity=16.0), ValueError, r"verify_capacity must be a positive static int; got .*=16.0"),
        (dict(write_req_capacity=True), ValueError, r"write_req_capacity=True"),
        (dict(swa_window_size=2.0), TypeError, r"swa_window_size must be a static Python int; got .*=2.0"),
        (dict(kv_token_id_vs_position_offset="1"), TypeError, r"kv_token_id_vs_position_offset='1'"),
        (dict(full_to_swa_index_mapping=[0, 1, 2], swa_window_size=2), TypeError,
         r"full_to_swa_index_mapping must be an array; got list"),
        (dict(rpi=[[1, 2]]), ValueError, r"req_pool_indices must have 1 dimension\(s\); got .*shape=\(1, 2\)"),
        (dict(table=np.zeros((8, 4), np.uint32)), TypeError, r"req_to_token must have dtype int32; got .*uint32"),
    ],
)  # fmt: skip
def test_build_plans_names_every_bad_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        _plans(**kwargs)


def test_build_plans_refuses_int64_host_arrays_by_name():
    with pytest.raises(TypeError, match=r"prefix_lens must have dtype int32; got prefix_lens.dtype=int64"):
        kc.build_plans(
            np.array([1], np.int32), np.array([1]), np.array([1], np.int32), jnp.zeros((2, 4), jnp.int32),
            verify_capacity=VCAP, write_req_capacity=WCAP,
        )  # fmt: skip


def test_build_plans_takes_numpy_arrays_and_integers():
    table = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    want = _plans()
    got = kc.build_plans(
        np.array([1, 2], np.int32), np.array([1, 0], np.int32), np.array([1, 1], np.int32), table,
        verify_capacity=np.int64(VCAP), write_req_capacity=np.int32(WCAP), swa_window_size=np.int8(0),
        kv_token_id_vs_position_offset=np.int64(0),
    )  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert int(got[0].slot_indices[0]) == 4 and int(got[1].seed_slot_indices[0]) == 4  # row 1, position 0


# ------------------------------------------------------------------------------------- canary_verify / canary_write


def _verify(**kwargs):
    args = dict(state=new_state(), canary_buf=new_buf(), plan=verify_plan([1], [0], [-1]))
    args.update((k, kwargs.pop(k)) for k in list(kwargs) if k in args)
    kwargs = dict(dict(tag=TAG_TAIL, backend="xla"), **kwargs)
    return kc.canary_verify(args["state"], args["canary_buf"], args["plan"], **kwargs)


def _write(**kwargs):
    plan, ids, pos, loc = write_batch([(-1, [(1, 5, 0), (2, 6, 1)])])
    args = dict(state=new_state(), canary_buf=new_buf(), plan=plan, input_ids=ids, positions=pos, out_cache_loc=loc)
    args.update((k, kwargs.pop(k)) for k in list(kwargs) if k in args)
    kwargs = dict(dict(tag=TAG_HEAD, backend="xla"), **kwargs)
    return kc.canary_write(*args.values(), **kwargs)


_SOURCE = kc.RealKvSource(jnp.zeros((NUM_SLOTS, 16), jnp.uint8))


@pytest.mark.parametrize("op", [_verify, _write], ids=["verify", "write"])
@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(state=None), TypeError, r"state must be a CanaryDeviceState; got NoneType"),
        (dict(state=kc.KvCanary(kc.CanaryConfig(), kc.CanaryPool(num_slots=8)).init_state()), TypeError,
         r"state must be a CanaryDeviceState; got CanaryState"),
        (dict(canary_buf=[[0]]), TypeError, r"canary_buf must be an array; got list"),
        (dict(canary_buf=np.zeros((NUM_SLOTS, 2, 4), np.uint32)), ValueError,  # the (lo, hi) axis not last
         r"canary_buf must have shape \(\*, 4, 2\); got canary_buf.shape=\(64, 2, 4\)"),
        (dict(canary_buf=np.zeros((0, 4, 2), np.uint32)), ValueError, r"canary_buf needs at least one slot"),
        (dict(plan=None), TypeError, r"plan must be a (Verify|Write)Plan; got NoneType"),
        (dict(tag=kc.CanaryLaunchTag.HEAD_K_FULL.name.lower()), TypeError, r"tag must be a static Python int"),
        (dict(tag=np.int64(12)), ValueError, r"tag must be in \[0, 12\); got tag=12"),
        (dict(real_kv_sources=None, real_kv_hash_mode="partial"), TypeError,
         r"real_kv_sources must be a tuple of RealKvSource; got NoneType"),
        (dict(real_kv_sources=_SOURCE, real_kv_hash_mode="all"), TypeError,
         r"real_kv_sources must be a tuple of RealKvSource; got RealKvSource"),
        (dict(real_kv_sources={"k": _SOURCE}, real_kv_hash_mode="all"), TypeError, r"got dict"),
        (dict(real_kv_sources=(_SOURCE.data,), real_kv_hash_mode="all"), TypeError,
         r"real_kv_sources\[0\] must be a RealKvSource; got ArrayImpl"),
        (dict(real_kv_hash_mode="partial"), ValueError, r"real_kv_hash_mode=PARTIAL .* real_kv_sources is empty"),
        (dict(real_kv_hash_mode=3), ValueError, r"real_kv_hash_mode must be one of .*got real_kv_hash_mode=3"),
        (dict(backend=None), ValueError, r"backend must be one of .*got backend=None"),
    ],
)  # fmt: skip
def test_ops_name_every_bad_argument(op, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        op(**kwargs)


def test_write_names_its_token_arrays():
    with pytest.raises(TypeError, match=r"out_cache_loc must have dtype int32; got out_cache_loc.dtype=uint32"):
        _write(out_cache_loc=jnp.zeros((24,), jnp.uint32))
    with pytest.raises(ValueError, match=r"out_cache_loc must have 1 dimension\(s\); got out_cache_loc.shape=\(\)"):
        _write(out_cache_loc=jnp.int32(3))
    with pytest.raises(TypeError, match=r"input_ids must be an array; got list"):
        _write(input_ids=[5, 6])


def test_a_source_that_covers_too_few_slots_is_named():
    short = kc.RealKvSource(jnp.zeros((NUM_SLOTS // 4, 4, 16), jnp.uint8), page_size=2)
    with pytest.raises(ValueError, match=rf"real_kv_sources\[1\] holds 32 token slots .* num_slots={NUM_SLOTS}"):
        _verify(real_kv_sources=(_SOURCE, short), real_kv_hash_mode="partial")


def test_ops_take_numpy_buffers_plans_and_integers():
    """The host-side spellings give the same state and buffer as the jax ones."""
    plan = verify_plan([1], [3], [-1])
    want = _verify(plan=plan)
    got = _verify(
        plan=jax.tree.map(np.asarray, plan), canary_buf=np.zeros((NUM_SLOTS, 4, 2), np.uint32),
        tag=np.int64(int(TAG_TAIL)), real_kv_hash_mode=np.int32(0),
    )  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert expect_violation(got, tag="TAIL_K_FULL", reason=kc.FailReason.VERIFY_POSITION_MISMATCH, slot=1)

    plan, ids, pos, loc = write_batch([(-1, [(1, 5, 0), (2, 6, 1)])])
    want_buf, want_state = _write()
    host = lambda x: np.asarray(x)  # noqa: E731
    got_buf, got_state = _write(
        plan=jax.tree.map(host, plan), input_ids=host(ids), positions=host(pos), out_cache_loc=host(loc),
        canary_buf=host(new_buf()), tag=np.int32(int(TAG_HEAD)),
    )  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, (got_buf, got_state), (want_buf, want_state))
    assert kc.records_as_int64(got_buf)[1:3, :2].tolist() == [[5, 0], [6, 1]]


def test_real_kv_hash_mode_takes_numpy_integers():
    got = _verify(real_kv_sources=(_SOURCE,), real_kv_hash_mode=np.int64(1))
    want = _verify(real_kv_sources=(_SOURCE,), real_kv_hash_mode="partial")
    jax.tree.map(np.testing.assert_array_equal, got, want)


# ------------------------------------------------------------------------------------------------------- RealKvSource


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "pattern"),
    [
        ((jnp.zeros((8, 4, 16), jnp.uint8),), dict(page_size=None), TypeError,
         r"RealKvSource.page_size must be an int; got page_size=None"),
        ((jnp.zeros((8, 4, 16), jnp.uint8),), dict(page_size=True), TypeError, r"page_size=True"),
        ((jnp.zeros((8, 4, 16), jnp.uint8),), dict(page_size=4.0), TypeError, r"page_size=4.0"),
        ((jnp.zeros((8, 4, 16), jnp.uint8),), dict(page_size=4, read_bytes="16"), TypeError,
         r"RealKvSource.read_bytes must be an int; got read_bytes='16'"),
        ((jnp.zeros((8, 4, 16), jnp.uint8),), dict(page_size=4, read_bytes=-16), ValueError, r"read_bytes=-16"),
        ((jnp.zeros((8, 4, 4), jnp.complex64),), {}, TypeError, r"RealKvSource.data must have .*got dtype complex64"),
        ((jnp.zeros((8, 32), jnp.int4),), {}, TypeError, r"got dtype int4"),
        ((jnp.zeros((), jnp.float32),), {}, ValueError, r"RealKvSource.data needs a leading page axis; got shape \(\)"),
        ((None,), {}, TypeError, r"RealKvSource.data must be an array; got NoneType"),
        # Paged by 4 but declared paged by 8: 16 bytes per page row would leave 8 bytes per token.
        ((jnp.zeros((8, 4, 4), jnp.float32),), dict(page_size=8), ValueError,
         r"num_bytes_per_token must be a positive multiple of 16; got 8"),
    ],
)  # fmt: skip
def test_real_kv_source_names_every_bad_argument(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        kc.RealKvSource(*args, **kwargs)


def test_real_kv_source_takes_numpy_data_and_integers():
    src = kc.RealKvSource(np.zeros((8, 4, 16), np.uint8), page_size=np.int64(4), read_bytes=np.int32(16))
    assert isinstance(src.data, jax.Array) and (src.page_size, src.num_bytes_per_token, src.read_bytes) == (4, 16, 16)
    assert type(src.page_size) is int and src.num_token_slots == 32
    fp8 = kc.RealKvSource(jnp.zeros((8, 4, 16), jnp.float8_e4m3fn), page_size=4)
    assert fp8.num_bytes_per_token == 16

    @functools.partial(jax.jit, static_argnames="page_size")
    def slots(data, page_size):  # a traced array is a valid source inside a step
        return jnp.int32(kc.RealKvSource(data, page_size=page_size).num_token_slots)

    assert int(slots(jnp.zeros((8, 4, 16), jnp.uint8), page_size=4)) == 32
