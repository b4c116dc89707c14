"""The canary on sglang-jax's hybrid ``SWAKVPool``: a tiny random Gemma 2 (one sliding-window layer of 8 tokens, one
full layer), on CPU, driven in-process with the engine's own ``SWARadixCache``, which frees the SWA slots that leave
the window. The native attention's SWA path is the patch :mod:`kvcanary_jax.integrations.sglang_native_swa` adds
(sglang-jax 0.1.0rc0 addresses an ``SWAKVPool`` only in its TPU backend).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")

import kvcanary_jax as kc  # noqa: E402
from kvcanary_jax.demo import sglang_engine, sglang_faults  # noqa: E402
from kvcanary_jax.integrations import _sglang_pools, sglang_jax, tiny_gemma2, tiny_models  # noqa: E402

pytestmark = [pytest.mark.families, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
WINDOW = tiny_gemma2.SLIDING_WINDOW


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The tiny Gemma 2's ModelWorker (its own random weights, page size 1)."""
    path = tiny_models.write_arch(tmp_path_factory.mktemp("tiny_gemma2"), arch="gemma2")
    return sglang_engine.build_worker(path, page_size=1, seed=0, load_format="auto")


def _workload(n: int = 16) -> list[sglang_engine.Arrival]:
    """``n`` greedy requests arriving together (all running at once once admitted), each generating 2-3 windows."""
    rng = np.random.default_rng(1)
    system = list(map(int, rng.integers(3, 500, 10)))  # a shared prefix: the SWA tree's prefix reuse
    return [sglang_engine.Arrival(0, f"req{i}", system + list(map(int, rng.integers(3, 500, int(rng.integers(2, 9))))),
                                  int(rng.integers(20, 27))) for i in range(n)]  # fmt: skip


def _drive(worker, config, *, inject=None, stop_on_report=True, max_steps=None):
    """Runs :func:`_workload` wrapped; ``inject(step, sched, batch)`` before each forward may flip a byte and return
    what it injected. Returns ``(sched, guard, injected, swa_freed)``: ``swa_freed`` counts the request slots whose
    SWA slot the engine freed (its table maps them to 0) while they were still held."""
    sched = sglang_engine.MiniScheduler(worker, _workload())
    guard = sglang_jax.wrap(worker, config, tree_cache=sched.tree_cache)
    lut = sched.allocator.full_to_swa_index_mapping
    injected, swa_freed = None, 0
    try:
        for step, batch in enumerate(sched):
            if max_steps is not None and step >= max_steps:
                break
            guard.expect(batch)
            if inject is not None and injected is None:
                injected = inject(step, sched, batch)
            table = sched.req_to_token_pool.req_to_token
            swa_freed += sum(int((lut[table[r.req_pool_idx, : _cached(r)]] == 0).sum()) for r in sched.running_reqs())
            sched.run_batch(batch)
            guard.after_step()
            if stop_on_report and guard.monitor.observed:
                break
        guard.final_check()
    except kc.KvCanaryViolationError:
        pass
    finally:
        guard.unwrap()
    return sched, guard, injected, swa_freed


def _cached(req) -> int:
    """Positions a decoding request has cached before its next forward."""
    return len(req.origin_input_ids) + len(req.output_ids) - 1


def _swa_flip(offset: int, *, at_step: int = 20):
    """An injector: at the first decode step from ``at_step``, flips the SWA-layer KV of a running request's position
    ``P - offset`` (``P``: its cached positions), in the SWA sub-pool, at that slot's SWA slot."""

    def inject(step, sched, batch):
        if step < at_step or not batch.forward_mode.is_decode():
            return None
        req = batch.reqs_info[0].reqs[0]
        position = _cached(req) - offset
        full = int(sched.req_to_token_pool.req_to_token[req.req_pool_idx, position])
        swa = int(sched.allocator.full_to_swa_index_mapping[full])
        assert swa > 0, f"position {position} of {req.rid} is not resident in the SWA pool"
        sglang_faults._flip(sched.runner, swa, group="swa")
        return step, swa, req.rid

    return inject


def test_the_swa_pool_is_mapped_as_two_groups(worker):
    view = _sglang_pools.pool_view(worker.model_runner)
    pool = worker.model_runner.token_to_kv_pool
    assert type(view) is _sglang_pools.SwaPoolView and view.name == "SWAKVPool"
    assert view.swa_window == WINDOW - 1  # an SWA layer's query reads the last sliding_window - 1 cached positions
    assert view.num_slots == pool.full_kv_pool.kv_buffer[0].shape[0]  # page size 1: a slot a page
    assert view.swa_slots == pool.swa_kv_pool.kv_buffer[0].shape[0]
    arrays = view.arrays(pool)
    assert arrays["full_to_swa"] is not pool.full_to_swa_index_mapping  # a copy, taken at each launch
    np.testing.assert_array_equal(arrays["full_to_swa"], pool.full_to_swa_index_mapping)


def test_clean_run_crosses_the_window_silent_with_the_engines_tokens(worker):
    alone = sglang_engine.MiniScheduler(worker, _workload())
    for batch in alone:
        alone.run_batch(batch)
    tokens = {r.rid: list(r.output_ids) for r in alone.finished}
    sched, guard, _, swa_freed = _drive(worker, sglang_faults.ENGINE_CONFIG)
    assert not guard.monitor.observed, guard.monitor.observed[:3]
    assert len(sched.finished) == 16 and {r.rid: list(r.output_ids) for r in sched.finished} == tokens
    assert len({tuple(t) for t in tokens.values()}) > 1  # the random weights give each request its own tokens
    assert swa_freed > 0  # the engine freed SWA slots of running requests as they left the window: no alarm
    assert sum(r.cached_tokens for r in sched.finished) > 0  # prefixes reused through the SWA radix tree
    assert int(np.asarray(guard.state.verify_overflows).sum()) == 0  # no plan (FULL or SWA) too small for its batch
    counters = np.asarray(guard.state.device.slot_run_counters).view(np.int64)[:, 0]
    for tag in ("HEAD_K_SWA", "TAIL_K_SWA", "SWEEP_K_SWA"):  # the SWA group verified and wrote, the sweep covered it
        assert counters[kc.CanaryLaunchTag[tag]] > 0, tag


@pytest.mark.parametrize("fault", [kc.testing.FaultKind.LIVE_KV, kc.testing.FaultKind.REQ_TO_TOKEN],
                         ids=lambda f: f.value)  # fmt: skip
def test_faults_are_found_at_the_injected_request(worker, fault):
    run = sglang_faults.run(worker, fault)
    assert run.injected is not None and run.ok, f"{run.note}: {run}"
    assert (run.detected_step, run.slot, run.rid) == (run.injected.step, run.injected.slot, run.injected.rid)


@pytest.mark.parametrize("offset", [1, WINDOW - 1], ids=["newest", "oldest_in_window"])
def test_a_flipped_swa_byte_in_the_window_is_found_by_tail_k_swa(worker, offset):
    _, guard, injected, _ = _drive(worker, sglang_faults.ENGINE_CONFIG, inject=_swa_flip(offset))
    assert injected is not None and guard.monitor.observed, "no target, or not found"
    first = guard.monitor.observed[0]
    step, swa_slot, rid = injected
    assert first.violation.tag_label == "TAIL_K_SWA" and first.violation.reason_labels == ["verify_real_kv_hash"]
    assert (first.user_step, first.violation.slot_idx, guard.rid_of(first)) == (step, swa_slot, rid)


def test_a_flipped_swa_byte_past_the_window_is_not_read_so_not_reported(worker):
    """Position ``P - sliding_window``: still resident (the engine frees a slot ``sliding_window + page_size`` back),
    but no SWA layer reads it again, nor does any forward's check; it is left to the sweep, the next one due at step
    30 (every 10 steps). A window one longer would report it at once."""
    _, guard, injected, _ = _drive(worker, sglang_faults.ENGINE_CONFIG, inject=_swa_flip(WINDOW, at_step=21),
                                   stop_on_report=False, max_steps=30)  # fmt: skip
    assert injected is not None and injected[0] < 29
    assert not guard.monitor.observed, guard.monitor.observed[:3]


def test_an_idle_swa_slot_is_found_by_the_sweep(worker):
    """A slot only the SWA radix tree holds, still resident in the SWA pool: SWEEP_K_SWA, at its SWA slot."""

    def inject(step, sched, batch):
        if step < 10 or step % sglang_faults.ENGINE_CONFIG.sweep_interval:  # a step that ends with a sweep
            return None
        lut = sched.allocator.full_to_swa_index_mapping
        idle = sglang_jax.radix_entries(sched.tree_cache, include=lambda n: n.full_lock_ref == 0)
        resident = [int(lut[s]) for s in idle.slots if lut[s] > 0]
        if not resident:
            return None
        sglang_faults._flip(sched.runner, resident[0], group="swa")
        return step, resident[0], None

    _, guard, injected, _ = _drive(worker, sglang_faults.ENGINE_CONFIG, inject=inject)
    assert injected is not None and guard.monitor.observed, "no idle SWA slot, or not found"
    first = guard.monitor.observed[0]
    assert (first.violation.tag_label, first.violation.slot_idx, first.user_step) == ("SWEEP_K_SWA", injected[1],
                                                                                       injected[0])  # fmt: skip


def test_unmapped_swa_set_ups_are_refused_by_name(worker):
    sched = sglang_engine.MiniScheduler(worker, _workload(2))
    with pytest.raises(NotImplementedError, match=r"does not adopt a warm engine's SWAKVPool"):
        sglang_jax.wrap(worker, sglang_faults.ENGINE_CONFIG, tree_cache=sched.tree_cache, live_requests=[])
