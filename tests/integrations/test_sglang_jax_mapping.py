"""The sglang-jax batch and KV mapping on plain arrays: no engine needed, so it runs on every CI leg."""

from __future__ import annotations

import importlib.util

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
