"""Fused verify kernel (Pallas Mosaic, TPU): DMA-gather records and KV windows, re-hash on u32[rows, 128] tiles."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
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
        the slot ids are scalar-prefetched into SMEM (1 MiB per core on v4 and newer), 8 bytes per entry.
    """

    rows: int
    max_entries_per_call: int = 32768


def heuristic(capacity: int) -> Config:
    """Full (8, 128) tiles, fewer rows for small plans. Untuned: no TPU has run it (MOSAIC_NOTES.md)."""
    return Config(rows=max(1, min(8, pl.cdiv(capacity, LANES))))


def _verify_kernel(
    num_active_ref,  # SMEM i32[1]: active entries of this call
    slot_ref,  # SMEM i32[n]
    prev_ref,  # SMEM i32[n]
    slot_v_ref,  # i32[rows, 128]
    prev_v_ref,  # i32[rows, 128]
    token_v_ref,  # i32[rows, 128]
    position_v_ref,  # i32[rows, 128]
    buf_hbm,  # u32[num_slots, 4, 2] in HBM
    *refs,  # KV views u{8,16,32}[pages, row] in HBM..., out i32[rows, 128], then the scratch (below)
    specs: tuple[realkv.RealKvSource, ...],
    mode: int,
    check_expected_token: bool,
):
    """Fail bits of one block of entries; entries past ``num_active`` (and blocks wholly past it) get zeros."""
    num_sources = len(specs)
    kv_hbm, (out_ref, rec_ref, prev_rec_ref) = refs[:num_sources], refs[num_sources : num_sources + 3]
    kv_refs = refs[num_sources + 3 : 2 * num_sources + 3]  # dtype[rows, 128, window]
    kv_t_refs = refs[2 * num_sources + 3 : 3 * num_sources + 3]  # u32[rows, window, 128]
    sems = refs[-1]  # DMA[2 + num_sources]
    windows = [mosaic_io.kv_window(s, mode) for s in specs]
    rows, num_slots = out_ref.shape[0], buf_hbm.shape[0]
    base = pl.program_id(0) * (rows * LANES)
    count = jnp.clip(num_active_ref[0] - base, 0, rows * LANES)

    def copies(e):
        slot = records.clamp_slots(slot_ref[base + e], num_slots)
        prev = records.clamp_slots(prev_ref[base + e], num_slots)
        return [
            mosaic_io.record_copy(buf_hbm, slot, rec_ref, e, mosaic_io.semaphore(sems, 0)),
            mosaic_io.record_copy(buf_hbm, prev, prev_rec_ref, e, mosaic_io.semaphore(sems, 1)),
            *(
                copy
                for i in range(num_sources)
                for copy in mosaic_io.kv_copies(
                    kv_hbm[i], windows[i], slot, kv_refs[i], e, mosaic_io.semaphore(sems, 2 + i)
                )
            ),
        ]

    @pl.when(count == 0)
    def _skip():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.int32)

    @pl.when(count > 0)
    def _check():
        mosaic_io.gather(count, copies)  # rows past count keep stale scratch; their bits are masked below
        for kv_ref, kv_t_ref in zip(kv_refs, kv_t_refs, strict=True):
            mosaic_io.transpose_kv(kv_ref, kv_t_ref)
        slot, prev = slot_v_ref[...], prev_v_ref[...]
        bits = reference.entry_bits(
            mosaic_io.record_columns(rec_ref),
            records.record_hash(prev, mosaic_io.record_columns(prev_rec_ref)),
            prev != 0,  # prev == 0: padding/evicted predecessor, chain unknowable
            token_v_ref[...] if check_expected_token else None,
            position_v_ref[...],
            realkv.fold_loaded(specs, slot, mode, mosaic_io.chunk_loader(kv_t_refs, windows)),
            check_expected_token=check_expected_token,
        )
        live = (mosaic_io.entry_index(rows) < count) & (slot != layout.PADDING_SLOT)
        out_ref[...] = jnp.where(live, bits, 0)


def _verify_call(canary_buf, plan, num_active, views, specs, *, mode, check, rows, interpret):
    """One ``pallas_call`` over ``n`` plan entries (``num_active`` of them active)."""
    slots, tokens, positions, prevs = plan
    n, block = slots.shape[0], rows * LANES
    grid = pl.cdiv(n, block)
    windows = [mosaic_io.kv_window(s, mode) for s in specs]
    dense = functools.partial(mosaic_io.lane_dense, num_rows=grid * rows)
    blocked = pl.BlockSpec((rows, LANES), lambda b, *_: (b, 0))
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(grid,),
        in_specs=[blocked] * 4 + [in_hbm] * (1 + len(views)),
        out_specs=blocked,
        scratch_shapes=[
            pltpu.VMEM((rows, LANES, 4, 2), jnp.uint32),  # stored records
            pltpu.VMEM((rows, LANES, 4, 2), jnp.uint32),  # predecessor records
            *mosaic_io.kv_scratch(rows, views, windows),
            pltpu.SemaphoreType.DMA((2 + len(views),)),
        ],
    )
    kernel = functools.partial(_verify_kernel, specs=specs, mode=mode, check_expected_token=check)
    bits = compat.mosaic_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((grid * rows, LANES), jnp.int32),
        grid_spec=grid_spec,
        name=f"kvcanary_verify_mosaic_{rows=}",
        dimension_semantics=("parallel",),  # blocks are independent
        interpret=interpret,
    )(
        jnp.reshape(num_active, (1,)),
        slots,
        prevs,
        dense(slots),
        dense(prevs),
        dense(tokens),
        dense(positions),
        canary_buf,
        *views,
    )
    return bits.reshape(-1)[:n]


def _forward(canary_buf, plan, num_active, sources, *, mode, check, interpret, config):
    """The plan in calls of at most ``config.max_entries_per_call`` entries."""
    capacity = plan[0].shape[0]
    views = [mosaic_io.kv_view(s.data) for s in sources]
    specs = kernel_io.source_specs(sources)
    active = jnp.clip(jnp.reshape(num_active, ()).astype(jnp.int32), 0, capacity)
    parts = []
    for lo in range(0, capacity, config.max_entries_per_call):  # static split: SMEM holds one part's slot ids
        hi = min(capacity, lo + config.max_entries_per_call)
        parts.append(
            _verify_call(
                canary_buf,
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
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


verify_bits = base.entry_point(_forward, heuristic)
