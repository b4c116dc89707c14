"""``ShardedKvCanary`` on a scheduled workload: TP and DP layouts, clean soaks, one-device faults, per-shard equality.

Run by ``test_sharding_subprocess.py`` with 4 and 8 fake CPU devices.
"""

import dataclasses
import logging

import chex
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import KvCanaryHealthError, ShardedCanaryMonitor, ShardedKvCanary
from kvcanary_jax.testing import assert_no_violations, expect_violation
from tests.sharded.sharding_testlib import (
    CANARY,
    DEVICES,
    TRACES,
    Run,
    at,
    data_index,
    device_kv,
    mesh_layout,
    poked,
    replay_single_device,
    requires_devices,
)

pytestmark = requires_devices

# 4 devices: pure TP and pure DP; 8 devices: both on one 2-D mesh. Each layout compiles its step once (~15 s).
RUNNER_LAYOUTS = {4: ["tp4", "dp4"], 8: ["dp2_tp4"]}.get(DEVICES, [])
FIELDS = kc.CANARY_FIELDS_PER_SLOT


def _last_device(lay: kc.MeshLayout) -> tuple[int, ...]:
    return tuple(n - 1 for n in lay.shape)


@pytest.mark.parametrize("name", RUNNER_LAYOUTS)
def test_clean_soak_is_silent_on_every_device(name):
    run = Run.start(name)
    for _ in range(24):
        run.step()
    assert_no_violations(run.report())
    assert TRACES[run.lay] == 1  # one compile serves every batch
    lay, state = run.lay, run.state
    counters = np.asarray(state.device.kernel_run_counters)
    for coords, _ in lay.devices():  # every device launched every tag, the same number of times
        chex.assert_trees_all_equal(counters[coords], counters[(0,) * len(lay.shape)])
    assert counters[..., kc.CanaryLaunchTag.TAIL_K_FULL, 0].min() == 2 * 24  # a verify and a write per step
    if lay.tp_axis:  # TP shards agree on the chain but each folds its own KV bytes into REAL_KV_HASH
        tails = kc.records_as_int64(np.asarray(state.full.k_tail))  # int64[*mesh, num_slots, 4]
        tp = lay.axis_names.index(lay.tp_axis)
        chain = tails[..., : FIELDS - 1]
        assert (chain == np.take(chain, [0], axis=tp)).all()
        first, second = (np.take(tails[..., 1:, FIELDS - 1], i, axis=tp) for i in (0, 1))
        assert (first != 0).any() and (first != second)[first != 0].all()


@pytest.mark.parametrize("name", RUNNER_LAYOUTS)
def test_kv_fault_on_one_device_is_reported_by_that_device_only(name):
    run = Run.start(name, seed=1)
    for _ in range(6):
        run.step()
    faulty = _last_device(run.lay)
    slot, _ = run.decoding_slot(data_index(run.lay, faulty))
    run.flip_kv(faulty, slot)
    for _ in range(2):
        run.step()
    report = run.report()
    assert report.devices_with_violations == (faulty,)
    assert {dv.device for dv in report.violations} == {faulty} and len(report.violations) >= 2
    for dv in report.violations:
        v = dv.violation
        assert v.launch_tag == kc.CanaryLaunchTag.TAIL_K_FULL and v.slot_idx == slot and dv.peer is None
        assert v.fail_reason == kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert f"  device: {run.lay.label(faulty)}" in report.format()[0]


@pytest.mark.parametrize("name", RUNNER_LAYOUTS)
def test_chain_fault_on_one_device_is_reported_by_that_device_only(name):
    run = Run.start(name, seed=2)
    for _ in range(6):
        run.step()
    lay = run.lay
    faulty = _last_device(lay)
    _, seed_slot = run.decoding_slot(data_index(lay, faulty))
    # PREV_HASH of the slot the request's next record chains from, in this device's TAIL buffer only.
    tail = run.state.full.k_tail
    index = faulty + (seed_slot, FIELDS - 2, 0)
    full = dataclasses.replace(run.state.full, k_tail=poked(tail, index, np.asarray(tail)[index] ^ 1))
    run.state = dataclasses.replace(run.state, full=full)
    run.step()
    report = run.report()
    assert report.devices_with_violations == (faulty,)
    expect_violation(report, tag="TAIL_K_FULL", reason=kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    shard_rows = [dv for dv in report.violations if dv.violation.fail_reason & kc.FailReason.SHARD_CHAIN_MISMATCH]
    if lay.tp_axis is None:
        assert not shard_rows
        return
    # The next TAIL record chains from the corrupted seed, so this shard alone disagrees with its TP peers.
    consensus = tuple(0 if a == lay.tp_axis else c for a, c in zip(lay.axis_names, faulty, strict=True))
    assert shard_rows and all(dv.peer == consensus for dv in shard_rows)
    assert {dv.violation.launch_tag for dv in shard_rows} == {kc.CanaryLaunchTag.TAIL_K_FULL}


@pytest.mark.parametrize("name", RUNNER_LAYOUTS)
def test_sharded_results_equal_single_device_results_per_shard(name):
    run = Run.start(name, seed=3)
    for _ in range(5):
        run.step()
    faulty = _last_device(run.lay)
    run.flip_kv(faulty, run.decoding_slot(data_index(run.lay, faulty))[0])
    for _ in range(3):
        run.step()
    assert run.report().devices_with_violations == (faulty,)
    for coords, _ in run.lay.devices():
        want = replay_single_device(run, coords)
        got = (at(run.state, coords), *(device_kv(run.lay, kv, coords) for kv in (run.k, run.v)))
        chex.assert_trees_all_equal(got, want)  # state, buffers, ring, counters and KV, byte for byte


@pytest.mark.parametrize("name", RUNNER_LAYOUTS[:1])
def test_sweep_finds_an_idle_cache_fault_on_one_device_only(name):
    run = Run.start(name, seed=5)
    for _ in range(16):
        run.step()
    run.sweep()
    assert not run.report().is_errored
    faulty = _last_device(run.lay)
    idle = run.schedulers[data_index(run.lay, faulty)].sweep_entries(unlocked_only=True).slots
    run.flip_kv(faulty, int(idle[0]))
    run.sweep()
    report = run.report()
    assert report.devices_with_violations == (faulty,)
    (dv,) = report.violations
    assert dv.violation.launch_tag == kc.CanaryLaunchTag.SWEEP_K_FULL and dv.violation.slot_idx == idle[0]
    assert dv.violation.fail_reason == kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH


def test_layouts_cover_tp_and_dp():
    kinds = {(mesh_layout(n).tp_axis is not None, bool(mesh_layout(n).data_axes)) for n in RUNNER_LAYOUTS}
    assert kinds >= ({(True, True)} if len(RUNNER_LAYOUTS) == 1 else {(True, False), (False, True)})


def _monitored_run(name: str, mode: str, seed: int, **config) -> tuple[Run, ShardedCanaryMonitor]:
    run = Run.start(name, seed=seed)
    canary = kc.KvCanary(dataclasses.replace(CANARY.config, mode=mode, **config), CANARY.pool)
    return run, ShardedCanaryMonitor(ShardedKvCanary(canary, run.lay))


@pytest.mark.parametrize("name", RUNNER_LAYOUTS[:1])
def test_monitor_logs_violations_device_major_with_their_devices(name, caplog):
    run, mon = _monitored_run(name, "log", seed=4)
    for _ in range(5):
        run.step()
        mon.after_step(run.state)
    devices = [c for c, _ in run.lay.devices()]
    first, last = devices[0], devices[-1]
    for coords in (last, first):  # injected in reverse device order, reported device-major
        run.flip_kv(coords, run.decoding_slot(data_index(run.lay, coords))[0])
    with caplog.at_level(logging.WARNING):
        run.step()
        mon.after_step(run.state)  # lagged: the host has not read step 6 yet
        assert not mon.observed
        merged = mon.final_check(run.state)
    # One message per incident: the two flips are one incident when both devices hold the same data replica (its
    # TP shards: the same slot), else one each, device-major; every row is counted, every device named.
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-canary incident #")]
    same_replica = data_index(run.lay, first) == data_index(run.lay, last)
    assert len(messages) == len(mon.incidents.incidents) == (1 if same_replica else 2)
    assert len(mon.observed) == merged.write_index == sum(i.rows for i in mon.incidents.incidents) >= 2
    named = [m.split("\n  on devices: ")[1].split("\n")[0] for m in messages]
    assert named == ([f"{run.lay.label(first)}; {run.lay.label(last)}"] if same_replica else
                     [run.lay.label(first), run.lay.label(last)])  # fmt: skip
    assert all(m.count("\nkv_canary violation: ") == 1 for m in messages), "each incident's root row, once"
    assert [o.device for o in mon.observed] == [dv.device for dv in merged.violations]
    assert all(o.observed.step == 6 for o in mon.observed)


@pytest.mark.parametrize("name", RUNNER_LAYOUTS)
def test_monitor_raises_once_every_device_was_polled(name):
    run, mon = _monitored_run(name, "raise", seed=2, check_lag_steps=0)
    for _ in range(6):
        run.step()
        mon.after_step(run.state)
    faulty = _last_device(run.lay)
    run.flip_kv(faulty, run.decoding_slot(data_index(run.lay, faulty))[0])
    run.step()
    with pytest.raises(kc.KvCanaryViolationError) as caught:
        mon.after_step(run.state)
    assert caught.value.report.devices_with_violations == (faulty,)
    assert f"  device: {run.lay.label(faulty)}" in str(caught.value)
    assert str(caught.value).startswith("kv-canary incident #1: verify_real_kv_hash (TAIL_K_FULL) at request ")
    assert [i.rows for i in caught.value.incidents] == [len(caught.value.report.violations)]


@pytest.mark.parametrize("name", RUNNER_LAYOUTS[:1])
def test_monitor_health_error_names_every_stalled_device(name):
    run, mon = _monitored_run(name, "log", seed=0, health_check_every_n_steps=1, check_lag_steps=0)
    run.step()
    mon.after_step(run.state)
    with pytest.raises(KvCanaryHealthError) as caught:
        mon.after_step(run.state)  # the same state again: no launch ran since the last check
    for coords, _ in run.lay.devices():
        assert f"device {run.lay.label(coords)}: kv-canary: kernel_run_counter did not increase" in str(caught.value)
