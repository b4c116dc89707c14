"""Test assertions over canary results: nothing was reported, or a matching violation was.

Both accept what a test has at hand: a :class:`CanaryState` (single-device or per-device over a mesh), a
:class:`CanaryDeviceState`, a :class:`ViolationLog`, a :class:`ViolationReport` or a sharded report. Reading a
state is a host sync: call them after the steps, not inside one.
"""

from __future__ import annotations

import numpy as np

from kvcanary_jax.core._constants import CanaryLaunchTag, FailReason
from kvcanary_jax.core._report import Violation, ViolationReport, format_violation, read_violations
from kvcanary_jax.core._state import CanaryDeviceState, ViolationLog
from kvcanary_jax.runtime._batch import CanaryState
from kvcanary_jax.sharded._report import ShardedViolationReport
from pallas_kernels import validate

Checkable = CanaryState | CanaryDeviceState | ViolationLog | ViolationReport | ShardedViolationReport


def _reports(x: Checkable) -> list[tuple[str, ViolationReport]]:
    """``(where, report)`` per ring: one for a single-device value, one per device for a per-device one."""
    if isinstance(x, ViolationReport):
        return [("", x)]
    if isinstance(x, ShardedViolationReport):
        return [(f" on device {x.mesh_layout.label(c)}", r) for c, r in x.per_device.items()]
    if isinstance(x, CanaryState):
        x = x.device
    if isinstance(x, CanaryDeviceState):
        x = x.violation_log
    if not isinstance(x, ViolationLog):
        raise TypeError(
            "expected a CanaryState, CanaryDeviceState, ViolationLog, ViolationReport or ShardedViolationReport; "
            f"got {type(x).__name__}"
        )
    ring, index = np.asarray(x.violation_ring), np.asarray(x.violation_write_index)
    if ring.ndim == 3:
        return [("", read_violations(x))]
    # Per-device state from ShardedKvCanary: leading mesh axes; name each ring by its flat device index.
    rings, indices = ring.reshape(-1, *ring.shape[-3:]), index.reshape(-1, 1)
    return [
        (f" on device #{d}", read_violations(ViolationLog(violation_ring=rings[d], violation_write_index=indices[d])))
        for d in range(rings.shape[0])
    ]


def assert_no_violations(x: Checkable, *, step: int | None = None) -> None:
    """Asserts that the canary recorded no violation.

    Args:
      x: a state, device state, violation log or report (see the module docstring).
      step: the step to name in the message, if known.

    Raises:
      AssertionError: naming the total count, the first incident's headline and its root row's report (whose
        first line is SGLang's ``kv_canary violation: ...`` log line).
    """
    if step is not None and not validate.is_int(step):
        raise TypeError(f"step must be an int; got step={step!r}")
    errored = [(where, r) for where, r in _reports(x) if r.is_errored]
    if not errored:
        return
    total = sum(r.write_index for _, r in errored)
    where, first = errored[0]
    incidents = first.incidents
    root = incidents[0].root
    message = format_violation(root, total=first.write_index, overflowed=first.overflowed, step=step)
    raise AssertionError(
        f"assert_no_violations failed: the canary recorded {total} violation(s); the first{where} "
        f"(of {len(incidents)} incident(s) there):\n{incidents[0].headline()}\n{message}"
    )


def expect_violation(
    x: Checkable,
    *,
    tag: CanaryLaunchTag | str | None = None,
    reason: FailReason | str | None = None,
    slot: int | None = None,
) -> Violation:
    """Asserts that at least one recorded violation matches; returns the first that does.

    Args:
      x: a state, device state, violation log or report (see the module docstring).
      tag: the launch tag (a :class:`CanaryLaunchTag` or its name, e.g. ``"TAIL_K_FULL"``), or None for any.
      reason: fail-reason bits the row must all carry: members (``FailReason.VERIFY_REAL_KV_HASH``) or the names
        reports print (``"verify_real_kv_hash"``, several joined by ``+``).
      slot: the row's ``slot_idx``.

    Raises:
      AssertionError: listing what was recorded when nothing matches.
    """
    if isinstance(tag, str):
        try:
            tag = CanaryLaunchTag[tag]
        except KeyError:
            raise ValueError(f"tag must be a CanaryLaunchTag or one of its names; got tag={tag!r}") from None
    elif tag is not None:  # a tag no launch has would never match: say so instead
        if not validate.is_int(tag) or int(tag) not in CanaryLaunchTag._value2member_map_:
            raise ValueError(f"tag must be a CanaryLaunchTag, one of its names or values; got tag={tag!r}")
        tag = CanaryLaunchTag(int(tag))
    if reason is not None:
        reason = FailReason.parse(reason)
    if slot is not None and not validate.is_int(slot):
        raise TypeError(f"slot must be an int (a row's slot_idx); got slot={slot!r}")
    rows = [v for _, r in _reports(x) for v in r.violations]
    for v in rows:
        if (
            (tag is None or v.launch_tag == tag)
            and (reason is None or v.fail_reason & reason == reason)
            and (slot is None or v.slot_idx == slot)
        ):
            return v
    want = ", ".join(f"{k}={v!r}" for k, v in (("tag", tag), ("reason", reason), ("slot", slot)) if v is not None)
    seen = "\n".join(f"  {v.tag_label} {'+'.join(v.reason_labels)} slot_idx={v.slot_idx}" for v in rows[:20])
    raise AssertionError(
        f"expect_violation failed: no violation with {want or 'any fields'}; recorded {len(rows)} row(s)"
        + (f":\n{seen}" if rows else "")
    )
