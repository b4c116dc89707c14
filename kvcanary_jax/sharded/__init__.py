"""Sharded canaries over a ``jax.sharding.Mesh``: per-device state, the TP cross-shard check, one merged report."""

from kvcanary_jax.sharded._canary import ShardedKvCanary as ShardedKvCanary
from kvcanary_jax.sharded._check import cross_shard_check as cross_shard_check
from kvcanary_jax.sharded._layout import MeshLayout as MeshLayout
from kvcanary_jax.sharded._layout import local as local
from kvcanary_jax.sharded._layout import per_device as per_device
from kvcanary_jax.sharded._layout import stacked as stacked
from kvcanary_jax.sharded._monitor import ShardedCanaryMonitor as ShardedCanaryMonitor
from kvcanary_jax.sharded._report import DeviceObservedViolation as DeviceObservedViolation
from kvcanary_jax.sharded._report import DeviceViolation as DeviceViolation
from kvcanary_jax.sharded._report import MeshIncidents as MeshIncidents
from kvcanary_jax.sharded._report import ShardedViolationReport as ShardedViolationReport
from kvcanary_jax.sharded._report import read_sharded_violations as read_sharded_violations

__all__ = [
    "DeviceObservedViolation",
    "DeviceViolation",
    "MeshIncidents",
    "MeshLayout",
    "ShardedCanaryMonitor",
    "ShardedKvCanary",
    "ShardedViolationReport",
    "cross_shard_check",
    "local",
    "per_device",
    "read_sharded_violations",
    "stacked",
]
