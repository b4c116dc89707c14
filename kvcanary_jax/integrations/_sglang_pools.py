"""sglang-jax's KV pools as the canary's groups: which slots each group covers and which engine arrays its real-KV
check reads.

One :class:`PoolView` per pool class the mapping covers, chosen by :func:`pool_view`. A view is static (hashable: the
launches close over it); the engine's arrays go to the launches through :meth:`PoolView.arrays`, read afresh after
each forward (the forward donates the pools).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

import kvcanary_jax as kc
from kvcanary_jax import testing
from kvcanary_jax.integrations._sglang_mapping import kv_sources, mla_source


@dataclasses.dataclass(frozen=True)
class PoolView:
    """The canary's view of one engine KV pool (the base: one FULL group over a fused MHA pool).

    Attributes:
      name: the engine's pool class.
      page_size: slots per KV page.
      num_slots: slots of the FULL group (the engine's pool, page 0 included).
    """

    name: str
    page_size: int
    num_slots: int

    def canary_pool(self, **kwargs) -> kc.CanaryPool:
        """The :class:`kvcanary_jax.CanaryPool` of this view; ``kwargs`` (capacities, token pool) pass through."""
        return kc.CanaryPool(num_slots=self.num_slots, page_size=self.page_size, **kwargs)

    def arrays(self, pool) -> dict[str, jax.Array]:
        """The engine arrays the launches read (host side, after the forward): layer 0's fused K/V array."""
        return {"full": pool.kv_buffer[0]}

    def sources(self, canary: kc.KvCanary, arrays: dict[str, jax.Array]) -> kc.KvSources:
        """The real-KV sources of :meth:`arrays` (traced)."""
        k, v = kv_sources(arrays["full"])
        return canary.kv_sources(full_k=k, full_v=v)

    def batch_fields(self, arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Fields of :class:`kvcanary_jax.CanaryBatch` the pool gives (none for one FULL group; traced)."""
        return {}


def _mha(pool, page_size: int) -> PoolView:
    kv0 = pool.kv_buffer[0]
    if kv0.ndim != 5 or kv0.shape[1] != page_size or math.prod(kv0.shape[2:4]) % 2:
        raise NotImplementedError(f"unexpected KV layer layout {jax.typeof(kv0)} for page_size={page_size}")
    return PoolView(name=type(pool).__name__, page_size=page_size, num_slots=int(kv0.shape[0]) * page_size)


@dataclasses.dataclass(frozen=True)
class MlaView(PoolView):
    """One FULL group over an ``MLATokenToKVPool``: K only, its real-KV source layer 0's latent row.

    MLA caches one latent row per token per layer (``c_kv`` then ``k_pe``, each padded to 128): no V, so the pool has
    no V endpoints (``with_v=False``). PARTIAL folds the row's first 16 bytes (``c_kv``'s first values), ALL the whole
    row (:func:`~kvcanary_jax.integrations._sglang_mapping.mla_source`).
    """

    def canary_pool(self, **kwargs) -> kc.CanaryPool:
        return kc.CanaryPool(num_slots=self.num_slots, page_size=self.page_size, with_v=False, **kwargs)

    def sources(self, canary: kc.KvCanary, arrays: dict[str, jax.Array]) -> kc.KvSources:
        return canary.kv_sources(full_k=mla_source(arrays["full"], self.page_size))


def _mla(pool, page_size: int) -> PoolView:
    kv0 = pool.kv_buffer[0]
    packing = kv0.shape[2] if kv0.ndim == 4 else 0
    if kv0.ndim != 4 or kv0.shape[1] * packing < page_size or kv0.shape[3] != pool.kv_dim:
        raise NotImplementedError(
            f"unexpected MLA layer layout {jax.typeof(kv0)} for page_size={page_size}, kv_dim={pool.kv_dim}"
        )
    if getattr(pool, "indexer_key_buffer", None):
        raise NotImplementedError(
            f"the DSA indexer key cache of {type(pool).__name__} ({len(pool.indexer_key_buffer)} buffer(s), "
            "--attention-backend dsa_sparse): only the latent KV rows are mapped"
        )
    return MlaView(name=type(pool).__name__, page_size=page_size, num_slots=int(kv0.shape[0]) * page_size)


@dataclasses.dataclass(frozen=True)
class HybridLinearView(PoolView):
    """A ``HybridLinearKVPool``: the view of its inner pool (``full_kv_pool``), which holds the full-attention layers'
    KV only; its layer 0, whose bytes the real-KV check reads, is the model's first full-attention layer. The linear
    layers' recurrent state (``RecurrentStatePool``, one state per request, not paged by token) is not covered.

    Attributes:
      inner: the view of ``full_kv_pool``.
    """

    inner: PoolView | None = None

    def canary_pool(self, **kwargs) -> kc.CanaryPool:
        return self.inner.canary_pool(**kwargs)

    def arrays(self, pool) -> dict[str, jax.Array]:
        return self.inner.arrays(pool.full_kv_pool)

    def sources(self, canary: kc.KvCanary, arrays: dict[str, jax.Array]) -> kc.KvSources:
        return self.inner.sources(canary, arrays)

    def batch_fields(self, arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return self.inner.batch_fields(arrays)


def _hybrid_linear(pool, page_size: int) -> PoolView:
    inner = pool.full_kv_pool
    make = _VIEWS.get(type(inner).__name__)
    if make is None or make is _hybrid_linear:
        raise NotImplementedError(f"{type(pool).__name__} over {type(inner).__name__}")
    view = make(inner, page_size)
    return HybridLinearView(name=f"{type(pool).__name__}({view.name})", page_size=page_size,
                            num_slots=view.num_slots, inner=view)  # fmt: skip


def flip_layer0_byte(pool, slot: int, page_size: int, *, byte: int = 0) -> None:
    """Fault injection (drills, tests): XORs byte ``byte`` of ``slot``'s row in the layer-0 array the real-KV check
    reads, in place of the engine's (a fused MHA, an MLA latent or a hybrid pool's first full-attention layer)."""
    pool = getattr(pool, "full_kv_pool", pool)  # HybridLinearKVPool: its full-attention layers' pool
    kv0 = pool.kv_buffer[0]
    if kv0.ndim == 4:  # MLA: [pages, page_size // packing, packing, kv_dim], token-major within a page
        rows = kv0.shape[1] * kv0.shape[2]
        flat = kv0.reshape(kv0.shape[0], rows, kv0.shape[3])
        slot = slot // page_size * rows + slot % page_size
        flipped = testing.flip_kv_byte(flat, np.int32(slot), page_size=rows, byte=byte)
        pool.kv_buffer[0] = jax.device_put(flipped.reshape(kv0.shape), kv0.sharding)
        return
    pool.kv_buffer[0] = testing.flip_kv_byte(kv0, np.int32(slot), page_size=page_size, byte=byte)


_VIEWS = {"MHATokenToKVPool": _mha, "MLATokenToKVPool": _mla, "HybridLinearKVPool": _hybrid_linear}


def pool_view(runner) -> PoolView:
    """The :class:`PoolView` of a ``ModelRunner``'s ``token_to_kv_pool``.

    Raises:
      NotImplementedError: a pool class the mapping does not cover, or an unexpected layer layout, named.
    """
    pool = runner.token_to_kv_pool
    make = _VIEWS.get(type(pool).__name__)
    if make is None:
        raise NotImplementedError(f"the KV pool {type(pool).__name__} (the mapped pools: {', '.join(sorted(_VIEWS))})")
    return make(pool, int(runner.page_size))
