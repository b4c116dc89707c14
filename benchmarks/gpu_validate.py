"""Differential run on a GPU: the Pallas kernels (backend="pallas") against the xla path at realistic sizes.

Usage: python benchmarks/gpu_validate.py [--out DIR]

Replays the generators of ``tests/pallas_kernels/kernel_cases.py`` at GPU sizes (>= 1M verify entries, paged
bf16/fp8/int KV pools with arbitrary bit patterns, noisy decode and prefill writes with duplicate slots), compares
with ``chex.assert_trees_all_equal``, checks the compiled HLO for copies of the canary buffer or the KV pool, and
prints one line per case plus a summary. Writes ``validate.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import traceback
import warnings
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "pallas_kernels"))
import kernel_cases as cases  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvcanary_jax as kc  # noqa: E402
from pallas_kernels import compat, realkv  # noqa: E402
from pallas_kernels.batch_checks import api as batch_checks_api  # noqa: E402
from pallas_kernels.phase import api as phase_api  # noqa: E402
from pallas_kernels.verify import api as verify_api  # noqa: E402
from pallas_kernels.verify import pallas_triton as verify_triton  # noqa: E402
from pallas_kernels.write import api as write_api  # noqa: E402
from tests.pallas_kernels import phase_cases  # noqa: E402

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"
BF16_P16 = cases.SourceSpec("bfloat16", 16, 256, 256)
FP8_P1 = cases.SourceSpec("float8_e4m3fn", 1, 64, 48, row_padding=16)
FOUR = (
    cases.SourceSpec("float32", 4, 32, 32),
    cases.SourceSpec("int8", 1, 48, 32),
    cases.SourceSpec("uint8", 16, 16, 16),
    cases.SourceSpec("bfloat16", 1, 64, 64, row_padding=32),
)
_START = time.perf_counter()
LOG: list[str] = []


def log(line: str) -> None:
    line = f"[{time.perf_counter() - _START:6.1f}s] {line}"
    print(line, flush=True)
    LOG.append(line)


@functools.partial(jax.jit, static_argnames=("mode", "check", "backend", "config"))
def _verify(buf, plan, num_active, sources, *, mode, check, backend, config=None):
    if config is not None:
        return verify_triton.verify_bits(
            buf,
            *plan,
            num_active,
            real_kv_sources=sources,
            real_kv_hash_mode=mode,
            check_expected_token=check,
            interpret=backend == "interpret",
            config=config,
        )
    return verify_api.verify(
        buf,
        *plan,
        num_active,
        real_kv_sources=sources,
        real_kv_hash_mode=mode,
        check_expected_token=check,
        backend=backend,
    )


@functools.partial(jax.jit, static_argnames=("mode", "backend"))
def _write(buf, inputs, flag, sources, *, mode, backend):
    return write_api.write(buf, *inputs, flag, real_kv_sources=sources, real_kv_hash_mode=mode, backend=backend)


RESULTS = {"pass": 0, "fail": 0}


SELECTED: list[str] = []


def case(name: str, fn) -> None:
    if SELECTED and not any(word in name for word in SELECTED):
        return
    start = time.perf_counter()
    try:
        detail = fn()
        RESULTS["pass"] += 1
        log(f"PASS {name} ({time.perf_counter() - start:.1f}s) {detail or ''}")
    except Exception as e:  # one failing case must not hide the others
        RESULTS["fail"] += 1
        log(f"FAIL {name}: {type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()


def verify_case(seed, specs, mode, check, *, num_slots, num_reqs, max_len, actives=(None,), config=None):
    def run():
        rng = np.random.default_rng(seed)
        sources = cases.make_sources(rng, num_slots, specs)
        buf, sources, plan, n = cases.verify_inputs(
            rng, num_slots=num_slots, num_reqs=num_reqs, max_len=max_len, sources=sources, mode=mode
        )
        seen = 0
        for active in actives:
            active = n if active is None else jnp.int32(active)
            want = _verify(buf, plan, active, sources, mode=mode, check=check, backend="xla")
            got = _verify(buf, plan, active, sources, mode=mode, check=check, backend=BACKEND, config=config)
            chex.assert_trees_all_equal(got, want)
            seen |= int(np.bitwise_or.reduce(np.asarray(want)))
        return f"entries={int(n)} capacity={plan[0].shape[0]} bits seen={seen:#x}"

    return run


def write_case(seeds, specs, mode, *, num_slots, num_reqs, max_len):
    def run():
        written = dup = 0
        for seed in seeds:
            rng = np.random.default_rng(seed)
            inputs = cases.write_inputs(rng, num_slots=num_slots, num_reqs=num_reqs, max_len=max_len)
            buf = cases.random_buffer(rng, num_slots)
            sources = cases.make_sources(rng, num_slots, specs)
            for flag in (1, 0):
                flag = jnp.full((1,), flag, jnp.int32)
                want = _write(buf, inputs, flag, sources, mode=mode, backend="xla")
                got = _write(buf, inputs, flag, sources, mode=mode, backend=BACKEND)
                chex.assert_trees_all_equal(got, want)
            loc = np.asarray(inputs[5])[np.asarray(want[1].written)]
            written += loc.size
            dup += loc.size - np.unique(loc).size
        return f"tokens={inputs[5].shape[0]} x {len(seeds)} seeds, written={written}, duplicate writes={dup}"

    return run


def clean_law(num_reqs: int, max_len: int, num_slots: int):
    """The Pallas verify of fresh chains written by the Pallas write is silent, real KV included."""

    def run():
        rng = np.random.default_rng(11)
        offsets, seeds, num_valid, ids, positions, loc = cases.write_inputs(
            rng, num_slots=num_slots, num_reqs=num_reqs, max_len=max_len, extra_tokens=0, clean=True
        )
        sources = cases.make_sources(rng, num_slots, (BF16_P16,))
        zeros = jnp.zeros((num_slots, 4, 2), jnp.uint32)
        inputs = (offsets, seeds, num_valid, ids, positions, loc)
        flag = jnp.ones((1,), jnp.int32)
        got = _write(zeros, inputs, flag, sources, mode=2, backend=BACKEND)
        n = int(offsets[-1])
        o, lc = np.asarray(offsets), np.asarray(loc)[:n]
        prev = np.where(np.isin(np.arange(n), o), -1, np.roll(lc, 1)).astype(np.int32)
        plan = (loc[:n], ids[:n], positions[:n], jnp.asarray(prev))
        bits = _verify(got[0], plan, jnp.int32(n), sources, mode=2, check=True, backend=BACKEND)
        chex.assert_trees_all_equal(bits, jnp.zeros((n,), jnp.int32))
        return f"{n} tokens written and verified clean"

    return run


def canary_ops(num_slots: int, num_reqs: int, max_len: int, write_reqs: int):
    """kvcanary_jax level: whole states (ring rows, index, counters) and buffers identical across backends."""

    def run():
        rng = np.random.default_rng(12)
        sources = cases.make_sources(rng, num_slots, (BF16_P16, FP8_P1))
        buf, sources, plan, n = cases.verify_inputs(
            rng, num_slots=num_slots, num_reqs=num_reqs, max_len=max_len, sources=sources, mode=2
        )
        vplan = kc.VerifyPlan(*plan, num_valid=jnp.asarray([n], jnp.int32), enable=jnp.ones((1,), jnp.int32))
        offsets, seeds, num_valid, ids, positions, loc = cases.write_inputs(
            rng, num_slots=num_slots, num_reqs=write_reqs, max_len=1
        )
        wplan = kc.WritePlan(write_offsets=offsets, seed_slot_indices=seeds, num_valid_reqs=num_valid)
        expected_ids = jnp.where(jnp.asarray(rng.random(ids.shape[0]) < 0.1), ids + 1, ids)

        @functools.partial(jax.jit, static_argnames="backend")
        def step(state, buf, vplan, wplan, tokens, sources, *, backend):
            # Everything is an argument: arrays closed over would be baked into the executable as constants.
            ids, positions, loc, expected_ids = tokens
            tag = kc.CanaryLaunchTag.TAIL_K_FULL
            state = kc.canary_verify(
                state,
                buf,
                vplan,
                tag=tag,
                real_kv_sources=sources,
                real_kv_hash_mode=2,
                check_expected_token=True,
                backend=backend,
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
                real_kv_hash_mode=2,
                expected_input_tokens=expected_ids,
                expected_input_positions=positions,
                backend=backend,
            )

        config = kc.CanaryConfig(ring_capacity=1024, enable_verify_token_assert=True)
        state = kc.CanaryDeviceState.allocate(config=config, req_to_token_alloc_size=2, max_context_len=4)
        operands = (state, buf, vplan, wplan, (ids, positions, loc, expected_ids), sources)
        got, want = step(*operands, backend=BACKEND), step(*operands, backend="xla")
        chex.assert_trees_all_equal(got, want)
        index = int(want[1].violation_log.violation_write_index[0])
        return f"verify entries={int(n)}, write tokens={ids.shape[0]}, ring index={index}"

    return run


def x64_case():
    def run():
        with jax.enable_x64(True):
            rng = np.random.default_rng(13)
            data = jnp.asarray(rng.integers(-(2**62), 2**62, (4096, 4)), jnp.int64)
            sources = (realkv.RealKvSource(data),)
            buf, sources, plan, n = cases.verify_inputs(
                rng, num_slots=4096, num_reqs=8, max_len=256, sources=sources, mode=2
            )
            chex.assert_trees_all_equal(
                _verify(buf, plan, n, sources, mode=2, check=True, backend=BACKEND),
                _verify(buf, plan, n, sources, mode=2, check=True, backend="xla"),
            )
            inputs = cases.write_inputs(rng, num_slots=4096, num_reqs=16, max_len=64)
            flag = jnp.ones((1,), jnp.int32)
            chex.assert_trees_all_equal(
                _write(buf, inputs, flag, sources, mode=2, backend=BACKEND),
                _write(buf, inputs, flag, sources, mode=2, backend="xla"),
            )
        return "int64 source under x64"

    return run


def batch_checks_case(num_rows: int, num_tokens: int, seeds=range(3)):
    """The batch-checks kernel equals the jnp reference on random batches with bad values of every kind, for every
    padding convention, with and without the token-history check."""

    def run():
        flagged = 0
        for seed in seeds:
            rng = np.random.default_rng(seed)
            bad = rng.random(num_rows) < 0.05
            rpi = np.where(
                bad & (rng.random(num_rows) < 0.5), rng.integers(-2, 600, num_rows), rng.integers(1, 500, num_rows)
            )
            cached = np.where(bad & (rng.random(num_rows) < 0.3), -1, rng.integers(0, 1000, num_rows))
            extend = rng.integers(0, 2 * num_tokens // num_rows + 1, num_rows)
            extend = np.where(bad & (rng.random(num_rows) < 0.3), -1, extend)
            loc = np.where(
                rng.random(num_tokens) < 0.01, rng.integers(-2, 10_000, num_tokens), rng.integers(1, 9000, num_tokens)
            )
            lens = rng.integers(-1, 1100, num_rows)
            arrays = [jnp.asarray(x, jnp.int32) for x in (rpi, cached, extend, loc, lens)]
            for padding in ("negative", "reserved", "none"):
                for width in (None, 1024):
                    static = dict(
                        padding=padding, table_rows=512, context_len=1100, num_slots=9000, token_ids_width=width
                    )
                    lens_arg = arrays[4] if width else None
                    got = batch_checks_api.check(*arrays[:4], lens_arg, backend=BACKEND, **static)
                    want = batch_checks_api.check(*arrays[:4], lens_arg, backend="xla", **static)
                    chex.assert_trees_all_equal(got, want)
                    flagged += int(np.count_nonzero(np.asarray(want.issues[0])))
        return f"{len(seeds) * 6} batches equal, {flagged} candidates flagged"

    return run


@functools.partial(jax.jit, static_argnames=("tags", "shape", "backend", "skip_bad_requests", "batch_checks"))
def _phase(buffers, log, batch, cpa, sources, *, tags, shape, backend, skip_bad_requests=False, batch_checks=None):
    return phase_api.phase(
        buffers,
        log,
        batch,
        cpa,
        tags=tags,
        real_kv_sources=sources,
        real_kv_hash_mode=shape.mode,
        verify_capacity=shape.capacity,
        window=shape.window,
        token_offset=shape.token_offset,
        check_table=shape.check_table,
        skip_bad_requests=skip_bad_requests,
        batch_checks=batch_checks,
        full_slots=shape.num_slots if batch_checks else None,  # the checks' FULL pool
        backend=backend,
    )


def phase_checks_case(shape, seeds=range(1)):
    """The fused phase running the batch checks itself (its HEAD's check launch runs their programs, every
    program derives the rows' roles) against its jnp reference, on batches with rows the checks reject."""

    def run():
        details = []
        for seed in seeds:  # a HEAD (reported checks) and a TAIL, one compile each
            for padding, report in (("negative", True), ("reserved", False)):
                *args, tags = phase_cases.make_case(seed, shape, ring_start="mid" if report else "empty")
                args[2] = phase_cases.with_bad_rows(args[2], padding, seed + int(report))
                kw = dict(tags=tags, shape=shape, skip_bad_requests=True)
                checks = phase_api.BatchChecks(padding, report)
                want = _phase(*args, backend="xla", batch_checks=checks, **kw)
                got = _phase(*args, backend=BACKEND, batch_checks=checks, **kw)
                chex.assert_trees_all_equal(got, want)
                details.append(f"+{int(want[1].write_index[0]) - int(args[1].write_index[0])}")
        return f"capacity={shape.capacity} tokens={shape.num_tokens}, rows per run: " + " ".join(details)

    return run


def phase_case(shape, runs):
    """The fused phase (two kernels) against its jnp reference: buffers, ring, index, counters, enable.

    ``runs`` holds ``(seed, make_case keyword arguments)``; primed runs are mostly clean chains whose rows of all
    four launches land in the ring, the others flood it from any starting index; the runner's form (explicit
    roles, unmasked slots) runs with ``skip_bad_requests``."""

    def run():
        details = []
        for seed, kwargs in runs:
            *args, tags = phase_cases.make_case(seed, shape, **kwargs)
            skip = kwargs.get("masked") is False
            want = _phase(*args, tags=tags, shape=shape, backend="xla", skip_bad_requests=skip)
            got = _phase(*args, tags=tags, shape=shape, backend=BACKEND, skip_bad_requests=skip)
            chex.assert_trees_all_equal(got, want)
            index = int(want[1].write_index[0]) - int(args[1].write_index[0])
            landed = sorted(set(np.asarray(want[1].ring[:, 0, 0]).tolist()) & set(tags))
            details.append(f"+{index} rows (tags {landed}, enable {int(want[2][0])})")
        return f"capacity={shape.capacity} tokens={shape.num_tokens}: " + "; ".join(details)

    return run


def runner_paths(bs: int, ctx: int, steps: int = 3):
    """KvCanary's phase on the GPU's kernels against its xla reference, HEAD + TAIL steps with real KV, then the
    compiled fused step: no copy of a canary buffer or of the KV pool."""

    def run():
        page = 16
        pool = kc.CanaryPool(num_slots=bs * ctx + page, page_size=page, verify_capacity=bs * ctx)
        config = kc.CanaryConfig(real_kv_hash_mode="partial", ring_capacity=1024, enable_write_input_assert=True)
        fused = kc.KvCanary(config, pool)

        reference = kc.KvCanary(dataclasses.replace(config, backend="xla"), pool)
        rng = np.random.default_rng(15)
        kv = jnp.asarray(rng.integers(-100, 100, (bs * ctx // page + 1, page, 8, 128)), jnp.bfloat16)
        slots = 1 + rng.permutation(bs * ctx)[: bs * ctx].reshape(bs, ctx).astype(np.int32)
        req_to_token = jnp.asarray(np.concatenate([np.zeros((1, ctx), np.int32), slots]))

        def batch(prefix, extend):
            n = bs * extend
            positions = np.repeat(np.full(bs, prefix), extend) + np.tile(np.arange(extend), bs)
            loc = slots[np.repeat(np.arange(bs), extend), positions]
            ids = rng.integers(0, 1000, n).astype(np.int32)
            expected = np.where(rng.random(n) < 0.01, ids + 1, ids).astype(np.int32)
            return kc.CanaryBatch(
                jnp.arange(1, bs + 1, dtype=jnp.int32),
                jnp.full((bs,), prefix, jnp.int32),
                jnp.full((bs,), extend, jnp.int32),
                req_to_token,
                jnp.asarray(ids),
                jnp.asarray(positions, jnp.int32),
                jnp.asarray(loc, jnp.int32),
                expected_input_ids=jnp.asarray(expected),
            )

        def step_fn(canary):
            def step(state, b, kv):
                state = canary.before_forward(state, b)
                return canary.after_forward(state, b, canary.kv_sources(full_k=kv, full_v=kv))

            return jax.jit(step, donate_argnums=0)

        steps_fns = {"fused": step_fn(fused), "xla": step_fn(reference)}
        states = {name: canary.init_state() for name, canary in (("fused", fused), ("xla", reference))}
        batches = [batch(0, ctx - steps)] + [batch(ctx - steps + i, 1) for i in range(steps)]
        for i, b in enumerate(batches):
            if i == 1:
                kv = kv.at[1].add(1)  # corrupt some KV bytes after the prefill: TAIL real-KV rows
                states = {name: fused.mark_init_finished(s) for name, s in states.items()}
            states = {name: steps_fns[name](states[name], b, kv) for name in states}
            chex.assert_trees_all_equal(states["fused"], states["xla"])
        text = steps_fns["fused"].lower(states["fused"], batches[-1], kv).compile().as_text()
        big = (f"u32[{bs * ctx + page},4,2]", f"u32[{bs * ctx + page},8]", "bf16[" + ",".join(map(str, kv.shape)))
        copies = [line.strip()[:160] for line in text.splitlines() if " copy(" in line and any(b in line for b in big)]
        assert not copies, f"the fused step copies a canary buffer or the KV pool: {copies}"
        index = int(states["fused"].violation_log.violation_write_index[0])
        kernels = text.count(compat.TRITON_CUSTOM_CALL_TARGET)
        return f"{len(batches)} steps equal, ring index {index}, no big copies, triton calls in step text: {kernels}"

    return run


def hlo_checks():
    """No copy of the canary buffer (donated) and no copy of the KV pool in the compiled Pallas ops."""

    def run():
        num_slots = 1 << 20
        rng = np.random.default_rng(14)
        sources = cases.make_sources(rng, num_slots, (BF16_P16,))
        pool_bytes = sources[0].data.size * 2
        buf = cases.random_buffer(rng, num_slots)
        plan = tuple(jnp.asarray(rng.integers(0, num_slots, num_slots), jnp.int32) for _ in range(4))
        verify = jax.jit(
            lambda b, p, s: verify_api.verify(
                b, *p, jnp.int32(num_slots), real_kv_sources=s, real_kv_hash_mode=2, backend=BACKEND
            )
        )
        compiled = verify.lower(buf, plan, sources).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < pool_bytes // 4, f"verify temp buffers {temp} B: the {pool_bytes} B KV pool was copied"
        inputs = cases.write_inputs(rng, num_slots=num_slots, num_reqs=256, max_len=1)
        write = jax.jit(
            lambda b, i, s: write_api.write(
                b, *i, jnp.ones((1,), jnp.int32), real_kv_sources=s, real_kv_hash_mode=2, backend=BACKEND
            ),
            donate_argnums=0,
        )
        text = write.lower(buf, inputs, sources).compile().as_text()
        copies = [line.strip()[:160] for line in text.splitlines() if " copy(" in line or "copy-start" in line]
        buf_copies = [c for c in copies if f"u32[{num_slots},4,2]" in c or f"u32[{num_slots},8]" in c]
        assert not buf_copies, f"the donated canary buffer is copied: {buf_copies}"
        triton_calls = text.count(compat.TRITON_CUSTOM_CALL_TARGET) + text.count("triton")
        return f"verify temp={temp} B (pool {pool_bytes} B); write copies={copies}; triton mentions={triton_calls}"

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes")
    parser.add_argument("--cases", nargs="+", default=[], help="run only cases whose name contains one of these")
    parser.add_argument("--big", action="store_true", help="also the 64 x 8K fused-phase case (slow to set up)")
    args = parser.parse_args()
    SELECTED.extend(args.cases)
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"device={jax.devices()[0].device_kind} jax={jax.__version__} backend={BACKEND}")
    big = dict(num_slots=(1 << 20) + 64, num_reqs=1024, max_len=1024)
    mid = dict(num_slots=300_000, num_reqs=256, max_len=1024)
    if args.quick:
        big = mid = dict(num_slots=3000, num_reqs=8, max_len=64)
    # The fused phase first: the newest kernels; the per-op cases below compile the xla write slowly.
    floods = [(s, dict(ring_start=r)) for s, r in enumerate(phase_cases.RING_STARTS)]
    primed = [(10 + s, dict(ring_start="empty", primed=True, corrupt=c)) for s, c in enumerate((0.0005, 0.002))]
    overflow = [(20, dict(overflow=True))]
    runner_form = [(30, dict(ring_start="mid", roles=True, masked=False))]
    kv = dict(mode=1, sources=(BF16_P16,), input_assert=True, token_check=True, ring_capacity=1024, check_table=True)
    case("batch checks 256 rows, 770 tokens", batch_checks_case(256, 770))
    case("batch checks 4 rows, 8K tokens", batch_checks_case(4, 8192, seeds=range(1)))
    if args.quick:
        decode = phase_cases.Shape(num_slots=3000, num_reqs=8, max_len=64, num_tokens=24, capacity=500, **kv)
        case("phase decode (quick)", phase_case(decode, floods + primed + overflow + runner_form))
        case("phase decode with batch checks (quick)", phase_checks_case(decode))
        case("runner fused vs xla (quick)", runner_paths(4, 64))
    else:
        decode = phase_cases.Shape(
            num_slots=300_000, num_reqs=256, max_len=1024, num_tokens=770, capacity=256_000, **kv
        )
        case(
            "phase decode 256x1K PARTIAL K+V, asserts", phase_case(decode, floods[:3] + primed + overflow + runner_form)
        )
        case("phase decode 256x1K with batch checks, bad rows", phase_checks_case(decode))
        long = phase_cases.Shape(
            num_slots=600_000,
            num_reqs=64,
            max_len=8192,
            num_tokens=64,
            capacity=524_288,
            mode=2,
            sources=(BF16_P16,),
            ring_capacity=1024,
        )
        if args.big:
            case("phase decode 64x8K ALL K+V", phase_case(long, floods[:2] + primed[:1]))
        swa = phase_cases.Shape(
            num_slots=100_000,
            num_reqs=64,
            max_len=2048,
            num_tokens=130,
            capacity=65_536,
            halves=1,
            swa_slots=40_000,
            window=128,
            mode=2,
            sources=(FP8_P1,),
            token_check=True,
            input_assert=True,
            token_offset=1,
            ring_capacity=1024,
            check_table=True,
        )
        case("phase SWA K only ALL fp8, window 128", phase_case(swa, floods[:2] + primed[:1] + runner_form))
        prefill = phase_cases.Shape(
            num_slots=100_000,
            num_reqs=8,
            max_len=2048,
            num_tokens=4800,
            capacity=16_384,
            mode=1,
            sources=(BF16_P16,),
            max_extend=600,
            input_assert=True,
            ring_capacity=1024,
        )
        case("phase prefill 8x600 (sort winner rule)", phase_case(prefill, floods[:2] + primed[:1] + runner_form))
        case("runner fused vs xla 64x1K, no copies", runner_paths(64, 1024))
    case("verify 1M ALL bf16/p16 token-check", verify_case(1, (BF16_P16,), 2, True, **big))
    case(
        "verify 1M PARTIAL bf16/p16+fp8/p1, num_active ragged",
        verify_case(2, (BF16_P16, FP8_P1), 1, False, **big, actives=(None, 1000003 if not args.quick else 97)),
    )
    case("verify 256K NONE token-check", verify_case(3, (), 0, True, **mid))
    case(
        "verify 4 sources ALL, block=128, num_active 0/1/all",
        verify_case(
            4,
            FOUR,
            2,
            True,
            num_slots=20000,
            num_reqs=16,
            max_len=1000,
            actives=(0, 1, None),
            config=verify_triton.Config(block=128, num_warps=4),
        ),
    )
    case(
        "write decode bs=256 ALL bf16/p16",
        write_case(range(5), (BF16_P16,), 2, num_slots=5000, num_reqs=256, max_len=1),
    )
    case(
        "write decode bs=64 PARTIAL 4 sources", write_case(range(5, 8), FOUR, 1, num_slots=400, num_reqs=64, max_len=1)
    )
    case("write 4x1000 NONE", write_case(range(8, 10), (), 0, num_slots=5000, num_reqs=4, max_len=1000))
    case(
        "write 32x512 PARTIAL bf16+fp8",
        write_case(range(10, 12), (BF16_P16, FP8_P1), 1, num_slots=40000, num_reqs=32, max_len=512),
    )
    case(
        "clean write then verify, 256x1024 ALL",
        clean_law(256, 1024, 300_000) if not args.quick else clean_law(8, 64, 3000),
    )
    case(
        "canary_verify + canary_write states",
        canary_ops(num_slots=70_000, num_reqs=64, max_len=1024, write_reqs=256)
        if not args.quick
        else canary_ops(num_slots=3000, num_reqs=8, max_len=64, write_reqs=16),
    )
    case("x64 int64 sources", x64_case())
    if not args.quick:
        case("hlo: no buffer / KV-pool copies", hlo_checks())
    total = RESULTS["pass"] + RESULTS["fail"]
    log(f"SUMMARY {total} cases: {RESULTS['pass']} passed, {RESULTS['fail']} failed")
    (args.out / "validate.txt").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
