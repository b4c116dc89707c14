"""The demo on a ``(dp, tp)`` mesh: per-data-shard schedulers and pools, the KV cache split by data shard and head.

The demo model has two KV heads, so ``tp = 2`` (one head per device) when the device count is even, else 1; the
``dp`` data shards each run their own scheduler, pool and requests. The model runs under plain ``jax.jit`` (XLA
partitions it: the KV cache is sharded by data shard and head); the canary runs in ``shard_map`` islands before and
after it, on each device's own KV heads. ``sharded_faults`` injects faults into it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import kvcanary_jax as kc
from kvcanary_jax import CanaryState, ShardedCanaryMonitor, ShardedKvCanary
from kvcanary_jax.demo import faults, loop, model, scheduler

_HEADS = model.ModelConfig().num_kv_heads


class StepHooks(Protocol):
    """Fault injection points of :meth:`ShardedDemo.step`; each gets the step's per-data-shard batches."""

    def before_forward(self, batches: list) -> None: ...

    def after_commit(self, batches: list) -> None: ...


def mesh_layout(devices: int) -> kc.MeshLayout:
    """A ``(dp, tp)`` mesh of the first ``devices`` devices, ``tp`` splitting the demo model's KV heads.

    Under ``jax.distributed`` the devices are taken each process's first device, then each one's second, and so on,
    so TP peers (neighbours along ``tp``) live in different processes.
    """
    tp = _HEADS if devices % _HEADS == 0 else 1
    rank = {}  # a device's index among its process's devices
    for d in jax.devices():
        rank[d] = sum(e.process_index == d.process_index for e in rank)
    ordered = sorted(jax.devices(), key=lambda d: (rank[d], d.process_index))
    grid = np.array(ordered[:devices]).reshape(devices // tp, tp)
    return kc.MeshLayout(jax.sharding.Mesh(grid, ("dp", "tp")), tp_axis="tp")


@dataclasses.dataclass
class ShardedDemo:
    """One sharded demo run: the single-device demo's configs and weights, and per-data-shard schedulers."""

    base: loop.DemoSetup
    sharded: ShardedKvCanary
    schedulers: list[scheduler.Scheduler]
    kv_cache: model.KvCache  # every leaf [dp, pages, page_size, kv_heads, head_dim]
    canary_state: CanaryState
    monitor: ShardedCanaryMonitor

    @classmethod
    def build(cls, mesh_layout: kc.MeshLayout, seed: int, backend: str = "auto") -> ShardedDemo:
        config = dataclasses.replace(faults.DEMO_CONFIG, backend=backend)
        base = loop.build_demo(seed, canary_config=config, **faults.DEMO_BUILD)
        sharded = ShardedKvCanary(base.canary, mesh_layout)
        dp = mesh_layout.mesh.shape["dp"]
        kv_sharding = NamedSharding(mesh_layout.mesh, _kv_spec(mesh_layout))
        kv_cache = jax.jit(lambda kv: jax.tree.map(lambda x: jnp.broadcast_to(x, (dp, *x.shape)), kv),
                           out_shardings=kv_sharding)(base.kv_cache)  # fmt: skip
        schedulers = [scheduler.Scheduler(base.sched_config, seed=seed * 1000 + i) for i in range(dp)]
        return cls(base, sharded, schedulers, kv_cache, sharded.init_state(), ShardedCanaryMonitor(sharded))

    @property
    def layout(self) -> kc.MeshLayout:
        return self.sharded.mesh_layout

    def _put(self, tree):
        """Per-data-shard host trees, stacked on a leading dp axis and placed by data shard."""
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *tree)
        return jax.device_put(stacked, NamedSharding(self.layout.mesh, self.layout.data_spec))

    def step(self, hooks: StepHooks | None = None) -> None:
        """One step of every data shard: schedule, run, commit, sweep when due, poll the monitor.

        ``hooks.before_forward(batches)`` may replace batches in the list; ``hooks.after_commit(batches)`` runs
        before the sweep. Both may edit ``kv_cache`` and ``canary_state``.
        """
        batches = [s.step() for s in self.schedulers]
        if hooks is not None:
            hooks.before_forward(batches)
        fn = _step_fn(self.sharded, self.base.layout)
        self.kv_cache, self.canary_state = fn(self.base.params, self.kv_cache, self.canary_state, self._put(batches))
        for s in self.schedulers:
            s.commit(None)  # token oracle: the host needs nothing from the device
        if hooks is not None:
            hooks.after_commit(batches)
        if self.monitor.step == 0:
            self.canary_state = self.sharded.mark_init_finished(self.canary_state)  # warm-up over
        if self.monitor.sweep_due:
            plans = [self.base.canary.sweep_plan(s.sweep_entries(), s.full_to_swa_index_mapping)
                     for s in self.schedulers]  # fmt: skip
            fn = _sweep_fn(self.sharded, self.base.layout)
            self.canary_state = fn(self.canary_state, self._put(plans), self.kv_cache)
        self.monitor.after_step(self.canary_state)


def _kv_spec(mesh_layout: kc.MeshLayout) -> PartitionSpec:
    return PartitionSpec(*mesh_layout.data_axes, None, None, mesh_layout.tp_axis, None)


@functools.cache
def _step_fn(sharded: ShardedKvCanary, layout: model.KvCacheLayout) -> Callable:
    """``(params, kv_cache, canary_state, batch) -> (kv_cache, canary_state)``, jitted with both donated."""
    lay, kv_spec, d = sharded.mesh_layout, _kv_spec(sharded.mesh_layout), sharded.mesh_layout.data_spec

    def head(state, batch):
        return sharded.before_forward(state, kc.local(batch, d).canary())

    def tail(state, batch, kv_cache):
        batch, kv_cache = kc.local((batch, kv_cache), d)
        return sharded.after_forward(state, batch.canary(), loop.kv_sources(sharded.canary, layout, kv_cache))

    state_spec = sharded.state_spec
    head = sharded.shard_map(head, in_specs=(state_spec, d), out_specs=state_spec)
    tail = sharded.shard_map(tail, in_specs=(state_spec, d, kv_spec), out_specs=state_spec)

    def step(params, kv_cache, state, batch):
        state = head(state, batch)
        _, kv_cache = jax.vmap(model.forward, in_axes=(None, 0, 0))(params, kv_cache, batch)
        return kv_cache, tail(state, batch, kv_cache)

    kv_sharding = NamedSharding(lay.mesh, kv_spec)
    return jax.jit(step, out_shardings=(kv_sharding, NamedSharding(lay.mesh, state_spec)), donate_argnums=(1, 2))


@functools.cache
def _sweep_fn(sharded: ShardedKvCanary, layout: model.KvCacheLayout) -> Callable:
    """``(canary_state, plan, kv_cache) -> canary_state``: every device sweeps its data shard's prefix cache."""
    d = sharded.mesh_layout.data_spec

    def sweep(state, plan, kv_cache):
        plan, kv_cache = kc.local((plan, kv_cache), d)
        return sharded.sweep(state, plan, loop.kv_sources(sharded.canary, layout, kv_cache))

    specs = (sharded.state_spec, d, _kv_spec(sharded.mesh_layout))
    return jax.jit(sharded.shard_map(sweep, in_specs=specs, out_specs=specs[0]), donate_argnums=(0,))


def use_fake_cpu_devices(devices: int) -> None:
    """Asks jax for ``devices`` CPU devices; a no-op if jax already runs with that many devices.

    Raises:
      RuntimeError: jax's own, if it initialised with fewer devices first.
    """
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:
        if len(jax.devices()) < devices:
            raise
