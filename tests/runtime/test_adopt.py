"""``KvCanary.adopt``: a warm engine's cached slots get the records the canary's own writes would have stored."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import FailReason, InputField, InputProblem, read_violations, testing
from kvcanary_jax.runtime import _adopt

NUM_SLOTS, PAGE, MAX_REQS, WIDTH = 32, 4, 4, 16
CONFIG = kc.CanaryConfig(mode="log", ring_capacity=16, real_kv_hash_mode="all", backend="xla")
CANARY = kc.KvCanary(CONFIG, kc.CanaryPool(num_slots=NUM_SLOTS, page_size=PAGE))
KV_K = jax.random.normal(jax.random.key(0), (NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32)
KV_V = jax.random.normal(jax.random.key(1), (NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32)

# Two requests: A (row 0) at slots 3..9 and B (row 1) sharing A's first three slots, then 12..14.
SLOTS = {0: [3, 4, 5, 6, 7, 8, 9, 10], 1: [3, 4, 5, 12, 13, 14, 15]}
TOKENS = {0: [11, 12, 13, 14, 15, 16, 17, 18], 1: [11, 12, 13, 21, 22, 23, 24]}
# Each step: (row, prefix_len, extend_len); the tokens' positions are prefix_len .. prefix_len + extend_len - 1.
STEPS = [[(0, 0, 5)], [(0, 5, 1), (1, 3, 2)], [(0, 6, 1), (1, 5, 1)]]


def _table():
    table = np.zeros((MAX_REQS, WIDTH), np.int32)
    for row, slots in SLOTS.items():
        table[row, : len(slots)] = slots
    return table


def _batch(step, bs=3, num_tokens=8) -> kc.CanaryBatch:
    rows, prefix, extend = np.full(bs, -1, np.int32), np.zeros(bs, np.int32), np.zeros(bs, np.int32)
    ids, pos, loc = (np.full(num_tokens, f, np.int32) for f in (0, 0, -1))
    t = 0
    for b, (row, p, n) in enumerate(step):
        rows[b], prefix[b], extend[b] = row, p, n
        ids[t : t + n], pos[t : t + n] = TOKENS[row][p : p + n], np.arange(p, p + n)
        loc[t : t + n] = SLOTS[row][p : p + n]
        t += n
    return kc.CanaryBatch(rows, prefix, extend, _table(), ids, pos, loc)


@jax.jit
def _step(state, batch):
    state = CANARY.before_forward(state, batch)
    return CANARY.after_forward(state, batch, CANARY.kv_sources(full_k=KV_K, full_v=KV_V))


@functools.partial(jax.jit, static_argnames="canary")
def _adopt_jit(state, plan, canary=CANARY):
    return canary.adopt(state, plan, canary.kv_sources(full_k=KV_K, full_v=KV_V))


def _served(steps=STEPS):
    state = CANARY.mark_init_finished(CANARY.init_state())
    for step in steps:
        state = _step(state, _batch(step))
    return state


def _cached_entries():
    """What the engine holds after STEPS: A's first 7 positions, B's first 6 (its last token not written yet)."""
    parts = [kc.AdoptEntries.from_request(SLOTS[r], TOKENS[r], n) for r, n in ((0, 7), (1, 6))]
    return kc.AdoptEntries.merge(*parts)


def _buffers(state):
    return jax.tree.leaves(state.full)


def test_adopted_records_are_byte_identical_to_the_canary_s_own_writes():
    served = _served()
    assert not read_violations(served.violation_log).is_errored
    adopted = _adopt_jit(CANARY.init_state(), CANARY.adopt_plan(_cached_entries()))
    chex.assert_trees_all_equal(_buffers(adopted), _buffers(served))
    assert not read_violations(adopted.violation_log).is_errored
    # and the adopted slots hold what was written: a sample record, by hand
    assert kc.records_as_int64(adopted.full.k_tail)[13][:2].tolist() == [22, 4]


def test_entries_in_any_order_of_predecessors_first_give_the_same_bytes():
    e = _cached_entries()
    order = np.r_[0:3, 7:10, 3:7]  # B's own slots before A's: each predecessor still comes first
    shuffled = kc.AdoptEntries(*(np.asarray(x)[order] for x in e))
    a = _adopt_jit(CANARY.init_state(), CANARY.adopt_plan(shuffled))
    chex.assert_trees_all_equal(_buffers(a), _buffers(_served()))


def test_interpret_backend_gives_the_same_bytes():
    canary = dataclasses.replace(CANARY, config=dataclasses.replace(CONFIG, backend="interpret"))
    a = _adopt_jit(canary.init_state(), canary.adopt_plan(_cached_entries(), capacity=16), canary=canary)
    chex.assert_trees_all_equal(_buffers(a), _buffers(_served()))


def test_serving_on_after_adoption_is_silent_and_a_later_fault_is_caught():
    state = _adopt_jit(CANARY.mark_init_finished(CANARY.init_state()), CANARY.adopt_plan(_cached_entries()))
    state = _step(state, _batch([(0, 7, 1), (1, 6, 1)]))  # the next decode of both requests
    assert not read_violations(state.violation_log).is_errored
    kv_k = testing.flip_kv_byte(KV_K, np.int32(12), page_size=PAGE)
    sweep = CANARY.sweep_plan(kc.SweepEntries(np.array([3, 4, 12]), np.array([0, 1, 3]), np.array([-1, 3, 5])))
    state = jax.jit(lambda s, p, k: CANARY.sweep(s, p, CANARY.kv_sources(full_k=k, full_v=KV_V)))(state, sweep, kv_k)
    (v,) = read_violations(state.violation_log).violations
    assert (v.slot_idx, v.position, v.fail_reason) == (12, 3, FailReason.VERIFY_REAL_KV_HASH_MISMATCH)


def test_host_misuse_is_named():
    e = _cached_entries()
    cases = [
        (e._replace(slots=np.r_[0, e.slots[1:]].astype(np.int32)), r"SweepEntries.slots\[0\] = 0 is out of range"),
        (e._replace(slots=np.r_[NUM_SLOTS, e.slots[1:]].astype(np.int32)), r"slots\[0\] = 32 is out of range"),
        (e._replace(prev_slots=np.r_[-1, 30, e.prev_slots[2:]].astype(np.int32)),
         r"prev_slots\[1\] = 30 is not an earlier entry's slot"),
        (kc.AdoptEntries(*(np.asarray(x)[::-1] for x in e)), r"prev_slots\[0\] = .* is not an earlier entry's slot"),
        (e._replace(positions=np.r_[0, 2, e.positions[2:]].astype(np.int32)),
         r"positions\[1\] = 2, but its predecessor's position \+ 1 is 1"),
        (e._replace(slots=np.r_[e.slots[:2], 3, e.slots[3:]].astype(np.int32)), r"slots\[2\] = 3 is given twice"),
        (e._replace(tokens=e.tokens[:-1]), "AdoptEntries.tokens has 9 entries, slots 10"),
    ]  # fmt: skip
    for entries, message in cases:
        with pytest.raises(ValueError, match=message):
            CANARY.adopt_plan(entries)
    with pytest.raises(ValueError, match="exceed the plan's capacity of 4"):
        CANARY.adopt_plan(e, capacity=4)
    with pytest.raises(ValueError, match=r"slot 3 is given twice with different entries: \(token, position"):
        kc.AdoptEntries.merge(e, kc.AdoptEntries.from_request([3], [99], 1))
    with pytest.raises(ValueError, match=r"length must be an int in .* = \[0, 2\]; got length=3"):
        kc.AdoptEntries.from_request([3, 4], [1, 2], 3)
    with pytest.raises(TypeError, match="plan must be an AdoptPlan"):
        CANARY.adopt(CANARY.init_state(), e, CANARY.kv_sources(full_k=KV_K, full_v=KV_V))
    bad_plan = dataclasses.replace(CANARY.adopt_plan(e), tokens=jnp.zeros(NUM_SLOTS, jnp.float32))
    with pytest.raises(TypeError, match=r"plan.tokens must have dtype int32"):
        CANARY.adopt(CANARY.init_state(), bad_plan, CANARY.kv_sources(full_k=KV_K, full_v=KV_V))
    with pytest.raises(ValueError, match="has no full_v source"):
        CANARY.adopt(CANARY.init_state(), CANARY.adopt_plan(e), CANARY.kv_sources(full_k=KV_K))
    swa_pool = kc.CanaryPool(num_slots=NUM_SLOTS, page_size=PAGE, swa=kc.SwaGroup(num_slots=8, window=4))
    swa = kc.KvCanary(CONFIG, swa_pool)
    with pytest.raises(NotImplementedError, match="adopt_plan covers the FULL pool only"):
        swa.adopt_plan(e)
    with pytest.raises(NotImplementedError, match="adopt covers the FULL pool only"):
        swa.adopt(swa.init_state(), CANARY.adopt_plan(e), swa.kv_sources(full_k=KV_K, full_v=KV_V))


def test_device_entries_that_cannot_be_adopted_are_invalid_input_rows():
    # entry 0: slot 0; entry 1: prev 40 (out of range); 2 -> 3 -> 2: a cycle; entry 4 follows the rejected entry 0.
    columns = dict(
        slots=[0, 6, 7, 8, 9], tokens=[1, 2, 3, 4, 5], positions=[0, 1, 1, 2, 1], prev_slots=[-1, 40, 8, 7, 0]
    )
    plan = _adopt.AdoptPlan(**{k: jnp.array(v + [0] * (NUM_SLOTS - 5), jnp.int32) for k, v in columns.items()},
                            num_valid=jnp.array([5], jnp.int32))  # fmt: skip
    state = _adopt_jit(CANARY.init_state(), plan)
    got = [
        (v.fail_reason, InputField(v.reason_detail & 0xFF), InputProblem(v.reason_detail >> 8), v.stored_token,
         v.slot_idx, v.stored_chain_hash)
        for v in read_violations(state.violation_log).violations
    ]  # fmt: skip
    bad = FailReason.INVALID_INPUT
    assert got == [
        (bad, InputField.ADOPT_SLOTS, InputProblem.RESERVED_SLOT, 0, -1, 0),
        (bad, InputField.ADOPT_PREV_SLOTS, InputProblem.OUT_OF_RANGE, 40, 6, 1),
        (bad, InputField.ADOPT_PREV_SLOTS, InputProblem.RESERVED_SLOT, 0, 9, 4),
        (bad, InputField.ADOPT_PREV_SLOTS, InputProblem.UNADOPTED, 8, 7, 2),
        (bad, InputField.ADOPT_PREV_SLOTS, InputProblem.UNADOPTED, 7, 8, 3),
    ]
    chex.assert_trees_all_equal(_buffers(state), _buffers(CANARY.init_state()))  # nothing written
    assert "adopt_prev_slots[2] = 8 was never adopted" in "\n".join(read_violations(state.violation_log).format())
