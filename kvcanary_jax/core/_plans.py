"""In-graph verify and write plans from the batch's request table (SGLang's plan kernels, in jnp).

Capacities are static; every count, flag and index is traced, so one compiled step serves every batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import mesh, validate
from pallas_kernels.prefix import api as prefix


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    """Entries to verify, request-major and position-ascending.

    Attributes:
      slot_indices: i32[capacity] slot of each entry (0 = padding, skipped).
      expected_tokens: i32[capacity] source-of-truth token, -1 when unknown (check skipped).
      expected_positions: i32[capacity] position the slot must hold.
      prev_slot_indices: i32[capacity] predecessor slot; -1 = chain head, 0 = unreachable (chain check skipped).
      num_valid: i32[1] entries in use (clamped to capacity on overflow).
      enable: i32[1] 0 when the plan overflowed its capacity: the whole verify is skipped this step.
    """

    slot_indices: jax.Array
    expected_tokens: jax.Array
    expected_positions: jax.Array
    prev_slot_indices: jax.Array
    num_valid: jax.Array
    enable: jax.Array

    @property
    def capacity(self) -> int:
        return self.slot_indices.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WritePlan:
    """Per-request spans of the token arrays and the slot each chain continues from.

    Attributes:
      write_offsets: i32[write_req_capacity + 1]; request r writes tokens ``[offsets[r], offsets[r+1])``.
      seed_slot_indices: i32[write_req_capacity] slot of the last cached token (-1 starts a new chain).
      num_valid_reqs: i32[1] rows of the batch (padding rows included; they have no tokens).
    """

    write_offsets: jax.Array
    seed_slot_indices: jax.Array
    num_valid_reqs: jax.Array


def translate(slots: jax.Array, lut: jax.Array | None) -> jax.Array:
    """Full-pool slots to SWA-pool slots; negatives pass through and indices past the table clamp to its end."""
    if lut is None:
        return slots
    return jnp.where(slots < 0, slots, lut[jnp.minimum(slots, lut.shape[0] - 1)])


def _non_empty(name: str, x) -> None:
    """The plans gather from these tables (clamping indices into them), so each axis needs an entry."""
    if 0 in x.shape:
        what = "at least one entry" if len(x.shape) == 1 else "at least one row and one column"
        raise ValueError(f"{name} needs {what}; got {name}.shape={tuple(x.shape)}")


@mesh.entry_point(  # batch arrays typed P("data") on an explicit mesh: plans from replicated copies
    "req_pool_indices",
    "prefix_lens",
    "extend_lens",
    "req_to_token",
    "full_to_swa_index_mapping",
    "req_to_verify_expected_tokens",
    "expected_tokens_valid_lens",
)
def build_plans(
    req_pool_indices: jax.Array,
    prefix_lens: jax.Array,
    extend_lens: jax.Array,
    req_to_token: jax.Array,
    *,
    verify_capacity: int,
    write_req_capacity: int,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: jax.Array | None = None,
    req_to_verify_expected_tokens: jax.Array | None = None,
    expected_tokens_valid_lens: jax.Array | None = None,
    kv_token_id_vs_position_offset: int = 0,
) -> tuple[VerifyPlan, WritePlan]:
    """Builds this step's verify and write plans on device, exactly as SGLang's plan kernels do.

    Args:
      req_pool_indices: i32[bs] row of each request in ``req_to_token``; 0 marks a padding row. Padding rows own no
        tokens, so they may sit anywhere (after the real rows, as with CUDA-graph padding, or interleaved, as
        sglang-jax pads each data-parallel rank's rows).
      prefix_lens: i32[bs] tokens already cached before this step.
      extend_lens: i32[bs] tokens this step writes.
      req_to_token: i32[max_reqs, max_context_len] slot of each (request row, position).
      verify_capacity, write_req_capacity: static plan sizes.
      swa_window_size: > 0 verifies only the last ``swa_window_size`` cached positions (needs the LUT).
      full_to_swa_index_mapping: i32[full_slots + 1] full-pool slot -> SWA slot (0 = evicted).
      req_to_verify_expected_tokens: i32[max_reqs, max_context_len] source-of-truth tokens, or None.
      expected_tokens_valid_lens: i32[bs] valid prefix of each request's row in that pool.
      kv_token_id_vs_position_offset: the token at KV position p is token p + offset (1 for an EAGLE draft pool).

    Returns:
      ``(VerifyPlan, WritePlan)``. On overflow (more entries than ``verify_capacity``) the verify plan is
      disabled for this step and ``num_valid`` is clamped. Entries past ``num_valid`` are zero (token -1).

    Raises:
      ValueError, TypeError: for wrong shapes, dtypes or static arguments.
    """
    lut, pool, valid_lens = full_to_swa_index_mapping, req_to_verify_expected_tokens, expected_tokens_valid_lens
    batch = {"req_pool_indices": req_pool_indices, "prefix_lens": prefix_lens, "extend_lens": extend_lens}
    for name, x in batch.items():
        validate.array(name, x, dtype=jnp.int32, ndim=1)
    bs = validate.same_length(batch)
    validate.array("req_to_token", req_to_token, dtype=jnp.int32, ndim=2)
    _non_empty("req_to_token", req_to_token)
    validate.positive_int("verify_capacity", verify_capacity)
    validate.positive_int("write_req_capacity", write_req_capacity)
    validate.static_int("swa_window_size", swa_window_size)
    validate.static_int("kv_token_id_vs_position_offset", kv_token_id_vs_position_offset, minimum=-(2**31))
    if bs < 1:
        raise ValueError(f"the batch needs at least one row (padding rows count); got req_pool_indices.shape={(bs,)}")
    if bs > write_req_capacity:
        raise ValueError(f"batch size {bs} exceeds write_req_capacity={write_req_capacity}; raise the capacity")
    if swa_window_size > 0 and lut is None:
        raise ValueError(f"swa_window_size={swa_window_size} needs full_to_swa_index_mapping (the full->SWA LUT)")
    if lut is not None:
        validate.array("full_to_swa_index_mapping", lut, dtype=jnp.int32, ndim=1)
        _non_empty("full_to_swa_index_mapping", lut)
    if (pool is None) != (valid_lens is None):
        raise ValueError(
            "req_to_verify_expected_tokens and expected_tokens_valid_lens go together; got "
            f"req_to_verify_expected_tokens={'None' if pool is None else 'an array'}, "
            f"expected_tokens_valid_lens={'None' if valid_lens is None else 'an array'}"
        )
    if pool is not None:
        validate.array("req_to_verify_expected_tokens", pool, dtype=jnp.int32, ndim=2)
        _non_empty("req_to_verify_expected_tokens", pool)
        validate.array("expected_tokens_valid_lens", valid_lens, dtype=jnp.int32, shape=(bs,))
    active = req_pool_indices != 0  # SGLang's roles: row 0 is padding, and a padding row owns no tokens
    span_lens = jnp.where(active, jnp.maximum(extend_lens, 0), 0)
    max_context = req_to_token.shape[1]
    window_start = jnp.maximum(prefix_lens - swa_window_size, 0) if swa_window_size > 0 else jnp.zeros_like(prefix_lens)
    verify_lens = jnp.where(active, jnp.maximum(prefix_lens - window_start, 0), 0)

    verify_ends = prefix.inclusive_sum(verify_lens)
    verify_starts = verify_ends - verify_lens
    total = verify_ends[-1]
    overflow = total > verify_capacity
    num_valid = jnp.where(overflow, verify_capacity, total)

    t = jnp.arange(verify_capacity, dtype=jnp.int32)
    req = jnp.clip(jnp.searchsorted(verify_starts, t, side="right", method="scan_unrolled") - 1, 0, bs - 1)
    pos = window_start[req] + t - verify_starts[req]
    row = req_pool_indices[req]
    raw_slot = req_to_token[row, jnp.clip(pos, 0, max_context - 1)]
    raw_prev = jnp.where(pos > 0, req_to_token[row, jnp.clip(pos - 1, 0, max_context - 1)], -1)
    slot = translate(raw_slot, lut)
    prev = jnp.where(pos > 0, translate(raw_prev, lut), -1)
    expected_token = jnp.full_like(t, -1)
    if pool is not None:
        token_pos = pos + kv_token_id_vs_position_offset
        known = (token_pos >= 0) & (token_pos < valid_lens[req])
        expected_token = jnp.where(known, pool[row, jnp.clip(token_pos, 0, pool.shape[1] - 1)], -1)
    used = (t < num_valid) & ~overflow
    verify_plan = VerifyPlan(
        slot_indices=jnp.where(used, slot, 0),
        expected_tokens=jnp.where(used, expected_token, -1),
        expected_positions=jnp.where(used, pos, 0),
        prev_slot_indices=jnp.where(used, prev, 0),
        num_valid=num_valid.reshape(1).astype(jnp.int32),
        enable=jnp.where(overflow, 0, 1).reshape(1).astype(jnp.int32),
    )

    write_offsets = jnp.zeros((write_req_capacity + 1,), jnp.int32).at[1 : bs + 1].set(prefix.inclusive_sum(span_lens))
    seed_full = req_to_token[req_pool_indices, jnp.clip(prefix_lens - 1, 0, max_context - 1)]
    seed = jnp.where(active & (prefix_lens > 0) & (span_lens > 0), translate(seed_full, lut), -1)
    write_plan = WritePlan(
        write_offsets=write_offsets,
        seed_slot_indices=jnp.full((write_req_capacity,), -1, jnp.int32).at[:bs].set(seed),
        num_valid_reqs=jnp.full((1,), bs, jnp.int32),
    )
    return verify_plan, write_plan
