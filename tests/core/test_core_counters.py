"""Per-tag u64 counters: +1 per launch (disabled and empty ones too), + active/written entries, carry across 2^32."""

import dataclasses

import chex

import kvcanary_jax as kc
from tests.core.canary_testlib import (
    NUM_TOKENS,
    TAG_HEAD,
    TAG_TAIL,
    U64,
    counters,
    jit_verify,
    jit_write,
    new_buf,
    new_state,
    u64_pairs,
    verify_plan,
    write_batch,
)


def _verify(state, plan):
    return jit_verify(state, new_buf(), plan, tag=TAG_TAIL, check_expected_token=False, backend="xla")


def _write(state, requests, **kwargs):
    plan, ids, pos, loc = write_batch(requests, **kwargs)
    return jit_write(state, new_buf(), plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")[1]


def test_every_launch_counts_even_when_disabled_or_empty():
    state = new_state()
    state = _verify(state, verify_plan([1, 2, 3], [0, 0, 0], [0, 0, 0], enable=0))  # disabled: +1 launch, +0
    state = _verify(state, verify_plan([], [], []))  # empty plan
    state = _write(state, [])  # no requests
    state = _write(state, [(-1, [(5, 1, 0)])], num_valid_reqs=0)  # a request, but not valid
    state = _write(state, [(-1, [(-1, 1, 0), (-1, 2, 1)])])  # only skipped entries
    kernel, slots = counters(state)
    assert kernel[TAG_TAIL] == 2 and kernel[TAG_HEAD] == 3
    assert sum(kernel) == 5 and sum(slots) == 0


def test_slot_counters_add_active_and_written_entries():
    state = new_state()
    state = _verify(state, verify_plan([0, 4, 0, 7], [0, 0, 0, 0], [0, 0, 0, 0]))  # slot-0 entries count too
    state = _verify(state, verify_plan([1, 2, 3], [0, 0, 0], [0, 0, 0], num_valid=2))
    state = _write(state, [(-1, [(5, 1, 0), (-1, 2, 1), (6, 3, 1)]), (-1, [(8, 1, 0)])])
    state = _write(state, [(-1, [(9, 1, 0)] * NUM_TOKENS)])
    kernel, slots = counters(state)
    assert (kernel[TAG_TAIL], slots[TAG_TAIL]) == (2, 4 + 2)
    assert (kernel[TAG_HEAD], slots[TAG_HEAD]) == (2, 3 + NUM_TOKENS)
    assert [k for k, v in enumerate(kernel) if v] == [TAG_HEAD, TAG_TAIL]


def test_counters_carry_across_2_pow_32():
    state = new_state()
    near = [0] * kc.NUM_LAUNCH_TAGS
    near[TAG_TAIL] = 2**32 - 1
    near[TAG_HEAD] = 2**32 - 2
    state = dataclasses.replace(state, kernel_run_counters=u64_pairs(near), slot_run_counters=u64_pairs(near))
    assert counters(state)[0] == near  # the helper's layout round-trips
    state = _verify(state, verify_plan([1, 2, 3, 4, 5], [0] * 5, [0] * 5))
    state = _write(state, [(-1, [(s, 1, s) for s in range(1, 6)])])
    kernel, slots = counters(state)
    assert kernel[TAG_TAIL] == 2**32 and slots[TAG_TAIL] == 2**32 + 4
    assert kernel[TAG_HEAD] == 2**32 - 1 and slots[TAG_HEAD] == 2**32 + 3
    # A counter far above 2^32 keeps adding in both words.
    high = [(7 << 40) | (2**32 - 1)] * kc.NUM_LAUNCH_TAGS
    state = dataclasses.replace(state, slot_run_counters=u64_pairs(high))
    state = _verify(state, verify_plan([1, 2], [0, 0], [0, 0]))
    assert counters(state)[1][TAG_TAIL] == ((7 << 40) + 2**32 + 1) & U64
    assert counters(state)[1][TAG_HEAD] == high[TAG_HEAD]


def test_counter_updates_leave_the_rest_of_the_state_alone():
    state = new_state()
    after = _verify(state, verify_plan([3], [0], [0]))
    assert after.enable_chain_position_assert.tolist() == [1]
    chex.assert_trees_all_equal(after.req_to_verify_expected_tokens, state.req_to_verify_expected_tokens)
    after = _write(after, [(-1, [(4, 1, 0)])])
    chex.assert_trees_all_equal(after.enable_chain_position_assert, state.enable_chain_position_assert)
    chex.assert_trees_all_equal(after.req_to_verify_expected_tokens, state.req_to_verify_expected_tokens)
    chex.assert_trees_all_equal(after.violation_log, state.violation_log)
