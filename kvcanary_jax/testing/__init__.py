"""What a user's test suite needs: assertions, fault injectors, a pytest guard, and the reference hashing.

- ``assert_no_violations`` / ``expect_violation``: chex-style assertions over a state or a report.
- Fault injectors (pure, jittable): ``flip_kv_byte``, ``corrupt_page``, ``remap_slot``, ``swap_tokens``; host target
  pickers ``choose_live_slot``, ``choose_remap``, ``choose_token_swap``; ``FaultKind`` and ``expected_detection``.
- ``CanaryGuard`` and the pytest plugin ``kvcanary_jax.testing.pytest_plugin`` (fixture ``kvcanary_guard``).
- ``splitmix64``, ``mix3``, ``chain_hash``, ``fold_bytes``, ``fold_sources``: the 64-bit formulas on Python ints,
  an oracle independent of the device code.
"""

from kvcanary_jax.testing._assertions import assert_no_violations as assert_no_violations
from kvcanary_jax.testing._assertions import expect_violation as expect_violation
from kvcanary_jax.testing._faults import FaultKind as FaultKind
from kvcanary_jax.testing._faults import corrupt_page as corrupt_page
from kvcanary_jax.testing._faults import expected_detection as expected_detection
from kvcanary_jax.testing._faults import flip_kv_byte as flip_kv_byte
from kvcanary_jax.testing._faults import remap_slot as remap_slot
from kvcanary_jax.testing._faults import swap_tokens as swap_tokens
from kvcanary_jax.testing._guard import CanaryGuard as CanaryGuard
from kvcanary_jax.testing._hashing import anchor_hash as anchor_hash
from kvcanary_jax.testing._hashing import chain_hash as chain_hash
from kvcanary_jax.testing._hashing import fold_bytes as fold_bytes
from kvcanary_jax.testing._hashing import fold_sources as fold_sources
from kvcanary_jax.testing._hashing import mix3 as mix3
from kvcanary_jax.testing._hashing import splitmix64 as splitmix64
from kvcanary_jax.testing._hashing import to_signed as to_signed
from kvcanary_jax.testing._targets import cached_entries as cached_entries
from kvcanary_jax.testing._targets import choose_live_slot as choose_live_slot
from kvcanary_jax.testing._targets import choose_remap as choose_remap
from kvcanary_jax.testing._targets import choose_token_swap as choose_token_swap
from kvcanary_jax.testing._targets import row_starts as row_starts

__all__ = [
    "CanaryGuard",
    "FaultKind",
    "anchor_hash",
    "assert_no_violations",
    "cached_entries",
    "chain_hash",
    "choose_live_slot",
    "choose_remap",
    "choose_token_swap",
    "corrupt_page",
    "expect_violation",
    "expected_detection",
    "flip_kv_byte",
    "fold_bytes",
    "fold_sources",
    "mix3",
    "remap_slot",
    "row_starts",
    "splitmix64",
    "swap_tokens",
    "to_signed",
]
