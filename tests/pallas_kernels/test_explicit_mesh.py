"""The lower layer's ops on inputs typed with a mesh sharding (sharding in types), as sglang-jax makes them.

sglang-jax's KV pool per layer is ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]`` (K and V
alternating per head), ``P("data", None, "tensor", None, None)`` on a mesh of ``AxisType.Explicit`` axes; its batch
arrays are ``P("data")``. In this process the cases run on a 1 x 1 mesh; ``tests/sharded/test_sharding_subprocess.py``
runs this file again with 4 fake CPU devices, where they run on 2 x 2 meshes (explicit and auto axes). Every case
must give exactly the bytes of the same op on plain single-device arrays.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import realkv
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api as write_api

SHAPE = (2, 2) if len(jax.devices()) >= 4 else (1, 1)
MESHES = [(SHAPE, AxisType.Explicit)] + ([(SHAPE, AxisType.Auto)] if SHAPE == (2, 2) else [])
MESH_IDS = [f"{d}x{t}-{a.name.lower()}" for (d, t), a in MESHES]
KV_SPEC = P("data", None, "tensor", None, None)
PAGES, KV_HEADS, HEAD_DIM = 16, 2, 128


def _mesh(shape, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, ("data", "tensor"), axis_types=(axis_type,) * 2)


def fused_kv(rng, page_size: int, dtype=jnp.bfloat16) -> np.ndarray:
    """Random bytes (any bit pattern) in sglang-jax's fused layout."""
    itemsize = np.dtype(dtype).itemsize
    packing = 4 // itemsize if itemsize < 4 else 1
    shape = (PAGES, page_size, 2 * KV_HEADS // packing, packing, HEAD_DIM)
    return rng.integers(0, 256, int(np.prod(shape)) * itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def strided(data, page_size: int, half: int) -> realkv.RealKvSource:
    """The K (half 0) or V (half 1) heads of a fused array: an offset and a stride, no copy."""
    head_bytes = HEAD_DIM * jnp.dtype(data.dtype).itemsize
    return realkv.RealKvSource(
        data,
        page_size=page_size,
        byte_offset=half * head_bytes,
        segment_bytes=head_bytes,
        segment_stride=2 * head_bytes,
        read_bytes=KV_HEADS * head_bytes,
    )


_fold = jax.jit(realkv.fold_slots, static_argnums=(2,))


@pytest.mark.parametrize("shape,axis_type", MESHES, ids=MESH_IDS)
def test_fold_reads_a_sharded_kv_array_in_place(shape, axis_type):
    kv = fused_kv(np.random.default_rng(1), 4)
    sharded = jax.device_put(kv, NamedSharding(_mesh(shape, axis_type), KV_SPEC))
    slots = jnp.arange(PAGES * 4, dtype=jnp.int32)
    for mode in (1, 2):
        for half in (0, 1):
            got = _fold((strided(sharded, 4, half),), slots, mode)
            chex.assert_trees_all_equal(got, _fold((strided(jnp.asarray(kv), 4, half),), slots, mode))
    if axis_type == AxisType.Explicit:
        # Only gathered elements cross devices: no all-gather, and every collective is far smaller than the KV.
        text = _fold.lower((strided(sharded, 4, 0),), slots, 2).compile().as_text()
        assert "all-gather" not in text
        for dims in re.findall(r"= \w+\[([\d,]*)\][^=]*(?:all-reduce|all-to-all|collective-permute)\(", text):
            assert np.prod([int(d) for d in dims.split(",") if d]) * 8 < kv.size


def _verify_inputs(rng, num_slots: int, capacity: int = 24):
    buf = rng.integers(0, 2**32, (num_slots, 4, 2), dtype=np.uint32)
    slots = rng.integers(0, num_slots, capacity).astype(np.int32)
    prev = np.where(rng.random(capacity) < 0.2, -1, rng.integers(0, num_slots, capacity)).astype(np.int32)
    tokens = rng.integers(-1, 500, capacity).astype(np.int32)
    positions = rng.integers(0, 64, capacity).astype(np.int32)
    return buf, slots, tokens, positions, prev


def _run_verify(kv, buf, slots, tokens, positions, prev, backend="auto"):
    sources = (strided(kv, 1, 0), strided(kv, 1, 1))
    return verify_api.verify(buf, slots, tokens, positions, prev, jnp.int32(20), real_kv_sources=sources,
                             real_kv_hash_mode=2, check_expected_token=True, backend=backend)  # fmt: skip


_WRITE = dict(
    offsets=np.array([0, 3, 6], np.int32), seeds=np.array([-1, 5], np.int32), valid=np.array([2], np.int32),
    pos=np.array([0, 1, 2, 7, 8, 9, 0, 0], np.int32), loc=np.array([1, 2, 3, 6, 7, 8, -1, -1], np.int32),
)  # fmt: skip


def _run_write(kv, buf, ids, pos, loc, backend="auto"):
    w = _WRITE
    return write_api.write(buf, jnp.asarray(w["offsets"]), jnp.asarray(w["seeds"]), jnp.asarray(w["valid"]), ids, pos,
                           loc, jnp.ones((1,), jnp.int32), real_kv_sources=(strided(kv, 1, 0),), real_kv_hash_mode=1,
                           backend=backend)  # fmt: skip


@pytest.mark.parametrize("shape,axis_type", MESHES, ids=MESH_IDS)
def test_verify_and_write_accept_sharded_inputs(shape, axis_type):
    """Batch arrays P("data"), the canary buffer replicated, KV sharded as sglang-jax shards it: the same bits and
    bytes, jitted and eagerly, with backend 'auto' (which must take the xla path for them on every platform)."""
    mesh = _mesh(shape, axis_type)
    rng = np.random.default_rng(2)
    kv = fused_kv(rng, 1)
    buf, slots, tokens, positions, prev = _verify_inputs(rng, PAGES)
    data = P("data")
    put = lambda x, spec=data: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    kv_s, buf_s = put(kv, KV_SPEC), put(buf, P())

    verify = jax.jit(_run_verify)
    plain = verify(jnp.asarray(kv), *map(jnp.asarray, (buf, slots, tokens, positions, prev)))
    assert np.asarray(plain).any()
    sharded_args = (kv_s, buf_s, put(slots), put(tokens), put(positions), put(prev))
    chex.assert_trees_all_equal(np.asarray(verify(*sharded_args)), np.asarray(plain))
    chex.assert_trees_all_equal(np.asarray(_run_verify(*sharded_args)), np.asarray(plain))

    ids = rng.integers(0, 500, 8).astype(np.int32)
    write = jax.jit(_run_write)
    plain = jax.tree.map(np.asarray, write(jnp.asarray(kv), jnp.asarray(buf), *map(jnp.asarray, (ids, _WRITE["pos"],
                                                                                                _WRITE["loc"]))))  # fmt: skip
    sharded_args = (kv_s, buf_s, put(ids), put(_WRITE["pos"]), put(_WRITE["loc"]))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, write(*sharded_args)), plain)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, _run_write(*sharded_args)), plain)  # eagerly


@pytest.mark.parametrize("backend", ["pallas", "interpret", "interpret_tpu"])
def test_kernel_backends_refuse_explicit_shardings(backend):
    mesh = _mesh(SHAPE)
    rng = np.random.default_rng(3)
    kv = jax.device_put(fused_kv(rng, 1), NamedSharding(mesh, KV_SPEC))
    args = map(jnp.asarray, _verify_inputs(rng, PAGES))
    with pytest.raises(NotImplementedError, match=rf"backend='{backend}'.*explicit mesh sharding.*shard_map"):
        _run_verify(kv, *args, backend=backend)
    ids = jax.device_put(np.zeros(8, np.int32), NamedSharding(mesh, P("data")))
    with pytest.raises(NotImplementedError, match="shard_map"):
        jax.jit(_run_write, static_argnames="backend")(
            kv, jnp.zeros((PAGES, 4, 2), jnp.uint32), ids, ids, ids, backend=backend
        )
