"""``python -m kvcanary_jax demo``: a clean run and every fault, as a table or JSON; the exit code is the verdict."""

import dataclasses
import io
import json

import pytest

from kvcanary_jax import __main__ as cli_main
from kvcanary_jax.demo import cli, faults
from kvcanary_jax.testing import FaultKind, expected_detection

_LIVE = "KV bytes of this slot changed after they were written: during this step's forward (a kernel wrote the wrong " \
    "slot) or between steps\n  explains 1 row(s)"
_IDLE = "KV bytes of an idle prefix-cached slot changed: the slot was overwritten while cached (an allocation or " \
    "eviction bug)\n  explains 1 row(s)"
# What the demo raises for each fault it injects (seed 0): the first incident's headline, golden.
GOLDEN_HEADLINES = {
    ("live_kv", "FULL"): "verify_real_kv_hash (TAIL_K_FULL) at request row 4, position 26, slot 179 (FULL), written at "
    "step 12\n  likely cause: " + _LIVE,
    ("live_kv", "SWA"): "verify_real_kv_hash (TAIL_K_SWA) at request row 2, position 58, slot 130 (SWA), written at "
    "step 12\n  likely cause: " + _LIVE,
    ("req_to_token", "FULL"): "verify_chain_hash+verify_position+verify_token (HEAD_K_FULL) at request row 3, position "
    "16, slot 260 (FULL), written at step 12\n  likely cause: the slot holds another token than the request's history: "
    "it maps to another request's KV, or to a stale page\n  explains 8 row(s); knock-ons of this root at slot@position "
    "138@17",
    ("idle_cache_kv", "FULL"): "verify_real_kv_hash (SWEEP_K_FULL) at an idle prefix-cache slot, position 37, slot 62 "
    "(FULL), written at step 13\n  likely cause: " + _IDLE,
    ("idle_cache_kv", "SWA"): "verify_real_kv_hash (SWEEP_K_SWA) at an idle prefix-cache slot, position 56, slot 253 "
    "(SWA), written at step 13\n  likely cause: " + _IDLE,
    ("post_forward_kv", "FULL"): "verify_real_kv_hash (TAIL_K_FULL) at request row 3, position 31, slot 391 (FULL), "
    "written at step 13\n  likely cause: " + _LIVE,
    ("post_forward_kv", "SWA"): "verify_real_kv_hash (TAIL_K_SWA) at request row 3, position 31, slot 92 (SWA), "
    "written at step 13\n  likely cause: " + _LIVE,
    ("token_swap", "FULL"): "write_token (HEAD_K_FULL) at request row 6, position 47, slot 393 (FULL), written at step "
    "12\n  likely cause: the token written is not the one the oracle expects: sampled tokens were crossed between "
    "requests, or a stale input was fed\n  explains 8 row(s); tokens crossed with request row 2, position 74, slot 390",
}


def test_demo_json_reports_every_fault_detected(capsys):
    assert cli_main.main(["demo", "--json", "--clean-steps", "60"]) == 0
    payload = json.loads(capsys.readouterr().out)
    runs = payload["runs"]
    assert payload["ok"] and runs[0]["fault"] == "none" and runs[0]["steps"] == 60 and runs[0]["headline"] is None
    assert {r["fault"] for r in runs[1:]} == {k.value for k in FaultKind}
    for r in runs[1:]:
        tag, _, after = expected_detection(FaultKind(r["fault"]), faults.PoolKind[r["group"]])
        assert r["ok"] and r["launch_tag"] == tag.name and r["detected_step"] - r["injected_step"] == after, r
    # One incident report per fault kind, its text golden (issue 31): one headline, knock-ons and partners counted.
    headlines = {(r["fault"], r["group"]): r["headline"] for r in runs[1:]}
    assert headlines == {k: "kv-canary incident #1: " + v for k, v in GOLDEN_HEADLINES.items()}


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
