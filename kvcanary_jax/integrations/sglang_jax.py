"""kvcanary-jax around sglang-jax's ``ModelRunner``: HEAD before and TAIL after every forward, in jits of their own.

Wrap the worker your scheduler calls (a ``ModelWorker``, or the overlap scheduler's ``ModelWorkerClient``)::

    guard = wrap(worker, kc.CanaryConfig(mode="raise", real_kv_hash_mode="partial"), tree_cache=tree_cache)
    for batch in ...:  # each ScheduleBatch, as Scheduler.run_batch gets it
        guard.expect(batch)  # the requests' own token history (needed by the token asserts)
        worker.forward_batch_generation(batch.get_model_worker_batch(...))  # ModelRunner.forward runs the canary
        ...  # the scheduler's own result processing
        guard.after_step()  # the radix-cache sweep when due; the lagged, non-blocking report check

What the engine's batch becomes (all on device, inside the HEAD / TAIL jits):

* rows: batch row ``b`` of a real request is canary row ``b``; padding rows (``req_pool_indices == -1``, anywhere
  in the batch) are ``-1``, the pool's ``padding="negative"`` convention. The engine's own pool row is not used.
* lengths: EXTEND and MIXED batches carry ``extend_prefix_lens`` / ``extend_seq_lens``; a DECODE row caches
  ``seq_lens - 1`` tokens and writes 1.
* the page table: built from ``ForwardBatch.cache_loc``, the slots attention reads (each row's ``seq_lens`` slots
  end to end, every row padded to a whole page), as ``i32[bs, W]``: nothing is uploaded from the host.
* real KV: layer 0's fused array ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]`` (K and V
  alternate per head) read in place as a K source and a V source (a byte offset and a stride; no copy), on the
  engine's explicit mesh sharding.
* plan sizes: a forward verifies at most its real rows' ``seq_lens`` summed (known on the host), so HEAD and TAIL
  run with plans of the next power of two of that (:func:`sized_capacity`: at least 256, at most the largest
  ``cache_loc`` bucket), one compile per size and mode. The canary's work follows its plans' size, and the bucket
  (every row at the model's context length) is many times what a batch holds.
* sweep: every slot the ``RadixCache`` (or ``SWARadixCache``) holds (a depth-first walk of its nodes).
* SWA (``SWAKVPool``, e.g. Gemma 2): a FULL group over the full-attention sub-pool and an SWA group over the
  sliding-window one, its slots through the allocator's ``full_to_swa_index_mapping`` (copied at each launch: a
  slot freed as it leaves the window maps to 0 and is skipped); per forward the SWA group verifies the last
  ``sliding_window - 1`` cached positions, the ones an SWA layer reads (see :class:`._sglang_pools.SwaPoolView`).
* the monitor: TAIL and the sweep also return ``CanaryMonitor.snapshot`` of their state, which the step's check
  hands to ``after_step``: two launches a step (three with a sweep), none of the monitor's own.
* token oracle: ``req.origin_input_ids + req.output_ids`` of each request, for the write-input assert (the tokens
  each forward writes) and the verify-token assert (each cached slot's token), taken on the scheduler's thread when
  the batch is handed to the worker.
* the overlap scheduler (``ModelWorkerClient``): the forward runs on the worker's thread and the host history lags a
  step, so a decode row's newest token is not known yet. Its expected input id is then the row's own future-map
  entry (``map[req_pool_idx + 1]``, read on device: the token the row's previous forward sampled), independent of
  the placeholder the batch carries; the verify-token assert checks that token one step later, from the history.
  The step's end (the radix sweep, planned on the scheduler's thread, and the monitor) runs on the worker's thread
  after the forward: ``after_step`` is not called by the user.

Not mapped (refused with an error): speculative decoding (every algorithm, each with what stops it on CPU:
``_sglang_refuse.SPECULATIVE_UNMAPPED``; none of sglang-jax 0.1.0rc0's runs there), SWA with DP > 1 or on a parallel
engine, MLA or hybrid pools on a parallel engine, MLA's DSA indexer-key cache, adopting a warm SWA engine, the fused
Pathways forward-and-sample path, and an engine that already holds requests or cached prefixes (its records were never
written: see :func:`refuse_warm_engine`). A parallel engine (``tp_size`` or ``dp_size`` > 1) gets a sharded canary
over its mesh, each DP rank numbering its own slots: see :mod:`._sglang_parallel`.
"""

from __future__ import annotations

from kvcanary_jax import CanaryConfig
from kvcanary_jax.integrations import _sglang_parallel
from kvcanary_jax.integrations._sglang_guard import Pending, SglangCanary
from kvcanary_jax.integrations._sglang_mapping import (
    INSTALL_HINT,
    Layout,
    Shapes,
    batch_fields,
    canary_batch,
    capacity_ladder,
    host_fields,
    kv_sources,
    padded_oracle,
    page_table,
    radix_entries,
    require_sglang_jax,
    resolve_future,
    scheduler_requests,
    sized_capacity,
    token_oracle,
    verify_need,
)
from kvcanary_jax.integrations._sglang_refuse import check_engine, refuse_warm_engine

__all__ = [
    "INSTALL_HINT", "Layout", "Pending", "SglangCanary", "Shapes", "batch_fields", "canary_batch", "capacity_ladder",
    "host_fields", "kv_sources", "padded_oracle", "page_table", "radix_entries", "refuse_warm_engine",
    "require_sglang_jax", "resolve_future", "scheduler_requests", "sized_capacity", "token_oracle", "verify_need", "wrap",
]  # fmt: skip


def wrap(
    worker, config: CanaryConfig, *, tree_cache=None, table_width: int | None = None, live_requests=None
) -> SglangCanary:
    """Puts the canary around a sglang-jax ``ModelWorker``'s forwards; returns the guard.

    From then on ``worker.forward_batch_generation`` (and so ``worker.model_runner.forward``) runs HEAD before and
    TAIL after the model, each in a jit of its own, on the engine's mesh. Fixed padding buckets keep one compile per
    bucket and mode, as for the engine.

    Args:
      worker: the ``sgl_jax`` worker the scheduler calls: a ``ModelWorker``, or the overlap scheduler's
        ``ModelWorkerClient``, before it served anything. On a parallel engine (a mesh of several devices) the guard
        is a :class:`._sglang_parallel.ParallelSglangCanary` (overlap scheduler off).
      config: the :class:`kvcanary_jax.CanaryConfig`; ``backend="auto"`` reads the engine's sharded KV in place.
      tree_cache: the scheduler's ``RadixCache``, swept every ``config.sweep_interval`` steps (None: no sweep).
      table_width: columns of the device-built page table; default the model's context length.
      live_requests: on a warm engine (one that served before the wrap), its live requests, e.g.
        :func:`scheduler_requests` of its ``Scheduler`` between steps: the records of their slots and of every slot
        ``tree_cache`` holds are adopted once (:meth:`SglangCanary.adopt`), then checked from there. None: the engine
        must be cold (nothing cached yet).

    Returns:
      The :class:`SglangCanary` guard; as a context manager it runs :meth:`SglangCanary.final_check` and unwraps on
      exit.

    Raises:
      ImportError: sglang-jax is not installed (with the command that installs it).
      TypeError: ``worker`` or ``config`` of the wrong type.
      NotImplementedError: an engine set-up the mapping does not cover, named.
      ValueError: the engine already holds requests or cached prefixes and ``live_requests`` is None
        (:func:`refuse_warm_engine`), or an entry of its tables cannot be adopted.
    """
    require_sglang_jax()
    check_engine(worker, config)
    if table_width is not None:  # a narrower table would report every longer request as INVALID_INPUT
        context = int(worker.model_runner.model_config.context_len)
        if not isinstance(table_width, int) or isinstance(table_width, bool) or table_width < context:
            raise ValueError(
                f"table_width must be a positive int of at least the engine's longest request (model_config."
                f"context_len={context}); got table_width={table_width!r}"
            )
    parallel = _sglang_parallel.is_parallel(worker)
    if parallel:
        _sglang_parallel.refuse(worker, live_requests)
    if live_requests is None:
        refuse_warm_engine(worker, tree_cache)
    elif (pool := type(worker.model_runner.token_to_kv_pool).__name__) != "MHATokenToKVPool":
        raise NotImplementedError(
            f"kvcanary's sglang-jax wrapper does not adopt a warm engine's {pool} (live_requests; the SWA group's "
            "records are not adopted): wrap it before it serves"
        )
    if config.sweep_interval > 0 and tree_cache is None:
        raise ValueError(
            f"config.sweep_interval={config.sweep_interval} sweeps the radix cache: pass tree_cache=<the "
            "scheduler's RadixCache>, or set sweep_interval=0"
        )
    guard_class = _sglang_parallel.ParallelSglangCanary if parallel else SglangCanary
    guard = guard_class(worker, config, tree_cache=tree_cache, table_width=table_width)
    if live_requests is not None:
        guard.adopt(live_requests, worker.get_memory_pool()[0])
    return guard
