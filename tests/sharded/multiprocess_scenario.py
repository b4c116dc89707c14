"""One process of the multi-controller scenario that ``test_multiprocess.py`` launches P times.

``python multiprocess_scenario.py PROCESS_ID NUM_PROCESSES COORDINATOR`` joins ``jax.distributed`` (2 CPU devices
per process, set by the launcher), builds a ``(dp, tp=2)`` mesh whose TP peers live in different processes, and runs
four short loops over the sharded test step, each with its own :class:`ShardedCanaryMonitor`:

- ``clean``: log mode, nothing injected; the violations every process saw (none expected).
- ``kv``: log mode, one K byte flipped on a device of process 1; who reported it.
- ``chain``: log mode, one TAIL record's PREV_HASH flipped on the TP index 1 device of data shard 0 (a process other
  than its TP peer's); the reasons and peers reported.
- ``health``: one device of process 1 has its launch counters reset; the health error's text.
- ``raise``: raise mode, the ``kv`` fault; the step at which this process raised and the error's text.

It prints one JSON object; the test compares every process's object with the others and with the expectations.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax


def _coords_of_process(lay, process: int, data_index: int = 0) -> tuple[int, int]:
    """The mesh coordinates of the device of ``process`` in data shard ``data_index``."""
    return next(c for c, d in lay.devices() if d.process_index == process and c[0] == data_index)


def _observed(monitor) -> list[dict]:
    return [
        {"device": list(o.device), "peer": o.peer and list(o.peer), "step": o.observed.step,
         "tag": o.observed.violation.tag_label, "reasons": o.observed.violation.reason_labels}
        for o in monitor.observed
    ]  # fmt: skip


def main(process_id: int, num_processes: int, coordinator: str) -> dict:
    started = time.perf_counter()
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    import jax.numpy as jnp

    import kvcanary_jax as kc
    from kvcanary_jax.demo import sharded as demo_sharded
    from tests.sharded import sharding_testlib as lib

    lay = demo_sharded.mesh_layout(len(jax.devices()))
    log_canary = dataclasses.replace(
        lib.CANARY, config=dataclasses.replace(lib.CONFIG, check_lag_steps=2, health_check_every_n_steps=4)
    )

    def monitor(mode: str = "log") -> kc.ShardedCanaryMonitor:
        canary = dataclasses.replace(log_canary, config=dataclasses.replace(log_canary.config, mode=mode))
        return kc.ShardedCanaryMonitor(kc.ShardedKvCanary(canary, lay), report_on=0)

    def flip_kv(run: lib.Run, coords) -> None:
        slot, _ = run.decoding_slot(lib.data_index(lay, coords))  # position 0: TAIL verifies it next step
        index = lib.kv_index(lay, coords, slot)
        run.k = jax.device_put(run.k.at[index].set(lib.BAD_KV), run.k.sharding)

    def steps(run: lib.Run, mon, n: int) -> None:
        for _ in range(n):
            run.step()
            mon.after_step(run.state)

    out = {"mesh": [[d.process_index for d in row] for row in lay.mesh.devices]}
    kv_target = _coords_of_process(lay, 1)
    out["kv_target"] = list(kv_target)

    run, mon = lib.Run.start(lay), monitor()
    steps(run, mon, 6)
    out["first_run_s"] = round(time.perf_counter() - started, 1)
    mon.final_check(run.state)
    out["clean"] = _observed(mon)

    run, mon = lib.Run.start(lay), monitor()
    steps(run, mon, 4)
    flip_kv(run, kv_target)
    steps(run, mon, 1)
    report = mon.final_check(run.state)
    out["kv"] = _observed(mon)
    out["kv_text"] = report.format()[0] if report.violations else ""

    chain_target = (0, 1)  # TP index 1: never the consensus of two shards, so the row comes from it
    run, mon = lib.Run.start(lay), monitor()
    steps(run, mon, 4)
    _, slot = run.decoding_slot(0)
    k_tail = run.state.full.k_tail
    index = (*chain_target, slot, 2, 0)  # PREV_HASH, low word
    k_tail = jax.device_put(k_tail.at[index].set(k_tail[index] ^ jnp.uint32(1)), k_tail.sharding)
    run.state = dataclasses.replace(run.state, full=dataclasses.replace(run.state.full, k_tail=k_tail))
    steps(run, mon, 1)
    mon.final_check(run.state)
    out["chain_target"] = list(chain_target)
    out["chain"] = _observed(mon)

    run, mon = lib.Run.start(lay), monitor()
    try:
        steps(run, mon, 5)  # checks at steps 4, 8, ... (read 2 steps later)
        # Reset after step 5: at step 8 this device's counters are below step 4's, as if its launches had stopped.
        counters = run.state.device.kernel_run_counters
        counters = jax.device_put(counters.at[kv_target].set(0), counters.sharding)
        device = dataclasses.replace(run.state.device, kernel_run_counters=counters)
        run.state = dataclasses.replace(run.state, device=device)
        steps(run, mon, 6)
        out["health"] = None
    except kc.KvCanaryHealthError as e:
        out["health"] = {"step": mon.step, "text": str(e)}

    run, mon = lib.Run.start(lay), monitor("raise")
    try:
        steps(run, mon, 4)
        flip_kv(run, kv_target)
        steps(run, mon, 8)
        out["raise"] = None
    except kc.KvCanaryViolationError as e:
        devices = [list(c) for c in e.report.devices_with_violations]
        out["raise"] = {"step": mon.step, "text": str(e), "devices": devices}
    out["wall_s"], out["cpu_s"] = round(time.perf_counter() - started, 1), round(time.process_time(), 1)
    return out


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    print(json.dumps(result), flush=True)  # the last line of stdout
    jax.distributed.shutdown()
