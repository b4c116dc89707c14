"""Served, across the engine's settings: the canary changes no token, and every valid configuration serves.

* Token equality: with the batch composition fixed (requests sent one at a time), the overlap scheduler's greedy
  tokens with the canary on (real KV ``all``, a sweep every 2 steps) equal the engine's alone, at page sizes 1, 4 and
  16 (one of them in a single process).
* A matrix of engine settings the tests elsewhere never set: no overlap scheduler, odd batch and token buckets, more
  rows than any bucket: each serves concurrent completions with no violation and compiles nothing after startup.

The servers run with XLA's backend optimisations off (``JAX_DISABLE_MOST_OPTIMIZATIONS``, both sides alike): their
programs compile in a fraction of the time; the tokens compared come from the same setting.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")
pytest.importorskip("openai")

from kvcanary_jax.integrations import tiny_llama  # noqa: E402
from tests.integrations.serve_testlib import PREFIXES, Server  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.serve]
_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
_SMALL = ("--context-length", "128", "--max-running-requests", "4", "--max-total-tokens", "1024",
          "--chunked-prefill-size", "256", "--disable-precompile", "--precompile-bs-paddings", "2", "4", "--random-seed", "0",
          "--skip-server-warmup")  # fmt: skip
# Shared prefixes (radix-cache hits), one prompt repeated (a whole-prompt hit), lengths across a page.
_PROMPTS = [PREFIXES[0], PREFIXES[0] + " Again", PREFIXES[1], PREFIXES[1] + " and more", PREFIXES[0], "Hi"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama.write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def _served(model_dir, log, engine, *canary) -> tuple[list[str], Server]:
    server = Server(model_dir, log, _ENV, *canary, engine=engine)
    try:
        texts = server.one_at_a_time(_PROMPTS, max_tokens=12)
    finally:
        server.interrupt()
    return texts, server


@pytest.mark.parametrize(
    "page_size, extra",
    [(1, ("--enable-single-process",)), (4, ()), (16, ())],
    ids=["page1-single-process", "page4", "page16"],
)
def test_the_canary_changes_no_token_under_the_overlap_scheduler(model_dir, tmp_path, page_size, extra):
    engine = (*_SMALL, "--page-size", str(page_size), *extra)
    alone, _ = _served(model_dir, tmp_path / "off.log", engine, "--canary-mode", "off")
    guarded, server = _served(model_dir, tmp_path / "on.log", engine, "--canary-mode", "log", "--canary-real-kv",
                              "all", "--canary-sweep-interval", "2")  # fmt: skip
    assert "overlap=True" in server.text()
    assert guarded == alone
    assert len(set(alone)) > 1 and all(alone)  # real, varied text: the comparison can fail
    assert server.summary() == (0, 0, 0)


@pytest.mark.parametrize(
    "engine",
    [
        ("--page-size", "16", "--max-running-requests", "8", "--disable-overlap-schedule", "--chunked-prefill-size", "64", "--max-prefill-tokens",
         "64", "--precompile-token-paddings", "64"),
        ("--page-size", "2", "--max-running-requests", "12", "--precompile-bs-paddings", "3", "5", "12",
         "--precompile-token-paddings", "96", "160"),
    ],
    ids=["no-overlap-chunked-page16", "odd-buckets-page2"],
)  # fmt: skip
def test_engine_settings_serve_with_no_violation_and_no_compile(model_dir, tmp_path, engine):
    base = ("--context-length", "128", "--max-total-tokens", "2048", "--disable-precompile", "--random-seed", "0",
            "--skip-server-warmup")  # fmt: skip
    if "--precompile-bs-paddings" not in engine:
        base += ("--precompile-bs-paddings", "2", "4", "8", "16")
    server = Server(model_dir, tmp_path / "server.log", _ENV, "--canary-mode", "log", engine=(*base, *engine))
    try:
        results = server.completions(16, max_tokens=lambda i: 3 + i % 6)
    finally:
        server.interrupt()
    assert not [r for r in results if isinstance(r, BaseException)], server.text()[-3000:]
    assert server.summary() == (0, 0, 0), server.text()[-3000:]
