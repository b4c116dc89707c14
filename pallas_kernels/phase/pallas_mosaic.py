"""Fused phase on TPU (Pallas Mosaic): the reference's plan, rows and ring placement around the Mosaic verify and
write kernels.

TPU has Mosaic kernels for the single verify and write launches, so a phase is the reference's (``reference.phase``)
with each half's verify bits and its chain walk and store taken from those kernels: the plan, the skipped tokens
and the ``INVALID_INPUT`` rows are :func:`reference.prepare`'s, the rows are read from the buffers before the
stores (:func:`reference.verify_rows`, ordered by :func:`reference.loaded_after`), and :func:`reference.finish` places
every row in one ring update and bumps the counters. The bytes are the reference's.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import fusion
from pallas_kernels.phase import reference
from pallas_kernels.verify import pallas_mosaic as verify_kernels
from pallas_kernels.write import pallas_mosaic as write_kernels


def phase(
    buffers, log, batch, enable_chain_position_assert, real_kv_sources, input_issues=None, *, spec, interpret=False
):
    """``reference.phase`` (the contract) with the Mosaic verify and write kernels; ``interpret`` runs them in TPU
    interpret mode (any platform)."""
    p = reference.prepare(buffers, log, batch, input_issues, spec)
    plan, check, capacity = p.plan, p.batch.token_ids is not None, log.ring.shape[0]
    loaded = reference.load_halves(buffers, plan)  # every record the rows read, before any store
    num_reqs = jnp.full((1,), p.batch.req_pool_indices.shape[0], jnp.int32)
    pending, new_buffers = list(p.pending), []
    all_bits = verify_kernels.verify_bits_of_buffers(  # both halves in one launch, before any store
        buffers,
        plan.slot_indices,
        plan.expected_tokens,
        plan.expected_positions,
        plan.prev_slot_indices,
        plan.active,
        real_kv_sources=real_kv_sources,
        real_kv_hash_mode=spec.real_kv_hash_mode,
        check_expected_token=check,
        interpret=interpret,
    )
    for h, (buf, tag, sources, bits) in enumerate(zip(buffers, spec.tags, real_kv_sources, all_bits, strict=True)):
        verify = reference.verify_rows(p, loaded, h, bits, tag, check, capacity)
        buf, chain = write_kernels.write(
            buf,
            plan.write_offsets,
            plan.seed_slot_indices,
            num_reqs,
            p.batch.input_ids,
            p.batch.positions,
            p.loc + reference.loaded_after(loaded) + fusion.zero_after(bits),  # after the reads of this buffer
            enable_chain_position_assert,
            real_kv_sources=sources,
            real_kv_hash_mode=spec.real_kv_hash_mode,
            interpret=interpret,
        )
        pending += [verify, reference.write_rows(p, chain, tag, capacity)]
        new_buffers.append(buf)
    return reference.finish(log, p, pending, new_buffers, chain.written, spec.tags)
