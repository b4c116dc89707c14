"""Serving cost of the canary: ``python -m kvcanary_jax serve sglang-jax`` with the canary off, on (default options)
and on with ``--canary-real-kv all``, driven by a real streaming async client.

Each config is a server subprocess of its own, started in turn and interleaved over ``--rounds`` (off, on, all, off,
on, all, ...). Against each, for every concurrency level: a warm-up wave of ``c`` requests like the measured ones
(unmeasured: the engine under ``--disable-precompile``, and the canary, compile new padding buckets lazily), then ``max(waves * c, min_requests)`` streaming ``/v1/completions`` requests, ``c``
at a time: prompts of exactly ``--prompt-len`` token ids (a share of them a prefix common to a few groups, so the
radix cache has hits), ``--output-len`` new tokens each, greedy, ``ignore_eos``.

Per config and concurrency it prints output tokens/s (all requests' tokens over the level's wall time), TTFT p50/p99
(send to first streamed chunk), ITL p50/p99 (gaps between streamed chunks; one token each at the engine's default
``stream_interval`` 1, but chunks arrive in bursts when the server or client falls behind: ITL p50 then reads ~0),
TPOT p50/p99 (per request: first to last chunk over its tokens - 1, burst-proof), and per config the warm-up waves'
time (lazy compiles of new padding buckets land there), and the server's start to its first answer and
the compile times the server log states (the engine's ``[EXTEND]/[DECODE] Precompile finished in N secs``, any
``kvcanary`` line naming a compile time; "n/a" otherwise), with ratios against ``off``. Writes every sample to
``--out`` (JSON).

CPU (the tiny model; the engine's CPU decode precompile is broken, hence ``--disable-precompile`` in the preset)::

    python -m kvcanary_jax tiny-model /tmp/tiny
    PYTHONPATH=. python benchmarks/bench_serve.py --model-path /tmp/tiny --preset cpu --rounds 1 --out serve_cpu.json

GPU (a Llama-3.2-1B-shaped model with dummy weights)::

    python -m kvcanary_jax tiny-model /tmp/llama1b --size 1b
    PYTHONPATH=. python benchmarks/bench_serve.py --model-path /tmp/llama1b --preset gpu --out serve_gpu.json

Engine flags: the preset's (see ``PRESETS``), then ``--page-size`` & co., then ``--engine-args "..."`` and whatever
follows ``--``, all passed through to sglang-jax's ``launch_server`` (a later flag wins).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = {"off": ["--canary-mode", "off"], "on": [], "all": ["--canary-real-kv", "all"]}

# workload and engine flags per preset; "engine" flags are sglang-jax's launch_server arguments
PRESETS = {
    "cpu": {
        "concurrency": "1,4,16", "prompt_len": 64, "output_len": 16,
        "engine": ["--device", "cpu", "--attention-backend", "native", "--skip-server-warmup", "--disable-precompile",
                   "--page-size", "4", "--max-running-requests", "16", "--max-total-tokens", "4096",
                   "--context-length", "256", "--chunked-prefill-size", "256", "--max-prefill-tokens", "256",
                   "--precompile-bs-paddings", "16", "--precompile-token-paddings", "256", "--random-seed", "0"],
    },
    "gpu": {
        "concurrency": "1,16,64", "prompt_len": 512, "output_len": 256,
        "engine": ["--device", "gpu", "--attention-backend", "native", "--skip-server-warmup", "--page-size", "16",
                   "--max-running-requests", "64", "--max-total-tokens", "131072", "--context-length", "1024",
                   "--chunked-prefill-size", "4096", "--max-prefill-tokens", "4096",
                   "--precompile-bs-paddings", "1", "16", "64", "--precompile-token-paddings", "512", "4096",
                   "--random-seed", "0"],
    },
}  # fmt: skip

_ENGINE_COMPILE = re.compile(r"\[(EXTEND|DECODE)\] Precompile finished in ([0-9.]+) secs")
# the serve log's startup line: "kvcanary precompiled 17 programs in 37.5 s (...)"
_CANARY_COMPILE = re.compile(r"kvcanary precompiled \d+ programs in ([0-9]+(?:\.[0-9]+)?) (ms|s)\b")


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


# --- the server ----------------------------------------------------------------------------------------------------


class Server:
    """``python -m kvcanary_jax serve sglang-jax ...`` as a subprocess, its output in a log file."""

    def __init__(self, args, engine: list[str], canary: list[str], log_path: pathlib.Path):
        self.port, self.log_path = _free_port(), log_path
        self.cmd = [args.python, "-m", "kvcanary_jax", "serve", "sglang-jax", "--model-path", args.model_path,
                    "--host", "127.0.0.1", "--port", str(self.port), *engine, *canary]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        env |= dict(kv.split("=", 1) for kv in args.server_env)
        if args.compile_cache:  # shared by every server of the run: later servers load what earlier ones compiled
            env |= {"JAX_COMPILATION_CACHE_DIR": args.compile_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}  # fmt: skip
        self.log = open(log_path, "w")
        self.log.write("$ " + shlex.join(self.cmd) + "\n")
        self.log.flush()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_first_answer(self, timeout: float) -> float:
        """Seconds from the process start to its first completion answered (health first, then one token)."""
        deadline = self.t0 + timeout
        body = json.dumps({"model": "bench", "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}).encode()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})  # fmt: skip
                urllib.request.urlopen(req, timeout=max(1.0, deadline - time.monotonic())).read()
                return time.monotonic() - self.t0
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"server not answering after {timeout:.0f} s")

    def stop(self) -> int | None:
        """Stops the server and its process group (the engine's scheduler and detokenizer children)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: whatever it left behind
        except ProcessLookupError:
            pass
        self.log.close()
        return self.proc.returncode


def log_compile_times(text: str) -> dict:
    """What the server log states about compile time: the engine's precompile per mode, the canary's (if any)."""
    engine = {}
    for mode, secs in _ENGINE_COMPILE.findall(text):
        engine[mode.lower()] = engine.get(mode.lower(), 0.0) + float(secs)
    canary = []
    for line in text.splitlines():
        m = _CANARY_COMPILE.search(line)
        if m:
            canary.append(float(m.group(1)) / (1000.0 if m.group(2).lower() == "ms" else 1.0))
    return {"engine_precompile_s": engine or None, "canary_compile_s": sum(canary) if canary else None,
            "canary_compile_lines": [ln for ln in text.splitlines() if _CANARY_COMPILE.search(ln)][:20]}  # fmt: skip


# --- the client ----------------------------------------------------------------------------------------------------


class Prompts:
    """Prompts of exactly ``length`` token ids: ``groups`` shared prefixes of ``shared * length`` tokens, then a
    suffix of their own (never repeated across the run)."""

    def __init__(self, length: int, vocab: int, shared: float, groups: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.length, self.vocab = length, vocab
        n_shared = int(length * shared)
        self.prefixes = [self.rng.integers(3, vocab, n_shared).tolist() for _ in range(max(1, groups))]
        self.count = 0

    def next(self) -> list[int]:
        prefix = self.prefixes[self.count % len(self.prefixes)]
        self.count += 1
        return prefix + self.rng.integers(3, self.vocab, self.length - len(prefix)).tolist()


async def one_request(client, url: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    chunks, tokens, error = [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg or msg.get("object") == "error":
                    error = str(msg)[:300]
                if msg.get("choices"):
                    chunks.append(time.perf_counter())
                if msg.get("usage"):
                    tokens = msg["usage"].get("completion_tokens")
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"}
    if error or not chunks:
        return {"error": error or "no chunk streamed"}
    n = tokens if tokens is not None else len(chunks)
    return {"ttft": chunks[0] - t0, "itl": [b - a for a, b in zip(chunks, chunks[1:], strict=False)],
            "tpot": (chunks[-1] - chunks[0]) / (n - 1) if n > 1 else None, "latency": chunks[-1] - t0,
            "tokens": n, "chunks": len(chunks)}  # fmt: skip


async def run_level(url: str, prompts: Prompts, concurrency: int, n_requests: int, output_len: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        queue = [prompts.next() for _ in range(n_requests)]
        results: list[dict] = []

        async def worker():
            while queue:
                results.append(await one_request(client, url, queue.pop(), output_len))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "requests": n_requests, "ok": len(ok), "errors": errors[:5],
            "n_errors": len(errors), "wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall if wall else 0.0,
            "chunks": sum(r["chunks"] for r in ok), "ttft_s": ttft, "itl_s": itl,
            "tpot_s": [r["tpot"] for r in ok if r["tpot"] is not None]}  # fmt: skip


# --- the run -------------------------------------------------------------------------------------------------------


def engine_args(args) -> list[str]:
    out = list(PRESETS[args.preset]["engine"]) if args.preset else []
    flags = {"--page-size": args.page_size, "--max-running-requests": args.max_running_requests,
             "--device": args.device, "--attention-backend": args.attention_backend,
             "--load-format": args.load_format, "--max-total-tokens": args.max_total_tokens,
             "--context-length": args.context_length, "--mem-fraction-static": args.mem_fraction_static}  # fmt: skip
    for flag, value in flags.items():
        if value is not None:
            out += [flag, str(value)]
    if args.precompile is True:
        out = [a for a in out if a != "--disable-precompile"]
    elif args.precompile is False and "--disable-precompile" not in out:
        out.append("--disable-precompile")
    if args.engine_args:
        out += shlex.split(args.engine_args)
    return out + list(args.passthrough)


def one_server(args, config: str, rnd: int, engine: list[str], vocab: int, log_dir: pathlib.Path) -> dict:
    log_path = log_dir / f"server_{config}_r{rnd}.log"
    progress(f"round {rnd + 1}/{args.rounds} config {config}: starting the server (log {log_path})")
    server = Server(args, engine, CONFIGS[config], log_path)
    rec: dict = {"config": config, "round": rnd, "cmd": server.cmd, "log": str(log_path), "levels": []}
    try:
        rec["start_to_first_answer_s"] = server.wait_first_answer(args.start_timeout)
        progress(f"  {config}: first answer {rec['start_to_first_answer_s']:.1f} s after start")
        # fresh prompts per server, same seed: every config sees the same requests in the same order
        # the warm-up wave draws from the same generator (same prefixes, fresh suffixes): the same batch shapes,
        # prefix hits included, so the lazy compiles of both the engine and the canary land there
        prompts = Prompts(args.prompt_len, vocab, args.shared_prefix, args.prefix_groups, args.seed + rnd)
        for c in args.concurrency:
            warm_s = None
            if args.warmup:
                t = time.perf_counter()
                asyncio.run(run_level(server.url, prompts, c, c, args.warmup_output_len or args.output_len))
                warm_s = time.perf_counter() - t
                progress(f"  {config} c={c}: warm-up wave {warm_s:.1f} s")
            n = max(args.waves * c, args.min_requests)
            level = asyncio.run(run_level(server.url, prompts, c, n, args.output_len))
            level["warmup_s"] = warm_s
            rec["levels"].append(level)
            progress(f"  {config} c={c}: {level['ok']}/{n} ok, {level['output_tokens']} tokens in "
                     f"{level['wall_s']:.1f} s = {level['tok_s']:.1f} tok/s, TTFT p50 "
                     f"{(pct(level['ttft_s'], 50) or 0) * 1e3:.0f} ms, ITL p50 {(pct(level['itl_s'], 50) or 0) * 1e3:.1f} ms, "
                     f"TPOT p50 {(pct(level['tpot_s'], 50) or 0) * 1e3:.1f} ms"
                     + (f", {level['n_errors']} errors: {level['errors'][:1]}" if level["n_errors"] else ""))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - recorded, the next server goes on
        rec["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"  {config}: FAILED: {rec['error']}")
    finally:
        rec["exit_code"] = server.stop()
        text = server.text()
        rec |= log_compile_times(text)
        rec["canary_on_line"] = next((ln for ln in text.splitlines() if "kvcanary on:" in ln), None)
        rec["violations"] = sum("kvcanary violation" in ln for ln in text.splitlines())
        if "error" in rec:
            rec["log_tail"] = text[-6000:]
            print(f"--- {config} round {rnd}: server log tail ---\n{rec['log_tail']}\n---", flush=True)
    return rec


def summarize(records: list[dict], configs: list[str], levels: list[int]) -> dict:
    """Per config: start and compile times (means over rounds); per config and concurrency: pooled samples."""
    out: dict = {}
    for cfg in configs:
        recs = [r for r in records if r["config"] == cfg]
        starts = [r["start_to_first_answer_s"] for r in recs if "start_to_first_answer_s" in r]
        eng = [sum(r["engine_precompile_s"].values()) for r in recs if r.get("engine_precompile_s")]
        can = [r["canary_compile_s"] for r in recs if r.get("canary_compile_s") is not None]
        warm = [sum(lv["warmup_s"] or 0.0 for lv in r["levels"]) for r in recs if r["levels"]]
        row = {"start_s": statistics.mean(starts) if starts else None,
               "warmup_s": statistics.mean(warm) if warm else None,
               "engine_precompile_s": statistics.mean(eng) if eng else None,
               "canary_compile_s": statistics.mean(can) if can else None,
               "errors": [r["error"] for r in recs if "error" in r], "violations": sum(r["violations"] for r in recs),
               "levels": {}}  # fmt: skip
        for c in levels:
            lv = [lv for r in recs for lv in r["levels"] if lv["concurrency"] == c]
            if not lv:
                continue
            ttft = [x for v in lv for x in v["ttft_s"]]
            itl = [x for v in lv for x in v["itl_s"]]
            tpot = [x for v in lv for x in v["tpot_s"]]
            row["levels"][c] = {
                "tok_s": statistics.mean(v["tok_s"] for v in lv), "tok_s_rounds": [v["tok_s"] for v in lv],
                "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
                "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
                "tokens_per_chunk": sum(v["output_tokens"] for v in lv) / max(1, sum(v["chunks"] for v in lv)),
                "requests": sum(v["requests"] for v in lv), "errors": sum(v["n_errors"] for v in lv),
            }  # fmt: skip
        out[cfg] = row
    return out


def _f(x, scale=1.0, fmt="{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x * scale)


def _ratio(x, base) -> str:
    return "n/a" if x is None or not base else f"{x / base:.3f}"


def table(summary: dict, levels: list[int]) -> str:
    lines = ["| config | conc | out tok/s | vs off | TTFT p50 ms | TTFT p99 ms | vs off (p50) | ITL p50 ms | ITL p99 ms "
             "| TPOT p50 ms | TPOT p99 ms | vs off (TPOT p50) | reqs | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    base = summary.get("off", {}).get("levels", {})
    for cfg, row in summary.items():
        for c in levels:
            v, b = row["levels"].get(c), base.get(c, {})
            if v is None:
                lines.append(f"| {cfg} | {c} | failed | | | | | | | | | | | |")
                continue
            lines.append(
                f"| {cfg} | {c} | {_f(v['tok_s'])} | {_ratio(v['tok_s'], b.get('tok_s'))} | "
                f"{_f(v['ttft_p50'], 1e3)} | {_f(v['ttft_p99'], 1e3)} | {_ratio(v['ttft_p50'], b.get('ttft_p50'))} | "
                f"{_f(v['itl_p50'], 1e3, '{:.2f}')} | {_f(v['itl_p99'], 1e3, '{:.2f}')} | "
                f"{_f(v['tpot_p50'], 1e3, '{:.2f}')} | {_f(v['tpot_p99'], 1e3, '{:.2f}')} | "
                f"{_ratio(v['tpot_p50'], b.get('tpot_p50'))} | {v['requests']} | {v['errors']} |"
            )  # fmt: skip
    lines += ["", "| config | start to first answer s | vs off | warm-up waves s | engine precompile s (log) "
              "| canary compile s (log) | violations | server errors |", "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    off_start = summary.get("off", {}).get("start_s")
    for cfg, row in summary.items():
        errs = "; ".join(row["errors"])[:200] or "none"
        lines.append(f"| {cfg} | {_f(row['start_s'])} | {_ratio(row['start_s'], off_start)} | {_f(row['warmup_s'])} | "
                     f"{_f(row['engine_precompile_s'])} | {_f(row['canary_compile_s'], fmt='{:.2f}')} | "
                     f"{row['violations']} | {errs} |")  # fmt: skip
    return "\n".join(lines)


def _jax_version() -> str:
    try:
        import jax

        return jax.__version__
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {exc}"


def _accelerator() -> str:
    """The GPU's name from nvidia-smi, else the CPU's model name."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        if out.returncode == 0 and out.stdout.strip():
            return "GPU: " + ", ".join(out.stdout.strip().splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
        return f"CPU: {cpu}, {os.cpu_count()} cores"
    except (OSError, StopIteration):
        return "unknown"


def parse_args(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    passthrough = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="the model dir (python -m kvcanary_jax tiny-model DIR [--size])")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="workload and engine defaults")
    p.add_argument("--configs", default="off,on,all", help="comma list of off, on, all (started in this order)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds: off, on, all, off, on, all, ...")
    p.add_argument("--concurrency", default=None, help="comma list (default 1,16,64; cpu preset 1,4,16)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; cpu preset 64)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 256; cpu preset 16)")
    p.add_argument("--shared-prefix", type=float, default=0.5, help="share of each prompt common to its group")
    p.add_argument("--prefix-groups", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--waves", type=int, default=2, help="requests per level = max(waves * c, --min-requests)")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the unmeasured wave per level")
    p.add_argument("--warmup-output-len", type=int, default=None,
                   help="output tokens of the warm-up wave's c requests (default: --output-len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=1200.0, help="seconds for a server to answer")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no further server once this much has passed (the rest are skipped)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="one JAX compilation cache for every server (faster; start times then favour later servers)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the servers (repeatable), e.g. JAX_LOG_COMPILES=1")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs the server")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--log-dir", default=None, help="server logs (default: next to --out, else a temp dir)")
    eng = p.add_argument_group("engine flags (sglang-jax launch_server), over the preset's")
    eng.add_argument("--device", default=None)
    eng.add_argument("--attention-backend", default=None)
    eng.add_argument("--page-size", type=int, default=None)
    eng.add_argument("--max-running-requests", type=int, default=None)
    eng.add_argument("--max-total-tokens", type=int, default=None)
    eng.add_argument("--context-length", type=int, default=None)
    eng.add_argument("--mem-fraction-static", type=float, default=None)
    eng.add_argument("--load-format", default=None, help="dummy for tiny-model --size 1b / 8b (no weights written)")
    eng.add_argument("--precompile", dest="precompile", action="store_true", default=None,
                     help="drop --disable-precompile")  # fmt: skip
    eng.add_argument("--no-precompile", dest="precompile", action="store_false", help="add --disable-precompile")
    eng.add_argument("--engine-args", default="", help="more launch_server flags, one string (also: after --)")
    args = p.parse_args(argv)
    args.passthrough = passthrough
    preset = PRESETS.get(args.preset, {})
    args.concurrency = [int(c) for c in (args.concurrency or preset.get("concurrency", "1,16,64")).split(",")]
    args.prompt_len = args.prompt_len or preset.get("prompt_len", 512)
    args.output_len = args.output_len or preset.get("output_len", 256)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := set(args.configs) - set(CONFIGS):
        p.error(f"--configs: unknown {sorted(unknown)}; pick from {sorted(CONFIGS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    config = json.loads((pathlib.Path(args.model_path) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    engine = engine_args(args)
    if args.load_format is None and not (pathlib.Path(args.model_path) / "model.safetensors").exists() \
            and "--load-format" not in engine:  # fmt: skip
        engine += ["--load-format", "dummy"]  # tiny-model --size 1b / 8b writes no weights
    if args.log_dir:
        log_dir = pathlib.Path(args.log_dir)
    elif args.out:
        log_dir = pathlib.Path(args.out).parent / (pathlib.Path(args.out).stem + "_logs")
    else:
        import tempfile

        log_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench_serve_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    progress(f"engine args: {shlex.join(engine)}")
    progress(f"workload: concurrency {args.concurrency}, prompt {args.prompt_len} tokens ({args.shared_prefix:.0%} "
             f"shared in {args.prefix_groups} groups), output {args.output_len} tokens, configs {args.configs}, "
             f"{args.rounds} round(s); logs in {log_dir}")  # fmt: skip
    t0 = time.time()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv, "engine_args": engine,
            "model_config": config, "python": sys.version.split()[0], "jax": _jax_version(),
            "accelerator": _accelerator()}  # fmt: skip  (no jax backend in this process: the GPU is the server's)
    records: list[dict] = []
    # a SIGTERM (``timeout``, a job manager) unwinds like Ctrl-C, so the running server is stopped, not left holding
    # the accelerator's memory for the next run
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    for rnd in range(args.rounds):
        for cfg in args.configs:
            if args.time_budget and time.time() - t0 > args.time_budget:
                progress(f"time budget ({args.time_budget:.0f} s) spent: round {rnd + 1} config {cfg} not run")
                continue
            records.append(one_server(args, cfg, rnd, engine, vocab, log_dir))
            if args.out:  # after every server, so a run cut short keeps what it measured
                partial = {"meta": meta | {"wall_s": time.time() - t0, "partial": True}, "runs": records}
                pathlib.Path(args.out).write_text(json.dumps(partial, indent=1))
    summary = summarize(records, args.configs, args.concurrency)
    meta["wall_s"] = time.time() - t0
    print(f"\nbench_serve: {meta['date']}, jax {meta['jax']}, {meta['accelerator']}, model "
          f"{config.get('hidden_size')}h x {config.get('num_hidden_layers')}L, prompt {args.prompt_len}, output "
          f"{args.output_len}, rounds {args.rounds}")  # fmt: skip
    print(table(summary, args.concurrency), flush=True)
    if args.out:
        # the raw samples stay (ttft_s, itl_s per level); the summary is what the table shows
        pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "runs": records}, indent=1))
        progress(f"wrote {args.out}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
