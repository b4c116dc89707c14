"""Real-KV sources that name part of each token (``byte_offset``, segments of a stride), without a copy.

sglang-jax fuses K and V per layer, alternating per head; its K heads are segments of ``head_bytes`` every
``2 * head_bytes`` from offset 0, its V heads the same from ``head_bytes``. Such a source must fold exactly like a
contiguous copy of those bytes, on every backend: xla, the Triton kernels and the Mosaic kernels (interpreted).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import realkv
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api as write_api
from tests.pallas_kernels import kernel_cases as cases

NUM_SLOTS = 48
HEADS = 2

_fold = jax.jit(realkv.fold_slots, static_argnums=(2,))


def _fused(rng, pages: int, page_size: int, head_bytes: int, dtype) -> np.ndarray:
    """Random bytes as ``[pages, page_size, 2 * HEADS, head_elements]`` (K0, V0, K1, V1 per token)."""
    dtype = np.dtype(dtype)
    shape = (pages, page_size, 2 * HEADS, head_bytes // dtype.itemsize)
    return rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def _half(data, page_size: int, head_bytes: int, half: int) -> realkv.RealKvSource:
    return realkv.RealKvSource(data, page_size, byte_offset=half * head_bytes, segment_bytes=head_bytes,
                               segment_stride=2 * head_bytes, read_bytes=HEADS * head_bytes)  # fmt: skip


@pytest.mark.parametrize("page_size,dtype,head_bytes", [(1, jnp.bfloat16, 256), (4, jnp.float32, 32)])
@pytest.mark.parametrize("mode", [1, 2])
def test_strided_sources_fold_like_contiguous_copies(page_size, dtype, head_bytes, mode):
    kv = _fused(np.random.default_rng(0), 12, page_size, head_bytes, dtype)
    slots = jnp.arange(12 * page_size, dtype=jnp.int32)
    for half in (0, 1):
        copy = np.ascontiguousarray(kv[:, :, half::2])  # the K (or V) heads, copied
        want = _fold((realkv.RealKvSource(jnp.asarray(copy), page_size),), slots, mode)
        chex.assert_trees_all_equal(_fold((_half(jnp.asarray(kv), page_size, head_bytes, half),), slots, mode), want)


def test_source_addressing_is_validated():
    data = jnp.zeros((4, 1, 2, 1, 128), jnp.float32)  # 1024 bytes per token
    with pytest.raises(ValueError, match="byte_offset must be a non-negative multiple of 16; got byte_offset=8"):
        realkv.RealKvSource(data, byte_offset=8)
    with pytest.raises(TypeError, match="segment_bytes must be an int"):
        realkv.RealKvSource(data, segment_bytes=16.0)
    with pytest.raises(ValueError, match="segment_stride >= segment_bytes"):
        realkv.RealKvSource(data, read_bytes=512, segment_bytes=512, segment_stride=256)
    with pytest.raises(ValueError, match="end at byte 1536"):
        realkv.RealKvSource(data, byte_offset=512, read_bytes=1024, segment_bytes=512, segment_stride=512)
    # Defaults: every byte from the offset on; with segments, every whole segment that fits.
    assert realkv.RealKvSource(data, byte_offset=512).read_bytes == 512
    assert realkv.RealKvSource(data, byte_offset=512, segment_bytes=256, segment_stride=512).read_bytes == 256


# A strided source next to a plain one (the layout RealKvSource names without a copy), 2-D data as the kernel tests
# build it: 96-byte tokens, folded bytes [16, 32) and [64, 80) (ALL), or [16, 32) (PARTIAL).
SPECS = (
    cases.SourceSpec("bfloat16", 2, 96, 32, row_padding=16, byte_offset=16, segment_bytes=16, segment_stride=48),
    cases.SourceSpec("float32", 1, 32, 32),
)
KERNELS = ["interpret", "interpret_tpu"]


@functools.partial(jax.jit, static_argnames=("mode", "backend"))
def _verify(buf, plan, num_active, sources, *, mode, backend):
    return verify_api.verify(buf, *plan, num_active, real_kv_sources=sources, real_kv_hash_mode=mode,
                             check_expected_token=True, backend=backend)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("mode", "backend"))
def _write(buf, inputs, sources, *, mode, backend):
    return write_api.write(buf, *inputs, jnp.ones((1,), jnp.int32), real_kv_sources=sources, real_kv_hash_mode=mode,
                           backend=backend)  # fmt: skip


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("mode", [1, 2])
def test_kernels_read_strided_sources_like_xla(backend, mode):
    rng = np.random.default_rng(7 + mode)
    sources = cases.make_sources(rng, NUM_SLOTS, SPECS)
    buf, kv, plan, n = cases.verify_inputs(rng, num_slots=NUM_SLOTS, num_reqs=3, max_len=8, sources=sources, mode=mode)
    want = _verify(buf, plan, n, kv, mode=mode, backend="xla")
    assert np.asarray(want).any() and np.bitwise_or.reduce(np.asarray(want)) & 4, "some real-KV mismatches"
    chex.assert_trees_all_equal(_verify(buf, plan, n, kv, mode=mode, backend=backend), want)
    inputs = cases.write_inputs(rng, num_slots=NUM_SLOTS, num_reqs=3, max_len=6)
    buf = cases.random_buffer(rng, NUM_SLOTS)
    want = _write(buf, inputs, sources, mode=mode, backend="xla")
    chex.assert_trees_all_equal(_write(buf, inputs, sources, mode=mode, backend=backend), want)
