"""sglang-jax with tensor and data parallelism, on 4 host-platform CPU devices (run by test_sglang_jax_parallel.py).

Two engines, each built once: ``tp2`` (tp_size=2: the tiny Llama's 2 KV heads split over ``tensor``, one per device)
and ``tp2dp2`` (tp_size=4, dp_size=2: a 2 x 2 ``(data, tensor)`` mesh, each DP rank numbering its own slots). Short
workloads keep the module cheap: the compiles dominate.
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax.demo import sglang_engine, sglang_faults
from kvcanary_jax.integrations import _sglang_parallel, sglang_jax

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the engine's own (flax .value access)
RUN = dict(num_requests=6, inject_at=5)  # faults land at step 5 of ~20: before the DP engine's KV collides


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = sglang_engine.write_tiny_llama(tmp_path_factory.mktemp("tp2"), kv_heads=2)
    return sglang_engine.build_worker(path, tp=2)


@pytest.fixture(scope="module")
def tp2dp2(tmp_path_factory):
    path = sglang_engine.write_tiny_llama(tmp_path_factory.mktemp("tp2dp2"), kv_heads=2)
    return sglang_engine.build_worker(path, tp=2, dp=2)


def test_the_engines_meshes_and_the_canarys_per_device_pools(tp2, tp2dp2):
    assert len(jax.devices()) == 4
    for worker, mesh in ((tp2, {"data": 1, "tensor": 2}), (tp2dp2, {"data": 2, "tensor": 2})):
        assert dict(worker.model_runner.mesh.shape) == mesh
        sglang_engine.MiniScheduler(worker, [])  # cold
        with sglang_jax.wrap(worker, kc.CanaryConfig(sweep_interval=0)) as guard:
            assert isinstance(guard, _sglang_parallel.ParallelSglangCanary)
            kv0 = worker.model_runner.token_to_kv_pool.kv_buffer[0]
            # One DP rank's pages (its padding page 0 included); one KV head of K and V per device.
            assert guard.canary.groups[0].num_slots == kv0.shape[0] // mesh["data"] == 2049
            assert [s.data.shape[2] for s in kv0.addressable_shards] == [1] * (mesh["data"] * mesh["tensor"])
            assert guard.state.device.violation_log.violation_ring.shape[:2] == (mesh["data"], mesh["tensor"])


def test_tp2_clean_run_is_silent_and_every_fault_is_found_at_its_device_slot_and_request(tp2):
    alone = sglang_engine.MiniScheduler(tp2, sglang_engine.workload(0, RUN["num_requests"]))
    for batch in alone:
        alone.run_batch(batch)
    clean = sglang_faults.run(tp2, None, **RUN)
    assert clean.ok and clean.reported_by == [], clean.note
    assert clean.tokens == {r.rid: list(r.output_ids) for r in alone.finished}  # the engine's own tokens
    for fault in sglang_faults.FAULTS:
        run = sglang_faults.run(tp2, fault, **RUN)
        assert run.injected is not None and run.ok, f"{fault}: {run.note}: {run}"
        assert (run.detected_step, run.slot, run.rid) == (run.injected.step, run.injected.slot, run.injected.rid)
        # A KV byte of head 0 lives on tensor=0 only; the chain faults are seen by both TP peers.
        kv_fault = fault in (kc.testing.FaultKind.LIVE_KV, kc.testing.FaultKind.IDLE_CACHE_KV)
        assert run.reported_by == (["data=0,tensor=0"] if kv_fault else ["data=0,tensor=0", "data=0,tensor=1"])


def test_dp2_every_fault_is_found_at_its_rank_slot_and_request(tp2dp2):
    ranks = set()
    for fault in sglang_faults.FAULTS:
        run = sglang_faults.run(tp2dp2, fault, **RUN)
        ranks.add(run.injected.rank)
        assert run.injected is not None and run.ok, f"{fault}: {run.note}: {run}"
        assert (run.detected_step, run.slot, run.rid) == (run.injected.step, run.injected.slot, run.injected.rid)
        rank = run.injected.rank
        kv_fault = fault in (kc.testing.FaultKind.LIVE_KV, kc.testing.FaultKind.IDLE_CACHE_KV)
        assert run.reported_by == [f"data={rank},tensor={t}" for t in ((0,) if kv_fault else (0, 1))]
    assert 1 in ranks  # rank 1's slots are numbered from 1 again: a mix-up with rank 0 would show


def test_dp2_on_cpu_the_engines_own_cross_rank_kv_write_is_reported(tp2dp2):
    """sglang-jax's CPU KV write scatters each DP rank's rank-local slot numbers into the whole pool: rank 1's writes
    land in rank 0's pages. The canary's clean run reports the first such page rank 0 reads."""
    clean = sglang_faults.run(tp2dp2, None, **RUN)
    assert clean.launch_tag is not None, "the engine's cross-rank writes went unreported"
    assert clean.ok and clean.note.startswith("engine defect on CPU: DP rank 1 wrote its slot"), clean.note
    assert clean.fail_reason == "verify_real_kv_hash" and clean.reported_by[0] == "data=0,tensor=0"


def test_parallel_set_ups_not_mapped_are_refused_by_name(tp2dp2):
    sglang_engine.MiniScheduler(tp2dp2, [])
    with pytest.raises(NotImplementedError, match=r"parallel engine \(mesh \{'data': 2, 'tensor': 2\}\) does not "
                                                  r"map adopting a warm engine"):  # fmt: skip
        sglang_jax.wrap(tp2dp2, kc.CanaryConfig(sweep_interval=0), live_requests=[])
    client = types.SimpleNamespace(model_runner=tp2dp2.model_runner, worker=tp2dp2, future_token_ids_map=np.zeros(4),
                                   forward_batch_generation=tp2dp2.forward_batch_generation)  # fmt: skip
    with pytest.raises(NotImplementedError, match="the overlap scheduler"):
        sglang_jax.wrap(client, kc.CanaryConfig(sweep_interval=0))
