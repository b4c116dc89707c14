"""Pure-jnp fused phase: the specification of one HEAD or TAIL phase of a group, the default off-GPU, the oracle.

A phase is SGLang's launch sequence for one group: build the verify and write plans from the batch, then per half
(K, then V) verify the cached slots and write this step's records. Its effects on the shared state are those of
the launches run one at a time in the order verify K, write K, verify V, write V: each launch's rows land in the
fill-once ring in plan-entry order, a verify's rows are read from the buffer as it stood before the phase's writes,
and every launch bumps its tag's counters (the phase also counts a verify overflow, when given a count).
``INVALID_INPUT`` rows, when asked for, come before them all: the caller's ``input_issues``, then the plan's table
values the pools cannot hold (``check_table``). This file states that directly, from the verify, write and store
references, in four steps each in a module of its own: the plans (``plan``), the reads before the writes
(``reads``), the rows and their placement (``rows``), then the stores and counters; the Triton kernels of
``pallas_triton`` must give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import realkv, ring
from pallas_kernels.phase import common, reads, rows
from pallas_kernels.phase import plan as plans
from pallas_kernels.write import reference as write_reference
from pallas_kernels.write import store


class Prepared(NamedTuple):
    """What every backend's phase starts from (:func:`prepare`)."""

    batch: common.Batch  # padded to one token at least, with its rows' roles
    plan: plans.Plan
    loc: jax.Array  # i32[T] each token's slot in the group; -1 where it is skipped
    pending: list  # the INVALID_INPUT rows, ``(RowSet, launch)`` per set, placed before the launches'


def prepare(
    buffers: Sequence[jax.Array],
    log: common.Log,
    batch: common.Batch,
    input_issues: jax.Array | None,
    spec: common.PhaseSpec,
) -> Prepared:
    """The plan, the written slots and the ``INVALID_INPUT`` rows of a phase (arguments as in :func:`phase`)."""
    batch = common.with_roles(common.pad_tokens(batch))  # the write chain needs at least one token
    group_slots = buffers[0].shape[0]
    full_slots = spec.full_slots or group_slots
    plan = plans.build_plan(
        batch,
        capacity=spec.verify_capacity,
        window=spec.window,
        token_offset=spec.token_offset,
        full_slots=full_slots,
        group_slots=group_slots,
    )
    gather_lut, lut_size = common.lut_reader(batch.full_to_swa_index_mapping)
    loc = batch.out_cache_loc
    if spec.skip_bad_requests:
        loc = plans.skip_rejected_requests(
            batch, plan.write_offsets, gather_lut, lut_size, full_slots=full_slots, group_slots=group_slots
        )
    loc = common.write_slots(loc, gather_lut, lut_size, group_slots)
    tag, pending = spec.tags[0], []
    if input_issues is not None:
        build = lambda _, entries: rows.input_issue_rows(input_issues, entries, tag)  # noqa: E731
        pending.append((rows.RowSet((input_issues[0] != 0)[None], build), 0))
    if spec.check_table:
        build = lambda _, entries: rows.table_rows(batch, plan, entries, tag, group_slots)  # noqa: E731
        pending.append((rows.RowSet((plan.table_problems != 0)[None], build), 0))
    return Prepared(batch, plan, loc, pending)


def verify_rows(p: Prepared, loaded: reads.Loaded, h: int, bits: jax.Array, tag: int, check: bool, capacity: int):
    """The pending verify launch ``(RowSet, 0)`` of half ``h``, from its ``loaded`` records and fail ``bits``
    (``capacity``, the ring's, is :func:`finish`'s to apply)."""
    del capacity
    return rows.verify_set(p.batch, loaded, bits[None], (h,), (tag,), check), 0


def write_rows(p: Prepared, chain: write_reference.ChainOut, tag: int, capacity: int):
    """The pending write launch ``(RowSet, 0)`` of one half, from its chain walk."""
    del capacity
    return rows.write_set(p.batch, p.plan.write_offsets, p.loc, reads.stack_halves([chain]), (tag,)), 0


def finish(
    log: common.Log, p: Prepared, pending: list, buffers: Sequence[jax.Array], written: jax.Array, tags: Sequence[int]
) -> tuple[tuple[jax.Array, ...], common.Log, jax.Array]:
    """Places the phase's rows in order (``pending``: ``(RowSet, launch)`` per launch, in ring order) and bumps
    its counters (a verify and a write per tag; ``written`` is a half's bool[T] written tokens)."""
    placed, context, write_index = rows.place(log, pending)
    entries = p.plan.active + jnp.sum(written, dtype=jnp.int32)
    overflows = log.verify_overflows
    if overflows is not None:
        overflows = common.count_overflow(overflows, p.plan.enable == 0)
    new_log = common.Log(
        ring=placed,
        write_index=write_index,
        kernel_run_counters=ring.bump(log.kernel_run_counters, {tag: jnp.int32(2) for tag in tags}),
        slot_run_counters=ring.bump(log.slot_run_counters, {tag: entries for tag in tags}),
        context=context,
        verify_overflows=overflows,
    )
    return tuple(buffers), new_log, p.plan.enable


def phase(
    buffers: Sequence[jax.Array],
    log: common.Log,
    batch: common.Batch,
    enable_chain_position_assert: jax.Array,
    real_kv_sources: Sequence[Sequence[realkv.RealKvSource]],
    input_issues: jax.Array | None,
    spec: common.PhaseSpec,
) -> tuple[tuple[jax.Array, ...], common.Log, jax.Array]:
    """One phase of one group: per half, verify the plan's cached slots, then write this step's records.

    Args:
      buffers: per half (K, then V), u32[num_slots, 4, 2] canary buffers (one or two).
      log: the ring, write index and counters (:class:`common.Log`).
      batch: the step's arrays (:class:`common.Batch`); the token check is on when ``batch.token_ids`` is given,
        the write input assert when ``batch.expected_input_ids`` is.
      enable_chain_position_assert: i32[1].
      real_kv_sources: per half, the sources folded into REAL_KV_HASH (empty on HEAD phases).
      input_issues: i32[8, n] ``INVALID_INPUT`` candidates the caller checked (rows ``common.INPUT_ISSUE_FIELDS``;
        problem 0: none), placed first, in order, tagged ``spec.tags[0]``; or None.
      spec: the static arguments (:class:`common.PhaseSpec`).

    Returns:
      ``(buffers, log, enable)``: the new buffers and log, and i32[1] 0 when the verify plan overflowed.
    """
    p = prepare(buffers, log, batch, input_issues, spec)
    batch, plan, loc = p.batch, p.plan, p.loc
    check = batch.token_ids is not None
    loaded = reads.read_halves(buffers, plan, loc, real_kv_sources, spec.real_kv_hash_mode, check)
    chains = reads.walk_halves(loaded, plan, batch, loc, enable_chain_position_assert)
    verify = rows.verify_set(batch, loaded, None, range(len(buffers)), spec.tags, check)
    write = rows.write_set(batch, plan.write_offsets, loc, chains, spec.tags)
    target = loc + reads.loaded_after(loaded)  # the stores wait for every record the rows read from the buffers
    written = chains.written[0]  # the halves' chains write the same tokens: one last-writer pass serves both
    new_buffers = [
        store.store(buf, target, batch.input_ids, batch.positions, prev_hash, loaded.write_kv(h), written)
        for h, (buf, prev_hash) in enumerate(zip(buffers, chains.prev_hash, strict=True))
    ]
    pending = list(p.pending) + [(row_set, h) for h in range(len(buffers)) for row_set in (verify, write)]
    return finish(log, p, pending, new_buffers, written, spec.tags)
