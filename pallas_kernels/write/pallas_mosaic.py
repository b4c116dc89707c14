"""Write kernels (Pallas Mosaic, TPU): a serial chain walk per request, then a vectorised real-KV fold and store.

Two launches, as in ``pallas_triton``:
  * ``kvcanary_write_chain_mosaic``: one grid step per request walks its entries in order on the scalar core
    (``mix3`` is not associative). The token arrays stay in HBM, stacked as ``[windows, 3, 128]``; the walk DMAs
    each 128-entry window it touches into SMEM (128 i32 are 512 bytes, the smallest HBM-to-SMEM DMA), with the
    matching window of its outputs (``[windows, 5, 128]``). Windows are shared by neighbouring requests, so the
    grid is sequential ("arbitrary") and the window in SMEM is kept across requests, written back when the walk
    moves to another.
    Seeds are hashed before the launch, from the pre-launch buffer.
  * ``kvcanary_write_store_mosaic``: ``rows * 128`` entries per grid step fold their KV windows on
    ``u32[rows, 128]`` vectors and DMA their records into the aliased buffer. Only each slot's last writer
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


_INS, _OUTS = 3, 5  # window rows: token, position, loc; prev_hash lo/hi, expected lo/hi, flags
_REQUEST_FIELDS = 7  # count, start, check, seed hash lo/hi, seed position lo/hi


def _chain_kernel(
    request_ref,  # SMEM i32[R * 7]: per request count, start, check, seed hash lo/hi, seed position lo/hi (u32 bits)
    ins_hbm,  # i32[windows, 3, 128] in HBM: token, position, loc
    zeros_hbm,  # i32[windows, 5, 128] in HBM, aliased to out_hbm
    out_hbm,  # i32[windows, 5, 128] in HBM: prev_hash lo/hi, expected lo/hi (u32 bits), flags
    window_s,  # SMEM i32[8, 128]: the held window, the 3 input rows then the 5 output rows
    held_s,  # SMEM i32[1]: the window held
    sems,  # DMA semaphore[1]
):
    """Walks request ``program_id``'s entries in order; entries of no request keep the aliased zeros.

    The SMEM window stays loaded across requests (the grid is sequential): it is written back and the next one
    loaded only when the walk moves to another window, and the last one after the last request. Neighbouring
    requests mostly share windows, so a step of short requests moves each window once, not once per request. A
    window's rows are one array in HBM and in SMEM, so a move is one DMA each way and one wait.
    """
    del zeros_hbm  # only its aliased contents (out_hbm's initial zeros) matter
    sem, u32_bits = mosaic_io.semaphore(sems, 0), functools.partial(lax.bitcast_convert_type, new_dtype=jnp.int32)
    r = pl.program_id(0)
    field = lambda k: request_ref[_REQUEST_FIELDS * r + k]  # noqa: E731
    count = field(0)

    def write_back(held):
        @pl.when(held >= 0)
        def _():
            copy = pltpu.make_async_copy(window_s.at[pl.ds(_INS, _OUTS)], out_hbm.at[held], sem)
            copy.start()
            copy.wait()

    @pl.when(r == 0)
    def _init():
        held_s[0] = jnp.int32(-1)

    def step(k, carry, check):
        h, position_prev = (carry[0], carry[1]), (carry[2], carry[3])
        token, position, slot = window_s[0, k], window_s[1, k], window_s[2, k]
        live = slot >= 0
        expected, failed = reference.position_assert(position_prev, position, live, check)
        window_s[3, k], window_s[4, k] = (u32_bits(x) for x in h)
        window_s[5, k], window_s[6, k] = (u32_bits(x) for x in expected)
        window_s[7, k] = jnp.where(live, jnp.int32(_WRITTEN), 0) | jnp.where(failed, jnp.int32(_POSITION_FAILED), 0)
        h, position_prev = reference.advance(h, position_prev, token, position, live)
        return (*h, *position_prev)

    def window(w, carry, start, end, check):
        held = held_s[0]

        @pl.when(w != held)
        def _load():
            write_back(held)
            copies = [  # outputs too: the window's other entries must survive
                pltpu.make_async_copy(ins_hbm.at[w], window_s.at[pl.ds(0, _INS)], sem),
                pltpu.make_async_copy(out_hbm.at[w], window_s.at[pl.ds(_INS, _OUTS)], sem),
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
        seed = tuple(lax.bitcast_convert_type(field(3 + j), jnp.uint32) for j in range(4))
        walk = functools.partial(window, start=start, end=end, check=field(2) != 0)
        lax.fori_loop(start >> _WINDOW_BITS, ((end - 1) >> _WINDOW_BITS) + 1, walk, seed)  # start, end >= 0

    @pl.when(r == pl.num_programs(0) - 1)
    def _last():
        write_back(held_s[0])


def _walk(start, count, seed_hash, seed_position, check, input_ids, positions, out_cache_loc, *, interpret):
    """Runs the chain kernel; returns (prev_hash u32[T, 2], expected_position u32[T, 2], flags i32[T])."""
    num_tokens, num_reqs = input_ids.shape[0], start.shape[0]
    num_windows = pl.cdiv(num_tokens, _WINDOW)
    dense = functools.partial(mosaic_io.lane_dense, num_rows=num_windows)
    seeds = lax.bitcast_convert_type(jnp.stack([*seed_hash, *seed_position], axis=-1), jnp.int32)
    requests = jnp.concatenate([jnp.stack([count, start, check], axis=-1).astype(jnp.int32), seeds], axis=-1)
    ins = jnp.stack([dense(input_ids), dense(positions), dense(out_cache_loc)], axis=1)
    zeros = jnp.zeros((num_windows, _OUTS, _WINDOW), jnp.int32)
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_reqs,),
        in_specs=[in_hbm] * 2,
        out_specs=in_hbm,
        scratch_shapes=[
            pltpu.SMEM((_INS + _OUTS, _WINDOW), jnp.int32),
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
    words = jnp.swapaxes(out, 0, 1).reshape(_OUTS, -1)[:, :num_tokens]
    prev_lo, prev_hi, expected_lo, expected_hi = lax.bitcast_convert_type(words[:4], jnp.uint32)
    return hash64.join((prev_lo, prev_hi)), hash64.join((expected_lo, expected_hi)), words[4]


def _store_kernel(
    slot_ref,  # SMEM i32[1 + n]: 1 + the last stored entry (0 if none), then each entry's out_cache_loc where its
    # record is stored (written, last writer, slot in range), else -1
    entry_v_ref,  # i32[4, rows, 128]: token, position, prev_hash lo and hi (u32 bits)
    *refs,  # KV views u{8,16,32}[slots, token] in HBM..., buf in, buf out (u32[num_slots, 4, 2], aliased), scratch
    specs: tuple[realkv.RealKvSource, ...],
    mode: int,
):
    """Folds and stores the records of one block of entries into the aliased canary buffer."""
    num_sources = len(specs)
    kv_hbm, buf_hbm, rec_ref = refs[:num_sources], refs[num_sources + 1], refs[num_sources + 2]
    kv_refs = refs[num_sources + 3 : 2 * num_sources + 3]  # dtype[rows, 128, window]
    kv_t_refs = refs[2 * num_sources + 3 : 3 * num_sources + 3]  # u32[rows, window, 128]
    sems = refs[-1]  # DMA[1 + num_sources]
    windows = [mosaic_io.kv_window(s, mode) for s in specs]
    rows = entry_v_ref.shape[1]
    base = pl.program_id(0) * (rows * LANES)
    count = jnp.clip(slot_ref[0] - base, 0, rows * LANES)  # entries past the last stored one are not visited
    slot_at = lambda e: slot_ref[1 + base + e]  # noqa: E731
    rec_sem, kv_sems = mosaic_io.semaphore(sems, 0), [mosaic_io.semaphore(sems, 1 + i) for i in range(num_sources)]

    if num_sources:  # only stored entries fold: the others' (stale) columns are never written out
        mosaic_io.gather(
            count,
            slot_at,
            lambda e, slot: [
                copy
                for i in range(num_sources)
                for copy in mosaic_io.kv_copies(kv_hbm[i], windows[i], slot, kv_refs[i], e, kv_sems[i])
            ],
            lambda e: [mosaic_io.row_wait(kv_refs[i], e, kv_sems[i]) for i in range(num_sources)],
        )
        for kv_ref, kv_t_ref in zip(kv_refs, kv_t_refs, strict=True):
            mosaic_io.transpose_kv(kv_ref, kv_t_ref)
    token, position, prev_lo, prev_hi = (entry_v_ref[k] for k in range(4))
    record = (
        hash64.from_i32(token),
        hash64.from_i32(position),
        tuple(lax.bitcast_convert_type(x, jnp.uint32) for x in (prev_lo, prev_hi)),
        realkv.fold_loaded(specs, token, mode, mosaic_io.chunk_loader(kv_t_refs, windows)),
    )
    mosaic_io.store_record_columns(rec_ref, record)
    mosaic_io.gather(
        count,
        slot_at,
        lambda e, slot: [mosaic_io.record_copy(buf_hbm, slot, rec_ref, e, rec_sem, to_hbm=True)],
        lambda e: [mosaic_io.record_copy(buf_hbm, jnp.int32(0), rec_ref, e, rec_sem, to_hbm=True)],  # any slot
    )


def _store(canary_buf, entries, views, specs, *, mode, rows, interpret):
    """One store ``pallas_call`` over ``n`` entries; returns the updated (aliased) buffer."""
    loc, flag, token, position, prev_lo, prev_hi = entries
    n = loc.shape[0]
    grid = pl.cdiv(n, rows * LANES)
    end = jnp.max(jnp.where(flag != 0, jnp.arange(1, n + 1, dtype=jnp.int32), 0), initial=0, keepdims=True)
    slots = jnp.concatenate([end, jnp.where(flag != 0, loc, -1).astype(jnp.int32)])
    prev = [lax.bitcast_convert_type(x, jnp.int32) for x in (prev_lo, prev_hi)]
    windows = [mosaic_io.kv_window(s, mode) for s in specs]
    dense = functools.partial(mosaic_io.lane_dense, num_rows=grid * rows)
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(grid,),
        in_specs=[mosaic_io.stacked_block(4, rows)] + [in_hbm] * (len(views) + 1),
        out_specs=in_hbm,
        scratch_shapes=[
            pltpu.VMEM((rows, LANES, 4, 2), jnp.uint32),
            *mosaic_io.kv_scratch(rows, views, windows),
            pltpu.SemaphoreType.DMA((1 + len(views),)),
        ],
    )
    return compat.mosaic_call(
        functools.partial(_store_kernel, specs=specs, mode=mode),
        out_shape=jax.ShapeDtypeStruct(canary_buf.shape, canary_buf.dtype),
        grid_spec=grid_spec,
        name=f"kvcanary_write_store_mosaic_{rows=}",
        dimension_semantics=("parallel",),  # one writer per slot: blocks never touch the same record
        interpret=interpret,
        input_output_aliases={1 + 1 + len(views): 0},  # the canary buffer, updated in place
    )(slots, jnp.stack([dense(x) for x in (token, position, *prev)]), *views, canary_buf)


def _forward(canary_buf, walk, sources, *, mode, interpret, config):
    """The chain kernel, then the store in calls of at most ``config.max_entries_per_call`` entries."""
    out_cache_loc, input_ids, positions = walk[-1], walk[-3], walk[-2]
    num_tokens = out_cache_loc.shape[0]
    prev_hash, expected, flags = _walk(*walk, interpret=interpret)
    written = (flags & _WRITTEN) != 0
    flag = store.last_writer(out_cache_loc, written, canary_buf.shape[0]).astype(jnp.int32)
    views = [mosaic_io.kv_view(s) for s in sources]
    entries = (out_cache_loc, flag, input_ids, positions, prev_hash[:, 0], prev_hash[:, 1])
    buf = canary_buf
    for lo in range(0, num_tokens, config.max_entries_per_call):  # static split: SMEM holds one part's slots
        hi = min(num_tokens, lo + config.max_entries_per_call)
        part = tuple(x[lo:hi] for x in entries)
        buf = _store(
            buf,
            part,
            views,
            kernel_io.source_specs(sources),
            mode=mode,
            rows=config.rows,
            interpret=interpret,
        )
    return buf, prev_hash, expected, flags


write = base.entry_point(_forward, heuristic)
