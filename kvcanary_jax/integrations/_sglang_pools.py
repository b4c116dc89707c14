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

    def canary_pool(self, *, max_rows: int, **kwargs) -> kc.CanaryPool:
        """The :class:`kvcanary_jax.CanaryPool` of this view for batches of at most ``max_rows`` rows; ``kwargs``
        (the FULL group's verify capacity, the token pool) pass through."""
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

    def sweep_plan(self, canary: kc.KvCanary, entries: kc.SweepEntries, arrays: dict) -> kc.SweepPlan:
        """The sweep's plan of ``entries`` (full-pool slots, a radix walk), from :meth:`arrays` as they stand now."""
        return canary.sweep_plan(entries)


@dataclasses.dataclass(frozen=True)
class SwaPoolView(PoolView):
    """``SWAKVPool``: a FULL group over the full-attention sub-pool and an SWA group over the sliding-window one.

    The engine numbers a token's KV by its full-pool slot (``req_to_token``, ``out_cache_loc``); its SWA-layer KV sits
    at ``full_to_swa_index_mapping[slot]`` of the SWA sub-pool (0: freed, the token left every window). The allocator
    keeps that table in host numpy and rewrites it as it allocates and frees; :meth:`arrays` copies it at each launch
    (HEAD, TAIL, sweep), so a launch maps slots as the engine does at that moment, and a slot freed when it left the
    window maps to 0, which the canary skips.

    The window: an SWA layer's query at position ``q`` attends keys ``k`` with ``q - k < sliding_window`` (sglang-jax's
    native and Pallas attention), itself included: of a forward's cached prefix ``[0, P)`` it reads the last
    ``sliding_window - 1`` positions. :attr:`swa_window` is that, so the SWA group verifies exactly the SWA slots the
    forward reads (the engine frees only slots older than ``sliding_window + page_size`` positions).

    Attributes (besides the base class's):
      swa_slots: slots of the SWA sub-pool (page 0 included).
      swa_window: cached positions the SWA group verifies per forward (``sliding_window - 1``).
    """

    swa_slots: int = 0
    swa_window: int = 0

    def canary_pool(self, *, max_rows: int, **kwargs) -> kc.CanaryPool:
        """Both groups; the SWA group's plans hold ``max_rows * swa_window`` entries, what a batch can verify (its
        cost follows the window, not the sequences)."""
        swa = kc.SwaGroup(num_slots=self.swa_slots, window=self.swa_window, page_size=self.page_size,
                          verify_capacity=max_rows * self.swa_window)  # fmt: skip
        return kc.CanaryPool(num_slots=self.num_slots, page_size=self.page_size, swa=swa, **kwargs)

    def arrays(self, pool) -> dict:
        """The full sub-pool's first layer array, the SWA sub-pool's, and a copy of the full->SWA table (i32 numpy)."""
        lut = pool.full_to_swa_index_mapping
        return {"full": pool.full_kv_pool.kv_buffer[0], "swa": pool.swa_kv_pool.kv_buffer[0],
                "full_to_swa": np.array(lut, np.int32)}  # fmt: skip

    def sources(self, canary: kc.KvCanary, arrays: dict) -> kc.KvSources:
        full_k, full_v = kv_sources(arrays["full"])
        swa_k, swa_v = kv_sources(arrays["swa"])
        return canary.kv_sources(full_k=full_k, full_v=full_v, swa_k=swa_k, swa_v=swa_v)

    def batch_fields(self, arrays: dict) -> dict:
        """The full->SWA table as :attr:`kvcanary_jax.CanaryBatch.full_to_swa_index_mapping` (traced)."""
        return {"full_to_swa_index_mapping": arrays["full_to_swa"]}

    def sweep_plan(self, canary: kc.KvCanary, entries: kc.SweepEntries, arrays: dict) -> kc.SweepPlan:
        """Both groups' sweep plans: the SWA group's through the table as it stands (a freed SWA slot is skipped)."""
        return canary.sweep_plan(entries, arrays["full_to_swa"])


def layer_pool(pool, group: str = "full"):
    """The (sub-)pool whose ``kv_buffer[0]`` is the array group ``group`` (``"full"`` or ``"swa"``) checks: the pool
    itself, or an ``SWAKVPool``'s full or SWA sub-pool (fault drills flip its bytes)."""
    if group not in ("full", "swa"):
        raise ValueError(f"group must be 'full' or 'swa'; got {group!r}")
    if hasattr(pool, "swa_kv_pool"):
        return pool.swa_kv_pool if group == "swa" else pool.full_kv_pool
    if group == "swa":
        raise ValueError(f"the KV pool {type(pool).__name__} has no SWA group")
    return getattr(pool, "full_kv_pool", pool)  # HybridLinearKVPool: its full-attention layers' pool


def _fused_slots(kv0, page_size: int, what: str) -> int:
    """Slots of a fused K/V layer array ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]``."""
    if kv0.ndim != 5 or kv0.shape[1] != page_size or math.prod(kv0.shape[2:4]) % 2:
        raise NotImplementedError(f"unexpected {what} KV layer layout {jax.typeof(kv0)} for page_size={page_size}")
    return int(kv0.shape[0]) * page_size


def _mha(pool, page_size: int, runner) -> PoolView:
    return PoolView(name=type(pool).__name__, page_size=page_size,
                    num_slots=_fused_slots(pool.kv_buffer[0], page_size, "fused"))  # fmt: skip


def _swa(pool, page_size: int, runner) -> SwaPoolView:
    dp = int(getattr(pool, "dp_size", 1))
    if dp > 1 or isinstance(pool.full_to_swa_index_mapping, list):
        raise NotImplementedError(f"the SWA pool (SWAKVPool) with DP > 1 (dp_size={dp}: one full->SWA table per rank)")
    if pool.full_to_swa_index_mapping is None:
        raise NotImplementedError("the SWA pool (SWAKVPool) without its allocator's full->SWA table")
    window = int(runner.sliding_window_size or 0)
    if window < 2:  # a window of 1 reads no cached position: nothing for the SWA group to verify
        raise NotImplementedError(f"the SWA pool (SWAKVPool) with sliding_window={window} (the mapping needs >= 2)")
    full, swa = len(runner.model_config.full_attention_layer_ids), len(runner.model_config.swa_attention_layer_ids)
    if not full or not swa:
        raise NotImplementedError(f"the SWA pool (SWAKVPool) with {full} full and {swa} SWA layers")
    num_slots = _fused_slots(pool.full_kv_pool.kv_buffer[0], page_size, "full")
    swa_slots = _fused_slots(pool.swa_kv_pool.kv_buffer[0], page_size, "SWA")
    return SwaPoolView(name=type(pool).__name__, page_size=page_size, num_slots=num_slots, swa_slots=swa_slots,
                       swa_window=window - 1)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MlaView(PoolView):
    """One FULL group over an ``MLATokenToKVPool``: K only, its real-KV source layer 0's latent row.

    MLA caches one latent row per token per layer (``c_kv`` then ``k_pe``, each padded to 128): no V, so the pool has
    no V endpoints (``with_v=False``). PARTIAL folds the row's first 16 bytes (``c_kv``'s first values), ALL the whole
    row (:func:`~kvcanary_jax.integrations._sglang_mapping.mla_source`).
    """

    def canary_pool(self, *, max_rows: int, **kwargs) -> kc.CanaryPool:
        return kc.CanaryPool(num_slots=self.num_slots, page_size=self.page_size, with_v=False, **kwargs)

    def sources(self, canary: kc.KvCanary, arrays: dict[str, jax.Array]) -> kc.KvSources:
        return canary.kv_sources(full_k=mla_source(arrays["full"], self.page_size))


def _mla(pool, page_size: int, runner) -> PoolView:
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

    def canary_pool(self, *, max_rows: int, **kwargs) -> kc.CanaryPool:
        return self.inner.canary_pool(max_rows=max_rows, **kwargs)

    def arrays(self, pool) -> dict[str, jax.Array]:
        return self.inner.arrays(pool.full_kv_pool)

    def sources(self, canary: kc.KvCanary, arrays: dict[str, jax.Array]) -> kc.KvSources:
        return self.inner.sources(canary, arrays)

    def batch_fields(self, arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return self.inner.batch_fields(arrays)

    def sweep_plan(self, canary: kc.KvCanary, entries: kc.SweepEntries, arrays: dict) -> kc.SweepPlan:
        return self.inner.sweep_plan(canary, entries, arrays)


def _hybrid_linear(pool, page_size: int, runner) -> PoolView:
    inner = pool.full_kv_pool
    make = _VIEWS.get(type(inner).__name__)
    if make is None or make is _hybrid_linear:
        raise NotImplementedError(f"{type(pool).__name__} over {type(inner).__name__}")
    view = make(inner, page_size, runner)
    return HybridLinearView(name=f"{type(pool).__name__}({view.name})", page_size=page_size,
                            num_slots=view.num_slots, inner=view)  # fmt: skip


def flip_layer0_byte(pool, slot: int, page_size: int, *, group: str = "full", byte: int = 0) -> None:
    """Fault injection (drills, tests): XORs byte ``byte`` of ``slot``'s row in the layer-0 array group ``group``'s
    real-KV check reads (:func:`layer_pool`: a fused MHA, an MLA latent, a hybrid pool's first full-attention layer,
    an SWA pool's full or SWA sub-pool; ``slot`` numbers that sub-pool), in place of the engine's."""
    pool = layer_pool(pool, group)
    kv0 = pool.kv_buffer[0]
    if kv0.ndim == 4:  # MLA: [pages, page_size // packing, packing, kv_dim], token-major within a page
        rows = kv0.shape[1] * kv0.shape[2]
        flat = kv0.reshape(kv0.shape[0], rows, kv0.shape[3])
        slot = slot // page_size * rows + slot % page_size
        flipped = testing.flip_kv_byte(flat, np.int32(slot), page_size=rows, byte=byte)
        pool.kv_buffer[0] = jax.device_put(flipped.reshape(kv0.shape), kv0.sharding)
        return
    pool.kv_buffer[0] = testing.flip_kv_byte(kv0, np.int32(slot), page_size=page_size, byte=byte)


_VIEWS = {"MHATokenToKVPool": _mha, "SWAKVPool": _swa, "MLATokenToKVPool": _mla, "HybridLinearKVPool": _hybrid_linear}


def pool_view(runner) -> PoolView:
    """The :class:`PoolView` of a ``ModelRunner``'s ``token_to_kv_pool``.

    Raises:
      NotImplementedError: a pool class the mapping does not cover, or an unexpected layer layout, named.
    """
    pool = runner.token_to_kv_pool
    make = _VIEWS.get(type(pool).__name__)
    if make is None:
        raise NotImplementedError(f"the KV pool {type(pool).__name__} (the mapped pools: {', '.join(sorted(_VIEWS))})")
    return make(pool, int(runner.page_size), runner)
