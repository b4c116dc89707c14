"""Host-side pools of the demo scheduler: KV slots, the SWA pool with its full->SWA table, and request rows."""

from __future__ import annotations

import collections

import numpy as np

PADDING_SLOT = 0  # KV slot 0 and request row 0 are padding: never handed out, never real context.


class SlotAllocator:
    """Token-granular free list over slots 1..num_slots-1.

    FIFO, like SGLang's allocator: a freed slot goes to the back, so reuse happens, but not instantly. A request's
    slots therefore need not be page-contiguous, which is a harsher test of the slot mapping than page allocation.
    """

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is padding); got {num_slots=}")
        self.num_slots = num_slots
        self._free = collections.deque(range(1, num_slots))
        self._in_use = np.zeros(num_slots, bool)
        self.alloc_counts = np.zeros(num_slots, np.int64)  # times each slot was handed out; > 1 means reuse

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        """Returns i32[n] fresh slots, or None (allocating nothing) when fewer than n are free."""
        if n > len(self._free):
            return None
        out = np.array([self._free.popleft() for _ in range(n)], np.int32)
        assert not self._in_use[out].any() and PADDING_SLOT not in out, "allocator handed out a live slot"
        self._in_use[out] = True
        self.alloc_counts[out] += 1
        return out

    def free(self, slots: np.ndarray) -> None:
        """Returns slots to the pool. Raises RuntimeError on a double free or on freeing the padding slot."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        if len(np.unique(slots)) != len(slots) or (slots <= 0).any() or not self._in_use[slots].all():
            raise RuntimeError(f"double free or bad slot in {slots.tolist()}")
        self._in_use[slots] = False
        self._free.extend(slots.tolist())

    def is_in_use(self, slots: np.ndarray) -> np.ndarray:
        return self._in_use[np.asarray(slots)]


class SwaPool:
    """The SWA sub-pool plus `full_to_swa_index_mapping`, SGLang's full->SWA slot table.

    `lut[full_slot]` is the SWA slot holding that token's SWA-layer KV, or 0 when it is not resident (never
    allocated, fallen out of the window, or evicted). The table has num_full_slots + 1 entries, as in SGLang.
    """

    def __init__(self, num_swa_slots: int, num_full_slots: int):
        self.allocator = SlotAllocator(num_swa_slots)
        self.lut = np.zeros(num_full_slots + 1, np.int32)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def alloc_for(self, full_slots: np.ndarray) -> np.ndarray | None:
        """Gives each full slot an SWA slot and records it in the LUT; None if the SWA pool is short."""
        swa = self.allocator.alloc(len(full_slots))
        if swa is not None:
            assert not self.lut[full_slots].any(), "full slot already has an SWA slot"
            self.lut[full_slots] = swa
        return swa

    def free_for(self, full_slots: np.ndarray) -> int:
        """Frees the resident SWA slots of `full_slots` and zeroes their LUT entries; returns how many."""
        full_slots = np.asarray(full_slots, np.int64)
        resident = full_slots[self.lut[full_slots] != 0]
        if len(resident):
            self.allocator.free(self.lut[resident])
            self.lut[resident] = 0
        return len(resident)

    def num_resident(self, full_slots: np.ndarray) -> int:
        return int(np.count_nonzero(self.lut[np.asarray(full_slots, np.int64)]))


class ReqToTokenPool:
    """`req_to_token i32[max_reqs, max_context_len]`: row r maps a request's positions to full-pool slots.

    Row 0 is the padding row (all zeros, what padding batch rows point at). Freed rows keep stale slots, as in
    SGLang: only `[0, seq_len)` of a live row is meaningful. `token_ids` mirrors the table with token ids, the
    history the canary's verify-token check compares against.
    """

    def __init__(self, max_reqs: int, max_context_len: int):
        if max_reqs < 2:
            raise ValueError(f"max_reqs must be >= 2 (row 0 is padding); got {max_reqs=}")
        self.req_to_token = np.zeros((max_reqs, max_context_len), np.int32)
        self.token_ids = np.zeros((max_reqs, max_context_len), np.int32)
        self._free = collections.deque(range(1, max_reqs))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, row: int) -> None:
        assert row != 0 and row not in self._free, f"bad request row free: {row}"
        self._free.append(row)
