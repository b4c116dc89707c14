"""The canary's Prometheus counters in a served sglang-jax engine (``--enable-metrics``).

The scheduler process counts; sglang-jax's HTTP front end serves ``/metrics`` from ``PROMETHEUS_MULTIPROC_DIR``
(``prometheus_client``'s multiprocess mode), which the engine sets before it starts the scheduler, so the counters
below appear there with the engine's own.

Every counter is exported from startup, at 0 until something happens, so an alert tells "no violation" from "no canary":

* ``kvcanary_violations_total``: every violation the canary counted (repeats and rows a full ring lost included).
* ``kvcanary_violations_by_kind_total{launch_tag, fail_reason}``: the same, by launch and reason.
* ``kvcanary_protected_tokens_total``: KV slots written or verified (all launch tags), read a few steps late.
* ``kvcanary_checks_total``: canary launches (writes, verifies, sweeps), read a few steps late.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_EVERY = 4  # steps between counter reads (each read is started async and taken at the next one)


def u64_total(pairs) -> int:
    """Sum of a ``u32[..., 2]`` (low, high) array of u64 counters."""
    pairs = np.asarray(pairs, np.uint64)
    return int(np.sum(pairs[..., 0] + (pairs[..., 1] << np.uint64(32))))


class CanaryMetrics:
    """The ``kvcanary_*`` counters, fed by the guard's step ends (``on_step_end``)."""

    def __init__(self):
        from prometheus_client import Counter

        self.total = Counter("kvcanary_violations", "KV-cache canary violations read from the ring")
        self.violations = Counter("kvcanary_violations_by_kind", "KV-cache canary violations by launch and reason",
                                  ["launch_tag", "fail_reason"])  # fmt: skip
        self.protected = Counter("kvcanary_protected_tokens", "KV slots the canary wrote or verified")
        self.checks = Counter("kvcanary_checks", "Canary launches (writes, verifies, sweeps)")
        self._seen = (0, 0)
        self._violations = 0
        self._inflight = None
        self._steps = 0

    def count_violations(self, observed: list, *, total: int) -> None:
        """``total``: the monitor's count over the whole run (repeats and rows a full ring lost included); the
        breakdown by kind counts the rows read."""
        self.total.inc(max(0, total - self._violations))
        self._violations = max(self._violations, total)
        for o in observed:
            v = o.violation
            self.violations.labels(launch_tag=v.tag_label, fail_reason="+".join(v.reason_labels)).inc()

    def after_step(self, state) -> None:
        """Every few steps: adds what the counters grew by as of the previous read, starts the next read."""
        self._steps += 1
        if self._steps % _EVERY:
            return
        if self._inflight is not None:
            self.flush()
        d = state.device
        self._inflight = (jnp.copy(d.slot_run_counters), jnp.copy(d.kernel_run_counters))
        for x in self._inflight:
            x.copy_to_host_async()

    def flush(self) -> None:
        """Adds the counters' growth as of the read in flight (blocks on it, if it is not home yet)."""
        if self._inflight is None:
            return
        slot, kernel = (u64_total(x) for x in jax.device_get(self._inflight))
        self.protected.inc(max(0, slot - self._seen[0]))
        self.checks.inc(max(0, kernel - self._seen[1]))
        self._seen, self._inflight = (slot, kernel), None
