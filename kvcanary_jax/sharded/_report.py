"""Host merge of per-device violation rings into one report: device-major, each row tagged with its mesh coordinates."""

from __future__ import annotations

import dataclasses
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

from kvcanary_jax.core import _incidents, _report
from kvcanary_jax.core._constants import FailReason
from kvcanary_jax.core._state import ViolationLog
from kvcanary_jax.runtime import _monitor
from kvcanary_jax.sharded import _check, _layout
from pallas_kernels import layout, validate

_HOST_NAME_BYTES = 64


@dataclasses.dataclass(frozen=True)
class DeviceViolation:
    """One decoded ring row and the device whose ring held it.

    Attributes:
      device: mesh coordinates of the reporting device, in ``axis_names`` order.
      violation: the decoded row.
      peer: mesh coordinates of the consensus shard for a ``SHARD_CHAIN_MISMATCH`` row, else None.
    """

    device: _layout.Coords
    violation: _report.Violation
    peer: _layout.Coords | None = None


@dataclasses.dataclass(frozen=True)
class DeviceObservedViolation:
    """An observed violation and where it happened.

    Attributes:
      device: mesh coordinates of the reporting device.
      peer: mesh coordinates of the consensus shard of a ``SHARD_CHAIN_MISMATCH`` row, else None.
      observed: the violation with its step, observed step and ring row (in that device's ring).
    """

    device: _layout.Coords
    peer: _layout.Coords | None
    observed: _monitor.ObservedViolation


@dataclasses.dataclass(frozen=True)
class ShardedViolationReport:
    """Every device's ring merged into one report; violations are device-major, then in ring order.

    Attributes:
      mesh_layout: the layout the rings came from.
      per_device: each device's own :class:`~kvcanary_jax.ViolationReport`, keyed by mesh coordinates.
      violations: all rows, device-major.
      write_index: violations seen on all devices together.
      is_errored: any device saw a violation.
      overflowed: any device's ring overflowed.
      hosts: every process's host name, by process index (multi-controller meshes), or empty.
    """

    mesh_layout: _layout.MeshLayout
    per_device: dict[_layout.Coords, _report.ViolationReport]
    violations: tuple[DeviceViolation, ...]
    write_index: int
    is_errored: bool
    overflowed: bool
    hosts: tuple[str, ...] = ()

    def where(self, coords: _layout.Coords) -> str:
        """The device at ``coords`` as text, e.g. ``dp=0,tp=1 (cpu:2048, process 1 on host node7)``."""
        device = self.mesh_layout.mesh.devices[coords]
        owner = f", process {device.process_index} on host {self.hosts[device.process_index]}" if self.hosts else ""
        return f"{self.mesh_layout.label(coords)} ({device}{owner})"

    @property
    def devices_with_violations(self) -> tuple[_layout.Coords, ...]:
        """Mesh coordinates of the devices that reported, device-major."""
        return tuple(coords for coords, r in self.per_device.items() if r.is_errored)

    def format(self, *, step: int | None = None, start: int = 0) -> list[str]:
        """One message per violation from ``start`` on: SGLang's message plus the device (and peer) lines."""
        return [format_device_violation(v, self, step=step) for v in self.violations[start:]]

    @property
    def incidents(self) -> list[_incidents.Incident]:
        """Every device's rows grouped by the fault behind them (steps unknown: the rings do not keep them)."""
        tracker = MeshIncidents(self.mesh_layout)
        tracker.add([(dv, None) for dv in self.violations])
        return tracker.incidents


class MeshIncidents:
    """Incidents over a mesh: the TP shards of a data replica hold the same requests and slots, so a fault they all
    see is one incident (its rows counted); data replicas never share one. See :mod:`kvcanary_jax.core._incidents`.
    """

    def __init__(self, mesh_layout: _layout.MeshLayout):
        names = mesh_layout.axis_names
        self.mesh_layout = mesh_layout
        self._data_axes = tuple(i for i, name in enumerate(names) if name != mesh_layout.tp_axis)
        self.tracker = _incidents.Incidents()
        self.devices: dict[int, list[_layout.Coords]] = {}  # incident number -> devices that wrote its rows

    @property
    def incidents(self) -> list[_incidents.Incident]:
        return self.tracker.incidents

    def add(
        self, rows: list[tuple[DeviceViolation, int | None]]
    ) -> list[tuple[_report.Violation, _incidents.Incident]]:
        """Adds rows (each its own decoded object, as a read gives), each with the step that wrote it, step by step
        and replica by replica (device-major within)."""
        groups: dict[tuple, list[_report.Violation]] = {}
        for dv, step in rows:
            groups.setdefault((step, tuple(dv.device[i] for i in self._data_axes)), []).append(dv.violation)
        placed = []
        for (step, scope), violations in sorted(groups.items(), key=lambda kv: -1 if kv[0][0] is None else kv[0][0]):
            placed += self.tracker.add(violations, step=step, scope=scope)
        device = {id(dv.violation): dv.device for dv, _ in rows}
        for v, incident in placed:
            seen = self.devices.setdefault(incident.number, [])
            if device[id(v)] not in seen:
                seen.append(device[id(v)])
        return placed

    def note(self, incident: _incidents.Incident) -> str:
        """The devices whose rings hold the incident's rows, e.g. ``  on devices: dp=0,tp=0; dp=0,tp=1``."""
        return "  on devices: " + "; ".join(self.mesh_layout.label(c) for c in self.devices[incident.number])

    def messages(
        self,
        rows: list[tuple[DeviceViolation, int | None]],
        merged: ShardedViolationReport,
        *,
        step: int | None,
        verbose: bool = False,
    ) -> list[str]:
        """One message per incident the rows touch, as the single-device monitor writes them; a row's SGLang lines
        carry its device (and peer). ``step`` is when the host read them."""
        opened = len(self.incidents)
        by_row = {id(dv.violation): (dv, written) for dv, written in rows}
        placed = self.add(rows)

        def raw(v: _report.Violation) -> str:
            dv, written = by_row[id(v)]
            return format_device_violation(dv, merged, step=step, written_step=written)

        return _incidents.messages(placed, opened=opened, raw=raw, verbose=verbose, note=self.note)


def format_device_violation(
    dv: DeviceViolation, merged: ShardedViolationReport, *, step: int | None = None, written_step: int | None = None
) -> str:
    """SGLang's message for ``dv`` (its first line unchanged), then ``  device: ...`` and, if any, ``  peer: ...``.

    ``total_violations`` and ``ring_overflow`` are those of ``dv``'s device, whose ring held the row.
    """
    own = merged.per_device[dv.device]
    lines = [
        _report.format_violation(
            dv.violation, total=own.write_index, overflowed=own.overflowed, step=step, written_step=written_step
        ),
        f"  device: {merged.where(dv.device)}",
    ]
    if dv.peer is not None:
        lines.append(f"  peer: {merged.where(dv.peer)}")
    return "\n".join(lines)


def host_names() -> tuple[str, ...]:
    """Every process's host name, by process index: a blocking all-gather that every process must call."""
    name = np.zeros(_HOST_NAME_BYTES, np.uint8)
    mine = socket.gethostname().encode()[:_HOST_NAME_BYTES]
    name[: len(mine)] = np.frombuffer(mine, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(name)).reshape(-1, _HOST_NAME_BYTES)
    return tuple(bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows)


def read_sharded_violations(
    violation_log: ViolationLog, mesh_layout: _layout.MeshLayout, *, hosts: tuple[str, ...] | None = None
) -> ShardedViolationReport:
    """Copies every device's ring to the host (a sync) and merges them into one report.

    On a mesh that spans ``jax.distributed`` processes the rings are all-gathered first
    (``multihost_utils.process_allgather``): a collective, so every process must call this at the same point.

    Args:
      violation_log: a per-device log: ring u32[*mesh, capacity, 8, 2], index i32[*mesh, 1].
      mesh_layout: the layout the log was allocated for.
      hosts: every process's host name, by process index, named in the report's device lines. None: gathered
        (:func:`host_names`) when the mesh spans processes, else none named.
    """
    validate.instance("violation_log", violation_log, ViolationLog)
    ring = violation_log.violation_ring
    if isinstance(ring, jax.Array) and not ring.is_fully_addressable:
        violation_log = multihost_utils.process_allgather(violation_log, tiled=True)
        hosts = host_names() if hosts is None else hosts
    shape = mesh_layout.shape
    rings, indices = np.asarray(violation_log.violation_ring), np.asarray(violation_log.violation_write_index)
    contexts = None if violation_log.violation_context is None else np.asarray(violation_log.violation_context)
    if rings.shape[: len(shape)] != shape or indices.shape != shape + (1,):
        raise ValueError(
            f"violation_log must be per-device with leading axes {shape}; got ring shape {rings.shape} and index "
            f"shape {indices.shape}. Allocate it with kvcanary_jax.per_device(..., mesh_layout)."
        )
    tp = mesh_layout.axis_names.index(mesh_layout.tp_axis) if mesh_layout.tp_axis is not None else None
    per_device, violations = {}, []
    for coords, _ in mesh_layout.devices():
        own = _report.read_violations(
            ViolationLog(
                violation_ring=rings[coords],
                violation_write_index=indices[coords],
                violation_context=None if contexts is None else contexts[coords],
            )
        )
        per_device[coords] = own
        for row, v in zip(own.rows, own.violations, strict=True):
            peer = None
            if tp is not None and v.fail_reason & FailReason.SHARD_CHAIN_MISMATCH:
                peer = coords[:tp] + (int(row[layout.ROW_FAIL_REASON_BITS]) >> _check.PEER_SHIFT,) + coords[tp + 1 :]
            violations.append(DeviceViolation(device=coords, violation=v, peer=peer))
    return ShardedViolationReport(
        mesh_layout=mesh_layout,
        per_device=per_device,
        violations=tuple(violations),
        write_index=sum(r.write_index for r in per_device.values()),
        is_errored=any(r.is_errored for r in per_device.values()),
        overflowed=any(r.overflowed for r in per_device.values()),
        hosts=tuple(hosts or ()),
    )
