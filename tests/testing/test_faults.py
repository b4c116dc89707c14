"""Fault-injection primitives: exact byte flips, remaps and swaps; target pickers return valid targets."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvcanary_jax import CanaryBatch, CanaryLaunchTag, FailReason, PoolKind, testing
from kvcanary_jax.testing import FaultKind

T = CanaryLaunchTag


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int8])
def test_flip_kv_byte_changes_exactly_one_byte(dtype):
    kv = jnp.asarray(np.random.default_rng(0).integers(-50, 50, (6, 4, 2, 8)), dtype)
    flipped = testing.flip_kv_byte(kv, jnp.int32(13), page_size=4, byte=3)
    before, after = (np.asarray(x).view(np.uint8).reshape(6, 4, -1) for x in (kv, flipped))
    diff = np.argwhere(before != after)
    assert diff.tolist() == [[3, 1, 3]]  # slot 13 = page 3, row 1; byte 3 of its token row
    assert after[3, 1, 3] == before[3, 1, 3] ^ 0xFF
    np.testing.assert_array_equal(testing.flip_kv_byte(flipped, jnp.int32(13), page_size=4, byte=3), kv)
    with pytest.raises(ValueError, match="byte must be an int in"):
        testing.flip_kv_byte(kv, jnp.int32(0), page_size=4, byte=10_000)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_corrupt_page_flips_one_byte_of_every_token_row_of_the_page(dtype):
    kv = jnp.asarray(np.random.default_rng(1).integers(-50, 50, (5, 4, 2, 8)), dtype)
    flipped = testing.corrupt_page(kv, jnp.int32(2), page_size=4, byte=5)
    before, after = (np.asarray(x).view(np.uint8).reshape(5, 4, -1) for x in (kv, flipped))
    assert np.argwhere(before != after).tolist() == [[2, r, 5] for r in range(4)]
    np.testing.assert_array_equal(testing.corrupt_page(flipped, jnp.int32(2), page_size=4, byte=5), kv)
    with pytest.raises(ValueError, match=r"byte must be an int in \[0, (32|64)\)"):
        testing.corrupt_page(kv, jnp.int32(0), page_size=4, byte=64)


def _batch():
    table = np.zeros((4, 8), np.int32)
    table[1, :5] = [11, 12, 13, 14, 15]  # row 1: 4 cached + 1 new
    table[2, :3] = [21, 22, 23]  # row 2: 2 cached + 1 new
    return CanaryBatch(
        req_pool_indices=np.array([1, 2, 0], np.int32),
        prefix_lens=np.array([4, 2, 0], np.int32),
        extend_lens=np.array([1, 1, 0], np.int32),
        req_to_token=table,
        input_ids=np.array([7, 8, 0, 0], np.int32),
        positions=np.array([4, 2, 0, 0], np.int32),
        out_cache_loc=np.array([15, 23, 0, 0], np.int32),
    )


def test_pickers_return_targets_the_step_verifies():
    batch, rng = _batch(), np.random.default_rng(0)
    cached = {11, 12, 13, 14, 21, 22}
    for _ in range(20):
        assert testing.choose_live_slot(batch, rng) in cached
        row, pos, new = testing.choose_remap(batch, rng)
        assert batch.req_to_token[row, pos] in cached and new in cached
        assert new != batch.req_to_token[row, pos] and pos not in np.argwhere(batch.req_to_token == new)[:, 1]
    assert testing.choose_token_swap(batch, rng) == (0, 1)
    assert testing.choose_live_slot(batch, rng, window=1) in {14, 22}
    lut = np.zeros(32, np.int32)
    lut[[14, 22]] = [3, 4]
    assert testing.choose_live_slot(batch, rng, window=1, lut=lut) in {3, 4}
    assert testing.row_starts(batch).tolist() == [0, 1, 2]


def test_remap_and_swap_are_pure():
    batch = _batch()
    remapped = testing.remap_slot(batch.req_to_token, 1, 2, 22)
    assert int(remapped[1, 2]) == 22 and batch.req_to_token[1, 2] == 13
    swapped = testing.swap_tokens(batch.input_ids, 0, 1)
    assert swapped.tolist() == [8, 7, 0, 0] and batch.input_ids.tolist() == [7, 8, 0, 0]


def test_expected_detection_table():
    assert testing.expected_detection(FaultKind.LIVE_KV, PoolKind.SWA) == (
        T.TAIL_K_SWA,
        FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
        0,
    )
    assert testing.expected_detection(FaultKind.POST_FORWARD_KV)[::2] == (T.TAIL_K_FULL, 1)
    assert testing.expected_detection(FaultKind.IDLE_CACHE_KV, PoolKind.SWA)[0] == T.SWEEP_K_SWA
    tag, bits, _ = testing.expected_detection(FaultKind.REQ_TO_TOKEN, PoolKind.SWA)
    assert tag == T.HEAD_K_FULL and bits == FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH
    assert testing.expected_detection(FaultKind.TOKEN_SWAP)[:2] == (T.HEAD_K_FULL, FailReason.WRITE_TOKEN_MISMATCH)
