"""The Mosaic verify kernel (TPU interpret mode) gives exactly the xla path's fail bits, and whole canary states.

TPU interpret mode emulates every DMA and SMEM access, so the cases stay small: one or two 128-entry blocks.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from pallas_kernels import mosaic_io, realkv
from pallas_kernels.verify import api, pallas_mosaic
from tests.pallas_kernels import kernel_cases as cases

NUM_SLOTS = 160

SOURCES = {
    "none": (),
    "bf16_p4": (cases.SourceSpec("bfloat16", 4, 64, 48, row_padding=16),),
    "4_sources": (
        cases.SourceSpec("float32", 16, 32, 32),
        cases.SourceSpec("int8", 1, 48, 32, row_padding=16),
        cases.SourceSpec("bfloat16", 1, 32, 32),
        cases.SourceSpec("float8_e4m3fn", 4, 16, 16),
    ),
}


@functools.partial(jax.jit, static_argnames=("mode", "check", "backend", "config"))
def _bits(buf, plan, num_active, sources, *, mode, check, backend, config=None):
    kwargs = dict(real_kv_sources=sources, real_kv_hash_mode=mode, check_expected_token=check)
    if config is not None:
        return pallas_mosaic.verify_bits(buf, *plan, num_active, **kwargs, interpret=True, config=config)
    return api.verify(buf, *plan, num_active, **kwargs, backend=backend)


def _case(seed, specs, mode, *, num_reqs=6, max_len=20):
    rng = np.random.default_rng(seed)
    sources = cases.make_sources(rng, NUM_SLOTS, specs)
    return cases.verify_inputs(rng, num_slots=NUM_SLOTS, num_reqs=num_reqs, max_len=max_len, sources=sources, mode=mode)


def _assert_same(buf, plan, num_active, sources, *, mode, check, config=None):
    want = _bits(buf, plan, num_active, sources, mode=mode, check=check, backend="xla")
    got = _bits(buf, plan, num_active, sources, mode=mode, check=check, backend="interpret_tpu", config=config)
    chex.assert_trees_all_equal(got, want)
    return np.asarray(want)


def test_none_mode():
    buf, _, plan, n = _case(1, (), 0)
    seen = functools.reduce(np.bitwise_or, _assert_same(buf, plan, n, (), mode=0, check=False))
    assert seen & 3 == 3 and not seen & 32, f"chain and position bits, no token bit; saw {seen:#x}"


def test_four_sources_over_blocks_and_calls():
    """ALL mode, 4 sources, token check; two 128-entry blocks and a split into two calls; num_active past a block
    (the second call then has none active) and past capacity (one compile)."""
    buf, kv, plan, _ = _case(2, SOURCES["4_sources"], 2, num_reqs=7, max_len=22)
    capacity = plan[0].shape[0]
    config = pallas_mosaic.Config(rows=1, max_entries_per_call=150)  # calls of 150 (2 blocks) and 9 entries
    assert 256 > capacity > config.max_entries_per_call > 128, capacity
    for num_active in (131, capacity + 9):
        bits = _assert_same(buf, plan, jnp.int32(num_active), kv, mode=2, check=True, config=config)
        assert not bits[num_active:].any()
    seen = functools.reduce(np.bitwise_or, bits)
    assert seen == 1 | 2 | 4 | 32, f"the case should exercise every bit; saw {seen:#x}"


def test_chained_plan_reads_predecessors_from_the_previous_lane():
    """A plan in chain order: a predecessor that is the previous entry's slot is taken from the previous lane, not
    fetched; first entries, wrong or zero predecessors and a row's lane 0 (a chain crossing rows) are fetched."""
    rng = np.random.default_rng(5)
    sources = cases.make_sources(rng, 2 * NUM_SLOTS, SOURCES["bf16_p4"])
    buf, kv, plan, n = cases.verify_inputs(
        rng, num_slots=2 * NUM_SLOTS, num_reqs=12, max_len=24, sources=sources, mode=1, shuffle=False
    )
    slots, prevs = np.asarray(plan[0])[:n], np.asarray(plan[3])[:n]
    chained = np.flatnonzero(prevs[1:] == slots[:-1]) + 1
    assert n > 128 and 128 in chained and len(chained) > n // 2, (n, chained)
    bits = _assert_same(buf, plan, n, kv, mode=1, check=True, config=pallas_mosaic.Config(rows=2))
    assert bits[chained].any() and not bits[chained].all()


def test_runs_of_consecutive_slots_are_fetched_in_pieces():
    """Requests in pages of 16 consecutive slots, in chain order: records are fetched by runs (one DMA per power
    of two of a run) that end at a page, a row's lane 0, a tampered slot or predecessor, and num_active."""
    rng = np.random.default_rng(6)
    sources = cases.make_sources(rng, 2 * NUM_SLOTS, SOURCES["bf16_p4"])
    buf, kv, plan, n = cases.verify_inputs(
        rng, num_slots=2 * NUM_SLOTS, num_reqs=12, max_len=24, sources=sources, mode=1, shuffle=False, page=16
    )
    runs = np.asarray(mosaic_io.runs(plan[0], plan[3], 2 * NUM_SLOTS))[:n] >> 1
    assert n > 128 and runs.max() == 16 and (runs[1:] == runs[:-1] - 1).sum() > n // 2, runs
    config = pallas_mosaic.Config(rows=2)
    for num_active in (n, 131):
        bits = _assert_same(buf, plan, jnp.int32(num_active), kv, mode=1, check=True, config=config)
    assert bits[:131].any()


def test_empty_plan():
    empty = [jnp.zeros((0,), jnp.int32)] * 4
    _assert_same(jnp.zeros((8, 4, 2), jnp.uint32), empty, jnp.int32(0), (), mode=0, check=False)


def test_x64_with_eight_byte_sources():
    """Under x64 nothing may turn 64-bit in the kernel; 8-byte sources are read as u32 pairs."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        data = jnp.asarray(rng.integers(-(2**62), 2**62, (NUM_SLOTS // 2, 2, 4)), jnp.int64)
        kv = (realkv.RealKvSource(data, page_size=2), cases.make_sources(rng, NUM_SLOTS, SOURCES["bf16_p4"])[0])
        buf, kv, plan, n = cases.verify_inputs(rng, num_slots=NUM_SLOTS, num_reqs=4, max_len=10, sources=kv, mode=2)
        _assert_same(buf, plan, n, kv, mode=2, check=True)


def test_pallas_backend_off_gpu_and_tpu_raises():
    if jax.default_backend() != "cpu":
        pytest.skip("runs a kernel natively here")
    args = (jnp.zeros((8, 4, 2), jnp.uint32), *([jnp.zeros((4,), jnp.int32)] * 4), jnp.int32(4))
    for run in (api.verify, jax.jit(api.verify, static_argnames="backend")):  # eagerly, and when lowered
        with pytest.raises(NotImplementedError, match=r"backend='pallas'.*lowered for 'cpu'.*'interpret_tpu'"):
            run(*args, backend="pallas")


# --------------------------------------------------------------------------------------- kvcanary_jax.canary_verify

_canary_verify = jax.jit(
    kc.canary_verify, static_argnames=("tag", "real_kv_hash_mode", "check_expected_token", "backend")
)


@pytest.mark.parametrize("enable", [1, 0], ids=["enabled", "overflowed"])
def test_canary_verify_states_identical(enable):
    """PARTIAL mode through the upper layer: ring rows (overflowing the ring), write index and counters are
    byte-identical to the xla path."""
    buf, kv, plan, n = _case(4, SOURCES["bf16_p4"], 1)
    plan = kc.VerifyPlan(*plan, num_valid=jnp.asarray([n], jnp.int32), enable=jnp.asarray([enable], jnp.int32))
    config = kc.CanaryConfig(ring_capacity=8, enable_verify_token_assert=True)
    state = kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=2, max_context_len=4)
    states = {}
    for backend in ("xla", "interpret_tpu"):
        s = state
        for _ in range(2):  # two launches share the ring (one tag: one compile)
            s = _canary_verify(
                s,
                buf,
                plan,
                tag=kc.CanaryLaunchTag.TAIL_K_FULL,
                real_kv_sources=kv,
                real_kv_hash_mode=1,
                check_expected_token=True,
                backend=backend,
            )
        states[backend] = s
    chex.assert_trees_all_equal(states["interpret_tpu"], states["xla"])
    index = int(states["xla"].violation_log.violation_write_index[0])
    assert index > 8 if enable else index == 0
