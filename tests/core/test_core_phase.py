"""The fused phase equals SGLang's launch sequence run with the public per-launch ops, byte for byte.

``_ops.fused_phase`` (the runner's path) against ``build_plans`` then ``canary_verify`` / ``canary_write`` in the
order verify K, write K, verify V, write V, on random cases: records that fail, ragged and padding rows, skipped and
duplicated slots, overflowing plans, and a ring that starts empty, part full, full or saturated.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

import kvcanary_jax as kc
from kvcanary_jax.core import _ops
from kvcanary_jax.core._plans import translate
from pallas_kernels.phase import api as phase_api
from tests.pallas_kernels.phase_cases import RING_STARTS, make_case
from tests.pallas_kernels.test_phase_kernel import VARIANTS


def _device(log, cpa, batch):
    return kc.CanaryDeviceState(
        violation_log=kc.ViolationLog(log.ring, log.write_index),
        kernel_run_counters=log.kernel_run_counters,
        slot_run_counters=log.slot_run_counters,
        enable_chain_position_assert=cpa,
        req_to_verify_expected_tokens=batch.token_ids,
    )


@functools.partial(jax.jit, static_argnames=("tags", "shape", "backend"))
def _per_launch(buffers, log, batch, cpa, sources, *, tags, shape, backend):
    b = batch
    vplan, wplan = kc.build_plans(
        b.req_pool_indices,
        b.prefix_lens,
        b.extend_lens,
        b.req_to_token,
        verify_capacity=shape.capacity,
        write_req_capacity=b.req_pool_indices.shape[0],
        swa_window_size=shape.window,
        full_to_swa_index_mapping=b.full_to_swa_index_mapping,
        req_to_verify_expected_tokens=b.token_ids,
        expected_tokens_valid_lens=b.token_ids_lens,
        kv_token_id_vs_position_offset=shape.token_offset,
    )
    loc = translate(b.out_cache_loc, b.full_to_swa_index_mapping)
    device, out = _device(log, cpa, b), []
    for buf, tag, src in zip(buffers, tags, sources, strict=True):
        common = dict(tag=tag, real_kv_sources=src, real_kv_hash_mode=shape.mode, backend=backend)
        device = kc.canary_verify(device, buf, vplan, check_expected_token=shape.token_check, **common)
        buf, device = kc.canary_write(
            device,
            buf,
            wplan,
            b.input_ids,
            b.positions,
            loc,
            expected_input_tokens=b.expected_input_ids,
            expected_input_positions=b.expected_positions,
            **common,
        )
        out.append(buf)
    return device, tuple(out), 1 - vplan.enable  # the overflows a count starting at 0 gets


@functools.partial(jax.jit, static_argnames=("tags", "shape", "backend"))
def _fused(buffers, log, batch, cpa, sources, *, tags, shape, backend):
    spec = phase_api.PhaseSpec(
        tags=tags,
        real_kv_hash_mode=shape.mode,
        verify_capacity=shape.capacity,
        window=shape.window,
        token_offset=shape.token_offset,
        full_slots=shape.num_slots,
        check_table=shape.check_table,  # valid tables: no INVALID_INPUT rows to add
        skip_bad_requests=False,
    )
    return _ops.fused_phase(
        _device(log, cpa, batch),
        buffers,
        batch,
        spec,
        real_kv_sources=sources,
        input_issues=None,
        verify_overflows=jnp.zeros((1,), jnp.int32),
        backend=backend,
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_phase_is_the_launch_sequence(name):
    # The xla path only: the kernels equal it byte for byte (tests/pallas_kernels/test_phase_kernel.py).
    shape = VARIANTS[name]
    # Valid slots only: the public ops keep SGLang's clamping of slots past the pool, which the phase skips.
    case = functools.partial(make_case, shape=shape, out_of_range=False)
    cases = [case(seed, ring_start=start) for seed, start in enumerate(RING_STARTS)]
    cases += [case(10 + seed, ring_start="empty", primed=True) for seed in range(2)]  # rows of every launch land
    cases.append(case(99, overflow=True))
    for *args, tags in cases:
        want = _per_launch(*args, tags=tags, shape=shape, backend="xla")
        chex.assert_trees_all_equal(_fused(*args, tags=tags, shape=shape, backend="xla"), want)
