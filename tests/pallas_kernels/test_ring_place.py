"""``ring.place`` against SGLang's atomic append run flag by flag: several launches' candidates in one call, a
partly full ring, overflow and the index's saturation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ring

_INT32_MAX = 2**31 - 1


def _atomic_append(old_ring, old_ctx, start, flags, rows, ctx):
    """SGLang's append, one flag at a time: ``idx = index++``; row ``idx`` is written if ``idx < capacity``."""
    new_ring, new_ctx, index = old_ring.copy(), old_ctx.copy(), start
    for entry in np.nonzero(flags)[0]:
        if index < len(new_ring):
            new_ring[index], new_ctx[index] = rows[entry], ctx[entry]
        index = min(index + 1, _INT32_MAX)
    return new_ring, new_ctx, np.array([index], np.int32)


@pytest.mark.parametrize("start", [0, 5, 7, 8, _INT32_MAX - 2])
def test_place_is_the_atomic_append_of_the_flagged_rows(start):
    rng = np.random.default_rng(start % 97)
    capacity, n = 8, 13  # three launches' candidates (3 + 6 + 4), concatenated in ring order
    old_ring = rng.integers(0, 2**32, (capacity, 8, 2), dtype=np.uint32)
    old_ctx = rng.integers(-9, 9, (capacity, 3), dtype=np.int32)
    flags = rng.random(n) < 0.5
    flags[0] = True  # at least one row
    rows = rng.integers(0, 2**32, (n, 8, 2), dtype=np.uint32)
    ctx = rng.integers(-9, 9, (n, 3), dtype=np.int32)
    asked = []

    def build(entries):
        asked.append(entries.shape)
        return jnp.asarray(rows)[entries], jnp.asarray(ctx)[entries]

    got = jax.jit(lambda r, c, i, f: ring.place(r, c, i, f, build))(
        jnp.asarray(old_ring), jnp.asarray(old_ctx), jnp.array([start], jnp.int32), jnp.asarray(flags)
    )
    want = _atomic_append(old_ring, old_ctx, start, flags, rows, ctx)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert set(asked) == {(capacity,)}  # one row built per ring row, not one per candidate
