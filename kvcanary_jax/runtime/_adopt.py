"""Adopting a warm engine: write, once, the records of slots the engine cached before the canary was attached.

An engine that served steps unwrapped holds KV the canary has no records of: its first verify of those slots would
report every one. :meth:`KvCanary.adopt` writes their records from the engine's own tables and token history, exactly
as the canary's write would have stored them (TOKEN, POSITION, PREV_HASH chained from the anchor along each path,
REAL_KV_HASH folded from the current KV), and checks from there on.

The entries are a forest of chains: each names its slot, token, position and predecessor slot (-1 at a chain head).
A radix tree's walk (:func:`walk_prefix_tree`) and a request's page-table row both give one (:class:`AdoptEntries`).
On device the entries are cut into segments (runs where each entry follows the one before it), each segment is one
"request" of the lower layer's write op, and the op runs in rounds: a round writes every segment whose predecessor
was written in an earlier round. Entries that cannot be adopted become ``INVALID_INPUT`` rows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvcanary_jax.core._constants import InputField, InputProblem
from kvcanary_jax.runtime import _sweep
from kvcanary_jax.runtime._inputs import Issues
from pallas_kernels import realkv, validate
from pallas_kernels.write import api as write_api

_FIELDS = ("slots", "tokens", "positions", "prev_slots")


class AdoptEntries(NamedTuple):
    """Cached slots to adopt, one entry per slot; a predecessor must come before its successors.

    Attributes:
      slots: i32[n] KV slots, in ``[1, num_slots)``.
      tokens: i32[n] the token whose KV each slot holds.
      positions: i32[n] its position in the sequence (its predecessor's + 1).
      prev_slots: i32[n] the slot of the previous position on the same path; -1 at position 0.
    """

    slots: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    prev_slots: np.ndarray

    @classmethod
    def empty(cls) -> AdoptEntries:
        return cls(*(np.zeros(0, np.int32) for _ in _FIELDS))

    @classmethod
    def from_sweep(cls, entries: _sweep.SweepEntries, tokens) -> AdoptEntries:
        """A prefix tree's sweep entries with each slot's token (e.g. a second :func:`walk_prefix_tree` over the
        nodes' keys, which visits the nodes in the same order)."""
        tokens = np.asarray(tokens)
        if tokens.shape != np.shape(entries.slots):
            raise ValueError(
                f"tokens must hold one token per sweep entry: {np.shape(entries.slots)}; got shape {tokens.shape}"
            )
        return cls(entries.slots, tokens, entries.positions, entries.prev_slots)

    @classmethod
    def from_request(cls, slots, tokens, length: int) -> AdoptEntries:
        """The first ``length`` positions of one request: its page-table row ``slots`` and its token history.

        ``length`` counts the positions whose KV is written (a decoding request's last sampled token is not).
        """
        slots, tokens = np.asarray(slots).reshape(-1), np.asarray(tokens).reshape(-1)
        if not isinstance(length, (int, np.integer)) or not 0 <= length <= min(len(slots), len(tokens)):
            raise ValueError(
                f"length must be an int in [0, min(len(slots), len(tokens))] = [0, {min(len(slots), len(tokens))}]; "
                f"got length={length!r}"
            )
        n = int(length)
        prev = np.concatenate([[-1], slots[: max(n - 1, 0)]])[:n]
        return cls(slots[:n], tokens[:n], np.arange(n), prev)

    @staticmethod
    def merge(*parts: AdoptEntries) -> AdoptEntries:
        """The parts in order, each slot once: a repeat of an identical entry (a request's prefix that the radix
        tree also holds) is dropped; a repeat that differs is an error naming the slot."""
        columns = [[np.asarray(getattr(p, f), np.int64).reshape(-1) for p in parts] for f in _FIELDS]
        table = np.stack([np.concatenate([np.zeros(0, np.int64), *c]) for c in columns], axis=1)
        _, first, inverse = np.unique(table[:, 0], return_index=True, return_inverse=True)
        kept = table[first[inverse.reshape(-1)]]  # each entry's first entry of the same slot
        differs = (table != kept).any(axis=1)
        if differs.any():
            i = int(np.argmax(differs))
            raise ValueError(
                f"slot {table[i, 0]} is given twice with different entries: (token, position, prev_slot) = "
                f"{tuple(kept[i, 1:].tolist())} and {tuple(table[i, 1:].tolist())}"
            )
        keep = np.sort(first)
        return AdoptEntries(*(table[keep, i].astype(np.int32) for i in range(len(_FIELDS))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdoptPlan:
    """Adopt entries on device at a static capacity (``KvCanary.adopt_plan``); entries past ``num_valid`` unused."""

    slots: jax.Array
    tokens: jax.Array
    positions: jax.Array
    prev_slots: jax.Array
    num_valid: jax.Array

    @property
    def capacity(self) -> int:
        return self.slots.shape[0]

    def check(self) -> None:
        """Static checks (trace time): four i32 columns of one length (at least one entry) and an i32[1] count."""
        columns = {f"plan.{f}": getattr(self, f) for f in _FIELDS}
        for name, x in columns.items():
            validate.array(name, x, dtype=jnp.int32, ndim=1)
        if not validate.same_length(columns):
            raise ValueError("plan.slots needs at least one entry (shapes are static: pad it)")
        validate.array("plan.num_valid", self.num_valid, dtype=jnp.int32, shape=(1,))


def pack(entries: AdoptEntries, num_slots: int, capacity: int | None = None) -> AdoptPlan:
    """Host: checks the entries and pads them to ``capacity`` (default ``num_slots``: each slot at most once).

    Raises:
      TypeError, ValueError: naming the entry: a slot out of ``[1, num_slots)`` or given twice, a predecessor that
        is not -1 nor an earlier entry's slot (missing, or a cycle), a position that is not its predecessor's + 1
        (0 at a chain head), or more entries than ``capacity``.
    """
    what = "adopt"
    if not isinstance(entries, AdoptEntries):
        raise TypeError(f"entries must be AdoptEntries; got {type(entries).__name__}")
    if not np.issubdtype(np.asarray(entries.tokens).dtype, np.integer) or np.ndim(entries.tokens) != 1:
        raise TypeError(f"{what}: AdoptEntries.tokens must be a 1-D integer array; got {np.asarray(entries.tokens)!r}")
    sweep = _sweep.SweepEntries(entries.slots, entries.positions, entries.prev_slots)
    _sweep.check_entries(sweep, num_slots, what)  # integer columns, one length, slots and predecessors in range
    if len(entries.tokens) != len(entries.slots):
        raise ValueError(f"{what}: AdoptEntries.tokens has {len(entries.tokens)} entries, slots {len(entries.slots)}")
    slots, positions, prev = (np.asarray(x, np.int64) for x in sweep)
    position_of = {}
    for i, (slot, position, p) in enumerate(zip(slots.tolist(), positions.tolist(), prev.tolist(), strict=True)):
        if slot in position_of:
            raise ValueError(f"{what}: AdoptEntries.slots[{i}] = {slot} is given twice (merge the parts first)")
        if p != -1 and p not in position_of:
            raise ValueError(
                f"{what}: AdoptEntries.prev_slots[{i}] = {p} is not an earlier entry's slot: a predecessor must be "
                "adopted before its successors (missing, out of order, or a cycle)"
            )
        want = 0 if p == -1 else position_of[p] + 1
        if position != want:
            raise ValueError(
                f"{what}: AdoptEntries.positions[{i}] = {position}, but its predecessor's position + 1 is {want}"
            )
        position_of[slot] = position
    capacity = num_slots if capacity is None else capacity
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int; got capacity={capacity!r}")
    n = len(slots)
    if n > capacity:
        raise ValueError(f"{what}: {n} entries exceed the plan's capacity of {capacity}")

    def padded(x):
        out = np.zeros(capacity, np.int32)
        out[:n] = x
        return jnp.asarray(out)

    columns = {f: padded(getattr(entries, f)) for f in _FIELDS}
    return AdoptPlan(**columns, num_valid=jnp.full((1,), n, jnp.int32))


class _Segments(NamedTuple):
    """The entries cut into chains the write op walks: segment r owns entries ``[offsets[r], offsets[r + 1])``."""

    offsets: jax.Array  # i32[capacity + 1]
    seeds: jax.Array  # i32[capacity] each segment's predecessor slot (-1: a chain head); -1 past ``count``
    count: jax.Array  # i32[1]
    of_entry: jax.Array  # i32[capacity] each entry's segment


def _segments(plan: AdoptPlan, listed: jax.Array, good: jax.Array) -> _Segments:
    """A segment starts wherever an entry does not follow the entry before it; a rejected entry stands alone."""
    i = jnp.arange(plan.capacity, dtype=jnp.int32)
    before = jnp.roll(plan.slots, 1)
    follows = (i > 0) & (plan.prev_slots == before) & jnp.roll(good, 1) & good
    start = listed & ~follows
    n = jnp.clip(plan.num_valid[0], 0, plan.capacity)
    (first,) = jnp.nonzero(start, size=plan.capacity, fill_value=n)
    count = jnp.sum(start, dtype=jnp.int32)
    seeds = jnp.where(i < count, plan.prev_slots[jnp.minimum(first, plan.capacity - 1)], -1)
    offsets = jnp.concatenate([first, n.reshape(1)]).astype(jnp.int32)
    return _Segments(offsets, seeds.astype(jnp.int32), count.reshape(1), jnp.cumsum(start, dtype=jnp.int32) - 1)


def adopt_buffers(
    buffers: tuple[jax.Array, ...],
    sources: tuple[tuple[realkv.RealKvSource, ...], ...],
    plan: AdoptPlan,
    *,
    real_kv_hash_mode: int,
    backend: str,
) -> tuple[tuple[jax.Array, ...], Issues]:
    """Writes the plan's records into each buffer (folding its own real-KV sources), in rounds of the write op.

    Returns the new buffers and the ``INVALID_INPUT`` candidates: entries whose slot or predecessor is out of range
    (or the reserved slot 0), and entries whose predecessor was never written (missing, rejected, or a cycle).
    """
    num_slots = buffers[0].shape[0]
    i = jnp.arange(plan.capacity, dtype=jnp.int32)
    listed = i < jnp.clip(plan.num_valid[0], 0, plan.capacity)
    slot_ok = (plan.slots >= 1) & (plan.slots < num_slots)
    prev_ok = (plan.prev_slots == -1) | ((plan.prev_slots >= 1) & (plan.prev_slots < num_slots))
    good = listed & slot_ok & prev_ok
    seg = _segments(plan, listed, good)
    in_pool = lambda s: (s >= 1) & (s < num_slots)  # noqa: E731
    no_assert = jnp.zeros((1,), jnp.int32)  # the entries' positions are checked on the host (pack)

    def round_(carry):
        bufs, done, pending, _ = carry
        seed_done = done[jnp.clip(seg.seeds, 0, num_slots - 1)]
        ready = (seg.seeds == -1) | (in_pool(seg.seeds) & seed_done)
        now = pending & ready[jnp.clip(seg.of_entry, 0, plan.capacity - 1)]
        loc = jnp.where(now, plan.slots, -1)
        bufs = tuple(
            write_api.write(buf, seg.offsets, seg.seeds, seg.count, plan.tokens, plan.positions, loc, no_assert,
                            real_kv_sources=src, real_kv_hash_mode=real_kv_hash_mode, backend=backend)[0]
            for buf, src in zip(bufs, sources, strict=True)
        )  # fmt: skip
        done = done.at[jnp.where(now, plan.slots, num_slots)].set(True, mode="drop")
        return bufs, done, pending & ~now, jnp.any(now)

    carry = (tuple(buffers), jnp.zeros((num_slots,), bool), good, jnp.bool_(True))
    bufs, _, unresolved, _ = lax.while_loop(lambda c: c[3] & jnp.any(c[2]), round_, carry)

    slot_problem = jnp.where(plan.slots == 0, InputProblem.RESERVED_SLOT, InputProblem.OUT_OF_RANGE)
    prev_problem = jnp.where(plan.prev_slots == 0, InputProblem.RESERVED_SLOT, InputProblem.OUT_OF_RANGE)
    common = dict(limit=num_slots, position=plan.positions, entry=i)
    issues = Issues.concat(
        [
            Issues.of(jnp.where(listed & ~slot_ok, slot_problem, 0), InputField.ADOPT_SLOTS, plan.slots,
                      slot=-1, **common),
            Issues.of(jnp.where(listed & slot_ok & ~prev_ok, prev_problem, 0), InputField.ADOPT_PREV_SLOTS,
                      plan.prev_slots, slot=plan.slots, **common),
            Issues.of(jnp.where(unresolved, InputProblem.UNADOPTED, 0), InputField.ADOPT_PREV_SLOTS,
                      plan.prev_slots, slot=plan.slots, **common),
        ]
    )  # fmt: skip
    return bufs, issues
