"""Step time of sglang-jax on CPU, engine alone vs wrapped by kvcanary_jax.integrations.sglang_jax, after compile.

    python benchmarks/bench_sglang_jax_cpu.py [--reps 5] [--page-size 1] [--json out.json] [--threads]

Needs the sglang-jax extra. The tiny random Llama of the demo, the same workload (prefills mixed with running decodes,
then decodes) run alone and wrapped, interleaved, after one warm-up run of each (compiles). A step is timed from before
the forward to the sampled ids on the host (wrapped: plus the canary state ready and the monitor's ``after_step``).
Per run: the median per step kind (prefill = EXTEND, decode = DECODE), each kind's first 2 steps dropped; then the
median over runs. Both wall and process CPU time (all threads) are reported: on a shared machine CPU time is steadier.
The radix-cache sweep is timed on its own. ``--threads`` also splits each step's CPU time by thread (Linux): the
scheduler's thread (Python, dispatch, host work), XLA's compute threads, the rest (PjRt's client pool among them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import jax

from kvcanary_jax import CanaryConfig
from kvcanary_jax.demo import sglang_engine
from kvcanary_jax.integrations import sglang_jax

# The demo's config without the periodic sweep (timed apart): raise mode, real KV PARTIAL, both token asserts.
CONFIG = CanaryConfig(mode="raise", real_kv_hash_mode="partial", sweep_interval=0, enable_write_input_assert=True,
                      enable_verify_token_assert=True)  # fmt: skip


def thread_cpu() -> dict:
    """CPU seconds so far of this process's threads, by group: the scheduler's (this) thread, XLA's compute threads
    (``XLAEigen``), the others (read from ``/proc/self/task``; empty where there is none)."""
    if not os.path.isdir("/proc/self/task"):
        return {}
    out = {"scheduler thread": 0.0, "XLA compute threads": 0.0, "other threads": 0.0}
    me = str(threading.get_native_id())
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # the thread ended
            continue
        group = "scheduler thread" if tid == me else "XLA compute threads" if "XLAEigen" in comm else "other threads"
        out[group] += ns / 1e9
    return out


def run_once(worker, wrapped: bool, seed: int, threads: bool = False) -> tuple[dict, object]:
    """One workload run; returns ``{kind: [(wall_s, cpu_s, {thread group: cpu_s}), ...]}`` and the scheduler."""
    sched = sglang_engine.MiniScheduler(worker, sglang_engine.workload(seed))
    guard = sglang_jax.wrap(worker, CONFIG, tree_cache=sched.tree_cache) if wrapped else None
    times: dict[str, list] = {"prefill": [], "decode": []}
    try:
        for batch in sched:
            kind = "prefill" if batch.forward_mode.is_extend() else "decode"
            split = thread_cpu() if threads else {}
            wall, cpu = time.perf_counter(), time.process_time()
            if guard:
                guard.expect(batch)
            sched.run_batch(batch)  # the sampled ids come back to the host
            if guard:
                jax.block_until_ready(guard.state)
                guard.after_step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            split = {k: v - split[k] for k, v in thread_cpu().items()} if threads else {}
            times[kind].append((wall, cpu, split))
        if guard:
            guard.final_check()
    finally:
        if guard:
            guard.unwrap()
    return times, sched


def medians(times: dict) -> dict:
    """Median wall and CPU ms per step kind, each kind's first 2 steps dropped."""
    out = {}
    for kind, rows in times.items():
        rows = rows[2:]
        out[f"{kind} wall ms"] = 1e3 * statistics.median(r[0] for r in rows)
        out[f"{kind} cpu ms"] = 1e3 * statistics.median(r[1] for r in rows)
        out[f"{kind} steps"] = len(rows)
        for group in rows[0][2] if rows else ():
            out[f"{kind} cpu ms, {group}"] = 1e3 * statistics.median(r[2][group] for r in rows)
    return out


def sweep_ms(worker, sched, reps: int = 5) -> tuple[float, int]:
    """Median wall ms of one sweep of everything the radix cache holds (after a warm-up sweep), and its slots.

    The engine is warm (the runs cached their prompts): the guard adopts what the radix cache holds first."""
    guard = sglang_jax.wrap(worker, CONFIG, tree_cache=sched.tree_cache, live_requests=[])
    try:
        guard.sweep()
        jax.block_until_ready(guard.state)
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            guard.sweep()
            jax.block_until_ready(guard.state)
            samples.append(time.perf_counter() - start)
    finally:
        guard.unwrap()
    return 1e3 * statistics.median(samples), len(sglang_jax.radix_entries(sched.tree_cache).slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--threads", action="store_true", help="also split each step's CPU time by thread")
    args = parser.parse_args()
    worker, _ = sglang_engine.tiny_engine(args.page_size, seed=args.seed)
    for wrapped in (False, True):  # compile both
        run_once(worker, wrapped, args.seed, args.threads)
    runs: dict[str, list] = {"alone": [], "wrapped": []}
    for _ in range(args.reps):
        for name in runs:
            times, sched = run_once(worker, name == "wrapped", args.seed, args.threads)
            runs[name].append(medians(times))
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    sweep, slots = sweep_ms(worker, sched)
    print(f"sglang-jax tiny Llama, CPU, page size {args.page_size}, {args.reps} runs each, jax {jax.__version__}")
    print(f"{'per step (median)':<40}{'alone':>10}{'wrapped':>10}{'cost':>20}")
    split = [k for k in summary["alone"] if k.startswith("decode cpu ms, ")]
    for key in ("prefill cpu ms", "decode cpu ms", *split, "prefill wall ms", "decode wall ms"):
        a, w = summary["alone"][key], summary["wrapped"][key]
        print(f"{key:<40}{a:>10.2f}{w:>10.2f}{f'{w - a:+.2f} ms ({(w / a - 1) * 100:+.0f} %)':>20}")
    print(f"steps per run after compile: prefill {summary['alone']['prefill steps']}, decode "
          f"{summary['alone']['decode steps']}; one radix sweep ({slots} slots): {sweep:.1f} ms wall")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs, "sweep_ms": sweep, "sweep_slots": slots}, f, indent=1)


if __name__ == "__main__":
    main()
