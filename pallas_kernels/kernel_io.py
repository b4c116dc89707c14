"""Ref-side loads and stores shared by the Pallas kernels: canary records, and KV bytes read as u32 words.

Every helper takes whole-array refs (see ``compat.triton_call``) and vectors of indices, so a load is a Triton
pointer gather and the same code runs in interpret mode.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from pallas_kernels import hash64, layout, realkv, records

WORDS_PER_RECORD = 2 * layout.CANARY_FIELDS_PER_SLOT
_WORDS_PER_CHUNK = layout.REAL_KV_CHUNK_BYTES // 4
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def record_rows(canary_buf: jax.Array) -> jax.Array:
    """``u32[num_slots, 4, 2]`` as ``u32[num_slots, 8]``: a free reshape, one row of words per record."""
    return canary_buf.reshape(canary_buf.shape[0], WORDS_PER_RECORD)


def kv_rows(data: jax.Array, *, interpret: bool) -> jax.Array:
    """A source as ``dtype[pages, row_elements]`` for a kernel: a free reshape, in its own dtype on GPU.

    ``realkv.as_words`` cannot feed a kernel: XLA expands a bitcast between element types of different widths
    into a shift-and-or fusion, i.e. a copy of the whole KV pool per launch. The kernels assemble the u32 words
    from native-dtype loads instead (:func:`_chunk_words`). In interpret mode the kernel body runs on XLA:CPU,
    which computes bf16 element ops in f32 and so quiets signalling-NaN payloads; there the source is passed as
    same-width unsigned ints (a copy, but only of a small test pool).
    """
    rows = data.reshape(data.shape[0], math.prod(data.shape[1:]))
    if interpret and jnp.issubdtype(rows.dtype, jnp.floating):
        rows = lax.bitcast_convert_type(rows, _UINT[jnp.dtype(rows.dtype).itemsize])
    return rows


def load_record(buf_ref, slots: jax.Array) -> records.Record:
    """Gathers the records of in-range ``slots`` (i32[block]) from ``u32[num_slots, 8]``."""
    return tuple((buf_ref[slots, 2 * f], buf_ref[slots, 2 * f + 1]) for f in range(layout.CANARY_FIELDS_PER_SLOT))


def store_record(buf_ref, slots: jax.Array, mask: jax.Array, record: records.Record) -> None:
    """Stores records at ``slots`` where ``mask``; masked lanes must point out of range.

    All-array indices and an out-of-range row for masked lanes: a masked store mixing an array index with a slice
    fails in interpret mode, whose discharge also writes masked lanes' old values back (pallas_notes §2a).
    """
    for f, (lo, hi) in enumerate(record):
        for w, value in enumerate((lo, hi)):
            plt.store(buf_ref.at[slots, jnp.full(slots.shape, 2 * f + w, jnp.int32)], value, mask=mask)


def _chunk_words(ref, row: jax.Array, first_word: jax.Array) -> tuple[jax.Array, ...]:
    """The 4 little-endian u32 words of the 16-byte chunk starting at word ``first_word`` (16-byte aligned) of page
    row ``row``, exactly as ``realkv.as_words`` views them.

    One ``[n, 16 / itemsize]`` tile load per chunk: each lane's chunk is contiguous and 16-byte aligned, so Triton
    reads it with one vector load per lane instead of a scalar gather per element (16 bytes of a lane's own cache
    line per instruction, not 2: the real-KV ALL fold was bound by those per-element wavefronts). The elements are
    read in the ref's own dtype and put together in registers: Triton only bitcasts between equal widths, so narrow
    elements are widened, shifted into place and summed per word (their bytes do not overlap); Triton cannot index a
    register tile at a column, so a column is a select and an in-lane sum (compiled away: each lane owns its row).
    """
    itemsize = jnp.dtype(ref.dtype).itemsize
    lane = jnp.arange(layout.REAL_KV_CHUNK_BYTES // itemsize, dtype=jnp.int32)
    start = first_word // 2 if itemsize == 8 else first_word * (4 // itemsize)
    tile = ref[row[..., None] + jnp.zeros_like(lane), start[..., None] + lane]
    tile = lax.bitcast_convert_type(tile, _UINT[itemsize])
    if itemsize == 8:  # two words per element, low word first
        words = []
        for e in range(2):
            element = jnp.sum(jnp.where(lane == e, tile, jnp.uint64(0)), axis=-1, dtype=jnp.uint64)
            words += [element.astype(jnp.uint32), (element >> jnp.uint64(32)).astype(jnp.uint32)]
        return tuple(words)
    per_word = 4 // itemsize
    shifted = tile.astype(jnp.uint32) << ((lane % per_word) * (8 * itemsize)).astype(jnp.uint32)
    return tuple(
        jnp.sum(jnp.where(lane // per_word == k, shifted, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)
        for k in range(_WORDS_PER_CHUNK)
    )


def fold(kv_refs, specs, slots: jax.Array, mode: int) -> hash64.U64:
    """REAL_KV_HASH of in-range ``slots`` read straight from the KV refs, via the shared fold arithmetic."""
    return fold_halves((kv_refs,), (specs,), (slots,), mode)[0]


def fold_halves(kv_refs, specs, slots, mode: int) -> tuple[hash64.U64, ...]:
    """:func:`fold` of every half ``h`` (``kv_refs[h]``, ``specs[h]``, ``slots[h]``), the halves in one chunk loop.

    A slot's fold is a serial chain of splitmix rounds (``realkv.fold_loaded``'s arithmetic, in its order), so a lane
    mostly waits on each round's latency and on its chunk's load. K's and V's chains are independent: one loop that
    advances every half's chain, and loads each chunk one step ahead of its rounds, keeps twice the work in flight.
    Halves whose sources fold different chunk counts are folded one after the other. Same bytes as
    ``realkv.fold_slots``.
    """
    counts = [tuple(realkv.num_chunks(s, mode) for s in half) for half in specs]
    if mode == layout.REAL_KV_NONE or len(set(counts)) == 1:
        return _fold_together(kv_refs, specs, slots, mode, range(len(specs)))
    return tuple(_fold_together(kv_refs, specs, slots, mode, (h,))[0] for h in range(len(specs)))


def _fold_together(kv_refs, specs, slots, mode: int, halves) -> tuple[hash64.U64, ...]:
    """The folds of ``halves`` (whose sources fold the same chunk counts), their chunk loops run as one."""
    outer = [hash64.const(0, slots[h]) for h in halves]
    if mode == layout.REAL_KV_NONE:
        return tuple(outer)
    offsets = {h: [realkv.slot_word_offset(src, slots[h]) for src in specs[h]] for h in halves}

    def load(h, i, chunk):
        row, word = offsets[h][i]
        return _chunk_words(kv_refs[h][i], row, word + realkv.chunk_word(specs[h][i], chunk))

    for i in range(len(specs[halves[0]])):
        n = realkv.num_chunks(specs[halves[0]][i], mode)
        zero = [hash64.const(0, slots[h]) for h in halves]
        if n == 1:  # PARTIAL, or a 16-byte read: no loop
            ones = [realkv.fold_chunk(z, load(h, i, jnp.int32(0))) for z, h in zip(zero, halves, strict=True)]
        else:

            def step(c, carry, i=i, n=n):
                accs, words = carry
                ahead = tuple(load(h, i, jnp.minimum(c + 1, n - 1)) for h in halves)  # the next chunk, in flight
                return tuple(realkv.fold_chunk(a, w) for a, w in zip(accs, words, strict=True)), ahead

            first = tuple(load(h, i, jnp.int32(0)) for h in halves)
            ones, _ = lax.fori_loop(jnp.int32(0), jnp.int32(n), step, (tuple(zero), first))
        outer = [realkv.fold_source_into(o, one) for o, one in zip(outer, ones, strict=True)]
    return tuple(outer)


def source_specs(sources) -> tuple[realkv.RealKvSource, ...]:
    """The sources' static layout with shape-only data, safe to bind into a kernel body."""
    return tuple(
        realkv.RealKvSource(
            jax.ShapeDtypeStruct(s.data.shape, s.data.dtype),
            s.page_size,
            s.num_bytes_per_token,
            s.read_bytes,
            s.byte_offset,
            s.segment_bytes,
            s.segment_stride,
        )
        for s in sources
    )
