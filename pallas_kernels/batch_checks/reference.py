"""Pure-jnp batch checks: the specification, the default off-GPU, the oracle of the Triton kernel.

JAX clamps out-of-range gathers and drops out-of-range scatters without a word, so a batch whose conventions differ
from the canary's would go unchecked. Before the launches, each batch row is checked (its request row against the
table, its lengths, its token span against the token arrays and the context) and each request token's new slot
against the FULL pool. A bad value becomes one ``INVALID_INPUT`` candidate naming the field, the batch entry and the
value; its row is not a request (not verified or written). Rows after one whose token span cannot be located (a
negative length, or past the token arrays) are not requests either, and only that row is reported. Padding is never
a violation.

The element-wise pieces (:func:`padding_rows`, :func:`bad_span`, :func:`row_issue`, :func:`lens_issue`,
:func:`token_issue`, :func:`token_position_and_request`, :func:`issue_fields`) are written once here and traced by
the kernel too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import fusion, issues, layout
from pallas_kernels.prefix import api as prefix

PADDINGS = ("negative", "reserved", "none")
_INT32_MAX = 2**31 - 1


class Checked(NamedTuple):
    """The rows' roles and the ``INVALID_INPUT`` candidates of one batch.

    Attributes:
      active: i32[R] 1 for the rows that are requests (the launches verify and write them), else 0.
      span_lens: i32[R] token entries each row owns (>= 0), request or not: the token layout stays as given. A span
        is counted at most ``T + 1`` long (:func:`span_lens`), so the spans' sums stay within int32.
      span_starts: i32[R] each row's first token entry.
      token_rows: i32[T] the row owning each token entry; -1 past every span.
      issues: i32[8, n] one candidate per column (rows ``issues.INPUT_ISSUE_FIELDS``; problem 0: none): each
        row's first problem (R columns), then, with ``token_ids_width``, each request's ``token_ids_lens`` (R), then
        each token's new slot (T): the FULL group's candidates, in ring order.
      swa_issues: i32[8, T] the SWA group's candidates (:func:`swa_issues`), or None without an SWA group.
    """

    active: jax.Array
    span_lens: jax.Array
    span_starts: jax.Array
    token_rows: jax.Array
    issues: jax.Array
    swa_issues: jax.Array | None = None


def padding_rows(rpi: jax.Array, padding: str) -> jax.Array:
    """bool: the rows the pool's convention calls padding (``req_pool_indices`` < 0, == 0, or none)."""
    if padding == "negative":
        return rpi < 0
    if padding == "reserved":
        return rpi == 0
    return jnp.zeros(rpi.shape, bool)


def span_lens(extend: jax.Array, num_tokens: int) -> jax.Array:
    """The token entries each row owns: ``extend_lens``, 0 where negative, and at most ``T + 1``. A span past the
    token arrays is bad (or padding) whatever its length, and every row after it ends past them too; counted at
    ``T + 1``, the ends never decrease and their sum never overflows (``api`` checks ``R * (T + 1) < 2**31``)."""
    return jnp.minimum(jnp.maximum(extend, 0), num_tokens + 1)


def bad_span(padding_row: jax.Array, extend: jax.Array, span_end: jax.Array, num_tokens: int) -> jax.Array:
    """bool: a request row whose token span cannot be located: a negative length, or an end past the tokens."""
    return ~padding_row & ((extend < 0) | (span_end > num_tokens))


def row_issue(
    rpi: jax.Array,
    cached: jax.Array,
    extend: jax.Array,
    span_start: jax.Array,
    span_end: jax.Array,
    padding_row: jax.Array,
    after_bad_span: jax.Array,
    reserved_in_use: jax.Array,
    *,
    padding: str,
    table_rows: int,
    context_len: int,
    num_tokens: int,
):
    """(problem, field, value, limit, active) of each row: its first problem (0: none), and whether it is a request.

    ``after_bad_span``: a row before it has a :func:`bad_span`. ``reserved_in_use``: a padding row of the
    ``"reserved"`` convention that holds a request (it only ever names a padding row, so ``active`` does not
    depend on it). The sums named (``prefix_lens + extend_lens``, a span's end) saturate at 2**31 - 1 rather than
    wrap, and are compared without overflow: a value near the int32 limit is reported, not wrapped past its check.
    """
    lower = 1 if padding == "reserved" else 0
    request = ~padding_row
    past_context = cached > context_len - extend  # cached + extend > context_len, for extend >= 0 (else NEGATIVE)
    context_end = cached + jnp.minimum(extend, _INT32_MAX - cached)
    span_end_named = span_start + jnp.minimum(jnp.maximum(extend, 0), _INT32_MAX - span_start)
    checks = [  # (where bad, problem, field, value, limit); the first bad one names the row
        (reserved_in_use, layout.INPUT_PROBLEM_RESERVED_ROW, layout.INPUT_FIELD_REQ_POOL_INDICES, rpi, -1),
        (request & ((rpi < lower) | (rpi >= table_rows)), layout.INPUT_PROBLEM_OUT_OF_RANGE, layout.INPUT_FIELD_REQ_POOL_INDICES, rpi, table_rows),
        (request & (cached < 0), layout.INPUT_PROBLEM_NEGATIVE, layout.INPUT_FIELD_PREFIX_LENS, cached, -1),
        (request & (extend < 0), layout.INPUT_PROBLEM_NEGATIVE, layout.INPUT_FIELD_EXTEND_LENS, extend, -1),
        (request & past_context, layout.INPUT_PROBLEM_PAST_CONTEXT, layout.INPUT_FIELD_EXTEND_LENS, context_end, context_len),
        (request & (span_end > num_tokens) & ~after_bad_span, layout.INPUT_PROBLEM_PAST_TOKENS, layout.INPUT_FIELD_EXTEND_LENS, span_end_named, num_tokens),
    ]  # fmt: skip
    zero = jnp.zeros(rpi.shape, jnp.int32)
    problem, field, value, limit = zero, zero, zero, zero
    for bad, p, f, v, lim in reversed(checks):  # reversed: the first listed problem wins
        problem, field = jnp.where(bad, jnp.int32(p), problem), jnp.where(bad, jnp.int32(f), field)
        value, limit = jnp.where(bad, v, value), jnp.where(bad, jnp.int32(lim), limit)
    active = request & (problem == 0) & ~after_bad_span
    return problem, field, value, limit, active


def lens_issue(lens: jax.Array, active: jax.Array, width: int) -> jax.Array:
    """i32 problem of a request's ``token_ids_lens`` (its known token history): outside ``[0, width]``."""
    return jnp.where(active & ((lens < 0) | (lens > width)), jnp.int32(layout.INPUT_PROBLEM_OUT_OF_RANGE), 0)


def token_issue(loc: jax.Array, live: jax.Array, num_slots: int) -> jax.Array:
    """i32 problem of a request token's new FULL-pool slot (``issues.slot_issue``); 0 for a skipped token
    (< 0) or one no request owns (not ``live``)."""
    problem, _ = issues.slot_issue(loc, None, None, full_slots=num_slots, group_slots=num_slots)
    return jnp.where(live & (loc >= 0), problem, 0)


def token_position_and_request(
    t: jax.Array, cached: jax.Array, span_start: jax.Array, rpi: jax.Array, live: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(position, request): the context of token entries ``t``'s candidates, from their row's ``prefix_lens``,
    first token entry and ``req_pool_indices`` (one per token) and whether a request owns them (``live``): the
    request position each token writes, and its request row (-1 where no request owns it). Public so that a
    caller's own per-token candidates name the same context."""
    return cached + t - span_start, jnp.where(live, rpi, -1)


def issue_fields(problem, field, value, *, limit=-1, slot=-1, position=-1, entry=-1, request=-1) -> tuple:
    """The eight i32 fields of ``problem``'s candidates, each broadcast to its shape, in ``INPUT_ISSUE_FIELDS``
    order (the rows of :attr:`Checked.issues`)."""
    at = dict(problem=problem, field=field, value=value, limit=limit, slot=slot, position=position, entry=entry)
    at["request"] = request
    full = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), problem.shape)  # noqa: E731
    return tuple(full(at[name]) for name in issues.INPUT_ISSUE_FIELDS)


def _columns(*args, **kwargs) -> jax.Array:
    """i32[8, n]: :func:`issue_fields` stacked."""
    return jnp.stack(issue_fields(*args, **kwargs))


def check(
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    out_cache_loc: jax.Array,
    token_ids_lens: jax.Array | None,
    *,
    padding: str,
    table_rows: int,
    context_len: int,
    num_slots: int,
    token_ids_width: int | None,
) -> Checked:
    """The batch's checks and roles (:class:`Checked`); arguments as in ``api.check``."""
    rpi, cached, extend, loc = req_pool_indices, prefix_lens, extend_lens, out_cache_loc
    num_rows, num_tokens = rpi.shape[0], loc.shape[0]
    r = jnp.arange(num_rows, dtype=jnp.int32)
    spans = span_lens(extend, num_tokens)
    span_ends = prefix.inclusive_sum(spans)
    span_starts = span_ends - spans
    token_rows = _token_rows(span_ends, num_tokens)
    padding_row = padding_rows(rpi, padding)
    bad = bad_span(padding_row, extend, span_ends, num_tokens)
    after_bad = prefix.inclusive_sum(bad.astype(jnp.int32)) - bad > 0
    reserved_in_use = jnp.zeros(rpi.shape, bool)
    if padding == "reserved":
        # A padding row may own tokens that write the padding slot (CUDA-graph padding); a request in row 0 has a
        # cached prefix or writes a real slot (known only where the row's span can be located).
        writes_real_slot = segment_any((loc > layout.PADDING_SLOT) & (token_rows >= 0), token_rows, num_rows)
        reserved_in_use = padding_row & ((cached > 0) | (writes_real_slot & ~after_bad))
    problem, field, value, limit, active = row_issue(
        rpi,
        cached,
        extend,
        span_starts,
        span_ends,
        padding_row,
        after_bad,
        reserved_in_use,
        padding=padding,
        table_rows=table_rows,
        context_len=context_len,
        num_tokens=num_tokens,
    )
    columns = [_columns(problem, field, value, limit=limit, entry=r, request=jnp.where(problem == 0, rpi, -1))]
    if token_ids_width is not None:
        lens = token_ids_lens
        field = layout.INPUT_FIELD_TOKEN_IDS_LENS
        columns.append(
            _columns(
                lens_issue(lens, active, token_ids_width), field, lens, limit=token_ids_width + 1, entry=r, request=rpi
            )
        )
    row_of = jnp.maximum(token_rows, 0)
    live = live_tokens(token_rows, active)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    position, request = token_position_and_request(t, cached[row_of], span_starts[row_of], rpi[row_of], live)
    columns.append(
        _columns(
            token_issue(loc, live, num_slots),
            layout.INPUT_FIELD_OUT_CACHE_LOC,
            loc,
            limit=num_slots,
            slot=loc,
            position=position,
            entry=t,
            request=request,
        )
    )
    # The roles are read by every launch of the step: computed once, not in each reader's fusion.
    roles = fusion.computed_once(jnp.stack([active.astype(jnp.int32), spans, span_starts]), rpi[0])
    return Checked(
        active=roles[0],
        span_lens=roles[1],
        span_starts=roles[2],
        token_rows=token_rows,
        issues=jnp.concatenate(columns, axis=1),
    )


def swa_issues(
    checked: Checked,
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    out_cache_loc: jax.Array,
    full_to_swa_index_mapping: jax.Array,
    *,
    num_slots: int,
    swa_num_slots: int,
) -> jax.Array:
    """i32[8, T]: an SWA group's candidates, one per token: what ``full_to_swa_index_mapping`` makes of the new
    slots the FULL group accepts, against the SWA pool's ``swa_num_slots`` (``issues.slot_issue``; the FULL
    group reports the others). A request with a bad FULL slot writes nothing, so none of its tokens is checked
    here. The context is the FULL group's (:func:`token_position_and_request`)."""
    token_rows, active = checked.token_rows, checked.active
    t = jnp.arange(out_cache_loc.shape[0], dtype=jnp.int32)
    row_of = jnp.maximum(token_rows, 0)
    live = live_tokens(token_rows, active)
    position, request = token_position_and_request(
        t, prefix_lens[row_of], checked.span_starts[row_of], req_pool_indices[row_of], live
    )
    rejected = issues.slot_rejected(out_cache_loc, None, None, full_slots=num_slots, group_slots=num_slots)
    unwritten = segment_any(live & rejected, token_rows, active.shape[0])
    full_loc = jnp.where(live & ~unwritten[row_of], out_cache_loc, -1)
    problem, swa_loc = issues.slot_issue(
        full_loc,
        *issues.lut_reader(full_to_swa_index_mapping),
        full_slots=num_slots,
        group_slots=swa_num_slots,
    )
    field = layout.INPUT_FIELD_FULL_TO_SWA_INDEX_MAPPING
    return _columns(
        problem, field, swa_loc, limit=swa_num_slots, slot=full_loc, position=position, entry=t, request=request
    )


def live_tokens(token_rows: jax.Array, active: jax.Array) -> jax.Array:
    """bool[T]: the token entries owned by a row that is a request (``active``, bool or i32, nonzero)."""
    return (token_rows >= 0) & (active[jnp.maximum(token_rows, 0)] != 0)


def _token_rows(span_ends: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: the row whose span holds each token entry, -1 past the last span."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(span_ends, t, side="right", method="compare_all").astype(jnp.int32)
    return jnp.where(row < span_ends.shape[0], row, -1)


def segment_any(flags: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
    """bool[num_segments]: whether any flag of each segment id is set (ids < 0 are ignored)."""
    hits = (
        jnp.zeros((num_segments,), jnp.int32)
        .at[jnp.where(segments >= 0, segments, num_segments)]
        .max(flags.astype(jnp.int32), mode="drop")
    )
    return hits > 0
