"""One sglang-jax engine run with speculative decoding, the canary off: ``python spec_probe.py ALGORITHM TARGET [DRAFT]``.

Builds the engine in this process (``enable_single_process``), sends four greedy requests and prints ``GENERATED
<output ids>`` when they come back. When the engine's scheduler fails it signals this process (SIGQUIT), which then
dies with the traceback on stderr: run it in a subprocess (``tests/integrations/test_sglang_jax_spec.py``).
"""

from __future__ import annotations

import os
import sys

# the speculative settings sglang-jax's overlap-free path takes for every algorithm (DFLASH: one step, block size)
STEPS = {"DFLASH": (1, 4)}


def main(algorithm: str, target: str, draft: str | None) -> None:
    from sgl_jax.srt.entrypoints.engine import Engine

    steps, draft_tokens = STEPS.get(algorithm, (2, 3))
    engine = Engine(
        model_path=target, device="cpu", attention_backend="native", load_format="dummy", skip_tokenizer_init=True,
        page_size=1, max_running_requests=16, max_total_tokens=2048, max_prefill_tokens=256, chunked_prefill_size=256,
        precompile_bs_paddings=[4, 16], precompile_token_paddings=[256], disable_precompile=True,
        enable_single_process=True, disable_overlap_schedule=True, random_seed=0, log_level="warning",
        speculative_algorithm=algorithm, speculative_draft_model_path=draft, speculative_num_steps=steps,
        speculative_eagle_topk=1, speculative_num_draft_tokens=draft_tokens,
        grammar_backend="none",  # DFLASH refuses constrained decoding
    )  # fmt: skip
    out = engine.generate(input_ids=[[5, 6, 7, 8, 9 + i] for i in range(4)],
                          sampling_params={"max_new_tokens": 8, "temperature": 0})  # fmt: skip
    print("GENERATED", [o.get("output_ids") for o in out], flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    os._exit(0)  # the engine's threads
