"""Inclusive prefix sums written as one ``reduce_window``: the same lowering on every jax version and platform.

``jnp.cumsum`` lowers to a ``reduce_window`` up to jax 0.11, but jax 0.12 lowers it for CUDA to ``chlo.scan``, whose
portable form is a while loop; XLA:GPU copies a while loop's predicate to the host every iteration. Spelled as a
``reduce_window`` the sum stays a fusion everywhere (XLA recognises the prefix-sum window on CPU, GPU and TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def inclusive_sum(x: jax.Array) -> jax.Array:
    """``cumsum`` of a 1-D array: ``out[i] = x[0] + ... + x[i]``, in ``x``'s dtype."""
    n = x.shape[0]
    if n == 0:
        return x
    return lax.reduce_window(x, jnp.zeros((), x.dtype), lax.add, (n,), (1,), [(n - 1, 0)])
