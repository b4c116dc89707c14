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

import kvcanary_jax as kc
from kvcanary_jax.integrations._sglang_mapping import kv_sources


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


_VIEWS = {"MHATokenToKVPool": _mha}


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
