"""Wrapping a decode loop: ``KvCanary`` and its pytrees, the pool description, sweeps, ``fence``, the host monitor."""

from kvcanary_jax.runtime._adopt import AdoptEntries as AdoptEntries
from kvcanary_jax.runtime._adopt import AdoptPlan as AdoptPlan
from kvcanary_jax.runtime._batch import CanaryBatch as CanaryBatch
from kvcanary_jax.runtime._batch import CanaryState as CanaryState
from kvcanary_jax.runtime._canary import KvCanary as KvCanary
from kvcanary_jax.runtime._fence import fence as fence
from kvcanary_jax.runtime._health import KvCanaryHealthError as KvCanaryHealthError
from kvcanary_jax.runtime._monitor import CanaryMonitor as CanaryMonitor
from kvcanary_jax.runtime._monitor import ObservedViolation as ObservedViolation
from kvcanary_jax.runtime._pool import CanaryPool as CanaryPool
from kvcanary_jax.runtime._pool import KvSources as KvSources
from kvcanary_jax.runtime._pool import SwaGroup as SwaGroup
from kvcanary_jax.runtime._sweep import SweepEntries as SweepEntries
from kvcanary_jax.runtime._sweep import SweepPlan as SweepPlan
from kvcanary_jax.runtime._sweep import walk_prefix_tree as walk_prefix_tree

__all__ = [
    "AdoptEntries",
    "AdoptPlan",
    "CanaryBatch",
    "CanaryMonitor",
    "CanaryPool",
    "CanaryState",
    "KvCanary",
    "KvCanaryHealthError",
    "KvSources",
    "ObservedViolation",
    "SwaGroup",
    "SweepEntries",
    "SweepPlan",
    "fence",
    "walk_prefix_tree",
]
