"""``canary_verify`` and ``canary_write``: run the lower layer's op, append its violations, bump its counters.

The runner runs a whole phase at once instead (:func:`fused_phase`, the lower layer's ``phase`` op: plans, both
halves' verify and write, rows and counters, on every backend); the ring bytes are the same either way. The public
ops check what only this layer knows (state, tag, plan type, the token pool) and parse the real-KV mode;
``pallas_kernels`` checks its own arrays, sources and backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvcanary_jax.core import _ring
from kvcanary_jax.core._config import parse_real_kv_hash_mode
from kvcanary_jax.core._constants import RealKvHashMode
from kvcanary_jax.core._plans import VerifyPlan, WritePlan
from kvcanary_jax.core._state import CanaryDeviceState, ViolationLog
from pallas_kernels import hash64, layout, mesh, realkv, records, ring, validate
from pallas_kernels.phase import api as phase_api
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api as write_api


def commit(
    state: CanaryDeviceState, tag: int, flags: jax.Array, build_rows: _ring.RowBuilder, entries: jax.Array
) -> CanaryDeviceState:
    """One launch's effect: its rows appended (one per set flag, in flag order), ``kernel_run_counters[tag] += 1``
    and ``slot_run_counters[tag] += entries``."""
    return dataclasses.replace(
        state,
        violation_log=_ring.append(state.violation_log, flags, build_rows),
        kernel_run_counters=ring.bump(state.kernel_run_counters, {tag: jnp.int32(1)}),
        slot_run_counters=ring.bump(state.slot_run_counters, {tag: entries}),
    )


def fused_phase(
    device: CanaryDeviceState,
    buffers: tuple[jax.Array, ...],
    batch: phase_api.Batch,
    spec: phase_api.PhaseSpec,
    *,
    real_kv_sources: tuple[tuple[realkv.RealKvSource, ...], ...],
    input_issues: jax.Array | None,
    verify_overflows: jax.Array | None,
    backend: str,
    batch_checks: phase_api.BatchChecks | None = None,
) -> tuple[CanaryDeviceState, tuple[jax.Array, ...], jax.Array | None]:
    """One HEAD/TAIL phase of a group through the lower layer's fused ``phase`` op (its static arguments:
    ``spec``). Its ``INVALID_INPUT`` rows come first: the caller's ``input_issues`` (i32[8, n]), then, with
    ``spec.check_table``, the cached positions' ``req_to_token`` values. With ``spec.skip_bad_requests``, rows
    that are not requests and requests with a slot the group cannot store write nothing. With ``batch_checks``,
    the phase runs the batch checks itself (their roles; reported, their candidates are the ``input_issues``).

    Same effects as the public single ops run in SGLang's order (verify K, write K, verify V, write V): the ring, index,
    counters and buffers are byte-identical. Returns ``(device, buffers, verify_overflows)``: the i32[1] count
    given, +1 when the verify plan overflowed its capacity (saturating); None when none was given.
    """
    log = device.violation_log
    new_buffers, out, _ = phase_api.run(
        buffers,
        phase_api.Log(
            log.violation_ring,
            log.violation_write_index,
            device.kernel_run_counters,
            device.slot_run_counters,
            log.violation_context,
            verify_overflows,
        ),
        batch,
        device.enable_chain_position_assert,
        spec,
        real_kv_sources=real_kv_sources,
        input_issues=input_issues,
        batch_checks=batch_checks,
        backend=backend,
    )
    device = dataclasses.replace(
        device,
        violation_log=ViolationLog(
            violation_ring=out.ring, violation_write_index=out.write_index, violation_context=out.context
        ),
        kernel_run_counters=out.kernel_run_counters,
        slot_run_counters=out.slot_run_counters,
    )
    return device, new_buffers, out.verify_overflows


def _check_common(state, tag, real_kv_sources, real_kv_hash_mode):
    """What the public ops check themselves; arrays, sources and the backend are ``pallas_kernels``' to check."""
    validate.instance("state", state, CanaryDeviceState)
    tag = validate.static_int("tag", tag, maximum=state.num_tags)
    mode = parse_real_kv_hash_mode(real_kv_hash_mode)
    if mode is not RealKvHashMode.NONE and isinstance(real_kv_sources, (tuple, list)) and not real_kv_sources:
        raise ValueError(
            f"real_kv_hash_mode={mode.name} folds the slots' KV bytes, but real_kv_sources is empty: every record "
            "would be compared with a fold of nothing. Pass the KV arrays as RealKvSource(s), or use "
            "real_kv_hash_mode='none' (e.g. for HEAD launches, before the forward wrote the KV)"
        )
    return tag, real_kv_sources, mode


def _host_arrays_to_jax(tree):
    """numpy arrays (a host batch, a saved buffer) become jax arrays; anything else is left for the checks."""
    return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, tree)


@mesh.entry_point("state", "canary_buf", "plan")  # explicitly sharded inputs: see pallas_kernels.mesh
def canary_verify(
    state: CanaryDeviceState,
    canary_buf: jax.Array,
    plan: VerifyPlan,
    *,
    tag: int,
    real_kv_sources: Sequence[realkv.RealKvSource] = (),
    real_kv_hash_mode: RealKvHashMode | int | str = RealKvHashMode.NONE,
    check_expected_token: bool = False,
    backend: str = "auto",
) -> CanaryDeviceState:
    """Verifies the plan's slots against their records; violations go to the ring.

    Args:
      state: the device state (ring, counters, flags).
      canary_buf: u32[num_slots, 4, 2] records of one endpoint (read only).
      plan: the verify plan; nothing is checked when ``plan.enable == 0``.
      tag: static launch tag (a :class:`CanaryLaunchTag`), stamped into rows and counters.
      real_kv_sources: up to 4 sources whose bytes must still fold to each slot's REAL_KV_HASH.
      real_kv_hash_mode: NONE, PARTIAL or ALL.
      check_expected_token: compare stored tokens with ``plan.expected_tokens`` (needs the expected-token pool).
      backend: one of ``pallas_kernels.backend.BACKENDS``: ``"auto"``, ``"xla"``, ``"pallas"`` (Triton on GPU, Mosaic on
        TPU), ``"interpret"`` or ``"interpret_tpu"``.

    Returns:
      The new state: ring rows in plan-entry order; ``kernel_run_counters[tag] += 1``;
      ``slot_run_counters[tag] += active entries`` (padding-slot entries included).

    Raises:
      ValueError, TypeError: for bad shapes, dtypes or static arguments; NotImplementedError for a backend that
      cannot run here.
    """
    tag, sources, mode = _check_common(state, tag, real_kv_sources, real_kv_hash_mode)
    canary_buf, plan = _host_arrays_to_jax((canary_buf, plan))
    validate.instance("plan", plan, VerifyPlan)
    for name in ("num_valid", "enable"):
        validate.array(f"plan.{name}", getattr(plan, name), dtype=jnp.int32, shape=(1,))
    if not isinstance(check_expected_token, bool):
        raise TypeError(f"check_expected_token must be a static bool; got {check_expected_token!r}")
    if check_expected_token and state.req_to_verify_expected_tokens is None:
        raise ValueError(
            "check_expected_token=True needs the expected-token pool, but state.req_to_verify_expected_tokens is "
            "None; allocate the state with CanaryConfig(enable_verify_token_assert=True)"
        )
    capacity = np.shape(plan.slot_indices)[0]  # the array itself is checked by pallas_kernels
    active = jnp.where(plan.enable[0] != 0, jnp.clip(plan.num_valid[0], 0, capacity), 0)
    bits = verify_api.verify(
        canary_buf,
        plan.slot_indices,
        plan.expected_tokens,
        plan.expected_positions,
        plan.prev_slot_indices,
        active,
        real_kv_sources=sources,
        real_kv_hash_mode=int(mode),
        check_expected_token=check_expected_token,
        backend=backend,
    )

    def build_rows(entry):
        slot, prev = plan.slot_indices[entry], plan.prev_slot_indices[entry]
        expected_token = plan.expected_tokens[entry] if check_expected_token else jnp.full_like(entry, -1)
        fields = phase_api.verify_row(
            tag, slot, prev, records.load(canary_buf, slot), records.slot_hash(canary_buf, prev), expected_token,
            bits[entry],
        )  # fmt: skip
        none = jnp.full_like(entry, -1)  # no batch: no request row, no batch entry
        return ring.pack_row(fields), ring.row_context(none, plan.expected_positions[entry], none)

    return commit(state, tag, bits != 0, build_rows, active)


@mesh.entry_point(
    "state",
    "canary_buf",
    "plan",
    "input_ids",
    "positions",
    "out_cache_loc",
    "expected_input_tokens",
    "expected_input_positions",
)
def canary_write(
    state: CanaryDeviceState,
    canary_buf: jax.Array,
    plan: WritePlan,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    *,
    tag: int,
    real_kv_sources: Sequence[realkv.RealKvSource] = (),
    real_kv_hash_mode: RealKvHashMode | int | str = RealKvHashMode.NONE,
    expected_input_tokens: jax.Array | None = None,
    expected_input_positions: jax.Array | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, CanaryDeviceState]:
    """Writes the records of this step's tokens, chaining each request from its seed slot.

    Args:
      state: the device state.
      canary_buf: u32[num_slots, 4, 2]; donate it under ``jax.jit`` so the update is in place.
      plan: the write plan from :func:`build_plans`.
      input_ids, positions, out_cache_loc: i32[T] this step's tokens, request-major; ``out_cache_loc < 0`` skips
        an entry (it is not stored and does not advance the chain).
      tag: static launch tag.
      real_kv_sources, real_kv_hash_mode: fold the slots' KV bytes into REAL_KV_HASH (TAIL endpoints).
      expected_input_tokens, expected_input_positions: i32[T] oracle values; given together, they turn on the
        input assert (WRITE_TOKEN / WRITE_POSITION rows).
      backend: one of ``pallas_kernels.backend.BACKENDS``: ``"auto"``, ``"xla"``, ``"pallas"`` (Triton on GPU, Mosaic on
        TPU), ``"interpret"`` or ``"interpret_tpu"``.

    Returns:
      ``(canary_buf, state)``; ``slot_run_counters[tag] += written entries``.

    Raises:
      ValueError, TypeError: for bad shapes, dtypes or static arguments.
    """
    tag, sources, mode = _check_common(state, tag, real_kv_sources, real_kv_hash_mode)
    canary_buf, plan, input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions = (
        _host_arrays_to_jax(
            (canary_buf, plan, input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions)
        )
    )
    validate.instance("plan", plan, WritePlan)
    expected_inputs = _expected_inputs(input_ids, expected_input_tokens, expected_input_positions)
    validate.array("out_cache_loc", out_cache_loc, dtype=jnp.int32, ndim=1)  # before the ordering zero is added
    new_buf, chain = write_api.write(
        canary_buf,
        plan.write_offsets,
        plan.seed_slot_indices,
        plan.num_valid_reqs,
        input_ids,
        positions,
        out_cache_loc + ring.after(state.violation_log.violation_ring),  # the store waits for the ring's rows
        state.enable_chain_position_assert,
        real_kv_sources=sources,
        real_kv_hash_mode=int(mode),
        backend=backend,
    )
    input_bits = jnp.zeros_like(input_ids)
    if expected_inputs is not None:
        expected_tokens, expected_positions = expected_inputs
        input_bits = jnp.where(chain.written & (input_ids != expected_tokens), layout.FAIL_WRITE_TOKEN, 0)
        input_bits |= jnp.where(chain.written & (positions != expected_positions), layout.FAIL_WRITE_POSITION, 0)
    # Entry-major, input-assert row before chain-position row: SGLang's order within one entry.
    flags = jnp.stack([input_bits != 0, chain.position_assert_failed], axis=1)

    def build_rows(entry):
        i, is_chain_row = entry // 2, entry % 2 == 1
        token, position = input_ids[i], positions[i]
        if expected_inputs is None:
            expected_token, input_aux = token, hash64.from_i32(position)
        else:
            expected_token = jnp.where(is_chain_row, token, expected_tokens[i])
            input_aux = hash64.from_i32(expected_positions[i])
        aux = hash64.where(is_chain_row, hash64.split(chain.expected_position[i]), input_aux)
        bits = jnp.where(is_chain_row, layout.FAIL_WRITE_POSITION, input_bits[i])
        fields = phase_api.write_row(
            tag, out_cache_loc[i], position, token, expected_token, hash64.split(chain.prev_hash[i]), aux, bits
        )
        request = jnp.full_like(entry, -1)  # no batch: no request row
        return ring.pack_row(fields), ring.row_context(request, lax.bitcast_convert_type(aux[0], jnp.int32), i)

    return new_buf, commit(state, tag, flags, build_rows, jnp.sum(chain.written, dtype=jnp.int32))


def _expected_inputs(input_ids, tokens, positions) -> tuple[jax.Array, jax.Array] | None:
    """The input assert's oracle arrays, checked against ``input_ids``; None when the assert is off."""
    if (tokens is None) != (positions is None):
        raise ValueError(
            "expected_input_tokens and expected_input_positions turn on the input assert together; got only "
            f"{'expected_input_tokens' if positions is None else 'expected_input_positions'}"
        )
    if tokens is None:
        return None
    arrays = {"input_ids": input_ids, "expected_input_tokens": tokens, "expected_input_positions": positions}
    for name, x in arrays.items():
        validate.array(name, x, dtype=jnp.int32, ndim=1)
    validate.same_length(arrays)
    return tokens, positions
