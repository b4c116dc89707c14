"""Runs the sharded cases on 4 and 8 fake CPU devices, each count in its own subprocess.

``--xla_force_host_platform_device_count`` only takes effect before jax initialises, so the cases cannot run in this
process (the rest of the suite has already initialised jax with one device). Both subprocesses start at once: the
cost is XLA compiles, which are single-threaded, so two run side by side on a 2-core machine.
"""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
CASES = ("sharded_core_cases.py", "sharded_runner_cases.py")
DEVICE_COUNTS = (4, 8)


def _start(devices: int) -> subprocess.Popen:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "KVCANARY_TEST_DEVICES": str(devices), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(HERE / c) for c in CASES)]
    return subprocess.Popen(
        command, env=env, cwd=HERE.parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_sharded_cases_pass_on_4_and_8_fake_devices():
    runs = {n: _start(n) for n in DEVICE_COUNTS}
    outputs = {n: p.communicate(timeout=600)[0] for n, p in runs.items()}
    for n, p in runs.items():
        summary = outputs[n].strip().splitlines()[-1] if outputs[n].strip() else "(no output)"
        assert p.returncode == 0, f"{n} devices: {summary}\n{outputs[n][-12000:]}"
        assert " passed" in summary and "skipped" not in summary, f"{n} devices: {summary}"
