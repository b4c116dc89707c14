"""``python -m kvcanary_jax serve sglang-jax <launch_server args> [--canary-*]``: sglang-jax's server, canary on.

Every argument not ``--canary-*`` goes to sglang-jax's own ``ServerArgs`` parser unchanged. The engine runs its
scheduler in a spawned process (a patch made here would not reach it), so the engine is told to start
:func:`run_scheduler_process` of this module instead of its own: it installs a subclass of the engine's ``Scheduler``
that wraps its worker when it is built, in the child, then runs the engine's. ``--enable-single-process`` runs the
same class in this process. The scheduler's own loop then drives the guard: ``run_batch`` feeds the requests (the
token oracle), the step's end runs after the forward.

A violation is logged as ``kvcanary violation: rid=... slot=... step=...``. In ``raise`` mode the scheduler then
signals this process, which stops the engine (in-flight requests see their connection close) and exits with
:data:`EXIT_VIOLATION`; the violation line is the last line logged.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

import numpy as np

from kvcanary_jax.integrations import sglang_cpu, sglang_drills, sglang_jax, sglang_metrics, sglang_native_swa
from kvcanary_jax.integrations.sglang_serve_args import ServeSettings, refuse_unmapped, split_args

logger = logging.getLogger("kvcanary_jax.serve")
ENV = "KVCANARY_SERVE"  # the settings, from this process to the scheduler's
EXIT_VIOLATION = 3
_STOP_SIGNAL = signal.SIGUSR2


# --- inside the scheduler's process --------------------------------------------------------------------------------

_SWEPT_TREES = ("RadixCache", "SWARadixCache")  # the trees the sweep walks (the same nodes: children, value)


def attach(scheduler, settings: ServeSettings) -> sglang_jax.SglangCanary | None:
    """Wraps the scheduler's worker and hooks its ``run_batch``; the scheduler's loop drives the guard from then on."""
    if settings.mode == "off":
        return None
    if getattr(scheduler, "pd", None):
        raise NotImplementedError("kvcanary serve does not map the Pathways PD workers")
    tree_cache = scheduler.tree_cache if settings.sweep_interval else None
    if tree_cache is not None and type(tree_cache).__name__ not in _SWEPT_TREES:
        raise NotImplementedError(f"kvcanary's sweep maps the {' and '.join(_SWEPT_TREES)} only; got "
                                  f"{type(tree_cache).__name__} (run with --canary-sweep-interval 0)")  # fmt: skip
    guard = sglang_jax.wrap(scheduler.tp_worker, settings.config(), tree_cache=tree_cache)
    if getattr(scheduler.tree_cache, "hicache_enabled", False):  # records travel with the host pages
        from kvcanary_jax.integrations import sglang_hicache

        sglang_hicache.carry_records(guard, scheduler.tree_cache)
    metrics = None
    if scheduler.server_args.enable_metrics:
        from kvcanary_jax.integrations.sglang_metrics import CanaryMetrics

        metrics = CanaryMetrics()
    guard.monitor.log = _AtDebug(logging.getLogger("kvcanary_jax.monitor"), {})  # raw rows; the reporter names them
    started = time.monotonic()
    programs = guard.precompile()
    logger.info("kvcanary precompiled %d programs in %.1f s (every batch and token bucket, plans %s)", programs,
                time.monotonic() - started, "/".join(map(str, sglang_jax.capacity_ladder(guard.max_verify))))  # fmt: skip
    reporter = _Reporter(settings, metrics, compiled=guard.compiled_programs())
    guard.on_step_end = reporter
    _Lifeline(guard, reporter).start(scheduler)
    drill = None
    if settings.inject:
        drill = sglang_drills.Drill(sglang_drills.DrillSpec.parse(settings.inject, settings.inject_seed), scheduler)
        guard.on_enqueue = drill.on_enqueue
        logger.warning("!" * 100)
        logger.warning("kvcanary DRILL ON: %s will corrupt this engine's state on purpose (--canary-inject). NOT FOR "
                       "PRODUCTION TRAFFIC.", settings.inject)  # fmt: skip
        logger.warning("!" * 100)
    run_batch = scheduler.run_batch

    def run_batch_with_canary(batch):
        guard.expect(batch)
        undo = drill.before_run_batch(batch) if drill else None
        try:
            result = run_batch(batch)
        finally:
            if undo is not None:
                undo()
        if not guard.overlap:
            guard.after_step()
        return result

    scheduler.run_batch = run_batch_with_canary
    logger.info("kvcanary on: mode=%s real_kv=%s sweep_interval=%d token_asserts=%s overlap=%s page_size=%d",
                settings.mode, settings.real_kv, settings.sweep_interval, settings.token_asserts, guard.overlap,
                guard.layout.page_size)  # fmt: skip
    return guard


class _AtDebug(logging.LoggerAdapter):
    """The monitor's own messages (SGLang's raw lines) at DEBUG: the reporter logs one line per incident."""

    def warning(self, msg, *args, **kwargs):
        self.debug(msg, *args, **kwargs)


class _Reporter:
    """The guard's step end: one ERROR line per slot and reason a request (its rid) or a cached prefix shows, every row
    at DEBUG (a slot re-reported every step is counted, not logged again), the counters; a raise-mode stop; the
    summary line at shutdown."""

    def __init__(self, settings: ServeSettings, metrics, *, compiled: dict[str, int]):
        self.settings, self.metrics, self.compiled = settings, metrics, compiled
        self.named: set = set()  # (request or prefix, slot, reason) already logged
        self.repeats = 0  # rows not logged again (the same request, slot and reason)
        self.dropped = 0  # rows a full ring lost, as last reported

    def __call__(self, guard, observed: list) -> None:
        if self.metrics is not None:
            self.metrics.count_violations(observed, total=guard.monitor.total_violations)
            self.metrics.after_step(guard.state)
        for o in observed:
            v = o.violation
            who = guard.rid_of(o)
            where = f"rid={who}" if who is not None else f"prefix={cached_prefix(guard, v)}"
            logger.debug("kvcanary row: %s slot=%s step=%s launch=%s reason=%s position=%s", where, v.slot_idx,
                         o.user_step, v.tag_label, "+".join(v.reason_labels), v.position)  # fmt: skip
            key = (where, v.slot_idx, int(v.fail_reason))  # a slot re-reported every step is one line
            if key in self.named:
                self.repeats += 1
                continue
            self.named.add(key)
            logger.error("kvcanary violation: %s slot=%s step=%s launch=%s reason=%s position=%s", where, v.slot_idx,
                         o.user_step, v.tag_label, "+".join(v.reason_labels), v.position)  # fmt: skip
        dropped = guard.monitor.dropped_violations
        if dropped > self.dropped:  # the monitor's own line is at DEBUG here: say it where operators look
            logger.warning("kvcanary: %d violation(s) had no ring row to read (the ring filled between two reads); "
                           "%d in all", dropped - self.dropped, dropped)  # fmt: skip
            self.dropped = dropped
        if observed and self.settings.mode == "raise":
            _stop(self.settings.server_pid)

    def summary(self, guard) -> str:
        """One line: what the canary saw and did since startup."""
        d = guard.state.device
        protected, checks = (sglang_metrics.u64_total(x) for x in (d.slot_run_counters, d.kernel_run_counters))
        grown = {k: v - self.compiled[k] for k, v in guard.compiled_programs().items() if v > self.compiled[k]}
        compiles = f"{sum(grown.values())}" + (f" ({', '.join(map(str, grown.items()))})" if grown else "")
        monitor = guard.monitor
        return (f"kvcanary summary: violations={monitor.total_violations} incidents={len(monitor.incidents.incidents)} "
                f"repeats_folded={self.repeats} dropped={monitor.dropped_violations} "
                f"protected_tokens={protected} checks={checks} steps={guard.steps} "
                f"compiles_while_serving={compiles}")  # fmt: skip


def cached_prefix(guard, v) -> str:
    """The radix-cache prefix holding a swept slot, as ``<depth> tokens ...<last tokens>`` (or why it is unknown)."""
    tree = guard.tree_cache
    if tree is None:
        return "none"
    stack = [(tree.root_node, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            if child.value is None:
                continue
            slots = np.asarray(child.value).reshape(-1)
            key = list(getattr(child.key, "token_ids", child.key) or [])
            hit = np.nonzero(slots == v.slot_idx)[0]
            if hit.size:
                tokens = path + key[: int(hit[0]) + 1]
                return f"{len(tokens)}tok:...{','.join(map(str, tokens[-4:]))}"
            stack.append((child, path + key))
    return "evicted"


class _Lifeline:
    """Reads what the lagged check has not, when nothing else will: within a second of the server going idle (from
    the scheduler's own ``on_idle``, on its thread, when no forward is in flight), and at SIGINT / SIGTERM / exit,
    followed by the summary line. Runs in the scheduler's process."""

    IDLE_S = 0.5

    def __init__(self, guard, reporter: _Reporter):
        self.guard, self.reporter = guard, reporter
        self._done = threading.Event()
        self._closing = threading.Lock()  # one shutdown; a second caller waits for it to finish
        self._exiting = False

    def start(self, scheduler) -> None:
        on_idle = scheduler.on_idle

        def on_idle_with_canary():
            on_idle()
            if self.guard.unread_steps and self.guard.idle_s >= self.IDLE_S and not self._done.is_set():
                self.guard.flush()

        scheduler.on_idle = on_idle_with_canary
        _LIFELINES.append(self)
        atexit.register(self.shutdown)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # Not here: the signal may have stopped this thread inside a forward. A thread waits for it, then exits. A
        # second signal (Ctrl-C reaches every process of the group, then the server asks its children to stop) does
        # not cut the first one's reading short.
        if not self._exiting:
            self._exiting = True
            threading.Thread(target=self._exit, args=(128 + signum,), daemon=True).start()

    def _exit(self, code: int) -> None:
        self.shutdown()
        os._exit(code)

    def shutdown(self) -> None:
        """Reads every pending check and logs the summary line, once (a concurrent caller waits for it)."""
        with self._closing:
            if self._done.is_set():
                return
            self._done.set()
            try:
                self.guard.flush()
            except Exception:
                logger.exception("kvcanary final read failed")
            logger.info(self.reporter.summary(self.guard))
            for handler in logging.getLogger().handlers + logger.handlers:
                handler.flush()


_LIFELINES: list[_Lifeline] = []  # this process's guards (the server's own with --enable-single-process)


def _stop(server_pid: int) -> None:
    """Raise mode: flushes the logs, signals the server process to stop the engine, and never returns."""
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    os.kill(server_pid or os.getppid(), _STOP_SIGNAL)
    threading.Event().wait()  # the server kills this process


def _scheduler_class(base):
    class CanaryScheduler(base):
        """The engine's ``Scheduler`` with the canary attached when it is built (before it reports ready)."""

        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            self.kvcanary = attach(self, ServeSettings(**json.loads(os.environ[ENV])))

    return CanaryScheduler


def install_in_this_process() -> None:
    """Makes the engine build :class:`CanaryScheduler` wherever it builds its ``Scheduler`` in this process."""
    from sgl_jax.srt.managers import scheduler as scheduler_module

    if not getattr(scheduler_module.Scheduler, "_kvcanary", False):
        cls = _scheduler_class(scheduler_module.Scheduler)
        cls._kvcanary = True
        scheduler_module.Scheduler = cls


def install_engine_patches(settings: ServeSettings, device: str) -> None:
    """The engine's own gaps filled in this process, canary on or off (so ``--canary-mode off`` is the same engine):
    on CPU, MLA and hybrid-linear models (:mod:`.sglang_cpu`); with ``--canary-native-swa``, SWA pools on the native
    attention (:mod:`.sglang_native_swa`)."""
    sglang_cpu.install(device)
    if settings.native_swa:
        sglang_native_swa.install()


def run_scheduler_process(server_args, *args, **kwargs):
    """The spawned scheduler's target (picklable by name): the engine's patches and the canary installed, then the
    engine's own target."""
    from sgl_jax.srt.managers import scheduler as scheduler_module

    settings = ServeSettings(**json.loads(os.environ[ENV]))
    install_engine_patches(settings, server_args.device)
    if settings.mode != "off":
        install_in_this_process()
    return scheduler_module.run_scheduler_process(server_args, *args, **kwargs)


# --- the server process ---------------------------------------------------------------------------------------------


def _on_stop(signum, frame) -> None:
    from sgl_jax.srt.utils import kill_process_tree

    kill_process_tree(os.getpid(), include_parent=False)
    os._exit(EXIT_VIOLATION)


def main(argv: list[str]) -> int:
    """Parses, refuses what is unmapped, then runs sglang-jax's ``launch_server`` with the canary in its scheduler."""
    try:
        settings, rest = split_args(argv)
    except ValueError as err:
        print(f"kvcanary serve: {err}", file=sys.stderr)
        return 2
    try:
        sglang_jax.require_sglang_jax()
    except ImportError as err:
        print(f"kvcanary serve: {err}", file=sys.stderr)
        return 1
    from sgl_jax.srt.entrypoints import engine, http_server
    from sgl_jax.srt.server_args import ServerArgs
    from sgl_jax.srt.utils import kill_process_tree

    server_args = ServerArgs.from_cli(rest)
    try:
        refuse_unmapped(server_args)
    except NotImplementedError as err:
        print(f"kvcanary serve: {err}", file=sys.stderr)
        return 2
    os.environ[ENV] = json.dumps(dataclasses.asdict(settings))
    install_engine_patches(settings, server_args.device)  # --enable-single-process runs the model here
    engine.run_scheduler_process = run_scheduler_process  # the spawned child's target
    if settings.mode != "off":
        install_in_this_process()  # --enable-single-process builds the scheduler here
        signal.signal(_STOP_SIGNAL, _on_stop)
    try:
        http_server.launch(server_args)
    finally:
        for lifeline in _LIFELINES:  # --enable-single-process: the guard lives here
            lifeline.shutdown()
        _stop_children()
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


def _stop_children(timeout_s: float = 30.0) -> None:
    """Asks the engine's processes to stop (SIGTERM: the scheduler's canary reads its pending checks and logs its
    summary first), and waits for them a while before they are killed."""
    import psutil

    def spawned(p) -> bool:  # the engine's own processes (the resource tracker ignores SIGTERM: it is killed after)
        with contextlib.suppress(psutil.Error):
            return "resource_tracker" not in " ".join(p.cmdline())
        return False

    children = [p for p in psutil.Process().children(recursive=True) if spawned(p)]
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGTERM)
    psutil.wait_procs(children, timeout=timeout_s)
