"""Fault injectors: pure, jittable functions that corrupt what a paged-KV engine keeps, as real bugs do.

Each fault, how to inject it, and the launch that must catch it (``expected_detection``):

=================  ==================================================  ======================================
fault              inject                                              caught by
=================  ==================================================  ======================================
LIVE_KV            :func:`flip_kv_byte` on a slot a running request    TAIL verify, REAL_KV, same step
                   has cached, before the forward
REQ_TO_TOKEN       :func:`remap_slot`: a cached ``req_to_token``       HEAD verify, CHAIN and/or POSITION,
                   entry points at another live slot                   same step
IDLE_CACHE_KV      :func:`flip_kv_byte` (or :func:`corrupt_page`) on   SWEEP verify, REAL_KV, at the next
                   a slot only the prefix cache holds                  sweep
POST_FORWARD_KV    :func:`flip_kv_byte` on a slot this step wrote,     TAIL verify, REAL_KV, next step
                   after the step
TOKEN_SWAP         :func:`swap_tokens`: two requests' sampled input    HEAD write input assert, WRITE_TOKEN,
                   tokens crossed                                      same step (needs a token oracle)
=================  ==================================================  ======================================

Real-KV faults are caught only with ``real_kv_hash_mode`` PARTIAL or ALL, on the bytes that mode folds: flip
byte 0 of the K (or V) array you pass as the real-KV source. The host helpers in ``_targets`` pick valid targets.
"""

from __future__ import annotations

import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvcanary_jax.core._constants import CanaryLaunchTag, FailReason, Half, Phase, PoolKind, launch_tag
from kvcanary_jax.runtime._pool import check_paged_kv
from pallas_kernels import mesh, validate


class FaultKind(enum.Enum):
    """The injectable faults; ``value`` is the name used in tables and JSON."""

    LIVE_KV = "live_kv"
    REQ_TO_TOKEN = "req_to_token"
    IDLE_CACHE_KV = "idle_cache_kv"
    POST_FORWARD_KV = "post_forward_kv"
    TOKEN_SWAP = "token_swap"


_EXPECTED = {
    FaultKind.LIVE_KV: (Phase.TAIL, FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 0),
    FaultKind.REQ_TO_TOKEN: (
        Phase.HEAD,
        FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH,
        0,
    ),
    FaultKind.IDLE_CACHE_KV: (Phase.SWEEP, FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 0),
    FaultKind.POST_FORWARD_KV: (Phase.TAIL, FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 1),
    FaultKind.TOKEN_SWAP: (Phase.HEAD, FailReason.WRITE_TOKEN_MISMATCH, 0),
}


def expected_detection(kind: FaultKind, group: PoolKind = PoolKind.FULL) -> tuple[CanaryLaunchTag, FailReason, int]:
    """``(tag, bits, steps_after)``: the K-half launch that must report ``kind`` first, any of the bits it may set,
    and how many steps after the injection step it runs (a sweep fault: within one sweep interval instead).

    REQ_TO_TOKEN and TOKEN_SWAP are always caught by the FULL group, whose HEAD launches run first.
    """
    phase, bits, after = _EXPECTED[kind]
    return launch_tag(phase, Half.K, PoolKind.FULL if phase is Phase.HEAD else group), bits, after


def _token_row_bytes(kv: jax.Array, page_size: int) -> int:
    row_bytes = math.prod(kv.shape[1:]) * jnp.dtype(kv.dtype).itemsize
    return row_bytes // page_size


def _flip_bytes(kv: jax.Array, page: jax.Array, cols: jax.Array) -> jax.Array:
    """XORs bytes ``cols`` (i32[n], distinct) of page row ``page`` with 0xFF.

    Only the elements holding those bytes are read and written back, in a same-width unsigned view: the array keeps
    its shape and sharding (an explicitly sharded KV pool, as sglang-jax's, is neither reshaped nor resharded), and
    no float op touches NaN payloads elsewhere in the array.
    """
    itemsize = jnp.dtype(kv.dtype).itemsize
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[itemsize]
    with mesh.context(kv):
        page, cols = mesh.replicate((jnp.asarray(page, jnp.int32), jnp.asarray(cols, jnp.int32)))
        index = (jnp.broadcast_to(page, cols.shape), *jnp.unravel_index(cols // itemsize, kv.shape[1:]))
        bits = lax.bitcast_convert_type(kv, uint)
        elements = mesh.take(bits, index)  # uint[n]
        mask = jnp.left_shift(jnp.full(cols.shape, 0xFF, uint), (8 * (cols % itemsize)).astype(uint))
        return lax.bitcast_convert_type(mesh.set_elements(bits, index, elements ^ mask), kv.dtype)


def _check_byte(byte: int, bytes_per_token: int) -> int:
    if not validate.is_int(byte) or not 0 <= byte < bytes_per_token:
        raise ValueError(f"byte must be an int in [0, {bytes_per_token}) (bytes per token); got {byte=}")
    return int(byte)


def _check_index(name: str, value, size: int, what: str) -> None:
    """An integer scalar (Python, numpy or jax; traced ones are not range-checked) in ``[0, size)``.

    JAX drops out-of-range scatter indices and wraps negative ones, so an injector given one would inject nothing,
    or corrupt another place, without a word.
    """
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        if tuple(value.shape) != () or not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(
                f"{name} must be an integer scalar; got {name} of shape {tuple(value.shape)}, {value.dtype}"
            )
        if isinstance(value, jax.core.Tracer):
            return
        value = int(value)
    elif not validate.is_int(value):
        raise TypeError(f"{name} must be an integer scalar; got {name}={value!r}")
    if not 0 <= value < size:
        raise ValueError(f"{name} must be in [0, {size}) ({what}); got {name}={value}")


def _paged(kv, page_size) -> tuple[jax.Array, int]:
    """``kv`` checked to be laid out ``[pages, page_size, ...]`` (numpy becomes jax), and its bytes per token."""
    page_size = validate.positive_int("page_size", page_size)
    validate.array("kv", kv)
    kv = check_paged_kv("kv", kv, page_size, num_slots=0)
    return jnp.asarray(kv), _token_row_bytes(kv, page_size)


@functools.partial(jax.jit, static_argnames=("page_size", "byte"))
def _flip_kv_byte(kv, slot, *, page_size, byte):
    bytes_per_token = _token_row_bytes(kv, page_size)
    col = (slot % page_size) * bytes_per_token + byte
    return _flip_bytes(kv, slot // page_size, jnp.reshape(col, (1,)))


def flip_kv_byte(kv: jax.Array, slot: jax.Array, *, page_size: int, byte: int = 0) -> jax.Array:
    """XORs byte ``byte`` of ``slot``'s token row with 0xFF in a paged KV array (SGLang flips byte 0).

    Args:
      kv: ``[num_pages, page_size, ...]`` of any 1/2/4/8-byte dtype; slot ``s`` is row ``s % page_size`` of page
        ``s // page_size``.
      slot: integer scalar slot in this array's pool (may be traced; a concrete one is range-checked).
      page_size: static slots per page; must be ``kv.shape[1]``.
      byte: static byte offset inside the token row.

    Returns:
      A new array with one byte changed.

    Raises:
      TypeError, ValueError: for a ``kv`` not laid out ``[pages, page_size, ...]``, a ``slot`` outside the pages,
        or a ``byte`` outside the token row, naming the argument.
    """
    kv, bytes_per_token = _paged(kv, page_size)
    byte = _check_byte(byte, bytes_per_token)
    _check_index("slot", slot, kv.shape[0] * page_size, "pages * page_size of kv")
    return _flip_kv_byte(kv, slot, page_size=int(page_size), byte=byte)


@functools.partial(jax.jit, static_argnames=("page_size", "byte"))
def _corrupt_page(kv, page, *, page_size, byte):
    bytes_per_token = _token_row_bytes(kv, page_size)
    return _flip_bytes(kv, page, jnp.arange(page_size, dtype=jnp.int32) * bytes_per_token + byte)


def corrupt_page(kv: jax.Array, page: jax.Array, *, page_size: int, byte: int = 0) -> jax.Array:
    """XORs byte ``byte`` of every token row of page ``page`` with 0xFF: a whole cached page overwritten.

    Every slot of the page then folds to another REAL_KV_HASH, so each one the canary checks is reported.

    Args:
      kv: ``[num_pages, page_size, ...]`` of any 1/2/4/8-byte dtype.
      page: integer scalar page index (may be traced; a concrete one is range-checked).
      page_size: static slots per page; must be ``kv.shape[1]``.
      byte: static byte offset inside each token row.

    Raises:
      TypeError, ValueError: as :func:`flip_kv_byte`, for ``page`` outside ``[0, num_pages)``.
    """
    kv, bytes_per_token = _paged(kv, page_size)
    byte = _check_byte(byte, bytes_per_token)
    _check_index("page", page, kv.shape[0], "pages of kv")
    return _corrupt_page(kv, page, page_size=int(page_size), byte=byte)


def _int_array(name: str, x, ndim: int) -> jax.Array:
    x = jnp.asarray(x) if isinstance(x, (list, tuple, np.ndarray)) else x
    validate.array(name, x, ndim=ndim)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array; got {name}.dtype={jnp.dtype(x.dtype).name}")
    return x


def remap_slot(req_to_token: jax.Array, pool_row: int, position: int, new_slot: int) -> jax.Array:
    """``req_to_token`` with entry ``[pool_row, position]`` pointing at ``new_slot`` (a wrong page mapping).

    ``new_slot`` may be any int32 (an out-of-range one is a fault too); ``pool_row`` and ``position`` must name an
    entry of the table. Keeps the table's sharding (a page table on an explicit mesh stays where it is).
    """
    table = _int_array("req_to_token", req_to_token, ndim=2)
    _check_index("pool_row", pool_row, table.shape[0], "rows of req_to_token")
    _check_index("position", position, table.shape[1], "columns of req_to_token")
    if not (validate.is_int(new_slot) or (hasattr(new_slot, "dtype") and jnp.issubdtype(new_slot.dtype, jnp.integer))):
        raise TypeError(f"new_slot must be an integer; got new_slot={new_slot!r}")
    with mesh.context(table):
        index = (jnp.asarray([pool_row], jnp.int32), jnp.asarray([position], jnp.int32))
        return mesh.set_elements(table, index, jnp.asarray([new_slot], table.dtype))


def swap_tokens(input_ids: jax.Array, i: int, j: int) -> jax.Array:
    """``input_ids`` with entries ``i`` and ``j`` swapped (two requests' sampled tokens crossed); ``i != j``. Keeps
    its sharding."""
    input_ids = _int_array("input_ids", input_ids, ndim=1)
    for name, value in (("i", i), ("j", j)):
        _check_index(name, value, input_ids.shape[0], "token entries of input_ids")
    if validate.is_int(i) and validate.is_int(j) and i == j:
        raise ValueError(f"i and j must be two different token entries; got i=j={i}")
    with mesh.context(input_ids):
        swapped = mesh.take(input_ids, (jnp.asarray([j, i], jnp.int32),))
        return mesh.set_elements(input_ids, (jnp.asarray([i, j], jnp.int32),), swapped)
