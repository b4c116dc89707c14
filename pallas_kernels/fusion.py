"""Computing a value once under XLA's fusion: a boundary XLA:CPU keeps, for values several fusions read."""

from __future__ import annotations

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
