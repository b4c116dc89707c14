"""End to end: ``python -m kvcanary_jax serve sglang-jax`` as a real server process (default overlap scheduler) on
CPU, a tiny random Llama from ``tiny-model``, 24 concurrent completions through the ``openai`` client over HTTP.

One server per scenario (a clean run, a drill in log mode, raise mode), each kept small: page size 4, short prompts
on two shared prefixes, a few new tokens, one padding bucket per mode, one JAX compilation cache for all three.
Skipped where sglang-jax is not installed, unless
``KVCANARY_REQUIRE_SGLANG_JAX=1`` (CI's sglang-jax leg).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")
openai = pytest.importorskip("openai")

from kvcanary_jax.integrations import sglang_server, tiny_llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
_PREFIXES = ("The quick brown fox jumps over the lazy dog.", "A KV cache holds the keys and values of every token")
_START_S, _RUN_S = 600, 900


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama.write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One JAX compilation cache for the module's servers: same model, buckets and canary config (raise mode runs
    the monitor in log mode), so only the first server compiles."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m kvcanary_jax serve sglang-jax ...`` as a subprocess, its output in a file."""

    def __init__(self, model_dir, log_path, env, *canary_args, page_size=4):
        self.port, self.log_path = _free_port(), log_path
        cmd = [sys.executable, "-m", "kvcanary_jax", "serve", "sglang-jax", "--model-path", model_dir,
               "--device", "cpu", "--attention-backend", "native", "--host", "127.0.0.1", "--port", str(self.port),
               "--page-size", str(page_size), "--max-running-requests", "16", "--max-total-tokens", "2048",
               "--chunked-prefill-size", "128", "--max-prefill-tokens", "128", "--precompile-bs-paddings", "16",
               "--precompile-token-paddings", "128", "--disable-precompile", "--enable-metrics", "--random-seed", "0",
               "--skip-server-warmup", *canary_args]  # fmt: skip
        self.log = open(log_path, "w")
        path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **env, "PYTHONPATH": path}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"server not up in {_START_S} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict:
        """``kvcanary_*`` samples: name with labels -> value."""
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30).read().decode()
        lines = (line.rsplit(" ", 1) for line in body.splitlines() if line.startswith("kvcanary_"))
        return {k: float(v) for k, v in lines}

    def completions(self, n: int = 24) -> list:
        """``n`` concurrent completions: two shared prefixes, prompts and outputs of different lengths."""
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                               timeout=_RUN_S)  # fmt: skip

        def one(i):
            prompt = f"{_PREFIXES[i % 2]}{' and then' * (i % 4)} {i}"
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=4 + i % 5, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            return [f.exception() or f.result() for f in futures]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _total(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def test_clean_run_serves_every_request_with_no_violation(model_dir, compile_cache, tmp_path):
    server = Server(model_dir, tmp_path / "server.log", compile_cache, "--canary-mode", "log")
    try:
        results = server.completions()
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4 + i % 5
                   for i, r in enumerate(results))  # fmt: skip
        time.sleep(2)
        metrics = server.metrics()
        assert _total(metrics, "kvcanary_violations_total") == 0, metrics
        assert _total(metrics, "kvcanary_protected_tokens_total") > 0, metrics
        assert _total(metrics, "kvcanary_checks_total") > 0, metrics
        assert "kvcanary on: mode=log" in server.text() and "overlap=True page_size=4" in server.text()
        assert "kvcanary violation" not in server.text()
    finally:
        server.stop()


def test_a_token_swap_drill_is_caught_under_overlap_and_counted(model_dir, compile_cache, tmp_path):
    drill = ("--canary-mode", "log", "--canary-inject", "token_swap:0.5")
    server = Server(model_dir, tmp_path / "server.log", compile_cache, *drill)
    try:
        results = server.completions()
        assert not [r for r in results if isinstance(r, BaseException)]  # log mode keeps serving
        time.sleep(2)
        metrics = server.metrics()
        text = server.text()
    finally:
        server.stop()
    assert "kvcanary DRILL ON: token_swap" in text
    injected = set(re.findall(r"kvcanary drill injected token_swap: rid=(\S+) other=(\S+)", text))
    assert injected, text[-3000:]
    named = set(re.findall(r"kvcanary violation: rid=(\S+) slot=\d+ step=\d+ launch=(\S+)", text))
    assert named, text[-3000:]
    rids = {rid for pair in injected for rid in pair}
    assert {rid for rid, _ in named} & rids, (named, injected)
    assert _total(metrics, "kvcanary_violations_total") >= 1, metrics


def test_raise_mode_stops_the_server_with_the_violation_last(model_dir, compile_cache, tmp_path):
    drill = ("--canary-mode", "raise", "--canary-inject", "live_kv:1.0")
    server = Server(model_dir, tmp_path / "server.log", compile_cache, *drill)
    try:
        results = server.completions(8)
        server.proc.wait(120)
    finally:
        code = server.stop()
    assert code == sglang_server.EXIT_VIOLATION
    assert any(isinstance(r, BaseException) for r in results)  # in-flight requests saw the server go
    lines = [line for line in server.text().splitlines() if line.strip()]
    assert "kvcanary violation: rid=" in lines[-1], lines[-5:]
