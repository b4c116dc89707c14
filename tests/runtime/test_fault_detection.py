"""Every fault kind, many random instances: caught first by the right launch, with the right bit, on time."""

import collections

import pytest

from kvcanary_jax.demo import faults
from kvcanary_jax.testing import FaultKind, expected_detection

# Each case runs the demo for many steps: optimised code costs less here than the quicker compile saves.
pytestmark = pytest.mark.usefixtures("xla_optimised")

CASES = faults.FAULT_RUNS
SEEDS = range(12)


@pytest.mark.parametrize("kind,group", CASES, ids=[f"{k.value}-{g.name}" for k, g in CASES])
def test_every_instance_is_detected_by_the_expected_launch(kind, group):
    """12 seeds x varied injection steps per case: 100% caught (``RunResult.ok`` checks tag, bits and timing)."""
    tag, _, after = expected_detection(kind, group)
    delays = collections.Counter()
    for seed in SEEDS:
        result = faults.run(kind, group=group, seed=seed, inject_at=6 + 3 * seed, max_steps=70)
        assert result.ok, result
        assert result.launch_tag == tag.name and result.injected_step >= 6 + 3 * seed
        delays[result.detected_step - result.injected_step] += 1
    if kind is not FaultKind.IDLE_CACHE_KV:
        assert delays == {after: len(SEEDS)}
    else:  # injected only on a sweep step, right before that sweep
        assert delays == {0: len(SEEDS)}


def test_clean_runs_stay_clean():
    for seed in range(3):
        result = faults.run(None, seed=seed, max_steps=80)
        assert result.ok and result.detected_step is None, result
