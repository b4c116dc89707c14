"""Tests for the demo scheduler: pools, radix cache, batch layout and the invariants a canary relies on."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary_jax import demo
from kvcanary_jax.demo import batch as batch_lib
from kvcanary_jax.runtime import _sweep as sweep

SWA = {"swa_window": 24, "num_swa_slots": 256}
VARIANTS = {
    "plain": {},
    "spec_oracle": {"spec_prob": 0.3, "token_oracle": True},
    "swa_spec": dict(**SWA, spec_prob=0.3),
}


def check_batch(s: demo.Scheduler, b: demo.StepBatch) -> None:
    """Layout of one StepBatch: padding last, request-major tokens, tables consistent with the tokens."""
    c = s.config
    real = b.req_pool_indices != 0
    n = int(real.sum())
    assert real[:n].all() and not real[n:].any(), "padding rows must come after all real rows"
    assert (b.extend_lens[:n] > 0).all() and not b.extend_lens[n:].any() and not b.prefix_lens[n:].any()
    total = b.num_tokens
    assert total <= c.max_tokens and n <= c.max_batch
    for name in ("input_ids", "positions", "out_cache_loc", "swa_out_cache_loc"):
        assert not getattr(b, name)[total:].any(), f"padding tokens must have {name} == 0"
    loc = b.out_cache_loc[:total]
    assert (loc > 0).all() and len(np.unique(loc)) == total, "new tokens need distinct real slots"
    assert not b.req_to_token[0].any(), "request row 0 is the padding row"
    off = 0
    for r in range(n):
        row, p, e = b.req_pool_indices[r], b.prefix_lens[r], b.extend_lens[r]
        np.testing.assert_array_equal(b.positions[off : off + e], np.arange(p, p + e))
        np.testing.assert_array_equal(b.req_to_token[row, p : p + e], loc[off : off + e])
        np.testing.assert_array_equal(b.req_to_token_ids[row, p : p + e], b.input_ids[off : off + e])
        assert b.expected_tokens_valid_lens[r] == p + e
        off += e
    np.testing.assert_array_equal(b.swa_out_cache_loc, b.full_to_swa_index_mapping[b.out_cache_loc])
    if c.token_oracle:
        np.testing.assert_array_equal(b.expected_input_ids, b.input_ids)


def check_pools(s: demo.Scheduler) -> None:
    """Between steps: every slot is exactly one of free / cached in the tree / owned by one running request."""
    table = s.req_pool.req_to_token
    tree = s.radix.list_slots().slots
    own = [table[r.pool_row, r.cached_len : r.kv_len] for r in s.running]
    for r in s.running:
        ctx = table[r.pool_row, : r.kv_len]
        assert (ctx > 0).all() and len(np.unique(ctx)) == r.kv_len, f"request {r.rid} has bad/duplicate slots"
        assert s.slot_allocator.is_in_use(ctx).all(), f"request {r.rid} reads a freed slot"
        assert r.own_full == r.kv_len - r.cached_len
    held = np.concatenate([tree, *own])
    assert len(np.unique(held)) == len(held), "a slot is held twice (tree and/or requests)"
    assert s.slot_allocator.is_in_use(held).all()
    assert len(held) + s.slot_allocator.num_free == s.config.num_slots - 1, "slot leak"
    assert s.slot_allocator.num_free + s.radix.evictable_size() >= sum(r.full_budget - r.own_full for r in s.running)
    if s.swa_pool is None:
        return
    lut = s.swa_pool.lut
    resident = lut[lut != 0]
    assert lut[0] == 0 and len(np.unique(resident)) == len(resident)
    assert s.swa_pool.allocator.is_in_use(resident).all()
    assert len(resident) + s.swa_pool.num_free == s.config.num_swa_slots - 1, "SWA slot leak"
    assert not lut[np.flatnonzero(~s.slot_allocator.is_in_use(np.arange(s.config.num_slots)))].any()
    for r in s.running:
        window = table[r.pool_row, max(0, r.kv_len - s.config.swa_window) : r.kv_len]
        assert (lut[window] != 0).all(), f"request {r.rid} lost an SWA slot inside its window"


def run(steps: int, seed: int = 0, check: bool = True, **kw) -> demo.Scheduler:
    s = demo.Scheduler(demo.SchedulerConfig(**kw), seed=seed)
    rng = np.random.default_rng(seed + 1)
    for _ in range(steps):
        b = s.step()
        if check:
            check_batch(s, b)
        s.commit(rng.integers(0, s.config.vocab_size, s.config.max_batch, dtype=np.int32))
        if check:
            check_pools(s)
    return s


@pytest.mark.parametrize("variant", VARIANTS)
def test_300_step_run_exercises_everything(variant):
    s = run(300, **VARIANTS[variant])
    st_ = s.stats
    assert st_["prefix_hit_reqs"] > 0 and st_["prefix_hit_tokens"] > 0, "no prefix sharing"
    assert st_["evicted_slots"] > 0, "no eviction"
    assert (s.slot_allocator.alloc_counts > 1).sum() > 0, "no slot reuse"
    assert st_["chunked_prefill_rows"] > 0, "no chunked prefill"
    assert st_["finished"] > 10 and st_["decode_rows"] > 0
    if "spec_prob" in VARIANTS[variant]:
        assert st_["spec_rows"] > 0 and st_["spec_rejected_tokens"] > 0
    if "swa_window" in VARIANTS[variant]:
        assert st_["swa_window_freed"] > 0


def test_run_is_deterministic():
    a, b = run(60, seed=3, check=False), run(60, seed=3, check=False)
    np.testing.assert_array_equal(a.req_pool.req_to_token, b.req_pool.req_to_token)
    assert a.stats == b.stats


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=60))
def test_allocator_never_hands_out_padding_or_live_slots(ops):
    alloc, live = demo.SlotAllocator(16), []
    for is_alloc, n in ops:
        if is_alloc:
            got = alloc.alloc(n)
            if got is None:
                assert alloc.num_free < n
                continue
            assert 0 not in got and not set(got.tolist()) & set(live)
            live += got.tolist()
        elif live:
            alloc.free(np.array(live[:n]))
            live = live[n:]
        assert alloc.num_free + len(live) == 15


def test_allocator_rejects_double_free_and_padding():
    alloc = demo.SlotAllocator(8)
    slots = alloc.alloc(3)
    alloc.free(slots[:1])
    with pytest.raises(RuntimeError):
        alloc.free(slots[:1])
    with pytest.raises(RuntimeError):
        alloc.free(np.array([0]))


def test_radix_match_split_lock_evict():
    r, freed = demo.RadixCache(), []
    assert r.insert([1, 2, 3, 4], np.array([11, 12, 13, 14])) == 0
    assert r.insert([1, 2, 9], np.array([21, 22, 29])) == 2  # caller owns 21, 22 again
    slots, node = r.match_prefix([1, 2, 3, 7])
    np.testing.assert_array_equal(slots, [11, 12, 13])
    r.inc_lock(node)
    assert r.evictable_size() == 2  # leaves [14] and [29]
    assert r.evict(100, freed.append) == 2
    assert sorted(np.concatenate(freed).tolist()) == [14, 29]
    r.dec_lock(node)
    assert r.evict(100, freed.append) == 3 and r.total_size() == 0


def test_sweep_entries_follow_tree_paths():
    s = run(120, seed=5, check=False)
    e = s.sweep_entries()
    assert len(e.slots) == s.radix.total_size() > 0
    pos_of = dict(zip(e.slots.tolist(), e.positions.tolist(), strict=True))
    for _slot, pos, prev in zip(*e, strict=True):
        assert (prev == -1) == (pos == 0)
        assert prev == -1 or pos_of[prev] == pos - 1
    idle = s.sweep_entries(unlocked_only=True)
    assert set(idle.slots.tolist()) <= set(e.slots.tolist())
    locked = {int(x) for r in s.running for x in s.req_pool.req_to_token[r.pool_row, : r.cached_len]}
    assert not locked & set(idle.slots.tolist())


def test_swa_sweep_translates_through_lut():
    s = run(120, seed=2, check=False, **SWA)
    lut = s.full_to_swa_index_mapping
    full = s.sweep_entries()
    swa = sweep.translate_entries(full, lut)
    keep = lut[full.slots] != 0
    assert 0 < keep.sum() < len(keep), "expected both resident and tombstoned cached slots"
    np.testing.assert_array_equal(swa.slots, lut[full.slots[keep]])
    np.testing.assert_array_equal(swa.positions, full.positions[keep])
    assert ((swa.prev_slots == -1) == (swa.positions == 0)).all()


def test_oracle_mode_emits_oracle_tokens():
    s = demo.Scheduler(demo.SchedulerConfig(token_oracle=True), seed=0)
    for _ in range(40):
        s.step()
        s.commit(None)
    for r in s.running:
        for p in range(r.prompt_len, len(r.tokens)):
            assert r.tokens[p] == batch_lib.oracle_token(r.rid, p, s.config.vocab_size)


def test_misuse_raises():
    with pytest.raises(ValueError, match="max_reqs"):
        demo.SchedulerConfig(max_reqs=4)
    with pytest.raises(ValueError, match="swa_window"):
        demo.SchedulerConfig(swa_window=8)
    s = demo.Scheduler(demo.SchedulerConfig(), seed=0)
    with pytest.raises(RuntimeError):
        s.commit(np.zeros(8, np.int32))
    s.step()
    with pytest.raises(RuntimeError):
        s.step()
    with pytest.raises(ValueError, match="next_tokens"):
        s.commit(None)
