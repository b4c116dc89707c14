"""Fault runs on the demo: inject one fault into a running decode loop and record which launch caught it, when."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcanary_jax import CanaryConfig, KvCanaryViolationError, PoolKind, testing
from kvcanary_jax.demo import batch as batch_lib
from kvcanary_jax.demo import loop
from kvcanary_jax.testing import FaultKind

# Every fault kind on every group it applies to, in the order the demo and the tests run them.
FAULT_RUNS = [
    (FaultKind.LIVE_KV, PoolKind.FULL),
    (FaultKind.LIVE_KV, PoolKind.SWA),
    (FaultKind.REQ_TO_TOKEN, PoolKind.FULL),
    (FaultKind.IDLE_CACHE_KV, PoolKind.FULL),
    (FaultKind.IDLE_CACHE_KV, PoolKind.SWA),
    (FaultKind.POST_FORWARD_KV, PoolKind.FULL),
    (FaultKind.POST_FORWARD_KV, PoolKind.SWA),
    (FaultKind.TOKEN_SWAP, PoolKind.FULL),
]

# The demo's canary: everything on, as in SGLang's CI lane (raise mode, token oracle, asserts, sweeps).
DEMO_CONFIG = CanaryConfig(
    mode="raise",
    ring_capacity=64,
    real_kv_hash_mode="partial",
    sweep_interval=4,
    enable_write_input_assert=True,
    enable_verify_token_assert=True,
    stats_every_n_steps=50,
    health_check_every_n_steps=20,
    check_lag_steps=2,
)
DEMO_BUILD = {"swa": True, "with_v": False, "spec_prob": 0.3, "token_oracle": True}


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One demo run: a clean run (``fault == "none"``) or one injected fault, and what the canary reported first.

    Steps are 1-based monitor steps. ``detected_step`` is the step whose launch wrote the first violation (the host
    reads it ``check_lag_steps`` later, at ``observed_step``).
    """

    fault: str
    group: str
    steps: int
    injected_step: int | None
    detected_step: int | None
    observed_step: int | None
    launch_tag: str | None
    fail_reason: str | None
    ok: bool
    note: str = ""
    headline: str | None = None  # the first incident's headline, as the monitor raised it


def _layer(setup: loop.DemoSetup, group: PoolKind) -> int:
    swa = setup.layout.swa_layers
    return swa[0] if group is PoolKind.SWA else next(i for i in range(setup.layout.num_layers) if i not in swa)


def _flip(setup: loop.DemoSetup, group: PoolKind, slot: int) -> None:
    """Flips byte 0 of ``slot``'s K row in the group's real-KV layer (outside the jitted step, after compilation)."""
    layer = _layer(setup, group)
    k = list(setup.kv_cache.k)
    k[layer] = testing.flip_kv_byte(k[layer], np.int32(slot), page_size=setup.layout.page_size)
    setup.kv_cache = dataclasses.replace(setup.kv_cache, k=tuple(k))


def _running_by_row(setup: loop.DemoSetup) -> dict[int, Any]:
    return {r.pool_row: r for r in setup.scheduler.running}


class Injector:
    """Step hooks that inject ``kind`` once, at the first step at or after ``at_step`` that offers a target.

    Pass ``**injector.hooks`` to :meth:`DemoSetup.step`; ``injected_step`` is set once the fault is in.
    """

    def __init__(self, kind: FaultKind, group: PoolKind, at_step: int, rng: np.random.Generator):
        self.kind, self.group, self.at_step, self.rng = kind, group, at_step, rng
        self.injected_step: int | None = None

    @property
    def hooks(self) -> dict[str, Callable]:
        return {"before_forward": self.before_forward, "after_commit": self.after_commit}

    def _due(self, setup: loop.DemoSetup) -> bool:
        return self.injected_step is None and setup.monitor.step + 1 >= self.at_step

    def _done(self, setup: loop.DemoSetup) -> None:
        self.injected_step = setup.monitor.step + 1

    def _lut(self, setup: loop.DemoSetup) -> np.ndarray | None:
        """The live full->SWA table when the SWA group is targeted (it changes at commit as windows slide)."""
        return setup.scheduler.full_to_swa_index_mapping if self.group is PoolKind.SWA else None

    def before_forward(self, setup: loop.DemoSetup, batch: batch_lib.StepBatch) -> batch_lib.StepBatch | None:
        if not self._due(setup):
            return None
        view = batch.canary()
        if self.kind is FaultKind.LIVE_KV:
            window = setup.sched_config.swa_window if self.group is PoolKind.SWA else 0
            slot = testing.choose_live_slot(view, self.rng, window=window, lut=self._lut(setup))
            if slot is not None:
                _flip(setup, self.group, slot)
                self._done(setup)
        elif self.kind is FaultKind.REQ_TO_TOKEN:
            if (target := testing.choose_remap(view, self.rng)) is not None:
                self._done(setup)
                return dataclasses.replace(batch, req_to_token=testing.remap_slot(batch.req_to_token, *target))
        elif self.kind is FaultKind.TOKEN_SWAP:
            running = _running_by_row(setup)
            decode_rows = [
                r for r, row in enumerate(batch.req_pool_indices) if row and not running[int(row)].in_prefill
            ]
            if (pair := testing.choose_token_swap(view, self.rng, rows=decode_rows)) is not None:
                self._done(setup)
                return dataclasses.replace(batch, input_ids=testing.swap_tokens(batch.input_ids, *pair))
        return None

    def after_commit(self, setup: loop.DemoSetup, batch: batch_lib.StepBatch) -> None:
        if not self._due(setup):
            return
        lut = self._lut(setup)
        if self.kind is FaultKind.POST_FORWARD_KV:
            # The first token of a row is always kept; a request still running and decoding is in the next batch.
            running = _running_by_row(setup)
            starts = testing.row_starts(batch.canary())
            slots = [
                int(batch.out_cache_loc[starts[r]])
                for r, row in enumerate(batch.req_pool_indices)
                if row and int(row) in running and not running[int(row)].in_prefill
            ]
            slots = [int(lut[s]) if lut is not None else s for s in slots]
            if slots:
                _flip(setup, self.group, slots[self.rng.integers(len(slots))])
                self._done(setup)
        elif self.kind is FaultKind.IDLE_CACHE_KV and setup.monitor.sweep_due:
            idle = setup.scheduler.sweep_entries(unlocked_only=True).slots
            if lut is not None:
                idle = lut[idle][lut[idle] != 0]
            if len(idle):
                _flip(setup, self.group, int(self.rng.choice(idle)))
                self._done(setup)


def run(
    fault: FaultKind | None = None,
    *,
    group: PoolKind = PoolKind.FULL,
    seed: int = 0,
    inject_at: int = 12,
    max_steps: int = 60,
    config: CanaryConfig = DEMO_CONFIG,
    build: dict[str, Any] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> RunResult:
    """Runs the demo with ``fault`` injected once (at or after step ``inject_at``), or clean when ``fault`` is None.

    A clean run lasts ``max_steps`` and must report nothing. A fault run stops once the monitor raises (raise mode)
    or after ``max_steps``; the first violation must come from the launch and with a bit that
    :func:`kvcanary_jax.testing.expected_detection` names, on time, and nothing may fire before the injection.

    Args:
      on_step: progress callback, given the step number after every step.
    """
    setup = loop.build_demo(seed, canary_config=config, **(build or DEMO_BUILD))
    rng = np.random.default_rng(seed + 1)
    injector = Injector(fault, group, inject_at, rng) if fault is not None else None
    hooks = injector.hooks if injector else {}
    note = ""
    try:
        for step in range(1, max_steps + 1):
            setup.step(**hooks)
            if step == 1:
                setup.canary_state = setup.canary.mark_init_finished(setup.canary_state)  # warm-up over
            if on_step is not None:
                on_step(step)
            if injector and injector.injected_step is not None and setup.monitor.observed:
                break
        setup.monitor.final_check(setup.canary_state)
    except KvCanaryViolationError:
        pass  # raise mode: monitor.observed holds what was read
    if setup.retraces:
        note = f"step retraced {setup.retraces} time(s) after its first step"
    first = setup.monitor.observed[0] if setup.monitor.observed else None
    injected = injector.injected_step if injector else None
    if fault is None:
        ok = first is None
        note = note or ("" if ok else "false positive in the clean run")
    elif injected is None:
        ok, note = False, note or "no target to inject into"
    elif first is None:
        ok, note = False, note or "fault went undetected"
    else:
        tag, bits, after = testing.expected_detection(fault, group)
        sweep = fault is FaultKind.IDLE_CACHE_KV
        late = first.step - injected > (config.sweep_interval if sweep else after)
        checks = {
            "fired before the injection": first.step < injected,
            f"expected {tag.name}": first.violation.launch_tag != tag,
            f"expected a bit of {bits!r}": not (first.violation.fail_reason & bits),
            "detected late": late,
        }
        problems = [k for k, bad in checks.items() if bad]
        ok, note = not problems and not note, note or "; ".join(problems)
    return RunResult(
        fault="none" if fault is None else fault.value,
        group=group.name,
        steps=setup.monitor.step,
        injected_step=injected,
        detected_step=first.step if first else None,
        observed_step=first.observed_step if first else None,
        launch_tag=first.violation.tag_label if first else None,
        fail_reason="+".join(first.violation.reason_labels) if first else None,
        ok=ok,
        note=note,
        headline=setup.monitor.incidents.incidents[0].headline() if setup.monitor.incidents.incidents else None,
    )
