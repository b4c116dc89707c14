"""sglang-jax with tensor and data parallelism: runs ``sglang_parallel_cases.py`` on 4 CPU devices in a subprocess.

``--xla_force_host_platform_device_count`` only takes effect before jax initialises, and this process already runs
with one device, so the cases run in a pytest of their own. Skipped where sglang-jax is not installed, unless
``KVCANARY_REQUIRE_SGLANG_JAX=1`` (CI's sglang-jax leg).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":  # CI's sglang-jax leg: a broken install must fail, not skip
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")

from kvcanary_jax.__main__ import main  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DEVICES = 4


def test_tensor_and_data_parallel_engines_on_cpu_devices():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
               str(HERE / "sglang_parallel_cases.py")]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)"
    assert done.returncode == 0, f"{summary}\n{done.stdout[-12000:]}\n{done.stderr[-4000:]}"
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def test_the_demo_refuses_parallel_flags_it_cannot_use(capsys):
    assert main(["demo", "--tp", "2"]) == 2
    assert "--tp / --dp are for --engine sglang-jax" in capsys.readouterr().out
    assert main(["demo", "--engine", "sglang-jax", "--dp", "0"]) == 2
    assert "--tp and --dp must be >= 1; got --tp 1 --dp 0" in capsys.readouterr().out
