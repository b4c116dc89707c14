"""What a wrapped step validates at trace time: the state, the batch and the real-KV sources, against the canary.

Shapes, dtypes and presence are static, so they are validated here, once a step, naming the field; the values are
checked in the step (:mod:`kvcanary_jax.runtime._inputs`, by the batch checks).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp

from kvcanary_jax.core._config import CanaryConfig
from kvcanary_jax.core._constants import Half, Phase, RealKvHashMode
from kvcanary_jax.runtime import _pool
from kvcanary_jax.runtime._batch import CanaryBatch, CanaryState
from pallas_kernels import realkv, validate
from pallas_kernels.phase import api as phase_api

_REQUIRED_FIELDS = (
    "req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions", "out_cache_loc",
)  # fmt: skip


def parse_phase(value) -> Phase:
    """A Phase from a member, its value or its (case-insensitive) name."""
    if isinstance(value, str) and value.strip().upper() in Phase.__members__:
        return Phase[value.strip().upper()]
    if validate.is_int(value) and int(value) in Phase._value2member_map_:
        return Phase(int(value))
    raise ValueError(f"phases must hold Phase members or their names {list(Phase.__members__)}; got {value!r}")


def check_not_donated(state: CanaryState) -> None:
    """A concrete state whose buffers a jitted step took (donated) is used again: name it, not 'argument 2'."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
            raise ValueError(DONATED_STATE)


DONATED_STATE = (
    "state was donated to an earlier step and its buffers are gone: use the state that step returned "
    "(state = step(..., state, ...)), not the one passed in"
)


def fingerprint(config: CanaryConfig, pool: _pool.CanaryPool) -> int:
    """What a state's records mean: the pool and the config fields the launches read (not the host's mode,
    periods or backend, nor the pool's verify capacities, a per-forward sizing: any canary of the same records
    may differ in those)."""
    swa = None if pool.swa is None else dataclasses.replace(pool.swa, verify_capacity=None)
    pool = dataclasses.replace(pool, verify_capacity=None, swa=swa)
    fields = (pool, config.ring_capacity, config.real_kv_hash_mode, config.enable_write_input_assert,
              config.enable_verify_token_assert)  # fmt: skip
    return zlib.crc32(repr(fields).encode())


def check_no_swa(pool: _pool.CanaryPool, op: str) -> None:
    if pool.swa is not None:
        raise NotImplementedError(f"{op} covers the FULL pool only; this pool has an SWA group (CanaryPool.swa)")


def validate_state(config: CanaryConfig, pool: _pool.CanaryPool, state) -> None:
    """``state`` is shaped as the ``init_state()`` of the canary of ``config`` and ``pool`` (a state of another
    canary reads out of range)."""
    validate.instance("state", state, CanaryState, what="CanaryState (from KvCanary.init_state)")
    if not config.enabled:
        return
    hint = "it was allocated by another canary; use this canary's init_state()"
    check_not_donated(state)
    capacity = state.device.violation_log.ring_capacity
    if capacity != config.ring_capacity:
        raise ValueError(f"state's ring holds {capacity} rows but config.ring_capacity={config.ring_capacity}: {hint}")
    tokens = state.device.req_to_verify_expected_tokens
    want_pool = (pool.max_reqs, pool.max_context_len) if config.enable_verify_token_assert else None
    if (None if tokens is None else tuple(tokens.shape)) != want_pool:
        raise ValueError(
            f"state's expected-token pool is {None if tokens is None else tuple(tokens.shape)}, but this canary "
            f"needs {want_pool} (config.enable_verify_token_assert={config.enable_verify_token_assert}): {hint}"
        )
    for g in pool.groups:
        buffers = state.buffers(g)
        if buffers is None:
            raise ValueError(f"state has no {g.name.upper()} buffers (state.{g.name} is None): {hint}")
        for phase in (Phase.HEAD, Phase.TAIL):
            for half in Half:
                buf = buffers.buffer(phase, half)
                name = f"state.{g.name}.{_pool.GroupBuffers.field_name(phase, half)}"
                if half in _pool.halves(pool):
                    validate.array(name, buf, dtype=jnp.uint32, shape=(g.num_slots, 4, 2))
                elif buf is not None:
                    raise ValueError(f"{name} is set but CanaryPool.with_v is False: {hint}")
    want = fingerprint(config, pool)
    if state.fingerprint is not None and state.fingerprint != want:
        raise ValueError(
            f"state was allocated by a canary of another config or pool (fingerprint {state.fingerprint:#010x}, "
            f"this canary's {want:#010x}): its records mean something else here; use this canary's "
            "init_state()"
        )


def validated_batch(config: CanaryConfig, pool: _pool.CanaryPool, state, batch) -> phase_api.ValidBatch:
    """Validates the batch against the canary of ``config`` and ``pool``, once a step; returns it as the phase op's
    ``ValidBatch`` (which the phases take as it is): every field a jax array, those the config does not read None.

    Shapes, dtypes and presence are static, so they are validated here, at trace time, naming the field: what the
    config needs of the batch, here, and its arrays by the phase op's ``validate_batch`` (the one set of array
    checks). The values are checked in the step (:mod:`kvcanary_jax.runtime._inputs`).
    """
    validate_state(config, pool, state)
    validate.instance("batch", batch, CanaryBatch)
    arrays = {}
    for field in dataclasses.fields(CanaryBatch):
        x = getattr(batch, field.name)
        if x is not None and field.name in ("active", "span_lens"):
            raise ValueError(f"batch.{field.name} is the runner's (from its batch checks); leave it None")
        if x is None:
            if field.name in _REQUIRED_FIELDS:
                raise TypeError(f"batch.{field.name} is required (an int32 array); got None")
        elif not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"batch.{field.name} must be an int32 array; got {type(x).__name__}")
        else:
            arrays[field.name] = jnp.asarray(x)  # a host (numpy) batch works eagerly too
    for name in ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc"):
        validate.array(f"batch.{name}", arrays[name], dtype=jnp.int32, ndim=1)
        if not arrays[name].shape[0]:  # shapes are static
            raise ValueError(f"batch.{name} needs at least one entry (pad it); got batch.{name}.shape=(0,)")
    c, swa = config, pool.swa is not None
    if c.enable_write_input_assert and "expected_input_ids" not in arrays:
        raise ValueError(
            "config.enable_write_input_assert compares written tokens with batch.expected_input_ids, but it "
            "is None; pass the oracle's tokens (i32[T]) or turn the assert off"
        )
    if swa and "full_to_swa_index_mapping" not in arrays:
        raise ValueError(
            "the pool has an SWA group, so batch.full_to_swa_index_mapping (i32[num_slots + 1], the full->SWA "
            "slot table) is required"
        )
    if c.enable_verify_token_assert and ("token_ids" not in arrays or "token_ids_lens" not in arrays):
        raise ValueError(
            "config.enable_verify_token_assert needs batch.token_ids (i32[max_reqs, max_context_len]) and "
            "batch.token_ids_lens (i32[bs]); pass the requests' token history or turn the assert off"
        )
    batch = dataclasses.replace(batch, **arrays)
    used = {  # the fields this config reads; the others are ignored
        "full_to_swa_index_mapping": swa,
        "expected_input_ids": c.enable_write_input_assert,
        "expected_positions": c.enable_write_input_assert,
        "token_ids": c.enable_verify_token_assert,
        "token_ids_lens": c.enable_verify_token_assert,
    }
    launched = {name: getattr(batch, name) if on else None for name, on in used.items()}
    batch = phase_api.validate_batch(dataclasses.replace(batch, **launched))
    if swa and batch.full_to_swa_index_mapping.shape[0] < pool.num_slots:
        raise ValueError(
            f"batch.full_to_swa_index_mapping must map every full-pool slot (i32[num_slots + 1], "
            f"num_slots={pool.num_slots}); got batch.full_to_swa_index_mapping.shape="
            f"{tuple(batch.full_to_swa_index_mapping.shape)}"
        )
    if c.enable_verify_token_assert:
        pool_shape = tuple(state.device.req_to_verify_expected_tokens.shape)
        if tuple(batch.req_to_token.shape) != pool_shape:
            raise ValueError(
                f"batch.req_to_token must have CanaryPool's shape (max_reqs, max_context_len)={pool_shape} "
                f"while the verify-token assert keeps a token pool of that shape; got batch.req_to_token.shape="
                f"{tuple(batch.req_to_token.shape)}"
            )
        validate.array("batch.token_ids", batch.token_ids, dtype=jnp.int32, shape=pool_shape)
    return batch


def validate_sources(config: CanaryConfig, pool: _pool.CanaryPool, sources) -> None:
    if not isinstance(sources, _pool.KvSources):
        raise TypeError(f"kv_cache_sources must be KvSources (see KvCanary.kv_sources); got {type(sources).__name__}")
    launched = {f"{g.name}_{h.name.lower()}": (g, h) for g in pool.groups for h in _pool.halves(pool)}
    for field in dataclasses.fields(_pool.KvSources):
        value, arg = getattr(sources, field.name), f"kv_cache_sources.{field.name}"
        if field.name in launched:
            num_slots = launched[field.name][0].num_slots
            realkv.validate_sources(value, num_slots=num_slots, arg=arg)
            for i, source in enumerate(value):
                _pool.check_covers_pool(f"{arg}[{i}]", source, num_slots)
        elif value:
            raise ValueError(
                f"{arg} holds sources, but no launch of this canary reads them (CanaryPool.swa="
                f"{pool.swa!r}, with_v={pool.with_v})"
            )
    if config.real_kv_hash_mode == RealKvHashMode.NONE:
        return
    for g in pool.groups:
        for half in _pool.halves(pool):
            if not sources.get(g, half):
                name = f"{g.name}_{half.name.lower()}"
                raise ValueError(
                    f"real_kv_hash_mode={config.real_kv_hash_mode.name} but kv_cache_sources has no "
                    f"{name} source; pass kv_sources({name}=<layer-0 {half.name} array of the "
                    f"{g.name.upper()} pool>), or set CanaryConfig(real_kv_hash_mode='none') to check chains only"
                )
