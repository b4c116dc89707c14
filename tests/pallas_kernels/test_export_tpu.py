"""Exports the jitted ops for TPU on any host: ``backend="pallas"`` and ``"auto"`` lower to Mosaic custom calls.

The backend is chosen by the platform lowered for, so nothing is patched. Exporting runs the Pallas-to-Mosaic
lowering, which rejects primitives Mosaic lacks and 64-bit values in a kernel (x64 below); the Mosaic compiler
itself is part of libtpu and runs only on a TPU.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

import kvcanary_jax as kc
from pallas_kernels import compat, realkv
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api as write_api
from pallas_kernels.write import pallas_mosaic as write_mosaic

S = jax.ShapeDtypeStruct
NUM_SLOTS, CAPACITY, TOKENS, REQS = 1000, 777, 300, 9  # ragged: none is a multiple of a block


def _export(fn, *args) -> str:
    return export.export(fn, platforms=["tpu"])(*args).mlir_module()


def _assert_mosaic(text: str, *names: str) -> None:
    """One Mosaic custom call per name (a kernel name prefix), no Triton call, no XLA loop left."""
    assert text.count(f"@{compat.MOSAIC_CUSTOM_CALL_TARGET}(") == len(names)
    for name in set(names):
        assert text.count(f'kernel_name = "{name}') == names.count(name), name
    assert compat.TRITON_CUSTOM_CALL_TARGET not in text
    assert "stablehlo.while" not in text


def _sources(*dtypes):
    """Shape-only sources of the given dtypes: page sizes 1, 4, 16, 1; 64 bytes per token, read 48."""
    sources = []
    for dtype, page in zip(dtypes, (1, 4, 16, 1), strict=False):
        pages = -(-NUM_SLOTS // page)
        data = S((pages, page, 64 // jnp.dtype(dtype).itemsize), dtype)
        sources.append(realkv.RealKvSource(data, page_size=page, num_bytes_per_token=64, read_bytes=48))
    return tuple(sources)


def _verify_args(sources):
    return (S((NUM_SLOTS, 4, 2), jnp.uint32), *([S((CAPACITY,), jnp.int32)] * 4), S((), jnp.int32), sources)


def _write_args(sources, tokens=TOKENS):
    i32 = lambda n: S((n,), jnp.int32)  # noqa: E731
    buf = S((NUM_SLOTS, 4, 2), jnp.uint32)
    return (buf, i32(REQS + 1), i32(REQS), i32(1), i32(tokens), i32(tokens), i32(tokens), i32(1), sources)


def _verify(backend, mode, check=True):
    def fn(*args):
        return verify_api.verify(
            *args[:-1],
            real_kv_sources=args[-1],
            real_kv_hash_mode=mode,
            check_expected_token=check,
            backend=backend,
        )

    return jax.jit(fn)


def _write(backend, mode):
    fn = lambda *a: write_api.write(*a[:-1], real_kv_sources=a[-1], real_kv_hash_mode=mode, backend=backend)  # noqa: E731
    return jax.jit(fn, donate_argnums=0)


@pytest.mark.parametrize("backend", ["pallas", "auto"])
@pytest.mark.parametrize(
    "dtypes,mode",
    [((), 0), ((jnp.bfloat16,), 1), ((jnp.float32, jnp.int8, jnp.uint8, jnp.float8_e4m3fn), 2)],
    ids=["none", "partial", "all-4"],
)
def test_verify_lowers_to_mosaic(backend, dtypes, mode):
    _assert_mosaic(_export(_verify(backend, mode), *_verify_args(_sources(*dtypes))), "kvcanary_verify_mosaic")


@pytest.mark.parametrize("backend", ["pallas", "auto"])
def test_write_lowers_to_mosaic(backend):
    text = _export(_write(backend, 2), *_write_args(_sources(jnp.bfloat16, jnp.float8_e4m3fn)))
    _assert_mosaic(text, "kvcanary_write_chain_mosaic", "kvcanary_write_store_mosaic")


def test_large_launches_split_into_calls():
    """Slot ids are scalar-prefetched into SMEM, so a plan or launch past the per-call budget takes more calls."""
    per_call = write_mosaic.Config(rows=8).max_entries_per_call
    _assert_mosaic(
        _export(_write("pallas", 0), *_write_args((), tokens=per_call + 1)),
        "kvcanary_write_chain_mosaic",
        *["kvcanary_write_store_mosaic"] * 2,
    )
    big = (S((NUM_SLOTS, 4, 2), jnp.uint32), *([S((2 * per_call + 5,), jnp.int32)] * 4), S((), jnp.int32), ())
    _assert_mosaic(_export(_verify("pallas", 0, check=False), *big), *["kvcanary_verify_mosaic"] * 3)


def test_x64_lowers_without_64_bit_values():
    """Mosaic rejects i64 scalars (e.g. a Python-int index under x64); 8-byte sources become u32 pairs."""
    with jax.enable_x64(True):
        sources = _sources(jnp.int64, jnp.float64)
        _assert_mosaic(_export(_verify("pallas", 2), *_verify_args(sources)), "kvcanary_verify_mosaic")
        text = _export(_write("pallas", 1), *_write_args(sources))
        _assert_mosaic(text, "kvcanary_write_chain_mosaic", "kvcanary_write_store_mosaic")


def test_pallas_lowered_for_cpu_raises():
    with pytest.raises(NotImplementedError, match=r"backend='pallas'.*lowered for 'cpu'"):
        export.export(_verify("pallas", 0), platforms=["cpu"])(*_verify_args(()))


def test_canary_step_lowers_to_mosaic():
    """Plans, verify and write of the upper layer around the kernels: only Mosaic calls, no XLA loop."""
    config = kc.CanaryConfig(ring_capacity=64, enable_verify_token_assert=True)
    state = kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=16, max_context_len=64)
    state = jax.tree.map(lambda x: S(x.shape, x.dtype), state)
    sources = _sources(jnp.bfloat16, jnp.uint8)
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731

    def step(state, buf, req_pool_indices, prefix_lens, extend_lens, req_to_token, ids, positions, loc, sources):
        vplan, wplan = kc.build_plans(
            req_pool_indices,
            prefix_lens,
            extend_lens,
            req_to_token,
            verify_capacity=CAPACITY,
            write_req_capacity=REQS,
            req_to_verify_expected_tokens=state.req_to_verify_expected_tokens,
            expected_tokens_valid_lens=prefix_lens + extend_lens,
        )
        tag, kv = kc.CanaryLaunchTag.TAIL_K_FULL, dict(real_kv_sources=sources, real_kv_hash_mode="all")
        state = kc.canary_verify(state, buf, vplan, tag=tag, **kv, check_expected_token=True, backend="pallas")
        return kc.canary_write(state, buf, wplan, ids, positions, loc, tag=tag, **kv, backend="pallas")

    args = (state, S((NUM_SLOTS, 4, 2), jnp.uint32), *([i32(REQS)] * 3), i32(16, 64), *([i32(TOKENS)] * 3), sources)
    text = _export(jax.jit(step, donate_argnums=(0, 1)), *args)
    _assert_mosaic(text, "kvcanary_verify_mosaic", "kvcanary_write_chain_mosaic", "kvcanary_write_store_mosaic")
