"""``KvCanary``: wraps a jitted decode step with SGLang's HEAD (before forward) and TAIL (after forward) launches.

This module is the public face; what runs in the step is :mod:`kvcanary_jax.runtime._step`, and what is
validated at trace time :mod:`kvcanary_jax.runtime._validate`.

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

import jax.numpy as jnp
import numpy as np

from kvcanary_jax.core import _ops
from kvcanary_jax.core._config import CanaryConfig
from kvcanary_jax.core._constants import CanaryLaunchTag, Half, Phase, RealKvHashMode
from kvcanary_jax.core._state import CanaryDeviceState, allocate_canary_buffer
from kvcanary_jax.runtime import _adopt, _inputs, _pool, _step, _sweep, _validate
from kvcanary_jax.runtime._batch import CanaryBatch, CanaryState
from pallas_kernels import mesh, validate


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
        validate.instance("config", self.config, CanaryConfig)
        validate.instance("pool", self.pool, _pool.CanaryPool)
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
        periods or backend, nor the pool's verify capacities, a per-forward sizing: any canary of the same records
        may differ in those)."""
        return _validate.fingerprint(self.config, self.pool)

    @property
    def halves(self) -> tuple[Half, ...]:
        return _pool.halves(self.pool)

    def launch_tags(self, phases: tuple[Phase | str, ...] = tuple(Phase)) -> tuple[CanaryLaunchTag, ...]:
        """Tags this canary launches in ``phases`` (SWEEP only when ``sweep_interval > 0``); empty when off.

        Phases are :class:`Phase` members or their names (``"HEAD"``, ``"TAIL"``, ``"SWEEP"``, any case); a single
        phase may be given alone.
        """
        if not self.enabled:
            return ()
        if isinstance(phases, (str, Phase)) or validate.is_int(phases):
            phases = (phases,)
        phases = tuple(_validate.parse_phase(p) for p in phases)
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
        _validate.validate_state(self.config, self.pool, state)
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
        batch = _validate.validated_batch(self.config, self.pool, state, batch)
        rows = _step.rows(self.config, self.pool, state, batch)
        state = _step.update_expected_tokens(self.config, state, batch, rows)
        for g in self.groups:
            state = _step.forward_phase(self.config, self.pool, state, batch, rows, g, Phase.HEAD, _pool.KvSources())
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
        batch = _validate.validated_batch(self.config, self.pool, state, batch)
        _validate.validate_sources(self.config, self.pool, kv_cache_sources)
        # The HEAD's rows, recomputed: in one jit XLA computes them once.
        rows = _step.rows(self.config, self.pool, state, batch)
        for g in self.groups:
            state = _step.forward_phase(self.config, self.pool, state, batch, rows, g, Phase.TAIL, kv_cache_sources)
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
        _validate.validate_state(self.config, self.pool, state)
        _validate.validate_sources(self.config, self.pool, kv_cache_sources)
        validate.instance("plan", plan, _sweep.SweepPlan, what="SweepPlan (see KvCanary.sweep_plan)")
        device = state.device
        if plan.issues is not None:  # before the launches, as the HEAD's input rows
            tag = self.groups[0].tag(Phase.SWEEP, Half.K)
            device = _inputs.Issues.unstacked(plan.issues).append(device, tag)
        for g in self.groups:
            group_plan = getattr(plan, g.name)
            if group_plan is None:
                raise ValueError(f"the sweep plan has no {g.name.upper()} plan but the pool has that group")
            for half in self.halves:
                device = _ops.canary_verify(
                    device,
                    state.buffers(g).buffer(Phase.SWEEP, half),
                    group_plan,
                    tag=g.tag(Phase.SWEEP, half),
                    real_kv_sources=kv_cache_sources.get(g, half),
                    real_kv_hash_mode=self.config.real_kv_hash_mode,
                    backend=self.config.backend,
                )
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
        _validate.check_no_swa(self.pool, "adopt_plan")
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
        _validate.check_no_swa(self.pool, "adopt")
        _validate.validate_state(self.config, self.pool, state)
        _validate.validate_sources(self.config, self.pool, kv_cache_sources)
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
