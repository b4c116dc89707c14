"""Decode-step overhead of the canary on a Llama-3-8B-shaped JAX decoder: canary off vs on, in one process.

Usage (H200): python benchmarks/bench_decode_overhead.py --out $OUT
Smoke test (CPU, tiny model, interpret-mode attention): python benchmarks/bench_decode_overhead.py --tiny

Points of one step shape run in interleaved rounds (off, on, ..., off, on, ...): each round times a long donated
async loop (``--steps`` steps after warm-up, one sync at the end) per variant, so clock and temperature drift hits
all variants alike. Overhead is the median over ``--repeats`` rounds of (on / off of the same round - 1). The step is
the user's view, one jit with the KV cache and canary state donated: ``canary.before_forward`` (HEAD plans, verify,
write), the model forward over the paged cache between two ``kvcanary_jax.fence`` barriers (``--no-fence`` drops
them), ``canary.after_forward`` (TAIL verify and write with the layer-0 K/V real-KV fold). Results stream to
``<out>/decode_overhead.jsonl`` (the card and versions to ``<out>/header.json``); the table is printed at the end and
``<out>/overhead.png`` plots overhead against batch and context. ``--merge DIR...`` runs nothing: it writes one table
and plot from earlier runs' ``--out`` folders (one device time limit per call often splits the points over calls).

Every canary point also runs the canary alone (HEAD then TAIL in one jit, no forward): its wall time per step, and,
from a ``jax.profiler`` trace of ``--profile-steps`` steps, its device kernels per step and their device time
(``<out>/profiles.md`` lists each point's kernels). XLA:GPU runs a jit as one CUDA graph, which the trace shows as a
single ``command_buffer`` op, so that one profiled compile turns command buffers off
(``compiler_options={"xla_gpu_enable_command_buffer": ""}``); the timed steps keep XLA's defaults. The detail point
also checks the compiled step for
buffer copies and writes the profiled HLO to ``<out>/canary_only_hlo.txt`` (it names the trace's fusions).

Every variant also reports its step's compile time, wrapped beside unwrapped: ``lower_s`` (jaxpr to MLIR, the
Pallas kernels' Triton IR included) and ``compile_s`` (XLA's backend compile, the Triton kernels' PTX included),
summed from jax's monitoring events during the variant's first call (in-process caches cold for the first variant
of a shape only; no persistent cache).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import glob
import gzip
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llama_model as lm  # noqa: E402

import kvcanary_jax as kc  # noqa: E402

PAGE_SIZE = 16
_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_compile_seconds: collections.Counter = collections.Counter()  # filled by _on_event, registered in main()


def _on_event(event: str, seconds: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[_COMPILE_EVENTS[event]] += seconds


@dataclasses.dataclass(frozen=True)
class Point:
    """One measurement: step shape plus canary variant (``mode=None`` is canary off)."""

    kind: str  # "decode" or "prefill"
    bs: int
    ctx: int  # decode: tokens incl. the new one; prefill: chunk length
    mode: str | None = None  # real-KV mode: "none", "partial", "all"; None = canary off
    halves: str = "K+V"
    backend: str = "pallas"
    detail: bool = False  # also check the compiled step for buffer copies and dump the canary's HLO

    @property
    def label(self) -> str:
        canary = "off" if self.mode is None else f"{self.mode} {self.halves} {self.backend}"
        return f"{self.kind} bs={self.bs} ctx={self.ctx} canary={canary}"


def default_points(tiny: bool) -> list[Point]:
    """Most important first, so a time-limited run still covers the targets."""
    if tiny:
        return [
            Point("decode", 2, 64),
            Point("decode", 2, 64, "partial", detail=True),
            Point("decode", 2, 64, "all", "K"),
            Point("decode", 2, 64, "partial", backend="xla"),
            Point("prefill", 2, 32),
            Point("prefill", 2, 32, "partial"),
        ]
    points = []
    for kind, bs, ctx in [
        ("decode", 64, 1024),  # 0..3 (off, partial, none, all)
        ("decode", 1, 1024),  # 4..5 (off, partial); so on for each shape
        ("decode", 256, 1024),  # 6..7
        ("decode", 64, 8192),  # 8..9
        ("prefill", 32, 4096),  # 10..11
        ("decode", 1, 8192),  # 12..13
    ]:
        points += [Point(kind, bs, ctx), Point(kind, bs, ctx, "partial", detail=(bs, ctx) == (64, 1024))]
        if (bs, ctx) == (64, 1024):
            points += [Point(kind, bs, ctx, "none"), Point(kind, bs, ctx, "all")]
    # Last, with their own canary-off twins: K alone; the XLA chain walk compiles slowly.
    points += [Point("decode", 64, 1024), Point("decode", 64, 1024, "partial", "K")]  # 14, 15
    points += [Point("decode", 64, 1024), Point("decode", 64, 1024, "partial", backend="xla")]  # 16, 17
    return points


def copy_bandwidth(nbytes: int) -> float:
    """Device copy bandwidth in bytes/s (bytes read + written by a u32 xor pass), median of 10 after warm-up."""
    x = jnp.ones((nbytes // 4,), jnp.uint32)
    copy = jax.jit(lambda a: a ^ 1)
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - start)
    del x
    return 2 * nbytes / statistics.median(times)


class Pool:
    """The paged KV pool and a random page assignment for ``bs`` requests of ``pages_per_seq`` pages."""

    def __init__(self, shape: lm.ModelShape, num_pages: int, seed: int):
        self.shape, self.num_pages = shape, num_pages
        self.kv = lm.init_kv_cache(shape, num_pages, PAGE_SIZE, jax.random.key(seed))
        self.rng = np.random.default_rng(seed)

    def assign(self, bs: int, ctx: int):
        """Block tables and ``req_to_token`` (row 0 = padding) for requests of ``ctx`` tokens on shuffled pages."""
        pages_per_seq = ctx // PAGE_SIZE
        pages = 1 + self.rng.permutation(self.num_pages - 1)[: bs * pages_per_seq].reshape(bs, pages_per_seq)
        slots = (pages[:, :, None] * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(bs, ctx)
        req_to_token = np.zeros((bs + 1, ctx), np.int32)
        req_to_token[1:] = slots
        return jnp.asarray(pages, jnp.int32), req_to_token


def attention_kw(ctx: int, tiny: bool) -> tuple:
    """Split the sequence so every (kv head, split) program streams a few compute blocks of 8 pages."""
    pages = ctx // PAGE_SIZE
    per_block = min(8, pages)
    splits = max(1, min(16, pages // per_block))
    return (("k_splits", splits), ("pages_per_compute_block", per_block))


def make_canary(point: Point, num_slots: int, verify_capacity: int, tiny: bool) -> kc.KvCanary:
    backend = "auto" if tiny and point.backend == "pallas" else point.backend  # no Triton on the CPU smoke test
    config = kc.CanaryConfig(mode="log", real_kv_hash_mode=point.mode, backend=backend, ring_capacity=1024)
    return kc.KvCanary(
        config,
        kc.CanaryPool(
            num_slots=num_slots, page_size=PAGE_SIZE, with_v=point.halves == "K+V", verify_capacity=verify_capacity
        ),
    )


def kv_sources(canary: kc.KvCanary, kv, shape: lm.ModelShape):
    """Layer 0's K and V rows: page axis ``kv_heads * layers * pages`` (a free reshape); head 0 comes first, so
    slot ``s`` maps to layer 0, head 0 page ``s // 16``. ALL folds that head's 256-byte row."""
    flat = lambda a: kc.RealKvSource(a.reshape(-1, PAGE_SIZE, shape.head_dim), page_size=PAGE_SIZE)  # noqa: E731
    return canary.kv_sources(full_k=flat(kv[0]), full_v=flat(kv[1]) if canary.pool.with_v else None)


def canary_only(canary: kc.KvCanary, shape: lm.ModelShape):
    """HEAD then TAIL with no forward in between: primes the chains, and times and profiles the canary alone."""

    def canary_only_step(cs, b, kv):
        return canary.after_forward(canary.before_forward(cs, b), b, kv_sources(canary, kv, shape))

    return canary_only_step


def timed_steps(step, carry, steps: int) -> tuple[float, object]:
    """Wall time of ``steps`` async steps with one sync at the end, per step."""
    jax.block_until_ready(carry)
    start = time.perf_counter()
    for _ in range(steps):
        carry = step(*carry)
    jax.block_until_ready(carry)
    return (time.perf_counter() - start) / steps, carry


def warm_up(step, carry):
    """Compiles and runs three steps."""
    for _ in range(3):
        carry = step(*carry)
    return jax.block_until_ready(carry)


def canary_bytes(point: Point, shape: lm.ModelShape) -> int:
    """Extra HBM bytes per step, counted from the launches (model, not a profiler reading).

    Per verify entry and half: slot record 32 B + predecessor record 32 B + the real-KV read on TAIL (one 32-byte
    sector for PARTIAL, the 256-byte row for ALL); per entry, the plan: fused, the two ``req_to_token`` words read
    in-kernel (8 B); per launch, a 16 B plan row written by the plan build and read by each verify (16 + 16 per
    half). Per written entry: record 32 B + token/position/slot words 12 B on HEAD and on TAIL, plus the real-KV
    read on TAIL. HEAD and TAIL each run verify + write per half.
    """
    if point.mode is None:
        return 0
    halves = 2 if point.halves == "K+V" else 1
    entries = point.bs * (point.ctx - 1) if point.kind == "decode" else 0
    written = point.bs if point.kind == "decode" else point.bs * point.ctx
    rkv = {"none": 0, "partial": 32, "all": 256}[point.mode]
    plan = 2 * 8
    verify = entries * (halves * (2 * (32 + 32) + rkv) + plan)
    write = written * halves * (2 * (32 + 12) + rkv)
    return verify + write


@dataclasses.dataclass
class Variant:
    """One point's jitted step ``(tok, kv, cs, params, fixed) -> (tok, kv, cs)`` and its carry (``cs`` is None with
    the canary off); ``fixed`` holds the step's device-resident inputs that do not change between steps."""

    point: Point
    jitted: object
    tok: jax.Array
    cs: object = None
    canary: kc.KvCanary | None = None
    seconds: list = dataclasses.field(default_factory=list)
    compile: dict = dataclasses.field(default_factory=dict)  # lower_s, compile_s of the step's first call
    only: dict = dataclasses.field(default_factory=dict)  # the canary alone: times, kernels


def user_step(forward, shape: lm.ModelShape, canary: kc.KvCanary | None, fence: bool):
    """The user's step as one jit (KV and canary state donated): HEAD, forward, TAIL; the forward alone when off.

    ``fixed`` carries the block tables, positions and the canary batch with everything but ``input_ids``, built
    on the device once, so a step only swaps in the new tokens (as a serving loop keeps its tables resident).
    ``fence`` wraps the forward in :func:`kvcanary_jax.fence` as the runner's usage does, so XLA cannot schedule
    canary launches inside it.
    """

    def step(tok, kv, cs, params, fixed):
        bs = fixed["seq_lens"].shape[0]
        if canary is not None:
            batch = dataclasses.replace(fixed["batch"], input_ids=tok)
            cs = canary.before_forward(cs, batch)
            if fence:
                cs, kv = kc.fence(cs, kv)
        nxt, kv = forward(
            params, kv, tok, fixed["positions"], fixed["out_cache_loc"], fixed["block_tables"], fixed["seq_lens"]
        )
        if canary is not None:
            if fence:
                cs, kv = kc.fence(cs, kv)
            cs = canary.after_forward(cs, batch, kv_sources(canary, kv, shape))
        return jnp.broadcast_to(nxt[:, None], (bs, tok.shape[0] // bs)).reshape(-1), kv, cs

    return jax.jit(step, donate_argnums=(1, 2))


def run_group(points: list[Point], params, pool: Pool, shape: lm.ModelShape, args, bandwidth: float) -> list[dict]:
    """Times every variant of one step shape in interleaved rounds (off, on, ..., off, on, ...), so drift of the
    card's clocks and temperature hits all variants alike; a variant's overhead is the median over rounds of its
    time over the canary-off time of the same round."""
    first = points[0]
    bs, ctx = first.bs, first.ctx
    block_tables, req_to_token = pool.assign(bs, ctx)
    slots = jnp.asarray(req_to_token[1:])
    rng = np.random.default_rng(1)
    kw = dict(shape=shape, page_size=PAGE_SIZE, num_pages=pool.num_pages, interpret=args.tiny)
    if first.kind == "decode":
        tokens = jnp.asarray(rng.integers(1, shape.vocab, bs), jnp.int32)
        positions = jnp.full((bs,), ctx - 1, jnp.int32)
        out_cache_loc = slots[:, ctx - 1]
        prefix, extend = ctx - 1, 1
        kw["attention_kw"] = attention_kw(ctx, args.tiny)
    else:
        tokens = jnp.asarray(rng.integers(1, shape.vocab, bs * ctx), jnp.int32)
        positions = jnp.tile(jnp.arange(ctx, dtype=jnp.int32), bs)
        out_cache_loc = slots.reshape(-1)
        prefix, extend = 0, ctx
    batch = kc.CanaryBatch(
        req_pool_indices=jnp.arange(1, bs + 1, dtype=jnp.int32),
        prefix_lens=jnp.full((bs,), prefix, jnp.int32),
        extend_lens=jnp.full((bs,), extend, jnp.int32),
        req_to_token=jnp.asarray(req_to_token),
        input_ids=tokens,
        positions=positions,
        out_cache_loc=out_cache_loc,
    )
    fixed = dict(
        positions=positions,
        out_cache_loc=out_cache_loc,
        block_tables=block_tables,
        seq_lens=jnp.full((bs,), ctx, jnp.int32),
        batch=batch,
    )
    forward = functools.partial(lm.forward, **kw)
    steps = args.steps if first.kind == "decode" else args.prefill_steps

    variants = []
    for point in points:
        if point.mode is None:
            variants.append(Variant(point, user_step(forward, shape, None, fence=False), tokens))
            continue
        canary = make_canary(point, pool.num_pages * PAGE_SIZE, max(bs * ctx, 16), args.tiny)
        cs = prime_chains(canary, pool, req_to_token, bs, ctx, shape, point)
        variants.append(Variant(point, user_step(forward, shape, canary, fence=not args.no_fence), tokens, cs, canary))

    kv = pool.kv
    bound = [functools.partial(v.jitted, params=params, fixed=fixed) for v in variants]
    for v, step in zip(variants, bound, strict=True):
        before = collections.Counter(_compile_seconds)
        v.tok, kv, v.cs = warm_up(step, (v.tok, kv, v.cs))
        v.compile = {key: _compile_seconds[key] - before[key] for key in _COMPILE_EVENTS.values()}
    for _ in range(args.repeats):
        for v, step in zip(variants, bound, strict=True):
            seconds, (v.tok, kv, v.cs) = timed_steps(step, (v.tok, kv, v.cs), steps)
            v.seconds.append(seconds)
    pool.kv = kv

    off_variant = next((v for v in variants if v.point.mode is None), None)
    off = off_variant.seconds if off_variant else None
    off_copies = None  # the off-step's copies, compiled once per group for the first detail point
    results = []
    for v in variants:  # the canary alone, after every timed round of the group (kv is back in pool.kv)
        if v.point.mode is not None:
            v.only = canary_alone(v, fixed, pool, shape, steps, args)
    for v in variants:
        result = dict(dataclasses.asdict(v.point), label=v.point.label, step_s=statistics.median(v.seconds))
        result.update(v.compile)
        if v.point.mode is not None:
            result["fence"] = not args.no_fence
            if off is not None:
                ratios = [100 * (on / base - 1) for on, base in zip(v.seconds, off, strict=True)]
                result.update(overhead_pct=statistics.median(ratios), overhead_range=[min(ratios), max(ratios)])
            result.update(v.only)
            counters = np.asarray(v.cs.device.kernel_run_counters)[:, 0]
            result.update(
                violations=kc.read_violations(v.cs.violation_log).write_index,
                launches=[int(c) for c in counters],
                overflows=int(np.asarray(v.cs.verify_overflows)[0]),
            )
            if v.point.detail:
                result.update(canary_detail(v, params, fixed, pool, shape, steps, args))
                if off_variant is not None:
                    if off_copies is None:
                        lowered = off_variant.jitted.lower(v.tok, pool.kv, None, params=params, fixed=fixed)
                        off_copies = hlo_copies(lowered, pool.kv, v.cs)
                    result["hlo_copies_off"] = off_copies
        results.append(finish(result, v.point, shape, bandwidth))
        v.cs = None
    return results


def canary_detail(v: Variant, params, fixed: dict, pool: Pool, shape, steps: int, args) -> dict:
    """HLO copies of the compiled step (the canary should add none)."""
    return {"hlo_copies": hlo_copies(v.jitted.lower(v.tok, pool.kv, v.cs, params=params, fixed=fixed), pool.kv, v.cs)}


def canary_alone(v: Variant, fixed: dict, pool: Pool, shape, steps: int, args) -> dict:
    """The canary alone (HEAD + TAIL in one jit): wall time per step, and, from a profiler trace of a compile with
    command buffers off, its device kernels and device time per step."""
    only_step = jax.jit(canary_only(v.canary, shape), donate_argnums=(0,))
    only = lambda cs, b, kv: (only_step(cs, b, kv), b, kv)  # noqa: E731
    carry = warm_up(only, (v.cs, fixed["batch"], pool.kv))
    seconds = []
    for _ in range(args.repeats):
        elapsed, carry = timed_steps(only, carry, steps)
        seconds.append(elapsed)
    result = {"canary_only_s": statistics.median(seconds)}
    if args.profile_steps:
        lowered = only_step.lower(*carry)
        try:  # one kernel per thunk in the trace, not one command_buffer op per step
            compiled = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
        except Exception as error:  # noqa: BLE001 - an older XLA without the option: profile the graph as is
            print(f"  (command buffers stay on: {type(error).__name__}: {str(error)[:120]})", flush=True)
            compiled = lowered.compile()
        if v.point.detail:
            with open(os.path.join(args.out, "canary_only_hlo.txt"), "w") as f:  # names the profile's fusions
                f.write(compiled.as_text())
        profiled = lambda cs, b, kv: (compiled(cs, b, kv), b, kv)  # noqa: E731
        carry = warm_up(profiled, carry)
        stats, carry = profile_steps(profiled, carry, args.profile_steps, v.point.label, args.out)
        result.update(stats)
    v.cs = carry[0]
    return result


def finish(result: dict, point: Point, shape: lm.ModelShape, bandwidth: float) -> dict:
    """Adds the roofline fraction (weights + KV bytes read, over copy bandwidth) and the canary's extra bytes."""
    bs, ctx, seconds = point.bs, point.ctx, result["step_s"]
    read = shape.weight_bytes_read + (bs * ctx * shape.kv_bytes_per_token if point.kind == "decode" else 0)
    result["roofline_fraction"] = read / bandwidth / seconds
    result["canary_bytes"] = canary_bytes(point, shape)
    return result


def prime_chains(canary, pool: Pool, req_to_token, bs: int, ctx: int, shape, point: Point):
    """Writes HEAD and TAIL records for every cached position (0..ctx-2) as one prefill would, real KV included."""
    state = canary.init_state()
    cached = ctx - 1 if point.kind == "decode" else ctx
    batch = kc.CanaryBatch(
        req_pool_indices=jnp.arange(1, bs + 1, dtype=jnp.int32),
        prefix_lens=jnp.zeros((bs,), jnp.int32),
        extend_lens=jnp.full((bs,), cached, jnp.int32),
        req_to_token=jnp.asarray(req_to_token),
        input_ids=jnp.ones((bs * cached,), jnp.int32),
        positions=jnp.tile(jnp.arange(cached, dtype=jnp.int32), bs),
        out_cache_loc=jnp.asarray(req_to_token[1:, :cached].reshape(-1)),
    )
    state = jax.jit(canary_only(canary, shape))(state, batch, pool.kv)
    return canary.mark_init_finished(state)


def hlo_copies(lowered, kv, cstate) -> list[str]:
    """Copies of the KV pool or a canary buffer in a compiled step (the canary should add none), as HLO lines."""
    text = lowered.compile().as_text()
    big = {
        str(tuple(kv[0].shape)).replace(" ", "").strip("()"),
        str(tuple(cstate.full.k_tail.shape)).replace(" ", "").strip("()"),
    }
    return [line.strip()[:160] for line in text.splitlines() if " copy(" in line and any(b in line for b in big)]


def profile_steps(step, carry, steps: int, label: str, out: str) -> tuple[dict, object]:
    """Runs ``steps`` steps under ``jax.profiler`` and reads the trace: device kernels per step and their device
    time per step (µs) of the canary-only module, from the device streams (host threads when the trace has none).
    Appends the point's top kernels to ``<out>/profiles.md``; the trace itself goes to a temporary folder."""
    trace_dir = tempfile.mkdtemp(prefix="canary_profile_")
    jax.block_until_ready(carry)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            carry = step(*carry)
        jax.block_until_ready(carry)
    path = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    device_pids = {pid for pid, name in process.items() if name.startswith("/device:")}
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and "canary_only" in e.get("args", {}).get("hlo_module", "")
        and (not device_pids or e["pid"] in device_pids)
    ]
    per_op, count = collections.Counter(), collections.Counter()
    for e in ops:
        name = e["args"].get("hlo_op", e["name"])
        per_op[name] += e.get("dur", 0.0) / steps
        count[name] += 1 / steps
    stats = {
        "canary_kernels": len(ops) / steps,
        "canary_device_us": sum(per_op.values()),
        "profile_source": "device" if device_pids else "host",
    }
    lines = [
        f"## {label}",
        "",
        f"{stats['canary_kernels']:.0f} kernels and {stats['canary_device_us']:.1f} µs of "
        f"device time per step ({steps} steps, {stats['profile_source']} streams)",
        "",
    ]
    lines += ["| µs/step | per step | op |", "|---|---|---|"]
    lines += [f"| {us:.1f} | {count[op]:.0f} | `{op[:110]}` |" for op, us in per_op.most_common(40)]
    with open(os.path.join(out, "profiles.md"), "a") as f:
        f.write("\n".join(lines) + "\n\n")
    return stats, carry


def write_outputs(results: list[dict], out: str, header: dict) -> str:
    lines = [
        f"Card: {header['device']}; jax {header['jax']}; {header['date']}; copy bandwidth "
        f"{header['copy_bw'] / 1e12:.2f} TB/s; model {header['model']}",
        "",
        "| step | bs | ctx | canary | path | fence | step ms | overhead % (min..max) | canary-only ms | "
        "canary kernels | canary device µs | extra MB/step | roofline (off) | violations | lower + compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        over = ""
        if "overhead_pct" in r:
            low, high = r["overhead_range"]
            over = f"{r['overhead_pct']:+.2f} ({low:+.2f}..{high:+.2f})"
        canary = "off" if r["mode"] is None else f"{r['mode']} {r['halves']}"
        path = "" if r["mode"] is None else f"{r['backend']} {r.get('path', 'fused')}"
        only = f"{1e3 * r['canary_only_s']:.3f}" if "canary_only_s" in r else ""
        kernels = f"{r['canary_kernels']:.0f}" if "canary_kernels" in r else ""
        device_us = f"{r['canary_device_us']:.1f}" if "canary_device_us" in r else ""
        roof = f"{100 * r['roofline_fraction']:.0f}%" if r["mode"] is None else ""
        fence = {True: "yes", False: "no"}.get(r.get("fence"), "")
        built = f"{r['lower_s']:.2f} + {r['compile_s']:.2f}" if "compile_s" in r else ""
        lines.append(
            f"| {r['kind']} | {r['bs']} | {r['ctx']} | {canary} | {path} | {fence} | "
            f"{1e3 * r['step_s']:.3f} | {over} | {only} | {kernels} | {device_us} | {r['canary_bytes'] / 1e6:.1f} | {roof} | "
            f"{r.get('violations', '')} | {built} |"
        )
    table = "\n".join(lines)
    with open(os.path.join(out, "decode_overhead.md"), "w") as f:
        f.write(table + "\n")
    try:
        plot(results, os.path.join(out, "overhead.png"))
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return table


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    series = collections.defaultdict(list)
    for r in results:
        if r["kind"] == "decode" and (r["mode"], r["halves"], r["backend"]) == ("partial", "K+V", "pallas"):
            if "overhead_pct" in r:
                key = (r["ctx"], r.get("path", "fused"), r.get("fence", True))
                series[key].append((r["bs"], r["overhead_pct"], *r["overhead_range"]))
    color = {ctx: f"C{i}" for i, ctx in enumerate(sorted({key[0] for key in series}))}
    for (ctx, route, fenced), pts in sorted(series.items()):
        bs, mid, low, high = (np.array(column) for column in zip(*sorted(pts), strict=True))
        label = f"decode, context {ctx}" + ("" if route == "fused" else f", {route} (before)")
        label += "" if fenced else ", no fence"
        fmt = "o-" if route == "fused" else "s:"
        ax.errorbar(bs, mid, yerr=[mid - low, high - mid], label=label, fmt=fmt, capsize=3, color=color[ctx])
    ax.axhline(1.0, color="grey", ls="--", lw=0.8, label="1% budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("overhead, % of step (bars: min..max)")
    ax.set_title("kvcanary-jax, real-KV PARTIAL, K+V, pallas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merged_runs(run_dirs: list[str]) -> tuple[list[dict], dict]:
    """The results of earlier runs (their ``--out`` folders), in order, and their common header.

    Refuses runs from different cards or jax versions: their overheads do not compare.
    """
    results, headers = [], []
    for run_dir in run_dirs:
        with open(os.path.join(run_dir, "header.json")) as f:
            headers.append(json.load(f))
        with open(os.path.join(run_dir, "decode_overhead.jsonl")) as f:
            results += [json.loads(line) for line in f if line.strip()]
    setups = {(h["device"], h["jax"]) for h in headers}
    if len(setups) != 1:
        raise ValueError(f"--merge: the runs {run_dirs} come from different cards or jax versions {sorted(setups)}")
    return results, headers[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (interpret-mode attention)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prefill-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=20, help="canary-only steps traced per point (0: none)")
    parser.add_argument("--only", type=int, nargs="*", help="indices into the point list")
    parser.add_argument("--no-fence", action="store_true", help="no kvcanary_jax.fence around the forward")
    parser.add_argument("--detail", action="store_true", help="copy check on every canary point")
    parser.add_argument("--merge", nargs="+", metavar="RUN_DIR", help="run nothing: one table and plot of earlier runs")
    args = parser.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    if args.merge:
        os.makedirs(args.out, exist_ok=True)
        results, header = merged_runs(args.merge)
        print(write_outputs(results, args.out, header))
        return
    if args.tiny:
        args.steps, args.prefill_steps, args.repeats = min(args.steps, 3), 2, 1
    os.makedirs(args.out, exist_ok=True)
    shape = lm.ModelShape.tiny() if args.tiny else lm.ModelShape.llama3_8b()
    points = default_points(args.tiny)
    if args.only is not None:
        points = [points[i] for i in args.only]
    if args.detail:
        points = [dataclasses.replace(p, detail=p.mode is not None) for p in points]
    max_tokens = max(p.bs * p.ctx for p in points)
    bandwidth = copy_bandwidth(1 << 24 if args.tiny else 4 << 30)
    header = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        copy_bw=bandwidth,
        date=datetime.date.today().isoformat(),
        model="tiny" if args.tiny else "Llama-3-8B shape, bf16",
    )
    print(f"# {header}", flush=True)
    with open(os.path.join(args.out, "header.json"), "w") as f:
        json.dump(header, f)
    params = lm.init_params(shape, jax.random.key(0))
    pool = Pool(shape, max_tokens // PAGE_SIZE + 1, seed=2)
    results = []
    with open(os.path.join(args.out, "decode_overhead.jsonl"), "w") as log:
        groups = [list(g) for _, g in itertools.groupby(points, key=lambda p: (p.kind, p.bs, p.ctx))]
        shown = (
            "overhead_pct",
            "violations",
            "hlo_copies",
            "hlo_copies_off",
            "canary_only_s",
            "canary_kernels",
            "canary_device_us",
            "roofline_fraction",
            "lower_s",
            "compile_s",
        )
        for i, group in enumerate(groups):
            start = time.perf_counter()
            for result in run_group(group, params, pool, shape, args, bandwidth):
                results.append(result)
                log.write(json.dumps(result) + "\n")
                log.flush()
                extra = json.dumps({k: v for k, v in result.items() if k in shown})
                print(f"  {result['label']}: {1e3 * result['step_s']:.3f} ms/step {extra}", flush=True)
            print(f"[{i + 1}/{len(groups)}] done in {time.perf_counter() - start:.0f} s", flush=True)
            write_outputs(results, args.out, header)
    print(write_outputs(results, args.out, header))


if __name__ == "__main__":
    main()
