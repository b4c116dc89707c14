"""HiCache end to end on CPU: canary records carried across sglang-jax's host pool (L2), and each transfer fault named.

One engine for the module (a small device pool, so prefixes are evicted to host and loaded back all the time); each
run builds a fresh ``UnifiedRadixCache`` with HiCache on (``hicache_storage="none"``) in one write policy.
Skipped where sglang-jax is not installed, unless ``KVCANARY_REQUIRE_SGLANG_JAX=1`` (CI's sglang-jax leg).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":  # CI's sglang-jax leg: a broken install must fail, not skip
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")

from sgl_jax.srt.mem_cache.radix_cache import RadixCache  # noqa: E402

import kvcanary_jax as kc  # noqa: E402
from kvcanary_jax.demo import sglang_hicache as hc  # noqa: E402
from kvcanary_jax.integrations import sglang_hicache, sglang_jax  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the engine's own (flax .value access)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    return hc.hicache_worker(tmp_path_factory.mktemp("tiny_llama"))


@pytest.mark.parametrize("policy", hc.POLICIES)
def test_a_clean_run_with_many_load_backs_is_silent(worker, policy):
    run = hc.run(worker, write_policy=policy)
    assert run.ok and run.detected_step is None, run
    assert run.steps >= 100 and run.loads >= 20, run
    assert run.pages_loaded >= 20 and run.pages_backed_up >= run.pages_loaded // 4, run  # records made both trips
    assert run.pages_host_swept >= run.steps // hc.HOST_SWEEP_INTERVAL * 32, run  # the host sweep ran, silent


def test_without_the_records_a_load_back_is_a_false_alarm(worker):
    run = hc.run(worker, write_policy="write_back", carry=False)
    assert run.launch_tag == "HEAD_K_FULL" and "verify_chain_hash" in run.fail_reason, run
    assert run.pages_loaded == 0 and 40 <= run.detected_step < 60, run  # at the first load-back


# Each fault once, the policies alternating (CI time; the demo runs all eight): where the host copy comes from
# (a hit-time or an eviction-time backup) differs by policy, the load path does not.
FAULT_RUNS = [(f, hc.POLICIES[i % 2]) for i, f in enumerate(hc.TransferFault)]


@pytest.mark.parametrize("fault, policy", FAULT_RUNS, ids=[f"{f.value}-{p}" for f, p in FAULT_RUNS])
def test_a_transfer_fault_is_named_at_its_load(worker, fault, policy):
    run = hc.run(worker, write_policy=policy, fault=fault)
    tag, bits = hc.EXPECTED[fault]
    assert run.injected is not None and run.injected.step >= 40, run  # the first load-back after the warm-up
    assert run.ok, run.note
    assert (run.detected_step, run.slot, run.rid) == (run.injected.step, run.injected.slot, run.injected.rid)
    assert run.launch_tag == tag.name and kc.FailReason[run.fail_reason.split("+")[0].upper()] & bits, run
    if fault is hc.TransferFault.HOST_RESIDENT_FLIP:  # a page never loaded back: the host sweep names it
        assert run.host_page == (run.flipped_host_page, 0) and run.rid is None, run


def test_carry_records_refuses_a_cache_without_hicache(worker):
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()  # a fresh start after the module's other runs
    allocator.clear()
    radix = RadixCache(req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=1)
    guard = sglang_jax.wrap(worker, hc.CONFIG)
    try:
        with pytest.raises(ValueError, match="tree_cache must be a UnifiedRadixCache with HiCache on"):
            sglang_hicache.carry_records(guard, radix)
        with pytest.raises(ValueError, match=r"host_sweep_interval must be an int >= 0; got -1"):
            sglang_hicache.carry_records(guard, radix, host_sweep_interval=-1)
        with pytest.raises(ValueError, match=r"host_sweep_pages must be an int >= 1; got 0"):
            sglang_hicache.carry_records(guard, radix, host_sweep_pages=0)
    finally:
        guard.unwrap()
