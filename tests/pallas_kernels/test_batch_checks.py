"""The batch checks: hand-computed golden candidates, and the Triton kernel (interpret mode) equal to the jnp
reference on random batches, every padding convention, with and without the token-history check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import layout
from pallas_kernels.batch_checks import api, pallas_triton, reference

OUT = layout.INPUT_PROBLEM_OUT_OF_RANGE
# Small chunks: several row and token chunks, every loop looped.
TINY = pallas_triton.Config(row_chunk=4, token_chunk=8)


def _check(rpi, cached, extend, loc, lens=None, *, backend, **static):
    arrays = [jnp.asarray(x, jnp.int32) for x in (rpi, cached, extend, loc)]
    lens = None if lens is None else jnp.asarray(lens, jnp.int32)
    return api.check(*arrays, lens, backend=backend, **static)


def _flagged(checked) -> dict[int, list[int]]:
    issues = np.asarray(checked.issues)
    return {int(c): issues[:, c].tolist() for c in np.flatnonzero(issues[0])}


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_golden_negative_padding(backend):
    """Row 1 is padding; row 2's request row is past the table, row 3's prefix is negative: neither is a request.
    Token 1, row 0's second, writes slot 8 of an 8-slot pool."""
    checked = _check(
        [3, -1, 20, 2], [2, 0, 1, -1], [2, 1, 1, 1], [5, 8, 0, 7, 9],
        backend=backend, padding="negative", table_rows=10, context_len=8, num_slots=8,
    )  # fmt: skip
    np.testing.assert_array_equal(checked.active, [1, 0, 0, 0])
    np.testing.assert_array_equal(checked.span_lens, [2, 1, 1, 1])
    np.testing.assert_array_equal(checked.span_starts, [0, 2, 3, 4])
    np.testing.assert_array_equal(checked.token_rows, [0, 0, 1, 2, 3])
    assert checked.issues.shape == (8, 4 + 5)
    # problem, field, value, limit, slot, position, entry, request
    assert _flagged(checked) == {
        2: [OUT, layout.INPUT_FIELD_REQ_POOL_INDICES, 20, 10, -1, -1, 2, -1],
        3: [layout.INPUT_PROBLEM_NEGATIVE, layout.INPUT_FIELD_PREFIX_LENS, -1, -1, -1, -1, 3, -1],
        4 + 1: [OUT, layout.INPUT_FIELD_OUT_CACHE_LOC, 8, 8, 8, 3, 1, 3],
    }
    np.testing.assert_array_equal(checked.issues[:, 0], [0, 0, 0, 0, -1, -1, 0, 3])  # a clean row names its request


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_golden_reserved_row_and_past_tokens(backend):
    """Row 0 (reserved) writes a real slot; row 2's span [3, 6) runs past the 4 tokens; row 1's lens are past the
    token pool's width 6."""
    checked = _check(
        [0, 4, 5], [0, 1, 2], [1, 2, 3], [9, 3, 4, 5], [0, 7, 2],
        backend=backend, padding="reserved", table_rows=10, context_len=16, num_slots=8, token_ids_width=6,
    )  # fmt: skip
    np.testing.assert_array_equal(checked.active, [0, 1, 0])
    np.testing.assert_array_equal(checked.token_rows, [0, 1, 1, 2])
    assert _flagged(checked) == {
        0: [layout.INPUT_PROBLEM_RESERVED_ROW, layout.INPUT_FIELD_REQ_POOL_INDICES, 0, -1, -1, -1, 0, -1],
        2: [layout.INPUT_PROBLEM_PAST_TOKENS, layout.INPUT_FIELD_EXTEND_LENS, 6, 4, -1, -1, 2, -1],
        3 + 1: [OUT, layout.INPUT_FIELD_TOKEN_IDS_LENS, 7, 7, -1, -1, 1, 4],
    }


M = 2**31 - 1


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_sums_near_the_int32_limit_are_reported_not_wrapped(backend):
    """Padding rows' spans of 2**31 - 1 (their sum would wrap to a small end): the request after them is past the
    4 tokens. A prefix at the int32 limit plus one more token is past the context, not a wrapped negative sum."""
    checked = _check(
        [-1, -1, 3, 4], [0, 0, 0, M], [M, M, 2, 1], [5, 6, 7, 1],
        backend=backend, padding="negative", table_rows=10, context_len=16, num_slots=8,
    )  # fmt: skip
    np.testing.assert_array_equal(checked.active, [0, 0, 0, 0])
    np.testing.assert_array_equal(checked.span_lens, [5, 5, 2, 1])  # counted at most T + 1 = 5
    np.testing.assert_array_equal(checked.token_rows, [0, 0, 0, 0])
    assert _flagged(checked) == {
        2: [layout.INPUT_PROBLEM_PAST_TOKENS, layout.INPUT_FIELD_EXTEND_LENS, 12, 4, -1, -1, 2, -1],
        3: [layout.INPUT_PROBLEM_PAST_CONTEXT, layout.INPUT_FIELD_EXTEND_LENS, M, 16, -1, -1, 3, -1],
    }
    reserved = _check(
        [0, 0, 0], [0, 0, 0], [M, M, 4], [5, 6, 7, 1],
        backend=backend, padding="reserved", table_rows=10, context_len=16, num_slots=8,
    )  # fmt: skip
    assert _flagged(reserved) == {  # only row 0 owns tokens (all 4), and they write real slots
        0: [layout.INPUT_PROBLEM_RESERVED_ROW, layout.INPUT_FIELD_REQ_POOL_INDICES, 0, -1, -1, -1, 0, -1]
    }


@st.composite
def _batches(draw):
    """Mostly valid rows (so many are requests and own tokens), with some of every kind of bad value."""
    num_rows = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bad = rng.random(num_rows) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    rpi = np.where(bad & (rng.random(num_rows) < 0.5), rng.integers(-2, 14, num_rows), rng.integers(1, 10, num_rows))
    cached = np.where(bad & (rng.random(num_rows) < 0.3), -1, rng.integers(0, 12, num_rows))
    extend = np.where(bad & (rng.random(num_rows) < 0.3), rng.integers(-2, 9, num_rows), rng.integers(0, 4, num_rows))
    num_tokens = max(1, int(np.maximum(extend, 0).sum()) + draw(st.integers(-3, 5)))
    loc = np.where(rng.random(num_tokens) < 0.1, rng.integers(-2, 70, num_tokens), rng.integers(1, 60, num_tokens))
    lens = np.where(rng.random(num_rows) < 0.1, rng.integers(-1, 40, num_rows), rng.integers(0, 30, num_rows))
    return rpi, cached, extend, loc, lens


# Derandomized (as the suite's other compiling property tests): each example is a shape, so a compile; the same draws in
# every run let a CI leg load the programs that an earlier leg on the same jaxlib compiled.
@settings(max_examples=12, deadline=None, derandomize=True)
@given(_batches(), st.sampled_from(reference.PADDINGS), st.booleans(), st.booleans())
def test_kernel_equals_reference(batch, padding, with_lens, tiny):
    rpi, cached, extend, loc, lens = batch
    static = dict(padding=padding, table_rows=10, context_len=14, num_slots=60, token_ids_width=None)
    if with_lens:
        static["token_ids_width"] = 30
    arrays = [jnp.asarray(x, jnp.int32) for x in (rpi, cached, extend, loc)] + [
        jnp.asarray(lens, jnp.int32) if with_lens else None
    ]
    want = reference.check(*arrays, **static)
    got = pallas_triton.check(*arrays, interpret=True, config=TINY if tiny else None, **static)
    for name, w, g in zip(reference.Checked._fields, want, got, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_no_tokens():
    """A batch of no tokens: the rows' candidates only, on every backend."""
    args = ([1, 2], [0, -1], [0, 0], np.zeros((0,), np.int32))
    static = dict(padding="none", table_rows=4, context_len=4, num_slots=8)
    want, got = _check(*args, backend="xla", **static), _check(*args, backend="interpret", **static)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
    assert _flagged(want) == {1: [layout.INPUT_PROBLEM_NEGATIVE, layout.INPUT_FIELD_PREFIX_LENS, -1, -1, -1, -1, 1, -1]}


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(padding="zero"), ValueError, "padding must be one of"),
        (dict(token_ids_width=4), ValueError, "token_ids_width=4 needs token_ids_lens"),
        (dict(lens=[1, 1]), ValueError, "token_ids_lens is checked against token_ids_width"),
        (dict(rpi=np.zeros((2,), np.float32)), TypeError, "req_pool_indices must have dtype int32"),
        (dict(rpi=[1], cached=[0]), ValueError, "same length"),
        (dict(num_slots=0), ValueError, "num_slots must be a positive static int; got num_slots=0"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
    ],
)
def test_misuse_is_named(change, error, match):
    """Each refusal names the argument and the value received."""
    args = dict(rpi=[1, 2], cached=[0, 0], extend=[1, 1], loc=[3, 4], lens=None)
    static = dict(padding="none", table_rows=4, context_len=4, num_slots=8, backend="xla")
    for key, value in change.items():
        (args if key in args else static)[key] = value
    arrays = [
        jnp.asarray(x) if isinstance(x, np.ndarray) else jnp.asarray(x, jnp.int32)  # an ndarray keeps its dtype
        for x in (args["rpi"], args["cached"], args["extend"], args["loc"])
    ]
    lens = None if args["lens"] is None else jnp.asarray(args["lens"], jnp.int32)
    with pytest.raises(error, match=match):
        api.check(*arrays, lens, **static)


def test_span_sums_must_fit_int32():
    rows, loc = jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2**30,), jnp.int32)  # shapes only
    static = dict(padding="none", table_rows=4, context_len=4, num_slots=8)
    with pytest.raises(ValueError, match=r"too large for int32 span sums.*got 2 \* \(1073741824 \+ 1\)"):
        jax.eval_shape(lambda r, t: api.check(r, r, r, t, **static), rows, loc)


def test_config_chunks_are_powers_of_2():
    with pytest.raises(ValueError, match="Config.row_chunk must be a power of 2; got row_chunk=3"):
        pallas_triton.Config(row_chunk=3)
