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
from jax import lax

from kvcanary_jax.core._constants import CanaryLaunchTag, FailReason, Half, Phase, PoolKind, launch_tag
from pallas_kernels import mesh


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


def _check_byte(byte: int, bytes_per_token: int) -> None:
    if not isinstance(byte, int) or not 0 <= byte < bytes_per_token:
        raise ValueError(f"byte must be an int in [0, {bytes_per_token}) (bytes per token); got {byte=}")


@functools.partial(jax.jit, static_argnames=("page_size", "byte"))
def flip_kv_byte(kv: jax.Array, slot: jax.Array, *, page_size: int, byte: int = 0) -> jax.Array:
    """XORs byte ``byte`` of ``slot``'s token row with 0xFF in a paged KV array (SGLang flips byte 0).

    Args:
      kv: ``[num_pages, page_size, ...]`` of any 1/2/4-byte dtype; slot ``s`` is row ``s % page_size`` of page
        ``s // page_size``.
      slot: i32 scalar slot in this array's pool (may be traced).
      page_size: static slots per page.
      byte: static byte offset inside the token row.

    Returns:
      A new array with one byte changed.
    """
    bytes_per_token = _token_row_bytes(kv, page_size)
    _check_byte(byte, bytes_per_token)
    col = (slot % page_size) * bytes_per_token + byte
    return _flip_bytes(kv, slot // page_size, jnp.reshape(col, (1,)))


@functools.partial(jax.jit, static_argnames=("page_size", "byte"))
def corrupt_page(kv: jax.Array, page: jax.Array, *, page_size: int, byte: int = 0) -> jax.Array:
    """XORs byte ``byte`` of every token row of page ``page`` with 0xFF: a whole cached page overwritten.

    Every slot of the page then folds to another REAL_KV_HASH, so each one the canary checks is reported.

    Args:
      kv: ``[num_pages, page_size, ...]`` of any 1/2/4-byte dtype.
      page: i32 scalar page index (may be traced).
      page_size: static slots per page.
      byte: static byte offset inside each token row.
    """
    bytes_per_token = _token_row_bytes(kv, page_size)
    _check_byte(byte, bytes_per_token)
    return _flip_bytes(kv, page, jnp.arange(page_size, dtype=jnp.int32) * bytes_per_token + byte)


def remap_slot(req_to_token: jax.Array, pool_row: int, position: int, new_slot: int) -> jax.Array:
    """``req_to_token`` with entry ``[pool_row, position]`` pointing at ``new_slot`` (a wrong page mapping).

    Keeps the table's sharding (a page table on an explicit mesh stays where it is)."""
    req_to_token = jnp.asarray(req_to_token)
    with mesh.context(req_to_token):
        index = (jnp.asarray([pool_row], jnp.int32), jnp.asarray([position], jnp.int32))
        return mesh.set_elements(req_to_token, index, jnp.asarray([new_slot], req_to_token.dtype))


def swap_tokens(input_ids: jax.Array, i: int, j: int) -> jax.Array:
    """``input_ids`` with entries ``i`` and ``j`` swapped (two requests' sampled tokens crossed); keeps its sharding."""
    input_ids = jnp.asarray(input_ids)
    with mesh.context(input_ids):
        swapped = mesh.take(input_ids, (jnp.asarray([j, i], jnp.int32),))
        return mesh.set_elements(input_ids, (jnp.asarray([i, j], jnp.int32),), swapped)
