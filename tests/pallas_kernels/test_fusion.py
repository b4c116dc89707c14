"""``fusion.computed_once`` gives its input back byte for byte, whatever the traced index."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fusion, hash64


@pytest.mark.parametrize("index", [-7, 0, 1, 5])
def test_computed_once_returns_its_input_unchanged(index):
    x = jnp.asarray(np.random.default_rng(index + 10).integers(0, 2**32, (3, 5, 2), dtype=np.uint32))

    @jax.jit
    def f(x, i):
        h = fusion.computed_once(hash64.join(hash64.splitmix64(hash64.split(x))), i)
        return h, h[1:] ^ h[:-1]  # two readers of the one value

    once, xors = f(x, jnp.int32(index))
    expected = hash64.join(hash64.splitmix64(hash64.split(x)))
    np.testing.assert_array_equal(np.asarray(once), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(xors), np.asarray(expected[1:] ^ expected[:-1]))
