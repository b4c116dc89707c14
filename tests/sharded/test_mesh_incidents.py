"""Incidents over a mesh: a data replica's TP shards seeing one fault give one incident; replicas never share one."""

import dataclasses

import jax
import numpy as np

import kvcanary_jax as kc
from kvcanary_jax.core import _incidents
from kvcanary_jax.sharded._report import DeviceViolation, MeshIncidents
from tests.core.test_core_incidents import GOLDEN, KV, T, _row

# A dp x tp layout; grouping reads only its axis names (the rows below name devices of a 2 x 2 mesh).
LAYOUT = kc.MeshLayout(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "tp")), tp_axis="tp")
REMAP_ROWS, (REMAP_HEADLINE,) = GOLDEN["req_to_token FULL"]  # request row 3's entry 16 remapped: 8 rows per device


def test_tp_shards_of_a_replica_share_an_incident_and_replicas_do_not():
    other_replica = _row(T.TAIL_K_FULL, 50, 20, 7, 7, KV, 3, 20, 0)  # request row 3 of replica 1: another request
    tracker = MeshIncidents(LAYOUT)
    rows = [(DeviceViolation(d, dataclasses.replace(v)), 12) for d in ((0, 0), (0, 1)) for v in REMAP_ROWS]  # copies
    placed = tracker.add(rows + [(DeviceViolation((1, 1), other_replica), 12)])
    first, second = tracker.incidents
    assert first.headline() == REMAP_HEADLINE.replace("explains 8 row(s)", "explains 16 row(s)")
    assert (second.root, second.rows, second.step) == (other_replica, 1, 12)
    notes = ["  on devices: dp=0,tp=0; dp=0,tp=1", "  on devices: dp=1,tp=1"]
    assert [tracker.note(i) for i in tracker.incidents] == notes
    raw = lambda v: f"RAW slot={v.slot_idx}"  # noqa: E731
    assert _incidents.messages(placed, opened=0, raw=raw, note=tracker.note) == [
        REMAP_HEADLINE.replace("8 row(s)", "16 row(s)") + "\n  on devices: dp=0,tp=0; dp=0,tp=1\nRAW slot=260",
        second.headline() + "\n  on devices: dp=1,tp=1\nRAW slot=50",
    ]
    again = tracker.add([(DeviceViolation((0, 1), v), 13) for v in REMAP_ROWS[:2]])  # the same slots, a step later
    assert _incidents.messages(again, opened=2, raw=raw, note=tracker.note) == [
        "kv-canary incident #1: 2 more row(s) at step 13 (18 in all): the same fault, already reported\n"
        "  on devices: dp=0,tp=0; dp=0,tp=1"
    ]
