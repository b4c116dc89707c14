"""The serve command's own parts that need no engine: the ``--canary-*`` split, drill specs, startup refusals, and
the token oracle under the overlap scheduler's one-step-lagged history (hand-computed)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvcanary_jax.integrations import sglang_drills, sglang_jax, sglang_serve_args


def test_canary_options_are_split_off_and_the_rest_is_kept_in_order():
    argv = ["--model-path", "/m", "--canary-mode", "raise", "--page-size", "4", "--canary-inject=live_kv:0.5",
            "--canary-sweep-interval", "8", "--enable-metrics"]  # fmt: skip
    settings, rest = sglang_serve_args.split_args(argv)
    assert rest == ["--model-path", "/m", "--page-size", "4", "--enable-metrics"]
    assert (settings.mode, settings.inject, settings.sweep_interval, settings.real_kv) == ("raise", "live_kv:0.5", 8,
                                                                                           "partial")  # fmt: skip
    config = settings.config()
    assert config.mode.value == "log"  # raise: the server stops the engine itself, after the violation line
    assert config.enable_write_input_assert and config.enable_verify_token_assert


@pytest.mark.parametrize("argv, message", [
    (["--canary-inject", "bitrot"], "kind must be one of live_kv"),
    (["--canary-inject", "live_kv:2"], r"probability must be in \(0, 1\]"),
    (["--canary-inject", "live_kv:x"], "probability must be a number"),
    (["--canary-inject", "live_kv", "--canary-real-kv", "none"], "needs --canary-real-kv partial or all"),
    (["--canary-inject", "idle_cache_kv", "--canary-sweep-interval", "0"], "found by the sweep"),
    (["--canary-inject", "token_swap", "--canary-no-token-asserts"], "found by the token asserts"),
    (["--canary-sweep-interval", "-1"], "must be >= 0"),
])  # fmt: skip
def test_bad_canary_options_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        sglang_serve_args.split_args(argv)


def test_drill_spec_default_probability():
    assert sglang_drills.DrillSpec.parse("token_swap", seed=3) == sglang_drills.DrillSpec("token_swap", 0.1, 3)


def test_unmapped_server_set_ups_are_refused_before_launch():
    args = types.SimpleNamespace(speculative_algorithm="EAGLE", dp_size=2, disaggregation_mode="prefill",
                                 multimodal=False)  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"speculative decoding.*data parallelism.*PD disaggregation"):
        sglang_serve_args.refuse_unmapped(args)
    with pytest.raises(NotImplementedError, match=r"tensor or data parallelism \(--tp-size 2 --dp-size 1"):
        sglang_serve_args.refuse_unmapped(types.SimpleNamespace(speculative_algorithm=None, tp_size=2, dp_size=1,
                                                            disaggregation_mode="null", multimodal=False))  # fmt: skip
    sglang_serve_args.refuse_unmapped(types.SimpleNamespace(speculative_algorithm=None, dp_size=1,
                                                        disaggregation_mode="null", multimodal=False))  # fmt: skip


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "DFLASH", "medusa"])
def test_each_speculative_algorithm_is_refused_with_its_reason(algorithm):
    """No speculative algorithm of sglang-jax 0.1.0rc0 runs on CPU (tests/integrations/test_sglang_jax_spec.py):
    each is refused at startup with what stops it."""
    args = types.SimpleNamespace(speculative_algorithm=algorithm, dp_size=1, disaggregation_mode="null",
                                 multimodal=False)  # fmt: skip
    reason = {"STANDALONE": "builds no draft worker", "DFLASH": "Pallas TPU kernel", "medusa": "does not know"}
    with pytest.raises(NotImplementedError, match=rf"kvcanary serve does not map speculative decoding "
                       rf"\(speculative_algorithm='{algorithm}': .*{reason.get(algorithm, 'EAGLE metadata')}"):  # fmt: skip
        sglang_serve_args.refuse_unmapped(args)


def test_hicache_is_refused_under_the_overlap_scheduler_and_accepted_without_it():
    """Records are carried with host pages under the normal scheduler only: with the overlap scheduler on (the
    engine's default) a HiCache server is refused at startup, by name, rather than false-alarming at a load-back."""
    args = dict(speculative_algorithm=None, dp_size=1, disaggregation_mode="null", multimodal=False,
                hicache_storage="none")  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"HiCache under the overlap scheduler.*--disable-overlap-schedule"):
        sglang_serve_args.refuse_unmapped(types.SimpleNamespace(**args, disable_overlap_schedule=False))
    sglang_serve_args.refuse_unmapped(types.SimpleNamespace(**args, disable_overlap_schedule=True))


def _mwb(decode: bool, **arrays):
    return types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: decode), **arrays)


def test_token_oracle_marks_the_pending_token_of_a_lagged_history():
    """Overlap: row 0 (pool row 5) has not seen its last sampled token yet; row 1 (pool row 2) has its whole history."""
    layout = sglang_jax.Layout(page_size=1, table_width=8)
    reqs = [types.SimpleNamespace(rid="a", origin_input_ids=[10, 11, 12], output_ids=[13]),
            types.SimpleNamespace(rid="b", origin_input_ids=[20, 21], output_ids=[22, 23])]  # fmt: skip
    mwb = _mwb(decode=True, input_ids=np.array([-6, 23]), seq_lens=np.array([5, 4]), req_pool_indices=np.array([5, 2]))
    out = sglang_jax.token_oracle(reqs, mwb, layout, max_bs=2, write=True, verify=True)
    np.testing.assert_array_equal(out["expected_input_ids"], [-6, 23])  # -(5 + 1): row 0's own future-map entry
    np.testing.assert_array_equal(out["token_ids_lens"], [4, 4])  # only known tokens are verified
    np.testing.assert_array_equal(out["token_ids"][0, :4], [10, 11, 12, 13])
    reqs[0].output_ids = []  # two tokens behind: a bug, named
    with pytest.raises(ValueError, match="request 'a': the batch runs 5 tokens but its history holds 3"):
        sglang_jax.token_oracle(reqs, mwb, layout, max_bs=2, write=True, verify=True)
