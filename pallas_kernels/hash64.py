"""64-bit hashing on uint32 (lo, hi) pairs: one copy shared by the XLA path and the Pallas kernel bodies.

A u64 is a tuple ``(lo, hi)`` of equally shaped ``uint32`` arrays. Only plain ``jnp``/``lax`` element-wise ops
are used, so these functions trace the same way in a jitted jnp function and inside a Pallas Triton kernel, and
give bit-identical results with ``jax_enable_x64`` on or off (no 64-bit dtype ever appears).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

U64 = tuple[jax.Array, jax.Array]

SPLITMIX_MUL_1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL_2 = 0x94D049BB133111EB
CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890

_MASK16 = 0xFFFF


def _u32(x: int) -> jax.Array:
    # Explicit dtype: a bare Python int would be weakly typed and could promote (pallas_notes §4).
    return jnp.uint32(x)


def const(value: int, like: jax.Array | None = None) -> U64:
    """A u64 constant as a (lo, hi) pair, broadcast to ``like``'s shape when given."""
    lo, hi = _u32(value & 0xFFFFFFFF), _u32((value >> 32) & 0xFFFFFFFF)
    if like is None:
        return lo, hi
    return jnp.full(like.shape, lo, jnp.uint32), jnp.full(like.shape, hi, jnp.uint32)


def from_i32(x: jax.Array) -> U64:
    """Sign-extends int32 values to u64, as SGLang widens int32 tokens/positions to int64."""
    x = x.astype(jnp.int32)
    hi = jnp.where(x < 0, _u32(0xFFFFFFFF), _u32(0))
    return x.astype(jnp.uint32), hi


def split(pairs: jax.Array) -> U64:
    """``u32[..., 2]`` storage layout to a (lo, hi) pair."""
    return pairs[..., 0], pairs[..., 1]


def join(x: U64) -> jax.Array:
    """A (lo, hi) pair to the ``u32[..., 2]`` storage layout (little-endian int64 bytes)."""
    return jnp.stack([x[0], x[1]], axis=-1)


def xor(a: U64, b: U64) -> U64:
    return a[0] ^ b[0], a[1] ^ b[1]


def eq(a: U64, b: U64) -> jax.Array:
    return (a[0] == b[0]) & (a[1] == b[1])


def ne(a: U64, b: U64) -> jax.Array:
    return (a[0] != b[0]) | (a[1] != b[1])


def where(c: jax.Array, a: U64, b: U64) -> U64:
    return jnp.where(c, a[0], b[0]), jnp.where(c, a[1], b[1])


def add(a: U64, b: U64) -> U64:
    """Addition mod 2^64; the carry is an unsigned compare (signed compares would be wrong, pallas_notes §4)."""
    lo = a[0] + b[0]
    carry = (lo < a[0]).astype(jnp.uint32)
    return lo, a[1] + b[1] + carry


def shr(a: U64, s: int) -> U64:
    """Logical right shift by a constant 0 < s < 32 (Triton shifts >= width are UB, pallas_notes §4)."""
    assert 0 < s < 32, s
    return (a[0] >> _u32(s)) | (a[1] << _u32(32 - s)), a[1] >> _u32(s)


def _mul32_wide(a: jax.Array, b_lo16: int, b_hi16: int) -> U64:
    """Full 32x32 -> 64-bit product of ``a`` and a 32-bit constant given as 16-bit limbs.

    Only 16-bit constants appear, so no literal >= 2^31 reaches the Triton lowering.
    """
    a0, a1 = a & _u32(_MASK16), a >> _u32(16)
    p00, p01 = a0 * _u32(b_lo16), a0 * _u32(b_hi16)
    p10, p11 = a1 * _u32(b_lo16), a1 * _u32(b_hi16)
    mid1 = p10 + (p00 >> _u32(16))  # < 2^32: (2^16-1)^2 + 2^16
    mid2 = p01 + (mid1 & _u32(_MASK16))
    lo = (mid2 << _u32(16)) | (p00 & _u32(_MASK16))
    hi = p11 + (mid1 >> _u32(16)) + (mid2 >> _u32(16))
    return lo, hi


def _mul32_low(a: jax.Array, b: int) -> jax.Array:
    """``(a * b) mod 2^32`` for a 32-bit constant, built from 16-bit limbs of ``b``."""
    return a * _u32(b & _MASK16) + ((a * _u32(b >> 16)) << _u32(16))


def mul_const(a: U64, c: int) -> U64:
    """``a * c mod 2^64`` for a Python-int constant: schoolbook on 32-bit halves, dropping terms >= 2^64."""
    c_lo, c_hi = c & 0xFFFFFFFF, (c >> 32) & 0xFFFFFFFF
    lo, hi = _mul32_wide(a[0], c_lo & _MASK16, c_lo >> 16)
    hi = hi + _mul32_low(a[0], c_hi) + _mul32_low(a[1], c_lo)
    return lo, hi


@jax.jit
def splitmix64(x: U64) -> U64:
    """The splitmix64 finalizer (shifts 30/27/31), exactly as SGLang's canary kernels.

    Jitted so that it is traced once per input shape and reused: a phase hashes at some fifty call sites, and
    tracing its ~60 element-wise ops anew at each was a quarter to a third of a wrapped step's trace time on
    CPU. XLA and the Pallas lowerings inline the call, so the compiled code is the same.
    """
    x = xor(x, shr(x, 30))
    x = mul_const(x, SPLITMIX_MUL_1)
    x = xor(x, shr(x, 27))
    x = mul_const(x, SPLITMIX_MUL_2)
    return xor(x, shr(x, 31))


def mix3(a: U64, b: U64, c: U64) -> U64:
    """``sm(sm(sm(a) ^ b) ^ c)``: the chain hash of a record (prev_hash, token, position)."""
    return splitmix64(xor(splitmix64(xor(splitmix64(a), b)), c))


def anchor_hash(like: jax.Array) -> U64:
    """``splitmix64(CANARY_CHAIN_ANCHOR)``, the hash of a chain head (slot < 0), shaped like ``like``."""
    return splitmix64(const(CANARY_CHAIN_ANCHOR, like))
