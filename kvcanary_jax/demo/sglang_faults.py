"""The demo's fault table over a real engine: sglang-jax's tiny Llama, wrapped by ``integrations.sglang_jax``.

``python -m kvcanary_jax demo --engine sglang-jax``. One clean run, then one fresh run per fault, each injected
into the engine's own state (its KV pool, its host page table, the batch it is about to run), and what the canary
reported first: the launch, the fail reason, the slot, the request and the step must be the injected ones.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import TextIO

import jax
import numpy as np

from kvcanary_jax import CanaryConfig, KvCanaryViolationError, testing
from kvcanary_jax.demo import cli, sglang_engine
from kvcanary_jax.demo.faults import RunResult
from kvcanary_jax.integrations import _sglang_mapping, _sglang_parallel, _sglang_pools, sglang_jax
from kvcanary_jax.testing import FaultKind

FAULTS = (FaultKind.LIVE_KV, FaultKind.REQ_TO_TOKEN, FaultKind.TOKEN_SWAP, FaultKind.IDLE_CACHE_KV)
# Everything on; the README's snippet uses this very config, so its test shares the compiled jits.
ENGINE_CONFIG = CanaryConfig(
    mode="raise",
    real_kv_hash_mode="partial",
    sweep_interval=10,
    enable_write_input_assert=True,
    enable_verify_token_assert=True,
)


@dataclasses.dataclass(frozen=True)
class Injected:
    """What a fault run changed: at forward ``step`` (0-based), the ``slot`` the canary must name, its request."""

    step: int
    slot: int
    rid: str | None
    position: int
    rank: int = 0  # the DP rank whose slot it is


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """One run on the engine and what the canary reported first (steps are 0-based forward indices)."""

    fault: str
    steps: int
    requests: int
    cached_tokens: int
    injected: Injected | None
    detected_step: int | None
    launch_tag: str | None
    fail_reason: str | None
    slot: int | None
    rid: str | None
    ok: bool
    note: str = ""
    tokens: dict = dataclasses.field(default_factory=dict, repr=False)
    reported_by: list = dataclasses.field(default_factory=list)  # devices that reported (a parallel engine), labels

    def as_row(self) -> RunResult:
        """The toy demo's row type (1-based steps), for its table."""
        one = lambda x: None if x is None else x + 1  # noqa: E731
        return RunResult(self.fault, "FULL", self.steps, one(self.injected and self.injected.step),
                         one(self.detected_step), None, self.launch_tag, self.fail_reason, self.ok, self.note)  # fmt: skip


def _flip(runner, slot: int, rank: int = 0, group: str = "full") -> None:
    """Byte 0 of DP rank ``rank``'s ``slot`` in layer 0's fused K/V array: K head 0's first byte (on the rank's first
    TP device). Keeps its sharding. ``group="swa"``: an SWA model's SWA sub-pool (``slot`` is an SWA slot)."""
    kv0 = _sglang_pools.layer_pool(runner.token_to_kv_pool, group).kv_buffer[0]
    rank_slots = kv0.shape[0] // runner.dp_size * runner.page_size  # each rank's pages, its padding page first
    _sglang_pools.flip_layer0_byte(runner.token_to_kv_pool, rank * rank_slots + slot, runner.page_size, group=group)


class _Injector:
    """Injects ``fault`` once, at the first step at or after ``at_step`` that offers a target: on the last DP rank
    that offers one (so a rank mix-up shows), its slots numbered as that rank numbers them."""

    def __init__(self, fault: FaultKind, sched: sglang_engine.MiniScheduler, at_step: int, seed: int):
        self.fault, self.sched, self.at_step = fault, sched, at_step
        self.rng = np.random.default_rng(seed + 1)
        self.injected: Injected | None = None
        self.ranks = list(reversed(range(sched.dp)))

    def _due(self, step: int) -> bool:
        return self.injected is None and step >= self.at_step

    def _decoding(self, batch, rank: int) -> list:
        """``(batch row, req)`` of rank ``rank``'s rows that decode this step, each with a cached prefix of >= 2
        tokens (rows counted within the rank's section)."""
        info = batch.reqs_info[rank]
        mixed = {id(r) for r in info.decoding_reqs or []}
        decode = batch.forward_mode.is_decode()
        return [(b, r) for b, r in enumerate(info.reqs or []) if (decode or id(r) in mixed) and len(r.output_ids) >= 2]

    def _cached(self, req) -> int:
        return len(req.origin_input_ids) + len(req.output_ids) - 1  # positions cached before this decode

    def before_batch(self, step: int, batch) -> None:
        """Faults in what the step will read: a remapped host page-table entry (to a page of the same rank)."""
        if self.fault is not FaultKind.REQ_TO_TOKEN or not self._due(step):
            return
        for rank in self.ranks:
            rows = self._decoding(batch, rank)
            if len(rows) < 2:
                continue
            table, ps = self.sched.req_to_token_pool.req_to_token, self.sched.page_size
            (_, req), (_, other) = (rows[i] for i in self.rng.choice(len(rows), 2, replace=False))
            # A page start (attention reads whole pages from their first slot) pointed at another request's page.
            # Another position (the record's POSITION then differs) and another slot.
            position = int(self.rng.integers(0, self._cached(req) - 1)) // ps * ps
            mine = table[req.req_pool_idx, position]
            sources = [q for q in range(0, self._cached(other) - 1, ps)
                       if q != position and table[other.req_pool_idx, q] != mine]  # fmt: skip
            if not sources:
                continue
            source = sources[int(self.rng.integers(len(sources)))]
            new_slot = int(table[other.req_pool_idx, source])
            table[:] = np.asarray(testing.remap_slot(table, req.req_pool_idx, position, new_slot))
            self.injected = Injected(step, new_slot, req.rid, position, rank)
            return

    def before_forward(self, step: int, batch, mwb) -> None:
        """Faults in the batch about to run, or in the live KV it reads."""
        if not self._due(step):
            return
        table = self.sched.req_to_token_pool.req_to_token
        for rank in self.ranks:
            rows = self._decoding(batch, rank)
            if self.fault is FaultKind.LIVE_KV and rows:
                held = [table[r.req_pool_idx, : self._cached(r)] for r in batch.reqs_info[rank].reqs]
                # A slot only this request holds (a shared prefix slot would be reported for whichever row reads it
                # first).
                own = [(r, p) for _, r in rows for p in range(self._cached(r))
                       if sum(int((h == table[r.req_pool_idx, p]).sum()) for h in held) == 1]  # fmt: skip
                if own:
                    req, position = own[int(self.rng.integers(len(own)))]
                    slot = int(table[req.req_pool_idx, position])
                    _flip(self.sched.runner, slot, rank)
                    self.injected = Injected(step, slot, req.rid, position, rank)
                    return
            elif self.fault is FaultKind.TOKEN_SWAP and len(rows) >= 2 and batch.forward_mode.is_decode():
                # One token per row: row b of rank r's section is entry r * per_rank + b.
                ids, base = mwb.input_ids, rank * (len(mwb.input_ids) // self.sched.dp)
                pairs = [(i, j) for i, _ in rows for j, _ in rows if i < j and ids[base + i] != ids[base + j]]
                if pairs:
                    i, j = pairs[int(self.rng.integers(len(pairs)))]
                    mwb.input_ids = np.asarray(testing.swap_tokens(ids, base + i, base + j))
                    req = batch.reqs_info[rank].reqs[i]
                    self.injected = Injected(step, int(mwb.out_cache_loc[base + i]), req.rid, self._cached(req), rank)
                    return

    def after_step(self, step: int, guard: sglang_jax.SglangCanary) -> None:
        """Faults only the sweep can see: a slot only the radix cache holds; the sweep then runs this step."""
        if self.fault is not FaultKind.IDLE_CACHE_KV or not self._due(step):
            return
        for rank in self.ranks:
            idle = _sglang_parallel.rank_entries(self.sched.tree_cache, rank, include=_sglang_mapping.unlocked)
            if len(idle.slots):
                k = int(self.rng.integers(len(idle.slots)))
                _flip(self.sched.runner, int(idle.slots[k]), rank)
                self.injected = Injected(step, int(idle.slots[k]), None, int(idle.positions[k]), rank)
                guard.sweep()
                return


def judge(first, rid: str | None, injected: Injected | None, expected, *, rank: int | None = None) -> tuple[bool, str]:
    """``(ok, note)`` for a run: clean (``expected`` None) must report nothing; a fault run's first report must carry
    the ``expected = (launch tag, reason bits)`` and name the injected step, slot and request (and, given the
    reporting device's DP ``rank``, the injected rank)."""
    if expected is None:
        return first is None, "" if first is None else "false positive in the clean run"
    if injected is None:
        return False, "no target to inject into"
    if first is None:
        return False, "fault went undetected"
    tag, bits = expected
    v = first.violation
    problems = {
        f"expected {tag.name}": v.launch_tag != tag,
        f"expected a bit of {bits!r}": not (v.fail_reason & bits),
        f"expected step {injected.step}": first.user_step != injected.step,
        f"expected slot {injected.slot}": v.slot_idx != injected.slot,
        f"expected request {injected.rid}": rid != injected.rid,
        f"expected DP rank {injected.rank}": rank is not None and rank != injected.rank,
    }
    note = "; ".join(k for k, bad in problems.items() if bad)
    return not note, note


def run(
    worker, fault: FaultKind | None = None, *, config: CanaryConfig = ENGINE_CONFIG, seed: int = 0,
    inject_at: int = 12, num_requests: int = 16, max_steps: int = 200, spread: int | None = None,
) -> EngineRun:  # fmt: skip
    """Runs the workload on ``worker`` wrapped by the canary, clean or with ``fault`` injected once.

    A clean run goes to the end of the workload and must report nothing; a fault run stops at the first report
    (raise mode) and must name the injected slot, its request and DP rank, the expected launch and bit, in the
    injection step. ``spread``: the DP ranks the requests go to (see ``MiniScheduler``).
    """
    sched = sglang_engine.MiniScheduler(worker, sglang_engine.workload(seed, num_requests), spread=spread)
    injector = _Injector(fault, sched, inject_at, seed) if fault is not None else None
    guard = sglang_jax.wrap(worker, config, tree_cache=sched.tree_cache)
    writers: dict = {}  # slot number -> [(step, DP rank)] of its writes (DP > 1)
    try:
        for step, batch in enumerate(sched):
            if step >= max_steps:
                break
            if injector:
                injector.before_batch(step, batch)
            guard.expect(batch)
            mwb = sched.model_worker_batch(batch)
            if sched.dp > 1:
                for rank, section in enumerate(np.split(np.asarray(mwb.out_cache_loc), sched.dp)):
                    for slot in section[section > 0]:
                        writers.setdefault(int(slot), []).append((step, rank))
            if injector:
                injector.before_forward(step, batch, mwb)
            sched.run_batch(batch, mwb)
            if injector:
                injector.after_step(step, guard)
            guard.after_step()
        guard.final_check()
    except KvCanaryViolationError:
        pass  # raise mode: the monitor's observed list holds what it read
    finally:
        guard.unwrap()
    reports = guard.monitor.observed
    rid = guard.rid_of(reports[0]) if reports else None
    first, device = _where(reports[0]) if reports else (None, None)
    reported_by = sorted({guard.sharded.mesh_layout.label(o.device) for o in reports}) if device else []
    injected = injector.injected if injector else None
    defect = _cross_rank_write(writers, first, device) if fault is None and device else ""
    if defect:
        ok, note = True, defect
    else:
        expected = testing.expected_detection(fault)[:2] if fault is not None else None
        ok, note = judge(first, rid, injected, expected, rank=device[0] if device else 0)
    return EngineRun(
        fault="none" if fault is None else fault.value,
        steps=sched.step,
        requests=len(sched.finished) + len(sched.running_reqs()),
        cached_tokens=sum(r.cached_tokens for r in sched.finished),
        injected=injected,
        detected_step=first.user_step if first else None,
        launch_tag=first.violation.tag_label if first else None,
        fail_reason="+".join(first.violation.reason_labels) if first else None,
        slot=first.violation.slot_idx if first else None,
        rid=rid,
        ok=ok,
        note=note,
        tokens={r.rid: list(r.output_ids) for r in sched.finished},
        reported_by=reported_by,
    )


def _cross_rank_write(writers: dict, first, device) -> str:
    """Explains a clean run's first report as sglang-jax's DP defect on CPU, if it is one: the reported slot number
    was last written by another DP rank (its native backend's ``set_kv_buffer_legacy``, used off TPU, scatters each
    rank's rank-local slot numbers into the whole pool, so every rank writes into rank 0's pages). Else ``""``."""
    if jax.default_backend() != "cpu" or first.violation.reason_labels != ["verify_real_kv_hash"]:
        return ""
    rank, slot = device[0], first.violation.slot_idx
    before = [w for w in writers.get(slot, []) if w[0] <= first.user_step]
    if not before or before[-1][1] == rank:
        return ""
    step, other = before[-1]
    return (f"engine defect on CPU: DP rank {other} wrote its slot {slot} at step {step} into rank {rank}'s page "
            "(sglang-jax's CPU KV write ignores the DP sharding)")


def _where(report) -> tuple:
    """``(observed violation, device coordinates or None)`` of a report: a parallel engine's names its device."""
    return (report.observed, report.device) if hasattr(report, "device") else (report, None)


def run_demo(
    *, seed: int = 0, page_size: int = 1, tp: int = 1, dp: int = 1, as_json: bool = False, out: TextIO | None = None,
    **run_options,
) -> int:  # fmt: skip
    """The clean run and every fault on the tiny engine (``tp`` x ``dp`` devices: see ``sglang_engine.build_worker``);
    prints the table (or JSON). ``run_options`` go to :func:`run`. Returns 0 if all were as expected."""
    out = out or sys.stdout
    started = time.perf_counter()
    worker, _ = sglang_engine.tiny_engine(page_size, seed=seed, tp=tp, dp=dp)
    if dp > 1 and jax.default_backend() == "cpu":  # inject before the engine's own CPU writes collide across ranks
        run_options.setdefault("inject_at", 5)
    runs = [run(worker, fault, seed=seed, **run_options) for fault in (None, *FAULTS)]
    ok = all(r.ok for r in runs)
    if as_json:
        payload = {"ok": ok, "engine": "sglang-jax", "jax": jax.__version__, "page_size": page_size,
                   "mesh": dict(worker.model_runner.mesh.shape), "wall_s": round(time.perf_counter() - started, 1),
                   "runs": [dataclasses.asdict(dataclasses.replace(r, tokens={})) for r in runs]}  # fmt: skip
        out.write(json.dumps(payload, indent=2) + "\n")
        return 0 if ok else 1
    clean = runs[0]
    mesh = dict(worker.model_runner.mesh.shape)
    out.write(f"sglang-jax {worker.model_runner.model_config.hf_config.model_type} (tiny, random weights), page size "
              f"{page_size}, mesh {mesh}: clean run {clean.steps} steps, {clean.requests} requests, "
              f"{clean.cached_tokens} prompt tokens from the radix cache\n\n")  # fmt: skip
    out.write(cli.format_table([r.as_row() for r in runs]) + "\n")
    for r in runs[1:]:
        if r.injected is not None:
            where = f"request {r.injected.rid}" if r.injected.rid else "radix cache only"
            by = f" by {', '.join(r.reported_by)}" if r.reported_by else ""
            rank = f"DP rank {r.injected.rank} " if mesh["data"] > 1 else ""
            out.write(f"  {r.fault}: {rank}slot {r.injected.slot} ({where}, position {r.injected.position}); reported "
                      f"slot {r.slot}, request {r.rid}{by}\n")  # fmt: skip
    if clean.note:
        out.write(f"  clean run: {clean.note}\n")
    verdict = "all faults detected at the injected slot, request and step; no false positives" if ok else "FAILED"
    if ok and clean.note:
        verdict = "all faults detected at the injected slot, request and step; the clean run found the engine's defect"
    out.write(f"\n{verdict} ({time.perf_counter() - started:.0f} s)\n")
    return 0 if ok else 1
