"""A served soak: ``python -m kvcanary_jax serve sglang-jax`` in log mode, a fault drill at a low rate, for minutes
of mixed streaming traffic; then the log is read back against what the drill did.

    python benchmarks/soak_serve.py [--minutes 30] [--clients 32] [--drill live_kv:0.02] [--out soak.json]

Needs the sglang-jax extra (and ``openai``, ``psutil``). A benchmark, not a CI test; the tiny random Llama of
``python -m kvcanary_jax tiny-model`` (or ``--model-dir``), the CPU flags of docs/serve.md.

1. **Engine alone.** A ``--canary-mode off`` server with the same engine flags answers a fixed set of greedy
   control prompts one at a time, twice (the second round from the radix cache); their texts are the reference.
   It is stopped.
2. **Canary server** (``--canary-mode log --canary-inject KIND:PROB``). For ``--minutes``: bursts (``--burst-s``)
   of ``--clients`` concurrent streaming clients (``openai.AsyncOpenAI``), prompt and output lengths random
   (seeded), some prompts on shared prefixes, greedy and sampled, some streams cancelled mid-way (``--abort-prob``),
   an occasional ``POST /flush_cache``; after each burst the clients finish, the server is left idle for a few
   seconds (``--idle-s``: the canary's idle read path), then the control prompts go one at a time and their text is
   compared with the engine alone's. The scheduler process's RSS (the child whose title starts with
   ``sglang::scheduler``) is sampled every ``--rss-every`` s; a progress line every ``--progress-every`` s.
3. **Shutdown and read-back.** ``/metrics`` is read, then SIGINT to the server's process group (a Ctrl-C); the log
   is parsed: each ``kvcanary drill injected`` line against the ``kvcanary violation`` lines.

A violation is *explained* when a drill fired at step ``s`` on its request (``rid``; a ``token_swap`` names two) or
on its slot (``idle_cache_kv`` names no request: its violation names a cached ``prefix=``), and the violation's step
is in ``[s, s + 2]``. A drill is *named* when such a violation exists; its latency is the violation line's timestamp
less the drill line's (1 s resolution). A drilled slot stays corrupt after its request ends, in the radix cache,
where the sweep finds it again later (``prefix=``, at the drill's slot and position): counted apart, not as a false
positive. Any other violation is a false positive. A control answer a drill hit (its rid in a drill line) may
differ from the engine alone's: counted apart.

Targets (exit 1 if one fails): no false positive, every drill named, within 2 s after warm-up (``--warmup-minutes``;
during it the engine compiles its own programs, steps take seconds), control texts identical to the engine alone's
(but a drilled one), scheduler RSS growth from the end of warm-up to the end < 5 % (medians of ``--rss-window``),
no request error, the server up to the end with its summary line and no traceback, no canary compile while
serving.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import httpx
import openai
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# docs/serve.md's CPU flags (a small KV pool, the default buckets less sglang-jax's broken one-row CPU decode, no
# engine precompile), as tests/integrations/serve_testlib.py runs them.
ENGINE = ("--page-size 4 --max-running-requests 16 --max-total-tokens 4096 --disable-precompile "
          "--precompile-bs-paddings 2 4 8 16 --enable-metrics --random-seed 0 --skip-server-warmup")  # fmt: skip
CONTROL = ["The quick brown fox jumps over the lazy dog.", "A KV cache holds the keys and values of every token",
           "Once upon a time, in a server far away,", "def fib(n): return n if n < 2 else", "0 1 1 2 3 5 8 13 21"]  # fmt: skip
CONTROL_TOKENS = 16
PREFIXES = ["You are a helpful assistant. Answer briefly and precisely. ",
            "System: the following is a conversation between a user and a model. User: ",
            "Summarise the text below in one sentence.\n\n"]  # fmt: skip
WORDS = (
    "cache key value token page slot radix tree prefix batch decode prefill scheduler request stream abort "
    "flush memory canary drill guard kernel launch step ring report sweep host device model layer head rope "
    "the a of and to in is for on with as at by from it that this be are was not or but all any one two"
).split()
START_S = 900
_TS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_DRILL = re.compile(r"kvcanary drill injected (\w+): (.*)$")
_VIOLATION = re.compile(r"kvcanary violation: (?:rid=(\S+)|prefix=(\S+)) slot=(\d+) step=(\d+) launch=(\S+) "
                        r"reason=(\S+) position=(\S+)")  # fmt: skip
_SUMMARY = re.compile(r"kvcanary summary: (.*)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m kvcanary_jax serve sglang-jax ...`` in its own process group, its output in ``log_path``."""

    def __init__(self, model_dir: str, log_path: str, engine: list[str], canary: list[str], env: dict):
        self.port, self.log_path = free_port(), log_path
        cmd = [sys.executable, "-m", "kvcanary_jax", "serve", "sglang-jax", "--model-path", model_dir,
               "--device", "cpu", "--attention-backend", "native", "--host", "127.0.0.1", "--port", str(self.port),
               *engine, *canary]  # fmt: skip
        self.cmd = cmd
        self.log = open(log_path, "w")
        path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env,
                                     "PYTHONPATH": path}, start_new_session=True)  # fmt: skip
        started = time.monotonic()
        while time.monotonic() - started < START_S:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                self.startup_s = time.monotonic() - started
                return
            except OSError:
                time.sleep(1)
        self.interrupt()
        raise SystemExit(f"server not up in {START_S} s:\n{self.text()[-4000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> dict:
        body = urllib.request.urlopen(f"{self.url}/metrics", timeout=60).read().decode()
        lines = (line.rsplit(" ", 1) for line in body.splitlines() if line.startswith("kvcanary_"))
        return {k: float(v) for k, v in lines}

    def scheduler_rss(self) -> int | None:
        """RSS (bytes) of the server's child whose process title starts with ``sglang::scheduler``."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return None
        for child in children:
            try:
                title = " ".join(child.cmdline()) or child.name()
                if title.startswith("sglang::scheduler") or child.name().startswith("sglang::sched"):
                    return child.memory_info().rss
            except psutil.Error:
                continue
        return None

    def interrupt(self, wait_s: float = 180) -> int:
        """A Ctrl-C: SIGINT to the whole process group; SIGKILL to it if it has not exited in ``wait_s``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        return self.proc.returncode


def control_texts(server: Server, rounds: int) -> list[list[str]]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    return [[client.completions.create(model="tiny", prompt=p, max_tokens=CONTROL_TOKENS, temperature=0)
             .choices[0].text for p in CONTROL] for _ in range(rounds)]  # fmt: skip


class Load:
    """The traffic: streaming clients in bursts, control prompts between them, counters."""

    def __init__(self, server: Server, args, reference: list[str]):
        self.server, self.args, self.reference = server, args, reference
        self.rng = random.Random(args.seed)
        # Idle connections are let go after 2 s: the server (uvicorn) closes them after 5 s, and a request sent on one
        # it is closing fails as a connection error, the engine never seeing it (the idle pauses are 3-6 s).
        http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, keepalive_expiry=2))
        self.client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600,
                                         http_client=http)  # fmt: skip
        self.burst = asyncio.Event()
        self.stop = False
        self.in_flight = 0
        self.c = dict(started=0, completed=0, aborted=0, errors=0, tokens=0, flush_ok=0, flush_refused=0,
                      bursts=0, control_rounds=0, control_mismatches=0)  # fmt: skip
        self.control_rids: list[str] = []
        self.error_samples: list[str] = []
        self.mismatches: list[dict] = []
        self.rss: list[tuple[float, int]] = []
        self.t0, self.wall0 = time.monotonic(), datetime.datetime.now()

    def prompt(self, rng: random.Random) -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, self.args.max_prompt_words)))
        return (rng.choice(PREFIXES) if rng.random() < 0.5 else "") + words

    async def one(self, rng: random.Random) -> None:
        abort_after = rng.randint(1, 24) if rng.random() < self.args.abort_prob else None
        kwargs = dict(model="tiny", prompt=self.prompt(rng), max_tokens=rng.randint(1, self.args.max_tokens),
                      temperature=0 if rng.random() < 0.5 else 0.8, stream=True, seed=rng.randint(0, 2**31))  # fmt: skip
        self.c["started"] += 1
        self.in_flight += 1
        chunks = 0
        try:
            stream = await self.client.completions.create(**kwargs)
            try:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        chunks += 1
                    if abort_after is not None and chunks >= abort_after:
                        break
                else:
                    abort_after = None  # it finished before its abort point: completed
            finally:
                await stream.close()  # cancelled mid-way: the server sees the disconnect and aborts the request
            self.c["aborted" if abort_after is not None else "completed"] += 1
        except Exception as e:  # noqa: BLE001 - counted and sampled; the soak goes on
            self.c["errors"] += 1
            if len(self.error_samples) < 10:
                cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
                phase = "burst" if self.burst.is_set() else "after burst"
                self.error_samples.append(f"t={self.elapsed():.0f} s, {phase}, {chunks} chunks: {type(e).__name__}: "
                                          f"{e}{cause}"[:400])  # fmt: skip
        finally:
            self.c["tokens"] += chunks
            self.in_flight -= 1

    async def client_loop(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        while not self.stop:
            await self.burst.wait()
            if self.stop:
                return
            await self.one(rng)

    async def flush(self) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{self.server.url}/flush_cache")
        self.c["flush_ok" if r.status_code == 200 else "flush_refused"] += 1

    async def control(self) -> None:
        """The control prompts one at a time (each batch holds one request), greedy, against the engine alone."""
        self.c["control_rounds"] += 1
        for prompt, want in zip(CONTROL, self.reference, strict=True):
            r = await self.client.completions.create(model="tiny", prompt=prompt, max_tokens=CONTROL_TOKENS,
                                                     temperature=0)  # fmt: skip
            got = r.choices[0].text
            self.control_rids.append(r.id)
            if got != want:
                self.c["control_mismatches"] += 1
                self.mismatches.append(dict(t=round(self.elapsed(), 1), rid=r.id, prompt=prompt, want=want, got=got))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    async def sample_rss(self) -> None:
        while not self.stop:
            rss = await asyncio.to_thread(self.server.scheduler_rss)
            if rss is not None:
                self.rss.append((self.elapsed(), rss))
            await asyncio.sleep(self.args.rss_every)

    async def progress(self) -> None:
        while not self.stop:
            await asyncio.sleep(self.args.progress_every)
            text = self.server.text()
            rss = f"{self.rss[-1][1] / 2**20:.0f}" if self.rss else "?"
            print(f"[{self.elapsed():6.0f} s] {'burst' if self.burst.is_set() else 'idle '} bursts={self.c['bursts']} "
                  f"completed={self.c['completed']} aborted={self.c['aborted']} errors={self.c['errors']} "
                  f"tokens={self.c['tokens']} in_flight={self.in_flight} flush={self.c['flush_ok']}/"
                  f"{self.c['flush_ok'] + self.c['flush_refused']} control={self.c['control_rounds']} rounds "
                  f"{self.c['control_mismatches']} mismatches, drills={text.count('kvcanary drill injected')} "
                  f"violations={text.count('kvcanary violation:')} scheduler_rss={rss} MiB "
                  f"server={'up' if self.server.alive() else 'DOWN'}", flush=True)  # fmt: skip

    async def run(self) -> None:
        a = self.args
        lo_b, hi_b = a.burst_s
        lo_i, hi_i = a.idle_s
        tasks = [asyncio.create_task(self.client_loop(i)) for i in range(a.clients)]
        side = [asyncio.create_task(self.sample_rss()), asyncio.create_task(self.progress())]
        end = a.minutes * 60
        while self.elapsed() < end and self.server.alive():
            self.c["bursts"] += 1
            burst_end = min(self.elapsed() + self.rng.uniform(lo_b, hi_b), end)
            flush_at = self.elapsed() + self.rng.uniform(0, burst_end - self.elapsed()) \
                if self.rng.random() < a.flush_prob else None  # fmt: skip
            self.burst.set()
            while self.elapsed() < burst_end and self.server.alive():
                await asyncio.sleep(0.2)
                if flush_at is not None and self.elapsed() >= flush_at:
                    flush_at = None
                    await self.flush()
            self.burst.clear()
            while self.in_flight:  # every client finishes its request: the server goes idle
                await asyncio.sleep(0.1)
            if self.rng.random() < a.flush_prob / 2:
                await self.flush()  # on an idle server: this one flushes
            await asyncio.sleep(self.rng.uniform(lo_i, hi_i))  # idle: the canary reads what the steps left
            if self.server.alive():
                await self.control()
        self.stop = True
        self.burst.set()
        await asyncio.gather(*tasks)
        for t in side:
            t.cancel()
        rss = await asyncio.to_thread(self.server.scheduler_rss)
        if rss is not None:
            self.rss.append((self.elapsed(), rss))


def _ts(line: str) -> datetime.datetime | None:
    m = _TS.match(line)
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S") if m else None


def parse_log(text: str) -> dict:
    """The drill, violation and summary lines; each violation matched to the drills that explain it."""
    drills, violations, summary = [], [], None
    for line in text.splitlines():
        if m := _DRILL.search(line):
            kv = dict(part.split("=", 1) for part in m.group(2).split() if "=" in part)
            rids = {kv[k] for k in ("rid", "other") if kv.get(k) not in (None, "None")}
            drills.append(dict(kind=m.group(1), rids=sorted(rids), slot=int(kv["slot"]) if "slot" in kv else None,
                               position=kv.get("position"), step=int(kv["step"]), ts=_ts(line), line=line.strip()))  # fmt: skip
        elif m := _VIOLATION.search(line):
            rid, prefix, slot, step, launch, reason, position = m.groups()
            violations.append(dict(rid=rid, prefix=prefix, slot=int(slot), step=int(step), launch=launch,
                                   reason=reason, position=position, ts=_ts(line), line=line.strip()))  # fmt: skip
        elif m := _SUMMARY.search(line):
            summary = dict(part.split("=", 1) for part in m.group(1).split() if "=" in part)
            summary["line"] = line.strip()

    def explains(d, v) -> bool:
        on = (v["rid"] is not None and v["rid"] in d["rids"]) or (d["slot"] is not None and v["slot"] == d["slot"])
        return on and d["step"] <= v["step"] <= d["step"] + 2

    def found_again(d, v) -> bool:  # a drilled slot read again later (the sweep of its cached prefix, a reader)
        return d["slot"] == v["slot"] and d.get("position") == v["position"] and d["step"] < v["step"]

    outside = [v for v in violations if not any(explains(d, v) for d in drills)]
    late_on_drilled_slot = [v for v in outside if any(found_again(d, v) for d in drills)]
    false_positives = [v for v in outside if v not in late_on_drilled_slot]
    unnamed, latencies = [], []
    for d in drills:
        hits = [v for v in violations if explains(d, v)]
        if not hits:
            unnamed.append(d)
            continue
        first = min(hits, key=lambda v: (v["ts"] or datetime.datetime.max, v["step"]))
        d["named_step"], d["latency_s"] = first["step"], (first["ts"] - d["ts"]).total_seconds() \
            if first["ts"] and d["ts"] else None  # fmt: skip
        if d["latency_s"] is not None:
            latencies.append((d["ts"], d["latency_s"]))
    return dict(drills=drills, violations=violations, summary=summary, false_positives=false_positives,
                late_on_drilled_slot=late_on_drilled_slot, unnamed=unnamed, latencies=latencies,
                tracebacks=_tracebacks(text))  # fmt: skip


def _tracebacks(text: str) -> int:
    """Tracebacks in the log, less the engine processes' ``KeyboardInterrupt`` at the SIGINT."""
    blocks = text.split("Traceback (most recent call last)")[1:]
    return sum(1 for b in blocks if "KeyboardInterrupt" not in b.split("\n[", 1)[0])


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, datetime.datetime):
        return x.strftime("%Y-%m-%d %H:%M:%S")
    return x


def rss_at(samples: list[tuple[float, int]], lo: float, hi: float) -> float | None:
    """The median RSS of the samples taken in ``[lo, hi]`` seconds (bursts and idle pauses alike)."""
    window = [r for t, r in samples if lo <= t <= hi]
    return statistics.median(window) if window else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--drill", default="live_kv:0.02", help="--canary-inject KIND[:PROB] (live_kv, req_to_token, "
                   "idle_cache_kv, token_swap), or 'none'")  # fmt: skip
    p.add_argument("--drill-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="the traffic's seed")
    p.add_argument("--warmup-minutes", type=float, default=None, help="default: a quarter of --minutes, at most 5")
    p.add_argument("--burst-s", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN", "MAX"))
    p.add_argument("--idle-s", type=float, nargs=2, default=(3.0, 6.0), metavar=("MIN", "MAX"))
    p.add_argument("--abort-prob", type=float, default=0.1)
    p.add_argument("--flush-prob", type=float, default=0.3, help="per burst: a /flush_cache during it")
    p.add_argument("--max-prompt-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rss-every", type=float, default=5)
    p.add_argument("--rss-window", type=float, default=30, help="s: RSS is the median of the samples this long "
                   "before the end of warm-up, and before the end")  # fmt: skip
    p.add_argument("--progress-every", type=float, default=30)
    p.add_argument("--model-dir", help="default: a tiny random Llama written to the work directory")
    p.add_argument("--engine-args", default=ENGINE, help=f"the engine's flags, both servers (default: {ENGINE})")
    p.add_argument("--canary-args", default="", help="more --canary-* flags for the canary server")
    p.add_argument("--work-dir", help="logs and the model (default: a new temporary directory)")
    p.add_argument("--jax-cache", default=os.path.join(tempfile.gettempdir(), "kvcanary-soak-jax-cache"),
                   help="JAX_COMPILATION_CACHE_DIR for both servers ('' for none)")  # fmt: skip
    p.add_argument("--out", default="soak_serve.json")
    args = p.parse_args()
    warmup_min = args.warmup_minutes if args.warmup_minutes is not None else min(args.minutes / 4, 5)
    work = args.work_dir or tempfile.mkdtemp(prefix="kvcanary-soak-")
    os.makedirs(work, exist_ok=True)
    env = {"JAX_COMPILATION_CACHE_DIR": args.jax_cache} if args.jax_cache else {}
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = os.path.join(work, "tiny")
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            subprocess.run([sys.executable, "-m", "kvcanary_jax", "tiny-model", model_dir], check=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                os.environ.get("PYTHONPATH")]))})  # fmt: skip
    engine = shlex.split(args.engine_args)
    drill = [] if args.drill == "none" else ["--canary-inject", args.drill, "--canary-inject-seed",
                                             str(args.drill_seed)]  # fmt: skip
    canary = ["--canary-mode", "log", *drill, *shlex.split(args.canary_args)]
    print(f"work dir {work}; engine: {' '.join(engine)}", flush=True)

    # 1. The engine alone: the control prompts' reference texts.
    t = time.monotonic()
    off = Server(model_dir, os.path.join(work, "engine_alone.log"), engine, ["--canary-mode", "off"], env)
    try:
        rounds = control_texts(off, 2)
    finally:
        off_code = off.interrupt()
    reference = rounds[0]
    print(f"engine alone: up in {off.startup_s:.0f} s, control prompts read in {time.monotonic() - t:.0f} s "
          f"(rounds agree: {rounds[0] == rounds[1]}; exit {off_code})", flush=True)  # fmt: skip

    # 2. The canary server under load.
    server = Server(model_dir, os.path.join(work, "canary.log"), engine, canary, env)
    print(f"canary server up in {server.startup_s:.0f} s: {' '.join(canary)}; soak of {args.minutes} min, "
          f"{args.clients} clients, warm-up {warmup_min:.1f} min", flush=True)  # fmt: skip
    load = Load(server, args, reference)
    try:
        asyncio.run(load.run())
        up_to_end = server.alive()
        metrics = server.metrics() if up_to_end else {}
    finally:
        time.sleep(2)
        code = server.interrupt()
    text = server.text()
    log = parse_log(text)

    # 3. The figures and the targets.
    s = log["summary"] or {}
    warm_t, end_t = warmup_min * 60, (load.rss[-1][0] if load.rss else 0)
    warm, last = rss_at(load.rss, warm_t - args.rss_window, warm_t), rss_at(load.rss, end_t - args.rss_window, end_t)
    growth = (last - warm) / warm if warm and last else None
    warm_wall = load.wall0 + datetime.timedelta(seconds=warm_t)
    lat_all = [x for _, x in log["latencies"]]
    lat_after = [x for ts, x in log["latencies"] if ts >= warm_wall]
    latency_max = max(lat_all) if lat_all else None
    latency_max_after = max(lat_after) if lat_after else None
    kinds = sorted({d["kind"] for d in log["drills"]})
    drilled = {r for d in log["drills"] for r in d["rids"]}
    control_drilled = sum(1 for r in load.control_rids if r in drilled)
    control_unexplained = [m for m in load.mismatches if m["rid"] not in drilled]
    ring_note = " (= the default ring_capacity: the fill-once ring is full?)" if s.get("violations") == "1024" else ""
    metric_total = lambda name: sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))  # noqa: E731
    targets = {
        "no false positive": not log["false_positives"],
        "every drill named": not log["unnamed"],
        "drill named within 2 s (after warm-up)": latency_max_after is None or latency_max_after <= 2,
        "control prompts identical (but a drilled one)": not control_unexplained and load.c["control_rounds"] > 0,
        "scheduler RSS growth after warm-up < 5 %": growth is not None and growth < 0.05,
        "no request error": load.c["errors"] == 0,
        "server up to the end, summary line, no traceback (but the SIGINT's)": up_to_end
        and bool(s)
        and not log["tracebacks"],
        "no canary compile while serving": s.get("compiles_while_serving", "?") == "0",
    }
    rows = [
        ("soak", f"{args.minutes} min, {args.clients} clients, {load.c['bursts']} bursts, drill {args.drill}"),
        ("requests completed / aborted / errors", f"{load.c['completed']} / {load.c['aborted']} / {load.c['errors']}"),
        ("tokens streamed", load.c["tokens"]),
        ("canary steps (summary)", s.get("steps", "?")),
        ("/flush_cache ok / refused (busy)", f"{load.c['flush_ok']} / {load.c['flush_refused']}"),
        ("drills injected" + (f" ({', '.join(kinds)})" if kinds else ""), len(log["drills"])),
        ("drills named at step s..s+2", f"{len(log['drills']) - len(log['unnamed'])} / {len(log['drills'])}"),
        ("drill -> violation line s: max after warm-up / max / median",
         f"{latency_max_after} / {latency_max} / {statistics.median(lat_all)}" if lat_all else "-"),
        ("violation lines", len(log["violations"])),
        ("  within 2 steps of a drill on its rid/slot", len(log["violations"]) - len(log["false_positives"])
         - len(log["late_on_drilled_slot"])),
        ("  a drilled slot+position found again later (sweep)", len(log["late_on_drilled_slot"])),
        ("  false positives (neither)", len(log["false_positives"])),
        ("control prompts: rounds / answers drilled / mismatches (undrilled)",
         f"{load.c['control_rounds']} / {control_drilled} / {load.c['control_mismatches']} ({len(control_unexplained)})"
         f"  ({len(CONTROL)} prompts a round; engine alone's two rounds agree: {rounds[0] == rounds[1]})"),
        (f"scheduler RSS, median of {args.rss_window:.0f} s: warm-up end -> end (MiB)",
         f"{warm / 2**20:.0f} (t={warm_t:.0f} s) -> {last / 2**20:.0f} (t={end_t:.0f} s): {growth * 100:+.2f} %"
         if growth is not None else "?"),
        ("scheduler RSS min / max over the soak (MiB)",
         f"{min(r for _, r in load.rss) / 2**20:.0f} / {max(r for _, r in load.rss) / 2**20:.0f}" if load.rss else "?"),
        ("summary line", (" ".join(f"{k}={v}" for k, v in s.items() if k != "line") or "MISSING") + ring_note),
        ("/metrics before SIGINT", f"violations_total={metric_total('kvcanary_violations_total'):.0f} "
         f"protected_tokens_total={metric_total('kvcanary_protected_tokens_total'):.0f} "
         f"checks_total={metric_total('kvcanary_checks_total'):.0f}"),
        ("tracebacks in the log / server exit code", f"{log['tracebacks']} / {code}"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print()
    for name, ok in targets.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for title, items in (("false positives", log["false_positives"]), ("drills not named", log["unnamed"]),
                         ("control mismatches", load.mismatches), ("request errors", load.error_samples),
                         ("drilled slots found again later", log["late_on_drilled_slot"])):  # fmt: skip
        if items:
            print(f"\n{title} (first 10 of {len(items)}):")
            for item in items[:10]:
                print("  " + (item["line"] if isinstance(item, dict) and "line" in item else str(item)))
    result = dict(args=vars(args), command=" ".join(map(shlex.quote, sys.argv)), server_cmd=server.cmd, work_dir=work,
                  counters=load.c, reference=reference, engine_alone_rounds_agree=rounds[0] == rounds[1],
                  rss=load.rss, rss_warm=warm, rss_end=last, rss_growth=growth, latency_max_s=latency_max,
                  latency_max_after_warmup_s=latency_max_after, control_rids=load.control_rids,
                  targets=targets, table=[[k, str(v)] for k, v in rows], control_mismatches=load.mismatches,
                  error_samples=load.error_samples, metrics=metrics, exit_code=code,
                  **{k: log[k] for k in ("drills", "violations", "summary", "false_positives", "late_on_drilled_slot",
                                         "unnamed", "tracebacks")})  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(_jsonable(result), f, indent=1)
    print(f"\nwrote {args.out}; logs in {work}")
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
