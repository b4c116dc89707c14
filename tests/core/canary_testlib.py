"""Shared helpers of the core tests: fixed shapes, jitted ops reused across tests, and a host oracle in Python ints.

Every test builds its inputs at the shapes below, so each jitted op compiles once per static variant (tag, mode,
sources) for the whole suite. The oracle is a line-by-line port of SGLang's torch references
(``reference/sglang_kernels.md`` §2, §3, §5, §7): Python ints masked to 64 bits, rows collected in entry order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import kvcanary_jax as kc
from kvcanary_jax import testing
from kvcanary_jax.core._state import u64_pairs_as_int64

U64 = (1 << 64) - 1
INT32_MAX = 2**31 - 1

NUM_SLOTS = 64  # canary buffer slots (slot 0 is padding)
VCAP = 32  # verify capacity
NUM_TOKENS = 24  # token-array length of a write launch
WCAP = 4  # write_req_capacity
RING = 16  # ring capacity
POOL_ROWS, POOL_CTX = 8, 32  # expected-token pool and req_to_token shape

TAG_HEAD = kc.CanaryLaunchTag.HEAD_K_FULL
TAG_TAIL = kc.CanaryLaunchTag.TAIL_K_FULL

jit_verify = jax.jit(kc.canary_verify, static_argnames=("tag", "real_kv_hash_mode", "check_expected_token", "backend"))
jit_write = jax.jit(kc.canary_write, static_argnames=("tag", "real_kv_hash_mode", "backend"))
jit_build_plans = jax.jit(
    kc.build_plans,
    static_argnames=("verify_capacity", "write_req_capacity", "swa_window_size", "kv_token_id_vs_position_offset"),
)


def new_state(*, ring_capacity: int = RING) -> kc.CanaryDeviceState:
    """A fresh state; it always carries the expected-token pool so every test shares one pytree structure."""
    config = kc.CanaryConfig(ring_capacity=ring_capacity, enable_verify_token_assert=True, backend="xla")
    return kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=POOL_ROWS, max_context_len=POOL_CTX)


def new_buf() -> jax.Array:
    return kc.allocate_canary_buffer(NUM_SLOTS)


def i32(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, np.int64).astype(np.int32))


def padded(values, length: int, fill: int) -> jax.Array:
    values = list(values)
    assert len(values) <= length, (len(values), length)
    return i32(values + [fill] * (length - len(values)))


def verify_plan(slots, positions, prevs, tokens=None, *, num_valid=None, enable=1, capacity=VCAP) -> kc.VerifyPlan:
    """A VerifyPlan from entry lists, padded to ``capacity`` (padding: slot 0, token -1)."""
    n = len(slots)
    tokens = [-1] * n if tokens is None else tokens
    return kc.VerifyPlan(
        slot_indices=padded(slots, capacity, 0),
        expected_tokens=padded(tokens, capacity, -1),
        expected_positions=padded(positions, capacity, 0),
        prev_slot_indices=padded(prevs, capacity, 0),
        num_valid=i32([n if num_valid is None else num_valid]),
        enable=i32([enable]),
    )


def write_batch(requests, *, num_tokens=NUM_TOKENS, wcap=WCAP, num_valid_reqs=None):
    """(WritePlan, input_ids, positions, out_cache_loc) for ``requests = [(seed, [(slot, token, position), ...])]``.

    Unused token entries are padding (slot -1) outside every request's span.
    """
    offsets, seeds, entries = [0], [], []
    for seed, items in requests:
        seeds.append(seed)
        entries.extend(items)
        offsets.append(len(entries))
    offsets += [offsets[-1]] * (wcap + 1 - len(offsets))
    plan = kc.WritePlan(
        write_offsets=i32(offsets),
        seed_slot_indices=padded(seeds, wcap, -1),
        num_valid_reqs=i32([len(requests) if num_valid_reqs is None else num_valid_reqs]),
    )
    slots = [e[0] for e in entries]
    tokens = [e[1] for e in entries]
    positions = [e[2] for e in entries]
    return plan, padded(tokens, num_tokens, 0), padded(positions, num_tokens, 0), padded(slots, num_tokens, -1)


# ----------------------------------------------------------------------------------------------------------- host views


def u64s(pairs) -> list:
    """A ``u32[..., 2]`` device array as nested lists of unsigned Python ints."""
    return (u64_pairs_as_int64(pairs).astype(np.uint64)).tolist()


def records(buf) -> list[list[int]]:
    """The canary buffer as ``[slot][TOKEN, POSITION, PREV_HASH, REAL_KV_HASH]`` unsigned ints."""
    return [[int(v) for v in rec] for rec in kc.records_as_int64(buf).astype(np.uint64)]


def u64_pairs(values) -> jax.Array:
    """Unsigned (or signed) ints as the ``u32[..., 2]`` (lo, hi) device layout."""
    host = np.array(values, dtype=object)
    flat = np.array([int(v) & U64 for v in host.reshape(-1)], np.uint64).reshape(host.shape)
    return jnp.asarray(flat.view(np.uint32).reshape(host.shape + (2,)))


def buf_from_records(recs) -> jax.Array:
    """A device canary buffer holding ``recs`` (``[slot][4]`` ints, any sign), via SGLang's int64 byte layout."""
    host = np.array([[v & U64 for v in rec] for rec in recs], np.uint64)
    return jnp.asarray(host.view(np.uint32).reshape(len(recs), 4, 2))


def empty_records(num_slots: int = NUM_SLOTS) -> list[list[int]]:
    return [[0, 0, 0, 0] for _ in range(num_slots)]


def ring_rows(state) -> list[list[int]]:
    """The valid ring rows as signed int64 Python ints (SGLang's int64 view)."""
    return kc.read_violations(state.violation_log).rows.tolist()


def write_index(state) -> int:
    return int(np.asarray(state.violation_log.violation_write_index)[0])


def counters(state) -> tuple[list[int], list[int]]:
    """(kernel_run_counters, slot_run_counters) as unsigned ints per tag."""
    return u64s(state.kernel_run_counters), u64s(state.slot_run_counters)


def signed_row(row) -> list[int]:
    return [testing.to_signed(v) for v in row]


# --------------------------------------------------------------------------------------------------------- host oracle


def slot_hash(recs, slot: int) -> int:
    """H(slot): the anchor hash for slot < 0, else mix3(PREV_HASH, TOKEN, POSITION)."""
    if slot < 0:
        return testing.anchor_hash()
    token, position, prev_hash, _ = recs[slot]
    return testing.mix3(prev_hash, token, position)


def oracle_verify(
    recs,
    slots,
    positions,
    prevs,
    tokens=None,
    *,
    num_valid=None,
    enable=1,
    capacity=VCAP,
    tag=TAG_TAIL,
    check_token=False,
    real_kv=lambda slot: 0,
):
    """SGLang's verify reference: (rows, active entries counted)."""
    n = len(slots)
    num_valid = n if num_valid is None else num_valid
    tokens = [-1] * n if tokens is None else tokens
    if not enable:
        return [], 0
    active = min(max(num_valid, 0), capacity)
    pad = lambda xs, fill: list(xs) + [fill] * (capacity - len(xs))  # noqa: E731
    slots, positions, prevs, tokens = pad(slots, 0), pad(positions, 0), pad(prevs, 0), pad(tokens, -1)
    rows = []
    for e in range(active):
        slot = slots[e]
        if slot == 0:
            continue
        token, position, prev_hash, stored_kv = recs[slot]
        reachable = prevs[e] != 0
        expected_chain = slot_hash(recs, prevs[e]) if reachable else prev_hash
        expected_token = tokens[e] if check_token else -1
        bits = 0
        if reachable and prev_hash != expected_chain:
            bits |= 1
        if position != positions[e] & U64:
            bits |= 2
        if stored_kv != real_kv(slot):
            bits |= 4
        if check_token and expected_token != -1 and token != expected_token & U64:
            bits |= 32
        if bits:
            rows.append(signed_row([tag, slot, position, token, expected_token, prev_hash, expected_chain, bits]))
    return rows, active


def oracle_write(
    recs, requests, *, tag=TAG_HEAD, position_assert=1, expected=None, real_kv=lambda slot: 0, num_valid_reqs=None
):
    """SGLang's write reference: (new records, rows, written entries).

    ``requests`` as in :func:`write_batch`; ``expected`` is ``[(token, position)]`` per flat entry (input assert).
    Seeds are read from the records before the launch (as every backend does).
    """
    before = recs
    recs = [list(r) for r in recs]
    rows, written, flat = [], 0, 0
    num_valid_reqs = len(requests) if num_valid_reqs is None else num_valid_reqs
    for r, (seed, items) in enumerate(requests):
        base, flat = flat, flat + len(items)
        if r >= num_valid_reqs or not items:
            continue
        running_hash = slot_hash(before, seed)
        check_position = seed >= 0 and position_assert != 0
        prev_position = before[seed][1] if check_position else None
        for k, (slot, token, position) in enumerate(items):
            if slot < 0:
                continue
            written += 1
            token, position = token & U64, position & U64
            if expected is not None:
                exp_token, exp_position = expected[base + k]
                bits = (8 if token != exp_token & U64 else 0) | (16 if position != exp_position & U64 else 0)
                if bits:
                    rows.append(signed_row([tag, slot, position, token, exp_token, running_hash, exp_position, bits]))
            if check_position:
                want = (prev_position + 1) & U64
                if position != want:
                    rows.append(signed_row([tag, slot, position, token, token, running_hash, want, 16]))
                prev_position = position
            if slot < len(recs):
                recs[slot] = [token, position, running_hash, real_kv(slot)]
            running_hash = testing.mix3(running_hash, token, position)
    return recs, rows, written


def oracle_plans(
    rpi, prefix, extend, req_to_token, *, vcap, wcap, window=0, lut=None, pool=None, valid_lens=None, offset=0
):
    """SGLang's plan reference (§5) in numpy; padding entries are (slot 0, token -1, position 0, prev 0)."""
    req_to_token = np.asarray(req_to_token)

    def xlat(x):
        x = int(x)
        return x if lut is None or x < 0 else int(lut[min(x, len(lut) - 1)])

    entries, offsets, seeds = [], [0], []
    for r in range(len(rpi)):
        row, active = int(rpi[r]), int(rpi[r]) != 0
        start = max(prefix[r] - window, 0) if window > 0 else 0
        vlen = max(prefix[r] - start, 0) if active else 0
        wlen = max(extend[r], 0) if active else 0
        for p in range(start, start + vlen):
            token = -1
            if pool is not None and 0 <= p + offset < valid_lens[r]:
                token = int(pool[row][p + offset])
            prev = xlat(req_to_token[row, p - 1]) if p > 0 else -1
            entries.append((xlat(req_to_token[row, p]), token, p, prev))
        offsets.append(offsets[-1] + wlen)
        seeds.append(xlat(req_to_token[row, prefix[r] - 1]) if active and prefix[r] > 0 and wlen > 0 else -1)
    total = len(entries)
    overflow = total > vcap
    used = [] if overflow else entries
    used = used + [(0, -1, 0, 0)] * (vcap - len(used))
    verify = {
        "slot_indices": [e[0] for e in used],
        "expected_tokens": [e[1] for e in used],
        "expected_positions": [e[2] for e in used],
        "prev_slot_indices": [e[3] for e in used],
        "num_valid": [vcap if overflow else total],
        "enable": [0 if overflow else 1],
    }
    write = {
        "write_offsets": offsets + [0] * (wcap + 1 - len(offsets)),
        "seed_slot_indices": seeds + [-1] * (wcap - len(seeds)),
        "num_valid_reqs": [len(rpi)],
    }
    return verify, write


def plan_as_lists(plan) -> dict:
    return {k: np.asarray(v).tolist() for k, v in vars(plan).items()}


def oracle_ring(rows_before, index, new_rows, capacity):
    """Fill-once append: (valid rows, index) after appending ``new_rows`` in order."""
    rows = list(rows_before)
    for row in new_rows:
        if index < capacity:
            rows.append(row)
        index = min(index + 1, INT32_MAX)
    return rows, index


# ------------------------------------------------------------------------------------------------------------- real KV


def host_fold(sources, slot: int, mode) -> int:
    """REAL_KV_HASH of ``slot`` from the sources' raw bytes, with the host fold (``kvcanary_jax.testing``)."""
    if int(mode) == 0 or not sources:
        return 0
    chunks = []
    for src in sources:
        raw = np.asarray(src.data).view(np.uint8).reshape(src.data.shape[0], -1)
        start = (slot % src.page_size) * src.num_bytes_per_token
        n = 16 if int(mode) == 1 else src.read_bytes
        chunks.append(raw[slot // src.page_size, start : start + n].tobytes())
    return testing.fold_sources(chunks)


def random_source(rng, dtype, *, pages, page_size, bytes_per_token, read_bytes=None, pad_bytes=0):
    """A RealKvSource of random bytes viewed as ``dtype``: ``[pages, row_bytes / itemsize]`` (row may be padded)."""
    itemsize = np.dtype(dtype).itemsize
    row_bytes = page_size * bytes_per_token + pad_bytes
    raw = rng.integers(0, 256, size=(pages, row_bytes), dtype=np.uint8)
    data = jnp.asarray(raw.view(dtype).reshape(pages, row_bytes // itemsize))
    return kc.RealKvSource(data, page_size=page_size, num_bytes_per_token=bytes_per_token, read_bytes=read_bytes)
