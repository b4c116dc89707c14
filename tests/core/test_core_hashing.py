"""SPEC §4 golden values: splitmix64, the chain, the real-KV fold; device (u32 pairs) == host (Python ints)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import testing
from pallas_kernels import hash64, realkv
from tests.core.canary_testlib import (
    NUM_SLOTS,
    TAG_HEAD,
    U64,
    jit_write,
    new_buf,
    new_state,
    records,
    write_batch,
)

SPLITMIX_GOLDEN = [
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF),
    (1, 0x5692161D100B05E5),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
    (2**64 - 1, 0xB4D055FCF2CBBD7B),
    (2**63, 0x25C26EA579CEA98A),
    (0xC0FFEE1234567890, 0xDE7FAE23A9A1B716),
]
CHAIN_GOLDEN = [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634]
REAL_KV_BYTES = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])
REAL_KV_GOLDEN = 0x6041580849E6407D
REAL_KV_ONE_SOURCE_GOLDEN = 0xF036E30B6961C78D


def _pairs(values):
    v = np.asarray(values, np.uint64)
    return jnp.asarray((v & np.uint64(0xFFFFFFFF)).astype(np.uint32)), jnp.asarray(
        (v >> np.uint64(32)).astype(np.uint32)
    )


def _ints(pair):
    lo, hi = (np.asarray(x).astype(np.uint64) for x in pair)
    return ((hi << np.uint64(32)) | lo).tolist()


_device_splitmix = jax.jit(hash64.splitmix64)
_device_mix3 = jax.jit(lambda a, b, c: hash64.mix3(a, hash64.from_i32(b), hash64.from_i32(c)))


def test_splitmix64_golden_on_host():
    for x, want in SPLITMIX_GOLDEN:
        assert testing.splitmix64(x) == want, hex(x)
    assert testing.anchor_hash() == kc.ANCHOR_HASH == 0xDE7FAE23A9A1B716
    assert kc.CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890


def test_splitmix64_golden_on_device():
    inputs = [x for x, _ in SPLITMIX_GOLDEN]
    assert _ints(_device_splitmix(_pairs(inputs))) == [want for _, want in SPLITMIX_GOLDEN]
    assert _ints(jax.jit(hash64.anchor_hash)(jnp.zeros((3,), jnp.int32))) == [kc.ANCHOR_HASH] * 3


def test_device_hash_equals_host_hash_on_random_values():
    rng = np.random.default_rng(1234)
    a = rng.integers(0, 2**64, size=512, dtype=np.uint64, endpoint=False)
    a[:4] = [0, 1, 2**63, 2**64 - 1]  # edge cases of the carries and the sign bit
    assert _ints(_device_splitmix(_pairs(a))) == [testing.splitmix64(int(x)) for x in a]
    # mix3 with int32 tokens/positions sign-extended to 64 bits (negative values included).
    b = rng.integers(-(2**31), 2**31, size=512).astype(np.int32)
    c = rng.integers(-(2**31), 2**31, size=512).astype(np.int32)
    b[:3], c[:3] = [-1, -(2**31), 2**31 - 1], [-1, 0, -5]
    got = _ints(_device_mix3(_pairs(a), jnp.asarray(b), jnp.asarray(c)))
    assert got == [testing.mix3(int(x), int(y), int(z)) for x, y, z in zip(a, b, c, strict=True)]


def test_splitmix64_is_traced_once_per_input_shape():
    """A phase hashes at many call sites: each input shape's trace is made once and shared, not redone per call."""

    def three(a, b, c):
        return hash64.splitmix64(a), hash64.splitmix64(b), hash64.splitmix64(c)

    def pair(n, seed):
        words = np.random.default_rng(seed).integers(0, 2**32, size=(2, n), dtype=np.uint32)
        return jnp.asarray(words[0]), jnp.asarray(words[1])

    args = (pair(8, 0), pair(8, 1), pair(16, 2))
    eqns = jax.make_jaxpr(three)(*args).jaxpr.eqns
    traces = [e.params["jaxpr"] for e in eqns if e.params.get("name") == "splitmix64"]
    assert len(traces) == len(eqns) == 3, [e.primitive.name for e in eqns]
    assert traces[0] is traces[1] and traces[2] is not traces[0]
    got = [_ints(h) for h in three(*args)]
    assert got == [[testing.splitmix64(int(lo) | int(hi) << 32) for lo, hi in zip(*a, strict=True)] for a in args]


def test_u64_helpers_match_python_ints():
    rng = np.random.default_rng(7)
    a = rng.integers(0, 2**64, size=256, dtype=np.uint64, endpoint=False)
    b = rng.integers(0, 2**64, size=256, dtype=np.uint64, endpoint=False)
    a[0], b[0] = 2**64 - 1, 1  # carry out of the top word wraps
    a[1], b[1] = 0xFFFFFFFF, 1  # carry from lo into hi
    got_add = _ints(jax.jit(hash64.add)(_pairs(a), _pairs(b)))
    assert got_add == [(int(x) + int(y)) & U64 for x, y in zip(a, b, strict=True)]
    for constant in (hash64.SPLITMIX_MUL_1, hash64.SPLITMIX_MUL_2, 0xFFFFFFFFFFFFFFFF, 3):
        got = _ints(jax.jit(lambda x, c=constant: hash64.mul_const(x, c))(_pairs(a)))
        assert got == [(int(x) * constant) & U64 for x in a], hex(constant)
    for s in (1, 27, 30, 31):
        got = _ints(jax.jit(lambda x, s=s: hash64.shr(x, s))(_pairs(a)))
        assert got == [int(x) >> s for x in a], s
    x32 = np.array([-1, -(2**31), 0, 5, 2**31 - 1], np.int32)
    assert _ints(hash64.from_i32(jnp.asarray(x32))) == [int(v) & U64 for v in x32]


def test_chain_golden_through_canary_write():
    """Tokens 101..505 at positions 0..4 written from seed -1 into slots 1..5 store SGLang's PREV_HASH values."""
    plan, ids, pos, loc = write_batch([(-1, [(s, 101 * s, s - 1) for s in range(1, 6)])])
    buf, _ = jit_write(new_state(), new_buf(), plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")
    recs = records(buf)
    assert [recs[s][2] for s in range(1, 6)] == CHAIN_GOLDEN
    assert [recs[s][:2] for s in range(1, 6)] == [[101 * s, s - 1] for s in range(1, 6)]
    # Host chain agrees: each PREV_HASH is H(predecessor).
    for s in range(2, 6):
        assert testing.chain_hash(recs[s - 1][2], recs[s - 1][0], recs[s - 1][1]) == recs[s][2]


def test_chain_golden_survives_slot_remapping():
    """The golden chain snapshot from slots 1..5 and restored into scattered slots: same bytes, verified clean, and
    the next token written after the new last slot chains exactly as after the old one (no field names a slot)."""
    plan, ids, pos, loc = write_batch([(-1, [(s, 101 * s, s - 1) for s in range(1, 6)])])
    buf, _ = jit_write(new_state(), new_buf(), plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")
    new_slots = [40, 7, 33, 12, 50]
    snap = kc.snapshot_records(buf, jnp.arange(1, 6, dtype=jnp.int32))
    moved, state = jax.jit(kc.restore_and_verify, static_argnames=("tag",))(
        new_state(), new_buf(), snap, jnp.asarray(new_slots, jnp.int32), jnp.asarray([-1, *new_slots[:4]], jnp.int32),
        jnp.arange(5, dtype=jnp.int32), tag=TAG_HEAD,
    )  # fmt: skip
    assert not kc.read_violations(state.violation_log).is_errored
    assert [records(moved)[s][2] for s in new_slots] == CHAIN_GOLDEN
    after = {}
    for name, (b, prev) in {"old": (buf, 5), "new": (moved, 50)}.items():
        plan, ids, pos, loc = write_batch([(prev, [(60, 606, 5)])])
        after[name] = records(jit_write(new_state(), b, plan, ids, pos, loc, tag=TAG_HEAD, backend="xla")[0])[60]
    assert after["old"] == after["new"] == [606, 5, testing.chain_hash(CHAIN_GOLDEN[4], 505, 4), 0]


def test_real_kv_golden_host():
    assert testing.fold_bytes(REAL_KV_BYTES) == REAL_KV_ONE_SOURCE_GOLDEN
    assert testing.fold_sources([REAL_KV_BYTES]) == REAL_KV_GOLDEN
    assert testing.splitmix64(REAL_KV_ONE_SOURCE_GOLDEN) == REAL_KV_GOLDEN
    with pytest.raises(ValueError, match="multiple of 16"):
        testing.fold_bytes(b"\x00" * 8)


def test_real_kv_one_source_fold_on_device():
    words = np.frombuffer(REAL_KV_BYTES, np.uint32)
    acc = realkv.fold_chunk(hash64.const(0), tuple(jnp.uint32(w) for w in words))
    assert _ints(acc) == REAL_KV_ONE_SOURCE_GOLDEN


# The same 16 bytes at slot 1 of a uint8[NUM_SLOTS, 16] page table, viewed as other dtypes (the bytes are what count;
# the float views hold NaN bit patterns, which must survive untouched).
_VIEWS = [np.uint8, np.int8, jnp.bfloat16, jnp.float8_e4m3fn, np.float32, np.int32]
_MODES = [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL]
_fold_slots = jax.jit(realkv.fold_slots, static_argnums=(2,))


def _golden_source(view):
    raw = np.zeros((NUM_SLOTS, 16), np.uint8)
    raw[1] = np.frombuffer(REAL_KV_BYTES, np.uint8)
    return kc.RealKvSource(jnp.asarray(raw.view(np.dtype(view))), page_size=1, num_bytes_per_token=16, read_bytes=16)


@pytest.mark.parametrize("mode", _MODES, ids=["partial", "all"])
@pytest.mark.parametrize("view", _VIEWS, ids=lambda d: np.dtype(d).name)
def test_real_kv_golden_fold_of_dtype_views(mode, view):
    got = _ints(_fold_slots((_golden_source(view),), jnp.array([1, 0], jnp.int32), int(mode)))
    assert got == [REAL_KV_GOLDEN, testing.fold_sources([bytes(16)])]
    assert _ints(_fold_slots((_golden_source(view),), jnp.array([1], jnp.int32), 0)) == [0]  # NONE folds nothing


def test_real_kv_golden_through_canary_write():
    """ALL mode, the uint8 view (PARTIAL and the other views go through the write in test_core_write)."""
    plan, ids, pos, loc = write_batch([(-1, [(1, 7, 0), (2, 8, 1)])])
    buf, _ = jit_write(
        new_state(),
        new_buf(),
        plan,
        ids,
        pos,
        loc,
        tag=TAG_HEAD,
        real_kv_sources=(_golden_source(np.uint8),),
        real_kv_hash_mode=kc.RealKvHashMode.ALL,
        backend="xla",
    )
    assert records(buf)[1][3] == REAL_KV_GOLDEN
    assert records(buf)[2][3] == testing.fold_sources([bytes(16)])


def test_x64_mode_gives_identical_hashes():
    a = np.random.default_rng(3).integers(0, 2**64, size=64, dtype=np.uint64, endpoint=False)
    off = _ints(jax.jit(hash64.splitmix64)(_pairs(a)))
    with jax.enable_x64(True):
        on = _ints(jax.jit(hash64.splitmix64)(_pairs(a)))
    assert off == on == [testing.splitmix64(int(x)) for x in a]
