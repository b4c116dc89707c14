"""``canary_verify`` and ``canary_write``: validate, run the backend op, append violations, bump counters.

Each op is a launch (``verify_launch`` / ``write_launch``: validate and run, leaving the state alone) plus
``commit`` (append its rows, bump its counters). The runner calls the halves itself, so that all launches of one
phase share one prefix sum and one ring update (``apply``); the ring bytes are the same either way.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvcanary_jax import ring, validation
from kvcanary_jax.config import parse_real_kv_hash_mode
from kvcanary_jax.constants import RealKvHashMode
from kvcanary_jax.plans import VerifyPlan, WritePlan
from kvcanary_jax.state import CanaryDeviceState
from pallas_kernels import backend as backends
from pallas_kernels import hash64, layout, realkv, records
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api as write_api


@dataclasses.dataclass(frozen=True)
class Launch:
    """One verify or write launch before its effect on the shared state is applied.

    Attributes:
      tag: the static launch tag.
      flags: bool violation flags in append order.
      build_rows: i32[capacity] entry ids -> u32[capacity, 8, 2] ring rows.
      entries: i32[] the launch's ``slot_run_counters`` increment.
    """

    tag: int
    flags: jax.Array
    build_rows: ring.RowBuilder
    entries: jax.Array

    @property
    def row_source(self) -> tuple[jax.Array, ring.RowBuilder]:
        return self.flags, self.build_rows


def _bump(counters: jax.Array, increments: dict[int, jax.Array]) -> jax.Array:
    """``counters[tag] += amount`` per tag on u64 (lo, hi) counters; amounts are non-negative int32.

    Elementwise over every tag (not one-row updates), so XLA fuses a step's bumps into one kernel.
    """
    tags = jnp.arange(counters.shape[0])
    add = jnp.zeros(counters.shape[:1], jnp.uint32)
    for tag, amount in increments.items():
        add = add + jnp.where(tags == tag, amount.astype(jnp.uint32), jnp.uint32(0))
    return hash64.join(hash64.add(hash64.split(counters), (add, jnp.zeros_like(add))))


def apply(
    state: CanaryDeviceState, pending: Sequence[ring.PendingRows], launches: Sequence[Launch]
) -> CanaryDeviceState:
    """Places the launches' pending rows in the ring (in the order given) and bumps their counters."""
    kernels, slots = collections.Counter(), collections.defaultdict(lambda: jnp.int32(0))
    for launch in launches:
        kernels[launch.tag] += 1
        slots[launch.tag] = slots[launch.tag] + launch.entries
    return CanaryDeviceState(
        violation_log=ring.place(state.violation_log, pending),
        kernel_run_counters=_bump(state.kernel_run_counters, {t: jnp.int32(n) for t, n in kernels.items()}),
        slot_run_counters=_bump(state.slot_run_counters, dict(slots)),
        enable_chain_position_assert=state.enable_chain_position_assert,
        req_to_verify_expected_tokens=state.req_to_verify_expected_tokens,
    )


def commit(state: CanaryDeviceState, launch: Launch) -> CanaryDeviceState:
    """Appends one launch's rows and bumps its counters."""
    return apply(state, ring.first_rows([launch.row_source], state.violation_log.ring_capacity), [launch])


def _validate_common(state, canary_buf, tag, real_kv_sources, real_kv_hash_mode, backend):
    if not isinstance(state, CanaryDeviceState):
        raise TypeError(f"state must be a CanaryDeviceState; got {type(state).__name__}")
    num_slots = validation.canary_buffer(canary_buf)
    # int(): a CanaryLaunchTag becomes a plain int; a bool is left as is, so static_int rejects it.
    tag = validation.static_int(
        "tag", int(tag) if type(tag) is not bool and isinstance(tag, int) else tag, maximum=state.num_tags
    )
    if not isinstance(real_kv_sources, (tuple, list)):
        raise TypeError(f"real_kv_sources must be a tuple of RealKvSource; got {type(real_kv_sources).__name__}")
    realkv.validate_sources(real_kv_sources, num_slots=num_slots)
    backends.validate(backend)
    return tag, parse_real_kv_hash_mode(real_kv_hash_mode)


def verify_launch(
    state: CanaryDeviceState,
    canary_buf: jax.Array,
    plan: VerifyPlan,
    *,
    tag: int,
    real_kv_sources: Sequence[realkv.RealKvSource] = (),
    real_kv_hash_mode: RealKvHashMode | int | str = RealKvHashMode.NONE,
    check_expected_token: bool = False,
    backend: str = "auto",
) -> Launch:
    """:func:`canary_verify` without touching the state: its fail bits, row builder and count."""
    tag, mode = _validate_common(state, canary_buf, tag, real_kv_sources, real_kv_hash_mode, backend)
    if not isinstance(plan, VerifyPlan):
        raise TypeError(f"plan must be a VerifyPlan; got {type(plan).__name__}")
    entries = {
        f: getattr(plan, f) for f in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices")
    }
    for name, x in entries.items():
        validation.array(f"plan.{name}", x, dtype=jnp.int32, ndim=1)
    capacity = validation.same_length({f"plan.{k}": v for k, v in entries.items()})
    for name in ("num_valid", "enable"):
        validation.array(f"plan.{name}", getattr(plan, name), dtype=jnp.int32, shape=(1,))
    if not isinstance(check_expected_token, bool):
        raise TypeError(f"check_expected_token must be a static bool; got {check_expected_token!r}")
    if check_expected_token and state.req_to_verify_expected_tokens is None:
        raise ValueError(
            "check_expected_token=True needs the expected-token pool, but state.req_to_verify_expected_tokens is "
            "None; allocate the state with CanaryConfig(enable_verify_token_assert=True)"
        )

    active = jnp.where(plan.enable[0] != 0, jnp.clip(plan.num_valid[0], 0, capacity), 0)
    bits = verify_api.verify(
        canary_buf,
        plan.slot_indices,
        plan.expected_tokens,
        plan.expected_positions,
        plan.prev_slot_indices,
        active,
        real_kv_sources=tuple(real_kv_sources),
        real_kv_hash_mode=int(mode),
        check_expected_token=check_expected_token,
        backend=backend,
    )

    def build_rows(entry):
        slot, prev = plan.slot_indices[entry], plan.prev_slot_indices[entry]
        token, position, prev_hash, _ = records.load(canary_buf, slot)
        expected_chain = hash64.where(prev != 0, records.slot_hash(canary_buf, prev), prev_hash)
        expected_token = plan.expected_tokens[entry] if check_expected_token else jnp.full_like(entry, -1)
        return ring.pack_row(
            [
                hash64.const(tag, entry),
                hash64.from_i32(slot),
                position,
                token,
                hash64.from_i32(expected_token),
                prev_hash,
                expected_chain,
                hash64.from_i32(bits[entry]),
            ]
        )

    return Launch(tag, bits != 0, build_rows, active)


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
      backend: ``"auto"``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

    Returns:
      The new state: ring rows in plan-entry order; ``kernel_run_counters[tag] += 1``;
      ``slot_run_counters[tag] += active entries`` (padding-slot entries included).

    Raises:
      ValueError, TypeError: for bad shapes, dtypes or static arguments; NotImplementedError for a backend that
      cannot run here.
    """
    launch = verify_launch(
        state,
        canary_buf,
        plan,
        tag=tag,
        real_kv_sources=real_kv_sources,
        real_kv_hash_mode=real_kv_hash_mode,
        check_expected_token=check_expected_token,
        backend=backend,
    )
    return commit(state, launch)


def write_launch(
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
    store_after: jax.Array | None = None,
) -> tuple[jax.Array, Launch]:
    """:func:`canary_write`'s new buffer, without touching the state; its rows and count come as a :class:`Launch`.

    ``store_after`` is a traced int32 zero (:func:`kvcanary_jax.ring.after`) that orders the in-place store after
    rows already gathered from this buffer; by default it depends on the ring, for a verify committed just before.
    """
    tag, mode = _validate_common(state, canary_buf, tag, real_kv_sources, real_kv_hash_mode, backend)
    if not isinstance(plan, WritePlan):
        raise TypeError(f"plan must be a WritePlan; got {type(plan).__name__}")
    validation.array("plan.seed_slot_indices", plan.seed_slot_indices, dtype=jnp.int32, ndim=1)
    num_reqs = plan.seed_slot_indices.shape[0]
    validation.array("plan.write_offsets", plan.write_offsets, dtype=jnp.int32, shape=(num_reqs + 1,))
    validation.array("plan.num_valid_reqs", plan.num_valid_reqs, dtype=jnp.int32, shape=(1,))
    tokens = {"input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc}
    if (expected_input_tokens is None) != (expected_input_positions is None):
        raise ValueError(
            "expected_input_tokens and expected_input_positions turn on the input assert together; got only "
            f"{'expected_input_tokens' if expected_input_positions is None else 'expected_input_positions'}"
        )
    input_assert = expected_input_tokens is not None
    if input_assert:
        tokens.update(expected_input_tokens=expected_input_tokens, expected_input_positions=expected_input_positions)
    for name, x in tokens.items():
        validation.array(name, x, dtype=jnp.int32, ndim=1)
    validation.same_length(tokens)

    new_buf, chain = write_api.write(
        canary_buf,
        plan.write_offsets,
        plan.seed_slot_indices,
        plan.num_valid_reqs,
        input_ids,
        positions,
        out_cache_loc + (ring.after(state.violation_log.violation_ring) if store_after is None else store_after),
        state.enable_chain_position_assert,
        real_kv_sources=tuple(real_kv_sources),
        real_kv_hash_mode=int(mode),
        backend=backend,
    )
    input_bits = jnp.zeros_like(input_ids)
    if input_assert:
        input_bits = jnp.where(chain.written & (input_ids != expected_input_tokens), layout.FAIL_WRITE_TOKEN, 0)
        input_bits |= jnp.where(chain.written & (positions != expected_input_positions), layout.FAIL_WRITE_POSITION, 0)
    # Entry-major, input-assert row before chain-position row: SGLang's order within one entry.
    flags = jnp.stack([input_bits != 0, chain.position_assert_failed], axis=1)

    def build_rows(entry):
        i, is_chain_row = entry // 2, entry % 2 == 1
        token, position = input_ids[i], positions[i]
        expected_token = jnp.where(is_chain_row, token, expected_input_tokens[i]) if input_assert else token
        input_aux = hash64.from_i32(expected_input_positions[i]) if input_assert else hash64.from_i32(position)
        aux = hash64.where(is_chain_row, hash64.split(chain.expected_position[i]), input_aux)
        bits = jnp.where(is_chain_row, layout.FAIL_WRITE_POSITION, input_bits[i])
        return ring.pack_row(
            [
                hash64.const(tag, entry),
                hash64.from_i32(out_cache_loc[i]),
                hash64.from_i32(position),
                hash64.from_i32(token),
                hash64.from_i32(expected_token),
                hash64.split(chain.prev_hash[i]),
                aux,
                hash64.from_i32(bits),
            ]
        )

    return new_buf, Launch(tag, flags, build_rows, jnp.sum(chain.written, dtype=jnp.int32))


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
      backend: ``"auto"``, ``"xla"``, ``"pallas"`` or ``"interpret"``.

    Returns:
      ``(canary_buf, state)``; ``slot_run_counters[tag] += written entries``.

    Raises:
      ValueError, TypeError: for bad shapes, dtypes or static arguments.
    """
    new_buf, launch = write_launch(
        state,
        canary_buf,
        plan,
        input_ids,
        positions,
        out_cache_loc,
        tag=tag,
        real_kv_sources=real_kv_sources,
        real_kv_hash_mode=real_kv_hash_mode,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
        backend=backend,
    )
    return new_buf, commit(state, launch)
