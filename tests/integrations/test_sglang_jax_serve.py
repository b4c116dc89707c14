"""End to end: ``python -m kvcanary_jax serve sglang-jax`` as a real server process (default overlap scheduler) on
CPU, a tiny random Llama from ``tiny-model``, completions through the ``openai`` client over HTTP.

The servers run as a user of a small machine runs them (serve_testlib.ENGINE): the engine's default batch and token
buckets, its default chunked prefill. One server per scenario (a clean run, drills in log mode, raise mode), one JAX
compilation cache for all. Skipped where sglang-jax is not installed, unless ``KVCANARY_REQUIRE_SGLANG_JAX=1`` (CI's
sglang-jax leg).
"""

from __future__ import annotations

import os
import re
import time

import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")
pytest.importorskip("openai")

from kvcanary_jax.integrations import sglang_server, tiny_llama  # noqa: E402
from tests.integrations.serve_testlib import Server, total  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.serve]
_VIOLATION = re.compile(r"kvcanary violation: rid=(\S+) slot=(\d+) step=(\d+) launch=(\S+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama.write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def env():
    """The servers' programs are compiled once per run (the suite's JAX cache, which they inherit)."""
    return {}


def test_default_buckets_serve_every_request_with_no_violation_and_no_compile(model_dir, env, tmp_path):
    server = Server(model_dir, tmp_path / "server.log", env, "--canary-mode", "log")
    try:
        before = server.metrics()  # before any request: every counter is there, at 0
        assert {k: v for k, v in before.items() if k.endswith("_total")} == {
            "kvcanary_violations_total": 0.0, "kvcanary_protected_tokens_total": 0.0, "kvcanary_checks_total": 0.0,
        }, before  # fmt: skip
        results = server.completions(24)  # batches of 16 and fewer rows: the engine pads them to 1, 2, 4, 8 or 16
        results += server.completions(1)  # one row alone
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4 + i % 5
                   for i, r in enumerate(results[:24]))  # fmt: skip
        time.sleep(2)
        metrics = server.metrics()
        assert total(metrics, "kvcanary_violations_total") == 0, metrics
        assert total(metrics, "kvcanary_protected_tokens_total") > 0, metrics
        assert total(metrics, "kvcanary_checks_total") > 0, metrics
    finally:
        server.interrupt()
    text = server.text()
    assert "kvcanary on: mode=log" in text and "overlap=True page_size=1" in text
    assert re.search(r"kvcanary precompiled \d+ programs in [\d.]+ s", text), text[-3000:]
    assert "kvcanary violation" not in text
    violations, incidents, compiles = server.summary()
    assert (violations, incidents, compiles) == (0, 0, 0)  # no canary program compiled after startup


def test_sigint_right_after_the_last_answer_reports_every_injected_slot_then_the_summary(model_dir, env, tmp_path):
    server = Server(model_dir, tmp_path / "server.log", env, "--canary-mode", "log", "--canary-inject", "live_kv:0.5")
    try:
        results = server.completions(16, max_tokens=lambda i: 6 + i % 5)
        assert not [r for r in results if isinstance(r, BaseException)]
    finally:
        server.interrupt()  # at once: the last steps' checks are still pending
    text = server.text()
    injected = re.findall(r"kvcanary drill injected live_kv: rid=(\S+) position=\d+ slot=(\d+) step=(\d+)", text)
    assert len(injected) >= 2, text[-3000:]
    named = {(rid, slot) for rid, slot, _, _ in _VIOLATION.findall(text)}
    assert {(rid, slot) for rid, slot, _ in injected} <= named, (injected, named)
    assert text.rindex("kvcanary violation:") < text.index("kvcanary summary:")
    violations, incidents, _ = server.summary()
    assert violations >= len(injected) and incidents >= 1


@pytest.mark.parametrize("prob", [0.3])
def test_every_token_swap_drill_is_named_at_its_step(model_dir, env, tmp_path, prob):
    drill = ("--canary-mode", "log", "--canary-inject", f"token_swap:{prob}")
    server = Server(model_dir, tmp_path / "server.log", env, *drill)
    try:
        for _ in range(3):  # > 100 steps: the ring is read and re-armed many times, repeats are folded
            results = server.completions(16, max_tokens=lambda i: 24 + i % 9)
            assert not [r for r in results if isinstance(r, BaseException)]  # log mode keeps serving
        time.sleep(2)
        metrics = server.metrics()
    finally:
        server.interrupt()
    text = server.text()
    assert "kvcanary DRILL ON: token_swap" in text
    injected = re.findall(r"kvcanary drill injected token_swap: rid=(\S+) other=(\S+) step=(\d+)", text)
    # Under the overlap scheduler the drill swaps two placeholders; where both stood for the same token it changed
    # nothing, and the drill says so (the forward's thread read them): those are not drills to name.
    void = set(re.findall(r"kvcanary drill token_swap had no effect: rid=(\S+) other=(\S+) step=(\d+)", text))
    assert len(void) <= len(injected) // 4, (void, len(injected))  # an exception, not the rule
    injected = [drill for drill in injected if drill not in void]
    assert len(injected) >= 10, text[-3000:]
    named = [(rid, int(step)) for rid, _, step, _ in _VIOLATION.findall(text)]
    missed = [(a, b, s) for a, b, s in injected
              if not any(rid in (a, b) and int(s) <= step <= int(s) + 2 for rid, step in named)]  # fmt: skip
    assert not missed, (missed, len(injected))
    assert total(metrics, "kvcanary_violations_total") >= len(injected), metrics


def test_raise_mode_stops_the_server_with_the_violation_last(model_dir, env, tmp_path):
    drill = ("--canary-mode", "raise", "--canary-inject", "live_kv:1.0")
    server = Server(model_dir, tmp_path / "server.log", env, *drill)
    try:
        results = server.completions(8)
        server.proc.wait(120)
    finally:
        code = server.stop()
    assert code == sglang_server.EXIT_VIOLATION
    assert any(isinstance(r, BaseException) for r in results)  # in-flight requests saw the server go
    lines = [line for line in server.text().splitlines() if line.strip()]
    assert "kvcanary violation: rid=" in lines[-1], lines[-5:]
