"""``verify``: per-entry fail bits of a verify plan, on the chosen backend."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import backend as backends
from pallas_kernels import layout, mesh, realkv, validate
from pallas_kernels.verify import pallas_mosaic, pallas_triton, reference


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
    ``"xla"`` runs the pure-jnp reference; ``"pallas"`` the fused kernel of ``pallas_triton`` on GPU or of
    ``pallas_mosaic`` on TPU, chosen by the platform lowered for; ``"interpret"`` / ``"interpret_tpu"`` run
    those kernels interpreted, anywhere; ``"auto"`` is ``"pallas"`` on GPU and TPU, else ``"xla"``. All give
    identical bits. Inputs typed with an explicit mesh sharding (e.g. a KV pool sharded over devices) are read in
    place by ``"xla"``, which ``"auto"`` then picks on every platform.

    Raises:
      ValueError, TypeError: for a wrong shape, dtype or static argument (backend name included), naming it.
      NotImplementedError: ``"pallas"`` lowered for a platform other than GPU or TPU; a kernel backend given
        inputs with an explicit mesh sharding.
    """
    entries = {
        "slot_indices": slot_indices,
        "expected_tokens": expected_tokens,
        "expected_positions": expected_positions,
        "prev_slot_indices": prev_slot_indices,
    }
    num_slots = validate.canary_buffer(canary_buf)
    for arg, x in entries.items():
        validate.array(arg, x, dtype=jnp.int32, ndim=1)
    validate.same_length(entries)
    validate.array("num_active", num_active, dtype=jnp.int32, shape=())
    sources = realkv.validate_sources(real_kv_sources, num_slots=num_slots)
    validate.static_int("real_kv_hash_mode", real_kv_hash_mode, maximum=layout.REAL_KV_ALL + 1)
    if not isinstance(check_expected_token, bool):
        raise TypeError(f"check_expected_token must be a static bool; got {check_expected_token!r}")
    static = dict(real_kv_hash_mode=real_kv_hash_mode, check_expected_token=check_expected_token)

    def xla(*args):
        *small, sources = args
        with mesh.context(small, sources):  # explicit mesh shardings: small inputs replicated, KV read in place
            return reference.verify_bits(*mesh.replicate(small), real_kv_sources=sources, **static)

    def triton(*args, interpret):
        return pallas_triton.verify_bits(*args[:-1], real_kv_sources=args[-1], interpret=interpret, **static)

    def mosaic(*args, interpret):
        return pallas_mosaic.verify_bits(*args[:-1], real_kv_sources=args[-1], interpret=interpret, **static)

    run = backends.dispatch(backend, xla=xla, triton=triton, mosaic=mosaic)
    return run(canary_buf, slot_indices, expected_tokens, expected_positions, prev_slot_indices, num_active, sources)
