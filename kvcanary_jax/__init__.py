"""kvcanary-jax: SGLang's KV-cache canary for JAX decode loops."""

from kvcanary_jax.config import CanaryConfig as CanaryConfig
from kvcanary_jax.constants import ANCHOR_HASH as ANCHOR_HASH
from kvcanary_jax.constants import CANARY_CHAIN_ANCHOR as CANARY_CHAIN_ANCHOR
from kvcanary_jax.constants import CANARY_FIELDS_PER_SLOT as CANARY_FIELDS_PER_SLOT
from kvcanary_jax.constants import NUM_LAUNCH_TAGS as NUM_LAUNCH_TAGS
from kvcanary_jax.constants import VIOLATION_FIELDS as VIOLATION_FIELDS
from kvcanary_jax.constants import CanaryLaunchTag as CanaryLaunchTag
from kvcanary_jax.constants import CanaryMode as CanaryMode
from kvcanary_jax.constants import FailReason as FailReason
from kvcanary_jax.constants import PoolKind as PoolKind
from kvcanary_jax.constants import RealKvHashMode as RealKvHashMode
from kvcanary_jax.health import KvCanaryHealthError as KvCanaryHealthError
from kvcanary_jax.monitor import CanaryMonitor as CanaryMonitor
from kvcanary_jax.ops import canary_verify as canary_verify
from kvcanary_jax.ops import canary_write as canary_write
from kvcanary_jax.plans import VerifyPlan as VerifyPlan
from kvcanary_jax.plans import WritePlan as WritePlan
from kvcanary_jax.plans import build_plans as build_plans
from kvcanary_jax.pool import CanaryPool as CanaryPool
from kvcanary_jax.pool import KvSources as KvSources
from kvcanary_jax.pool import SwaGroup as SwaGroup
from kvcanary_jax.report import KvCanaryViolationError as KvCanaryViolationError
from kvcanary_jax.report import Violation as Violation
from kvcanary_jax.report import ViolationReport as ViolationReport
from kvcanary_jax.report import format_violation as format_violation
from kvcanary_jax.report import read_violations as read_violations
from kvcanary_jax.runner import CanaryBatch as CanaryBatch
from kvcanary_jax.runner import CanaryState as CanaryState
from kvcanary_jax.runner import KvCanary as KvCanary
from kvcanary_jax.runner import fence as fence
from kvcanary_jax.state import CanaryDeviceState as CanaryDeviceState
from kvcanary_jax.state import ViolationLog as ViolationLog
from kvcanary_jax.state import allocate_canary_buffer as allocate_canary_buffer
from kvcanary_jax.state import records_as_int64 as records_as_int64
from kvcanary_jax.sweep import SweepEntries as SweepEntries
from kvcanary_jax.sweep import SweepPlan as SweepPlan
from kvcanary_jax.sweep import walk_prefix_tree as walk_prefix_tree
from pallas_kernels.realkv import RealKvSource as RealKvSource

__all__ = [
    "CanaryBatch",
    "CanaryMonitor",
    "CanaryPool",
    "CanaryState",
    "KvCanary",
    "KvCanaryHealthError",
    "KvSources",
    "SwaGroup",
    "SweepEntries",
    "SweepPlan",
    "walk_prefix_tree",
    "ANCHOR_HASH",
    "CANARY_CHAIN_ANCHOR",
    "CANARY_FIELDS_PER_SLOT",
    "NUM_LAUNCH_TAGS",
    "VIOLATION_FIELDS",
    "CanaryConfig",
    "CanaryDeviceState",
    "CanaryLaunchTag",
    "CanaryMode",
    "FailReason",
    "KvCanaryViolationError",
    "fence",
    "PoolKind",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyPlan",
    "Violation",
    "ViolationLog",
    "ViolationReport",
    "WritePlan",
    "allocate_canary_buffer",
    "build_plans",
    "canary_verify",
    "canary_write",
    "format_violation",
    "read_violations",
    "records_as_int64",
]
