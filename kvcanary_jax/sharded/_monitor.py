"""``ShardedCanaryMonitor``: the host monitor over a mesh, one :class:`CanaryMonitor` per device, one merged report.

Each device's monitor polls that device's own write index and counters (lagged, non-blocking, as on one device).
Violations are reported here instead, from the merged report, grouped into incidents as on one device (a data
replica's TP shards seeing one fault give one incident): each new incident's headline, then SGLang's message of its
root row plus the device's mesh coordinates and, for a ``SHARD_CHAIN_MISMATCH`` row, the peer's; rows of an incident
already reported come back as a count. Other lines of a device's monitor (overflow
warnings, dropped-row notes, stats) pass through with the device appended. A mesh that spans ``jax.distributed``
processes is polled by ``_multihost`` instead: lagged all-gathers give every process the same merged view.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from kvcanary_jax.core import _report
from kvcanary_jax.core._constants import CanaryMode
from kvcanary_jax.core._state import ViolationLog
from kvcanary_jax.runtime import _health, _monitor
from kvcanary_jax.runtime._batch import CanaryState
from kvcanary_jax.sharded import _layout, _multihost
from kvcanary_jax.sharded import _report as _sharded_report
from kvcanary_jax.sharded._canary import ShardedKvCanary
from pallas_kernels import validate

_VIOLATION_PREFIX = ("kv_canary violation:", "kv-canary incident #")  # SGLang's frozen first line; an incident


class _DeviceLog(logging.LoggerAdapter):
    """A device's monitor log: drops its violation lines (written by the sharded monitor) and labels the rest."""

    def __init__(self, logger: logging.Logger, label: str):
        super().__init__(logger, {})
        self.label = label

    def log(self, level, msg, *args, **kwargs):
        if isinstance(msg, str) and msg.startswith(_VIOLATION_PREFIX):
            return
        super().log(level, f"{msg} [device {self.label}]", *args, **kwargs)


class ShardedCanaryMonitor:
    """Polls a :class:`ShardedKvCanary`'s per-device state after every step without stalling it.

    Call :meth:`after_step` once per outer step and :meth:`final_check` at shutdown, as with
    :class:`~kvcanary_jax.CanaryMonitor`. In ``raise`` mode the error's ``.report`` is a
    :class:`~kvcanary_jax.ShardedViolationReport`; a health error names the stalled devices.

    Under ``jax.distributed`` (a mesh spanning processes) every process creates one and makes the same calls: each
    then sees every device's violations, raises at the same step in raise mode, and names each device's process and
    host. ``report_on`` picks the one process that logs (None: every process logs).

    Reports lead with one headline per incident, as :class:`~kvcanary_jax.CanaryMonitor`'s do; ``verbose=True`` adds
    SGLang's lines of every row, each labelled with its incident. ``incidents`` is the :class:`MeshIncidents`
    tracker (its ``.incidents``, the raised error's too).
    """

    def __init__(
        self,
        sharded: ShardedKvCanary,
        *,
        log: logging.Logger | None = None,
        report_on: int | None = None,
        verbose: bool = False,
    ):
        validate.instance("sharded", sharded, ShardedKvCanary)
        if report_on is not None and not (validate.is_int(report_on) and 0 <= report_on < jax.process_count()):
            raise ValueError(f"report_on must be a process index below {jax.process_count()} or None; got {report_on=}")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool; got verbose={verbose!r}")
        self.sharded = sharded
        self.verbose = verbose
        self.incidents = _sharded_report.MeshIncidents(sharded.mesh_layout)
        self.config = sharded.canary.config
        self.log = log or _monitor.logger
        lay = sharded.mesh_layout
        self._multi = None
        if _multihost.spans_processes(lay):
            self._multi = _multihost.MultiProcessMonitor(sharded, log=log, report_on=report_on, verbose=verbose)
            self.incidents = self._multi.incidents
            self.monitors = {}
            return
        # Device monitors only log: raising is decided here, once every device has been polled.
        mode = CanaryMode.LOG if self.config.mode is CanaryMode.RAISE else self.config.mode
        quiet = dataclasses.replace(sharded.canary, config=dataclasses.replace(self.config, mode=mode))
        self.monitors = {
            coords: _monitor.CanaryMonitor(quiet, log=_DeviceLog(self.log, lay.label(coords)))
            for coords, _ in lay.devices()
        }
        self._observed: list[_sharded_report.DeviceObservedViolation] = []

    @property
    def observed(self) -> list[_sharded_report.DeviceObservedViolation]:
        """Every violation reported so far, in report order."""
        return self._observed if self._multi is None else self._multi.observed

    @property
    def step(self) -> int:
        """Outer steps seen so far (every device's monitor has seen the same)."""
        if self._multi is not None:
            return self._multi.step
        return next(iter(self.monitors.values())).step

    @property
    def sweep_due(self) -> bool:
        """Whether the step now running should end with a sweep (see ``CanaryMonitor.sweep_due``)."""
        if self._multi is not None:
            return self._multi.sweep_due
        return next(iter(self.monitors.values())).sweep_due

    def after_step(self, state: CanaryState, *, step: int | None = None) -> None:
        """Lets every device's monitor poll, then reports new violations device-major.

        Raises:
          KvCanaryViolationError: in raise mode, when any device shows new violations.
          KvCanaryHealthError: when a launch tag stopped running on some device; the message names them.
        """
        if self._multi is not None:
            return self._multi.after_step(state, step=step)
        seen = {coords: len(m.observed) for coords, m in self.monitors.items()}
        stalled = []
        for coords, view in self._views(state).items():
            try:
                self.monitors[coords].after_step(view, step=step)
            except _health.KvCanaryHealthError as e:
                stalled.append(f"device {self.sharded.mesh_layout.label(coords)}: {e}")
        self._report_new(state, seen)
        if stalled:
            raise _health.KvCanaryHealthError("\n".join(stalled))

    def final_check(self, state: CanaryState) -> _sharded_report.ShardedViolationReport:
        """Blocking: processes every pending snapshot on every device; returns the merged report.

        Raises:
          KvCanaryViolationError: in raise mode, if violations not yet raised are found.
        """
        if self._multi is not None:
            return self._multi.final_check(state)
        seen = {coords: len(m.observed) for coords, m in self.monitors.items()}
        for coords, view in self._views(state).items():
            self.monitors[coords].final_check(view)
        return self._report_new(state, seen) or self.sharded.read_violations(state)

    def _report_new(self, state, seen) -> _sharded_report.ShardedViolationReport | None:
        """Logs (or raises) the violations the device monitors observed since ``seen``; returns the merged report."""
        new = {c: self.monitors[c].observed[n:] for c, n in seen.items() if len(self.monitors[c].observed) > n}
        if not new:
            return None
        merged = self.sharded.read_violations(state)  # a sync, only when some device has news
        own = {c: [dv for dv in merged.violations if dv.device == c] for c in new}
        rows = []
        for coords, observed in new.items():  # device-major, as self.monitors is ordered
            for o in observed:
                dv = own[coords][o.row]
                self._observed.append(_sharded_report.DeviceObservedViolation(device=coords, peer=dv.peer, observed=o))
                rows.append((dv, o.step if o.user_step is None else o.user_step))
        monitor = next(iter(self.monitors.values()))  # every device's monitor has seen the same steps
        now = monitor.step if monitor.user_step is None else monitor.user_step
        messages = self.incidents.messages(rows, merged, step=now, verbose=self.verbose)
        if self.config.mode is CanaryMode.RAISE:
            raise _report.KvCanaryViolationError(merged, "\n".join(messages), self.incidents.incidents)
        for message in messages:
            self.log.warning(message)
        return merged

    def _views(self, state: CanaryState) -> dict[_layout.Coords, CanaryState]:
        """Each device's share of what a monitor reads, as single-device arrays on that device (no host copy)."""
        d = state.device
        log = d.violation_log
        names = ("ring", "index", "kernel", "slot", "overflows", "context")
        leaves = (log.violation_ring, log.violation_write_index, d.kernel_run_counters, d.slot_run_counters,
                  state.verify_overflows, log.violation_context)  # fmt: skip
        shards = dict(zip(names, (None if x is None else self._shards(x) for x in leaves), strict=True))
        views = {}
        for coords in self.monitors:
            context = None if shards["context"] is None else shards["context"][coords]  # the request row, etc.
            device = dataclasses.replace(
                d,
                violation_log=ViolationLog(violation_ring=shards["ring"][coords],
                                           violation_write_index=shards["index"][coords], violation_context=context),
                kernel_run_counters=shards["kernel"][coords],
                slot_run_counters=shards["slot"][coords],
            )  # fmt: skip
            views[coords] = dataclasses.replace(state, device=device, verify_overflows=shards["overflows"][coords])
        return views

    def _shards(self, x: jax.Array) -> dict[_layout.Coords, jax.Array]:
        """A per-device array's shards without their leading unit axes, keyed by mesh coordinates."""
        n = len(self.sharded.mesh_layout.shape)
        return {tuple(i.start or 0 for i in s.index[:n]): s.data.reshape(x.shape[n:]) for s in x.addressable_shards}
