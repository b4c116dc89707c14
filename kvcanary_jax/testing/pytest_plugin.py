"""A pytest plugin: the ``kvcanary_guard`` fixture fails a test whose canary recorded any violation.

Enable it in a ``conftest.py``::

    pytest_plugins = ["kvcanary_jax.testing.pytest_plugin"]

then wrap the test's step (or watch states by hand) with the fixture; see :class:`kvcanary_jax.testing.CanaryGuard`.
The check runs right after the test body, so a violation fails the test itself (not its teardown); a test that
already failed is not checked again. A test that requested the fixture but let it watch no state fails too: it would
pass whatever its cache held. Failures show the guard's message only (no framework frames, no arrays).
"""

from __future__ import annotations

import pytest

from kvcanary_jax.testing._guard import CanaryGuard

_FIXTURE = "kvcanary_guard"
_UNWIRED = (
    "kvcanary_guard watched no canary state, so it checked nothing: wrap the jitted step "
    "(step = kvcanary_guard.wrap(step)) or pass the final state to kvcanary_guard.watch(state)"
)


@pytest.fixture
def kvcanary_guard() -> CanaryGuard:
    """A :class:`CanaryGuard` checked when the test body returns."""
    return CanaryGuard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    guard = getattr(item, "funcargs", {}).get(_FIXTURE)
    if guard is not None:
        if not guard.watched:
            pytest.fail(_UNWIRED, pytrace=False)
        try:
            guard.check()
        except AssertionError as e:
            failure = str(e)
        else:
            failure = None
        if failure is not None:  # failed outside the except: a chained AssertionError would print the text twice
            pytest.fail(failure, pytrace=False)
    return result
