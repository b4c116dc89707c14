"""``write``: validates, walks the chain on the chosen backend, folds real KV and stores the new records."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels import backend as backends
from pallas_kernels import realkv, records
from pallas_kernels.write import reference, store


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
    """
    name = backends.resolve(backend)
    if name == "xla":
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
    else:
        raise NotImplementedError(f"backend={name!r} write kernel is not available yet; use backend='xla'")
    slots = records.clamp_slots(out_cache_loc, canary_buf.shape[0])
    real_kv = realkv.fold_slots(real_kv_sources, slots, real_kv_hash_mode)
    new_buf = store.store(canary_buf, out_cache_loc, input_ids, positions, chain.prev_hash, real_kv, chain.written)
    return new_buf, chain
