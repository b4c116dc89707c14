"""``python -m kvcanary_jax serve sglang-jax ...`` as a real server process for the served tests, spoken to over HTTP.

Each server is its own process group, so :meth:`Server.interrupt` is what a Ctrl-C in a terminal sends: SIGINT to the
server and to the engine's processes at once.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai

START_S, RUN_S = 600, 900
PREFIXES = ("The quick brown fox jumps over the lazy dog.", "A KV cache holds the keys and values of every token")
# What a user of a small CPU machine passes (README.md's serve command, page size 1 as there): a small KV pool, the
# engine's default buckets less its one-row batch, whose decode sglang-jax fails to compile on CPU (ShardingTypeError,
# canary or not), and no engine precompile (it compiles that batch). The canary precompiles its own programs.
CPU_WORKAROUND = ("--disable-precompile", "--precompile-bs-paddings", "2", "4", "8", "16")
ENGINE = ("--page-size", "1", "--max-running-requests", "16", "--max-total-tokens", "4096", *CPU_WORKAROUND,
          "--enable-metrics", "--random-seed", "0", "--skip-server-warmup")  # fmt: skip
SUMMARY = re.compile(r"kvcanary summary: violations=(\d+) incidents=(\d+) .* compiles_while_serving=(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The server as a subprocess (its own process group), its output in ``log_path``."""

    def __init__(self, model_dir, log_path, env: dict, *canary_args: str, engine: tuple[str, ...] = ENGINE):
        self.port, self.log_path = free_port(), log_path
        cmd = [sys.executable, "-m", "kvcanary_jax", "serve", "sglang-jax", "--model-path", str(model_dir),
               "--device", "cpu", "--attention-backend", "native", "--host", "127.0.0.1", "--port", str(self.port),
               *engine, *canary_args]  # fmt: skip
        self.log = open(log_path, "w")
        path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **env, "PYTHONPATH": path}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise AssertionError(f"server not up in {START_S} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict:
        """``kvcanary_*`` samples: name with labels -> value."""
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30).read().decode()
        lines = (line.rsplit(" ", 1) for line in body.splitlines() if line.startswith("kvcanary_"))
        return {k: float(v) for k, v in lines}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                             timeout=RUN_S)  # fmt: skip

    def completions(self, n: int = 24, *, max_tokens=lambda i: 4 + i % 5) -> list:
        """``n`` concurrent greedy completions: two shared prefixes, prompts and outputs of different lengths."""
        client = self.client()

        def one(i):
            prompt = f"{PREFIXES[i % 2]}{' and then' * (i % 4)} {i}"
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens(i), temperature=0)

        try:  # alone: the client builds its response models on first use (a race when 24 threads do)
            first = [one(0)]
        except Exception as err:  # noqa: BLE001  (returned as the others are: a raise-mode server may stop)
            first = [err]
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(1, n)]
            return first + [f.exception() or f.result() for f in futures]

    def one_at_a_time(self, prompts: list[str], max_tokens: int) -> list[str]:
        """Greedy completions sent one after another: each batch holds one request, whatever the timing."""
        client = self.client()
        return [client.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, temperature=0)
                .choices[0].text for p in prompts]  # fmt: skip

    def interrupt(self) -> int:
        """A Ctrl-C: SIGINT to the whole process group; waits for the server to exit."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self._wait()

    def stop(self) -> int:
        """SIGTERM to the server (as a process manager stops it); waits for it to exit."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return self._wait()

    def _wait(self, wait_s: float = 120) -> int:
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def summary(self) -> tuple[int, int, int]:
        """The shutdown summary line's (violations, incidents, compiles while serving); it must be there."""
        found = SUMMARY.findall(self.text())
        assert len(found) == 1, f"expected one summary line, got {found}:\n{self.text()[-3000:]}"
        return tuple(map(int, found[0]))


def total(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
