"""Misuse of the test tier: assertions, fault injectors and the guard name a bad argument instead of passing,
injecting nothing, or corrupting another place (JAX drops out-of-range scatter indices and wraps negative ones).
Next to each misuse, the correct call injects its fault where asked, and the canary of the tiny loop finds it there.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import CanaryBatch, FailReason, testing
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


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(tag="bogus"), ValueError, r"tag must be a CanaryLaunchTag or one of its names; got tag='bogus'"),
        (dict(tag=99), ValueError, r"tag must be a CanaryLaunchTag, one of its names or values; got tag=99"),
        (dict(tag=-1), ValueError, r"got tag=-1"),
        (dict(tag=2.0), ValueError, r"got tag=2.0"),
        (dict(reason=128), TypeError, r"reason must be a FailReason or its printed name; got reason=128"),
        (dict(reason="invalid_inputs"), ValueError,
         r"reason must be a FailReason or one of invalid_input, shard_chain, .*; got reason='invalid_inputs'"),
        (dict(slot="99"), TypeError, r"slot must be an int \(a row's slot_idx\); got slot='99'"),
        (dict(slot=99.0), TypeError, r"got slot=99.0"),
    ],
)  # fmt: skip
def test_expect_violation_names_a_filter_that_could_never_match(bad_slot_state, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        expect_violation(bad_slot_state, **kwargs)


def test_assertions_report_a_bad_value_by_name(bad_slot_state):
    v = expect_violation(bad_slot_state, tag=np.int64(0), reason=FailReason.INVALID_INPUT, slot=np.int64(99))
    assert v == expect_violation(bad_slot_state, tag="HEAD_K_FULL", slot=99)
    assert v == expect_violation(bad_slot_state, reason="invalid_input")
    assert v == expect_violation(bad_slot_state, reason="INVALID_INPUT")
    assert (v.position, v.stored_token, v.expected_aux) == (2, 99, 1)  # position 2 of request row 1
    with pytest.raises(AssertionError, match=r"no violation with slot=3; recorded 1 row\(s\):\n  HEAD_K_FULL invalid"):
        expect_violation(bad_slot_state, slot=3)
    with pytest.raises(AssertionError) as raised:
        assert_no_violations(bad_slot_state, step=np.int64(2))
    message = str(raised.value)
    assert "kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=invalid_input slot_idx=99 position=2" in message
    assert "input: out_cache_loc[0] (request row 1, position 2) = 99 is out of range (limit 64)" in message
    assert "step_when_pumped=2" in message
    with pytest.raises(TypeError, match=r"step must be an int; got step='2'"):
        assert_no_violations(bad_slot_state, step="2")


def test_printed_reason_names_are_members_and_public_types_show_their_public_module():
    """A report prints ``verify_real_kv_hash``: it is a member, and ``expect_violation`` takes it."""
    for member in FailReason:
        assert FailReason[member.label.upper()] is member and FailReason.parse(member.label) is member
    both = FailReason.VERIFY_CHAIN_HASH | FailReason.VERIFY_POSITION
    assert FailReason.parse("verify_chain_hash+verify_position") == both
    assert FailReason.VERIFY_REAL_KV_HASH is FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert [r.label for r in FailReason][:3] == ["verify_chain_hash", "verify_position", "verify_real_kv_hash"]
    assert kc.KvCanaryViolationError.__module__ == "kvcanary_jax" and kc.CanaryState.__module__ == "kvcanary_jax"
    assert CanaryGuard.__module__ == "kvcanary_jax.testing"
    assert repr(kc.KvCanaryViolationError).startswith("<class 'kvcanary_jax.KvCanaryViolationError'")


# --------------------------------------------------------------------------------------------------------- injectors

_PAGED = r"kv must be a paged KV array laid out \[pages, page_size={}, \.\.\.\]"


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "pattern"),
    [
        ((KV, 16), dict(page_size=4), ValueError, r"slot must be in \[0, 16\) \(pages \* page_size of kv\); got slot=16"),
        ((KV, -1), dict(page_size=4), ValueError, r"got slot=-1"),  # would flip the last page's byte
        ((KV, np.int64(99)), dict(page_size=4), ValueError, r"got slot=99"),
        ((KV, jnp.int32(99)), dict(page_size=4), ValueError, r"got slot=99"),
        ((KV, 5.0), dict(page_size=4), TypeError, r"slot must be an integer scalar; got slot=5.0"),
        ((KV, jnp.array([5, 6])), dict(page_size=4), TypeError, r"slot must be an integer scalar; got slot of shape \(2,\)"),
        # A page size that does not match the array, and a head-major [pages, heads, page_size, dim] layout.
        ((KV, 5), dict(page_size=8), ValueError, _PAGED.format(8) + r".*got shape \(4, 4, 2, 8\)"),
        ((KV, 5), dict(page_size=2), ValueError, _PAGED.format(2)),
        ((KV.transpose(0, 2, 1, 3), 5), dict(page_size=4), ValueError, r"The page_size \(4\) is a later axis"),
        ((KV, 5), dict(page_size=0), ValueError, r"page_size must be a positive static int; got page_size=0"),
        ((KV, 5), dict(page_size=4.0), ValueError, r"page_size=4.0"),
        ((KV.astype(bool), 5), dict(page_size=4), TypeError, r"kv must have a 1/2/4/8-byte integer or float dtype .*bool"),
        (([[0] * 16] * 4, 5), dict(page_size=4), TypeError, r"kv must be an array; got list"),
        ((KV, 5), dict(page_size=4, byte=32), ValueError, r"byte must be an int in \[0, 32\) \(bytes per token\); got byte=32"),
        ((KV, 5), dict(page_size=4, byte=1.0), ValueError, r"got byte=1.0"),
    ],
)  # fmt: skip
def test_flip_kv_byte_names_every_bad_argument(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        testing.flip_kv_byte(*args, **kwargs)


def test_flip_kv_byte_takes_numpy_and_traced_arguments():
    want = testing.flip_kv_byte(KV, 13, page_size=4, byte=3)
    assert _changed(KV, want) == [[3, 1, 3]]  # slot 13 = page 3, row 1
    host = testing.flip_kv_byte(np.asarray(KV), np.int64(13), page_size=np.int64(4), byte=np.int32(3))
    np.testing.assert_array_equal(host, want)
    traced = jax.jit(lambda kv, slot: testing.flip_kv_byte(kv, slot, page_size=4, byte=3))(KV, jnp.int32(13))
    np.testing.assert_array_equal(traced, want)


@pytest.mark.parametrize(
    ("page", "page_size", "error", "pattern"),
    [
        (4, 4, ValueError, r"page must be in \[0, 4\) \(pages of kv\); got page=4"),
        (-1, 4, ValueError, r"got page=-1"),
        (1, 8, ValueError, _PAGED.format(8)),
        (1.0, 4, TypeError, r"page must be an integer scalar; got page=1.0"),
    ],
)
def test_corrupt_page_names_every_bad_argument(page, page_size, error, pattern):
    with pytest.raises(error, match=pattern):
        testing.corrupt_page(KV, page, page_size=page_size)


def test_corrupt_page_flips_the_page_asked_for():
    assert _changed(KV, testing.corrupt_page(KV, np.int32(2), page_size=4, byte=5)) == [[2, r, 5] for r in range(4)]


_TABLE = jnp.arange(4 * 8, dtype=jnp.int32).reshape(4, 8)


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        ((_TABLE, 4, 0, 5), ValueError, r"pool_row must be in \[0, 4\) \(rows of req_to_token\); got pool_row=4"),
        ((_TABLE, 1, -1, 5), ValueError, r"position must be in \[0, 8\) \(columns of req_to_token\); got position=-1"),
        ((_TABLE, 1, 8, 5), ValueError, r"got position=8"),
        ((_TABLE, 1, 2.0, 5), TypeError, r"position must be an integer scalar; got position=2.0"),
        ((_TABLE, 1, 2, 5.5), TypeError, r"new_slot must be an integer; got new_slot=5.5"),
        ((_TABLE[1], 1, 2, 5), ValueError, r"req_to_token must have 2 dimension\(s\); got req_to_token.shape=\(8,\)"),
        ((_TABLE.astype(jnp.float32), 1, 2, 5), TypeError, r"req_to_token must be an integer array; got .*float32"),
    ],
)  # fmt: skip
def test_remap_slot_names_every_bad_argument(args, error, pattern):
    with pytest.raises(error, match=pattern):
        testing.remap_slot(*args)


def test_remap_slot_takes_numpy_and_may_point_anywhere():
    remapped = testing.remap_slot(np.asarray(_TABLE), np.int64(1), np.int32(2), np.int64(-7))
    assert np.argwhere(np.asarray(remapped) != np.asarray(_TABLE)).tolist() == [[1, 2]] and remapped[1, 2] == -7


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        ((0, 4), ValueError, r"j must be in \[0, 4\) \(token entries of input_ids\); got j=4"),
        ((-1, 0), ValueError, r"i must be in \[0, 4\).*got i=-1"),
        ((2, 2), ValueError, r"i and j must be two different token entries; got i=j=2"),
        ((0, 1.0), TypeError, r"j must be an integer scalar; got j=1.0"),
    ],
)
def test_swap_tokens_names_every_bad_argument(args, error, pattern):
    with pytest.raises(error, match=pattern):
        testing.swap_tokens(jnp.arange(4, dtype=jnp.int32), *args)


def test_swap_tokens_refuses_a_table():
    with pytest.raises(ValueError, match=r"input_ids must have 1 dimension\(s\); got input_ids.shape=\(2, 2\)"):
        testing.swap_tokens(jnp.arange(4, dtype=jnp.int32).reshape(2, 2), 0, 1)
    assert testing.swap_tokens(np.arange(4, dtype=np.int32), np.int64(0), 3).tolist() == [3, 1, 2, 0]


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


def test_guard_names_what_it_cannot_watch(bad_slot_state):
    guard = CanaryGuard()
    with pytest.raises(TypeError, match=r"step must be callable \(the jitted step\); got int"):
        guard.wrap(3)
    with pytest.raises(TypeError, match=r"key must be an int \(one per canary of the test\); got key=\[1\]"):
        guard.watch(bad_slot_state, key=[1])
    with pytest.raises(TypeError, match=r"state must be a CanaryState or CanaryDeviceState; got ViolationLog"):
        guard.watch(bad_slot_state.violation_log)
    assert guard.watch(bad_slot_state, key=np.int64(1)) is bad_slot_state
    with pytest.raises(AssertionError, match=re.escape("fail_reason=invalid_input slot_idx=99")):
        guard.check()


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


def test_target_pickers_skip_padding_rows_of_every_convention():
    """Negative padding rows (the default convention) may carry garbage lengths; they hold no targets."""
    table = np.zeros((4, 8), np.int32)
    table[1, :3] = [11, 12, 13]
    table[3, :8] = np.arange(30, 38)  # the last row: what a negative row index would read
    batch = CanaryBatch(
        req_pool_indices=np.array([1, -1, 0], np.int32),
        prefix_lens=np.array([2, 6, 0], np.int32),
        extend_lens=np.array([1, 2, 0], np.int32),
        req_to_token=table,
        input_ids=np.array([7, 8, 9, 0], np.int32),
        positions=np.array([2, 0, 0, 0], np.int32),
        out_cache_loc=np.array([13, -1, -1, -1], np.int32),
    )
    assert testing.cached_entries(batch).tolist() == [[0, 0, 11], [0, 1, 12]]
    rng = np.random.default_rng(0)
    assert {testing.choose_live_slot(batch, rng) for _ in range(10)} == {11, 12}
    assert testing.choose_token_swap(batch, rng) is None  # one request: nothing to cross
