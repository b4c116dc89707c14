"""``assert_no_violations`` and ``expect_violation`` on a corrupted and a clean run of a tiny wrapped loop."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import CanaryLaunchTag, FailReason
from kvcanary_jax.testing import assert_no_violations, expect_violation
from tests.testing import tiny_loop

KV_BITS = FailReason.VERIFY_REAL_KV_HASH_MISMATCH
FIRST_LINE = (
    "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx=1 position=0 "
    "stored_token=100 expected_token=-1"
)


@pytest.fixture(scope="module")
def corrupted():
    """A run whose KV byte of slot 1 is flipped before step 3: each later TAIL verify reports slot 1 (3 rows)."""
    return tiny_loop.run(6, corrupt_at=3)[1]


@pytest.fixture(scope="module")
def clean():
    return tiny_loop.run(6)[1]


def test_clean_run_passes_for_every_kind_of_input(clean):
    for x in (clean, clean.device, clean.violation_log, kc.read_violations(clean.violation_log)):
        assert_no_violations(x)


def test_corrupted_run_fails_with_the_log_line_and_the_count(corrupted):
    for x in (corrupted, corrupted.device, corrupted.violation_log, kc.read_violations(corrupted.violation_log)):
        with pytest.raises(AssertionError) as caught:
            assert_no_violations(x, step=4)
        message = str(caught.value)
        assert "recorded 3 violation(s)" in message
        assert FIRST_LINE in message and "step_when_pumped=4" in message


def test_per_device_state_names_the_device(corrupted):
    """A state with leading mesh axes (as ShardedKvCanary keeps it) is read ring by ring."""
    log = corrupted.violation_log
    clean_log = kc.ViolationLog.allocate(ring_capacity=log.ring_capacity)
    stacked = kc.ViolationLog(
        violation_ring=jnp.stack([clean_log.violation_ring, log.violation_ring]).reshape(
            1, 2, *log.violation_ring.shape
        ),
        violation_write_index=jnp.stack([clean_log.violation_write_index, log.violation_write_index]).reshape(1, 2, 1),
    )
    with pytest.raises(AssertionError, match=r"recorded 3 violation\(s\); the first on device #1"):
        assert_no_violations(stacked)
    assert expect_violation(stacked, slot=1).slot_idx == 1


def test_expect_violation_finds_a_matching_row(corrupted):
    v = expect_violation(corrupted, tag=CanaryLaunchTag.TAIL_K_FULL, reason=KV_BITS, slot=1)
    assert (v.launch_tag, v.slot_idx, v.position, v.stored_token) == (CanaryLaunchTag.TAIL_K_FULL, 1, 0, 100)
    assert expect_violation(corrupted, tag="TAIL_K_FULL") == v
    assert expect_violation(kc.read_violations(corrupted.violation_log), reason=KV_BITS) == v


@pytest.mark.parametrize(
    "query",
    [
        {"tag": CanaryLaunchTag.HEAD_K_FULL},
        {"reason": FailReason.VERIFY_CHAIN_HASH_MISMATCH},
        {"reason": KV_BITS | FailReason.VERIFY_POSITION_MISMATCH},  # every bit must be there
        {"slot": 2},
    ],
)
def test_expect_violation_fails_listing_what_was_recorded(corrupted, query):
    with pytest.raises(AssertionError, match=r"no violation with .* recorded 3 row\(s\):\n  TAIL_K_FULL"):
        expect_violation(corrupted, **query)


def test_expect_violation_on_a_clean_run_fails(clean):
    with pytest.raises(AssertionError, match=r"recorded 0 row\(s\)$"):
        expect_violation(clean)


def test_bad_arguments_are_named(clean):
    with pytest.raises(TypeError, match=r"expected a CanaryState, .*; got ndarray"):
        assert_no_violations(np.zeros(3))
    with pytest.raises(ValueError, match=r"tag must be a CanaryLaunchTag or one of its names; got tag='TAIL'"):
        expect_violation(clean, tag="TAIL")
    with pytest.raises(TypeError, match=r"reason must be a FailReason or its printed name; got reason=4"):
        expect_violation(clean, reason=4)
