"""sglang-jax 0.1.0rc0's native attention (the CPU and GPU backend) over an ``SWAKVPool``: a patch of the engine.

The release builds the hybrid ``SWAKVPool`` for a sliding-window model (Gemma 2, Gemma 4, MiMo-V2-Flash) on any
platform, but only its TPU ``fa`` backend addresses it: the native backend calls ``set_kv_buffer_legacy``, which
``SWAKVPool`` lacks (``AttributeError`` at the first forward), and reads every layer at the full-pool slots. So an SWA
model does not run off TPU. :func:`install` adds the missing path as the ``fa`` backend has it: an SWA layer writes
and reads its sub-pool at ``full_to_swa_index_mapping[slot]`` (the table travels into the engine's jit with the pool,
as for ``fa``); a full layer is unchanged. Nothing else of the engine changes (its allocator, table, SWA radix tree
and window eviction are its own), so the canary meets the engine's real SWA bookkeeping on CPU.

Opt-in: the in-process test engine installs it for an SWA model; ``serve sglang-jax --canary-native-swa`` installs it
in the scheduler's process (with the canary on or off).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _swa_loc(pool, loc, mesh):
    """Full-pool slots to the SWA sub-pool's through the pool's table (replicated on ``mesh``); a negative (padding)
    slot stays negative."""
    loc = jax.sharding.reshard(loc, NamedSharding(mesh, P()))
    lut = jax.sharding.reshard(jnp.asarray(pool.full_to_swa_index_mapping, jnp.int32), NamedSharding(mesh, P()))
    return jnp.where(loc >= 0, lut[jnp.clip(loc, 0, lut.shape[0] - 1)], -1).astype(jnp.int32)


def _set_kv_buffer_legacy(self, layer_id, loc, cache_k, cache_v):
    """``SWAKVPool``'s missing native-backend write: to the layer's sub-pool (an SWA layer's ``loc`` comes already
    through the table: see :func:`install`)."""
    layer_in_pool, is_swa = self.layers_mapping[layer_id]
    pool = self.swa_kv_pool if is_swa else self.full_kv_pool
    return pool.set_kv_buffer_legacy(layer_in_pool, loc, cache_k, cache_v)


def install() -> bool:
    """Patches sglang-jax's ``SWAKVPool`` and native attention backend in this process (once); True if it patched."""
    from sgl_jax.srt.layers.attention import native_backend
    from sgl_jax.srt.mem_cache.memory_pool import SWAKVPool

    backend = native_backend.NativeAttention
    if getattr(backend, "_kvcanary_native_swa", False):
        return False
    call = backend.__call__

    def swa_call(self, q, k, v, layer, forward_batch, token_to_kv_pool, *args, **kwargs):
        """An SWA layer's writes and reads at its sub-pool's slots (through the table), as the ``fa`` backend."""
        mapping = getattr(token_to_kv_pool, "layers_mapping", None)
        if mapping is not None and mapping[layer.layer_id][1]:  # writes (out_cache_loc) and reads (cache_loc)
            forward_batch = copy.copy(forward_batch)
            for name in ("out_cache_loc", "cache_loc"):
                setattr(forward_batch, name, _swa_loc(token_to_kv_pool, getattr(forward_batch, name), self.mesh))
        return call(self, q, k, v, layer, forward_batch, token_to_kv_pool, *args, **kwargs)

    backend.__call__ = swa_call
    backend._kvcanary_native_swa = True
    SWAKVPool.set_kv_buffer_legacy = _set_kv_buffer_legacy
    return True
