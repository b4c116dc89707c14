"""``verify``'s kernel entry point, written once: each backend supplies only its forward."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import layout


def entry_point(forward: Callable, heuristic: Callable, *, halves: bool = False) -> Callable:
    """A backend's ``verify_bits``: ``api.verify``'s arrays and static arguments (the contract is there) plus
    ``interpret`` and ``config``, around ``forward(canary_buf, plan, num_active, sources, *, mode, check, interpret,
    config)``.

    ``forward`` gets the four plan arrays as one tuple, only the real-KV sources ``mode`` reads, and a config
    (``heuristic(capacity)`` when None); an empty plan never reaches it (a kernel would index empty refs).

    With ``halves``, the entry checks one plan against several buffers in one launch (a phase's K and V):
    ``canary_buf`` is a sequence of buffers, ``real_kv_sources`` one sequence per buffer, and ``forward``, like the
    entry, returns one bits array per buffer.
    """

    @functools.partial(jax.jit, static_argnames=("real_kv_hash_mode", "check_expected_token", "interpret", "config"))
    def verify_bits(
        canary_buf, *plan_and_count, real_kv_sources, real_kv_hash_mode, check_expected_token, interpret=False,
        config=None,
    ) -> jax.Array | list[jax.Array]:  # fmt: skip
        """``api.verify`` by this backend's kernel; ``interpret`` runs it interpreted (any platform),
        ``config`` is its launch shape."""
        *plan, num_active = plan_and_count  # slot_indices, expected_tokens, expected_positions, prev_slot_indices
        capacity = plan[0].shape[0]
        reads = real_kv_hash_mode != layout.REAL_KV_NONE
        if halves:
            sources = tuple(tuple(half) if reads else () for half in real_kv_sources)
        else:
            sources = tuple(real_kv_sources) if reads else ()
        if capacity == 0:
            empty = jnp.zeros((0,), jnp.int32)
            return [empty for _ in canary_buf] if halves else empty
        return forward(
            canary_buf,
            tuple(plan),
            num_active,
            sources,
            mode=real_kv_hash_mode,
            check=check_expected_token,
            interpret=interpret,
            config=config or heuristic(capacity),
        )

    return verify_bits
