"""What the canary adds on CPU: compile time, step time and compiled HLO size, wrapped vs the same step unwrapped.

    python benchmarks/bench_cpu_cost.py [--only readme,demo,demo-full,sglang] [--backends xla,interpret,interpret_tpu]
                                        [--reps 50] [--baseline-tree /work/main]

Per shape and backend, the step is built twice: unwrapped (the forward alone) and wrapped (the canary's HEAD and TAIL
around it). Compile is ``lower`` + ``compile`` from a cold cache (``jax.clear_caches()``, no persistent cache); the
step time is the median of ``--reps`` steady-state calls (outputs fed back, ``block_until_ready``); the HLO counts are
the instructions and fusions of ``compiled.as_text()``. Shapes: the README's wrap snippet (256 slots, page 16, 4 rows,
PARTIAL K+V), the demo's step (its fault-run config: SWA, K only, both asserts), ``demo-full`` (the same build without
its SWA group: one group's phases) and the sglang-jax tiny engine's decode (when ``sgl_jax`` imports; step time only,
through ``bench_sglang_jax_cpu``). ``--baseline-tree`` runs the same measurements on another checkout (e.g. main's) in
a subprocess, interleaved per shape, for before/after pairs on one loaded machine. Progress goes to stderr, a markdown
table to stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_compilation_cache", False)

SHAPES = ("readme", "demo", "demo-full", "sglang")
BACKENDS = ("xla", "interpret", "interpret_tpu")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# A built step: (jitted fn, args, feed) where feed(args, outputs) gives the next call's args (donated buffers back in).
Built = tuple[Callable, tuple, Callable]


def readme_step(backend: str, wrapped: bool) -> Built:
    """The README wrap snippet's step (tests/test_readme.py runs the snippet itself), one decode step of 2 of 4 rows."""
    import kvcanary_jax as kc

    num_slots, page_size, max_reqs, max_context = 256, 16, 4, 64
    canary = kc.KvCanary(
        kc.CanaryConfig(mode="raise", real_kv_hash_mode="partial", backend=backend),
        kc.CanaryPool(num_slots=num_slots, page_size=page_size),
    )
    state = canary.init_state()
    kv = [jnp.zeros((num_slots // page_size, page_size, 2, 64), jnp.bfloat16) for _ in "kv"]

    def forward(kv, batch):
        loc = jnp.where(batch.out_cache_loc >= 0, batch.out_cache_loc, num_slots)
        rows = jnp.broadcast_to(batch.input_ids[:, None, None], (loc.shape[0], 2, 64)).astype(jnp.bfloat16)
        return [x.at[loc // page_size, loc % page_size].set(rows * s, mode="drop") for x, s in zip(kv, (1, -1), strict=True)]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(kv, state, batch):
        if wrapped:
            state = canary.before_forward(state, batch)
            state, kv = kc.fence(state, kv)
        kv = forward(kv, batch)
        if wrapped:
            state, kv = kc.fence(state, kv)
            state = canary.after_forward(state, batch, canary.kv_sources(full_k=kv[0], full_v=kv[1]))
        return kv, state

    req_to_token = np.zeros((max_reqs, max_context), np.int32)
    req_to_token[0, :40], req_to_token[1, :40] = np.arange(1, 41), np.arange(101, 141)
    real, i = np.array([1, 1, 0, 0], bool), 20
    batch = kc.CanaryBatch(
        req_pool_indices=np.where(real, [0, 1, -1, -1], -1).astype(np.int32),
        prefix_lens=np.where(real, i, 0).astype(np.int32),
        extend_lens=real.astype(np.int32),
        req_to_token=req_to_token,
        input_ids=np.where(real, [7 + i, 9 + i, 0, 0], 0).astype(np.int32),
        positions=np.where(real, i, 0).astype(np.int32),
        out_cache_loc=np.where(real, req_to_token[[0, 1, 0, 0], i], -1).astype(np.int32),
    )
    return step, (kv, state, batch), lambda args, out: (out[0], out[1], args[2])


def demo_step(backend: str, wrapped: bool, *, swa: bool = True) -> Built:
    """The demo's jitted step (its fault runs' config and build), on a decode-and-prefill batch of its scheduler.
    Without ``swa`` (the ``demo-full`` shape), the same build with its FULL group only: one group's phases."""
    import dataclasses

    from kvcanary_jax.demo import faults, loop

    config = dataclasses.replace(faults.DEMO_CONFIG, backend=backend) if wrapped else loop._OFF
    setup = loop.build_demo(canary_config=config, **{**faults.DEMO_BUILD, "swa": swa})
    for _ in range(6):  # past the first prefills: running decodes mixed with new requests
        batch = setup.scheduler.step()
        setup.scheduler.commit(None)
    fn = functools.partial(loop._jitted_step, setup.canary, setup.layout)
    jitted = jax.jit(fn, donate_argnums=(1, 2))
    args = (setup.params, setup.kv_cache, setup.canary_state, batch)
    return jitted, args, lambda args, out: (args[0], out[2], out[3], args[3])


def hlo_counts(text: str) -> tuple[int, int]:
    """(instructions, fusions) of a compiled module's text: every ``name = ...`` line, and the fusion ops."""
    instructions = len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", text, flags=re.M))
    fusions = len(re.findall(r"= [^=]*? fusion\(", text))
    return instructions, fusions


def measure(build: Callable[[str, bool], Built], backend: str, wrapped: bool, reps: int) -> dict:
    """Cold compile seconds, median step ms and HLO counts of one built step."""
    fn, args, feed = build(backend, wrapped)
    jax.clear_caches()
    start, cpu = time.perf_counter(), time.process_time()
    lowered = fn.lower(*args)
    compiled = lowered.compile()
    compile_s, compile_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    instructions, fusions = hlo_counts(compiled.as_text())
    for _ in range(3):  # warm-up
        args = feed(args, jax.block_until_ready(compiled(*args)))
    samples = []
    deadline = time.perf_counter() + 60.0  # a slow backend stops early (at least 3 samples)
    for n in range(reps):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - start)
        args = feed(args, out)
        if n >= 2 and time.perf_counter() > deadline:
            break
    return {
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "step_ms": 1e3 * statistics.median(samples),
        "samples": len(samples),
        "instructions": instructions,
        "fusions": fusions,
    }


def sglang_decode(reps: int) -> dict | None:
    """Decode step wall/CPU ms of the sglang-jax tiny engine alone and wrapped (``bench_sglang_jax_cpu``)."""
    try:
        import sgl_jax  # noqa: F401
    except ImportError:
        return None
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_sglang_jax_cpu as bench

    from kvcanary_jax.demo import sglang_engine

    worker, _ = sglang_engine.tiny_engine(1)
    for wrapped in (False, True):
        bench.run_once(worker, wrapped, 0)
    runs: dict[str, list] = {"alone": [], "wrapped": []}
    for _ in range(reps):
        for name in runs:
            runs[name].append(bench.medians(bench.run_once(worker, name == "wrapped", 0)[0]))
    return {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}


BUILDERS = {"readme": readme_step, "demo": demo_step, "demo-full": functools.partial(demo_step, swa=False)}


def run_shape(shape: str, backends: list[str], reps: int) -> list[dict]:
    """Every (backend, wrapped) measurement of one shape, as rows."""
    rows = []
    if shape == "sglang":
        result = sglang_decode(max(1, reps // 25))
        if result is None:
            log("sglang: sgl_jax does not import; skipped")
        else:
            rows.append({"shape": "sglang", "backend": "auto", "sglang": result})
        return rows
    for backend in backends:
        for wrapped in (False, True):
            if not wrapped and backend != backends[0] and rows:
                rows.append({**rows[0], "backend": backend})  # the unwrapped step has no backend
                continue
            log(f"{shape} {backend} {'wrapped' if wrapped else 'unwrapped'} ...")
            result = measure(BUILDERS[shape], backend, wrapped, reps)
            log(f"  {json.dumps(result)}")
            rows.append({"shape": shape, "backend": backend, "wrapped": wrapped, **result})
    return rows


def table(rows: list[dict], label: str) -> str:
    """Markdown: per shape and backend, unwrapped vs wrapped and the canary's cost."""
    lines = [
        f"| {label}shape | backend | compile s (unwrapped -> wrapped) | +s | compile CPU s | +CPU s "
        "| step ms (unwrapped -> wrapped) | +ms | HLO instr. | fusions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in SHAPES:
        for row in (r for r in rows if r["shape"] == shape and "sglang" in r):
            alone, wrapped = row["sglang"]["alone"], row["sglang"]["wrapped"]
            a, w = alone["decode wall ms"], wrapped["decode wall ms"]
            ac, wc = alone["decode cpu ms"], wrapped["decode cpu ms"]
            lines.append(
                f"| {label}sglang decode | auto | - | - | wall {a:.1f} -> {w:.1f} ({w / a:.2f}x), cpu {ac:.1f} -> "
                f"{wc:.1f} ({wc / ac:.2f}x) | {w - a:+.1f} | - | - | - | - |"
            )
        backends = dict.fromkeys(r["backend"] for r in rows if r["shape"] == shape and "wrapped" in r)
        for backend in backends:
            pair = {r["wrapped"]: r for r in rows if r["shape"] == shape and r["backend"] == backend and "wrapped" in r}
            if set(pair) != {False, True}:
                continue
            u, w = pair[False], pair[True]
            lines.append(
                f"| {label}{shape} | {backend} | {u['compile_s']:.2f} -> {w['compile_s']:.2f} "
                f"| {w['compile_s'] - u['compile_s']:+.2f} | {u['compile_cpu_s']:.2f} -> {w['compile_cpu_s']:.2f} "
                f"| {w['compile_cpu_s'] - u['compile_cpu_s']:+.2f} | {u['step_ms']:.3f} -> {w['step_ms']:.3f} "
                f"| {w['step_ms'] - u['step_ms']:+.3f} | {u['instructions']} -> {w['instructions']} "
                f"| {u['fusions']} -> {w['fusions']} |"
            )
    return "\n".join(lines)


def baseline_rows(tree: str, shape: str, args: argparse.Namespace) -> list[dict]:
    """The same shape measured on another checkout (its package, this script), in a subprocess."""
    cmd = [sys.executable, __file__, "--only", shape, "--backends", args.backends, "--reps", str(args.reps), "--json-rows"]
    env = {**os.environ, "PYTHONPATH": tree}
    log(f"baseline {shape} on {tree} ...")
    out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    log(out.stderr.rstrip())
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="readme,demo,sglang", help=f"comma-separated shapes of {SHAPES}")
    parser.add_argument("--backends", default="xla", help=f"comma-separated backends of {BACKENDS}")
    parser.add_argument("--reps", type=int, default=50, help="steady-state steps timed (median)")
    parser.add_argument("--baseline-tree", default=None, help="also measure this checkout (e.g. /work/main)")
    parser.add_argument("--json-rows", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [s for s in args.only.split(",") if s]
    backends = [b for b in args.backends.split(",") if b]
    for name, values, allowed in (("--only", shapes, SHAPES), ("--backends", backends, BACKENDS)):
        if not values or set(values) - set(allowed):
            parser.error(f"{name} takes a comma-separated subset of {allowed}; got {values}")
    import kvcanary_jax

    log(f"kvcanary_jax from {pathlib.Path(kvcanary_jax.__file__).parent}, jax {jax.__version__}")
    rows, before = [], []
    for shape in shapes:
        if args.baseline_tree:
            before += baseline_rows(args.baseline_tree, shape, args)
        rows += run_shape(shape, backends, args.reps)
    if args.json_rows:
        print(json.dumps(rows))
        return
    if before:
        print(table(before, "before: ") + "\n")
    print(table(rows, "after: " if before else ""))


if __name__ == "__main__":
    main()
