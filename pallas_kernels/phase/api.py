"""``phase``: one fused HEAD/TAIL phase of a canary group, on the chosen backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backends
from pallas_kernels import layout, realkv, validate
from pallas_kernels.batch_checks import api as batch_checks_api
from pallas_kernels.batch_checks import pallas_triton as batch_checks_triton
from pallas_kernels.batch_checks import reference as batch_checks_reference
from pallas_kernels.phase import common, pallas_mosaic, pallas_triton, reference

Batch = common.Batch
ValidBatch = common.ValidBatch
Log = common.Log
PhaseSpec = common.PhaseSpec
INPUT_ISSUE_FIELDS = common.INPUT_ISSUE_FIELDS  # the rows of ``input_issues``
input_row = common.input_row  # the eight fields of an INVALID_INPUT row, as the phase writes them
verify_row = common.verify_row  # ... of a verify row
write_row = common.write_row  # ... of a write row (input assert or chain position)


class BatchChecks(NamedTuple):
    """The batch checks (``batch_checks.api.check``), run by a phase itself: the rows' roles are theirs.

    Attributes:
      padding: the pool's padding rows (``batch_checks.api.PADDINGS``); the table's shape, the FULL pool's slots
        (``PhaseSpec.full_slots``, else the group's) and the batch give the rest.
      report: their ``INVALID_INPUT`` candidates are the phase's ``input_issues`` (a group's HEAD).
    """

    padding: str
    report: bool = False


def validate_batch(batch: Batch) -> ValidBatch:
    """Validates a batch's arrays (int32, ranks, matching lengths) and the fields that go together, naming the
    field; returns it as a :class:`ValidBatch` (a ValidBatch is returned as it is). The runner validates its
    batches with it once a step, at its entry; :func:`run` then takes them as they are."""
    if isinstance(batch, ValidBatch):
        return batch
    validate.instance("batch", batch, Batch, what="pallas_kernels.phase.api.Batch")
    requests = {f"batch.{n}": getattr(batch, n) for n in ("req_pool_indices", "prefix_lens", "extend_lens")}
    for name, x in requests.items():
        validate.array(name, x, dtype=jnp.int32, ndim=1)
    num_reqs = validate.same_length(requests)
    if num_reqs < 1:
        raise ValueError(f"the batch needs at least one request row; got req_pool_indices.shape={(num_reqs,)}")
    validate.array("batch.req_to_token", batch.req_to_token, dtype=jnp.int32, ndim=2)
    if 0 in batch.req_to_token.shape:  # the plans gather from it (clamping), so each axis needs an entry
        raise ValueError(
            "batch.req_to_token needs at least one row and one column; got "
            f"batch.req_to_token.shape={tuple(batch.req_to_token.shape)}"
        )
    names = ("input_ids", "positions", "out_cache_loc")
    if batch.expected_input_ids is not None:  # the input assert: its positions default to ``positions``
        names += ("expected_input_ids",) + (("expected_positions",) if batch.expected_positions is not None else ())
    tokens = {f"batch.{n}": getattr(batch, n) for n in names}
    for name, x in tokens.items():
        validate.array(name, x, dtype=jnp.int32, ndim=1)
    validate.same_length(tokens)
    if batch.full_to_swa_index_mapping is not None:
        validate.array("batch.full_to_swa_index_mapping", batch.full_to_swa_index_mapping, dtype=jnp.int32, ndim=1)
    if (batch.token_ids is None) != (batch.token_ids_lens is None):
        raise ValueError("batch.token_ids and batch.token_ids_lens turn on the verify-token check together")
    if batch.token_ids is not None:
        validate.array("batch.token_ids", batch.token_ids, dtype=jnp.int32, ndim=2)
        validate.array("batch.token_ids_lens", batch.token_ids_lens, dtype=jnp.int32, shape=(num_reqs,))
    for name in ("active", "span_lens"):
        if getattr(batch, name) is not None:
            validate.array(f"batch.{name}", getattr(batch, name), dtype=jnp.int32, shape=(num_reqs,))
    return ValidBatch(**{field.name: getattr(batch, field.name) for field in dataclasses.fields(Batch)})


def _validate_log(log: Log) -> None:
    validate.instance("log", log, Log, what="pallas_kernels.phase.api.Log")
    validate.array("log.ring", log.ring, dtype=jnp.uint32, shape=(None, layout.VIOLATION_FIELDS, 2))
    if log.ring.shape[0] < 1:
        raise ValueError(f"log.ring needs at least one row; got log.ring.shape={tuple(log.ring.shape)}")
    validate.array("log.write_index", log.write_index, dtype=jnp.int32, shape=(1,))
    validate.array("log.kernel_run_counters", log.kernel_run_counters, dtype=jnp.uint32, shape=(None, 2))
    shape = tuple(log.kernel_run_counters.shape)
    validate.array("log.slot_run_counters", log.slot_run_counters, dtype=jnp.uint32, shape=shape)
    if log.context is not None:
        validate.array("log.context", log.context, dtype=jnp.int32, shape=(log.ring.shape[0], 3))
    if log.verify_overflows is not None:
        validate.array("log.verify_overflows", log.verify_overflows, dtype=jnp.int32, shape=(1,))


def phase(
    buffers: Sequence[jax.Array],
    log: Log,
    batch: Batch,
    enable_chain_position_assert: jax.Array,
    *,
    real_kv_sources: Sequence[Sequence[realkv.RealKvSource]] | None = None,
    input_issues: jax.Array | None = None,
    batch_checks: BatchChecks | None = None,
    backend: str = "auto",
    **spec_fields,
) -> tuple[tuple[jax.Array, ...], Log, jax.Array]:
    """:func:`run` with the :class:`PhaseSpec` given by its fields as keywords (``tags=``, ``verify_capacity=``)."""
    return run(
        buffers,
        log,
        batch,
        enable_chain_position_assert,
        PhaseSpec(**spec_fields),
        real_kv_sources=real_kv_sources,
        input_issues=input_issues,
        batch_checks=batch_checks,
        backend=backend,
    )


def run(
    buffers: Sequence[jax.Array],
    log: Log,
    batch: Batch,
    enable_chain_position_assert: jax.Array,
    spec: PhaseSpec,
    *,
    real_kv_sources: Sequence[Sequence[realkv.RealKvSource]] | None = None,
    input_issues: jax.Array | None = None,
    batch_checks: BatchChecks | None = None,
    backend: str = "auto",
) -> tuple[tuple[jax.Array, ...], Log, jax.Array]:
    """One HEAD or TAIL phase of a group: plans, then per half verify K/V and write K/V, rows, counters.

    The effects equal the verify and write ops run one launch at a time in SGLang's order (verify K, write K,
    verify V, write V; ``reference.phase`` states it), on every backend, byte for byte.

    Args:
      buffers: one or two (K, then V) u32[num_slots, 4, 2] canary buffers of one group; donate them under jit.
      log: :class:`Log` (ring u32[capacity, 8, 2], write index i32[1], counters u32[num_tags, 2], optionally the
        rows' context i32[capacity, 3] and the verify-overflow count i32[1]).
      batch: :class:`Batch`, the step's i32 arrays (R requests, T tokens).
      enable_chain_position_assert: i32[1].
      spec: the static arguments (:class:`PhaseSpec`): one tag per buffer, each below the log's tag count.
      real_kv_sources: per half, up to 4 sources (None: none).
      input_issues: i32[8, n] ``INVALID_INPUT`` candidates the caller checked itself, one per column (rows
        ``INPUT_ISSUE_FIELDS``: problem, 0 for none; field; value; limit; slot; position; batch entry; request
        row), placed first, in column order, tagged ``spec.tags[0]``; None: none. (With
        ``spec.skip_bad_requests``, the caller reports the rejected slots here.)
      batch_checks: :class:`BatchChecks`: the phase runs the batch checks itself (``batch.active`` and
        ``batch.span_lens`` must be None: the checks' roles are used; with ``report``, ``input_issues`` must be
        None: the checks' candidates are used). The Triton kernels derive the roles in each program and run the
        checks' programs in the check launch, so the step has no launch of its own for them. None: not run.
      backend: ``"xla"`` (``reference``), ``"pallas"`` (the Triton kernels on GPU, ``pallas_mosaic`` on TPU),
        ``"interpret"`` / ``"interpret_tpu"`` (those, interpreted) or ``"auto"`` (``"pallas"`` on GPU and TPU,
        else ``"xla"``).

    Returns:
      ``(buffers, log, enable)``: new buffers, new log, and i32[1] 0 when the verify plan overflowed.

    Raises:
      ValueError, TypeError: for a wrong shape, dtype or static argument, naming it.
      NotImplementedError: ``"pallas"`` lowered for a platform other than GPU or TPU.
    """
    buffers = tuple(buffers) if isinstance(buffers, (tuple, list)) else buffers
    if not isinstance(buffers, tuple) or len(buffers) not in (1, 2):
        raise ValueError(f"buffers must be a tuple of one or two canary buffers (K, V); got {buffers!r:.80}")
    num_slots = {validate.canary_buffer(b, f"buffers[{h}]") for h, b in enumerate(buffers)}
    if len(num_slots) != 1:
        raise ValueError(f"the K and V buffers of a group must have the same num_slots; got {sorted(num_slots)}")
    (num_slots,) = num_slots
    _validate_log(log)
    batch = validate_batch(batch)
    validate.array("enable_chain_position_assert", enable_chain_position_assert, dtype=jnp.int32, shape=(1,))
    validate.instance("spec", spec, PhaseSpec, what="pallas_kernels.phase.api.PhaseSpec")
    if len(spec.tags) != len(buffers):
        raise ValueError(
            f"tags must hold one distinct launch tag per buffer; got {spec.tags} for {len(buffers)} buffers"
        )
    for h, tag in enumerate(spec.tags):
        validate.static_int(f"tags[{h}]", tag, maximum=log.kernel_run_counters.shape[0])
    real_kv_sources = real_kv_sources if real_kv_sources is not None else ((),) * len(buffers)
    if not isinstance(real_kv_sources, (tuple, list)) or len(real_kv_sources) != len(buffers):
        raise ValueError(f"real_kv_sources must hold one tuple of sources per buffer; got {real_kv_sources!r:.80}")
    real_kv_sources = tuple(
        realkv.validate_sources(s, num_slots=num_slots, arg=f"real_kv_sources[{h}]")
        for h, s in enumerate(real_kv_sources)
    )
    if input_issues is not None:
        validate.array("input_issues", input_issues, dtype=jnp.int32, shape=(len(INPUT_ISSUE_FIELDS), None))
        if input_issues.shape[1] == 0:
            input_issues = None
    if spec.window > 0 and batch.full_to_swa_index_mapping is None:
        raise ValueError(f"window={spec.window} needs batch.full_to_swa_index_mapping (the full->SWA LUT)")
    static = _checks_static(batch_checks, batch, input_issues, spec.full_slots or num_slots)

    def with_checks(batch, issues):
        return _with_checks(batch_checks, static, batch, issues)

    def xla(buffers, log, batch, cpa, sources, issues):
        batch, issues = with_checks(batch, issues)
        return reference.phase(buffers, log, batch, cpa, sources, issues, spec)

    def triton(buffers, log, batch, cpa, sources, issues, *, interpret):
        num_tokens = batch.out_cache_loc.shape[0]
        if batch_checks is None or num_tokens == 0:  # no token programs: the jnp checks first
            batch, issues = with_checks(batch, issues)
            return pallas_triton.phase(buffers, log, batch, cpa, sources, issues, spec=spec, interpret=interpret)
        fused = batch_checks_triton.static(batch.req_pool_indices.shape[0], num_tokens, **static)
        return pallas_triton.phase(
            buffers, log, batch, cpa, sources, issues, spec=spec, interpret=interpret, checks=fused,
            report_checks=batch_checks.report,
        )  # fmt: skip

    def mosaic(buffers, log, batch, cpa, sources, issues, *, interpret):
        batch, issues = with_checks(batch, issues)
        return pallas_mosaic.phase(buffers, log, batch, cpa, sources, issues, spec=spec, interpret=interpret)

    call = backends.dispatch(backend, xla=xla, triton=triton, mosaic=mosaic)
    return call(buffers, log, batch, enable_chain_position_assert, real_kv_sources, input_issues)


def _checks_static(batch_checks: BatchChecks | None, batch: Batch, input_issues, full_slots: int) -> dict | None:
    """The batch checks' static arguments (``batch_checks.reference.check``'s keywords), checked; None without."""
    if batch_checks is None:
        return None
    if not isinstance(batch_checks, BatchChecks):
        kind = type(batch_checks).__name__
        raise TypeError(f"batch_checks must be a pallas_kernels.phase.api.BatchChecks; got {kind}")
    for name in ("active", "span_lens"):
        if getattr(batch, name) is not None:
            raise ValueError(f"batch_checks gives the rows' roles: batch.{name} must be None")
    if batch_checks.report and input_issues is not None:
        raise ValueError("batch_checks with report=True places the checks' candidates: input_issues must be None")
    rows = (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc, None)
    table_rows, context_len = batch.req_to_token.shape
    static = batch_checks_api.Static(batch_checks.padding, table_rows, context_len, full_slots)
    return batch_checks_api.validate_arguments(rows, static)


def _with_checks(batch_checks: BatchChecks | None, static: dict | None, batch: Batch, issues):
    """(batch, issues): the batch with the checks' roles, and the issues to place (the checks' candidates when
    reported), in jnp; unchanged without checks."""
    if batch_checks is None:
        return batch, issues
    checked = batch_checks_reference.check(
        batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc, None, **static
    )
    batch = dataclasses.replace(batch, active=checked.active, span_lens=checked.span_lens)
    return batch, (checked.issues if batch_checks.report else issues)
