"""The served canary's correctness on an accelerator: ``python -m kvcanary_jax serve sglang-jax`` on the tiny model
(random weights: real, varied text), with the engine's defaults for the device (its precompile on).

1. canary off, then canary on (default options), then on with ``--canary-real-kv all --canary-sweep-interval 2``:
   the same greedy prompts one at a time (token equality needs a fixed batch composition), then 16 concurrent ones;
   the texts must match the engine alone, the shutdown summary must read 0 violations and 0 compiles while serving;
2. a ``live_kv`` drill server: every injected slot must be named at its request.

Prints one JSON line per check and a verdict; exits 1 if any check fails. On the GPU machine (device tool)::

    PYTHONPATH=/tmp/site:$PWD/repo python3 repo/benchmarks/gpu/served_check.py --device gpu --out $OUT/served_check.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
import signal
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvcanary_jax.integrations import tiny_llama  # noqa: E402
from tests.integrations.serve_testlib import CPU_WORKAROUND, Server  # noqa: E402

PROMPTS = ["The quick brown fox", "The quick brown fox jumps over", "A KV cache holds the keys", "one two three four",
           "The quick brown fox", "Once upon a time there was a small model that answered questions about numbers"]  # fmt: skip
VIOLATION = re.compile(r"kvcanary violation: rid=(\S+) slot=(\d+)")
INJECTED = re.compile(r"kvcanary drill injected live_kv: rid=(\S+) position=\d+ slot=(\d+) step=(\d+)")


def served(model, log, engine, *canary) -> tuple[dict, Server]:
    started = time.monotonic()
    server = Server(model, log, {}, *canary, engine=engine)
    up_s = time.monotonic() - started
    try:
        alone = server.one_at_a_time(PROMPTS, max_tokens=24)
        together = [r if isinstance(r, BaseException) else r.choices[0].text
                    for r in server.completions(16, max_tokens=lambda i: 8 + i % 9)]  # fmt: skip
    finally:
        server.interrupt()
    return {"one_at_a_time": alone, "concurrent": [str(t) for t in together], "up_s": round(up_s, 1)}, server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="gpu")
    p.add_argument("--page-size", default="16")
    p.add_argument("--out", default=None)
    p.add_argument("--engine-args", default="", help="more launch_server flags, one string (a later flag wins)")
    p.add_argument("--steps", default="equal,drill", help="equal: token equality off vs on vs all; drill: live_kv")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout stops the running server, as Ctrl-C does
    work = pathlib.Path(tempfile.mkdtemp(prefix="served_check_"))
    model = tiny_llama.write_tiny_model(work / "tiny")
    engine = ("--device", args.device, "--page-size", args.page_size, "--max-running-requests", "16",
              "--max-total-tokens", "8192", "--random-seed", "0", "--skip-server-warmup", "--enable-metrics")  # fmt: skip
    engine += tuple(shlex.split(args.engine_args))
    if args.device == "cpu":  # sglang-jax's own precompile fails on CPU (see serve_testlib)
        engine += CPU_WORKAROUND
    checks, ok = [], True

    def check(name: str, passed: bool, **detail) -> None:
        nonlocal ok
        ok &= passed
        checks.append({"check": name, "passed": passed, **detail})
        print(json.dumps(checks[-1]), flush=True)

    steps, off = args.steps.split(","), None
    if "equal" in steps:
        off, _ = served(model, work / "off.log", engine, "--canary-mode", "off")
        check("engine alone answers with varied text", len(set(off["one_at_a_time"])) > 1, up_s=off["up_s"])
        for name, canary in (("on", ()), ("all", ("--canary-real-kv", "all", "--canary-sweep-interval", "2"))):
            on, server = served(model, work / f"{name}.log", engine, "--canary-mode", "log", *canary)
            text = server.text()
            summary = server.summary()
            check(f"{name}: the same greedy text one at a time", on["one_at_a_time"] == off["one_at_a_time"],
                  up_s=on["up_s"], texts=on["one_at_a_time"][:2])  # fmt: skip
            same = sum(a == b for a, b in zip(on["concurrent"], off["concurrent"], strict=True))
            check(f"{name}: concurrent greedy text (batching may differ)", True, same=same, of=len(off["concurrent"]))
            check(f"{name}: 0 violations, 0 compiles while serving", summary[0] == 0 and summary[2] == 0,
                  summary=summary, precompiled=re.findall(r"kvcanary precompiled .*", text)[:1])  # fmt: skip
    if "drill" not in steps:
        return finish(ok, checks, off, args.out)
    server = Server(model, work / "drill.log", {}, "--canary-mode", "log", "--canary-inject", "live_kv:0.5",
                    engine=engine)  # fmt: skip
    try:
        server.completions(16, max_tokens=lambda i: 6 + i % 5)
    finally:
        server.interrupt()
    text = server.text()
    injected = {(rid, slot) for rid, slot, _ in INJECTED.findall(text)}
    named = set(VIOLATION.findall(text))
    check("live_kv drill: every injected slot named at its request", bool(injected) and injected <= named,
          injected=len(injected), missed=sorted(injected - named)[:5],
          precompiled=re.findall(r"kvcanary precompiled .*", text)[:1])  # fmt: skip
    return finish(ok, checks, off, args.out)


def finish(ok: bool, checks: list, off: dict | None, out: str | None) -> int:
    print("served check:", "PASSED" if ok else "FAILED", flush=True)
    if out:
        pathlib.Path(out).write_text(json.dumps({"ok": ok, "checks": checks, "off": off}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
