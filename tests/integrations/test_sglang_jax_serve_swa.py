"""End to end over HTTP on a sliding-window model: ``serve sglang-jax`` (default overlap scheduler) on CPU with the
tiny random Gemma 2 of ``tiny-model --arch gemma2`` (window 8: every completion here crosses it), its hybrid
``SWAKVPool`` under the canary, the engine's native attention given its SWA path by ``--canary-native-swa``.
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

from kvcanary_jax.integrations import tiny_models  # noqa: E402
from tests.integrations.serve_testlib import Server, total  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.serve, pytest.mark.families]
_VIOLATION = re.compile(r"kvcanary violation: rid=(\S+) slot=(\d+) step=(\d+) launch=(\S+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_models.write_arch(tmp_path_factory.mktemp("tiny_gemma2"), arch="gemma2")


def test_gemma2_serves_silent_then_a_live_kv_drill_is_named(model_dir, tmp_path):
    server = Server(model_dir, tmp_path / "clean.log", {}, "--canary-mode", "log", "--canary-native-swa")
    try:
        results = server.completions(16, max_tokens=lambda i: 20 + i % 7)  # 16 at once, each past the window
        assert not [r for r in results if isinstance(r, BaseException)]
        assert all(r.usage.completion_tokens == 20 + i % 7 for i, r in enumerate(results))
        time.sleep(2)
        metrics = server.metrics()
    finally:
        server.interrupt()
    text = server.text()
    assert "Tree cache initialized: impl=SWARadixCache hybrid_swa=True" in text  # the engine's SWA pool and tree
    assert "kvcanary on: mode=log" in text and "kvcanary violation" not in text, text[-3000:]
    assert total(metrics, "kvcanary_violations_total") == 0 and total(metrics, "kvcanary_protected_tokens_total") > 0
    assert server.summary() == (0, 0, 0)

    drill = ("--canary-mode", "log", "--canary-native-swa", "--canary-inject", "live_kv:0.5")
    server = Server(model_dir, tmp_path / "drill.log", {}, *drill)
    try:
        results = server.completions(16, max_tokens=lambda i: 12 + i % 5)
        assert not [r for r in results if isinstance(r, BaseException)]
    finally:
        server.interrupt()
    text = server.text()
    injected = re.findall(r"kvcanary drill injected live_kv: rid=(\S+) position=\d+ slot=(\d+) step=(\d+)", text)
    assert injected, text[-3000:]
    named = {(rid, slot) for rid, slot, _, _ in _VIOLATION.findall(text)}
    assert {(rid, slot) for rid, slot, _ in injected} <= named, (injected, named)
