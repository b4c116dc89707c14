"""The runner, the core ops and the fault injectors on inputs typed with a mesh sharding (sglang-jax's).

Batch arrays ``P("data")``, KV ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]`` sharded
``P("data", None, "tensor", None, None)`` and read through strided K / V sources; two requests in a batch of four
rows with interleaved padding rows, as sglang-jax pads each data-parallel rank. In this process the cases run on a
1 x 1 mesh; ``tests/sharded/test_sharding_subprocess.py`` runs this file again with 4 fake CPU devices (2 x 2
meshes, explicit and auto axes). Each case must give exactly the state of the same run on plain arrays.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax import testing

SHAPE = (2, 2) if len(jax.devices()) >= 4 else (1, 1)
MESHES = [(SHAPE, AxisType.Explicit)] + ([(SHAPE, AxisType.Auto)] if SHAPE == (2, 2) else [])
MESH_IDS = [f"{d}x{t}-{a.name.lower()}" for (d, t), a in MESHES]
KV_SPEC = P("data", None, "tensor", None, None)
NUM_SLOTS, HEADS, HEAD_DIM = 32, 2, 128
HEAD_BYTES = HEAD_DIM * 2  # bf16
CONFIG = kc.CanaryConfig(
    mode="log", ring_capacity=16, real_kv_hash_mode="all", sweep_interval=1, enable_write_input_assert=True,
    backend="auto",
)  # fmt: skip
CANARY = kc.KvCanary(CONFIG, kc.CanaryPool(num_slots=NUM_SLOTS, page_size=1))


def _mesh(shape, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, ("data", "tensor"), axis_types=(axis_type,) * 2)


def _sources(kv):
    common = dict(page_size=1, read_bytes=HEADS * HEAD_BYTES, segment_bytes=HEAD_BYTES, segment_stride=2 * HEAD_BYTES)
    k = kc.RealKvSource(kv, byte_offset=0, **common)
    v = kc.RealKvSource(kv, byte_offset=HEAD_BYTES, **common)
    return CANARY.kv_sources(full_k=k, full_v=v)


# Requests in table rows 0 and 1 (row 0 is real; -1 pads), batch rows interleaved with padding rows: prefill
# (4 + 3 tokens), then one decode token each.
TABLE = np.zeros((2, 8), np.int32)
TABLE[0, :5] = [1, 2, 3, 4, 8]
TABLE[1, :4] = [5, 6, 7, 9]
STEPS = [
    dict(rows=[0, -1, 1, -1], prefix=[0, 0, 0, 0], extend=[4, 0, 3, 0], ids=[11, 12, 13, 14, 21, 22, 23, 0],
         pos=[0, 1, 2, 3, 0, 1, 2, 0], loc=[1, 2, 3, 4, 5, 6, 7, -1]),
    dict(rows=[0, -1, 1, -1], prefix=[4, 0, 3, 0], extend=[1, 0, 1, 0], ids=[15, 24, 0, 0, 0, 0, 0, 0],
         pos=[4, 3, 0, 0, 0, 0, 0, 0], loc=[8, 9, -1, -1, -1, -1, -1, -1]),
]  # fmt: skip


def _batch(step, expected=None):
    s = STEPS[step]
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return kc.CanaryBatch(
        req_pool_indices=i32(s["rows"]), prefix_lens=i32(s["prefix"]), extend_lens=i32(s["extend"]),
        req_to_token=TABLE, input_ids=i32(s["ids"]), positions=i32(s["pos"]), out_cache_loc=i32(s["loc"]),
        expected_input_ids=i32(s["ids"] if expected is None else expected),
    )  # fmt: skip


def _kv(seed=0):
    raw = np.random.default_rng(seed).integers(0, 256, NUM_SLOTS * HEADS * 2 * HEAD_DIM * 2, dtype=np.uint8)
    return raw.view(jnp.bfloat16).reshape(NUM_SLOTS, 1, HEADS, 2, HEAD_DIM)  # packing 2: [pages, 1, 2H/2, 2, hd]


@jax.jit
def _step(state, batch, kv):
    state = CANARY.before_forward(state, batch)
    return CANARY.after_forward(state, batch, _sources(kv))


@jax.jit
def _sweep(state, plan, kv):
    return CANARY.sweep(state, plan, _sources(kv))


def _run(put_batch, put_kv, *, swap=False, put_state=lambda state: state):
    """Prefill; a flipped K byte of slot 2 and (optionally) a swapped decode token; decode; a sweep."""
    state, kv = put_state(CANARY.init_state()), put_kv(_kv())
    state = _step(state, put_batch(_batch(0)), kv)
    kv = testing.flip_kv_byte(kv, jnp.int32(2), page_size=1)
    batch = put_batch(_batch(1))
    if swap:
        batch = dataclasses.replace(batch, input_ids=testing.swap_tokens(batch.input_ids, 0, 1))
    state = _step(state, batch, kv)
    entries = kc.SweepEntries(*(np.asarray(x, np.int32) for x in ([1, 2, 3, 4], [0, 1, 2, 3], [-1, 1, 2, 3])))
    state = _sweep(state, CANARY.sweep_plan(entries), kv)
    return jax.tree.map(np.asarray, state)


def _plain(batch):
    return jax.tree.map(jnp.asarray, batch)


def _placers(shape, axis_type=AxisType.Explicit):
    mesh = _mesh(shape, axis_type)

    def put_batch(batch):
        def one(x):
            x = np.asarray(x)
            spec = P("data", *([None] * (x.ndim - 1))) if x.shape[0] % shape[0] == 0 else P()
            return jax.device_put(x, NamedSharding(mesh, spec))

        return jax.tree.map(one, batch)

    return put_batch, lambda kv: jax.device_put(kv, NamedSharding(mesh, KV_SPEC)), mesh


def _replicated(mesh):
    """Places a state as the ops return it (replicated, one ``None`` per axis), so the step compiles once."""
    return lambda tree: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(*([None] * x.ndim)))), tree)


@pytest.mark.parametrize("shape", [SHAPE], ids=[f"{SHAPE[0]}x{SHAPE[1]}-explicit"])
def test_runner_on_sharded_inputs_matches_plain_arrays(shape):
    """HEAD, TAIL and SWEEP with K and V as strided views of one sharded fused array: the plain run's state.
    (Explicit axes only: each mesh type compiles the whole step again, and auto axes are covered below.)"""
    put_batch, put_kv, mesh = _placers(shape)
    want = _run(_plain, jnp.asarray)
    chex.assert_trees_all_equal(_run(put_batch, put_kv, put_state=_replicated(mesh)), want)
    report = kc.read_violations(want.device.violation_log)
    seen = {(kc.CanaryLaunchTag(v.launch_tag).name, v.slot_idx, v.fail_reason) for v in report.violations}
    real_kv = kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert seen == {("TAIL_K_FULL", 2, real_kv), ("SWEEP_K_FULL", 2, real_kv)}, seen  # K byte 0 of slot 2 only


def _same_sharding(x, y) -> bool:
    return x.sharding.is_equivalent_to(y.sharding, y.ndim)


@pytest.mark.parametrize("shape,axis_type", MESHES, ids=MESH_IDS)
def test_injectors_keep_the_sharding(shape, axis_type):
    put_batch, put_kv, mesh = _placers(shape, axis_type)
    kv = put_kv(_kv())
    byte = HEAD_BYTES + 3  # a V byte, not the first of its element
    flipped = testing.flip_kv_byte(kv, jnp.int32(5), page_size=1, byte=byte)
    assert _same_sharding(flipped, kv)
    want = testing.flip_kv_byte(jnp.asarray(_kv()), jnp.int32(5), page_size=1, byte=byte)
    chex.assert_trees_all_equal(np.asarray(flipped), np.asarray(want))
    assert (np.asarray(want).view(np.uint8) != _kv().view(np.uint8)).sum() == 1
    page = testing.corrupt_page(kv, jnp.int32(3), page_size=1, byte=1)
    assert _same_sharding(page, kv)
    ids = jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P("data")))
    swapped = testing.swap_tokens(ids, 1, 6)
    assert _same_sharding(swapped, ids) and list(np.asarray(swapped)) == [0, 6, 2, 3, 4, 5, 1, 7]
    table = jax.device_put(TABLE, NamedSharding(mesh, P("data")))
    remapped = testing.remap_slot(table, 1, 2, 5)
    assert _same_sharding(remapped, table) and int(np.asarray(remapped)[1, 2]) == 5
    if axis_type != AxisType.Explicit:
        return  # the step below compiles once more per mesh type
    # A swapped token is reported by the write-input assert, on sharded inputs as on plain ones.
    want = _run(_plain, jnp.asarray, swap=True)
    chex.assert_trees_all_equal(_run(put_batch, put_kv, swap=True, put_state=_replicated(mesh)), want)
    testing.expect_violation(want, tag="HEAD_K_FULL", reason=kc.FailReason.WRITE_TOKEN_MISMATCH, slot=8)


@pytest.mark.parametrize("shape,axis_type", MESHES, ids=MESH_IDS)
def test_core_ops_on_sharded_inputs(shape, axis_type):
    put_batch, put_kv, _ = _placers(shape, axis_type)
    batch = _batch(1)  # SGLang's row convention for the core ops: table row 0 pads
    rows = np.where(batch.req_pool_indices >= 0, batch.req_pool_indices + 2, 0).astype(np.int32)
    table = np.concatenate([np.zeros((2, TABLE.shape[1]), np.int32), TABLE])  # 4 rows: shardable 2 ways
    batch = dataclasses.replace(batch, req_pool_indices=rows, req_to_token=table)
    config = kc.CanaryConfig(ring_capacity=8)
    buf = jnp.asarray(np.random.default_rng(4).integers(0, 2**32, (NUM_SLOTS, 4, 2), dtype=np.uint32))

    @jax.jit
    def ops(state, buf, batch, kv):
        vp, wp = kc.build_plans(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.req_to_token,
                                verify_capacity=16, write_req_capacity=4)  # fmt: skip
        sources = _sources(kv).full_k
        state = kc.canary_verify(state, buf, vp, tag=kc.CanaryLaunchTag.TAIL_K_FULL, real_kv_sources=sources,
                                 real_kv_hash_mode="partial")  # fmt: skip
        return kc.canary_write(state, buf, wp, batch.input_ids, batch.positions, batch.out_cache_loc,
                               tag=kc.CanaryLaunchTag.TAIL_K_FULL, real_kv_sources=sources,
                               real_kv_hash_mode="partial")  # fmt: skip

    state = kc.CanaryDeviceState.allocate(config=config)
    want = ops(state, buf, _plain(batch), jnp.asarray(_kv()))
    got = ops(state, buf, put_batch(batch), put_kv(_kv()))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
    assert int(want[1].violation_log.violation_write_index[0]) > 0  # a random buffer: verify reports
