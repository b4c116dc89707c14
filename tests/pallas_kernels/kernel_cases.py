"""Random differential inputs for the verify and write kernels, from a fixed seed, at any size.

The CPU tests use small shapes (interpret mode); ``benchmarks/gpu_validate.py`` replays the same generators at
GPU sizes. Each case plants every kind of trouble the ops must handle identically: corrupted records and KV
bytes, slot 0, unreachable and anchored predecessors, out-of-range slots, skipped and duplicated
``out_cache_loc``, uncovered tokens, and a ragged last block.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import realkv
from pallas_kernels.write import api as write_api


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One real-KV source: dtype name, page size, bytes per token, read bytes and unused bytes per page row; and
    where in the token the folded bytes sit (offset, segments of a stride), as ``RealKvSource`` takes them."""

    dtype: str
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    row_padding: int = 0
    byte_offset: int = 0
    segment_bytes: int | None = None
    segment_stride: int | None = None


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, name))


def make_sources(rng: np.random.Generator, num_slots: int, specs) -> tuple[realkv.RealKvSource, ...]:
    """Random bytes (any bit pattern, NaNs included) in ``dtype[pages, row]`` sources covering ``num_slots``."""
    sources = []
    for spec in specs:
        dtype = _np_dtype(spec.dtype)
        pages = math.ceil(num_slots / spec.page_size)
        row_bytes = spec.page_size * spec.num_bytes_per_token + spec.row_padding
        raw = rng.integers(0, 256, (pages, row_bytes), dtype=np.uint8)
        data = raw.view(dtype).reshape(pages, row_bytes // dtype.itemsize)
        sources.append(
            realkv.RealKvSource(
                jnp.asarray(data),
                spec.page_size,
                spec.num_bytes_per_token,
                spec.read_bytes,
                spec.byte_offset,
                spec.segment_bytes,
                spec.segment_stride,
            )
        )
    return tuple(sources)


def corrupt_sources(rng, sources, slots: np.ndarray) -> tuple[realkv.RealKvSource, ...]:
    """Flips one byte among the first 32 of each slot in ``slots``, in every source."""
    out = []
    for src in sources:
        raw = np.asarray(src.data).view(np.uint8).reshape(src.data.shape[0], -1).copy()
        offset = rng.integers(0, min(32, src.read_bytes), slots.shape[0])
        raw[slots // src.page_size, (slots % src.page_size) * src.num_bytes_per_token + offset] ^= 0x5A
        data = raw.view(np.asarray(src.data).dtype).reshape(src.data.shape)
        out.append(dataclasses.replace(src, data=jnp.asarray(data)))
    return tuple(out)


_xla_write = jax.jit(functools.partial(write_api.write, backend="xla"), static_argnames=("real_kv_hash_mode",))
_xla_fold = jax.jit(realkv.fold_slots, static_argnames=("mode",))


def write_inputs(
    rng, *, num_slots: int, num_reqs: int, max_len: int, extra_tokens: int = 3, clean: bool = False, page: int = 1
):
    """Positional args of ``write_api.write`` after the buffer, ``num_reqs * max_len + extra_tokens`` tokens.

    Requests are ragged (the rest of the token arrays belongs to no request). ``clean`` writes fresh unique
    slots from seed -1 at positions 0, 1, ...; otherwise entries are skipped, duplicated within and across
    requests, out of range or at slot 0, positions glitch, seeds are arbitrary and some requests are invalid.
    The tokens' slots are pages of ``page`` consecutive slots (from slot 1) in random order.
    """
    lens = rng.integers(0 if not clean else 1, max_len + 1, num_reqs)
    lens[0] = max(lens[0], 2)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = num_reqs * max_len + extra_tokens
    num_valid = num_reqs if clean else int(rng.integers(num_reqs - 1, num_reqs + 1))
    if n < num_slots:
        pages = rng.permutation((num_slots - 1) // page)[:, None] * page + np.arange(page)
        loc = (1 + pages.reshape(-1))[:n].astype(np.int32)
    else:
        assert not clean, f"clean writes need a fresh slot per token; got {n=} tokens, {num_slots=}"
        loc = rng.integers(1, num_slots, n).astype(np.int32)
    positions = (np.arange(n) - np.repeat(offsets, np.diff(offsets, append=n))).astype(np.int32)
    ids = rng.integers(0, 32000, n).astype(np.int32)
    seeds = np.full(num_reqs, -1, np.int32)
    if not clean:
        pick = lambda p: rng.random(n) < p  # noqa: E731
        positions += np.repeat(rng.integers(0, 50, num_reqs + 1), np.diff(offsets, append=n)).astype(np.int32)
        loc[pick(0.1)] = -1  # skipped entries
        dup = pick(0.15)
        loc[dup] = loc[rng.integers(0, n, int(dup.sum()))]  # duplicates, within and across requests, both orders
        loc[pick(0.03)] = 0
        loc[pick(0.03)] = num_slots + rng.integers(0, 5)  # dropped by the store
        positions[pick(0.1)] += rng.integers(-2, 3)  # chain-position glitches
        ids[pick(0.05)] = -rng.integers(1, 100)  # negative tokens sign-extend
        seeds = rng.integers(-1, num_slots + 2, num_reqs).astype(np.int32)
        last = offsets[num_valid] - 1  # one sure cross-request duplicate (the first request has >= 2 entries)
        loc[[0, last if last > 1 else 1]] = rng.integers(1, num_slots)
    return tuple(jnp.asarray(x) for x in (offsets, seeds, np.array([num_valid], np.int32), ids, positions, loc))


def random_buffer(rng, num_slots: int):
    """A buffer of arbitrary records (the state before a write launch)."""
    return jnp.asarray(rng.integers(0, 2**32, (num_slots, 4, 2), dtype=np.uint32))


def verify_inputs(
    rng,
    *,
    num_slots: int,
    num_reqs: int,
    max_len: int,
    sources,
    mode: int,
    capacity_slack: int = 5,
    shuffle=True,
    page: int = 1,
):
    """(canary_buf, sources, plan arrays, num_active) of chains written by the xla path, then tampered with.

    Returns the buffer after a clean xla write, KV sources with some slots' bytes changed afterwards, and a plan
    (shuffled, or in chain order) whose entries are partly wrong (expected position, predecessor, expected token)
    or special (slot 0, prev 0 / -1, out-of-range slots), followed by garbage entries past ``num_active`` up to a
    fixed capacity of ``num_reqs * max_len + capacity_slack``.
    """
    offsets, seeds, num_valid, ids, positions, loc = write_inputs(
        rng, num_slots=num_slots, num_reqs=num_reqs, max_len=max_len, extra_tokens=0, clean=True, page=page
    )
    # The chain is written without sources (one compile of the xla chain per shape), then the REAL_KV_HASH
    # field is filled with the xla fold, exactly what a write with the sources would store.
    buf, _ = _xla_write(
        jnp.zeros((num_slots, 4, 2), jnp.uint32),
        offsets,
        seeds,
        num_valid,
        ids,
        positions,
        loc,
        jnp.ones((1,), jnp.int32),
        real_kv_sources=(),
        real_kv_hash_mode=0,
    )
    total = int(offsets[-1])
    offsets = np.asarray(offsets)
    ids, positions, loc = (np.asarray(x)[:total] for x in (ids, positions, loc))
    real_kv = np.stack(_xla_fold(sources, jnp.asarray(loc), mode=mode), axis=-1)
    records = np.asarray(buf).copy()
    records[loc, 3] = real_kv
    n = loc.shape[0]
    starts = np.repeat(offsets[:-1], np.diff(offsets))
    first = np.arange(n) == starts
    prev = np.where(first, -1, np.roll(loc, 1)).astype(np.int32)
    slot, exp_pos, exp_tok = loc.copy(), positions.copy(), ids.copy()
    pick = lambda p: rng.random(n) < p  # noqa: E731
    exp_pos[pick(0.05)] += 1
    wrong_prev = pick(0.05)
    prev[wrong_prev] = rng.integers(1, num_slots, int(wrong_prev.sum()))
    prev[pick(0.05)] = 0
    exp_tok[pick(0.2)] = -1
    exp_tok[pick(0.05)] += 7
    slot[pick(0.03)] = 0
    slot[pick(0.01)] = -rng.integers(1, 4)
    slot[pick(0.01)] = num_slots + rng.integers(0, 4)
    tampered = rng.choice(loc, max(4, n // 40), replace=False)
    field = np.arange(tampered.shape[0]) % 4  # every field: token, position, prev hash, real-KV hash
    records[tampered, field, rng.integers(0, 2, tampered.shape[0])] ^= np.uint32(1 << 7)
    sources = corrupt_sources(rng, sources, rng.choice(loc, max(1, n // 40), replace=False))
    order = rng.permutation(n) if shuffle else np.arange(n)
    garbage = lambda lo, hi: rng.integers(lo, hi, num_reqs * max_len + capacity_slack - n)  # noqa: E731
    plan = [
        np.concatenate([x[order], garbage(lo, hi)]).astype(np.int32)
        for x, (lo, hi) in (
            (slot, (0, num_slots)),
            (exp_tok, (-1, 9)),
            (exp_pos, (0, 9)),
            (prev, (-1, num_slots)),
        )
    ]
    return jnp.asarray(records), sources, [jnp.asarray(x) for x in plan], jnp.int32(n)
