"""The HiCache host sweep's cost on CPU: per sweep, the step end's dispatch and dispatch + device time.

Usage: ``python benchmarks/bench_hicache_host_sweep_cpu.py`` (needs the sglang-jax extra). Runs the HiCache demo's
clean workload in each write policy with a host sweep every step (``host_sweep_interval=1``, 64 pages a sweep), each
sweep timed as dispatched (what the step end pays) and then blocked on (measurement only: the sweep itself never
syncs). Prints the medians over all sweeps but the first (its compile).
"""

from __future__ import annotations

import statistics
import time

import jax

from kvcanary_jax.demo import sglang_hicache as hc
from kvcanary_jax.integrations import sglang_hicache


def main() -> None:
    worker = hc.hicache_worker()
    sweep = sglang_hicache.HostRecords.host_sweep
    dispatch, total, pages = [], [], []

    def timed(carried) -> None:
        t, before = time.perf_counter(), carried.host_swept
        sweep(carried)
        dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(carried.guard.state)
        total.append(time.perf_counter() - t)
        pages.append(carried.host_swept - before)

    sglang_hicache.HostRecords.host_sweep = timed
    try:
        for policy in hc.POLICIES:
            run = hc.run(worker, write_policy=policy, host_sweep_interval=1)
            print(f"{policy}: {run.steps} steps, {run.pages_host_swept} pages swept, clean={run.ok}")
    finally:
        sglang_hicache.HostRecords.host_sweep = sweep
    d, f = (statistics.median(x[1:]) * 1e3 for x in (dispatch, total))
    per = statistics.median(pages[1:])
    print(f"jax {jax.__version__}, {jax.default_backend()}: {len(dispatch) - 1} sweeps of {per:.0f} pages, median "
          f"dispatch {d:.2f} ms, dispatch + device {f:.2f} ms ({f / per:.3f} ms a page)")


if __name__ == "__main__":
    main()
