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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import ops, plans, pool, ring, sweep, validation
from kvcanary_jax.config import CanaryConfig
from kvcanary_jax.constants import CanaryLaunchTag, RealKvHashMode
from kvcanary_jax.state import CanaryDeviceState, ViolationLog, allocate_canary_buffer

_HALVES = ("K", "V")


def fence(*trees: Any) -> tuple[Any, ...]:
    """Returns ``trees`` unchanged, behind an optimization barrier: put it around the model forward.

    Without it XLA may schedule canary launches in the middle of the forward, and the step pays for that far
    more than for the launches themselves: on an H200, a Llama-3-8B-shaped decode step at batch 64 x 8K context
    went from +2.5 % to +0.6 % with the canary on (``benchmarks/RESULTS.md``).
    """
    return jax.lax.optimization_barrier(trees)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CanaryBatch:
    """One forward step as the canary sees it: static shapes, int32 arrays, request-major tokens.

    A batch has ``bs`` rows (requests) and ``T`` token entries. Row ``r`` owns the ``extend_lens[r]`` entries
    starting at ``sum(extend_lens[:r])``. Padding rows (``req_pool_indices == 0``) come after the real rows and own
    no tokens; entries past ``sum(extend_lens)`` are padding too. How the usual step shapes map onto the fields:

    ================================  ==========================  =============================
    step                              ``prefix_lens[r]``           ``extend_lens[r]``
    ================================  ==========================  =============================
    decode                            tokens already cached        1
    prefill (with a prefix-cache hit) cached prefix length (0)     prompt tokens run this step
    chunked prefill                   tokens of earlier chunks     this chunk's length
    speculative target-verify         accepted tokens cached       1 + number of draft tokens
    speculative draft-extend          accepted tokens cached       tokens the draft model runs
    ================================  ==========================  =============================

    Attributes:
      req_pool_indices: i32[bs] row of each request in ``req_to_token`` (0 = padding row; row 0 is never real).
      prefix_lens: i32[bs] tokens of the request whose KV is already cached before this step (verified).
      extend_lens: i32[bs] tokens this step appends (written).
      req_to_token: i32[max_reqs, max_context_len] full-pool KV slot of each (request row, position), already
        holding this step's slots; slot 0 is the padding slot.
      input_ids: i32[T] token id of each new entry.
      positions: i32[T] 0-based position of each new entry in its request.
      out_cache_loc: i32[T] full-pool slot each new entry's KV goes to; < 0 skips the entry.
      full_to_swa_index_mapping: i32[num_slots + 1] full slot -> SWA slot (0 = not resident). Required with an
        SWA group, ignored otherwise.
      expected_input_ids: i32[T] what each input token should be, from an independent source (a token oracle, the
        request's history). Required when ``config.enable_write_input_assert``, ignored otherwise.
      expected_positions: i32[T] expected positions for the input assert; None = ``positions``.
      token_ids: i32[max_reqs, max_context_len] token id of each (request row, position), mirroring
        ``req_to_token``. Required when ``config.enable_verify_token_assert``, ignored otherwise.
      token_ids_lens: i32[bs] how many leading ``token_ids`` of each row are known (checks past it are skipped).
    """

    req_pool_indices: jax.Array
    prefix_lens: jax.Array
    extend_lens: jax.Array
    req_to_token: jax.Array
    input_ids: jax.Array
    positions: jax.Array
    out_cache_loc: jax.Array
    full_to_swa_index_mapping: jax.Array | None = None
    expected_input_ids: jax.Array | None = None
    expected_positions: jax.Array | None = None
    token_ids: jax.Array | None = None
    token_ids_lens: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CanaryState:
    """All device state of one canary, threaded through the user's jitted step and donated.

    Attributes:
      device: ring, counters and flags shared by every launch (:class:`CanaryDeviceState`).
      full: FULL-group buffers (None when the canary is off).
      swa: SWA-group buffers (None without an SWA group or when off).
      verify_overflows: i32[1] per-forward verify plans that overflowed their capacity and were skipped.
    """

    device: CanaryDeviceState
    full: pool.GroupBuffers | None
    swa: pool.GroupBuffers | None
    verify_overflows: jax.Array

    @property
    def violation_log(self) -> ViolationLog:
        return self.device.violation_log

    def buffers(self, group: pool.Group) -> pool.GroupBuffers:
        return getattr(self, group.name)


@dataclasses.dataclass(frozen=True)
class KvCanary:
    """The canary of one KV pool: static settings plus pure functions over :class:`CanaryState`.

    It is frozen and hashable, so closing over it in ``jax.jit`` (or passing it as a static argument) is free.

    Attributes:
      config: the :class:`CanaryConfig`.
      pool: the :class:`CanaryPool` description.
    """

    config: CanaryConfig
    pool: pool.CanaryPool

    def __post_init__(self):
        if not isinstance(self.config, CanaryConfig):
            raise TypeError(f"config must be a CanaryConfig; got {type(self.config).__name__}")
        if not isinstance(self.pool, pool.CanaryPool):
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
    def groups(self) -> tuple[pool.Group, ...]:
        return self.pool.groups

    @property
    def halves(self) -> tuple[str, ...]:
        return _HALVES if self.pool.with_v else _HALVES[:1]

    def launch_tags(self, phases: tuple[str, ...] = ("HEAD", "TAIL", "SWEEP")) -> tuple[CanaryLaunchTag, ...]:
        """Tags this canary launches in ``phases`` (SWEEP only when ``sweep_interval > 0``); empty when off."""
        if not self.enabled:
            return ()
        phases = tuple(p for p in phases if p != "SWEEP" or self.config.sweep_interval > 0)
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
                buffers[g.name] = pool.GroupBuffers(
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

    def kv_sources(self, *, full_k=None, full_v=None, swa_k=None, swa_v=None) -> pool.KvSources:
        """Real-KV sources from KV arrays (paged ``[pages, page_size, ...]``) or ready :class:`RealKvSource` s.

        SGLang folds layer 0's K (and V) row of each slot: pass e.g. ``full_k=kv.k[0], full_v=kv.v[0]``. Arrays are
        wrapped with the group's page size and read their whole token row in ALL mode.
        """
        page = {g.name: g.page_size for g in self.groups}
        given = {"full_k": full_k, "full_v": full_v, "swa_k": swa_k, "swa_v": swa_v}
        if self.pool.swa is None and (swa_k is not None or swa_v is not None):
            raise ValueError("swa_k / swa_v were given but the pool has no SWA group (CanaryPool.swa is None)")
        return pool.KvSources(
            **{name: pool.as_sources(name, value, page.get(name.split("_")[0], 1)) for name, value in given.items()}
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
        batch = self._validate(state, batch)
        state = self._update_expected_tokens(state, batch)
        for g in self.groups:
            state = self._forward_launches(state, batch, g, "HEAD", pool.KvSources())
        return state

    def after_forward(self, state: CanaryState, batch: CanaryBatch, kv_cache_sources: pool.KvSources) -> CanaryState:
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
        batch = self._validate(state, batch)
        self._validate_sources(kv_cache_sources)
        for g in self.groups:
            state = self._forward_launches(state, batch, g, "TAIL", kv_cache_sources)
        return state

    def sweep_plan(
        self, entries: sweep.SweepEntries, full_to_swa_index_mapping: np.ndarray | None = None
    ) -> sweep.SweepPlan:
        """Host: packs the prefix cache's slots (full-pool space) into static-capacity device plans.

        Args:
          entries: every cached slot once, e.g. from :func:`kvcanary_jax.sweep.walk_prefix_tree`.
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
            swa_entries = sweep.translate_entries(entries, full_to_swa_index_mapping)
            swa_plan = sweep.pack_entries(swa_entries, rest[0].num_slots, what="SWA sweep")
        return sweep.SweepPlan(full=sweep.pack_entries(entries, full.num_slots, what="FULL sweep"), swa=swa_plan)

    def sweep(self, state: CanaryState, plan: sweep.SweepPlan, kv_cache_sources: pool.KvSources) -> CanaryState:
        """SWEEP launches: verify every prefix-cached slot against the TAIL buffers, with real KV.

        Args:
          state: the canary state.
          plan: the :class:`kvcanary_jax.sweep.SweepPlan` from :meth:`sweep_plan`.
          kv_cache_sources: the current KV cache as :class:`KvSources` (the same sources ``after_forward`` gets).

        Returns:
          The new state.
        """
        if not self.enabled:
            return state
        self._validate_sources(kv_cache_sources)
        device = state.device
        if not isinstance(plan, sweep.SweepPlan):
            raise TypeError(f"plan must be a SweepPlan (see KvCanary.sweep_plan); got {type(plan).__name__}")
        for g in self.groups:
            group_plan = getattr(plan, g.name)
            if group_plan is None:
                raise ValueError(f"the sweep plan has no {g.name.upper()} plan but the pool has that group")
            for half in self.halves:
                device = ops.canary_verify(
                    device,
                    state.buffers(g).tail(half),
                    group_plan,
                    tag=g.tag("SWEEP", half),
                    real_kv_sources=kv_cache_sources.get(g, half),
                    real_kv_hash_mode=self.config.real_kv_hash_mode,
                    backend=self.config.backend,
                )
        return dataclasses.replace(state, device=device)

    def _forward_launches(self, state, batch, g, phase, sources):
        lut = batch.full_to_swa_index_mapping if g.window else None
        pool_tokens = state.device.req_to_verify_expected_tokens if self.config.enable_verify_token_assert else None
        verify_plan, write_plan = plans.build_plans(
            batch.req_pool_indices,
            batch.prefix_lens,
            batch.extend_lens,
            batch.req_to_token,
            verify_capacity=g.verify_capacity,
            write_req_capacity=batch.req_pool_indices.shape[0],
            swa_window_size=g.window,
            full_to_swa_index_mapping=lut,
            req_to_verify_expected_tokens=pool_tokens,
            expected_tokens_valid_lens=batch.token_ids_lens if pool_tokens is not None else None,
            kv_token_id_vs_position_offset=self.pool.kv_token_id_vs_position_offset,
        )
        expected = {}
        if self.config.enable_write_input_assert:
            positions = batch.positions if batch.expected_positions is None else batch.expected_positions
            expected = {"expected_input_tokens": batch.expected_input_ids, "expected_input_positions": positions}
        out_cache_loc = plans.translate(batch.out_cache_loc, lut)
        buffers, device = state.buffers(g), state.device
        buf = {h: buffers.head(h) if phase == "HEAD" else buffers.tail(h) for h in self.halves}
        kw = {
            h: {
                "tag": g.tag(phase, h),
                "real_kv_sources": sources.get(g, h),
                "real_kv_hash_mode": self.config.real_kv_hash_mode,
                "backend": self.config.backend,
            }
            for h in self.halves
        }
        # Every verify reads its buffer before any write of the phase; their rows come out of one prefix sum and
        # are gathered before the in-place stores, and all rows land in the ring at once, in SGLang's launch order
        # (verify K, write K, verify V, write V). Fewer, larger launches: the step pays per launch, not per byte.
        verifies = [
            ops.verify_launch(device, buf[h], verify_plan, check_expected_token=pool_tokens is not None, **kw[h])
            for h in self.halves
        ]
        verify_rows = ring.first_rows([v.row_source for v in verifies], device.violation_log.ring_capacity)
        store_after = ring.after(*(p.rows for p in verify_rows))
        writes = []
        for h in self.halves:
            buf[h], launch = ops.write_launch(
                device,
                buf[h],
                write_plan,
                batch.input_ids,
                batch.positions,
                out_cache_loc,
                store_after=store_after,
                **expected,
                **kw[h],
            )
            buffers = buffers.with_buffer(phase, h, buf[h])
            writes.append(launch)
        write_rows = ring.first_rows([w.row_source for w in writes], device.violation_log.ring_capacity)
        in_launch_order = [p for pair in zip(verify_rows, write_rows, strict=True) for p in pair]
        launches = [x for pair in zip(verifies, writes, strict=True) for x in pair]
        device = ops.apply(device, in_launch_order, launches)
        # Only the HEAD pass counts overflows: the TAIL pass rebuilds the identical plan.
        overflows = state.verify_overflows + (1 - verify_plan.enable if phase == "HEAD" else 0)
        return dataclasses.replace(state, device=device, verify_overflows=overflows, **{g.name: buffers})

    def _update_expected_tokens(self, state, batch):
        """Scatters the batched requests' token history into the expected-token pool (SGLang's snapshot scatter)."""
        if not self.config.enable_verify_token_assert:
            return state
        pool_tokens = state.device.req_to_verify_expected_tokens
        validation.array("batch.token_ids", batch.token_ids, dtype=jnp.int32, shape=pool_tokens.shape)
        validation.array(
            "batch.token_ids_lens", batch.token_ids_lens, dtype=jnp.int32, shape=batch.req_pool_indices.shape
        )
        rows = batch.req_pool_indices
        # Padding rows point at row 0, which is never real: writing it is harmless and keeps shapes static.
        pool_tokens = pool_tokens.at[rows].set(batch.token_ids[rows])
        device = dataclasses.replace(state.device, req_to_verify_expected_tokens=pool_tokens)
        return dataclasses.replace(state, device=device)

    def _validate(self, state, batch) -> CanaryBatch:
        """Checks the arguments; returns the batch with every field a jax array (numpy works eagerly too)."""
        if not isinstance(state, CanaryState):
            raise TypeError(f"state must be a CanaryState (from KvCanary.init_state); got {type(state).__name__}")
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
        if self.config.enable_verify_token_assert and (batch.token_ids is None or batch.token_ids_lens is None):
            raise ValueError(
                "config.enable_verify_token_assert needs batch.token_ids (i32[max_reqs, max_context_len]) and "
                "batch.token_ids_lens (i32[bs]); pass the requests' token history or turn the assert off"
            )
        return jax.tree.map(jnp.asarray, batch)

    def _validate_sources(self, sources):
        if not isinstance(sources, pool.KvSources):
            raise TypeError(
                f"kv_cache_sources must be KvSources (see KvCanary.kv_sources); got {type(sources).__name__}"
            )
        if self.config.real_kv_hash_mode == RealKvHashMode.NONE:
            return
        for g in self.groups:
            for half in self.halves:
                if not sources.get(g, half):
                    raise ValueError(
                        f"real_kv_hash_mode={self.config.real_kv_hash_mode.name} but kv_cache_sources has no "
                        f"{g.name}_{half.lower()} source; pass kv_sources({g.name}_{half.lower()}=<layer-0 "
                        f"{half} array of the {g.name.upper()} pool>)"
                    )
