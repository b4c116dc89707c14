"""The sglang-jax guard on model families beyond Llama, each a tiny random model with real weights, on CPU.

- DeepSeek-V3 (MLA): ``MLATokenToKVPool``, one latent row per token (``--attention-backend fa``, page size 4; on CPU
  its TPU kernel is swapped for the XLA one of :mod:`kvcanary_jax.integrations.sglang_cpu`).
- Qwen3.5 (hybrid linear attention): ``HybridLinearKVPool``, the full-attention layer's paged KV (the Gated DeltaNet
  layer's recurrent state is not covered); its prefill on CPU is ``chunked_jax``, its cache a ``ChunkCache``.

Each: a clean run of 16 concurrent greedy requests reports nothing and samples the tokens of the engine alone; a
flipped live-KV byte and a remapped page-table entry are reported at the injected slot, request and step.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")

import kvcanary_jax as kc  # noqa: E402
from kvcanary_jax import testing  # noqa: E402
from kvcanary_jax.demo import sglang_engine, sglang_faults  # noqa: E402
from kvcanary_jax.integrations import _sglang_mapping, _sglang_pools, sglang_cpu, tiny_models  # noqa: E402
from pallas_kernels import realkv  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FAMILIES = {
    "deepseek_v3": dict(attention_backend="fa", page_size=4, pool="MLATokenToKVPool"),
    # the hybrid recurrent state takes no radix cache (the engine asserts it): no prefix reuse, no sweep
    "qwen3_5": dict(attention_backend="native", page_size=1, pool="HybridLinearKVPool",
                    engine=dict(gdn_prefill_impl="chunked_jax", disable_radix_cache=True, max_recurrent_state_size=48),
                    config=dataclasses.replace(sglang_faults.ENGINE_CONFIG, sweep_interval=0)),
}  # fmt: skip
NUM_REQUESTS = 16
_WORKLOAD = sglang_engine.workload


def family_worker(path: str, *, attention_backend: str, page_size: int, **engine):
    """The engine's ``ModelWorker`` on CPU over a model directory with real weights (no dummy load)."""
    from sgl_jax.srt.managers.tp_worker import ModelWorker
    from sgl_jax.srt.server_args import ServerArgs
    from sgl_jax.srt.utils.mesh_utils import create_device_mesh

    sglang_cpu.install("cpu")
    e = sglang_engine
    args = ServerArgs(
        model_path=path, device="cpu", attention_backend=attention_backend, skip_tokenizer_init=True,
        dtype="bfloat16", page_size=page_size, max_running_requests=e.MAX_RUNNING, max_total_tokens=e.MAX_TOTAL_TOKENS,
        max_prefill_tokens=e.TOKEN_BUCKET, chunked_prefill_size=e.TOKEN_BUCKET, precompile_bs_paddings=[e.MAX_RUNNING],
        precompile_token_paddings=[e.TOKEN_BUCKET], disable_overlap_schedule=True, disable_precompile=True,
        random_seed=0, **engine,
    )  # fmt: skip
    mesh = create_device_mesh(ici_parallelism=[1, 1], dcn_parallelism=[1, 1], devices=jax.devices()[:1])
    return ModelWorker(server_args=args, mesh=mesh)


def concurrent(num: int = NUM_REQUESTS) -> list:
    """The workload's requests, all arriving at once (the scheduler admits 4 a step: all 16 run together)."""
    return [dataclasses.replace(a, step=0) for a in _WORKLOAD(0, num)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    spec = FAMILIES[request.param]
    path = tiny_models.write_arch(tmp_path_factory.mktemp(request.param), arch=request.param)
    worker = family_worker(path, attention_backend=spec["attention_backend"], page_size=spec["page_size"],
                           **spec.get("engine", {}))  # fmt: skip
    return request.param, spec, worker


@pytest.mark.families
def test_clean_concurrent_run_is_silent_and_samples_the_engines_tokens(family, monkeypatch):
    name, spec, worker = family
    assert type(worker.model_runner.token_to_kv_pool).__name__ == spec["pool"]
    sched = sglang_engine.MiniScheduler(worker, concurrent())
    for batch in sched:
        sched.run_batch(batch)
    alone = {r.rid: list(r.output_ids) for r in sched.finished}
    assert len(alone) == NUM_REQUESTS and len({tuple(t) for t in alone.values()}) > 1  # random weights: tokens vary
    monkeypatch.setattr(sglang_engine, "workload", lambda seed, num: concurrent(num))
    run = sglang_faults.run(
        worker, None, num_requests=NUM_REQUESTS, config=spec.get("config", sglang_faults.ENGINE_CONFIG)
    )
    assert run.ok, run.note
    assert run.requests == NUM_REQUESTS
    assert run.cached_tokens > 0 or worker.server_args.disable_radix_cache  # prefix reuse where the engine has it
    assert run.tokens == alone


@pytest.mark.families
@pytest.mark.parametrize("fault", [testing.FaultKind.LIVE_KV, testing.FaultKind.REQ_TO_TOKEN], ids=lambda f: f.value)
def test_faults_are_reported_at_the_injected_slot_request_and_step(family, fault, monkeypatch):
    _, spec, worker = family
    monkeypatch.setattr(sglang_engine, "workload", lambda seed, num: concurrent(num))
    config = spec.get("config", sglang_faults.ENGINE_CONFIG)
    run = sglang_faults.run(worker, fault, num_requests=NUM_REQUESTS, inject_at=6, config=config)
    assert run.injected is not None, "no target to inject into"
    assert run.ok, f"{run.note}: {run}"
    assert (run.detected_step, run.slot, run.rid) == (run.injected.step, run.injected.slot, run.injected.rid)
    assert run.launch_tag == testing.expected_detection(fault)[0].name


# --- the MLA latent row as a real-KV source (no engine) ------------------------------------------------------------


def _as_int(u64) -> np.ndarray:
    lo, hi = (np.asarray(x, np.uint64) for x in u64)
    return hi << np.uint64(32) | lo


@pytest.mark.parametrize("page_size,dtype", [(4, jnp.bfloat16), (3, jnp.bfloat16), (2, jnp.float32)])
@pytest.mark.parametrize("mode", [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL])
def test_mla_source_folds_each_slots_latent_row(page_size, dtype, mode):
    """``[pages, align(page_size, packing) // packing, packing, kv_dim]``: token t of a page is row t // packing,
    lane t % packing; its row is kv_dim values (c_kv then k_pe, each padded to 128)."""
    packing, pages, kv_dim = 4 // jnp.dtype(dtype).itemsize, 5, 256
    rows = -(-page_size // packing)
    shape = (pages, rows, packing, kv_dim)
    size = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    raw = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    kv = jnp.asarray(raw.view(jnp.dtype(dtype)).reshape(shape))
    slots = np.arange(pages * page_size, dtype=np.int32)
    got = _as_int(realkv.fold_slots((_sglang_mapping.mla_source(kv, page_size),), jnp.asarray(slots), int(mode)))
    token_bytes = kv_dim * jnp.dtype(dtype).itemsize
    by_page = raw.reshape(pages, rows * packing * token_bytes)  # token-major: a page's tokens end to end
    read = 16 if mode == kc.RealKvHashMode.PARTIAL else token_bytes
    for s in slots:
        start = (s % page_size) * token_bytes
        want = testing.fold_sources([by_page[s // page_size, start : start + read].tobytes()])
        assert int(got[s]) == want, f"slot {s}"


def test_mla_flip_changes_the_slots_row_only():
    """The drills' flip on an MLA layer changes byte 0 of the slot's latent row and nothing else."""
    pool = type("Pool", (), {})()
    pool.kv_buffer = [jnp.zeros((3, 2, 2, 256), jnp.bfloat16)]
    _sglang_pools.flip_layer0_byte(pool, 6, 4)  # page 1, token 2: row 1, lane 0
    flipped = np.argwhere(np.asarray(pool.kv_buffer[0]).view(np.uint16) != 0)
    assert flipped.tolist() == [[1, 1, 0, 0]]


def _fake_pool(class_name: str, **attrs):
    return type(class_name, (), attrs)()  # pool_view goes by the class's name


def test_pool_views_map_mla_and_hybrid_pools_and_refuse_the_dsa_indexer_by_name():
    mla = _fake_pool("MLATokenToKVPool", kv_buffer=[jnp.zeros((5, 2, 2, 256), jnp.bfloat16)], kv_dim=256,
                     indexer_key_buffer=[])  # fmt: skip
    hybrid = _fake_pool("HybridLinearKVPool", full_kv_pool=mla)
    for pool, name in [(mla, "MLATokenToKVPool"), (hybrid, "HybridLinearKVPool(MLATokenToKVPool)")]:
        view = _sglang_pools.pool_view(type("Runner", (), {"token_to_kv_pool": pool, "page_size": 4})())
        assert (view.name, view.num_slots, view.page_size) == (name, 20, 4)
        assert view.canary_pool(max_rows=4).with_v is False  # MLA: K only
        assert view.arrays(pool)["full"] is mla.kv_buffer[0]  # the hybrid pool's inner (full-attention) pool
    mla.indexer_key_buffer = [jnp.zeros((5, 2, 2, 128), jnp.bfloat16)]
    runner = type("Runner", (), {"token_to_kv_pool": mla, "page_size": 4})()
    with pytest.raises(NotImplementedError, match="the DSA indexer key cache of MLATokenToKVPool"):
        _sglang_pools.pool_view(runner)
