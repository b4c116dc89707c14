"""Live fault drills in a served sglang-jax engine (``--canary-inject KIND[:PROB]``), off by default.

Each scheduler step fires the drill with probability ``PROB`` (seeded), into the engine's own state, with the
``kvcanary_jax.testing`` injectors; each drill that fires is logged as ``kvcanary drill injected``, with the step of
the forward it corrupts (the step a violation line names):

* ``live_kv``: a byte of the slot a decoding request wrote at its previous step (its own slot).
* ``req_to_token``: one step's host page-table entry of a decoding request pointed at another request's slot.
* ``idle_cache_kv``: a byte of a slot only the radix cache holds (found by the sweep; needs ``sweep_interval``).
* ``token_swap``: two decoding requests' input tokens crossed (under the overlap scheduler, their placeholders).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvcanary_jax import testing
from kvcanary_jax.integrations import _sglang_mapping, _sglang_pools, sglang_jax

logger = logging.getLogger("kvcanary_jax.drill")
KINDS = ("live_kv", "req_to_token", "idle_cache_kv", "token_swap")


@dataclasses.dataclass(frozen=True)
class DrillSpec:
    """``kind`` fired with probability ``prob`` per step, from ``seed``."""

    kind: str
    prob: float = 0.1
    seed: int = 0

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> DrillSpec:
        """``KIND`` or ``KIND:PROB``."""
        kind, _, prob = text.partition(":")
        if kind not in KINDS:
            raise ValueError(f"--canary-inject kind must be one of {', '.join(KINDS)}; got {kind!r}")
        try:
            p = float(prob) if prob else cls.prob
        except ValueError:
            raise ValueError(f"--canary-inject probability must be a number in (0, 1]; got {prob!r}") from None
        if not 0 < p <= 1:
            raise ValueError(f"--canary-inject probability must be in (0, 1]; got {p}")
        return cls(kind, p, seed)


def _flip(guard, slot: int) -> None:
    """Byte 0 of full-pool ``slot`` in the array the FULL group checks (an SWA model's full sub-pool)."""
    _sglang_pools.flip_layer0_byte(guard.runner.token_to_kv_pool, slot, guard.layout.page_size)


class Drill:
    """Fires one :class:`DrillSpec` inside the served engine; hooks the scheduler's ``run_batch`` and the guard."""

    def __init__(self, spec: DrillSpec, scheduler):
        self.spec, self.scheduler = spec, scheduler
        self.rng = np.random.default_rng(spec.seed)
        self.fired = 0

    def _roll(self) -> bool:
        return bool(self.rng.random() < self.spec.prob)

    def _injected(self, what: str, **where) -> None:
        self.fired += 1
        logger.warning("kvcanary drill injected %s: %s", what, " ".join(f"{k}={v}" for k, v in where.items()))

    @staticmethod
    def _decoding(batch) -> list:
        """``(row, req, seq_len)`` of each decoding row with >= 2 generated tokens (its last two slots are its own)."""
        info = batch.reqs_info[0]
        decode = batch.forward_mode.is_decode()
        mixed = {id(r) for r in info.decoding_reqs or []}
        return [(b, req, int(info.seq_lens[b])) for b, req in enumerate(info.reqs)
                if (decode or id(req) in mixed) and len(req.output_ids) >= 2]  # fmt: skip

    def before_run_batch(self, batch):
        """The scheduler's thread, before the batch is built: a page-table remap for this one step (undone after)."""
        if self.spec.kind != "req_to_token" or not self._roll():
            return None
        rows = self._decoding(batch)
        if len(rows) < 2:
            return None
        table, ps = self.scheduler.req_to_token_pool.req_to_token, self.scheduler.page_size
        (_, req, seq), (_, other, other_seq) = (rows[i] for i in self.rng.choice(len(rows), 2, replace=False))
        position = int(self.rng.integers(0, seq - 2)) // ps * ps  # a page start attention reads
        sources = [q for q in range(0, other_seq - 2, ps) if table[other.req_pool_idx, q] != table[req.req_pool_idx,
                   position] and q != position]  # fmt: skip
        if not sources:
            return None
        source = sources[int(self.rng.integers(len(sources)))]
        old, new = int(table[req.req_pool_idx, position]), int(table[other.req_pool_idx, source])
        table[:] = np.asarray(testing.remap_slot(table, req.req_pool_idx, position, new))
        self._injected("req_to_token", rid=req.rid, position=position, slot=new, was=old,
                       step=self.scheduler.kvcanary.enqueued)  # fmt: skip

        def undo():
            table[req.req_pool_idx, position] = old

        return undo

    def on_enqueue(self, guard, model_worker_batch, pending) -> None:
        """The scheduler's thread, as the batch goes to the worker: token swaps, and KV flips queued for the
        forward's thread."""
        kind = self.spec.kind
        if kind == "req_to_token" or not self._roll():
            return
        batch = self.scheduler.cur_batch
        if kind == "idle_cache_kv":
            sweeps = pending.sweep is not None if guard.overlap else guard.monitor.sweep_due
            idle = sglang_jax.radix_entries(guard.tree_cache, include=_sglang_mapping.unlocked)
            if sweeps and len(idle.slots):
                slot = int(idle.slots[int(self.rng.integers(len(idle.slots)))])
                self._injected("idle_cache_kv", rid=None, slot=slot, step=guard.enqueued - 1)
                self._on_forward_thread(guard, pending.before_sweep, lambda g: _flip(g, slot))
            return
        rows = self._decoding(batch)
        if kind == "live_kv" and rows:
            _, req, seq = rows[int(self.rng.integers(len(rows)))]
            slot = int(self.scheduler.req_to_token_pool.req_to_token[req.req_pool_idx, seq - 2])
            self._injected("live_kv", rid=req.rid, position=seq - 2, slot=slot, step=guard.enqueued - 1)
            self._on_forward_thread(guard, pending.before_forward, lambda g: _flip(g, slot))
        elif kind == "token_swap" and batch.forward_mode.is_decode() and len(rows) >= 2:
            ids = np.asarray(model_worker_batch.input_ids)
            pairs = [(i, j) for i, _, _ in rows for j, _, _ in rows if i < j and ids[i] != ids[j]]
            if pairs:
                i, j = pairs[int(self.rng.integers(len(pairs)))]
                model_worker_batch.input_ids = np.asarray(testing.swap_tokens(ids, i, j)).astype(ids.dtype)
                reqs = batch.reqs_info[0].reqs
                where = dict(rid=reqs[i].rid, other=reqs[j].rid, step=guard.enqueued - 1)
                self._injected("token_swap", **where)
                if ids[i] < 0 and ids[j] < 0:  # the overlap scheduler's placeholders: their tokens may be equal
                    pending.before_forward.append(lambda g: self._check_swap(g, -int(ids[i]), -int(ids[j]), where))

    @staticmethod
    def _check_swap(guard, a: int, b: int, where: dict) -> None:
        """On the forward's thread, where the future-token map holds the tokens the swapped placeholders stand for: a
        swap of two equal tokens changes nothing, and is said so (no violation can name it)."""
        first, second = np.asarray(guard.worker.future_token_ids_map[np.array([a, b])]).tolist()
        if first == second:
            logger.warning("kvcanary drill token_swap had no effect: %s (both tokens were %d)",
                           " ".join(f"{k}={v}" for k, v in where.items()), first)  # fmt: skip

    @staticmethod
    def _on_forward_thread(guard, actions: list, action) -> None:
        """Runs ``action`` where the KV buffer is safe to replace: queued for the overlap worker's thread, or now."""
        if guard.overlap:
            actions.append(action)
        else:
            action(guard)
