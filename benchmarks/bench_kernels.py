"""Verify and write throughput, Pallas kernels vs the xla path, on the local GPU (Triton) or TPU (Mosaic).

Usage: python benchmarks/bench_kernels.py [--out DIR] [--deadline SECONDS] [--quick]

Each point runs ``N`` iterations of the op inside one jitted ``lax.fori_loop`` after a warm-up, and reports the
median over 5 such calls of (wall time / N). The loop carries a dependency through every iteration, so XLA can
neither hoist nor drop the op: verify folds a reduction of its bits into the next ``num_active`` (the same value,
which XLA cannot prove), write carries the donated canary buffer. The reduction (one pass over i32 bits) is
included in the verify numbers. Bandwidth is the fewest bytes the op must move (``workloads.*_bytes``) over that
time, as a fraction of a device-to-device copy timed in the same run (bytes read + written). Prints a progress
line per point and writes ``kernels.md`` (the RESULTS.md section) and ``kernels.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import workloads
from jax import lax

import kvcanary_jax as kc
from pallas_kernels.verify import api as verify_api
from pallas_kernels.verify import pallas_mosaic as verify_mosaic
from pallas_kernels.verify import pallas_triton as verify_triton
from pallas_kernels.write import api as write_api
from pallas_kernels.write import pallas_mosaic as write_mosaic
from pallas_kernels.write import pallas_triton as write_triton
from pallas_kernels.write import reference as write_reference

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
_START = time.perf_counter()
SECTIONS = ["verify", "write", "canary", "chain", "variants"]


def _median_seconds(step, carry, args, *, target_s: float = 0.03, calls: int = 5) -> float:
    """Median over ``calls`` of (wall time of one jitted N-iteration loop) / N, N sized to ~``target_s``."""

    def body(i, c, a):
        # Ties the loop-invariant inputs to the carry, so XLA cannot hoist the op's invariant part (its gathers
        # and hashes) out of the loop; the barrier is free at run time.
        c, a = lax.optimization_barrier((c, a))
        return step(c, a)

    loop = jax.jit(lambda c, a, n: lax.fori_loop(0, n, lambda i, c: body(i, c, a), c), donate_argnums=0)
    carry = jax.tree.map(jnp.copy, carry)  # donated below; the caller's arrays stay usable
    carry = jax.block_until_ready(loop(carry, args, 2))  # compile + warm-up
    start = time.perf_counter()
    carry = jax.block_until_ready(loop(carry, args, 2))
    n = int(min(2000, max(3, target_s / max((time.perf_counter() - start) / 2, 1e-7))))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        carry = jax.block_until_ready(loop(carry, args, n))
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Bytes/s of an in-place device-to-device pass over ``num_bytes`` (read + write counted)."""
    x = jnp.arange(num_bytes // 4, dtype=jnp.uint32)
    seconds = _median_seconds(lambda x, _: x ^ jnp.uint32(0x9E3779B9), x, ())
    return 2 * num_bytes / seconds


def verify_step(backend: str, mode: int, config=None):
    """One verify; a ``config`` runs the platform's kernel module directly with it (a variant)."""
    kernels = verify_mosaic if isinstance(config, verify_mosaic.Config) else verify_triton

    def step(active, a):
        buf, slots, tokens, positions, prevs, sources = a
        if config is None:
            bits = verify_api.verify(
                buf,
                slots,
                tokens,
                positions,
                prevs,
                active,
                real_kv_sources=sources,
                real_kv_hash_mode=mode,
                backend=backend,
            )
        else:
            bits = kernels.verify_bits(
                buf,
                slots,
                tokens,
                positions,
                prevs,
                active,
                real_kv_sources=sources,
                real_kv_hash_mode=mode,
                check_expected_token=False,
                config=config,
            )
        # min(bits) >= 0, so this keeps ``active`` unchanged; XLA cannot know, so each iteration runs in full.
        return jnp.minimum(active, slots.shape[0] + jnp.min(bits))

    return step


def write_step(backend: str, mode: int, config=None):
    """One write; a ``config`` runs the platform's kernel module directly with it (a variant)."""
    kernels = write_mosaic if isinstance(config, write_mosaic.Config) else write_triton

    def step(carry, a):
        buf, acc = carry
        *inputs, sources = a
        if config is None:
            buf, chain = write_api.write(buf, *inputs, real_kv_sources=sources, real_kv_hash_mode=mode, backend=backend)
        else:
            buf, chain = kernels.write(buf, *inputs, real_kv_sources=sources, real_kv_hash_mode=mode, config=config)
        # Consume every ChainOut field, as canary_write's ring append does, so the xla path computes them too.
        used = chain.prev_hash[:, 0] ^ chain.expected_position[:, 0]
        used = used ^ chain.position_assert_failed.astype(jnp.uint32) ^ chain.written.astype(jnp.uint32)
        return buf, acc ^ jnp.bitwise_xor.reduce(used)

    return step


class Table:
    def __init__(self, copy_bw: float):
        self.copy_bw, self.rows = copy_bw, []

    def add(self, op: str, shape: str, kv: str, backend: str, seconds: float, num_bytes: int, note: str = ""):
        row = dict(
            op=op,
            shape=shape,
            kv=kv,
            backend=backend,
            us=seconds * 1e6,
            gbs=num_bytes / seconds / 1e9,
            frac=num_bytes / seconds / self.copy_bw,
            note=note,
        )
        self.rows.append(row)
        t = time.perf_counter() - _START
        print(
            f"[{t:6.1f}s] {op:7} {shape:12} {kv:8} {backend:18} {row['us']:11.1f} us {row['gbs']:8.1f} GB/s "
            f"{100 * row['frac']:5.1f}% {note}",
            flush=True,
        )

    def speedup(self, op, shape, kv) -> str:
        us = {r["backend"]: r["us"] for r in self.rows if (r["op"], r["shape"], r["kv"]) == (op, shape, kv)}
        return f"{us['xla'] / us['pallas']:.2f}x" if "xla" in us and "pallas" in us else ""

    def markdown(self) -> str:
        lines = [
            "| op | shape | real-KV | backend | time / op (us) | GB/s | % copy BW | pallas speed-up | note |",
            "|---|---|---|---|---:|---:|---:|---:|---|",
        ]
        for r in self.rows:
            up = self.speedup(r["op"], r["shape"], r["kv"]) if r["backend"] == "pallas" else ""
            lines.append(
                f"| {r['op']} | {r['shape']} | {r['kv']} | {r['backend']} | {r['us']:.1f} | "
                f"{r['gbs']:.0f} | {100 * r['frac']:.1f} | {up} | {r['note']} |"
            )
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--deadline", type=float, default=1e9, help="skip the remaining points after this many s")
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    parser.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS, help="which parts to run")
    parser.add_argument(
        "--backends", nargs="+", help="default: pallas and xla on GPU and TPU, interpret and xla elsewhere"
    )
    parser.add_argument("--write-shapes", nargs="+", help="e.g. 256x1 1x4096 (default: all decode/prefill shapes)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    print(f"device={device.device_kind} jax={jax.__version__} backend={jax.default_backend()}", flush=True)
    table = Table(copy_bandwidth(256 << 20 if args.quick else 4 << 30))
    print(f"copy bandwidth {table.copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    # "pallas" is the platform's own kernels: Triton on GPU, Mosaic on TPU (pallas_kernels.backend).
    on_gpu, on_tpu = jax.default_backend() == "gpu", jax.default_backend() == "tpu"
    backends = args.backends or (("pallas", "xla") if on_gpu or on_tpu else ("interpret", "xla"))

    def point(op, shape, kv, backend, step, carry, step_args, num_bytes, note="", **timing):
        if time.perf_counter() - _START > args.deadline:
            print(f"skipped (deadline): {op} {shape} {kv} {backend}", flush=True)
            return
        try:
            table.add(op, shape, kv, backend, _median_seconds(step, carry, step_args, **timing), num_bytes, note)
        except Exception as e:  # a failing point must not hide the others
            print(f"FAILED {op} {shape} {kv} {backend}: {type(e).__name__}: {str(e)[:800]}", flush=True)

    for n in () if "verify" not in args.sections else workloads.VERIFY_ENTRIES[: 1 if args.quick else None]:
        w = workloads.verify(n)
        for kv, mode in workloads.MODES.items():
            for backend in backends:
                point(
                    "verify",
                    f"n={n}",
                    kv,
                    backend,
                    verify_step(backend, mode),
                    w.args[-1],
                    (*w.args[:-1], w.sources),
                    workloads.verify_bytes(n, mode),
                )
        del w

    shapes = [(bs, 1) for bs in workloads.DECODE_BATCHES] + list(workloads.PREFILL_SHAPES)
    if args.write_shapes:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.write_shapes]
    for num_reqs, each in () if "write" not in args.sections else shapes[: 2 if args.quick else None]:
        w = workloads.write(num_reqs, each)
        carry, step_args, tokens = (w.args[0], jnp.uint32(0)), (*w.args[1:], w.sources), w.num_entries
        for kv, mode in workloads.MODES.items():
            for backend in backends:
                point(
                    "write",
                    f"{num_reqs}x{each}",
                    kv,
                    backend,
                    write_step(backend, mode),
                    carry,
                    step_args,
                    workloads.write_bytes(tokens, mode),
                )

    # The upper-layer ops add the ring append (prefix sum + scatter) and counters around the kernels.
    canary_backends = backends if "canary" in args.sections else ()
    state = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(ring_capacity=1024))
    n = 4096 if args.quick else 1 << 20
    w = workloads.verify(n)
    plan = kc.VerifyPlan(*w.args[1:5], num_valid=jnp.asarray([n], jnp.int32), enable=jnp.ones((1,), jnp.int32))
    for backend in canary_backends:
        step = functools.partial(lambda s, a, b: kc.canary_verify(s, a[0], a[1], tag=2, backend=b), b=backend)
        point(
            "canary_verify",
            f"n={n}",
            "none",
            backend,
            step,
            state,
            (w.args[0], plan),
            workloads.verify_bytes(n, 0),
            "+ ring",
        )
    w = workloads.write(64 if args.quick else 256, 1)
    buf, offsets, seeds, num_valid, ids, positions, loc, _ = w.args
    wplan = kc.WritePlan(write_offsets=offsets, seed_slot_indices=seeds, num_valid_reqs=num_valid)
    for backend in canary_backends:
        step = functools.partial(lambda c, a, b: kc.canary_write(c[1], c[0], a[0], *a[1:], tag=2, backend=b), b=backend)
        point(
            "canary_write",
            f"{w.num_entries}x1",
            "none",
            backend,
            step,
            (buf, state),
            (wplan, ids, positions, loc),
            workloads.write_bytes(w.num_entries, 0),
            "+ ring",
        )

    chain_rows = []
    if "chain" in args.sections and not args.quick:
        w = workloads.write(8, 4096)
        for block in (1, 8):
            write_reference.CHAIN_BLOCK = block
            jax.clear_caches()  # the block size is a module constant, not a jit argument
            before = len(table.rows)
            point(
                "write",
                "8x4096",
                "none",
                f"xla CHAIN_BLOCK={block}",
                write_step("xla", 0),
                (w.args[0], jnp.uint32(0)),
                (*w.args[1:], w.sources),
                workloads.write_bytes(w.num_entries, 0),
                "chain-block study",
                target_s=0.2,
                calls=3,
            )
            if len(table.rows) > before:
                chain_rows.append((block, table.rows[-1]["us"]))
        write_reference.CHAIN_BLOCK = 8

    # Variants behind the heuristics (last: the first to go when the deadline is near).
    if "variants" in args.sections and on_gpu:
        n = 1 << 20
        w = workloads.verify(n)
        for kv, mode in (("none", 0), ("all", 2)):
            for block in (128, 512, 1024):
                config = verify_triton.Config(block=block, num_warps=4 if block <= 256 else 8)
                point(
                    "verify",
                    f"n={n}",
                    kv,
                    f"pallas block={block}",
                    verify_step("pallas", mode, config),
                    w.args[-1],
                    (*w.args[:-1], w.sources),
                    workloads.verify_bytes(n, mode),
                    "variant",
                )
        for num_reqs, each in ((256, 1), (1, 4096), (32, 512)):  # the other winner rule
            w = workloads.write(num_reqs, each)
            config = write_triton.heuristic(w.num_entries)
            config = dataclasses.replace(config, dedupe="pairwise" if config.dedupe == "sort" else "sort")
            point(
                "write",
                f"{num_reqs}x{each}",
                "none",
                f"pallas {config.dedupe}",
                write_step("pallas", 0, config),
                (w.args[0], jnp.uint32(0)),
                (*w.args[1:], w.sources),
                workloads.write_bytes(w.num_entries, 0),
                "variant",
            )

    if "variants" in args.sections and on_tpu:  # untuned: rows of 128 entries per grid step (issue 17)
        n = 1 << 20
        w = workloads.verify(n)
        for kv, mode in (("none", 0), ("all", 2)):
            for rows in (1, 2, 4, 8):
                point(
                    "verify",
                    f"n={n}",
                    kv,
                    f"pallas rows={rows}",
                    verify_step("pallas", mode, verify_mosaic.Config(rows=rows)),
                    w.args[-1],
                    (*w.args[:-1], w.sources),
                    workloads.verify_bytes(n, mode),
                    "variant",
                )
        for num_reqs, each in ((256, 1), (1, 4096)):
            w = workloads.write(num_reqs, each)
            for rows in (1, 8):
                point(
                    "write",
                    f"{num_reqs}x{each}",
                    "none",
                    f"pallas rows={rows}",
                    write_step("pallas", 0, write_mosaic.Config(rows=rows)),
                    (w.args[0], jnp.uint32(0)),
                    (*w.args[1:], w.sources),
                    workloads.write_bytes(w.num_entries, 0),
                    "variant",
                )

    header = (
        f"Card: {device.device_kind}; jax {jax.__version__}; {datetime.date.today().isoformat()}; "
        f"command: `cd benchmarks && python bench_kernels.py --out $OUT`.\n"
        f"Copy bandwidth measured in the same run: {table.copy_bw / 1e9:.0f} GB/s (bytes read + written).\n"
    )
    (args.out / "kernels.md").write_text(header + "\n" + table.markdown() + "\n")
    (args.out / "kernels.json").write_text(json.dumps(dict(copy_bw=table.copy_bw, rows=table.rows), indent=1))
    print(table.markdown())
    print("chain block (block, us/op):", chain_rows)


if __name__ == "__main__":
    sys.exit(main())
