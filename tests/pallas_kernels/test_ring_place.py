"""``ring.place_flagged`` places the same bytes as ``ring.place`` of the launches' compacted rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ring

_INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("start", [0, 5, 7, 8, _INT32_MAX - 2])
def test_place_flagged_is_place_of_the_compacted_rows(start):
    rng = np.random.default_rng(start % 97)
    capacity, sizes = 8, (3, 6, 4)
    old_ring = jnp.asarray(rng.integers(0, 2**32, (capacity, 8, 2), dtype=np.uint32))
    old_ctx = jnp.asarray(rng.integers(-9, 9, (capacity, 3), dtype=np.int32))
    flags = [rng.random(n) < 0.5 for n in sizes]
    flags[0][:] = True  # at least one row
    rows = [rng.integers(0, 2**32, (n, 8, 2), dtype=np.uint32) for n in sizes]
    ctx = [rng.integers(-9, 9, (n, 3), dtype=np.int32) for n in sizes]
    index = jnp.array([start], jnp.int32)

    pending = []
    for f, r, c in zip(flags, rows, ctx, strict=True):  # the launch's k-th row is its k-th flagged candidate
        (hits,) = np.nonzero(f)
        packed = np.zeros((capacity, 8, 2), np.uint32)
        packed_ctx = np.zeros((capacity, 3), np.int32)
        kept = min(len(hits), capacity)
        packed[:kept], packed_ctx[:kept] = r[hits][:kept], c[hits][:kept]
        pending.append((jnp.int32(len(hits)), jnp.asarray(packed), jnp.asarray(packed_ctx)))
    want = ring.place(old_ring, old_ctx, index, pending)

    candidates = lambda: (jnp.asarray(np.concatenate(rows)), jnp.asarray(np.concatenate(ctx)))  # noqa: E731
    got = jax.jit(lambda r, c, i, f: ring.place_flagged(r, c, i, f, candidates))(
        old_ring, old_ctx, index, jnp.asarray(np.concatenate(flags))
    )
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
