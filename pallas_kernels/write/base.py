"""``write``'s kernel entry point, written once: each backend supplies only its forward (chain walk and store)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels import layout
from pallas_kernels.write import reference

WRITTEN = 1  # bits of the chain kernels' per-entry flags
POSITION_FAILED = 2


def entry_point(forward: Callable, heuristic: Callable, *, halves: bool = False) -> Callable:
    """A backend's ``write``: the xla path's arguments (``api.write``, the contract) plus ``interpret`` and
    ``config``, around ``forward(canary_buf, walk, sources, *, mode, interpret, config)``.

    ``walk`` is ``(start, count, seed_hash, seed_position, check, input_ids, positions, out_cache_loc)``: each
    request's span and chain seed (``reference.request_spans``, ``reference.chain_seeds``) and the tokens.
    ``forward`` gets only the real-KV sources ``mode`` reads and a config (``heuristic(T)`` when None), and returns
    ``(new canary_buf, prev_hash u32[T, 2], expected_position u32[T, 2], flags i32[T])`` (``WRITTEN`` and
    ``POSITION_FAILED`` bits); no request or no token never reaches it.

    With ``halves``, one walk and one store serve several buffers that share the tokens (a phase's K and V):
    ``canary_buf`` is a sequence of buffers and ``real_kv_sources`` one sequence per buffer; ``forward`` gets them
    so, with a ``seed_hash`` and ``seed_position`` per buffer, and returns each of its four results per buffer, as
    the entry returns its ``(buffers, chains)``.
    """

    @functools.partial(jax.jit, static_argnames=("real_kv_hash_mode", "interpret", "config"))
    def write(
        canary_buf, *arrays, real_kv_sources, real_kv_hash_mode, interpret=False, config=None
    ) -> tuple[jax.Array | list[jax.Array], reference.ChainOut | list[reference.ChainOut]]:
        """``api.write``'s xla path by this backend's kernels; ``interpret`` runs them interpreted (any platform),
        ``config`` is the store's launch shape."""
        write_offsets, seed_slot_indices, num_valid_reqs, input_ids, positions, out_cache_loc, flag = arrays
        bufs = tuple(canary_buf) if halves else (canary_buf,)
        num_tokens = out_cache_loc.shape[0]
        if num_tokens == 0 or seed_slot_indices.shape[0] == 0:
            empty = reference.empty_chain(num_tokens)
            return (list(bufs), [empty] * len(bufs)) if halves else (canary_buf, empty)
        start, count = reference.request_spans(write_offsets, num_valid_reqs, num_tokens)
        seeds = [reference.chain_seeds(buf, seed_slot_indices, count, flag) for buf in bufs]
        reads = real_kv_hash_mode != layout.REAL_KV_NONE
        if halves:
            sources = tuple(tuple(half) if reads else () for half in real_kv_sources)
            seed_hash, seed_position = tuple(s[0] for s in seeds), tuple(s[1] for s in seeds)
        else:
            sources, (seed_hash, seed_position, _) = (tuple(real_kv_sources) if reads else ()), seeds[0]
        outs = forward(
            canary_buf,
            (start, count, seed_hash, seed_position, seeds[0][2], input_ids, positions, out_cache_loc),
            sources,
            mode=real_kv_hash_mode,
            interpret=interpret,
            config=config or heuristic(num_tokens),
        )
        new_bufs, prev_hash, expected, flags = outs if halves else ([x] for x in outs)
        chains = [
            reference.ChainOut(
                prev_hash=p,
                expected_position=e,
                position_assert_failed=(f & POSITION_FAILED) != 0,
                written=(f & WRITTEN) != 0,
            )
            for p, e, f in zip(prev_hash, expected, flags, strict=True)
        ]
        return (list(new_bufs), chains) if halves else (new_bufs[0], chains[0])

    return write
