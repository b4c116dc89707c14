"""Tests for the demo model: paged attention equals dense attention, and the jitted donated step never retraces.

``run_demo_steps`` (the test rig) drives the demo's scheduler, model and canary for a number of steps."""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcanary_jax import demo
from kvcanary_jax.demo import batch as batch_lib

NUM_SLOTS, MAX_REQS, CTX, MAX_BATCH, MAX_TOKENS, WINDOW = 128, 6, 48, 5, 64, 6


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
    setup: demo.DemoSetup | None = None,
    on_step: Callable[[demo.StepBatch, jax.Array], None] | None = None,
    **build_kwargs: Any,
) -> DemoStats:
    """Runs `num_steps` scheduler + model + canary steps and checks the step compiled exactly once.

    Args:
      num_steps: steps to run.
      seed, swa, **build_kwargs: passed to `build_demo` (ignored when `setup` is given).
      setup: an existing `DemoSetup` to drive; its `kv_cache` and `canary_state` are replaced as it runs.
      on_step: called with each step's batch and logits f32[max_batch, vocab] (e.g. to compare to a reference).

    Raises:
      RuntimeError: if the step was traced more than once (a shape or dtype in the batch changed).
      KvCanaryViolationError, KvCanaryHealthError: from the canary monitor.
    """
    s = setup or demo.build_demo(seed, swa, **build_kwargs)
    start = time.perf_counter()
    for _ in range(num_steps):
        s.step(on_logits=on_step)
    jax.block_until_ready((s.kv_cache, s.canary_state))
    if s.retraces:
        raise RuntimeError(f"demo step retraced {s.retraces} time(s) after its first step")
    return DemoStats(
        steps=num_steps,
        traces=s.traces,
        reused_slots=int(np.count_nonzero(s.scheduler.slot_allocator.alloc_counts > 1)),
        wall_s=time.perf_counter() - start,
        scheduler=dict(s.scheduler.stats),
    )


def _dense_last_logits(params, token_ids, lens, kv_dtype):
    """Dense reference logits of the last valid token of each row; token_ids: i32[B, C], lens: i32[B]."""
    dense = jax.vmap(lambda t: demo.dense_forward(params, t, kv_dtype=kv_dtype))(jnp.asarray(token_ids))
    return np.asarray(dense)[np.arange(len(lens)), np.maximum(np.asarray(lens) - 1, 0)]


@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
@pytest.mark.parametrize("kv_dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)], ids=["f32", "bf16"])
def test_paged_forward_matches_dense(swa, kv_dtype, tol):
    """Two steps (prefill, then a mixed extend) over scrambled, non-contiguous slots vs. a non-paged model."""
    rng = np.random.default_rng(0)
    cfg = demo.ModelConfig(swa_window=WINDOW if swa else 0, swa_layers=(1,) if swa else ())
    layout = demo.KvCacheLayout.for_model(
        cfg, num_slots=NUM_SLOTS, page_size=4, dtype=kv_dtype, num_swa_slots=NUM_SLOTS if swa else 0
    )
    params = demo.init_params(cfg, jax.random.key(1))
    cache = demo.init_kv_cache(layout)
    fwd = jax.jit(demo.forward, donate_argnums=1)

    lens = [(5, 9), (17, 1), (1, 20)]  # (first-step tokens, second-step tokens) per request
    rows = [1, 4, 2]  # request-pool rows, deliberately out of order
    seqs = [rng.integers(0, cfg.vocab_size, a + b).tolist() for a, b in lens]
    slots = rng.permutation(np.arange(1, NUM_SLOTS))[: sum(a + b for a, b in lens)].astype(np.int32)
    table = np.zeros((MAX_REQS, CTX), np.int32)
    ids = np.zeros_like(table)
    # A random full->SWA mapping: the SWA pool is addressed differently from the full pool.
    lut = np.zeros(NUM_SLOTS + 1, np.int32)
    if swa:
        lut[1:NUM_SLOTS] = rng.permutation(np.arange(1, NUM_SLOTS))
    off = 0
    for row, seq in zip(rows, seqs, strict=True):
        table[row, : len(seq)] = slots[off : off + len(seq)]
        ids[row, : len(seq)] = seq
        off += len(seq)

    for step in range(2):
        entries = []
        for (a, b), row, seq in zip(lens, rows, seqs, strict=True):
            start, n = (0, a) if step == 0 else (a, b)
            entries.append((row, start, seq[start : start + n], seq[start : start + n], table[row, start : start + n]))
        batch = batch_lib.pack_step_batch(
            entries, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS, req_to_token=table, req_to_token_ids=ids, lut=lut
        )
        logits, cache = fwd(params, cache, batch)
        valid = batch.expected_tokens_valid_lens
        ref = _dense_last_logits(params, ids[batch.req_pool_indices], valid, kv_dtype)
        chex.assert_trees_all_close(np.asarray(logits)[:3], ref[:3], atol=tol, rtol=tol)
        np.testing.assert_array_equal(np.asarray(logits)[3:], 0.0)  # padding rows


@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
def test_demo_loop_matches_dense_every_step(swa):
    """End to end: prefix reuse, eviction, slot reuse, speculative rejection and SWA freeing keep KV exact."""
    setup = demo.build_demo(0, swa, kv_dtype=jnp.float32, spec_prob=0.3)
    dense = jax.jit(jax.vmap(lambda p, t: demo.dense_forward(p, t, kv_dtype=jnp.float32), in_axes=(None, 0)))
    errors = []

    def on_step(batch, logits):
        real = batch.extend_lens > 0
        last = np.maximum(batch.expected_tokens_valid_lens - 1, 0)
        ref = np.asarray(dense(setup.params, batch.req_to_token_ids[batch.req_pool_indices]))
        errors.append(np.abs(np.asarray(logits)[real] - ref[np.arange(len(last)), last][real]).max())

    stats = run_demo_steps(50, setup=setup, on_step=on_step)
    assert max(errors) < 1e-4, f"paged logits drift from dense at step {int(np.argmax(errors))}"
    assert stats.scheduler["prefix_hit_tokens"] > 0 and stats.scheduler["evicted_slots"] > 0
    assert stats.reused_slots > 0 and stats.traces <= 1


def test_jitted_donated_step_does_not_retrace():
    setup = demo.build_demo(1, swa=True, spec_prob=0.3, token_oracle=True)

    @chex.assert_max_traces(n=1)
    def step(params, kv_cache, canary_state, batch):
        return demo.demo_step(setup.canary, setup.layout, params, kv_cache, canary_state, batch)

    step = jax.jit(step, donate_argnums=(1, 2))
    cache, canary_state, sched = setup.kv_cache, setup.canary_state, setup.scheduler
    for _ in range(12):  # batch contents (row counts, spec extends, chunk sizes) vary; shapes must not
        old = cache
        _, logits, cache, canary_state = step(setup.params, cache, canary_state, sched.step())
        assert old.k[0].is_deleted(), "the KV cache was not donated"
        sched.commit(None)
    assert np.isfinite(np.asarray(logits)).all()
    stats = run_demo_steps(12, 2, kv_dtype=jnp.bfloat16)
    assert stats.traces <= 1 and stats.steps == 12
