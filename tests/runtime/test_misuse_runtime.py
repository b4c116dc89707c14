"""Misuse of the runtime tier, as a new user wiring ``KvCanary`` into an engine commits it.

Static mistakes (types, shapes, dtypes, layouts, a state or sources of another canary) fail at trace time with a
message naming the argument and what it received. Bad values inside a step (out-of-range indices, negative lengths,
reserved rows and slots) become exactly one ``INVALID_INPUT`` row per bad value and step, naming the field, the
entry and the value; padding, in each convention, is never a violation; and next to every misuse, a correct batch
stays silent while an injected fault is still found at its slot.
"""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcanary_jax as kc
from kvcanary_jax import FailReason, testing
from kvcanary_jax.core._constants import InputField, InputProblem
from kvcanary_jax.core._state import u64_pairs_as_int64
from kvcanary_jax.testing import assert_no_violations, expect_violation
from tests.runtime.misuse_testlib import (
    BATCH,
    CONTEXT,
    LUT,
    NUM_SLOTS,
    PADDINGS,
    PAGE_SIZE,
    SWA_SLOTS,
    TABLE_ROWS,
    TOKENS,
    WINDOW,
    Padding,
    Request,
    loop,
    pack,
    pack_padded,
    prefill,
)

INVALID = FailReason.INVALID_INPUT
_SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)

# ---------------------------------------------------------------------------------------- pool and canary descriptions


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(num_slots=16.0), ValueError, r"CanaryPool.num_slots must be a positive int; got num_slots=16.0"),
        (dict(num_slots="16"), ValueError, r"num_slots='16'"),
        (dict(num_slots=True), ValueError, r"num_slots=True"),
        (dict(num_slots=1), ValueError, r"num_slots must be >= 2 \(slot 0 is the reserved padding slot\)"),
        (dict(page_size=0), ValueError, r"CanaryPool.page_size must be a positive int; got page_size=0"),
        (dict(page_size=None), ValueError, r"page_size=None"),
        (dict(padding="Reserved"), ValueError, r"CanaryPool.padding must be one of .*got padding='Reserved'"),
        (dict(padding=None), ValueError, r"got padding=None"),
        (dict(padding=-1), ValueError, r"got padding=-1"),
        (dict(swa={"num_slots": 8, "window": 4}), TypeError, r"CanaryPool.swa must be a SwaGroup or None; got dict"),
        (dict(with_v=1), TypeError, r"CanaryPool.with_v must be a bool; got with_v=1"),
        (dict(verify_capacity=0), ValueError, r"CanaryPool.verify_capacity must be a positive int; got .*=0"),
        (dict(max_reqs=True), ValueError, r"max_reqs=True"),
        (dict(max_context_len=-4), ValueError, r"max_context_len=-4"),
        (dict(kv_token_id_vs_position_offset=1.0), TypeError, r"kv_token_id_vs_position_offset must be an int; got 1.0"),
    ],
)  # fmt: skip
def test_canary_pool_names_every_bad_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        kc.CanaryPool(**{"num_slots": 16, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(num_slots=1), ValueError, r"SwaGroup.num_slots must be >= 2 \(slot 0 is the reserved padding slot\)"),
        (dict(num_slots=8.0), ValueError, r"SwaGroup.num_slots must be a positive int; got num_slots=8.0"),
        (dict(window=None), ValueError, r"SwaGroup.window must be a positive int; got window=None"),
        (dict(page_size=0), ValueError, r"SwaGroup.page_size must be a positive int; got page_size=0"),
        (dict(verify_capacity="3"), ValueError, r"verify_capacity='3'"),
    ],
)  # fmt: skip
def test_swa_group_names_every_bad_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        kc.SwaGroup(**{"num_slots": 8, "window": 4, **kwargs})


def test_pool_and_canary_take_numpy_integers():
    pool = kc.CanaryPool(
        num_slots=np.int64(16), page_size=np.int32(4), swa=kc.SwaGroup(np.int64(8), np.int16(4)),
        verify_capacity=np.uint16(40), kv_token_id_vs_position_offset=np.int64(1),
    )  # fmt: skip
    assert pool == kc.CanaryPool(
        num_slots=16, page_size=4, swa=kc.SwaGroup(8, 4), verify_capacity=40, kv_token_id_vs_position_offset=1
    )
    assert type(pool.num_slots) is int and type(pool.swa.window) is int
    canary = kc.KvCanary(kc.CanaryConfig(ring_capacity=np.int64(8)), pool)
    assert canary.init_state().full.k_head.shape == (16, 4, 2)


def test_kv_canary_names_its_arguments():
    config, pool = kc.CanaryConfig(), kc.CanaryPool(num_slots=16)
    with pytest.raises(TypeError, match=r"config must be a CanaryConfig; got CanaryPool"):
        kc.KvCanary(pool, config)  # swapped
    with pytest.raises(TypeError, match=r"pool must be a CanaryPool; got NoneType"):
        kc.KvCanary(config, None)
    with pytest.raises(TypeError, match=r"pool must be a CanaryPool; got SwaGroup"):
        kc.KvCanary(config, kc.SwaGroup(8, 4))


def test_launch_tags_parse_phases_or_name_the_bad_one():
    canary = kc.KvCanary(kc.CanaryConfig(), kc.CanaryPool(num_slots=16, with_v=False))
    T = kc.CanaryLaunchTag
    assert canary.launch_tags(("head",)) == canary.launch_tags((kc.Phase.HEAD,)) == (T.HEAD_K_FULL,)
    assert canary.launch_tags("TAIL") == canary.launch_tags(np.int64(1)) == (T.TAIL_K_FULL,)
    for bad in [("HED",), (7,), (1.0,), (None,)]:
        with pytest.raises(ValueError, match=rf"phases must hold Phase members or their names .*got {bad[0]!r}"):
            canary.launch_tags(bad)


# ------------------------------------------------------------------------------------------------------- kv_sources

_CANARY = kc.KvCanary(kc.CanaryConfig(real_kv_hash_mode="partial"), kc.CanaryPool(num_slots=16, page_size=4))
_SWA_CANARY = kc.KvCanary(
    kc.CanaryConfig(), kc.CanaryPool(num_slots=16, page_size=4, swa=kc.SwaGroup(8, 2, page_size=2), with_v=False)
)
_KV = jnp.zeros((4, 4, 2, 8), jnp.bfloat16)  # [pages, page_size, kv_heads, head_dim]: 32 bytes per token


@pytest.mark.parametrize(
    ("canary", "kwargs", "error", "pattern"),
    [
        # A head-major array: [pages, heads, page_size, dim]. The page size is found on a later axis.
        (_CANARY, dict(full_k=_KV.transpose(0, 2, 1, 3)), ValueError,
         r"full_k must be a paged KV array laid out \[pages, page_size=4, \.\.\.\] .*got shape \(4, 2, 4, 8\)\. "
         r"The page_size \(4\) is a later axis: a head-major"),
        # The case: a page size of 8 declared over KV paged by 4 (and the converse).
        (_CANARY, dict(full_k=_KV.reshape(2, 8, 2, 8)), ValueError, r"page_size=4.*got shape \(2, 8, 2, 8\)"),
        # Pages of 8 with head_dim 4 under page_size=4: the page size is wrong; the layout is not head-major.
        (_CANARY, dict(full_k=jnp.zeros((2, 8, 2, 4), jnp.bfloat16)), ValueError,
         r"got shape \(2, 8, 2, 4\)\. Its pages hold 8 slots: if the engine pages KV by 8, the canary's page_size "
         r"must say so \(CanaryPool.page_size"),
        (_CANARY, dict(full_v=_KV.reshape(8, 2, 2, 8)), ValueError, r"full_v must be .*got shape \(8, 2, 2, 8\)"),
        (_CANARY, dict(full_k=_KV[:3]), ValueError,
         r"full_k holds 3 pages x 4 = 12 slots, fewer than the group's num_slots=16"),
        (_CANARY, dict(full_k=_KV.reshape(-1)), ValueError, r"full_k must be a paged KV array .*got shape \(256,\)"),
        # Issue 43: a flat [slots, heads, dim] array whose head count is the page size passes for 16 pages of 4.
        (_CANARY, dict(full_k=jnp.zeros((16, 4, 8), jnp.bfloat16)), ValueError,
         r"full_k holds 16 pages x page_size=4 = 64 token slots, but the pool group has num_slots=16: .*got shape "
         r"\(16, 4, 8\)\. Its leading axis holds the 16 slots: it looks like a flat per-slot array \[slots, heads, "
         r"dim\], not \[pages, page_size, \.\.\.\]\. View it paged as the pool is: kv\.reshape\(4, 4, 4, 8\)"),
        # A flat array whose head count is not the page size: the hint is the same reshape, not a page size.
        (_CANARY, dict(full_k=jnp.zeros((16, 2, 8), jnp.bfloat16)), ValueError,
         r"got shape \(16, 2, 8\)\. Its leading axis holds the 16 slots: .* kv\.reshape\(4, 4, 2, 8\)$"),
        (_CANARY, dict(full_v=kc.RealKvSource(jnp.zeros((16, 4, 8), jnp.bfloat16), page_size=4)), ValueError,
         r"full_v holds 16 pages x page_size=4 = 64 token slots, but the pool group has num_slots=16"),
        (_CANARY, dict(full_k=jnp.concatenate([_KV, _KV])), ValueError,
         r"full_k holds 8 pages x page_size=4 = 32 token slots, but the pool group has num_slots=16: a source must "
         r"hold exactly the group's slots \(slot s at page s // page_size, row s % page_size\); got shape "
         r"\(8, 4, 2, 8\)\.$"),
        (_CANARY, dict(full_k=_KV.astype(bool)), TypeError, r"full_k must have a 1/2/4/8-byte .*got dtype bool"),
        (_CANARY, dict(full_k=jnp.zeros((4, 4, 4), jnp.complex64)), TypeError, r"got dtype complex64"),
        (_CANARY, dict(full_k=jnp.zeros((4, 4, 2), jnp.float32)), ValueError,
         r"num_bytes_per_token must be a positive multiple of 16; got 8"),
        (_CANARY, dict(full_k=[1, 2]), TypeError, r"full_k\[0\] must be a KV array or a RealKvSource; got int"),
        (_CANARY, dict(full_k=3), TypeError, r"full_k must be a KV array or a RealKvSource; got int"),
        (_CANARY, dict(full_k=[_KV] * 5), ValueError, r"full_k holds at most 4 sources; got 5"),
        (_CANARY, dict(full_v=kc.RealKvSource(_KV[:2], page_size=4)), ValueError,
         r"full_v\[0\] holds 8 token slots .* num_slots=16"),
        (_CANARY, dict(swa_k=_KV), ValueError, r"swa_k / swa_v were given but the pool has no SWA group"),
        (_SWA_CANARY, dict(full_v=_KV), ValueError, r"full_v / swa_v were given but CanaryPool.with_v is False"),
        (_SWA_CANARY, dict(swa_k=_KV), ValueError,
         r"swa_k must be a paged KV array laid out \[pages, page_size=2, .*got shape \(4, 4, 2, 8\)"),
    ],
)  # fmt: skip
def test_kv_sources_name_every_bad_array(canary, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        canary.kv_sources(**kwargs)


def test_kv_sources_take_numpy_arrays_and_sequences():
    sources = _CANARY.kv_sources(full_k=np.zeros((4, 4, 2, 8), np.float16), full_v=[_KV, _KV])
    (k,), (v0, v1) = sources.full_k, sources.full_v
    assert isinstance(k.data, jax.Array) and (k.page_size, k.num_bytes_per_token) == (4, 32)
    assert v0.data is _KV and v1.page_size == 4
    swa = _SWA_CANARY.kv_sources(swa_k=_KV.reshape(8, 2, 2, 8)[:4]).swa_k[0]
    assert swa.page_size == 2 and swa.num_token_slots == 8


def test_a_flat_kv_array_viewed_as_the_hint_says_reads_each_slot_at_its_own_row():
    """Issue 43: flat [slots, heads=page_size, dim] was taken for [pages, page_size, ...] (slot 5 read at row 10 with
    a page of 2); it is refused, and the reshape its message gives makes slot s's bytes the source's slot s."""
    flat = jnp.arange(16 * 4 * 8, dtype=jnp.int32).reshape(16, 4, 8).astype(jnp.bfloat16)  # [slots, heads, dim]
    with pytest.raises(ValueError, match=r"View it paged as the pool is: kv\.reshape\(4, 4, 4, 8\)"):
        _CANARY.kv_sources(full_k=flat)
    (k,) = _CANARY.kv_sources(full_k=flat.reshape(4, 4, 4, 8)).full_k
    assert k.num_token_slots == 16 and k.num_bytes_per_token == 4 * 8 * 2
    for slot in (5, 10):
        np.testing.assert_array_equal(k.data[slot // 4, slot % 4], flat[slot])


# ------------------------------------------------------------------------------------------- CanaryBatch (trace time)


def _host_batch():
    requests = [Request(1, 2, 1, (3, 4, 5)), Request(2, 0, 2, (6, 7))]
    return pack(requests, Padding(rows=((-1, 0, 0),)))


_FRESH = object()


def _trace(canary, batch, state=_FRESH):
    """Traces ``before_forward`` without compiling: trace-time errors raise, a good batch gives the state's shapes."""
    return jax.eval_shape(canary.before_forward, canary.init_state() if state is _FRESH else state, batch)


_ROW_FIELDS = ("req_pool_indices", "prefix_lens", "extend_lens")
_TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")


def _bad_fields():
    for name in _ROW_FIELDS + _TOKEN_FIELDS:
        x = getattr(_host_batch(), name)
        group = _ROW_FIELDS if name in _ROW_FIELDS else _TOKEN_FIELDS
        yield name, "float", x.astype(np.float32), TypeError, rf"batch.{name} must have dtype int32; got batch.{name}.dtype=float32"  # fmt: skip
        yield name, "uint32", x.astype(np.uint32), TypeError, rf"batch.{name}.dtype=uint32"
        yield name, "2-D", x.reshape(1, -1), ValueError, rf"batch.{name} must have 1 dimension\(s\); got .*shape=\(1, {len(x)}\)"  # fmt: skip
        yield name, "scalar", x[0], ValueError, rf"batch.{name} must have 1 dimension\(s\); got batch.{name}.shape=\(\)"
        yield name, "short", x[:-1], ValueError, rf"same length: .*'batch.{name}': {len(x) - 1}"
        yield name, "list", x.tolist(), TypeError, rf"batch.{name} must be an int32 array; got list"
        yield name, "None", None, TypeError, rf"batch.{name} is required \(an int32 array\); got None"
        del group
    table = _host_batch().req_to_token
    yield "req_to_token", "1-D", table[1], ValueError, r"batch.req_to_token must have 2 dimension\(s\); got .*\(12,\)"
    yield "req_to_token", "3-D", table[None], ValueError, r"batch.req_to_token.shape=\(1, 4, 12\)"
    yield "req_to_token", "float", table.astype(np.float32), TypeError, r"batch.req_to_token.dtype=float32"
    yield "req_to_token", "no columns", table[:, :0], ValueError, r"req_to_token needs at least one row and one column; got (batch.)?req_to_token.shape=\(4, 0\)"  # fmt: skip
    yield "req_to_token", "list", table.tolist(), TypeError, r"batch.req_to_token must be an int32 array; got list"
    yield "req_to_token", "None", None, TypeError, r"batch.req_to_token is required"


@pytest.mark.parametrize(("field", "value", "error", "pattern"), [c[:1] + c[2:] for c in _bad_fields()],
                         ids=[f"{c[0]}-{c[1]}" for c in _bad_fields()])  # fmt: skip
def test_batch_fields_are_checked_by_name(field, value, error, pattern):
    canary = loop("negative").canary
    with pytest.raises(error, match=pattern):
        _trace(canary, dataclasses.replace(_host_batch(), **{field: value}))


def test_empty_batches_are_refused_by_name():
    canary = loop("none").canary
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    no_rows = dataclasses.replace(_host_batch(), req_pool_indices=i32(), prefix_lens=i32(), extend_lens=i32())
    with pytest.raises(ValueError, match=r"batch.req_pool_indices needs at least one entry .*shape=\(0,\)"):
        _trace(canary, no_rows)
    no_tokens = dataclasses.replace(_host_batch(), input_ids=i32(), positions=i32(), out_cache_loc=i32())
    with pytest.raises(ValueError, match=r"batch.input_ids needs at least one entry"):
        _trace(canary, no_tokens)
    with pytest.raises(TypeError, match=r"batch must be a CanaryBatch; got dict"):
        _trace(canary, dataclasses.asdict(_host_batch()))


def test_a_host_batch_of_numpy_int64_arrays_is_accepted():
    """numpy arrays (any integer width jax maps to int32) go through; the state comes back with its own shapes."""
    canary = loop("negative").canary
    host = jax.tree.map(lambda x: np.asarray(x, np.int64), _host_batch())
    out = _trace(canary, host)
    assert out.full.k_head.shape == (NUM_SLOTS, 4, 2) and out.swa.v_tail.shape == (SWA_SLOTS, 4, 2)


def test_a_host_integer_that_int32_cannot_hold_is_refused_by_name():
    """jax narrows an int64 of 2**32 + 5 to 5 without a word (x64 off): the batch refuses it before that."""
    good = _host_batch()
    slots = np.asarray(good.out_cache_loc, np.int64)
    slots[1] = 2**32 + 5
    with pytest.raises(ValueError, match=re.escape(
        "batch.out_cache_loc holds 4294967301 at index [1], which does not fit the int32 the canary checks "
        "(batch.out_cache_loc.dtype=int64; narrowing would wrap it silently)"
    )):  # fmt: skip
        dataclasses.replace(good, out_cache_loc=slots)
    table = np.asarray(good.req_to_token, np.int64)
    table[1, 2] = -(2**31) - 1
    with pytest.raises(ValueError, match=r"batch.req_to_token holds -2147483649 at index \[1, 2\]"):
        dataclasses.replace(good, req_to_token=table)
    fits = dataclasses.replace(good, req_to_token=np.asarray(good.req_to_token, np.int64))
    assert _trace(loop("negative").canary, fits).verify_overflows.shape == (1,)


def test_a_same_shaped_state_of_another_config_is_refused_at_trace_time():
    canary = loop("negative").canary
    mode = "none" if canary.config.real_kv_hash_mode != kc.RealKvHashMode.NONE else "partial"
    other = kc.KvCanary(dataclasses.replace(canary.config, real_kv_hash_mode=mode), canary.pool).init_state()
    shapes = lambda state: [x.shape for x in jax.tree.leaves(state)]  # noqa: E731
    assert shapes(other) == shapes(canary.init_state()), "same shapes: only the fingerprint tells them apart"
    pattern = r"state was allocated by a canary of another config or pool \(fingerprint 0x[0-9a-f]{8}, this canary's"
    with pytest.raises(ValueError, match=pattern):
        _trace(canary, _host_batch(), other)
    same_records = kc.KvCanary(dataclasses.replace(canary.config, mode="log", backend="xla"), canary.pool)
    assert _trace(canary, _host_batch(), same_records.init_state()).fingerprint == canary.fingerprint
    resized = kc.KvCanary(canary.config, dataclasses.replace(canary.pool, verify_capacity=7))  # a per-forward sizing
    assert _trace(resized, _host_batch(), canary.init_state()).fingerprint == canary.fingerprint


def test_the_monitor_refuses_an_older_state_and_a_donated_one_by_name():
    lp = loop("none")
    canary = lp.canary
    step = jax.jit(canary.before_forward, donate_argnums=0)
    batch = pack_padded([Request(1, 0, 2, (3, 4))], "none")
    old = canary.init_state()
    new = step(canary.init_state(), batch)
    launches = lambda state: int(np.asarray(state.device.kernel_run_counters).view(np.int64).sum())  # noqa: E731
    assert launches(new) > launches(old) == 0
    for check in ("after_step", "final_check", "flush"):
        monitor = kc.CanaryMonitor(dataclasses.replace(canary, config=dataclasses.replace(canary.config,
                                                                                          check_lag_steps=0)))
        monitor.after_step(new)
        with pytest.raises(ValueError, match=r"state is older than one the monitor has already seen \(it has been "
                                             rf"through 0 canary launch\(es\), an earlier one through {launches(new)}\)"):  # fmt: skip
            getattr(monitor, check)(old)
    donated = canary.init_state()
    step(donated, batch)
    gone = r"state was donated to an earlier step and its buffers are gone: use the state that step returned"
    for call in ("after_step", "flush", "rearm"):
        with pytest.raises(ValueError, match=gone):
            getattr(kc.CanaryMonitor(canary), call)(donated)
    with pytest.raises(ValueError, match=gone):
        canary.before_forward(donated, batch)


def _asserting(**config):
    pool = kc.CanaryPool(
        num_slots=NUM_SLOTS, page_size=PAGE_SIZE, max_reqs=TABLE_ROWS, max_context_len=CONTEXT, with_v=False
    )
    return kc.KvCanary(kc.CanaryConfig(backend="xla", **config), pool)


def test_oracle_fields_are_checked_when_an_assert_uses_them():
    canary = _asserting(enable_write_input_assert=True)
    batch = _host_batch()
    ok = batch.input_ids
    for value, error, pattern in [
        (None, ValueError, r"config.enable_write_input_assert compares .* batch.expected_input_ids, but it is None"),
        (ok[:1], ValueError, r"same length: .*'batch.expected_input_ids': 1"),  # would broadcast silently
        (ok[:3], ValueError, r"'batch.expected_input_ids': 3"),
        (ok.astype(np.float32), TypeError, r"batch.expected_input_ids must have dtype int32; got .*float32"),
        (ok.reshape(1, -1), ValueError, r"batch.expected_input_ids must have 1 dimension\(s\)"),
        (ok.tolist(), TypeError, r"batch.expected_input_ids must be an int32 array; got list"),
    ]:
        with pytest.raises(error, match=pattern):
            _trace(canary, dataclasses.replace(batch, expected_input_ids=value))
    for value, error, pattern in [
        (batch.positions[:2], ValueError, r"'batch.expected_positions': 2"),
        (batch.positions.astype(np.float32), TypeError, r"batch.expected_positions must have dtype int32"),
    ]:
        with pytest.raises(error, match=pattern):
            _trace(canary, dataclasses.replace(batch, expected_input_ids=ok, expected_positions=value))
    _trace(canary, dataclasses.replace(batch, expected_input_ids=ok))  # the oracle given: accepted

    canary = _asserting(enable_verify_token_assert=True)
    history = np.zeros((TABLE_ROWS, CONTEXT), np.int32)
    lens = np.array([3, 2, 0], np.int32)
    for changes, error, pattern in [
        (dict(token_ids=None), ValueError, r"needs batch.token_ids .* and batch.token_ids_lens"),
        (dict(token_ids=history[:, :5]), ValueError, r"batch.token_ids must have shape \(4, 12\); got .*\(4, 5\)"),
        (dict(token_ids_lens=lens.astype(np.float32)), TypeError, r"batch.token_ids_lens must have dtype int32"),
        (dict(token_ids_lens=lens[:2]), ValueError, r"batch.token_ids_lens must have shape \(3,\); got .*\(2,\)"),
        # A table of another shape than the pool's: rows past the token pool would be dropped from it silently.
        (dict(req_to_token=np.zeros((6, CONTEXT), np.int32), token_ids=np.zeros((6, CONTEXT), np.int32)),
         ValueError, r"batch.req_to_token must have CanaryPool's shape \(max_reqs, max_context_len\)=\(4, 12\) .*"
         r"got batch.req_to_token.shape=\(6, 12\)"),
    ]:  # fmt: skip
        with pytest.raises(error, match=pattern):
            _trace(canary, dataclasses.replace(batch, **{"token_ids": history, "token_ids_lens": lens, **changes}))


def test_the_swa_table_is_checked_when_the_pool_has_an_swa_group():
    canary, batch = loop("negative").canary, _host_batch()
    for value, error, pattern in [
        (None, ValueError, r"the pool has an SWA group, so batch.full_to_swa_index_mapping .* is required"),
        # Shorter than the pool: slots past its end would read its last entry.
        (LUT[:3], ValueError, rf"batch.full_to_swa_index_mapping must map every full-pool slot .*num_slots="
         rf"{NUM_SLOTS}\); got batch.full_to_swa_index_mapping.shape=\(3,\)"),
        (LUT.astype(np.float32), TypeError, r"batch.full_to_swa_index_mapping must have dtype int32"),
        (LUT[None], ValueError, r"batch.full_to_swa_index_mapping must have 1 dimension\(s\)"),
    ]:  # fmt: skip
        with pytest.raises(error, match=pattern):
            _trace(canary, dataclasses.replace(batch, full_to_swa_index_mapping=value))


# ------------------------------------------------------------------------------- the state and sources of the canary


def _other_states():
    pool = loop("negative").canary.pool
    config = loop("negative").canary.config
    other = lambda **changes: kc.KvCanary(  # noqa: E731
        dataclasses.replace(config, **changes.pop("config", {})), dataclasses.replace(pool, **changes)
    ).init_state()
    yield "off", other(config=dict(mode="off")), ValueError, r"state has no FULL buffers \(state.full is None\)"
    yield "no-swa", other(swa=None), ValueError, r"state has no SWA buffers"
    yield (
        "smaller",
        other(num_slots=16),
        ValueError,
        r"state.full.k_head must have shape \(32, 4, 2\); got .*\(16, 4, 2\)",
    )
    yield "k-only", other(with_v=False), TypeError, r"state.full.v_head must be an array; got NoneType"
    yield (
        "ring",
        other(config=dict(ring_capacity=8)),
        ValueError,
        r"state's ring holds 8 rows but config.ring_capacity=64",
    )
    yield "device", loop("negative").canary.init_state().device, TypeError, r"state must be a CanaryState .*got CanaryDeviceState"  # fmt: skip
    yield "none", None, TypeError, r"state must be a CanaryState \(from KvCanary.init_state\); got NoneType"


@pytest.mark.parametrize(("state", "error", "pattern"), [c[1:] for c in _other_states()],
                         ids=[c[0] for c in _other_states()])  # fmt: skip
def test_a_state_of_another_canary_is_refused(state, error, pattern):
    canary = loop("negative").canary
    with pytest.raises(error, match=pattern):
        _trace(canary, _host_batch(), state)
    with pytest.raises(error, match=pattern):
        canary.mark_init_finished(state)
    with pytest.raises(error, match=pattern):
        canary.sweep(state, canary.sweep_plan(kc.SweepEntries.empty(), LUT), kc.KvSources())


def test_a_state_without_the_token_pool_the_assert_needs_is_refused():
    canary = _asserting(enable_verify_token_assert=True)
    state = _asserting().init_state()
    with pytest.raises(ValueError, match=r"state's expected-token pool is None, but this canary needs \(4, 12\)"):
        canary.mark_init_finished(state)


def test_sources_are_checked_by_field_name():
    lp = loop("negative")
    canary, (kv, state) = lp.canary, lp.init()
    good = lp.sources(kv)
    for sources, error, pattern in [
        (None, TypeError, r"kv_cache_sources must be KvSources \(see KvCanary.kv_sources\); got NoneType"),
        ({"full_k": kv[0]}, TypeError, r"kv_cache_sources must be KvSources .*got dict"),
        # Built by hand around a raw array instead of through kv_sources().
        (dataclasses.replace(good, full_k=kv[0]), TypeError,
         r"kv_cache_sources.full_k must be a tuple of RealKvSource; got ArrayImpl"),
        (dataclasses.replace(good, swa_v=good.swa_v * 5), ValueError,
         r"kv_cache_sources.swa_v holds at most 4 sources; got 5"),
        (dataclasses.replace(good, full_v=(kc.RealKvSource(kv[0][:2], page_size=PAGE_SIZE),)), ValueError,
         rf"kv_cache_sources.full_v\[0\] holds 8 token slots .*num_slots={NUM_SLOTS}"),
        (dataclasses.replace(good, full_v=(kc.RealKvSource(jnp.concatenate([kv[0], kv[0]]), page_size=PAGE_SIZE),)),
         ValueError, rf"kv_cache_sources.full_v\[0\] holds {2 * NUM_SLOTS // PAGE_SIZE} pages x page_size={PAGE_SIZE} "
                     rf"= {2 * NUM_SLOTS} token slots, but the pool group has num_slots={NUM_SLOTS}"),
        (dataclasses.replace(good, swa_k=()), ValueError,
         r"real_kv_hash_mode=PARTIAL but kv_cache_sources has no swa_k source"),
    ]:  # fmt: skip
        with pytest.raises(error, match=pattern):
            canary.after_forward(state, _host_batch(), sources)
        with pytest.raises(error, match=pattern):
            canary.sweep(state, canary.sweep_plan(kc.SweepEntries.empty(), LUT), sources)
    k_only = loop("none").canary
    with pytest.raises(ValueError, match=r"kv_cache_sources.full_v holds sources, but no launch of this canary reads"):
        k_only.sweep(k_only.init_state(), k_only.sweep_plan(kc.SweepEntries.empty()), good)


# ------------------------------------------------------------------------------------------------------------ sweeps


def _entries(slots=(3, 4), positions=(0, 1), prev=(-1, 3)):
    return kc.SweepEntries(*(np.asarray(x, np.int32) for x in (slots, positions, prev)))


@pytest.mark.parametrize(
    ("entries", "lut", "error", "pattern"),
    [
        ((np.array([3]), np.array([0]), np.array([-1])), LUT, TypeError,
         r"FULL sweep: entries must be SweepEntries \(e.g. from walk_prefix_tree\); got tuple"),
        (_entries()._replace(positions=np.zeros(3, np.int32)), LUT, ValueError,
         r"SweepEntries fields must have one length; got slots=2, positions=3"),
        (_entries()._replace(slots=np.array([3.0, 4.0])), LUT, TypeError,
         r"FULL sweep: SweepEntries.slots must hold integers; got dtype float64"),
        (_entries()._replace(slots=np.array([[3, 4]])), LUT, ValueError,
         r"SweepEntries.slots must have 1 dimension; got shape \(1, 2\)"),
        (_entries(), None, ValueError, r"the pool has an SWA group: sweep_plan needs full_to_swa_index_mapping"),
        (_entries(), LUT[:4], ValueError, r"full_to_swa_index_mapping must map every full-pool slot .*shape \(4,\)"),
        (_entries(), LUT.astype(np.float32), TypeError, r"full_to_swa_index_mapping must hold integers"),
        (_entries(), np.where(np.arange(33) == 4, 99, LUT), ValueError,
         rf"full_to_swa_index_mapping must map into the SWA pool \[0, {SWA_SLOTS}\); got .*\[4\]=99"),
        (_entries(), np.where(np.arange(33) == 3, -1, LUT), ValueError, r"full_to_swa_index_mapping\[3\]=-1"),
    ],
)  # fmt: skip
def test_sweep_plan_names_every_bad_entry(entries, lut, error, pattern):
    with pytest.raises(error, match=pattern):
        loop("negative").canary.sweep_plan(entries, lut)


def test_a_corrupt_prefix_cache_entry_is_an_invalid_input_row_and_the_rest_of_the_sweep_runs():
    """Before: slot 0 (or a slot past the pool) in a radix entry raised ValueError on the host, stopping a served
    engine's scheduler even in log mode. It is engine data: one INVALID_INPUT row each, the other entries checked."""
    lp = loop("negative")
    kv, state = lp.run(pack_padded(prefill([Request(1, 3, 0, (5, 6, 7))]), "negative"))
    bad = _entries(slots=(5, 0, 6, 99, 7, 8), positions=(0, 9, 1, 9, 2, -4), prev=(-1, 5, 5, 6, 6, 40))
    plan = lp.canary.sweep_plan(bad, LUT)
    assert int(plan.full.num_valid[0]) == int(plan.swa.num_valid[0]) == 3
    full = testing.flip_kv_byte(kv[0], 6, page_size=PAGE_SIZE)
    report = kc.read_violations(lp.sweep((full, kv[1]), state, plan).violation_log)
    inputs = [kc.format_violation(v, total=0, overflowed=False).split("  input: ")[1].split("\n")[0]
              for v in report.violations if v.fail_reason & INVALID]  # fmt: skip
    assert inputs == [
        "prefix-cache sweep entry SweepEntries.slots[1] (slot 0, position 9) = 0 is the reserved padding slot 0, "
        "inside a request",
        f"prefix-cache sweep entry SweepEntries.slots[3] (slot 99, position 9) = 99 is out of range (limit {NUM_SLOTS})",
        "prefix-cache sweep entry SweepEntries.positions[5] (slot 8, position -4) = -4 is negative",
    ]
    assert {v.launch_tag for v in report.violations if v.fail_reason & INVALID} == {kc.CanaryLaunchTag.SWEEP_K_FULL}
    expect_violation(report, tag="SWEEP_K_FULL", reason="verify_real_kv_hash", slot=6)  # the rest still ran
    assert report.write_index == 3 + 2  # the three bad entries, then slot 6's K and V rows


def test_a_correct_sweep_is_silent_and_finds_an_idle_fault():
    lp = loop("negative")
    req = Request(1, 3, 0, (5, 6, 7))
    kv, state = lp.run(pack_padded(prefill([req]), "negative"))
    plan = lp.canary.sweep_plan(_entries(slots=(5, 6, 7), positions=(0, 1, 2), prev=(-1, 5, 6)), LUT)
    assert int(plan.swa.num_valid[0]) == 3
    with pytest.raises(TypeError, match=r"plan must be a SweepPlan \(see KvCanary.sweep_plan\); got VerifyPlan"):
        lp.canary.sweep(state, plan.full, lp.sources(kv))
    with pytest.raises(ValueError, match=r"the sweep plan has no SWA plan but the pool has that group"):
        lp.canary.sweep(state, kc.SweepPlan(full=plan.full), lp.sources(kv))
    assert_no_violations(lp.sweep(kv, state, plan))
    full = testing.flip_kv_byte(kv[0], 6, page_size=PAGE_SIZE)
    state = lp.sweep((full, kv[1]), state, plan)
    v = expect_violation(state, tag="SWEEP_K_FULL", reason=FailReason.VERIFY_REAL_KV_HASH_MISMATCH, slot=6)
    assert v.position == 1 and kc.read_violations(state.violation_log).write_index == 2  # K and V halves


# ------------------------------------------------------------------------------------------------------ the monitor


def test_monitor_names_what_it_is_given(caplog):
    lp = loop("none")
    canary = lp.canary
    with pytest.raises(TypeError, match=r"canary must be a KvCanary; got KvSources"):
        kc.CanaryMonitor(kc.KvSources())
    with pytest.raises(TypeError, match=r"log must be a logging.Logger or LoggerAdapter \(or None\); got log='x'"):
        kc.CanaryMonitor(canary, log="x")
    monitor = kc.CanaryMonitor(canary, log=logging.getLogger("misuse"))
    state = canary.init_state()
    for bad, error, pattern in [
        (None, TypeError, r"state must be a CanaryState \(the state the step returned\); got NoneType"),
        (state.device, TypeError, r"got CanaryDeviceState"),
        (loop("negative").canary.init_state().violation_log, TypeError, r"got ViolationLog"),
        (kc.KvCanary(kc.CanaryConfig(ring_capacity=8), canary.pool).init_state(), ValueError,
         r"state's ring holds 8 rows but config.ring_capacity=64"),
    ]:  # fmt: skip
        for call in (monitor.after_step, monitor.final_check, monitor.flush, monitor.rearm):
            with pytest.raises(error, match=pattern):
                call(bad)
    for step in ("3", 3.0, jnp.int32(3)):
        with pytest.raises(TypeError, match=re.escape(f"step must be an int; got step={step!r}")):
            monitor.after_step(state, step=step)
    assert monitor.step == 0  # refused calls count no step

    # The same monitor with the right state: a step's INVALID_INPUT row is reported with the user's step number.
    bad = pack_padded([Request(1, 0, 2, (3, 99))], "none")
    monitor.after_step(lp.run(bad)[1], step=np.int64(41))
    with caplog.at_level(logging.WARNING, logger="misuse"):
        report = monitor.final_check(lp.run(bad)[1])
    assert report.write_index == 1 and monitor.observed[0].user_step == 41
    assert "input: out_cache_loc[1] (request row 1, position 1) = 99 is out of range (limit 32)" in caplog.text


# ------------------------------------------------------------------------------------- run time: values in the step


def _cached(requests):
    """(request index, position, slot) of every cached position, in batch order."""
    return [(i, p, r.slots[p]) for i, r in enumerate(requests) for p in range(r.prefix)]


@st.composite
def scenarios(draw, padding: str):
    """Requests (the first with 2 cached positions, so a fault has a target) and the convention's padding.

    Padding rows and tokens hold whatever an engine may leave there: garbage lengths in ``negative`` padding rows,
    slot 0 for ``reserved`` padding tokens (CUDA-graph padding writes the padding slot), nothing for ``none``.
    """
    n = BATCH if padding == "none" else draw(st.integers(1, BATCH))
    rows = draw(st.permutations(range(1 if padding == "reserved" else 0, TABLE_ROWS)))[:n]
    slots = iter(draw(st.permutations(range(1, SWA_SLOTS))))  # resident in the SWA pool of the "negative" loop
    requests = []
    for i, row in enumerate(rows):
        prefix = 2 if i == 0 else draw(st.integers(0, 2))
        extend = draw(st.integers(1, 2))
        requests.append(Request(row, prefix, extend, tuple(next(slots) for _ in range(prefix + extend))))
    ints = lambda lo, hi: st.integers(lo, hi)  # noqa: E731
    if padding == "negative":
        pad_row, pad_loc = st.tuples(ints(-9, -1), ints(-4, 20), ints(-4, 3)), ints(-9, -1)
    elif padding == "reserved":
        pad_row, pad_loc = st.tuples(st.just(0), st.just(0), ints(0, 2)), st.sampled_from([0, -1])
    else:
        pad_row, pad_loc = st.nothing(), ints(-9, 0)
    pad_rows = tuple(draw(pad_row) for _ in range(BATCH - n))
    pad_tokens = tuple(draw(st.tuples(ints(-5, 999), ints(-5, 50), pad_loc)) for _ in range(3))
    return requests, Padding(pad_rows, pad_tokens)


def _steps(requests, padding):
    return pack(prefill(requests), padding), pack(requests, padding)


@pytest.mark.parametrize("padding", PADDINGS)
@_SETTINGS
@given(data=st.data())
def test_valid_batches_are_silent_and_faults_are_found_at_their_slot(padding, data):
    lp = loop(padding)
    requests, pad = data.draw(scenarios(padding))
    step_a, step_b = _steps(requests, pad)
    kv, state = lp.run(step_a, step_b)
    assert_no_violations(state)

    # A page-table fault: position 1 of the first request mapped to its position-0 slot.
    first = requests[0]
    remapped = dataclasses.replace(step_b, req_to_token=testing.remap_slot(step_b.req_to_token, first.row, 1, first.slots[0]))  # fmt: skip
    state = lp.run(step_a, remapped)[1]
    v = expect_violation(state, tag="HEAD_K_FULL", reason=FailReason.VERIFY_POSITION_MISMATCH, slot=first.slots[0])
    assert (v.position, v.expected_position, v.request_row) == (0, 1, first.row)
    if lp.real_kv:  # a KV fault on a cached slot, before step B's forward
        _, _, slot = data.draw(st.sampled_from(_cached(requests)))
        kv, state = lp.run(step_a)
        kv = (testing.flip_kv_byte(kv[0], slot, page_size=PAGE_SIZE), kv[1])
        state = lp.run(step_b, kv=kv, state=state)[1]
        expect_violation(state, tag="TAIL_K_FULL", reason=FailReason.VERIFY_REAL_KV_HASH_MISMATCH, slot=slot)


def _token_entries(requests):
    """(request index, token entry, position) of every new token."""
    out, t = [], 0
    for i, r in enumerate(requests):
        out += [(i, t + k, r.prefix + k) for k in range(r.extend)]
        t += r.extend
    return out


_KINDS = ["rpi_past_table", "prefix_negative", "extend_negative", "past_context", "past_tokens", "loc_past_pool",
          "loc_reserved", "table_out_of_range", "table_reserved"]  # fmt: skip
_MUTATIONS = (
    [("negative", kind) for kind in _KINDS + ["lut_out_of_range"]]
    + [("reserved", kind) for kind in _KINDS + ["rpi_negative", "rpi_reserved_row"]]
    + [("none", kind) for kind in _KINDS + ["rpi_negative"]]  # a negative row is the "negative" padding marker
)


@st.composite
def mutations(draw, kind: str, requests):
    """One bad value of ``kind`` in step B's batch, and what its INVALID_INPUT row must say."""
    k = draw(st.integers(0, 3))
    i = draw(st.integers(0, len(requests) - 1))
    r = requests[i]
    start = sum(q.extend for q in requests[:i])
    row = dict(entry=i, request=-1, slot=-1, position=-1, limit=-1)  # a batch-row problem names no request
    arrays = {}
    if kind == "rpi_past_table":
        arrays["req_pool_indices"] = (i, TABLE_ROWS + k)
        want = dict(row, field="REQ_POOL_INDICES", problem="OUT_OF_RANGE", value=TABLE_ROWS + k, limit=TABLE_ROWS)
    elif kind == "rpi_negative":
        arrays["req_pool_indices"] = (i, -1 - k)
        want = dict(row, field="REQ_POOL_INDICES", problem="OUT_OF_RANGE", value=-1 - k, limit=TABLE_ROWS)
    elif kind == "rpi_reserved_row":
        arrays["req_pool_indices"] = (i, 0)
        want = dict(row, field="REQ_POOL_INDICES", problem="RESERVED_ROW", value=0)
    elif kind == "prefix_negative":
        arrays["prefix_lens"] = (i, -1 - k)
        want = dict(row, field="PREFIX_LENS", problem="NEGATIVE", value=-1 - k)
    elif kind == "extend_negative":
        arrays["extend_lens"] = (i, -1 - k)
        want = dict(row, field="EXTEND_LENS", problem="NEGATIVE", value=-1 - k)
    elif kind == "past_context":
        extend = CONTEXT - r.prefix + 1 + k
        arrays["extend_lens"] = (i, extend)
        want = dict(row, field="EXTEND_LENS", problem="PAST_CONTEXT", value=r.prefix + extend, limit=CONTEXT)
    elif kind == "past_tokens":
        extend = TOKENS - start + 1 + min(k, 1)  # prefix + extend stays within CONTEXT
        arrays["extend_lens"] = (i, extend)
        want = dict(row, field="EXTEND_LENS", problem="PAST_TOKENS", value=start + extend, limit=TOKENS)
    elif kind.startswith("loc"):
        _, t, pos = draw(st.sampled_from([e for e in _token_entries(requests) if e[0] == i]))
        value = NUM_SLOTS + k if kind == "loc_past_pool" else 0
        arrays["out_cache_loc"] = (t, value)
        problem = "OUT_OF_RANGE" if kind == "loc_past_pool" else "RESERVED_SLOT"
        want = dict(field="OUT_CACHE_LOC", problem=problem, value=value, entry=t, request=r.row, slot=value,
                    position=pos, limit=NUM_SLOTS)  # fmt: skip
    elif kind.startswith("table"):
        i, pos, _ = draw(st.sampled_from(_cached(requests)))
        r = requests[i]
        value = draw(st.sampled_from([NUM_SLOTS + k, -1 - k])) if kind == "table_out_of_range" else 0
        arrays["req_to_token"] = ((r.row, pos), value)
        problem = "OUT_OF_RANGE" if kind == "table_out_of_range" else "RESERVED_SLOT"
        want = dict(field="REQ_TO_TOKEN", problem=problem, value=value, entry=i, request=r.row, slot=value,
                    position=pos, limit=NUM_SLOTS)  # fmt: skip
    else:  # the SWA table maps a slot the SWA group checks (in the window) or writes past the SWA pool
        targets = [(i, r.prefix - 1, r.slots[r.prefix - 1], i) for i, r in enumerate(requests) if r.prefix]
        targets += [(i, pos, requests[i].slots[pos], t) for i, t, pos in _token_entries(requests)]
        i, pos, slot, entry = draw(st.sampled_from(targets))
        value = SWA_SLOTS + k
        arrays["full_to_swa_index_mapping"] = (slot, value)
        want = dict(field="FULL_TO_SWA_INDEX_MAPPING", problem="OUT_OF_RANGE", value=value, entry=entry,
                    request=requests[i].row, slot=slot, position=pos, limit=SWA_SLOTS)  # fmt: skip
    return arrays, want


def _mutate(batch, arrays):
    changes = {}
    for name, (index, value) in arrays.items():
        x = np.array(getattr(batch, name))
        x[index] = value
        changes[name] = x
    return dataclasses.replace(batch, **changes)


def _input_where(want) -> str:
    """How the report's ``input:`` line names the value (the wording of ``kvcanary_jax.core._explain``)."""
    field = want["field"].lower()
    if field == "req_to_token":
        return f"req_to_token[{want['request']}, {want['position']}] (batch row {want['entry']})"
    if field in ("out_cache_loc", "full_to_swa_index_mapping"):
        index = want["entry"] if field == "out_cache_loc" else want["slot"]
        return f"{field}[{index}] (request row {want['request']}, position {want['position']})"
    return f"{field}[{want['entry']}]"


@pytest.mark.parametrize(("padding", "kind"), _MUTATIONS)
@settings(_SETTINGS, max_examples=10)
@given(data=st.data())
def test_one_bad_value_gives_one_row_naming_it(padding, kind, data):
    """With the chain-position assert on, so that a request left half-written would be noticed too."""
    lp = loop(padding)
    requests, pad = data.draw(scenarios(padding))
    arrays, want = data.draw(mutations(kind, requests))
    step_a, step_b = _steps(requests, pad)
    state = lp.run(step_a, _mutate(step_b, arrays))[1]
    report = kc.read_violations(state.violation_log)
    assert report.write_index == 1, "\n".join(report.format())
    group = "SWA" if want["field"] == "FULL_TO_SWA_INDEX_MAPPING" else "FULL"  # the group's HEAD K launch
    v = expect_violation(report, tag=f"HEAD_K_{group}", reason=INVALID)
    assert v.fail_reason == INVALID
    assert v.reason_detail == InputField[want["field"]] | InputProblem[want["problem"]] << 8
    got = dict(value=v.stored_token, limit=v.expected_token, entry=v.stored_chain_hash, request=v.expected_aux,
               slot=v.slot_idx, position=v.position)  # fmt: skip
    assert got == {key: want[key] for key in got}
    message = kc.format_violation(v, total=1, overflowed=False)
    if want["problem"] == "PAST_TOKENS":  # the value is the rows' token count, named as such (issue 43)
        e = want["entry"]
        assert (f"  input: extend_lens[{e}]: the token entries of batch {f'rows 0..{e}' if e else 'row 0'} "
                f"(sum(extend_lens[:{e + 1}]) = {want['value']}) run past the {TOKENS} token entries of the batch "
                "(input_ids, positions, out_cache_loc)") in message  # fmt: skip
    else:
        assert f"  input: {_input_where(want)} = {want['value']} " in message


@pytest.mark.parametrize("padding", PADDINGS)
def test_a_bad_value_every_step_gives_one_row_every_step(padding):
    """A table entry that stays bad: reported again at each step, and nothing else (no storm from what it masks)."""
    lp = loop(padding)
    first = Request(1, 2, 1, (3, 4, 5, 6, 7))
    steps = [pack_padded(prefill([first]), padding)]
    for prefix in (2, 3, 4):  # decode steps; position 1 of the request maps to slot 99 from step 1 on
        batch = pack_padded([dataclasses.replace(first, prefix=prefix)], padding)
        steps.append(dataclasses.replace(batch, req_to_token=testing.remap_slot(batch.req_to_token, 1, 1, 99)))
    state = lp.run(*steps)[1]
    report = kc.read_violations(state.violation_log)
    assert [(v.fail_reason, v.slot_idx, v.position) for v in report.violations] == [(INVALID, 99, 1)] * 3


def test_request_row_zero_is_a_request_unless_reserved():
    """The issue's first trap: a request in table row 0 must be checked (or refused), never skipped."""
    request = Request(0, 2, 1, (3, 4, 5))
    step_a, step_b = pack_padded(prefill([request]), "negative"), pack_padded([request], "negative")
    lp = loop("negative")
    kv, state = lp.run(step_a)
    kv = (testing.flip_kv_byte(kv[0], 4, page_size=PAGE_SIZE), kv[1])
    state = lp.run(step_b, kv=kv, state=state)[1]
    expect_violation(state, tag="TAIL_K_FULL", reason=FailReason.VERIFY_REAL_KV_HASH_MISMATCH, slot=4)
    reserved = dataclasses.replace(step_b, req_pool_indices=np.array([0, 0, 0], np.int32))
    state = loop("reserved").run(reserved)[1]
    v = expect_violation(state, tag="HEAD_K_FULL", reason=INVALID)
    assert kc.read_violations(state.violation_log).write_index == 1
    assert "input: req_pool_indices[0] = 0 is the reserved padding row 0" in kc.format_violation(v, total=1, overflowed=False)  # fmt: skip


def test_a_dropped_slot_is_not_counted_as_written():
    """The issue's third trap: an out_cache_loc past the pool was dropped while the slot counter counted it."""
    lp = loop("none")
    requests = [Request(1, 0, 2, (3, 4)), Request(2, 0, 2, (5, 6)), Request(3, 0, 1, (7,))]
    batch = pack(requests)
    state = lp.run(_mutate(batch, {"out_cache_loc": (1, NUM_SLOTS)}))[1]
    slots = u64_pairs_as_int64(state.device.slot_run_counters)
    tag = kc.CanaryLaunchTag
    assert slots[tag.HEAD_K_FULL] == slots[tag.TAIL_K_FULL] == 3  # rows 1 and 2 written; row 0 not at all
    records = kc.records_as_int64(state.full.k_tail)
    assert records[[3, 4], 0].tolist() == [0, 0] and records[[5, 6, 7], 0].tolist() == [300, 301, 400]
    assert [v.slot_idx for v in kc.read_violations(state.violation_log).violations] == [NUM_SLOTS]


def test_window_and_table_sizes_of_the_loops():
    """What the scenarios above assume of the loops' shapes."""
    assert WINDOW == 1 and LUT[SWA_SLOTS - 1] == SWA_SLOTS - 1 and LUT[SWA_SLOTS] == 0
    assert loop("negative").canary.pool.swa.window == WINDOW and TOKENS >= 3 * 2 and CONTEXT >= TOKENS + 4
