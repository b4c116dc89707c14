"""A pytest plugin: the ``kvcanary_guard`` fixture fails a test whose canary recorded any violation.

Enable it in a ``conftest.py``::

    pytest_plugins = ["kvcanary_jax.testing.pytest_plugin"]

then wrap the test's step (or watch states by hand) with the fixture; see :class:`kvcanary_jax.testing.CanaryGuard`.
The check runs right after the test body, so a violation fails the test itself (not its teardown); a test that
already failed is not checked again.
"""

from __future__ import annotations

import pytest

from kvcanary_jax.testing._guard import CanaryGuard

_FIXTURE = "kvcanary_guard"


@pytest.fixture
def kvcanary_guard() -> CanaryGuard:
    """A :class:`CanaryGuard` checked when the test body returns."""
    return CanaryGuard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    guard = getattr(item, "funcargs", {}).get(_FIXTURE)
    if guard is not None:
        guard.check()
    return result
