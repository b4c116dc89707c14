"""Device-state pytrees: the violation ring and the per-tag counters, plus canary buffers.

Every int64/uint64 of SGLang is a trailing axis of two uint32 words (lo, hi), so no x64 mode is needed and the
bytes equal SGLang's (``np.asarray(x).view(np.int64)[..., 0]`` gives its int64 values).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core import _constants as constants
from kvcanary_jax.core._config import CanaryConfig
from pallas_kernels import validate


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ViolationLog:
    """The one fill-once violation sink shared by every launch.

    Attributes:
      violation_ring: u32[ring_capacity, 8, 2], rows of eight int64 fields; row 0 is the first violation forever.
      violation_write_index: i32[1], violations seen so far; keeps counting past capacity and saturates at 2^31-1.
      violation_context: i32[ring_capacity, 3] beside each row (ours, not SGLang's): the request row, the expected
        position and the batch entry the row is about, -1 where there is none. None keeps no context.
    """

    violation_ring: jax.Array
    violation_write_index: jax.Array
    violation_context: jax.Array | None = None

    @classmethod
    def allocate(cls, *, ring_capacity: int) -> ViolationLog:
        """An empty ring of ``ring_capacity`` rows.

        Raises:
          ValueError: if ``ring_capacity`` is not a positive int.
        """
        if not validate.is_int(ring_capacity) or ring_capacity <= 0:
            raise ValueError(f"ViolationLog ring_capacity must be a positive int; got {ring_capacity=}")
        ring_capacity = int(ring_capacity)
        return cls(
            violation_ring=jnp.zeros((ring_capacity, constants.VIOLATION_FIELDS, 2), jnp.uint32),
            violation_write_index=jnp.zeros((1,), jnp.int32),
            violation_context=jnp.full((ring_capacity, constants.CONTEXT_FIELDS), -1, jnp.int32),
        )

    @property
    def ring_capacity(self) -> int:
        return self.violation_ring.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CanaryDeviceState:
    """Everything a canary launch reads and updates besides the canary buffers; fed back every step.

    Attributes:
      violation_log: the shared :class:`ViolationLog`.
      kernel_run_counters: u32[num_tags, 2] u64 launches per tag, +1 on every launch (a liveness signal).
      slot_run_counters: u32[num_tags, 2] u64 entries checked (verify) or written (write) per tag.
      enable_chain_position_assert: i32[1]; 0 during warm-up, 1 after ``mark_init_finished``.
      req_to_verify_expected_tokens: i32[req rows, max_context_len] source-of-truth tokens, or None when the
        verify-token assert is off.
    """

    violation_log: ViolationLog
    kernel_run_counters: jax.Array
    slot_run_counters: jax.Array
    enable_chain_position_assert: jax.Array
    req_to_verify_expected_tokens: jax.Array | None

    @classmethod
    def allocate(
        cls,
        *,
        config: CanaryConfig,
        num_tags: int = constants.NUM_LAUNCH_TAGS,
        req_to_token_alloc_size: int | None = None,
        max_context_len: int | None = None,
    ) -> CanaryDeviceState:
        """Allocates the state once; nothing is allocated per step.

        Raises:
          ValueError: for ``num_tags <= 0``, or missing pool sizes while the verify-token assert is on.
        """
        validate.instance("config", config, CanaryConfig)
        if not validate.is_int(num_tags) or num_tags <= 0:
            raise ValueError(f"CanaryDeviceState num_tags must be a positive int; got {num_tags=}")
        num_tags = int(num_tags)
        pool = None
        if config.enable_verify_token_assert:
            for name, value in (
                ("req_to_token_alloc_size", req_to_token_alloc_size),
                ("max_context_len", max_context_len),
            ):
                if not validate.is_int(value) or value <= 0:
                    raise ValueError(
                        f"CanaryDeviceState.allocate needs a positive {name} when "
                        f"config.enable_verify_token_assert is on; got {name}={value!r}"
                    )
            pool = jnp.full((int(req_to_token_alloc_size), int(max_context_len)), -1, jnp.int32)
        return cls(
            violation_log=ViolationLog.allocate(ring_capacity=config.ring_capacity),
            kernel_run_counters=jnp.zeros((num_tags, 2), jnp.uint32),
            slot_run_counters=jnp.zeros((num_tags, 2), jnp.uint32),
            enable_chain_position_assert=jnp.ones((1,), jnp.int32),
            req_to_verify_expected_tokens=pool,
        )

    @property
    def num_tags(self) -> int:
        return self.kernel_run_counters.shape[0]


def allocate_canary_buffer(num_slots: int) -> jax.Array:
    """A zeroed canary buffer ``u32[num_slots, 4, 2]``: one 32-byte record per KV slot (slot 0 is padding)."""
    if not validate.is_int(num_slots) or num_slots <= 0:
        raise ValueError(f"num_slots must be a positive int; got {num_slots=}")
    num_slots = int(num_slots)
    return jnp.zeros((num_slots, constants.CANARY_FIELDS_PER_SLOT, 2), jnp.uint32)


def u64_pairs_as_int64(pairs) -> np.ndarray:
    """Host view of a ``u32[..., 2]`` device array as SGLang's int64 values (shape without the last axis)."""
    assert sys.byteorder == "little", "the (lo, hi) layout is read as little-endian int64"
    host = np.ascontiguousarray(np.asarray(pairs, dtype=np.uint32))
    return host.view(np.int64)[..., 0]


def records_as_int64(canary_buf) -> np.ndarray:
    """Host view of a canary buffer as ``int64[num_slots, 4]``: TOKEN, POSITION, PREV_HASH, REAL_KV_HASH.

    Per-device buffers keep their leading mesh axes: ``u32[*mesh, num_slots, 4, 2]`` gives ``int64[*mesh, num_slots, 4]``;
    other u64 pairs (e.g. counters ``u32[num_tags, 2]``) read alike.

    Raises:
      TypeError, ValueError: if ``canary_buf`` is not a uint32 array of (lo, hi) pairs (numpy or jax).
    """
    validate.array("canary_buf", canary_buf, dtype=jnp.uint32)
    shape = tuple(canary_buf.shape)
    if len(shape) < 2 or shape[-1] != 2:  # any (lo, hi) pairs read alike, e.g. counters u32[num_tags, 2]
        raise ValueError(
            f"canary_buf must have shape (..., num_slots, 4, 2): (lo, hi) pairs; got canary_buf.shape={shape}"
        )
    return u64_pairs_as_int64(canary_buf)
