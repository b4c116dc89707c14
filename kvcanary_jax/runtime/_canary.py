"""``KvCanary``: wraps a jitted decode step with SGLang's HEAD (before forward) and TAIL (after forward) launches.

Usage inside the user's step (donate the KV cache and the canary state)::

    canary = KvCanary(config, CanaryPool(num_slots=4096, page_size=16))
    state = canary.init_state()

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(params, kv_cache, canary_state, batch):
        cb = CanaryBatch(...)                                    # from the step's batch
        canary_state = canary.before_forward(canary_state, cb)   # HEAD: plans, verify, write
        canary_state, kv_cache = fence(canary_state, kv_cache)   # keep the canary out of the forward
        logits, kv_cache = forward(params, kv_cache, batch)
        canary_state, kv_cache = fence(canary_state, kv_cache)
        sources = canary.kv_sources(full_k=kv_cache.k[0], full_v=kv_cache.v[0])
        canary_state = canary.after_forward(canary_state, cb, sources)  # TAIL: verify + write with real KV
        return logits, kv_cache, canary_state
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core import _ops, _plans, _ring
from kvcanary_jax.core._config import CanaryConfig
from kvcanary_jax.core._constants import CanaryLaunchTag, Half, Phase, RealKvHashMode
from kvcanary_jax.core._state import CanaryDeviceState, allocate_canary_buffer
from kvcanary_jax.runtime import _pool, _sweep
from kvcanary_jax.runtime._batch import CanaryBatch, CanaryState
from pallas_kernels import checks
from pallas_kernels.phase import api as phase_api


@dataclasses.dataclass(frozen=True)
class KvCanary:
    """The canary of one KV pool: static settings plus pure functions over :class:`CanaryState`.

    It is frozen and hashable, so closing over it in ``jax.jit`` (or passing it as a static argument) is free.

    Attributes:
      config: the :class:`CanaryConfig`.
      pool: the :class:`CanaryPool` description.
    """

    config: CanaryConfig
    pool: _pool.CanaryPool

    def __post_init__(self):
        if not isinstance(self.config, CanaryConfig):
            raise TypeError(f"config must be a CanaryConfig; got {type(self.config).__name__}")
        if not isinstance(self.pool, _pool.CanaryPool):
            raise TypeError(f"pool must be a CanaryPool; got {type(self.pool).__name__}")
        if self.config.enable_verify_token_assert and (self.pool.max_reqs is None or self.pool.max_context_len is None):
            raise ValueError(
                "config.enable_verify_token_assert keeps an expected-token pool shaped like req_to_token; set "
                f"CanaryPool(max_reqs=..., max_context_len=...); got max_reqs={self.pool.max_reqs}, "
                f"max_context_len={self.pool.max_context_len}"
            )

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def groups(self) -> tuple[_pool.Group, ...]:
        return self.pool.groups

    @property
    def halves(self) -> tuple[Half, ...]:
        return (Half.K, Half.V) if self.pool.with_v else (Half.K,)

    def launch_tags(self, phases: tuple[Phase | str, ...] = tuple(Phase)) -> tuple[CanaryLaunchTag, ...]:
        """Tags this canary launches in ``phases`` (SWEEP only when ``sweep_interval > 0``); empty when off.

        Phases are :class:`Phase` members or their names (``"HEAD"``, ``"TAIL"``, ``"SWEEP"``).
        """
        if not self.enabled:
            return ()
        phases = tuple(Phase[p] if isinstance(p, str) else Phase(p) for p in phases)
        phases = tuple(p for p in phases if p is not Phase.SWEEP or self.config.sweep_interval > 0)
        return tuple(sorted(g.tag(p, h) for g in self.groups for p in phases for h in self.halves))

    def init_state(self) -> CanaryState:
        """Allocates every buffer once. The chain-position assert starts off (warm-up); see ``mark_init_finished``."""
        device = CanaryDeviceState.allocate(
            config=self.config,
            req_to_token_alloc_size=self.pool.max_reqs,
            max_context_len=self.pool.max_context_len,
        )
        device = dataclasses.replace(device, enable_chain_position_assert=jnp.zeros((1,), jnp.int32))
        buffers = {"full": None, "swa": None}
        if self.enabled:
            for g in self.groups:
                v = self.pool.with_v
                buffers[g.name] = _pool.GroupBuffers(
                    k_head=allocate_canary_buffer(g.num_slots),
                    k_tail=allocate_canary_buffer(g.num_slots),
                    v_head=allocate_canary_buffer(g.num_slots) if v else None,
                    v_tail=allocate_canary_buffer(g.num_slots) if v else None,
                )
        return CanaryState(device=device, verify_overflows=jnp.zeros((1,), jnp.int32), **buffers)

    def mark_init_finished(self, state: CanaryState) -> CanaryState:
        """Turns on the write-time chain-position assert after warm-up; a device value, so nothing retraces."""
        device = dataclasses.replace(state.device, enable_chain_position_assert=jnp.ones((1,), jnp.int32))
        return dataclasses.replace(state, device=device)

    def kv_sources(self, *, full_k=None, full_v=None, swa_k=None, swa_v=None) -> _pool.KvSources:
        """Real-KV sources from KV arrays (paged ``[pages, page_size, ...]``) or ready :class:`RealKvSource` s.

        SGLang folds layer 0's K (and V) row of each slot: pass e.g. ``full_k=kv.k[0], full_v=kv.v[0]``. Arrays are
        wrapped with the group's page size and read their whole token row in ALL mode.
        """
        page = {g.name: g.page_size for g in self.groups}
        given = {"full_k": full_k, "full_v": full_v, "swa_k": swa_k, "swa_v": swa_v}
        if self.pool.swa is None and (swa_k is not None or swa_v is not None):
            raise ValueError("swa_k / swa_v were given but the pool has no SWA group (CanaryPool.swa is None)")
        return _pool.KvSources(
            **{name: _pool.as_sources(name, value, page.get(name.split("_")[0], 1)) for name, value in given.items()}
        )

    def before_forward(self, state: CanaryState, batch: CanaryBatch) -> CanaryState:
        """HEAD launches, before the model writes KV: per group, build plans; per half, verify then write.

        HEAD records carry no real-KV hash (the forward has not produced the KV yet).

        Args:
          state: the canary state (donate it with the rest of the step's state).
          batch: this step's :class:`CanaryBatch`; ``req_to_token`` already maps this step's new positions.

        Returns:
          The new state. Mismatches go to the ring; nothing is raised here.
        """
        if not self.enabled:
            return state
        batch = self._checked_batch(state, batch)
        state = self._update_expected_tokens(state, batch)
        for g in self.groups:
            state = self._forward_phase(state, batch, g, Phase.HEAD, _pool.KvSources())
        return state

    def after_forward(self, state: CanaryState, batch: CanaryBatch, kv_cache_sources: _pool.KvSources) -> CanaryState:
        """TAIL launches, after the forward: per group and half, verify (with real KV) then write (folding real KV).

        Args:
          state: the state returned by ``before_forward`` in the same step.
          batch: the same batch.
          kv_cache_sources: the updated KV cache as :class:`KvSources` (see :meth:`kv_sources`).

        Returns:
          The new state.
        """
        if not self.enabled:
            return state
        batch = self._checked_batch(state, batch)
        self._check_sources(kv_cache_sources)
        for g in self.groups:
            state = self._forward_phase(state, batch, g, Phase.TAIL, kv_cache_sources)
        return state

    def sweep_plan(
        self, entries: _sweep.SweepEntries, full_to_swa_index_mapping: np.ndarray | None = None
    ) -> _sweep.SweepPlan:
        """Host: packs the prefix cache's slots (full-pool space) into static-capacity device plans.

        Args:
          entries: every cached slot once, e.g. from :func:`kvcanary_jax.walk_prefix_tree`.
          full_to_swa_index_mapping: the current full->SWA table (numpy); required with an SWA group, whose plan
            keeps only resident slots.

        Raises:
          ValueError: for more entries than a group has slots, or a missing table.
        """
        full, *rest = self.groups
        swa_plan = None
        if rest:
            if full_to_swa_index_mapping is None:
                raise ValueError("the pool has an SWA group: sweep_plan needs full_to_swa_index_mapping")
            swa_entries = _sweep.translate_entries(entries, full_to_swa_index_mapping)
            swa_plan = _sweep.pack_entries(swa_entries, rest[0].num_slots, what="SWA sweep")
        return _sweep.SweepPlan(full=_sweep.pack_entries(entries, full.num_slots, what="FULL sweep"), swa=swa_plan)

    def sweep(self, state: CanaryState, plan: _sweep.SweepPlan, kv_cache_sources: _pool.KvSources) -> CanaryState:
        """SWEEP launches: verify every prefix-cached slot against the TAIL buffers, with real KV.

        Args:
          state: the canary state.
          plan: the :class:`SweepPlan` from :meth:`sweep_plan`.
          kv_cache_sources: the current KV cache as :class:`KvSources` (the same sources ``after_forward`` gets).

        Returns:
          The new state.
        """
        if not self.enabled:
            return state
        self._check_state(state)
        self._check_sources(kv_cache_sources)
        if not isinstance(plan, _sweep.SweepPlan):
            raise TypeError(f"plan must be a SweepPlan (see KvCanary.sweep_plan); got {type(plan).__name__}")
        device = state.device
        for g in self.groups:
            group_plan = getattr(plan, g.name)
            if group_plan is None:
                raise ValueError(f"the sweep plan has no {g.name.upper()} plan but the pool has that group")
            for half in self.halves:
                launch = self._verify(
                    state.buffers(g).buffer(Phase.SWEEP, half),
                    group_plan,
                    g,
                    Phase.SWEEP,
                    half,
                    kv_cache_sources,
                    check_expected_token=False,
                )
                device = _ops.commit(device, launch)
        return dataclasses.replace(state, device=device)

    # -- one phase of one group ------------------------------------------------------------------------------------

    def _forward_phase(
        self, state: CanaryState, batch: CanaryBatch, g: _pool.Group, phase: Phase, sources: _pool.KvSources
    ) -> CanaryState:
        """A HEAD or TAIL phase of group ``g``: verify each half's cached slots, then write this step's records.

        Its effects are SGLang's launch sequence (verify K, write K, verify V, write V). The lower layer's fused
        ``phase`` op runs it in three kernels (plans built in-kernel, K and V together, rows placed by the kernels);
        backends without that op (Mosaic on TPU) run :meth:`_per_launch_phase`, with the same bytes.
        """
        if not phase_api.supports(self.config.backend):
            return self._per_launch_phase(state, batch, g, phase, sources)
        check_token = self.config.enable_verify_token_assert
        token_pool = state.device.req_to_verify_expected_tokens if check_token else None
        expected = self._expected_inputs(batch) or (None, None)
        fused_batch = phase_api.Batch(
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            req_to_token=batch.req_to_token,
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            full_to_swa_index_mapping=batch.full_to_swa_index_mapping if g.window else None,
            token_pool=token_pool,
            token_pool_lens=batch.token_ids_lens if check_token else None,
            expected_input_ids=expected[0],
            expected_input_positions=expected[1],
        )
        buffers = state.buffers(g)
        device, new_buffers, enable = _ops.fused_phase(
            state.device,
            tuple(buffers.buffer(phase, h) for h in self.halves),
            fused_batch,
            tags=tuple(int(g.tag(phase, h)) for h in self.halves),
            real_kv_sources=tuple(sources.get(g, h) for h in self.halves),
            real_kv_hash_mode=self.config.real_kv_hash_mode,
            verify_capacity=g.verify_capacity,
            window=g.window,
            token_offset=self.pool.kv_token_id_vs_position_offset,
            backend=self.config.backend,
        )
        for h, buf in zip(self.halves, new_buffers, strict=True):
            buffers = buffers.with_buffer(phase, h, buf)
        # Only the HEAD phase counts overflows: the TAIL phase rebuilds the identical plan.
        overflows = state.verify_overflows + (1 - enable if phase is Phase.HEAD else 0)
        return dataclasses.replace(state, device=device, verify_overflows=overflows, **{g.name: buffers})

    def _per_launch_phase(
        self, state: CanaryState, batch: CanaryBatch, g: _pool.Group, phase: Phase, sources: _pool.KvSources
    ) -> CanaryState:
        """:meth:`_forward_phase` from the per-launch ops (the path of backends without a fused phase).

        Every verify reads its buffer before any write of the phase; their rows come out of one prefix sum and are
        gathered before the in-place stores, and all rows land in the ring at once, in SGLang's launch order
        (verify K, write K, verify V, write V). Fewer, larger launches: the step pays per launch, not per byte.
        """
        verify_plan, write_plan = self._plans(state, batch, g)
        buffers, capacity = state.buffers(g), state.device.violation_log.ring_capacity
        check_token = self.config.enable_verify_token_assert
        verifies = [
            self._verify(buffers.buffer(phase, h), verify_plan, g, phase, h, sources, check_expected_token=check_token)
            for h in self.halves
        ]
        verify_rows = _ops.pending_rows([(v.flags, v.build_rows) for v in verifies], capacity)
        store_after = _ring.after(*(p.rows for p in verify_rows))
        out_cache_loc = _plans.translate(batch.out_cache_loc, batch.full_to_swa_index_mapping if g.window else None)
        writes = []
        for h in self.halves:
            buf, launch = _ops.write_launch(
                buffers.buffer(phase, h),
                write_plan,
                batch.input_ids,
                batch.positions,
                out_cache_loc,
                state.device.enable_chain_position_assert,
                tag=g.tag(phase, h),
                real_kv_sources=sources.get(g, h),
                real_kv_hash_mode=self.config.real_kv_hash_mode,
                expected_inputs=self._expected_inputs(batch),
                backend=self.config.backend,
                store_after=store_after,
            )
            buffers = buffers.with_buffer(phase, h, buf)
            writes.append(launch)
        write_rows = _ops.pending_rows([(w.flags, w.build_rows) for w in writes], capacity)
        in_launch_order = [p for pair in zip(verify_rows, write_rows, strict=True) for p in pair]
        launches = [x for pair in zip(verifies, writes, strict=True) for x in pair]
        device = _ops.apply(state.device, in_launch_order, launches)
        # Only the HEAD phase counts overflows: the TAIL phase rebuilds the identical plan.
        overflows = state.verify_overflows + (1 - verify_plan.enable if phase is Phase.HEAD else 0)
        return dataclasses.replace(state, device=device, verify_overflows=overflows, **{g.name: buffers})

    def _plans(
        self, state: CanaryState, batch: CanaryBatch, g: _pool.Group
    ) -> tuple[_plans.VerifyPlan, _plans.WritePlan]:
        token_pool = state.device.req_to_verify_expected_tokens if self.config.enable_verify_token_assert else None
        return _plans.build_plans(
            batch.req_pool_indices,
            batch.prefix_lens,
            batch.extend_lens,
            batch.req_to_token,
            verify_capacity=g.verify_capacity,
            write_req_capacity=batch.req_pool_indices.shape[0],
            swa_window_size=g.window,
            full_to_swa_index_mapping=batch.full_to_swa_index_mapping if g.window else None,
            req_to_verify_expected_tokens=token_pool,
            expected_tokens_valid_lens=batch.token_ids_lens if token_pool is not None else None,
            kv_token_id_vs_position_offset=self.pool.kv_token_id_vs_position_offset,
        )

    def _verify(self, buf, plan, g, phase, half, sources, *, check_expected_token) -> _ops.Launch:
        return _ops.verify_launch(
            buf,
            plan,
            tag=g.tag(phase, half),
            real_kv_sources=sources.get(g, half),
            real_kv_hash_mode=self.config.real_kv_hash_mode,
            check_expected_token=check_expected_token,
            backend=self.config.backend,
        )

    def _expected_inputs(self, batch: CanaryBatch) -> tuple[jax.Array, jax.Array] | None:
        """The write input assert's oracle ``(tokens, positions)``, or None when the assert is off."""
        if not self.config.enable_write_input_assert:
            return None
        positions = batch.positions if batch.expected_positions is None else batch.expected_positions
        return batch.expected_input_ids, positions

    def _update_expected_tokens(self, state: CanaryState, batch: CanaryBatch) -> CanaryState:
        """Scatters the batched requests' token history into the expected-token pool (SGLang's snapshot scatter)."""
        if not self.config.enable_verify_token_assert:
            return state
        rows = batch.req_pool_indices
        # Padding rows point at row 0, which is never real: writing it is harmless and keeps shapes static.
        pool_tokens = state.device.req_to_verify_expected_tokens.at[rows].set(batch.token_ids[rows])
        device = dataclasses.replace(state.device, req_to_verify_expected_tokens=pool_tokens)
        return dataclasses.replace(state, device=device)

    # -- checks of what only this layer knows ----------------------------------------------------------------------

    @staticmethod
    def _check_state(state) -> None:
        if not isinstance(state, CanaryState):
            raise TypeError(f"state must be a CanaryState (from KvCanary.init_state); got {type(state).__name__}")

    def _checked_batch(self, state, batch) -> CanaryBatch:
        """Checks the batch against the config; returns it with every field a jax array (numpy works eagerly too)."""
        self._check_state(state)
        if not isinstance(batch, CanaryBatch):
            raise TypeError(f"batch must be a CanaryBatch; got {type(batch).__name__}")
        if self.pool.swa is not None and batch.full_to_swa_index_mapping is None:
            raise ValueError(
                "the pool has an SWA group, so batch.full_to_swa_index_mapping (i32[num_slots + 1], the full->SWA "
                "slot table) is required"
            )
        if self.config.enable_write_input_assert and batch.expected_input_ids is None:
            raise ValueError(
                "config.enable_write_input_assert compares written tokens with batch.expected_input_ids, but it is "
                "None; pass the oracle's tokens (i32[T]) or turn the assert off"
            )
        if self.config.enable_verify_token_assert:
            if batch.token_ids is None or batch.token_ids_lens is None:
                raise ValueError(
                    "config.enable_verify_token_assert needs batch.token_ids (i32[max_reqs, max_context_len]) and "
                    "batch.token_ids_lens (i32[bs]); pass the requests' token history or turn the assert off"
                )
            pool_shape = state.device.req_to_verify_expected_tokens.shape
            checks.array("batch.token_ids", batch.token_ids, dtype=jnp.int32, shape=pool_shape)
            checks.array(
                "batch.token_ids_lens", batch.token_ids_lens, dtype=jnp.int32, shape=batch.req_pool_indices.shape
            )
        return jax.tree.map(jnp.asarray, batch)

    def _check_sources(self, sources) -> None:
        if not isinstance(sources, _pool.KvSources):
            raise TypeError(
                f"kv_cache_sources must be KvSources (see KvCanary.kv_sources); got {type(sources).__name__}"
            )
        if self.config.real_kv_hash_mode == RealKvHashMode.NONE:
            return
        for g in self.groups:
            for half in self.halves:
                if not sources.get(g, half):
                    name = f"{g.name}_{half.name.lower()}"
                    raise ValueError(
                        f"real_kv_hash_mode={self.config.real_kv_hash_mode.name} but kv_cache_sources has no "
                        f"{name} source; pass kv_sources({name}=<layer-0 {half.name} array of the "
                        f"{g.name.upper()} pool>)"
                    )
