"""Small wrapped decode loops, one per padding convention, compiled once per session, for the runtime misuse suite.

A "step" is HEAD launches, a toy forward that writes each new token's KV as a function of (token, position), and
TAIL launches. ``negative`` (the default convention) runs the full checker: an SWA group, K and V halves and
real-KV PARTIAL, so KV faults are caught; ``reserved`` and ``none`` check chains only (K half, no real KV), which
keeps their compilation short.

Every scenario is two steps: step A writes each request's cached prefix (a prefill), step B verifies it and writes
the new tokens (a decode or an extend), so a step-B violation means something about step B's batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import kvcanary_jax as kc

NUM_SLOTS, PAGE_SIZE = 32, 4  # full pool
SWA_SLOTS, WINDOW = 16, 1  # SWA pool of the "negative" loop; full slots 1..15 are SWA slots 1..15
BATCH, TOKENS, TABLE_ROWS, CONTEXT = 3, 8, 4, 12  # static step shapes
LUT = np.where(np.arange(NUM_SLOTS + 1) < SWA_SLOTS, np.arange(NUM_SLOTS + 1), 0).astype(np.int32)
PADDINGS = ("negative", "reserved", "none")


@dataclasses.dataclass(frozen=True)
class Request:
    """A request in table row ``row`` with ``prefix`` cached and ``extend`` new tokens at ``slots[prefix:]``."""

    row: int
    prefix: int
    extend: int
    slots: tuple[int, ...]  # slot of each position, prefix + extend of them

    def token(self, position: int) -> int:
        return 100 * (self.row + 1) + position


@dataclasses.dataclass(frozen=True)
class Padding:
    """A convention's padding: extra batch rows ``(req_pool_indices, prefix, extend)`` and token-entry fillers."""

    rows: tuple[tuple[int, int, int], ...] = ()
    tokens: tuple[tuple[int, int, int], ...] = ()  # (input_id, position, out_cache_loc), cycled over free entries


def pack(requests, padding: Padding = Padding(), *, lut=LUT) -> kc.CanaryBatch:
    """The :class:`CanaryBatch` of ``requests`` (real rows first, request-major tokens), padded to static shapes."""
    table = np.zeros((TABLE_ROWS, CONTEXT), np.int32)
    rows, tokens = [], []
    for r in requests:
        table[r.row, : len(r.slots)] = r.slots
        rows.append((r.row, r.prefix, r.extend))
        tokens += [(r.token(p), p, r.slots[p]) for p in range(r.prefix, r.prefix + r.extend)]
    rows += list(padding.rows)
    fill = list(padding.tokens) or [(0, 0, -1)]
    tokens += [fill[i % len(fill)] for i in range(TOKENS - len(tokens))]
    assert len(rows) == BATCH and len(tokens) == TOKENS, (rows, tokens)
    i32 = functools.partial(np.asarray, dtype=np.int32)
    (rpi, prefix, extend), (ids, positions, loc) = zip(*rows, strict=True), zip(*tokens, strict=True)
    return kc.CanaryBatch(
        i32(rpi), i32(prefix), i32(extend), table, i32(ids), i32(positions), i32(loc), full_to_swa_index_mapping=lut
    )


def pack_padded(requests, padding: str) -> kc.CanaryBatch:
    """:func:`pack` with the batch's free rows filled as ``padding`` fills them (``none``: requests without tokens)."""
    free = BATCH - len(requests)
    if padding == "none":
        rows = [row for row in range(TABLE_ROWS) if row not in {r.row for r in requests}]
        return pack(list(requests) + [Request(row, 0, 0, ()) for row in rows[:free]])
    return pack(requests, Padding(rows=((-1 if padding == "negative" else 0, 0, 0),) * free))


def prefill(requests) -> list[Request]:
    """Step A of a scenario: each request writes its cached prefix from position 0."""
    return [dataclasses.replace(r, prefix=0, extend=r.prefix, slots=r.slots[: r.prefix]) for r in requests]


def _forward(kv, batch: kc.CanaryBatch):
    """The toy forward: token t at position p writes ``1000 t + p`` into its slot's K/V row (full and SWA pools)."""
    full, swa = kv
    loc = batch.out_cache_loc
    row = (batch.input_ids * 1000 + batch.positions).astype(jnp.float32)[:, None] * jnp.ones((4,), jnp.float32)
    slot = jnp.where(loc >= 0, loc, NUM_SLOTS)  # padding and bad slots fall off the pool, as a drop-mode scatter does
    full = full.at[slot // PAGE_SIZE, slot % PAGE_SIZE].set(row, mode="drop")
    lut = batch.full_to_swa_index_mapping
    swa_slot = jnp.where((loc >= 0) & (loc < NUM_SLOTS), lut[jnp.clip(loc, 0, NUM_SLOTS)], SWA_SLOTS)
    swa_slot = jnp.where(swa_slot >= 0, swa_slot, SWA_SLOTS)
    swa = swa.at[swa_slot // PAGE_SIZE, swa_slot % PAGE_SIZE].set(row, mode="drop")
    return full, swa


@dataclasses.dataclass(frozen=True)
class Loop:
    """A canary and its jitted step ``(kv, state, batch) -> (kv, state)``; ``kv`` is ``(full, swa)`` f32 pools."""

    canary: kc.KvCanary
    step: object
    sweep: object

    @property
    def real_kv(self) -> bool:
        return self.canary.config.real_kv_hash_mode is not kc.RealKvHashMode.NONE

    def init(self):
        kv = (
            jnp.zeros((NUM_SLOTS // PAGE_SIZE, PAGE_SIZE, 4), jnp.float32),
            jnp.zeros((SWA_SLOTS // PAGE_SIZE, PAGE_SIZE, 4), jnp.float32),
        )
        return kv, self.canary.init_state()

    def sources(self, kv) -> kc.KvSources:
        if not self.real_kv:
            return kc.KvSources()
        full, swa = kv
        return self.canary.kv_sources(full_k=full, full_v=full, swa_k=swa, swa_v=swa)

    def run(self, *batches, kv=None, state=None, armed: bool = True):
        """Runs the batches from a fresh state; ``armed`` turns the chain-position assert on after the first."""
        if kv is None:
            kv, state = self.init()
        for i, batch in enumerate(batches):
            kv, state = self.step(kv, state, batch)
            if i == 0 and armed:
                state = self.canary.mark_init_finished(state)
        return kv, state


@functools.cache
def loop(padding: str) -> Loop:
    """The session's loop for ``padding`` (compiled on first use)."""
    negative = padding == "negative"
    config = kc.CanaryConfig(
        mode="log", ring_capacity=64, real_kv_hash_mode="partial" if negative else "none", backend="xla"
    )
    pool = kc.CanaryPool(
        num_slots=NUM_SLOTS,
        page_size=PAGE_SIZE,
        swa=kc.SwaGroup(SWA_SLOTS, WINDOW) if negative else None,
        with_v=negative,
        padding=padding,
    )
    canary = kc.KvCanary(config, pool)
    holder = Loop(canary, None, None)

    @jax.jit
    def step(kv, state, batch):
        state = canary.before_forward(state, batch)
        state, kv = kc.fence(state, kv)
        kv = _forward(kv, batch)
        state, kv = kc.fence(state, kv)
        return kv, canary.after_forward(state, batch, holder.sources(kv))

    @jax.jit
    def sweep(kv, state, plan):
        return canary.sweep(state, plan, holder.sources(kv))

    return dataclasses.replace(holder, step=step, sweep=sweep)
