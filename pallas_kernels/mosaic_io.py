"""Mosaic (TPU) side of the kernels' I/O: DMA gathers of records and KV windows, and their u32 columns.

A TPU kernel reaches HBM only by DMA, and its vector unit works on (8, 128) tiles of 32-bit words. The Mosaic
kernels therefore lay a block of ``rows * 128`` entries out as ``[rows, 128]`` (entry ``e`` at ``(e >> 7, e & 127)``):

  * each entry's record, and each entry's window of KV bytes, is DMA'd from HBM into the entry's own row of a VMEM
    scratch, with slot ids read as scalars from SMEM (scalar prefetch); records and KV windows of consecutive slots
    in consecutive entries (a request's tokens in a page) move as one DMA per power of two of their run
    (:func:`fetch_runs`);
  * a transpose of the last two axes then turns those rows into "columns": one ``u32[rows, 128]`` vector per
    word, the shape the shared u32-pair hash code (:mod:`pallas_kernels.hash64`) works on.

Every DMA indexes only the leading (untiled) dims of its HBM ref, except the KV window inside a token's row; see
:func:`kv_copies`. Nothing here is 64-bit: 8-byte KV elements are viewed as u32 pairs before the kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import layout, realkv, records

LANES = 128
_LANE_BITS = 7  # log2(LANES): entry e sits at (e >> 7, e & 127); shifts, because a signed // or % on a TPU
# vector asks the lowering for the chip generation, which a CPU host exporting for TPU does not have.
_WORDS_PER_CHUNK = layout.REAL_KV_CHUNK_BYTES // 4
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass(frozen=True)
class KvWindow:
    """Where a slot's folded bytes sit in its row of a source's kernel view (:func:`kv_view`), in view elements.

    Attributes:
      elements: elements DMA'd per slot: 16 bytes in PARTIAL mode, ``read_bytes`` in ALL mode.
      itemsize: bytes per view element (1, 2 or 4).
      offset: elements from the token's start to its first folded byte (``byte_offset / itemsize``).
      segment: elements per DMA; ``elements / segment`` DMAs per run of slots.
      stride: elements between the starts of consecutive segments in the token.
    """

    elements: int
    itemsize: int
    offset: int = 0
    segment: int | None = None
    stride: int | None = None


def kv_window(source: realkv.RealKvSource, mode: int) -> KvWindow:
    itemsize = _view_itemsize(source.data.dtype)
    nbytes = layout.REAL_KV_CHUNK_BYTES * realkv.num_chunks(source, mode)
    segment = min(nbytes, source.segment_bytes)  # PARTIAL: the first 16 bytes, inside the first segment
    return KvWindow(
        nbytes // itemsize,
        itemsize,
        offset=source.byte_offset // itemsize,
        segment=segment // itemsize,
        stride=source.segment_stride // itemsize,
    )


def _view_itemsize(dtype) -> int:
    return min(4, jnp.dtype(dtype).itemsize)  # 8-byte elements are viewed as u32 pairs


def kv_view(source: realkv.RealKvSource) -> jax.Array:
    """A source as unsigned ints ``u{8,16,32}[token_slots, token_elements]``: row ``s`` is slot ``s``'s token, so
    the KV windows of consecutive slots are one rectangle, even across pages, and one DMA moves a run of them.

    Slot ``s`` is token ``s % page_size`` of page ``s // page_size``, i.e. row ``s`` of the pages' tokens laid end
    to end. Same-width bitcasts are free; reading the bits as unsigned ints also keeps float payloads (signalling
    NaNs) untouched by interpret mode. 8-byte elements become little-endian u32 pairs, a copy, because Mosaic has no
    64-bit types; so does a page row longer than its tokens (its tail is cut off). A source of exactly
    ``[pages, page_size * token_elements]`` is a free view; XLA may relayout (copy) one of more dims on TPU.
    """
    data = source.data
    rows = data.reshape(data.shape[0], math.prod(data.shape[1:]))
    itemsize = jnp.dtype(rows.dtype).itemsize
    if itemsize == 8:
        rows = lax.bitcast_convert_type(rows, jnp.uint32).reshape(rows.shape[0], 2 * rows.shape[1])
    else:
        rows = lax.bitcast_convert_type(rows, _UINT[itemsize])
    token_elements = source.num_bytes_per_token // _view_itemsize(data.dtype)
    tokens = rows[:, : source.page_size * token_elements] if rows.shape[1] > source.page_size * token_elements else rows
    return tokens.reshape(source.num_token_slots, token_elements)


def lane_dense(x: jax.Array, num_rows: int) -> jax.Array:
    """``x[n]`` zero-padded to ``[num_rows, 128]``, so a ``(rows, 128)`` block holds ``rows * 128`` entries."""
    return jnp.pad(x, (0, num_rows * LANES - x.shape[0])).reshape(num_rows, LANES)


def stacked_block(depth: int, rows: int) -> pl.BlockSpec:
    """The ``(depth, rows, 128)`` block of grid step ``b`` of an ``[depth, grid * rows, 128]`` stack of
    :func:`lane_dense` operands: interpret mode copies each blocked operand in (or out) per grid step, so one stack
    costs one copy where ``depth`` operands cost ``depth``."""
    return pl.BlockSpec((depth, rows, LANES), lambda b, *_: (0, b, 0))


def entry_index(rows: int) -> jax.Array:
    """i32[rows, 128]: each position's entry number within its block."""
    row = lax.broadcasted_iota(jnp.int32, (rows, LANES), 0)
    return (row << _LANE_BITS) | lax.broadcasted_iota(jnp.int32, (rows, LANES), 1)


def semaphore(sems, i: int):
    """DMA semaphore ``i`` of an array of them; an int32 index, since a Python int is int64 under x64."""
    return sems.at[jnp.int32(i)]


def _at(ref, e: jax.Array):
    """The one-entry window ``[1, ...]`` of entry ``e`` in a ``[rows, 128, ...]`` VMEM scratch."""
    return ref.at[e >> _LANE_BITS, pl.ds(e & (LANES - 1), 1)]  # e >= 0: arithmetic shift is exact


def record_copy(
    buf_hbm,
    slot: jax.Array,
    rec_ref,
    e: jax.Array,
    sem,
    *,
    to_hbm: bool = False,
    part: int | None = None,
    count: int = 1,
):
    """DMA of records ``slot .. slot + count - 1`` of ``u32[num_slots, 4, 2]`` to (or from) entries
    ``e .. e + count - 1`` of ``u32[rows, 128, 4, 2]`` (or their ``part`` of ``u32[rows, 128, parts, 4, 2]``), which
    must share a 128-lane row.

    The HBM side is whole records on the leading dim: the canary buffer keeps its own shape, since reshaping it
    to rows of 8 words would make XLA relayout (copy) the whole buffer on TPU.
    """
    lanes = pl.ds(e & (LANES - 1), count)  # e >= 0: arithmetic shift is exact
    # An int32 part: a Python int is int64 under x64, which Mosaic rejects as an index.
    vmem = rec_ref.at[e >> _LANE_BITS, lanes] if part is None else rec_ref.at[e >> _LANE_BITS, lanes, jnp.int32(part)]
    hbm = buf_hbm.at[pl.ds(slot, count)]
    return pltpu.make_async_copy(vmem, hbm, sem) if to_hbm else pltpu.make_async_copy(hbm, vmem, sem)


def row_wait(ref, e: jax.Array, sem):
    """A wait for every DMA into entry ``e``'s row of a VMEM scratch, on one semaphore: a descriptor of their
    destinations' union with ``src = dst``. A DMA wait uses only its semaphore and its destination's size (ragged
    paged attention waits for a block of page copies the same way), so one wait replaces one per copy."""
    row = _at(ref, e)
    return pltpu.make_async_copy(row, row, sem)


def wait_entries(ref, n: jax.Array, sem, parts: tuple[int, int] | None = None) -> None:
    """Waits for DMAs into ``n`` entries' rows of a ``[rows, 128, ...]`` VMEM scratch (or into their ``parts =
    (first, count)`` of a ``[rows, 128, parts, ...]`` scratch), on one semaphore, whichever entries they filled.

    A DMA wait uses only its semaphore and its destination's size (ragged paged attention waits for a block of
    page copies the same way), so ``n`` entries are waited for as one wait per set bit of ``n``: a descriptor of
    the first ``2**k`` entries with ``src = dst``, instead of one wait per entry.
    """
    k = 0
    while (1 << k) <= ref.shape[0] * LANES:
        size = 1 << k

        @pl.when((n & size) != 0)
        def _(size=size):
            region = (pl.ds(0, max(1, size // LANES)), pl.ds(0, min(size, LANES)))
            region = region if parts is None else (*region, pl.ds(*parts))
            pltpu.make_async_copy(ref.at[region], ref.at[region], sem).wait()

        k += 1


def runs(slots: jax.Array, prevs: jax.Array, num_slots: int) -> jax.Array:
    """Per plan entry: ``2 * run + fetch``, for :func:`fetch_runs`.

    ``run``: the entries from this one on whose records (``records.clamp_slots`` of ``slots``) are consecutive
    slots, to the end of the entry's 128-lane row, with none that fetches its predecessor past the first.
    ``fetch``: 1 where the entry's predecessor record is fetched, 0 where it is the previous lane's stored record
    (a request's chain: not lane 0, and ``prevs`` names the previous entry's slot).
    """
    e = jnp.arange(slots.shape[0], dtype=jnp.int32)
    clamped = records.clamp_slots(slots, num_slots)
    fetch = ((e & (LANES - 1)) == 0) | (prevs != jnp.roll(slots, 1))
    start = fetch | (clamped != jnp.roll(clamped, 1) + 1)
    after = jnp.concatenate([jnp.where(start, e, slots.shape[0])[1:], jnp.full((1,), slots.shape[0], jnp.int32)])
    return 2 * (lax.cummin(after, reverse=True) - e) + fetch.astype(jnp.int32)


def fetch_runs(
    count: jax.Array,
    read: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
    starts: Callable[[jax.Array, jax.Array, int], None],
    fetch: Callable[[jax.Array], None],
) -> jax.Array:
    """Starts the DMAs of entries ``0 .. count - 1`` in pieces, and returns how many predecessors it fetched.

    From each piece's first entry ``e``, ``read(e)`` gives its run (:func:`runs`) and its slot; the piece is the
    run's largest power of two within ``count`` (``size``, static in ``starts(e, slot, size)``), and ``fetch(e)``
    runs where the run's first entry fetches its predecessor. A run of ``n`` consecutive slots is one DMA per set
    bit of ``n`` and buffer, and two SMEM reads per piece, instead of a DMA and a slot id per entry.
    """

    def piece(carry):
        e, fetched = carry
        meta, slot = read(e)
        run, fetching = jnp.minimum(meta >> 1, count - e), (meta & 1) != 0
        size = jnp.int32(0)
        for k in range(_LANE_BITS + 1):
            fits = (run >> k) == 1  # 2**k <= run < 2**(k + 1)

            @pl.when(fits)
            def _(k=k):
                starts(e, slot, 1 << k)

            size = jnp.where(fits, jnp.int32(1 << k), size)
        pl.when(fetching)(lambda: fetch(e))
        return e + size, fetched + fetching.astype(jnp.int32)

    return lax.while_loop(lambda c: c[0] < count, piece, (jnp.int32(0), jnp.int32(0)))[1]


def kv_copies(kv_hbm, window: KvWindow, slot: jax.Array, kv_ref, e: jax.Array, sem, count: int = 1) -> list:
    """DMAs of the folded bytes of slots ``slot .. slot + count - 1`` from their rows of ``kv_hbm`` (:func:`kv_view`)
    into entries ``e .. e + count - 1`` of ``kv_ref`` (``[rows, 128, elements]``), which must share a 128-lane row.

    One DMA per segment of the source (one for a contiguous source), packed end to end in each entry's window, so
    the window holds exactly the folded bytes in fold order. The slots must be in range (clamped). A segment starts
    ``offset + k * stride`` into the token's row: 16-byte aligned, but not tile aligned.
    """
    segment = window.segment or window.elements
    stride = window.stride or segment
    dst = kv_ref.at[e >> _LANE_BITS, pl.ds(e & (LANES - 1), count)]  # e >= 0: arithmetic shift is exact
    copies = []
    for k in range(window.elements // segment):
        src = kv_hbm.at[pl.ds(slot, count), pl.ds(window.offset + k * stride, segment)]
        part = dst if segment == window.elements else dst.at[:, pl.ds(k * segment, segment)]
        copies.append(pltpu.make_async_copy(src, part, sem))
    return copies


def gather(
    count: jax.Array,
    slot_at: Callable[[jax.Array], jax.Array],
    starts: Callable[[jax.Array, jax.Array], Sequence],
    waits: Callable[[jax.Array], Sequence],
) -> None:
    """Starts the DMAs ``starts(e, slot)`` of entries ``e < count`` whose ``slot = slot_at(e)`` is not negative
    (one SMEM read per entry), then waits ``waits(i)`` once per started entry.

    ``waits(i)`` must consume what one entry's starts signal, semaphore by semaphore (the same descriptors, or
    :func:`row_wait` unions); a wait needs no source address, so the wait loop reads no slot ids from SMEM and
    waits for entries ``0 .. started - 1``, whose destinations have the same sizes as the started ones.
    """

    def start(e, started):
        slot = slot_at(e)
        ok = slot >= 0

        @pl.when(ok)
        def _():
            for copy in starts(e, slot):
                copy.start()

        return started + ok.astype(jnp.int32)

    def wait(i, carry):
        for copy in waits(i):
            copy.wait()
        return carry

    lax.fori_loop(0, lax.fori_loop(0, count, start, jnp.int32(0)), wait, 0)


def record_columns(rec_ref, part: int) -> records.Record:
    """The four u64 fields of records ``part`` of ``u32[rows, 128, parts, 4, 2]`` as ``u32[rows, 128]`` (lo, hi)
    columns."""
    rec, fields = rec_ref[:, :, part], []  # u32[rows, 128, 4, 2]: one load
    for f in range(layout.CANARY_FIELDS_PER_SLOT):
        pairs = jnp.swapaxes(rec[:, :, f, :], 1, 2)  # u32[rows, 2, 128]: transpose of the last two axes
        fields.append((pairs[:, 0, :], pairs[:, 1, :]))
    return tuple(fields)


def store_record_columns(rec_ref, part: int, record: records.Record) -> None:
    """The inverse of :func:`record_columns`: writes ``u32[rows, 128]`` field columns as records ``part``."""
    pairs = [jnp.swapaxes(jnp.stack([lo, hi], axis=1), 1, 2) for lo, hi in record]  # u32[rows, 128, 2] per field
    rec_ref[:, :, part] = jnp.stack(pairs, axis=2)  # one store


def transpose_kv(kv_ref, kv_t_ref) -> None:
    """``u{8,16,32}[rows, 128, elements]`` windows to ``u32[rows, elements, 128]``: element j of every entry per row."""
    for r in range(kv_ref.shape[0]):
        kv_t_ref[r] = kv_ref[r].astype(jnp.uint32).T  # zero-extended: the view is unsigned


def chunk_loader(kv_t_refs, windows: Sequence[KvWindow]):
    """The ``load_chunk(source, chunk)`` of :func:`realkv.fold_loaded` over :func:`transpose_kv` scratches.

    Word ``k`` of a chunk is ``4 / itemsize`` consecutive little-endian elements, which the transpose put on
    consecutive sublanes; the chunk's ``16 / itemsize`` sublanes are read as one block, at a dynamic sublane offset
    (``chunk`` is a traced loop index).
    """

    def load_chunk(i: int, chunk: jax.Array) -> tuple[jax.Array, ...]:
        ref, window = kv_t_refs[i], windows[i]
        per_word = 4 // window.itemsize
        block = ref[:, pl.ds(chunk * (_WORDS_PER_CHUNK * per_word), _WORDS_PER_CHUNK * per_word), :]
        words = []
        for k in range(_WORDS_PER_CHUNK):
            word = None
            for j in range(per_word):
                part = block[:, k * per_word + j, :]
                part = part << jnp.uint32(8 * window.itemsize * j) if j else part
                word = part if word is None else word | part
            words.append(word)
        return tuple(words)

    return load_chunk


def kv_scratch(rows: int, views: Sequence[jax.Array], windows: Sequence[KvWindow]) -> list:
    """VMEM scratch of the KV gather: one window buffer per source, then one transposed u32 buffer per source."""
    gathered = [pltpu.VMEM((rows, LANES, w.elements), v.dtype) for v, w in zip(views, windows, strict=True)]
    return gathered + [pltpu.VMEM((rows, w.elements, LANES), jnp.uint32) for w in windows]


# A ref the kernel reaches by DMA only: left in HBM, never blocked into VMEM.
HBM = pl.BlockSpec(memory_space=pl.ANY)


def gather_grid_spec(
    *,
    rows: int,
    num_blocks: int,
    depth: int,
    num_buffers: int,
    record_parts: int,
    out_specs,
    views: Sequence[Sequence[jax.Array]],
    specs: Sequence[Sequence[realkv.RealKvSource]],
    mode: int,
) -> pltpu.PrefetchScalarGridSpec:
    """The grid spec of a kernel that DMA-gathers records and KV windows for blocks of ``rows * 128`` entries.

    Args:
      rows: sublane rows per grid step.
      num_blocks: grid steps.
      depth: operands of the ``[depth, num_blocks * rows, 128]`` stack (:func:`stacked_block`), the first input
        after the scalar-prefetched slot ids (SMEM).
      num_buffers: canary buffers left in HBM (:data:`HBM`), in or out; with every KV view, the inputs after the
        stack.
      record_parts: records per entry in the record scratch ``u32[rows, 128, record_parts, 4, 2]``.
      out_specs: the kernel's out specs.
      views, specs: each buffer's KV views (:func:`kv_view`) and their source specs; ``mode`` the real-KV mode.

    Returns:
      The spec: scratch is the records, then :func:`kv_scratch`, then DMA semaphores (records, one per source).
    """
    flat_views = [v for half in views for v in half]
    windows = [kv_window(s, mode) for half in specs for s in half]
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_blocks,),
        in_specs=[stacked_block(depth, rows)] + [HBM] * (num_buffers + len(flat_views)),
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((rows, LANES, record_parts, 4, 2), jnp.uint32),
            *kv_scratch(rows, flat_views, windows),
            pltpu.SemaphoreType.DMA((1 + len(flat_views),)),
        ],
    )
