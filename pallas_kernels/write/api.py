"""``write``: validates, walks the chain on the chosen backend, folds real KV and stores the new records."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels import backend as backends
from pallas_kernels import kernel_io, realkv, records
from pallas_kernels.write import pallas_triton, reference, store


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
    Backends ``"pallas"`` and ``"interpret"`` run the kernels of ``pallas_triton`` (natively, or in Pallas
    interpret mode); ``"xla"`` runs the pure-jnp chain and the shared store. Both give identical bytes.

    Raises:
      NotImplementedError: ``"pallas"`` off-GPU, or a Pallas backend with a KV dtype it cannot read as words.
    """
    name = backends.resolve(backend)
    real_kv_sources = tuple(real_kv_sources)
    if name != "xla":
        for i, src in enumerate(real_kv_sources):
            kernel_io.check_kv_dtype(src.data.dtype, f"real_kv_sources[{i}].data")
        return pallas_triton.write(
            canary_buf,
            write_offsets,
            seed_slot_indices,
            num_valid_reqs,
            input_ids,
            positions,
            out_cache_loc,
            enable_chain_position_assert,
            real_kv_sources=real_kv_sources,
            real_kv_hash_mode=real_kv_hash_mode,
            interpret=name == "interpret",
        )
    chain = reference.write_chain(
        canary_buf,
        write_offsets,
        seed_slot_indices,
        num_valid_reqs,
        input_ids,
        positions,
        out_cache_loc,
        enable_chain_position_assert,
    )
    slots = records.clamp_slots(out_cache_loc, canary_buf.shape[0])
    real_kv = realkv.fold_slots(real_kv_sources, slots, real_kv_hash_mode)
    new_buf = store.store(canary_buf, out_cache_loc, input_ids, positions, chain.prev_hash, real_kv, chain.written)
    return new_buf, chain
