"""Random inputs for the fused phase op, from a fixed seed, at any size (CPU tests and ``benchmarks/gpu_validate.py``).

A case is one phase of one group: random canary buffers (so most verified entries fail), a ragged batch with
padding rows, empty and long requests, slot 0 and out-of-range slots in ``req_to_token``, skipped, duplicated and
out-of-range ``out_cache_loc``, position glitches, and a ring that starts anywhere from empty to saturated, so rows
overflow it in the middle of the phase. Shapes depend only on the keyword arguments, so one compile serves every
seed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.phase import api, common
from tests.pallas_kernels import kernel_cases

RING_STARTS = ("empty", "mid", "almost_full", "full", "saturated")


@dataclasses.dataclass(frozen=True)
class Shape:
    """Static shape and switches of a case (everything that selects a compile)."""

    num_slots: int = 64
    num_reqs: int = 5
    max_len: int = 12
    num_tokens: int = 9
    capacity: int = 40
    ring_capacity: int = 16
    halves: int = 2
    mode: int = 0
    sources: tuple = ()  # kernel_cases.SourceSpec per source, the same for each half
    swa_slots: int = 0  # > 0: an SWA group of that many slots, addressed through a LUT
    window: int = 0
    token_check: bool = False
    input_assert: bool = False
    token_offset: int = 0
    max_extend: int = 3  # tokens a request writes: up to 3 (decode, speculative), more for a prefill chunk
    check_table: bool = False  # the phase reports the bad table values (INVALID_INPUT rows) first


def make_case(
    seed: int,
    shape: Shape,
    *,
    ring_start: str = "mid",
    overflow: bool = False,
    primed: bool = False,
    corrupt: float = 0.05,
    clean_seeds: bool = False,
    out_of_range: bool = True,
    roles: bool = False,
    masked: bool = True,
):
    """``(buffers, log, batch, enable_chain_position_assert, sources, tags)`` for ``pallas_kernels.phase``.

    ``primed`` writes every cached position's record first (a prefill through the phase op) and then
    corrupts a ``corrupt`` fraction of the records, so most entries verify clean and every launch's rows land in a
    roomy ring;
    otherwise the buffers are random and nearly every verified entry fails. ``clean_seeds`` starts from zeros.
    ``out_of_range`` puts the padding slot and slots past the pool into the table, and slots past the pool into the
    tokens (the phase skips them, and a chain does not continue from them: the runner's input checks report them). ``roles`` gives the rows' roles explicitly, as the runner does: some rows with a
    table row are not requests but own tokens (skipped), and the ring carries a context array and a
    verify-overflow count; ``masked=False`` leaves their tokens' slots as they were (for ``skip_bad_requests``).
    """
    rng = np.random.default_rng(seed)
    s = shape
    buf_slots = s.swa_slots or s.num_slots
    rows = s.num_reqs + 2
    real = int(rng.integers(1, s.num_reqs + 1))  # the rest are padding rows (req_pool_indices 0)
    real = s.num_reqs if overflow else real
    rpi = np.zeros(s.num_reqs, np.int32)
    rpi[:real] = 1 + rng.permutation(rows - 1)[:real]
    prefix = rng.integers(0, s.max_len, s.num_reqs).astype(np.int32)
    if overflow:
        prefix[:real] = s.max_len - 1
    else:  # keep the plan within capacity most of the time, but let it be large
        while int(prefix[:real].sum()) > s.capacity:
            prefix[int(rng.integers(0, real))] //= 2
    prefix[rng.random(s.num_reqs) < 0.2] = 0  # empty requests
    extend = rng.integers(0, s.max_extend + 1, s.num_reqs).astype(np.int32)
    extend[rng.random(s.num_reqs) < 0.2] = 0
    extend = np.minimum(extend, s.max_len - prefix).astype(np.int32)

    req_to_token = rng.integers(1, s.num_slots, (rows, s.max_len)).astype(np.int32)
    if out_of_range:
        req_to_token[rng.random(req_to_token.shape) < 0.05] = 0  # the padding slot inside a chain: skipped
        req_to_token[rng.random(req_to_token.shape) < 0.03] = s.num_slots + 3  # skipped
    ids, positions, loc = [], [], []
    for r in range(s.num_reqs):
        for j in range(int(extend[r]) if rpi[r] else 0):
            ids.append(int(rng.integers(0, 1000)))
            positions.append(int(prefix[r]) + j + (1 if rng.random() < 0.1 else 0))  # position glitch
            loc.append(int(req_to_token[rpi[r], prefix[r] + j]))
    n = s.num_tokens
    ids = np.resize(np.asarray(ids + [0] * n, np.int32), n)
    positions = np.resize(np.asarray(positions + [0] * n, np.int32), n)
    loc = np.resize(np.asarray(loc + [-1] * n, np.int32), n)
    if n:
        loc[rng.random(n) < 0.1] = -1  # skipped entries
        dup = rng.random(n) < 0.15
        loc[dup] = loc[rng.integers(0, n, n)][dup]  # duplicate slots within the launch
        if out_of_range:
            loc[rng.random(n) < 0.05] = s.num_slots + 7  # skipped: not stored, the chain does not advance

    lut = None
    if s.swa_slots:
        lut = rng.integers(0, s.swa_slots, s.num_slots + 1).astype(np.int32)
        lut[rng.random(lut.shape) < 0.1] = 0  # evicted
        if out_of_range:
            lut[rng.random(lut.shape) < 0.15] = s.swa_slots + 5  # past the SWA pool: skipped (reported when checked)
        lut[0] = 0  # the padding slot maps to the padding slot
    pool = pool_lens = None
    if s.token_check:
        pool = rng.integers(0, 1000, (rows, s.max_len)).astype(np.int32)
        pool_lens = rng.integers(0, s.max_len + 1, s.num_reqs).astype(np.int32)
    expected_ids = expected_positions = None
    if s.input_assert:
        # Often wrong, so some tokens get both an input-assert row and a chain-position row.
        expected_ids = np.where(rng.random(n) < 0.3, ids + 1, ids).astype(np.int32)
        expected_positions = np.where(rng.random(n) < 0.3, positions - 1, positions).astype(np.int32)
        if n:  # the first token fails both asserts (input and, from a seed, chain position): two rows
            positions[0] += 2
    batch = common.Batch(
        *(jnp.asarray(x) for x in (rpi, prefix, extend, req_to_token, ids, positions, loc)),
        **{
            k: None if x is None else jnp.asarray(x)
            for k, x in zip(
                ("full_to_swa_index_mapping", "token_ids", "token_ids_lens", "expected_input_ids", "expected_positions"),
                (lut, pool, pool_lens, expected_ids, expected_positions),
                strict=True,
            )
        },
    )
    if roles:
        batch = _with_roles(rng, batch, masked=masked)

    buffers = tuple(kernel_cases.random_buffer(rng, buf_slots) for _ in range(s.halves))
    if clean_seeds or primed:
        buffers = tuple(jnp.zeros_like(b) for b in buffers)
    sources = tuple(kernel_cases.make_sources(rng, buf_slots, s.sources) for _ in range(s.halves))
    tags = (2, 3) if s.halves == 2 else (8,)
    if primed:
        buffers = _prime(rng, s, buffers, batch, sources, tags, corrupt)
    cap = s.ring_capacity
    start = {"empty": 0, "mid": cap // 2, "almost_full": cap - 2, "full": cap + 3, "saturated": 2**31 - 3}[ring_start]
    counters = rng.integers(0, 2**32, (2, 12, 2), dtype=np.uint32)
    counters[:, :, 0] |= np.uint32(0xFFFFFFF0)  # low words near 2^32: every bump carries
    ring = rng.integers(0, 2**32, (cap, 8, 2), dtype=np.uint32)
    ring[:, 7, 0] %= 128  # fail bits, as in any real ring (the per-launch path's _ring.after relies on < 2^31)
    log = common.Log(
        ring=jnp.asarray(ring),
        write_index=jnp.full((1,), start, jnp.int32),
        kernel_run_counters=jnp.asarray(counters[0]),
        slot_run_counters=jnp.asarray(counters[1]),
        context=jnp.asarray(rng.integers(-9, 99, (cap, 3)), jnp.int32) if roles else None,
        verify_overflows=jnp.asarray([rng.choice([0, 7, 2**31 - 1])], jnp.int32) if roles else None,
    )
    cpa = jnp.full((1,), int(rng.random() < 0.8), jnp.int32)
    return buffers, log, batch, cpa, sources, tags


def _with_roles(rng, batch: common.Batch, *, masked: bool) -> common.Batch:
    """Explicit roles: every row with a table row owns ``max(extend, 0)`` tokens, but a third of them are not
    requests (their tokens skipped, ``out_cache_loc = -1``, when ``masked``)."""
    rpi, extend = np.asarray(batch.req_pool_indices), np.asarray(batch.extend_lens)
    active = (rpi != 0) & (rng.random(rpi.shape) < 0.67)
    span = np.maximum(extend, 0).astype(np.int32)
    starts = np.cumsum(span) - span
    loc = np.asarray(batch.out_cache_loc).copy()
    for r in np.nonzero(~active)[0] if masked else ():
        loc[starts[r] : starts[r] + span[r]] = -1
    return dataclasses.replace(
        batch, out_cache_loc=jnp.asarray(loc), active=jnp.asarray(active, jnp.int32), span_lens=jnp.asarray(span)
    )


@functools.partial(jax.jit, static_argnames=("tags", "mode"))
def _prefill(buffers, log, batch, sources, *, tags, mode):
    # backend="auto": the jnp reference on CPU, the kernels on a GPU (quick to compile at GPU sizes). The records
    # are only the case's starting point, which both backends under test then receive.
    zero = jnp.zeros((1,), jnp.int32)
    out = api.phase(
        buffers,
        log,
        batch,
        zero,
        tags=tags,
        real_kv_sources=sources,
        real_kv_hash_mode=mode,
        verify_capacity=1,
        backend="auto",
    )
    return out[0]


def _prime(rng, s: Shape, buffers, batch: common.Batch, sources, tags, corrupt: float):
    """Writes the records of every cached position as one prefill would, then corrupts a fraction of the slots."""
    rpi, prefix, rtt = (np.asarray(x) for x in (batch.req_pool_indices, batch.prefix_lens, batch.req_to_token))
    ids, positions, loc = [], [], []
    for r in np.nonzero(rpi)[0]:
        for p in range(int(prefix[r])):
            token = int(rng.integers(0, 1000))
            if batch.token_ids is not None and 0 <= p + s.token_offset < s.max_len:
                token = int(np.asarray(batch.token_ids)[rpi[r], p + s.token_offset])  # what the check expects
            ids.append(token)
            positions.append(p)
            loc.append(int(rtt[rpi[r], p]))
    n = s.num_reqs * s.max_len
    pad = lambda xs, fill: jnp.asarray(np.asarray(xs + [fill] * (n - len(xs)), np.int32))  # noqa: E731
    prefill = common.Batch(
        batch.req_pool_indices,
        jnp.zeros_like(batch.prefix_lens),
        batch.prefix_lens,
        batch.req_to_token,
        pad(ids, 0),
        pad(positions, 0),
        pad(loc, -1),
        batch.full_to_swa_index_mapping,
    )
    log = common.Log(
        jnp.zeros((1, 8, 2), jnp.uint32),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((12, 2), jnp.uint32),
        jnp.zeros((12, 2), jnp.uint32),
    )
    primed = []
    for buf in _prefill(buffers, log, prefill, sources, tags=tags, mode=s.mode):
        raw = np.asarray(buf).copy()
        bad = rng.random(raw.shape[0]) < corrupt
        raw[bad, rng.integers(0, 4), rng.integers(0, 2)] ^= np.uint32(0x10000)
        primed.append(jnp.asarray(raw))
    return tuple(primed)


def with_bad_rows(batch: common.Batch, padding: str, seed: int) -> common.Batch:
    """``batch`` with rows the batch checks reject: a request row past the table, a negative extend, a prefix
    past the context, a span past the tokens (the rows after it are not requests either), and padding rows."""
    rng = np.random.default_rng(seed)
    rows = (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens)
    rpi, prefix, extend = (np.asarray(x).copy() for x in rows)
    rows, context = batch.req_to_token.shape
    r = rng.permutation(len(rpi))
    rpi[r[0]] = rows + int(rng.integers(0, 3))
    extend[r[1]] = -int(rng.integers(1, 3))
    prefix[r[2]] = context
    rpi[r[3]] = -1 if padding == "negative" else 0
    if seed % 2:  # a span past the tokens: the rows after it own none
        extend[r[4]] = batch.out_cache_loc.shape[0] + 1
    arrays = {"req_pool_indices": rpi, "prefix_lens": prefix, "extend_lens": extend}
    return dataclasses.replace(batch, **{k: jnp.asarray(v, jnp.int32) for k, v in arrays.items()})
