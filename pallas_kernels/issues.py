"""``INVALID_INPUT`` candidates of a batch's slot values, shared by the batch checks and the fused phase.

Which full-pool slot values (``req_to_token``'s, ``out_cache_loc``'s, and their SWA translations) a group cannot
hold, and the eight fields of the row that reports one, written once with plain ``jnp`` ops: they trace the same in
a jnp reference and inside a Pallas kernel body. Both ops import this module; neither imports the other's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import hash64, layout


def outside(raw: jax.Array, slot: jax.Array, full_slots: int, group_slots: int) -> jax.Array:
    """A full-pool value outside ``[1, full_slots)`` or its group slot outside ``[0, group_slots)``."""
    return (raw < 1) | (raw >= full_slots) | (slot < 0) | (slot >= group_slots)


def lut_reader(lut: jax.Array | None):
    """``(gather_lut, lut_size)`` of the slot formulas here for a LUT array; ``(None, None)`` without one."""
    return (None, None) if lut is None else ((lambda i: lut[i]), lut.shape[0])


def translate(slots: jax.Array, gather_lut, lut_size: int | None) -> jax.Array:
    """Full-pool slots to SWA slots (``_plans.translate``): negatives pass, indices past the table clamp to its end.

    ``gather_lut(index)`` reads the table; ``lut_size`` None means no table (the FULL group).
    """
    if lut_size is None:
        return slots
    return jnp.where(slots < 0, slots, gather_lut(jnp.clip(slots, 0, lut_size - 1)))


def slot_issue(raw: jax.Array, gather_lut, lut_size: int | None, *, full_slots: int, group_slots: int):
    """(problem, value): the ``INVALID_INPUT`` problem (0: none) of full-pool slot values (``req_to_token``'s, or
    ``out_cache_loc``'s), and the value a row names.

    Without a LUT (the FULL group): a value outside ``[0, full_slots)``, or the reserved slot 0, named as given.
    With one (an SWA group): the translation of a value the FULL group accepts, outside ``[0, group_slots)``, named
    as translated (the FULL group reports the others).
    """
    if lut_size is None:
        out_of_range = (raw < 0) | (raw >= full_slots)
        reserved = raw == layout.PADDING_SLOT
        problem = jnp.where(reserved, layout.INPUT_PROBLEM_RESERVED_SLOT, 0)
        return jnp.where(out_of_range, layout.INPUT_PROBLEM_OUT_OF_RANGE, problem).astype(jnp.int32), raw
    slot = translate(raw, gather_lut, lut_size)
    bad = (raw >= 1) & (raw < full_slots) & ((slot < 0) | (slot >= group_slots))
    return jnp.where(bad, layout.INPUT_PROBLEM_OUT_OF_RANGE, 0).astype(jnp.int32), slot


def slot_rejected(loc: jax.Array, gather_lut, lut_size: int | None, *, full_slots: int, group_slots: int):
    """bool: new full-pool slots (``out_cache_loc``) a group cannot store: outside ``[1, full_slots)``, or
    translated outside ``[0, group_slots)`` (what :func:`slot_issue` reports, in this group or the FULL one); a
    skipped token (< 0) is not."""
    return (loc >= 0) & outside(loc, translate(loc, gather_lut, lut_size), full_slots, group_slots)


# The rows of a caller's ``input_issues`` array (i32[8, n]): input_row's arguments after the tag, in order.
INPUT_ISSUE_FIELDS = ("problem", "field", "value", "limit", "slot", "position", "entry", "request")


def input_row(
    tag: int,
    problem: jax.Array,
    field,
    value: jax.Array,
    limit,
    slot,
    position,
    entry: jax.Array,
    request: jax.Array,
) -> list[hash64.U64]:
    """The eight fields of an ``INVALID_INPUT`` row (SPEC's layout, ``kvcanary_jax.runtime._inputs``): the slot
    involved, the request position, the value received, the limit it broke, the batch entry, the request row, and
    ``INVALID_INPUT | field << 32 | problem << 40`` (-1 where a field does not apply)."""
    i32 = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), problem.shape)  # noqa: E731
    high = i32(field) << (layout.INPUT_FIELD_SHIFT - 32) | problem << (layout.INPUT_PROBLEM_SHIFT - 32)
    return [
        hash64.const(tag, problem),
        hash64.from_i32(i32(slot)),
        hash64.from_i32(i32(position)),
        hash64.from_i32(i32(value)),
        hash64.from_i32(i32(limit)),
        hash64.from_i32(i32(entry)),
        hash64.from_i32(i32(request)),
        (jnp.full(problem.shape, layout.FAIL_INVALID_INPUT, jnp.uint32), high.astype(jnp.uint32)),
    ]
