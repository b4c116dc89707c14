"""The fill-once violation ring's append: a deterministic emulation of SGLang's atomic append.

SGLang reserves ``idx = atomicAdd(index, 1)`` and writes row ``idx`` only if ``idx < capacity``. Here the
reservation is the rank of a launch's violation flag, so rows land in flag (plan-entry) order on every backend, and
the index counts every flag, saturating at 2^31 - 1. :func:`append` is ``pallas_kernels.ring.place``, the phase op's
placement, on a :class:`ViolationLog`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from kvcanary_jax.core._state import ViolationLog
from pallas_kernels import ring

# i32[n] entry ids -> (u32[n, 8, 2] ring rows, i32[n, 3] their context)
RowBuilder = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def append(log: ViolationLog, flags: jax.Array, build_rows: RowBuilder) -> ViolationLog:
    """Appends one launch's rows (one per set flag, in flag order) to the fill-once ring; ``build_rows`` is asked
    for one row per ring row, whatever the number of flags."""
    placed, context, index = ring.place(
        log.violation_ring, log.violation_context, log.violation_write_index, flags, build_rows
    )
    return ViolationLog(violation_ring=placed, violation_write_index=index, violation_context=context)
