"""Misuse of the test tier: assertions, fault injectors and the guard name a bad argument instead of passing,
injecting nothing, or corrupting another place (JAX drops out-of-range scatter indices and wraps negative ones).
Next to each misuse, the correct call injects its fault where asked, and the canary of the tiny loop finds it there.
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import FailReason, testing
from kvcanary_jax.testing import CanaryGuard, assert_no_violations, expect_violation
from tests.testing import tiny_loop

KV = jnp.asarray(np.random.default_rng(0).integers(-50, 50, (4, 4, 2, 8)), jnp.bfloat16)  # 32 bytes per token


def _changed(a, b) -> list[list[int]]:
    """Byte positions ``[page, row, byte]`` where two paged arrays differ."""
    view = lambda x: np.asarray(x).view(np.uint8).reshape(x.shape[0], x.shape[1], -1)  # noqa: E731
    return np.argwhere(view(a) != view(b)).tolist()


@pytest.fixture(scope="module")
def bad_slot_state():
    """The tiny loop after 3 steps whose last writes slot 99 of a 64-slot pool: one INVALID_INPUT row."""
    kv, state = tiny_loop.init()
    for i in range(3):
        batch = tiny_loop.batch(i)
        if i == 2:
            batch = dataclasses.replace(batch, out_cache_loc=np.array([99], np.int32))
        kv, state = tiny_loop.step(kv, state, batch)
    return state


# -------------------------------------------------------------------------------------------------------- assertions


@pytest.mark.parametrize("x", [None, [1], {"state": 1}, tiny_loop.CANARY, np.zeros(3)], ids=type)
def test_assertions_name_what_they_cannot_read(x):
    pattern = r"expected a CanaryState, CanaryDeviceState, ViolationLog, ViolationReport or ShardedViolationReport"
    with pytest.raises(TypeError, match=rf"{pattern}; got {type(x).__name__}"):
        assert_no_violations(x)
    with pytest.raises(TypeError, match=rf"got {type(x).__name__}"):
        expect_violation(x)


# --------------------------------------------------------------------------------------------------------- injectors

_PAGED = r"kv must be a paged KV array laid out \[pages, page_size={}, \.\.\.\]"


def test_corrupt_page_flips_the_page_asked_for():
    assert _changed(KV, testing.corrupt_page(KV, np.int32(2), page_size=4, byte=5)) == [[2, r, 5] for r in range(4)]


_TABLE = jnp.arange(4 * 8, dtype=jnp.int32).reshape(4, 8)


def test_remap_slot_takes_numpy_and_may_point_anywhere():
    remapped = testing.remap_slot(np.asarray(_TABLE), np.int64(1), np.int32(2), np.int64(-7))
    assert np.argwhere(np.asarray(remapped) != np.asarray(_TABLE)).tolist() == [[1, 2]] and remapped[1, 2] == -7


def test_injected_faults_are_found_where_they_were_injected():
    """A KV byte flipped through numpy arguments, and a table entry remapped out of the pool, in the tiny loop."""
    kv, state = tiny_loop.init()
    for i in range(4):
        batch = tiny_loop.batch(i)
        if i == 2:
            kv = testing.flip_kv_byte(np.asarray(kv), np.int64(2), page_size=np.int64(tiny_loop.PAGE_SIZE))
        if i == 3:
            batch = dataclasses.replace(batch, req_to_token=testing.remap_slot(batch.req_to_token, 1, 0, 70))
        kv, state = tiny_loop.step(kv, state, batch)
    expect_violation(state, tag="TAIL_K_FULL", reason=FailReason.VERIFY_REAL_KV_HASH_MISMATCH, slot=2)
    v = expect_violation(state, tag="HEAD_K_FULL", reason=FailReason.INVALID_INPUT, slot=70)
    assert (v.position, v.expected_aux) == (0, 1)
    assert "input: req_to_token[1, 0] (batch row 0) = 70 is out of range (limit 64)" in kc.format_violation(
        v, total=1, overflowed=False
    )


# ------------------------------------------------------------------------------------------------------------- guard


def test_a_wrapped_step_is_watched():
    guard = CanaryGuard()
    step = guard.wrap(tiny_loop.step)
    kv, state = tiny_loop.init()
    for i in range(2):
        kv, state = step(kv, state, tiny_loop.batch(i))
    guard.check()
    kv, state = step(kv, state, dataclasses.replace(tiny_loop.batch(2), prefix_lens=np.array([-2], np.int32)))
    with pytest.raises(AssertionError, match=re.escape("input: prefix_lens[0] = -2 is negative")):
        guard.check()


# ----------------------------------------------------------------------------------------------------------- targets
