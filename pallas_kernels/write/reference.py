"""Pure-jnp write chain: the serial per-request hash chain, vectorised across requests.

The chain ``h' = mix3(h, token, position)`` is not associative, so one request's entries are inherently serial.
Instead of one XLA loop step per token, each loop step walks a block of ``CHAIN_BLOCK`` entries of every request
in straight-line (unrolled) code, so a 4096-token prefill chunk takes 4096 / CHAIN_BLOCK loop steps and a decode
step takes one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import hash64, records

# bs=8 x 4096 tokens: block 8 runs 24.8 ms on an H200 against 85.6 ms at block 1 (each XLA:GPU loop step costs
# launches and a predicate copy); on CPU loop steps are cheap and block 1 wins (3.7 vs 12.9 ms), and each unrolled
# entry adds three splitmix64 chains to the compiled step. benchmarks/bench_write_chain_cpu.py measures it.
CHAIN_BLOCK = 8
CPU_CHAIN_BLOCK = 1


def chain_block() -> int:
    """Entries one loop step walks: ``CPU_CHAIN_BLOCK`` when jax runs on CPU, else ``CHAIN_BLOCK``."""
    return CPU_CHAIN_BLOCK if jax.default_backend() == "cpu" else CHAIN_BLOCK


_OUT_FIELDS = 6  # the walk's per-entry words: prev_hash (2), expected_position (2), position_assert_failed, written


class Launch(NamedTuple):
    """A write launch's arrays after the buffer, in ``api.write``'s order: one pytree, so ``jax.vmap`` and the mesh
    helpers take it whole."""

    write_offsets: jax.Array  # i32[R + 1]: request r's entries are [write_offsets[r], write_offsets[r + 1])
    seed_slot_indices: jax.Array  # i32[R]: the slot each request's chain continues from (< 0: a new chain)
    num_valid_reqs: jax.Array  # i32[1]: requests past it walk nothing
    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    out_cache_loc: jax.Array  # i32[T]: each entry's slot (< 0: skipped)
    enable_chain_position_assert: jax.Array  # i32[1]


class ChainOut(NamedTuple):
    """Per-entry results of the serial walk, indexed like the token arrays (``T`` entries)."""

    prev_hash: jax.Array  # u32[T, 2]: running chain hash stored as the entry's PREV_HASH
    expected_position: jax.Array  # u32[T, 2]: previous position + 1 (chain-position assert's expectation)
    position_assert_failed: jax.Array  # bool[T]
    written: jax.Array  # bool[T]: covered by a valid request and out_cache_loc >= 0


def empty_chain(num_tokens: int) -> ChainOut:
    """The ChainOut of entries no request walks: zero hashes and positions, nothing failed or written."""
    return ChainOut(
        prev_hash=jnp.zeros((num_tokens, 2), jnp.uint32),
        expected_position=jnp.zeros((num_tokens, 2), jnp.uint32),
        position_assert_failed=jnp.zeros((num_tokens,), bool),
        written=jnp.zeros((num_tokens,), bool),
    )


def request_spans(write_offsets: jax.Array, num_valid_reqs: jax.Array, num_tokens: int):
    """(start, count) of each request's entries, clamped to the token arrays; count 0 past ``num_valid_reqs``."""
    num_reqs = write_offsets.shape[0] - 1
    valid = jnp.arange(num_reqs) < jnp.clip(num_valid_reqs[0], 0, num_reqs)
    start = jnp.clip(write_offsets[:-1], 0, num_tokens)
    end = jnp.clip(write_offsets[1:], 0, num_tokens)
    return start, jnp.where(valid, jnp.maximum(end - start, 0), 0)


def chain_seeds(canary_buf, seed_slot_indices, count, enable_chain_position_assert):
    """Initial running hash, running position and position-assert switch of each request."""
    seed_record = records.load(canary_buf, seed_slot_indices)
    check_position = position_checked(seed_slot_indices, count, enable_chain_position_assert)
    return records.record_hash(seed_slot_indices, seed_record), seed_record[1], check_position


def position_checked(seed_slot_indices, count, enable_chain_position_assert):
    """bool[R]: the requests whose chain-position assert is on (a continued chain with entries, the flag set)."""
    return (seed_slot_indices >= 0) & (enable_chain_position_assert[0] != 0) & (count > 0)


def advance(h: hash64.U64, pos_prev: hash64.U64, token: jax.Array, position: jax.Array, live: jax.Array):
    """One chain step: a live entry moves the running hash to ``mix3(h, token, position)`` and the position on."""
    pos = hash64.from_i32(position)
    h = hash64.where(live, hash64.mix3(h, hash64.from_i32(token), pos), h)
    return h, hash64.where(live, pos, pos_prev)


def position_assert(prev_position: hash64.U64, position: jax.Array, live: jax.Array, check: jax.Array):
    """(previous position + 1, failed): the chain-position assert of live entries whose request checks it."""
    expected = hash64.add(prev_position, hash64.const(1, prev_position[0]))
    return expected, live & check & hash64.ne(hash64.from_i32(position), expected)


def write_chain(canary_buf: jax.Array, launch: Launch) -> ChainOut:
    """Walks every request's entries in order, as SGLang's one-thread-per-request write kernel does.

    Args:
      canary_buf: u32[num_slots, 4, 2], read for the seeds only (the state before this launch).
      launch: the launch's :class:`Launch` arrays.
    """
    seed_record = records.load(canary_buf, launch.seed_slot_indices)
    return walk_chain(records.record_hash(launch.seed_slot_indices, seed_record), seed_record[1], launch)


@jax.jit  # one compiled walk per shape, also for eager (un-jitted) callers: the loop body is a fresh closure
def walk_chain(seed_hash: hash64.U64, seed_position: hash64.U64, launch: Launch) -> ChainOut:
    """:func:`write_chain` from the seed slots' H(slot) and stored positions (``records.record_hash`` and the
    position field of their records): it reads no buffer, so the caller may hash the seeds with other records,
    and ``jax.vmap`` over stacked seeds walks the K and V halves' chains as one batched loop."""
    write_offsets, seed_slot_indices, num_valid_reqs, input_ids, positions, out_cache_loc, flag = launch
    num_tokens = out_cache_loc.shape[0]
    start, count = request_spans(write_offsets, num_valid_reqs, num_tokens)
    running_hash, running_pos = seed_hash, seed_position
    check_position = position_checked(seed_slot_indices, count, flag)
    block_size = chain_block()
    lanes = jnp.arange(block_size)
    tokens = jnp.stack([out_cache_loc, input_ids, positions], axis=-1)  # one gather per loop step reads all three

    def block(k, carry):
        running, out = carry  # running: u32[4, R] (hash lo, hash hi, position lo, position hi) of each request
        offset = k * block_size + lanes[None, :]  # [R, B]
        covered = offset < count[:, None]
        entry = jnp.where(covered, start[:, None] + offset, num_tokens)  # sentinel T is dropped below
        safe = jnp.minimum(entry, num_tokens - 1)
        read = tokens[safe]
        slot, token, position = read[..., 0], read[..., 1], read[..., 2]
        live = covered & (slot >= 0)
        # history[j] = the running state before entry j, u32[B, 4, R]. Routing every step through it keeps XLA
        # from fusing the unrolled chain into one expression: XLA:CPU re-emits shared subexpressions of a fused
        # chain, which cost 0.5 s per block at B=4 (optimization_barrier is expanded before fusion on CPU, so it
        # cannot help). The traced ``zero`` stops the simplifier from folding the store/load pair away. The state
        # stays one array, so one fusion computes each step's hash, not one per field read.
        # With one entry a step (CPU) there is no chain to keep apart: the history is the state the step starts from.
        history = running[None] if block_size == 1 else jnp.zeros((block_size, 4, count.shape[0]), jnp.uint32)
        zero = jnp.minimum(k, 0)
        for j in range(block_size):  # straight-line: the serial dependency stays inside one loop step
            state = running
            if block_size > 1:
                history = lax.dynamic_update_index_in_dim(history, running, j + zero, 0)
                state = lax.dynamic_index_in_dim(history, j + zero, 0, keepdims=False)
            h, pos_prev = advance((state[0], state[1]), (state[2], state[3]), token[:, j], position[:, j], live[:, j])
            running = jnp.stack([*h, *pos_prev])
        history = jnp.transpose(history, (2, 0, 1))  # [R, B, 4]
        prev_position = (history[..., 2], history[..., 3])
        expected, failed = position_assert(prev_position, position, live, check_position[:, None])
        flags = jnp.stack([failed, live], axis=-1).astype(jnp.uint32)
        fields = jnp.concatenate([history[..., :2], hash64.join(expected), flags], axis=-1)  # [R, B, 6]
        out = out.at[entry.reshape(-1)].set(fields.reshape(-1, _OUT_FIELDS), mode="drop")  # one scatter, all fields
        return running, out

    num_blocks = (jnp.max(count, initial=0) + block_size - 1) // block_size
    init = (jnp.stack([*running_hash, *running_pos]), jnp.zeros((num_tokens, _OUT_FIELDS), jnp.uint32))
    _, out = lax.fori_loop(0, num_blocks, block, init)
    return ChainOut(
        prev_hash=out[:, 0:2],
        expected_position=out[:, 2:4],
        position_assert_failed=out[:, 4] != 0,
        written=out[:, 5] != 0,
    )
