"""The canary around one sglang-jax worker (:class:`SglangCanary`): HEAD before and TAIL after every forward."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax.integrations import _sglang_adopt
from kvcanary_jax.integrations._sglang_launches import _LAUNCHES, _head, _sweep, _tail
from kvcanary_jax.integrations._sglang_mapping import (
    Layout,
    Shapes,
    capacity_ladder,
    host_fields,
    padded_oracle,
    radix_entries,
    sized_capacity,
    token_oracle,
    verify_need,
)
from kvcanary_jax.integrations._sglang_pools import pool_view
from kvcanary_jax.integrations._sglang_steps import steps_for

_MAPPED_MODES = ("EXTEND", "MIXED", "DECODE")
_KEEP_REQUESTS = 64  # steps whose batch requests are kept for report lookups


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
      view: the :class:`PoolView` of the engine's KV pool (which slots each canary group covers, what real KV it reads).
      steps: forwards run so far (the step number reports use).
      enqueued: batches handed to the worker so far (under the overlap scheduler, ahead of ``steps``): the step
        number the next batch's forward will have.
      overlap: the worker is the overlap scheduler's ``ModelWorkerClient`` (the step's end runs on its thread).
      on_enqueue: ``f(guard, model_worker_batch, pending)`` on the scheduler's thread as each batch goes to the worker.
      on_step_end: ``f(guard, new_observed)`` after each monitor check, before a violation is raised.
    """

    def __init__(self, worker, config: kc.CanaryConfig, *, tree_cache=None, table_width: int | None = None):
        self._steps = steps_for(worker)  # where a step begins and ends: the plain worker's or the overlap client's
        self.overlap = self._steps.overlap
        self.worker, self.runner, self.config, self.tree_cache = worker, worker.model_runner, config, tree_cache
        self.model_worker = self._steps.model_worker
        self.view = pool_view(self.runner)
        page_size = self.view.page_size
        width = int(table_width or self.runner.model_config.context_len)
        self.layout = Layout(page_size=page_size, table_width=-(-width // page_size) * page_size)
        self.shapes = Shapes.of(worker)
        self.max_bs = self.shapes.rows
        self.max_verify = self.shapes.cache_loc  # a forward verifies at most the slots attention reads
        self.lock = threading.RLock()  # held by each step (launches and check), a sweep, a flush
        self._build(max_verify=self.max_verify)
        self._sized: dict[int, kc.KvCanary] = {}  # verify capacity -> the canary with plans of that size
        self.steps = 0
        self.on_enqueue: Callable | None = None
        self.on_step_end: Callable | None = None
        self.enqueued = 0
        self._reported = 0  # monitor.observed rows handed to on_step_end
        self._reqs = None
        self._current: Pending | None = None
        self._current_bid = None
        self._snapshot = (None, None)  # (a state, the monitor's snapshot of it) from the latest launch
        self._last_step_end = -math.inf
        self._requests = collections.OrderedDict()  # step -> rids by batch row
        self._forward = self.runner.forward
        self._forward_batch_generation = self.model_worker.forward_batch_generation
        self.runner.forward = self.forward
        self.model_worker.forward_batch_generation = self._generate
        self._steps.install(self)

    def _build(self, *, max_verify: int) -> None:
        """The canary (its pool: every slot of the engine's KV pool), its monitor and its state."""
        token_pool = {}
        if self.config.enable_verify_token_assert:
            token_pool = dict(max_reqs=self.max_bs, max_context_len=self.layout.table_width)
        # A forward verifies at most the slots attention reads: the largest cache_loc bucket.
        pool = self.view.canary_pool(max_rows=self.max_bs, verify_capacity=max_verify, **token_pool)
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
        self._steps.after_step(self)

    def sweep(self, entries: kc.SweepEntries | None = None) -> None:
        """Verifies every slot the radix cache holds now, or ``entries`` (the step's end runs it when due)."""
        if entries is None and self.tree_cache is None:
            raise ValueError("sweep needs the engine's RadixCache: wrap(worker, config, tree_cache=...)")
        arrays = self.pool_arrays()  # the SWA group's slots through the full->SWA table as it stands now
        plan = self.view.sweep_plan(self.canary, radix_entries(self.tree_cache) if entries is None else entries, arrays)
        self._run("sweep", plan, arrays)

    def adopt(self, reqs, req_to_token_pool) -> int:
        """Writes the records of the slots the engine cached before the wrap (see :mod:`._sglang_adopt`)."""
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
        self._steps.uninstall(self)

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
        pending.sweep = self._steps.sweep_entries(self)
        self.enqueued += 1
        if self.on_enqueue is not None:
            self.on_enqueue(self, model_worker_batch, pending)  # a drill may change the batch: copy it after
        pending.fields = self._host_fields(model_worker_batch, is_decode=is_decode)
        return pending

    def _generate(self, model_worker_batch, *args, **kwargs):
        """``ModelWorker.forward_batch_generation`` (the forward's thread), with the batch's Pending."""
        self._current = self._steps.pending_for(self, model_worker_batch)
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
        self._run("head", fields, pending.oracle, self.pool_arrays(), **static)
        out = self._forward(forward_batch, logits_metadata, *args, **kwargs)
        self._run("tail", fields, pending.oracle, self.pool_arrays(), **static)  # the forward donated the pools
        if self.steps == 0:  # warm-up over: the write-time chain-position assert turns on
            self._mark_init_finished()
        self._requests[self.steps] = pending.rids
        while len(self._requests) > _KEEP_REQUESTS:
            self._requests.popitem(last=False)
        self.steps += 1
        self._steps.end_forward(self, pending)
        return out

    def _check(self) -> None:
        """The monitor's lagged check, then the ring re-armed (the rows read dropped); new reports go to
        ``on_step_end`` first (also when the check raises)."""
        with self.lock:
            try:
                state, snapshot = self._snapshot
                if state is self.state:  # the latest launch's snapshot, as no mark_init_finished or adopt came since
                    self.monitor.after_step(self.state, step=self.steps - 1, snapshot=snapshot)
                else:  # the monitor takes its own (the parallel guard's launches return none)
                    self.monitor.after_step(self.state, step=self.steps - 1)
                self._rearm()
            finally:
                self._last_step_end = time.monotonic()
                self._hand_over()

    def _hand_over(self) -> None:
        """Gives ``on_step_end`` the reports it has not seen (the lock held). A guard with an ``on_step_end`` hands
        them over for good: ``monitor.observed`` is emptied, so a server that runs for days keeps no rows."""
        new = self.monitor.observed[self._reported :]
        if self.on_step_end is None:
            self._reported = len(self.monitor.observed)
            return
        self.monitor.observed.clear()
        self._reported = 0
        self.on_step_end(self, new)

    def _rearm(self) -> None:
        """Drops the ring rows the monitor has read, so the ring never stays full (a no-op when none was read)."""
        with jax.set_mesh(self.runner.mesh):
            self.state = self.monitor.rearm(self.state)

    def flush(self) -> kc.ViolationReport:
        """Blocking: reads every check still pending (the last ``check_lag_steps`` steps), re-arms the ring and hands
        new reports to ``on_step_end``; for an idle server and at shutdown. Safe from any thread (it waits for a
        running step)."""
        with self.lock:
            try:
                report = self.monitor.flush(self.state)
                self._rearm()
                return report
            finally:
                self._hand_over()

    @property
    def unread_steps(self) -> int:
        """Steps whose check has not been read yet (they are read ``check_lag_steps`` steps later, or by flush)."""
        return self.monitor.unchecked_steps

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

    def pool_arrays(self) -> dict[str, jax.Array]:
        """The engine's KV arrays the launches read, as they stand now (:meth:`PoolView.arrays`)."""
        return self.view.arrays(self.runner.token_to_kv_pool)

    def _run(self, launch: str, *args, capacity: int | None = None, **static) -> None:
        """Runs the ``head``, ``tail`` or ``sweep`` jit on the state, on the engine's mesh, with plans of
        ``capacity`` entries."""
        with self.lock, jax.set_mesh(self.runner.mesh):
            canary = self._sized_canary(capacity)
            self.state, snapshot = _LAUNCHES[launch](self.state, *args, canary=canary, view=self.view, **static)
            self._snapshot = (self.state, snapshot)

    def _host_fields(self, model_worker_batch, *, is_decode: bool) -> dict:
        """The batch's arrays for the launches, copied on the scheduler's thread: :func:`host_fields`."""
        return host_fields(model_worker_batch, self.shapes, is_decode=is_decode)

    def _launch_fields(self, pending: Pending, forward_batch) -> dict:
        """The arrays HEAD and TAIL map: the copied host fields, and under the overlap scheduler the future-token
        map this batch's placeholders resolve with (read on the forward's thread)."""
        return {**pending.fields, **self._steps.launch_extras()}

    def compiled_programs(self) -> dict[str, int]:
        """How many programs each of the guard's launches holds compiled (to show that serving compiles none)."""
        return {name: fn._cache_size() for name, fn in _LAUNCHES.items()}

    def precompile(self) -> int:
        """Compiles, before anything serves, every HEAD and TAIL program a forward can need: each kind (DECODE,
        EXTEND / MIXED) at each plan size of :func:`capacity_ladder`, and the sweep. They run on scratch states with
        an all-padding batch: no record is written, no violation can come of it. The HEAD / TAIL pairs compile side by
        side, one thread each (up to the host's cores): compiling releases the GIL. Returns the programs compiled."""
        before = sum(self.compiled_programs().values())
        arrays = self.pool_arrays()
        jobs = [(is_decode, self._sized_canary(capacity))
                for is_decode in (True, False) for capacity in capacity_ladder(self.max_verify)]  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            scratch = list(pool.map(lambda job: self._precompile_pair(*job, arrays), jobs))[-1]
        if self.tree_cache is not None and self.config.sweep_interval > 0:
            plan = self.view.sweep_plan(self.canary, kc.SweepEntries.empty(), arrays)
            # after a TAIL (a launch's output) and after the first step's mark_init_finished (the state re-placed)
            for state in (scratch, self._on_mesh(self.canary.init_state())):
                with jax.set_mesh(self.runner.mesh):
                    scratch, _ = _sweep(state, plan, arrays, canary=self.canary, view=self.view)
        jax.block_until_ready(self.canary.mark_init_finished(scratch))
        return sum(self.compiled_programs().values()) - before

    def _precompile_pair(self, is_decode: bool, canary: kc.KvCanary, arrays: dict):
        """HEAD then TAIL of one kind and plan size on a scratch state (a thread of :meth:`precompile`)."""
        write, verify = self.config.enable_write_input_assert, self.config.enable_verify_token_assert
        fields, oracle = self._empty_batch(is_decode, write=write, verify=verify)
        fields.update(self._steps.launch_extras())
        static = dict(canary=canary, view=self.view, layout=self.layout, is_decode=is_decode)
        with jax.set_mesh(self.runner.mesh):
            scratch, _ = _head(self._on_mesh(self.canary.init_state()), fields, oracle, arrays, **static)
            scratch, _ = _tail(scratch, fields, oracle, arrays, **static)
        return jax.block_until_ready(scratch)

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
