"""Host-side demo scheduler: admission, chunked prefill, decode, speculative extends, radix reuse, SWA windows."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

import kvcanary_jax as kc
from kvcanary_jax.demo import allocator, batch, radix, workload
from kvcanary_jax.demo.config import SchedulerConfig


@dataclasses.dataclass(eq=False)
class Request:
    """A request's host state. `tokens` = prompt + generated; the last generated token is not in the cache yet."""

    rid: int
    prompt_len: int
    max_new_tokens: int
    tokens: list[int]
    pool_row: int = 0
    kv_len: int = 0  # tokens whose KV is in the cache (the request's seq_len)
    cached_len: int = 0  # leading tokens reused from the radix tree; their slots belong to the tree
    last_node: radix.RadixNode | None = None  # locked end of the matched prefix
    own_full: int = 0  # full slots this request allocated and still holds
    own_swa: int = 0
    swa_freed_upto: int = 0  # own SWA slots below this position have been freed
    full_budget: int = 0  # most full slots it may hold at once (reserved at admission)
    swa_budget: int = 0

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < self.prompt_len


class Scheduler:
    """Produces one `StepBatch` per `step()`; `commit(next_tokens)` applies the model's output.

    Admission reserves each request's worst-case slot need against free + evictable slots, so a running request
    can always allocate (evicting idle radix leaves if needed) and nothing is ever retracted.
    """

    def __init__(self, config: SchedulerConfig, seed: int = 0):
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.slot_allocator = allocator.SlotAllocator(config.num_slots)
        self.swa_pool = allocator.SwaPool(config.num_swa_slots, config.num_slots) if config.swa_window else None
        self.req_pool = allocator.ReqToTokenPool(config.max_reqs, config.max_context_len)
        self.radix = radix.RadixCache()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats: collections.Counter[str] = collections.Counter()
        self.prompts = workload.PromptSource(config, self.rng)
        self._no_lut = np.zeros(config.num_slots + 1, np.int32)
        self._in_flight: list[tuple[Request, int, list[int]]] | None = None
        self._next_rid = 1

    @property
    def full_to_swa_index_mapping(self) -> np.ndarray:
        """i32[num_slots + 1], the live full->SWA LUT (all zeros without SWA)."""
        return self.swa_pool.lut if self.swa_pool else self._no_lut

    def step(self) -> batch.StepBatch:
        """Schedules decode rows, continuing prefill chunks, then new admissions, and allocates their slots."""
        if self._in_flight is not None:
            raise RuntimeError("step() called twice; call commit(next_tokens) after each step")
        c = self.config
        while len(self.waiting) < 2:
            prompt, max_new = self.prompts.draw()
            self.waiting.append(Request(self._next_rid, len(prompt), max_new, prompt))
            self._next_rid += 1
        budget = c.max_tokens
        decode = []
        for req in self.running:  # running <= max_batch and decode always fits, so no request starves
            if not req.in_prefill:
                k = c.spec_k if c.spec_prob > 0 and self.rng.random() < c.spec_prob else 1
                decode.append((req, k))
                budget -= k
        prefill = []
        for req in self.running:
            if req.in_prefill and budget > 0:
                e = min(c.chunk_size, req.prompt_len - req.kv_len, budget)
                prefill.append((req, e))
                budget -= e
        while self.waiting and budget > 0 and len(self.running) < c.max_batch and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            self.running.append(req)
            e = min(c.chunk_size, req.prompt_len - req.kv_len, budget)
            prefill.append((req, e))
            budget -= e

        rows, self._in_flight = [], []
        for req, e in prefill + decode:  # prefill rows first, like SGLang's mixed batches
            start, drafts = req.kv_len, []
            if req.in_prefill:
                ids = req.tokens[start : start + e]
                self.stats["chunked_prefill_rows"] += start + e < req.prompt_len
            else:
                drafts = [self._draft(req, start + j) for j in range(1, e)]
                ids = [req.tokens[start], *drafts]
            expected = [self._expected(req, start + j, t) for j, t in enumerate(ids)]
            slots = self._alloc(e)
            req.own_full += e
            req.own_swa += e if self.swa_pool else 0
            self.req_pool.req_to_token[req.pool_row, start : start + e] = slots
            self.req_pool.token_ids[req.pool_row, start : start + e] = ids
            rows.append((req.pool_row, start, ids, expected, slots))
            self._in_flight.append((req, e, drafts))
        self.stats.update(steps=1, tokens=c.max_tokens - budget, decode_rows=len(decode), prefill_rows=len(prefill))
        return batch.pack_step_batch(
            rows,
            max_batch=c.max_batch,
            max_tokens=c.max_tokens,
            req_to_token=self.req_pool.req_to_token,
            req_to_token_ids=self.req_pool.token_ids,
            lut=self.full_to_swa_index_mapping,
        )

    def commit(self, next_tokens: np.ndarray | None) -> None:
        """Applies a step's sampled tokens (i32[max_batch], row-aligned; ignored in token-oracle mode).

        Speculative rows accept a random number of their drafts and free the rejected drafts' slots. Finished
        requests go into the radix cache. Without the oracle, a row's token comes from its last new token's
        logits, even when that token was a rejected draft: the demo only needs consistent KV, not good text.
        """
        if self._in_flight is None:
            raise RuntimeError("commit() without a pending step()")
        if next_tokens is None and not self.config.token_oracle:
            raise ValueError("next_tokens is required unless config.token_oracle is on")
        finished = []
        for i, (req, e, drafts) in enumerate(self._in_flight):
            start = req.kv_len
            if drafts:
                accepted = int(self.rng.integers(0, e))
                self._release_own(req, self.req_pool.req_to_token[req.pool_row, start + 1 + accepted : start + e])
                req.tokens.extend(drafts[:accepted])
                self.stats.update(spec_rows=1, spec_rejected_tokens=e - 1 - accepted)
                e = 1 + accepted
            req.kv_len = start + e
            if not req.in_prefill:
                oracle = batch.oracle_token(req.rid, req.kv_len, self.config.vocab_size)
                req.tokens.append(oracle if self.config.token_oracle else int(next_tokens[i]))
            self._slide_window(req)
            if len(req.tokens) - req.prompt_len >= req.max_new_tokens:
                finished.append(req)
        self._in_flight = None
        for req in finished:
            self._finish(req)

    def sweep_entries(self, *, unlocked_only: bool = False) -> kc.SweepEntries:
        """Every radix-cached slot as (slot, position, prev_slot) arrays (full-pool slots), for the canary's kc.

        Args:
          unlocked_only: list only idle slots (no running request holds their node).
        """
        return self.radix.list_slots(unlocked_only=unlocked_only)

    def _admit(self, req: Request) -> bool:
        """Matches the prompt in the radix cache, locks the match and reserves slots; False if it cannot fit."""
        c, prompt = self.config, req.tokens[: req.prompt_len]
        # At most prompt_len - 1 tokens: the last prompt token must run to produce the first logits.
        slots, node = self.radix.match_prefix(prompt[:-1])
        m = self._usable_prefix(slots)
        if m < len(slots):
            slots, node = self.radix.match_prefix(prompt[:m])
        self.radix.inc_lock(node)
        req.full_budget = req.prompt_len + req.max_new_tokens - 1 + c.max_decode_extend - m
        req.swa_budget = c.swa_window + max(c.chunk_size, c.max_decode_extend) if self.swa_pool else 0
        need_full, need_swa = req.full_budget, req.swa_budget
        for r in self.running:
            need_full += r.full_budget - r.own_full
            need_swa += r.swa_budget - r.own_swa
        fits = self.slot_allocator.num_free + self.radix.evictable_size() >= need_full
        if self.swa_pool:
            fits &= self.swa_pool.num_free + self._evictable_swa() >= need_swa
        row = self.req_pool.alloc() if fits else None
        if row is None:
            self.radix.dec_lock(node)
            return False
        req.pool_row, req.cached_len, req.kv_len, req.swa_freed_upto, req.last_node = row, m, m, m, node
        self.req_pool.req_to_token[row, :m] = slots
        self.req_pool.token_ids[row, :m] = prompt[:m]
        self.stats.update(admitted=1, prefix_hit_reqs=m > 0, prefix_hit_tokens=m)
        return True

    def _usable_prefix(self, slots: np.ndarray) -> int:
        """SWA: longest prefix m whose last `swa_window` tokens are SWA-resident, so SWA layers can attend."""
        if self.swa_pool is None:
            return len(slots)
        resident = self.swa_pool.lut[slots] != 0
        for m in range(len(slots), 0, -1):
            if resident[max(0, m - self.config.swa_window) : m].all():
                return m
        return 0

    def _evictable_swa(self) -> int:
        return sum(self.swa_pool.num_resident(n.value) for n, _ in self.radix.nodes() if n.lock_ref == 0)

    def _alloc(self, n: int) -> np.ndarray:
        if (short := n - self.slot_allocator.num_free) > 0:
            self.stats["evicted_slots"] += self.radix.evict(short, self._free_full)
        slots = self.slot_allocator.alloc(n)
        assert slots is not None, "admission reservation violated: full pool exhausted"
        if self.swa_pool:
            while self.swa_pool.num_free < n:
                freed = self.radix.evict(1, self._free_full)
                assert freed, "admission reservation violated: SWA pool exhausted"
                self.stats["evicted_slots"] += freed
            self.swa_pool.alloc_for(slots)
        return slots

    def _free_full(self, slots: np.ndarray) -> None:
        if self.swa_pool:
            self.swa_pool.free_for(slots)
        self.slot_allocator.free(slots)

    def _release_own(self, req: Request, slots: np.ndarray) -> None:
        req.own_swa -= self.swa_pool.num_resident(slots) if self.swa_pool else 0
        req.own_full -= len(slots)
        self._free_full(slots)

    def _slide_window(self, req: Request) -> None:
        """SWA: frees the request's own SWA slots more than `swa_window` tokens behind; the tree's stay."""
        if self.swa_pool is None or (upto := req.kv_len - self.config.swa_window) <= req.swa_freed_upto:
            return
        freed = self.swa_pool.free_for(self.req_pool.req_to_token[req.pool_row, req.swa_freed_upto : upto])
        req.own_swa -= freed
        req.swa_freed_upto = upto
        self.stats["swa_window_freed"] += freed

    def _finish(self, req: Request) -> None:
        slots = self.req_pool.req_to_token[req.pool_row, : req.kv_len].copy()
        cached = self.radix.insert(req.tokens[: req.kv_len], slots)
        assert cached >= req.cached_len, "the locked prefix vanished from the radix tree"
        # Positions [cached_len, cached) duplicate KV another request cached first: the tree keeps its copy.
        self._free_full(slots[req.cached_len : cached])
        self.radix.dec_lock(req.last_node)
        self.req_pool.free(req.pool_row)
        self.running.remove(req)
        self.prompts.remember(req.tokens)
        self.stats["finished"] += 1

    def _draft(self, req: Request, position: int) -> int:
        if self.config.token_oracle:
            return batch.oracle_token(req.rid, position, self.config.vocab_size)
        return int(self.rng.integers(self.config.vocab_size))

    def _expected(self, req: Request, position: int, token: int) -> int:
        if self.config.token_oracle and position >= req.prompt_len:
            return batch.oracle_token(req.rid, position, self.config.vocab_size)
        return token
