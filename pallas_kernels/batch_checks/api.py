"""``check``: the batch rows' and new slots' ``INVALID_INPUT`` candidates and the rows' roles, on the chosen
backend."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backends
from pallas_kernels import validate
from pallas_kernels.batch_checks import pallas_triton, reference

Checked = reference.Checked
PADDINGS = reference.PADDINGS
_INT32_LIMIT = 2**31


class Static(NamedTuple):
    """:func:`check`'s static arguments of the FULL group, one value (its docstring says what each means)."""

    padding: str
    table_rows: int
    context_len: int
    num_slots: int
    token_ids_width: int | None = None


def check(
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    out_cache_loc: jax.Array,
    token_ids_lens: jax.Array | None = None,
    *,
    padding: str,
    table_rows: int,
    context_len: int,
    num_slots: int,
    token_ids_width: int | None = None,
    full_to_swa_index_mapping: jax.Array | None = None,
    swa_num_slots: int | None = None,
    backend: str = "auto",
) -> Checked:
    """Checks a batch's rows and new slots; says which rows are requests (``reference`` states the rules).

    Args:
      req_pool_indices, prefix_lens, extend_lens: i32[R] (R >= 1) the batch rows.
      out_cache_loc: i32[T] each token's new FULL-pool slot (< 0: skipped).
      token_ids_lens: i32[R] each row's known token history; with ``token_ids_width`` only.
      padding: the pool's padding rows: ``"negative"`` (``req_pool_indices`` < 0), ``"reserved"`` (row 0, the
        reserved request row; a request in it is reported) or ``"none"``.
      table_rows, context_len: static, ``req_to_token``'s shape (request rows must be below ``table_rows``).
      num_slots: static, the FULL pool's slots (new slots must be in ``[1, num_slots)``).
      token_ids_width: static, the expected-token pool's width (the verify-token check is on), or None.
      full_to_swa_index_mapping: i32[num_slots + 1] the full->SWA slot table of an SWA group, or None (none).
      swa_num_slots: static, the SWA group's slots; with ``full_to_swa_index_mapping`` only.
      backend: ``"xla"`` (``reference``), ``"pallas"`` (the Triton kernel on GPU), ``"interpret"`` (it,
        interpreted) or ``"auto"`` (the Triton kernel on GPU, else ``"xla"``). There is no Mosaic kernel: ``"auto"``
        runs ``"xla"`` on TPU.

    Returns:
      :class:`Checked`, identical on every backend (``swa_issues`` with an SWA group: jnp on every backend).

    Raises:
      ValueError, TypeError: for a wrong shape, dtype or static argument, naming it.
    """
    arrays = (req_pool_indices, prefix_lens, extend_lens, out_cache_loc, token_ids_lens)
    static = validate_arguments(arrays, Static(padding, table_rows, context_len, num_slots, token_ids_width))
    lut = full_to_swa_index_mapping
    if (lut is None) != (swa_num_slots is None):
        raise ValueError(
            "full_to_swa_index_mapping and swa_num_slots check an SWA group's slots: give both, or neither"
        )
    if lut is not None:
        validate.array("full_to_swa_index_mapping", lut, dtype=jnp.int32, ndim=1)
        swa_num_slots = validate.positive_int("swa_num_slots", swa_num_slots)

    def xla(*arrays):
        return reference.check(*arrays, **static)

    def triton(*arrays, interpret):
        if out_cache_loc.shape[0] == 0:  # no token programs, no empty outputs: the jnp checks
            return xla(*arrays)
        return pallas_triton.check(*arrays, interpret=interpret, **static)

    checked = backends.dispatch(backend, xla=xla, triton=triton, mosaic=None)(*arrays)
    if lut is None:
        return checked
    swa = reference.swa_issues(
        checked,
        req_pool_indices,
        prefix_lens,
        out_cache_loc,
        lut,
        num_slots=static["num_slots"],
        swa_num_slots=swa_num_slots,
    )
    return checked._replace(swa_issues=swa)


def validate_arguments(arrays: tuple[jax.Array | None, ...], static: Static) -> dict:
    """Checks :func:`check`'s arguments (those of the FULL group), naming the one that is wrong; returns the static
    ones, normalised, as keywords of ``reference.check``. A fused launch that runs the checks calls it too.

    Args:
      arrays: ``(req_pool_indices, prefix_lens, extend_lens, out_cache_loc, token_ids_lens)``, as :func:`check`
        takes them.
      static: the static arguments.
    """
    req_pool_indices, prefix_lens, extend_lens, out_cache_loc, token_ids_lens = arrays
    padding, table_rows, context_len, num_slots, token_ids_width = static
    rows = {"req_pool_indices": req_pool_indices, "prefix_lens": prefix_lens, "extend_lens": extend_lens}
    for name, x in rows.items():
        validate.array(name, x, dtype=jnp.int32, ndim=1)
    num_rows = validate.same_length(rows)
    if num_rows < 1:
        raise ValueError(f"the batch needs at least one row; got req_pool_indices.shape={(num_rows,)}")
    validate.array("out_cache_loc", out_cache_loc, dtype=jnp.int32, ndim=1)
    if num_rows * (out_cache_loc.shape[0] + 1) >= _INT32_LIMIT:  # the spans' sums (reference.span_lens) in int32
        raise ValueError(
            "the batch is too large for int32 span sums: req_pool_indices.shape[0] * (out_cache_loc.shape[0] + 1) "
            f"must be < 2**31; got {num_rows} * ({out_cache_loc.shape[0]} + 1)"
        )
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}; got {padding=!r}")
    table_rows = validate.positive_int("table_rows", table_rows)
    context_len = validate.positive_int("context_len", context_len)
    num_slots = validate.positive_int("num_slots", num_slots)
    if token_ids_width is not None:
        token_ids_width = validate.static_int("token_ids_width", token_ids_width, maximum=_INT32_LIMIT - 1)
        if token_ids_lens is None:
            raise ValueError(f"token_ids_width={token_ids_width} needs token_ids_lens (each row's token history)")
        validate.array("token_ids_lens", token_ids_lens, dtype=jnp.int32, shape=(num_rows,))
    elif token_ids_lens is not None:
        raise ValueError("token_ids_lens is checked against token_ids_width: give both, or neither")
    return dict(
        padding=padding,
        table_rows=table_rows,
        context_len=context_len,
        num_slots=num_slots,
        token_ids_width=token_ids_width,
    )
