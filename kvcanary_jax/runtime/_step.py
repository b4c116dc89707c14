"""What runs in a wrapped step: the batch checks, the expected-token scatter and each group's phase.

:class:`~kvcanary_jax.runtime._canary.KvCanary` is the public face; these functions are its launches, each a pure
function of the canary's static settings (its config and pool) and the step's arrays.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvcanary_jax.core import _ops
from kvcanary_jax.core._config import CanaryConfig
from kvcanary_jax.core._constants import Phase
from kvcanary_jax.runtime import _pool
from kvcanary_jax.runtime._batch import CanaryState
from pallas_kernels.batch_checks import api as batch_checks
from pallas_kernels.phase import api as phase_api


def forward_phase(
    config: CanaryConfig,
    pool: _pool.CanaryPool,
    state: CanaryState,
    batch: phase_api.ValidBatch,
    rows: batch_checks.Checked | None,
    g: _pool.Group,
    phase: Phase,
    sources: _pool.KvSources,
) -> CanaryState:
    """A HEAD or TAIL phase of group ``g``: verify each half's cached slots, then write this step's records.

    Its effects are SGLang's launch sequence (verify K, write K, verify V, write V), after the HEAD's
    ``INVALID_INPUT`` rows (the batch checks' of this group, then the table's), through the lower layer's
    ``phase`` op on every backend. It skips the requests the checks reject (``skip_bad_requests``) and counts
    the HEAD's verify overflow. Without ``rows`` (:func:`rows`), the phase runs the batch checks itself.
    """
    head = phase is Phase.HEAD
    tokens = state.device.req_to_verify_expected_tokens if config.enable_verify_token_assert else None
    phase_batch = dataclasses.replace(  # the config's choices and the checks' roles; the rest as given
        batch,
        full_to_swa_index_mapping=batch.full_to_swa_index_mapping if g.window else None,
        expected_input_ids=batch.expected_input_ids if config.enable_write_input_assert else None,
        token_ids=tokens,
        token_ids_lens=None if tokens is None else jnp.clip(batch.token_ids_lens, 0, tokens.shape[1]),
        active=None if rows is None else rows.active,
        span_lens=None if rows is None else rows.span_lens,
    )
    if rows is None:
        issues, checks = None, phase_api.BatchChecks(pool.padding, report=head)
    else:
        issues, checks = (rows.swa_issues if g.window else rows.issues) if head else None, None
    buffers = state.buffers(g)
    device, new_buffers, overflows = _ops.fused_phase(
        state.device,
        tuple(buffers.buffer(phase, h) for h in _pool.halves(pool)),
        phase_batch,
        phase_spec(config, pool, g, phase),
        real_kv_sources=tuple(sources.get(g, h) for h in _pool.halves(pool)),
        input_issues=issues,
        batch_checks=checks,
        # Only the HEAD phase counts overflows: the TAIL phase rebuilds the identical plan.
        verify_overflows=state.verify_overflows if head else None,
        backend=config.backend,
    )
    for h, buf in zip(_pool.halves(pool), new_buffers, strict=True):
        buffers = buffers.with_buffer(phase, h, buf)
    overflows = overflows if head else state.verify_overflows
    return dataclasses.replace(state, device=device, verify_overflows=overflows, **{g.name: buffers})


def phase_spec(config: CanaryConfig, pool: _pool.CanaryPool, g: _pool.Group, phase: Phase) -> phase_api.PhaseSpec:
    """The static arguments of group ``g``'s ``phase``: the HEAD checks the table; rejected requests are skipped
    (the batch checks report them)."""
    return phase_api.PhaseSpec(
        tags=tuple(int(g.tag(phase, h)) for h in _pool.halves(pool)),
        real_kv_hash_mode=int(config.real_kv_hash_mode),
        verify_capacity=g.verify_capacity,
        window=g.window,
        token_offset=pool.kv_token_id_vs_position_offset,
        full_slots=pool.num_slots,
        check_table=phase is Phase.HEAD,
        skip_bad_requests=True,
    )


def rows(
    config: CanaryConfig, pool: _pool.CanaryPool, state: CanaryState, batch: phase_api.ValidBatch
) -> batch_checks.Checked | None:
    """The batch checks (the lower layer's ``batch_checks`` op; :mod:`._inputs` says what they check): the rows'
    roles and each group's ``INVALID_INPUT`` candidates. The op has no Mosaic kernel: on TPU it runs its jnp
    reference. None when no step launch but the phases needs them (one FULL group, no verify-token assert): each
    phase then runs them itself (on GPU inside its launches, so the step has no launch of its own for them)."""
    if pool.swa is None and not config.enable_verify_token_assert:
        return None
    width = state.device.req_to_verify_expected_tokens.shape[1] if config.enable_verify_token_assert else None
    swa, backend = pool.swa, config.backend
    return batch_checks.check(
        batch.req_pool_indices,
        batch.prefix_lens,
        batch.extend_lens,
        batch.out_cache_loc,
        None if width is None else batch.token_ids_lens,
        padding=pool.padding,
        table_rows=batch.req_to_token.shape[0],
        context_len=batch.req_to_token.shape[1],
        num_slots=pool.num_slots,
        token_ids_width=width,
        full_to_swa_index_mapping=None if swa is None else batch.full_to_swa_index_mapping,
        swa_num_slots=None if swa is None else swa.num_slots,
        backend={"interpret_tpu": "xla", "pallas": "auto"}.get(backend, backend),
    )


def update_expected_tokens(
    config: CanaryConfig, state: CanaryState, batch: phase_api.ValidBatch, rows: batch_checks.Checked
) -> CanaryState:
    """Scatters the batched requests' token history into the expected-token pool (SGLang's snapshot scatter)."""
    if not config.enable_verify_token_assert:
        return state
    pool_tokens = state.device.req_to_verify_expected_tokens
    # Rows that are not requests (padding, or rejected by the checks) go to an index past the pool: dropped.
    target = jnp.where(rows.active != 0, batch.req_pool_indices, pool_tokens.shape[0])
    source = batch.token_ids[jnp.clip(batch.req_pool_indices, 0, batch.token_ids.shape[0] - 1)]
    pool_tokens = pool_tokens.at[target].set(source, mode="drop")
    device = dataclasses.replace(state.device, req_to_verify_expected_tokens=pool_tokens)
    return dataclasses.replace(state, device=device)
