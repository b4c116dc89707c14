"""The pytrees a wrapped step threads through: ``CanaryBatch`` (what the canary sees of a step) and ``CanaryState``."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvcanary_jax.core._state import CanaryDeviceState, ViolationLog
from kvcanary_jax.runtime import _pool
from pallas_kernels.phase import api as phase_api


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CanaryBatch(phase_api.Batch):
    """One forward step as the canary sees it: static shapes, int32 arrays, request-major tokens.

    It is the lower layer's batch (``pallas_kernels.phase.api.Batch``) under its public name: the runner hands it
    to the phase op as it is, with the config's choices and the batch checks' row roles filled in.

    A batch has ``bs`` rows (requests) and ``T`` token entries. Row ``r`` owns the ``extend_lens[r]`` entries
    starting at ``sum(extend_lens[:r])``. Padding rows may sit anywhere; how they are marked is
    ``CanaryPool.padding``: ``req_pool_indices < 0`` by default (``"negative"``), or SGLang's row 0
    (``"reserved"``). Entries past ``sum(extend_lens)``, and tokens with ``out_cache_loc < 0``, are padding too.
    How the usual step shapes map onto the fields:

    ================================  ==========================  =============================
    step                              ``prefix_lens[r]``           ``extend_lens[r]``
    ================================  ==========================  =============================
    decode                            tokens already cached        1
    prefill (with a prefix-cache hit) cached prefix length (0)     prompt tokens run this step
    chunked prefill                   tokens of earlier chunks     this chunk's length
    speculative target-verify         accepted tokens cached       1 + number of draft tokens
    speculative draft-extend          accepted tokens cached       tokens the draft model runs
    ================================  ==========================  =============================

    Attributes:
      req_pool_indices: i32[bs] row of each request in ``req_to_token``; a padding row as ``CanaryPool.padding``
        says (< 0 by default; 0 with ``"reserved"``).
      prefix_lens: i32[bs] tokens of the request whose KV is already cached before this step (verified).
      extend_lens: i32[bs] tokens this step appends (written).
      req_to_token: i32[max_reqs, max_context_len] full-pool KV slot of each (request row, position), already
        holding this step's slots; slot 0 is the padding slot.
      input_ids: i32[T] token id of each new entry.
      positions: i32[T] 0-based position of each new entry in its request.
      out_cache_loc: i32[T] full-pool slot each new entry's KV goes to; < 0 skips the entry.
      full_to_swa_index_mapping: i32[num_slots + 1] full slot -> SWA slot (0 = not resident). Required with an
        SWA group, ignored otherwise.
      expected_input_ids: i32[T] what each input token should be, from an independent source (a token oracle, the
        request's history). Required when ``config.enable_write_input_assert``, ignored otherwise.
      expected_positions: i32[T] expected positions for the input assert; None = ``positions``.
      token_ids: i32[max_reqs, max_context_len] token id of each (request row, position), mirroring
        ``req_to_token``. Required when ``config.enable_verify_token_assert``, ignored otherwise.
      token_ids_lens: i32[bs] how many leading ``token_ids`` of each row are known (checks past it are skipped).
      active, span_lens: the rows' roles, which the runner sets from its batch checks; leave them None.
    """

    def __post_init__(self):
        for field in dataclasses.fields(self):
            _check_fits_int32(f"batch.{field.name}", getattr(self, field.name))


_INT32 = np.iinfo(np.int32)


def _check_fits_int32(name: str, x) -> None:
    """A host signed integer array wider than int32 must fit it: jax narrows it silently (2**32 + 5 becomes 5).
    (An unsigned array keeps an unsigned dtype, which the step refuses by name.)

    Only concrete numpy values are seen here (a jax array is int32 already, a tracer has no values); so build the
    batch on the host from the engine's arrays, before they cross a jit boundary, which narrows them unchecked.
    """
    if not isinstance(x, np.ndarray) or x.dtype.kind != "i" or np.can_cast(x.dtype, np.int32) or not x.size:
        return
    bad = np.flatnonzero((x.reshape(-1) < _INT32.min) | (x.reshape(-1) > _INT32.max))
    if bad.size:
        at = tuple(int(i) for i in np.unravel_index(bad[0], x.shape))
        raise ValueError(
            f"{name} holds {int(x[at])} at index {list(at)}, which does not fit the int32 the canary checks "
            f"({name}.dtype={x.dtype.name}; narrowing would wrap it silently): the engine's value is corrupt or not "
            "a slot/row/length"
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CanaryState:
    """All device state of one canary, threaded through the user's jitted step and donated.

    Attributes:
      device: ring, counters and flags shared by every launch (:class:`CanaryDeviceState`).
      full: FULL-group buffers (None when the canary is off).
      swa: SWA-group buffers (None without an SWA group or when off).
      verify_overflows: i32[1] per-forward verify plans that overflowed their capacity and were skipped.
      fingerprint: static (pytree metadata, seen at trace time): the config and pool of the canary that allocated
        the state, so a canary refuses a same-shaped state of another config; None in a state built by hand.
    """

    device: CanaryDeviceState
    full: _pool.GroupBuffers | None
    swa: _pool.GroupBuffers | None
    verify_overflows: jax.Array
    fingerprint: int | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def violation_log(self) -> ViolationLog:
        return self.device.violation_log

    def buffers(self, group: _pool.Group) -> _pool.GroupBuffers:
        return getattr(self, group.name)
