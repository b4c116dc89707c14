"""``CanaryGuard``: remembers the newest canary state a test's steps produce, and asserts it stayed silent."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvcanary_jax.core._state import CanaryDeviceState, ViolationLog
from kvcanary_jax.runtime._batch import CanaryState
from kvcanary_jax.testing import _assertions
from pallas_kernels import validate

_STATES = (CanaryState, CanaryDeviceState)


class CanaryGuard:
    """Watches a test's canary states; :meth:`check` fails if any of them recorded a violation.

    The ring is fill-once and its index only grows, so the newest state of each canary says everything (unless a
    :class:`~kvcanary_jax.CanaryMonitor` re-armed it: ``rearm`` drops the rows that monitor read, so check the
    monitor's ``total_violations`` there). The guard
    keeps an on-device copy of that state's violation log (a step usually donates its state to the next one),
    which costs no host sync.

    Example::

        def test_decode(kvcanary_guard):
            step = kvcanary_guard.wrap(jitted_step)   # every CanaryState it returns is watched
            for batch in batches:
                logits, kv, state = step(params, kv, state, batch)
        # the test fails here if the canary recorded anything
    """

    def __init__(self):
        self._logs: dict[int, ViolationLog] = {}

    def watch(self, state: Any, *, key: int = 0) -> Any:
        """Remembers ``state``'s violation log (for canary ``key``) and returns ``state`` unchanged.

        Args:
          state: a :class:`CanaryState` or :class:`CanaryDeviceState` (single-device or per-device).
          key: tells several canaries of one test apart.
        """
        validate.instance("state", state, _STATES, what="CanaryState or CanaryDeviceState")
        if not validate.is_int(key):
            raise TypeError(f"key must be an int (one per canary of the test); got key={key!r}")
        log = state.violation_log
        self._logs[key] = jax.tree.map(jnp.copy, log)
        return state

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` unchanged, except that every canary state in its outputs is watched (in output order)."""
        if not callable(step):
            raise TypeError(f"step must be callable (the jitted step); got {type(step).__name__}")

        @functools.wraps(step)
        def watched(*args, **kwargs):
            out = step(*args, **kwargs)
            states = [
                x for x in jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, _STATES)) if isinstance(x, _STATES)
            ]
            for key, state in enumerate(states):
                self.watch(state, key=key)
            return out

        return watched

    @property
    def watched(self) -> int:
        """How many canaries the guard has seen a state of."""
        return len(self._logs)

    def check(self) -> None:
        """Asserts that no watched state recorded a violation (a host sync).

        Raises:
          AssertionError: with the first violation's log line and the total count.
        """
        for log in self._logs.values():
            _assertions.assert_no_violations(log)
