"""The phase's rows in jnp: the ``INVALID_INPUT``, verify and write rows it may place, built only for the candidates
the ring takes, and their placement in ring order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import hash64, layout, ring
from pallas_kernels.phase import common, reads
from pallas_kernels.phase import plan as plans
from pallas_kernels.write import reference as write_reference


def table_rows(batch: common.Batch, plan: plans.Plan, entries, tag: int, group_slots: int):
    """(rows, context) of the ``INVALID_INPUT`` rows of table-issue ``entries``."""
    batch_row, position = plan.entry_rows[entries], plan.positions[entries]
    request = batch.req_pool_indices[batch_row]
    issue = common.table_issue(
        plan.table_problems[entries],
        plan.table_values[entries],
        plan.raw_slots[entries],
        position,
        batch_row,
        request,
        has_lut=batch.full_to_swa_index_mapping is not None,
        group_slots=group_slots,
    )
    return ring.pack_row(common.input_row(tag, **issue)), ring.row_context(request, position, batch_row)


def input_issue_rows(input_issues: jax.Array, entries, tag: int):
    """(rows, context) of the caller's ``input_issues`` columns ``entries``."""
    at = dict(zip(common.INPUT_ISSUE_FIELDS, input_issues[:, entries], strict=True))
    return ring.pack_row(common.input_row(tag, **at)), ring.row_context(at["request"], at["position"], at["entry"])


def write_input_bits(batch: common.Batch, written: jax.Array) -> jax.Array:
    """i32[..., T] the write input assert's ``FAIL_WRITE_TOKEN | FAIL_WRITE_POSITION`` bits of the ``written``
    entries (0 when the assert is off)."""
    if batch.expected_input_ids is None:
        return jnp.zeros(written.shape, batch.input_ids.dtype)
    bits = jnp.where(written & (batch.input_ids != batch.expected_input_ids), layout.FAIL_WRITE_TOKEN, 0)
    bad_position = written & (batch.positions != batch.expected_positions)
    return bits | jnp.where(bad_position, layout.FAIL_WRITE_POSITION, 0)


class RowSet(NamedTuple):
    """The candidate rows of one kind of ``m`` launches: ``flags`` bool[m, n], each launch's candidates in order,
    and ``build(launch, entry)`` (i32 arrays of one shape) -> ``(rows u32[..., 8, 2], context i32[..., 3])`` of
    any of them. A phase's rows are built only when the ring takes some (:func:`place`)."""

    flags: jax.Array
    build: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _tagged(rows: jax.Array, tags: Sequence[int], launch: jax.Array) -> jax.Array:
    """``rows`` (built with tag 0) with each row's launch tag, ``tags[launch]`` (a tag's high word is 0), set by an
    element-wise OR that fuses with the rows' packing (an indexed update would be a kernel of its own)."""
    field, word = jnp.indices(rows.shape[-2:])
    at_tag = (field == layout.ROW_LAUNCH_TAG) & (word == 0)
    return rows | jnp.where(at_tag, jnp.asarray(tags, jnp.uint32)[launch][..., None, None], jnp.uint32(0))


def verify_set(
    batch: common.Batch,
    loaded: reads.Loaded,
    bits: jax.Array | None,
    halves: Sequence[int],
    tags: Sequence[int],
    check: bool,
) -> RowSet:
    """The verify rows of launches that read half ``halves[j]`` of ``loaded``, one tag each, with fail ``bits``
    i32[launches, capacity] (None: ``loaded``'s own, read where the rows are built)."""

    def build(launch, entries):
        stored, expected_chain, own_bits, at = loaded.verify(jnp.asarray(halves, jnp.int32)[launch], entries)
        slot, prev, token, position, batch_row = at
        token = token if check else jnp.full_like(entries, -1)
        entry_bits = own_bits if bits is None else bits[launch, entries]
        fields = common.verify_row(0, slot, prev, stored, expected_chain, token, entry_bits)
        context = ring.row_context(batch.req_pool_indices[batch_row], position, batch_row)
        return _tagged(ring.pack_row(fields), tags, launch), context

    return RowSet((loaded.bits() if bits is None else bits) != 0, build)


def write_set(
    batch: common.Batch, write_offsets: jax.Array, loc: jax.Array, chain: write_reference.ChainOut, tags: Sequence[int]
) -> RowSet:
    """The write rows of each half's chain walk (``chain`` stacked on a leading half axis, one tag per half):
    per token an input-assert row, then a chain-position row."""
    input_bits = write_input_bits(batch, chain.written)
    flags = jnp.stack([input_bits != 0, chain.position_assert_failed], axis=-1).reshape(len(tags), -1)

    # Per half and token, every value a row reads (u32): token, position, expected token and position (the
    # input assert's; the written ones when it is off), slot, request row, input bits, the chain's expected
    # position and prev hash. One gather of it builds any row.
    expected_ids, expected_positions = batch.input_ids, batch.positions
    if batch.expected_input_ids is not None:
        expected_ids, expected_positions = batch.expected_input_ids, batch.expected_positions
    token_rows = common.token_row(write_offsets, jnp.arange(loc.shape[0], dtype=jnp.int32))
    request = batch.req_pool_indices[token_rows]
    shared = jnp.stack([batch.input_ids, batch.positions, expected_ids, expected_positions, loc, request], axis=-1)
    as_u32 = lambda x: lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)  # noqa: E731 (i32 under x64 too)
    per_half = [as_u32(input_bits)[..., None], chain.expected_position, chain.prev_hash]
    shared = jnp.broadcast_to(as_u32(shared), (len(tags), *shared.shape))
    values = jnp.concatenate([shared, *per_half], axis=-1)

    def build(launch, entries):
        i, is_chain_row = entries // 2, entries % 2 == 1
        at = values[launch, i]
        token, position, expected_id, expected_position, slot, request, input_bit = (
            lax.bitcast_convert_type(at[..., c], jnp.int32) for c in range(7)
        )
        expected_token = jnp.where(is_chain_row, token, expected_id)
        aux = hash64.where(is_chain_row, hash64.split(at[..., 7:9]), hash64.from_i32(expected_position))
        bits = jnp.where(is_chain_row, layout.FAIL_WRITE_POSITION, input_bit)
        prev_hash = hash64.split(at[..., 9:11])
        rows = ring.pack_row(common.write_row(0, slot, position, token, expected_token, prev_hash, aux, bits))
        aux_i32 = lax.bitcast_convert_type(aux[0], jnp.int32)
        return _tagged(rows, tags, launch), ring.row_context(request, aux_i32, i)

    return RowSet(flags, build)


def place(log: common.Log, pending: list) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """``ring.place`` of every pending launch's candidates at once, each kind's rows built once for all its
    launches."""

    def build(at):  # the rows of the candidates ``at`` (every pending launch's, in ring order)
        tables = {}
        for rows, _ in pending:
            if id(rows) not in tables:
                launch, entry = jnp.indices(rows.flags.shape, jnp.int32)
                tables[id(rows)] = rows.build(launch, entry)
        table = [jax.tree.map(lambda x, j=j: x[j], tables[id(rows)]) for rows, j in pending]
        return tuple(jnp.concatenate(parts)[at] for parts in zip(*table, strict=True))

    flags = jnp.concatenate([rows.flags[launch] for rows, launch in pending])
    return ring.place(log.ring, log.context, log.write_index, flags, build)
