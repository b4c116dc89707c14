"""Numeric layout constants shared by every kernel: record fields, violation-row columns, fail bits, real-KV modes.

These are SGLang's values. The upper layer (``kvcanary_jax.core``) builds its enums from them, so each
number is written once.
"""

CANARY_FIELDS_PER_SLOT = 4
FIELD_TOKEN = 0
FIELD_POSITION = 1
FIELD_PREV_HASH = 2
FIELD_REAL_KV_HASH = 3

VIOLATION_FIELDS = 8
ROW_LAUNCH_TAG = 0
ROW_SLOT_IDX = 1
ROW_POSITION = 2
ROW_STORED_TOKEN = 3
ROW_EXPECTED_TOKEN = 4
ROW_STORED_CHAIN_HASH = 5
ROW_EXPECTED_AUX = 6
ROW_FAIL_REASON_BITS = 7

FAIL_VERIFY_CHAIN_HASH = 1 << 0
FAIL_VERIFY_POSITION = 1 << 1
FAIL_VERIFY_REAL_KV_HASH = 1 << 2
FAIL_WRITE_TOKEN = 1 << 3
FAIL_WRITE_POSITION = 1 << 4
FAIL_VERIFY_TOKEN = 1 << 5
# Ours, beyond SGLang's six bits: a batch value the canary cannot check as given (an INVALID_INPUT row, whose
# fail-bits word carries the field and the problem above bit 32). The fused phase reports req_to_token's.
FAIL_INVALID_INPUT = 1 << 7
INPUT_FIELD_SHIFT = 32
INPUT_PROBLEM_SHIFT = 40
INPUT_FIELD_REQ_TO_TOKEN = 4
INPUT_FIELD_FULL_TO_SWA_INDEX_MAPPING = 6
INPUT_PROBLEM_OUT_OF_RANGE = 1
INPUT_PROBLEM_RESERVED_SLOT = 4

REAL_KV_NONE = 0
REAL_KV_PARTIAL = 1
REAL_KV_ALL = 2

MAX_REAL_KV_SOURCES = 4
REAL_KV_CHUNK_BYTES = 16
PADDING_SLOT = 0
