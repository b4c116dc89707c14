"""``verify``: per-entry fail bits of a verify plan, on the chosen backend."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels import backend as backends
from pallas_kernels import realkv
from pallas_kernels.verify import reference


def verify(
    canary_buf: jax.Array,
    slot_indices: jax.Array,
    expected_tokens: jax.Array,
    expected_positions: jax.Array,
    prev_slot_indices: jax.Array,
    num_active: jax.Array,
    *,
    real_kv_sources: Sequence[realkv.RealKvSource] = (),
    real_kv_hash_mode: int = 0,
    check_expected_token: bool = False,
    backend: str = "auto",
) -> jax.Array:
    """Returns i32[capacity] fail bits (0 = clean) for the first ``num_active`` plan entries.

    Shapes: ``canary_buf`` u32[num_slots, 4, 2]; plan arrays i32[capacity]; ``num_active`` i32[].
    """
    name = backends.resolve(backend)
    kwargs = dict(
        real_kv_sources=tuple(real_kv_sources),
        real_kv_hash_mode=real_kv_hash_mode,
        check_expected_token=check_expected_token,
    )
    if name == "xla":
        return reference.verify_bits(
            canary_buf, slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_active, **kwargs
        )
    raise NotImplementedError(f"backend={name!r} verify kernel is not available yet; use backend='xla'")
