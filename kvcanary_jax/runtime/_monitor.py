"""Host monitor: lagged, non-blocking reads of the violation count; log or raise; health watchdog; stats lines."""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core import _constants, _incidents, _report
from kvcanary_jax.core._constants import CanaryMode
from kvcanary_jax.core._state import u64_pairs_as_int64
from kvcanary_jax.runtime import _health, _ring_cursor, _validate
from kvcanary_jax.runtime._batch import CanaryState
from kvcanary_jax.runtime._canary import KvCanary
from pallas_kernels import validate

logger = logging.getLogger("kvcanary_jax.monitor")  # a stable name users filter on, whatever the module path

SNAPSHOT_SIZE = 2 + 2 * _constants.NUM_LAUNCH_TAGS * 2  # index, overflows, then both u64 counter tables as i32 words


def _pack(write_index, verify_overflows, kernel_run_counters, slot_run_counters) -> jax.Array:
    """i32[SNAPSHOT_SIZE]: what the host polls, in the layout :func:`_unpack` reads (pure, traceable)."""
    as_i32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32).reshape(-1)  # noqa: E731
    return jnp.concatenate([write_index, verify_overflows, as_i32(kernel_run_counters), as_i32(slot_run_counters)])


# A fresh copy in a launch of its own, so the state itself can be donated to the next step.
_snapshot = jax.jit(_pack)


def _polled(state: CanaryState) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The state's leaves the monitor polls, in :func:`_pack`'s order."""
    d = state.device
    return d.violation_log.violation_write_index, state.verify_overflows, d.kernel_run_counters, d.slot_run_counters


def _unpack(values: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
    counters = values[2:].view(np.uint32).reshape(2, _constants.NUM_LAUNCH_TAGS, 2)
    kernel, slot = u64_pairs_as_int64(counters[0]), u64_pairs_as_int64(counters[1])
    return int(values[0]), int(values[1]), kernel, slot


def _check_snapshot(snapshot) -> None:
    """What ``after_step`` accepts as a snapshot: a concrete, live i32[SNAPSHOT_SIZE] jax.Array."""
    if not isinstance(snapshot, jax.Array) or isinstance(snapshot, jax.core.Tracer):
        raise TypeError(
            "snapshot must be the concrete jax.Array CanaryMonitor.snapshot(state) returned from the step's jit (or "
            f"None); got {type(snapshot).__name__}: snapshot={snapshot!r}"
        )
    if snapshot.shape != (SNAPSHOT_SIZE,) or snapshot.dtype != jnp.int32:
        raise ValueError(
            f"snapshot must be i32[{SNAPSHOT_SIZE}] (CanaryMonitor.snapshot(state)); got "
            f"{snapshot.dtype}{list(snapshot.shape)}"
        )
    if snapshot.is_deleted():
        raise ValueError("snapshot was deleted (donated to a jit?): return it from the step as an output not donated")


@dataclasses.dataclass(frozen=True)
class ObservedViolation:
    """A violation with the step whose launches wrote it and the step at which the host read it.

    Attributes:
      violation: the decoded ring row.
      step: the monitor step (1-based count of ``after_step`` calls) whose launches appended the row.
      observed_step: the monitor step at which the host read it (``step + check_lag_steps`` normally).
      row: the row's index in the ring when the host read it (after any :meth:`CanaryMonitor.rearm` before then).
      user_step: the step the caller passed to ``after_step`` for ``step`` (None if it passed none).
    """

    violation: _report.Violation
    step: int
    observed_step: int
    row: int
    user_step: int | None = None


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A snapshot waiting for its lagged read: the step it follows and the arm of the state it was taken from."""

    step: int
    user_step: int | None
    snapshot: jax.Array
    epoch: int


def _unchecked_message(steps: int) -> str:
    return f"kv-canary: {steps} step(s) never checked; call final_check(state)"


def _warn_unchecked(pending: collections.deque, log: logging.Logger | logging.LoggerAdapter) -> None:
    """At garbage collection or interpreter exit: name the staged snapshots no read will see (refers no monitor)."""
    if pending:
        log.warning("%s (the monitor was dropped or the interpreter exited)", _unchecked_message(len(pending)))


class CanaryMonitor:
    """Polls a :class:`KvCanary`'s state after every step without stalling it.

    After each step it snapshots the write index (and counters) on device and starts an async copy to the host;
    it reads that copy ``config.check_lag_steps`` steps later and pulls the ring only when the index grew. In
    ``log`` mode each incident a read touches is one WARNING; in ``raise`` mode the first read that finds new
    violations raises :class:`KvCanaryViolationError`. Messages lead with one headline per incident (a fault and the
    rows it explains, see :mod:`kvcanary_jax.core._incidents`), then SGLang's lines of its root row; rows of an
    incident already reported show only as a count (``verbose=True`` adds SGLang's lines of every row). Every
    ``health_check_every_n_steps`` it raises :class:`KvCanaryHealthError` (in every mode) if a launch tag stopped
    running; every ``stats_every_n_steps`` it logs SGLang's stats line.

    Call :meth:`after_step` once per outer step, after the step (and a sweep, if one ran), before the state is
    donated again; call :meth:`final_check` at shutdown, :meth:`flush` when the loop goes idle.

    The ring is fill-once within an arm: a long run in log mode calls ``state = monitor.rearm(state)`` after
    ``after_step`` to drop the rows already reported, so the ring keeps naming new incidents. Totals
    (:attr:`total_violations`, ``total_violations=`` in messages) count over every arm. A row that repeats an earlier
    step's row but for its launch tag is counted (:attr:`repeats`, the incident's count) but not logged again.

    Unchecked steps are never lost silently: used as a context manager (``with CanaryMonitor(canary) as
    monitor:``), leaving the block with staged snapshots unread logs ``kv-canary: N step(s) never checked; call
    final_check(state)`` (the monitor holds no state to read them with); so does a monitor garbage-collected, or
    alive at interpreter exit, with staged snapshots unread. :meth:`final_check` or :meth:`flush` before then
    reads them and silences it.

    Args:
      canary: the :class:`KvCanary` whose state is polled.
      log: where messages go; default the ``kvcanary_jax.monitor`` logger.
      verbose: also show SGLang's lines of every row, each labelled with its incident.
    """

    def __init__(
        self, canary: KvCanary, *, log: logging.Logger | logging.LoggerAdapter | None = None, verbose: bool = False
    ):
        validate.instance("canary", canary, KvCanary)
        if log is not None and not isinstance(log, (logging.Logger, logging.LoggerAdapter)):
            raise TypeError(f"log must be a logging.Logger or LoggerAdapter (or None); got log={log!r}")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool; got verbose={verbose!r}")
        self.canary = canary
        self.verbose = verbose
        self.incidents = _incidents.Incidents(fold_repeats=True)
        self.config = canary.config
        self.log = log or logger
        self.step = 0
        self.observed: list[ObservedViolation] = []
        self.watchdog = _health.HealthWatchdog(canary.launch_tags())
        self._pending: collections.deque[_Staged] = collections.deque()
        self.cursor = _ring_cursor.RingCursor(canary.config.ring_capacity)  # rows read, across re-arms
        self._overflows = 0
        self._launches = -1  # the most launches a state seen so far has been through (its age)
        self._report: _report.ViolationReport | None = None  # the last pulled ring
        self.user_step: int | None = None  # the caller's number for the latest step, if it passed one
        # Refers to the deque, not the monitor: the monitor can still be collected.
        self._finalizer = weakref.finalize(self, _warn_unchecked, self._pending, self.log)

    def __enter__(self) -> CanaryMonitor:
        return self

    def __exit__(self, *exc_info) -> None:
        """Logs how many staged steps were never read (call :meth:`final_check` before leaving); raises nothing."""
        if self._pending:
            self.log.warning(_unchecked_message(len(self._pending)))
            self._finalizer.detach()  # named once: not again at garbage collection
        return None

    @property
    def total_violations(self) -> int:
        """Violations the monitor has counted so far, over every re-arm (rows read, repeats and dropped included)."""
        return self.cursor.total

    @property
    def dropped_violations(self) -> int:
        """Violations counted that had no ring row to read (the ring was full); each was reported as dropped."""
        return self.cursor.dropped

    @property
    def repeats(self) -> int:
        """Rows counted but not logged: equal but for the launch tag to a row an earlier read reported."""
        return self.incidents.repeats

    @property
    def unchecked_steps(self) -> int:
        """Steps whose snapshot is staged but not read yet (what :meth:`flush` would read)."""
        return len(self._pending)

    @property
    def sweep_due(self) -> bool:
        """Whether the step now running should end with a sweep: the first step, then every ``sweep_interval``."""
        interval = self.config.sweep_interval
        return self.canary.enabled and interval > 0 and self.step % interval == 0

    def after_step(self, state: CanaryState, *, step: int | None = None, snapshot: jax.Array | None = None) -> None:
        """Stages this step's snapshot and processes the one from ``check_lag_steps`` steps ago.

        Args:
          state: the canary state after the step (and its sweep, if one ran).
          step: the step's number in the caller's loop; reports then name steps by it (default: the count of
            ``after_step`` calls, from 1).
          snapshot: :meth:`snapshot` of ``state``, returned by the jit that produced ``state``; None: the monitor
            takes it in a launch of its own.

        Raises:
          KvCanaryViolationError: in raise mode, when a processed snapshot shows new violations.
          KvCanaryHealthError: when a health check finds a tag that did not run.
        """
        self._check_state(state)
        if step is not None and not validate.is_int(step):
            raise TypeError(f"step must be an int; got step={step!r}")
        if snapshot is not None:
            _check_snapshot(snapshot)
        self.step += 1
        self.user_step = None if step is None else int(step)
        if not self.canary.enabled:
            return
        if snapshot is None:
            snapshot = self._take_snapshot(state)
        snapshot.copy_to_host_async()
        self._pending.append(_Staged(self.step, self.user_step, snapshot, self.cursor.epoch))
        while self._pending and self._pending[0].step <= self.step - self.config.check_lag_steps:
            self._process(self._pending.popleft(), state)

    def rearm(self, state: CanaryState) -> CanaryState:
        """Drops the ring rows this monitor has read, so a fill-once ring never stays full; returns the new state.

        Call it after :meth:`after_step` (or :meth:`flush`), with the state passed there or a later one, and use the
        state it returns: the old one's ring is donated. On device, in one jitted launch and with no host sync, it
        drops rows ``[0, n)`` (``n``: the rows read from this arm), moves the unread rows ``[n, index)`` down to
        ``[0, ...)`` and lowers the write index by what it removed; rows a full ring dropped are still counted and
        reported as dropped. With nothing read from this arm yet (``n == 0``, e.g. within ``check_lag_steps`` of the
        last re-arm), or the canary off, it returns ``state`` itself and launches nothing.

        Within one arm the ring stays SGLang's fill-once ring (row 0 is the arm's first unread violation); the
        monitor's totals, incidents and messages count over every arm.

        Order matters for a ``snapshot=`` handed to :meth:`after_step`: it must come from a state of the arm the
        monitor holds, so pass a step's snapshot to ``after_step`` before re-arming, and launch the next step from
        the returned state (snapshots staged before a re-arm are read against their own arm, whatever the lag).

        Args:
          state: the canary state the owner holds now.

        Returns:
          The state with its ring re-armed (the same object when nothing was drained).
        """
        self._check_state(state)
        drained = self.cursor.drainable
        if not self.canary.enabled or drained == 0:
            return state
        log, before = _ring_cursor.drain(state.violation_log, np.int32(drained))
        before.copy_to_host_async()
        self.cursor.rearmed(drained, before)
        self._report = None  # the pulled ring's rows moved
        return dataclasses.replace(state, device=dataclasses.replace(state.device, violation_log=log))

    def flush(self, state: CanaryState) -> _report.ViolationReport:
        """Blocking: reads every staged snapshot and ``state`` as it is now, and reports all that is pending.

        For a loop going idle or shutting down. Unlike :meth:`after_step` it runs no health check and writes no
        stats line (an idle loop launches nothing, which is not a stall); violations are logged, or raised in raise
        mode, as usual. Afterwards :attr:`unchecked_steps` is 0.

        Returns:
          The ring as read now (``read_violations``); after a :meth:`rearm`, its ``write_index``, ``is_errored``
          and ``overflowed`` count over every arm (:attr:`total_violations`), its rows are the current arm's.

        Raises:
          KvCanaryViolationError: in raise mode, if violations not yet raised are found.
        """
        return self._read_all(state, periodic=False)

    def final_check(self, state: CanaryState) -> _report.ViolationReport:
        """Blocking, at shutdown: :meth:`flush`, but each staged step gets the health check and stats line
        :meth:`after_step` would have given it (the steps ran); the state now gets none.

        Returns:
          The report :meth:`flush` returns.

        Raises:
          KvCanaryViolationError: in raise mode, if violations not yet raised are found.
          KvCanaryHealthError: when a staged step's health check finds a tag that did not run.
        """
        return self._read_all(state, periodic=True)

    def _read_all(self, state: CanaryState, *, periodic: bool) -> _report.ViolationReport:
        """Reads every staged snapshot (``periodic``: with their health checks and stats), then ``state`` now."""
        self._check_state(state)
        if self.canary.enabled:
            while self._pending:
                self._process(self._pending.popleft(), state, periodic=periodic)
            now = _Staged(self.step, self.user_step, self._take_snapshot(state), self.cursor.epoch)
            self._process(now, state, periodic=False)
        return self._whole_report(state)

    def _whole_report(self, state: CanaryState) -> _report.ViolationReport:
        """The ring's report; after a re-arm, its counts over every arm."""
        ring = _report.read_violations(state.violation_log)
        if self.cursor.epoch == 0:
            return ring
        total = max(self.cursor.total, self.cursor.base + ring.write_index)
        first = self.observed[0].violation if self.observed else ring.first_violation
        overflowed = ring.overflowed or self.cursor.dropped > 0
        return dataclasses.replace(
            ring, write_index=total, is_errored=total > 0, overflowed=overflowed, first_violation=first
        )

    def _check_state(self, state) -> None:
        """What the monitor reads: a CanaryState whose ring has the configured capacity."""
        validate.instance("state", state, CanaryState, what="CanaryState (the state the step returned)")
        _validate.check_not_donated(state)
        capacity = state.device.violation_log.ring_capacity
        if capacity != self.config.ring_capacity:
            raise ValueError(
                f"state's ring holds {capacity} rows but config.ring_capacity={self.config.ring_capacity}: the "
                "state belongs to another canary"
            )

    @staticmethod
    def snapshot(state: CanaryState) -> jax.Array:
        """i32[SNAPSHOT_SIZE]: what :meth:`after_step` polls, computed from ``state``; pure and traceable.

        Return it from the jit that produces the step's last state (not donated) and pass it to
        ``after_step(state, snapshot=...)``: the monitor then launches no copy program of its own.
        """
        return _pack(*_polled(state))

    @staticmethod
    def _take_snapshot(state: CanaryState) -> jax.Array:
        return _snapshot(*_polled(state))

    def _process(self, staged: _Staged, state: CanaryState, periodic: bool = True) -> None:
        step, user_step = staged.step, staged.user_step
        index, overflows, kernel, slot = _unpack(np.asarray(staged.snapshot))
        # Every launch counts itself (kernel_run_counters), so their sum orders the states one run goes through.
        launches = int(kernel.sum())
        if launches < self._launches:
            raise ValueError(
                f"state is older than one the monitor has already seen (it has been through {launches} canary "
                f"launch(es), an earlier one through {self._launches}): its ring misses the newer violations; pass "
                "the state the latest step returned"
            )
        self._launches = max(self._launches, launches)
        if overflows > self._overflows:
            capacities = {g.name: g.verify_capacity for g in self.canary.groups}
            self.log.warning(
                "kv-canary: per-forward verify skipped %d time(s) due to overflow (step=%d, capacities=%s); "
                "check CanaryPool verify_capacity / pool sizing",
                overflows - self._overflows,
                step,
                capacities,
            )
            self._overflows = overflows
        rows, dropped = self.cursor.read(staged.epoch, index)
        if rows or dropped:
            self._collect(step, user_step, rows, dropped, state)
        if periodic and self.config.health_check_every_n_steps and step % self.config.health_check_every_n_steps == 0:
            self.watchdog.check(kernel, step=step)
        if periodic and self.config.stats_every_n_steps and step % self.config.stats_every_n_steps == 0:
            self.log.info(
                _health.stats_line(
                    step=step, kernel_run_counters=kernel, slot_run_counters=slot, write_index=self.cursor.total
                )
            )

    def _collect(self, step: int, user_step: int | None, rows: range, dropped: int, state: CanaryState) -> None:
        """Reports ring ``rows`` (positions in the state's ring), all written by ``step``, and ``dropped`` rows the
        full ring lost; pulls the ring only if needed."""
        capacity = self.config.ring_capacity
        if rows and (self._report is None or self._report.ring_valid_count < rows.stop):
            self._report = _report.read_violations(state.violation_log)  # a sync, only when there is news
        new = [ObservedViolation(self._report.violations[row], step, self.step, row, user_step) for row in rows]
        self.observed.extend(new)
        now = self.step if self.user_step is None else self.user_step
        written = step if user_step is None else user_step
        total = self.cursor.total
        messages = self._messages([o.violation for o in new], total=total, step=now, written_step=written)
        if dropped:
            messages.append(
                f"kv-canary: {dropped} more violation(s) at step={written} were dropped: the ring "
                f"(ring_capacity={capacity}) is full"
            )
        if not messages:  # only repeats of rows already reported: counted (self.repeats), not shown again
            return
        if self.config.mode is CanaryMode.RAISE:
            raise _report.KvCanaryViolationError(
                _report.read_violations(state.violation_log), "\n".join(messages), self.incidents.incidents
            )
        for message in messages:
            self.log.warning(message)

    def _messages(self, rows: list[_report.Violation], *, total: int, step: int, written_step: int) -> list[str]:
        """One message per incident the rows touch: a new one's headline and root row, an old one's new count."""
        opened = len(self.incidents.incidents)
        placed = self.incidents.add(rows, step=written_step)
        overflowed = self.cursor.dropped > 0  # within one arm: total > ring_capacity, as SGLang's host says
        raw = lambda v: _report.format_violation(  # noqa: E731
            v, total=total, overflowed=overflowed, step=step, written_step=written_step
        )
        return _incidents.messages(placed, opened=opened, raw=raw, verbose=self.verbose)
