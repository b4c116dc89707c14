"""Fused phase kernels (Pallas Triton): one phase of a group (K and V together) in two launches.

The single ops pay ~50 small kernels per decode step (plan build, prefix sums, row gathers, appends, counter
bumps; ``benchmarks/RESULTS.md``). Here a phase is:

  * ``kvcanary_phase_check`` (``triton_check``): programs ``[0, R)`` walk one request's write chain each (K and V side
    by side; the seed records are read before any store, as the write op reads the pre-launch buffer; with
    ``skip_bad_requests`` a first pass over its slots decides whether it writes at all), programs ``[R, R + B)``
    verify one block of plan entries each, for every half. The plan is built in-kernel from the batch (request lookup,
    ``req_to_token`` gathers, window), so it is never materialised. Outputs: each verify block's flag count per half
    (and, with ``check_table``, its count of table values the pools cannot hold), each request's row count per half
    and written count, the chain's per-token results, and a stash where a block with flags writes its verify rows,
    packed, in its own region (nothing is written there by a clean block).
  * ``kvcanary_phase_ring_store`` (``triton_ring_store``), programs ``[0, B + R)``: every verify block or request with
    flags writes its rows straight into the ring at ``index + rank``; the rank is the flag counts of the launches and
    programs before it (SGLang's order: verify K, write K, verify V, write V; plan-entry order within a launch), so
    the ring is byte-identical to the single launches'. Verify rows are copied from the stash, write rows built from
    the chain's results, so no program reads a canary buffer. The ``INVALID_INPUT`` rows come first: program 0 places
    the caller's ``input_issues``, then every block with table issues places theirs (recomputed from the table). Clean
    programs only read their counts and exit. Program 0 also advances the write index and bumps the counters (and the
    verify-overflow count).
  * the same launch, the programs after those: per block of tokens, fold the real KV and store the records of both
    halves in place, with the write op's deterministic last-writer rule. Sharing the launch with the ring is safe
    because the ring reads no record; a third launch would cost a dependent launch's 3-5 us at decode sizes.

With ``checks`` (the runner's batches), the rows' roles (``active``, ``span_lens``) are not inputs: every program
that needs them derives them from the batch (``triton_common.roles``, the batch checks' own rules, carried over
the rows it scans anyway), and a HEAD's check launch also runs the batch checks' programs, whose candidates the
ring places first. The step then has no launch of its own for the checks (a dependent launch's 3-5 us).

No XLA loop, prefix sum or scatter is left in the step (only ``store.last_writer``'s sort for more than
``PAIRWISE_MAX_TOKENS`` tokens, as in the write op).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat, kernel_io, layout
from pallas_kernels.batch_checks import pallas_triton as batch_checks
from pallas_kernels.phase import common, triton_check, triton_ring_store
from pallas_kernels.phase import triton_common as tc
from pallas_kernels.write import store

Config = tc.Config
PAIRWISE_MAX_TOKENS = 512  # as the write op (write/pallas_triton.py): pairwise scan below, sort above


def heuristic(capacity: int, num_tokens: int) -> Config:
    """128 plan entries and up to 128 tokens per program on 4 warps (the verify and write ops' measured best)."""
    return Config(
        verify_block=min(128, compat.next_power_of_2(capacity)),
        store_block=min(128, compat.next_power_of_2(num_tokens)),
        dedupe="pairwise" if num_tokens <= PAIRWISE_MAX_TOKENS else "sort",
    )


# -- entry point -------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "config", "checks", "report_checks"))
def phase(
    buffers, log, batch, enable_chain_position_assert, real_kv_sources, input_issues=None, *, spec, interpret=False,
    config=None, checks=None, report_checks=False,
):  # fmt: skip
    """``reference.phase`` (the contract) in two Pallas launches (see the module docstring); ``interpret`` runs
    them in Pallas interpret mode (any platform), ``config`` is their launch shapes (``heuristic`` when None).

    ``checks`` (a ``batch_checks.pallas_triton.Static``, for a batch of at least one token): the rows' roles are
    the batch checks' of the batch, derived in every program that needs them (``batch.active`` and
    ``batch.span_lens`` are not read); with ``report_checks``, the check launch also runs the batch checks'
    programs and their candidates are ``input_issues`` (which must be None), with no launch of their own."""
    batch = common.with_roles(common.pad_tokens(batch))
    num_reqs, num_tokens = batch.req_pool_indices.shape[0], batch.input_ids.shape[0]
    group_slots = buffers[0].shape[0]
    halves = len(buffers)
    config = config or heuristic(spec.verify_capacity, num_tokens)
    sources = tuple(tuple(s) if spec.real_kv_hash_mode != layout.REAL_KV_NONE else () for s in real_kv_sources)
    num_issues = 0 if input_issues is None else input_issues.shape[1]
    if report_checks:
        num_issues = batch_checks.out_shapes(checks)[-1].shape[1]
    st = tc.Static(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        tags=spec.tags,
        specs=tuple(kernel_io.source_specs(s) for s in sources),
        mode=spec.real_kv_hash_mode,
        capacity=spec.verify_capacity,
        window=spec.window,
        token_offset=spec.token_offset,
        has_lut=batch.full_to_swa_index_mapping is not None,
        has_pool=batch.token_ids is not None,
        has_inputs=batch.expected_input_ids is not None,
        config=config,
        full_slots=spec.full_slots or group_slots,
        group_slots=group_slots,
        has_context=log.context is not None,
        check_table=spec.check_table,
        skip_bad_requests=spec.skip_bad_requests,
        num_issues=num_issues,
        count_overflows=log.verify_overflows is not None,
        checks=checks,
        run_checks=report_checks,
    )
    inputs = tc.input_arrays(batch, enable_chain_position_assert, buffers, sources, st, interpret=interpret)
    num_blocks = st.num_blocks
    i32, u32 = jnp.int32, jnp.uint32
    call = functools.partial(compat.triton_call, num_warps=config.num_warps, num_stages=config.num_stages)

    chain_outs = (
        jax.ShapeDtypeStruct((halves + 1, num_reqs), i32),  # rows per request and half; written per request
        jax.ShapeDtypeStruct((halves, num_tokens, 2), u32),  # PREV_HASH to store
        jax.ShapeDtypeStruct((halves, num_tokens, 2), u32),  # chain-position assert's expected position
        jax.ShapeDtypeStruct((halves, num_tokens), i32),  # common.FLAG_* | input-assert bits
    )
    ring_rows = log.ring.reshape(log.ring.shape[0], -1)  # u32[capacity, 16]
    stash_rows = halves * num_blocks * config.verify_block  # written only where a verify entry is flagged
    stash = (jax.ShapeDtypeStruct((stash_rows, ring_rows.shape[1]), u32),)
    if log.context is not None:
        stash += (jax.ShapeDtypeStruct((stash_rows, log.context.shape[1]), i32),)
    batch_outs = batch_checks.out_shapes(checks) if report_checks else ()
    checked = call(
        functools.partial(triton_check.kernel, st=st),
        out_shape=(
            jax.ShapeDtypeStruct((halves + spec.check_table, num_blocks), i32),
            *chain_outs,
            *stash,
            *batch_outs,
        ),
        grid=(num_reqs + num_blocks + (batch_checks.num_programs(checks) if report_checks else 0),),
        name=f"kvcanary_phase_check_block={config.verify_block}",
        interpret=interpret,
    )(*inputs)
    if report_checks:  # the batch checks' candidates: the rows' INVALID_INPUT rows, placed first
        input_issues, checked = checked[-1], checked[: len(checked) - len(batch_outs)]

    flags = checked[4]
    winner = ()
    if config.dedupe == "sort":
        loc = common.translate(batch.out_cache_loc, *common.lut_reader(batch.full_to_swa_index_mapping))
        written = (flags[0] & common.FLAG_WRITTEN) != 0
        winner = (store.last_writer(loc, written, buffers[0].shape[0]).astype(i32),)
    context = () if log.context is None else (log.context,)
    issues = () if input_issues is None else (input_issues,)
    overflows = () if log.verify_overflows is None else (log.verify_overflows,)
    rows = tuple(kernel_io.record_rows(b) for b in buffers)
    aliased = (ring_rows, *context, *rows)  # updated in place: the ring (and its context), the canary buffers
    state = (log.write_index, log.kernel_run_counters, log.slot_run_counters, *overflows)
    leading = (
        *tc.input_arrays(batch, enable_chain_position_assert, (), sources, st, interpret=interpret), *checked, *issues,
        *winner,
    )  # fmt: skip
    out_shape = (
        jax.ShapeDtypeStruct(ring_rows.shape, u32),
        *(jax.ShapeDtypeStruct(c.shape, i32) for c in context),
        jax.ShapeDtypeStruct((1,), i32),
        jax.ShapeDtypeStruct(log.kernel_run_counters.shape, u32),
        jax.ShapeDtypeStruct(log.slot_run_counters.shape, u32),
        jax.ShapeDtypeStruct((1,), i32),
        *(jax.ShapeDtypeStruct((1,), i32) for _ in overflows),
        *(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows),
    )
    first_state = len(leading) + len(aliased)
    aliases = {len(leading) + k: k for k in range(1 + len(context))}
    aliases.update({len(leading) + 1 + len(context) + h: len(out_shape) - halves + h for h in range(halves)})
    if overflows:  # only program 0 reads the count, so it may be updated in place too (no copy into the donated one)
        aliases[first_state + 3] = len(out_shape) - halves - 1
    out = call(
        functools.partial(triton_ring_store.kernel, st=st),
        out_shape=out_shape,
        grid=(num_blocks + num_reqs + pl.cdiv(num_tokens, config.store_block),),
        name=f"kvcanary_phase_ring_store_block={config.store_block}_{config.dedupe}",
        interpret=interpret,
        input_output_aliases=aliases,
    )(*leading, *aliased, *state)
    ring_rows, context, rest = out[0], out[1 : 1 + len(context)], out[1 + len(context) :]
    write_index, kernel_counters, slot_counters, enable, *rest = rest
    overflows, new_rows = rest[: len(overflows)], rest[len(overflows) :]
    new_log = common.Log(
        ring=ring_rows.reshape(log.ring.shape),
        write_index=write_index,
        kernel_run_counters=kernel_counters,
        slot_run_counters=slot_counters,
        context=context[0] if context else None,
        verify_overflows=overflows[0] if overflows else None,
    )
    return tuple(r.reshape(b.shape) for r, b in zip(new_rows, buffers, strict=True)), new_log, enable
