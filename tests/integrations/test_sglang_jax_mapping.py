"""The sglang-jax batch and KV mapping on plain arrays: no engine needed, so it runs on every CI leg."""

from __future__ import annotations

import importlib.util
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax.integrations import sglang_jax
from pallas_kernels import realkv

_fold = jax.jit(realkv.fold_slots, static_argnums=(2,))


@pytest.mark.parametrize("page_size,packing,kv_heads", [(1, 2, 1), (4, 2, 2), (2, 1, 2)])
def test_fused_layer_views_fold_like_k_and_v_copies(page_size, packing, kv_heads):
    """K and V of sglang-jax's fused layer array, read in place, fold like contiguous copies of the K / V heads."""
    dtype = jnp.bfloat16 if packing == 2 else jnp.float32
    pages, head_dim = 6, 128
    shape = (pages, page_size, 2 * kv_heads // packing, packing, head_dim)
    raw = np.random.default_rng(0).integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    kv0 = jnp.asarray(raw.view(dtype).reshape(shape))
    k, v = sglang_jax.kv_sources(kv0)
    assert k.data is kv0 and v.data is kv0  # views, not copies
    heads = kv0.reshape(pages, page_size, 2 * kv_heads, head_dim)  # fused head j = a * packing + p
    slots = jnp.arange(pages * page_size, dtype=jnp.int32)
    for source, half in ((k, 0), (v, 1)):
        copy = kc.RealKvSource(heads[:, :, half::2], page_size=page_size)
        for mode in (1, 2):
            chex.assert_trees_all_equal(_fold((source,), slots, mode), _fold((copy,), slots, mode))


def test_kv_sources_refuses_other_layouts():
    with pytest.raises(ValueError, match=r"kv0 must be sglang-jax's fused layer array .* got shape \(4, 1, 2, 128\)"):
        sglang_jax.kv_sources(jnp.zeros((4, 1, 2, 128), jnp.bfloat16))


def test_page_table_is_built_from_cache_loc():
    """Rows end to end in cache_loc, each padded to a whole page; padding rows (seq_len 0) own nothing."""
    layout = sglang_jax.Layout(page_size=2, table_width=6)
    seq_lens = jnp.array([3, 0, 1, 4], jnp.int32)
    # row 0: slots 10 11 12 (+ page pad 13), row 2: 20 (+ pad 21), row 3: 30 31 32 33, then bucket padding.
    cache_loc = jnp.array([10, 11, 12, 13, 20, 21, 30, 31, 32, 33, 0, 0], jnp.int32)
    want = [[10, 11, 12, 0, 0, 0], [0] * 6, [20, 0, 0, 0, 0, 0], [30, 31, 32, 33, 0, 0]]
    np.testing.assert_array_equal(sglang_jax.page_table(cache_loc, seq_lens, layout), want)


def _fields(**kw):
    return {k: jnp.asarray(v, jnp.int32) for k, v in kw.items()}


def test_decode_batch_with_interleaved_padding_rows():
    layout = sglang_jax.Layout(page_size=1, table_width=4)
    fields = _fields(
        input_ids=[7, 0, 8, 0], positions=[2, 0, 1, 0], out_cache_loc=[5, -1, 9, -1],
        req_pool_indices=[3, -1, 0, -1], seq_lens=[3, 0, 2, 0], cache_loc=[1, 2, 5, 6, 9, 0, 0, 0],
    )  # fmt: skip
    batch = sglang_jax.canary_batch(fields, layout, is_decode=True, oracle={})
    np.testing.assert_array_equal(batch.req_pool_indices, [0, -1, 2, -1])  # engine row 0 is real: rows are batch rows
    np.testing.assert_array_equal(batch.prefix_lens, [2, 0, 1, 0])
    np.testing.assert_array_equal(batch.extend_lens, [1, 0, 1, 0])
    np.testing.assert_array_equal(batch.req_to_token, [[1, 2, 5, 0], [0] * 4, [6, 9, 0, 0], [0] * 4])
    np.testing.assert_array_equal(batch.out_cache_loc, [5, -1, 9, -1])


def test_extend_batch_reads_the_extend_arrays():
    """A prefill mixed with a running decode (the engine keeps EXTEND; the decode row extends by 1)."""
    layout = sglang_jax.Layout(page_size=1, table_width=4)
    fields = _fields(
        input_ids=[4, 5, 6, 9, 0], positions=[1, 2, 3, 2, 0], out_cache_loc=[2, 3, 4, 8, -1],
        req_pool_indices=[0, 1, -1], seq_lens=[4, 3, 0], cache_loc=[1, 2, 3, 4, 6, 7, 8],
        extend_prefix_lens=[1, 2, 0], extend_seq_lens=[3, 1, 0],
    )  # fmt: skip
    batch = sglang_jax.canary_batch(fields, layout, is_decode=False, oracle={})
    np.testing.assert_array_equal(batch.req_pool_indices, [0, 1, -1])
    np.testing.assert_array_equal(batch.prefix_lens, [1, 2, 0])
    np.testing.assert_array_equal(batch.extend_lens, [3, 1, 0])
    np.testing.assert_array_equal(batch.req_to_token, [[1, 2, 3, 4], [6, 7, 8, 0], [0] * 4])


def test_wrap_without_the_engine_says_what_to_install():
    if importlib.util.find_spec("sgl_jax") is not None:
        with pytest.raises(TypeError, match="worker must be an sgl_jax ModelWorker"):
            sglang_jax.wrap(object(), kc.CanaryConfig(sweep_interval=0))
    else:
        with pytest.raises(ImportError, match=r'pip install "kvcanary-jax\[sglang-jax\]"'):
            sglang_jax.wrap(object(), kc.CanaryConfig(sweep_interval=0))


def test_plan_sizes_are_a_ladder_of_x4_ending_at_the_bucket_and_hold_every_need():
    assert sglang_jax.capacity_ladder(8176) == (256, 1024, 4096, 8176)
    assert sglang_jax.capacity_ladder(100) == (100,)
    assert sglang_jax.capacity_ladder(1024) == (256, 1024)
    for need in range(0, 8177, 7):
        size = sglang_jax.sized_capacity(need, 8176)
        assert size in sglang_jax.capacity_ladder(8176) and size >= need
        smaller = [c for c in sglang_jax.capacity_ladder(8176) if c < size]
        assert all(c < need for c in smaller)  # the smallest that holds it


def _batch(**arrays):
    return types.SimpleNamespace(**{k: np.asarray(v, np.int32) for k, v in arrays.items()})


def test_a_smaller_bucket_is_padded_to_the_canary_shapes_as_the_engine_pads():
    shapes = sglang_jax.Shapes(rows=4, decode_tokens=4, extend_tokens=8, cache_loc=12)
    decode = _batch(input_ids=[7, 9], positions=[3, 5], out_cache_loc=[11, -1], req_pool_indices=[2, -1],
                    seq_lens=[4, 0], cache_loc=[1, 2, 3, 11, 0, 0])  # fmt: skip
    fields = sglang_jax.host_fields(decode, shapes, is_decode=True)
    assert set(fields) == {"input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "cache_loc"}
    assert fields["input_ids"].tolist() == [7, 9, 0, 0] and fields["out_cache_loc"].tolist() == [11, -1, -1, -1]
    assert fields["req_pool_indices"].tolist() == [2, -1, -1, -1] and fields["seq_lens"].tolist() == [4, 0, 0, 0]
    assert fields["cache_loc"].tolist() == [1, 2, 3, 11, 0, 0] + [0] * 6
    extend = _batch(input_ids=[1] * 6, positions=list(range(6)), out_cache_loc=list(range(1, 7)), req_pool_indices=[0],
                    seq_lens=[6], cache_loc=list(range(1, 7)), extend_prefix_lens=[0], extend_seq_lens=[6])  # fmt: skip
    fields = sglang_jax.host_fields(extend, shapes, is_decode=False)
    assert fields["input_ids"].shape == (8,) and fields["extend_seq_lens"].tolist() == [6, 0, 0, 0]
    oracle = sglang_jax.padded_oracle({"expected_input_ids": np.array([1] * 6), "token_ids_lens": np.array([6])},
                                      shapes, is_decode=False)  # fmt: skip
    assert oracle["expected_input_ids"].tolist() == [1] * 6 + [0, 0] and oracle["token_ids_lens"].tolist() == [6, 0, 0, 0]


def test_a_batch_past_the_shapes_sized_at_startup_is_refused_by_name():
    shapes = sglang_jax.Shapes(rows=2, decode_tokens=2, extend_tokens=4, cache_loc=4)
    decode = _batch(input_ids=[1, 2, 3], positions=[0, 0, 0], out_cache_loc=[1, 2, 3], req_pool_indices=[0, 1, 2],
                    seq_lens=[1, 1, 1], cache_loc=[1, 2, 3])  # fmt: skip
    with pytest.raises(ValueError, match=r"the engine's batch has 3 tokens, more than the largest bucket \(2\)"):
        sglang_jax.host_fields(decode, shapes, is_decode=True)


def test_overlap_placeholders_resolve_through_the_future_map_as_the_engine_resolves_them():
    future_map = jnp.asarray([0, 41, 42, 43], jnp.int32)
    ids = jnp.asarray([5, -1, -3, 0, -9], jnp.int32)  # -9: past the map, clipped as the engine clips it
    assert sglang_jax.resolve_future(ids, future_map).tolist() == [5, 41, 43, 0, 43]
