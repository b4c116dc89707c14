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

from kvcanary_jax.core._plans import VerifyPlan

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


def pack_entries(entries: SweepEntries, capacity: int, *, what: str = "sweep") -> VerifyPlan:
    """A :class:`VerifyPlan` of ``capacity`` entries holding ``entries`` (no token check, enabled).

    Raises:
      TypeError, ValueError: for entries that are not integer columns of one length holding slots in
        ``[1, capacity)``, or more entries than ``capacity``.
    """
    check_entries(entries, capacity, what)
    n = len(entries.slots)
    if n > capacity:
        raise ValueError(
            f"{what}: {n} entries exceed the sweep capacity of {capacity} (the group's slot count); a slot must "
            "appear at most once, so de-duplicate shared prefixes"
        )

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


def check_entries(entries: SweepEntries, num_slots: int, what: str) -> None:
    """Host checks: 1-D integer columns of one length, slots in ``[1, num_slots)``, predecessors -1, 0 or a slot,
    positions >= 0."""
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
    problems = {
        "slots": (slots < 1) | (slots >= num_slots),
        "prev_slots": (prev < -1) | (prev >= num_slots),
        "positions": positions < 0,
    }
    for name, bad in problems.items():
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            value = (slots, prev, positions)[("slots", "prev_slots", "positions").index(name)][i]
            raise ValueError(
                f"{what}: SweepEntries.{name}[{i}] = {int(value)} is out of range (slots are 1..{num_slots - 1}; slot 0 "
                "is the reserved padding slot; prev_slots may also be -1 for a chain head or 0 for unreachable; "
                "positions are >= 0)"
            )
