"""Speculative decoding on sglang-jax 0.1.0rc0, canary off: which algorithm runs on CPU (none yet), and what stops each.

The wrapper refuses every ``--speculative-algorithm`` by name with the reason recorded here
(``_sglang_refuse.SPECULATIVE_UNMAPPED``): no spec forward of this engine release runs on CPU, so none could be
mapped and tested. Each test runs the real engine (tiny Llama target, the draft ``tiny-model --draft`` writes) in a
subprocess and checks it still stops where it did; when a release makes one run, its test fails: map its forwards
(TARGET_VERIFY, DRAFT_EXTEND, the draft's decode steps) then.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

if os.environ.get("KVCANARY_REQUIRE_SGLANG_JAX") == "1":
    import sgl_jax  # noqa: F401
else:
    pytest.importorskip("sgl_jax", reason="the sglang-jax extra is not installed")

from kvcanary_jax.integrations import _sglang_refuse, tiny_llama  # noqa: E402

pytestmark = pytest.mark.families
PROBE = pathlib.Path(__file__).with_name("spec_probe.py")
NO_EAGLE_METADATA = "'NativeAttention' object has no attribute 'get_eagle_forward_metadata'"
# algorithm -> (the draft tiny-model --draft writes, or None; what stops the engine on CPU with the canary off)
STOPS = {
    "STANDALONE": ("standalone", "'Scheduler' object has no attribute 'draft_worker'"),
    "EAGLE": ("eagle3", NO_EAGLE_METADATA),
    "EAGLE3": ("eagle3", NO_EAGLE_METADATA),
    "NEXTN": ("eagle3", NO_EAGLE_METADATA),
    "DFLASH": ("dflash", "Only interpret mode is supported on CPU backend"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    out = {"target": str(tiny_llama.write_config(root / "target"))}
    for draft in tiny_llama.DRAFTS:
        out[draft] = str(tiny_llama.write_config(root / draft, draft=draft))
    return out


@pytest.mark.parametrize("algorithm", list(STOPS))
def test_the_algorithm_stops_on_cpu_where_recorded_and_is_refused_by_name(models, algorithm):
    draft, stop = STOPS[algorithm]
    proc = subprocess.run([sys.executable, str(PROBE), algorithm, models["target"], models[draft]],
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "GENERATED" not in out, (
        f"{algorithm} now runs on CPU with the canary off: map its forwards onto the canary and drop its refusal "
        f"(_sglang_refuse.SPECULATIVE_UNMAPPED)\n{out[-3000:]}"
    )
    assert stop in out, out[-3000:]
    assert algorithm in _sglang_refuse.SPECULATIVE_UNMAPPED
    assert _sglang_refuse.speculative_refusal(algorithm).startswith(f"speculative decoding (speculative_algorithm="
                                                                    f"'{algorithm}': ")  # fmt: skip
