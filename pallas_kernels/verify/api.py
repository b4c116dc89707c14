"""``verify``: per-entry fail bits of a verify plan, on the chosen backend."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels import backend as backends
from pallas_kernels import kernel_io, realkv
from pallas_kernels.verify import pallas_triton, reference


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
    Backends ``"pallas"`` and ``"interpret"`` run the fused kernel of ``pallas_triton`` (natively, or in Pallas
    interpret mode); ``"xla"`` runs the pure-jnp reference. Both give identical bits.

    Raises:
      NotImplementedError: ``"pallas"`` off-GPU, or a Pallas backend with a KV dtype it cannot read as words.
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
    for i, src in enumerate(kwargs["real_kv_sources"]):
        kernel_io.check_kv_dtype(src.data.dtype, f"real_kv_sources[{i}].data")
    return pallas_triton.verify_bits(
        canary_buf,
        slot_indices,
        expected_tokens,
        expected_positions,
        prev_slot_indices,
        num_active,
        **kwargs,
        interpret=name == "interpret",
    )
