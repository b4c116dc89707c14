"""The phase's reads in jnp: every record, hash and real-KV fold it reads from the canary buffers before its writes,
in one pass, and the write chains walked from them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import fusion, hash64, layout, realkv, records
from pallas_kernels.phase import common
from pallas_kernels.phase import plan as plans
from pallas_kernels.verify import reference as verify_reference
from pallas_kernels.write import reference as write_reference

# The u32 words of each entry's ``Loaded.words[entry, half]``: the record read at the entry's slot (its position
# field at _POSITION), the H() of its hashed slot, the REAL_KV_HASH fold of its slot and its verify bits.
_RECORD, _POSITION, _HASH, _FOLD, _BITS = slice(0, 8), slice(2, 4), slice(8, 10), slice(10, 12), 12
_WORDS = _BITS + 1

# Entries read per loop step on CPU: the loop walks the listed entries only (fusion.leading).
_BLOCK = 64


class Loaded(NamedTuple):
    """What the phase reads of the canary buffers before its writes, and what it derives from those reads alone.

    ``words`` is u32[R + T + capacity, halves, 13], one row per entry of three lists: each request's write-chain
    seed, each written token and each verify plan entry, in that order (:func:`read_halves`). Readers index it
    directly (:meth:`seeds`, :meth:`write_kv`, :meth:`verify`), so it is computed once and no slice or split copy
    of it crosses into a loop or a conditional. Past the plan's ``active`` entries the verify rows hold zeros or
    unspecified values (no reader looks there; the bits are 0)."""

    words: jax.Array
    table: jax.Array  # i32[R + T + capacity, 6] what each entry read: see read_halves
    num_reqs: int
    num_tokens: int

    def seeds(self) -> tuple[hash64.U64, hash64.U64]:
        """(H(seed slot), the seed slot's stored position) of each request's write chain, u64 [halves, R]."""
        seeds = jnp.moveaxis(self.words[: self.num_reqs], 0, 1)
        return hash64.split(seeds[..., _HASH]), hash64.split(seeds[..., _POSITION])

    def write_kv(self, h: int) -> hash64.U64:
        """Half ``h``'s REAL_KV_HASH of each written token's slot, u64 [T]."""
        return hash64.split(self.words[self.num_reqs : self.num_reqs + self.num_tokens, h, _FOLD])

    def verify(self, h, entries) -> tuple[records.Record, hash64.U64, jax.Array, tuple[jax.Array, ...]]:
        """(stored record, H(prev), verify bits i32, (slot, prev, expected token, expected position, batch row))
        of verify plan ``entries`` of half ``h`` (arrays of one shape, or an int half): one gather of each array."""
        at = self.num_reqs + self.num_tokens + entries
        words, plan = self.words[at, h], self.table[at]
        stored = records.fields(words[..., _RECORD].reshape(*words.shape[:-1], 4, 2))
        bits = lax.bitcast_convert_type(words[..., _BITS], jnp.int32)
        return stored, hash64.split(words[..., _HASH]), bits, tuple(plan[..., c] for c in (0, 1, 2, 3, 5))

    def bits(self) -> jax.Array:
        """i32[halves, capacity] the verify bits of every plan entry."""
        words = self.words[self.num_reqs + self.num_tokens :, :, _BITS]
        return lax.bitcast_convert_type(words.T, jnp.int32)


def read_halves(
    buffers: Sequence[jax.Array],
    plan: plans.Plan,
    loc: jax.Array,
    real_kv_sources: Sequence[Sequence[realkv.RealKvSource]] = (),
    mode: int = layout.REAL_KV_NONE,
    check_expected_token: bool | None = None,
) -> Loaded:
    """Every read of the canary buffers and the real KV that the phase makes before its writes, in one pass.

    Per entry of the seeds (R), the written tokens ``loc`` (T) and the verify plan (capacity), of every half: the
    record at its slot (the seed, the written or the verified slot), H() of the slot it hashes (the seed; the
    predecessor; a token's own slot, unread), the REAL_KV_HASH fold of its slot (with ``real_kv_sources``, one
    list per half) and, for a verify entry when ``check_expected_token`` is not None, its verify bits. On CPU the
    pass is one loop over blocks of the seeds, the written tokens and the listed verify entries only
    (:func:`fusion.leading`); lowered elsewhere, one pass over all of them.
    """
    num_reqs, num_tokens, capacity = plan.seed_slot_indices.shape[0], loc.shape[0], plan.slot_indices.shape[0]
    fold = mode != layout.REAL_KV_NONE and any(real_kv_sources)
    seeds, tokens = plan.seed_slot_indices, loc
    none = lambda like, value: jnp.full(like.shape, value, jnp.int32)  # noqa: E731
    # Per entry: the slot read, the slot hashed (a verify entry's predecessor), the expected token and position,
    # the plan entry (capacity for a seed or a token: not a verify entry, no bits) and its batch row.
    table = jnp.stack(
        [
            jnp.concatenate(column)
            for column in (
                (seeds, tokens, plan.slot_indices),
                (seeds, tokens, plan.prev_slot_indices),
                (none(seeds, -1), none(tokens, -1), plan.expected_tokens),
                (none(seeds, 0), none(tokens, 0), plan.expected_positions),
                (none(seeds, capacity), none(tokens, capacity), jnp.arange(capacity, dtype=jnp.int32)),
                (none(seeds, 0), none(tokens, 0), plan.entry_rows),
            )
        ],
        axis=1,
    )

    def read_block(rows):  # i32[B, 6] entries -> u32[B, halves, 13]
        slots, hash_slots, tokens, positions, entries = (rows[:, c] for c in range(5))
        stored = jnp.stack([buf[records.clamp_slots(slots, buf.shape[0])] for buf in buffers])  # [halves, B, 4, 2]
        chained = jnp.stack([buf[records.clamp_slots(hash_slots, buf.shape[0])] for buf in buffers])
        chain = records.record_hash(hash_slots, records.fields(chained))
        real_kv = hash64.const(0, stored[..., 0, 0])
        if fold:
            clamped = records.clamp_slots(slots, buffers[0].shape[0])
            folds = [realkv.fold_slots(sources, clamped, mode) for sources in real_kv_sources]
            real_kv = tuple(jnp.stack(parts) for parts in zip(*folds, strict=True))
        bits = jnp.zeros(stored.shape[:2], jnp.int32)
        if check_expected_token is not None:
            bits = verify_reference.loaded_bits(
                records.fields(stored),
                chain,
                real_kv,
                slots,
                tokens,
                positions,
                hash_slots,
                plan.active,
                check_expected_token=check_expected_token,
                entries=entries,
            )
        # The hash, fold and bits words share their work: computed together, not once per word (no fold: zeros).
        shared = [*chain, lax.bitcast_convert_type(bits, jnp.uint32), *(real_kv if fold else ())]
        shared = fusion.computed_together(shared)
        chain, bits, real_kv = shared[:2], shared[2], shared[3:] if fold else real_kv
        words = jnp.stack([*chain, *real_kv, bits], axis=-1)
        return jnp.moveaxis(jnp.concatenate([stored.reshape(*stored.shape[:2], 8), words], axis=-1), 1, 0)

    entry = jax.ShapeDtypeStruct((len(buffers), _WORDS), jnp.uint32)
    words = fusion.leading(read_block, table, num_reqs + num_tokens + plan.active, _BLOCK, entry)
    return Loaded(words, table, num_reqs, num_tokens)


def load_halves(buffers: Sequence[jax.Array], plan: plans.Plan) -> Loaded:
    """:func:`read_halves` of the seeds and the verify plan entries only: the records the rows read and the
    hashes, without folds or bits (a backend that verifies in its own kernels)."""
    return read_halves(buffers, plan, jnp.zeros((0,), jnp.int32))


def loaded_after(loaded: Loaded) -> jax.Array:
    """A traced int32 zero that orders a store after the phase's reads (:func:`fusion.zero_after`)."""
    return fusion.zero_after(loaded.words)


def stack_halves(trees):
    """One pytree from per-half pytrees of equal structure, each leaf stacked on a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def walk_halves(loaded: Loaded, plan: plans.Plan, batch: common.Batch, loc, enable_chain_position_assert):
    """The write chains of every half as one batched walk (``write_reference.walk_chain`` over stacked seeds)."""
    num_reqs = jnp.full((1,), batch.req_pool_indices.shape[0], jnp.int32)
    walk = jax.vmap(write_reference.walk_chain, in_axes=(0, 0, None))
    seed_hash, seed_position = loaded.seeds()
    launch = write_reference.Launch(
        plan.write_offsets,
        plan.seed_slot_indices,
        num_reqs,
        batch.input_ids,
        batch.positions,
        loc,
        enable_chain_position_assert,
    )
    return walk(seed_hash, seed_position, launch)
