"""The guard's three launches (HEAD, TAIL, sweep), each a jit of its own around the engine's forward.

Each takes the engine's pool arrays (:meth:`PoolView.arrays`) and returns (state, the monitor's snapshot of it or
None). The state is donated.
"""

from __future__ import annotations

import functools

import jax

import kvcanary_jax as kc
from kvcanary_jax.integrations._sglang_mapping import canary_batch

_STATIC = ("canary", "view", "layout", "is_decode")


def _batch(fields, oracle, arrays, *, view, layout, is_decode):
    return canary_batch(fields, layout, is_decode=is_decode, oracle=oracle, pool_fields=view.batch_fields(arrays))


# TAIL and the sweep may end a step: their snapshot spares the monitor a launch of its own per step.
@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=(0,))
def _head(state, fields, oracle, arrays, *, canary, view, layout, is_decode):
    batch = _batch(fields, oracle, arrays, view=view, layout=layout, is_decode=is_decode)
    return canary.before_forward(state, batch), None


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=(0,))
def _tail(state, fields, oracle, arrays, *, canary, view, layout, is_decode):
    batch = _batch(fields, oracle, arrays, view=view, layout=layout, is_decode=is_decode)
    state = canary.after_forward(state, batch, view.sources(canary, arrays))
    return state, kc.CanaryMonitor.snapshot(state)


@functools.partial(jax.jit, static_argnames=("canary", "view"), donate_argnums=(0,))
def _sweep(state, plan, arrays, *, canary, view):
    state = canary.sweep(state, plan, view.sources(canary, arrays))
    return state, kc.CanaryMonitor.snapshot(state)


_LAUNCHES = {"head": _head, "tail": _tail, "sweep": _sweep}
