"""Host side of the periodic sweep: list every prefix-cached slot as (slot, position, prev) and pack a static plan.

SGLang walks its radix tree depth-first (``walk_radix_cache_for_canary``): a node at depth ``d`` holding slots
``s_0..s_k`` emits ``(s_j, d + j, prev)``, with ``prev`` the parent's last slot for ``j == 0`` (-1 under the root)
and ``s_{j-1}`` otherwise. Any prefix cache can use :func:`walk_prefix_tree`, or build :class:`SweepEntries` directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core._constants import InputField, InputProblem
from kvcanary_jax.core._plans import VerifyPlan
from kvcanary_jax.runtime._inputs import Issues

_EMPTY = np.zeros(0, np.int32)


class SweepEntries(NamedTuple):
    """A flat list of cached slots with their chain links, one entry per slot.

    Attributes:
      slots: i32[n] cached KV slots.
      positions: i32[n] token position each slot holds.
      prev_slots: i32[n] the slot of the previous position on the same path, -1 at position 0; 0 marks an
        unreachable predecessor (the chain check of that entry is skipped).
    """

    slots: np.ndarray
    positions: np.ndarray
    prev_slots: np.ndarray

    @classmethod
    def empty(cls) -> SweepEntries:
        return cls(_EMPTY, _EMPTY, _EMPTY)


def walk_prefix_tree(
    root: Any,
    *,
    children: Callable[[Any], Iterable[Any]],
    slots: Callable[[Any], np.ndarray],
    include: Callable[[Any], bool] | None = None,
) -> SweepEntries:
    """Depth-first walk of a prefix tree (SGLang's radix walk); the root itself holds no slots.

    Args:
      root: the tree's root node.
      children: a node's child nodes, in emission order.
      slots: the i32 KV slots a node holds, in position order.
      include: emit a node's slots only if this returns True (e.g. ``lambda n: n.lock_ref == 0`` for idle slots);
        its subtree is still walked, and predecessors are taken from the path either way.
    """
    parts = []
    stack = [(c, 0, -1) for c in reversed(list(children(root)))]
    while stack:
        node, depth, parent_last = stack.pop()
        values = np.asarray(slots(node), np.int32).reshape(-1)
        if include is None or include(node):
            parts.append(
                (
                    values,
                    np.arange(depth, depth + len(values), dtype=np.int32),
                    np.concatenate([[parent_last], values[:-1]]).astype(np.int32),
                )
            )
        last = int(values[-1]) if len(values) else parent_last
        stack.extend((c, depth + len(values), last) for c in reversed(list(children(node))))
    if not parts:
        return SweepEntries.empty()
    return SweepEntries(*(np.concatenate(column) for column in zip(*parts, strict=True)))


def check_table(full_to_swa_index_mapping, entries: SweepEntries, *, num_slots: int, swa_num_slots: int) -> np.ndarray:
    """The full->SWA table as numpy, checked to map every full-pool slot, and the entries' slots into the SWA pool.

    Raises:
      TypeError, ValueError: naming ``full_to_swa_index_mapping`` and the entry it maps out of range.
    """
    name = "full_to_swa_index_mapping"
    lut = np.asarray(full_to_swa_index_mapping)
    if not np.issubdtype(lut.dtype, np.integer):
        raise TypeError(f"{name} must hold integers; got {name}.dtype={lut.dtype}")
    if lut.ndim != 1 or lut.shape[0] < num_slots:
        raise ValueError(
            f"{name} must map every full-pool slot (i32[num_slots + 1], {num_slots=}); got shape {lut.shape}"
        )
    prev = np.asarray(entries.prev_slots)
    used = np.concatenate([np.asarray(entries.slots), prev[prev > 0]])
    bad = (lut[used] < 0) | (lut[used] >= swa_num_slots)
    if bad.any():
        slot = int(used[np.argmax(bad)])
        raise ValueError(f"{name} must map into the SWA pool [0, {swa_num_slots}); got {name}[{slot}]={lut[slot]}")
    return lut


def translate_entries(entries: SweepEntries, full_to_swa_index_mapping: np.ndarray) -> SweepEntries:
    """Full-pool entries to SWA-pool entries: non-resident slots are dropped, a non-resident predecessor becomes 0."""
    lut = np.asarray(full_to_swa_index_mapping)
    slots, positions, prev = (np.asarray(x) for x in entries)
    slots = lut[slots]
    prev = np.where(prev < 0, -1, lut[np.maximum(prev, 0)]).astype(np.int32)
    keep = slots != 0
    return SweepEntries(slots[keep].astype(np.int32), positions[keep], prev[keep])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """Device sweep plans, one static-capacity :class:`VerifyPlan` per group (capacity = the group's slot count)."""

    full: VerifyPlan
    swa: VerifyPlan | None = None
    issues: jax.Array | None = None  # i32[8, num_slots]: entries the sweep cannot check (``split_entries``)


def pack_entries(entries: SweepEntries, capacity: int, *, what: str = "sweep") -> VerifyPlan:
    """A :class:`VerifyPlan` of ``capacity`` entries holding ``entries`` (no token check, enabled).

    Raises:
      TypeError, ValueError: for entries that are not integer columns of one length holding slots in
        ``[1, capacity)``, or more entries than ``capacity``.
    """
    _check_entries(entries, capacity, what)
    n = len(entries.slots)
    _check_capacity(n, capacity, what)
    _check_values(entries, capacity, what)

    def padded(x, fill=0):
        out = np.full(capacity, fill, np.int32)
        out[:n] = x
        return jnp.asarray(out)

    return VerifyPlan(
        slot_indices=padded(entries.slots),
        expected_tokens=jnp.full((capacity,), -1, jnp.int32),
        expected_positions=padded(entries.positions),
        prev_slot_indices=padded(entries.prev_slots),
        num_valid=jnp.full((1,), n, jnp.int32),
        enable=jnp.ones((1,), jnp.int32),
    )


def split_entries(entries: SweepEntries, num_slots: int, what: str = "FULL sweep") -> tuple[SweepEntries, jax.Array]:
    """The entries a sweep can check, and an ``INVALID_INPUT`` issue (i32[8, num_slots]) for each one it cannot.

    A slot 0 or a slot past the pool, a predecessor past it, or a negative position comes only from a corrupted
    prefix cache: it is engine data, not the caller's mistake, so it is reported in the ring (by the sweep) and
    left out, while the rest of the sweep runs. An entry whose predecessor is bad keeps its slot, unchained (0).

    Raises:
      TypeError, ValueError: for entries that are not 1-D integer columns of one length (a caller's mistake).
    """
    _check_entries(entries, num_slots, what)
    _check_capacity(len(entries.slots), num_slots, what)
    slots, positions, prev = (np.asarray(x).astype(np.int64) for x in entries)
    problem = np.zeros(num_slots, np.int32)
    names = ("field", "value", "limit", "slot", "position", "entry")
    columns = {name: np.full(num_slots, -1, np.int64) for name in names}
    bad = _bad_values(slots, positions, prev, num_slots)
    found = [
        (InputField.SWEEP_SLOTS, slots, bad["slots"], num_slots),
        (InputField.SWEEP_POSITIONS, positions, bad["positions"], -1),
        (InputField.SWEEP_PREV_SLOTS, prev, bad["prev_slots"], num_slots),
    ]
    reported = np.zeros(len(slots), bool)  # one issue per entry (its first problem), so at most num_slots
    n = 0
    for field, values, flagged, limit in found:
        for i in np.flatnonzero(flagged & ~reported):
            value = int(values[i])
            if field is InputField.SWEEP_SLOTS and value == 0:
                problem[n] = InputProblem.RESERVED_SLOT
            elif field is InputField.SWEEP_POSITIONS:
                problem[n] = InputProblem.NEGATIVE
            else:
                problem[n] = InputProblem.OUT_OF_RANGE
            row = dict(field=field, value=value, limit=limit, slot=slots[i], position=positions[i], entry=i)
            for name, x in row.items():
                columns[name][n] = x
            reported[i], n = True, n + 1
    keep = ~(bad["slots"] | bad["positions"])
    prev = np.where(bad["prev_slots"], 0, prev)
    issues = Issues.of(jnp.asarray(problem), **{k: jnp.asarray(x.astype(np.int32)) for k, x in columns.items()})
    good = SweepEntries(*(x[keep].astype(np.int32) for x in (slots, positions, prev)))
    return good, issues.stacked()


def check_entries(entries: SweepEntries, num_slots: int, what: str) -> None:
    """Host checks of entries a caller hands in: 1-D integer columns of one length, slots in ``[1, num_slots)``,
    predecessors -1, 0 or a slot, positions >= 0."""
    _check_entries(entries, num_slots, what)
    _check_values(entries, num_slots, what)


def _check_capacity(n: int, capacity: int, what: str) -> None:
    if n > capacity:
        raise ValueError(
            f"{what}: {n} entries exceed the sweep capacity of {capacity} (the group's slot count); a slot must "
            "appear at most once, so de-duplicate shared prefixes"
        )


def _check_entries(entries: SweepEntries, num_slots: int, what: str) -> None:
    """Host checks of the caller's part: 1-D integer columns of one length (their values: :func:`_check_values`)."""
    if not isinstance(entries, SweepEntries):
        raise TypeError(
            f"{what}: entries must be SweepEntries (e.g. from walk_prefix_tree); got {type(entries).__name__}"
        )
    slots, positions, prev = (np.asarray(x) for x in entries)
    for name, x in zip(SweepEntries._fields, (slots, positions, prev), strict=True):
        if not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"{what}: SweepEntries.{name} must hold integers; got dtype {x.dtype}")
        if x.ndim != 1:
            raise ValueError(f"{what}: SweepEntries.{name} must have 1 dimension; got shape {x.shape}")
    if not (len(slots) == len(positions) == len(prev)):
        raise ValueError(
            f"{what}: SweepEntries fields must have one length; got slots={len(slots)}, positions={len(positions)}, "
            f"prev_slots={len(prev)}"
        )


def _check_values(entries: SweepEntries, num_slots: int, what: str) -> None:
    """Slots in ``[1, num_slots)``, predecessors -1, 0 or a slot, positions >= 0 (``sweep_plan`` has split off the
    entries that are not, see :func:`split_entries`; a direct caller gets a ValueError)."""
    slots, positions, prev = (np.asarray(x) for x in entries)
    for name, bad in _bad_values(slots, positions, prev, num_slots).items():
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            value = (slots, prev, positions)[("slots", "prev_slots", "positions").index(name)][i]
            raise ValueError(
                f"{what}: SweepEntries.{name}[{i}] = {int(value)} is out of range (slots are 1..{num_slots - 1}; slot 0 "
                "is the reserved padding slot; prev_slots may also be -1 for a chain head or 0 for unreachable; "
                "positions are >= 0)"
            )


def _bad_values(slots, positions, prev, num_slots: int) -> dict[str, np.ndarray]:
    """Per column, the entries no pool holds: a slot outside ``[1, num_slots)``, a predecessor below -1 or past
    the pool, a negative position."""
    return {
        "slots": (slots < 1) | (slots >= num_slots),
        "prev_slots": (prev < -1) | (prev >= num_slots),
        "positions": positions < 0,
    }
