"""Shared set-ups for the runner tests: two canary configurations, each compiled once per test session.

* DEMO: the demo CLI's configuration (SWA model, K half only, every assert, sweeps). Steps are jitted by the demo's
  module-level step, so the CLI test, the soak and the fault tests share one compilation.
* TINY: a small full-pool model with K and V halves and real-KV ALL, small enough to also run eagerly.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np

from kvcanary_jax import CanaryConfig, KvCanaryViolationError, ViolationReport
from kvcanary_jax.core._state import u64_pairs_as_int64
from kvcanary_jax.demo import faults, loop

TINY_CONFIG = CanaryConfig(
    mode="raise",
    ring_capacity=32,
    real_kv_hash_mode="all",
    sweep_interval=3,
    enable_write_input_assert=True,
    enable_verify_token_assert=True,
    stats_every_n_steps=0,
    health_check_every_n_steps=5,
    check_lag_steps=1,
)
TINY_SCHED = {
    "num_slots": 64,
    "max_reqs": 5,
    "max_context_len": 24,
    "max_batch": 3,
    "max_tokens": 9,
    "chunk_size": 4,
    "prompt_len": (2, 12),
    "max_new_tokens": (2, 8),
    "shared_prefix_len": (2, 6),
    "spec_prob": 0.4,
    "spec_k": 3,
    "token_oracle": True,
}


def tiny_build(seed: int = 0, config: CanaryConfig = TINY_CONFIG) -> loop.DemoSetup:
    """A tiny DemoSetup (its step_fn is the demo's shared jit; tests swap in ``TINY_STEP``)."""
    return loop.build_demo(seed, False, canary_config=config, page_size=4, **TINY_SCHED)


_TEMPLATE = tiny_build()
TINY_CANARY, TINY_LAYOUT = _TEMPLATE.canary, _TEMPLATE.layout


@chex.assert_max_traces(n=1)
def _tiny_step(params, kv_cache, canary_state, batch):
    return loop.demo_step(TINY_CANARY, TINY_LAYOUT, params, kv_cache, canary_state, batch)


TINY_STEP = jax.jit(_tiny_step, donate_argnums=(1, 2))


def _eager(fn):
    def run(*args):
        # Op by op: loops run as Python loops instead of compiling a fresh while-loop on every call.
        with jax.disable_jit():
            return fn(TINY_CANARY, TINY_LAYOUT, *args)

    return run


def tiny_setup(seed: int = 0, *, eager: bool = False) -> loop.DemoSetup:
    """A tiny DemoSetup whose step is jitted once per session (chex-asserted), or whose step and sweep run eagerly."""
    setup = tiny_build(seed)
    if eager:
        sweep = lambda canary, layout, state, plan, kv: canary.sweep(state, plan, loop.kv_sources(canary, layout, kv))  # noqa: E731
        return dataclasses.replace(setup, step_fn=_eager(loop.demo_step), sweep_fn=_eager(sweep))
    return dataclasses.replace(setup, step_fn=TINY_STEP)


def demo_setup(seed: int = 0) -> loop.DemoSetup:
    """The demo CLI's configuration; all such setups share one compiled step."""
    return loop.build_demo(seed, canary_config=faults.DEMO_CONFIG, **faults.DEMO_BUILD)


def run_steps(setup: loop.DemoSetup, n: int, *, keep_going: bool = False, **hooks) -> None:
    """Runs ``n`` steps; with ``keep_going`` a raise-mode violation is recorded by the monitor and the run goes on."""
    for _ in range(n):
        try:
            setup.step(**hooks)
        except KvCanaryViolationError:
            if not keep_going:
                raise


def finish(setup: loop.DemoSetup) -> ViolationReport:
    """The monitor's blocking final check; in raise mode the raised report is returned instead."""
    try:
        return setup.monitor.final_check(setup.canary_state)
    except KvCanaryViolationError as error:
        return error.report


def violation_set(setup: loop.DemoSetup) -> set[tuple]:
    """The monitor's observed violations as comparable tuples (step, tag, slot, position, bits)."""
    return {
        (o.step, int(o.violation.launch_tag), o.violation.slot_idx, o.violation.position, int(o.violation.fail_reason))
        for o in setup.monitor.observed
    }


def counters(setup: loop.DemoSetup) -> np.ndarray:
    """int64[12] kernel-run counters of the setup's canary state (a sync)."""
    return u64_pairs_as_int64(setup.canary_state.device.kernel_run_counters)
