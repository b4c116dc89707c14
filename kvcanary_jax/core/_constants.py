"""SGLang's canary constants and enums, with the same names and values."""

from __future__ import annotations

import enum

from pallas_kernels import hash64, layout

CANARY_CHAIN_ANCHOR = hash64.CANARY_CHAIN_ANCHOR
ANCHOR_HASH = 0xDE7FAE23A9A1B716  # splitmix64(CANARY_CHAIN_ANCHOR); checked against the hash code in the tests
NUM_LAUNCH_TAGS = 12
VIOLATION_FIELDS = layout.VIOLATION_FIELDS
CANARY_FIELDS_PER_SLOT = layout.CANARY_FIELDS_PER_SLOT
CANARY_SLOT_BYTES = 32
CONTEXT_FIELDS = 3  # a ring row's context: request row, expected position, batch entry (ours)
MAX_REAL_KV_SOURCES = layout.MAX_REAL_KV_SOURCES
TOKEN_TO_KV_SLOT_PADDING = layout.PADDING_SLOT
REQ_POOL_IDX_PADDING = 0

CANARY_FIELD_TOKEN = layout.FIELD_TOKEN
CANARY_FIELD_POSITION = layout.FIELD_POSITION
CANARY_FIELD_PREV_HASH = layout.FIELD_PREV_HASH
CANARY_FIELD_REAL_KV_HASH = layout.FIELD_REAL_KV_HASH

VIOLATION_FIELD_KERNEL_KIND = layout.ROW_LAUNCH_TAG
VIOLATION_FIELD_SLOT_IDX = layout.ROW_SLOT_IDX
VIOLATION_FIELD_POSITION = layout.ROW_POSITION
VIOLATION_FIELD_STORED_TOKEN = layout.ROW_STORED_TOKEN
VIOLATION_FIELD_EXPECTED_TOKEN = layout.ROW_EXPECTED_TOKEN
VIOLATION_FIELD_STORED_CHAIN_HASH = layout.ROW_STORED_CHAIN_HASH
VIOLATION_FIELD_EXPECTED_AUX = layout.ROW_EXPECTED_AUX
VIOLATION_FIELD_FAIL_REASON_BITS = layout.ROW_FAIL_REASON_BITS


class CanaryLaunchTag(enum.IntEnum):
    """Which launch wrote a violation row: (HEAD | TAIL | SWEEP) x (K | V) x (FULL | SWA)."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


class Phase(enum.IntEnum):
    """When a launch runs: before the forward (HEAD), after it (TAIL), or in a prefix-cache sweep (SWEEP)."""

    HEAD = 0
    TAIL = 1
    SWEEP = 2


class Half(enum.IntEnum):
    """Which endpoint buffer of a group a launch checks: the K half or the V half."""

    K = 0
    V = 1


def launch_tag(phase: Phase, half: Half, kind: PoolKind) -> CanaryLaunchTag:
    """SGLang's tag numbering: ``6 * group + 2 * phase + half``, e.g. ``TAIL_V_SWA = 6 + 2 + 1``."""
    return CanaryLaunchTag(6 * kind + 2 * phase + half)


class FailReason(enum.IntFlag):
    """Violation bits; a row may carry several."""

    VERIFY_CHAIN_HASH_MISMATCH = layout.FAIL_VERIFY_CHAIN_HASH
    VERIFY_POSITION_MISMATCH = layout.FAIL_VERIFY_POSITION
    VERIFY_REAL_KV_HASH_MISMATCH = layout.FAIL_VERIFY_REAL_KV_HASH
    WRITE_TOKEN_MISMATCH = layout.FAIL_WRITE_TOKEN
    WRITE_POSITION_MISMATCH = layout.FAIL_WRITE_POSITION
    VERIFY_TOKEN_MISMATCH = layout.FAIL_VERIFY_TOKEN
    # Ours, beyond SGLang's six bits:
    # TP shards disagree on a written record's chain fields (kvcanary_jax.sharded);
    SHARD_CHAIN_MISMATCH = 1 << 6
    # a batch input the canary cannot check as given: out of range, negative, or a reserved row or slot in use.
    INVALID_INPUT = layout.FAIL_INVALID_INPUT
    # Aliases: the names reports print (SGLang's ``verify_chain_hash`` ...), so a printed name is a member too.
    VERIFY_CHAIN_HASH = VERIFY_CHAIN_HASH_MISMATCH
    VERIFY_POSITION = VERIFY_POSITION_MISMATCH
    VERIFY_REAL_KV_HASH = VERIFY_REAL_KV_HASH_MISMATCH
    WRITE_TOKEN = WRITE_TOKEN_MISMATCH
    WRITE_POSITION = WRITE_POSITION_MISMATCH
    VERIFY_TOKEN = VERIFY_TOKEN_MISMATCH
    SHARD_CHAIN = SHARD_CHAIN_MISMATCH

    @property
    def label(self) -> str:
        """The printed name of a single reason, e.g. ``verify_real_kv_hash`` (reasons joined by ``+``)."""
        return "+".join(r.name.lower().removesuffix("_mismatch") for r in FailReason if self & r)

    @classmethod
    def parse(cls, reason: FailReason | str, *, argument: str = "reason") -> FailReason:
        """A member, its name or its printed name (``"verify_real_kv_hash"``; several joined by ``+``).

        Raises:
          TypeError, ValueError: naming ``argument`` and the value received.
        """
        if isinstance(reason, cls):
            return reason
        if not isinstance(reason, str):
            raise TypeError(f"{argument} must be a FailReason or its printed name; got {argument}={reason!r}")
        bits = cls(0)
        for part in reason.split("+"):
            member = cls.__members__.get(part.strip().upper())
            if member is None:
                names = ", ".join(sorted(r.label for r in cls))
                raise ValueError(f"{argument} must be a FailReason or one of {names}; got {argument}={reason!r}")
            bits |= member
        return bits


class InputField(enum.IntEnum):
    """The batch field an ``INVALID_INPUT`` row names (bits 32..39 of its ``fail_reason_bits``)."""

    REQ_POOL_INDICES = layout.INPUT_FIELD_REQ_POOL_INDICES
    PREFIX_LENS = layout.INPUT_FIELD_PREFIX_LENS
    EXTEND_LENS = layout.INPUT_FIELD_EXTEND_LENS
    REQ_TO_TOKEN = layout.INPUT_FIELD_REQ_TO_TOKEN
    OUT_CACHE_LOC = layout.INPUT_FIELD_OUT_CACHE_LOC
    FULL_TO_SWA_INDEX_MAPPING = layout.INPUT_FIELD_FULL_TO_SWA_INDEX_MAPPING
    TOKEN_IDS_LENS = layout.INPUT_FIELD_TOKEN_IDS_LENS
    # Ours, host-found: a prefix-cache sweep entry (SweepEntries' columns) only a corrupted cache holds.
    SWEEP_SLOTS = layout.INPUT_FIELD_SWEEP_SLOTS
    SWEEP_POSITIONS = layout.INPUT_FIELD_SWEEP_POSITIONS
    SWEEP_PREV_SLOTS = layout.INPUT_FIELD_SWEEP_PREV_SLOTS
    # an adopted entry's slot / predecessor slot (KvCanary.adopt)
    ADOPT_SLOTS = layout.INPUT_FIELD_ADOPT_SLOTS
    ADOPT_PREV_SLOTS = layout.INPUT_FIELD_ADOPT_PREV_SLOTS


class InputProblem(enum.IntEnum):
    """What is wrong with the value an ``INVALID_INPUT`` row names (bits 40..47 of its ``fail_reason_bits``)."""

    # outside [lower bound, limit); the row's expected_token holds the limit
    OUT_OF_RANGE = layout.INPUT_PROBLEM_OUT_OF_RANGE
    # a length or count below 0
    NEGATIVE = layout.INPUT_PROBLEM_NEGATIVE
    # a request with tokens in the reserved request row (padding="reserved")
    RESERVED_ROW = layout.INPUT_PROBLEM_RESERVED_ROW
    # a request position mapped to the reserved padding slot 0
    RESERVED_SLOT = layout.INPUT_PROBLEM_RESERVED_SLOT
    # the row's tokens run past the batch's token arrays (sum(extend_lens) > T)
    PAST_TOKENS = layout.INPUT_PROBLEM_PAST_TOKENS
    # prefix_lens + extend_lens exceeds req_to_token's width
    PAST_CONTEXT = layout.INPUT_PROBLEM_PAST_CONTEXT
    # an adopted entry whose predecessor was never adopted (missing, itself rejected, or a cycle)
    UNADOPTED = layout.INPUT_PROBLEM_UNADOPTED


INPUT_FIELD_SHIFT = layout.INPUT_FIELD_SHIFT  # fail_reason_bits = INVALID_INPUT | field << 32 | problem << 40
INPUT_PROBLEM_SHIFT = layout.INPUT_PROBLEM_SHIFT


class RealKvHashMode(enum.IntEnum):
    """How much of a slot's KV bytes the REAL_KV_HASH folds: none, the first 16 bytes, or ``read_bytes``."""

    NONE = layout.REAL_KV_NONE
    PARTIAL = layout.REAL_KV_PARTIAL
    ALL = layout.REAL_KV_ALL


class PoolKind(enum.IntEnum):
    """KV pool group: FULL covers every position, SWA only the sliding window."""

    FULL = 0
    SWA = 1


class CanaryMode(enum.StrEnum):
    """What the host does on a violation: ``raise`` (CI lane), ``log`` (keep serving), or ``off``."""

    OFF = "off"
    LOG = "log"
    RAISE = "raise"
