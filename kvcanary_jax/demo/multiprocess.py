"""``python -m kvcanary_jax demo --processes P --devices D``: the sharded fault table over P local processes.

The command starts P copies of itself on this machine, each with D CPU devices, joined by ``jax.distributed`` over
one ``(dp, tp)`` mesh whose TP peers live in different processes. Every process runs the same fault table with
its own :class:`~kvcanary_jax.ShardedCanaryMonitor` and prints what it saw as JSON; the parent prints process 0's
table and fails if a fault was missed or any process saw something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TextIO

_TIMEOUT_S = 3600  # the whole table on a loaded 2-core machine; a hung process fails the run at this point


def free_port() -> int:
    """A TCP port free on localhost now (for the ``jax.distributed`` coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch_local(
    command: Callable[[int, str], list[str]],
    *,
    processes: int,
    devices: int,
    timeout_s: float,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> list[tuple[int, str, str]]:
    """Runs ``command(process_id, coordinator)`` in ``processes`` processes of ``devices`` CPU devices each.

    The processes get this one's environment, updated with ``env``, and ``XLA_FLAGS`` asking for the devices.

    Returns each process's ``(returncode, stdout, stderr)``, by process id.

    Raises:
      TimeoutError: some process did not exit within ``timeout_s`` (all of them are killed then).
    """
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = {**os.environ, **(env or {}), "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    coordinator = f"localhost:{free_port()}"
    procs = [
        subprocess.Popen(command(i, coordinator), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        outputs = [p.communicate(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired as e:
        for p in procs:
            p.kill()
            p.wait()
        raise TimeoutError(f"a process of {processes} did not exit within {timeout_s} s") from e
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def run_process(*, process_id: int, processes: int, coordinator: str, seed: int, clean_steps: int, backend: str):
    """One process: joins ``jax.distributed``, runs the fault table over every process's devices, prints JSON."""
    import jax

    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)
    from kvcanary_jax.demo import sharded_faults

    lay, results = sharded_faults.fault_table(
        devices=len(jax.devices()), seed=seed, clean_steps=clean_steps, backend=backend
    )
    payload = {"process": process_id, "mesh": dict(lay.mesh.shape), "runs": [dataclasses.asdict(r) for r in results]}
    print(json.dumps(payload), flush=True)  # the last line of stdout
    jax.distributed.shutdown()
    return 0


def run_multiprocess_demo(
    *, processes: int, devices: int, seed: int, clean_steps: int, as_json: bool, backend: str, out: TextIO
) -> int:
    """Starts the processes, checks that they agree, prints process 0's table (or JSON). 0 if all went well."""
    if processes < 2 or devices < 1:
        raise ValueError(f"--processes must be >= 2 and --devices >= 1; got {processes=}, {devices=}")
    from kvcanary_jax.demo import sharded_faults

    started = time.perf_counter()
    common = ["--seed", str(seed), "--clean-steps", str(clean_steps), "--backend", backend]

    def command(i: int, coordinator: str) -> list[str]:
        return [sys.executable, "-m", "kvcanary_jax", "demo", "--processes", str(processes), "--devices",
                str(devices), "--process-id", str(i), "--coordinator", coordinator, *common]  # fmt: skip

    finished = launch_local(command, processes=processes, devices=devices, timeout_s=_TIMEOUT_S)
    payloads = []
    for i, (code, stdout, stderr) in enumerate(finished):
        if code != 0 or not stdout.strip():
            out.write(f"process {i} failed (exit {code}):\n{stderr[-4000:]}\n")
            return 1
        payloads.append(json.loads(stdout.strip().splitlines()[-1]))
    disagree = [p["process"] for p in payloads[1:] if p["runs"] != payloads[0]["runs"]]
    results = [sharded_faults.ShardedRunResult(**r) for r in payloads[0]["runs"]]
    where = f"{processes} processes x {devices} cpu devices, the last in process {processes - 1}; merged on each"
    code = sharded_faults.write_results(results, mesh=payloads[0]["mesh"], where=where,
                                        wall_s=time.perf_counter() - started, as_json=as_json, out=out,
                                        processes=processes)  # fmt: skip
    if disagree:
        out.write(f"FAILED: processes {disagree} saw other results than process 0\n")
        return 1
    return code
