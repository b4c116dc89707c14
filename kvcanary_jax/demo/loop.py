"""Demo driver: model, pools, scheduler and canary wired into one jitted, donated, never-retraced decode loop."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kvcanary_jax as kc
from kvcanary_jax.demo import batch as batch_lib
from kvcanary_jax.demo import model, scheduler

# SGLang-style hybrid for the SWA variant: layer 0 attends to everything, layer 1 to a sliding window.
_SWA_WINDOW = 24
_NUM_SWA_SLOTS = 256
_OFF = kc.CanaryConfig(mode="off")


def kv_sources(canary: kc.KvCanary, layout: model.KvCacheLayout, kv_cache: model.KvCache) -> kc.KvSources:
    """The first full layer's K/V (and the first SWA layer's) as real-KV sources, as SGLang folds layer 0."""
    full = next(i for i in range(layout.num_layers) if i not in layout.swa_layers)
    kw = {"full_k": kv_cache.k[full], "full_v": kv_cache.v[full] if canary.pool.with_v else None}
    if layout.swa_layers:
        swa = layout.swa_layers[0]
        kw.update(swa_k=kv_cache.k[swa], swa_v=kv_cache.v[swa] if canary.pool.with_v else None)
    return canary.kv_sources(**kw)


def demo_step(
    canary: kc.KvCanary,
    layout: model.KvCacheLayout,
    params: model.Params,
    kv_cache: model.KvCache,
    canary_state: kc.CanaryState,
    batch: batch_lib.StepBatch,
) -> tuple[jax.Array, jax.Array, model.KvCache, kc.CanaryState]:
    """The jitted step: HEAD canary launches, the model forward, TAIL launches, greedy sampling.

    Returns ``(next_tokens i32[max_batch], logits f32[max_batch, vocab], kv_cache, canary_state)``.
    """
    view = batch.canary()
    canary_state = canary.before_forward(canary_state, view)
    canary_state, kv_cache = kc.fence(canary_state, kv_cache)
    logits, kv_cache = model.forward(params, kv_cache, batch)
    canary_state, kv_cache = kc.fence(canary_state, kv_cache)
    canary_state = canary.after_forward(canary_state, view, kv_sources(canary, layout, kv_cache))
    next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # greedy; padding rows give token 0
    return next_tokens, logits, kv_cache, canary_state


Hook = Callable[["DemoSetup", batch_lib.StepBatch], Any]


@dataclasses.dataclass
class DemoSetup:
    """Everything one demo run drives; :meth:`step` runs one scheduler + model + canary step."""

    model_config: model.ModelConfig
    layout: model.KvCacheLayout
    sched_config: scheduler.SchedulerConfig
    params: model.Params
    kv_cache: model.KvCache
    scheduler: scheduler.Scheduler
    canary: kc.KvCanary
    canary_state: kc.CanaryState
    monitor: kc.CanaryMonitor
    step_fn: Callable[..., Any]  # demo_step, jitted, KV cache and canary state donated
    sweep_fn: Callable[..., Any]  # KvCanary.sweep, jitted, canary state donated
    traces_before: int  # traces of this configuration's step before this setup was built
    traces_after_first_step: int | None = None

    @property
    def traces(self) -> int:
        """How many times this setup's steps traced the jitted step: 0 when an equal earlier setup compiled it and
        jax still caches it, 1 on first use (or after jax evicted it), more only if a step's inputs changed type."""
        return _TRACES[self.canary, self.layout] - self.traces_before

    @property
    def retraces(self) -> int:
        """Traces after this setup's first step: any is a bug (a batch field changed shape or dtype)."""
        if self.traces_after_first_step is None:
            return 0
        return _TRACES[self.canary, self.layout] - self.traces_after_first_step

    def step(
        self,
        *,
        before_forward: Hook | None = None,
        after_commit: Hook | None = None,
        on_logits: Callable[[batch_lib.StepBatch, jax.Array], None] | None = None,
    ) -> batch_lib.StepBatch:
        """Schedules, runs the jitted step, commits, sweeps when due and lets the monitor poll.

        Args:
          before_forward: may return a replacement batch (or None) and may replace ``self.kv_cache``.
          after_commit: runs after the scheduler applied the step (before a sweep); may replace ``self.kv_cache``.
          on_logits: receives the batch and its logits (a device sync).

        Returns:
          The batch the step ran.
        """
        batch = self.scheduler.step()
        if before_forward is not None:
            batch = before_forward(self, batch) or batch
        next_tokens, logits, self.kv_cache, self.canary_state = self.step_fn(
            self.params, self.kv_cache, self.canary_state, batch
        )
        if self.traces_after_first_step is None:
            self.traces_after_first_step = _TRACES[self.canary, self.layout]
        if on_logits is not None:
            on_logits(batch, logits)
        # With the token oracle the host needs nothing from the device, so the loop never syncs.
        self.scheduler.commit(None if self.sched_config.token_oracle else np.asarray(next_tokens))
        if after_commit is not None:
            after_commit(self, batch)
        if self.monitor.sweep_due:
            plan = self.canary.sweep_plan(self.scheduler.sweep_entries(), self.scheduler.full_to_swa_index_mapping)
            self.canary_state = self.sweep_fn(self.canary_state, plan, self.kv_cache)
        self.monitor.after_step(self.canary_state)
        return batch


def build_demo(
    seed: int = 0,
    swa: bool = False,
    *,
    canary_config: kc.CanaryConfig = _OFF,
    with_v: bool = True,
    kv_dtype: Any = jnp.bfloat16,
    page_size: int = 8,
    **sched_overrides: Any,
) -> DemoSetup:
    """Builds consistent model / KV layout / scheduler / canary configs and the jitted, donated step.

    Args:
      seed: seeds both the weights and the scheduler's workload.
      swa: use the hybrid full + sliding-window model, the SWA pool and its full->SWA LUT.
      canary_config: the canary's settings (off by default).
      with_v: launch the V-half canary endpoints too (SGLang's default is K only).
      kv_dtype: KV pool dtype (bf16 by default; float32 for exact comparisons).
      page_size: slots per page of the KV pools.
      **sched_overrides: `SchedulerConfig` fields, e.g. `spec_prob=0.3, token_oracle=True`.
    """
    swa_kw = {"swa_window": _SWA_WINDOW, "num_swa_slots": _NUM_SWA_SLOTS} if swa else {}
    sc = scheduler.SchedulerConfig(**{**swa_kw, **sched_overrides})
    model_cfg = model.ModelConfig(vocab_size=sc.vocab_size, swa_window=sc.swa_window, swa_layers=(1,) if swa else ())
    layout = model.KvCacheLayout.for_model(
        model_cfg, num_slots=sc.num_slots, page_size=page_size, dtype=kv_dtype, num_swa_slots=sc.num_swa_slots
    )
    canary_pool = kc.CanaryPool(
        num_slots=sc.num_slots,
        page_size=page_size,
        # Exact worst cases of this scheduler: every batch row at full context (or a full window).
        verify_capacity=sc.max_batch * sc.max_context_len,
        swa=kc.SwaGroup(sc.num_swa_slots, sc.swa_window, verify_capacity=sc.max_batch * sc.swa_window) if swa else None,
        with_v=with_v,
        max_reqs=sc.max_reqs,
        max_context_len=sc.max_context_len,
        padding="reserved",  # the demo scheduler pads as SGLang does: request row 0 and slot 0 are padding
    )
    canary = kc.KvCanary(canary_config, canary_pool)
    return DemoSetup(
        model_config=model_cfg,
        layout=layout,
        sched_config=sc,
        params=model.init_params(model_cfg, jax.random.key(seed)),
        kv_cache=model.init_kv_cache(layout),
        scheduler=scheduler.Scheduler(sc, seed=seed),
        canary=canary,
        canary_state=canary.init_state(),
        monitor=kc.CanaryMonitor(canary),
        step_fn=functools.partial(_jitted_step, canary, layout),
        sweep_fn=functools.partial(_jitted_sweep, canary, layout),
        traces_before=_TRACES[canary, layout],
    )


# Module-level jits with (canary, layout) static: every DemoSetup of the same configuration shares one compiled step.
_TRACES: collections.Counter = collections.Counter()


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def _jitted_step(canary, layout, params, kv_cache, canary_state, batch):
    _TRACES[canary, layout] += 1  # Python side effect: runs once per trace, never per cached call
    return demo_step(canary, layout, params, kv_cache, canary_state, batch)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def _jitted_sweep(canary, layout, canary_state, plan, kv_cache):
    return canary.sweep(canary_state, plan, kv_sources(canary, layout, kv_cache))
