"""Every bad input fails at trace time with a TypeError/ValueError that names the argument and the value received."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from tests.core.canary_testlib import (
    NUM_SLOTS,
    NUM_TOKENS,
    POOL_CTX,
    POOL_ROWS,
    TAG_HEAD,
    TAG_TAIL,
    VCAP,
    WCAP,
    i32,
    jit_verify,
    new_buf,
    new_state,
    verify_plan,
    write_batch,
)


def _source(**kwargs):
    data = jnp.zeros((NUM_SLOTS, 32), jnp.uint8)
    return kc.RealKvSource(data, **kwargs)


def _verify(state=None, buf=None, plan=None, **kwargs):
    kwargs.setdefault("tag", TAG_TAIL)
    kwargs.setdefault("backend", "xla")
    return kc.canary_verify(
        new_state() if state is None else state, new_buf() if buf is None else buf,
        verify_plan([1], [0], [-1]) if plan is None else plan, **kwargs,
    )  # fmt: skip


def _write(state=None, buf=None, plan=None, tokens=None, **kwargs):
    kwargs.setdefault("tag", TAG_HEAD)
    kwargs.setdefault("backend", "xla")
    default_plan, ids, pos, loc = write_batch([(-1, [(1, 5, 0)])])
    ids, pos, loc = (ids, pos, loc) if tokens is None else tokens
    return kc.canary_write(
        new_state() if state is None else state, new_buf() if buf is None else buf,
        default_plan if plan is None else plan, ids, pos, loc, **kwargs,
    )  # fmt: skip


def test_more_than_four_sources():
    sources = (_source(),) * 5
    with pytest.raises(ValueError, match=r"real_kv_sources holds at most 4 sources; got 5"):
        _verify(real_kv_sources=sources, real_kv_hash_mode="all")
    with pytest.raises(ValueError, match=r"real_kv_sources holds at most 4 sources; got 5"):
        _write(real_kv_sources=sources, real_kv_hash_mode="all")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(read_bytes=24), r"read_bytes must be a positive multiple of 16.*read_bytes=24"),
        (dict(read_bytes=0), r"read_bytes=0"),
        (dict(read_bytes=48), r"read_bytes=48, num_bytes_per_token=32"),
        (dict(num_bytes_per_token=24), r"num_bytes_per_token must be a positive multiple of 16; got 24"),
        (dict(page_size=0), r"page_size must be an int >= 1; got page_size=0"),
        (dict(page_size=2), r"page_size \* num_bytes_per_token = 64 exceeds the page row of 32 bytes"),
    ],
)
def test_bad_real_kv_source_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _source(**dict(dict(num_bytes_per_token=32), **kwargs))


def test_bad_real_kv_source_data():
    with pytest.raises(TypeError, match=r"RealKvSource.data must be an array; got list"):
        kc.RealKvSource([1, 2, 3])
    with pytest.raises(
        TypeError, match=r"RealKvSource.data must have a 1/2/4/8-byte integer or float dtype .*; got dtype bool"
    ):
        kc.RealKvSource(jnp.zeros((4, 16), bool))
    with pytest.raises(ValueError, match=r"multiple of 16 bytes; got 24 bytes"):
        kc.RealKvSource(jnp.zeros((4, 12), jnp.bfloat16))
    small = kc.RealKvSource(jnp.zeros((NUM_SLOTS // 2, 16), jnp.uint8))
    with pytest.raises(ValueError, match=rf"real_kv_sources\[0\] holds 32 token slots .* num_slots={NUM_SLOTS}"):
        _verify(real_kv_sources=(small,), real_kv_hash_mode="partial")
    with pytest.raises(TypeError, match=r"real_kv_sources\[1\] must be a RealKvSource; got ArrayImpl"):
        _write(real_kv_sources=(_source(), jnp.zeros((NUM_SLOTS, 16))), real_kv_hash_mode="partial")
    with pytest.raises(TypeError, match=r"real_kv_sources must be a tuple of RealKvSource; got RealKvSource"):
        _verify(real_kv_sources=_source())
    with pytest.raises(ValueError, match=r"real_kv_hash_mode must be one of .*got real_kv_hash_mode='most'"):
        _verify(real_kv_sources=(_source(),), real_kv_hash_mode="most")


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_ring_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match=rf"ring_capacity.*ring_capacity={capacity!r}"):
        kc.ViolationLog.allocate(ring_capacity=capacity)
    with pytest.raises(ValueError, match=rf"ring_capacity.*ring_capacity={capacity!r}"):
        kc.CanaryConfig(ring_capacity=capacity)


def _bad_verify_plans():
    good = verify_plan([1], [0], [-1])
    yield (
        "float",
        dataclasses.replace(good, slot_indices=good.slot_indices.astype(jnp.float32)),
        TypeError,
        (r"slot_indices must have dtype int32; got slot_indices.dtype=float32"),
    )
    yield (
        "uint32",
        dataclasses.replace(good, prev_slot_indices=good.prev_slot_indices.astype(jnp.uint32)),
        TypeError,
        (r"prev_slot_indices must have dtype int32; got prev_slot_indices.dtype=uint32"),
    )
    yield (
        "2d",
        dataclasses.replace(good, expected_positions=good.expected_positions.reshape(2, -1)),
        ValueError,
        (r"expected_positions must have 1 dimension\(s\); got expected_positions.shape=\(2, 16\)"),
    )
    yield (
        "length",
        dataclasses.replace(good, expected_tokens=good.expected_tokens[:5]),
        ValueError,
        (r"same length: .*'expected_tokens': 5"),
    )
    yield (
        "num_valid",
        dataclasses.replace(good, num_valid=i32([1, 1])),
        ValueError,
        (r"plan.num_valid must have shape \(1,\); got plan.num_valid.shape=\(2,\)"),
    )
    yield (
        "enable",
        dataclasses.replace(good, enable=jnp.ones((1,), bool)),
        TypeError,
        (r"plan.enable must have dtype int32; got plan.enable.dtype=bool"),
    )
    yield "list", dataclasses.replace(good, slot_indices=[1, 2]), TypeError, r"slot_indices must be an array"
    yield "type", write_batch([])[0], TypeError, r"plan must be a VerifyPlan; got WritePlan"


@pytest.mark.parametrize(("plan", "error", "pattern"), [p[1:] for p in _bad_verify_plans()],
                         ids=[p[0] for p in _bad_verify_plans()])  # fmt: skip
def test_bad_verify_plan(plan, error, pattern):
    with pytest.raises(error, match=pattern):
        _verify(plan=plan)


def _bad_write_inputs():
    plan, ids, pos, loc = write_batch([(-1, [(1, 5, 0)])])
    yield "offsets-len", (dataclasses.replace(plan, write_offsets=plan.write_offsets[:3]), (ids, pos, loc)), (
        ValueError, rf"write_offsets must have shape \({WCAP + 1},\); got write_offsets.shape=\(3,\)"
    )  # fmt: skip
    yield (
        "seed-dtype",
        (dataclasses.replace(plan, seed_slot_indices=plan.seed_slot_indices.astype(jnp.uint32)), (ids, pos, loc)),
        (TypeError, r"seed_slot_indices must have dtype int32.*uint32"),
    )
    yield "num-valid", (dataclasses.replace(plan, num_valid_reqs=i32(1)), (ids, pos, loc)), (
        ValueError, r"num_valid_reqs must have shape \(1,\); got num_valid_reqs.shape=\(\)"
    )  # fmt: skip
    yield "ids-dtype", (plan, (ids.astype(jnp.float32), pos, loc)), (
        TypeError, r"input_ids must have dtype int32; got input_ids.dtype=float32"
    )  # fmt: skip
    yield "pos-2d", (plan, (ids, pos.reshape(2, -1), loc)), (
        ValueError, rf"positions must have 1 dimension\(s\); got positions.shape=\(2, {NUM_TOKENS // 2}\)"
    )  # fmt: skip
    yield "loc-len", (plan, (ids, pos, loc[:-1])), (ValueError, rf"'out_cache_loc': {NUM_TOKENS - 1}")
    yield "type", (verify_plan([], [], []), (ids, pos, loc)), (TypeError, r"plan must be a WritePlan; got VerifyPlan")


@pytest.mark.parametrize(("args", "expect"), [c[1:] for c in _bad_write_inputs()],
                         ids=[c[0] for c in _bad_write_inputs()])  # fmt: skip
def test_bad_write_inputs(args, expect):
    plan, tokens = args
    error, pattern = expect
    with pytest.raises(error, match=pattern):
        _write(plan=plan, tokens=tokens)


def test_input_assert_needs_both_arrays_of_the_right_kind():
    _, ids, pos, _ = write_batch([])
    with pytest.raises(ValueError, match=r"turn on the input assert together; got only expected_input_tokens"):
        _write(expected_input_tokens=ids)
    with pytest.raises(ValueError, match=r"got only expected_input_positions"):
        _write(expected_input_positions=pos)
    with pytest.raises(TypeError, match=r"expected_input_positions must have dtype int32.*float32"):
        _write(expected_input_tokens=ids, expected_input_positions=pos.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"'expected_input_tokens': 3"):
        _write(expected_input_tokens=ids[:3], expected_input_positions=pos)


def test_token_check_needs_the_expected_token_pool():
    state = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig())
    assert state.req_to_verify_expected_tokens is None
    with pytest.raises(ValueError, match=r"check_expected_token=True needs the expected-token pool.*None"):
        _verify(state=state, check_expected_token=True)
    with pytest.raises(TypeError, match=r"check_expected_token must be a static bool; got 1"):
        _verify(check_expected_token=1)
    with pytest.raises(ValueError, match=r"positive req_to_token_alloc_size .*got req_to_token_alloc_size=None"):
        kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(enable_verify_token_assert=True), max_context_len=8)
    with pytest.raises(ValueError, match=r"positive max_context_len .*got max_context_len=0"):
        kc.CanaryDeviceState.allocate(
            config=kc.CanaryConfig(enable_verify_token_assert=True), req_to_token_alloc_size=4, max_context_len=0
        )


@pytest.mark.parametrize(
    ("tag", "error", "pattern"),
    [
        (12, ValueError, r"tag must be in \[0, 12\); got tag=12"),
        (-1, ValueError, r"tag must be in \[0, 12\); got tag=-1"),
        ("HEAD_K_FULL", TypeError, r"tag must be a static Python int; got tag='HEAD_K_FULL'"),
        (1.0, TypeError, r"tag must be a static Python int; got tag=1.0"),
        (True, TypeError, r"tag must be a static Python int; got tag=True"),
    ],
)
def test_bad_tag(tag, error, pattern):
    with pytest.raises(error, match=pattern):
        _verify(tag=tag)
    with pytest.raises(error, match=pattern):
        _write(tag=tag)


def test_bad_backend():
    with pytest.raises(ValueError, match=r"backend must be one of .*got backend='cuda'"):
        _verify(backend="cuda")
    with pytest.raises(ValueError, match=r"backend must be one of .*got backend='triton'"):
        _write(backend="triton")
    if jax.default_backend() == "cpu":  # an explicit backend never falls back silently
        with pytest.raises(NotImplementedError, match=r"backend='pallas'.*needs a GPU"):
            _verify(backend="pallas")


def test_bad_canary_buffer_and_state():
    with pytest.raises(TypeError, match=r"canary_buf must have dtype uint32; got canary_buf.dtype=int32"):
        _verify(buf=jnp.zeros((NUM_SLOTS, 4, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"canary_buf must have shape \(\*, 4, 2\); got canary_buf.shape=\(64, 8\)"):
        _write(buf=jnp.zeros((NUM_SLOTS, 8), jnp.uint32))
    with pytest.raises(TypeError, match=r"state must be a CanaryDeviceState; got ViolationLog"):
        _verify(state=new_state().violation_log)
    with pytest.raises(ValueError, match=r"num_slots must be a positive int; got num_slots=0"):
        kc.allocate_canary_buffer(0)
    with pytest.raises(TypeError, match=r"config must be a CanaryConfig; got dict"):
        kc.CanaryDeviceState.allocate(config={})


def test_errors_are_raised_at_trace_time_under_jit():
    with pytest.raises(ValueError, match=r"tag must be in \[0, 12\); got tag=13"):
        jit_verify(new_state(), new_buf(), verify_plan([1], [0], [-1]), tag=13, check_expected_token=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(mode="bogus"), ValueError, r"mode must be one of \['off', 'log', 'raise'\]; got mode='bogus'"),
        (dict(mode=3), ValueError, r"got mode=3"),
        (dict(ring_capacity=0), ValueError, r"ring_capacity must be an int >= 1; got ring_capacity=0"),
        (dict(mode="off", sweep_interval=5), ValueError, r"sweep_interval=5 requires mode 'log' or 'raise'"),
        (dict(backend="tpu"), ValueError, r"backend must be one of .*got backend='tpu'"),
        (dict(real_kv_hash_mode=7), ValueError, r"got real_kv_hash_mode=7"),
        (dict(check_lag_steps=-1), ValueError, r"check_lag_steps must be an int >= 0; got check_lag_steps=-1"),
        (dict(enable_write_input_assert=1), TypeError, r"enable_write_input_assert must be a bool; got .*=1"),
    ],
)
def test_canary_config_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        kc.CanaryConfig(**kwargs)


def test_canary_config_accepts_sglang_spellings():
    config = kc.CanaryConfig(mode="none", real_kv_hash_mode="Partial", sweep_interval=0)
    assert config.mode is kc.CanaryMode.OFF and not config.enabled
    assert config.real_kv_hash_mode is kc.RealKvHashMode.PARTIAL
    assert kc.CanaryConfig(mode="LOG", sweep_interval=3).enabled
    assert hash(kc.CanaryConfig()) == hash(kc.CanaryConfig())  # frozen and hashable: usable as a static argument


def _table():
    return jnp.zeros((POOL_ROWS, POOL_CTX), jnp.int32)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "pattern"),
    [
        ((5,), {}, ValueError, rf"batch size 5 exceeds write_req_capacity={WCAP}"),
        ((2,), dict(verify_capacity=0), ValueError, r"verify_capacity must be a positive static int; got .*=0"),
        ((2,), dict(write_req_capacity=-2), ValueError, r"write_req_capacity=-2"),
        ((2,), dict(swa_window_size=4), ValueError, r"swa_window_size=4 needs full_to_swa_index_mapping"),
        ((2,), dict(full_to_swa_index_mapping=jnp.zeros(9, jnp.uint32)), TypeError,
         r"full_to_swa_index_mapping must have dtype int32.*uint32"),
        ((2,), dict(req_to_verify_expected_tokens=_table()), ValueError,
         r"req_to_verify_expected_tokens and expected_tokens_valid_lens go together"),
        ((2,), dict(req_to_verify_expected_tokens=_table(), expected_tokens_valid_lens=i32([1, 2, 3])), ValueError,
         r"expected_tokens_valid_lens must have shape \(2,\); got expected_tokens_valid_lens.shape=\(3,\)"),
        ((0,), {}, ValueError, r"at least one row"),
    ],
)  # fmt: skip
def test_build_plans_errors(args, kwargs, error, pattern):
    (bs,) = args
    options = dict(verify_capacity=VCAP, write_req_capacity=WCAP)
    options.update(kwargs)
    with pytest.raises(error, match=pattern):
        kc.build_plans(i32([1] * bs), i32([0] * bs), i32([1] * bs), _table(), **options)


def test_build_plans_array_errors():
    ok = i32([1, 2])
    with pytest.raises(TypeError, match=r"prefix_lens must have dtype int32; got prefix_lens.dtype=float32"):
        kc.build_plans(ok, ok.astype(jnp.float32), ok, _table(), verify_capacity=VCAP, write_req_capacity=WCAP)
    with pytest.raises(ValueError, match=r"req_to_token must have 2 dimension\(s\); got req_to_token.shape=\(8,\)"):
        kc.build_plans(ok, ok, ok, _table()[0, :8], verify_capacity=VCAP, write_req_capacity=WCAP)
    with pytest.raises(ValueError, match=r"same length: .*'extend_lens': 3"):
        kc.build_plans(ok, ok, i32([1, 2, 3]), _table(), verify_capacity=VCAP, write_req_capacity=WCAP)


def test_int64_inputs_are_rejected_under_x64():
    with jax.enable_x64(True):
        plan = verify_plan([1], [0], [-1])
        plan = dataclasses.replace(plan, slot_indices=jnp.asarray(np.asarray(plan.slot_indices), jnp.int64))
        with pytest.raises(TypeError, match=r"slot_indices must have dtype int32; got .*dtype=int64"):
            kc.canary_verify(new_state(), new_buf(), plan, tag=TAG_TAIL, backend="xla")
