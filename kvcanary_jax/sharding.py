"""Sharded canaries: per-device canary state over a ``jax.sharding.Mesh``, a cross-shard chain check, one report.

Every device keeps its own canary buffers, ring and counters. A per-device pytree has one leading axis per mesh
axis (``[*mesh.devices.shape, ...]``), sharded by :attr:`MeshLayout.device_spec`, so inside ``jax.shard_map`` each
device sees exactly the single-device state the core ops take. Two layouts, freely combined on a 2-D mesh:

- **TP** (``tp_axis``): KV heads are split over the axis. Every TP shard sees the same batch and slots, so its
  records agree on TOKEN, POSITION and PREV_HASH, while REAL_KV_HASH folds that shard's own KV bytes.
  :func:`cross_shard_check` compares the chain fields of this step's written records across the axis.
- **DP** (every other axis): requests are split over the axis; each shard has its own pool, table and records.

Cross-shard violation rows use SGLang's row layout with one bit of ours, ``FailReason.SHARD_CHAIN_MISMATCH``:
``launch_tag`` is the TAIL tag, ``slot_idx`` the written slot, ``position``/``stored_token``/``stored_chain_hash``
this shard's record, ``expected_token``/``expected_aux`` the consensus record's TOKEN and PREV_HASH, and
``fail_reason_bits`` is ``SHARD_CHAIN_MISMATCH | (consensus_tp_index << 32)``: the high word names the peer (the
core reader keeps only the low word as the fail reason).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvcanary_jax import ring, validation
from kvcanary_jax.constants import FailReason
from kvcanary_jax.state import CanaryDeviceState
from pallas_kernels import hash64, layout, records

Coords = tuple[int, ...]
PEER_SHIFT = 32  # the peer's TP index lives in the high word of fail_reason_bits


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
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(self.mesh).__name__}")
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


def cross_shard_check(
    state: CanaryDeviceState, canary_buf: jax.Array, out_cache_loc: jax.Array, *, mesh_layout: MeshLayout, tag: int
) -> CanaryDeviceState:
    """Inside ``shard_map``: checks that TP shards wrote the same chain for this step's slots.

    Each TP shard all-gathers TOKEN, POSITION and PREV_HASH of the records at ``out_cache_loc`` (slots > 0). Per
    entry the consensus is the value most shards hold, ties going to the lowest TP index; a shard holding another
    value appends a ``SHARD_CHAIN_MISMATCH`` row naming the consensus shard (see the module docstring). With two
    shards a disagreement is therefore always reported by the second. Counters are left alone: this is not one of
    SGLang's launches. Without a ``tp_axis`` there is nothing to compare and ``state`` is returned unchanged.

    Args:
      state: this device's state (a :func:`local` view).
      canary_buf: u32[num_slots, 4, 2] this device's TAIL buffer, after this step's TAIL write.
      out_cache_loc: i32[T] slots written this step (the same on every TP shard).
      mesh_layout: the layout; its ``tp_axis`` is the axis compared over.
      tag: static TAIL launch tag stamped into the rows.

    Returns:
      The state with one row per disagreeing entry, in entry order.
    """
    if not isinstance(mesh_layout, MeshLayout):
        raise TypeError(f"mesh_layout must be a MeshLayout; got {type(mesh_layout).__name__}")
    num_slots = validation.canary_buffer(canary_buf)
    validation.array("out_cache_loc", out_cache_loc, dtype=jnp.int32, ndim=1)
    tag = validation.static_int("tag", int(tag) if isinstance(tag, int) else tag, maximum=state.num_tags)
    if mesh_layout.tp_axis is None:
        return state
    num_entries = out_cache_loc.shape[0]
    live = (out_cache_loc > layout.PADDING_SLOT) & (out_cache_loc < num_slots)
    mine = canary_buf[records.clamp_slots(out_cache_loc, num_slots), : layout.FIELD_REAL_KV_HASH]  # u32[T, 3, 2]
    shards = lax.all_gather(mine, mesh_layout.tp_axis)  # u32[tp, T, 3, 2]
    agree = jnp.all(shards[:, None] == shards[None, :], axis=(-2, -1))  # bool[tp, tp, T]
    consensus = jnp.argmax(jnp.sum(agree, axis=1), axis=0).astype(jnp.int32)  # i32[T]; argmax: lowest index wins
    entries = jnp.arange(num_entries)
    flags = live & ~agree[lax.axis_index(mesh_layout.tp_axis), consensus, entries]
    peer = shards[consensus, entries]  # u32[T, 3, 2]

    def build_rows(entry):
        token, position, prev_hash = (hash64.split(mine[entry, f]) for f in range(3))
        peer_token, _, peer_prev_hash = (hash64.split(peer[entry, f]) for f in range(3))
        bits = (
            jnp.full_like(entry, int(FailReason.SHARD_CHAIN_MISMATCH), dtype=jnp.uint32),
            consensus[entry].astype(jnp.uint32),
        )
        return ring.pack_row(
            [
                hash64.const(tag, entry),
                hash64.from_i32(out_cache_loc[entry]),
                position,
                token,
                peer_token,
                prev_hash,
                peer_prev_hash,
                bits,
            ]
        )

    log = ring.append(state.violation_log, flags, build_rows)
    return dataclasses.replace(state, violation_log=log)
