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

from kvcanary_jax.core import _ring
from kvcanary_jax.core._state import CanaryDeviceState
from pallas_kernels import ring
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
            rows = ring.pack_row(phase_api.input_row(tag, **at))
            return rows, ring.row_context(at["request"], at["position"], at["entry"])

        log = _ring.append(device.violation_log, self.problem != 0, build_rows)
        return dataclasses.replace(device, violation_log=log)
