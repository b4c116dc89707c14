"""``write``: validates, walks the chain on the chosen backend, folds real KV and stores the new records."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backends
from pallas_kernels import layout, mesh, realkv, records, validate
from pallas_kernels.write import pallas_mosaic, pallas_triton, reference, store


def _xla_write(canary_buf, launch: reference.Launch, sources, *, real_kv_hash_mode):
    """The pure-jnp chain walk, real-KV fold and deterministic store."""
    out_cache_loc = launch.out_cache_loc
    if out_cache_loc.shape[0] == 0 or launch.seed_slot_indices.shape[0] == 0:  # nothing to walk, as in the kernels
        return canary_buf, reference.empty_chain(out_cache_loc.shape[0])
    chain = reference.write_chain(canary_buf, launch)
    slots = records.clamp_slots(out_cache_loc, canary_buf.shape[0])
    real_kv = realkv.fold_slots(sources, slots, real_kv_hash_mode)
    new_buf = store.store(
        canary_buf, out_cache_loc, launch.input_ids, launch.positions, chain.prev_hash, real_kv, chain.written
    )
    return new_buf, chain


def write(
    canary_buf: jax.Array,
    write_offsets: jax.Array,
    seed_slot_indices: jax.Array,
    num_valid_reqs: jax.Array,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    enable_chain_position_assert: jax.Array,
    *,
    real_kv_sources: Sequence[realkv.RealKvSource] = (),
    real_kv_hash_mode: int = 0,
    backend: str = "auto",
) -> tuple[jax.Array, reference.ChainOut]:
    """Writes one launch's records; returns the new buffer and the per-entry chain results.

    Shapes: ``canary_buf`` u32[num_slots, 4, 2]; ``write_offsets`` i32[R + 1]; ``seed_slot_indices`` i32[R];
    ``num_valid_reqs``, ``enable_chain_position_assert`` i32[1]; token arrays i32[T].
    ``"xla"`` runs the pure-jnp chain and the shared store; ``"pallas"`` the kernels of ``pallas_triton`` on GPU
    or of ``pallas_mosaic`` on TPU, chosen by the platform lowered for; ``"interpret"`` / ``"interpret_tpu"``
    run those kernels interpreted, anywhere; ``"auto"`` is ``"pallas"`` on GPU and TPU, else ``"xla"``. All
    give identical bytes. Inputs typed with an explicit mesh sharding are read in place by ``"xla"``, which
    ``"auto"`` then picks on every platform.

    Raises:
      ValueError, TypeError: for a wrong shape, dtype or static argument (backend name included), naming it.
      NotImplementedError: ``"pallas"`` lowered for a platform other than GPU or TPU; a kernel backend given
        inputs with an explicit mesh sharding.
    """
    num_slots = validate.canary_buffer(canary_buf)
    validate.array("seed_slot_indices", seed_slot_indices, dtype=jnp.int32, ndim=1)
    num_reqs = seed_slot_indices.shape[0]
    validate.array("write_offsets", write_offsets, dtype=jnp.int32, shape=(num_reqs + 1,))
    for arg, x in (("num_valid_reqs", num_valid_reqs), ("enable_chain_position_assert", enable_chain_position_assert)):
        validate.array(arg, x, dtype=jnp.int32, shape=(1,))
    tokens = {"input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc}
    for arg, x in tokens.items():
        validate.array(arg, x, dtype=jnp.int32, ndim=1)
    validate.same_length(tokens)
    sources = realkv.validate_sources(real_kv_sources, num_slots=num_slots)
    validate.static_int("real_kv_hash_mode", real_kv_hash_mode, maximum=layout.REAL_KV_ALL + 1)

    launch = reference.Launch(
        write_offsets, seed_slot_indices, num_valid_reqs, input_ids, positions, out_cache_loc,
        enable_chain_position_assert,
    )  # fmt: skip

    def xla(canary_buf, launch, sources):
        small = (canary_buf, launch)
        with mesh.context(small, sources):  # explicit mesh shardings: small inputs replicated, KV read in place
            return _xla_write(*mesh.replicate(small), sources, real_kv_hash_mode=real_kv_hash_mode)

    def triton(canary_buf, launch, sources, *, interpret):
        return pallas_triton.write(
            canary_buf, *launch, real_kv_sources=sources, real_kv_hash_mode=real_kv_hash_mode, interpret=interpret
        )

    def mosaic(canary_buf, launch, sources, *, interpret):
        return pallas_mosaic.write(
            canary_buf, *launch, real_kv_sources=sources, real_kv_hash_mode=real_kv_hash_mode, interpret=interpret
        )

    run = backends.dispatch(backend, xla=xla, triton=triton, mosaic=mosaic)
    return run(canary_buf, launch, sources)
