"""The fused verify kernel (interpret mode) gives exactly the xla path's fail bits, and whole canary states."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from pallas_kernels import realkv
from pallas_kernels.verify import api, pallas_triton
from tests.pallas_kernels import kernel_cases as cases

NUM_SLOTS = 160

SOURCES = {
    "none": (),
    "bf16_p4": (cases.SourceSpec("bfloat16", 4, 64, 48, row_padding=16),),
    "fp8_p1+u8_p16": (cases.SourceSpec("float8_e4m3fn", 1, 32, 32), cases.SourceSpec("uint8", 16, 16, 16)),
    "4_sources": (
        cases.SourceSpec("float32", 16, 32, 32),
        cases.SourceSpec("int8", 1, 48, 32, row_padding=16),
        cases.SourceSpec("bfloat16", 1, 32, 32),
        cases.SourceSpec("float8_e4m3fn", 4, 16, 16),
    ),
}


@functools.partial(jax.jit, static_argnames=("mode", "check", "backend", "config"))
def _bits(buf, plan, num_active, sources, *, mode, check, backend, config=None):
    if config is not None:
        return pallas_triton.verify_bits(
            buf,
            *plan,
            num_active,
            real_kv_sources=sources,
            real_kv_hash_mode=mode,
            check_expected_token=check,
            interpret=True,
            config=config,
        )
    return api.verify(
        buf,
        *plan,
        num_active,
        real_kv_sources=sources,
        real_kv_hash_mode=mode,
        check_expected_token=check,
        backend=backend,
    )


def _case(seed, specs, mode, *, num_reqs=6, max_len=20):
    rng = np.random.default_rng(seed)
    sources = cases.make_sources(rng, NUM_SLOTS, specs)
    return cases.verify_inputs(rng, num_slots=NUM_SLOTS, num_reqs=num_reqs, max_len=max_len, sources=sources, mode=mode)


def _assert_same(buf, plan, num_active, sources, *, mode, check, config=None):
    want = _bits(buf, plan, num_active, sources, mode=mode, check=check, backend="xla")
    got = _bits(buf, plan, num_active, sources, mode=mode, check=check, backend="interpret", config=config)
    chex.assert_trees_all_equal(got, want)
    return np.asarray(want)


@pytest.mark.parametrize(
    "sources,mode,check",
    [("none", 0, False), ("bf16_p4", 1, True), ("fp8_p1+u8_p16", 2, True), ("4_sources", 2, False)],
)
def test_interpret_matches_xla(sources, mode, check):
    buf, kv, plan, n = _case(1, SOURCES[sources], mode)
    bits = _assert_same(buf, plan, n, kv, mode=mode, check=check)
    seen = functools.reduce(np.bitwise_or, bits)
    assert seen & 1 and seen & 2 and seen & 4, f"the case should exercise every bit; saw {seen:#x}"
    assert bool(seen & 32) == check


def test_num_active_edges_share_one_compile():
    """0, 1, a ragged middle, exactly capacity and past it; blocks wholly past num_active store zeros."""
    buf, kv, plan, _ = _case(2, SOURCES["bf16_p4"], 2)
    capacity = plan[0].shape[0]
    config = pallas_triton.Config(block=16, num_warps=1)  # several programs, a ragged last block
    assert capacity % config.block
    for num_active in (0, 1, 17, capacity, capacity + 9):
        bits = _assert_same(buf, plan, jnp.int32(num_active), kv, mode=2, check=True, config=config)
        assert not bits[num_active:].any()


def test_empty_plan():
    empty = [jnp.zeros((0,), jnp.int32)] * 4
    _assert_same(jnp.zeros((8, 4, 2), jnp.uint32), empty, jnp.int32(0), (), mode=0, check=False)


def test_eight_byte_source_under_x64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        data = jnp.asarray(rng.integers(-(2**62), 2**62, (NUM_SLOTS // 2, 2, 4)), jnp.int64)
        kv = (realkv.RealKvSource(data, page_size=2),)
        buf, kv, plan, n = cases.verify_inputs(rng, num_slots=NUM_SLOTS, num_reqs=4, max_len=10, sources=kv, mode=2)
        _assert_same(buf, plan, n, kv, mode=2, check=True)


def test_unreadable_dtype_raises():
    for dtype in (jnp.complex64, jnp.bool_):
        with pytest.raises(
            TypeError,
            match=rf"RealKvSource.data must have a 1/2/4/8-byte integer or float dtype .*{jnp.dtype(dtype).name}",
        ):
            realkv.RealKvSource(jnp.zeros((NUM_SLOTS, 16), dtype))


def test_pallas_backend_needs_a_gpu():
    if jax.default_backend() != "cpu":
        pytest.skip("runs a kernel natively here")
    with pytest.raises(NotImplementedError, match="interpret"):
        api.verify(
            jnp.zeros((8, 4, 2), jnp.uint32), *([jnp.zeros((4,), jnp.int32)] * 4), jnp.int32(4), backend="pallas"
        )


# --------------------------------------------------------------------------------------- kvcanary_jax.canary_verify

_canary_verify = jax.jit(
    kc.canary_verify, static_argnames=("tag", "real_kv_hash_mode", "check_expected_token", "backend")
)


@pytest.mark.parametrize("enable", [1, 0], ids=["enabled", "overflowed"])
def test_canary_verify_states_identical(enable):
    """Ring rows (overflowing the ring), write index and counters are byte-identical across backends."""
    buf, kv, plan, n = _case(4, SOURCES["fp8_p1+u8_p16"], 2)
    plan = kc.VerifyPlan(*plan, num_valid=jnp.asarray([n], jnp.int32), enable=jnp.asarray([enable], jnp.int32))
    config = kc.CanaryConfig(ring_capacity=8, enable_verify_token_assert=True)
    state = kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=2, max_context_len=4)
    states = {}
    for backend in ("xla", "interpret"):
        s = state
        for tag in (kc.CanaryLaunchTag.TAIL_K_FULL, kc.CanaryLaunchTag.SWEEP_V_SWA):  # two launches share the ring
            s = _canary_verify(
                s,
                buf,
                plan,
                tag=tag,
                real_kv_sources=kv,
                real_kv_hash_mode=2,
                check_expected_token=True,
                backend=backend,
            )
        states[backend] = s
    chex.assert_trees_all_equal(states["interpret"], states["xla"])
    index = int(states["xla"].violation_log.violation_write_index[0])
    assert index > 8 if enable else index == 0
