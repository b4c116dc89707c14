"""KvCanary's API: state layout, off mode, argument checks, and the records every step shape leaves behind."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import (
    CanaryBatch,
    CanaryConfig,
    CanaryLaunchTag,
    CanaryPool,
    CanaryState,
    FailReason,
    KvCanary,
    KvSources,
    SwaGroup,
    SweepEntries,
    read_violations,
    records_as_int64,
    testing,
)
from kvcanary_jax.demo import batch as batch_lib
from tests.runtime.runner_testlib import TINY_CANARY, TINY_CONFIG, TINY_LAYOUT, TINY_SCHED, TINY_STEP, tiny_build

T = CanaryLaunchTag
SWA_POOL = CanaryPool(num_slots=64, page_size=4, swa=SwaGroup(num_slots=32, window=6), max_reqs=5, max_context_len=24)


def _tiny_batch(n_tokens=2, lut=None) -> CanaryBatch:
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return CanaryBatch(
        req_pool_indices=np.array([1, 0], np.int32),
        prefix_lens=i32(2),
        extend_lens=np.array([n_tokens, 0], np.int32),
        req_to_token=i32(5, 24),
        input_ids=i32(n_tokens),
        positions=np.arange(n_tokens, dtype=np.int32),
        out_cache_loc=np.arange(1, n_tokens + 1, dtype=np.int32),
        full_to_swa_index_mapping=lut,
    )


def test_state_layout_and_launch_tags():
    canary = KvCanary(CanaryConfig(sweep_interval=2), SWA_POOL)
    state = canary.init_state()
    assert isinstance(state, CanaryState)
    assert state.full.k_head.shape == state.full.v_tail.shape == (64, 4, 2)
    assert state.swa.k_tail.shape == (32, 4, 2) and state.swa.v_head is not None
    assert int(state.device.enable_chain_position_assert[0]) == 0, "warm-up: the chain-position assert starts off"
    assert int(canary.mark_init_finished(state).device.enable_chain_position_assert[0]) == 1
    assert canary.launch_tags() == tuple(T)  # all 12
    k_only = KvCanary(CanaryConfig(), dataclasses.replace(SWA_POOL, with_v=False))
    assert k_only.launch_tags() == (T.HEAD_K_FULL, T.TAIL_K_FULL, T.HEAD_K_SWA, T.TAIL_K_SWA)
    assert k_only.init_state().full.v_head is None


def test_off_mode_functions_are_identity():
    canary = KvCanary(CanaryConfig(mode="off"), SWA_POOL)
    state = canary.init_state()
    batch = _tiny_batch()
    assert canary.before_forward(state, batch) is state
    assert canary.after_forward(state, batch, KvSources()) is state
    assert canary.sweep(state, None, KvSources()) is state
    assert state.full is None and state.swa is None


def test_argument_errors_teach():
    canary = KvCanary(CanaryConfig(real_kv_hash_mode="none"), SWA_POOL)  # KvSources() below: no real KV
    state = canary.init_state()
    with pytest.raises(TypeError, match="CanaryState"):
        canary.before_forward(object(), _tiny_batch())
    with pytest.raises(TypeError, match="CanaryBatch"):
        canary.before_forward(state, {"input_ids": 1})
    with pytest.raises(ValueError, match="full_to_swa_index_mapping"):
        canary.before_forward(state, _tiny_batch())
    asserting = KvCanary(CanaryConfig(enable_write_input_assert=True), TINY_CANARY.pool)
    with pytest.raises(ValueError, match="expected_input_ids"):
        asserting.before_forward(asserting.init_state(), _tiny_batch())
    verifying = KvCanary(CanaryConfig(enable_verify_token_assert=True), TINY_CANARY.pool)
    with pytest.raises(ValueError, match="token_ids"):
        verifying.before_forward(verifying.init_state(), _tiny_batch())
    with pytest.raises(ValueError, match="max_reqs=..., max_context_len"):
        KvCanary(CanaryConfig(enable_verify_token_assert=True), CanaryPool(num_slots=8))
    real_kv = KvCanary(CanaryConfig(real_kv_hash_mode="partial"), TINY_CANARY.pool)
    sources = real_kv.kv_sources(full_k=jnp.zeros((16, 4, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match="no full_v source"):
        real_kv.after_forward(real_kv.init_state(), _tiny_batch(), sources)
    with pytest.raises(ValueError, match="no SWA group"):
        real_kv.kv_sources(swa_k=jnp.zeros((4, 4, 16)))
    with pytest.raises(ValueError, match="CanaryPool.num_slots"):
        CanaryPool(num_slots=0)
    with pytest.raises(ValueError, match="SwaGroup.window"):
        SwaGroup(num_slots=8, window=0)
    with pytest.raises(TypeError, match="SweepPlan"):
        canary.sweep(state, object(), KvSources())


def test_kv_sources_use_the_group_page_size():
    sources = KvCanary(CanaryConfig(), SWA_POOL).kv_sources(
        full_k=jnp.zeros((16, 4, 2, 8), jnp.bfloat16), swa_k=jnp.zeros((8, 4, 2, 8), jnp.bfloat16)
    )
    (full,), (swa,) = sources.full_k, sources.swa_k
    assert (full.page_size, full.num_bytes_per_token, full.read_bytes) == (4, 32, 32)
    assert swa.page_size == 4 and sources.full_v == ()


def test_sweep_plan_checks_capacity_and_table():
    canary = KvCanary(CanaryConfig(), SWA_POOL)
    entries = SweepEntries(*(np.array(x, np.int32) for x in ([1, 2, 3], [0, 1, 2], [-1, 1, 2])))
    with pytest.raises(ValueError, match="full_to_swa_index_mapping"):
        canary.sweep_plan(entries)
    big = SweepEntries(*(np.ones(65, np.int32) for _ in range(3)))
    with pytest.raises(ValueError, match="65 entries exceed the sweep capacity of 64"):
        canary.sweep_plan(big, np.zeros(65, np.int32))
    plan = canary.sweep_plan(entries, np.arange(65, dtype=np.int32) % 2)
    assert int(plan.full.num_valid[0]) == 3 and int(plan.swa.num_valid[0]) == 2  # slots 1 and 3 are SWA-resident


class _Script:
    """Hand-written steps for the tiny configuration: one (pool_row, prefix, tokens, slots) tuple per batch row."""

    def __init__(self):
        self.setup = tiny_build()
        sc = self.setup.scheduler.config
        self.table = np.zeros((sc.max_reqs, sc.max_context_len), np.int32)
        self.ids = np.zeros_like(self.table)
        self.lut = np.zeros(sc.num_slots + 1, np.int32)

    def step(self, rows, *, positions_shift=0):
        for row, prefix, tokens, slots in rows:
            self.table[row, prefix : prefix + len(tokens)] = slots
            self.ids[row, prefix : prefix + len(tokens)] = tokens
        packed = [(row, prefix, tokens, tokens, np.array(slots, np.int32)) for row, prefix, tokens, slots in rows]
        batch = batch_lib.pack_step_batch(
            packed,
            max_batch=TINY_SCHED["max_batch"],
            max_tokens=TINY_SCHED["max_tokens"],
            req_to_token=self.table,
            req_to_token_ids=self.ids,
            lut=self.lut,
        )
        batch = dataclasses.replace(batch, positions=batch.positions + positions_shift * (batch.out_cache_loc > 0))
        s = self.setup
        _, _, s.kv_cache, s.canary_state = TINY_STEP(s.params, s.kv_cache, s.canary_state, batch)
        return read_violations(s.canary_state.violation_log)


def _chain(tokens):
    """Host oracle: the PREV_HASH stored at each position of a chain of ``tokens`` from position 0."""
    prev, out = testing.anchor_hash(), []
    for pos, tok in enumerate(tokens):
        out.append(prev)
        prev = testing.chain_hash(prev, tok, pos)
    return out


def test_every_step_shape_leaves_the_chain_sglang_would():
    """Chunked prefill, prefill, decode, speculative target-verify (then a rejection) and draft-extend shapes."""
    s = _Script()
    a, b = [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]
    steps = [
        [(1, 0, a[:4], [10, 11, 12, 13]), (2, 0, b[:3], [20, 21, 22])],  # chunk 1 of A, whole prompt of B
        [(1, 4, a[4:6], [14, 15]), (2, 3, b[3:4], [23])],  # chunk 2 of A, decode of B
        [(1, 6, a[6:7], [16]), (2, 4, [b[4], 99, 98], [24, 25, 26])],  # decode; target-verify with 2 drafts
        [(2, 5, b[5:7], [27, 28]), (1, 7, a[7:8], [17])],  # drafts rejected: draft-extend from prefix 5; decode
    ]
    s.setup.canary_state = s.setup.canary.mark_init_finished(s.setup.canary_state)
    for rows in steps:
        assert s.step(rows).write_index == 0
    state = s.setup.canary_state
    head, tail = records_as_int64(state.full.k_head), records_as_int64(state.full.k_tail)
    slots_a, slots_b = [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 27, 28]
    for slots, tokens in ((slots_a, a), (slots_b, b[:5] + b[5:7])):
        want = np.array(
            [[t, p, testing.to_signed(h)] for p, (t, h) in enumerate(zip(tokens, _chain(tokens), strict=True))]
        )
        np.testing.assert_array_equal(head[slots, :3], want)
        np.testing.assert_array_equal(tail[slots, :3], want)
        np.testing.assert_array_equal(records_as_int64(state.full.v_head)[slots], head[slots])
    assert not head[:, 3].any(), "HEAD records carry no real-KV hash"
    # TAIL: REAL_KV_HASH is the ALL-mode fold of layer 0's K bytes of the slot (64 bytes, page_size 4).
    k0 = np.asarray(s.setup.kv_cache.k[0]).view(np.uint8).reshape(-1, TINY_LAYOUT.page_size, 64)
    for slot in slots_a + slots_b:
        folded = testing.fold_sources([k0[slot // 4, slot % 4].tobytes()])
        assert tail[slot, 3] == testing.to_signed(folded)


@pytest.mark.parametrize("armed", [False, True], ids=["warm-up", "after-init"])
def test_chain_position_assert_is_a_device_flag(armed):
    s = _Script()
    if armed:
        s.setup.canary_state = s.setup.canary.mark_init_finished(s.setup.canary_state)
    assert s.step([(1, 0, [5, 6, 7], [3, 4, 5])]).write_index == 0
    report = s.step([(1, 3, [8], [6])], positions_shift=1)  # position 4 after position 2
    if not armed:
        assert report.write_index == 0
        return
    first = report.first_violation
    assert (first.launch_tag, first.fail_reason, first.position, first.expected_aux) == (
        T.HEAD_K_FULL,
        FailReason.WRITE_POSITION_MISMATCH,
        4,
        3,
    )
    assert report.write_index == 4  # HEAD/TAIL x K/V writes each report it


def test_tiny_configuration_is_what_the_tests_assume():
    assert TINY_CANARY.config == TINY_CONFIG and TINY_CANARY.pool.swa is None and TINY_CANARY.pool.with_v


@pytest.mark.parametrize("ring_capacity", [8, 64], ids=["overflows-mid-phase", "room-for-all"])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_a_phase_equals_sglangs_launch_sequence(ring_capacity, backend):
    """The runner batches a phase's ring appends; ring, index, counters and buffers must equal the public ops run
    one launch at a time in SGLang's order (verify K, write K, verify V, write V), overflow included."""
    canary = KvCanary(
        CanaryConfig(mode="log", ring_capacity=ring_capacity, enable_write_input_assert=True, backend=backend),
        CanaryPool(num_slots=64, page_size=4, verify_capacity=16),
    )
    state = canary.mark_init_finished(canary.init_state())
    rng = np.random.default_rng(0)
    # Random records: every verified entry fails, so both verifies append, and the K and V rows differ.
    full = state.full
    k_head = jnp.asarray(rng.integers(0, 2**32, full.k_head.shape, dtype=np.uint32))
    v_head = jnp.asarray(rng.integers(0, 2**32, full.v_head.shape, dtype=np.uint32))
    state = dataclasses.replace(state, full=dataclasses.replace(full, k_head=k_head, v_head=v_head))
    req_to_token = np.zeros((4, 8), np.int32)
    req_to_token[1, :4], req_to_token[2, :3] = [5, 9, 13, 17], [6, 10, 14]
    batch = CanaryBatch(
        req_pool_indices=np.array([1, 2, 0], np.int32),
        prefix_lens=np.array([3, 2, 0], np.int32),
        extend_lens=np.array([1, 1, 0], np.int32),
        req_to_token=req_to_token,
        input_ids=np.array([7, 8], np.int32),
        positions=np.array([3, 2], np.int32),
        out_cache_loc=np.array([17, 14], np.int32),
        expected_input_ids=np.array([7, 1], np.int32),  # the second token fails the input assert
    )
    got = canary.before_forward(state, batch)

    verify_plan, write_plan = kc.build_plans(
        *(jnp.asarray(x) for x in (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, req_to_token)),
        verify_capacity=16,
        write_req_capacity=3,
    )
    device, bufs = state.device, {"K": k_head, "V": v_head}
    tokens = (jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), jnp.asarray(batch.out_cache_loc))
    for half in ("K", "V"):
        tag = T[f"HEAD_{half}_FULL"]
        device = kc.canary_verify(device, bufs[half], verify_plan, tag=tag, backend=backend)
        bufs[half], device = kc.canary_write(
            device,
            bufs[half],
            write_plan,
            *tokens,
            tag=tag,
            expected_input_tokens=jnp.asarray(batch.expected_input_ids),
            expected_input_positions=tokens[1],
            backend=backend,
        )
    # Per half: 5 verified entries fail; the write has 1 input-assert row and 2 chain-position rows (random seeds).
    assert int(device.violation_log.violation_write_index[0]) == 2 * (5 + 1 + 2)
    # The ring's context (ours) differs: the runner knows each row's request, the public ops do not.
    without_context = lambda d: dataclasses.replace(  # noqa: E731
        d, violation_log=dataclasses.replace(d.violation_log, violation_context=None)
    )
    chex.assert_trees_all_equal(without_context(got.device), without_context(device))
    rows = min(ring_capacity, 16)
    context = np.asarray(got.device.violation_log.violation_context)[:rows]
    # Verify K rows (entries of request rows 1, 1, 1, 2, 2), then write K rows: token 0's chain row (row 1),
    # token 1's input-assert and chain rows (row 2).
    want_requests = [1, 1, 1, 2, 2, 1, 2, 2]
    assert context[: min(rows, 8), 0].tolist() == want_requests[: min(rows, 8)]
    assert (np.asarray(device.violation_log.violation_context)[:rows, 0] == -1).all()
    chex.assert_trees_all_equal((got.full.k_head, got.full.v_head), (bufs["K"], bufs["V"]))


def test_fence_passes_values_through_behind_a_barrier():
    """``fence`` changes no value, and the compiled step keeps the barrier that orders the forward."""
    state, kv = TINY_CANARY.init_state(), jnp.arange(6.0)
    fenced = kc.fence(state, kv)
    chex.assert_trees_all_equal(fenced, (state, kv))
    text = jax.jit(lambda s, x: kc.fence(s, x * 2)).lower(state, kv).as_text()
    assert "optimization_barrier" in text
