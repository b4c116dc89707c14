"""No false positives over long mixed workloads, jitted and eager; jit and eager agree on violations bit for bit."""

import logging
import re

import chex
import numpy as np
import pytest

from kvcanary_jax import CanaryLaunchTag, FailReason, PoolKind, read_violations
from kvcanary_jax.demo import faults
from kvcanary_jax.testing import FaultKind, assert_no_violations
from tests.runtime.runner_testlib import counters, demo_setup, finish, run_steps, tiny_setup, violation_set

T = CanaryLaunchTag


class _Shapes:
    """Counts the step shapes a run exercised (a before_forward hook; it never changes the batch)."""

    def __init__(self):
        self.padding_rows = self.padding_tokens = 0

    def __call__(self, setup, batch):
        self.padding_rows += int(batch.num_reqs < len(batch.req_pool_indices))
        self.padding_tokens += int(batch.num_tokens < len(batch.input_ids))


def _check_clean(setup, steps: int, health_checks: list) -> None:
    assert_no_violations(setup.monitor.final_check(setup.canary_state))
    assert not setup.monitor.observed
    assert int(setup.canary_state.verify_overflows[0]) == 0
    interval = setup.canary.config.health_check_every_n_steps
    assert health_checks == list(range(interval, steps + 1, interval))


def _spy_health(setup) -> list:
    """Records the steps at which the watchdog checked (it raises if a check fails)."""
    checked, check = [], setup.monitor.watchdog.check

    def spy(kernel_run_counters, *, step):
        check(kernel_run_counters, step=step)
        checked.append(step)

    setup.monitor.watchdog.check = spy
    return checked


def test_demo_configuration_soak_300_steps_is_clean(caplog):
    """SWA model, spec extends, prefix reuse, eviction, sweeps, token oracle: 300 jitted steps, zero violations."""
    setup, shapes = demo_setup(seed=3), _Shapes()
    checked = _spy_health(setup)
    with caplog.at_level(logging.INFO, logger="kvcanary_jax.monitor"):
        setup.step(before_forward=shapes)
        setup.canary_state = setup.canary.mark_init_finished(setup.canary_state)
        run_steps(setup, 299, before_forward=shapes)
        _check_clean(setup, 300, checked)
    assert setup.traces <= 1 and setup.retraces == 0, "the jitted step retraced"
    stats = setup.scheduler.stats
    for key in (
        "prefix_hit_tokens",
        "evicted_slots",
        "chunked_prefill_rows",
        "spec_rows",
        "spec_rejected_tokens",
        "swa_window_freed",
        "decode_rows",
        "finished",
    ):
        assert stats[key] > 0, f"the workload never exercised {key}"
    assert (setup.scheduler.slot_allocator.alloc_counts > 1).any(), "no slot was reused"
    assert shapes.padding_rows > 0 and shapes.padding_tokens > 0
    run = counters(setup)
    for tag in setup.canary.launch_tags(("HEAD", "TAIL")):
        assert run[tag] == 600, tag  # a verify and a write per step, each counted under the endpoint's tag
    assert run[T.SWEEP_K_FULL] == run[T.SWEEP_K_SWA] == 75  # steps 1, 5, 9, ... (every sweep_interval=4)
    assert run[T.HEAD_V_FULL] == run[T.TAIL_V_SWA] == 0  # K half only, like SGLang's default
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[canary]")]
    assert len(lines) == 6 and re.fullmatch(
        r"\[canary\] step=300 protected_tokens=\d+ sweep_passes=75 violations=0 launch_tags_active=6/12", lines[-1]
    )


def test_tiny_full_pool_soak_300_steps_is_clean():
    """K and V halves, real-KV ALL, a tight pool: 300 jitted steps (compiled once, chex-asserted), zero violations."""
    setup = tiny_setup(seed=1)
    checked = _spy_health(setup)
    run_steps(setup, 2)
    setup.canary_state = setup.canary.mark_init_finished(setup.canary_state)  # a device flag: no retrace
    run_steps(setup, 298)
    _check_clean(setup, 300, checked)
    stats = setup.scheduler.stats
    assert stats["evicted_slots"] > 0 and stats["spec_rejected_tokens"] > 0 and stats["prefix_hit_tokens"] > 0
    assert counters(setup)[T.TAIL_V_FULL] == 600 and counters(setup)[T.SWEEP_V_FULL] == 100


LONG_SOAK_SEEDS, LONG_SOAK_STEPS = (11, 12, 13), 3000


@pytest.mark.soak
@pytest.mark.parametrize("seed", LONG_SOAK_SEEDS)
def test_long_soak_is_clean(seed):
    """9,000 jitted steps over three seeds of the tiny workload (with the suite's other runs, over 10^4): every
    check on, slots reused thousands of times, zero violations, one compile."""
    setup = tiny_setup(seed=seed)
    run_steps(setup, 1)
    setup.canary_state = setup.canary.mark_init_finished(setup.canary_state)
    run_steps(setup, LONG_SOAK_STEPS - 1)
    assert_no_violations(setup.monitor.final_check(setup.canary_state))
    assert int(setup.canary_state.verify_overflows[0]) == 0
    assert (setup.scheduler.slot_allocator.alloc_counts > 20).any(), "slots were not reused much"
    assert counters(setup)[T.TAIL_K_FULL] == 2 * LONG_SOAK_STEPS


EAGER_STEPS, EAGER_FAULT_AT = 9, 7


@pytest.fixture(scope="module")
def eager_and_jitted():
    """The same seeded run, eager and jitted: clean steps, then a req_to_token remap (chain/position) at step 7."""
    runs = {}
    for mode in ("eager", "jit"):
        setup = tiny_setup(seed=7, eager=mode == "eager")
        checked = _spy_health(setup)
        injector = faults.Injector(FaultKind.REQ_TO_TOKEN, PoolKind.FULL, EAGER_FAULT_AT, np.random.default_rng(0))
        run_steps(setup, 1)
        setup.canary_state = setup.canary.mark_init_finished(setup.canary_state)
        run_steps(setup, EAGER_FAULT_AT - 2)
        clean = read_violations(setup.canary_state.violation_log).write_index
        run_steps(setup, EAGER_STEPS - EAGER_FAULT_AT + 1, keep_going=True, **injector.hooks)
        finish(setup)
        runs[mode] = (setup, clean, checked, injector.injected_step)
    return runs


@pytest.mark.soak  # eager steps run op by op, each op its own program: a minute of CPU for 9 steps
def test_eager_run_is_clean_until_the_fault(eager_and_jitted):
    """Eager (un-jitted) steps are slow on CPU, so the eager soak is 6 steps, with one passing health check."""
    setup, clean, checked, injected = eager_and_jitted["eager"]
    assert clean == 0 and checked == [5] and injected == EAGER_FAULT_AT


@pytest.mark.soak
def test_jit_and_eager_agree_bit_for_bit(eager_and_jitted):
    eager, jit = eager_and_jitted["eager"][0], eager_and_jitted["jit"][0]
    chex.assert_trees_all_equal(eager.canary_state, jit.canary_state)
    report = read_violations(jit.canary_state.violation_log)
    assert report.is_errored
    first = report.first_violation
    assert first.launch_tag == T.HEAD_K_FULL and first.fail_reason & FailReason.VERIFY_POSITION_MISMATCH
    assert violation_set(eager) == violation_set(jit) and violation_set(jit)
