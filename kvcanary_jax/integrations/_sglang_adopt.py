"""Attaching the canary to a warm sglang-jax engine: adopt what it already cached, then check from there.

An engine that served steps before :func:`~kvcanary_jax.integrations.sglang_jax.wrap` holds KV the canary has no
records of (requests mid-decode, prefixes in the radix cache); its first verify of those slots would report each one.
:func:`adopt` writes their records once, from the engine's own tables and token history (:meth:`KvCanary.adopt`):

* every slot the ``RadixCache`` holds: its node's key gives the tokens, the depth-first walk the positions and the
  predecessors (as the sweep sees them);
* every live request's written positions: ``req_to_token[req.req_pool_idx, :req.kv_committed_len]`` with the tokens
  ``origin_input_ids + output_ids``. A decoding request's last sampled token has no KV yet: ``kv_committed_len``
  stops before it.

Call it between steps (after the scheduler processed a step's results, before the next batch is prepared), on a
guard that has not run a step yet or on any guard later: records already written are rewritten with the same bytes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

import kvcanary_jax as kc
from kvcanary_jax.integrations import _sglang_mapping as mapping


def _children(node) -> list:
    """A node's resident children, as :func:`~kvcanary_jax.integrations.sglang_jax.radix_entries` walks them."""
    return [c for c in node.children.values() if c.value is not None]


def radix_adopt_entries(tree_cache) -> kc.AdoptEntries:
    """Every slot the ``RadixCache`` holds, with its token: two walks of the same nodes in the same order."""
    tokens = lambda node: np.asarray(list(node.key), np.int32)  # noqa: E731
    keys = kc.walk_prefix_tree(tree_cache.root_node, children=_children, slots=tokens)
    return kc.AdoptEntries.from_sweep(mapping.radix_entries(tree_cache), keys.slots)


def request_adopt_entries(req, req_to_token_pool) -> kc.AdoptEntries:
    """A live request's written positions (``kv_committed_len`` of them) from its page-table row and history."""
    history = list(req.origin_input_ids) + list(req.output_ids)
    n = int(req.kv_committed_len)
    if req.req_pool_idx is None or n > len(history):
        raise ValueError(
            f"request {req.rid!r} cannot be adopted: req_pool_idx={req.req_pool_idx}, kv_committed_len={n}, "
            f"{len(history)} tokens of history (adopt between steps, after the results were processed)"
        )
    row = np.asarray(req_to_token_pool.req_to_token[req.req_pool_idx, :n], np.int32)
    return kc.AdoptEntries.from_request(row, np.asarray(history, np.int32), n)


def adopt_entries(reqs, req_to_token_pool, tree_cache=None) -> kc.AdoptEntries:
    """The radix cache's slots first (predecessors before successors), then each request's own, each slot once."""
    parts = [radix_adopt_entries(tree_cache)] if tree_cache is not None else []
    parts += [request_adopt_entries(r, req_to_token_pool) for r in reqs]
    return kc.AdoptEntries.merge(*parts)


@functools.partial(jax.jit, static_argnames=("canary", "view"), donate_argnums=(0,))
def _adopt(state, plan, arrays, *, canary, view):
    return canary.adopt(state, plan, view.sources(canary, arrays))


def adopt(guard, reqs, req_to_token_pool) -> int:
    """Writes the records of every slot the engine cached (``guard.tree_cache``'s and ``reqs``'); returns how many.

    Args:
      guard: the :class:`~kvcanary_jax.integrations.sglang_jax.SglangCanary` of the engine's worker.
      reqs: the live requests (e.g. :func:`~kvcanary_jax.integrations.sglang_jax.scheduler_requests`).
      req_to_token_pool: the scheduler's ``ReqToTokenPool``.

    Raises:
      ValueError: an entry the engine's tables give that cannot be adopted, named (see ``KvCanary.adopt_plan``).
    """
    entries = adopt_entries(reqs, req_to_token_pool, guard.tree_cache)
    capacity = mapping.sized_capacity(len(entries.slots), guard.canary.pool.num_slots)
    plan = guard.canary.adopt_plan(entries, capacity=capacity)
    with jax.set_mesh(guard.runner.mesh):
        guard.state = _adopt(guard.state, plan, guard.pool_arrays(), canary=guard.canary, view=guard.view)
    return len(entries.slots)
