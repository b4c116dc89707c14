"""In-jit checks of a batch's values: what the canary cannot check as given becomes one ``INVALID_INPUT`` row.

JAX clamps out-of-range gathers and drops out-of-range scatters without a word, so a batch whose conventions
differ from the canary's would go unchecked, or report rows that name nothing. Before the launches, every value
they index with is checked against the pool, the table and the token arrays (the rows and the FULL pool's new slots
by the lower layer's ``batch_checks`` op, one launch on GPU). A bad value is reported once per step,
as a row naming the field, the batch entry and the value, and is masked out of the launches: its row (request) is
not verified or written, its slot is skipped, so it adds no rows of its own. A request with a bad new slot writes
nothing (a partial write would trip the chain-position assert), one whose seed slot is bad starts a new chain, and
rows after one whose token span cannot be located (a negative length, or past the token arrays) are skipped with
it. Padding is never a violation. The cached positions' ``req_to_token`` values are checked by the phase that
reads them (the phase op's ``check_table``): the plan's listed entries, i.e. the first ``verify_capacity`` cached
positions, even when the verify overflows. The phase op also skips the rejected requests (``skip_bad_requests``).

An ``INVALID_INPUT`` row keeps SGLang's eight fields: ``launch_tag`` is the group's HEAD K tag, ``slot_idx`` the slot
involved (-1 if none), ``position`` the request position (-1 if none), ``stored_token`` the value received,
``expected_token`` the exclusive limit it broke (-1 if none), ``stored_chain_hash`` the batch entry (row or token
index), ``expected_aux`` the request row (-1 if unknown), and ``fail_reason_bits`` is
``INVALID_INPUT | field << 32 | problem << 40`` (:class:`InputField`, :class:`InputProblem`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvcanary_jax.core import _ops, _ring
from kvcanary_jax.core._state import CanaryDeviceState
from pallas_kernels.batch_checks import api as batch_checks
from pallas_kernels.phase import api as phase_api


@dataclasses.dataclass(frozen=True)
class Issues:
    """Parallel i32[n] arrays, one entry per checked value; ``problem == 0`` where the value is fine."""

    problem: jax.Array
    field: jax.Array
    value: jax.Array
    limit: jax.Array
    slot: jax.Array
    position: jax.Array
    entry: jax.Array
    request: jax.Array

    @classmethod
    def of(cls, problem, field, value, *, limit=-1, slot=-1, position=-1, entry=-1, request=-1) -> Issues:
        """Broadcasts every field to ``problem``'s shape."""
        full = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), problem.shape)  # noqa: E731
        return cls(*(full(x) for x in (problem, field, value, limit, slot, position, entry, request)))

    @classmethod
    def unstacked(cls, issues: jax.Array) -> Issues:
        """From an i32[8, n] array of candidates (rows ``phase.api.INPUT_ISSUE_FIELDS``), :meth:`stacked`'s."""
        return cls(*(issues[f] for f in range(len(phase_api.INPUT_ISSUE_FIELDS))))

    @staticmethod
    def concat(parts: list[Issues]) -> Issues:
        return Issues(*(jnp.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Issues)))

    def stacked(self) -> jax.Array:
        """i32[8, n]: the fields as the fused phase's ``input_issues`` (rows ``phase.api.INPUT_ISSUE_FIELDS``)."""
        return jnp.stack([getattr(self, name) for name in phase_api.INPUT_ISSUE_FIELDS])

    def append(self, device: CanaryDeviceState, tag: int) -> CanaryDeviceState:
        """``device`` with a row tagged ``tag`` appended per flagged candidate, in order (no counter moves)."""

        def build_rows(entry):
            at = {f.name: getattr(self, f.name)[entry] for f in dataclasses.fields(Issues)}
            rows = _ring.pack_row(phase_api.input_row(tag, **at))
            return rows, _ring.context(at["request"], at["position"], at["entry"])

        log = _ops.append(device.violation_log, self.problem != 0, build_rows)
        return dataclasses.replace(device, violation_log=log)


def check_rows(
    batch,
    *,
    padding: str,
    table_rows: int,
    context_len: int,
    num_slots: int,
    token_ids_width: int | None,
    swa_num_slots: int | None,
    backend: str,
) -> batch_checks.Checked:
    """Checks each batch row (its request row, its lengths, its tokens' span) and each request token's new slot;
    says which rows are requests (``pallas_kernels.batch_checks``: one Triton launch on GPU, jnp elsewhere).

    Args:
      batch: the :class:`CanaryBatch` (jax arrays).
      padding: the pool's convention: ``"negative"`` (rows < 0 are padding), ``"reserved"`` (row 0 is padding) or
        ``"none"`` (no padding rows).
      table_rows, context_len: ``req_to_token``'s shape.
      num_slots: the FULL pool's slots.
      token_ids_width: the expected-token pool's width when the verify-token assert is on, else None.
      swa_num_slots: the SWA group's slots (its candidates: ``swa_issues``), or None without an SWA group.
      backend: the canary's backend; the op has no Mosaic kernel, so on TPU it runs its jnp reference.

    Returns:
      The op's :class:`~pallas_kernels.batch_checks.reference.Checked`, which the runner carries through the step:
      the rows' roles (``active``, ``span_lens``, ``span_starts``, ``token_rows``) and ``issues``, the FULL group's
      ``INVALID_INPUT`` candidates (and ``swa_issues``, the SWA group's).
    """
    return batch_checks.check(
        batch.req_pool_indices,
        batch.prefix_lens,
        batch.extend_lens,
        batch.out_cache_loc,
        None if token_ids_width is None else batch.token_ids_lens,
        padding=padding,
        table_rows=table_rows,
        context_len=context_len,
        num_slots=num_slots,
        token_ids_width=token_ids_width,
        full_to_swa_index_mapping=None if swa_num_slots is None else batch.full_to_swa_index_mapping,
        swa_num_slots=swa_num_slots,
        backend={"interpret_tpu": "xla", "pallas": "auto"}.get(backend, backend),
    )
