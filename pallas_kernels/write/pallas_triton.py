"""Write kernels (Pallas Triton): a serial chain walk per request, then a parallel real-KV fold + in-place store.

Two launches, because the two halves want different parallelism and the store needs a grid-wide fact:
  * ``kvcanary_write_chain``: one program per request walks its entries in order (``mix3`` is not associative,
    so the chain is serial) and emits ChainOut. It only reads the canary buffer through the seeds, which are
    hashed before any record is stored, exactly as the reference reads the pre-launch buffer.
  * ``kvcanary_write_store``: ``block`` entries per program fold their slots' KV bytes (parallel across entries,
    where the per-request walk would serialise ``read_bytes / 8`` more splitmix rounds per token) and store the
    records into the aliased buffer. Duplicate ``out_cache_loc`` in one launch resolve as in ``store.store``: the
    last written entry wins. Only winners store, so no two lanes write one slot and the bytes are deterministic.
    A winner is an entry that no later written entry overwrites: checked pairwise in-kernel for small launches
    (decode), or from ``store.last_writer``'s sort for large ones, where the pairwise scan costs O(T^2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import compat, hash64, kernel_io, realkv, records
from pallas_kernels.write import base, reference, store

_WRITTEN, _POSITION_FAILED = base.WRITTEN, base.POSITION_FAILED  # the chain kernel's per-entry flag bits
_CHAIN_WARPS = 1  # the chain walk is scalar code: more warps would only repeat it
# H200: pairwise beats the sort by ~2 us at 256 tokens and loses by ~37 us at 4096 and ~270 us at 16K tokens
# (benchmarks/RESULTS.md); the scan grows linearly per program, so the crossover is near 400 tokens.
PAIRWISE_MAX_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class Config:
    """Store-kernel launch shape and winner rule.

    Attributes:
      block: entries per program (a power of 2).
      num_warps, num_stages: Triton launch parameters.
      dedupe: ``"pairwise"`` (in-kernel scan of later entries) or ``"sort"`` (``store.last_writer``).
      compare_block: later entries compared per step of the pairwise scan (a power of 2).
    """

    block: int
    num_warps: int
    dedupe: str
    compare_block: int = 64
    num_stages: int = 1


def heuristic(num_tokens: int) -> Config:
    """128 entries per program; the pairwise winner scan up to ``PAIRWISE_MAX_TOKENS`` tokens, a sort beyond."""
    block = min(128, compat.next_power_of_2(num_tokens))
    dedupe = "pairwise" if num_tokens <= PAIRWISE_MAX_TOKENS else "sort"
    return Config(block=block, num_warps=max(1, min(4, block // 32)), dedupe=dedupe)


def _chain_kernel(
    start_ref,  # i32[R]
    count_ref,  # i32[R]
    seed_hash_ref,  # u32[R, 2]
    seed_position_ref,  # u32[R, 2]
    check_ref,  # i32[R]
    token_ref,  # i32[T]
    position_ref,  # i32[T]
    loc_ref,  # i32[T]
    _prev_hash_zeros,  # u32[T, 2], aliased to prev_hash_ref
    _expected_zeros,  # u32[T, 2], aliased to expected_ref
    _flags_zeros,  # i32[T], aliased to flags_ref
    prev_hash_ref,  # u32[T, 2]
    expected_ref,  # u32[T, 2]
    flags_ref,  # i32[T]
):
    """Walks request ``program_id``'s entries in order; entries of no request keep the aliased zeros."""
    r = pl.program_id(0)
    start, check = start_ref[r], check_ref[r] != 0

    def step(j, carry):
        h, position_prev = (carry[0], carry[1]), (carry[2], carry[3])
        i = start + j
        slot, token, position = loc_ref[i], token_ref[i], position_ref[i]
        live = slot >= 0
        expected, failed = reference.position_assert(position_prev, position, live, check)
        prev_hash_ref[i, 0], prev_hash_ref[i, 1] = h
        expected_ref[i, 0], expected_ref[i, 1] = expected
        flags_ref[i] = jnp.where(live, jnp.int32(_WRITTEN), 0) | jnp.where(failed, jnp.int32(_POSITION_FAILED), 0)
        h, position_prev = reference.advance(h, position_prev, token, position, live)
        return (*h, *position_prev)

    seed = (seed_hash_ref[r, 0], seed_hash_ref[r, 1], seed_position_ref[r, 0], seed_position_ref[r, 1])
    lax.fori_loop(0, count_ref[r], step, seed)


def _overwritten_later(loc_ref, flags_ref, entry, slot, *, block: int, compare_block: int) -> jax.Array:
    """bool[block]: some later written entry stores the same slot (its record wins, as in ``store.last_writer``)."""
    num_tokens = loc_ref.shape[0]
    first = pl.program_id(0) * block

    def scan(c, hit):
        other = first + c * compare_block + jnp.arange(compare_block, dtype=jnp.int32)
        valid = other < num_tokens
        other_slot = plt.load(loc_ref.at[other], mask=valid, other=-1)
        other_written = (plt.load(flags_ref.at[other], mask=valid, other=0) & _WRITTEN) != 0
        same = (slot[:, None] == other_slot[None, :]) & other_written[None, :] & (other[None, :] > entry[:, None])
        # max over an int32 cast, not jnp.any: Triton has no reduce_or (pallas_notes §9, pitfall 4).
        return jnp.maximum(hit, jnp.max(same.astype(jnp.int32), axis=1))

    steps = (num_tokens - first + compare_block - 1) // compare_block  # not pl.cdiv: it breaks under x64
    hits = lax.fori_loop(0, steps, scan, jnp.zeros(entry.shape, jnp.int32))
    return hits != 0


def _store_kernel(
    token_ref,  # i32[T]
    position_ref,  # i32[T]
    loc_ref,  # i32[T]
    prev_hash_ref,  # u32[T, 2]
    flags_ref,  # i32[T]
    *refs,  # winner i32[T] (dedupe="sort" only), KV sources dtype[pages, row_elements]..., buf in, buf out
    block: int,
    compare_block: int,
    dedupe: str,
    specs: tuple[realkv.RealKvSource, ...],
    mode: int,
):
    """Folds and stores the records of one block of entries into the aliased ``u32[num_slots, 8]`` buffer."""
    winner_ref, refs = (refs[0], refs[1:]) if dedupe == "sort" else (None, refs)
    *kv_refs, _, buf_ref = refs
    num_tokens, num_slots = loc_ref.shape[0], buf_ref.shape[0]
    entry = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    in_range = entry < num_tokens  # ragged last block: no automatic bounds masks before jax 0.12
    load = lambda ref: plt.load(ref.at[entry], mask=in_range, other=0)  # noqa: E731
    slot = load(loc_ref)
    written = (load(flags_ref) & _WRITTEN) != 0
    if winner_ref is None:
        winner = ~_overwritten_later(loc_ref, flags_ref, entry, slot, block=block, compare_block=compare_block)
    else:
        winner = load(winner_ref) != 0
    ok = written & winner & (slot < num_slots)
    prev_hash = tuple(
        plt.load(prev_hash_ref.at[entry, jnp.full((block,), w, jnp.int32)], mask=in_range, other=0) for w in (0, 1)
    )
    record = (
        hash64.from_i32(load(token_ref)),
        hash64.from_i32(load(position_ref)),
        prev_hash,
        kernel_io.fold(kv_refs, specs, records.clamp_slots(slot, num_slots), mode),
    )
    kernel_io.store_record(buf_ref, jnp.where(ok, slot, num_slots), ok, record)


def _forward(canary_buf, walk, sources, *, mode, interpret, config):
    """The chain kernel (one program per request), then the store kernel."""
    start, count, seed_hash, seed_position, check, input_ids, positions, out_cache_loc = walk
    num_tokens, num_reqs = out_cache_loc.shape[0], start.shape[0]
    empty = reference.empty_chain(num_tokens)
    prev_hash, expected, flags = compat.triton_call(
        _chain_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, 2), jnp.uint32),
            jax.ShapeDtypeStruct((num_tokens, 2), jnp.uint32),
            jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
        ),
        grid=(num_reqs,),
        name="kvcanary_write_chain",
        num_warps=_CHAIN_WARPS,
        num_stages=1,
        interpret=interpret,
        # Entries of no request are never visited, and unwritten outputs are garbage (pallas_notes §9, pitfall
        # 8), so the outputs start as aliased zeros.
        input_output_aliases={8: 0, 9: 1, 10: 2},
    )(
        start,
        count,
        hash64.join(seed_hash),
        hash64.join(seed_position),
        check.astype(jnp.int32),
        input_ids,
        positions,
        out_cache_loc,
        empty.prev_hash,
        empty.expected_position,
        jnp.zeros((num_tokens,), jnp.int32),
    )
    written = (flags & _WRITTEN) != 0
    winner = ()
    if config.dedupe == "sort":
        winner = (store.last_writer(out_cache_loc, written, canary_buf.shape[0]).astype(jnp.int32),)
    block = config.block
    kernel = functools.partial(
        _store_kernel,
        block=block,
        compare_block=config.compare_block,
        dedupe=config.dedupe,
        specs=kernel_io.source_specs(sources),
        mode=mode,
    )
    inputs = (
        input_ids,
        positions,
        out_cache_loc,
        prev_hash,
        flags,
        *winner,
        *(kernel_io.kv_rows(s.data, interpret=interpret) for s in sources),
    )
    rows = kernel_io.record_rows(canary_buf)
    new_rows = compat.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        grid=(pl.cdiv(num_tokens, block),),
        name=f"kvcanary_write_store_{block=}_{config.dedupe}",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        input_output_aliases={len(inputs): 0},  # the canary buffer, updated in place
    )(*inputs, rows)
    return new_rows.reshape(canary_buf.shape), prev_hash, expected, flags


write = base.entry_point(_forward, heuristic)
