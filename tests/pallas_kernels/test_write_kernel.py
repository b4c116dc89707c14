"""The write kernels (interpret mode) give exactly the xla path's buffer and ChainOut, and whole canary states."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from pallas_kernels import realkv
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api, pallas_triton, store
from tests.pallas_kernels import kernel_cases as cases

NUM_SLOTS, NUM_REQS, MAX_LEN = 48, 5, 8

SOURCES = {
    "none": (),
    "bf16_p4+i8_p16": (cases.SourceSpec("bfloat16", 4, 64, 48, row_padding=16), cases.SourceSpec("int8", 16, 16, 16)),
    "4_sources": (
        cases.SourceSpec("float32", 1, 32, 32),
        cases.SourceSpec("uint8", 4, 16, 16),
        cases.SourceSpec("float8_e4m3fn", 16, 32, 16),
        cases.SourceSpec("bfloat16", 1, 48, 48),
    ),
}


@functools.partial(jax.jit, static_argnames=("mode", "backend", "config"))
def _write(buf, inputs, flag, sources, *, mode, backend, config=None):
    if config is not None:
        return pallas_triton.write(
            buf, *inputs, flag, real_kv_sources=sources, real_kv_hash_mode=mode, interpret=True, config=config
        )
    return api.write(buf, *inputs, flag, real_kv_sources=sources, real_kv_hash_mode=mode, backend=backend)


def _inputs(seed, specs, **kwargs):
    rng = np.random.default_rng(seed)
    shape = dict(num_slots=NUM_SLOTS, num_reqs=NUM_REQS, max_len=MAX_LEN) | kwargs
    inputs = cases.write_inputs(rng, **shape)
    return cases.random_buffer(rng, shape["num_slots"]), inputs, cases.make_sources(rng, shape["num_slots"], specs)


def _assert_same(buf, inputs, sources, *, mode, config=None, flags=(0, 1)):
    for flag in flags:  # the chain-position switch is traced: one compile serves both
        flag = jnp.full((1,), flag, jnp.int32)
        want = _write(buf, inputs, flag, sources, mode=mode, backend="xla")
        got = _write(buf, inputs, flag, sources, mode=mode, backend="interpret", config=config)
        chex.assert_trees_all_equal(got, want)
    return want


def _duplicate_winners_matter(inputs, chain) -> bool:
    """Some slot is written twice in the launch with different records (so the winner rule is tested)."""
    loc, written = np.asarray(inputs[5]), np.asarray(chain.written)
    slots, counts = np.unique(loc[written], return_counts=True)
    return bool((counts[slots < NUM_SLOTS] > 1).any())


SMALL = pallas_triton.Config(block=8, num_warps=1, dedupe="pairwise", compare_block=4)  # many programs, scan steps


@pytest.mark.parametrize(
    "sources,mode,config",
    [
        ("none", 0, None),
        ("bf16_p4+i8_p16", 1, pallas_triton.Config(block=16, num_warps=1, dedupe="sort")),
        ("4_sources", 2, SMALL),
    ],
    ids=["none-heuristic", "partial-sort", "all-pairwise"],
)
def test_interpret_matches_xla(sources, mode, config):
    buf, inputs, kv = _inputs(1, SOURCES[sources])
    _, chain = _assert_same(buf, inputs, kv, mode=mode, config=config)
    assert chain.position_assert_failed.any() and _duplicate_winners_matter(inputs, chain)
    assert not chain.written[int(inputs[0][-1]) :].any(), "the token tail belongs to no request"


def test_more_seeds_same_compile():
    for seed in range(2, 6):
        buf, inputs, kv = _inputs(seed, SOURCES["4_sources"])
        _assert_same(buf, inputs, kv, mode=2, config=SMALL, flags=(1,))


def test_no_requests_or_no_tokens():
    buf, (_, _, num_valid, ids, positions, loc), _ = _inputs(7, ())
    no_reqs = (jnp.zeros((1,), jnp.int32), jnp.zeros((0,), jnp.int32), num_valid, ids, positions, loc)
    _assert_same(buf, no_reqs, (), mode=0)
    # The xla chain cannot index empty token arrays; the kernels' contract is "nothing written".
    empty = tuple(jnp.zeros((0,), jnp.int32) for _ in range(3))
    flag = jnp.ones((1,), jnp.int32)
    out, chain = _write(
        buf, (jnp.zeros((6,), jnp.int32), jnp.full((5,), -1), num_valid, *empty), flag, (), mode=0, backend="interpret"
    )
    chex.assert_trees_all_equal(out, buf)
    assert chain.written.shape == (0,)


def test_eight_byte_source_under_x64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(8)
        data = jnp.asarray(rng.integers(-(2**62), 2**62, (NUM_SLOTS, 2)), jnp.uint64)
        buf, inputs, _ = _inputs(8, ())
        _assert_same(buf, inputs, (realkv.RealKvSource(data),), mode=2, flags=(1,))


def test_clean_write_then_verify_is_silent():
    """The law behind the canary, all on the kernels: a write of fresh chains verifies clean, real KV included."""
    rng = np.random.default_rng(9)
    num_slots = 64
    offsets, seeds, num_valid, ids, positions, loc = cases.write_inputs(
        rng, num_slots=num_slots, num_reqs=4, max_len=12, extra_tokens=0, clean=True
    )
    kv = cases.make_sources(rng, num_slots, SOURCES["bf16_p4+i8_p16"])
    buf, chain = api.write(
        jnp.zeros((num_slots, 4, 2), jnp.uint32),
        offsets,
        seeds,
        num_valid,
        ids,
        positions,
        loc,
        jnp.ones((1,), jnp.int32),
        real_kv_sources=kv,
        real_kv_hash_mode=2,
        backend="interpret",
    )
    n = int(offsets[-1])
    first = np.isin(np.arange(n), np.asarray(offsets))
    prev = np.where(first, -1, np.roll(np.asarray(loc)[:n], 1)).astype(np.int32)
    bits = verify_api.verify(
        buf,
        loc[:n],
        ids[:n],
        positions[:n],
        jnp.asarray(prev),
        jnp.int32(n),
        real_kv_sources=kv,
        real_kv_hash_mode=2,
        check_expected_token=True,
        backend="interpret",
    )
    assert int(chain.written.sum()) == n
    chex.assert_trees_all_equal(bits, jnp.zeros((n,), jnp.int32))


# ---------------------------------------------------------------------------------------- kvcanary_jax.canary_write

_canary_write = jax.jit(kc.canary_write, static_argnames=("tag", "real_kv_hash_mode", "backend"))


def test_canary_write_states_identical():
    """Buffer, ring rows (input-assert and chain-position rows, overflowing), index and counters all match."""
    buf, (offsets, seeds, num_valid, ids, positions, loc), kv = _inputs(10, SOURCES["bf16_p4+i8_p16"])
    plan = kc.WritePlan(write_offsets=offsets, seed_slot_indices=seeds, num_valid_reqs=num_valid)
    rng = np.random.default_rng(10)
    expected_ids = jnp.where(jnp.asarray(rng.random(ids.shape[0]) < 0.2), ids + 1, ids)
    state = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(ring_capacity=8))
    results = {}
    for backend in ("xla", "interpret"):
        out_buf, s = buf, state
        for tag in (kc.CanaryLaunchTag.TAIL_K_FULL, kc.CanaryLaunchTag.TAIL_V_SWA):
            out_buf, s = _canary_write(
                s,
                out_buf,
                plan,
                ids,
                positions,
                loc,
                tag=tag,
                real_kv_sources=kv,
                real_kv_hash_mode=2,
                expected_input_tokens=expected_ids,
                expected_input_positions=positions,
                backend=backend,
            )
        results[backend] = (out_buf, s)
    chex.assert_trees_all_equal(results["interpret"], results["xla"])
    assert int(results["xla"][1].violation_log.violation_write_index[0]) > 8


@pytest.mark.parametrize("num_entries", [9, store.PAIRWISE_MAX_ENTRIES, store.PAIRWISE_MAX_ENTRIES + 1])
def test_last_writer_is_each_slots_last_valid_entry(num_entries):
    """The pairwise scan (few entries) and the sort (more) both pick each slot's last valid writer; slots out of
    range and invalid entries never win."""
    rng = np.random.default_rng(num_entries)
    slots = rng.integers(-1, 24, num_entries).astype(np.int32)  # 20..23 are past the 20 slots: dropped
    valid = rng.random(num_entries) < 0.8
    want = np.zeros(num_entries, bool)
    for slot in set(slots[valid & (slots >= 0) & (slots < 20)]):  # -1 wraps in a scatter: the caller skips it
        want[np.flatnonzero(valid & (slots == slot))[-1]] = True
    got = np.asarray(jax.jit(store.last_writer, static_argnums=2)(slots, valid, 20)) & (slots >= 0)
    np.testing.assert_array_equal(got, want)
