"""sglang-jax with tensor and data parallelism, on 4 host-platform CPU devices (run by test_sglang_jax_parallel.py).

One engine, built once: tp_size=4, dp_size=2, a 2 x 2 ``(data, tensor)`` mesh. Each DP rank splits the tiny Llama's 2
KV heads over its 2 ``tensor`` devices (one each) and numbers its own slots. Short workloads keep the module cheap:
the compiles dominate.
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
RUN = dict(num_requests=6, inject_at=5)  # faults land at step 5 of ~20: before the engine's DP writes collide
KV_FAULTS = (kc.testing.FaultKind.LIVE_KV, kc.testing.FaultKind.IDLE_CACHE_KV)  # a byte of K head 0: tensor=0 only


def _compiled() -> dict:
    return {name: jit._cache_size() for name, jit in _sglang_parallel._LAUNCHES.items()}


@pytest.fixture(scope="module")
def tp2dp2(tmp_path_factory):
    path = sglang_engine.write_tiny_llama(tmp_path_factory.mktemp("tp2dp2"), kv_heads=2)
    return sglang_engine.build_worker(path, tp=2, dp=2)


def test_the_engines_mesh_and_the_canarys_per_device_pools(tp2dp2):
    assert len(jax.devices()) == 4 and dict(tp2dp2.model_runner.mesh.shape) == {"data": 2, "tensor": 2}
    sglang_engine.MiniScheduler(tp2dp2, [])  # cold
    with sglang_jax.wrap(tp2dp2, kc.CanaryConfig(sweep_interval=0)) as guard:
        assert isinstance(guard, _sglang_parallel.ParallelSglangCanary)
        kv0 = tp2dp2.model_runner.token_to_kv_pool.kv_buffer[0]
        # One DP rank's pages (its padding page 0 included); one KV head (K and V) per device.
        assert guard.canary.groups[0].num_slots == kv0.shape[0] // 2 == 2049
        assert [s.data.shape[:3] for s in kv0.addressable_shards] == [(2049, 1, 1)] * 4
        assert guard.state.device.violation_log.violation_ring.shape[:2] == (2, 2)


def test_a_clean_run_on_one_rank_is_silent_and_leaves_the_engine_unchanged(tp2dp2):
    """Every request on DP rank 0 (rank 1 runs padding): no rank writes into another's pages (see below)."""
    alone = sglang_engine.MiniScheduler(tp2dp2, sglang_engine.workload(0, RUN["num_requests"]), spread=1)
    for batch in alone:
        alone.run_batch(batch)
    compiled = _compiled()
    clean = sglang_faults.run(tp2dp2, None, spread=1, **RUN)
    assert clean.ok and clean.launch_tag is None and clean.reported_by == [], clean.note
    added = {name: n - compiled[name] for name, n in _compiled().items()}
    assert added["head"] <= 2 and added["tail"] <= 2 and added["sweep"] <= 1, added  # extend + decode; no per-step
    assert clean.steps >= 15 and clean.cached_tokens > 0
    assert clean.tokens == {r.rid: list(r.output_ids) for r in alone.finished}  # the engine's own tokens


def test_dp2_every_fault_is_found_at_its_rank_slot_and_request(tp2dp2):
    ranks, compiled = set(), _compiled()
    for fault in sglang_faults.FAULTS:
        run = sglang_faults.run(tp2dp2, fault, **RUN)
        assert run.injected is not None and run.ok, f"{fault}: {run.note}: {run}"
        ranks.add(run.injected.rank)
        assert (run.detected_step, run.slot, run.rid) == (run.injected.step, run.injected.slot, run.injected.rid)
        # The injected rank's devices: tensor=0 alone for a K byte of head 0; both TP peers for the chain faults.
        assert run.reported_by == [f"data={run.injected.rank},tensor={t}" for t in ((0,) if fault in KV_FAULTS
                                                                                    else (0, 1))]  # fmt: skip
    assert 1 in ranks  # rank 1's slots are numbered from 1 again: a mix-up with rank 0 would show
    added = {name: n - compiled[name] for name, n in _compiled().items()}
    assert added["head"] <= 2 and added["tail"] <= 2 and added["sweep"] <= 1, added  # 4 wraps, compiled once


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
