"""A warm sglang-jax engine: served unwrapped, then wrapped mid-flight; adopting its cache keeps a healthy run silent.

Skipped where sglang-jax is not installed, unless ``KVCANARY_REQUIRE_SGLANG_JAX=1`` (CI's sglang-jax leg).
"""

from __future__ import annotations

import dataclasses
import os
import types

import numpy as np
import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")

from kvcanary_jax import FailReason, read_violations  # noqa: E402
from kvcanary_jax.demo import sglang_engine, sglang_faults  # noqa: E402
from kvcanary_jax.integrations import _sglang_adopt, sglang_jax  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
WARM_STEPS, WRAPPED_STEPS = 25, 12
CONFIG = dataclasses.replace(sglang_faults.ENGINE_CONFIG, mode="log")  # every assert and the sweep on, keep going


def _serve(sched, steps, guard=None):
    """Runs ``steps`` scheduler steps (through the guard's calls when wrapped)."""
    for _ in range(steps):
        batch = sched.next_batch()
        assert batch is not None, "the workload ran out"
        if guard is not None:
            guard.expect(batch)
        sched.run_batch(batch)
        if guard is not None:
            guard.after_step()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = sglang_engine.write_tiny_llama(tmp_path_factory.mktemp("tiny_llama_warm"))
    return sglang_engine.build_worker(path, page_size=1, seed=0)


def _warm(worker):
    """The engine after WARM_STEPS steps served unwrapped: requests mid-decode, prefixes in the radix cache."""
    sched = sglang_engine.MiniScheduler(worker, sglang_engine.workload(0, 16))
    _serve(sched, WARM_STEPS)
    decoding = [r for r in sched.running_reqs() if r.output_ids]
    assert len(decoding) >= 2 and len(sglang_jax.radix_entries(sched.tree_cache).slots) > 0
    return sched


def test_a_warm_engine_adopted_runs_silent_and_a_later_fault_is_caught(worker):
    sched = _warm(worker)
    guard = sglang_jax.wrap(worker, CONFIG, tree_cache=sched.tree_cache, live_requests=sched.running_reqs())
    try:
        adopted = len(_sglang_adopt.adopt_entries(sched.running_reqs(), sched.req_to_token_pool, sched.tree_cache).slots)
        table = sched.req_to_token_pool.req_to_token
        held = {int(s) for r in sched.running_reqs() for s in table[r.req_pool_idx, : r.kv_committed_len]}
        assert adopted >= len(held) > 0
        _serve(sched, WRAPPED_STEPS, guard)
        report = read_violations(guard.state.violation_log)
        assert not report.is_errored, "\n".join(report.format())
        # A fault after the adoption: a KV byte of a position a running request cached before the wrap.
        req = next(r for r in sched.running_reqs() if r.kv_committed_len > 2)
        slot = int(sched.req_to_token_pool.req_to_token[req.req_pool_idx, 1])
        sglang_faults._flip(worker.model_runner, slot)
        _serve(sched, 1, guard)
        first = read_violations(guard.state.violation_log).first_violation
        assert first is not None and first.slot_idx == slot and first.position == 1
        assert first.fail_reason == FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    finally:
        guard.unwrap()


def test_without_adoption_a_warm_engine_is_refused_by_name(worker):
    """Unadopted, its cached slots have no records and would all be reported: wrap refuses it instead."""
    sched = _warm(worker)
    with pytest.raises(ValueError, match=r"cannot wrap a warm engine: it holds \d+ live request.*live_requests="):
        sglang_jax.wrap(worker, CONFIG, tree_cache=sched.tree_cache)
    assert worker.model_runner.forward.__self__ is worker.model_runner  # nothing was wrapped


def test_misuse_is_named():
    class Req:
        rid, req_pool_idx, kv_committed_len, origin_input_ids, output_ids = "r", 0, 5, [1, 2], [3]

    with pytest.raises(ValueError, match=r"request 'r' cannot be adopted: req_pool_idx=0, kv_committed_len=5"):
        _sglang_adopt.request_adopt_entries(Req(), None)
    pool = type("Pool", (), {"req_to_token": np.array([[4, 5, 5, 0]], np.int32)})()
    Req.kv_committed_len = 3
    with pytest.raises(ValueError, match=r"slot 5 is given twice with different entries"):
        _sglang_adopt.adopt_entries([Req()], pool)


def test_scheduler_requests_lists_each_live_request_once():
    def req(name, done=False, row=0):
        return types.SimpleNamespace(rid=name, req_pool_idx=row, finished=lambda: done)

    a, b, c, d, gone, unplaced = req("a"), req("b"), req("c"), req("d"), req("e", done=True), req("f", row=None)
    batch = lambda *reqs: types.SimpleNamespace(reqs_info=[types.SimpleNamespace(reqs=list(reqs))])  # noqa: E731
    scheduler = types.SimpleNamespace(running_batch=batch(a, b, gone), last_batch=batch(b, c, unplaced),
                                      chunked_reqs=[d, None])  # fmt: skip
    assert [r.rid for r in sglang_jax.scheduler_requests(scheduler)] == ["a", "b", "c", "d"]
