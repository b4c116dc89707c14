"""Runs the sharded cases on 4 and 8 fake CPU devices, and ``demo --devices 4``, each in its own subprocess.

The 4-device run also runs the explicit-mesh tests (ops, runner and injectors on arrays typed with a mesh
sharding, as sglang-jax's), which pick a 2 x 2 mesh when they see 4 devices and a 1 x 1 mesh in this process.

``--xla_force_host_platform_device_count`` only takes effect before jax initialises, so the cases cannot run in this
process (the rest of the suite has already initialised jax with one device). The subprocesses start at once: the
cost is XLA compiles, which are single-threaded, so they share a 2-core machine well.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
CASES = ("sharded_core_cases.py", "sharded_runner_cases.py")
DEVICE_COUNTS = (4, 8)
EXPLICIT_MESH_CASES = ("pallas_kernels/test_explicit_mesh.py", "runtime/test_explicit_mesh.py")  # 2 x 2 on 4

pytestmark = pytest.mark.processes


def _start(devices: int) -> subprocess.Popen:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "KVCANARY_TEST_DEVICES": str(devices), "JAX_PLATFORMS": "cpu"}
    env.pop("PYTEST_ADDOPTS", None)  # the run names its own tests: a leg's marker selection (CI) must not drop them
    cases = [str(HERE / c) for c in CASES]
    if devices == 4:
        cases += [str(HERE.parent / c) for c in EXPLICIT_MESH_CASES]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *cases]
    return subprocess.Popen(
        command, env=env, cwd=HERE.parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _start_demo() -> subprocess.Popen:
    command = [sys.executable, "-m", "kvcanary_jax", "demo", "--devices", "4", "--clean-steps", "12", "--json"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(command, env=env, cwd=HERE.parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def test_sharded_cases_and_demo_on_fake_devices():
    runs = {f"{n} devices": _start(n) for n in DEVICE_COUNTS}
    demo = _start_demo()
    outputs = {name: p.communicate(timeout=600)[0] for name, p in runs.items()}
    demo_out, demo_err = demo.communicate(timeout=600)
    for name, p in runs.items():
        summary = outputs[name].strip().splitlines()[-1] if outputs[name].strip() else "(no output)"
        assert p.returncode == 0, f"{name}: {summary}\n{outputs[name][-12000:]}"
        assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, f"{name}: {summary}"
    # The CLI made 4 fake CPU devices itself: a 2 x 2 mesh, every fault reported by the devices that hold it.
    assert demo.returncode == 0, demo_out[-8000:] + demo_err[-4000:]
    payload = json.loads(demo_out)
    assert payload["ok"] and payload["mesh"] == {"dp": 2, "tp": 2}
    by_fault = {r["fault"]: r for r in payload["runs"]}
    assert by_fault["none"]["steps"] == 12 and by_fault["none"]["reported_by"] == []
    assert by_fault["live_kv/FULL"]["reported_by"] == ["dp=1,tp=1"]
    assert by_fault["token_swap/FULL"]["reported_by"] == ["dp=1,tp=0", "dp=1,tp=1"]
    assert by_fault["shard_chain"]["fail_reasons"] == "verify_chain_hash+shard_chain"
