"""Demo driver: builds model, pools and scheduler, and runs a jitted, donated, never-retraced decode loop."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.demo import batch as batch_lib
from kvcanary_jax.demo import model, scheduler

# SGLang-style hybrid for the SWA variant: layer 0 attends to everything, layer 1 to a sliding window.
_SWA_WINDOW = 24
_NUM_SWA_SLOTS = 256


def demo_step(
    params: model.Params, kv_cache: model.KvCache, batch: batch_lib.StepBatch
) -> tuple[jax.Array, jax.Array, model.KvCache]:
    """The jitted step: a pure function of (params, kv_cache, batch) -> (next_tokens, logits, kv_cache).

    A canary wraps it by calling its HEAD ops before `model.forward` and its TAIL ops after, in this body.
    """
    logits, kv_cache = model.forward(params, kv_cache, batch)
    next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # greedy; padding rows give token 0
    return next_tokens, logits, kv_cache


@dataclasses.dataclass
class DemoSetup:
    """Everything `run_demo_steps` drives. `step_fn` is `demo_step` jitted with the KV cache donated."""

    model_config: model.ModelConfig
    layout: model.KvCacheLayout
    sched_config: scheduler.SchedulerConfig
    params: model.Params
    kv_cache: model.KvCache
    scheduler: scheduler.Scheduler
    step_fn: Callable[..., Any]
    trace_count: list[int]  # [n]: how many times demo_step was traced


def build_demo(
    seed: int = 0,
    swa: bool = False,
    *,
    kv_dtype: Any = jnp.bfloat16,
    page_size: int = 8,
    **sched_overrides: Any,
) -> DemoSetup:
    """Builds consistent model / KV layout / scheduler configs and a jitted, donated step.

    Args:
      seed: seeds both the weights and the scheduler's workload.
      swa: use the hybrid full + sliding-window model, the SWA pool and its full->SWA LUT.
      kv_dtype: KV pool dtype (bf16 by default; float32 for exact comparisons).
      page_size: slots per page of the KV pools.
      **sched_overrides: `SchedulerConfig` fields, e.g. `spec_prob=0.3, token_oracle=True`.
    """
    swa_kw = {"swa_window": _SWA_WINDOW, "num_swa_slots": _NUM_SWA_SLOTS} if swa else {}
    sched_cfg = scheduler.SchedulerConfig(**{**swa_kw, **sched_overrides})
    model_cfg = model.ModelConfig(
        vocab_size=sched_cfg.vocab_size,
        swa_window=sched_cfg.swa_window,
        swa_layers=(1,) if swa else (),
    )
    layout = model.KvCacheLayout.for_model(
        model_cfg,
        num_slots=sched_cfg.num_slots,
        page_size=page_size,
        dtype=kv_dtype,
        num_swa_slots=sched_cfg.num_swa_slots,
    )
    trace_count = [0]

    def counted_step(params, kv_cache, batch):
        trace_count[0] += 1  # Python side effect: runs once per trace, never per cached call
        return demo_step(params, kv_cache, batch)

    return DemoSetup(
        model_config=model_cfg,
        layout=layout,
        sched_config=sched_cfg,
        params=model.init_params(model_cfg, jax.random.key(seed)),
        kv_cache=model.init_kv_cache(layout),
        scheduler=scheduler.Scheduler(sched_cfg, seed=seed),
        step_fn=jax.jit(counted_step, donate_argnums=(1,)),
        trace_count=trace_count,
    )


@dataclasses.dataclass(frozen=True)
class DemoStats:
    """What a demo run did; `scheduler` holds the scheduler's counters (prefix hits, evictions, ...)."""

    steps: int
    traces: int
    reused_slots: int  # slots handed out more than once
    wall_s: float
    scheduler: dict[str, int]


def run_demo_steps(
    num_steps: int,
    seed: int = 0,
    swa: bool = False,
    *,
    setup: DemoSetup | None = None,
    on_step: Callable[[batch_lib.StepBatch, jax.Array], None] | None = None,
    **build_kwargs: Any,
) -> DemoStats:
    """Runs `num_steps` scheduler + model steps and checks the step compiled exactly once.

    Args:
      num_steps: steps to run.
      seed, swa, **build_kwargs: passed to `build_demo` (ignored when `setup` is given).
      setup: an existing `DemoSetup` to drive; its `kv_cache` is replaced by the final cache.
      on_step: called with each step's batch and logits f32[max_batch, vocab] (e.g. to compare to a reference).

    Raises:
      RuntimeError: if the step was traced more than once (a shape or dtype in the batch changed).
    """
    s = setup or build_demo(seed, swa, **build_kwargs)
    oracle = s.sched_config.token_oracle
    start = time.perf_counter()
    for _ in range(num_steps):
        batch = s.scheduler.step()
        next_tokens, logits, s.kv_cache = s.step_fn(s.params, s.kv_cache, batch)
        if on_step is not None:
            on_step(batch, logits)
        # With the token oracle the host needs nothing from the device, so the loop never syncs.
        s.scheduler.commit(None if oracle else np.asarray(next_tokens))
    jax.block_until_ready(s.kv_cache)
    if s.trace_count[0] > 1:
        raise RuntimeError(f"demo step retraced: {s.trace_count[0]} traces in {num_steps} steps")
    return DemoStats(
        steps=num_steps,
        traces=s.trace_count[0],
        reused_slots=int(np.count_nonzero(s.scheduler.slot_allocator.alloc_counts > 1)),
        wall_s=time.perf_counter() - start,
        scheduler=dict(s.scheduler.stats),
    )
