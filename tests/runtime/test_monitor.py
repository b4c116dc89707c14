"""The host monitor: lagged non-blocking reads, log and raise modes, final check, health watchdog, stats."""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcanary_jax import (
    CanaryLaunchTag,
    CanaryMonitor,
    FailReason,
    KvCanary,
    KvCanaryHealthError,
    KvCanaryViolationError,
)
from kvcanary_jax.core import _report as report
from kvcanary_jax.demo import model
from kvcanary_jax.runtime import _monitor
from tests.runtime.runner_testlib import TINY_CANARY, TINY_CONFIG, demo_setup, run_steps, tiny_setup

T = CanaryLaunchTag
FIRST_LINE = re.compile(
    r"^kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(\d+) position=(\d+) ", re.MULTILINE
)


def _canary(**overrides) -> KvCanary:
    quiet = {"health_check_every_n_steps": 0, "stats_every_n_steps": 0}
    return KvCanary(dataclasses.replace(TINY_CONFIG, **{**quiet, **overrides}), TINY_CANARY.pool)


def _append(state, *rows):
    """The state with ``rows`` of (tag, slot, position, bits[, stored token = 7]) appended to the ring, fill-once, as
    a launch would."""
    log = state.violation_log
    index, capacity = int(log.violation_write_index[0]), log.ring_capacity
    ring = np.asarray(log.violation_ring).copy()
    for i, (tag, slot, position, bits, *token) in enumerate(rows):
        if index + i < capacity:
            fields = [tag, slot, position, token[0] if token else 7, -1, 0, 0, bits]
            ring[index + i] = np.array(fields, np.int64).view(np.uint32).reshape(8, 2)
    log = dataclasses.replace(
        log, violation_ring=jnp.asarray(ring), violation_write_index=jnp.full((1,), index + len(rows), jnp.int32)
    )
    return dataclasses.replace(state, device=dataclasses.replace(state.device, violation_log=log))


def _bump(state, tags, by=1):
    """The state with the kernel-run counters of ``tags`` increased (a stand-in for launches)."""
    counters = np.asarray(state.device.kernel_run_counters).copy()
    for tag in tags:
        counters[tag, 0] += by
    return dataclasses.replace(
        state, device=dataclasses.replace(state.device, kernel_run_counters=jnp.asarray(counters))
    )


@pytest.fixture
def pulls(monkeypatch):
    """Counts ring pulls (``read_violations`` calls made by the monitor)."""
    calls = []
    real = report.read_violations
    monkeypatch.setattr(report, "read_violations", lambda log: calls.append(1) or real(log))
    return calls


def test_reads_lag_behind_and_the_ring_is_pulled_only_when_the_index_grew(pulls, caplog):
    canary = _canary(mode="log", check_lag_steps=3)
    monitor, state = CanaryMonitor(canary), canary.init_state()
    with caplog.at_level(logging.WARNING):
        monitor.after_step(state)  # step 1: clean
        state = _append(
            state,
            (T.TAIL_K_FULL, 5, 3, FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
            (T.TAIL_V_FULL, 5, 3, FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
        )
        for _ in range(3):  # steps 2..4: step 2 wrote two rows, but its snapshot is read at step 5
            monitor.after_step(state)
        assert monitor.observed == [] and pulls == []
        monitor.after_step(state)  # step 5
        assert [(o.step, o.observed_step, o.row) for o in monitor.observed] == [(2, 5, 0), (2, 5, 1)]
        assert len(pulls) == 1
        for _ in range(4):  # steps 6..9: no growth, no pull
            monitor.after_step(state)
        assert len(pulls) == 1
        state = _append(state, (T.SWEEP_K_FULL, 9, 1, FailReason.VERIFY_CHAIN_HASH_MISMATCH))
        for _ in range(4):  # step 10 wrote one row; read at step 13
            monitor.after_step(state)
    assert len(pulls) == 2 and [(o.step, o.observed_step) for o in monitor.observed][-1] == (10, 13)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2, "log mode: one WARNING per incident (slot 5's K and V rows are one)"
    assert messages[0].startswith("kv-canary incident #1: verify_real_kv_hash (TAIL_K_FULL) at request unknown, ")
    assert FIRST_LINE.search(messages[0]).groups() == ("TAIL_K_FULL", "verify_real_kv_hash", "5", "3")
    assert FIRST_LINE.search(messages[1]).groups() == ("SWEEP_K_FULL", "verify_chain_hash", "9", "1")
    assert "step_when_pumped=13" in messages[1] and "total_violations=3" in messages[1]


def test_lag_zero_reads_every_step():
    canary = _canary(mode="log", check_lag_steps=0)
    monitor = CanaryMonitor(canary)
    monitor.after_step(_append(canary.init_state(), (T.HEAD_K_FULL, 1, 0, FailReason.WRITE_TOKEN_MISMATCH)))
    assert [(o.step, o.observed_step) for o in monitor.observed] == [(1, 1)]


def test_raise_mode_raises_once_per_new_batch_of_violations():
    canary = _canary(mode="raise", check_lag_steps=1)
    monitor, state = CanaryMonitor(canary), canary.init_state()
    state = _append(state, (T.HEAD_K_FULL, 4, 2, FailReason.VERIFY_POSITION_MISMATCH))
    monitor.after_step(state)  # step 1 wrote it; read at step 2
    with pytest.raises(KvCanaryViolationError) as caught:
        monitor.after_step(state)
    err = caught.value
    assert err.report.write_index == 1 and err.report.first_violation.slot_idx == 4
    assert FIRST_LINE.search(str(err)).groups() == ("HEAD_K_FULL", "verify_position", "4", "2")
    assert [(i.number, i.rows, i.root.slot_idx) for i in err.incidents] == [(1, 1, 4)]
    monitor.after_step(state)  # nothing new: no second raise
    assert monitor.final_check(state).write_index == 1


def test_final_check_is_blocking_and_reads_what_the_lag_still_hides(caplog):
    canary = _canary(mode="log", check_lag_steps=4)
    monitor, state = CanaryMonitor(canary), canary.init_state()
    monitor.after_step(state)
    state = _append(state, (T.TAIL_K_FULL, 3, 1, FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
    monitor.after_step(state)
    assert monitor.observed == []
    with caplog.at_level(logging.WARNING):
        final = monitor.final_check(state)
    assert final.write_index == 1 and [(o.step, o.observed_step) for o in monitor.observed] == [(2, 2)]
    assert len(caplog.records) == 1
    raising = CanaryMonitor(_canary(mode="raise", check_lag_steps=4))
    with pytest.raises(KvCanaryViolationError):
        raising.final_check(state)


def test_ring_overflow_is_reported_without_detail(caplog):
    canary = _canary(mode="log", check_lag_steps=0, ring_capacity=2)
    monitor, state = CanaryMonitor(canary), canary.init_state()
    rows = [(T.TAIL_K_FULL, s, 0, FailReason.VERIFY_REAL_KV_HASH_MISMATCH) for s in (1, 2, 3, 4)]
    with caplog.at_level(logging.WARNING):
        monitor.after_step(_append(state, *rows))
    messages = [r.getMessage() for r in caplog.records]
    assert len(monitor.observed) == 2 and len(messages) == 3  # two incidents (slots 1, 2) and the dropped count
    assert "ring_overflow=True" in messages[0] and "2 more violation(s) at step=1 were dropped" in messages[2]


def test_plan_overflow_is_warned(caplog):
    canary = _canary(mode="log", check_lag_steps=0)
    monitor, state = CanaryMonitor(canary), canary.init_state()
    with caplog.at_level(logging.WARNING):
        monitor.after_step(dataclasses.replace(state, verify_overflows=jnp.ones((1,), jnp.int32)))
    assert "verify skipped 1 time(s) due to overflow" in caplog.records[0].getMessage()


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_watchdog_fires_in_every_mode_when_a_tag_stops(mode):
    canary = _canary(mode=mode, check_lag_steps=1, health_check_every_n_steps=2)
    expected = canary.launch_tags()
    assert T.SWEEP_V_FULL in expected and T.HEAD_K_SWA not in expected
    monitor, state = CanaryMonitor(canary), canary.init_state()
    for _ in range(4):  # checks at steps 2 and 4 (read one step later) pass: everything ran
        state = _bump(state, expected)
        monitor.after_step(state)
    stalled = [t for t in expected if t is not T.TAIL_V_FULL]
    state = _bump(state, stalled)
    monitor.after_step(state)  # step 5 reads step 4: fine
    state = _bump(state, stalled)
    monitor.after_step(state)  # step 6
    with pytest.raises(KvCanaryHealthError, match=r"tags=\['TAIL_V_FULL'\] at step=6; canary path is not executing"):
        monitor.after_step(state)  # step 7 reads step 6: TAIL_V_FULL did not run in steps 5-6


def test_off_mode_is_inert():
    canary = KvCanary(dataclasses.replace(TINY_CONFIG, mode="off", sweep_interval=0), TINY_CANARY.pool)
    monitor, state = CanaryMonitor(canary), canary.init_state()
    assert canary.launch_tags() == () and state.full is None and not monitor.sweep_due
    for _ in range(12):
        monitor.after_step(state)
    assert monitor.step == 12 and monitor.final_check(state).write_index == 0


def test_sweep_schedule_is_first_step_then_every_interval():
    monitor = CanaryMonitor(_canary(sweep_interval=3))
    due = []
    for _ in range(10):
        due.append(monitor.sweep_due)
        monitor.step += 1
    assert due == [True, False, False, True, False, False, True, False, False, True]


def test_watchdog_catches_a_dropped_sweep_in_the_demo():
    """The host forgets to launch sweeps: the first health check (step 20) names both SWEEP tags."""
    setup = demo_setup(seed=4)
    setup.sweep_fn = lambda state, plan, kv_cache: state
    with pytest.raises(KvCanaryHealthError, match=r"tags=\['SWEEP_K_FULL', 'SWEEP_K_SWA'\] at step=20"):
        run_steps(setup, 25)


def test_watchdog_catches_a_step_that_drops_the_tail_launches():
    """A step that forgets ``after_forward`` fails its first health check."""
    setup = tiny_setup(seed=2)
    canary = setup.canary

    @jax.jit  # one compile: run op by op, the phase took about 1.6x its CPU time
    def head_only_step(params, kv_cache, canary_state, batch):
        canary_state = canary.before_forward(canary_state, batch.canary())
        logits, kv_cache = model.forward(params, kv_cache, batch)
        return jnp.argmax(logits, -1), logits, kv_cache, canary_state

    setup.step_fn = head_only_step
    with pytest.raises(KvCanaryHealthError, match=r"tags=\['TAIL_K_FULL', 'TAIL_V_FULL'\] at step=5"):
        run_steps(setup, 6)


@pytest.mark.parametrize("verbose", [False, True])
def test_a_slot_already_reported_shows_again_only_as_a_count(caplog, verbose):
    canary = _canary(mode="log", check_lag_steps=0)
    monitor, state = CanaryMonitor(canary, verbose=verbose), canary.init_state()
    with caplog.at_level(logging.WARNING):
        for token in range(3):  # the slot fails again at every step that reads it, each time with other contents
            flip = [(tag, 5, 3, FailReason.VERIFY_REAL_KV_HASH, token) for tag in (T.TAIL_K_FULL, T.TAIL_V_FULL)]
            state = _append(state, *flip)
            monitor.after_step(state, step=100 + monitor.step)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and len(monitor.observed) == 6, "one message per step, every row kept"
    assert messages[0].startswith(
        "kv-canary incident #1: verify_real_kv_hash (TAIL_K_FULL) at request unknown, position 3, slot 5 (FULL), "
        "written at step 100\n"
    )
    count = "kv-canary incident #1: 2 more row(s) at step 101 (4 in all): the same fault, already reported"
    assert messages[1].splitlines()[0] == count and (messages[1] == count) is not verbose
    raw = [m for m in messages if FIRST_LINE.search(m)]
    assert len(raw) == (3 if verbose else 1)
    assert ("  incident: same fault of #1 (root: request unknown, position 3, slot 5 (FULL))" in messages[2]) is verbose
    with pytest.raises(TypeError, match=r"verbose must be a bool; got verbose=1"):
        CanaryMonitor(canary, verbose=1)


# ------------------------------------------------------------------------- a snapshot the step's own jit returns


def _random_step(state, rng, launch_tags):
    """The state after a random step: 0-2 violation rows appended, random launch counts, maybe an overflow."""
    tags = [launch_tags[i] for i in rng.choice(len(launch_tags), size=rng.integers(1, 4), replace=False)]
    rows = [(tag, int(rng.integers(0, 32)), int(rng.integers(0, 8)), FailReason.VERIFY_CHAIN_HASH_MISMATCH)
            for tag in tags[: rng.integers(0, 3)]]  # fmt: skip
    state = _bump(_append(state, *rows), tags, by=int(rng.integers(1, 5)))
    overflows = state.verify_overflows + int(rng.integers(0, 2))
    return dataclasses.replace(state, verify_overflows=overflows)


def test_a_snapshot_from_the_steps_jit_is_the_one_the_monitor_takes():
    """Layout (hand-decoded), equality with the monitor's own launch, and the same reports step by step."""
    rng = np.random.default_rng(7)
    canary = _canary(mode="log", check_lag_steps=1)
    snapshot = jax.jit(CanaryMonitor.snapshot)
    state = _random_step(canary.init_state(), rng, canary.launch_tags())
    words = lambda shape: rng.integers(0, 2**31, size=shape, dtype=np.uint32)  # noqa: E731  (hi < 2**31: int64)
    kernel, slot = words(state.device.kernel_run_counters.shape), words(state.device.slot_run_counters.shape)
    device = dataclasses.replace(state.device, kernel_run_counters=jnp.asarray(kernel),
                                 slot_run_counters=jnp.asarray(slot))  # fmt: skip
    state = dataclasses.replace(state, device=device)
    values = np.asarray(snapshot(state))
    as_ints = lambda pairs: [int(lo) + (int(hi) << 32) for lo, hi in pairs]  # noqa: E731  (u32 (lo, hi) pairs)
    assert values.dtype == np.int32 and values.shape == (_monitor.SNAPSHOT_SIZE,)
    index, overflows, got_kernel, got_slot = _monitor._unpack(values)
    assert (index, overflows) == (int(state.violation_log.violation_write_index[0]), int(state.verify_overflows[0]))
    assert list(got_kernel) == as_ints(kernel) and list(got_slot) == as_ints(slot)
    np.testing.assert_array_equal(values, np.asarray(CanaryMonitor._take_snapshot(state)))

    own, handed = CanaryMonitor(canary, log=logging.getLogger("own")), CanaryMonitor(canary, log=logging.getLogger("h"))
    state = canary.init_state()
    for step in range(8):
        state = _random_step(state, rng, canary.launch_tags())
        own.after_step(state, step=step)
        handed.after_step(state, step=step, snapshot=snapshot(state))
    assert own.final_check(state).write_index == handed.final_check(state).write_index > 4
    seen = lambda m: [(o.step, o.observed_step, o.row, o.violation) for o in m.observed]  # noqa: E731
    assert seen(handed) == seen(own) and len(own.observed) > 4
    assert handed._overflows == own._overflows > 0


def test_after_step_names_a_bad_snapshot():
    canary = _canary(mode="log")
    monitor, state = CanaryMonitor(canary), canary.init_state()
    good = jax.jit(CanaryMonitor.snapshot)(state)
    assert _monitor.SNAPSHOT_SIZE == 50  # index, overflows, two u64 tables of 12 tags
    for bad, error, pattern in [
        (np.asarray(good), TypeError, r"snapshot must be the concrete jax.Array CanaryMonitor.snapshot\(state\) "
                                      r"returned from the step's jit \(or None\); got ndarray"),
        (good[:-1], ValueError, r"snapshot must be i32\[50\] \(CanaryMonitor.snapshot\(state\)\); got int32\[49\]"),
        (good.astype(jnp.uint32), ValueError, r"got uint32\[50\]"),
        (good[None], ValueError, r"got int32\[1, 50\]"),
    ]:  # fmt: skip
        with pytest.raises(error, match=pattern):
            monitor.after_step(state, snapshot=bad)
    with pytest.raises(TypeError, match=r"got DynamicJaxprTracer"):  # after_step is host code, not for inside a jit
        jax.jit(lambda s: monitor.after_step(state, snapshot=s))(good)
    donated = jax.jit(lambda x: x + 1, donate_argnums=0)
    gone = jnp.array(good)
    donated(gone)
    with pytest.raises(ValueError, match=r"snapshot was deleted \(donated to a jit\?\)"):
        monitor.after_step(state, snapshot=gone)
    assert monitor.step == 0  # refused calls count no step
    monitor.after_step(state, snapshot=good)
    assert monitor.step == 1
