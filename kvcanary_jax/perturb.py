"""Fault injection (SGLang's perturb hooks) as pure functions, plus host helpers that pick valid targets.

Each fault and the launch that must catch it:

=================  ==============================================  =========================================
fault              what it does                                    caught by
=================  ==============================================  =========================================
LIVE_KV            flip a KV byte of a slot a running request      TAIL verify, REAL_KV, same step
                   has cached (before the forward)
REQ_TO_TOKEN       point a cached ``req_to_token`` entry at        HEAD verify, CHAIN and/or POSITION,
                   another live slot holding another position      same step
IDLE_CACHE_KV      flip a KV byte of an idle prefix-cached slot    SWEEP verify, REAL_KV, at the next sweep
POST_FORWARD_KV    flip a KV byte of a slot the TAIL just wrote    TAIL verify, REAL_KV, next step
TOKEN_SWAP         swap two requests' sampled input tokens         HEAD write input assert, WRITE_TOKEN,
                                                                   same step (needs a token oracle)
=================  ==============================================  =========================================

The device mutations (:func:`flip_kv_byte`, :func:`remap_slot`, :func:`swap_tokens`) are pure and jittable. The
``choose_*`` helpers run on the host over a :class:`CanaryBatch` of numpy arrays and an explicit RNG.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvcanary_jax.constants import CanaryLaunchTag, FailReason, PoolKind
from kvcanary_jax.runner import CanaryBatch


class FaultKind(enum.Enum):
    """The injectable faults; ``value`` is the name used in tables and JSON."""

    LIVE_KV = "live_kv"
    REQ_TO_TOKEN = "req_to_token"
    IDLE_CACHE_KV = "idle_cache_kv"
    POST_FORWARD_KV = "post_forward_kv"
    TOKEN_SWAP = "token_swap"


_EXPECTED = {
    FaultKind.LIVE_KV: ("TAIL", FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 0),
    FaultKind.REQ_TO_TOKEN: ("HEAD", FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH, 0),
    FaultKind.IDLE_CACHE_KV: ("SWEEP", FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 0),
    FaultKind.POST_FORWARD_KV: ("TAIL", FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 1),
    FaultKind.TOKEN_SWAP: ("HEAD", FailReason.WRITE_TOKEN_MISMATCH, 0),
}


def expected_detection(kind: FaultKind, group: PoolKind = PoolKind.FULL) -> tuple[CanaryLaunchTag, FailReason, int]:
    """``(tag, bits, steps_after)``: the K-half launch that must report ``kind`` first, any of the bits it may set,
    and how many steps after the injection step it runs (a sweep fault: within one sweep interval instead).

    REQ_TO_TOKEN and TOKEN_SWAP are always caught by the FULL group, whose HEAD launches run first.
    """
    phase, bits, after = _EXPECTED[kind]
    if phase == "HEAD":
        group = PoolKind.FULL
    return CanaryLaunchTag[f"{phase}_K_{group.name}"], bits, after


@functools.partial(jax.jit, static_argnames=("page_size", "byte"))
def flip_kv_byte(kv: jax.Array, slot: jax.Array, *, page_size: int, byte: int = 0) -> jax.Array:
    """XORs byte ``byte`` of ``slot``'s token row with 0xFF in a paged KV array (SGLang flips byte 0).

    Args:
      kv: ``[num_pages, page_size, ...]`` of any 1/2/4-byte dtype; slot ``s`` is row ``s % page_size`` of page
        ``s // page_size``.
      slot: i32 scalar slot in this array's pool.
      page_size: static slots per page.
      byte: static byte offset inside the token row.

    Returns:
      A new array with one byte changed.
    """
    pages, itemsize = kv.shape[0], jnp.dtype(kv.dtype).itemsize
    raw = kv.reshape(pages, -1)
    as_bytes = lax.bitcast_convert_type(raw, jnp.uint8).reshape(pages, -1)
    bytes_per_token = as_bytes.shape[1] // page_size
    if not 0 <= byte < bytes_per_token:
        raise ValueError(f"byte must be in [0, {bytes_per_token}) (bytes per token); got {byte=}")
    page, col = slot // page_size, (slot % page_size) * bytes_per_token + byte
    flipped = as_bytes.at[page, col].set(as_bytes[page, col] ^ jnp.uint8(0xFF))
    if itemsize > 1:
        flipped = flipped.reshape(pages, -1, itemsize)
    return lax.bitcast_convert_type(flipped, kv.dtype).reshape(kv.shape)


def remap_slot(req_to_token: jax.Array, pool_row: int, position: int, new_slot: int) -> jax.Array:
    """``req_to_token`` with entry ``[pool_row, position]`` pointing at ``new_slot`` (a wrong page mapping)."""
    return jnp.asarray(req_to_token).at[pool_row, position].set(new_slot)


def swap_tokens(input_ids: jax.Array, i: int, j: int) -> jax.Array:
    """``input_ids`` with entries ``i`` and ``j`` swapped (two requests' sampled tokens crossed)."""
    input_ids = jnp.asarray(input_ids)
    return input_ids.at[jnp.array([i, j])].set(input_ids[jnp.array([j, i])])


def row_starts(batch: CanaryBatch) -> np.ndarray:
    """i64[bs] index of each row's first token entry."""
    extend = np.asarray(batch.extend_lens)
    return np.cumsum(extend) - extend


def cached_entries(batch: CanaryBatch, *, window: int = 0, lut: np.ndarray | None = None) -> np.ndarray:
    """i64[n, 3] ``(batch row, position, slot)`` of every cached position the step verifies.

    With ``window`` > 0 only the last ``window`` cached positions of each row are listed and slots are translated
    through ``lut`` (the SWA group's view).
    """
    out = []
    for r, (row, prefix) in enumerate(
        zip(np.asarray(batch.req_pool_indices), np.asarray(batch.prefix_lens), strict=True)
    ):
        if row == 0:
            continue
        start = max(0, prefix - window) if window else 0
        for pos in range(start, prefix):
            slot = int(batch.req_to_token[row, pos])
            out.append((r, pos, int(lut[slot]) if lut is not None else slot))
    return np.array(out, np.int64).reshape(-1, 3)


def choose_live_slot(
    batch: CanaryBatch, rng: np.random.Generator, *, window: int = 0, lut: np.ndarray | None = None
) -> int | None:
    """A random non-padding slot that this step verifies but does not write (None if there is none)."""
    entries = cached_entries(batch, window=window, lut=lut)
    written = np.asarray(batch.out_cache_loc)
    if lut is not None:
        written = lut[np.maximum(written, 0)]
    candidates = np.setdiff1d(entries[:, 2], np.concatenate([written, [0]]))
    return int(rng.choice(candidates)) if len(candidates) else None


def choose_remap(batch: CanaryBatch, rng: np.random.Generator) -> tuple[int, int, int] | None:
    """``(pool_row, position, new_slot)``: a cached entry and a live slot holding a different position.

    A different position guarantees a POSITION mismatch (and usually CHAIN): a slot at the same position with the
    same history would be an identical, benign copy.
    """
    entries = cached_entries(batch)
    if len(entries) < 2:
        return None
    r, pos, slot = entries[rng.integers(len(entries))]
    others = entries[(entries[:, 1] != pos) & (entries[:, 2] != slot)]
    if not len(others):
        return None
    return int(batch.req_pool_indices[r]), int(pos), int(others[rng.integers(len(others)), 2])


def choose_token_swap(
    batch: CanaryBatch, rng: np.random.Generator, rows: np.ndarray | None = None
) -> tuple[int, int] | None:
    """Token entries ``(i, j)`` holding the first (sampled) token of two rows, with different token ids.

    Args:
      rows: candidate batch rows (default: every real row).
    """
    rows = np.flatnonzero(np.asarray(batch.req_pool_indices)) if rows is None else np.asarray(rows)
    starts = row_starts(batch)[rows]
    ids = np.asarray(batch.input_ids)
    pairs = [(int(a), int(b)) for a in starts for b in starts if a < b and ids[a] != ids[b]]
    return pairs[rng.integers(len(pairs))] if pairs else None
