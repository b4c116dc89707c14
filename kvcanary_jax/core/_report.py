"""Host reader: decodes the violation ring into a report and formats SGLang's violation message."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvcanary_jax.core import _constants as constants
from kvcanary_jax.core import _explain, _incidents
from kvcanary_jax.core._constants import CanaryLaunchTag, FailReason
from kvcanary_jax.core._state import ViolationLog, u64_pairs_as_int64
from pallas_kernels import validate

_U64_MASK = (1 << 64) - 1
_WRITE_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH
_TOKEN_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.VERIFY_TOKEN_MISMATCH
_SWEEP_TAGS = {t for t in CanaryLaunchTag if t.name.startswith("SWEEP_")}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One decoded ring row; every field is a Python int (hashes as SGLang's signed int64).

    The first eight fields are SGLang's row. The rest are ours: ``reason_detail`` is the high word of
    ``fail_reason_bits`` (an ``INVALID_INPUT`` row's field and problem, a ``SHARD_CHAIN_MISMATCH`` row's peer), and
    ``request_row``, ``expected_position``, ``batch_entry`` come from the ring's context (None where unknown).
    """

    launch_tag: int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason: FailReason
    reason_detail: int = 0
    request_row: int | None = None
    expected_position: int | None = None
    batch_entry: int | None = None

    @classmethod
    def from_row(cls, row, context=None) -> Violation:
        """Decodes one ``int64[8]`` row and its ``i32[3]`` context; a known tag becomes a :class:`CanaryLaunchTag`."""
        values = [int(v) for v in row]
        tag = values[constants.VIOLATION_FIELD_KERNEL_KIND]
        if tag in CanaryLaunchTag._value2member_map_:
            tag = CanaryLaunchTag(tag)
        known = [None if c is None or int(c) < 0 else int(c) for c in (context if context is not None else (None,) * 3)]
        bits = values[7]
        # IntFlag keeps unknown bits (boundary KEEP), so a corrupted row is shown, never dropped.
        return cls(
            *([tag] + values[1:7]),
            fail_reason=FailReason(bits & 0xFFFFFFFF),
            reason_detail=(bits >> 32) & 0xFFFFFFFF,
            request_row=known[0],
            expected_position=known[1],
            batch_entry=known[2],
        )

    @property
    def tag_label(self) -> str:
        """SGLang's label: the tag's name, or ``unknown(N)``."""
        return self.launch_tag.name if isinstance(self.launch_tag, CanaryLaunchTag) else f"unknown({self.launch_tag})"

    @property
    def reason_labels(self) -> list[str]:
        """Lower-case reason names without the ``_mismatch`` suffix, e.g. ``verify_chain_hash``."""
        return [r.label for r in FailReason if self.fail_reason & r]


@dataclasses.dataclass(frozen=True)
class ViolationReport:
    """What the ring says, derived from the write index exactly as SGLang's host does."""

    write_index: int
    ring_capacity: int
    is_errored: bool
    ring_valid_count: int
    overflowed: bool
    first_violation: Violation | None
    violations: tuple[Violation, ...]
    rows: np.ndarray  # int64[ring_valid_count, 8]

    def format(self, *, step: int | None = None, start: int = 0) -> list[str]:
        """One formatted message per violation from ``start`` on."""
        return [
            format_violation(v, total=self.write_index, overflowed=self.overflowed, step=step)
            for v in self.violations[start:]
        ]

    @property
    def incidents(self) -> list[_incidents.Incident]:
        """The rows grouped by the fault behind them (steps unknown: the ring does not keep them)."""
        return _incidents.group(self.violations)


class KvCanaryViolationError(RuntimeError):
    """Raised in ``raise`` mode; ``.report`` holds the decoded :class:`ViolationReport` (every raw row),
    ``.incidents`` the rows grouped by fault."""

    def __init__(self, report: ViolationReport, message: str | None = None, incidents=None):
        super().__init__(message if message is not None else "\n".join(report.format()))
        self.report = report
        self.incidents = list(incidents) if incidents is not None else report.incidents


def read_violations(violation_log: ViolationLog) -> ViolationReport:
    """Copies the ring and index to the host (a sync) and decodes them.

    ``is_errored = index > 0``; ``ring_valid_count = min(index, capacity)``; ``overflowed = index > capacity``;
    ``first_violation = ring[0]`` only when errored.
    """
    validate.instance("violation_log", violation_log, ViolationLog)
    _validate_log(violation_log)
    write_index = int(np.asarray(violation_log.violation_write_index).reshape(-1)[0])
    capacity = violation_log.ring_capacity
    valid = max(0, min(write_index, capacity))
    rows = u64_pairs_as_int64(violation_log.violation_ring)[:valid]
    if violation_log.violation_context is not None:
        contexts = np.asarray(violation_log.violation_context)[:valid]
    else:
        contexts = [None] * valid
    violations = tuple(Violation.from_row(r, c) for r, c in zip(rows, contexts, strict=True))
    return ViolationReport(
        write_index=write_index,
        ring_capacity=capacity,
        is_errored=write_index > 0,
        ring_valid_count=valid,
        overflowed=write_index > capacity,
        first_violation=violations[0] if violations else None,
        violations=violations,
        rows=rows,
    )


def _validate_log(log: ViolationLog) -> None:
    """The log's arrays (numpy or jax) have the layout ``ViolationLog.allocate`` gives them."""
    validate.array("violation_ring", log.violation_ring, dtype=np.uint32, shape=(None, constants.VIOLATION_FIELDS, 2))
    validate.array("violation_write_index", log.violation_write_index, dtype=np.int32, shape=(1,))
    if log.violation_context is not None:
        shape = (log.violation_ring.shape[0], constants.CONTEXT_FIELDS)
        validate.array("violation_context", log.violation_context, dtype=np.int32, shape=shape)


def _hex(x: int) -> str:
    return f"{x & _U64_MASK:#018x}"


def format_violation(
    violation: Violation, *, total: int, overflowed: bool, step: int | None = None, written_step: int | None = None
) -> str:
    """SGLang's multi-line report, then ours: the request, the token, the step written at, the likely cause.

    SGLang's lines come first and unchanged (its first line is frozen, so existing log regexes keep working, its
    ``expected_token=-1`` included); ``step`` is the step at which the host read the row (SGLang's
    ``step_when_pumped``), ``written_step`` the step whose launches wrote it.
    """
    validate.instance("violation", violation, Violation, what="Violation (from read_violations)")
    v = violation
    label = v.tag_label
    kind = (
        label.lower()
        if v.launch_tag in _SWEEP_TAGS
        else (f"per_forward_{label.lower()}" if isinstance(v.launch_tag, CanaryLaunchTag) else label)
    )
    reasons = v.reason_labels
    lines = [
        f"kv_canary violation: launch_tag={label} fail_reason={'+'.join(reasons) or 'none'} "
        f"slot_idx={v.slot_idx} position={v.position} stored_token={v.stored_token} "
        f"expected_token={v.expected_token} stored_chain_hash={_hex(v.stored_chain_hash)} "
        f"expected_aux={_hex(v.expected_aux)}",
        f"KV cache canary violation detected (kernel_kind={label}, slot_idx={v.slot_idx}, position={v.position})",
        f"canary_kind:       {kind}",
        f"  fail_reasons: {' '.join(reasons) or 'none'}",
    ]
    if v.fail_reason & _WRITE_BITS:
        lines += [
            f"  actual:   token_id={v.stored_token}   position={v.position} prev_hash={_hex(v.stored_chain_hash)}",
            f"  expected: token_id={v.expected_token}   position={v.expected_aux}",
        ]
    else:
        lines.append(
            f"  stored:   token_id={v.stored_token}   position={v.position} prev_hash={_hex(v.stored_chain_hash)}"
        )
        token = f"token_id={v.expected_token} " if v.fail_reason & _TOKEN_BITS else ""
        lines.append(f"  expected: {token}prev_hash={_hex(v.expected_aux)}")
    lines.append(f"  total_violations={total} ring_overflow={overflowed} step_when_pumped={step}")
    lines += _explain.explain(v, written_step=written_step)
    return "\n".join(lines)
