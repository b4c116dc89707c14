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

With ``host_sweep_interval=N`` the pages that stay on host are checked too (:meth:`HostRecords.host_sweep`): every
N steps, at the step's end, the next ``host_sweep_pages`` host pages (round robin over the tree's host pages) are
uploaded with their records into a scratch pool and verified as the device sweep verifies the radix cache: real KV
of the host copy against its TAIL records, chain and position along each tree node (``SWEEP_K_FULL`` /
``SWEEP_V_FULL``). One dispatch, no host sync; the monitor reads the rows lagged; :meth:`HostRecords.host_page_of`
names the host page of a report.

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
from kvcanary_jax.integrations.sglang_jax import kv_sources

_FIELDS = ("k_head", "k_tail", "v_head", "v_tail")
_SWEPT = {"k_tail": kc.CanaryLaunchTag.SWEEP_K_FULL, "v_tail": kc.CanaryLaunchTag.SWEEP_V_FULL}  # as the device sweep
_KEEP_SWEEPS = 64  # host sweeps remembered for host_page_of (the monitor reads a few steps late)


@jax.jit
def _snapshot(buffers: tuple, slots: jax.Array) -> jax.Array:
    return jnp.stack([kc.snapshot_records(b, slots) for b in buffers])


@functools.partial(jax.jit, donate_argnums=(0,))
def _restore(buffers: tuple, records: jax.Array, slots: jax.Array) -> tuple:
    return tuple(kc.restore_records(b, r, slots) for b, r in zip(buffers, records, strict=True))


@functools.partial(jax.jit, static_argnames=("tags", "mode", "backend"), donate_argnums=(0,))
def _host_sweep(device, records, pages, slots, prev, positions, *, tags, mode, backend):
    """Verifies host pages in a scratch pool: page 0 is padding, page ``i + 1`` holds ``pages[i]`` (layer-0 KV) and
    its records (``records[t]``: the TAIL records of ``tags[t]``'s half), each half against its own KV bytes."""
    kv0 = jnp.stack((jnp.zeros_like(pages[0]), *pages))
    scratch = jnp.zeros((kv0.shape[0] * kv0.shape[1], 4, 2), jnp.uint32)
    for recs, source, tag in zip(records, kv_sources(kv0), tags, strict=False):
        _, device = kc.restore_and_verify(device, scratch, recs, slots, prev, positions, tag=tag,
                                          real_kv_sources=(source,), real_kv_hash_mode=mode,
                                          backend=backend)  # fmt: skip
    return device


class HostRecords:
    """The canary records of the pages an ``LRUHostKVPool`` holds; made by :func:`carry_records`.

    Attributes:
      guard: the :class:`~kvcanary_jax.integrations.sglang_jax.SglangCanary` whose state the records belong to.
      host_pool: the engine's ``LRUHostKVPool``.
      records: host page id -> u32[buffers, page_size, 4, 2] (numpy), as the D2H worker published it.
      backed_up, loaded: pages carried each way so far.
      host_sweep_interval, host_sweep_pages: a host sweep every that many steps (0: none), of that many pages.
      host_swept: pages checked by host sweeps so far.
    """

    def __init__(self, guard, host_pool, tree_cache=None, *, host_sweep_interval: int = 0, host_sweep_pages: int = 64):
        self.guard, self.host_pool, self.tree_cache = guard, host_pool, tree_cache
        self.host_sweep_interval, self.host_sweep_pages = host_sweep_interval, host_sweep_pages
        self.host_swept = 0
        self._cursor = self._steps = 0
        self._sweeps: dict[int, list] = {}  # guard step -> the host pages of that step's host sweep, by scratch page
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
        if host_sweep_interval > 0:
            self._after_step = guard.after_step
            guard.after_step = self.after_step

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

    # -- the host sweep ---------------------------------------------------------------------------------------------

    def after_step(self) -> None:
        """The guard's step end, preceded by a host sweep every ``host_sweep_interval`` steps (installed on the
        guard by :func:`carry_records`): the sweep's rows are read by the same lagged monitor check."""
        if self._steps % self.host_sweep_interval == 0:
            self.host_sweep()
        self._steps += 1
        self._after_step()

    def host_pages(self) -> list[tuple[int, int, int]]:
        """``(host page, position, predecessor host page)`` of every host page the tree holds whose records were
        carried, depth first (the predecessor: -1 under the root, None when its page is not on host; host page ids
        start at 0)."""
        ps, out = self.page_size, []
        stack = [(c, 0, -1) for c in reversed(list(self.tree_cache.root_node.children.values()))]
        while stack:
            node, depth, prev = stack.pop()
            host = node.component_data[0].host_value
            if host is None:
                prev = None
            else:
                for i, bid in enumerate(int(b) for b in host):
                    held = bid in self.records and self.host_pool._slots[bid] is not None
                    if held:
                        out.append((bid, depth + i * ps, prev))
                    prev = bid if held else None
            stack.extend((c, depth + len(node.key), prev) for c in reversed(list(node.children.values())))
        return out

    def host_sweep(self) -> None:
        """Verifies the next ``host_sweep_pages`` host pages (round robin) in a scratch pool, into the guard's
        state: one async dispatch, no host sync (see the module doc)."""
        with self._lock:
            listed = self.host_pages()
            if not listed:
                return
            n = min(self.host_sweep_pages, len(listed))
            start = self._cursor % len(listed)
            chosen = (listed + listed)[start : start + n]
            self._cursor = start + n
            records = [self.records[bid] for bid, _, _ in chosen]
        pool, ps, k = self.host_pool, self.page_size, self.host_sweep_pages
        scratch = {bid: i + 1 for i, (bid, _, _) in enumerate(chosen)}
        slots = np.zeros((k, ps), np.int32)
        positions, prev = np.zeros_like(slots), np.zeros_like(slots)
        for i, (_, position, before) in enumerate(chosen):
            slots[i] = (i + 1) * ps + np.arange(ps)
            positions[i] = position + np.arange(ps)
            prev[i] = slots[i] - 1
            linked = scratch[before] * ps + ps - 1 if before in scratch else 0  # 0: not in this sweep, unchained
            prev[i, 0] = -1 if before == -1 else linked
        kv = [pool._slots[bid][0] for bid, _, _ in chosen]  # layer 0 (the canary's), still in host memory
        kv = [jax.device_put(x, x.sharding.with_memory_kind("device")) for x in kv]  # async H2D
        kv += [jnp.zeros_like(kv[0])] * (k - n)
        tails = [self.fields.index(f) for f in _SWEPT if f in self.fields]
        recs = np.zeros((len(tails), k * ps, 4, 2), np.uint32)
        recs[:, : n * ps] = np.concatenate(records, axis=1)[tails]
        guard = self.guard
        with jax.set_mesh(guard.runner.mesh):
            entries = (jnp.asarray(x.reshape(-1)) for x in (slots, prev, positions))
            device = _host_sweep(guard.state.device, jnp.asarray(recs), tuple(kv), *entries,
                                 tags=tuple(_SWEPT[self.fields[t]] for t in tails), mode=guard.config.real_kv_hash_mode,
                                 backend=guard.config.backend)  # fmt: skip
        guard.state = dataclasses.replace(guard.state, device=device)
        self.host_swept += n
        self._sweeps[guard.steps - 1] = [bid for bid, _, _ in chosen]
        while len(self._sweeps) > _KEEP_SWEEPS:
            del self._sweeps[min(self._sweeps)]

    def host_page_of(self, observed) -> tuple[int, int] | None:
        """``(host page, token row)`` a host sweep's report names (None: another launch's, or too long ago)."""
        v = observed.violation
        if v.launch_tag not in _SWEPT.values() or v.slot_idx is None:
            return None
        pages = self._sweeps.get(observed.user_step, [])
        page, row = divmod(v.slot_idx, self.page_size)
        return (pages[page - 1], row) if 1 <= page <= len(pages) else None

    def detach(self) -> None:
        """Gives the pool (and the guard) its own methods back."""
        for name in self._originals:
            delattr(self.host_pool, name)
        if self.host_sweep_interval > 0:
            del self.guard.after_step


def carry_records(guard, tree_cache, *, host_sweep_interval: int = 0, host_sweep_pages: int = 64) -> HostRecords:
    """Makes the canary records of ``guard`` travel with the HiCache pages of ``tree_cache`` (see the module doc).

    Args:
      guard: the :class:`~kvcanary_jax.integrations.sglang_jax.SglangCanary` around the engine's worker.
      tree_cache: the scheduler's ``UnifiedRadixCache`` with HiCache on (``hicache_storage="none"``).
      host_sweep_interval: a host sweep at the end of every that many steps (the first step's included); 0 (the
        default): pages on host are checked only when loaded back.
      host_sweep_pages: host pages per host sweep (a static shape: one compile).

    Returns:
      The :class:`HostRecords` (``detach()`` to unhook).

    Raises:
      ValueError: a host sweep option that is not an int (interval >= 0, pages >= 1), HiCache off on ``tree_cache``,
        or the pool hooked already.
      NotImplementedError: the overlap scheduler's worker.
    """
    limits = (("host_sweep_interval", host_sweep_interval, 0), ("host_sweep_pages", host_sweep_pages, 1))
    for name, value, low in limits:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
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
    return HostRecords(guard, tree_cache.host_pool, tree_cache, host_sweep_interval=host_sweep_interval,
                       host_sweep_pages=host_sweep_pages)  # fmt: skip
