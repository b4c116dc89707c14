"""``ShardedKvCanary``: a :class:`~kvcanary_jax.KvCanary` on every device of a mesh, used inside ``shard_map``.

Usage (TP over ``"tp"``, DP over ``"dp"``; ``batch`` and the KV cache carry one leading axis per data axis)::

    layout = MeshLayout(mesh, tp_axis="tp")
    sharded = ShardedKvCanary(KvCanary(config, CanaryPool(num_slots=4096, page_size=16)), layout)
    state = sharded.init_state()                       # per-device: leading mesh axes, sharded over the mesh

    def shard_step(params, kv_cache, canary_state, batch):
        batch, kv_cache = local((batch, kv_cache), layout.data_spec)   # this shard's batch and KV heads
        canary_state = sharded.before_forward(canary_state, batch)
        canary_state, kv_cache = fence(canary_state, kv_cache)         # keep the canary out of the forward
        logits, kv_cache = forward(params, kv_cache, batch)            # the TP forward (psum over "tp")
        canary_state, kv_cache = fence(canary_state, kv_cache)
        sources = sharded.canary.kv_sources(full_k=kv_cache.k[0], full_v=kv_cache.v[0])
        canary_state = sharded.after_forward(canary_state, batch, sources)  # TAIL + cross-shard check
        return stacked((logits, kv_cache), layout.data_spec), canary_state

    in_specs = (P(), kv_spec, sharded.state_spec, layout.data_spec)   # kv_spec: e.g. P(None, None, "tp", None)
    step = jax.jit(sharded.shard_map(shard_step, in_specs=in_specs, out_specs=(..., sharded.state_spec)),
                   donate_argnums=(1, 2))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from kvcanary_jax.core import _plans
from kvcanary_jax.core._constants import Phase
from kvcanary_jax.runtime import _pool, _sweep
from kvcanary_jax.runtime._batch import CanaryBatch, CanaryState
from kvcanary_jax.runtime._canary import KvCanary
from kvcanary_jax.sharded import _check, _layout, _report
from pallas_kernels import validate


@dataclasses.dataclass(frozen=True)
class ShardedKvCanary:
    """Per-device canary state over a mesh, one merged report, and the TP cross-shard chain check.

    ``before_forward``, ``after_forward`` and ``sweep`` run inside ``jax.shard_map``: they take and return the
    per-device state as passed in with :attr:`state_spec`, and take this shard's (:func:`kvcanary_jax.local`) batch
    and sources. Frozen and hashable, so closing over it in ``jax.jit`` is free.

    Attributes:
      canary: the single-device canary every shard runs.
      mesh_layout: the mesh and its TP axis.
    """

    canary: KvCanary
    mesh_layout: _layout.MeshLayout

    def __post_init__(self):
        validate.instance("canary", self.canary, KvCanary)
        validate.instance("mesh_layout", self.mesh_layout, _layout.MeshLayout)

    @property
    def state_spec(self) -> PartitionSpec:
        """The ``shard_map`` spec of the canary state (one leading axis per mesh axis)."""
        return self.mesh_layout.device_spec

    def shard_map(self, fn: Callable, *, in_specs, out_specs) -> Callable:
        """``jax.shard_map`` of ``fn`` over this mesh, with ``check_vma=False``.

        The core ops' loops start from constant carries while their bodies read per-device data, which shard_map's
        varying-axes check rejects ("carry input and carry output must have equal types"); the values are right.
        Pass ``check_vma=False`` yourself if you build the ``shard_map`` around a canary step by hand.
        """
        return jax.shard_map(fn, mesh=self.mesh_layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def init_state(self) -> CanaryState:
        """Host: every device's own copy of ``canary.init_state()``, sharded over the mesh."""
        return _layout.per_device(self.canary.init_state(), self.mesh_layout)

    def mark_init_finished(self, state: CanaryState) -> CanaryState:
        """Host: turns on the chain-position assert on every device (see ``KvCanary.mark_init_finished``)."""
        spec = self.state_spec
        flip = lambda s: _layout.stacked(self.canary.mark_init_finished(_layout.local(s, spec)), spec)  # noqa: E731
        return jax.jit(self.shard_map(flip, in_specs=spec, out_specs=spec))(state)

    def before_forward(self, state: CanaryState, batch: CanaryBatch) -> CanaryState:
        """Inside ``shard_map``: this device's HEAD launches."""
        spec = self.state_spec
        return _layout.stacked(self.canary.before_forward(_layout.local(state, spec), batch), spec)

    def after_forward(self, state: CanaryState, batch: CanaryBatch, kv_cache_sources: _pool.KvSources) -> CanaryState:
        """Inside ``shard_map``: this device's TAIL launches, then the cross-shard check of each TAIL buffer.

        Args:
          state: the per-device state returned by ``before_forward``.
          batch: this shard's batch.
          kv_cache_sources: this shard's KV bytes as ``KvSources`` (its KV heads under TP).
        """
        spec = self.state_spec
        local = self.canary.after_forward(_layout.local(state, spec), batch, kv_cache_sources)
        if self.canary.enabled and self.mesh_layout.tp_axis is not None:
            device = local.device
            for g in self.canary.groups:
                out_cache_loc = _plans.translate(
                    batch.out_cache_loc, batch.full_to_swa_index_mapping if g.window else None
                )
                for half in self.canary.halves:
                    device = _check.cross_shard_check(
                        device,
                        local.buffers(g).buffer(Phase.TAIL, half),
                        out_cache_loc,
                        mesh_layout=self.mesh_layout,
                        tag=g.tag(Phase.TAIL, half),
                    )
            local = dataclasses.replace(local, device=device)
        return _layout.stacked(local, spec)

    def sweep(self, state: CanaryState, plan: _sweep.SweepPlan, kv_cache_sources: _pool.KvSources) -> CanaryState:
        """Inside ``shard_map``: this device's SWEEP launches over this shard's plan (see ``KvCanary.sweep``)."""
        spec = self.state_spec
        return _layout.stacked(self.canary.sweep(_layout.local(state, spec), plan, kv_cache_sources), spec)

    def read_violations(self, state: CanaryState) -> _report.ShardedViolationReport:
        """Host (a sync): every device's ring merged, device-major."""
        return _report.read_sharded_violations(state.violation_log, self.mesh_layout)
