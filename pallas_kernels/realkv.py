"""Real-KV sources and the byte fold that fingerprints a slot's KV bytes (SGLang's ``fold_sources``).

The fold arithmetic (:func:`fold_chunk`, :func:`fold_source_into`) is shared by every backend; only the way the
16-byte chunks are loaded differs (a jnp gather here, ref loads inside a Pallas kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import hash64, layout, mesh, validate

_WORDS_PER_CHUNK = layout.REAL_KV_CHUNK_BYTES // 4
_CHUNK = layout.REAL_KV_CHUNK_BYTES


@dataclasses.dataclass(frozen=True)
class RealKvSource:
    """One KV tensor whose bytes are folded into a slot's REAL_KV_HASH.

    Attributes:
      data: any dtype, leading axis = pages; e.g. ``bf16[num_pages, page_size, kv_heads, head_dim]``.
      page_size: token slots per page (>= 1). Slot ``s`` lives in page ``s // page_size``.
      num_bytes_per_token: bytes of one token inside a page row, a positive multiple of 16.
      read_bytes: bytes folded in ALL mode, a multiple of 16 in ``[16, num_bytes_per_token]``; PARTIAL mode
        always folds the first 16. ``None`` means every byte from ``byte_offset`` on (whole segments that fit).
      byte_offset: where the folded bytes start in the token's bytes, a multiple of 16 (default 0).
      segment_bytes, segment_stride: ``read_bytes`` are read as runs of ``segment_bytes``, run ``k`` starting at
        ``byte_offset + k * segment_stride`` (multiples of 16; default: one contiguous run).

    Offset and segments name a strided part of each token without copying it. sglang-jax fuses K and V per layer as
    ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]``, K and V alternating per head; with
    ``h = head_dim * itemsize`` its K heads are ``byte_offset=0, segment_bytes=h, segment_stride=2 * h`` and its V
    heads the same with ``byte_offset=h``.
    """

    data: jax.Array
    page_size: int = 1
    num_bytes_per_token: int | None = None
    read_bytes: int | None = None
    byte_offset: int = 0
    segment_bytes: int | None = None
    segment_stride: int | None = None

    def __post_init__(self):
        if isinstance(self.data, np.ndarray):
            object.__setattr__(self, "data", jnp.asarray(self.data))
        row_bytes = _row_bytes(self.data)
        for name in _META_FIELDS:
            value = getattr(self, name)
            if (value is not None or name == "page_size") and not validate.is_int(value):
                raise TypeError(f"RealKvSource.{name} must be an int; got {name}={value!r}")
            object.__setattr__(self, name, None if value is None else int(value))
        if self.page_size < 1:
            raise ValueError(f"RealKvSource.page_size must be an int >= 1; got page_size={self.page_size!r}")
        if self.num_bytes_per_token is None:
            object.__setattr__(self, "num_bytes_per_token", row_bytes // self.page_size)
        self._default_segments()
        bpt, rb = self.num_bytes_per_token, self.read_bytes
        if not isinstance(bpt, int) or bpt <= 0 or bpt % 16:
            raise ValueError(f"RealKvSource.num_bytes_per_token must be a positive multiple of 16; got {bpt!r}")
        if self.page_size * bpt > row_bytes:
            raise ValueError(
                f"RealKvSource: page_size * num_bytes_per_token = {self.page_size * bpt} exceeds the page row of "
                f"{row_bytes} bytes (data shape {tuple(self.data.shape)}, dtype {self.data.dtype})"
            )
        if not isinstance(rb, int) or rb <= 0 or rb % 16 or rb > bpt:
            raise ValueError(
                f"read_bytes must be a positive multiple of 16 and <= num_bytes_per_token; got read_bytes={rb!r}, "
                f"num_bytes_per_token={bpt}"
            )
        self._check_segments()

    def _default_segments(self) -> None:
        off, bpt = self.byte_offset, self.num_bytes_per_token
        if off < 0 or off % 16:
            raise ValueError(f"RealKvSource.byte_offset must be a non-negative multiple of 16; got byte_offset={off}")
        if self.read_bytes is None:
            if self.segment_bytes is None:
                object.__setattr__(self, "read_bytes", bpt - off)
            else:  # every whole segment that fits in the token
                stride = self.segment_stride or self.segment_bytes
                runs = (bpt - off - self.segment_bytes) // stride + 1 if stride > 0 else 0
                object.__setattr__(self, "read_bytes", max(runs, 0) * self.segment_bytes)
        if self.segment_bytes is None:
            object.__setattr__(self, "segment_bytes", self.read_bytes)
        if self.segment_stride is None:
            object.__setattr__(self, "segment_stride", self.segment_bytes)

    def _check_segments(self) -> None:
        off, rb, seg, stride = self.byte_offset, self.read_bytes, self.segment_bytes, self.segment_stride
        for name, value in (("segment_bytes", seg), ("segment_stride", stride)):
            if value <= 0 or value % 16:
                raise ValueError(f"RealKvSource.{name} must be a positive multiple of 16; got {name}={value}")
        if rb % seg or stride < seg:
            raise ValueError(
                "RealKvSource: read_bytes must be a whole number of segments, and segment_stride >= segment_bytes; "
                f"got read_bytes={rb}, segment_bytes={seg}, segment_stride={stride}"
            )
        end = off + (rb // seg - 1) * stride + seg
        if end > self.num_bytes_per_token:
            raise ValueError(
                f"RealKvSource: the folded bytes end at byte {end} of the token, past num_bytes_per_token="
                f"{self.num_bytes_per_token} (byte_offset={off}, read_bytes={rb}, segment_bytes={seg}, "
                f"segment_stride={stride})"
            )

    @property
    def contiguous(self) -> bool:
        """Whether the folded bytes are one run (no segments)."""
        return self.segment_bytes == self.read_bytes

    @property
    def num_token_slots(self) -> int:
        """How many token slots the pages hold."""
        return int(self.data.shape[0]) * self.page_size


_META_FIELDS = ("page_size", "num_bytes_per_token", "read_bytes", "byte_offset", "segment_bytes", "segment_stride")


def _flatten_with_keys(source: RealKvSource):
    return ((jax.tree_util.GetAttrKey("data"), source.data),), tuple(getattr(source, f) for f in _META_FIELDS)


def _unflatten(meta, children) -> RealKvSource:
    # Bypasses __post_init__: the static fields were checked when the source was built, and jax unflattens with
    # leaves that are not arrays (jax.tree.map(lambda x: x.shape, ...), None, object() placeholders), which the
    # constructor's checks would reject.
    source = object.__new__(RealKvSource)
    for name, value in zip(_META_FIELDS, meta, strict=True):
        object.__setattr__(source, name, value)
    (data,) = children
    object.__setattr__(source, "data", data)
    return source


jax.tree_util.register_pytree_with_keys(
    RealKvSource, _flatten_with_keys, _unflatten, flatten_func=lambda s: ((s.data,), _flatten_with_keys(s)[1])
)


def check_kv_dtype(dtype, arg: str) -> None:
    """Raises ``TypeError`` naming ``arg`` unless ``dtype`` is a 1/2/4/8-byte integer or float type (whole bytes)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        bits = None
    if bits is None or bits != 8 * dtype.itemsize or dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(
            f"{arg} must have a 1/2/4/8-byte integer or float dtype (its bytes are folded as words); got dtype {dtype}"
        )


def _row_bytes(data) -> int:
    if not hasattr(data, "shape") or not hasattr(data, "dtype"):
        raise TypeError(f"RealKvSource.data must be an array; got {type(data).__name__}")
    if len(data.shape) < 1:
        raise ValueError(f"RealKvSource.data needs a leading page axis; got shape {tuple(data.shape)}")
    dtype = jnp.dtype(data.dtype)
    check_kv_dtype(dtype, "RealKvSource.data")
    row_bytes = math.prod(data.shape[1:]) * dtype.itemsize
    if row_bytes % 16:
        raise ValueError(f"RealKvSource: a page row must be a multiple of 16 bytes; got {row_bytes} bytes")
    return row_bytes


def validate_sources(
    sources: Sequence[RealKvSource], *, num_slots: int, arg: str = "real_kv_sources"
) -> tuple[RealKvSource, ...]:
    """Trace-time checks: at most 4 sources, each a ``RealKvSource`` covering every canary slot; returns a tuple."""
    if not isinstance(sources, (tuple, list)):
        raise TypeError(f"{arg} must be a tuple of RealKvSource; got {type(sources).__name__}")
    if len(sources) > layout.MAX_REAL_KV_SOURCES:
        raise ValueError(f"{arg} holds at most {layout.MAX_REAL_KV_SOURCES} sources; got {len(sources)}")
    for i, src in enumerate(sources):
        validate.instance(f"{arg}[{i}]", src, RealKvSource)
        if src.num_token_slots < num_slots:
            raise ValueError(
                f"{arg}[{i}] holds {src.num_token_slots} token slots (pages * page_size) but the canary buffer "
                f"has num_slots={num_slots}; every canary slot needs KV bytes to fold"
            )
    return tuple(sources)


def as_words(data: jax.Array) -> jax.Array:
    """Views a source as ``u32[pages, row_bytes // 4]`` (little-endian words) without copying semantics."""
    pages = data.shape[0]
    itemsize = jnp.dtype(data.dtype).itemsize
    flat = data.reshape(pages, -1)
    if itemsize < 4:
        flat = flat.reshape(pages, -1, 4 // itemsize)
    return lax.bitcast_convert_type(flat, jnp.uint32).reshape(pages, -1)


def num_chunks(source: RealKvSource, mode: int) -> int:
    """16-byte chunks folded per slot: 1 in PARTIAL mode, ``read_bytes / 16`` in ALL mode."""
    return 1 if mode == layout.REAL_KV_PARTIAL else source.read_bytes // layout.REAL_KV_CHUNK_BYTES


def fold_chunk(acc: hash64.U64, words: tuple[jax.Array, ...]) -> hash64.U64:
    """Folds one 16-byte chunk, given as 4 little-endian u32 words, as two u64 words: ``acc = sm(acc ^ w)``."""
    w0, w1, w2, w3 = words
    acc = hash64.splitmix64(hash64.xor(acc, (w0, w1)))
    return hash64.splitmix64(hash64.xor(acc, (w2, w3)))


def fold_source_into(outer: hash64.U64, one: hash64.U64) -> hash64.U64:
    """Combines one source's fold into the running result: ``outer = sm(outer ^ fold)``."""
    return hash64.splitmix64(hash64.xor(outer, one))


def slot_word_offset(source: RealKvSource, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page row, first u32 word) of each slot's folded bytes: ``(s // ps, ((s % ps) * bpt + byte_offset) / 4)``."""
    token_word = (slots % source.page_size) * (source.num_bytes_per_token // 4)
    return slots // source.page_size, token_word + source.byte_offset // 4


def chunk_word(source: RealKvSource, chunk) -> jax.Array:
    """Word offset of 16-byte chunk ``chunk`` (static or traced) from a slot's first folded word."""
    if source.contiguous:
        return chunk * _WORDS_PER_CHUNK
    per_segment = source.segment_bytes // _CHUNK
    return (chunk // per_segment) * (source.segment_stride // 4) + (chunk % per_segment) * _WORDS_PER_CHUNK


def load_words(data: jax.Array, row: jax.Array, first_word: jax.Array, count: int) -> tuple[jax.Array, ...]:
    """Little-endian u32 words ``first_word .. first_word + count - 1`` of page row ``row``, as :func:`as_words`.

    One gather reads the elements holding those bytes, one index array per axis of ``data``, and the words are
    put together from them. Nothing reshapes or bitcasts the whole array (XLA would copy it: a bitcast between
    widths is a shift-and-or fusion), so a KV array sharded over any axis is read in place too.

    Args:
      data: ``[pages, ...]`` of a 1/2/4/8-byte dtype.
      row, first_word: i32[n]; ``first_word`` is non-negative and 16-byte aligned (even).
      count: static number of words (even).
    """
    itemsize = jnp.dtype(data.dtype).itemsize
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[itemsize]
    per_word = max(1, 4 // itemsize)
    if itemsize == 8:
        flat = first_word[:, None] // 2 + jnp.arange(count // 2, dtype=first_word.dtype)
    else:
        flat = first_word[:, None] * per_word + jnp.arange(count * per_word, dtype=first_word.dtype)
    # flat >= 0: unravelled unsigned, plain div/mod (XLA would redo signed fix-ups for every element gathered).
    index = [i.astype(flat.dtype) for i in jnp.unravel_index(flat.astype(jnp.uint32), data.shape[1:])]
    rows = jnp.broadcast_to(row[:, None], flat.shape)
    # Same-width bitcast first: a free view that keeps the sharding, and no float op can quiet a NaN payload.
    elements = mesh.take(lax.bitcast_convert_type(data, uint), (rows, *index))  # [n, elements]
    if itemsize == 8:
        halves = (elements.astype(jnp.uint32), (elements >> jnp.uint64(32)).astype(jnp.uint32))
        return tuple(halves[k % 2][:, k // 2] for k in range(count))
    words = []
    for k in range(count):
        word = elements[:, k * per_word].astype(jnp.uint32)
        for j in range(1, per_word):
            word = word | (elements[:, k * per_word + j].astype(jnp.uint32) << jnp.uint32(8 * itemsize * j))
        words.append(word)
    return tuple(words)


def _fold_step(load_chunk, i: int, chunk, acc: hash64.U64) -> hash64.U64:
    """One chunk of source ``i``: the loop body of :func:`fold_loaded`, at module level (bound with ``partial``)."""
    return fold_chunk(acc, load_chunk(i, chunk))


def fold_loaded(
    sources: Sequence[RealKvSource],
    like: jax.Array,
    mode: int,
    load_chunk: Callable[[int, jax.Array], tuple[jax.Array, ...]],
) -> hash64.U64:
    """The fold of slots whose chunks ``load_chunk(source_index, chunk)`` returns, shaped like ``like``.

    The arithmetic every backend shares; 0 when the mode is NONE or there are no sources.
    """
    zero = hash64.const(0, like)
    if mode == layout.REAL_KV_NONE or not sources:
        return zero
    outer = zero
    for i, src in enumerate(sources):
        n = num_chunks(src, mode)
        if n == 1:  # PARTIAL, or a 16-byte read: no loop
            one = _fold_step(load_chunk, i, jnp.int32(0), zero)
        else:
            # int32 bounds: Python-int bounds make the chunk index int64 under x64, which Mosaic cannot lower.
            bounds = (jnp.int32(0), jnp.int32(n))
            one = lax.fori_loop(*bounds, functools.partial(_fold_step, load_chunk, i), zero)
        outer = fold_source_into(outer, one)
    return outer


def fold_slots(
    sources: Sequence[RealKvSource],
    slots: jax.Array,
    mode: int,
    load_chunk: Callable[[int, jax.Array, jax.Array], tuple[jax.Array, ...]] | None = None,
) -> hash64.U64:
    """REAL_KV_HASH of each slot in ``slots`` (any shape); 0 when the mode is NONE or there are no sources.

    ``load_chunk(source_index, row, first_word)`` returns the 4 words of the chunk starting at ``first_word`` of
    page row ``row``. The default gathers them from the source's own elements (:func:`load_words`), which also
    reads sources typed with an explicit mesh sharding in place; a Pallas kernel passes a ref-loading function
    (kernel bodies are traced once per jitted wrapper trace, so their loop bodies are bounded too).
    """
    if mode == layout.REAL_KV_NONE or not sources:
        return hash64.const(0, slots)
    if load_chunk is None:
        with mesh.context([s.data for s in sources], slots):
            return _fold_jnp(tuple(sources), mesh.replicate(slots), mode)
    return _fold_slots(sources, slots, mode, load_chunk)


@functools.partial(jax.jit, static_argnames="mode")
def _fold_jnp(sources, slots: jax.Array, mode: int) -> hash64.U64:
    """:func:`fold_slots` gathering from the sources' own elements. A jit of its own: the loop body closes over
    the sources, and ``lax.fori_loop`` caches its body by identity, so a fresh closure per caller trace would add
    a cache entry on every trace; here one is made per shape only."""

    def load_chunk(i, row, first):
        words = load_words(sources[i].data, row.reshape(-1), first.reshape(-1), _WORDS_PER_CHUNK)
        return tuple(w.reshape(row.shape) for w in words)

    return _fold_slots(sources, slots, mode, load_chunk)


def _fold_slots(sources, slots, mode, load_chunk):
    offsets = [slot_word_offset(src, slots) for src in sources]

    def load(i, chunk):
        row, word = offsets[i]
        return load_chunk(i, row, word + chunk_word(sources[i], chunk))

    return fold_loaded(sources, slots, mode, load)
