"""Re-arming the fill-once ring: the device drain, and the monitor's host bookkeeping of rows read across arms.

Within one arm the ring is SGLang's: fill-once, row 0 the arm's first violation. A re-arm drops the ``n`` rows the
monitor has read (the arm's rows ``[0, n)``), moves the rows still unread (``[n, min(index, capacity))``) down to
``[0, ...)`` and sets the write index to the count it kept: the ring then looks like a fresh arm whose first launch
appended the kept rows. Violations the device counted past a full ring and the monitor had not yet counted have no
row to keep: the host learns how many from the index before the re-arm (returned by the drain, copied lagged) and
reports them as dropped. :class:`RingCursor` keeps ``total = base + seen`` monotonic across arms.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core._state import ViolationLog


def _drain(log: ViolationLog, n: jax.Array) -> tuple[ViolationLog, jax.Array]:
    """The log with rows ``[0, n)`` dropped and the rest moved down; and i32[1], the write index before."""
    ring, context, index = log.violation_ring, log.violation_context, log.violation_write_index
    capacity = ring.shape[0]
    before = index[0]
    keep = jnp.clip(jnp.minimum(before, capacity) - n, 0, capacity)  # rows still unread, all in the ring
    rows = jnp.arange(capacity, dtype=jnp.int32)
    # min(n, capacity) first: n may count rows past a full ring, and n + row must not overflow int32.
    source = jnp.minimum(rows + jnp.minimum(n, capacity), capacity - 1)
    live = rows < keep
    ring = jnp.where(live[:, None, None], ring[source], jnp.zeros_like(ring))  # an empty row, as allocate leaves it
    if context is not None:
        context = jnp.where(live[:, None], context[source], jnp.full_like(context, -1))
    drained = ViolationLog(violation_ring=ring, violation_write_index=keep[None], violation_context=context)
    return drained, before[None] + 0  # a new buffer: the donated index is gone


# One program per ring shape: n is traced, so re-arming never retraces; the log is donated (no copy of the ring).
drain = jax.jit(_drain, donate_argnums=0)


@dataclasses.dataclass
class _End:
    """How an arm ended: the rows the re-arm drained and the write index before it (i32[1], copied lagged)."""

    drained: int
    before: jax.Array


class RingCursor:
    """Which ring rows the monitor has read, across re-arms; every count it gives is monotonic.

    An arm is numbered by the re-arms before it. Snapshots carry the arm of the state they were taken from, and
    are read in order, so a snapshot of arm ``k`` is read while the state holds arm ``k`` or ``k + 1``: its rows
    are at their own positions, or ``drained`` lower.

    Attributes:
      capacity: the ring's rows.
      epoch: the arm the state holds now (re-arms so far).
      read_epoch: the arm of the last snapshot read.
      seen: that arm's write index, as last read.
      base: violations the device counted in arms before ``read_epoch`` and re-arms removed from its index (rows
        drained, and rows counted past a full ring).
      dropped: violations counted that never had a ring row (the ring was full).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.epoch = 0
        self.read_epoch = 0
        self.seen = 0
        self.base = 0
        self.dropped = 0
        self._ends: dict[int, _End] = {}

    @property
    def total(self) -> int:
        """Violations counted so far, over every arm."""
        return self.base + self.seen

    @property
    def drainable(self) -> int:
        """Rows a re-arm may drop now: those read from the arm the state holds (0 until one is read)."""
        return self.seen if self.read_epoch == self.epoch else 0

    def rearmed(self, drained: int, before: jax.Array) -> None:
        """Records a re-arm of the state's arm: ``drained`` rows dropped; ``before`` the device's index then."""
        assert 0 < drained == self.drainable, (drained, self.drainable)
        self._ends[self.epoch] = _End(drained, before)
        self.epoch += 1

    def read(self, epoch: int, index: int) -> tuple[range, int]:
        """Reads arm ``epoch``'s write index ``index``: the ring positions of the new rows in the ring the state
        holds now, and how many new violations have no row (dropped: counted past a full ring)."""
        lost = self._enter(epoch)
        if index <= self.seen:
            return range(0), lost
        assert self.epoch - epoch in (0, 1), (self.epoch, epoch)  # a second re-arm needs a read of this arm
        shift = self._ends[epoch].drained if self.epoch > epoch else 0
        first, last = min(self.seen, self.capacity), min(index, self.capacity)
        dropped = index - max(self.seen, self.capacity) if index > self.capacity else 0
        self.seen = index
        self.dropped += dropped
        return range(first - shift, last - shift), lost + dropped

    def _enter(self, epoch: int) -> int:
        """Moves reading on to arm ``epoch``; returns the violations the re-arms between found without a row."""
        lost = 0
        while self.read_epoch < epoch:
            end = self._ends.pop(self.read_epoch)
            before = int(np.asarray(end.before)[0])  # ready long ago: the drain ran before the snapshot being read
            keep = max(0, min(before, self.capacity) - end.drained)
            lost += max(0, before - max(self.seen, self.capacity))  # counted after the last read, past a full ring
            self.base += before - keep
            self.seen = max(0, min(self.seen, self.capacity) - end.drained)  # kept rows already read
            self.read_epoch += 1
        self.dropped += lost
        return lost
