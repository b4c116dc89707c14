"""Shared harness of the sharded tests: meshes over fake CPU devices, a scheduled workload, a TP/DP decode step.

Imported only by the ``*_cases.py`` modules, which ``test_sharding_subprocess.py`` runs in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the flag must be set before jax initialises).
The "model" writes deterministic K/V rows per global KV head, so each TP shard holds different KV bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import kvcanary_jax as kc
from kvcanary_jax import CanaryPool, ShardedKvCanary, demo

DEVICES = int(os.environ.get("KVCANARY_TEST_DEVICES", "0"))
requires_devices = pytest.mark.skipif(
    DEVICES < 2 or jax.device_count() < DEVICES,
    reason="run through test_sharding_subprocess.py (sets KVCANARY_TEST_DEVICES and the fake device count)",
)

HEAD_DIM = 8  # bf16: 16 bytes per KV head per token, the smallest real-KV row
PAGE = 4
SCHED = demo.SchedulerConfig(
    num_slots=96, max_reqs=6, max_context_len=40, max_batch=4, max_tokens=16, chunk_size=8,
    prompt_len=(4, 16), max_new_tokens=(2, 10), num_shared_prefixes=2, shared_prefix_len=(4, 8), token_oracle=True,
)  # fmt: skip
CONFIG = kc.CanaryConfig(
    mode="log", ring_capacity=64, real_kv_hash_mode="all", enable_write_input_assert=True,
    enable_verify_token_assert=True, backend="xla",
)  # fmt: skip
POOL = CanaryPool(num_slots=SCHED.num_slots, page_size=PAGE, with_v=False, max_reqs=SCHED.max_reqs,
                  max_context_len=SCHED.max_context_len)  # fmt: skip
CANARY = kc.KvCanary(CONFIG, POOL)

# name -> (mesh shape, axis names, tp axis, built by jax.make_mesh (explicit axes) rather than Mesh (auto axes)).
LAYOUTS = {
    "tp4": ((4,), ("tp",), "tp", False),
    "dp4": ((4,), ("dp",), None, True),
    "dp2_tp4": ((2, 4), ("dp", "tp"), "tp", True),
    "dp4_tp2": ((4, 2), ("dp", "tp"), "tp", False),
}
LAYOUTS_HERE = [name for name, (shape, *_) in LAYOUTS.items() if int(np.prod(shape)) == DEVICES]


def mesh_layout(name: str) -> kc.MeshLayout:
    """The named layout over the first devices."""
    shape, names, tp, explicit = LAYOUTS[name]
    if explicit:
        mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)
    return kc.MeshLayout(mesh, tp_axis=tp)


def tp_size(lay: kc.MeshLayout) -> int:
    return lay.mesh.shape[lay.tp_axis] if lay.tp_axis else 1


def data_shape(lay: kc.MeshLayout) -> tuple[int, ...]:
    return tuple(lay.mesh.shape[a] for a in lay.data_axes)


def kv_spec(lay: kc.MeshLayout) -> PartitionSpec:
    """KV pools ``[*data, pages, page, heads, head_dim]``: one pool per data shard, heads split over TP."""
    return PartitionSpec(*lay.data_axes, None, None, lay.tp_axis, None)


def new_kv_spec(lay: kc.MeshLayout) -> PartitionSpec:
    """This step's K/V rows ``[*data, T, heads, head_dim]``."""
    return PartitionSpec(*lay.data_axes, None, lay.tp_axis, None)


def new_kv_rows(b: demo.StepBatch, heads: int, salt: int) -> np.ndarray:
    """bf16[T, heads, head_dim] K (salt 0) or V (salt 1) rows of this step: small ints, exact in bf16."""
    h, j = np.arange(heads)[None, :, None], np.arange(HEAD_DIM)[None, None, :]
    x = (b.input_ids[:, None, None] * 7 + b.positions[:, None, None] * 3 + h * 11 + j + salt * 5) % 127
    return x.astype(jnp.bfloat16)


def write_kv(kv: jax.Array, out_cache_loc: jax.Array, rows: jax.Array) -> jax.Array:
    """The forward's KV store: row t goes to slot out_cache_loc[t] (negative: padding slot 0)."""
    loc = jnp.maximum(out_cache_loc, 0)
    return kv.at[loc // PAGE, loc % PAGE].set(rows)


def shard_body(canary_ops, state, k, v, new_k, new_v, batch):
    """One device's step: HEAD, the KV write, TAIL. ``canary_ops`` is a ShardedKvCanary or a KvCanary."""
    state = canary_ops.before_forward(state, batch)
    k, v = write_kv(k, batch.out_cache_loc, new_k), write_kv(v, batch.out_cache_loc, new_v)
    state = canary_ops.after_forward(state, batch, CANARY.kv_sources(full_k=k))
    return state, k, v


@functools.cache
def sharded_step(lay: kc.MeshLayout):
    """The jitted sharded step ``(state, k, v, new_k, new_v, batch) -> (state, k, v)``; counts its traces."""
    sharded = ShardedKvCanary(CANARY, lay)
    d = lay.data_spec

    def shard_step(state, k, v, new_k, new_v, batch):
        k, v, new_k, new_v, batch = kc.local((k, v, new_k, new_v, batch), d)
        state, k, v = shard_body(sharded, state, k, v, new_k, new_v, batch)
        TRACES[lay] = TRACES.get(lay, 0) + 1
        return state, *kc.stacked((k, v), d)

    specs = (sharded.state_spec, kv_spec(lay), kv_spec(lay), new_kv_spec(lay), new_kv_spec(lay), d)
    mapped = sharded.shard_map(shard_step, in_specs=specs, out_specs=specs[:3])
    return jax.jit(mapped, donate_argnums=(0, 1, 2))


@functools.cache
def sharded_sweep(lay: kc.MeshLayout):
    """The jitted sharded sweep ``(state, k, v, plan) -> state``; ``plan`` has leading data axes."""
    sharded = ShardedKvCanary(CANARY, lay)
    d = lay.data_spec

    def shard_sweep(state, k, v, plan):
        k, v, plan = kc.local((k, v, plan), d)
        return sharded.sweep(state, plan, CANARY.kv_sources(full_k=k))

    specs = (sharded.state_spec, kv_spec(lay), kv_spec(lay), d)
    return jax.jit(sharded.shard_map(shard_sweep, in_specs=specs, out_specs=specs[0]), donate_argnums=(0,))


TRACES: dict[kc.MeshLayout, int] = {}
single_step = jax.jit(functools.partial(shard_body, CANARY), donate_argnums=(0, 1, 2))


@dataclasses.dataclass
class Run:
    """A sharded decode loop: one scheduler per data shard, state and KV sharded over the mesh."""

    lay: kc.MeshLayout
    schedulers: list[demo.Scheduler]
    state: kc.CanaryState
    k: jax.Array
    v: jax.Array
    history: list = dataclasses.field(default_factory=list)  # per step: (batches, new_k, new_v), host arrays
    faults: list = dataclasses.field(default_factory=list)  # (steps run before it, device coords, slot)

    @classmethod
    def start(cls, name: str | kc.MeshLayout, seed: int = 0) -> Run:
        """A fresh loop on the named layout (or on ``name`` itself, a layout)."""
        lay = name if isinstance(name, kc.MeshLayout) else mesh_layout(name)
        n_data = int(np.prod(data_shape(lay), dtype=int))
        pool_shape = data_shape(lay) + (SCHED.num_slots // PAGE, PAGE, tp_size(lay), HEAD_DIM)
        zeros = jax.jit(
            lambda: jnp.zeros(pool_shape, jnp.bfloat16), out_shardings=NamedSharding(lay.mesh, kv_spec(lay))
        )
        sharded = ShardedKvCanary(CANARY, lay)
        state = sharded.mark_init_finished(sharded.init_state())
        schedulers = [demo.Scheduler(SCHED, seed=seed * 100 + i) for i in range(n_data)]
        return cls(lay, schedulers, state, zeros(), zeros())

    def _stack(self, items):
        """Per-data-shard host items -> leading data axes (none under pure TP)."""
        shape = data_shape(self.lay)
        return jax.tree.map(lambda *xs: np.stack(xs).reshape(shape + xs[0].shape), *items)

    def step(self) -> None:
        batches = [s.step() for s in self.schedulers]
        heads = tp_size(self.lay)
        new_k = self._stack([new_kv_rows(b, heads, 0) for b in batches])
        new_v = self._stack([new_kv_rows(b, heads, 1) for b in batches])
        cb = self._stack([b.canary() for b in batches])
        # Placed explicitly: a mesh with explicit axes (jax.make_mesh) refuses host arrays for sharded in_specs.
        new_k, new_v = jax.device_put((new_k, new_v), NamedSharding(self.lay.mesh, new_kv_spec(self.lay)))
        cb = jax.device_put(cb, NamedSharding(self.lay.mesh, self.lay.data_spec))
        self.state, self.k, self.v = sharded_step(self.lay)(self.state, self.k, self.v, new_k, new_v, cb)
        self.history.append((batches, new_k, new_v))
        for s in self.schedulers:
            s.commit(None)

    def sweep(self) -> None:
        """Sweeps every data shard's prefix cache (all of its cached slots) on every device."""
        plans = self._stack([CANARY.sweep_plan(s.sweep_entries()) for s in self.schedulers])
        plans = jax.device_put(plans, NamedSharding(self.lay.mesh, self.lay.data_spec))
        self.state = sharded_sweep(self.lay)(self.state, self.k, self.v, plans)

    def flip_kv(self, coords: tuple[int, ...], slot: int) -> None:
        """Overwrites the first K element of ``slot`` in the KV head that device ``coords`` holds."""
        self.k = poked(self.k, kv_index(self.lay, coords, slot), BAD_KV)
        self.faults.append((len(self.history), coords, slot))

    def report(self):
        return ShardedKvCanary(CANARY, self.lay).read_violations(self.state)

    def decoding_slot(self, data_index: int) -> tuple[int, int]:
        """(slot at position 0, last cached slot) of a request that will surely run next step (it is decoding)."""
        s = self.schedulers[data_index]
        req = next(r for r in s.running if not r.in_prefill)
        row = s.req_pool.req_to_token[req.pool_row]
        return int(row[0]), int(row[req.kv_len - 1])


BAD_KV = 200  # outside the 0..126 range new_kv_rows writes


def shard_of(lay: kc.MeshLayout, coords: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(index of the device's data shard in the leading data axes, its TP index) for mesh coordinates."""
    tp = coords[lay.axis_names.index(lay.tp_axis)] if lay.tp_axis else 0
    data = np.unravel_index(data_index(lay, coords), data_shape(lay)) if lay.data_axes else ()
    return tuple(map(int, data)), tp


def kv_index(lay: kc.MeshLayout, coords: tuple[int, ...], slot: int) -> tuple[int, ...]:
    """Index of the first K element of ``slot`` in device ``coords``'s head, in the global KV array."""
    data, tp = shard_of(lay, coords)
    return (*data, slot // PAGE, slot % PAGE, tp, 0)


def device_kv(lay: kc.MeshLayout, kv: jax.Array, coords: tuple[int, ...]) -> np.ndarray:
    """Host copy of the KV pool device ``coords`` holds: its data shard's pool, its head."""
    data, tp = shard_of(lay, coords)
    return np.asarray(kv)[data][..., tp : tp + 1, :]


def replay_single_device(run: Run, coords: tuple[int, ...]):
    """Replays ``run``'s steps and faults for device ``coords`` on one device; returns (state, k, v) there."""
    (data, tp), d = shard_of(run.lay, coords), data_index(run.lay, coords)
    state = CANARY.mark_init_finished(CANARY.init_state())
    k, v = (jnp.zeros((SCHED.num_slots // PAGE, PAGE, 1, HEAD_DIM), jnp.bfloat16) for _ in range(2))
    for i, (batches, new_k, new_v) in enumerate(run.history):
        for when, faulty, slot in run.faults:
            if when == i and faulty == coords:
                k = k.at[slot // PAGE, slot % PAGE, 0, 0].set(BAD_KV)
        rows = (np.asarray(x)[data][:, tp : tp + 1] for x in (new_k, new_v))
        state, k, v = single_step(state, k, v, *rows, batches[d].canary())
    return state, k, v


def data_index(lay: kc.MeshLayout, coords: tuple[int, ...]) -> int:
    """Flat index of the data shard a device belongs to."""
    data = [c for a, c in zip(lay.axis_names, coords, strict=True) if a != lay.tp_axis]
    return int(np.ravel_multi_index(data, data_shape(lay))) if data else 0


def at(tree, index: tuple[int, ...]):
    """Host copy of one shard of every leaf (leading axes indexed by ``index``)."""
    return jax.tree.map(lambda x: np.asarray(x)[index], tree)


def poked(x: jax.Array, index: tuple, value) -> jax.Array:
    """``x`` with ``x[index] = value``, keeping its sharding (a host round trip: works with explicit mesh axes)."""
    host = np.array(x)
    host[index] = value
    return jax.device_put(host, x.sharding)
