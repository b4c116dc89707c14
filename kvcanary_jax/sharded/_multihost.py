"""The monitor's multi-controller path: a mesh that spans ``jax.distributed`` processes, one merged view on each.

A process can address only its own devices, so nothing is read across processes directly. After every step each
process dispatches one small all-gather (jitted, replicated output, asynchronous like the step): every device's
write index, overflow count and counters, 50 int32 each. ``check_lag_steps`` steps later each process reads its own
replica of it (no wait) and so sees the same numbers as every other process. Only when some device's index grew do
the processes pull the rings, all at the same step, with ``multihost_utils.process_allgather`` (a blocking
collective, as the single-device monitor's ring pull is a sync). Every decision (log, raise, health) is taken on
those identical numbers, so every process raises the same error at the same step and none waits in a collective
that another process skipped.
"""

from __future__ import annotations

import collections
import functools
import logging

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kvcanary_jax.core import _report
from kvcanary_jax.core._constants import CanaryMode
from kvcanary_jax.runtime import _health, _monitor
from kvcanary_jax.runtime._batch import CanaryState
from kvcanary_jax.sharded import _layout
from kvcanary_jax.sharded import _report as _sharded_report
from kvcanary_jax.sharded._canary import ShardedKvCanary
from pallas_kernels import validate


def spans_processes(mesh_layout: _layout.MeshLayout) -> bool:
    """Whether the mesh holds devices of another process (a multi-controller mesh)."""
    return any(d.process_index != jax.process_index() for d in mesh_layout.mesh.devices.flat)


@functools.cache
def _poll_fn(mesh_layout: _layout.MeshLayout):
    """``(index, overflows, kernel, slot) -> i32[*mesh, 50]``, every device's poll values, replicated everywhere."""
    n = len(mesh_layout.shape)

    def poll(*leaves):
        flat = [x.reshape((-1,) + x.shape[n:]) for x in leaves]  # one row per device
        values = jax.vmap(_monitor._snapshot)(*flat)
        return values.reshape(mesh_layout.shape + values.shape[1:])

    return jax.jit(poll, out_shardings=NamedSharding(mesh_layout.mesh, PartitionSpec()))


class MultiProcessMonitor:
    """:class:`~kvcanary_jax.ShardedCanaryMonitor` over a mesh that spans processes (see the module docstring).

    Every process must make the same calls (``after_step`` each step, ``final_check`` at the end): they run
    collectives. Health errors and violations name the device, its process and its host.
    """

    def __init__(
        self, sharded: ShardedKvCanary, *, log: logging.Logger | None, report_on: int | None, verbose: bool = False
    ):
        self.sharded = sharded
        self.config = sharded.canary.config
        self.layout = sharded.mesh_layout
        self.log = log or _monitor.logger
        self.logs_here = report_on is None or report_on == jax.process_index()
        self.hosts = _sharded_report.host_names()
        self.devices = tuple(c for c, _ in self.layout.devices())
        self.watchdogs = {c: _health.HealthWatchdog(sharded.canary.launch_tags()) for c in self.devices}
        self.step = 0
        self.user_step: int | None = None
        self.observed: list[_sharded_report.DeviceObservedViolation] = []
        self.verbose = verbose
        self.incidents = _sharded_report.MeshIncidents(self.layout)  # the same on every process: the same rows
        self._pending: collections.deque[tuple[int, int | None, jax.Array]] = collections.deque()
        self._index = dict.fromkeys(self.devices, 0)
        self._overflows = dict.fromkeys(self.devices, 0)

    @property
    def sweep_due(self) -> bool:
        """Whether the step now running should end with a sweep (see ``CanaryMonitor.sweep_due``)."""
        interval = self.config.sweep_interval
        return self.sharded.canary.enabled and interval > 0 and self.step % interval == 0

    def after_step(self, state: CanaryState, *, step: int | None = None) -> None:
        """Dispatches this step's poll and processes the one from ``check_lag_steps`` steps ago, on every process."""
        _check_state(state)
        if step is not None and not validate.is_int(step):
            raise TypeError(f"step must be an int; got step={step!r}")
        self.step += 1
        self.user_step = None if step is None else int(step)
        if not self.sharded.canary.enabled:
            return
        self._pending.append((self.step, self.user_step, self._start_poll(state)))
        while self._pending and self._pending[0][0] <= self.step - self.config.check_lag_steps:
            self._process(*self._pending.popleft(), state)

    def final_check(self, state: CanaryState) -> _sharded_report.ShardedViolationReport:
        """Blocking: processes every pending poll and the state as it is now; returns the merged report."""
        _check_state(state)
        if self.sharded.canary.enabled:
            while self._pending:
                self._process(*self._pending.popleft(), state)
            self._process(self.step, self.user_step, self._start_poll(state), state, periodic=False)
        return self._gather_rings(state)

    def _start_poll(self, state: CanaryState) -> jax.Array:
        d = state.device
        values = _poll_fn(self.layout)(
            d.violation_log.violation_write_index, state.verify_overflows, d.kernel_run_counters, d.slot_run_counters
        )
        values.copy_to_host_async()
        return values

    def _gather_rings(self, state: CanaryState) -> _sharded_report.ShardedViolationReport:
        """Every device's ring on every process (a blocking collective), merged."""
        return _sharded_report.read_sharded_violations(state.violation_log, self.layout, hosts=self.hosts)

    def _where(self, coords: _layout.Coords) -> str:
        device = self.layout.mesh.devices[coords]
        process = device.process_index
        return f"{self.layout.label(coords)} (process {process} on host {self.hosts[process]})"

    def _process(self, step: int, user_step: int | None, poll: jax.Array, state: CanaryState, periodic=True) -> None:
        values = np.asarray(poll.addressable_data(0))  # this process's replica: the same on every process
        unpacked = {c: _monitor._unpack(values[c]) for c in self.devices}
        news = {}
        for c, (index, overflows, _, _) in unpacked.items():
            if overflows > self._overflows[c] and self.logs_here:
                self.log.warning(
                    "kv-canary: per-forward verify skipped %d time(s) due to overflow (step=%d) on device %s",
                    overflows - self._overflows[c], step, self._where(c),
                )  # fmt: skip
            self._overflows[c] = overflows
            if index > self._index[c]:
                news[c] = index
        if news:
            self._collect(step, user_step, news, state)
        every = self.config.health_check_every_n_steps
        if periodic and every and step % every == 0:
            stalled = []
            for c, (_, _, kernel, _) in unpacked.items():
                try:
                    self.watchdogs[c].check(kernel, step=step)
                except _health.KvCanaryHealthError as e:
                    stalled.append(f"device {self._where(c)}: {e}")
            if stalled:
                raise _health.KvCanaryHealthError("\n".join(stalled))
        every = self.config.stats_every_n_steps
        if periodic and every and step % every == 0 and self.logs_here:
            total = [sum(u[i] for u in unpacked.values()) for i in range(4)]
            line = _health.stats_line(step=step, write_index=total[0], kernel_run_counters=total[2],
                                      slot_run_counters=total[3])  # fmt: skip
            self.log.info(f"{line} [{len(self.devices)} devices, {len(self.hosts)} processes]")

    def _collect(self, step: int, user_step: int | None, news: dict, state: CanaryState) -> None:
        """Reports each device's rows ``[previous index, index)`` from the gathered rings, device-major."""
        merged = self._gather_rings(state)
        capacity = self.config.ring_capacity
        now = self.step if self.user_step is None else self.user_step
        written = step if user_step is None else user_step
        rows, dropped = [], []
        for c, index in news.items():
            own = [dv for dv in merged.violations if dv.device == c]
            for row in range(min(self._index[c], capacity), min(index, capacity)):
                dv = own[row]
                o = _monitor.ObservedViolation(dv.violation, step, self.step, row, user_step)
                self.observed.append(_sharded_report.DeviceObservedViolation(device=c, peer=dv.peer, observed=o))
                rows.append((dv, written))
            if index > capacity:
                dropped.append(
                    f"kv-canary: {index - max(self._index[c], capacity)} more violation(s) at step={written} on "
                    f"device {self._where(c)} were dropped: the ring (ring_capacity={capacity}) is full"
                )
            self._index[c] = index
        messages = self.incidents.messages(rows, merged, step=now, verbose=self.verbose) + dropped
        if self.config.mode is CanaryMode.RAISE:
            raise _report.KvCanaryViolationError(merged, "\n".join(messages), self.incidents.incidents)
        if self.logs_here:
            for message in messages:
                self.log.warning(message)


def _check_state(state) -> None:
    validate.instance("state", state, CanaryState, what="CanaryState (the state the step returned)")
