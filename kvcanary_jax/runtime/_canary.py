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
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core import _ops
from kvcanary_jax.core._config import CanaryConfig
from kvcanary_jax.core._constants import CanaryLaunchTag, Half, Phase, RealKvHashMode
from kvcanary_jax.core._state import CanaryDeviceState, allocate_canary_buffer
from kvcanary_jax.runtime import _adopt, _inputs, _pool, _sweep
from kvcanary_jax.runtime._batch import CanaryBatch, CanaryState
from pallas_kernels import checks, mesh, realkv
from pallas_kernels.batch_checks import api as batch_checks
from pallas_kernels.phase import api as phase_api

_REQUIRED_FIELDS = (
    "req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions", "out_cache_loc",
)  # fmt: skip


def _phase(value) -> Phase:
    """A Phase from a member, its value or its (case-insensitive) name."""
    if isinstance(value, str) and value.strip().upper() in Phase.__members__:
        return Phase[value.strip().upper()]
    if checks.is_int(value) and int(value) in Phase._value2member_map_:
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
    def fingerprint(self) -> int:
        """What a state's records mean: the pool and the config fields the launches read (not the host's mode,
        periods or backend, which any canary of the same records may differ in)."""
        c = self.config
        fields = (self.pool, c.ring_capacity, c.real_kv_hash_mode, c.enable_write_input_assert,
                  c.enable_verify_token_assert)  # fmt: skip
        return zlib.crc32(repr(fields).encode())

    @property
    def halves(self) -> tuple[Half, ...]:
        return (Half.K, Half.V) if self.pool.with_v else (Half.K,)

    def launch_tags(self, phases: tuple[Phase | str, ...] = tuple(Phase)) -> tuple[CanaryLaunchTag, ...]:
        """Tags this canary launches in ``phases`` (SWEEP only when ``sweep_interval > 0``); empty when off.

        Phases are :class:`Phase` members or their names (``"HEAD"``, ``"TAIL"``, ``"SWEEP"``, any case); a single
        phase may be given alone.
        """
        if not self.enabled:
            return ()
        if isinstance(phases, (str, Phase)) or checks.is_int(phases):
            phases = (phases,)
        phases = tuple(_phase(p) for p in phases)
        phases = tuple(p for p in phases if p is not Phase.SWEEP or self.config.sweep_interval > 0)
        return tuple(sorted(g.tag(p, h) for g in self.groups for p in phases for h in self.halves))

    def coverage(self, sources: _pool.KvSources | None = None) -> str:
        """What this configuration checks and what it does not, in a few lines (for logs and reviews).

        Args:
          sources: the :class:`KvSources` given to ``after_forward``; with them, the real-KV line counts the bytes
            folded per slot out of each source's token row.
        """
        if not self.enabled:
            return "canary off: nothing is checked"
        c, halves = self.config, "+".join(h.name for h in self.halves)
        groups = ", ".join(
            f"{g.name.upper()}" + (f" (last {g.window} positions)" if g.window else "") for g in self.groups
        )
        phases = "HEAD and TAIL" + (f", SWEEP every {c.sweep_interval} steps" if c.sweep_interval else "")
        lines = [
            f"launches: {phases}; halves {halves}; groups {groups}; padding convention '{self.pool.padding}'",
            "chain and position: every cached position of every batch request, at HEAD and TAIL (and idle "
            "prefix-cached slots at SWEEP, if the sweep runs)",
            "batch inputs: out-of-range, negative and reserved values become INVALID_INPUT rows",
        ]
        mode = c.real_kv_hash_mode
        if mode is RealKvHashMode.NONE:
            lines.append(
                "KV bytes: not checked (real_kv_hash_mode='none'): corrupted KV is caught only if it breaks a chain"
            )
        else:
            how = "the first 16 bytes" if mode is RealKvHashMode.PARTIAL else "read_bytes (all by default)"
            lines.append(
                f"KV bytes ({mode.name}): {how} of each slot's token row in each real-KV source, at TAIL/SWEEP"
            )
            for g in self.groups if sources is not None else ():
                for h in self.halves:
                    for i, src in enumerate(sources.get(g, h)):
                        folded = 16 if mode is RealKvHashMode.PARTIAL else src.read_bytes
                        lines.append(
                            f"  {g.name}_{h.name.lower()}[{i}]: {folded} of {src.num_bytes_per_token} bytes per slot "
                            f"folded; other layers and bytes are not covered"
                        )
        lines.append(
            "written tokens vs an oracle: " + ("on" if c.enable_write_input_assert else "off (token swaps go unseen)")
        )
        lines.append(
            "cached tokens vs the requests' history: "
            + ("on" if c.enable_verify_token_assert else "off (report lines say 'token not checked')")
        )
        return "\n".join(lines)

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
        return CanaryState(
            device=device, verify_overflows=jnp.zeros((1,), jnp.int32), fingerprint=self.fingerprint, **buffers
        )

    def mark_init_finished(self, state: CanaryState) -> CanaryState:
        """Turns on the write-time chain-position assert after warm-up; a device value, so nothing retraces."""
        self._check_state(state)
        device = dataclasses.replace(state.device, enable_chain_position_assert=jnp.ones((1,), jnp.int32))
        return dataclasses.replace(state, device=device)

    def kv_sources(self, *, full_k=None, full_v=None, swa_k=None, swa_v=None) -> _pool.KvSources:
        """Real-KV sources from KV arrays (paged ``[pages, page_size, ...]``) or ready :class:`RealKvSource` s.

        SGLang folds layer 0's K (and V) row of each slot: pass e.g. ``full_k=kv.k[0], full_v=kv.v[0]``. Arrays are
        wrapped with the group's page size and read their whole token row in ALL mode.
        """
        groups = {g.name: g for g in self.groups}
        given = {"full_k": full_k, "full_v": full_v, "swa_k": swa_k, "swa_v": swa_v}
        if self.pool.swa is None and (swa_k is not None or swa_v is not None):
            raise ValueError("swa_k / swa_v were given but the pool has no SWA group (CanaryPool.swa is None)")
        if not self.pool.with_v and (full_v is not None or swa_v is not None):
            raise ValueError("full_v / swa_v were given but CanaryPool.with_v is False: no V launch would read them")
        sources = {}
        for name, value in given.items():
            g = groups.get(name.split("_")[0])
            sources[name] = () if g is None else _pool.as_sources(name, value, g.page_size, g.num_slots)
        return _pool.KvSources(**sources)

    @mesh.entry_point("state", "batch")  # explicitly sharded inputs (sglang-jax's): see pallas_kernels.mesh
    def before_forward(self, state: CanaryState, batch: CanaryBatch) -> CanaryState:
        """HEAD launches, before the model writes KV: per group, build plans; per half, verify then write.

        HEAD records carry no real-KV hash (the forward has not produced the KV yet). The batch's values are
        checked first: one that cannot be checked as given (out of range, negative, a reserved row or slot in use)
        becomes an ``INVALID_INPUT`` row and is left out of the launches.

        Args:
          state: the canary state (donate it with the rest of the step's state).
          batch: this step's :class:`CanaryBatch`; ``req_to_token`` already maps this step's new positions.

        Returns:
          The new state. Mismatches go to the ring; nothing is raised here.
        """
        if not self.enabled:
            return state
        batch = self._checked_batch(state, batch)
        rows = self._rows(state, batch)
        state = self._update_expected_tokens(state, batch, rows)
        for g in self.groups:
            state = self._forward_phase(state, batch, rows, g, Phase.HEAD, _pool.KvSources())
        return state

    @mesh.entry_point("state", "batch")  # KV sources are read in place, never resharded
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
        rows = self._rows(state, batch)  # the HEAD's, recomputed: in one jit XLA computes it once
        for g in self.groups:
            state = self._forward_phase(state, batch, rows, g, Phase.TAIL, kv_cache_sources)
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
          TypeError, ValueError: for entries or a table that are not integer arrays of the documented shapes, more
            entries than a group has slots, or a missing table. A slot 0 or a slot, predecessor or position out of
            range is engine data (a corrupted prefix cache): the plan carries it to the sweep, which reports it as
            an ``INVALID_INPUT`` row and checks the other entries.
        """
        full, *rest = self.groups
        entries, issues = _sweep.split_entries(entries, full.num_slots)  # bad engine data -> INVALID_INPUT rows
        full_plan = _sweep.pack_entries(entries, full.num_slots, what="FULL sweep")
        swa_plan = None
        if rest:
            if full_to_swa_index_mapping is None:
                raise ValueError("the pool has an SWA group: sweep_plan needs full_to_swa_index_mapping")
            lut = _sweep.check_table(
                full_to_swa_index_mapping, entries, num_slots=full.num_slots, swa_num_slots=rest[0].num_slots
            )
            swa_entries = _sweep.translate_entries(entries, lut)
            swa_plan = _sweep.pack_entries(swa_entries, rest[0].num_slots, what="SWA sweep")
        return _sweep.SweepPlan(full=full_plan, swa=swa_plan, issues=issues)

    @mesh.entry_point("state", "plan")
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
        if plan.issues is not None:  # before the launches, as the HEAD's input rows
            tag = self.groups[0].tag(Phase.SWEEP, Half.K)
            device = _inputs.Issues.unstacked(plan.issues).append(device, tag)
        for g in self.groups:
            group_plan = getattr(plan, g.name)
            if group_plan is None:
                raise ValueError(f"the sweep plan has no {g.name.upper()} plan but the pool has that group")
            for half in self.halves:
                launch = self._verify(
                    state.buffers(g).buffer(Phase.SWEEP, half), group_plan, g, Phase.SWEEP, half, kv_cache_sources
                )
                device = _ops.commit(device, launch)
        return dataclasses.replace(state, device=device)

    def adopt_plan(self, entries: _adopt.AdoptEntries, capacity: int | None = None) -> _adopt.AdoptPlan:
        """Host: checks slots an engine cached before the canary was attached and packs them for :meth:`adopt`.

        Args:
          entries: the :class:`AdoptEntries` (each slot once, predecessors first).
          capacity: the plan's static entry count; default the pool's slot count.

        Raises:
          TypeError, ValueError: for a bad entry, named (see :func:`kvcanary_jax.runtime._adopt.pack`).
          NotImplementedError: the pool has an SWA group (its records are not adopted).
        """
        self._check_no_swa("adopt_plan")
        return _adopt.pack(entries, self.pool.num_slots, capacity)

    @mesh.entry_point("state", "plan")
    def adopt(self, state: CanaryState, plan: _adopt.AdoptPlan, kv_cache_sources: _pool.KvSources) -> CanaryState:
        """Writes the HEAD and TAIL records of a warm engine's cached slots, as this canary's writes would have.

        Entries that cannot be adopted become ``INVALID_INPUT`` rows (fields ``ADOPT_SLOTS`` / ``ADOPT_PREV_SLOTS``)
        and are not written; no launch counter moves.

        Args:
          state: the canary state.
          plan: the :class:`AdoptPlan` from :meth:`adopt_plan`.
          kv_cache_sources: the current KV cache as :class:`KvSources` (the same sources ``after_forward`` gets).
        """
        if not self.enabled:
            return state
        self._check_no_swa("adopt")
        self._check_state(state)
        self._check_sources(kv_cache_sources)
        if not isinstance(plan, _adopt.AdoptPlan):
            raise TypeError(f"plan must be an AdoptPlan (see KvCanary.adopt_plan); got {type(plan).__name__}")
        plan.check()
        (g,) = self.groups
        keys = [(p, h) for p in (Phase.HEAD, Phase.TAIL) for h in self.halves]
        buffers, issues = _adopt.adopt_buffers(
            tuple(state.buffers(g).buffer(p, h) for p, h in keys),
            tuple(kv_cache_sources.get(g, h) if p is Phase.TAIL else () for p, h in keys),
            plan,
            real_kv_hash_mode=int(self.config.real_kv_hash_mode),
            backend=self.config.backend,
        )
        group_buffers = state.buffers(g)
        for (p, h), buf in zip(keys, buffers, strict=True):
            group_buffers = group_buffers.with_buffer(p, h, buf)
        device = issues.append(state.device, g.tag(Phase.HEAD, Half.K))  # no launch of SGLang's: no counter moves
        return dataclasses.replace(state, device=device, **{g.name: group_buffers})

    # -- one phase of one group ------------------------------------------------------------------------------------

    def _forward_phase(
        self,
        state: CanaryState,
        batch: CanaryBatch,
        rows: batch_checks.Checked,
        g: _pool.Group,
        phase: Phase,
        sources: _pool.KvSources,
    ) -> CanaryState:
        """A HEAD or TAIL phase of group ``g``: verify each half's cached slots, then write this step's records.

        Its effects are SGLang's launch sequence (verify K, write K, verify V, write V), after the HEAD's
        ``INVALID_INPUT`` rows (the batch checks' of this group, then the table's), through the lower layer's
        ``phase`` op on every backend. It skips the requests the checks reject (``skip_bad_requests``) and counts
        the HEAD's verify overflow.
        """
        head = phase is Phase.HEAD
        check_token = self.config.enable_verify_token_assert
        expected = self._expected_inputs(batch) or (None, None)
        token_pool = state.device.req_to_verify_expected_tokens if check_token else None
        phase_batch = phase_api.Batch(
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            req_to_token=batch.req_to_token,
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            full_to_swa_index_mapping=batch.full_to_swa_index_mapping if g.window else None,
            token_pool=token_pool,
            token_pool_lens=None if token_pool is None else jnp.clip(batch.token_ids_lens, 0, token_pool.shape[1]),
            expected_input_ids=expected[0],
            expected_input_positions=expected[1],
            active=rows.active,
            span_lens=rows.span_lens,
        )
        buffers = state.buffers(g)
        device, new_buffers, overflows = _ops.fused_phase(
            state.device,
            tuple(buffers.buffer(phase, h) for h in self.halves),
            phase_batch,
            tags=tuple(int(g.tag(phase, h)) for h in self.halves),
            real_kv_sources=tuple(sources.get(g, h) for h in self.halves),
            real_kv_hash_mode=self.config.real_kv_hash_mode,
            verify_capacity=g.verify_capacity,
            window=g.window,
            token_offset=self.pool.kv_token_id_vs_position_offset,
            full_slots=self.pool.num_slots,
            check_table=head,
            skip_bad_requests=True,
            input_issues=(rows.swa_issues if g.window else rows.issues) if head else None,
            # Only the HEAD phase counts overflows: the TAIL phase rebuilds the identical plan.
            verify_overflows=state.verify_overflows if head else None,
            backend=self.config.backend,
        )
        for h, buf in zip(self.halves, new_buffers, strict=True):
            buffers = buffers.with_buffer(phase, h, buf)
        overflows = overflows if head else state.verify_overflows
        return dataclasses.replace(state, device=device, verify_overflows=overflows, **{g.name: buffers})

    def _rows(self, state: CanaryState, batch: CanaryBatch) -> batch_checks.Checked:
        token_pool = state.device.req_to_verify_expected_tokens
        return _inputs.check_rows(
            batch,
            padding=self.pool.padding,
            table_rows=batch.req_to_token.shape[0],
            context_len=batch.req_to_token.shape[1],
            num_slots=self.pool.num_slots,
            token_ids_width=token_pool.shape[1] if self.config.enable_verify_token_assert else None,
            swa_num_slots=None if self.pool.swa is None else self.pool.swa.num_slots,
            backend=self.config.backend,
        )

    def _verify(self, buf, plan, g, phase, half, sources) -> _ops.Launch:
        """A sweep's verify launch of one half."""
        return _ops.verify_launch(
            buf,
            plan,
            tag=g.tag(phase, half),
            real_kv_sources=sources.get(g, half),
            real_kv_hash_mode=self.config.real_kv_hash_mode,
            check_expected_token=False,
            backend=self.config.backend,
        )

    def _expected_inputs(self, batch: CanaryBatch) -> tuple[jax.Array, jax.Array] | None:
        """The write input assert's oracle ``(tokens, positions)``, or None when the assert is off."""
        if not self.config.enable_write_input_assert:
            return None
        positions = batch.positions if batch.expected_positions is None else batch.expected_positions
        return batch.expected_input_ids, positions

    def _update_expected_tokens(
        self, state: CanaryState, batch: CanaryBatch, rows: batch_checks.Checked
    ) -> CanaryState:
        """Scatters the batched requests' token history into the expected-token pool (SGLang's snapshot scatter)."""
        if not self.config.enable_verify_token_assert:
            return state
        pool_tokens = state.device.req_to_verify_expected_tokens
        # Rows that are not requests (padding, or rejected by the checks) go to an index past the pool: dropped.
        target = jnp.where(rows.active != 0, batch.req_pool_indices, pool_tokens.shape[0])
        source = batch.token_ids[jnp.clip(batch.req_pool_indices, 0, batch.token_ids.shape[0] - 1)]
        pool_tokens = pool_tokens.at[target].set(source, mode="drop")
        device = dataclasses.replace(state.device, req_to_verify_expected_tokens=pool_tokens)
        return dataclasses.replace(state, device=device)

    # -- checks of what only this layer knows ----------------------------------------------------------------------

    def _check_no_swa(self, op: str) -> None:
        if self.pool.swa is not None:
            raise NotImplementedError(f"{op} covers the FULL pool only; this pool has an SWA group (CanaryPool.swa)")

    def _check_state(self, state) -> None:
        """``state`` is shaped as this canary's ``init_state()`` (a state of another canary reads out of range)."""
        if not isinstance(state, CanaryState):
            raise TypeError(f"state must be a CanaryState (from KvCanary.init_state); got {type(state).__name__}")
        if not self.enabled:
            return
        hint = "it was allocated by another canary; use this canary's init_state()"
        check_not_donated(state)
        capacity = state.device.violation_log.ring_capacity
        if capacity != self.config.ring_capacity:
            raise ValueError(
                f"state's ring holds {capacity} rows but config.ring_capacity={self.config.ring_capacity}: {hint}"
            )
        pool = state.device.req_to_verify_expected_tokens
        want_pool = (self.pool.max_reqs, self.pool.max_context_len) if self.config.enable_verify_token_assert else None
        if (None if pool is None else tuple(pool.shape)) != want_pool:
            raise ValueError(
                f"state's expected-token pool is {None if pool is None else tuple(pool.shape)}, but this canary "
                f"needs {want_pool} (config.enable_verify_token_assert={self.config.enable_verify_token_assert}): {hint}"
            )
        for g in self.groups:
            buffers = state.buffers(g)
            if buffers is None:
                raise ValueError(f"state has no {g.name.upper()} buffers (state.{g.name} is None): {hint}")
            for phase in (Phase.HEAD, Phase.TAIL):
                for half in Half:
                    buf = buffers.buffer(phase, half)
                    name = f"state.{g.name}.{_pool.GroupBuffers.field_name(phase, half)}"
                    if half in self.halves:
                        checks.array(name, buf, dtype=jnp.uint32, shape=(g.num_slots, 4, 2))
                    elif buf is not None:
                        raise ValueError(f"{name} is set but CanaryPool.with_v is False: {hint}")
        if state.fingerprint is not None and state.fingerprint != self.fingerprint:
            raise ValueError(
                f"state was allocated by a canary of another config or pool (fingerprint {state.fingerprint:#010x}, "
                f"this canary's {self.fingerprint:#010x}): its records mean something else here; use this canary's "
                "init_state()"
            )

    def _checked_batch(self, state, batch) -> CanaryBatch:
        """Checks the batch's arrays and what the config needs of it; returns it with every field a jax array.

        Shapes, dtypes and presence are static, so they are checked here, at trace time, naming the field; the
        values are checked in the step (:mod:`kvcanary_jax.runtime._inputs`).
        """
        self._check_state(state)
        if not isinstance(batch, CanaryBatch):
            raise TypeError(f"batch must be a CanaryBatch; got {type(batch).__name__}")
        arrays = {}
        for field in dataclasses.fields(CanaryBatch):
            x = getattr(batch, field.name)
            if x is None:
                if field.name in _REQUIRED_FIELDS:
                    raise TypeError(f"batch.{field.name} is required (an int32 array); got None")
            elif not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"batch.{field.name} must be an int32 array; got {type(x).__name__}")
            else:
                arrays[field.name] = jnp.asarray(x)  # a host (numpy) batch works eagerly too
        rows = {f"batch.{n}": arrays[n] for n in ("req_pool_indices", "prefix_lens", "extend_lens")}
        tokens = {f"batch.{n}": arrays[n] for n in ("input_ids", "positions", "out_cache_loc")}
        if self.config.enable_write_input_assert:
            if "expected_input_ids" not in arrays:
                raise ValueError(
                    "config.enable_write_input_assert compares written tokens with batch.expected_input_ids, but it "
                    "is None; pass the oracle's tokens (i32[T]) or turn the assert off"
                )
            tokens.update(
                {f"batch.{n}": arrays[n] for n in ("expected_input_ids", "expected_positions") if n in arrays}
            )
        for group in (rows, tokens):
            for name, x in group.items():
                checks.array(name, x, dtype=jnp.int32, ndim=1)
                if not x.shape[0]:
                    raise ValueError(
                        f"{name} needs at least one entry (shapes are static: pad it); got {name}.shape=(0,)"
                    )
            checks.same_length(group)
        table = arrays["req_to_token"]
        checks.array("batch.req_to_token", table, dtype=jnp.int32, ndim=2)
        if 0 in table.shape:  # the plans gather from it (clamping), so each axis needs an entry
            raise ValueError(
                f"batch.req_to_token needs at least one row and one column; got batch.req_to_token.shape={table.shape}"
            )
        if self.pool.swa is not None:
            lut = arrays.get("full_to_swa_index_mapping")
            if lut is None:
                raise ValueError(
                    "the pool has an SWA group, so batch.full_to_swa_index_mapping (i32[num_slots + 1], the full->SWA "
                    "slot table) is required"
                )
            checks.array("batch.full_to_swa_index_mapping", lut, dtype=jnp.int32, ndim=1)
            if lut.shape[0] < self.pool.num_slots:
                raise ValueError(
                    f"batch.full_to_swa_index_mapping must map every full-pool slot (i32[num_slots + 1], "
                    f"num_slots={self.pool.num_slots}); got batch.full_to_swa_index_mapping.shape={tuple(lut.shape)}"
                )
        if self.config.enable_verify_token_assert:
            if "token_ids" not in arrays or "token_ids_lens" not in arrays:
                raise ValueError(
                    "config.enable_verify_token_assert needs batch.token_ids (i32[max_reqs, max_context_len]) and "
                    "batch.token_ids_lens (i32[bs]); pass the requests' token history or turn the assert off"
                )
            pool_shape = state.device.req_to_verify_expected_tokens.shape
            if tuple(table.shape) != tuple(pool_shape):
                raise ValueError(
                    f"batch.req_to_token must have CanaryPool's shape (max_reqs, max_context_len)={tuple(pool_shape)} "
                    f"while the verify-token assert keeps a token pool of that shape; got batch.req_to_token.shape="
                    f"{tuple(table.shape)}"
                )
            checks.array("batch.token_ids", arrays["token_ids"], dtype=jnp.int32, shape=pool_shape)
            checks.array(
                "batch.token_ids_lens",
                arrays["token_ids_lens"],
                dtype=jnp.int32,
                shape=arrays["req_pool_indices"].shape,
            )
        return dataclasses.replace(batch, **arrays)

    def _check_sources(self, sources) -> None:
        if not isinstance(sources, _pool.KvSources):
            raise TypeError(
                f"kv_cache_sources must be KvSources (see KvCanary.kv_sources); got {type(sources).__name__}"
            )
        launched = {f"{g.name}_{h.name.lower()}": (g, h) for g in self.groups for h in self.halves}
        for field in dataclasses.fields(_pool.KvSources):
            value, arg = getattr(sources, field.name), f"kv_cache_sources.{field.name}"
            if field.name in launched:
                realkv.validate_sources(value, num_slots=launched[field.name][0].num_slots, arg=arg)
            elif value:
                raise ValueError(
                    f"{arg} holds sources, but no launch of this canary reads them (CanaryPool.swa="
                    f"{self.pool.swa!r}, with_v={self.pool.with_v})"
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
