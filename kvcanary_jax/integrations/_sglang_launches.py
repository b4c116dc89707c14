"""The guard's three launches (HEAD, TAIL, sweep), each a jit of its own around the engine's forward.

Each returns (state, the monitor's snapshot of it or None). The state is donated.
"""

from __future__ import annotations

import functools

import jax

import kvcanary_jax as kc
from kvcanary_jax.integrations._sglang_mapping import canary_batch, kv_sources


# TAIL and the sweep may end a step: their snapshot spares the monitor a launch of its own per step.
@functools.partial(jax.jit, static_argnames=("canary", "layout", "is_decode"), donate_argnums=(0,))
def _head(state, fields, oracle, *, canary, layout, is_decode):
    return canary.before_forward(state, canary_batch(fields, layout, is_decode=is_decode, oracle=oracle)), None


@functools.partial(jax.jit, static_argnames=("canary", "layout", "is_decode"), donate_argnums=(0,))
def _tail(state, fields, oracle, kv0, *, canary, layout, is_decode):
    k, v = kv_sources(kv0)
    batch = canary_batch(fields, layout, is_decode=is_decode, oracle=oracle)
    state = canary.after_forward(state, batch, canary.kv_sources(full_k=k, full_v=v))
    return state, kc.CanaryMonitor.snapshot(state)


@functools.partial(jax.jit, static_argnames=("canary",), donate_argnums=(0,))
def _sweep(state, plan, kv0, *, canary):
    k, v = kv_sources(kv0)
    state = canary.sweep(state, plan, canary.kv_sources(full_k=k, full_v=v))
    return state, kc.CanaryMonitor.snapshot(state)


_LAUNCHES = {"head": _head, "tail": _tail, "sweep": _sweep}
