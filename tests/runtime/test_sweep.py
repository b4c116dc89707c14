"""The sweep's host side (prefix-tree walk, SWA translation, packing) and its device side on the tiny model."""

import dataclasses

import numpy as np
import pytest

from kvcanary_jax import CanaryLaunchTag, FailReason, read_violations, testing
from kvcanary_jax.runtime import _sweep as sweep
from kvcanary_jax.testing import assert_no_violations, expect_violation
from tests.runtime.runner_testlib import TINY_CANARY, run_steps, tiny_setup

T = CanaryLaunchTag


@dataclasses.dataclass
class Node:
    slots: list
    children: list = dataclasses.field(default_factory=list)
    idle: bool = True


def _tree():
    #        root
    #       /    \
    #   [5, 6]   [9]
    #    /   \
    #  [7]   [8, 3]   (the [5, 6] node is in use)
    return Node([], [Node([5, 6], [Node([7]), Node([8, 3])], idle=False), Node([9])])


def _walk(root, **kw):
    return sweep.walk_prefix_tree(root, children=lambda n: n.children, slots=lambda n: n.slots, **kw)


def test_walk_emits_depth_first_with_path_predecessors():
    e = _walk(_tree())
    assert e.slots.tolist() == [5, 6, 7, 8, 3, 9]
    assert e.positions.tolist() == [0, 1, 2, 2, 3, 0]
    assert e.prev_slots.tolist() == [-1, 5, 6, 6, 8, -1]
    idle = _walk(_tree(), include=lambda n: n.idle)
    assert idle.slots.tolist() == [7, 8, 3, 9] and idle.prev_slots.tolist() == [6, 6, 8, -1]
    assert len(_walk(Node([])).slots) == 0


def test_swa_translation_drops_evicted_slots_and_unlinks_their_successors():
    lut = np.zeros(10, np.int32)
    lut[[6, 7, 8, 3]] = [1, 2, 3, 4]  # 5 and 9 are not SWA-resident
    e = sweep.translate_entries(_walk(_tree()), lut)
    assert e.slots.tolist() == [1, 2, 3, 4]
    assert e.positions.tolist() == [1, 2, 2, 3]
    assert e.prev_slots.tolist() == [0, 1, 1, 3]  # slot 6's predecessor (5) is gone: unreachable, not -1


def test_pack_entries_pads_to_the_static_capacity():
    plan = sweep.pack_entries(_walk(_tree()), 10)
    assert plan.slot_indices.shape == (10,) and int(plan.num_valid[0]) == 6 and int(plan.enable[0]) == 1
    assert plan.expected_tokens.tolist() == [-1] * 10 and plan.slot_indices.tolist()[6:] == [0] * 4


@pytest.mark.parametrize(
    ("field", "index", "value", "pattern"),
    [
        ("slots", 2, 10, r"SweepEntries.slots\[2\] = 10 is out of range \(slots are 1..9"),
        ("slots", 0, 0, r"SweepEntries.slots\[0\] = 0 .* slot 0 is the reserved padding slot"),
        ("prev_slots", 3, -5, r"SweepEntries.prev_slots\[3\] = -5 is out of range"),
        ("positions", 1, -1, r"SweepEntries.positions\[1\] = -1 is out of range"),
    ],
)
def test_pack_entries_refuses_slots_the_pool_does_not_have(field, index, value, pattern):
    entries = _walk(_tree())._asdict()
    entries[field] = entries[field].copy()
    entries[field][index] = value
    with pytest.raises(ValueError, match=pattern):
        sweep.pack_entries(sweep.SweepEntries(**entries), 10, what="FULL sweep")


def test_device_sweep_over_a_flat_entry_list():
    """Clean chains pass; a KV flip, a wrong predecessor and a wrong position are each caught by SWEEP."""
    setup = tiny_setup(seed=5)
    run_steps(setup, 40)
    setup.monitor.final_check(setup.canary_state)
    entries = setup.scheduler.sweep_entries()
    assert len(entries.slots) > 5

    def sweep_report(entries):
        state = setup.sweep_fn(setup.canary_state, TINY_CANARY.sweep_plan(entries), setup.kv_cache)
        setup.canary_state = state
        return read_violations(state.violation_log)

    assert_no_violations(sweep_report(entries))
    slots, positions, prevs = (np.array(x) for x in entries)
    chained = np.flatnonzero(prevs > 0)[0]
    prevs[chained] = slots[0] if slots[0] != prevs[chained] else slots[1]
    positions[1] += 7
    report = sweep_report(sweep.SweepEntries(slots, positions, prevs))
    expect_violation(report, tag=T.SWEEP_K_FULL, reason=FailReason.VERIFY_CHAIN_HASH_MISMATCH, slot=int(slots[chained]))
    expect_violation(report, tag=T.SWEEP_V_FULL, reason=FailReason.VERIFY_POSITION_MISMATCH, slot=int(slots[1]))
    before = report.write_index
    k = list(setup.kv_cache.k)
    k[0] = testing.flip_kv_byte(k[0], np.int32(slots[2]), page_size=setup.layout.page_size, byte=5)
    setup.kv_cache = dataclasses.replace(setup.kv_cache, k=tuple(k))
    new = read_violations(
        setup.sweep_fn(setup.canary_state, TINY_CANARY.sweep_plan(entries), setup.kv_cache).violation_log
    ).violations[before:]
    assert [(v.launch_tag, v.slot_idx, v.fail_reason) for v in new] == [
        (T.SWEEP_K_FULL, int(slots[2]), FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    ]
