"""``MeshLayout``: how per-device canary state maps onto a ``jax.sharding.Mesh``, and the ``shard_map`` view helpers.

Every device keeps its own canary buffers, ring and counters. A per-device pytree has one leading axis per mesh
axis (``[*mesh.devices.shape, ...]``), sharded by :attr:`MeshLayout.device_spec`, so inside ``jax.shard_map`` each
device sees exactly the single-device state the core ops take. Two layouts, freely combined on a 2-D mesh:

- **TP** (``tp_axis``): KV heads are split over the axis. Every TP shard sees the same batch and slots, so its
  records agree on TOKEN, POSITION and PREV_HASH, while REAL_KV_HASH folds that shard's own KV bytes
  (``kvcanary_jax.sharded._check`` compares the chain fields).
- **DP** (every other axis): requests are split over the axis; each shard has its own pool, table and records.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import validate

Coords = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How canary state maps onto a mesh; frozen and hashable, so it can be a static argument.

    Attributes:
      mesh: the device mesh; every device keeps its own canary buffers, ring and counters.
      tp_axis: the mesh axis that splits KV heads (its shards must agree on the chain), or None. Every other axis
        is a data axis whose shards hold independent pools and requests.
    """

    mesh: Mesh
    tp_axis: str | None = None

    def __post_init__(self):
        validate.instance("mesh", self.mesh, Mesh, what="jax.sharding.Mesh")
        if self.tp_axis is not None and self.tp_axis not in self.mesh.axis_names:
            raise ValueError(f"tp_axis must be a mesh axis ({self.mesh.axis_names}) or None; got {self.tp_axis=}")

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape: the leading axes of every per-device array."""
        return tuple(self.mesh.devices.shape)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes other than ``tp_axis``: the data-parallel axes."""
        return tuple(a for a in self.axis_names if a != self.tp_axis)

    @property
    def device_spec(self) -> PartitionSpec:
        """Spec of a per-device tree: one leading axis per mesh axis (canary state, canary buffers)."""
        return PartitionSpec(*self.axis_names)

    @property
    def data_spec(self) -> PartitionSpec:
        """Spec of a per-data-shard tree: one leading axis per data axis (DP batches, tables, pools)."""
        return PartitionSpec(*self.data_axes)

    def devices(self) -> Iterator[tuple[Coords, jax.Device]]:
        """``(mesh coordinates, device)`` of every device, device-major (row-major over the mesh axes)."""
        for coords in itertools.product(*(range(n) for n in self.shape)):
            yield coords, self.mesh.devices[coords]

    def label(self, coords: Coords) -> str:
        """Mesh coordinates as text, e.g. ``dp=0,tp=3``."""
        return ",".join(f"{name}={i}" for name, i in zip(self.axis_names, coords, strict=True))


def per_device(tree, mesh_layout: MeshLayout):
    """Copies a single-device pytree (state, buffers) to every device: leading mesh axes, sharded over the mesh.

    Each device materialises only its own copy. Example:
    ``state = per_device(CanaryDeviceState.allocate(config=config), mesh_layout)``.
    """
    shape = mesh_layout.shape

    def broadcast(t):
        return jax.tree.map(lambda x: jnp.broadcast_to(x, shape + x.shape), t)

    return jax.jit(broadcast, out_shardings=NamedSharding(mesh_layout.mesh, mesh_layout.device_spec))(tree)


def local(tree, spec: PartitionSpec):
    """Inside ``shard_map``: drops the ``len(spec)`` leading axes of a tree passed in with ``spec``.

    With ``spec = layout.device_spec`` this turns per-device state into the single-device state the core ops take;
    with ``layout.data_spec``, a per-data-shard batch into this shard's batch.
    """
    n = len(spec)

    def squeeze(x):
        assert x.shape[:n] == (1,) * n, f"expected {n} leading unit axes inside shard_map; got shape {x.shape}"
        return x.reshape(x.shape[n:])

    return jax.tree.map(squeeze, tree)


def stacked(tree, spec: PartitionSpec):
    """Inverse of :func:`local`: adds the ``len(spec)`` leading unit axes back before leaving ``shard_map``."""
    return jax.tree.map(lambda x: x.reshape((1,) * len(spec) + x.shape), tree)
