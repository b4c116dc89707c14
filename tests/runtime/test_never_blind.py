"""Issue 15's first-day mistakes: each is now a clear error or one named violation, never silence or a storm.

Every test drives a small hand-made paged-KV loop (one jitted step per canary configuration, shared across tests)
whose "forward" writes each new token's K row; requests decode one token per step.
"""

import dataclasses
import functools
import inspect
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import FailReason, InputField, InputProblem
from kvcanary_jax.testing import assert_no_violations, expect_violation, flip_kv_byte

NUM_SLOTS, PAGE, ROWS, CONTEXT, BATCH, TOKENS = 64, 4, 4, 16, 3, 3
KV_BITS = FailReason.VERIFY_REAL_KV_HASH_MISMATCH


@functools.cache
def _canary(padding: str = "negative", **config) -> kc.KvCanary:
    config = {"mode": "log", "real_kv_hash_mode": "partial", "backend": "xla", **config}
    return kc.KvCanary(
        kc.CanaryConfig(**config), kc.CanaryPool(num_slots=NUM_SLOTS, page_size=PAGE, padding=padding, with_v=False)
    )


def _make_step(canary: kc.KvCanary):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k, state, batch):
        state = canary.before_forward(state, batch)
        loc = jnp.where((batch.out_cache_loc > 0) & (batch.out_cache_loc < NUM_SLOTS), batch.out_cache_loc, NUM_SLOTS)
        rows = jnp.broadcast_to(batch.input_ids[:, None, None], (loc.shape[0], 2, 8)).astype(jnp.float32)
        k = k.at[loc // PAGE, loc % PAGE].set(rows, mode="drop")
        state = canary.after_forward(state, batch, canary.kv_sources(full_k=k))
        return k, state

    return step


_step = functools.cache(_make_step)


@dataclasses.dataclass
class Req:
    row: int  # req_to_token row
    slots: list  # slot of each position
    token: int = 100


def _batch(reqs, step, *, pad_row=-1, edit=None) -> kc.CanaryBatch:
    """Step ``step`` of ``reqs`` decoding together (request i has ``step`` tokens cached), padded to BATCH rows."""
    table = np.zeros((ROWS, CONTEXT), np.int32)
    fields = {k: np.full(n, v, np.int32) for k, n, v in [
        ("req_pool_indices", BATCH, pad_row), ("prefix_lens", BATCH, 0), ("extend_lens", BATCH, 0),
        ("input_ids", TOKENS, 0), ("positions", TOKENS, 0), ("out_cache_loc", TOKENS, -1),
    ]}  # fmt: skip
    for i, r in enumerate(reqs):
        table[r.row, : len(r.slots)] = r.slots
        fields["req_pool_indices"][i], fields["prefix_lens"][i], fields["extend_lens"][i] = r.row, step, 1
        fields["input_ids"][i], fields["positions"][i] = r.token + step, step
        fields["out_cache_loc"][i] = r.slots[step]
    if edit is not None:
        edit(table, fields)
    return kc.CanaryBatch(req_to_token=table, **fields)


def _run(canary, reqs, steps, *, corrupt=None, edit=None, pad_row=-1, start_state=None):
    """Runs ``steps`` decode steps; ``corrupt(step, k) -> k`` runs before each step; returns (k, state)."""
    k = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32)
    state = canary.init_state() if start_state is None else start_state
    for i in range(steps):
        if corrupt is not None:
            k = corrupt(i, k)
        k, state = _step(canary)(k, state, _batch(reqs, i, pad_row=pad_row, edit=edit))
    return k, state


def _rows(state):
    return kc.read_violations(state.violation_log).violations


def _input_rows(state):
    return [v for v in _rows(state) if v.fail_reason & FailReason.INVALID_INPUT]


def _detail(v):
    return InputField(v.reason_detail & 0xFF), InputProblem(v.reason_detail >> 8)


A, B = Req(row=0, slots=list(range(1, 12))), Req(row=2, slots=list(range(21, 32)), token=500)


def test_a_request_in_row_0_is_checked_by_default():
    """Before: row 0 was padding by fiat, so its KV could be corrupted silently. Now (padding='negative') it is a
    request like any other: a flipped byte of its cached slot is caught, and the report names row 0."""
    _, clean = _run(_canary(), [A, B], 6)
    assert_no_violations(clean)
    flip = lambda i, k: flip_kv_byte(k, jnp.int32(A.slots[1]), page_size=PAGE) if i == 4 else k  # noqa: E731
    _, state = _run(_canary(), [A, B], 6, corrupt=flip)
    v = expect_violation(state, tag="TAIL_K_FULL", reason=KV_BITS, slot=A.slots[1])
    assert (v.request_row, v.expected_position, v.position) == (0, 1, 1)
    assert "  request: row=0 (batch entry 0) position expected=1 found=1" in kc.format_violation(
        v, total=1, overflowed=False
    )


def test_the_defaults_catch_a_flipped_kv_byte_of_a_live_slot():
    """Before: real_kv_hash_mode defaulted to 'none', so with the defaults a flipped KV byte that leaves every chain
    intact went unseen. Now CanaryConfig's default folds the first 16 bytes ('partial'); SGLang's op signatures keep
    its 'none', and a canary left without KV sources is refused by name rather than blind."""
    canary = kc.KvCanary(kc.CanaryConfig(), kc.CanaryPool(num_slots=NUM_SLOTS, page_size=PAGE, with_v=False))
    assert canary.config.real_kv_hash_mode is kc.RealKvHashMode.PARTIAL
    for op in (kc.canary_verify, kc.canary_write):
        assert inspect.signature(op).parameters["real_kv_hash_mode"].default is kc.RealKvHashMode.NONE
    with pytest.raises(ValueError, match=r"no full_k source; .* or set CanaryConfig\(real_kv_hash_mode='none'\)"):
        canary.after_forward(canary.init_state(), _batch([A], 0), kc.KvSources())
    monitor = kc.CanaryMonitor(canary)
    k, state = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32), canary.init_state()
    for i in range(6):
        if i == 4:
            k = flip_kv_byte(k, jnp.int32(A.slots[1]), page_size=PAGE)
        k, state = _step(canary)(k, state, _batch([A, B], i))
        monitor.after_step(state, step=i)
    with pytest.raises(kc.KvCanaryViolationError) as raised:
        monitor.final_check(state)
    assert str(raised.value).splitlines()[0] == (
        "kv-canary incident #1: verify_real_kv_hash (TAIL_K_FULL) at request row 0, position 1, slot 2 (FULL), "
        "written at step 4"
    )


def test_a_request_in_the_reserved_row_is_one_named_violation_not_a_storm():
    """Before: with SGLang's convention, a request placed in row 0 was skipped and, first in the batch, shifted the
    other requests' tokens: hundreds of unexplained chain rows. Now: one INVALID_INPUT row per step naming
    req_pool_indices[0], and the other request (row 2) is checked and silent."""
    canary = _canary("reserved")
    _, state = _run(canary, [A, B], 5, pad_row=0)
    rows = _rows(state)
    assert len(rows) == 5 == len(_input_rows(state))  # one per step: row 0 has a prefix, or writes a real slot
    for v in rows:
        assert _detail(v) == (InputField.REQ_POOL_INDICES, InputProblem.RESERVED_ROW) and v.stored_chain_hash == 0
    assert "req_pool_indices[0] = 0 is the reserved padding row 0" in kc.format_violation(
        rows[0], total=4, overflowed=False
    )
    flip = lambda i, k: flip_kv_byte(k, jnp.int32(B.slots[2]), page_size=PAGE) if i == 4 else k  # noqa: E731
    _, state = _run(canary, [A, B], 5, corrupt=flip, pad_row=0)
    expect_violation(state, tag="TAIL_K_FULL", reason=KV_BITS, slot=B.slots[2])


def test_sglang_padding_rows_are_silent_under_the_reserved_convention():
    """CUDA-graph padding (row 0, tokens writing slot 0) is padding, never a violation."""

    def pad_with_tokens(table, f):
        f["extend_lens"][2], f["out_cache_loc"][2] = 1, 0  # a padding row owning one token that writes slot 0

    _, state = _run(_canary("reserved"), [Req(row=1, slots=A.slots), B], 5, pad_row=0, edit=pad_with_tokens)
    assert_no_violations(state)


def test_slot_0_inside_a_request_is_a_named_violation():
    """Before: slot 0 inside a request was skipped by verify (never checked). Now: RESERVED_SLOT rows, once per
    step for the cached position (req_to_token) and once for the token written there (out_cache_loc)."""
    a = Req(row=1, slots=[1, 2, 0, 4, 5, 6])
    _, state = _run(_canary(), [a], 5)
    fields = [(_detail(v), v.stored_chain_hash, v.position) for v in _input_rows(state)]
    written = ((InputField.OUT_CACHE_LOC, InputProblem.RESERVED_SLOT), 0, 2)  # token entry 0 at step 2
    cached = ((InputField.REQ_TO_TOKEN, InputProblem.RESERVED_SLOT), 0, 2)  # batch row 0, position 2, steps 3, 4
    assert fields == [written, cached, cached]
    assert len(_rows(state)) == 3, "a masked slot adds no verify rows of its own"


def _bad_slot_from_step_3(table, f, i):
    """Row 1 (request B) is handed a slot past the pool at every step from 3 on, in the table and the token."""
    if i >= 3:
        table[B.row, 3 : i + 1] = NUM_SLOTS + 5
        f["out_cache_loc"][1] = NUM_SLOTS + 5


@pytest.mark.parametrize(
    ("name", "edit", "field", "problem", "value"),
    [
        ("req_pool_indices past the table", lambda t, f, i: f["req_pool_indices"].__setitem__(1, ROWS + 3),
         InputField.REQ_POOL_INDICES, InputProblem.OUT_OF_RANGE, ROWS + 3),
        ("negative extend_lens", lambda t, f, i: f["extend_lens"].__setitem__(1, -2),
         InputField.EXTEND_LENS, InputProblem.NEGATIVE, -2),
        ("extend_lens past the token arrays", lambda t, f, i: f["extend_lens"].__setitem__(1, TOKENS + 1),
         InputField.EXTEND_LENS, InputProblem.PAST_TOKENS, TOKENS + 2),
        ("prefix_lens past the table's width", lambda t, f, i: f["prefix_lens"].__setitem__(1, CONTEXT),
         InputField.EXTEND_LENS, InputProblem.PAST_CONTEXT, CONTEXT + 1),
    ],
)  # fmt: skip
def test_a_bad_row_is_one_row_per_step_naming_the_field(name, edit, field, problem, value):
    """Before: JAX dropped or clamped these (a handful to dozens of rows naming nothing, or none at all). Now, from
    the step the bad value appears on: exactly one INVALID_INPUT row per step naming it, and nothing else (the row
    is left out of the launches); the other request stays checked."""
    edit_from_3 = lambda i: lambda t, f: edit(t, f, i) if i >= 3 else None  # noqa: E731
    canary, step = _canary(), _step(_canary())
    k, state, counts = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32), canary.init_state(), []
    for i in range(6):
        k, state = step(k, state, _batch([A, B], i, edit=edit_from_3(i)))
        counts.append(int(state.violation_log.violation_write_index[0]))
    assert counts == [0, 0, 0, 1, 2, 3], name
    for v in _rows(state):
        assert _detail(v) == (field, problem) and v.stored_token == value and v.stored_chain_hash == 1, name
        assert v.launch_tag == kc.CanaryLaunchTag.HEAD_K_FULL
    lines = kc.format_violation(_rows(state)[0], total=1, overflowed=False).split("\n")
    assert lines[0].startswith("kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=invalid_input slot_idx=")
    if problem is InputProblem.PAST_TOKENS:  # issue 43: it names extend_lens and both token counts, truly
        input_line = (f"  input: extend_lens[1]: the token entries of batch rows 0..1 (sum(extend_lens[:2]) = {value}) "
                      f"run past the {TOKENS} token entries of the batch (input_ids, positions, out_cache_loc)")  # fmt: skip
        assert input_line in lines, lines
    else:
        assert any(x.startswith(f"  input: {field.name.lower()}[1] = {value} ") for x in lines), lines


def test_a_slot_past_the_pool_is_one_row_per_bad_value():
    """A slot past the pool in the token written and then in the table: one row for each bad value each step
    (the token at step 3; then the cached position and the new token...), no verify or write rows."""
    canary, step = _canary(), _step(_canary())
    k, state = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32), canary.init_state()
    for i in range(6):
        k, state = step(k, state, _batch([A, B], i, edit=lambda t, f, i=i: _bad_slot_from_step_3(t, f, i)))
    details = [(_detail(v)[0], v.position) for v in _rows(state)]
    token, cached = InputField.OUT_CACHE_LOC, InputField.REQ_TO_TOKEN
    assert details == [(token, 3), (token, 4), (cached, 3), (token, 5), (cached, 3), (cached, 4)]
    assert "out_cache_loc[1] (request row 2, position 3) = 69 is out of range (limit 64)" in kc.format_violation(
        _rows(state)[0], total=6, overflowed=False
    )


def test_a_write_past_the_pool_is_not_counted_as_written():
    """Before: out_cache_loc >= num_slots was dropped by the store while slot_run_counters counted it."""

    def bad(table, f):
        f["out_cache_loc"][1] = NUM_SLOTS + 1

    _, good = _run(_canary(), [A, B], 1)
    _, state = _run(_canary(), [A, B], 1, edit=bad)
    written = lambda s: kc.records_as_int64(s.device.slot_run_counters)[kc.CanaryLaunchTag.HEAD_K_FULL]  # noqa: E731
    assert written(good) == 2 and written(state) == 1


def test_page_size_and_layout_are_checked_against_the_kv_array():
    """Before: CanaryPool(page_size=8) over KV paged by 4, or a head-major array, was accepted; faults were missed
    and false rows landed elsewhere. Now both are refused with the shape received and the layout expected."""
    canary = kc.KvCanary(kc.CanaryConfig(real_kv_hash_mode="partial"), kc.CanaryPool(num_slots=NUM_SLOTS, page_size=8))
    with pytest.raises(
        ValueError,
        match=r"full_k must be a paged KV array laid out \[pages, page_size=8, \.\.\.\].*got shape \(16, 4, 2, 8\)",
    ):
        canary.kv_sources(full_k=jnp.zeros((16, 4, 2, 8)))
    with pytest.raises(
        ValueError, match=r"got shape \(8, 2, 8, 16\)\. The page_size \(8\) is a later axis: a head-major"
    ):
        canary.kv_sources(full_k=jnp.zeros((8, 2, 8, 16)))
    with pytest.raises(ValueError, match=r"full_k holds 4 pages x 8 = 32 slots, fewer than the group's num_slots=64"):
        canary.kv_sources(full_k=jnp.zeros((4, 8, 2, 8)))


def test_reports_point_at_the_request_and_the_users_step(caplog):
    """Before: no request row, no expected position, a filler expected_token=-1, the monitor's read count as step."""
    canary = _canary(check_lag_steps=1, stats_every_n_steps=0, health_check_every_n_steps=0)
    monitor = kc.CanaryMonitor(canary)
    k, state = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32), canary.init_state()
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        for i in range(5):
            if i == 3:
                k = flip_kv_byte(k, jnp.int32(B.slots[1]), page_size=PAGE)
            k, state = _step(canary)(k, state, _batch([A, B], i))
            monitor.after_step(state, step=1000 + i)
        monitor.final_check(state)
    message = caplog.records[0].getMessage()
    headline, *lines = message.split("\n")
    assert headline == (
        "kv-canary incident #1: verify_real_kv_hash (TAIL_K_FULL) at request row 2, position 1, slot 22 (FULL), "
        "written at step 1003"
    )
    at = next(i for i, x in enumerate(lines) if x.startswith("kv_canary violation: "))  # the root row's block
    first, rest = lines[at], lines[at + 1 :]
    assert first.startswith("kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash ")
    assert " expected_token=-1 " in first  # SGLang's first line, byte for byte
    assert "  request: row=2 (batch entry 1) position expected=1 found=1" in rest
    assert "  token: found=501 (token not checked)" in rest
    assert "  written at step 1003" in rest and "step_when_pumped=1004" in message
    assert any(x.startswith("  likely cause: KV bytes of this slot changed after they were written") for x in rest)
    assert monitor.observed[0].user_step == 1003


def test_one_remapped_page_table_entry_is_one_incident_with_its_knock_ons_counted(caplog):
    """Before: one remapped req_to_token entry raised 8 violation blocks (HEAD and TAIL, the slot and the next one,
    whose chain it broke), each with the same likely cause. Now: one headline naming the request, the position and
    the user's step, the knock-on counted under it; verbose labels each raw row with its incident."""
    canary = _canary(check_lag_steps=1, stats_every_n_steps=0, health_check_every_n_steps=0)
    remap = lambda t, f: t.__setitem__((B.row, 1), A.slots[0])  # noqa: E731  B's position 1 -> A's position-0 slot
    for verbose in (False, True):
        monitor = kc.CanaryMonitor(canary, verbose=verbose)
        k, state = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32), canary.init_state()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
            for i in range(6):
                k, state = _step(canary)(k, state, _batch([A, B], i, edit=remap if i == 4 else None))
                monitor.after_step(state, step=1000 + i)
            monitor.final_check(state)
        (message,) = [r.getMessage() for r in caplog.records]
        lines = message.split("\n")
        assert lines[:3] == [
            "kv-canary incident #1: verify_chain_hash+verify_position (HEAD_K_FULL) at request row 2, position 1, "
            "slot 1 (FULL), written at step 1004",
            "  likely cause: req_to_token maps this position to a slot holding another token's record: a wrong "
            "page/slot mapping, a stale prefix-cache page, or a slot freed and reused while still referenced",
            "  explains 4 row(s); knock-ons of this root at slot@position 23@2",
        ]
        blocks = [x for x in lines if x.startswith("kv_canary violation: ")]
        labels = [x for x in lines if x.startswith("  incident: ")]
        assert len(blocks) == (4 if verbose else 1) and len(labels) == (4 if verbose else 0)
        if verbose:
            assert labels.count("  incident: #1 (root)") == 1
            knock_on = "  incident: knock-on of #1 (root: request row 2, position 1, slot 1 (FULL))"
            assert labels.count(knock_on) == 2
        assert [(i.number, i.rows) for i in monitor.incidents.incidents] == [(1, 4)]


def test_numpy_integers_and_arrays_are_accepted_like_python_ones():
    pool = kc.CanaryPool(num_slots=np.int64(NUM_SLOTS), page_size=np.int32(PAGE))
    config = kc.CanaryConfig(ring_capacity=np.int64(16), sweep_interval=np.int32(0))
    assert (pool.num_slots, pool.page_size, config.ring_capacity) == (NUM_SLOTS, PAGE, 16)
    assert type(pool.num_slots) is int and type(config.ring_capacity) is int
    state = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig(backend="xla"))
    buf = np.zeros((NUM_SLOTS, 4, 2), np.uint32)  # a host buffer, e.g. loaded from a checkpoint
    plan, _ = kc.build_plans(
        *(jnp.asarray(x) for x in ([1], [2], [0])),
        jnp.zeros((2, 4), jnp.int32).at[1, :2].set(jnp.array([1, 2])),
        verify_capacity=np.int64(4),
        write_req_capacity=1,
    )
    out = kc.canary_verify(state, buf, plan, tag=np.int32(2), backend="xla")
    assert kc.read_violations(out.violation_log).write_index == 2  # two zero records fail their position / chain


def test_unsupported_kv_dtypes_and_sourceless_real_kv_modes_are_refused_by_name():
    canary = kc.KvCanary(kc.CanaryConfig(), kc.CanaryPool(num_slots=NUM_SLOTS, page_size=PAGE))
    with pytest.raises(
        TypeError, match=r"full_k must have a 1/2/4/8-byte integer or float dtype .*got dtype complex64"
    ):
        canary.kv_sources(full_k=jnp.zeros((16, 4, 2), jnp.complex64))
    state = kc.CanaryDeviceState.allocate(config=kc.CanaryConfig())
    plan, _ = kc.build_plans(
        *(jnp.asarray(x, jnp.int32) for x in ([1], [2], [0])),
        jnp.zeros((2, 4), jnp.int32),
        verify_capacity=4,
        write_req_capacity=1,
    )
    with pytest.raises(
        ValueError, match=r"real_kv_hash_mode=ALL folds the slots' KV bytes, but real_kv_sources is empty"
    ):
        kc.canary_verify(state, kc.allocate_canary_buffer(NUM_SLOTS), plan, tag=2, real_kv_hash_mode="all")


_BAD_INPUTS = {
    "slot past the pool": lambda t, f, i: _bad_slot_from_step_3(t, f, i),
    "slot 0 inside a request": lambda t, f, i: t.__setitem__((B.row, 1), 0),
    "negative extend": lambda t, f, i: f["extend_lens"].__setitem__(1, -2) if i >= 3 else None,
    "tokens past the arrays": lambda t, f, i: f["extend_lens"].__setitem__(0, TOKENS + 1) if i == 2 else None,
}


def _states(step, canary, edit, steps=6):
    k, state = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32), canary.init_state()
    for i in range(steps):
        k, state = step(k, state, _batch([A, B], i, edit=lambda t, f, i=i: edit(t, f, i)))
    return state


@pytest.mark.parametrize("name", ["tokens past the arrays", "slot 0 inside a request"])
def test_the_rows_a_rejected_request_causes_later_are_knock_ons_of_its_incident(name, caplog):
    """Before: one precise INVALID_INPUT row, then 100+ verify rows over the next steps (the request it left
    unwritten failing verify), none linked to it. Now the monitor shows one incident, rooted at the bad value; the
    later rows are counted on it, not reported as new faults."""
    canary = _canary(check_lag_steps=1, stats_every_n_steps=0, health_check_every_n_steps=0)
    monitor, edit = kc.CanaryMonitor(canary), _BAD_INPUTS[name]
    k, state = jnp.zeros((NUM_SLOTS // PAGE, PAGE, 2, 8), jnp.float32), canary.init_state()
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.monitor"):
        for i in range(6):
            k, state = _step(canary)(k, state, _batch([A, B], i, edit=lambda t, f, i=i: edit(t, f, i)))
            monitor.after_step(state, step=i)
        monitor.final_check(state)
    (incident,) = monitor.incidents.incidents
    assert incident.root.fail_reason == FailReason.INVALID_INPUT
    assert incident.rows == len(_rows(state)) > 1
    messages = [r.getMessage() for r in caplog.records]
    span = "extend_lens[0]: the token entries of batch row 0 (sum(extend_lens[:1]) = 4) run past the 3 token entries"
    root = "request row 2, req_to_token[2, 1]" if name.startswith("slot 0") else span
    assert messages[0].startswith(f"kv-canary incident #1: invalid_input (HEAD_K_FULL) at {root}"), messages[0]
    assert all(m.startswith("kv-canary incident #1: ") and "more row(s)" in m for m in messages[1:])


def test_the_mosaic_phase_masks_and_reports_like_the_reference():
    """The TPU's phase (the Mosaic kernels, interpreted) masks and reports each bad value as the xla path does,
    byte for byte, ring context included."""
    xla, mosaic = _canary(), _canary(backend="interpret_tpu")
    mosaic_step = _make_step(mosaic)
    for name, edit in _BAD_INPUTS.items():
        want = _states(_step(xla), xla, edit)
        assert any(v.fail_reason & FailReason.INVALID_INPUT for v in _rows(want)), name
        chex.assert_trees_all_equal(_states(mosaic_step, mosaic, edit), want)


def test_the_fused_kernels_mask_and_report_like_the_reference():
    """The Triton kernels (interpreted) on a run with a bad slot and a bad row: the same state as the xla path."""
    edit = lambda t, f, i: (_bad_slot_from_step_3(t, f, i), f["extend_lens"].__setitem__(0, -1) if i == 4 else None)  # noqa: E731
    want = _states(_step(_canary()), _canary(), edit)
    interpret = _canary(backend="interpret")
    chex.assert_trees_all_equal(_states(_step(interpret), interpret, edit), want)
