"""sglang-jax's HiCache driven in-process, with the canary's records carried across its host pool, and its faults.

:class:`HiCacheScheduler` is :class:`~kvcanary_jax.demo.sglang_engine.MiniScheduler` on the engine's own
``UnifiedRadixCache`` with HiCache on (``hicache_storage="none"``: an ``LRUHostKVPool`` L2, write-through or
write-back), a small device pool and a workload of long shared prefixes, so prefixes are evicted to host and loaded
back into new slots all the time. Load-backs follow the engine's scheduler: ``init_load_back`` when a request is let
in, ``finish_load_back`` right before the forward (the donation-safe window).

``python -m kvcanary_jax demo --engine sglang-jax --hicache``: a clean run per write policy, then one run per
transfer fault, each injected into the engine's own host pool or load plan at the first load-back after a warm-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
import types

import jax
import jax.numpy as jnp
import numpy as np
from sgl_jax.srt.mem_cache import memory_pool
from sgl_jax.srt.mem_cache.kv_cache_builder import init_hicache
from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvcanary_jax import CanaryConfig, KvCanaryViolationError, testing
from kvcanary_jax.demo import sglang_engine
from kvcanary_jax.integrations import sglang_hicache, sglang_jax

POLICIES = ("write_through", "write_back")
DEVICE_TOKENS = 192  # the device KV pool: about three of the workload's prefixes
CONFIG = CanaryConfig(mode="raise", real_kv_hash_mode="partial", sweep_interval=0, enable_write_input_assert=True,
                      enable_verify_token_assert=True)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LoadBack:
    """One load-back: at forward ``step`` (0-based), request ``rid`` reads host pages loaded into device ``pages``."""

    step: int
    rid: str
    host_pages: list
    pages: list


def workload(seed: int = 0, *, num_prefixes: int = 8, prefix_len: int = 32, num_requests: int = 40):
    """Requests on ``num_prefixes`` long shared prefixes, in turn, one every 3 steps: each prefix comes back after
    the device pool (:data:`DEVICE_TOKENS`) has moved on to the others, so it is loaded back from host."""
    rng = np.random.default_rng(seed)
    prefixes = [list(map(int, rng.integers(3, 500, prefix_len))) for _ in range(num_prefixes)]
    order = [k for k in range(num_prefixes) for _ in range(2)]  # each twice at first: a hit, so write-through backs up
    order += [i % num_prefixes for i in range(num_requests - len(order))]  # round robin: each is gone when it returns
    return [sglang_engine.Arrival(3 * i, f"req{i}", prefixes[k] + list(map(int, rng.integers(3, 500, 3))),
                                  int(rng.integers(4, 8))) for i, k in enumerate(order)]  # fmt: skip


class HiCacheScheduler(sglang_engine.MiniScheduler):
    """The mini scheduler on a HiCache ``UnifiedRadixCache``; ``loads`` lists every load-back.

    Attributes:
      forwards: forwards run so far (the canary's step numbers); loads: the :class:`LoadBack` of each.
      before_load: ``f(sched, req)`` before a request's host hit is loaded (fault drills); before_flush:
        ``f(sched, plan)`` on the flush plan before the scatter; after_flush: ``f(sched, plan)`` after it.
    """

    def __init__(self, worker, arrivals, *, write_policy: str):
        super().__init__(worker, arrivals)
        cfg = worker.model_runner.model_config
        self.tree_cache = UnifiedRadixCache(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            page_size=self.page_size, kv_head_num=cfg.get_num_kv_heads(1), head_dim=cfg.head_dim,
            layer_num=cfg.num_hidden_layers,
        )  # fmt: skip
        args = types.SimpleNamespace(hicache_ratio=4.0, hicache_write_through_threshold=1,
                                     hicache_write_policy=write_policy)  # fmt: skip
        init_hicache(self.tree_cache, args, self.runner.mesh, self.allocator)
        self.forwards = 0
        self.loads: list[LoadBack] = []
        self.before_load = self.before_flush = self.after_flush = None
        self._plan: list = []

    def admit(self, req) -> None:
        """The radix match; a host hit is loaded back into new device slots (``init_load_back``, as the engine's
        ``PrefillAdder``), its scatter deferred to the forward's window."""
        req.init_next_round_input(self.tree_cache)
        if req.host_hit_length > 0:
            if self.before_load is not None:
                self.before_load(self, req)
            new, last, plan = self.tree_cache.init_load_back(req.last_host_node, req.host_hit_length)
            if len(new):
                req.prefix_indices = np.concatenate([req.prefix_indices, new])
                req.last_node = req.last_host_node = last
                req.host_hit_length = max(0, req.host_hit_length - len(new))
                req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)
                req.last_matched_prefix_len = len(req.prefix_indices)  # caching must not free the loaded slots
                self._plan.extend(plan)
                for host_pages, pages in plan:
                    self.loads.append(LoadBack(self.forwards, req.rid, list(host_pages), list(pages)))
        self.tree_cache.inc_lock_ref(req.last_node)

    def run_batch(self, batch, model_worker_batch=None) -> np.ndarray:
        """The load-backs' scatter (``finish_load_back``), the forward, then the settled backups."""
        mwb = model_worker_batch if model_worker_batch is not None else self.model_worker_batch(batch)
        plan, self._plan = self._plan, []
        if plan:
            if self.before_flush is not None:
                self.before_flush(self, plan)
            self.tree_cache.finish_load_back(plan)
            if self.after_flush is not None:
                self.after_flush(self, plan)
        out = super().run_batch(batch, mwb)
        self.forwards += 1
        self.tree_cache.check_hicache_events()
        return out


@functools.partial(jax.jit, static_argnames=("page_size",))
def _scatter_kv_layer(layer_kv, loc, kv_cache, page_size):
    pages = jnp.where(loc >= 0, loc // page_size, kv_cache.shape[0])  # -1 (padding): out of range, dropped
    return kv_cache.at[pages, loc % page_size].set(layer_kv[:, 0], mode="drop", out_sharding=jax.typeof(kv_cache).sharding)


def _cpu_write_kv_layer(layer_kv, loc, kv_cache, page_size, *_):
    """``memory_pool.write_kv_layer`` as an XLA scatter: the engine's is a TPU Pallas kernel that CPU cannot run."""
    return _scatter_kv_layer(layer_kv, loc, kv_cache, page_size)


@contextlib.contextmanager
def cpu_load_kernel():
    """On CPU, the H2D scatter of ``LRUHostKVPool.flush_load`` as :func:`_cpu_write_kv_layer` (same writes)."""
    if jax.default_backend() != "cpu":
        yield
        return
    original = memory_pool.write_kv_layer
    memory_pool.write_kv_layer = _cpu_write_kv_layer  # flush_load imports it at each call
    try:
        yield
    finally:
        memory_pool.write_kv_layer = original


def hicache_worker(model_dir: str | None = None, seed: int = 0):
    """The tiny Llama's ``ModelWorker`` with a small device pool (evictions every few requests)."""
    path = sglang_engine.write_tiny_llama(model_dir or tempfile.mkdtemp(prefix="kvcanary_tiny_llama_"))
    return sglang_engine.build_worker(path, seed=seed, max_total_tokens=DEVICE_TOKENS)


def run(worker, *, write_policy: str, seed: int = 0, fault=None, max_steps: int = 400):
    """One run: ``(sched, guard, carried, error)``; ``error`` is the violation raised (None on a clean run)."""
    sched = HiCacheScheduler(worker, workload(seed), write_policy=write_policy)
    guard = sglang_jax.wrap(worker, CONFIG, tree_cache=None)
    carried = sglang_hicache.carry_records(guard, sched.tree_cache)
    if fault is not None:
        fault.arm(sched, carried)
    error = None
    try:
        with cpu_load_kernel():
            for batch in sched:
                guard.expect(batch)
                sched.run_batch(batch)
                guard.after_step()
                if sched.forwards >= max_steps:
                    break
        guard.final_check()
    except KvCanaryViolationError as err:
        error = err
    finally:
        guard.unwrap()
        carried.detach()
        sched.tree_cache.hicache_controller.shutdown()
    return sched, guard, carried, error


def _flip_host_page(pool, bid: int, row: int) -> None:
    """XORs byte 0 of layer 0's token row ``row`` in host page ``bid`` (the engine's retained copy)."""
    page = pool._slots[bid]
    layer0 = testing.flip_kv_byte(page[0][None], np.int32(row), page_size=page.shape[1])[0]
    pool._slots[bid] = jax.device_put(page.at[0].set(layer0), page.sharding)
