"""Element-wise pieces of the fused phase shared by the jnp reference and the Triton kernels.

Plan formulas (SGLang's plan kernels: per-request verify and write lengths, slot translation) and the two
violation-row layouts are written once here with plain ``jnp`` ops, so they trace the same way in a jitted jnp
function and inside a Pallas kernel body.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import hash64, issues, layout, records, validate

# Per-token write flags of the chain walk (one i32 word per token and half).
FLAG_WRITTEN = 1
FLAG_CHAIN_POSITION = 2  # the chain-position assert failed: one WRITE_POSITION row
INPUT_BITS = layout.FAIL_WRITE_TOKEN | layout.FAIL_WRITE_POSITION  # the input assert's row bits, kept as they are
_INT32_MAX = 2**31 - 1

# The slot formulas and INVALID_INPUT row the phase shares with the batch checks (``pallas_kernels.issues``).
INPUT_ISSUE_FIELDS = issues.INPUT_ISSUE_FIELDS
input_row = issues.input_row
lut_reader = issues.lut_reader
slot_issue = issues.slot_issue
slot_rejected = issues.slot_rejected
translate = issues.translate


@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    """A phase's static arguments as one hashable value (a ``jax.jit`` static argument); its own values are
    checked here, the ones that depend on the arrays by ``api.phase``.

    Attributes:
      tags: the launch tag of each half (K, then V); a half's verify and write share it.
      real_kv_hash_mode: NONE=0, PARTIAL=1 or ALL=2 (the real-KV sources folded into REAL_KV_HASH).
      verify_capacity: the verify plan's capacity (positive); a batch with more entries skips its verify.
      window: > 0 verifies only the last ``window`` cached positions (an SWA group, which needs the batch's LUT).
      token_offset: the token at KV position p is token p + offset (the verify-token check).
      full_slots: the FULL pool's slot count (the range of ``req_to_token``'s values); None: the buffers'. Plan
        entries whose slots the pools cannot hold are left out (:func:`plan_slots`); tokens whose slot is outside
        the group's pool are skipped.
      check_table: report those ``req_to_token`` values of the listed plan entries (the first
        ``verify_capacity`` cached positions, overflow or not) as ``INVALID_INPUT`` rows, tagged ``tags[0]``,
        ahead of the launches' rows (:func:`slot_issue`); for the phase that checks the batch (the HEAD's).
      skip_bad_requests: write nothing for the tokens of a row that is not a request (``Batch.active``), nor for
        any token of a request with a new slot the group cannot store (:func:`slot_rejected`): a partial write
        would trip the chain-position assert. Off, each token's slot alone decides.
    """

    tags: tuple[int, ...]
    real_kv_hash_mode: int = 0
    verify_capacity: int = 1
    window: int = 0
    token_offset: int = 0
    full_slots: int | None = None
    check_table: bool = False
    skip_bad_requests: bool = False

    def __post_init__(self):
        tags = self.tags
        if not isinstance(tags, (tuple, list)) or len(set(tags)) != len(tags):
            raise ValueError(f"tags must hold one distinct launch tag per buffer; got {tags=}")
        # int(): a CanaryLaunchTag becomes a plain int; a bool stays, so static_int rejects it.
        tags = tuple(
            validate.static_int(f"tags[{h}]", t if isinstance(t, bool) or not isinstance(t, int) else int(t))
            for h, t in enumerate(tags)
        )
        object.__setattr__(self, "tags", tags)
        mode = validate.static_int("real_kv_hash_mode", self.real_kv_hash_mode, maximum=layout.REAL_KV_ALL + 1)
        object.__setattr__(self, "real_kv_hash_mode", mode)
        validate.positive_int("verify_capacity", self.verify_capacity)
        validate.static_int("window", self.window)
        validate.static_int("token_offset", self.token_offset, minimum=-(2**31))
        if self.full_slots is not None:
            object.__setattr__(self, "full_slots", validate.positive_int("full_slots", self.full_slots))
        for name in ("check_table", "skip_bad_requests"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One forward step's int32 arrays, the one batch type of both layers (``kvcanary_jax.CanaryBatch`` is it,
    with the user's docstring).

    Attributes:
      req_pool_indices, prefix_lens, extend_lens: i32[R] (by default row 0 of ``req_to_token`` is padding).
      req_to_token: i32[max_reqs, max_context_len] full-pool slot of each (row, position).
      input_ids, positions, out_cache_loc: i32[T] this step's tokens, request-major (full-pool slots).
      full_to_swa_index_mapping: i32[full_slots + 1], or None; given, it translates every slot (SWA group).
      expected_input_ids: i32[T] the write input assert's oracle, or None (off).
      expected_positions: i32[T] its positions; None: ``positions``.
      token_ids: i32[rows, len] expected token of each (``req_to_token`` row, position): the verify-token check
        is on when given.
      token_ids_lens: i32[R] valid prefix of each request's ``token_ids`` row; with ``token_ids`` only.
      active: i32[R] nonzero for the rows that are requests (verified, seeding a chain); None: SGLang's
        ``req_pool_indices != 0``.
      span_lens: i32[R] (>= 0) token entries each row owns, request-major; a row that is not a request may own
        tokens, which the caller skips (``out_cache_loc < 0``). None: SGLang's, ``max(extend_lens, 0)`` for the
        active rows and 0 for the others.
    """

    req_pool_indices: jax.Array
    prefix_lens: jax.Array
    extend_lens: jax.Array
    req_to_token: jax.Array
    input_ids: jax.Array
    positions: jax.Array
    out_cache_loc: jax.Array
    full_to_swa_index_mapping: jax.Array | None = None
    expected_input_ids: jax.Array | None = None
    expected_positions: jax.Array | None = None
    token_ids: jax.Array | None = None
    token_ids_lens: jax.Array | None = None
    active: jax.Array | None = None
    span_lens: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ValidBatch(Batch):
    """A :class:`Batch` that ``api.validate_batch`` passed: ``api.run`` takes it as it is, without validating it
    again. Replace its fields only with arrays of the shapes and dtypes validated (the runner fills in the config's
    choices and the batch checks' roles)."""


def with_roles(batch: Batch) -> Batch:
    """``batch`` with ``active`` and ``span_lens`` given (SGLang's when they were None), as i32[R], and the input
    assert's ``expected_positions`` (``positions`` when None)."""
    active = batch.active if batch.active is not None else (batch.req_pool_indices != 0).astype(jnp.int32)
    span = batch.span_lens
    if span is None:
        span = jnp.where(active != 0, jnp.maximum(batch.extend_lens, 0), 0).astype(jnp.int32)
    expected = batch.expected_positions
    if batch.expected_input_ids is not None and expected is None:
        expected = batch.positions
    return dataclasses.replace(batch, active=active.astype(jnp.int32), span_lens=span, expected_positions=expected)


class Log(NamedTuple):
    """The state a phase appends to and counts in.

    Attributes:
      ring: u32[capacity, 8, 2] fill-once violation rows.
      write_index: i32[1] violations seen so far (saturates at 2^31 - 1).
      kernel_run_counters, slot_run_counters: u32[num_tags, 2] u64 counters per launch tag.
      context: i32[capacity, 3] beside each row: its request row (``req_pool_indices`` of its batch row), expected
        position, and batch entry (batch row of a verify row, token entry of a write row); None keeps none.
      verify_overflows: i32[1] phases whose verify plan overflowed its capacity (and was skipped): +1 when this
        one's does, saturating at 2^31 - 1; None counts none (a TAIL phase rebuilds the HEAD's plan).
    """

    ring: jax.Array
    write_index: jax.Array
    kernel_run_counters: jax.Array
    slot_run_counters: jax.Array
    context: jax.Array | None = None
    verify_overflows: jax.Array | None = None


def count_overflow(verify_overflows: jax.Array, overflowed: jax.Array) -> jax.Array:
    """``verify_overflows`` (i32) + 1 where ``overflowed``, saturating at 2^31 - 1 (a counter never wraps)."""
    return verify_overflows + (overflowed & (verify_overflows < _INT32_MAX)).astype(jnp.int32)


def pad_tokens(batch: Batch) -> Batch:
    """A batch of no tokens gets one skipped token (``out_cache_loc = -1``): same effects, no empty arrays."""
    if batch.input_ids.shape[0]:
        return batch
    one = lambda fill: jnp.full((1,), fill, jnp.int32)  # noqa: E731
    padded = dict(input_ids=one(0), positions=one(0), out_cache_loc=one(-1))
    if batch.expected_input_ids is not None:
        padded.update(expected_input_ids=one(0))
    if batch.expected_positions is not None:
        padded.update(expected_positions=one(0))
    return dataclasses.replace(batch, **padded)


def jnp_index(i: jax.Array, n: int) -> jax.Array:
    """The row a jnp gather reads for index ``i`` of an axis of length ``n``: negatives wrap once, then clamp.

    The kernels gather from refs, which do no such normalisation; they apply this to user-given indices
    (``req_pool_indices``) so they read exactly what the jnp plan build reads, even for out-of-range rows.
    """
    return jnp.clip(jnp.where(i < 0, i + n, i), 0, n - 1)


def window_start(prefix_lens: jax.Array, window: int) -> jax.Array:
    """First verified position: the last ``window`` cached positions with a sliding window, else 0."""
    return jnp.maximum(prefix_lens - window, 0) if window > 0 else jnp.zeros_like(prefix_lens)


def verify_len(active: jax.Array, prefix_lens: jax.Array, window: int) -> jax.Array:
    """Verify entries of each row: its cached positions (in the window); 0 for a row that is not a request."""
    return jnp.where(active != 0, jnp.maximum(prefix_lens - window_start(prefix_lens, window), 0), 0)


def plan_slots(
    raw: jax.Array,
    raw_prev: jax.Array,
    position: jax.Array,
    gather_lut,
    lut_size: int | None,
    *,
    full_slots: int,
    group_slots: int,
) -> tuple[jax.Array, jax.Array]:
    """(slot, prev) of plan entries at ``position`` from their ``req_to_token`` values (``raw_prev`` is read at
    ``position - 1``; a chain head, position 0, has none).

    A value the pools cannot hold is left out, as the runner's input checks report it: a slot outside
    ``[1, full_slots)``, or whose SWA translation is outside ``[0, group_slots)``, becomes 0 (skipped); such a
    predecessor becomes 0 (unreachable: no chain check). Heads are told by position, not value: a table entry of
    -1 is a bad predecessor, not the head marker. Valid values translate as SGLang's plan does.
    """
    slot = translate(raw, gather_lut, lut_size)
    prev = translate(raw_prev, gather_lut, lut_size)
    head = position <= 0
    return (
        jnp.where(issues.outside(raw, slot, full_slots, group_slots), layout.PADDING_SLOT, slot),
        jnp.where(head, -1, jnp.where(issues.outside(raw_prev, prev, full_slots, group_slots), 0, prev)),
    )


def seed_slot(raw: jax.Array, live: jax.Array, gather_lut, lut_size: int | None, *, full_slots: int, group_slots: int):
    """The group's slot a request's chain continues from (its last cached slot, ``raw`` in the full pool); -1 (a
    new chain) where the request writes no continuation (not ``live``) or the slot is one the pools cannot hold."""
    slot = translate(raw, gather_lut, lut_size)
    return jnp.where(live & ~issues.outside(raw, slot, full_slots, group_slots), slot, -1)


def table_issue(problem, value, raw, position, batch_row, request, *, has_lut: bool, group_slots: int) -> dict:
    """The ``INVALID_INPUT`` fields (names ``INPUT_ISSUE_FIELDS``, for :func:`input_row`) of ``req_to_token``
    values :func:`slot_issue` judged: the value as it names it and the group's slot count as the limit, the raw
    value as the slot, the request position, the batch row as the entry, and the request row."""
    field = layout.INPUT_FIELD_FULL_TO_SWA_INDEX_MAPPING if has_lut else layout.INPUT_FIELD_REQ_TO_TOKEN
    return dict(
        problem=problem,
        field=field,
        value=value,
        limit=group_slots,
        slot=raw,
        position=position,
        entry=batch_row,
        request=request,
    )


def write_slots(out_cache_loc: jax.Array, gather_lut, lut_size: int | None, group_slots: int) -> jax.Array:
    """The group's slot of each token; -1 (skipped: not stored, the chain does not advance) where the token is
    skipped (< 0) or its slot is outside the group's pool."""
    slot = translate(out_cache_loc, gather_lut, lut_size)
    return jnp.where((slot >= 0) & (slot < group_slots), slot, -1)


def token_row(write_offsets: jax.Array, i: jax.Array) -> jax.Array:
    """The row whose span ``[write_offsets[r], write_offsets[r + 1])`` holds token entry ``i`` (clamped)."""
    num_rows = write_offsets.shape[0] - 1
    row = jnp.sum((write_offsets[None, 1:] <= i[..., None]).astype(jnp.int32), axis=-1)
    return jnp.minimum(row, num_rows - 1)


def verify_row(
    tag: int,
    slot: jax.Array,
    prev: jax.Array,
    stored: records.Record,
    expected_chain: hash64.U64,
    expected_token: jax.Array,
    bits: jax.Array,
) -> list[hash64.U64]:
    """The eight fields of a verify row (SGLang's ``canary_verify`` row), from already loaded values.

    ``expected_chain`` is H(prev) (the anchor for prev < 0); an unreachable entry (prev == 0) reports its stored
    PREV_HASH instead. ``expected_token`` is -1 when the token check is off.
    """
    token, position, prev_hash, _ = stored
    return [
        hash64.const(tag, slot),
        hash64.from_i32(slot),
        position,
        token,
        hash64.from_i32(expected_token),
        prev_hash,
        hash64.where(prev != 0, expected_chain, prev_hash),
        hash64.from_i32(bits),
    ]


def write_row(
    tag: int,
    slot: jax.Array,
    position: jax.Array,
    token: jax.Array,
    expected_token: jax.Array,
    prev_hash: hash64.U64,
    aux: hash64.U64,
    bits: jax.Array,
) -> list[hash64.U64]:
    """The eight fields of a write row: an input-assert row or a chain-position row (``aux`` = expected position)."""
    return [
        hash64.const(tag, slot),
        hash64.from_i32(slot),
        hash64.from_i32(position),
        hash64.from_i32(token),
        hash64.from_i32(expected_token),
        prev_hash,
        aux,
        hash64.from_i32(bits),
    ]
