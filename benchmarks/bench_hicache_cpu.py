"""The canary's extra cost per HiCache page on CPU: backup (D2H) and load-back (H2D), with and without the records.

Usage: ``python benchmarks/bench_hicache_cpu.py [--repeats 30]`` (needs the sglang-jax extra). On the tiny Llama's
warm engine (HiCache on, device pool of ``DEVICE_TOKENS``), each transfer of ``n`` pages runs through the engine's own
``LRUHostKVPool`` calls, alternately bare and with :func:`carry_records`' hooks; prints median milliseconds per
transfer and the extra per page. The load's scatter is the CPU stand-in (the engine's is a TPU Pallas kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from kvcanary_jax.demo import sglang_hicache as hc
from kvcanary_jax.integrations import sglang_hicache, sglang_jax


def _time(fn, repeats: int) -> float:
    fn()  # compile
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    worker = hc.hicache_worker()
    sched = hc.HiCacheScheduler(worker, [], write_policy="write_back")
    guard = sglang_jax.wrap(worker, hc.CONFIG)
    pool = sched.tree_cache.host_pool
    bare = {name: getattr(pool, name) for name in ("stage_backup", "flush_backup", "stage_load", "flush_load")}
    ps = guard.layout.page_size
    print(f"jax {jax.__version__}, {jax.default_backend()}, page size {ps}, median of {args.repeats}")
    print("pages  backup bare  backup +canary  extra/page  load bare  load +canary  extra/page   (ms)")
    with hc.cpu_load_kernel():
        for n in (1, 8, 32):
            ids, pages = [int(b) for b in pool.alloc(n)], list(range(1, n + 1))
            row = [n]
            for hooked in (False, True):
                carried = sglang_hicache.carry_records(guard, sched.tree_cache) if hooked else None
                calls = {name: getattr(pool, name) for name in bare}
                backup = _time(
                    lambda c=calls, pages=pages, ids=ids: (c["stage_backup"](pages, ids), c["flush_backup"](ids)),
                    args.repeats,
                )
                bare["stage_load"](ids)

                def load(c=calls, pages=pages, ids=ids):
                    bare["stage_load"](ids)  # the H2D put, off the step path: the same with or without the canary
                    t = time.perf_counter()
                    c["flush_load"](ids, pages)
                    jax.block_until_ready(guard.state)
                    return time.perf_counter() - t

                load()
                loads = statistics.median(load() for _ in range(args.repeats)) * 1e3
                row += [backup, loads]
                if carried is not None:
                    carried.detach()
            b0, l0, b1, l1 = row[1:]
            extra_b, extra_l = (b1 - b0) / n, (l1 - l0) / n
            print(f"{n:5d}  {b0:11.2f}  {b1:14.2f}  {extra_b:10.3f}  {l0:9.2f}  {l1:12.2f}  {extra_l:10.3f}")
            pool.free(ids)
    guard.unwrap()
    sched.tree_cache.hicache_controller.shutdown()


if __name__ == "__main__":
    main()
