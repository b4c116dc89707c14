"""The fused phase kernels (interpret mode) give exactly the reference's buffers, ring, index and counters."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import layout
from pallas_kernels.batch_checks import api as checks_api
from pallas_kernels.batch_checks import pallas_triton as checks_triton
from pallas_kernels.phase import api, common, pallas_triton
from pallas_kernels.phase import plan as plans
from pallas_kernels.write import store
from tests.pallas_kernels import kernel_cases as cases
from tests.pallas_kernels.phase_cases import RING_STARTS, Shape, make_case, with_bad_rows

BF16_P4 = cases.SourceSpec("bfloat16", 4, 64, 48, row_padding=16)
I8_P16 = cases.SourceSpec("int8", 16, 16, 16)
F8_P1 = cases.SourceSpec("float8_e4m3fn", 1, 32, 16)
VARIANTS = {
    "head_kv_input_assert_table": Shape(input_assert=True, ring_capacity=32, check_table=True),
    "tail_kv_all_token_check": Shape(mode=2, sources=(BF16_P4, I8_P16), token_check=True, ring_capacity=64),
    "swa_k_partial_everything": Shape(
        halves=1,
        swa_slots=32,
        window=5,
        mode=1,
        sources=(F8_P1,),
        token_check=True,
        input_assert=True,
        token_offset=1,
        check_table=True,
    ),
}
# Small blocks and chunks: many programs, every in-kernel loop runs several (and > 8, i.e. looped) steps.
TINY_BLOCKS = pallas_triton.Config(
    verify_block=8, store_block=4, dedupe="pairwise", req_chunk=2, sum_chunk=2, token_chunk=2, compare_block=2
)
MANY = Shape(num_reqs=20, max_len=10, num_tokens=30, capacity=80, ring_capacity=64, input_assert=True, check_table=True)


@functools.partial(
    jax.jit, static_argnames=("tags", "shape", "backend", "config", "full_slots", "skip_bad_requests", "batch_checks")
)
def _phase(
    buffers,
    log,
    batch,
    cpa,
    sources,
    issues=None,
    *,
    tags,
    shape,
    backend,
    config=None,
    full_slots=None,
    skip_bad_requests=False,
    batch_checks=None,
):
    kwargs = dict(
        input_issues=issues,
        tags=tags,
        real_kv_hash_mode=shape.mode,
        verify_capacity=shape.capacity,
        window=shape.window,
        token_offset=shape.token_offset,
        full_slots=full_slots,
        check_table=shape.check_table,
        skip_bad_requests=skip_bad_requests,
    )
    if config is not None:
        spec = common.PhaseSpec(**{k: v for k, v in kwargs.items() if k != "input_issues"})
        checks = {}
        if batch_checks is not None:
            static = dict(table_rows=batch.req_to_token.shape[0], context_len=batch.req_to_token.shape[1])
            static.update(padding=batch_checks.padding, num_slots=full_slots, token_ids_width=None)
            fused = checks_triton.static(batch.req_pool_indices.shape[0], batch.out_cache_loc.shape[0], **static)
            checks = dict(checks=fused, report_checks=batch_checks.report)
        return pallas_triton.phase(
            buffers, log, batch, cpa, sources, issues, spec=spec, interpret=True, config=config, **checks
        )
    kwargs.update(batch_checks=batch_checks)
    return api.phase(buffers, log, batch, cpa, real_kv_sources=sources, backend=backend, **kwargs)


def _assert_same(case, shape, config=None, **kwargs):
    *args, tags = case
    want = _phase(*args, tags=tags, shape=shape, backend="xla", **kwargs)
    got = _phase(*args, tags=tags, shape=shape, backend="interpret", config=config, **kwargs)
    chex.assert_trees_all_equal(got, want)
    return want


def _grew(log, out) -> int:
    return int(out[1].write_index[0]) - int(log.write_index[0])


def _placed(log, out) -> np.ndarray:
    """The rows a phase placed in the ring."""
    start, end = (min(int(x.write_index[0]), log.ring.shape[0]) for x in (log, out[1]))
    return np.asarray(out[1].ring[start:end])


def _landed_tags(log, out) -> set[int]:
    """Launch tags of the rows a phase placed in the ring, and -1 for INVALID_INPUT rows (table checks)."""
    rows = _placed(log, out)
    invalid = rows[:, 7, 0] == layout.FAIL_INVALID_INPUT
    return set(rows[~invalid, 0, 0].tolist()) | ({-1} if invalid.any() else set())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernels_equal_reference(name):
    shape, grown, landed = VARIANTS[name], 0, set()
    for seed, start in enumerate(RING_STARTS):
        case = make_case(seed, shape, ring_start=start)
        out = _assert_same(case, shape)
        grown += _grew(case[1], out)
        landed |= _landed_tags(case[1], out) & {-1}
    for seed in range(3):  # mostly clean chains: rows of every launch land in the ring
        case = make_case(10 + seed, shape, ring_start="empty", primed=True)
        landed |= _landed_tags(case[1], _assert_same(case, shape))
    want = set(case[-1]) | ({-1} if shape.check_table else set())
    assert landed == want, f"rows of tags {want - landed} never landed (-1: table checks)"
    overflowing = make_case(99, shape, overflow=True)  # more entries than verify_capacity: verify skipped
    out = _assert_same(overflowing, shape)
    assert int(out[2][0]) == (1 if shape.window else 0)  # a window keeps the SWA plan within capacity
    if not shape.window:  # the table checks cover the listed entries even when the verify overflows
        assert (-1 in _landed_tags(overflowing[1], out)) == shape.check_table
    assert grown > 0, "random records must make the launches append rows"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mosaic_phase_equals_reference(name):
    """The TPU's phase (the Mosaic verify and write kernels, interpreted) gives the reference's bytes: rows of
    every launch, a ring that fills, the runner's roles with skipped requests and input issues, an overflow."""
    shape = VARIANTS[name]
    cases = [
        (make_case(10, shape, ring_start="empty", primed=True), {}),
        (make_case(1, shape, ring_start="almost_full"), {}),
        (make_case(30, shape, ring_start="mid", roles=True, masked=False), dict(skip_bad_requests=True)),
        (make_case(99, shape, overflow=True), {}),
    ]
    issues = jnp.asarray(_random_issues(np.random.default_rng(5), 6))
    grown = 0
    for k, ((*args, tags), kwargs) in enumerate(cases):
        args = (*args, issues) if k == 2 else args
        kwargs = dict(kwargs, full_slots=shape.num_slots) if kwargs else kwargs
        want = _phase(*args, tags=tags, shape=shape, backend="xla", **kwargs)
        got = _phase(*args, tags=tags, shape=shape, backend="interpret_tpu", **kwargs)
        chex.assert_trees_all_equal(got, want)
        grown += _grew(args[1], want)
    assert grown > 0, "the cases must append rows"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernels_equal_reference_with_explicit_roles_and_context(name):
    """The runner's form: rows that are not requests own skipped tokens, slots past the pools are skipped (not
    clamped), and every placed row writes its context (request row, expected position, batch entry)."""
    shape = VARIANTS[name]
    for seed, start in enumerate(("empty", "mid")):
        case = make_case(20 + seed, shape, ring_start=start, roles=True)
        out = _assert_same(case, shape)
        log, new = case[1], out[1]
        placed = slice(int(log.write_index[0]), min(int(new.write_index[0]), log.ring.shape[0]))
        context = np.asarray(new.context)[placed]
        assert len(context) and (context[:, 0] >= 0).all(), "placed rows name their request row"
        batch = case[2]
        assert set(context[:, 0]) <= set(np.asarray(batch.req_pool_indices)[np.asarray(batch.active) != 0])


def _skipped_by_hand(batch: common.Batch, *, full_slots: int, group_slots: int) -> tuple[np.ndarray, int]:
    """(out_cache_loc, requests rejected): every token of a row that is not a request, or of a request one of
    whose slots is outside [1, full_slots) or translates outside [0, group_slots), set to -1."""
    loc, span, active = (np.asarray(x).copy() for x in (batch.out_cache_loc, batch.span_lens, batch.active))
    lut = None if batch.full_to_swa_index_mapping is None else np.asarray(batch.full_to_swa_index_mapping)

    def rejected(slot: int) -> bool:
        if slot < 0:
            return False
        if slot < 1 or slot >= full_slots:
            return True
        return lut is not None and not 0 <= lut[slot] < group_slots

    start, rejections = 0, 0
    for r in range(len(span)):
        tokens = slice(start, min(start + span[r], len(loc)))
        bad = any(rejected(int(x)) for x in loc[tokens])
        rejections += bool(active[r] and bad)
        if not active[r] or bad:
            loc[tokens] = -1
        start += span[r]
    return loc, rejections


@pytest.mark.parametrize("name", list(VARIANTS))
def test_skip_bad_requests_writes_nothing_for_rejected_requests(name):
    """With ``skip_bad_requests`` the phase on the raw ``out_cache_loc`` equals the phase without it on slots
    skipped by hand (rows that are not requests, requests with a slot the group cannot store); kernels too."""
    shape, rejections = VARIANTS[name], 0
    full_slots = shape.num_slots
    for seed, start in enumerate(("empty", "mid", "almost_full")):
        *args, tags = make_case(30 + seed, shape, ring_start=start, roles=True, masked=False)
        got = _assert_same((*args, tags), shape, full_slots=full_slots, skip_bad_requests=True)
        batch = args[2]
        loc, rejected = _skipped_by_hand(batch, full_slots=full_slots, group_slots=args[0][0].shape[0])
        rejections += rejected
        by_hand = (*args[:2], dataclasses.replace(batch, out_cache_loc=jnp.asarray(loc)), *args[3:])
        want = _phase(*by_hand, tags=tags, shape=shape, backend="xla", full_slots=full_slots)
        chex.assert_trees_all_equal(got, want)
    assert rejections > 0, "the cases must hold requests with a slot the group cannot store"


@pytest.mark.parametrize("pairwise_max", [0, store.PAIRWISE_MAX_ENTRIES])
def test_skip_rejected_requests_by_pairs_or_by_scatter(monkeypatch, pairwise_max):
    """Both forms of the rejected-request check (every token pair for a few tokens, a scatter for more) skip the
    tokens the by-hand rule skips (eager: no compile)."""
    monkeypatch.setattr(store, "PAIRWISE_MAX_ENTRIES", pairwise_max)
    shape = VARIANTS["head_kv_input_assert_table"]
    rejections = 0
    for seed in range(3):
        buffers, _, batch, *_ = make_case(30 + seed, shape, ring_start="empty", roles=True, masked=False)
        batch = common.with_roles(common.pad_tokens(batch))  # as the phase sees it
        group_slots = buffers[0].shape[0]
        offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(batch.span_lens, dtype=jnp.int32)])
        lut, lut_size = common.lut_reader(batch.full_to_swa_index_mapping)
        got = plans.skip_rejected_requests(
            batch, offsets, lut, lut_size, full_slots=shape.num_slots, group_slots=group_slots
        )
        want, rejected = _skipped_by_hand(batch, full_slots=shape.num_slots, group_slots=group_slots)
        covered = np.arange(want.shape[0]) < int(offsets[-1])  # tokens past every span are skipped too
        np.testing.assert_array_equal(np.asarray(got), np.where(covered, want, -1))
        rejections += rejected
    assert rejections > 0, "the cases must hold requests with a slot the group cannot store"


def test_batch_checks_run_by_the_phase():
    """With ``batch_checks`` the phase equals the batch checks then the phase with their roles (and, reported,
    their candidates as ``input_issues``), on every backend: the Triton kernels derive the roles in-kernel and
    run the checks' programs in the check launch (default and tiny blocks: looped row chunks)."""
    landed = 0
    cases = [  # (shape, padding, report, ring start, blocks): one interpret compile each
        (MANY, "negative", True, "empty", TINY_BLOCKS),
        (MANY, "reserved", True, "almost_full", None),
        (MANY, "negative", False, "mid", None),  # a TAIL: roles derived, no checks' programs
    ]
    for seed, (shape, padding, report, start, config) in enumerate(cases):
        *args, tags = make_case(60 + seed, shape, ring_start=start)
        batch = with_bad_rows(args[2], padding, seed)
        kw = dict(tags=tags, shape=shape, full_slots=shape.num_slots, skip_bad_requests=True)
        rows = dict(table_rows=batch.req_to_token.shape[0], context_len=batch.req_to_token.shape[1])
        checked = checks_api.check(
            batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc,
            padding=padding, num_slots=shape.num_slots, backend="xla", **rows,
        )  # fmt: skip
        with_roles = dataclasses.replace(batch, active=checked.active, span_lens=checked.span_lens)
        issues = checked.issues if report else None
        want = _phase(args[0], args[1], with_roles, *args[3:], issues, backend="xla", **kw)
        fused = api.BatchChecks(padding, report)
        for backend, blocks in [("xla", None), ("interpret", config)]:
            got = _phase(args[0], args[1], batch, *args[3:], backend=backend, config=blocks, batch_checks=fused, **kw)
            chex.assert_trees_all_equal(got, want)
        landed += int(report) * int((np.asarray(_placed(args[1], want))[:, 7, 0] == layout.FAIL_INVALID_INPUT).sum())
    assert landed > 0, "the reported checks must place INVALID_INPUT rows"


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_verify_overflows_counts_and_saturates(backend):
    shape = VARIANTS["head_kv_input_assert_table"]
    for overflow, count, want in [(True, 7, 8), (True, 2**31 - 1, 2**31 - 1), (False, 7, 7)]:
        *args, tags = make_case(40, shape, overflow=overflow)
        log = args[1]._replace(verify_overflows=jnp.asarray([count], jnp.int32))
        _, out, enable = _phase(args[0], log, *args[2:], tags=tags, shape=shape, backend=backend)
        assert int(enable[0]) == (0 if overflow else 1)
        assert int(out.verify_overflows[0]) == want, (overflow, count)


@pytest.mark.parametrize("config", [TINY_BLOCKS, None], ids=["tiny_blocks", "sort"])
def test_many_programs_and_both_winner_rules(config):
    config = config or pallas_triton.Config(verify_block=16, store_block=8, dedupe="sort")
    for seed, start in zip(range(3), ("empty", "mid", "almost_full"), strict=True):
        _assert_same(make_case(seed, MANY, ring_start=start), MANY, config)
        _assert_same(make_case(seed, MANY, ring_start=start, primed=True), MANY, config)


def _random_issues(rng, n: int) -> np.ndarray:
    """i32[8, n] input issues: about 40 % flagged, any values (negative ones too)."""
    issues = rng.integers(-5, 50, (len(common.INPUT_ISSUE_FIELDS), n)).astype(np.int32)
    issues[0] = np.where(rng.random(n) < 0.4, rng.integers(1, 7, n), 0)
    issues[1] = rng.integers(1, 8, n)
    return issues


def _issue_row(tag: int, column: np.ndarray) -> np.ndarray:
    """The ring row of one flagged issue column, by hand: seven sign-extended i64 fields and the fail bits."""
    problem, field, value, limit, slot, position, entry, request = (int(x) for x in column)
    words = [tag, slot, position, value, limit, entry, request]
    row = [((w & 0xFFFFFFFF), (w >> 32) & 0xFFFFFFFF) for w in words]
    row.append((layout.FAIL_INVALID_INPUT, field | problem << 8))
    return np.asarray(row, np.uint32)


@pytest.mark.parametrize("config", [TINY_BLOCKS, None], ids=["tiny_blocks", "default"])
@pytest.mark.parametrize("ring_start", ["empty", "almost_full", "saturated"])
def test_input_issues_come_first(ring_start, config):
    """The caller's ``input_issues``: their flagged columns' rows land first, in column order, on every backend."""
    shape = MANY
    *args, tags = make_case(3, shape, ring_start=ring_start)
    issues = _random_issues(np.random.default_rng(5), 70)  # 70 columns: several chunks of the ring kernel
    want = _phase(*args, jnp.asarray(issues), tags=tags, shape=shape, backend="xla")
    got = _phase(*args, jnp.asarray(issues), tags=tags, shape=shape, backend="interpret", config=config)
    chex.assert_trees_all_equal(got, want)
    log = args[1]
    flagged = issues[:, issues[0] != 0]
    start, capacity = int(log.write_index[0]), log.ring.shape[0]
    placed = max(min(flagged.shape[1], capacity - start), 0)
    expected = [_issue_row(tags[0], flagged[:, k]) for k in range(placed)]
    ring = np.asarray(want[1].ring)
    np.testing.assert_array_equal(ring[start : start + placed], np.asarray(expected).reshape(placed, 8, 2))
    without = _phase(*args, tags=tags, shape=shape, backend="xla")
    assert int(want[1].write_index[0]) == min(int(without[1].write_index[0]) + flagged.shape[1], 2**31 - 1)


def test_no_tokens_and_one_request():
    shape = Shape(num_reqs=1, num_tokens=0, input_assert=True)
    for seed in range(2):
        _assert_same(make_case(seed, shape), shape)


def test_x64_gives_the_same_bytes():
    shape = VARIANTS["swa_k_partial_everything"]
    case = make_case(7, shape, ring_start="almost_full")
    want = _assert_same(case, shape)
    with jax.enable_x64(True):
        chex.assert_trees_all_equal(_assert_same(case, shape), want)


def test_a_clean_prefill_then_decode_is_silent():
    """Records written by the fused phase verify clean on the next step (real KV ALL, K and V)."""
    shape = Shape(num_reqs=3, max_len=8, num_tokens=12, capacity=24, mode=2, sources=(BF16_P4,))
    buffers, log, _, _, sources, tags = make_case(0, shape, ring_start="empty", clean_seeds=True)
    req_to_token = jnp.asarray(np.arange(1, 25, dtype=np.int32).reshape(3, 8))
    req_to_token = jnp.concatenate([jnp.zeros((1, 8), jnp.int32), req_to_token])
    rows = jnp.arange(1, 4, dtype=jnp.int32)
    cpa = jnp.ones((1,), jnp.int32)
    prefill = common.Batch(
        rows,
        jnp.zeros(3, jnp.int32),
        jnp.full(3, 4, jnp.int32),
        req_to_token,
        jnp.arange(12, dtype=jnp.int32) * 7,
        jnp.tile(jnp.arange(4, dtype=jnp.int32), 3),
        req_to_token[1:, :4].reshape(-1),
    )
    decode = common.Batch(
        rows,
        jnp.full(3, 4, jnp.int32),
        jnp.ones(3, jnp.int32),
        req_to_token,
        jnp.zeros(12, jnp.int32),
        jnp.full(12, 4, jnp.int32),
        jnp.concatenate([req_to_token[1:, 4], jnp.full(9, -1, jnp.int32)]),
    )
    for backend in ("xla", "interpret"):
        state = (buffers, log)
        for batch in (prefill, decode):
            bufs, out, enable = _phase(*state, batch, cpa, sources, tags=tags, shape=shape, backend=backend)
            state = (bufs, out)
            assert int(enable[0]) == 1
        assert int(state[1].write_index[0]) == 0, backend


def test_api_checks_teach():
    shape = VARIANTS["head_kv_input_assert_table"]
    buffers, log, batch, cpa, sources, tags = make_case(0, shape)
    call = functools.partial(
        api.phase, log=log, batch=batch, enable_chain_position_assert=cpa, verify_capacity=8, backend="xla"
    )
    with pytest.raises(ValueError, match="one distinct launch tag per buffer"):
        call(buffers, tags=(2,))
    with pytest.raises(ValueError, match="same num_slots"):
        call((buffers[0], buffers[1][:5]), tags=tags)
    with pytest.raises(ValueError, match="window=3 needs batch.full_to_swa_index_mapping"):
        call(buffers, tags=tags, window=3)
    with pytest.raises(TypeError, match="check_table must be a bool; got 1"):
        call(buffers, tags=tags, check_table=1)
    with pytest.raises(TypeError, match="skip_bad_requests must be a bool; got 'yes'"):
        call(buffers, tags=tags, skip_bad_requests="yes")
    with pytest.raises(ValueError, match=r"log.verify_overflows must have shape \(1,\)"):
        call(buffers, tags=tags, log=log._replace(verify_overflows=jnp.zeros((2,), jnp.int32)))
    with pytest.raises(ValueError, match=r"input_issues must have shape \(8, \*\); got input_issues.shape=\(7, 2\)"):
        call(buffers, tags=tags, input_issues=jnp.zeros((7, 2), jnp.int32))
    with pytest.raises(TypeError, match="batch.input_ids must have dtype int32"):
        api.phase(
            buffers,
            log,
            dataclasses.replace(batch, input_ids=batch.input_ids.astype(jnp.uint32)),
            cpa,
            tags=tags,
            verify_capacity=8,
        )
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match=r"backend='pallas'.*lowered for 'cpu'"):
            jax.jit(functools.partial(call, tags=tags, backend="pallas"))(buffers)


def test_reference_plan_is_build_plans():
    """The phase's plan formulas are kvcanary_jax.build_plans' (one copy lives in each layer)."""
    import kvcanary_jax as kc

    shape = VARIANTS["swa_k_partial_everything"]
    for seed in range(3):
        _, _, b, *_ = make_case(seed, shape, overflow=seed == 2, out_of_range=False)
        b = common.with_roles(b)  # SGLang's roles: rows with a table row are requests
        plan = plans.build_plan(
            b,
            capacity=shape.capacity,
            window=shape.window,
            token_offset=1,
            full_slots=shape.num_slots,
            group_slots=shape.swa_slots or shape.num_slots,
        )
        vplan, wplan = kc.build_plans(
            b.req_pool_indices,
            b.prefix_lens,
            b.extend_lens,
            b.req_to_token,
            verify_capacity=shape.capacity,
            write_req_capacity=b.req_pool_indices.shape[0],
            swa_window_size=shape.window,
            full_to_swa_index_mapping=b.full_to_swa_index_mapping,
            req_to_verify_expected_tokens=b.token_ids,
            expected_tokens_valid_lens=b.token_ids_lens,
            kv_token_id_vs_position_offset=1,
        )
        chex.assert_trees_all_equal(
            (plan.slot_indices, plan.expected_tokens, plan.expected_positions, plan.prev_slot_indices, plan.enable),
            (
                vplan.slot_indices,
                vplan.expected_tokens,
                vplan.expected_positions,
                vplan.prev_slot_indices,
                vplan.enable,
            ),
        )
        chex.assert_trees_all_equal(
            (plan.write_offsets, plan.seed_slot_indices), (wplan.write_offsets, wplan.seed_slot_indices)
        )


def test_real_kv_fold_traces_its_loop_once_per_shape():
    """``realkv.fold_slots``' jnp loop is traced once per shape, not once per caller trace (issue 16)."""
    from jax._src.lax.control_flow import loops  # private: skip where jax moved it

    from pallas_kernels import realkv

    body_cache = getattr(loops, "_fori_scan_body_fun", None)
    if not hasattr(body_cache, "cache_info"):
        pytest.skip("this jax has no _fori_scan_body_fun cache to inspect")
    sources = (realkv.RealKvSource(jnp.zeros((8, 4, 32), jnp.bfloat16), page_size=4),)  # ALL: 4 chunks, a loop
    slots = jnp.arange(16, dtype=jnp.int32)
    before = body_cache.cache_info().misses
    for i in range(5):  # five fresh caller traces
        jax.jit(lambda s, x, i=i: realkv.fold_slots(s, x + i, 2)).lower(sources, slots)
    assert body_cache.cache_info().misses - before <= 1
