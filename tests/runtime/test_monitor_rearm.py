"""The monitor over a long run: re-arming the fill-once ring, repeats folded, flush, and unchecked steps named."""

import gc
import logging
import pathlib
import re
import subprocess
import sys
import textwrap

import chex
import jax
import numpy as np
import pytest

from kvcanary_jax import CanaryLaunchTag, CanaryMonitor, FailReason, KvCanaryHealthError, KvCanaryViolationError
from kvcanary_jax.core import _incidents
from kvcanary_jax.core._state import u64_pairs_as_int64
from kvcanary_jax.runtime import _ring_cursor
from tests.runtime.test_monitor import _append, _canary

T = CanaryLaunchTag
KV = FailReason.VERIFY_REAL_KV_HASH_MISMATCH
TOTAL = re.compile(r"total_violations=(\d+) ring_overflow=(\w+)")


def _row(slot: int, token: int, tag=T.TAIL_K_FULL) -> tuple:
    """A distinct row (its stored token) of a slot: never a repeat of another token's row."""
    return (tag, slot, 3, KV, token)


def _ring(state) -> tuple[int, list[int], np.ndarray]:
    """The ring as stored: write index, the stored token of every row (0 for an empty one), the context."""
    log = state.violation_log
    rows = u64_pairs_as_int64(log.violation_ring)
    return int(log.violation_write_index[0]), [int(t) for t in rows[:, 3]], np.asarray(log.violation_context)


def _warnings(caplog, logger: str = "kvcanary_jax.monitor") -> list[str]:
    """The WARNING messages ``logger`` wrote (not another monitor's, nor a collected one's of another test)."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == logger]


# ------------------------------------------------------------------------------------------------------ re-arm


def test_rearm_drops_the_rows_read_and_moves_the_unread_ones_down():
    canary = _canary(mode="log", check_lag_steps=0, ring_capacity=6)
    monitor = CanaryMonitor(canary, log=logging.getLogger("rearm"))
    state = _append(canary.init_state(), _row(1, 11), _row(2, 12), _row(3, 13))
    monitor.after_step(state)  # reads rows 0..2
    state = _append(state, _row(4, 14), _row(5, 15))  # the device is past what the monitor read
    state = monitor.rearm(state)
    index, tokens, context = _ring(state)
    assert (index, tokens) == (2, [14, 15, 0, 0, 0, 0]), "the read rows dropped, the unread moved to row 0"
    assert (context[2:] == -1).all(), "an empty row's context is the allocated one"
    assert monitor.total_violations == 3
    monitor.after_step(state)
    assert monitor.cursor.base == 3, "the rows re-arming removed from the device index"
    assert [o.violation.stored_token for o in monitor.observed] == [11, 12, 13, 14, 15]
    assert [o.row for o in monitor.observed] == [0, 1, 2, 0, 1]
    assert monitor.total_violations == 5 and monitor.final_check(state).write_index == 5


def test_a_log_mode_server_names_new_incidents_for_ever(caplog):
    """Capacity 2, one new fault a step for 12 steps: every one is named, totals climb; without re-arm, 2 are."""
    canary = _canary(mode="log", check_lag_steps=0, ring_capacity=2)
    rearmed, fill_once = CanaryMonitor(canary), CanaryMonitor(canary, log=logging.getLogger("fill-once"))
    state, plain = canary.init_state(), canary.init_state()
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        for step in range(12):
            state = _append(state, _row(step + 1, 100 + step))
            rearmed.after_step(state)
            state = rearmed.rearm(state)
            plain = _append(plain, _row(step + 1, 100 + step))
            fill_once.after_step(plain)
    messages = [m for m in _warnings(caplog) if m.startswith("kv-canary incident")]
    assert [int(re.match(r"kv-canary incident #(\d+)", m).group(1)) for m in messages] == list(range(1, 13))
    assert [int(TOTAL.search(m).group(1)) for m in messages] == list(range(1, 13)), "totals over every arm"
    assert all(TOTAL.search(m).group(2) == "False" for m in messages), "nothing was dropped"
    assert [o.violation.slot_idx for o in rearmed.observed] == list(range(1, 13))
    assert rearmed.total_violations == 12 and rearmed.dropped_violations == 0 and _ring(state)[0] == 0
    assert len(fill_once.observed) == 2 and fill_once.dropped_violations == 10
    report = rearmed.final_check(state)
    assert (report.write_index, report.is_errored, report.overflowed) == (12, True, False)
    assert report.first_violation.slot_idx == 1 and report.violations == ()


@pytest.mark.parametrize("lag", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_snapshots_staged_before_a_rearm_read_against_their_own_arm(lag, seed):
    """Random steps of 0-3 rows, a re-arm after every step. A ring of 24 rows, never full between two re-arms (at
    most lag + 4 steps of rows), gives the same rows, steps and totals as a ring that never fills (256 rows); a ring
    of 2 drops some, counts them, and reports the rest in order."""
    big = _canary(mode="log", check_lag_steps=lag, ring_capacity=256)
    reference = CanaryMonitor(big, log=logging.getLogger("big"))
    plain = big.init_state()
    rearmed = {cap: CanaryMonitor(_canary(mode="log", check_lag_steps=lag, ring_capacity=cap),
                                  log=logging.getLogger(f"ring{cap}")) for cap in (24, 2)}  # fmt: skip
    states = {cap: m.canary.init_state() for cap, m in rearmed.items()}
    rng, token, rearms = np.random.default_rng(seed), 0, 0
    for step in range(30):
        rows = []
        for _ in range(rng.integers(0, 4)):
            token += 1
            rows.append(_row(int(rng.integers(1, 32)), token))
        plain = _append(plain, *rows)
        reference.after_step(plain, step=step)
        for cap, monitor in rearmed.items():
            states[cap] = _append(states[cap], *rows)
            monitor.after_step(states[cap], step=step)
            before = states[cap]
            states[cap] = monitor.rearm(states[cap])
            rearms += cap == 24 and states[cap] is not before
    assert reference.final_check(plain).write_index == token > 30 and reference.dropped_violations == 0
    seen = lambda m: [(o.step, o.observed_step, o.user_step, o.violation) for o in m.observed]  # noqa: E731
    exact, small = rearmed[24], rearmed[2]
    assert exact.final_check(states[24]).write_index == exact.total_violations == token
    assert seen(exact) == seen(reference) and exact.dropped_violations == 0 and rearms > 5
    assert small.final_check(states[2]).write_index == small.total_violations == token
    assert small.dropped_violations > 0 and len(small.observed) + small.dropped_violations == token
    tokens = [o.violation.stored_token for o in small.observed]
    assert tokens == sorted(tokens) and set(tokens) < {o.violation.stored_token for o in reference.observed}


def test_rows_a_full_ring_dropped_are_counted_and_reported_as_dropped(caplog):
    canary = _canary(mode="log", check_lag_steps=0, ring_capacity=2)
    monitor = CanaryMonitor(canary)
    state = canary.init_state()
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        # Dropped between two reads: 5 rows, 3 past the ring.
        state = _append(state, *[_row(s, s) for s in range(1, 6)])
        monitor.after_step(state)
        assert "3 more violation(s) at step=1 were dropped" in _warnings(caplog)[-1]
        state = monitor.rearm(state)
        assert _ring(state)[:2] == (0, [0, 0])
        # Dropped after the last read, before the re-arm: the ring holds row 6, not 7 and 8, when it is re-armed.
        state = _append(state, _row(6, 6))
        monitor.after_step(state)
        state = _append(state, _row(7, 7), _row(8, 8), _row(9, 9))
        state = monitor.rearm(state)
        assert _ring(state)[:2] == (1, [7, 0]), "the unread row 7 kept, 8 and 9 had no row"
        caplog.clear()
        monitor.after_step(state)  # reads the re-arm's lost count, then row 7
    messages = _warnings(caplog)
    assert [o.violation.slot_idx for o in monitor.observed] == [1, 2, 6, 7]
    assert "2 more violation(s) at step=3 were dropped" in messages[-1]
    assert monitor.total_violations == 9 and monitor.dropped_violations == 5
    assert TOTAL.search(messages[0]).groups() == ("9", "True")
    report = monitor.final_check(state)
    assert (report.write_index, report.overflowed, report.ring_valid_count) == (9, True, 1)


def test_rearm_with_nothing_read_is_the_state_itself_and_launches_nothing(monkeypatch):
    canary = _canary(mode="log", check_lag_steps=2)
    monitor = CanaryMonitor(canary)
    launches = []
    real = _ring_cursor.drain
    monkeypatch.setattr(_ring_cursor, "drain", lambda *a: launches.append(1) or real(*a))
    state = _append(canary.init_state(), _row(1, 1))
    assert monitor.rearm(state) is state  # nothing read
    monitor.after_step(state)
    monitor.after_step(state)
    assert monitor.rearm(state) is state and launches == []  # step 1 not read yet (lag 2)
    monitor.after_step(state)  # reads step 1's snapshot: one row
    state = monitor.rearm(state)
    assert launches == [1]
    assert monitor.rearm(state) is state, "a second re-arm waits for a read of the new arm"
    off = CanaryMonitor(_canary(mode="off", sweep_interval=0))
    quiet = off.canary.init_state()
    off.after_step(quiet)
    assert off.rearm(quiet) is quiet and launches == [1]


def test_rearm_traces_once_and_donates_the_old_ring(monkeypatch):
    _ring_cursor.drain.clear_cache()
    canary = _canary(mode="log", check_lag_steps=0, ring_capacity=8)
    monitor, state = CanaryMonitor(canary, log=logging.getLogger("traces")), canary.init_state()
    for step in range(4):  # n = 1, 2, 3, 1: one program
        state = _append(state, *[_row(step + 1, 10 * step + k) for k in range(step % 3 + 1)])
        monitor.after_step(state)
        old, state = state, monitor.rearm(state)
    assert _ring_cursor.drain._cache_size() == 1
    with pytest.raises(ValueError, match=r"state was donated to an earlier step and its buffers are gone"):
        monitor.after_step(old)  # the ring was donated: re-arming copied nothing
    # The same through chex: the drain the monitor calls traces once whatever n.
    monkeypatch.setattr(
        _ring_cursor, "drain", jax.jit(chex.assert_max_traces(_ring_cursor._drain, n=1), donate_argnums=0)
    )
    canary = _canary(mode="log", check_lag_steps=0, ring_capacity=8)
    monitor = CanaryMonitor(canary, log=logging.getLogger("traces"))
    state = canary.init_state()
    for step in range(6):  # a different n each time: traced, not static
        state = _append(state, *[_row(step + 1, 10 * step + k) for k in range(step % 3 + 1)])
        monitor.after_step(state)
        state = monitor.rearm(state)
    assert monitor.total_violations == 1 + 2 + 3 + 1 + 2 + 3


# ------------------------------------------------------------------------------------------------------ repeats


def test_a_row_repeated_every_step_is_counted_not_logged(caplog):
    """A swapped request re-verified every step: its K and V rows come back unchanged; one incident, logged once."""
    canary = _canary(mode="log", check_lag_steps=0)
    monitor = CanaryMonitor(canary)
    state = canary.init_state()
    same = [_row(5, 42, T.TAIL_K_FULL), _row(5, 42, T.TAIL_V_FULL)]
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        for _ in range(4):
            state = _append(state, *same[::-1] if monitor.step % 2 else same)  # the tags' order does not matter
            monitor.after_step(state)
        assert len(_warnings(caplog)) == 1 and len(monitor.observed) == 8
        (incident,) = monitor.incidents.incidents
        assert (incident.rows, incident.repeats, monitor.repeats) == (8, 6, 6)
        state = _append(state, _row(5, 43))  # the slot's contents changed again: news, logged with the count
        monitor.after_step(state)
    assert _warnings(caplog)[-1] == (
        "kv-canary incident #1: 1 more row(s) at step 5 (9 in all, 6 repeat(s) not shown): the same fault, "
        "already reported"
    )
    raising = CanaryMonitor(_canary(mode="raise", check_lag_steps=0))
    state = _append(_canary().init_state(), *same)
    with pytest.raises(KvCanaryViolationError):
        raising.after_step(state)
    raising.after_step(_append(state, *same))  # only repeats: no second raise
    assert raising.repeats == 2


def test_repeats_are_remembered_within_a_bound(monkeypatch):
    monkeypatch.setattr(_incidents, "_MAX_REMEMBERED", 2)
    tracker = _incidents.Incidents(fold_repeats=True)
    rows = {t: _decoded(slot=t, token=t) for t in (1, 2, 3)}
    for step, t in enumerate((1, 2, 1, 3, 2, 1)):
        tracker.add([rows[t]], step=step)
    # 1 and 2 remembered; 1 again: a repeat, now the newest; 3 pushes out 2; 2 again: shown, pushes out 1; 1: shown.
    assert tracker.repeats == 1 and len(tracker._placed_before) == 2
    plain = _incidents.Incidents()
    plain.add([rows[1]], step=0)
    assert plain.add([rows[1]], step=1) != [] and plain.repeats == 0, "folding is opt-in"


def _decoded(slot: int, token: int):
    from kvcanary_jax.core._report import Violation

    return Violation(T.TAIL_K_FULL, slot, 3, token, -1, 0, 0, KV)


# -------------------------------------------------------------------------------- flush, exit and lost checks


def test_flush_reads_every_staged_step_and_runs_no_health_check(caplog):
    canary = _canary(mode="log", check_lag_steps=3, health_check_every_n_steps=2)
    monitor = CanaryMonitor(canary)
    state = canary.init_state()
    twin = CanaryMonitor(canary, log=logging.getLogger("twin"))
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        for step in range(3):  # nothing launched: step 2's health check names every tag
            state = _append(state, _row(step + 1, step))
            monitor.after_step(state)
            twin.after_step(state)
        assert monitor.observed == [] and monitor.unchecked_steps == 3
        report = monitor.flush(state)  # an idle server: reads steps 1-3 now, no health check
    assert [o.violation.slot_idx for o in monitor.observed] == [1, 2, 3] and monitor.unchecked_steps == 0
    assert report.write_index == 3 and len(_warnings(caplog)) == 3
    twin.after_step(state)  # step 4 reads step 1
    with pytest.raises(KvCanaryHealthError, match=r"at step=2; canary path is not executing"):
        twin.after_step(state)  # step 5 reads step 2 and checks health
    shutdown = CanaryMonitor(canary, log=logging.getLogger("twin"))
    for _ in range(3):
        shutdown.after_step(state)
    with pytest.raises(KvCanaryHealthError, match=r"at step=2; canary path is not executing"):
        shutdown.final_check(state)  # at shutdown the staged steps get the checks after_step would have given


def test_leaving_the_with_block_with_unread_steps_names_them(caplog):
    canary = _canary(mode="log", check_lag_steps=4)
    state = canary.init_state()
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        with CanaryMonitor(canary, log=logging.getLogger("exit")) as monitor:
            for _ in range(3):
                monitor.after_step(state)
        assert _warnings(caplog, "exit") == ["kv-canary: 3 step(s) never checked; call final_check(state)"]
        del monitor
        gc.collect()
        assert len(_warnings(caplog, "exit")) == 1, "named once, not again when collected"
        caplog.clear()
        with CanaryMonitor(canary, log=logging.getLogger("exit")) as monitor:
            monitor.after_step(state)
            monitor.final_check(state)
        del monitor
        gc.collect()
    assert _warnings(caplog, "exit") == []


def test_a_collected_monitor_with_unread_steps_names_them(caplog):
    canary = _canary(mode="log", check_lag_steps=4)
    monitor = CanaryMonitor(canary, log=logging.getLogger("collected"))
    monitor.after_step(canary.init_state())
    monitor.after_step(canary.init_state())
    with caplog.at_level(logging.WARNING):
        del monitor
        gc.collect()
    assert _warnings(caplog, "collected") == [
        "kv-canary: 2 step(s) never checked; call final_check(state) (the monitor was dropped or the interpreter "
        "exited)"
    ]


def test_the_interpreter_exiting_with_unread_steps_names_them():
    script = textwrap.dedent(
        """
        from tests.runtime.test_monitor import _canary
        from kvcanary_jax import CanaryMonitor
        canary = _canary(mode="log", check_lag_steps=4)
        monitor = CanaryMonitor(canary)
        monitor.after_step(canary.init_state())
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    assert "kv-canary: 1 step(s) never checked; call final_check(state)" in done.stderr
