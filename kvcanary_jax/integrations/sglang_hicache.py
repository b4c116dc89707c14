"""Canary records that travel with sglang-jax's HiCache pages (device L1 <-> host L2), checked where they land.

HiCache backs a radix node's device pages up to an ``LRUHostKVPool`` and later loads them back into new device
slots. :func:`carry_records` hooks the pool's own transfer calls so the canary's records make the same trip, in the
engine's order and on the engine's threads:

* ``stage_backup`` (the KV-owning thread, synchronous gather): the records of the pages' slots, every canary buffer
  (HEAD and TAIL, K and V), are gathered on device beside the KV (:func:`kvcanary_jax.snapshot_records`).
* ``flush_backup`` (the D2H worker thread): they are copied to the host record pool, keyed by host page id.
* ``flush_load`` (the KV-owning thread, after the engine's scatter): the host page's records are stored into the
  new device slots (:func:`kvcanary_jax.restore_records`), a device scatter: no host sync on the step path.
* ``free`` / ``release``: the host page's records go with it.

The loaded slots are then checked by the first forward that reads them, as every prefix slot is: chain, position and
token in the HEAD verify, real KV in the TAIL verify, under the request that reads them. A byte changed in the host
copy, pages scattered into the wrong slots, a host page reused by another prefix before the load, or a load the
forward overtook each break one of those checks (see the README's HiCache section).

Not mapped: the overlap scheduler (its ``stage_backup`` runs on the scheduler's thread while the forward's thread
owns the canary state), data parallelism > 1 (refused by ``wrap``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

import kvcanary_jax as kc

_FIELDS = ("k_head", "k_tail", "v_head", "v_tail")


@jax.jit
def _snapshot(buffers: tuple, slots: jax.Array) -> jax.Array:
    return jnp.stack([kc.snapshot_records(b, slots) for b in buffers])


@functools.partial(jax.jit, donate_argnums=(0,))
def _restore(buffers: tuple, records: jax.Array, slots: jax.Array) -> tuple:
    return tuple(kc.restore_records(b, r, slots) for b, r in zip(buffers, records, strict=True))


class HostRecords:
    """The canary records of the pages an ``LRUHostKVPool`` holds; made by :func:`carry_records`.

    Attributes:
      guard: the :class:`~kvcanary_jax.integrations.sglang_jax.SglangCanary` whose state the records belong to.
      host_pool: the engine's ``LRUHostKVPool``.
      records: host page id -> u32[buffers, page_size, 4, 2] (numpy), as the D2H worker published it.
      backed_up, loaded: pages carried each way so far.
    """

    def __init__(self, guard, host_pool):
        self.guard, self.host_pool = guard, host_pool
        self.page_size = guard.layout.page_size
        self.fields = tuple(f for f in _FIELDS if getattr(guard.state.full, f) is not None)
        self.records: dict[int, np.ndarray] = {}
        self.backed_up = self.loaded = 0
        self._staged: dict[int, tuple[jax.Array, int]] = {}
        self._lock = threading.Lock()
        self._originals = {name: getattr(host_pool, name) for name in
                           ("stage_backup", "flush_backup", "flush_load", "free", "release")}  # fmt: skip
        for name in self._originals:
            setattr(host_pool, name, getattr(self, name))

    def slots(self, device_pages) -> np.ndarray:
        """i32[bucket * page_size]: the token slots of global device pages, page by page, padded with slot 0 to the
        engine's page bucket (its gathers compile once per bucket; so do ours)."""
        pages = np.asarray(device_pages, np.int64).reshape(-1, 1)
        slots = (pages * self.page_size + np.arange(self.page_size)).reshape(-1).astype(np.int32)
        bucket = self.host_pool._pad_to_page_bucket(len(pages)) * self.page_size
        return np.pad(slots, (0, bucket - len(slots)))

    def _buffers(self) -> tuple:
        return tuple(getattr(self.guard.state.full, f) for f in self.fields)

    # -- the pool's calls ------------------------------------------------------------------------------------------

    def stage_backup(self, device_indices, host_buffer_ids) -> None:
        """The engine's gather, then the pages' records gathered on device beside it (the KV-owning thread)."""
        self._originals["stage_backup"](device_indices, host_buffer_ids)
        if not len(host_buffer_ids):
            return
        with jax.set_mesh(self.guard.runner.mesh):
            snap = _snapshot(self._buffers(), jnp.asarray(self.slots(device_indices)))
        with self._lock:
            for i, bid in enumerate(host_buffer_ids):
                self._staged[int(bid)] = (snap, i)

    def flush_backup(self, host_buffer_ids) -> None:
        """The engine's host put, then the records' (the D2H worker thread: its sync is off the step path)."""
        self._originals["flush_backup"](host_buffer_ids)
        ps, host = self.page_size, {}  # each staged gather copied to the host once
        for bid in host_buffer_ids:
            with self._lock:
                entry = self._staged.pop(int(bid), None)
            if entry is None:  # freed since staging: the engine dropped its gather too
                continue
            snap, i = entry
            if id(snap) not in host:
                host[id(snap)] = np.asarray(snap)
            page = host[id(snap)][:, i * ps : (i + 1) * ps].copy()
            with self._lock:
                self.records[int(bid)] = page
                self.backed_up += 1

    def flush_load(self, host_buffer_ids, device_indices) -> None:
        """The engine's scatter into the KV pool, then the records' into the same slots (the KV-owning thread)."""
        self._originals["flush_load"](host_buffer_ids, device_indices)
        if not len(host_buffer_ids):
            return
        empty = np.zeros((len(self.fields), self.page_size, 4, 2), np.uint32)  # never backed up: fails its verify
        with self._lock:
            pages = [self.records.get(int(b), empty) for b in host_buffer_ids]
            self.loaded += len(pages)
        slots = self.slots(device_indices)
        records = np.concatenate(pages, axis=1)
        records = jnp.asarray(np.pad(records, ((0, 0), (0, len(slots) - records.shape[1]), (0, 0), (0, 0))))
        guard = self.guard
        with jax.set_mesh(guard.runner.mesh):
            restored = _restore(self._buffers(), records, jnp.asarray(slots))
        full = dataclasses.replace(guard.state.full, **dict(zip(self.fields, restored, strict=True)))
        guard.state = dataclasses.replace(guard.state, full=full)

    def free(self, host_page_ids) -> None:
        self._originals["free"](host_page_ids)
        self._drop(host_page_ids)

    def release(self, buffer_id) -> None:
        self._originals["release"](buffer_id)
        self._drop([buffer_id])

    def _drop(self, ids) -> None:
        with self._lock:
            for bid in ids:
                self.records.pop(int(bid), None)
                self._staged.pop(int(bid), None)

    def detach(self) -> None:
        """Gives the pool its own methods back."""
        for name in self._originals:
            delattr(self.host_pool, name)


def carry_records(guard, tree_cache) -> HostRecords:
    """Makes the canary records of ``guard`` travel with the HiCache pages of ``tree_cache`` (see the module doc).

    Args:
      guard: the :class:`~kvcanary_jax.integrations.sglang_jax.SglangCanary` around the engine's worker.
      tree_cache: the scheduler's ``UnifiedRadixCache`` with HiCache on (``hicache_storage="none"``).

    Returns:
      The :class:`HostRecords` (``detach()`` to unhook).

    Raises:
      ValueError: HiCache is off on ``tree_cache``, or the pool is hooked already.
      NotImplementedError: the overlap scheduler's worker.
    """
    if not getattr(tree_cache, "hicache_enabled", False) or tree_cache.host_pool is None:
        raise ValueError(
            f"tree_cache must be a UnifiedRadixCache with HiCache on (hicache_storage='none'); got "
            f"{type(tree_cache).__name__} with hicache_enabled={getattr(tree_cache, 'hicache_enabled', None)}"
        )
    if guard.overlap:
        raise NotImplementedError(
            "HiCache records are carried under the normal scheduler only: the overlap scheduler gathers backups on "
            "its own thread while the forward's thread owns the canary state"
        )
    if isinstance(getattr(tree_cache.host_pool.flush_load, "__self__", None), HostRecords):
        raise ValueError("this host pool carries canary records already; detach() its HostRecords first")
    return HostRecords(guard, tree_cache.host_pool)
