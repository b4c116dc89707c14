"""kvcanary-jax around sglang-jax's ``ModelRunner``: HEAD before and TAIL after every forward, in jits of their own.

Wrap the worker your scheduler calls (a ``ModelWorker``, or the overlap scheduler's ``ModelWorkerClient``)::

    guard = wrap(worker, kc.CanaryConfig(mode="raise", real_kv_hash_mode="partial"), tree_cache=tree_cache)
    for batch in ...:  # each ScheduleBatch, as Scheduler.run_batch gets it
        guard.expect(batch)  # the requests' own token history (needed by the token asserts)
        worker.forward_batch_generation(batch.get_model_worker_batch(...))  # ModelRunner.forward runs the canary
        ...  # the scheduler's own result processing
        guard.after_step()  # the radix-cache sweep when due; the lagged, non-blocking report check

What the engine's batch becomes (all on device, inside the HEAD / TAIL jits):

* rows: batch row ``b`` of a real request is canary row ``b``; padding rows (``req_pool_indices == -1``, anywhere
  in the batch) are ``-1``, the pool's ``padding="negative"`` convention. The engine's own pool row is not used.
* lengths: EXTEND and MIXED batches carry ``extend_prefix_lens`` / ``extend_seq_lens``; a DECODE row caches
  ``seq_lens - 1`` tokens and writes 1.
* the page table: built from ``ForwardBatch.cache_loc``, the slots attention reads (each row's ``seq_lens`` slots
  end to end, every row padded to a whole page), as ``i32[bs, W]``: nothing is uploaded from the host.
* real KV: layer 0's fused array ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]`` (K and V
  alternate per head) read in place as a K source and a V source (a byte offset and a stride; no copy), on the
  engine's explicit mesh sharding.
* plan sizes: a forward verifies at most its real rows' ``seq_lens`` summed (known on the host), so HEAD and TAIL
  run with plans of the next power of two of that (:func:`sized_capacity`: at least 256, at most the largest
  ``cache_loc`` bucket), one compile per size and mode. The canary's work follows its plans' size, and the bucket
  (every row at the model's context length) is many times what a batch holds.
* sweep: every slot the ``RadixCache`` holds (a depth-first walk of its nodes).
* the monitor: TAIL and the sweep also return ``CanaryMonitor.snapshot`` of their state, which the step's check
  hands to ``after_step``: two launches a step (three with a sweep), none of the monitor's own.
* token oracle: ``req.origin_input_ids + req.output_ids`` of each request, for the write-input assert (the tokens
  each forward writes) and the verify-token assert (each cached slot's token), taken on the scheduler's thread when
  the batch is handed to the worker.
* the overlap scheduler (``ModelWorkerClient``): the forward runs on the worker's thread and the host history lags a
  step, so a decode row's newest token is not known yet. Its expected input id is then the row's own future-map
  entry (``map[req_pool_idx + 1]``, read on device: the token the row's previous forward sampled), independent of
  the placeholder the batch carries; the verify-token assert checks that token one step later, from the history.
  The step's end (the radix sweep, planned on the scheduler's thread, and the monitor) runs on the worker's thread
  after the forward: ``after_step`` is not called by the user.

Not mapped (refused with an error): speculative decoding, SWA / MLA / hybrid pools, the fused Pathways
forward-and-sample path, and an engine that already holds requests or cached prefixes (its records were never
written: see :func:`refuse_warm_engine`). A parallel engine (``tp_size`` or ``dp_size`` > 1) gets a sharded canary
over its mesh, each DP rank numbering its own slots: see :mod:`._sglang_parallel`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import logging
import math
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kvcanary_jax as kc

logger = logging.getLogger("kvcanary_jax.sglang_jax")

INSTALL_HINT = (
    'kvcanary_jax.integrations.sglang_jax needs sglang-jax: pip install "kvcanary-jax[sglang-jax]" '
    "(Python >= 3.12; it installs sglang-jax[cpu]==0.1.0rc0, the release on jax 0.10.2)"
)
_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "cache_loc",
           "extend_prefix_lens", "extend_seq_lens")  # fmt: skip
_MAPPED_MODES = ("EXTEND", "MIXED", "DECODE")
_KEEP_REQUESTS = 64  # steps whose batch requests are kept for report lookups
_MIN_CAPACITY = 256  # the smallest plan a forward (or an adoption) is sized for
_LADDER_STEP = 4  # each plan size is this many times the one below it


def require_sglang_jax():
    """Imports ``sgl_jax``; raises ``ImportError`` saying how to install the extra when it is missing."""
    try:
        return importlib.import_module("sgl_jax")
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err


# --- the engine's batch as the canary's (traced) ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static facts of one engine, closed over by the jits.

    Attributes:
      page_size: slots per KV page.
      table_width: columns of the device-built page table: the longest sequence, rounded up to a page.
    """

    page_size: int
    table_width: int


def kv_sources(kv0: jax.Array) -> tuple[kc.RealKvSource, kc.RealKvSource]:
    """K and V of one fused layer array as two real-KV sources, views of the same array (no copy).

    ``kv0`` is ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]``: per token, fused head ``j`` sits at
    byte ``j * head_bytes``, K of head ``h`` at ``j = 2h`` and V at ``2h + 1``.
    """
    if kv0.ndim != 5:
        raise ValueError(
            "kv0 must be sglang-jax's fused layer array [pages, page_size, 2 * kv_heads // packing, packing, "
            f"head_dim]; got shape {tuple(kv0.shape)}"
        )
    _, page_size, fused, packing, head_dim = kv0.shape
    head_bytes = head_dim * jnp.dtype(kv0.dtype).itemsize
    kv_heads = fused * packing // 2
    common = dict(page_size=page_size, read_bytes=kv_heads * head_bytes, segment_bytes=head_bytes,
                  segment_stride=2 * head_bytes)  # fmt: skip
    return kc.RealKvSource(kv0, byte_offset=0, **common), kc.RealKvSource(kv0, byte_offset=head_bytes, **common)


def _inclusive_sum(x: jax.Array) -> jax.Array:
    """``cumsum`` as one ``reduce_window`` (jax 0.12 lowers ``jnp.cumsum`` for CUDA to a while loop)."""
    n = x.shape[0]
    return lax.reduce_window(x, jnp.zeros((), x.dtype), lax.add, (n,), (1,), [(n - 1, 0)])


def page_table(cache_loc: jax.Array, seq_lens: jax.Array, layout: Layout) -> jax.Array:
    """i32[bs, W]: row ``b`` holds batch row b's first ``seq_lens[b]`` slots as attention reads them, 0 past them.

    ``cache_loc`` holds every row's slots end to end, each row padded to a whole page (DP = 1).
    """
    ps, width = layout.page_size, layout.table_width
    aligned = (seq_lens + ps - 1) // ps * ps
    starts = _inclusive_sum(aligned) - aligned
    col = jnp.arange(width, dtype=jnp.int32)
    index = jnp.clip(starts[:, None] + col[None, :], 0, cache_loc.shape[0] - 1)
    return jnp.where(col[None, :] < seq_lens[:, None], cache_loc[index], 0).astype(jnp.int32)


def canary_batch(fields: dict, layout: Layout, *, is_decode: bool, oracle: dict) -> kc.CanaryBatch:
    """The engine's ``ForwardBatch`` arrays (``fields``) as a :class:`kvcanary_jax.CanaryBatch`; traced.

    Args:
      fields: ``input_ids, positions, out_cache_loc`` (i32[T]), ``req_pool_indices, seq_lens`` (i32[bs]),
        ``cache_loc``, and for EXTEND / MIXED ``extend_prefix_lens, extend_seq_lens`` (i32[bs]).
      layout: the engine's :class:`Layout`.
      is_decode: a DECODE batch (no extend arrays).
      oracle: ``expected_input_ids`` (i32[T]) and / or ``token_ids`` (i32[max_bs, W]) with ``token_ids_lens``
        (i32[bs]), from :func:`token_oracle`; empty when the token asserts are off. Under the overlap scheduler it
        also holds ``future_map``: a negative expected id ``-k`` means "the token at ``future_map[k]``".
    """
    if not jax.sharding.get_abstract_mesh().empty:  # P("data") on the engine's mesh: the mapping works replicated
        fields = {k: jax.sharding.reshard(v, P()) for k, v in fields.items()}
        oracle = {k: jax.sharding.reshard(v, P()) for k, v in oracle.items()}
    fields, oracle = dict(fields), dict(oracle)
    future_map = fields.pop("future_map", None)
    if future_map is not None:  # the overlap scheduler's placeholders, resolved as the engine resolves them
        fields["input_ids"] = resolve_future(fields["input_ids"], future_map)
        if "expected_input_ids" in oracle:
            oracle["expected_input_ids"] = resolve_future(oracle["expected_input_ids"], future_map)
    rpi, seq_lens = fields["req_pool_indices"].astype(jnp.int32), fields["seq_lens"].astype(jnp.int32)
    real = (rpi >= 0) & (seq_lens > 0)
    rows = jnp.where(real, jnp.arange(rpi.shape[0], dtype=jnp.int32), -1)
    seq_lens = jnp.where(real, seq_lens, 0)
    if is_decode:
        prefix, extend = jnp.where(real, seq_lens - 1, 0), real.astype(jnp.int32)
    else:
        prefix = jnp.where(real, fields["extend_prefix_lens"], 0).astype(jnp.int32)
        extend = jnp.where(real, fields["extend_seq_lens"], 0).astype(jnp.int32)
    return kc.CanaryBatch(
        req_pool_indices=rows,
        prefix_lens=prefix,
        extend_lens=extend,
        req_to_token=page_table(fields["cache_loc"].astype(jnp.int32), seq_lens, layout),
        input_ids=fields["input_ids"].astype(jnp.int32),
        positions=fields["positions"].astype(jnp.int32),
        out_cache_loc=fields["out_cache_loc"].astype(jnp.int32),
        **oracle,
    )


def resolve_future(ids: jax.Array, future_map: jax.Array) -> jax.Array:
    """A negative id ``-k`` is the token at ``future_map[k]`` (sglang-jax's ``resolve_future_token_ids``); traced."""
    return jnp.where(ids < 0, future_map[jnp.clip(-ids, 0, future_map.shape[0] - 1)], ids)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The one shape per kind of forward the canary's programs see, whatever bucket the engine padded a batch to.

    The engine pads a batch to one of its buckets (rows, tokens, ``cache_loc``); the canary pads it further, on the
    host, to the largest, so its HEAD and TAIL compile once per kind and plan size (at startup, see
    :meth:`SglangCanary.precompile`), never per bucket, and a smaller bucket is never refused.

    Attributes:
      rows: batch rows (the largest batch-size bucket).
      decode_tokens: a DECODE batch's tokens (one per row: the largest batch-size bucket).
      extend_tokens: an EXTEND or MIXED batch's tokens (the largest token bucket).
      cache_loc: ``cache_loc`` entries (the largest ``cache_loc`` bucket).
    """

    rows: int
    decode_tokens: int
    extend_tokens: int
    cache_loc: int

    @classmethod
    def of(cls, worker) -> Shapes:
        """From the engine's buckets (``get_precompile_paddings``)."""
        token_buckets, bs_buckets, cache_loc_buckets = worker.get_precompile_paddings()
        rows = int(max(bs_buckets))
        return cls(rows=rows, decode_tokens=rows, extend_tokens=max(int(max(token_buckets)), rows),
                   cache_loc=int(max(cache_loc_buckets)))  # fmt: skip

    def tokens(self, is_decode: bool) -> int:
        return self.decode_tokens if is_decode else self.extend_tokens


def _padded(x, n: int, fill: int, what: str) -> np.ndarray:
    """``x`` as i32[n], its tail ``fill``; a longer ``x`` is an engine set-up the canary was not sized for."""
    x = np.asarray(x, np.int32).reshape(-1)
    if x.shape[0] > n:
        raise ValueError(f"the engine's batch has {x.shape[0]} {what}, more than the largest bucket ({n}) the canary "
                         "was sized for at startup")  # fmt: skip
    out = np.full(n, fill, np.int32)
    out[: x.shape[0]] = x
    return out


def host_fields(model_worker_batch, shapes: Shapes, *, is_decode: bool) -> dict:
    """The ``ModelWorkerBatch``'s arrays the mapping reads, copied and padded to ``shapes`` (numpy).

    Padding follows the engine's own: rows ``req_pool_indices = -1`` with no tokens, tokens ``out_cache_loc = -1``
    (not written). A copy, as the engine reuses its host buffers (``cache_loc``) for the next batch.
    """
    mwb, t, r = model_worker_batch, shapes.tokens(is_decode), shapes.rows
    fields = {
        "input_ids": _padded(mwb.input_ids, t, 0, "tokens"),
        "positions": _padded(mwb.positions, t, 0, "tokens"),
        "out_cache_loc": _padded(mwb.out_cache_loc, t, -1, "tokens"),
        "req_pool_indices": _padded(mwb.req_pool_indices, r, -1, "rows"),
        "seq_lens": _padded(mwb.seq_lens, r, 0, "rows"),
        "cache_loc": _padded(mwb.cache_loc, shapes.cache_loc, 0, "cache_loc entries"),
    }
    if not is_decode:
        fields["extend_prefix_lens"] = _padded(mwb.extend_prefix_lens, r, 0, "rows")
        fields["extend_seq_lens"] = _padded(mwb.extend_seq_lens, r, 0, "rows")
    return fields


def padded_oracle(oracle: dict, shapes: Shapes, *, is_decode: bool) -> dict:
    """A :func:`token_oracle` padded to ``shapes`` as :func:`host_fields` pads the batch."""
    out = dict(oracle)
    if "expected_input_ids" in out:
        out["expected_input_ids"] = _padded(out["expected_input_ids"], shapes.tokens(is_decode), 0, "tokens")
    if "token_ids_lens" in out:
        out["token_ids_lens"] = _padded(out["token_ids_lens"], shapes.rows, 0, "rows")
    return out


def capacity_ladder(limit: int) -> tuple[int, ...]:
    """The plan capacities a forward may run with: 256, then x4 each, up to ``limit`` (the largest ``cache_loc``
    bucket), which ends the ladder. Each is a HEAD and a TAIL program per kind of forward, compiled at startup; x4
    keeps that to a few programs while a plan stays within 4x of what its batch verifies."""
    sizes = [min(_MIN_CAPACITY, limit)]
    while sizes[-1] < limit:
        sizes.append(min(limit, sizes[-1] * _LADDER_STEP))
    return tuple(sizes)


def sized_capacity(need: int, limit: int) -> int:
    """The plan capacity for ``need`` entries: the smallest of :func:`capacity_ladder` that holds them (at most
    ``limit``).

    The canary's work scales with its plan's capacity, not with what the plan lists: a few sizes keep it near the
    batch's own size at a few programs per kind of forward.
    """
    return next((c for c in capacity_ladder(limit) if c >= need), limit)


def verify_need(model_worker_batch) -> int:
    """At least the entries a forward of this batch verifies (the real rows' cached prefixes): the rows' ``seq_lens``
    summed (host numpy)."""
    rpi, seq_lens = np.asarray(model_worker_batch.req_pool_indices), np.asarray(model_worker_batch.seq_lens)
    return int(np.sum(seq_lens, where=(rpi >= 0) & (seq_lens > 0)))


def batch_fields(forward_batch) -> dict:
    """The ``ForwardBatch`` arrays the mapping reads."""
    return {k: getattr(forward_batch, k) for k in _FIELDS if getattr(forward_batch, k, None) is not None}


# Each launch returns (state, the monitor's snapshot of it or None). TAIL and the sweep may end a step: their
# snapshot spares the monitor a launch of its own per step.
@functools.partial(jax.jit, static_argnames=("canary", "layout", "is_decode"), donate_argnums=(0,))
def _head(state, fields, oracle, *, canary, layout, is_decode):
    return canary.before_forward(state, canary_batch(fields, layout, is_decode=is_decode, oracle=oracle)), None


@functools.partial(jax.jit, static_argnames=("canary", "layout", "is_decode"), donate_argnums=(0,))
def _tail(state, fields, oracle, kv0, *, canary, layout, is_decode):
    k, v = kv_sources(kv0)
    batch = canary_batch(fields, layout, is_decode=is_decode, oracle=oracle)
    state = canary.after_forward(state, batch, canary.kv_sources(full_k=k, full_v=v))
    return state, kc.CanaryMonitor.snapshot(state)


@functools.partial(jax.jit, static_argnames=("canary",), donate_argnums=(0,))
def _sweep(state, plan, kv0, *, canary):
    k, v = kv_sources(kv0)
    state = canary.sweep(state, plan, canary.kv_sources(full_k=k, full_v=v))
    return state, kc.CanaryMonitor.snapshot(state)


_LAUNCHES = {"head": _head, "tail": _tail, "sweep": _sweep}


# --- host side: the token oracle and the radix walk ---------------------------------------------------------------


def token_oracle(reqs, model_worker_batch, layout: Layout, *, max_bs: int, write: bool, verify: bool) -> dict:
    """The requests' own history (``origin_input_ids + output_ids``) laid out as the batch (numpy).

    Returns ``expected_input_ids`` (i32[T]: each token the forward must write) when ``write``, and ``token_ids``
    (i32[max_bs, W]: each row's known tokens) with ``token_ids_lens`` (i32[bs]) when ``verify``. Under the overlap
    scheduler a row's history may lag its batch by one token (sampled by the previous forward, not yet on the host):
    that token's expected id is ``-(req_pool_idx + 1)``, the row's own future-map entry, resolved on device.
    """
    mwb = model_worker_batch
    num_tokens, bs = len(mwb.input_ids), len(mwb.seq_lens)
    is_decode = mwb.forward_mode.is_decode()
    expected = np.zeros(num_tokens, np.int32)
    table = np.zeros((max_bs, layout.table_width), np.int32)
    lens = np.zeros(bs, np.int32)
    t = 0
    for b, req in enumerate(reqs):
        history = list(req.origin_input_ids) + list(req.output_ids)
        seq = int(mwb.seq_lens[b])
        n = 1 if is_decode else int(mwb.extend_seq_lens[b])
        if seq > len(history) + 1:
            raise ValueError(
                f"request {req.rid!r}: the batch runs {seq} tokens but its history holds {len(history)} (at most one "
                "may be pending, under the overlap scheduler)"
            )
        lagged = history + [-(int(mwb.req_pool_indices[b]) + 1)] * max(0, seq - len(history))
        expected[t : t + n] = lagged[seq - n : seq]
        t += n
        known = min(len(history), layout.table_width)
        table[b, :known] = history[:known]
        lens[b] = known
    out = {}
    if write:
        out["expected_input_ids"] = expected
    if verify:
        out["token_ids"], out["token_ids_lens"] = table, lens
    return out


def radix_entries(tree_cache, *, include=None) -> kc.SweepEntries:
    """Every slot a ``RadixCache`` holds, as (slot, position = depth, predecessor) entries.

    ``include(node)``, if given, keeps only the slots of the nodes it accepts (e.g. ``lambda n: n.lock_ref == 0``:
    the slots no running request holds).
    """
    return kc.walk_prefix_tree(
        tree_cache.root_node,
        children=lambda node: [c for c in node.children.values() if c.value is not None],
        slots=lambda node: np.asarray(node.value, np.int32),
        include=include,
    )


# --- the wrapper --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Pending:
    """What the scheduler's thread hands one forward (taken when the batch goes to the worker).

    Attributes:
      rids: each batch row's ``rid``; oracle: the host token oracle (numpy); fields: the batch's arrays the mapping
      reads, copied (the engine builds ``cache_loc`` in one host buffer it reuses every step: under the overlap
      scheduler the next batch overwrites it while this one runs) and padded to the guard's :class:`Shapes`;
      is_decode: a DECODE batch; verify_capacity: the HEAD and TAIL plans' size (:func:`sized_capacity` of the
      batch's :func:`verify_need`); sweep: the radix slots to verify after the forward (overlap scheduler only);
      before_forward / before_sweep: callables run on the forward's thread (fault drills).
    """

    rids: list
    oracle: dict
    fields: dict
    is_decode: bool
    verify_capacity: int | None = None
    sweep: kc.SweepEntries | None = None
    before_forward: list = dataclasses.field(default_factory=list)
    before_sweep: list = dataclasses.field(default_factory=list)


class SglangCanary:
    """The canary around one sglang-jax worker; made by :func:`wrap`.

    Attributes:
      canary: the :class:`kvcanary_jax.KvCanary` (its pool: every slot of the engine's KV pool).
      state: the canary state, replicated on the engine's mesh.
      monitor: the :class:`kvcanary_jax.CanaryMonitor` reading it.
      layout: the engine's :class:`Layout`.
      steps: forwards run so far (the step number reports use).
      enqueued: batches handed to the worker so far (under the overlap scheduler, ahead of ``steps``): the step
        number the next batch's forward will have.
      overlap: the worker is the overlap scheduler's ``ModelWorkerClient`` (the step's end runs on its thread).
      on_enqueue: ``f(guard, model_worker_batch, pending)`` on the scheduler's thread as each batch goes to the worker.
      on_step_end: ``f(guard, new_observed)`` after each monitor check, before a violation is raised.
    """

    def __init__(self, worker, config: kc.CanaryConfig, *, tree_cache=None, table_width: int | None = None):
        self.overlap = _is_overlap_client(worker)
        self.worker, self.runner, self.config, self.tree_cache = worker, worker.model_runner, config, tree_cache
        self.model_worker = worker.worker if self.overlap else worker
        kv0 = self.runner.token_to_kv_pool.kv_buffer[0]
        page_size = int(kv0.shape[1])
        width = int(table_width or self.runner.model_config.context_len)
        self.layout = Layout(page_size=page_size, table_width=-(-width // page_size) * page_size)
        self.shapes = Shapes.of(worker)
        self.max_bs = self.shapes.rows
        self.max_verify = self.shapes.cache_loc  # a forward verifies at most the slots attention reads
        self.lock = threading.RLock()  # held by each step (launches and check), a sweep, a flush
        self._build(kv0, max_verify=self.max_verify)
        self._sized: dict[int, kc.KvCanary] = {}  # verify capacity -> the canary with plans of that size
        self.steps = 0
        self.on_enqueue: Callable | None = None
        self.on_step_end: Callable | None = None
        self.enqueued = 0
        self._reported = 0  # monitor.observed rows handed to on_step_end
        self._reqs = None
        self._pending: dict = {}  # bid -> Pending, from the scheduler's thread to the forward's
        self._current: Pending | None = None
        self._current_bid = None
        self._snapshot = (None, None)  # (a state, the monitor's snapshot of it) from the latest launch
        self._last_step_end = -math.inf
        self._requests = collections.OrderedDict()  # step -> rids by batch row
        self._forward = self.runner.forward
        self._forward_batch_generation = self.model_worker.forward_batch_generation
        self.runner.forward = self.forward
        self.model_worker.forward_batch_generation = self._generate
        if self.overlap:
            self._client_generate = worker.forward_batch_generation
            worker.forward_batch_generation = self._enqueue

    def _build(self, kv0: jax.Array, *, max_verify: int) -> None:
        """The canary (its pool: every slot of the engine's KV pool), its monitor and its state."""
        token_pool = {}
        if self.config.enable_verify_token_assert:
            token_pool = dict(max_reqs=self.max_bs, max_context_len=self.layout.table_width)
        # A forward verifies at most the slots attention reads: the largest cache_loc bucket.
        pool = kc.CanaryPool(num_slots=int(kv0.shape[0]) * self.layout.page_size, page_size=self.layout.page_size,
                             verify_capacity=max_verify, **token_pool)  # fmt: skip
        self.canary = kc.KvCanary(self.config, pool)
        self.monitor = kc.CanaryMonitor(self.canary)
        self.state = self._on_mesh(self.canary.init_state())

    # -- what the user calls ---------------------------------------------------------------------------------------

    def expect(self, schedule_batch) -> None:
        """Feeds the next forward's requests (a ``ScheduleBatch``): their own history is the token oracle.

        Required before each forward when ``enable_write_input_assert`` or ``enable_verify_token_assert`` is on;
        otherwise it only names the requests for :meth:`request_ids`.
        """
        infos = getattr(schedule_batch, "reqs_info", None)
        if infos is None:
            raise TypeError(f"schedule_batch must be an sgl_jax ScheduleBatch; got {type(schedule_batch).__name__}")
        self._reqs = self._requests_of(infos)

    def after_step(self) -> None:
        """After the scheduler processed the step: sweeps the radix cache when due, then the lagged report check.

        Under the overlap scheduler the worker's thread does this itself after each forward: calling it is an error.

        Raises:
          KvCanaryViolationError: in raise mode, when a step ``check_lag_steps`` ago recorded violations.
        """
        if self.overlap:
            raise RuntimeError("under the overlap scheduler the worker's thread ends each step itself; do not call "
                               "after_step()")  # fmt: skip
        if self.tree_cache is not None and self.monitor.sweep_due:
            self.sweep()
        self._check()

    def sweep(self, entries: kc.SweepEntries | None = None) -> None:
        """Verifies every slot the radix cache holds now, or ``entries`` (the step's end runs it when due)."""
        if entries is None and self.tree_cache is None:
            raise ValueError("sweep needs the engine's RadixCache: wrap(worker, config, tree_cache=...)")
        plan = self.canary.sweep_plan(radix_entries(self.tree_cache) if entries is None else entries)
        self._run("sweep", plan, self.runner.token_to_kv_pool.kv_buffer[0])

    def adopt(self, reqs, req_to_token_pool) -> int:
        """Writes the records of the slots the engine cached before the wrap (see :mod:`._sglang_adopt`)."""
        from kvcanary_jax.integrations import _sglang_adopt  # it imports this module

        return _sglang_adopt.adopt(self, reqs, req_to_token_pool)

    def final_check(self) -> kc.ViolationReport:
        """Blocking: every pending check, then the whole report (at shutdown)."""
        return self.monitor.final_check(self.state)

    def request_ids(self, step: int) -> list:
        """The ``rid`` of each batch row at ``step`` (a violation's ``request_row``), for the last steps."""
        return self._requests[step]

    def rid_of(self, observed) -> str | None:
        """The ``rid`` an :class:`kvcanary_jax.ObservedViolation` names (None: no request, or too long ago)."""
        row = observed.violation.request_row
        rids = self._requests.get(observed.user_step, [])
        return rids[row] if row is not None and 0 <= row < len(rids) else None

    def unwrap(self) -> None:
        """Gives the worker and its runner their own methods back."""
        self.runner.forward = self._forward
        self.model_worker.forward_batch_generation = self._forward_batch_generation
        if self.overlap:
            self.worker.forward_batch_generation = self._client_generate

    def __enter__(self) -> SglangCanary:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Unwraps; on a normal exit first runs :meth:`final_check` (raising in raise mode)."""
        try:
            if exc_type is None:
                self.final_check()
        finally:
            self.unwrap()

    # -- the engine's calls ----------------------------------------------------------------------------------------

    def _take(self, model_worker_batch) -> Pending:
        """The forward's :class:`Pending`, from the history as it is now (the scheduler's thread)."""
        write, verify = self.config.enable_write_input_assert, self.config.enable_verify_token_assert
        reqs, self._reqs = self._reqs, None
        if (write or verify) and reqs is None:
            raise ValueError(
                "the token asserts need the requests' history: call guard.expect(schedule_batch) before each "
                "forward, and run the forward through worker.forward_batch_generation(model_worker_batch)"
            )
        oracle = {}
        if write or verify:
            oracle = self._token_oracle(reqs, model_worker_batch, write=write, verify=verify)
        is_decode = model_worker_batch.forward_mode.is_decode()
        pending = Pending(rids=self._rids(reqs), oracle=oracle, fields={}, is_decode=is_decode,
                          verify_capacity=self._verify_capacity(model_worker_batch))  # fmt: skip
        interval = self.config.sweep_interval
        if self.overlap and self.tree_cache is not None and interval > 0 and self.enqueued % interval == 0:
            pending.sweep = radix_entries(self.tree_cache)  # the tree as the scheduler's thread holds it now
        self.enqueued += 1
        if self.on_enqueue is not None:
            self.on_enqueue(self, model_worker_batch, pending)  # a drill may change the batch: copy it after
        pending.fields = self._host_fields(model_worker_batch, is_decode=is_decode)
        return pending

    def _enqueue(self, model_worker_batch, *args, **kwargs):
        """``ModelWorkerClient.forward_batch_generation`` (the scheduler's thread): hands the forward its Pending."""
        self._pending[model_worker_batch.bid] = self._take(model_worker_batch)
        return self._client_generate(model_worker_batch, *args, **kwargs)

    def _generate(self, model_worker_batch, *args, **kwargs):
        """``ModelWorker.forward_batch_generation`` (the forward's thread), with the batch's Pending."""
        if self.overlap:
            self._current = self._pending.pop(model_worker_batch.bid)
        else:
            self._current = self._take(model_worker_batch)
        self._current_bid = model_worker_batch.bid
        try:
            return self._forward_batch_generation(model_worker_batch, *args, **kwargs)
        finally:
            self._current = None

    def forward(self, forward_batch, logits_metadata=None, *args, **kwargs):
        """``ModelRunner.forward`` with HEAD before and TAIL after it (installed on the runner by :func:`wrap`)."""
        mode = forward_batch.forward_mode
        if mode.name == "IDLE":
            return self._forward(forward_batch, logits_metadata, *args, **kwargs)
        if mode.name not in _MAPPED_MODES:
            raise NotImplementedError(
                f"kvcanary's sglang-jax mapping covers {', '.join(_MAPPED_MODES)} forwards; got {mode.name} "
                "(speculative decoding is not mapped)"
            )
        pending = self._current
        if pending is None or self._current_bid != forward_batch.bid:
            raise ValueError(
                "the canary needs each forward's batch: run it through worker.forward_batch_generation("
                "model_worker_batch), after guard.expect(schedule_batch) when the token asserts are on"
            )
        for action in pending.before_forward:
            action(self)
        if pending.is_decode != (mode.name == "DECODE"):
            raise ValueError(f"the forward is {mode.name} but its batch was handed over as another kind")
        with self.lock:  # a flush from another thread (shutdown) waits for the whole step
            return self._guarded_forward(pending, forward_batch, logits_metadata, *args, **kwargs)

    def _guarded_forward(self, pending: Pending, forward_batch, logits_metadata, *args, **kwargs):
        # The host arrays go to the jits as numpy, copied in C++ as each call parses its arguments: a jnp.asarray per
        # array runs a copy program of its own (decode step, host CPU: ~0.37 ms for the four, ~0.06 ms this way).
        fields = self._launch_fields(pending, forward_batch)
        static = dict(layout=self.layout, is_decode=pending.is_decode, capacity=pending.verify_capacity)
        self._run("head", fields, pending.oracle, **static)
        out = self._forward(forward_batch, logits_metadata, *args, **kwargs)
        kv0 = self.runner.token_to_kv_pool.kv_buffer[0]  # the forward donated the pools: read them afresh
        self._run("tail", fields, pending.oracle, kv0, **static)
        if self.steps == 0:  # warm-up over: the write-time chain-position assert turns on
            self._mark_init_finished()
        self._requests[self.steps] = pending.rids
        while len(self._requests) > _KEEP_REQUESTS:
            self._requests.popitem(last=False)
        self.steps += 1
        if self.overlap:  # the step's end, on this thread: the state is never touched from two threads
            if pending.sweep is not None:
                for action in pending.before_sweep:
                    action(self)
                self.sweep(pending.sweep)
            self._check()
        return out

    def _check(self) -> None:
        """The monitor's lagged check; new reports go to ``on_step_end`` first (also when it raises)."""
        with self.lock:
            try:
                state, snapshot = self._snapshot
                if state is self.state:  # the latest launch's snapshot, as no mark_init_finished or adopt came since
                    self.monitor.after_step(self.state, step=self.steps - 1, snapshot=snapshot)
                else:  # the monitor takes its own (the parallel guard's launches return none)
                    self.monitor.after_step(self.state, step=self.steps - 1)
            finally:
                self._last_step_end = time.monotonic()
                self._hand_over()

    def _hand_over(self) -> None:
        """Gives ``on_step_end`` the reports it has not seen (the lock held)."""
        new, self._reported = self.monitor.observed[self._reported :], len(self.monitor.observed)
        if self.on_step_end is not None:
            self.on_step_end(self, new)

    def flush(self) -> kc.ViolationReport:
        """Blocking: reads every check still pending (the last ``check_lag_steps`` steps) and hands new reports to
        ``on_step_end``; for an idle server and at shutdown. Safe from any thread (it waits for a running launch)."""
        with self.lock:
            try:
                return self.monitor.final_check(self.state)
            finally:
                self._hand_over()

    @property
    def unread_steps(self) -> int:
        """Steps whose check has not been read yet (they are read ``check_lag_steps`` steps later, or by flush)."""
        return len(self.monitor._pending)

    @property
    def idle_s(self) -> float:
        """Seconds since the last step ended (``inf`` before the first)."""
        return time.monotonic() - self._last_step_end

    # -- what a parallel engine's guard (``_sglang_parallel``) replaces ---------------------------------------------

    def _requests_of(self, infos) -> list:
        """The forward's requests, from the ``ScheduleBatch``'s per-DP-rank sections."""
        if len(infos) != 1:
            raise NotImplementedError(f"this guard maps one DP rank; the batch has {len(infos)} DP sections")
        return list(infos[0].reqs or [])

    def _rids(self, reqs) -> list:
        return [getattr(r, "rid", None) for r in reqs or []]

    def _token_oracle(self, reqs, model_worker_batch, *, write: bool, verify: bool) -> dict:
        oracle = token_oracle(reqs, model_worker_batch, self.layout, max_bs=self.max_bs, write=write, verify=verify)
        return padded_oracle(oracle, self.shapes, is_decode=model_worker_batch.forward_mode.is_decode())

    def _verify_capacity(self, model_worker_batch) -> int:
        """The HEAD and TAIL plans' size for this batch."""
        return sized_capacity(verify_need(model_worker_batch), self.max_verify)

    def _sized_canary(self, capacity: int | None) -> kc.KvCanary:
        """The canary with HEAD / TAIL plans of ``capacity`` entries (None: ``max_verify``); the same records."""
        if capacity is None:
            return self.canary
        if capacity not in self._sized:
            pool = dataclasses.replace(self.canary.pool, verify_capacity=capacity)
            self._sized[capacity] = dataclasses.replace(self.canary, pool=pool)
        return self._sized[capacity]

    def _mark_init_finished(self) -> None:
        self.state = self._on_mesh(self.canary.mark_init_finished(self.state))

    def _run(self, launch: str, *args, capacity: int | None = None, **static) -> None:
        """Runs the ``head``, ``tail`` or ``sweep`` jit on the state, on the engine's mesh, with plans of
        ``capacity`` entries."""
        with self.lock, jax.set_mesh(self.runner.mesh):
            self.state, snapshot = _LAUNCHES[launch](self.state, *args, canary=self._sized_canary(capacity), **static)
            self._snapshot = (self.state, snapshot)

    def _host_fields(self, model_worker_batch, *, is_decode: bool) -> dict:
        """The batch's arrays for the launches, copied on the scheduler's thread: :func:`host_fields`."""
        return host_fields(model_worker_batch, self.shapes, is_decode=is_decode)

    def _launch_fields(self, pending: Pending, forward_batch) -> dict:
        """The arrays HEAD and TAIL map: the copied host fields, and under the overlap scheduler the future-token
        map this batch's placeholders resolve with (read on the forward's thread)."""
        if self.overlap:
            return {**pending.fields, "future_map": self.worker.future_token_ids_map}
        return pending.fields

    def compiled_programs(self) -> dict[str, int]:
        """How many programs each of the guard's launches holds compiled (to show that serving compiles none)."""
        return {name: fn._cache_size() for name, fn in _LAUNCHES.items()}

    def precompile(self) -> int:
        """Compiles, before anything serves, every HEAD and TAIL program a forward can need: each kind (DECODE,
        EXTEND / MIXED) at each plan size of :func:`capacity_ladder`, and the sweep. They run on a scratch state with
        an all-padding batch: no record is written, no violation can come of it. Returns the programs compiled."""
        before = sum(self.compiled_programs().values())
        scratch = self._on_mesh(self.canary.init_state())
        kv0 = self.runner.token_to_kv_pool.kv_buffer[0]
        write, verify = self.config.enable_write_input_assert, self.config.enable_verify_token_assert
        for is_decode in (True, False):
            fields, oracle = self._empty_batch(is_decode, write=write, verify=verify)
            if self.overlap:
                fields["future_map"] = self.worker.future_token_ids_map
            for capacity in capacity_ladder(self.max_verify):
                canary = self._sized_canary(capacity)
                static = dict(canary=canary, layout=self.layout, is_decode=is_decode)
                with jax.set_mesh(self.runner.mesh):
                    scratch, _ = _head(scratch, fields, oracle, **static)
                    scratch, _ = _tail(scratch, fields, oracle, kv0, **static)
        if self.tree_cache is not None and self.config.sweep_interval > 0:
            plan = self.canary.sweep_plan(kc.SweepEntries.empty())
            # after a TAIL (a launch's output) and after the first step's mark_init_finished (the state re-placed)
            for state in (scratch, self._on_mesh(self.canary.init_state())):
                with jax.set_mesh(self.runner.mesh):
                    scratch, _ = _sweep(state, plan, kv0, canary=self.canary)
        jax.block_until_ready(self.canary.mark_init_finished(scratch))
        return sum(self.compiled_programs().values()) - before

    def _empty_batch(self, is_decode: bool, *, write: bool, verify: bool) -> tuple[dict, dict]:
        """An all-padding batch of :attr:`shapes` (host fields and token oracle), as :func:`host_fields` pads."""
        t, r = self.shapes.tokens(is_decode), self.shapes.rows
        fields = {"input_ids": np.zeros(t, np.int32), "positions": np.zeros(t, np.int32),
                  "out_cache_loc": np.full(t, -1, np.int32), "req_pool_indices": np.full(r, -1, np.int32),
                  "seq_lens": np.zeros(r, np.int32), "cache_loc": np.zeros(self.shapes.cache_loc, np.int32)}  # fmt: skip
        if not is_decode:
            fields["extend_prefix_lens"] = fields["extend_seq_lens"] = np.zeros(r, np.int32)
        oracle = {}
        if write:
            oracle["expected_input_ids"] = np.zeros(t, np.int32)
        if verify:
            oracle["token_ids"] = np.zeros((self.max_bs, self.layout.table_width), np.int32)
            oracle["token_ids_lens"] = np.zeros(r, np.int32)
        return fields, oracle

    def _on_mesh(self, state):
        """The state replicated on the engine's mesh, typed as the jits return it (one compile per shape)."""
        mesh = self.runner.mesh
        return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(*(None,) * x.ndim))), state)


def _is_overlap_client(worker) -> bool:
    """The overlap scheduler's ``ModelWorkerClient`` (a ``ModelWorker`` in ``.worker``, a future-token map)."""
    return hasattr(worker, "future_token_ids_map") and hasattr(worker, "worker")


def scheduler_requests(scheduler) -> list:
    """The live requests of an sglang-jax ``Scheduler`` between steps (DP rank 0): the running batch's, the last
    batch's (a prefill not merged yet) and the chunked request, each once."""
    reqs = {}
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)):
        for info in getattr(batch, "reqs_info", None) or []:
            for req in info.reqs or []:
                reqs.setdefault(id(req), req)
    for req in getattr(scheduler, "chunked_reqs", None) or []:
        if req is not None:
            reqs.setdefault(id(req), req)
    return [r for r in reqs.values() if r.req_pool_idx is not None and not r.finished()]


def refuse_warm_engine(worker, tree_cache=None) -> None:
    """Refuses an engine that already holds requests or cached prefixes: their slots have no records.

    Wrapping it would report every such slot as corrupt at its first read (``verify_chain_hash``); ``wrap(...,
    live_requests=...)`` adopts them instead (writes their records once from the engine's tables).

    Raises:
      ValueError: naming what the engine holds.
    """
    req_pool, allocator = worker.get_memory_pool()
    held = []
    live = req_pool.size - req_pool.available_size()
    if live:
        held.append(f"{live} live request(s) in its req_to_token pool")
    cached = int(tree_cache.total_size()) if tree_cache is not None else 0
    if cached:
        held.append(f"{cached} token(s) in its radix cache")
    free = sum(allocator.available_size(r) for r in range(int(getattr(allocator, "dp_size", 1))))  # each DP rank's
    used = allocator.size - free - cached
    if used > 0 and not live:
        held.append(f"{used} allocated KV slot(s)")
    if held:
        raise ValueError(
            "kvcanary cannot wrap a warm engine: it holds " + ", ".join(held) + " written before the canary, which "
            "would all be reported as corrupt; adopt them with wrap(..., live_requests=scheduler_requests(scheduler)) "
            "between steps, wrap it before it serves, or flush its cache first"
        )


def _check_engine(worker, config) -> None:
    """Refuses, by name, what the mapping does not cover."""
    if not isinstance(config, kc.CanaryConfig):
        raise TypeError(f"config must be a kvcanary_jax.CanaryConfig; got {type(config).__name__}")
    runner = getattr(worker, "model_runner", None)
    if runner is None or not callable(getattr(worker, "forward_batch_generation", None)):
        raise TypeError(
            "worker must be an sgl_jax ModelWorker or ModelWorkerClient (it has model_runner and "
            f"forward_batch_generation); got {type(worker).__name__}"
        )
    if isinstance(getattr(runner.forward, "__self__", None), SglangCanary):
        raise ValueError("this worker is wrapped already; call unwrap() on its guard first")
    model_worker = worker.worker if _is_overlap_client(worker) else worker
    args = model_worker.server_args
    problems = []
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm not in (None, "", "NONE", "none"):
        problems.append(f"speculative decoding (speculative_algorithm={algorithm!r})")
    if getattr(model_worker, "_pd_fuse_sample", False):
        problems.append("the fused Pathways forward-and-sample path (it bypasses ModelRunner.forward)")
    pool = type(runner.token_to_kv_pool).__name__
    if pool != "MHATokenToKVPool":
        problems.append(f"the KV pool {pool} (only MHATokenToKVPool's fused K/V layers are mapped; not SWA, MLA or "
                        "hybrid pools)")  # fmt: skip
    if problems:
        raise NotImplementedError("kvcanary's sglang-jax wrapper does not map " + "; ".join(problems))
    kv0 = runner.token_to_kv_pool.kv_buffer[0]
    if kv0.ndim != 5 or kv0.shape[1] != runner.page_size or math.prod(kv0.shape[2:4]) % 2:
        raise NotImplementedError(f"unexpected KV layer layout {jax.typeof(kv0)} for page_size={runner.page_size}")


def wrap(
    worker, config: kc.CanaryConfig, *, tree_cache=None, table_width: int | None = None, live_requests=None
) -> SglangCanary:
    """Puts the canary around a sglang-jax ``ModelWorker``'s forwards; returns the guard.

    From then on ``worker.forward_batch_generation`` (and so ``worker.model_runner.forward``) runs HEAD before and
    TAIL after the model, each in a jit of its own, on the engine's mesh. Fixed padding buckets keep one compile per
    bucket and mode, as for the engine.

    Args:
      worker: the ``sgl_jax`` worker the scheduler calls: a ``ModelWorker``, or the overlap scheduler's
        ``ModelWorkerClient``, before it served anything. On a parallel engine (a mesh of several devices) the guard
        is a :class:`._sglang_parallel.ParallelSglangCanary` (overlap scheduler off).
      config: the :class:`kvcanary_jax.CanaryConfig`; ``backend="auto"`` reads the engine's sharded KV in place.
      tree_cache: the scheduler's ``RadixCache``, swept every ``config.sweep_interval`` steps (None: no sweep).
      table_width: columns of the device-built page table; default the model's context length.
      live_requests: on a warm engine (one that served before the wrap), its live requests, e.g.
        :func:`scheduler_requests` of its ``Scheduler`` between steps: the records of their slots and of every slot
        ``tree_cache`` holds are adopted once (:meth:`SglangCanary.adopt`), then checked from there. None: the engine
        must be cold (nothing cached yet).

    Returns:
      The :class:`SglangCanary` guard; as a context manager it runs :meth:`SglangCanary.final_check` and unwraps on
      exit.

    Raises:
      ImportError: sglang-jax is not installed (with the command that installs it).
      TypeError: ``worker`` or ``config`` of the wrong type.
      NotImplementedError: an engine set-up the mapping does not cover, named.
      ValueError: the engine already holds requests or cached prefixes and ``live_requests`` is None
        (:func:`refuse_warm_engine`), or an entry of its tables cannot be adopted.
    """
    require_sglang_jax()
    _check_engine(worker, config)
    if table_width is not None:  # a narrower table would report every longer request as INVALID_INPUT
        context = int(worker.model_runner.model_config.context_len)
        if not isinstance(table_width, int) or isinstance(table_width, bool) or table_width < context:
            raise ValueError(
                f"table_width must be a positive int of at least the engine's longest request (model_config."
                f"context_len={context}); got table_width={table_width!r}"
            )
    from kvcanary_jax.integrations import _sglang_parallel  # it imports this module

    parallel = _sglang_parallel.is_parallel(worker)
    if parallel:
        _sglang_parallel.refuse(worker, live_requests)
    if live_requests is None:
        refuse_warm_engine(worker, tree_cache)
    if config.sweep_interval > 0 and tree_cache is None:
        raise ValueError(
            f"config.sweep_interval={config.sweep_interval} sweeps the radix cache: pass tree_cache=<the "
            "scheduler's RadixCache>, or set sweep_interval=0"
        )
    guard_class = _sglang_parallel.ParallelSglangCanary if parallel else SglangCanary
    guard = guard_class(worker, config, tree_cache=tree_cache, table_width=table_width)
    if live_requests is not None:
        guard.adopt(live_requests, worker.get_memory_pool()[0])
    return guard
