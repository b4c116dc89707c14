"""``inclusive_sum``: inclusive prefix sums written as one ``reduce_window`` (a short integer one as one masked
reduction): the same lowering on every jax version and platform.

``jnp.cumsum`` lowers to a ``reduce_window`` up to jax 0.11, but jax 0.12 lowers it for CUDA to ``chlo.scan``, whose
portable form is a while loop; XLA:GPU copies a while loop's predicate to the host every iteration. Spelled as a
``reduce_window`` the sum stays a fusion everywhere (XLA recognises the prefix-sum window on CPU, GPU and TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Up to this many integer entries, the sum is a masked reduction over every pair: XLA fuses it with what computes
# ``x`` and what reads the sums (a ``reduce_window`` is a kernel of its own to compile on CPU).
PAIRWISE_MAX_ENTRIES = 32


def inclusive_sum(x: jax.Array) -> jax.Array:
    """``cumsum`` of a 1-D array, lowered without a loop on every platform.

    Args:
      x: [n] a 1-D array (any numeric dtype; integer sums wrap as ``cumsum``'s do).

    Returns:
      [n] ``out[i] = x[0] + ... + x[i]``, in ``x``'s dtype.
    """
    n = x.shape[0]
    if n == 0:
        return x
    if n <= PAIRWISE_MAX_ENTRIES and jnp.issubdtype(x.dtype, jnp.integer):  # integer sums do not depend on order
        i = jnp.arange(n)
        return jnp.sum(jnp.where(i[None, :] <= i[:, None], x[None, :], 0), axis=1, dtype=x.dtype)
    return lax.reduce_window(x, jnp.zeros((), x.dtype), lax.add, (n,), (1,), [(n - 1, 0)])
