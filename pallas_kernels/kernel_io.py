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
    from native-dtype loads instead (:func:`chunk_loader`). In interpret mode the kernel body runs on XLA:CPU,
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


def _word(ref, row: jax.Array, first_word: jax.Array, k: int) -> jax.Array:
    """Little-endian u32 word ``first_word + k`` of page row ``row``; ``first_word`` is 16-byte aligned.

    Bytes are read in the ref's own dtype and reassembled exactly as ``realkv.as_words`` views them. Triton
    only bitcasts between equal widths, so narrow elements are widened and shifted into place.
    """
    itemsize = jnp.dtype(ref.dtype).itemsize
    as_uint = lambda x: lax.bitcast_convert_type(x, _UINT[itemsize])  # noqa: E731
    if itemsize == 8:  # two words per element; first_word is even, so k alone picks the half
        element = as_uint(ref[row, first_word // 2 + k // 2])
        return (element >> jnp.uint64(32) if k % 2 else element).astype(jnp.uint32)
    per_word = 4 // itemsize
    parts = [as_uint(ref[row, (first_word + k) * per_word + j]).astype(jnp.uint32) for j in range(per_word)]
    word = parts[0]
    for j, part in enumerate(parts[1:], start=1):
        word = word | (part << jnp.uint32(8 * itemsize * j))
    return word


def chunk_loader(kv_refs):
    """The ``load_chunk`` callback of :func:`realkv.fold_slots` for kernel refs of :func:`kv_rows` views."""

    def load_chunk(i: int, row: jax.Array, first: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(_word(kv_refs[i], row, first, k) for k in range(_WORDS_PER_CHUNK))

    return load_chunk


def fold(kv_refs, specs, slots: jax.Array, mode: int) -> hash64.U64:
    """REAL_KV_HASH of in-range ``slots`` read straight from the KV refs, via the shared fold arithmetic."""
    return realkv.fold_slots(specs, slots, mode, load_chunk=chunk_loader(kv_refs))


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
