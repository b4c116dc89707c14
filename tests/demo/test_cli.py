"""``python -m kvcanary_jax demo``: a clean run and every fault, as a table or JSON; the exit code is the verdict."""

import dataclasses
import io
import json

import pytest

from kvcanary_jax import __main__ as cli_main
from kvcanary_jax.demo import cli, faults
from kvcanary_jax.testing import FaultKind, expected_detection


def test_demo_json_reports_every_fault_detected(capsys):
    assert cli_main.main(["demo", "--json", "--clean-steps", "60"]) == 0
    payload = json.loads(capsys.readouterr().out)
    runs = payload["runs"]
    assert payload["ok"] and runs[0]["fault"] == "none" and runs[0]["steps"] == 60
    assert {r["fault"] for r in runs[1:]} == {k.value for k in FaultKind}
    for r in runs[1:]:
        tag, _, after = expected_detection(FaultKind(r["fault"]), faults.PoolKind[r["group"]])
        assert r["ok"] and r["launch_tag"] == tag.name and r["detected_step"] - r["injected_step"] == after, r


def test_demo_table_and_exit_code_on_a_miss(monkeypatch):
    out = io.StringIO()
    assert cli.run_demo(clean_steps=20, out=out) == 0
    text = out.getvalue()
    header = text.splitlines()[0].split()
    assert header[:2] == ["fault", "group"] and "launch" in header and "reason" in header
    assert "TAIL_K_SWA" in text and "SWEEP_K_FULL" in text and "write_token" in text
    assert "all faults detected, no false positives" in text
    real_run = faults.run

    def missed(fault=None, **kw):
        result = real_run(fault, **kw)
        return dataclasses.replace(result, ok=False, note="fault went undetected") if fault else result

    monkeypatch.setattr(faults, "run", missed)
    out = io.StringIO()
    assert cli.run_demo(clean_steps=5, out=out) == 1
    assert "FAIL: fault went undetected" in out.getvalue()


def test_example_subcommand_still_works(capsys):
    assert cli_main.main(["example"]) == 0
    assert "kv_canary violation: launch_tag=TAIL_K_FULL" in capsys.readouterr().out


def test_demo_processes_needs_devices_and_two_processes(capsys):
    assert cli_main.main(["demo", "--processes", "2"]) == 2
    assert "--processes P needs --devices D" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"--processes must be >= 2 and --devices >= 1; got processes=1, devices=2"):
        cli_main.main(["demo", "--processes", "1", "--devices", "2"])


def test_demo_hicache_needs_the_sglang_jax_engine(capsys):
    assert cli_main.main(["demo", "--hicache"]) == 2
    assert "--hicache needs --engine sglang-jax" in capsys.readouterr().out
