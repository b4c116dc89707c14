"""Whole steps (plans -> verify -> write) under one donated jit: a clean run is silent, never retraces, and gives
identical results with x64 on and off."""

import chex
import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary_jax as kc
from kvcanary_jax.core import _constants as constants
from tests.core.canary_testlib import (
    NUM_SLOTS,
    NUM_TOKENS,
    POOL_CTX,
    POOL_ROWS,
    TAG_HEAD,
    VCAP,
    WCAP,
    counters,
    empty_records,
    i32,
    new_buf,
    new_state,
    oracle_plans,
    oracle_verify,
    oracle_write,
    padded,
    records,
    ring_rows,
    u64_pairs,
    write_index,
)


def _step(state, buf, rpi, prefix, extend, req_to_token, input_ids, positions, out_cache_loc):
    """One decode-loop step of the HEAD endpoint: in-graph plans, verify the history, write this step's tokens."""
    verify_plan, write_plan = kc.build_plans(
        rpi, prefix, extend, req_to_token, verify_capacity=VCAP, write_req_capacity=WCAP
    )
    state = kc.canary_verify(state, buf, verify_plan, tag=TAG_HEAD, backend="xla")
    buf, state = kc.canary_write(
        state, buf, write_plan, input_ids, positions, out_cache_loc, tag=TAG_HEAD, backend="xla"
    )
    return state, buf


# Donated and trace-counted: any retrace with new values (same shapes) fails the test that caused it.
counted_step = jax.jit(chex.assert_max_traces(_step, n=1), donate_argnums=(0, 1))


class Scenario:
    """A host-side scheduler: requests with random tokens, some reusing another request's cached prefix, admitted
    over time and extended in random chunks. Tracks the oracle's records and the expected counters."""

    def __init__(self, seed: int, num_requests: int, max_len: int, reuse: float):
        self.rng = np.random.default_rng(seed)
        self.free = [int(s) for s in self.rng.permutation(np.arange(1, NUM_SLOTS))]
        self.lengths = [int(self.rng.integers(1, max_len + 1)) for _ in range(num_requests)]
        self.reuse = reuse
        self.table = np.zeros((POOL_ROWS, POOL_CTX), np.int32)
        self.requests = []  # dicts: row, tokens, slots, cached
        self.pending = list(range(num_requests))
        self.recs = empty_records()
        self.steps = self.verified = self.written = 0

    def _admit(self):
        length = self.lengths[self.pending.pop(0)]
        tokens = [int(t) for t in self.rng.integers(-(2**31), 2**31, size=length)]
        slots, cached = [], 0
        donors = [r for r in self.requests if r["cached"] > 0]
        if donors and self.rng.random() < self.reuse:  # prefix-cache hit: share the donor's first slots and tokens
            donor = donors[int(self.rng.integers(len(donors)))]
            cached = int(self.rng.integers(1, min(length, donor["cached"]) + 1))
            tokens[:cached], slots = donor["tokens"][:cached], donor["slots"][:cached]
        slots = slots + [self.free.pop() for _ in range(length - cached)]
        row = len(self.requests) + 1
        self.table[row, :cached] = slots[:cached]
        self.requests.append(dict(row=row, tokens=tokens, slots=slots, cached=cached))

    def next_batch(self):
        """This step's rows and chunks; None when every request is done."""
        running = [r for r in self.requests if r["cached"] < len(r["tokens"])]
        while self.pending and len(running) < WCAP and (not running or self.rng.random() < 0.6):
            self._admit()
            running = [r for r in self.requests if r["cached"] < len(r["tokens"])]
        if not running:
            return None
        batch, budget = [], NUM_TOKENS
        for r in running[:WCAP]:
            chunk = int(self.rng.integers(0, min(len(r["tokens"]) - r["cached"], budget) + 1))
            budget -= chunk
            batch.append((r, chunk))
        return batch

    def inputs(self, batch):
        """Device inputs of one step (padding rows last), after allocating this step's slots in the table."""
        ids, pos, loc, host_requests = [], [], [], []
        for r, chunk in batch:
            start = r["cached"]
            self.table[r["row"], start : start + chunk] = r["slots"][start : start + chunk]
            items = [(r["slots"][p], r["tokens"][p], p) for p in range(start, start + chunk)]
            seed = r["slots"][start - 1] if start > 0 and chunk > 0 else -1
            host_requests.append((seed, items))
            ids += [t for _, t, _ in items]
            pos += [p for _, _, p in items]
            loc += [s for s, _, _ in items]
        rpi = padded([r["row"] for r, _ in batch], WCAP, 0)
        prefix = padded([r["cached"] for r, _ in batch], WCAP, 0)
        extend = padded([c for _, c in batch], WCAP, 0)
        args = (rpi, prefix, extend, i32(self.table), padded(ids, NUM_TOKENS, 0), padded(pos, NUM_TOKENS, 0),
                padded(loc, NUM_TOKENS, -1))  # fmt: skip
        total = sum(r["cached"] for r, _ in batch)
        self.verified += total if total <= VCAP else 0  # an overflowing plan verifies nothing
        self.recs, rows, written = oracle_write(self.recs, host_requests)
        assert rows == []
        self.written += written
        self.steps += 1
        for r, chunk in batch:
            r["cached"] += chunk
        return args


def _run(step, scenario, state, buf):
    while (batch := scenario.next_batch()) is not None:
        state, buf = step(state, buf, *scenario.inputs(batch))
    return state, buf


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_requests=st.integers(1, POOL_ROWS - 2),
    max_len=st.integers(1, 12),
    reuse=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_clean_write_then_verify_is_silent(seed, num_requests, max_len, reuse):
    scenario = Scenario(seed, num_requests, max_len, reuse)
    state, buf = _run(counted_step, scenario, new_state(), new_buf())
    assert ring_rows(state) == [] and write_index(state) == 0
    assert records(buf) == scenario.recs
    kernel, slots = counters(state)
    assert kernel[TAG_HEAD] == 2 * scenario.steps
    assert slots[TAG_HEAD] == scenario.verified + scenario.written

    # Not vacuous: a final verify-only step over the finished requests catches one corrupted record.
    done = []
    for r in scenario.requests:
        if len(done) < WCAP and sum(len(d["tokens"]) for d in done) + len(r["tokens"]) <= VCAP:
            done.append(r)
    victim = done[0]["slots"][-1]
    buf = buf.at[victim, constants.CANARY_FIELD_POSITION].set(u64_pairs([999])[0])
    before = np.asarray(buf).copy()
    rpi = padded([r["row"] for r in done], WCAP, 0)
    lens = padded([len(r["tokens"]) for r in done], WCAP, 0)
    no_tokens = padded([], NUM_TOKENS, 0)
    state, buf = counted_step(state, buf, rpi, lens, padded([], WCAP, 0), i32(scenario.table), no_tokens, no_tokens,
                              padded([], NUM_TOKENS, -1))  # fmt: skip
    tampered = records(before)
    assert tampered[victim][1] == 999
    want_plan, _ = oracle_plans(
        [r["row"] for r in done], [len(r["tokens"]) for r in done], [0] * len(done), scenario.table, vcap=VCAP,
        wcap=WCAP,
    )  # fmt: skip
    want, _ = oracle_verify(
        tampered, want_plan["slot_indices"], want_plan["expected_positions"], want_plan["prev_slot_indices"],
        tag=TAG_HEAD,
    )  # fmt: skip
    assert (victim, int(kc.FailReason.VERIFY_POSITION_MISMATCH)) in [(r[1], r[7]) for r in want]
    assert ring_rows(state) == want


def test_step_does_not_retrace_and_donates():
    scenario = Scenario(1, 4, 8, 0.5)
    state, buf = new_state(), new_buf()
    inputs = scenario.inputs(scenario.next_batch())
    new_state_, new_buf_ = counted_step(state, buf, *inputs)
    # The donated inputs were consumed in place (CPU honours donation on jax 0.10.2).
    assert buf.is_deleted() and state.violation_log.violation_ring.is_deleted()
    state, buf = _run(counted_step, scenario, new_state_, new_buf_)
    assert records(buf) == scenario.recs and write_index(state) == 0
    assert counted_step._cache_size() == 1  # one compilation for every batch shape seen


def test_x64_on_and_off_give_identical_results():
    """The same scenario with a corruption in the middle, run with jax_enable_x64 off and on: equal pytrees."""

    def run():
        scenario = Scenario(7, 5, 10, 0.5)
        step = jax.jit(_step)  # not the trace-counted one: x64 is part of the trace key
        state, buf = new_state(), new_buf()
        for k, batch in enumerate(iter(scenario.next_batch, None)):
            state, buf = step(state, buf, *scenario.inputs(batch))
            if k == 1:
                buf = buf.at[scenario.requests[0]["slots"][0], 0].set(u64_pairs([-5])[0])
        return jax.tree.map(np.asarray, (state, buf)), scenario.steps

    (off, steps_off) = run()
    with jax.enable_x64(True):
        (on, steps_on) = run()
    chex.assert_trees_all_equal(off, on)
    assert steps_off == steps_on
    assert write_index(off[0]) > 0  # the comparison covers violation rows, not only an empty ring
