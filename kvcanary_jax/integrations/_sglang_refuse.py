"""What the sglang-jax guard refuses at wrap time, by name: a warm engine, set-ups the mapping does not cover."""

from __future__ import annotations

import kvcanary_jax as kc
from kvcanary_jax.integrations._sglang_guard import SglangCanary
from kvcanary_jax.integrations._sglang_mapping import is_overlap_client
from kvcanary_jax.integrations._sglang_pools import pool_view

_EAGLE_FAMILY = (
    "its draft and verify forwards need the fa attention backend's EAGLE metadata (get_eagle_forward_metadata), and fa "
    "is a TPU kernel: off TPU the engine runs native attention, which has none, so on CPU it fails at its first batch, "
    "canary or not; its TARGET_VERIFY, DRAFT_EXTEND and draft-decode forwards are not mapped"
)
# Why each speculative algorithm of sglang-jax 0.1.0rc0 is refused: what stops it on CPU with the canary off (tiny
# Llama target, drafts from `python -m kvcanary_jax tiny-model DIR --draft ...`; tests/integrations/
# test_sglang_jax_spec.py checks each still stops so), so no forward of it could be run, mapped or tested.
SPECULATIVE_UNMAPPED = {
    "STANDALONE": "sglang-jax 0.1.0rc0's scheduler builds no draft worker for it (it fails at the first batch: "
    "'Scheduler' object has no attribute 'draft_worker'), canary or not",
    "EAGLE": _EAGLE_FAMILY,
    "EAGLE3": _EAGLE_FAMILY,
    "NEXTN": _EAGLE_FAMILY,
    "DFLASH": "its draft extend appends the target's hidden states to the draft KV with a Pallas TPU kernel (and its "
    "forwards need the fa backend's EAGLE metadata): the engine fails at its first batch on CPU, canary or not; its "
    "forwards are not mapped",
}


def speculative_refusal(algorithm) -> str | None:
    """Why speculative decoding with ``algorithm`` (``--speculative-algorithm``) is not mapped; None when it is off."""
    if algorithm in (None, "", "NONE", "none"):
        return None
    name = str(algorithm).upper()
    reason = SPECULATIVE_UNMAPPED.get(name, "an algorithm this release of the wrapper does not know")
    return f"speculative decoding (speculative_algorithm={algorithm!r}: {reason})"


def refuse_warm_engine(worker, tree_cache=None) -> None:
    """Refuses an engine that already holds requests or cached prefixes: their slots have no records.

    Wrapping it would report every such slot as corrupt at its first read (``verify_chain_hash``); ``wrap(...,
    live_requests=...)`` adopts them instead (writes their records once from the engine's tables).

    Raises:
      ValueError: naming what the engine holds.
    """
    req_pool, allocator = worker.get_memory_pool()
    held = []
    live = req_pool.size - req_pool.available_size()
    if live:
        held.append(f"{live} live request(s) in its req_to_token pool")
    cached = 0
    if tree_cache is not None and hasattr(tree_cache, "root_node"):  # a ChunkCache (no radix) holds nothing
        cached = tree_cache.total_size()
        cached = int(cached[0] if isinstance(cached, tuple) else cached)  # SWARadixCache's: (full, SWA) tokens
    if cached:
        held.append(f"{cached} token(s) in its radix cache")
    # the full pool's free slots (an SWA allocator's available_size is the smaller of its two pools')
    available = getattr(allocator, "full_available_size", allocator.available_size)
    free = sum(available(r) for r in range(int(getattr(allocator, "dp_size", 1))))  # each DP rank's
    used = allocator.size - free - cached
    if used > 0 and not live:
        held.append(f"{used} allocated KV slot(s)")
    if held:
        raise ValueError(
            "kvcanary cannot wrap a warm engine: it holds " + ", ".join(held) + " written before the canary, which "
            "would all be reported as corrupt; adopt them with wrap(..., live_requests=scheduler_requests(scheduler)) "
            "between steps, wrap it before it serves, or flush its cache first"
        )


def check_engine(worker, config) -> None:
    """Refuses, by name, what the mapping does not cover."""
    if not isinstance(config, kc.CanaryConfig):
        raise TypeError(f"config must be a kvcanary_jax.CanaryConfig; got {type(config).__name__}")
    runner = getattr(worker, "model_runner", None)
    if runner is None or not callable(getattr(worker, "forward_batch_generation", None)):
        raise TypeError(
            "worker must be an sgl_jax ModelWorker or ModelWorkerClient (it has model_runner and "
            f"forward_batch_generation); got {type(worker).__name__}"
        )
    if isinstance(getattr(runner.forward, "__self__", None), SglangCanary):
        raise ValueError("this worker is wrapped already; call unwrap() on its guard first")
    model_worker = worker.worker if is_overlap_client(worker) else worker
    args = model_worker.server_args
    problems = []
    speculative = speculative_refusal(getattr(args, "speculative_algorithm", None))
    if speculative is not None:
        problems.append(speculative)
    if getattr(model_worker, "_pd_fuse_sample", False):
        problems.append("the fused Pathways forward-and-sample path (it bypasses ModelRunner.forward)")
    try:
        pool_view(runner)
    except NotImplementedError as err:
        problems.append(str(err))
    if problems:
        raise NotImplementedError("kvcanary's sglang-jax wrapper does not map " + "; ".join(problems))
