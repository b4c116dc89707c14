"""build_plans against a plain host reimplementation of SGLang's plan kernels (§5), plus the edge cases."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary_jax as kc
from tests.core.canary_testlib import (
    NUM_SLOTS,
    POOL_CTX,
    POOL_ROWS,
    VCAP,
    WCAP,
    i32,
    jit_build_plans,
    oracle_plans,
    plan_as_lists,
)

WINDOW = 5


@st.composite
def batches(draw, *, bs=WCAP):
    """A padded batch: distinct request rows (0 = padding, anywhere), lengths within the context, random tables."""
    rows = draw(st.lists(st.integers(1, POOL_ROWS - 1), min_size=bs, max_size=bs, unique=True))
    rpi, prefix, extend = [], [], []
    for r in range(bs):
        padding = draw(st.booleans()) and draw(st.booleans())
        p = draw(st.integers(0, POOL_CTX - 1))
        rpi.append(0 if padding else rows[r])
        prefix.append(p)
        extend.append(draw(st.integers(0, POOL_CTX - p)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    req_to_token = rng.integers(0, NUM_SLOTS, size=(POOL_ROWS, POOL_CTX)).astype(np.int32)  # 0: unfilled entry
    lut = rng.integers(0, NUM_SLOTS, size=NUM_SLOTS + 1).astype(np.int32)  # 0 = evicted from the SWA pool
    pool = rng.integers(-1, 1000, size=(POOL_ROWS, POOL_CTX)).astype(np.int32)
    valid = [draw(st.integers(0, POOL_CTX)) for _ in range(bs)]
    return rpi, prefix, extend, req_to_token, lut, pool, valid


def _check(batch, *, window=0, use_lut=False, use_pool=False, offset=0, vcap=VCAP):
    rpi, prefix, extend, req_to_token, lut, pool, valid = batch
    kwargs = {}
    if use_lut:
        kwargs["full_to_swa_index_mapping"] = i32(lut)
    if use_pool:
        kwargs.update(req_to_verify_expected_tokens=i32(pool), expected_tokens_valid_lens=i32(valid))
    vp, wp = jit_build_plans(
        i32(rpi), i32(prefix), i32(extend), i32(req_to_token), verify_capacity=vcap, write_req_capacity=WCAP,
        swa_window_size=window, kv_token_id_vs_position_offset=offset, **kwargs,
    )  # fmt: skip
    want_v, want_w = oracle_plans(
        rpi, prefix, extend, req_to_token, vcap=vcap, wcap=WCAP, window=window, lut=lut if use_lut else None,
        pool=pool if use_pool else None, valid_lens=valid, offset=offset,
    )  # fmt: skip
    assert plan_as_lists(vp) == want_v
    assert plan_as_lists(wp) == want_w
    for x in (*vars(vp).values(), *vars(wp).values()):
        assert x.dtype == jnp.int32
    return vp, wp


_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


@_SETTINGS
@given(batches())
def test_full_pool_plans_match_host(batch):
    _check(batch)


@_SETTINGS
@given(batches(), st.sampled_from([0, 1]))
def test_expected_tokens_match_host(batch, offset):
    _check(batch, use_pool=True, offset=offset)


@_SETTINGS
@given(batches())
def test_swa_window_and_lut_match_host(batch):
    _check(batch, window=WINDOW, use_lut=True)


def _table():
    table = np.zeros((POOL_ROWS, POOL_CTX), np.int32)
    table[1] = np.arange(100, 100 + POOL_CTX) % NUM_SLOTS
    table[2] = np.arange(1, 1 + POOL_CTX)
    table[5] = np.arange(40, 40 + POOL_CTX) % NUM_SLOTS
    return table


def test_known_batch_entries_offsets_and_seeds():
    table = _table()
    # rows: a decode (prefix 3, extend 1), a padding row, a fresh prefill (prefix 0), a prefix-only row (extend 0).
    batch = ([2, 0, 1, 5], [3, 9, 0, 2], [1, 4, 3, 0], table, None, None, None)
    vp, wp = _check(batch)
    n = int(vp.num_valid[0])
    assert n == 5 and int(vp.enable[0]) == 1
    assert vp.slot_indices.tolist()[:n] == [1, 2, 3, 40, 41]
    assert vp.expected_positions.tolist()[:n] == [0, 1, 2, 0, 1]
    assert vp.prev_slot_indices.tolist()[:n] == [-1, 1, 2, -1, 40]
    assert vp.expected_tokens.tolist() == [-1] * VCAP  # no pool: every token is unknown
    assert vp.slot_indices.tolist()[n:] == [0] * (VCAP - n)  # padding entries
    assert wp.write_offsets.tolist() == [0, 1, 1, 4, 4]
    assert wp.seed_slot_indices.tolist() == [3, -1, -1, -1]  # only a row with prefix > 0 and extend > 0 is seeded
    assert wp.num_valid_reqs.tolist() == [4]  # padding rows included


def test_overflow_disables_verify_and_clamps_num_valid():
    table = _table()
    batch = ([1, 2, 5, 0], [20, 10, 3, 0], [1, 1, 1, 0], table, None, None, None)
    vp, wp = _check(batch)  # 33 entries > 32
    assert vp.enable.tolist() == [0] and vp.num_valid.tolist() == [VCAP]
    assert wp.write_offsets.tolist() == [0, 1, 2, 3, 3]  # the write plan is unaffected
    vp, _ = _check(([1, 2, 5, 0], [20, 9, 3, 0], [1, 1, 1, 0], table, None, None, None))  # exactly 32
    assert vp.enable.tolist() == [1] and vp.num_valid.tolist() == [VCAP]


def test_swa_window_translates_and_keeps_the_real_predecessor():
    table = _table()
    lut = np.arange(NUM_SLOTS + 1, dtype=np.int32) + 1000
    lut[7] = 0  # slot 7 was evicted from the SWA pool
    batch = ([2, 0, 0, 0], [8, 0, 0, 0], [2, 0, 0, 0], table, lut, None, None)
    vp, wp = _check(batch, window=WINDOW, use_lut=True)
    n = int(vp.num_valid[0])
    assert vp.expected_positions.tolist()[:n] == [3, 4, 5, 6, 7]  # the last WINDOW cached positions
    assert vp.slot_indices.tolist()[:n] == [1004, 1005, 1006, 0, 1008]
    assert vp.prev_slot_indices.tolist()[:n] == [1003, 1004, 1005, 1006, 0]  # not reset at the window start
    assert wp.seed_slot_indices.tolist()[0] == 1008


def test_smaller_batch_than_write_capacity_zeroes_the_tail():
    table = _table()
    vp, wp = jit_build_plans(
        i32([1, 2]), i32([2, 1]), i32([3, 2]), i32(table), verify_capacity=VCAP, write_req_capacity=WCAP
    )
    assert wp.write_offsets.tolist() == [0, 3, 5, 0, 0]
    assert wp.seed_slot_indices.tolist() == [101 % NUM_SLOTS, 1, -1, -1]
    assert wp.num_valid_reqs.tolist() == [2]
    assert int(vp.num_valid[0]) == 3


class PlanVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_build_plans_with_and_without_jit(self):
        build = self.variant(kc.build_plans, static_argnames=("verify_capacity", "write_req_capacity"))
        table = _table()
        vp, wp = build(i32([2, 0, 1, 5]), i32([3, 9, 0, 2]), i32([1, 4, 3, 0]), i32(table), verify_capacity=VCAP,
                       write_req_capacity=WCAP)  # fmt: skip
        want_v, want_w = oracle_plans([2, 0, 1, 5], [3, 9, 0, 2], [1, 4, 3, 0], table, vcap=VCAP, wcap=WCAP)
        assert plan_as_lists(vp) == want_v and plan_as_lists(wp) == want_w
        assert want_v["num_valid"] == [5]


@pytest.mark.parametrize("offset", [0, 1])
def test_expected_token_offset(offset):
    table = _table()
    pool = np.arange(POOL_ROWS * POOL_CTX, dtype=np.int32).reshape(POOL_ROWS, POOL_CTX)
    batch = ([2, 0, 0, 0], [4, 0, 0, 0], [1, 0, 0, 0], table, None, pool, [4, 0, 0, 0])
    vp, _ = _check(batch, use_pool=True, offset=offset)
    base = 2 * POOL_CTX
    want = [base + p + offset if p + offset < 4 else -1 for p in range(4)]
    assert vp.expected_tokens.tolist()[:4] == want
