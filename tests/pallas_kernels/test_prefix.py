"""``prefix.inclusive_sum`` is ``cumsum``, and lowers without a loop for every platform on every jax version."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import prefix


@pytest.mark.parametrize("n", [0, 1, 5, prefix.PAIRWISE_MAX_ENTRIES, prefix.PAIRWISE_MAX_ENTRIES + 1, 4096 + 3])
def test_equals_cumsum(n):
    """Small and large, with sums that wrap around int32 (as cumsum's do)."""
    x = np.random.default_rng(n).integers(-(2**31), 2**31, n).astype(np.int32)
    got = jax.jit(prefix.inclusive_sum)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.cumsum(x, dtype=np.int32))


@pytest.mark.parametrize("platform", ["cuda", "tpu", "cpu"])
def test_lowers_without_a_loop(platform):
    """jax 0.12 lowers ``jnp.cumsum`` for CUDA to ``chlo.scan`` (a while loop); ours stays a reduce_window."""
    text = export.export(jax.jit(prefix.inclusive_sum), platforms=[platform])(
        jax.ShapeDtypeStruct((65536,), jnp.int32)
    ).mlir_module()
    assert "reduce_window" in text and "while" not in text
