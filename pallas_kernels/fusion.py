"""Shaping XLA's work on CPU: a value computed once for several readers, values that share work computed together,
work that follows a traced count rather than an array's static capacity, and a traced zero that orders an in-place
store after a read."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def computed_once(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x`` unchanged, as a value XLA computes once however many fusions read it.

    XLA fuses a cheap element-wise producer into each of its consumers and recomputes it there: a 64-bit hash that
    the verify bits and both halves' row gathers read is compiled three times (compile time on CPU grows with
    every copy), and XLA:CPU expands ``optimization_barrier`` before fusion, so a barrier does not stop it. Here
    ``x`` is written into a buffer one row longer and read back, both at the traced offset ``min(index, 0)``; the
    write is a fusion root, so ``x`` is computed there once. ``index`` is any traced int32 scalar: XLA clamps the
    offset into ``[0, 1]``, so it is always 0 and the bytes come back as they were.
    """
    zero = jnp.minimum(index, 0).astype(jnp.int32)
    buf = jnp.zeros((x.shape[0] + 1, *x.shape[1:]), x.dtype)
    buf = lax.dynamic_update_slice_in_dim(buf, x, zero, 0)
    return lax.dynamic_slice_in_dim(buf, zero, x.shape[0], 0)


def computed_together(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """``xs`` (arrays of one shape, integer dtypes) unchanged, as values XLA computes in one pass over their elements.

    XLA:CPU emits each element of a fusion's output on its own: words stacked into one array (a 64-bit hash's two
    halves and the bits derived from that hash) each redo the work they share, and the stack's per-element branch
    stops vectorisation. A multi-output reduce computes all its operands at one index together: here each ``x``
    gets a trailing axis of two, padded with a zero, and is OR-reduced over it (``x | 0``), so the bytes come back
    as they were.
    """
    padded = [jnp.pad(x[..., None], [(0, 0)] * x.ndim + [(0, 1)]) for x in xs]
    zeros = [jnp.zeros((), x.dtype) for x in xs]
    return list(lax.reduce(padded, zeros, lambda a, b: tuple(x | y for x, y in zip(a, b, strict=True)), (xs[0].ndim,)))


def leading(
    f: Callable[[jax.Array], jax.Array], xs: jax.Array, count: jax.Array, block: int, entry: jax.ShapeDtypeStruct
) -> jax.Array:
    """``f(xs)`` for the first ``count`` entries of ``xs`` (leading axis ``n``); past them, entries hold ``f``'s
    values or zeros (an ``f`` that gives 0 past ``count`` gives exact zeros). ``entry`` is the shape and dtype of
    one entry of ``f``'s output (given, so ``f`` is not traced once more only to learn it).

    A fixed-capacity list (a verify plan of thousands of entries) is mostly empty in a step: ``f`` runs on blocks
    of ``block`` entries, one loop step per block up to the block holding entry ``count - 1``, so its cost follows
    the traced count, not the capacity. ``f`` maps ``block`` entries of ``xs`` to an array with leading axis
    ``block``, element-wise along it; the result has leading axis ``n``. The last block starts at ``n - block``
    (the entries it repeats get the same values again), so nothing is padded or sliced around the loop. It is
    computed once (a loop's output), whoever reads it. Lowered for another platform than CPU (where each loop step
    would copy its predicate to the host, or a TPU export would hold a loop), ``f`` runs once on all of ``xs``
    (``lax.platform_dependent``).
    """
    n = xs.shape[0]
    if n <= block:
        return f(xs)
    num_blocks = -(-n // block)

    def looped(xs, count):
        out = jnp.zeros((n, *entry.shape), entry.dtype)

        def step(k, out):
            start = jnp.minimum(k * block, n - block)
            return lax.dynamic_update_slice_in_dim(out, f(lax.dynamic_slice_in_dim(xs, start, block)), start, 0)

        steps = jnp.clip((count + block - 1) // block, 0, num_blocks).astype(jnp.int32)
        return lax.fori_loop(jnp.int32(0), steps, step, out)

    return lax.platform_dependent(xs, count, cpu=looped, default=lambda xs, _: f(xs))


def zero_after(x: jax.Array) -> jax.Array:
    """A traced int32 zero that depends on ``x``'s first element (any 32-bit dtype).

    Added to the slots of an in-place store, it orders the store after ``x`` is computed (e.g. records gathered
    from the buffer it overwrites), so XLA neither schedules the store first nor copies the whole buffer to keep its
    old bytes. XLA cannot fold the masked shift to a constant.
    """
    word = lax.bitcast_convert_type(x.reshape(-1)[0], jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    return lax.shift_right_logical(word, jnp.uint32(31)).astype(jnp.int32)
