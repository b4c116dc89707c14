"""The sharded canary under ``jax.distributed``: 2 and 4 real processes on localhost, 2 CPU devices each.

Each launch runs ``multiprocess_scenario.py`` once per process over a ``(dp, tp=2)`` mesh whose TP peers live in
different processes (a clean loop, a KV fault on process 1, a TP chain split across processes, a stalled device,
raise mode) and checks what every process saw: the same merged report everywhere, naming the faulty device, its
process and its host. A process that hangs fails the test at the timeout; the others are then killed.
"""

import json
import os
import pathlib
import sys

import jax
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax.demo import multiprocess
from tests.sharded import sharding_testlib as lib

pytestmark = pytest.mark.processes

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 600  # generous: a loaded 2-core machine compiles 4 processes slowly; a hang still fails


def launch(processes: int) -> list[dict]:
    """Runs the scenario in ``processes`` processes of 2 CPU devices; returns each one's JSON, by process id."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # The scenario runs a few dozen steps: its processes compile at this run's optimisation level (12 % less CPU
    # than optimised code, measured), like the tests in this process.
    quick = str(int(jax.config.read("jax_disable_most_optimizations")))
    script = str(HERE / "multiprocess_scenario.py")
    try:
        finished = multiprocess.launch_local(
            lambda i, coordinator: [sys.executable, script, str(i), str(processes), coordinator],
            processes=processes, devices=2, timeout_s=TIMEOUT_S, cwd=str(ROOT),
            env={"PYTHONPATH": path, "JAX_DISABLE_MOST_OPTIMIZATIONS": quick},
        )  # fmt: skip
    except TimeoutError as e:
        pytest.fail(f"the {processes}-process scenario hung: {e}")
    results = []
    for i, (code, out, err) in enumerate(finished):
        assert code == 0, f"process {i} exited with {code}:\n{err[-6000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}proc")
def scenario(request) -> list[dict]:
    return launch(request.param)


def _same_everywhere(results: list[dict], key: str):
    """The value every process saw for ``key`` (they must all agree)."""
    values = [r[key] for r in results]
    assert all(v == values[0] for v in values), f"processes disagree on {key}: {values}"
    return values[0]


def test_mesh_puts_tp_peers_in_different_processes(scenario):
    mesh = _same_everywhere(scenario, "mesh")  # process index of each device, [dp, tp]
    assert len(mesh) == len(scenario) and all(row[0] != row[1] for row in mesh)


def test_clean_run_is_silent(scenario):
    assert _same_everywhere(scenario, "clean") == []


def test_fault_on_process_1_reported_by_that_device_everywhere(scenario):
    target = _same_everywhere(scenario, "kv_target")
    assert scenario[0]["mesh"][target[0]][target[1]] == 1
    kv = _same_everywhere(scenario, "kv")
    assert kv and {tuple(o["device"]) for o in kv} == {tuple(target)}
    assert kv[0]["step"] == 5 and kv[0]["tag"] == "TAIL_K_FULL" and kv[0]["reasons"] == ["verify_real_kv_hash"]
    text = _same_everywhere(scenario, "kv_text")
    assert f"  device: dp={target[0]},tp={target[1]} (" in text and ", process 1 on host " in text


def test_chain_split_between_tp_peers_in_different_processes(scenario):
    target = _same_everywhere(scenario, "chain_target")
    chain = _same_everywhere(scenario, "chain")
    peer = [target[0], 0]
    assert scenario[0]["mesh"][target[0]][target[1]] != scenario[0]["mesh"][peer[0]][peer[1]]
    # The corrupted seed breaks this device's own chain, and the record it writes differs from its TP peer's.
    assert [(o["device"], o["peer"], o["reasons"]) for o in chain] == [
        (target, None, ["verify_chain_hash"]),
        (target, peer, ["shard_chain"]),
    ]


def test_stalled_device_named_with_its_host(scenario):
    target = _same_everywhere(scenario, "kv_target")
    health = _same_everywhere(scenario, "health")
    assert health is not None and health["step"] == 10  # the step-8 check, read 2 steps later
    assert health["text"].startswith(f"device dp={target[0]},tp={target[1]} (process 1 on host ")
    assert "HEAD_K_FULL" in health["text"] and health["text"].count("\n") == 0  # that device only


def test_raise_mode_every_process_raises_the_same_error_at_the_same_step(scenario):
    raised = _same_everywhere(scenario, "raise")
    target = _same_everywhere(scenario, "kv_target")
    # Injected before step 5, read 2 steps later; every process got here, so none hung in a collective.
    assert raised is not None and raised["step"] == 7 and raised["devices"] == [target]
    assert raised["text"].startswith("kv-canary incident #1: verify_real_kv_hash (TAIL_K_FULL) at request ")
    assert f"\n  on devices: dp={target[0]},tp={target[1]}\n" in raised["text"]
    assert "\nkv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash " in raised["text"]


def test_report_on_must_name_a_process():
    lay = kc.MeshLayout(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "tp")), tp_axis="tp")
    with pytest.raises(ValueError, match=r"report_on must be a process index below 1 or None; got report_on=1"):
        kc.ShardedCanaryMonitor(kc.ShardedKvCanary(lib.CANARY, lay), report_on=1)
