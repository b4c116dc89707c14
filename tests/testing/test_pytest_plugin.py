"""The ``kvcanary_guard`` fixture fails a test whose step corrupts the cache, and passes a clean one."""

import pytest

from kvcanary_jax.testing import CanaryGuard
from tests.testing import tiny_loop

pytest_plugins = ["pytester"]

_TESTS = """
import jax.numpy as jnp
from tests.testing import tiny_loop


def test_clean(kvcanary_guard):
    tiny_loop.run(5, step_fn=kvcanary_guard.wrap(tiny_loop.step))
    assert kvcanary_guard.watched == 1


def test_corrupted(kvcanary_guard):
    tiny_loop.run(5, corrupt_at=2, step_fn=kvcanary_guard.wrap(tiny_loop.step))


def test_unwired(kvcanary_guard):
    tiny_loop.run(5, corrupt_at=2)


def test_failing_body_is_not_checked_again(kvcanary_guard):
    tiny_loop.run(5, corrupt_at=2, step_fn=kvcanary_guard.wrap(tiny_loop.step))
    assert False, "the body's own failure"
"""


def test_guard_fails_a_corrupting_test_and_passes_a_clean_one(pytester: pytest.Pytester):
    pytester.makeconftest('pytest_plugins = ["kvcanary_jax.testing.pytest_plugin"]')
    pytester.makepyfile(test_guarded=_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3)
    out = result.stdout.str()
    assert "kvcanary_guard watched no canary state, so it checked nothing: wrap the jitted step" in out
    assert "pytest_plugin.py" not in out and "Array(" not in out and "array(" not in out, "no frames, no arrays"
    assert "test_guarded.py::test_corrupted FAILED" in out or "FAILED test_guarded.py::test_corrupted" in out
    # Once in the failure's report (not chained twice); the short summary at the end may repeat it (untruncated where
    # the CI variable is set), so it is left out of the count.
    report = out.split("short test summary info")[0]
    assert report.count("assert_no_violations failed: the canary recorded 3 violation(s)") == 1
    assert "During handling of the above exception" not in out, "issue 43: the message once, no chained copy"
    assert "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx=1" in out
    assert "the body's own failure" in out


def test_guard_keeps_a_copy_of_the_newest_state_although_steps_donate_it():
    guard = CanaryGuard()
    step = guard.wrap(tiny_loop.step)
    _, state = tiny_loop.run(4, corrupt_at=1, step_fn=step)
    with pytest.raises(AssertionError, match="recorded 3 violation"):
        guard.check()
    assert guard.watched == 1
    with pytest.raises(TypeError, match="state must be a CanaryState or CanaryDeviceState; got int"):
        guard.watch(3)
