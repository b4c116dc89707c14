"""SGLang-compatible core: constants, config, device state, plans, the ring, ``canary_verify``/``canary_write``, the host reader.

Records, ring rows, counters and the first log line are bit-compatible with SGLang's canary.
"""

from kvcanary_jax.core._config import CanaryConfig as CanaryConfig
from kvcanary_jax.core._constants import ANCHOR_HASH as ANCHOR_HASH
from kvcanary_jax.core._constants import CANARY_CHAIN_ANCHOR as CANARY_CHAIN_ANCHOR
from kvcanary_jax.core._constants import CANARY_FIELDS_PER_SLOT as CANARY_FIELDS_PER_SLOT
from kvcanary_jax.core._constants import NUM_LAUNCH_TAGS as NUM_LAUNCH_TAGS
from kvcanary_jax.core._constants import VIOLATION_FIELDS as VIOLATION_FIELDS
from kvcanary_jax.core._constants import CanaryLaunchTag as CanaryLaunchTag
from kvcanary_jax.core._constants import CanaryMode as CanaryMode
from kvcanary_jax.core._constants import FailReason as FailReason
from kvcanary_jax.core._constants import Half as Half
from kvcanary_jax.core._constants import InputField as InputField
from kvcanary_jax.core._constants import InputProblem as InputProblem
from kvcanary_jax.core._constants import Phase as Phase
from kvcanary_jax.core._constants import PoolKind as PoolKind
from kvcanary_jax.core._constants import RealKvHashMode as RealKvHashMode
from kvcanary_jax.core._constants import launch_tag as launch_tag
from kvcanary_jax.core._incidents import Incident as Incident
from kvcanary_jax.core._incidents import Incidents as Incidents
from kvcanary_jax.core._ops import canary_verify as canary_verify
from kvcanary_jax.core._ops import canary_write as canary_write
from kvcanary_jax.core._plans import VerifyPlan as VerifyPlan
from kvcanary_jax.core._plans import WritePlan as WritePlan
from kvcanary_jax.core._plans import build_plans as build_plans
from kvcanary_jax.core._report import KvCanaryViolationError as KvCanaryViolationError
from kvcanary_jax.core._report import Violation as Violation
from kvcanary_jax.core._report import ViolationReport as ViolationReport
from kvcanary_jax.core._report import format_violation as format_violation
from kvcanary_jax.core._report import read_violations as read_violations
from kvcanary_jax.core._state import CanaryDeviceState as CanaryDeviceState
from kvcanary_jax.core._state import ViolationLog as ViolationLog
from kvcanary_jax.core._state import allocate_canary_buffer as allocate_canary_buffer
from kvcanary_jax.core._state import records_as_int64 as records_as_int64
from kvcanary_jax.core._transfer import restore_and_verify as restore_and_verify
from kvcanary_jax.core._transfer import restore_records as restore_records
from kvcanary_jax.core._transfer import snapshot_records as snapshot_records
from pallas_kernels.realkv import RealKvSource as RealKvSource

__all__ = [
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
    "Half",
    "Incident",
    "Incidents",
    "InputField",
    "InputProblem",
    "KvCanaryViolationError",
    "Phase",
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
    "launch_tag",
    "read_violations",
    "records_as_int64",
    "restore_and_verify",
    "restore_records",
    "snapshot_records",
]
