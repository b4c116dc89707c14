"""Decode-step overhead of the canary on a Llama-3-8B-shaped JAX decoder: canary off vs on, in one process.

Usage (H200): python benchmarks/bench_decode_overhead.py --out $OUT
Smoke test (CPU, tiny model, interpret-mode attention): python benchmarks/bench_decode_overhead.py --tiny

Each point times a long donated async loop (``--steps`` steps after warm-up, one sync at the end), ``--repeats``
times, and reports the median step time. The step is the user's view: ``canary.before_forward`` (HEAD plans,
verify, write), the model forward over the paged cache, ``canary.after_forward`` (TAIL verify and write with the
layer-0 K/V real-KV fold). Results stream to ``<out>/decode_overhead.jsonl``; the table is printed at the end and
``<out>/overhead.png`` plots overhead against batch and context.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llama_model as lm  # noqa: E402

import kvcanary_jax as kc  # noqa: E402
from kvcanary_jax import pool as kc_pool  # noqa: E402
from kvcanary_jax import runner  # noqa: E402

PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Point:
    """One measurement: step shape plus canary variant (``mode=None`` is canary off)."""

    kind: str  # "decode" or "prefill"
    bs: int
    ctx: int  # decode: tokens incl. the new one; prefill: chunk length
    mode: str | None = None  # real-KV mode: "none", "partial", "all"; None = canary off
    halves: str = "K+V"
    backend: str = "pallas"
    detail: bool = False  # also check the compiled TAIL for buffer copies and time the canary alone

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
    for bs, ctx in [(64, 1024), (1, 1024), (256, 1024), (1, 8192), (64, 8192)]:
        points += [Point("decode", bs, ctx), Point("decode", bs, ctx, "partial", detail=(bs, ctx) == (64, 1024))]
        if (bs, ctx) == (64, 1024):
            points += [
                Point("decode", bs, ctx, "none"),
                Point("decode", bs, ctx, "all"),
                Point("decode", bs, ctx, "partial", "K"),
            ]
    points += [Point("prefill", 32, 4096), Point("prefill", 32, 4096, "partial")]
    points += [Point("decode", 64, 1024, "partial", backend="xla")]  # last: its XLA chain walk compiles slowly
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


def make_canary(point: Point, num_slots: int, verify_capacity: int, tiny: bool) -> runner.KvCanary:
    backend = "auto" if tiny and point.backend == "pallas" else point.backend  # no Triton on the CPU smoke test
    config = kc.CanaryConfig(mode="log", real_kv_hash_mode=point.mode, backend=backend, ring_capacity=1024)
    return runner.KvCanary(
        config,
        kc_pool.CanaryPool(
            num_slots=num_slots, page_size=PAGE_SIZE, with_v=point.halves == "K+V", verify_capacity=verify_capacity
        ),
    )


def kv_sources(canary: runner.KvCanary, kv, shape: lm.ModelShape):
    """Layer 0's K and V rows: page axis ``kv_heads * layers * pages`` (a free reshape); head 0 comes first, so
    slot ``s`` maps to layer 0, head 0 page ``s // 16``. ALL folds that head's 256-byte row."""
    flat = lambda a: kc.RealKvSource(a.reshape(-1, PAGE_SIZE, shape.head_dim), page_size=PAGE_SIZE)  # noqa: E731
    return canary.kv_sources(full_k=flat(kv[0]), full_v=flat(kv[1]) if canary.pool.with_v else None)


def timed_loop(step, carry, steps: int, repeats: int) -> tuple[float, object]:
    """Median over ``repeats`` of (wall time of ``steps`` async steps, one sync at the end) / steps."""
    carry = step(*carry)  # warm-up (compiles)
    jax.block_until_ready(carry)
    for _ in range(2):
        carry = step(*carry)
    jax.block_until_ready(carry)
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            carry = step(*carry)
        jax.block_until_ready(carry)
        per_step.append((time.perf_counter() - start) / steps)
    return statistics.median(per_step), carry


def canary_bytes(point: Point, shape: lm.ModelShape) -> int:
    """Extra HBM bytes per step, counted from the launches (model, not a profiler reading).

    Per verify entry: slot record 32 B + predecessor record 32 B + plan row 16 B (written by the plan build, read
    by verify: 32 B) + the real-KV read on TAIL (one 32-byte sector for PARTIAL, the 256-byte row for ALL).
    Per written entry: record 32 B + token/position/slot words 12 B on HEAD and on TAIL, plus the real-KV read on
    TAIL. HEAD and TAIL each run verify + write per half.
    """
    if point.mode is None:
        return 0
    halves = 2 if point.halves == "K+V" else 1
    entries = point.bs * (point.ctx - 1) if point.kind == "decode" else 0
    written = point.bs if point.kind == "decode" else point.bs * point.ctx
    rkv = {"none": 0, "partial": 32, "all": 256}[point.mode]
    verify = entries * halves * (2 * (32 + 32 + 32) + rkv)
    write = written * halves * (2 * (32 + 12) + rkv)
    return verify + write


@functools.cache
def _compiled_forward(kw: tuple):
    """One jitted forward per step shape, shared by the canary-off and canary-on variants (compiled once)."""
    return jax.jit(functools.partial(lm.forward, **dict(kw)), donate_argnums=(1,))


def run_point(point: Point, params, pool: Pool, shape: lm.ModelShape, args, bandwidth: float) -> dict:
    bs, ctx = point.bs, point.ctx
    block_tables, req_to_token = pool.assign(bs, ctx)
    slots = jnp.asarray(req_to_token[1:])
    rng = np.random.default_rng(1)
    kw = dict(shape=shape, page_size=PAGE_SIZE, num_pages=pool.num_pages, interpret=args.tiny)
    if point.kind == "decode":
        tokens = jnp.asarray(rng.integers(1, shape.vocab, bs), jnp.int32)
        positions = jnp.full((bs,), ctx - 1, jnp.int32)
        out_cache_loc = slots[:, ctx - 1]
        seq_lens = jnp.full((bs,), ctx, jnp.int32)
        prefix, extend = ctx - 1, 1
        kw["attention_kw"] = attention_kw(ctx, args.tiny)
    else:
        tokens = jnp.asarray(rng.integers(1, shape.vocab, bs * ctx), jnp.int32)
        positions = jnp.tile(jnp.arange(ctx, dtype=jnp.int32), bs)
        out_cache_loc = slots.reshape(-1)
        seq_lens = jnp.full((bs,), ctx, jnp.int32)
        prefix, extend = 0, ctx
    forward = _compiled_forward(tuple(sorted(kw.items())))

    def batch_for(input_ids):
        return runner.CanaryBatch(
            req_pool_indices=jnp.arange(1, bs + 1, dtype=jnp.int32),
            prefix_lens=jnp.full((bs,), prefix, jnp.int32),
            extend_lens=jnp.full((bs,), extend, jnp.int32),
            req_to_token=jnp.asarray(req_to_token),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
        )

    result = dict(dataclasses.asdict(point), label=point.label)
    if point.mode is None:

        def step(tok, kv):
            nxt, kv = forward(params, kv, tok, positions, out_cache_loc, block_tables, seq_lens)
            return (jnp.broadcast_to(nxt[:, None], (bs, tokens.shape[0] // bs)).reshape(-1), kv)

        seconds, (_, pool.kv) = timed_loop(
            step, (tokens, pool.kv), args.steps if point.kind == "decode" else args.prefill_steps, args.repeats
        )
    else:
        canary = make_canary(point, pool.num_pages * PAGE_SIZE, max(bs * ctx, 16), args.tiny)
        head = jax.jit(canary.before_forward, donate_argnums=(0,))
        tail = jax.jit(
            lambda cs, b, kv: canary.after_forward(cs, b, kv_sources(canary, kv, shape)), donate_argnums=(0,)
        )
        cstate = prime_chains(canary, pool, req_to_token, bs, ctx, shape, point)

        def step(tok, kv, cs):
            batch = batch_for(tok)
            cs = head(cs, batch)
            nxt, kv = forward(params, kv, tok, positions, out_cache_loc, block_tables, seq_lens)
            cs = tail(cs, batch, kv)
            return (jnp.broadcast_to(nxt[:, None], (bs, tokens.shape[0] // bs)).reshape(-1), kv, cs)

        seconds, (_, pool.kv, cstate) = timed_loop(
            step, (tokens, pool.kv, cstate), args.steps if point.kind == "decode" else args.prefill_steps, args.repeats
        )
        report = kc.read_violations(cstate.violation_log)
        counters = np.asarray(cstate.device.kernel_run_counters)[:, 0]
        result.update(
            violations=report.write_index,
            launches=[int(c) for c in counters],
            overflows=int(np.asarray(cstate.verify_overflows)[0]),
        )
        if not point.detail:
            result["step_s"] = seconds
            return finish(result, point, shape, bandwidth)
        result["hlo_copies"] = hlo_copies(tail, cstate, batch_for(tokens), pool.kv)
        canary_only = jax.jit(
            lambda cs, b, kv: canary.after_forward(canary.before_forward(cs, b), b, kv_sources(canary, kv, shape)),
            donate_argnums=(0,),
        )
        only_seconds, (cstate, *_) = timed_loop(
            lambda cs, b, kv: (canary_only(cs, b, kv), b, kv),
            (cstate, batch_for(tokens), pool.kv),
            args.steps if point.kind == "decode" else args.prefill_steps,
            args.repeats,
        )
        result["canary_only_s"] = only_seconds
        del cstate
    result["step_s"] = seconds
    return finish(result, point, shape, bandwidth)


def finish(result: dict, point: Point, shape: lm.ModelShape, bandwidth: float) -> dict:
    """Adds the roofline fraction (weights + KV bytes read, over copy bandwidth) and the canary's extra bytes."""
    bs, ctx, seconds = point.bs, point.ctx, result["step_s"]
    read = shape.weight_bytes + (bs * ctx * shape.kv_bytes_per_token if point.kind == "decode" else 0)
    result["roofline_fraction"] = read / bandwidth / seconds
    result["canary_bytes"] = canary_bytes(point, shape)
    return result


def prime_chains(canary, pool: Pool, req_to_token, bs: int, ctx: int, shape, point: Point):
    """Writes HEAD and TAIL records for every cached position (0..ctx-2) as one prefill would, real KV included."""
    state = canary.init_state()
    cached = ctx - 1 if point.kind == "decode" else ctx
    batch = runner.CanaryBatch(
        req_pool_indices=jnp.arange(1, bs + 1, dtype=jnp.int32),
        prefix_lens=jnp.zeros((bs,), jnp.int32),
        extend_lens=jnp.full((bs,), cached, jnp.int32),
        req_to_token=jnp.asarray(req_to_token),
        input_ids=jnp.ones((bs * cached,), jnp.int32),
        positions=jnp.tile(jnp.arange(cached, dtype=jnp.int32), bs),
        out_cache_loc=jnp.asarray(req_to_token[1:, :cached].reshape(-1)),
    )
    prime = jax.jit(
        lambda cs, b, kv: canary.after_forward(canary.before_forward(cs, b), b, kv_sources(canary, kv, shape))
    )
    state = prime(state, batch, pool.kv)
    return canary.mark_init_finished(state)


def hlo_copies(tail, cstate, batch, kv) -> int:
    """Copies of the KV pool or a canary buffer in the compiled TAIL launch (should be 0)."""
    text = tail.lower(cstate, batch, kv).compile().as_text()
    big = {
        str(tuple(kv[0].shape)).replace(" ", "").strip("()"),
        str(tuple(cstate.full.k_tail.shape)).replace(" ", "").strip("()"),
    }
    return sum(1 for line in text.splitlines() if " copy(" in line and any(b in line for b in big))


def write_outputs(results: list[dict], out: str, header: dict) -> str:
    off = {(r["kind"], r["bs"], r["ctx"]): r["step_s"] for r in results if r["mode"] is None}
    lines = [
        f"Card: {header['device']}; jax {header['jax']}; {header['date']}; copy bandwidth "
        f"{header['copy_bw'] / 1e12:.2f} TB/s; model {header['model']}",
        "",
        "| step | bs | ctx | canary | backend | step ms | overhead % | canary-only ms | extra MB/step | "
        "roofline (off) | violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = off.get((r["kind"], r["bs"], r["ctx"]))
        over = "" if r["mode"] is None or base is None else f"{100 * (r['step_s'] / base - 1):+.2f}"
        canary = "off" if r["mode"] is None else f"{r['mode']} {r['halves']}"
        only = f"{1e3 * r['canary_only_s']:.3f}" if "canary_only_s" in r else ""
        roof = f"{100 * r['roofline_fraction']:.0f}%" if r["mode"] is None else ""
        lines.append(
            f"| {r['kind']} | {r['bs']} | {r['ctx']} | {canary} | {r['backend'] if r['mode'] else ''} | "
            f"{1e3 * r['step_s']:.3f} | {over} | {only} | {r['canary_bytes'] / 1e6:.1f} | {roof} | "
            f"{r.get('violations', '')} |"
        )
    table = "\n".join(lines)
    with open(os.path.join(out, "decode_overhead.md"), "w") as f:
        f.write(table + "\n")
    try:
        plot(results, off, os.path.join(out, "overhead.png"))
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return table


def plot(results, off, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for ctx in sorted({r["ctx"] for r in results if r["kind"] == "decode"}):
        pts = sorted(
            (r["bs"], 100 * (r["step_s"] / off[("decode", r["bs"], ctx)] - 1))
            for r in results
            if r["kind"] == "decode"
            and r["ctx"] == ctx
            and r["mode"] == "partial"
            and r["halves"] == "K+V"
            and r["backend"] == "pallas"
            and ("decode", r["bs"], ctx) in off
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"decode, context {ctx}")
    ax.axhline(1.0, color="grey", ls="--", lw=0.8, label="1% budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("canary overhead (% of step)")
    ax.set_title("kvcanary-jax, real-KV PARTIAL, K+V, pallas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (interpret-mode attention)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prefill-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", type=int, nargs="*", help="indices into the point list")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.prefill_steps, args.repeats = min(args.steps, 3), 2, 1
    os.makedirs(args.out, exist_ok=True)
    shape = lm.ModelShape.tiny() if args.tiny else lm.ModelShape.llama3_8b()
    points = default_points(args.tiny)
    if args.only is not None:
        points = [points[i] for i in args.only]
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
    params = lm.init_params(shape, jax.random.key(0))
    pool = Pool(shape, max_tokens // PAGE_SIZE + 1, seed=2)
    results = []
    with open(os.path.join(args.out, "decode_overhead.jsonl"), "w") as log:
        for i, point in enumerate(points):
            start = time.perf_counter()
            result = run_point(point, params, pool, shape, args, bandwidth)
            results.append(result)
            log.write(json.dumps(result) + "\n")
            log.flush()
            print(
                f"[{i + 1}/{len(points)}] {point.label}: {1e3 * result['step_s']:.3f} ms/step "
                f"({time.perf_counter() - start:.0f} s) {json.dumps({k: v for k, v in result.items() if k in ('violations', 'hlo_copies', 'canary_only_s', 'roofline_fraction')})}",
                flush=True,
            )
            write_outputs(results, args.out, header)
    print(write_outputs(results, args.out, header))


if __name__ == "__main__":
    main()
