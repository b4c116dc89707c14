"""``write``'s kernel entry point, written once: each backend supplies only its forward (chain walk and store)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels import layout
from pallas_kernels.write import reference

WRITTEN = 1  # bits of the chain kernels' per-entry flags
POSITION_FAILED = 2


def entry_point(forward: Callable, heuristic: Callable) -> Callable:
    """A backend's ``write``: the xla path's arguments (``api.write``, the contract) plus ``interpret`` and
    ``config``, around ``forward(canary_buf, walk, sources, *, mode, interpret, config)``.

    ``walk`` is ``(start, count, seed_hash, seed_position, check, input_ids, positions, out_cache_loc)``: each
    request's span and chain seed (``reference.request_spans``, ``reference.chain_seeds``) and the tokens.
    ``forward`` gets only the real-KV sources ``mode`` reads and a config (``heuristic(T)`` when None), and returns
    ``(new canary_buf, prev_hash u32[T, 2], expected_position u32[T, 2], flags i32[T])`` (``WRITTEN`` and
    ``POSITION_FAILED`` bits); no request or no token never reaches it.
    """

    @functools.partial(jax.jit, static_argnames=("real_kv_hash_mode", "interpret", "config"))
    def write(
        canary_buf, *arrays, real_kv_sources, real_kv_hash_mode, interpret=False, config=None
    ) -> tuple[jax.Array, reference.ChainOut]:
        """``api.write``'s xla path by this backend's kernels; ``interpret`` runs them interpreted (any platform),
        ``config`` is the store's launch shape."""
        write_offsets, seed_slot_indices, num_valid_reqs, input_ids, positions, out_cache_loc, flag = arrays
        num_tokens = out_cache_loc.shape[0]
        if num_tokens == 0 or seed_slot_indices.shape[0] == 0:
            return canary_buf, reference.empty_chain(num_tokens)
        start, count = reference.request_spans(write_offsets, num_valid_reqs, num_tokens)
        seeds = reference.chain_seeds(canary_buf, seed_slot_indices, count, flag)
        sources = tuple(real_kv_sources) if real_kv_hash_mode != layout.REAL_KV_NONE else ()
        new_buf, prev_hash, expected, flags = forward(
            canary_buf,
            (start, count, *seeds, input_ids, positions, out_cache_loc),
            sources,
            mode=real_kv_hash_mode,
            interpret=interpret,
            config=config or heuristic(num_tokens),
        )
        chain = reference.ChainOut(
            prev_hash=prev_hash,
            expected_position=expected,
            position_assert_failed=(flags & POSITION_FAILED) != 0,
            written=(flags & WRITTEN) != 0,
        )
        return new_buf, chain

    return write
