"""Fused verify kernel (Pallas Mosaic, TPU): DMA-gather records and KV windows, re-hash on u32[rows, 128] tiles."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat, kernel_io, layout, mosaic_io, realkv, records
from pallas_kernels.verify import base, reference

LANES = mosaic_io.LANES


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shape.

    Attributes:
      rows: sublane rows per grid step; a step checks ``rows * 128`` entries on ``u32[rows, 128]`` vectors.
      max_entries_per_call: plan entries per ``pallas_call``; a larger plan is split into several calls, because
        the slot ids are scalar-prefetched into SMEM (1 MiB per core on v4 and newer), 12 bytes per entry.
    """

    rows: int
    max_entries_per_call: int = 32768


def heuristic(capacity: int) -> Config:
    """Full (8, 128) tiles, fewer rows for small plans. Untuned: no TPU has run it (MOSAIC_NOTES.md)."""
    return Config(rows=max(1, min(8, pl.cdiv(capacity, LANES))))


def _verify_kernel(
    scalars_ref,  # SMEM i32[1 + 3n]: active entries of this call; slots, predecessor slots, mosaic_io.runs
    plan_v_ref,  # i32[4, rows, 128]: slot, predecessor slot, expected token, expected position
    *refs,  # per buffer: its records u32[num_slots, 4, 2] in HBM; then every buffer's KV views u{8,16,32}[slots,
    # token] in HBM; out i32[buffers, rows, 128]; then the scratch (below)
    specs: tuple[tuple[realkv.RealKvSource, ...], ...],
    mode: int,
    check_expected_token: bool,
):
    """Fail bits of one block of entries in each buffer; entries past ``num_active`` (and blocks wholly past it)
    get zeros.

    The buffers (K and V) share the plan, so each entry's records land in one row of one scratch (stored records
    at parts ``0 .. H-1``, predecessors at ``H .. 2H-1``). Records and KV windows of consecutive slots (a
    request's tokens in a page) are fetched by runs (:func:`mosaic_io.fetch_runs`), and all are waited for at once.
    A predecessor that is the previous entry's slot (a request's chain, lane ``e - 1`` of the same row) is not
    fetched: its record is the previous lane's stored one, rolled into place.
    """
    num_buffers, flat = len(specs), [s for half in specs for s in half]
    bufs_hbm, rest = refs[:num_buffers], refs[num_buffers:]
    kv_hbm, rest = rest[: len(flat)], rest[len(flat) :]
    out_ref, rec_ref, rest = rest[0], rest[1], rest[2:]
    kv_refs, kv_t_refs, sems = rest[: len(flat)], rest[len(flat) : 2 * len(flat)], rest[-1]  # sems: DMA[1 + sources]
    windows = [mosaic_io.kv_window(s, mode) for s in flat]
    rows, num_slots, n = out_ref.shape[1], bufs_hbm[0].shape[0], (scalars_ref.shape[0] - 1) // 3
    base = pl.program_id(0) * (rows * LANES)
    count = jnp.clip(scalars_ref[0] - base, 0, rows * LANES)
    slot_at, prev_at, run_at = (lambda e, k=k: scalars_ref[1 + k * n + base + e] for k in range(3))
    rec_sem, kv_sems = mosaic_io.semaphore(sems, 0), [mosaic_io.semaphore(sems, 1 + i) for i in range(len(flat))]

    def piece_start(e, slot, size):  # entries e .. e + size - 1: consecutive slots, records and KV windows
        for h, buf in enumerate(bufs_hbm):
            mosaic_io.record_copy(buf, slot, rec_ref, e, rec_sem, part=h, count=size).start()
        for i in range(len(flat)):
            for copy in mosaic_io.kv_copies(kv_hbm[i], windows[i], slot, kv_refs[i], e, kv_sems[i], count=size):
                copy.start()

    def predecessor_start(e):
        prev = records.clamp_slots(prev_at(e), num_slots)
        for h, buf in enumerate(bufs_hbm):
            mosaic_io.record_copy(buf, prev, rec_ref, e, rec_sem, part=num_buffers + h).start()

    @pl.when(count == 0)
    def _skip():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.int32)

    @pl.when(count > 0)
    def _check():
        read = lambda e: (run_at(e), records.clamp_slots(slot_at(e), num_slots))  # noqa: E731
        fetched = mosaic_io.fetch_runs(count, read, piece_start, predecessor_start)
        # rows past count keep stale scratch; their bits are masked below
        mosaic_io.wait_entries(rec_ref, count, rec_sem, parts=(0, num_buffers))
        mosaic_io.wait_entries(rec_ref, fetched, rec_sem, parts=(num_buffers, num_buffers))
        for kv_ref, sem in zip(kv_refs, kv_sems, strict=True):
            mosaic_io.wait_entries(kv_ref, count, sem)
        for kv_ref, kv_t_ref in zip(kv_refs, kv_t_refs, strict=True):
            mosaic_io.transpose_kv(kv_ref, kv_t_ref)
        slot, prev, token, position = (plan_v_ref[k] for k in range(4))
        lane, one = lax.broadcasted_iota(jnp.int32, slot.shape, 1), jnp.int32(1)  # i32: Mosaic rejects an i64 shift
        reused = (lane != 0) & (prev == pltpu.roll(slot, one, 1))  # jnp.roll's direction
        live = (mosaic_io.entry_index(rows) < count) & (slot != layout.PADDING_SLOT)
        first = 0
        for h, half in enumerate(specs):
            sources = slice(first, first + len(half))
            first += len(half)
            stored = mosaic_io.record_columns(rec_ref, h)
            predecessor = tuple(
                tuple(jnp.where(reused, pltpu.roll(mine, one, 1), theirs) for mine, theirs in zip(f, g, strict=True))
                for f, g in zip(stored, mosaic_io.record_columns(rec_ref, num_buffers + h), strict=True)
            )
            bits = reference.entry_bits(
                stored,
                records.record_hash(prev, predecessor),
                prev != 0,  # prev == 0: padding/evicted predecessor, chain unknowable
                token if check_expected_token else None,
                position,
                realkv.fold_loaded(half, slot, mode, mosaic_io.chunk_loader(kv_t_refs[sources], windows[sources])),
                check_expected_token=check_expected_token,
            )
            out_ref[h] = jnp.where(live, bits, 0)


def _verify_call(canary_bufs, plan, num_active, views, specs, *, mode, check, rows, interpret):
    """One ``pallas_call`` over ``n`` plan entries (``num_active`` of them active) of every buffer."""
    slots, tokens, positions, prevs = plan
    n, block, num_buffers, num_slots = slots.shape[0], rows * LANES, len(canary_bufs), canary_bufs[0].shape[0]
    grid = pl.cdiv(n, block)
    flat_views = [v for half in views for v in half]
    dense = functools.partial(mosaic_io.lane_dense, num_rows=grid * rows)
    grid_spec = mosaic_io.gather_grid_spec(
        rows=rows,
        num_blocks=grid,
        depth=4,
        num_buffers=num_buffers,
        record_parts=2 * num_buffers,  # per buffer: stored, predecessor
        out_specs=mosaic_io.stacked_block(num_buffers, rows),
        views=views,
        specs=specs,
        mode=mode,
    )
    kernel = functools.partial(_verify_kernel, specs=specs, mode=mode, check_expected_token=check)
    bits = compat.mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_buffers, grid * rows, LANES), jnp.int32),
        grid_spec=grid_spec,
        name=f"kvcanary_verify_mosaic_{rows=}",
        dimension_semantics=("parallel",),  # blocks are independent
        interpret=interpret,
    )(
        jnp.concatenate([jnp.reshape(num_active, (1,)), slots, prevs, mosaic_io.runs(slots, prevs, num_slots)]),
        jnp.stack([dense(slots), dense(prevs), dense(tokens), dense(positions)]),
        *canary_bufs,
        *flat_views,
    )
    return list(bits.reshape(num_buffers, -1)[:, :n])


def _forward_of_buffers(canary_bufs, plan, num_active, halves, *, mode, check, interpret, config):
    """The plan in calls of at most ``config.max_entries_per_call`` entries, each checking every buffer."""
    capacity = plan[0].shape[0]
    views = [[mosaic_io.kv_view(s) for s in half] for half in halves]
    specs = tuple(kernel_io.source_specs(half) for half in halves)
    active = jnp.clip(jnp.reshape(num_active, ()).astype(jnp.int32), 0, capacity)
    parts = []
    for lo in range(0, capacity, config.max_entries_per_call):  # static split: SMEM holds one part's slot ids
        hi = min(capacity, lo + config.max_entries_per_call)
        parts.append(
            _verify_call(
                tuple(canary_bufs),
                [x[lo:hi] for x in plan],
                jnp.clip(active - lo, 0, hi - lo),
                views,
                specs,
                mode=mode,
                check=check,
                rows=config.rows,
                interpret=interpret,
            )
        )
    return [jnp.concatenate(p) if len(p) > 1 else p[0] for p in zip(*parts, strict=True)]


def _forward(canary_buf, plan, num_active, sources, *, mode, check, interpret, config):
    """One buffer's bits: :func:`_forward_of_buffers` of that buffer alone."""
    (bits,) = _forward_of_buffers(
        (canary_buf,), plan, num_active, (sources,), mode=mode, check=check, interpret=interpret, config=config
    )
    return bits


verify_bits = base.entry_point(_forward, heuristic)
verify_bits_of_buffers = base.entry_point(_forward_of_buffers, heuristic, halves=True)  # a phase's K and V at once
