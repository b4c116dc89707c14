"""Cross-lowers the jitted pallas-backend ops for CUDA on any host, catching Triton lowering errors without a GPU.

Interpret mode does not check what only the Triton lowering rejects: non-power-of-2 tensors, ``reduce_or``,
uint64 constants >= 2^63, multiple indexers (pallas_notes §5). ``jax.export(..., platforms=["cuda"])`` runs that
lowering on CPU. It does not compile PTX; the GPU run (``benchmarks/gpu_validate.py``) covers the rest.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

import kvcanary_jax as kc
from pallas_kernels import compat, realkv
from pallas_kernels.batch_checks import api as batch_checks_api
from pallas_kernels.phase import api as phase_api
from pallas_kernels.phase import common as phase_common
from pallas_kernels.verify import api as verify_api
from pallas_kernels.write import api as write_api
from pallas_kernels.write import pallas_triton as write_triton

S = jax.ShapeDtypeStruct
NUM_SLOTS, CAPACITY, TOKENS, REQS = 1000, 777, 300, 9  # ragged: none is a multiple of a block


def _export(fn, *args) -> str:
    """``backend="pallas"``/``"auto"`` pick Triton because the lowering is for CUDA: nothing pretends a GPU."""
    with compat.cuda_export_target():
        exported = export.export(fn, platforms=["cuda"], disabled_checks=compat.export_disabled_checks())(*args)
    text = exported.mlir_module()
    assert compat.MOSAIC_CUSTOM_CALL_TARGET not in text  # the TPU branch is traced, but never lowered
    return text


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
    return (
        S((NUM_SLOTS, 4, 2), jnp.uint32),
        i32(REQS + 1),
        i32(REQS),
        i32(1),
        i32(tokens),
        i32(tokens),
        i32(tokens),
        i32(1),
        sources,
    )


@pytest.mark.parametrize(
    "dtypes,mode,check,backend",
    [
        ((), 0, False, "pallas"),
        ((jnp.bfloat16,), 1, True, "pallas"),
        ((jnp.float32, jnp.int8, jnp.uint8, jnp.float8_e4m3fn), 2, True, "pallas"),
        ((jnp.bfloat16,), 2, True, "auto"),
    ],
)
def test_verify_lowers(dtypes, mode, check, backend):
    def fn(buf, slots, tokens, positions, prevs, num_active, sources):
        return verify_api.verify(
            buf,
            slots,
            tokens,
            positions,
            prevs,
            num_active,
            real_kv_sources=sources,
            real_kv_hash_mode=mode,
            check_expected_token=check,
            backend=backend,
        )

    text = _export(jax.jit(fn), *_verify_args(_sources(*dtypes)))
    assert "kvcanary_verify_block" in text and compat.TRITON_CUSTOM_CALL_TARGET in text


@pytest.mark.parametrize(
    "tokens,backend",
    [(TOKENS, "pallas"), (write_triton.PAIRWISE_MAX_TOKENS + 1, "pallas"), (TOKENS, "auto")],
    ids=["pairwise", "sort", "auto"],
)
def test_write_lowers(tokens, backend):
    def fn(buf, offsets, seeds, num_valid, ids, positions, loc, flag, sources):
        return write_api.write(
            buf,
            offsets,
            seeds,
            num_valid,
            ids,
            positions,
            loc,
            flag,
            real_kv_sources=sources,
            real_kv_hash_mode=2,
            backend=backend,
        )

    text = _export(jax.jit(fn, donate_argnums=0), *_write_args(_sources(jnp.bfloat16, jnp.float8_e4m3fn), tokens))
    dedupe = "pairwise" if tokens <= write_triton.PAIRWISE_MAX_TOKENS else "sort"
    assert "kvcanary_write_chain" in text and f"kvcanary_write_store_block=128_{dedupe}" in text


def test_eight_byte_sources_lower_under_x64():
    with jax.enable_x64(True):
        sources = _sources(jnp.int64, jnp.float64)
        fn = lambda *a: verify_api.verify(*a[:-1], real_kv_sources=a[-1], real_kv_hash_mode=2, backend="pallas")  # noqa: E731
        assert "kvcanary_verify_block" in _export(jax.jit(fn), *_verify_args(sources))
        wfn = lambda *a: write_api.write(*a[:-1], real_kv_sources=a[-1], real_kv_hash_mode=2, backend="pallas")  # noqa: E731
        assert "kvcanary_write_chain" in _export(jax.jit(wfn), *_write_args(sources))


def test_canary_ops_lower():
    """The whole upper-layer ops (plans' arrays, ring append, counters) around the kernels."""
    config = kc.CanaryConfig(ring_capacity=64, enable_verify_token_assert=True)
    state = kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=4, max_context_len=16)
    state = jax.tree.map(lambda x: S(x.shape, x.dtype), state)
    sources = _sources(jnp.bfloat16, jnp.uint8)
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    vplan = kc.VerifyPlan(*([i32(CAPACITY)] * 4), num_valid=i32(1), enable=i32(1))
    wplan = kc.WritePlan(write_offsets=i32(REQS + 1), seed_slot_indices=i32(REQS), num_valid_reqs=i32(1))
    buf = S((NUM_SLOTS, 4, 2), jnp.uint32)

    def step(state, buf, vplan, wplan, ids, positions, loc, sources):
        tag = kc.CanaryLaunchTag.TAIL_K_FULL
        state = kc.canary_verify(
            state,
            buf,
            vplan,
            tag=tag,
            real_kv_sources=sources,
            real_kv_hash_mode="all",
            check_expected_token=True,
            backend="pallas",
        )
        return kc.canary_write(
            state,
            buf,
            wplan,
            ids,
            positions,
            loc,
            tag=tag,
            real_kv_sources=sources,
            real_kv_hash_mode="all",
            backend="pallas",
        )

    text = _export(jax.jit(step, donate_argnums=(0, 1)), state, buf, vplan, wplan, *([i32(TOKENS)] * 3), sources)
    assert text.count(compat.TRITON_CUSTOM_CALL_TARGET) == 3  # verify, write chain, write store


def _phase_args(tokens, *, swa: bool):
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    num_slots = 400 if swa else NUM_SLOTS
    counters = S((12, 2), jnp.uint32)
    log = phase_common.Log(S((64, 8, 2), jnp.uint32), i32(1), counters, counters, i32(64, 3), i32(1))
    batch = phase_common.Batch(
        i32(REQS),
        i32(REQS),
        i32(REQS),
        i32(REQS + 1, 40),
        i32(tokens),
        i32(tokens),
        i32(tokens),
        i32(NUM_SLOTS + 1) if swa else None,
        token_ids=i32(REQS + 1, 40),
        token_ids_lens=i32(REQS),
        expected_input_ids=i32(tokens),
        expected_positions=i32(tokens),
        active=i32(REQS),
        span_lens=i32(REQS),
    )
    buffers = (S((num_slots, 4, 2), jnp.uint32),) * 2
    return buffers, log, batch, i32(1)


@pytest.mark.parametrize(
    "tokens,swa", [(TOKENS, True), (write_triton.PAIRWISE_MAX_TOKENS + 1, False)], ids=["pairwise_swa", "sort"]
)
def test_phase_lowers(tokens, swa):
    buffers, log, batch, cpa = _phase_args(tokens, swa=swa)
    sources = tuple(
        tuple(
            dataclasses.replace(s, data=S((-(-buffers[0].shape[0] // s.page_size), *s.data.shape[1:]), s.data.dtype))
            for s in _sources(*dtypes)
        )
        for dtypes in ((jnp.bfloat16,), (jnp.float8_e4m3fn, jnp.int8))
    )

    def fn(buffers, log, batch, cpa, sources, issues):
        return phase_api.phase(
            buffers,
            log,
            batch,
            cpa,
            tags=(8, 9) if swa else (2, 3),
            real_kv_sources=sources,
            real_kv_hash_mode=2,
            verify_capacity=CAPACITY,
            window=6 if swa else 0,
            token_offset=1,
            full_slots=NUM_SLOTS,
            check_table=True,
            skip_bad_requests=True,
            input_issues=issues,
            backend="pallas",
        )

    # Every optional input and switch: the rows' context, the overflow count, explicit roles, the caller's issues.
    issues = S((len(phase_common.INPUT_ISSUE_FIELDS), 2 * REQS + tokens), jnp.int32)
    text = _export(jax.jit(fn, donate_argnums=(0, 1)), buffers, log, batch, cpa, sources, issues)
    assert text.count(compat.TRITON_CUSTOM_CALL_TARGET) == 2
    dedupe = "pairwise" if tokens <= write_triton.PAIRWISE_MAX_TOKENS else "sort"
    for name in ("kvcanary_phase_check_block=128", f"kvcanary_phase_ring_store_block=128_{dedupe}"):
        assert name in text
    # The ring-and-store kernel updates in place the ring, its context, the overflow count (output 6, after the
    # write index, the two counters and ``enable``; unaliased, XLA would copy the new count into the donated one
    # each step) and the two canary buffers (outputs 7 and 8).
    assert _aliased_outputs(text, "kvcanary_phase_ring_store") == [0, 1, 6, 7, 8]


@pytest.mark.parametrize("padding,width", [("reserved", 40), ("negative", None), ("none", None)])
def test_batch_checks_lower(padding, width):
    """One launch, every row and token check traced (the reserved-row scan with ``"reserved"``); many row and
    token chunks (REQS and TOKENS are ragged)."""

    def fn(rpi, cached, extend, loc, lens):
        return batch_checks_api.check(
            rpi,
            cached,
            extend,
            loc,
            lens,
            padding=padding,
            table_rows=REQS + 1,
            context_len=CAPACITY,
            num_slots=NUM_SLOTS,
            token_ids_width=width,
            backend="pallas",
        )

    rows = S((70,), jnp.int32)
    lens = rows if width else None
    text = _export(jax.jit(fn), rows, rows, rows, S((TOKENS,), jnp.int32), lens)
    assert text.count(compat.TRITON_CUSTOM_CALL_TARGET) == 1
    assert "kvcanary_batch_checks" in text


def _aliased_outputs(text: str, kernel_name: str) -> list[int]:
    """The outputs that the named kernel's custom call writes into one of its operands."""
    (call,) = [line for line in text.splitlines() if kernel_name in line and "output_operand_alias" in line]
    return sorted(int(i) for i in re.findall(r"output_tuple_indices = \[(\d+)\]", call))


@pytest.mark.parametrize("padding", ["negative", "reserved"])
def test_decode_step_is_only_triton_launches(padding):
    """The runner's HEAD + TAIL (K and V, real KV) lower to Triton launches and nothing XLA would run as a kernel
    of its own: two launches per phase (check, then ring and store); the batch checks run inside the HEAD's
    check launch, and each launch derives the rows' roles itself. No XLA while loop either (XLA:GPU copies a
    while loop's predicate to the host every iteration)."""
    bs, ctx, page = 8, 64, 16
    canary = kc.KvCanary(
        kc.CanaryConfig(real_kv_hash_mode="partial", ring_capacity=64),
        kc.CanaryPool(num_slots=bs * ctx + page, page_size=page, verify_capacity=bs * ctx, padding=padding),
    )
    state = jax.tree.map(lambda x: S(x.shape, x.dtype), jax.eval_shape(canary.init_state))
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    batch = kc.CanaryBatch(i32(bs), i32(bs), i32(bs), i32(bs + 1, ctx), i32(bs), i32(bs), i32(bs))
    kv = S((bs * ctx // page + 1, page, 8, 128), jnp.bfloat16)

    def step(state, batch, k, v):
        state = canary.before_forward(state, batch)
        return canary.after_forward(state, batch, canary.kv_sources(full_k=k, full_v=v))

    text = _export(jax.jit(step, donate_argnums=0), state, batch, kv, kv)
    assert text.count(compat.TRITON_CUSTOM_CALL_TARGET) == 4
    assert "kvcanary_batch_checks" not in text
    # Reshapes are bitcasts; the cases are the backends' platform branches, resolved for CUDA at compile time.
    ops = set(re.findall(r"stablehlo\.([a-z_]+)", text))
    assert ops <= {"custom_call", "output_operand_alias", "reshape", "case", "return", "constant"}, ops
