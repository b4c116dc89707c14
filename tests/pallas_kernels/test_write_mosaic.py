"""The Mosaic write kernels (TPU interpret mode) give exactly the xla path's buffer and ChainOut, and whole states.

TPU interpret mode emulates every DMA and SMEM access, so the cases stay small; one of them still spans several
chain windows and store blocks. The position-assert switch is traced, so both of its values share a compile.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary_jax as kc
from pallas_kernels import realkv
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api, pallas_mosaic
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
    kwargs = dict(real_kv_sources=sources, real_kv_hash_mode=mode)
    if config is not None:
        return pallas_mosaic.write(buf, *inputs, flag, **kwargs, interpret=True, config=config)
    return api.write(buf, *inputs, flag, **kwargs, backend=backend)


def _inputs(seed, specs, **kwargs):
    rng = np.random.default_rng(seed)
    shape = dict(num_slots=NUM_SLOTS, num_reqs=NUM_REQS, max_len=MAX_LEN) | kwargs
    inputs = cases.write_inputs(rng, **shape)
    return cases.random_buffer(rng, shape["num_slots"]), inputs, cases.make_sources(rng, shape["num_slots"], specs)


def _assert_same(buf, inputs, sources, *, mode, config=None, flags=(0, 1)):
    for flag in flags:  # the chain-position switch is traced: one compile serves both
        flag = jnp.full((1,), flag, jnp.int32)
        want = _write(buf, inputs, flag, sources, mode=mode, backend="xla")
        got = _write(buf, inputs, flag, sources, mode=mode, backend="interpret_tpu", config=config)
        chex.assert_trees_all_equal(got, want)
    return want


def _duplicate_winners_matter(inputs, chain, num_slots=NUM_SLOTS) -> bool:
    """Some slot is written twice in the launch (so the last-writer rule is tested)."""
    loc, written = np.asarray(inputs[5]), np.asarray(chain.written)
    slots, counts = np.unique(loc[written], return_counts=True)
    return bool((counts[slots < num_slots] > 1).any())


def test_four_sources_over_windows_and_blocks():
    """ALL mode, 4 sources; valid requests over ~300 of 363 tokens, two of them crossing the chain's 128-entry SMEM
    windows, stored in 3 blocks. (The split into several store calls is the verify kernel's loop; test_export_tpu
    lowers it.)"""
    buf, inputs, kv = _inputs(4, SOURCES["4_sources"], num_slots=64, num_reqs=6, max_len=60)
    offsets = np.asarray(inputs[0])[: int(inputs[2][0]) + 1]  # valid requests only
    crossing = [(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True) if b > a and a >> 7 != (b - 1) >> 7]
    assert inputs[5].shape[0] > 256 and len(crossing) == 2, (offsets, crossing)
    _, chain = _assert_same(buf, inputs, kv, mode=2, config=pallas_mosaic.Config(rows=1), flags=(1,))
    assert chain.position_assert_failed.any() and _duplicate_winners_matter(inputs, chain, num_slots=64)
    assert not chain.written[int(offsets[-1]) :].any(), "the token tail belongs to no request"


def test_no_requests_or_no_tokens():
    buf, (_, _, num_valid, ids, positions, loc), _ = _inputs(7, ())
    no_reqs = (jnp.zeros((1,), jnp.int32), jnp.zeros((0,), jnp.int32), num_valid, ids, positions, loc)
    _assert_same(buf, no_reqs, (), mode=0, flags=(1,))
    empty = tuple(jnp.zeros((0,), jnp.int32) for _ in range(3))
    no_tokens = (jnp.zeros((6,), jnp.int32), jnp.full((5,), -1, jnp.int32), num_valid, *empty)
    out, chain = _assert_same(buf, no_tokens, (), mode=0, flags=(1,))
    chex.assert_trees_all_equal(out, buf)
    assert chain.written.shape == (0,)


def test_x64_partial_mode_with_eight_byte_source():
    """Under x64 nothing may turn 64-bit in the kernels; an 8-byte source is read as u32 pairs."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(8)
        data = jnp.asarray(rng.integers(-(2**62), 2**62, (NUM_SLOTS // 4, 4, 2)), jnp.uint64)
        buf, inputs, kv = _inputs(8, SOURCES["bf16_p4+i8_p16"][:1])
        _assert_same(buf, inputs, (realkv.RealKvSource(data, page_size=4), *kv), mode=1)


def test_one_walk_and_store_serve_every_buffer():
    """``write_of_buffers`` (a phase's K and V: one chain launch and one store launch for both) gives each buffer
    its own ``write`` by the xla path, though the buffers' seeds (so chains and position asserts) and KV sources
    differ."""
    buf, inputs, kv = _inputs(9, SOURCES["bf16_p4+i8_p16"])
    rng = np.random.default_rng(11)
    other, other_kv = cases.random_buffer(rng, NUM_SLOTS), cases.make_sources(rng, NUM_SLOTS, SOURCES["4_sources"][:1])
    offsets, seeds, positions = (np.asarray(inputs[k]) for k in (0, 1, 4))
    continued = seeds >= 0
    first = positions[np.minimum(offsets[:-1], positions.shape[0] - 1)]  # each request's first position
    pair = np.stack([first[continued] - 1, 0 * first[continued]], -1).astype(np.uint32)
    other = other.at[seeds[continued], 1].set(pair)  # its continued chains pass the position assert
    flag = jnp.ones((1,), jnp.int32)
    want = [_write(b, inputs, flag, s, mode=1, backend="xla") for b, s in ((buf, kv), (other, other_kv))]
    got = pallas_mosaic.write_of_buffers(
        (buf, other), *inputs, flag, real_kv_sources=(kv, other_kv), real_kv_hash_mode=1, interpret=True
    )
    chex.assert_trees_all_equal(got, ([w[0] for w in want], [w[1] for w in want]))
    chains = [w[1] for w in want]
    assert (chains[0].prev_hash != chains[1].prev_hash).any() and chains[0].written.any()
    assert (chains[0].position_assert_failed != chains[1].position_assert_failed).any()


@settings(max_examples=2, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1))
def test_clean_write_then_verify_is_silent(seed):
    """The law behind the canary, all on the Mosaic kernels: fresh chains verify clean, real KV included."""
    rng = np.random.default_rng(seed)
    num_slots = 64
    offsets, seeds, num_valid, ids, positions, loc = cases.write_inputs(
        rng, num_slots=num_slots, num_reqs=4, max_len=12, extra_tokens=0, clean=True
    )
    kv = cases.make_sources(rng, num_slots, SOURCES["bf16_p4+i8_p16"])
    flag = jnp.ones((1,), jnp.int32)
    inputs = (offsets, seeds, num_valid, ids, positions, loc)
    buf, chain = _write(jnp.zeros((num_slots, 4, 2), jnp.uint32), inputs, flag, kv, mode=2, backend="interpret_tpu")
    n = int(offsets[-1])
    starts = np.isin(np.arange(loc.shape[0]), np.asarray(offsets))
    prev = jnp.asarray(np.where(starts, -1, np.roll(np.asarray(loc), 1)), jnp.int32)
    bits = _verify(buf, (loc, ids, positions, prev), jnp.int32(n), kv)
    assert int(chain.written.sum()) == n and not chain.position_assert_failed.any()
    chex.assert_trees_all_equal(bits, jnp.zeros(loc.shape, jnp.int32))


@jax.jit
def _verify(buf, plan, num_active, kv):
    return verify_api.verify(
        buf, *plan, num_active, real_kv_sources=kv, real_kv_hash_mode=2, check_expected_token=True,
        backend="interpret_tpu",
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- kvcanary_jax.canary_write

_canary_write = jax.jit(kc.canary_write, static_argnames=("tag", "real_kv_hash_mode", "backend"))


def test_canary_write_states_identical():
    """NONE mode through the upper layer: buffer, ring rows (input-assert and chain-position rows, overflowing),
    index and counters all match the xla path."""
    buf, (offsets, seeds, num_valid, ids, positions, loc), _ = _inputs(10, ())
    plan = kc.WritePlan(write_offsets=offsets, seed_slot_indices=seeds, num_valid_reqs=num_valid)
    rng = np.random.default_rng(10)
    expected_ids = jnp.where(jnp.asarray(rng.random(ids.shape[0]) < 0.2), ids + 1, ids)
    state = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(ring_capacity=8))
    results = {}
    for backend in ("xla", "interpret_tpu"):
        out_buf, s = buf, state
        for _ in range(2):  # two launches share the ring (one tag: one compile)
            out_buf, s = _canary_write(
                s,
                out_buf,
                plan,
                ids,
                positions,
                loc,
                tag=kc.CanaryLaunchTag.TAIL_K_FULL,
                expected_input_tokens=expected_ids,
                expected_input_positions=positions,
                backend=backend,
            )
        results[backend] = (out_buf, s)
    chex.assert_trees_all_equal(results["interpret_tpu"], results["xla"])
    assert int(results["xla"][1].violation_log.violation_write_index[0]) > 8
