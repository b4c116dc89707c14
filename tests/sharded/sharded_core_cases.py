"""Per-device state, the cross-shard chain check and the merged report, on the core ops (no runner).

Run by ``test_sharding_subprocess.py`` with 4 and 8 fake CPU devices.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import kvcanary_jax as kc
from kvcanary_jax.sharded import cross_shard_check
from tests.sharded.sharding_testlib import LAYOUTS, LAYOUTS_HERE, at, mesh_layout, poked, requires_devices, tp_size

pytestmark = requires_devices

NUM_SLOTS, RING = 16, 8
TAG = kc.CanaryLaunchTag.TAIL_K_FULL
OUT_CACHE_LOC = jnp.array([3, 5, 0, -1, 7, 99], jnp.int32)  # slots 3, 5, 7 are live; 0, -1, 99 are skipped
TP_LAYOUTS = [n for n in LAYOUTS_HERE if LAYOUTS[n][2]]


def _template() -> tuple[kc.CanaryDeviceState, jax.Array]:
    state = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(ring_capacity=RING, backend="xla"))
    records = np.random.default_rng(0).integers(0, 2**32, (NUM_SLOTS, 4, 2), dtype=np.uint32)
    return state, jnp.asarray(records)


def _check(lay: kc.MeshLayout, state, buf):
    spec = lay.device_spec

    def body(state, buf, loc):
        state, buf = kc.local((state, buf), spec)
        state = cross_shard_check(state, buf, loc, mesh_layout=lay, tag=TAG)
        return kc.stacked(state, spec)

    mapped = jax.shard_map(body, mesh=lay.mesh, in_specs=(spec, spec, PartitionSpec()), out_specs=spec)
    return jax.jit(mapped)(state, buf, OUT_CACHE_LOC)


def _device(lay: kc.MeshLayout, **coords: int) -> tuple[int, ...]:
    return tuple(coords.get(name, 0) for name in lay.axis_names)


def test_mesh_layout_specs_order_and_validation():
    lay = mesh_layout(LAYOUTS_HERE[-1])
    assert lay.device_spec == PartitionSpec(*lay.axis_names)
    assert lay.data_spec == PartitionSpec(*lay.data_axes)
    coords = [c for c, _ in lay.devices()]
    assert coords == sorted(coords) and len(coords) == lay.mesh.size  # device-major: row-major mesh coordinates
    assert [d for _, d in lay.devices()] == list(lay.mesh.devices.flat)
    assert lay.label(coords[-1]) == ",".join(f"{a}={n - 1}" for a, n in zip(lay.axis_names, lay.shape, strict=True))
    with pytest.raises(ValueError, match="tp_axis must be a mesh axis"):
        kc.MeshLayout(lay.mesh, tp_axis="heads")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        kc.MeshLayout("mesh")


@pytest.mark.parametrize("name", LAYOUTS_HERE)
def test_per_device_puts_one_copy_on_each_device(name):
    lay = mesh_layout(name)
    template = _template()
    state, buf = kc.per_device(template, lay)
    assert buf.shape == lay.shape + (NUM_SLOTS, 4, 2)
    for shard in buf.addressable_shards:
        coords = tuple(s.start for s in shard.index[: len(lay.shape)])
        assert shard.device == lay.mesh.devices[coords]
        assert shard.data.shape == (1,) * len(lay.shape) + (NUM_SLOTS, 4, 2)
    for coords, _ in lay.devices():
        chex.assert_trees_all_equal(at((state, buf), coords), jax.tree.map(np.asarray, template))


@pytest.mark.parametrize("name", TP_LAYOUTS)
def test_agreeing_shards_are_silent_even_with_different_real_kv(name):
    lay = mesh_layout(name)
    state, buf = kc.per_device(_template(), lay)
    for i, (coords, _) in enumerate(lay.devices()):  # every device folds other KV bytes: REAL_KV_HASH differs
        buf = poked(buf, coords + (5, kc.CANARY_FIELDS_PER_SLOT - 1, 0), 1000 + i)
    out = _check(lay, state, buf)
    report = kc.read_sharded_violations(out.violation_log, lay)
    assert not report.is_errored and report.violations == ()
    chex.assert_trees_all_equal(at(out, ()), at(state, ()))  # counters untouched: not one of SGLang's launches


@pytest.mark.parametrize("name", TP_LAYOUTS)
@pytest.mark.parametrize("faulty_tp", [0, -1])
def test_the_minority_shard_reports_and_names_the_consensus(name, faulty_tp):
    lay = mesh_layout(name)
    tp = tp_size(lay)
    faulty = _device(lay, dp=lay.shape[0] - 1, tp=faulty_tp % tp)
    state, buf = kc.per_device(_template(), lay)
    good = at(buf, faulty)
    buf = poked(buf, faulty + (7, 0, 0), good[7, 0, 0] ^ 1)  # TOKEN of slot 7
    buf = poked(buf, faulty + (0, 2, 0), 12345)  # padding slot 0 is never compared
    report = kc.read_sharded_violations(_check(lay, state, buf).violation_log, lay)
    if tp == 2:  # a tie: the consensus is TP index 0, so the second shard reports either way
        reporter, peer = _device(lay, dp=faulty[0], tp=1), _device(lay, dp=faulty[0], tp=0)
        reporter_buf, peer_buf = at(buf, reporter), at(buf, peer)
    else:
        reporter, peer = faulty, _device(lay, dp=faulty[0], tp=1 if faulty_tp % tp == 0 else 0)
        reporter_buf, peer_buf = at(buf, faulty), good
    assert report.devices_with_violations == (reporter,) and report.write_index == 1
    (dv,) = report.violations
    assert dv.device == reporter and dv.peer == peer
    v = dv.violation
    assert v.launch_tag == TAG and v.fail_reason == kc.FailReason.SHARD_CHAIN_MISMATCH and v.slot_idx == 7
    rec, want = kc.records_as_int64(reporter_buf)[7], kc.records_as_int64(peer_buf)[7]
    assert (v.position, v.stored_token, v.stored_chain_hash) == (rec[1], rec[0], rec[2])
    assert (v.expected_token, v.expected_aux) == (want[0], want[2])
    text = report.format(step=3)[0]
    first_line = "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=shard_chain slot_idx=7 "
    assert text.splitlines()[0].startswith(first_line)
    assert f"  device: {lay.label(reporter)}" in text and f"  peer: {lay.label(peer)}" in text


def test_without_a_tp_axis_the_check_is_a_no_op():
    lay = kc.MeshLayout(mesh_layout(LAYOUTS_HERE[0]).mesh, tp_axis=None)
    state, buf = _template()
    assert cross_shard_check(state, buf, OUT_CACHE_LOC, mesh_layout=lay, tag=TAG) is state


@pytest.mark.parametrize("name", TP_LAYOUTS[-1:])
def test_merged_report_is_device_major_and_counts_per_device(name):
    lay = mesh_layout(name)
    state, buf = kc.per_device(_template(), lay)
    devices = [c for c, _ in lay.devices()]
    late, early = devices[-1], devices[1]  # corrupt the later device first: order must not follow fault order
    for coords, slot in ((late, 3), (late, 5), (early, 5)):
        buf = poked(buf, coords + (slot, 1, 0), 777)
    report = kc.read_sharded_violations(_check(lay, state, buf).violation_log, lay)
    assert [(v.device, v.violation.slot_idx) for v in report.violations] == [(early, 5), (late, 3), (late, 5)]
    assert report.write_index == 3 and report.per_device[late].write_index == 2
    assert not report.overflowed and report.devices_with_violations == (early, late)
    assert "total_violations=2" in report.format()[-1]


def test_read_rejects_a_single_device_log():
    lay = mesh_layout(LAYOUTS_HERE[0])
    with pytest.raises(ValueError, match="must be per-device"):
        kc.read_sharded_violations(kc.ViolationLog.allocate(ring_capacity=4), lay)
