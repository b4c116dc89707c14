"""Host (Python int) splitmix64 and mix3: an independent oracle for tests and host tools.

The device code works on uint32 pairs (``pallas_kernels.hash64``); this is the plain 64-bit formula.
"""

from __future__ import annotations

from kvcanary_jax.core import _constants as constants

U64_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The splitmix64 finalizer on a Python int, modulo 2^64."""
    x &= U64_MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & U64_MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & U64_MASK
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    """``sm(sm(sm(a) ^ b) ^ c)``; negative ``b``/``c`` are sign-extended to 64 bits."""
    return splitmix64(splitmix64(splitmix64(a) ^ (b & U64_MASK)) ^ (c & U64_MASK))


def chain_hash(prev_hash: int, token: int, position: int) -> int:
    """H(slot) of a record holding (token, position, prev_hash)."""
    return mix3(prev_hash, token, position)


def anchor_hash() -> int:
    """H(-1): the PREV_HASH stored at the head of every chain."""
    return splitmix64(constants.CANARY_CHAIN_ANCHOR)


def fold_bytes(chunks: bytes) -> int:
    """One source's real-KV fold over ``chunks`` (a multiple of 16 bytes), little-endian u64 words."""
    if len(chunks) % 16:
        raise ValueError(f"fold_bytes needs a multiple of 16 bytes; got {len(chunks)}")
    acc = 0
    for off in range(0, len(chunks), 8):
        acc = splitmix64(acc ^ int.from_bytes(chunks[off : off + 8], "little"))
    return acc


def fold_sources(per_source_bytes: list[bytes]) -> int:
    """REAL_KV_HASH of one slot given each source's folded bytes, in source order."""
    outer = 0
    for chunk in per_source_bytes:
        outer = splitmix64(outer ^ fold_bytes(chunk))
    return outer


def to_signed(x: int) -> int:
    """A u64 as the int64 SGLang stores."""
    x &= U64_MASK
    return x - (1 << 64) if x >> 63 else x
