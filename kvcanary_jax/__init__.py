"""kvcanary-jax: SGLang's KV-cache canary for JAX decode loops.

The public surface, by tier (see ``__all__``): wrap a decode loop; run it on a mesh; SGLang-compatible ops and
plans; read reports; constants. ``kvcanary_jax.testing`` holds what a user's test suite needs.

Privacy rule: a ``_name`` (module or definition) is private to the package that defines it, and each package's
``__init__.py`` lists its public names. Of the lower layer, this package imports only each op's ``api`` module
(``pallas_kernels.<op>.api``) and the shared top-level modules (``pallas_kernels.backend``, ``validate``, ``hash64``,
...), never an op's ``reference``, ``common`` or kernel modules.
"""

from kvcanary_jax import testing as testing  # the test tier, as kvcanary_jax.testing (numpy.testing's manner)
from kvcanary_jax.core import (
    ANCHOR_HASH,
    CANARY_CHAIN_ANCHOR,
    CANARY_FIELDS_PER_SLOT,
    NUM_LAUNCH_TAGS,
    VIOLATION_FIELDS,
    CanaryConfig,
    CanaryDeviceState,
    CanaryLaunchTag,
    CanaryMode,
    FailReason,
    Half,
    Incident,
    Incidents,
    InputField,
    InputProblem,
    KvCanaryViolationError,
    Phase,
    PoolKind,
    RealKvHashMode,
    RealKvSource,
    VerifyPlan,
    Violation,
    ViolationLog,
    ViolationReport,
    WritePlan,
    allocate_canary_buffer,
    build_plans,
    canary_verify,
    canary_write,
    format_violation,
    launch_tag,
    read_violations,
    records_as_int64,
    restore_and_verify,
    restore_records,
    snapshot_records,
)
from kvcanary_jax.runtime import (
    AdoptEntries,
    AdoptPlan,
    CanaryBatch,
    CanaryMonitor,
    CanaryPool,
    CanaryState,
    KvCanary,
    KvCanaryHealthError,
    KvSources,
    ObservedViolation,
    SwaGroup,
    SweepEntries,
    SweepPlan,
    fence,
    walk_prefix_tree,
)
from kvcanary_jax.sharded import (
    DeviceObservedViolation,
    DeviceViolation,
    MeshIncidents,
    MeshLayout,
    ShardedCanaryMonitor,
    ShardedKvCanary,
    ShardedViolationReport,
    local,
    per_device,
    read_sharded_violations,
    stacked,
)


def _public(names: list[str], module: str) -> None:
    """Public classes show the module users import them from (``kvcanary_jax.KvCanaryViolationError``)."""
    for name in names:
        value = globals()[name] if module == __name__ else getattr(testing, name)
        if isinstance(value, type) and value.__module__.startswith("kvcanary_jax."):
            value.__module__ = module


__all__ = [
    # Wrap a decode loop: the canary, its state and batch, the pool, real-KV sources, sweeps, fence, the monitor.
    "AdoptEntries",
    "AdoptPlan",
    "CanaryBatch",
    "CanaryConfig",
    "CanaryMonitor",
    "CanaryPool",
    "CanaryState",
    "KvCanary",
    "KvSources",
    "RealKvSource",
    "SwaGroup",
    "SweepEntries",
    "SweepPlan",
    "fence",
    "walk_prefix_tree",
    # Run it on a mesh: per-device state, the sharded canary and monitor, shard_map views.
    "MeshLayout",
    "ShardedCanaryMonitor",
    "ShardedKvCanary",
    "local",
    "per_device",
    "stacked",
    # SGLang-compatible ops and plans: the building blocks KvCanary is made of.
    "CanaryDeviceState",
    "VerifyPlan",
    "ViolationLog",
    "WritePlan",
    "allocate_canary_buffer",
    "build_plans",
    "canary_verify",
    "canary_write",
    "restore_and_verify",
    "restore_records",
    "snapshot_records",
    # Read reports: the host reader, its rows and messages, the errors the monitor raises.
    "DeviceObservedViolation",
    "DeviceViolation",
    "Incident",
    "Incidents",
    "KvCanaryHealthError",
    "KvCanaryViolationError",
    "MeshIncidents",
    "ObservedViolation",
    "ShardedViolationReport",
    "Violation",
    "ViolationReport",
    "format_violation",
    "read_sharded_violations",
    "read_violations",
    "records_as_int64",
    # Constants and enums, with SGLang's names and values.
    "ANCHOR_HASH",
    "CANARY_CHAIN_ANCHOR",
    "CANARY_FIELDS_PER_SLOT",
    "NUM_LAUNCH_TAGS",
    "VIOLATION_FIELDS",
    "CanaryLaunchTag",
    "CanaryMode",
    "FailReason",
    "Half",
    "InputField",
    "InputProblem",
    "Phase",
    "PoolKind",
    "RealKvHashMode",
    "launch_tag",
]

_public(__all__, __name__)
_public(testing.__all__, testing.__name__)
