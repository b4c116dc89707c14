"""Fused phase on TPU (Pallas Mosaic): the reference's plan, rows and ring placement around the Mosaic verify and
write kernels.

TPU has Mosaic kernels for the verify and write launches, so a phase is the reference's (``reference.phase``)
with the halves' verify bits, chain walks and stores taken from those kernels, three launches that each serve
every half: the plan, the skipped tokens and the ``INVALID_INPUT`` rows are :func:`reference.prepare`'s, the rows
are read from the buffers before the stores (:func:`reference.verify_rows`, ordered by
:func:`reads.loaded_after`), and :func:`reference.finish` places every row in one ring update and bumps the
counters. The bytes are the reference's.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import fusion
from pallas_kernels.phase import reads, reference
from pallas_kernels.verify import pallas_mosaic as verify_kernels
from pallas_kernels.write import pallas_mosaic as write_kernels


def phase(
    buffers, log, batch, enable_chain_position_assert, real_kv_sources, input_issues=None, *, spec, interpret=False
):
    """``reference.phase`` (the contract) with the Mosaic verify and write kernels; ``interpret`` runs them in TPU
    interpret mode (any platform)."""
    p = reference.prepare(buffers, log, batch, input_issues, spec)
    plan, check, capacity = p.plan, p.batch.token_ids is not None, log.ring.shape[0]
    loaded = reads.load_halves(buffers, plan)  # every record the rows read, before any store
    num_reqs = jnp.full((1,), p.batch.req_pool_indices.shape[0], jnp.int32)
    pending = list(p.pending)
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
    verifies = [
        reference.verify_rows(p, loaded, h, bits, tag, check, capacity)
        for h, (tag, bits) in enumerate(zip(spec.tags, all_bits, strict=True))
    ]
    new_buffers, chains = write_kernels.write_of_buffers(  # every buffer in one walk and one store
        buffers,
        plan.write_offsets,
        plan.seed_slot_indices,
        num_reqs,
        p.batch.input_ids,
        p.batch.positions,
        p.loc + reads.loaded_after(loaded) + fusion.zero_after(all_bits[0]),  # after the reads (one launch)
        enable_chain_position_assert,
        real_kv_sources=real_kv_sources,
        real_kv_hash_mode=spec.real_kv_hash_mode,
        interpret=interpret,
    )
    for verify, chain, tag in zip(verifies, chains, spec.tags, strict=True):
        pending += [verify, reference.write_rows(p, chain, tag, capacity)]
    return reference.finish(log, p, pending, new_buffers, chains[-1].written, spec.tags)
