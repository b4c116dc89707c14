"""In-jit checks of a batch's values: what the canary cannot check as given becomes one ``INVALID_INPUT`` row.

JAX clamps out-of-range gathers and drops out-of-range scatters without a word, so a batch whose conventions
differ from the canary's would go unchecked, or report rows that name nothing. Before the launches, every value
they index with is checked against the pool, the table and the token arrays (the rows and the FULL pool's new slots
by the lower layer's ``batch_checks`` op, one launch on GPU). A bad value is reported once per step,
as a row naming the field, the batch entry and the value, and is masked out of the launches: its row (request) is
not verified or written, its slot is skipped, so it adds no rows of its own. A request with a bad new slot writes
nothing (a partial write would trip the chain-position assert), one whose seed slot is bad starts a new chain, and
rows after one whose token span cannot be located (a negative length, or past the token arrays) are skipped with
it. Padding is never a violation. The cached positions' ``req_to_token`` values are checked by the phase that
reads them (the fused phase op's ``check_table``, or :attr:`Group.table_issues` on the per-launch path): the plan's
listed entries, i.e. the first ``verify_capacity`` cached positions, even when the verify overflows. The fused phase
also skips the requests itself (``skip_bad_requests``); the per-launch path gets :func:`request_slots`.

An ``INVALID_INPUT`` row keeps SGLang's eight fields: ``launch_tag`` is the group's HEAD K tag, ``slot_idx`` the slot
involved (-1 if none), ``position`` the request position (-1 if none), ``stored_token`` the value received,
``expected_token`` the exclusive limit it broke (-1 if none), ``stored_chain_hash`` the batch entry (row or token
index), ``expected_aux`` the request row (-1 if unknown), and ``fail_reason_bits`` is
``INVALID_INPUT | field << 32 | problem << 40`` (:class:`InputField`, :class:`InputProblem`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvcanary_jax.core import _plans, _ring
from kvcanary_jax.core._constants import InputField
from pallas_kernels.batch_checks import api as batch_checks
from pallas_kernels.batch_checks import reference as batch_checks_reference
from pallas_kernels.phase import common as phase_common


@dataclasses.dataclass(frozen=True)
class Issues:
    """Parallel i32[n] arrays, one entry per checked value; ``problem == 0`` where the value is fine."""

    problem: jax.Array
    field: jax.Array
    value: jax.Array
    limit: jax.Array
    slot: jax.Array
    position: jax.Array
    entry: jax.Array
    request: jax.Array

    @classmethod
    def of(cls, problem, field, value, *, limit=-1, slot=-1, position=-1, entry=-1, request=-1) -> Issues:
        """Broadcasts every field to ``problem``'s shape."""
        full = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), problem.shape)  # noqa: E731
        return cls(*(full(x) for x in (problem, field, value, limit, slot, position, entry, request)))

    @classmethod
    def unstacked(cls, issues: jax.Array) -> Issues:
        """From an i32[8, n] array of candidates (rows ``phase.common.INPUT_ISSUE_FIELDS``), :meth:`stacked`'s."""
        return cls(*(issues[f] for f in range(len(phase_common.INPUT_ISSUE_FIELDS))))

    @staticmethod
    def concat(parts: list[Issues]) -> Issues:
        return Issues(*(jnp.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Issues)))

    def stacked(self) -> jax.Array:
        """i32[8, n]: the fields as the fused phase's ``input_issues`` (rows ``phase.common.INPUT_ISSUE_FIELDS``)."""
        return jnp.stack([getattr(self, name) for name in phase_common.INPUT_ISSUE_FIELDS])

    def launch_rows(self, tag: int):
        """``(flags, build_rows)`` for :func:`kvcanary_jax.core._ops.pending_rows`."""

        def build_rows(entry):
            at = {f.name: getattr(self, f.name)[entry] for f in dataclasses.fields(Issues)}
            rows = _ring.pack_row(phase_common.input_row(tag, **at))
            return rows, _ring.context(at["request"], at["position"], at["entry"])

        return self.problem != 0, build_rows


def check_rows(
    batch,
    *,
    padding: str,
    table_rows: int,
    context_len: int,
    num_slots: int,
    token_ids_width: int | None,
    backend: str,
) -> batch_checks.Checked:
    """Checks each batch row (its request row, its lengths, its tokens' span) and each request token's new slot;
    says which rows are requests (``pallas_kernels.batch_checks``: one Triton launch on GPU, jnp elsewhere).

    Args:
      batch: the :class:`CanaryBatch` (jax arrays).
      padding: the pool's convention: ``"negative"`` (rows < 0 are padding), ``"reserved"`` (row 0 is padding) or
        ``"none"`` (no padding rows).
      table_rows, context_len: ``req_to_token``'s shape.
      num_slots: the FULL pool's slots.
      token_ids_width: the expected-token pool's width when the verify-token assert is on, else None.
      backend: the canary's backend; the op has no Mosaic kernel, so on TPU it runs its jnp reference.

    Returns:
      The op's :class:`~pallas_kernels.batch_checks.reference.Checked`, which the runner carries through the step:
      the rows' roles (``active``, ``span_lens``, ``span_starts``, ``token_rows``) and ``issues``, the FULL group's
      ``INVALID_INPUT`` candidates.
    """
    return batch_checks.check(
        batch.req_pool_indices,
        batch.prefix_lens,
        batch.extend_lens,
        batch.out_cache_loc,
        None if token_ids_width is None else batch.token_ids_lens,
        padding=padding,
        table_rows=table_rows,
        context_len=context_len,
        num_slots=num_slots,
        token_ids_width=token_ids_width,
        backend={"interpret_tpu": "xla", "pallas": "auto"}.get(backend, backend),
    )


def token_history_lens(batch, token_pool: jax.Array) -> jax.Array:
    """i32[bs] the known prefix of each row's token history, within the expected-token pool's width (a longer one
    is an ``INVALID_INPUT`` row of the rows' checks)."""
    return jnp.clip(batch.token_ids_lens, 0, token_pool.shape[1])


def request_slots(
    batch,
    rows: batch_checks.Checked,
    *,
    full_num_slots: int,
    lut: jax.Array | None = None,
    num_slots: int | None = None,
) -> jax.Array:
    """i32[T] each token's FULL-pool slot for the launches; -1 (skipped) for the tokens of rows that are not
    requests, and for every token of a request with a slot the checks reject (outside ``[1, full_num_slots)``, or,
    given the group's ``lut``, translated outside ``[0, num_slots)``).

    A request with a bad new slot is not written at all: skipping only that token would leave a gap in its chain,
    which the chain-position assert would report on the token after it (rows for a value already reported).
    """
    loc, live = batch.out_cache_loc, batch_checks_reference.live_tokens(rows.token_rows, rows.active)
    group_slots = full_num_slots if lut is None else num_slots
    rejected = phase_common.slot_rejected(
        loc, *phase_common.lut_reader(lut), full_slots=full_num_slots, group_slots=group_slots
    )
    row_of = jnp.maximum(rows.token_rows, 0)
    unwritten = batch_checks_reference.segment_any(live & rejected, rows.token_rows, rows.active.shape[0])
    return jnp.where(live & ~unwritten[row_of], loc, -1)


def group_issues(batch, rows: batch_checks.Checked, *, window: int, num_slots: int, full_num_slots: int) -> jax.Array:
    """i32[8, n]: a group's ``INVALID_INPUT`` candidates of the rows and tokens, in ring order (rows
    ``INPUT_ISSUE_FIELDS``). (The cached positions' ``req_to_token`` values are the phase's: ``check_table``.)

    The FULL group's (``window == 0``) are the op's (``rows.issues``): each row's, then each request's
    ``token_ids_lens`` when the verify-token assert is on, then each token's ``out_cache_loc`` against
    ``[1, num_slots)``. The SWA group checks what ``full_to_swa_index_mapping`` makes of the slots the FULL group
    accepted, against its own ``num_slots``; its tokens' positions and requests are the op's
    (``token_position_and_request``).
    """
    if not window:
        return rows.issues
    t = jnp.arange(batch.out_cache_loc.shape[0], dtype=jnp.int32)
    row_of = jnp.maximum(rows.token_rows, 0)
    position, request = batch_checks_reference.token_position_and_request(
        t,
        batch.prefix_lens[row_of],
        rows.span_starts[row_of],
        batch.req_pool_indices[row_of],
        batch_checks_reference.live_tokens(rows.token_rows, rows.active),
    )
    full_loc = request_slots(batch, rows, full_num_slots=full_num_slots)  # the FULL group reports the others
    problem, swa_loc = phase_common.slot_issue(
        full_loc,
        *phase_common.lut_reader(batch.full_to_swa_index_mapping),
        full_slots=full_num_slots,
        group_slots=num_slots,
    )
    return Issues.of(
        problem,
        InputField.FULL_TO_SWA_INDEX_MAPPING,
        swa_loc,
        limit=num_slots,
        slot=full_loc,
        position=position,
        entry=t,
        request=request,
    ).stacked()


@dataclasses.dataclass(frozen=True)
class Group:
    """One group's plans for the per-launch ops, with the values the checks reject masked out.

    Attributes:
      verify_plan, write_plan: the plans, bad slots skipped (slot 0) and bad predecessors unreachable (0), as
        ``pallas_kernels.phase.common.plan_slots`` does it in the fused phase.
      out_cache_loc: i32[T] the group's write slots; -1 for the tokens the launches skip.
      entry_requests: i32[2, verify_capacity] each verify entry's request row and batch row (rows' context).
      table_issues: the listed entries' ``req_to_token`` values the pools cannot hold (the fused phase's
        ``check_table``), in plan-entry order.
    """

    verify_plan: _plans.VerifyPlan
    write_plan: _plans.WritePlan
    out_cache_loc: jax.Array
    entry_requests: jax.Array
    table_issues: Issues


def check_group(
    batch,
    rows: batch_checks.Checked,
    *,
    window: int,
    num_slots: int,
    full_num_slots: int,
    verify_capacity: int,
    token_pool: jax.Array | None,
    token_offset: int,
) -> Group:
    """Builds one group's plans from the checked rows for the per-launch ops (the fused phase builds its own)."""
    rpi = batch.req_pool_indices
    lut = batch.full_to_swa_index_mapping if window else None
    valid_lens = None if token_pool is None else token_history_lens(batch, token_pool)
    verify_plan, write_plan, plan_rows = _plans.build(
        jnp.where(rows.active != 0, rpi, 0),
        batch.prefix_lens,
        batch.extend_lens,
        batch.req_to_token,
        active=rows.active != 0,
        span_lens=rows.span_lens,
        verify_capacity=verify_capacity,
        write_req_capacity=rpi.shape[0],
        swa_window_size=window,
        full_to_swa_index_mapping=lut,
        req_to_verify_expected_tokens=token_pool,
        expected_tokens_valid_lens=valid_lens,
        kv_token_id_vs_position_offset=token_offset,
    )
    entries = jnp.arange(verify_capacity, dtype=jnp.int32)
    used = (entries < verify_plan.num_valid[0]) & (verify_plan.enable[0] != 0)
    gather_lut, lut_size = phase_common.lut_reader(lut)
    slot, prev = phase_common.plan_slots(
        plan_rows.raw_slots,
        plan_rows.raw_prev,
        verify_plan.expected_positions,
        gather_lut,
        lut_size,
        full_slots=full_num_slots,
        group_slots=num_slots,
    )
    verify_plan = dataclasses.replace(
        verify_plan, slot_indices=jnp.where(used, slot, 0), prev_slot_indices=jnp.where(used, prev, 0)
    )
    batch_row = jnp.where(used, plan_rows.verify_rows, -1)
    request = jnp.where(used, rpi[jnp.maximum(batch_row, 0)], -1)
    problem, value = phase_common.slot_issue(
        plan_rows.raw_slots, gather_lut, lut_size, full_slots=full_num_slots, group_slots=num_slots
    )
    table_issues = Issues.of(
        **phase_common.table_issue(
            jnp.where(entries < verify_plan.num_valid[0], problem, 0),
            value,
            plan_rows.raw_slots,
            plan_rows.positions,
            plan_rows.verify_rows,
            rpi[jnp.maximum(plan_rows.verify_rows, 0)],
            has_lut=lut is not None,
            group_slots=num_slots,
        )
    )
    full_loc = request_slots(batch, rows, full_num_slots=full_num_slots, lut=lut, num_slots=num_slots)
    # A request whose seed (its last cached slot) is bad starts a new chain: there is no record to continue from
    # or to compare positions with. (The seed is a cached position: the verify checks report it.)
    bs = rpi.shape[0]
    table = batch.req_to_token
    raw_seed = table[jnp.clip(rpi, 0, table.shape[0] - 1), jnp.clip(batch.prefix_lens - 1, 0, table.shape[1] - 1)]
    seed_live = (rows.active != 0) & (batch.prefix_lens > 0) & (rows.span_lens > 0)
    seeds = phase_common.seed_slot(
        raw_seed, seed_live, gather_lut, lut_size, full_slots=full_num_slots, group_slots=num_slots
    )
    write_plan = dataclasses.replace(write_plan, seed_slot_indices=write_plan.seed_slot_indices.at[:bs].set(seeds))
    return Group(
        verify_plan=verify_plan,
        write_plan=write_plan,
        out_cache_loc=phase_common.write_slots(full_loc, gather_lut, lut_size, num_slots),
        entry_requests=jnp.stack([request, batch_row]),
        table_issues=table_issues,
    )
