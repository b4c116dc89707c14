"""Named kernel workloads: realistic verify plans and decode/prefill write batches over a paged bf16 KV pool.

Contents are random bits (never zeros: zeros hide wrong indexing and can run faster than real data). Slots follow
a paged allocator: pages of ``PAGE_SIZE`` slots in random page order, sequential inside a page.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import realkv

PAGE_SIZE = 16
KV_HEADS, HEAD_DIM = 2, 128  # bf16 K of one layer: 512 bytes per token
VERIFY_ENTRIES = (4096, 65536, 1 << 20, 4 << 20)
VERIFY_REQUEST_LEN = 1024  # a verify plan re-checks each running request's whole prefix
DECODE_BATCHES = (1, 64, 256)
PREFILL_SHAPES = ((1, 4096), (32, 512))  # (requests, tokens each)
MODES = {"none": 0, "partial": 1, "all": 2}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    args: tuple  # positional array args of the op (after nothing: canary_buf first)
    sources: tuple[realkv.RealKvSource, ...]
    num_entries: int  # plan entries (verify) or tokens (write)


def _paged_slots(rng, num_slots: int, count: int) -> np.ndarray:
    pages = rng.permutation(np.arange(1, num_slots // PAGE_SIZE))  # page 0 holds padding slot 0
    slots = (pages[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)[None, :]).reshape(-1)
    return slots[:count].astype(np.int32)


def _pool(rng, num_slots: int):
    pages = num_slots // PAGE_SIZE
    raw = rng.integers(0, 2**16, (pages, PAGE_SIZE, KV_HEADS, HEAD_DIM), dtype=np.uint16)
    data = jnp.asarray(raw.view(ml_dtypes.bfloat16))
    return (realkv.RealKvSource(data, page_size=PAGE_SIZE),)


def _buffer(rng, num_slots: int):
    return jnp.asarray(rng.integers(0, 2**32, (num_slots, 4, 2), dtype=np.uint32))


def _num_slots(entries: int) -> int:
    return (entries // PAGE_SIZE + 2) * PAGE_SIZE


def verify(entries: int, seed: int = 0) -> Workload:
    """A full verify plan: ``entries / 1024`` requests of 1024 cached tokens each (decode-time re-verification)."""
    rng = np.random.default_rng(seed)
    num_slots = _num_slots(entries)
    slots = _paged_slots(rng, num_slots, entries)
    index = np.arange(entries)
    first = index % VERIFY_REQUEST_LEN == 0
    prev = np.where(first, -1, np.roll(slots, 1)).astype(np.int32)
    positions = (index % VERIFY_REQUEST_LEN).astype(np.int32)
    tokens = np.full(entries, -1, np.int32)
    plan = tuple(jnp.asarray(x) for x in (slots, tokens, positions, prev))
    args = (_buffer(rng, num_slots), *plan, jnp.int32(entries))
    return Workload(f"verify n={entries}", args, _pool(rng, num_slots), entries)


def write(num_reqs: int, tokens_each: int, seed: int = 0) -> Workload:
    """A write launch: decode (1 token each, seeded by the request's last slot) or a prefill chunk (seed -1)."""
    rng = np.random.default_rng(seed)
    num_tokens = num_reqs * tokens_each
    num_slots = _num_slots(2 * num_tokens + 64 * PAGE_SIZE)
    slots = _paged_slots(rng, num_slots, num_tokens + num_reqs)
    loc, seed_slots = slots[:num_tokens], slots[num_tokens:]
    decode = tokens_each == 1
    seeds = seed_slots if decode else np.full(num_reqs, -1, np.int32)
    positions = np.tile(np.arange(tokens_each), num_reqs) + (rng.integers(1, 4000, num_tokens) if decode else 0)
    args = (
        _buffer(rng, num_slots),
        jnp.asarray(np.arange(0, num_tokens + 1, tokens_each, dtype=np.int32)),
        jnp.asarray(seeds.astype(np.int32)),
        jnp.asarray([num_reqs], jnp.int32),
        jnp.asarray(rng.integers(0, 128000, num_tokens).astype(np.int32)),
        jnp.asarray(positions.astype(np.int32)),
        jnp.asarray(loc),
        jnp.ones((1,), jnp.int32),
    )
    return Workload(f"write {num_reqs}x{tokens_each}", args, _pool(rng, num_slots), num_tokens)


def verify_bytes(entries: int, mode: int) -> int:
    """Fewest bytes a verify must move: 4 plan words, its record (32 B), the predecessor's 3 fields, 4 B out, KV."""
    kv = {0: 0, 1: 16, 2: KV_HEADS * HEAD_DIM * 2}[mode]
    return entries * (16 + 32 + 24 + 4 + kv)


def write_bytes(tokens: int, mode: int) -> int:
    """Fewest bytes a write must move: 3 token words in, a 32 B record, ChainOut (8 + 8 + 2 B), KV read."""
    kv = {0: 0, 1: 16, 2: KV_HEADS * HEAD_DIM * 2}[mode]
    return tokens * (12 + 32 + 18 + kv)
