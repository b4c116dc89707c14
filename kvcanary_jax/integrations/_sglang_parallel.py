"""The sglang-jax guard on a parallel engine (``tp_size`` or ``dp_size`` > 1): a sharded canary over its mesh.

sglang-jax runs one ``(data, tensor)`` mesh: ``dp_size`` DP ranks on ``data``, each splitting its KV heads over
``tensor`` (``tp_size // dp_size`` devices). Its KV layers are sharded ``P("data", None, "tensor", None, None)``:
DP rank ``r`` holds pages ``[r * P, (r + 1) * P)`` of the fused array, numbered ``0 .. P - 1`` by that rank (page 0
is its padding), and every batch array is ``dp_size`` equal sections, rank ``r``'s requests in section ``r``. So the
guard runs a :class:`kvcanary_jax.ShardedKvCanary` over the engine's own mesh (``tp_axis="tensor"``), in
``shard_map`` islands before and after the forward, as the engine's KV write does:

* each device's canary covers its DP rank's ``P`` pages (slots numbered as that rank numbers them), and checks its
  own KV heads' bytes;
* each device maps its rank's sections of the batch (the single-device mapping of ``sglang_jax``: rows, lengths, the
  page table from ``cache_loc``, the token oracle per rank);
* TP peers write the same chain fields; the sharded canary's cross-shard check compares them after each forward;
* the sweep walks each rank's part of the ``RadixCache`` (its nodes carry the rank in their key).

A violation names its device (``data``, ``tensor`` coordinates), the slot as its DP rank numbers it, and the batch
row within that rank's section; :meth:`ParallelSglangCanary.rid_of` names the request.

Not mapped (refused): the overlap scheduler (its future-token map under DP is untested here) and adopting a warm
engine.
"""

from __future__ import annotations

import functools
import types

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax.integrations import _sglang_guard
from kvcanary_jax.integrations import _sglang_mapping as mapping

_DATA, _TENSOR = "data", "tensor"  # sglang-jax's mesh axes
_KV_SPEC = P(_DATA, None, _TENSOR, None, None)  # its fused KV layers


def is_parallel(worker) -> bool:
    """Whether the engine's mesh has more than one device (the sharded guard then runs)."""
    return worker.model_runner.mesh.devices.size > 1


def rank_entries(tree_cache, rank: int, *, include=None) -> kc.SweepEntries:
    """The slots of DP rank ``rank``'s part of a ``RadixCache`` (numbered as that rank numbers them).

    A node's key names its rank (``None`` when the engine runs one rank, read as rank 0).
    """
    keep = lambda node: (node.key.dp_rank or 0) == rank and (include is None or include(node))  # noqa: E731
    return mapping.radix_entries(tree_cache, include=keep)


def _spread(tree):
    """Arrays laid out as DP sections (flat, section ``r`` for rank ``r``): sharded over ``data``."""
    return jax.tree.map(lambda x: jax.sharding.reshard(x, P(_DATA)), tree)


@functools.partial(jax.jit, static_argnames=("sharded", "layout", "is_decode"), donate_argnums=(0,))
def _head(state, fields, oracle, arrays, *, sharded, layout, is_decode):
    def head(state, fields, oracle):
        return sharded.before_forward(state, mapping.canary_batch(fields, layout, is_decode=is_decode,
                                                                      oracle=oracle))  # fmt: skip

    fn = sharded.shard_map(head, in_specs=(sharded.state_spec, P(_DATA), P(_DATA)), out_specs=sharded.state_spec)
    return fn(state, _spread(fields), _spread(oracle))


@functools.partial(jax.jit, static_argnames=("sharded", "layout", "is_decode"), donate_argnums=(0,))
def _tail(state, fields, oracle, arrays, *, sharded, layout, is_decode):
    def tail(state, fields, oracle, kv0):
        k, v = mapping.kv_sources(kv0)  # this device's KV heads of its rank's pages
        batch = mapping.canary_batch(fields, layout, is_decode=is_decode, oracle=oracle)
        return sharded.after_forward(state, batch, sharded.canary.kv_sources(full_k=k, full_v=v))

    specs = (sharded.state_spec, P(_DATA), P(_DATA), _KV_SPEC)
    fn = sharded.shard_map(tail, in_specs=specs, out_specs=sharded.state_spec)
    return fn(state, _spread(fields), _spread(oracle), arrays["full"])


@functools.partial(jax.jit, static_argnames=("sharded",), donate_argnums=(0,))
def _sweep(state, plan, arrays, *, sharded):
    def sweep(state, plan, kv0):
        k, v = mapping.kv_sources(kv0)
        return sharded.sweep(state, kc.local(plan, P(_DATA)), sharded.canary.kv_sources(full_k=k, full_v=v))

    specs = (sharded.state_spec, P(_DATA), _KV_SPEC)
    return sharded.shard_map(sweep, in_specs=specs, out_specs=sharded.state_spec)(state, _spread(plan), arrays["full"])


_LAUNCHES = {"head": _head, "tail": _tail, "sweep": _sweep}


class ParallelSglangCanary(_sglang_guard.SglangCanary):
    """:class:`~kvcanary_jax.integrations.sglang_jax.SglangCanary` on a parallel engine; made by ``wrap``.

    Attributes (besides the base class's):
      sharded: the :class:`kvcanary_jax.ShardedKvCanary` over the engine's mesh (``canary`` is its per-device
        canary: one DP rank's pages, one device's KV heads).
      monitor: the :class:`kvcanary_jax.ShardedCanaryMonitor`; its ``observed`` name each violation's device.
      dp: the engine's DP ranks.
    """

    def _build(self, *, max_verify: int) -> None:
        if self.view.name != "MHATokenToKVPool":
            raise NotImplementedError(
                f"kvcanary's parallel sglang-jax guard maps MHATokenToKVPool only; got {self.view.name}"
            )
        kv0 = self.runner.token_to_kv_pool.kv_buffer[0]
        mesh = self.runner.mesh
        self.dp = int(mesh.shape[_DATA])
        if self.max_bs % self.dp or max_verify % self.dp or kv0.shape[0] % self.dp:
            raise NotImplementedError(
                f"the engine's buckets and KV pages must split into {self.dp} equal DP sections; got "
                f"max_bs={self.max_bs}, cache_loc={max_verify}, pages={kv0.shape[0]}"
            )
        self.max_bs //= self.dp  # the per-rank oracle's rows
        self.max_verify //= self.dp
        token_pool = {}
        if self.config.enable_verify_token_assert:
            token_pool = dict(max_reqs=self.max_bs, max_context_len=self.layout.table_width)
        pool = kc.CanaryPool(num_slots=int(kv0.shape[0]) // self.dp * self.layout.page_size,
                             page_size=self.layout.page_size, verify_capacity=self.max_verify,
                             **token_pool)  # fmt: skip
        self.canary = kc.KvCanary(self.config, pool)
        self.sharded = kc.ShardedKvCanary(self.canary, kc.MeshLayout(mesh, tp_axis=_TENSOR))
        self.monitor = kc.ShardedCanaryMonitor(self.sharded)
        self.state = self._typed(self.sharded.init_state())

    def _requests_of(self, infos) -> list:
        return [list(info.reqs or []) for info in infos]

    def _rids(self, reqs) -> list:
        return [[getattr(r, "rid", None) for r in rank] for rank in reqs or [[]] * self.dp]

    def _token_oracle(self, reqs, model_worker_batch, *, write: bool, verify: bool) -> dict:
        """Each DP rank's oracle (the single-device one over its sections), concatenated rank by rank."""
        parts = [mapping.token_oracle(rank_reqs, _section(model_worker_batch, r, self.dp), self.layout,
                                         max_bs=self.max_bs, write=write, verify=verify)
                 for r, rank_reqs in enumerate(reqs)]  # fmt: skip
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _host_fields(self, model_worker_batch, *, is_decode: bool) -> dict:
        """Only ``cache_loc`` is copied on the host (its buffer is reused); the rest is read from the device batch."""
        return {"cache_loc": np.array(model_worker_batch.cache_loc, np.int32)}

    def _launch_fields(self, pending, forward_batch) -> dict:
        return {**mapping.batch_fields(forward_batch), "cache_loc": pending.fields["cache_loc"]}

    def precompile(self) -> int:
        raise NotImplementedError("the parallel guard compiles its programs at the first forward of each shape")

    def _verify_capacity(self, model_worker_batch) -> int:
        """The busiest DP rank's (every rank runs plans of one size)."""
        sections = (_section(model_worker_batch, r, self.dp) for r in range(self.dp))
        return mapping.sized_capacity(max(map(mapping.verify_need, sections)), self.max_verify)

    def _rearm(self) -> None:
        """Nothing: the sharded monitor's ring is fill-once (it has no re-arm yet)."""

    def flush(self) -> kc.ViolationReport:
        """Blocking: every pending check (the sharded monitor's final check)."""
        with self.lock:
            try:
                return self.monitor.final_check(self.state)
            finally:
                self._hand_over()

    @property
    def unread_steps(self) -> int:
        return len(self.monitor._pending)

    def _mark_init_finished(self) -> None:
        self.state = self._typed(self.sharded.mark_init_finished(self.state))

    def _typed(self, state):
        """The per-device state typed as the launches return it (a full-length spec), so HEAD compiles once a mode."""
        mesh, lead = self.runner.mesh, tuple(self.sharded.state_spec)
        return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(*lead, *(None,) * (x.ndim - len(lead))))),
                            state)  # fmt: skip

    def _run(self, launch: str, *args, capacity: int | None = None, **static) -> None:
        sharded = self.sharded if capacity is None else kc.ShardedKvCanary(self._sized_canary(capacity),
                                                                           self.sharded.mesh_layout)  # fmt: skip
        with jax.set_mesh(self.runner.mesh):
            self.state = _LAUNCHES[launch](self.state, *args, sharded=sharded, **static)

    def sweep(self, entries: list[kc.SweepEntries] | None = None) -> None:
        """Verifies every slot the radix cache holds now, each DP rank its own, or ``entries`` (one per rank)."""
        if entries is None and self.tree_cache is None:
            raise ValueError("sweep needs the engine's RadixCache: wrap(worker, config, tree_cache=...)")
        if entries is None:
            entries = [rank_entries(self.tree_cache, r) for r in range(self.dp)]
        plans = [self.canary.sweep_plan(e) for e in entries]
        plan = jax.tree.map(lambda *xs: np.stack(xs), *plans)
        self._run("sweep", plan, self.pool_arrays())

    def rid_of(self, observed) -> str | None:
        """The ``rid`` a :class:`kvcanary_jax.DeviceObservedViolation` names (None: no request, or too long ago)."""
        row = observed.observed.violation.request_row
        ranks = self._requests.get(observed.observed.user_step, [])
        rank = observed.device[0]
        rids = ranks[rank] if rank < len(ranks) else []
        return rids[row] if row is not None and 0 <= row < len(rids) else None


def _section(mwb, rank: int, dp: int) -> types.SimpleNamespace:
    """DP rank ``rank``'s section of a ``ModelWorkerBatch``: the fields the single-device token oracle reads."""
    tokens, rows = len(mwb.input_ids) // dp, len(mwb.seq_lens) // dp
    cut = lambda x, n: None if x is None else x[rank * n : (rank + 1) * n]  # noqa: E731
    return types.SimpleNamespace(
        forward_mode=mwb.forward_mode, input_ids=cut(mwb.input_ids, tokens), seq_lens=cut(mwb.seq_lens, rows),
        req_pool_indices=cut(mwb.req_pool_indices, rows), extend_seq_lens=cut(mwb.extend_seq_lens, rows),
    )  # fmt: skip


def refuse(worker, live_requests) -> None:
    """Refuses, by name, what the parallel mapping does not cover."""
    problems = []
    pool = type(worker.model_runner.token_to_kv_pool).__name__
    if pool != "MHATokenToKVPool":
        problems.append(f"the KV pool {pool} (the parallel guard maps MHATokenToKVPool only)")
    if mapping.is_overlap_client(worker):
        problems.append("the overlap scheduler (run it with disable_overlap_schedule=True)")
    if live_requests is not None:
        problems.append("adopting a warm engine (live_requests; wrap it before it serves)")
    if problems:
        mesh = dict(worker.model_runner.mesh.shape)
        raise NotImplementedError(f"kvcanary's sglang-jax wrapper on a parallel engine (mesh {mesh}) does not map "
                                  + "; ".join(problems))  # fmt: skip
