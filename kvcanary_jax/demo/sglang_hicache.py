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
import enum
import functools
import json
import sys
import tempfile
import time
import types
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from sgl_jax.srt.mem_cache import memory_pool
from sgl_jax.srt.mem_cache.kv_cache_builder import init_hicache
from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvcanary_jax import CanaryConfig, CanaryLaunchTag, FailReason, KvCanaryViolationError
from kvcanary_jax.demo import cli, sglang_engine
from kvcanary_jax.demo.faults import RunResult
from kvcanary_jax.demo.sglang_faults import Injected, judge
from kvcanary_jax.integrations import sglang_hicache, sglang_jax

POLICIES = ("write_through", "write_back")
DEVICE_TOKENS = 192  # the device KV pool: about three of the workload's prefixes
HOST_SWEEP_INTERVAL = 8  # a host sweep (64 host pages) at the end of every 8th step
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
    sharding = jax.typeof(kv_cache).sharding
    return kv_cache.at[pages, loc % page_size].set(layer_kv[:, 0], mode="drop", out_sharding=sharding)


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


def hicache_worker(model_dir: str | None = None, *, seed: int = 0):
    """The tiny Llama's ``ModelWorker`` with a small device pool (evictions every few requests)."""
    path = sglang_engine.write_tiny_llama(model_dir or tempfile.mkdtemp(prefix="kvcanary_tiny_llama_"))
    return sglang_engine.build_worker(path, seed=seed, max_total_tokens=DEVICE_TOKENS)


def _flip_host_page(pool, bid: int, row: int) -> None:
    """XORs byte 0 of layer 0's token row ``row`` in host page ``bid`` (the engine's retained copy)."""
    page = pool._slots[bid]
    raw = np.array(page)  # host memory: flipped on the host, as SGLang's drills flip byte 0 of the token row
    raw[0, row].reshape(-1).view(np.uint8)[0] ^= 0xFF
    pool._slots[bid] = jax.device_put(raw, page.sharding)


# --- the transfer faults ------------------------------------------------------------------------------------------


class TransferFault(enum.Enum):
    """A HiCache transfer gone wrong, injected once into the engine's own host pool or load plan."""

    HOST_KV_FLIP = "host_kv_flip"  # a byte of a host page's KV changed while it sat in host memory
    WRONG_SLOTS = "wrong_slots"  # a load scattered its pages into the wrong device slots (the plan's pages reversed)
    HOST_PAGE_REUSED = "host_page_reused"  # a host page overwritten by another prefix's backup before its load
    STALE_LOAD = "stale_load"  # the forward read the new slots before the load's scatter landed
    HOST_RESIDENT_FLIP = "host_resident_flip"  # a byte of a page that stays on host changed: the host sweep's find


# What the canary names for each: SGLang's launch and reasons (no new reason is needed).
EXPECTED = {
    TransferFault.HOST_KV_FLIP: (CanaryLaunchTag.TAIL_K_FULL, FailReason.VERIFY_REAL_KV_HASH),
    TransferFault.WRONG_SLOTS: (CanaryLaunchTag.HEAD_K_FULL, FailReason.VERIFY_POSITION | FailReason.VERIFY_CHAIN_HASH),
    TransferFault.HOST_PAGE_REUSED: (CanaryLaunchTag.HEAD_K_FULL, FailReason.VERIFY_CHAIN_HASH),
    TransferFault.STALE_LOAD: (CanaryLaunchTag.TAIL_K_FULL, FailReason.VERIFY_REAL_KV_HASH),
    TransferFault.HOST_RESIDENT_FLIP: (CanaryLaunchTag.SWEEP_K_FULL, FailReason.VERIFY_REAL_KV_HASH),
}


def _evicted_host_pages(tree_cache) -> list[int]:
    """The host pages of nodes evicted from the device: a later hit must load them back."""
    pages, stack = [], list(tree_cache.root_node.children.values())
    while stack:
        node = stack.pop()
        if node.evicted and node.backuped:
            pages += [int(b) for b in node.component_data[0].host_value]
        stack.extend(node.children.values())
    return pages


def _chain_host_pages(tree_cache, node) -> list[int]:
    """The host pages a load-back from ``node`` reads, root side first (as ``init_load_back`` walks them)."""
    pages = []
    while node is not tree_cache.root_node and node.evicted and node.backuped:
        pages = [int(b) for b in node.component_data[0].host_value] + pages
        node = node.parent
    return pages


class Drill:
    """Injects ``fault`` into the first load-back at or after forward ``after``; ``host_page`` / ``pages`` say
    where (the host page, or the load's device pages), resolved to the slot the canary must name by :meth:`target`.
    """

    def __init__(self, fault: TransferFault, after: int = 40):
        self.fault, self.after = fault, after
        self.host_page: int | None = None
        self.pages: list | None = None
        self._old_kv = None
        self._swept: tuple | None = None  # (step, scratch slot) of the host sweep a host-resident fault is due in

    def arm(self, sched: HiCacheScheduler, carried: sglang_hicache.HostRecords) -> None:
        self.carried = carried
        if self.fault in (TransferFault.HOST_KV_FLIP, TransferFault.HOST_PAGE_REUSED):
            sched.before_load = self._before_load
        else:
            sched.before_flush, sched.after_flush = self._before_flush, self._after_flush

    def _due(self, sched) -> bool:
        return self.host_page is None and self.pages is None and sched.forwards >= self.after

    def _before_load(self, sched, req) -> None:
        """Changes the first host page the request's load-back will read (its backup settled first)."""
        pages = _chain_host_pages(sched.tree_cache, req.last_host_node)
        if not self._due(sched) or not pages:
            return
        sched.tree_cache.hicache_controller.drain_pending()
        pool, bid = sched.tree_cache.host_pool, pages[0]
        if self.fault is TransferFault.HOST_KV_FLIP:
            _flip_host_page(pool, bid, row=0)
        else:  # another prefix's page (KV and records, as the engine's backup would write both) in its place
            others = [b for b in self.carried.records if b not in pages and pool._slots[b] is not None]
            if not others:
                return
            pool._slots[bid] = pool._slots[others[0]]
            self.carried.records[bid] = self.carried.records[others[0]]
        self.host_page = bid

    def _before_flush(self, sched, plan) -> None:
        """The load about to be scattered: its pages reversed, or its slots' KV kept to put back after (stale)."""
        if not self._due(sched):
            return
        for i, (host_pages, pages) in enumerate(plan):
            if len(pages) >= 2:
                self.pages = list(pages)
                if self.fault is TransferFault.WRONG_SLOTS:
                    plan[i] = (host_pages, list(pages)[::-1])
                else:
                    kv = sched.runner.token_to_kv_pool.kv_buffer
                    self._old_kv = [np.asarray(layer)[np.asarray(pages)] for layer in kv]
                return

    def _after_flush(self, sched, plan) -> None:
        if self._old_kv is None:
            return
        kv, index = sched.runner.token_to_kv_pool.kv_buffer, np.asarray(self.pages)
        for layer, old in enumerate(self._old_kv):
            raw = np.array(kv[layer])
            raw[index] = old
            kv[layer] = jax.device_put(raw, kv[layer].sharding)
        self._old_kv = None

    def before_step_end(self, sched) -> None:
        """Before a step end that runs a host sweep: flips the first evicted (host-only) page that sweep takes."""
        carried = self.carried
        if self.fault is not TransferFault.HOST_RESIDENT_FLIP or not self._due(sched):
            return
        if not carried.host_sweep_interval or carried._steps % carried.host_sweep_interval:
            return
        listed = carried.host_pages()
        start = carried._cursor % len(listed) if listed else 0
        chosen = [bid for bid, _, _ in (listed + listed)[start : start + min(carried.host_sweep_pages, len(listed))]]
        evicted = {int(b) for b in _evicted_host_pages(sched.tree_cache)}
        for i, bid in enumerate(chosen):
            if bid in evicted:
                _flip_host_page(sched.tree_cache.host_pool, bid, row=0)
                self.host_page, self._swept = bid, (sched.forwards - 1, (i + 1) * sched.page_size)
                return

    def target(self, sched) -> Injected | None:
        """Where the canary must report: the load's forward, its request, the first slot the fault changed (for a
        page that stays on host: the host sweep's step and its scratch slot, no request)."""
        if self.fault is TransferFault.HOST_RESIDENT_FLIP:
            return None if self.host_page is None else Injected(self._swept[0], self._swept[1], None, -1)
        for load in sched.loads:
            if self.host_page is not None and self.host_page in load.host_pages:
                page = load.pages[load.host_pages.index(self.host_page)]
            elif self.pages is not None and load.pages == self.pages:
                page = load.pages[0]
            else:
                continue
            return Injected(load.step, page * sched.page_size, load.rid, -1)
        return None


@dataclasses.dataclass(frozen=True)
class HiCacheRun:
    """One run and what the canary reported first; ``loads`` / ``pages_loaded`` / ``pages_backed_up`` count the
    transfers (load-backs, and pages carried each way)."""

    policy: str
    fault: str
    steps: int
    loads: int
    pages_loaded: int
    pages_backed_up: int
    injected: Injected | None
    detected_step: int | None
    launch_tag: str | None
    fail_reason: str | None
    slot: int | None
    rid: str | None
    ok: bool
    note: str = ""
    host_page: tuple | None = None  # (host page, token row) a host sweep's report names
    flipped_host_page: int | None = None  # the host page a host-resident fault changed
    pages_host_swept: int = 0

    def as_row(self) -> RunResult:
        """The toy demo's row type (1-based steps), for its table."""
        one = lambda x: None if x is None else x + 1  # noqa: E731
        return RunResult(f"{self.fault} ({self.policy})", "FULL", self.steps,
                         one(self.injected and self.injected.step), one(self.detected_step), None, self.launch_tag,
                         self.fail_reason, self.ok, self.note)  # fmt: skip


def run(worker, *, write_policy: str, fault: TransferFault | None = None, seed: int = 0, after: int = 40,
        max_steps: int = 400, carry: bool = True,
        host_sweep_interval: int = HOST_SWEEP_INTERVAL) -> HiCacheRun:  # fmt: skip
    """The workload on ``worker`` with HiCache and the canary, clean or with ``fault`` injected once.

    ``carry=False`` leaves the records behind (the canary without :func:`~kvcanary_jax.integrations.sglang_hicache.
    carry_records`): the first load-back is then a false alarm, since its new slots hold no records of the pages.

    A clean run goes to the end and must report nothing; a fault run stops at the first report (raise mode), which
    must name the fault's launch and reason, the load's forward, its request and the first slot the fault changed.
    """
    if write_policy not in POLICIES:
        raise ValueError(f"write_policy must be one of {POLICIES}; got {write_policy!r}")
    sched = HiCacheScheduler(worker, workload(seed), write_policy=write_policy)
    guard = sglang_jax.wrap(worker, CONFIG, tree_cache=None)
    carried = sglang_hicache.carry_records(guard, sched.tree_cache, host_sweep_interval=host_sweep_interval)
    if not carry:
        carried.detach()
    drill = Drill(fault, after) if fault is not None else None
    if drill is not None:
        drill.arm(sched, carried)
    try:
        with cpu_load_kernel():
            for batch in sched:
                guard.expect(batch)
                sched.run_batch(batch)
                if drill is not None:
                    drill.before_step_end(sched)
                guard.after_step()
                if sched.forwards >= max_steps:
                    break
        guard.final_check()
    except KvCanaryViolationError:
        pass  # raise mode: the monitor's observed list holds what it read
    finally:
        guard.unwrap()
        if carry:
            carried.detach()
        sched.tree_cache.hicache_controller.shutdown()
    first = guard.monitor.observed[0] if guard.monitor.observed else None
    rid = guard.rid_of(first) if first is not None else None
    injected = drill.target(sched) if drill is not None else None
    ok, note = judge(first, rid, injected, EXPECTED.get(fault))
    return HiCacheRun(
        policy=write_policy, fault="none" if fault is None else fault.value, steps=sched.forwards,
        loads=len(sched.loads), pages_loaded=carried.loaded, pages_backed_up=carried.backed_up, injected=injected,
        detected_step=first.user_step if first else None, launch_tag=first.violation.tag_label if first else None,
        fail_reason="+".join(first.violation.reason_labels) if first else None,
        slot=first.violation.slot_idx if first else None, rid=rid, ok=ok, note=note,
        host_page=carried.host_page_of(first) if first else None, pages_host_swept=carried.host_swept,
        flipped_host_page=drill.host_page if fault is TransferFault.HOST_RESIDENT_FLIP else None,
    )  # fmt: skip


def run_demo(*, seed: int = 0, as_json: bool = False, out: TextIO | None = None) -> int:
    """A clean run per write policy, then every transfer fault in each; prints the table (or JSON). Returns 0 if all
    were as expected."""
    out = out or sys.stdout
    started = time.perf_counter()
    worker = hicache_worker(seed=seed)
    runs = [run(worker, write_policy=p, fault=f, seed=seed) for p in POLICIES for f in (None, *TransferFault)]
    ok = all(r.ok for r in runs)
    if as_json:
        payload = {"ok": ok, "engine": "sglang-jax", "hicache_storage": "none", "device_tokens": DEVICE_TOKENS,
                   "wall_s": round(time.perf_counter() - started, 1), "runs": [dataclasses.asdict(r) for r in runs]}
        out.write(json.dumps(payload, indent=2) + "\n")  # fmt: skip
        return 0 if ok else 1
    out.write(f"sglang-jax HiCache (hicache_storage='none', device pool {DEVICE_TOKENS} tokens, host pool 4x), "
              "canary records carried with every page backed up and loaded back\n")  # fmt: skip
    for r in runs:
        if r.fault == "none":
            out.write(f"  clean {r.policy}: {r.steps} steps, {r.loads} load-backs ({r.pages_loaded} pages loaded, "
                      f"{r.pages_backed_up} backed up, {r.pages_host_swept} host-swept)\n")  # fmt: skip
    out.write("\n" + cli.format_table([r.as_row() for r in runs]) + "\n")
    for r in runs:
        if r.flipped_host_page is not None:
            out.write(f"  {r.fault} ({r.policy}): host page {r.flipped_host_page} flipped before the host sweep of step "
                      f"{r.injected.step + 1}; reported (host page, row) {r.host_page}\n")  # fmt: skip
        elif r.injected is not None:
            out.write(f"  {r.fault} ({r.policy}): load at step {r.injected.step + 1} of request {r.injected.rid} into "
                      f"slot {r.injected.slot}; reported slot {r.slot}, request {r.rid}\n")  # fmt: skip
    verdict = ("all transfer faults detected at their load's slot, request and step (a page that stays on host: by "
               "the host sweep); no false positives")
    out.write(f"\n{verdict if ok else 'FAILED'} ({time.perf_counter() - started:.0f} s)\n")
    return 0 if ok else 1
