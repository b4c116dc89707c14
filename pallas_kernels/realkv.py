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

from pallas_kernels import checks, hash64, layout

_WORDS_PER_CHUNK = layout.REAL_KV_CHUNK_BYTES // 4


@dataclasses.dataclass(frozen=True)
class RealKvSource:
    """One KV tensor whose bytes are folded into a slot's REAL_KV_HASH.

    Attributes:
      data: any dtype, leading axis = pages; e.g. ``bf16[num_pages, page_size, kv_heads, head_dim]``.
      page_size: token slots per page (>= 1). Slot ``s`` lives in page ``s // page_size``.
      num_bytes_per_token: bytes of one token inside a page row, a positive multiple of 16.
      read_bytes: bytes folded in ALL mode, a multiple of 16 in ``[16, num_bytes_per_token]``; PARTIAL mode
        always folds the first 16. ``None`` means all ``num_bytes_per_token``.
    """

    data: jax.Array
    page_size: int = 1
    num_bytes_per_token: int | None = None
    read_bytes: int | None = None

    def __post_init__(self):
        if isinstance(self.data, np.ndarray):
            object.__setattr__(self, "data", jnp.asarray(self.data))
        row_bytes = _row_bytes(self.data)
        for name in _META_FIELDS:
            value = getattr(self, name)
            if (value is not None or name == "page_size") and not checks.is_int(value):
                raise TypeError(f"RealKvSource.{name} must be an int; got {name}={value!r}")
            object.__setattr__(self, name, None if value is None else int(value))
        if self.page_size < 1:
            raise ValueError(f"RealKvSource.page_size must be an int >= 1; got page_size={self.page_size!r}")
        if self.num_bytes_per_token is None:
            object.__setattr__(self, "num_bytes_per_token", row_bytes // self.page_size)
        if self.read_bytes is None:
            object.__setattr__(self, "read_bytes", self.num_bytes_per_token)
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

    @property
    def num_token_slots(self) -> int:
        """How many token slots the pages hold."""
        return int(self.data.shape[0]) * self.page_size


_META_FIELDS = ("page_size", "num_bytes_per_token", "read_bytes")


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
        if not isinstance(src, RealKvSource):
            raise TypeError(f"{arg}[{i}] must be a RealKvSource; got {type(src).__name__}")
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
    """(page row, first u32 word) of each slot's bytes: ``(s // page_size, (s % page_size) * bpt / 4)``."""
    return slots // source.page_size, (slots % source.page_size) * (source.num_bytes_per_token // 4)


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


@functools.partial(jax.jit, static_argnames="mode")
def _fold_jnp(sources, slots: jax.Array, mode: int) -> hash64.U64:
    """:func:`fold_slots` from the sources' jnp word views. A jit of its own: the loop body closes over the views,
    and ``lax.fori_loop`` caches its body by identity, so a fresh closure per caller trace would add a cache entry
    on every trace; here one is made per shape only."""
    views = [as_words(src.data) for src in sources]
    offsets = [slot_word_offset(src, slots) for src in sources]

    def load_chunk(i, chunk):
        row, word = offsets[i]
        base = word + chunk * _WORDS_PER_CHUNK
        return tuple(views[i][row, base + k] for k in range(_WORDS_PER_CHUNK))

    return fold_loaded(sources, slots, mode, load_chunk)


def fold_slots(
    sources: Sequence[RealKvSource],
    slots: jax.Array,
    mode: int,
    load_chunk: Callable[[int, jax.Array, jax.Array, jax.Array], tuple[jax.Array, ...]] | None = None,
) -> hash64.U64:
    """REAL_KV_HASH of each slot in ``slots`` (any shape); 0 when the mode is NONE or there are no sources.

    ``load_chunk(source_index, row, word, chunk)`` returns the 4 words of one chunk; the default gathers them
    from the jnp word view, and a Pallas kernel passes a ref-loading function instead (kernel bodies are traced
    once per jitted wrapper trace, so their closures are bounded the same way).
    """
    if mode == layout.REAL_KV_NONE or not sources:
        return hash64.const(0, slots)
    if load_chunk is None:
        return _fold_jnp(tuple(sources), slots, mode)
    offsets = [slot_word_offset(src, slots) for src in sources]
    return fold_loaded(sources, slots, mode, lambda i, chunk: load_chunk(i, *offsets[i], chunk))
