"""End to end on CPU against the real sglang-jax engine: a tiny random Llama, driven by the engine's own helpers.

Skipped where sglang-jax is not installed (it needs Python >= 3.12: ``pip install -e ".[test,sglang-jax]"``), unless
``KVCANARY_REQUIRE_SGLANG_JAX=1`` (CI's sglang-jax leg) makes the missing engine an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import types

import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":  # CI's sglang-jax leg: a broken install must fail, not skip
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")

import kvcanary_jax as kc  # noqa: E402
from kvcanary_jax.demo import sglang_engine, sglang_faults  # noqa: E402
from kvcanary_jax.integrations import _sglang_launches, sglang_jax  # noqa: E402
from kvcanary_jax.runtime import _monitor  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the engine's own (flax .value access)
_JITS = dict(_sglang_launches._LAUNCHES)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """The engine's ModelWorker: tiny Llama config from the package (no hub), random weights, page size 1."""
    path = sglang_engine.write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    return sglang_engine.build_worker(path, page_size=1, seed=0)


def _engine_alone(worker) -> dict:
    sched = sglang_engine.MiniScheduler(worker, sglang_engine.workload(0, 16))
    for batch in sched:
        sched.run_batch(batch)
    return {r.rid: list(r.output_ids) for r in sched.finished}


def test_clean_run_is_silent_and_leaves_the_engine_unchanged(worker, monkeypatch):
    alone = _engine_alone(worker)
    compiled = {name: jit._cache_size() for name, jit in _JITS.items()}
    sized = set()  # (mode, verify capacity) of each forward
    capacity_of = sglang_jax.SglangCanary._verify_capacity

    def record(guard, mwb):
        sized.add((mwb.forward_mode.name, capacity_of(guard, mwb)))
        return capacity_of(guard, mwb)

    monkeypatch.setattr(sglang_jax.SglangCanary, "_verify_capacity", record)
    run = sglang_faults.run(worker, None)
    assert run.ok, run.note
    assert run.steps >= 50 and run.requests >= 8 and run.cached_tokens > 0  # prefix reuse through the radix cache
    assert run.tokens == alone  # same sampled tokens as the engine alone
    added = {name: jit._cache_size() - compiled[name] for name, jit in _JITS.items()}
    # One compile per mode and plan size (a few powers of two), none per step.
    assert added["head"] <= len(sized) and added["tail"] <= len(sized) and added["sweep"] <= 1, (added, sized)
    # The plans follow the batch (at most 16 rows of < 64 tokens here), not the cache_loc bucket (8176 entries).
    assert {c for _, c in sized} <= {256, 512, 1024}, sized


def test_precompile_leaves_no_program_to_compile_while_serving(worker, monkeypatch):
    """``precompile`` (each kind at each plan size, compiled on threads side by side, and the sweep) covers every
    launch a run with prefills, decodes, prefix hits and sweeps makes: no jit compiles after it."""
    wrap, after = sglang_jax.wrap, {}

    def wrap_and_precompile(*args, **kwargs):
        guard = wrap(*args, **kwargs)
        after["precompiled"] = guard.precompile()
        after["programs"] = guard.compiled_programs()
        return guard

    monkeypatch.setattr(sglang_jax, "wrap", wrap_and_precompile)
    run = sglang_faults.run(worker, None)
    assert run.ok, run.note
    assert after["programs"] == {name: jit._cache_size() for name, jit in _JITS.items()}
    assert after["programs"]["head"] >= 2 and after["programs"]["sweep"] >= 1


def test_a_step_is_two_launches_the_monitor_launches_none(worker, monkeypatch):
    """HEAD and TAIL (and the sweep when due); the monitor reads the snapshot the last of them returned. Before: a
    third launch per step, the monitor's own snapshot (it still takes one in final_check: the hook sees it)."""
    launches = [[]]  # per monitor step (a new list at each after_step), the canary's launches by name
    counted = lambda name, fn: lambda *a, **k: launches[-1].append(name) or fn(*a, **k)  # noqa: E731
    for name, fn in _sglang_launches._LAUNCHES.items():
        monkeypatch.setitem(_sglang_launches._LAUNCHES, name, counted(name, fn))
    monkeypatch.setattr(_monitor, "_snapshot", counted("monitor snapshot", _monitor._snapshot))
    after_step = kc.CanaryMonitor.after_step
    monkeypatch.setattr(kc.CanaryMonitor, "after_step", lambda *a, **k: after_step(*a, **k) or launches.append([]))
    run = sglang_faults.run(worker, None)
    assert run.ok, run.note
    *steps, final = launches
    interval = sglang_faults.ENGINE_CONFIG.sweep_interval
    assert len(steps) == run.steps >= 50
    assert steps == [["head", "tail"] + ["sweep"] * (i % interval == 0) for i in range(run.steps)], steps
    assert final == ["monitor snapshot"]  # final_check's own, through the same hook


@pytest.mark.parametrize("fault", sglang_faults.FAULTS, ids=lambda f: f.value)
def test_each_fault_is_reported_at_its_slot_request_and_step(worker, fault):
    run = sglang_faults.run(worker, fault)
    assert run.injected is not None, "no target to inject into"
    assert run.ok, f"{run.note}: {run}"
    assert run.detected_step == run.injected.step
    assert run.slot == run.injected.slot
    assert run.rid == run.injected.rid  # None for the idle-cache slot: no request holds it
    tag, _, _ = kc.testing.expected_detection(fault)
    assert run.launch_tag == tag.name


@pytest.mark.parametrize("fault", sglang_faults.FAULTS[:3], ids=lambda f: f.value)
def test_log_mode_reports_one_corruption_once_not_every_step(worker, fault, caplog):
    """Before: in log mode (a server's), one corruption was reported again at every step that read the slot: 11-12
    blocks for a flipped byte, 100s for a remapped entry or a token swap. Now: one headline with SGLang's block of
    its root row; the rows the incident explains later come back as one-line counts."""
    config = dataclasses.replace(sglang_faults.ENGINE_CONFIG, mode="log")
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        run = sglang_faults.run(worker, fault, config=config)
    assert run.injected is not None and run.ok, f"{run.note}: {run}"
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-canary incident #")]
    (headline, *counts) = messages
    assert headline.startswith("kv-canary incident #1: ") and headline.count("\nkv_canary violation: ") == 1
    head = headline.split("\nkv_canary violation: ")[0]  # the incident's own lines (a swap names both requests)
    assert head.splitlines()[0].endswith(f", written at step {run.injected.step}")
    assert re.search(rf"slot {run.injected.slot}\b", head), head
    count = (r"kv-canary incident #1: \d+ more row\(s\) at step \d+ \(\d+ in all(, \d+ repeat\(s\) not shown)?\): the "
             r"same fault, already reported")  # repeats: rows equal to one read before, but for the launch tag
    assert all(re.fullmatch(count, m) for m in counts), counts
    rows = int(re.search(r"\((\d+) in all", counts[-1]).group(1)) if counts else 1
    assert rows > len(messages), f"{rows} rows, {len(messages)} messages: later rows are counted, not re-reported"


def test_pages_of_four_tokens_run_silent_and_catch_every_fault(tmp_path_factory):
    """A paged KV cache (sglang-jax's page_size=4): slots are page * 4 + offset, prefixes are shared by whole pages."""
    path = sglang_engine.write_tiny_llama(tmp_path_factory.mktemp("tiny_llama_p4"))
    paged = sglang_engine.build_worker(path, page_size=4, seed=0)
    clean = sglang_faults.run(paged, None)
    assert clean.ok and clean.cached_tokens > 0, clean.note
    for fault in sglang_faults.FAULTS:
        run = sglang_faults.run(paged, fault)
        assert run.injected is not None and run.ok, f"{fault}: {run.note}: {run}"
        assert (run.detected_step, run.slot, run.rid) == (run.injected.step, run.injected.slot, run.injected.rid)


def test_the_token_asserts_need_the_requests(worker):
    sched = sglang_engine.MiniScheduler(worker, sglang_engine.workload(0, 2))
    with sglang_jax.wrap(worker, sglang_faults.ENGINE_CONFIG, tree_cache=sched.tree_cache):
        with pytest.raises(ValueError, match=r"call guard.expect\(schedule_batch\) before each forward"):
            sched.run_batch(next(iter(sched)))
    assert not isinstance(getattr(worker.model_runner.forward, "__self__", None), sglang_jax.SglangCanary)


def test_unmapped_set_ups_are_refused_by_name(worker):
    config = kc.CanaryConfig(sweep_interval=0)
    sglang_engine.MiniScheduler(worker, [])  # a cold engine: empty pools
    with pytest.raises(TypeError, match="config must be a kvcanary_jax.CanaryConfig"):
        sglang_jax.wrap(worker, {"mode": "raise"})
    with pytest.raises(ValueError, match="pass tree_cache="):
        sglang_jax.wrap(worker, kc.CanaryConfig(sweep_interval=10))
    for width in (0, True, 8, worker.model_runner.model_config.context_len - 1):
        with pytest.raises(ValueError, match=rf"table_width must be a positive int of at least the engine's longest "
                                             rf"request \(model_config.context_len=\d+\); got table_width={width!r}"):
            sglang_jax.wrap(worker, config, table_width=width)
    speculative = [({"speculative_algorithm": a}, rf"speculative decoding \(speculative_algorithm='{a}': .*{why}")
                   for a, why in [("EAGLE", "get_eagle_forward_metadata"), ("EAGLE3", "native attention"),
                                  ("NEXTN", "DRAFT_EXTEND"), ("STANDALONE", "builds no draft worker"),
                                  ("DFLASH", "Pallas TPU kernel")]]  # fmt: skip
    for change, message in speculative:  # DP: _sglang_parallel
        other = types.SimpleNamespace(model_runner=worker.model_runner,
                                      forward_batch_generation=worker.forward_batch_generation,
                                      server_args=types.SimpleNamespace(**{**vars(worker.server_args), **change}))  # fmt: skip
        with pytest.raises(NotImplementedError, match=message):
            sglang_jax.wrap(other, config)
    with sglang_jax.wrap(worker, config) as guard:
        with pytest.raises(ValueError, match="wrapped already"):
            sglang_jax.wrap(worker, config)
        from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

        for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):  # a spec forward reaching the runner
            with pytest.raises(NotImplementedError, match=rf"got {mode.name} \(speculative decoding is not mapped\)"):
                worker.model_runner.forward(types.SimpleNamespace(forward_mode=mode, bid=0))
        assert guard.steps == 0


def test_a_warm_engine_is_refused_by_name(worker):
    """An engine that served unwrapped holds slots with no records: wrapping it would report them all as corrupt."""
    sched = sglang_engine.MiniScheduler(worker, sglang_engine.workload(0, 4))
    batches = iter(sched)
    for _ in range(3):
        sched.run_batch(next(batches))
    with pytest.raises(ValueError, match=r"cannot wrap a warm engine: it holds \d+ live request\(s\)"):
        sglang_jax.wrap(worker, kc.CanaryConfig(sweep_interval=10), tree_cache=sched.tree_cache)
    assert not isinstance(getattr(worker.model_runner.forward, "__self__", None), sglang_jax.SglangCanary)
