"""``fusion``'s shaping helpers give their inputs' values back byte for byte (``computed_once`` whatever the traced
index, ``computed_together`` as one multi-output kernel), ``leading`` the first ``count`` entries."""

import re

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


def test_computed_together_returns_its_inputs_unchanged_from_one_kernel():
    rng = np.random.default_rng(3)
    x = jnp.asarray(np.concatenate([[0, 1, 2**31, 2**32 - 1], rng.integers(0, 2**32, 12)]).astype(np.uint32))
    signed = jnp.asarray(np.array([-(2**31), -1, 0, 2**31 - 1] * 4, np.int32))

    def words(x, signed):  # a hash's two halves and a word derived from it, plus a signed word
        lo, hi = hash64.splitmix64(hash64.split(jnp.stack([x, x ^ 7], axis=-1)))
        return [lo, hi, lo ^ hi, signed * 3]

    step = jax.jit(lambda x, signed: fusion.computed_together(words(x, signed)))
    got, expected = step(x, signed), words(x, signed)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    text = step.lower(x, signed).compile().as_text()  # one instruction gives all four: a multi-output reduce
    assert re.search(r"= \((u32\[16\]\S*, ){3}s32\[16\]\S*\) (fusion|reduce)\(", text), text


@pytest.mark.parametrize("count", [0, 3, 4, 9, 10, 12])
def test_leading_computes_the_first_count_entries(count):
    xs = jnp.arange(10, dtype=jnp.int32) * 7 + 1
    f = lambda x: hash64.join(hash64.splitmix64(hash64.from_i32(x)))  # noqa: E731

    entry = jax.ShapeDtypeStruct((2,), jnp.uint32)  # one entry of f's output
    out = jax.jit(lambda xs, n: fusion.leading(f, xs, n, 4, entry))(xs, jnp.int32(count))  # 3 blocks of 4: a loop
    assert out.shape == (10, 2)
    np.testing.assert_array_equal(np.asarray(out)[:count], np.asarray(f(xs))[:count])


@pytest.mark.parametrize("word", [0, 1, 2**31 - 1, 2**31, 2**32 - 1])
def test_zero_after_is_zero_for_any_word(word):
    zero = jax.jit(fusion.zero_after)(jnp.full((3,), word, jnp.uint32))
    assert zero.dtype == jnp.int32 and int(zero) == 0
