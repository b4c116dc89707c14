"""What the multi-controller monitor costs per step on CPU: ``python benchmarks/bench_multihost_monitor.py P [STEPS]``.

Starts P local ``jax.distributed`` processes of 2 CPU devices each (a ``(dp=P, tp=2)`` mesh, TP peers in different
processes) over the sharded test step, and reports from process 0, in µs per step:
- ``after_step_us``: host time in ``ShardedCanaryMonitor.after_step`` (dispatching the lagged all-gather of every
  device's poll values, and reading the replica from ``check_lag_steps`` ago), median over the steps;
- ``loop_us`` with and without the monitor: a whole step loop (schedulers, placement, the step) divided by steps,
  median of 3 repeats; the difference is what the step loop pays for the monitor, collectives included.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _process(process_id: int, processes: int, coordinator: str, steps: int) -> None:
    import jax

    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)
    sys.path.insert(0, str(ROOT))
    import kvcanary_jax as kc
    from kvcanary_jax.demo import sharded as demo_sharded
    from tests.sharded import sharding_testlib as lib

    lay = demo_sharded.mesh_layout(len(jax.devices()))
    sharded = kc.ShardedKvCanary(lib.CANARY, lay)

    def loop(with_monitor: bool) -> tuple[float, list[float]]:
        run = lib.Run.start(lay)
        mon = kc.ShardedCanaryMonitor(sharded, report_on=0) if with_monitor else None
        run.step()  # compiled already after the first loop; this one is not timed
        jax.block_until_ready(run.state)
        spent = []
        started = time.perf_counter()
        for _ in range(steps):
            run.step()
            if mon is not None:
                t = time.perf_counter()
                mon.after_step(run.state)
                spent.append(time.perf_counter() - t)
        jax.block_until_ready(run.state)
        return (time.perf_counter() - started) / steps, spent

    loop(True)  # compiles the step, the poll and the gathers
    plain, monitored, after = [], [], []
    for _ in range(3):
        plain.append(loop(False)[0])
        per_step, spent = loop(True)
        monitored.append(per_step)
        after.extend(spent)
    if process_id == 0:
        us = lambda s: round(s * 1e6)  # noqa: E731
        print(json.dumps({"processes": processes, "devices": len(jax.devices()), "steps": steps,
                          "after_step_us": us(statistics.median(after)),
                          "loop_us_without_monitor": us(statistics.median(plain)),
                          "loop_us_with_monitor": us(statistics.median(monitored))}))  # fmt: skip
    jax.distributed.shutdown()


def main(processes: int, steps: int = 40) -> None:
    from kvcanary_jax.demo import multiprocess

    def command(i: int, coordinator: str) -> list[str]:
        return [sys.executable, __file__, "--process", str(i), str(processes), coordinator, str(steps)]

    finished = multiprocess.launch_local(command, processes=processes, devices=2, timeout_s=1200, cwd=str(ROOT))
    for i, (code, _out, err) in enumerate(finished):
        if code != 0:
            raise SystemExit(f"process {i} exited with {code}:\n{err[-4000:]}")
    print(finished[0][1].strip().splitlines()[-1])


if __name__ == "__main__":
    if sys.argv[1] == "--process":
        _process(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        main(*map(int, sys.argv[1:]))
