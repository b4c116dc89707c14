"""Host-side liveness watchdog (a launch tag that stopped running) and the periodic stats line."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcanary_jax.core import _constants as constants
from kvcanary_jax.core._constants import CanaryLaunchTag


class KvCanaryHealthError(RuntimeError):
    """A launch tag's kernel-run counter did not grow between two checks: the canary path is not executing."""


class HealthWatchdog:
    """SGLang's ``KernelRunCounterHealthChecker``: every expected tag must have launched since the last check.

    It raises in every mode, ``log`` included: a silent canary is worse than none.
    """

    def __init__(self, expected_tags: Sequence[CanaryLaunchTag]):
        self.expected_tags = tuple(expected_tags)
        self._previous = np.zeros(constants.NUM_LAUNCH_TAGS, np.int64)

    def check(self, kernel_run_counters: np.ndarray, *, step: int) -> None:
        """Compares ``int64[num_tags]`` counters with the previous check's.

        Raises:
          KvCanaryHealthError: naming the tags that did not run.
        """
        counters = np.asarray(kernel_run_counters, np.int64)
        stalled = [t.name for t in self.expected_tags if counters[t] <= self._previous[t]]
        self._previous = counters.copy()
        if stalled:
            raise KvCanaryHealthError(
                f"kv-canary: kernel_run_counter did not increase since previous check for tags={stalled} at "
                f"step={step}; canary path is not executing"
            )


def stats_line(*, step: int, kernel_run_counters: np.ndarray, slot_run_counters: np.ndarray, write_index: int) -> str:
    """SGLang's periodic INFO line; protected_tokens counts slot verifications plus writes over all tags."""
    kernel = np.asarray(kernel_run_counters, np.int64)
    sweeps = int(kernel[CanaryLaunchTag.SWEEP_K_FULL])
    active = int(np.count_nonzero(kernel))
    return (
        f"[canary] step={step} protected_tokens={int(np.sum(slot_run_counters))} sweep_passes={sweeps} "
        f"violations={write_index} launch_tags_active={active}/{constants.NUM_LAUNCH_TAGS}"
    )
