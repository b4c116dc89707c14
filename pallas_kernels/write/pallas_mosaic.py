"""Write kernels (Pallas Mosaic, TPU): a serial chain walk per request, then a vectorised real-KV fold and store.

Two launches, as in ``pallas_triton``, each serving every buffer that shares the tokens (a phase's K and V,
``write_of_buffers``; ``write`` is one buffer's):
  * ``kvcanary_write_chain_mosaic``: one grid step per request walks its entries in order on the scalar core
    (``mix3`` is not associative), one chain per buffer. The token arrays stay in HBM, stacked as
    ``[windows, 3, 128]``; the walk DMAs each 128-entry window it touches into SMEM (128 i32 are 512 bytes, the
    smallest HBM-to-SMEM DMA), with the matching window of its outputs (``[windows, 5 * buffers, 128]``). Windows
    are shared by neighbouring requests, so the grid is sequential ("arbitrary") and the window in SMEM is kept
    across requests, written back when the walk moves to another.
    Seeds are hashed before the launch, from the pre-launch buffers.
  * ``kvcanary_write_store_mosaic``: ``rows * 128`` entries per grid step fold their KV windows on
    ``u32[rows, 128]`` vectors and DMA their records into the aliased buffers. Only each slot's last writer
    (``store.last_writer``, a stable sort) stores, so no two DMAs of a launch hit one slot and the bytes are
    deterministic; the steps are then independent ("parallel").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, hash64, kernel_io, mosaic_io, realkv
from pallas_kernels.write import base, reference, store

LANES = mosaic_io.LANES
_WINDOW_BITS = 7  # the chain's SMEM windows hold 128 entries
_WINDOW = 1 << _WINDOW_BITS
_WRITTEN, _POSITION_FAILED = base.WRITTEN, base.POSITION_FAILED  # the chain kernel's per-entry flag bits


@dataclasses.dataclass(frozen=True)
class Config:
    """Store-kernel launch shape.

    Attributes:
      rows: sublane rows per grid step; a step folds and stores ``rows * 128`` entries on ``u32[rows, 128]``.
      max_entries_per_call: tokens per store ``pallas_call``; more are split into several calls, because each
        call scalar-prefetches the slots it stores into SMEM (1 MiB per core on v4 and newer), 4 bytes each.
    """

    rows: int
    max_entries_per_call: int = 32768


def heuristic(num_tokens: int) -> Config:
    """Full (8, 128) tiles, fewer rows for small launches. Untuned: no TPU has run it (MOSAIC_NOTES.md)."""
    return Config(rows=max(1, min(8, pl.cdiv(num_tokens, LANES))))


_INS, _OUTS = 3, 5  # window rows: token, position, loc; per buffer prev_hash lo/hi, expected lo/hi, flags
_SHARED_FIELDS, _SEED_FIELDS = 3, 4  # per request: count, start, check; per buffer seed hash lo/hi, position lo/hi


def _chain_kernel(
    request_ref,  # SMEM i32[R * (3 + 4H)]: per request count, start, check, per buffer its seed (u32 bits)
    ins_hbm,  # i32[windows, 3, 128] in HBM: token, position, loc
    zeros_hbm,  # i32[windows, 5H, 128] in HBM, aliased to out_hbm
    out_hbm,  # i32[windows, 5H, 128] in HBM: per buffer prev_hash lo/hi, expected lo/hi (u32 bits), flags
    window_s,  # SMEM i32[3 + 5H, 128]: the held window, the 3 input rows then the output rows
    held_s,  # SMEM i32[1]: the window held
    sems,  # DMA semaphore[1]
):
    """Walks request ``program_id``'s entries in order, one chain per buffer (``H`` buffers share the tokens, each
    has its own seeds); entries of no request keep the aliased zeros.

    The SMEM window stays loaded across requests (the grid is sequential): it is written back and the next one
    loaded only when the walk moves to another window, and the last one after the last request. Neighbouring
    requests mostly share windows, so a step of short requests moves each window once, not once per request. A
    window's rows are one array in HBM and in SMEM, so a move is one DMA each way and one wait.
    """
    del zeros_hbm  # only its aliased contents (out_hbm's initial zeros) matter
    sem, u32_bits = mosaic_io.semaphore(sems, 0), functools.partial(lax.bitcast_convert_type, new_dtype=jnp.int32)
    num_buffers, r = (window_s.shape[0] - _INS) // _OUTS, pl.program_id(0)
    field = lambda k: request_ref[(_SHARED_FIELDS + _SEED_FIELDS * num_buffers) * r + k]  # noqa: E731
    count = field(0)

    def write_back(held):
        @pl.when(held >= 0)
        def _():
            copy = pltpu.make_async_copy(window_s.at[pl.ds(_INS, _OUTS * num_buffers)], out_hbm.at[held], sem)
            copy.start()
            copy.wait()

    @pl.when(r == 0)
    def _init():
        held_s[0] = jnp.int32(-1)

    def step(k, carry, check):
        token, position, slot = window_s[0, k], window_s[1, k], window_s[2, k]
        live, out = slot >= 0, []
        for b in range(num_buffers):
            row, state = _INS + _OUTS * b, carry[_SEED_FIELDS * b : _SEED_FIELDS * (b + 1)]
            h, position_prev = state[:2], state[2:]
            expected, failed = reference.position_assert(position_prev, position, live, check)
            window_s[row, k], window_s[row + 1, k] = (u32_bits(x) for x in h)
            window_s[row + 2, k], window_s[row + 3, k] = (u32_bits(x) for x in expected)
            flags = jnp.where(live, jnp.int32(_WRITTEN), 0) | jnp.where(failed, jnp.int32(_POSITION_FAILED), 0)
            window_s[row + 4, k] = flags
            h, position_prev = reference.advance(h, position_prev, token, position, live)
            out += [*h, *position_prev]
        return tuple(out)

    def window(w, carry, start, end, check):
        held = held_s[0]

        @pl.when(w != held)
        def _load():
            write_back(held)
            copies = [  # outputs too: the window's other entries must survive
                pltpu.make_async_copy(ins_hbm.at[w], window_s.at[pl.ds(0, _INS)], sem),
                pltpu.make_async_copy(out_hbm.at[w], window_s.at[pl.ds(_INS, _OUTS * num_buffers)], sem),
            ]
            for copy in copies:
                copy.start()
            pltpu.make_async_copy(window_s, window_s, sem).wait()  # both: the whole window's size
            held_s[0] = w

        first = w << _WINDOW_BITS
        walk = functools.partial(step, check=check)
        return lax.fori_loop(jnp.maximum(start - first, 0), jnp.minimum(end - first, _WINDOW), walk, carry)

    @pl.when(count > 0)
    def _walk():
        start = field(1)
        end = start + count
        seeds = range(_SHARED_FIELDS, _SHARED_FIELDS + _SEED_FIELDS * num_buffers)
        seed = tuple(lax.bitcast_convert_type(field(k), jnp.uint32) for k in seeds)
        walk = functools.partial(window, start=start, end=end, check=field(2) != 0)
        lax.fori_loop(start >> _WINDOW_BITS, ((end - 1) >> _WINDOW_BITS) + 1, walk, seed)  # start, end >= 0

    @pl.when(r == pl.num_programs(0) - 1)
    def _last():
        write_back(held_s[0])


def _walk(start, count, seed_hashes, seed_positions, check, input_ids, positions, out_cache_loc, *, interpret):
    """Runs the chain kernel over every buffer's seeds; returns per buffer (prev_hash u32[T, 2],
    expected_position u32[T, 2], flags i32[T])."""
    num_tokens, num_reqs, num_buffers = input_ids.shape[0], start.shape[0], len(seed_hashes)
    num_windows = pl.cdiv(num_tokens, _WINDOW)
    dense = functools.partial(mosaic_io.lane_dense, num_rows=num_windows)
    seeds = [x for h, p in zip(seed_hashes, seed_positions, strict=True) for x in (*h, *p)]
    requests = jnp.concatenate(
        [
            jnp.stack([count, start, check], axis=-1).astype(jnp.int32),
            lax.bitcast_convert_type(jnp.stack(seeds, axis=-1), jnp.int32),
        ],
        axis=-1,
    )
    ins = jnp.stack([dense(input_ids), dense(positions), dense(out_cache_loc)], axis=1)
    zeros = jnp.zeros((num_windows, _OUTS * num_buffers, _WINDOW), jnp.int32)
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_reqs,),
        in_specs=[in_hbm] * 2,
        out_specs=in_hbm,
        scratch_shapes=[
            pltpu.SMEM((_INS + _OUTS * num_buffers, _WINDOW), jnp.int32),
            pltpu.SMEM((1,), jnp.int32),
            pltpu.SemaphoreType.DMA((1,)),
        ],
    )
    out = compat.mosaic_call(
        _chain_kernel,
        out_shape=jax.ShapeDtypeStruct(zeros.shape, zeros.dtype),
        grid_spec=grid_spec,
        name="kvcanary_write_chain_mosaic",
        dimension_semantics=("arbitrary",),  # requests share windows: read-modify-write in grid order
        interpret=interpret,
        # Entries of no request are never visited, and unwritten outputs are garbage (pallas_notes §9, pitfall
        # 8), so the outputs start as aliased zeros (scalar-prefetch operands count in the indices).
        input_output_aliases={1 + 1: 0},
    )(requests.reshape(-1), ins, zeros)  # 1-D: SMEM pads 2-D arrays' last dim
    words = jnp.swapaxes(out, 0, 1).reshape(num_buffers, _OUTS, -1)[:, :, :num_tokens]
    results = []
    for b in range(num_buffers):
        prev_lo, prev_hi, expected_lo, expected_hi = lax.bitcast_convert_type(words[b, :4], jnp.uint32)
        results.append((hash64.join((prev_lo, prev_hi)), hash64.join((expected_lo, expected_hi)), words[b, 4]))
    return results


def _store_kernel(
    slot_ref,  # SMEM i32[1 + n]: 1 + the last stored entry (0 if none), then each entry's out_cache_loc where its
    # record is stored (written, last writer, slot in range), else -1
    entry_v_ref,  # i32[2 + 2H, rows, 128]: token, position, per buffer its prev_hash lo and hi (u32 bits)
    *refs,  # every buffer's KV views u{8,16,32}[slots, token] in HBM...; the H buffers in, the H buffers out
    # (u32[num_slots, 4, 2], aliased); scratch
    specs: tuple[tuple[realkv.RealKvSource, ...], ...],
    mode: int,
):
    """Folds and stores the records of one block of entries into each of the ``H`` aliased canary buffers (they
    share the tokens and slots; each has its prev hashes and KV sources)."""
    num_buffers, flat = len(specs), [s for half in specs for s in half]
    kv_hbm, rest = refs[: len(flat)], refs[len(flat) + num_buffers :]
    bufs_hbm, rec_ref, rest = rest[:num_buffers], rest[num_buffers], rest[num_buffers + 1 :]
    kv_refs, kv_t_refs = rest[: len(flat)], rest[len(flat) : 2 * len(flat)]  # [rows, 128, window], transposed
    sems = rest[-1]  # DMA[1 + sources]
    windows = [mosaic_io.kv_window(s, mode) for s in flat]
    rows = entry_v_ref.shape[1]
    base = pl.program_id(0) * (rows * LANES)
    count = jnp.clip(slot_ref[0] - base, 0, rows * LANES)  # entries past the last stored one are not visited
    slot_at = lambda e: slot_ref[1 + base + e]  # noqa: E731
    rec_sem, kv_sems = mosaic_io.semaphore(sems, 0), [mosaic_io.semaphore(sems, 1 + i) for i in range(len(flat))]

    if flat:  # only stored entries fold: the others' (stale) columns are never written out
        mosaic_io.gather(
            count,
            slot_at,
            lambda e, slot: [
                copy
                for i in range(len(flat))
                for copy in mosaic_io.kv_copies(kv_hbm[i], windows[i], slot, kv_refs[i], e, kv_sems[i])
            ],
            lambda e: [mosaic_io.row_wait(kv_refs[i], e, kv_sems[i]) for i in range(len(flat))],
        )
        for kv_ref, kv_t_ref in zip(kv_refs, kv_t_refs, strict=True):
            mosaic_io.transpose_kv(kv_ref, kv_t_ref)
    token, position = entry_v_ref[0], entry_v_ref[1]
    first = 0
    for b, half in enumerate(specs):
        sources = slice(first, first + len(half))
        first += len(half)
        record = (
            hash64.from_i32(token),
            hash64.from_i32(position),
            tuple(lax.bitcast_convert_type(entry_v_ref[2 + 2 * b + j], jnp.uint32) for j in range(2)),
            realkv.fold_loaded(half, token, mode, mosaic_io.chunk_loader(kv_t_refs[sources], windows[sources])),
        )
        mosaic_io.store_record_columns(rec_ref, b, record)
    mosaic_io.gather(
        count,
        slot_at,
        lambda e, slot: [
            mosaic_io.record_copy(buf, slot, rec_ref, e, rec_sem, to_hbm=True, part=b) for b, buf in enumerate(bufs_hbm)
        ],
        lambda e: [  # any slot
            mosaic_io.record_copy(buf, jnp.int32(0), rec_ref, e, rec_sem, to_hbm=True, part=b)
            for b, buf in enumerate(bufs_hbm)
        ],
    )


def _store(canary_bufs, entries, views, specs, *, mode, rows, interpret):
    """One store ``pallas_call`` over ``n`` entries of every buffer; returns the updated (aliased) buffers."""
    loc, flag, token, position, prev_hashes = entries
    n, num_buffers = loc.shape[0], len(canary_bufs)
    grid = pl.cdiv(n, rows * LANES)
    end = jnp.max(jnp.where(flag != 0, jnp.arange(1, n + 1, dtype=jnp.int32), 0), initial=0, keepdims=True)
    slots = jnp.concatenate([end, jnp.where(flag != 0, loc, -1).astype(jnp.int32)])
    prev = [lax.bitcast_convert_type(p[:, j], jnp.int32) for p in prev_hashes for j in range(2)]
    flat_views = [v for half in views for v in half]
    dense = functools.partial(mosaic_io.lane_dense, num_rows=grid * rows)
    grid_spec = mosaic_io.gather_grid_spec(
        rows=rows,
        num_blocks=grid,
        depth=2 + 2 * num_buffers,
        num_buffers=num_buffers,
        record_parts=num_buffers,
        out_specs=[mosaic_io.HBM] * num_buffers,
        views=views,
        specs=specs,
        mode=mode,
    )
    aliases = {1 + 1 + len(flat_views) + b: b for b in range(num_buffers)}  # the canary buffers, updated in place
    return compat.mosaic_call(
        functools.partial(_store_kernel, specs=specs, mode=mode),
        out_shape=[jax.ShapeDtypeStruct(buf.shape, buf.dtype) for buf in canary_bufs],
        grid_spec=grid_spec,
        name=f"kvcanary_write_store_mosaic_{rows=}",
        dimension_semantics=("parallel",),  # one writer per slot: blocks never touch the same record
        interpret=interpret,
        input_output_aliases=aliases,
    )(slots, jnp.stack([dense(x) for x in (token, position, *prev)]), *flat_views, *canary_bufs)


def _forward_of_buffers(canary_bufs, walk, halves, *, mode, interpret, config):
    """One chain kernel for every buffer, then one store for every buffer in calls of at most
    ``config.max_entries_per_call`` entries."""
    out_cache_loc, input_ids, positions = walk[-1], walk[-3], walk[-2]
    num_tokens = out_cache_loc.shape[0]
    chains = _walk(*walk, interpret=interpret)
    written = (chains[0][2] & _WRITTEN) != 0  # the same in every buffer: the tokens' requests and slots
    flag = store.last_writer(out_cache_loc, written, canary_bufs[0].shape[0]).astype(jnp.int32)
    views = [[mosaic_io.kv_view(s) for s in half] for half in halves]
    specs = tuple(kernel_io.source_specs(half) for half in halves)
    entries = (out_cache_loc, flag, input_ids, positions, [prev_hash for prev_hash, _, _ in chains])
    bufs = list(canary_bufs)
    for lo in range(0, num_tokens, config.max_entries_per_call):  # static split: SMEM holds one part's slots
        hi = min(num_tokens, lo + config.max_entries_per_call)
        part = jax.tree.map(lambda x, lo=lo, hi=hi: x[lo:hi], entries)
        bufs = _store(bufs, part, views, specs, mode=mode, rows=config.rows, interpret=interpret)
    return bufs, *(list(x) for x in zip(*chains, strict=True))


def _forward(canary_buf, walk, sources, *, mode, interpret, config):
    """One buffer's write: :func:`_forward_of_buffers` of that buffer alone."""
    start, count, seed_hash, seed_position, *rest = walk
    bufs, *outs = _forward_of_buffers(
        (canary_buf,),
        (start, count, (seed_hash,), (seed_position,), *rest),
        (sources,),
        mode=mode,
        interpret=interpret,
        config=config,
    )
    return bufs[0], *(x[0] for x in outs)


write = base.entry_point(_forward, heuristic)
write_of_buffers = base.entry_point(_forward_of_buffers, heuristic, halves=True)  # a phase's K and V at once
