"""The batch checks as one Pallas Triton launch, ``kvcanary_batch_checks``, byte-identical to ``reference.check``.

The jnp checks cost five small XLA kernels per step on GPU (two prefix sums, their epilogue, the token-to-row
search, the stack of the candidates). Here one launch does it: program 0 checks the rows, ``row_chunk`` at a time,
carrying the span and bad-span prefix sums from chunk to chunk (for the ``"reserved"`` convention it also counts
each row's tokens that write a real slot); programs ``1 + k`` check token chunk ``k``: one light pass over the rows'
spans (``SCAN_CHUNKS`` row chunks a step) finds the few rows that can own its tokens (the spans' ends never
decrease), and only those rows' roles are recomputed and compared against its tokens. No program reads another's
output, so there is no ordering to keep, and every output element is written by exactly one program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import compat, issues, layout
from pallas_kernels.batch_checks import reference

SCAN_CHUNKS = 8  # row chunks per step of a token program's pass over the spans


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shape: rows and tokens per step (powers of 2), Triton's warps."""

    row_chunk: int = 32
    token_chunk: int = 64
    num_warps: int = 4

    def __post_init__(self):
        for name in ("row_chunk", "token_chunk"):
            n = getattr(self, name)
            if n < 1 or n & (n - 1):  # Triton's tensors are powers of 2
                raise ValueError(f"Config.{name} must be a power of 2; got {name}={n}")


@dataclasses.dataclass(frozen=True)
class Static:
    num_rows: int
    num_tokens: int
    padding: str
    table_rows: int
    context_len: int
    num_slots: int
    token_ids_width: int | None
    config: Config


class _Rows(NamedTuple):
    """One chunk of rows (i32 or bool [width] each); masked lanes own no tokens."""

    j: jax.Array
    valid: jax.Array
    rpi: jax.Array
    cached: jax.Array
    extend: jax.Array
    span: jax.Array
    start: jax.Array
    end: jax.Array
    padding_row: jax.Array
    bad: jax.Array  # i32: 1 for a row whose span is bad (reference.bad_span)
    after_bad_span: jax.Array


def _arange(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def _load(ref, idx, mask, other=0):
    return plt.load(ref.at[idx], mask=mask, other=other)


def _row_chunk(refs, first, bound, carry, st: Static, width: int | None = None) -> tuple[_Rows, tuple]:
    """Rows ``[first, first + width)`` (``row_chunk`` by default) below ``bound`` with their spans, from the span
    and bad-span sums of the rows before ``first`` (``carry``)."""
    return _rows_at(refs, first + _arange(width or st.config.row_chunk), bound, carry, st)


def _rows_at(refs, j, bound, carry, st: Static) -> tuple[_Rows, tuple]:
    """Rows ``j`` (consecutive) below ``bound``, as :func:`_row_chunk`."""
    rpi_ref, cached_ref, extend_ref = refs
    span_before, bad_before = carry
    valid = j < bound
    rpi, cached, extend = (_load(ref, j, valid) for ref in (rpi_ref, cached_ref, extend_ref))
    span = jnp.where(valid, reference.span_lens(extend, st.num_tokens), 0)
    end = span_before + jnp.cumsum(span, dtype=jnp.int32)
    padding_row = reference.padding_rows(rpi, st.padding)
    bad = (valid & reference.bad_span(padding_row, extend, end, st.num_tokens)).astype(jnp.int32)
    after = bad_before + jnp.cumsum(bad, dtype=jnp.int32) - bad > 0
    rows = _Rows(j, valid, rpi, cached, extend, span, end - span, end, padding_row, bad, after)
    return rows, (span_before + jnp.sum(span, dtype=jnp.int32), bad_before + jnp.sum(bad, dtype=jnp.int32))


def _row_issue(rows: _Rows, reserved_in_use, st: Static):
    return reference.row_issue(
        rows.rpi,
        rows.cached,
        rows.extend,
        rows.start,
        rows.end,
        rows.padding_row,
        rows.after_bad_span,
        reserved_in_use,
        padding=st.padding,
        table_rows=st.table_rows,
        context_len=st.context_len,
        num_tokens=st.num_tokens,
    )


def roles(refs, j, bound, carry, st: Static) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple]:
    """((active, span, bad), carry): rows ``j``'s roles (consecutive rows; 0 past ``bound``) as ``reference.check``
    gives them, from the span and bad-span sums of the rows before ``j[0]`` (``carry``), and the sums after them.
    ``active`` and ``bad`` are i32. A kernel that needs the roles derives them with it instead of reading this
    op's outputs. A request row is never a reserved padding row, so no reserved-row check is needed."""
    rows, carry = _rows_at(refs, j, bound, carry, st)
    _, _, _, _, active = _row_issue(rows, jnp.zeros(j.shape, bool), st)
    return (jnp.where(rows.valid & active, 1, 0).astype(jnp.int32), rows.span, rows.bad), carry


def _store_columns(issues_ref, column, mask, fields: tuple) -> None:
    """Stores candidates' eight fields (``reference.issue_fields``) at ``issues_ref[:, column]`` where ``mask``."""
    for f, value in enumerate(fields):
        plt.store(issues_ref.at[jnp.full(column.shape, f, jnp.int32), column], value, mask=mask)


def _writes_real_slot(loc_ref, rows: _Rows, st: Static) -> jax.Array:
    """bool[row_chunk]: a token of the row (within the token arrays) writes a slot past the padding slot."""
    chunk = st.config.token_chunk
    lo = jnp.min(rows.start)  # lane 0's: the starts never decrease (reference.span_lens), from 0
    hi = jnp.minimum(jnp.max(rows.end), st.num_tokens)

    def body(k, hits):
        t = lo + k * chunk + _arange(chunk)
        real = _load(loc_ref, t, t < hi, other=-1) > layout.PADDING_SLOT
        own = (rows.start[:, None] <= t[None, :]) & (t[None, :] < rows.end[:, None]) & real[None, :]
        return hits + jnp.sum(own.astype(jnp.int32), axis=1, dtype=jnp.int32)

    steps = jnp.maximum(hi - lo + chunk - 1, 0) // chunk
    return lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros(rows.j.shape, jnp.int32)) > 0


def _check_rows(refs, loc_ref, lens_ref, outs, st: Static) -> None:
    """Program 0: each row's roles and first problem (and its ``token_ids_lens``' problem)."""
    active_ref, span_ref, start_ref, _, issues_ref = outs

    def body(c, carry):
        rows, carry = _row_chunk(refs, c * st.config.row_chunk, st.num_rows, carry, st)
        reserved_in_use = jnp.zeros(rows.j.shape, bool)
        if st.padding == "reserved":
            real = _writes_real_slot(loc_ref, rows, st)
            reserved_in_use = rows.padding_row & ((rows.cached > 0) | (real & ~rows.after_bad_span))
        problem, field, value, limit, active = _row_issue(rows, reserved_in_use, st)
        for ref, x in ((active_ref, active.astype(jnp.int32)), (span_ref, rows.span), (start_ref, rows.start)):
            plt.store(ref.at[rows.j], x, mask=rows.valid)
        request = jnp.where(problem == 0, rows.rpi, -1)
        fields = reference.issue_fields(problem, field, value, limit=limit, entry=rows.j, request=request)
        _store_columns(issues_ref, rows.j, rows.valid, fields)
        if st.token_ids_width is not None:
            lens = _load(lens_ref, rows.j, rows.valid)
            width = st.token_ids_width
            problem = reference.lens_issue(lens, active, width)
            field = layout.INPUT_FIELD_TOKEN_IDS_LENS
            fields = reference.issue_fields(problem, field, lens, limit=width + 1, entry=rows.j, request=rows.rpi)
            _store_columns(issues_ref, st.num_rows + rows.j, rows.valid, fields)
        return carry

    _loop(-(-st.num_rows // st.config.row_chunk), body, (jnp.int32(0), jnp.int32(0)))


def _owner_range(refs, first, last, st: Static) -> tuple[jax.Array, jax.Array, tuple]:
    """(below, reach, carry): only rows ``[below, reach)`` can own tokens ``[first, last]``, and ``carry`` is the
    span and bad-span sums of the rows before ``below``. The spans' ends and starts never decrease
    (``reference.span_lens`` >= 0), so the rows ending at or before ``first`` come first and own none of them, and
    the rows starting after ``last`` come last."""
    width = SCAN_CHUNKS * st.config.row_chunk

    def body(c, carry):
        sums, below, reach, base = carry
        rows, sums = _row_chunk(refs, c * width, st.num_rows, sums, st, width)
        early = rows.valid & (rows.end <= first)
        below = below + jnp.sum(early.astype(jnp.int32), dtype=jnp.int32)
        reach = reach + jnp.sum((rows.valid & (rows.start <= last)).astype(jnp.int32), dtype=jnp.int32)
        span_base = jnp.maximum(base[0], jnp.max(jnp.where(early, rows.end, 0)))
        bad_base = base[1] + jnp.sum(jnp.where(early, rows.bad, 0), dtype=jnp.int32)
        return sums, below, reach, (span_base, bad_base)

    zero = jnp.int32(0)
    _, below, reach, base = _loop(-(-st.num_rows // width), body, ((zero, zero), zero, zero, (zero, zero)))
    return below, reach, base


def _check_tokens(refs, loc_ref, outs, k, st: Static) -> None:
    """Program ``1 + k``: token chunk ``k``'s rows and new slots' problems."""
    _, _, _, token_rows_ref, issues_ref = outs
    first = k * st.config.token_chunk
    t = first + _arange(st.config.token_chunk)
    valid = t < st.num_tokens
    below, reach, base = _owner_range(refs, first, first + st.config.token_chunk - 1, st)

    def body(c, carry):
        spans, picked = carry
        rows, spans = _row_chunk(refs, below + c * st.config.row_chunk, reach, spans, st)
        # A request row is never a reserved padding row, so its role does not need the reserved-row check.
        _, _, _, _, active = _row_issue(rows, jnp.zeros(rows.j.shape, bool), st)
        own = (rows.start[None, :] <= t[:, None]) & (t[:, None] < rows.end[None, :])  # one row at most per token

        def pick(x):
            return jnp.sum(jnp.where(own, x[None, :], 0), axis=1, dtype=jnp.int32)

        facts = (jnp.ones_like(rows.j), rows.j, active.astype(jnp.int32), rows.cached, rows.start, rows.rpi)
        return spans, tuple(p + pick(x) for p, x in zip(picked, facts, strict=True))

    zeros = jnp.zeros(t.shape, jnp.int32)
    steps = (reach - below + st.config.row_chunk - 1) // st.config.row_chunk
    _, (owned, row, active, cached, start, rpi) = lax.fori_loop(jnp.int32(0), steps, body, (base, (zeros,) * 6))
    owned = owned > 0
    token_row = jnp.where(owned, row, -1)
    plt.store(token_rows_ref.at[t], token_row, mask=valid)
    # A token no row owns reads row 0's facts, as the reference's clamped gathers do (its problem is 0).
    cached = jnp.where(owned, cached, refs[1][0])
    start = jnp.where(owned, start, 0)
    live = owned & (active != 0)
    loc = _load(loc_ref, t, valid, other=-1)
    position, request = reference.token_position_and_request(t, cached, start, rpi, live)
    fields = reference.issue_fields(
        reference.token_issue(loc, live, st.num_slots),
        layout.INPUT_FIELD_OUT_CACHE_LOC,
        loc,
        limit=st.num_slots,
        slot=loc,
        position=position,
        entry=t,
        request=request,
    )
    first = st.num_rows * (1 if st.token_ids_width is None else 2)
    _store_columns(issues_ref, first + t, valid, fields)


def _loop(n: int, body, carry):
    """``fori_loop`` over a static trip count; a single step is inlined."""
    if n == 1:
        return body(jnp.int32(0), carry)
    return lax.fori_loop(jnp.int32(0), jnp.int32(n), body, carry)


def program(row_refs, loc_ref, lens_ref, outs, pid, st: Static) -> None:
    """Program ``pid`` of the checks (of :func:`num_programs`): ``row_refs`` are the rows' ``req_pool_indices``,
    ``prefix_lens`` and ``extend_lens``, ``outs`` the refs of :func:`out_shapes`. Another kernel runs these
    programs as some of its own (the fused phase's HEAD check launch)."""

    @pl.when(pid == 0)
    def _rows():
        _check_rows(row_refs, loc_ref, lens_ref, outs, st)

    @pl.when(pid > 0)
    def _tokens():
        _check_tokens(row_refs, loc_ref, outs, pid - 1, st)


def _kernel(*refs, st: Static):
    rpi_ref, cached_ref, extend_ref, loc_ref = refs[:4]
    lens_ref = refs[4] if st.token_ids_width is not None else None
    program((rpi_ref, cached_ref, extend_ref), loc_ref, lens_ref, refs[-5:], pl.program_id(0), st)


def static(
    num_rows: int, num_tokens: int, *, padding, table_rows, context_len, num_slots, token_ids_width, config=None
) -> Static:
    """The launch's static description (``config``: by default, rows and tokens per step up to 32 and 64)."""
    config = config or Config(
        row_chunk=min(32, compat.next_power_of_2(num_rows)), token_chunk=min(64, compat.next_power_of_2(num_tokens))
    )
    return Static(num_rows, num_tokens, padding, table_rows, context_len, num_slots, token_ids_width, config)


def num_programs(st: Static) -> int:
    """Programs of the checks: one for the rows, one per token chunk."""
    return 1 + pl.cdiv(st.num_tokens, st.config.token_chunk)


def out_shapes(st: Static) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The checks' outputs, in ``reference.Checked`` order: active, span_lens, span_starts, token_rows, issues."""
    num_columns = st.num_rows * (1 if st.token_ids_width is None else 2) + st.num_tokens
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    rows = i32(st.num_rows)
    return (rows, rows, rows, i32(st.num_tokens), i32(len(issues.INPUT_ISSUE_FIELDS), num_columns))


@functools.partial(
    jax.jit,
    static_argnames=(
        "padding",
        "table_rows",
        "context_len",
        "num_slots",
        "token_ids_width",
        "interpret",
        "config",
    ),
)
def check(
    req_pool_indices, prefix_lens, extend_lens, out_cache_loc, token_ids_lens, *, padding, table_rows, context_len,
    num_slots, token_ids_width, interpret=False, config=None,
) -> reference.Checked:  # fmt: skip
    """Same contract as ``reference.check``, in one launch (a batch needs at least one row and one token)."""
    st = static(
        req_pool_indices.shape[0],
        out_cache_loc.shape[0],
        padding=padding,
        table_rows=table_rows,
        context_len=context_len,
        num_slots=num_slots,
        token_ids_width=token_ids_width,
        config=config,
    )
    lens = () if token_ids_width is None else (token_ids_lens,)
    outs = compat.triton_call(
        functools.partial(_kernel, st=st),
        out_shape=out_shapes(st),
        grid=(num_programs(st),),
        name="kvcanary_batch_checks",
        num_warps=st.config.num_warps,
        num_stages=1,
        interpret=interpret,
    )(req_pool_indices, prefix_lens, extend_lens, out_cache_loc, *lens)
    return reference.Checked(*outs)
