"""The per-step batch the demo scheduler hands to the jitted step, and the knowable-token oracle."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvcanary_jax import CanaryBatch, testing


def oracle_token(request_id: int, position: int, vocab_size: int) -> int:
    """The token a request emits at `position` in token-oracle mode (SGLang's HashOracle): knowable in advance."""
    return testing.splitmix64(request_id ^ position) % vocab_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One forward step, padded to static shapes. Every field is an int32 numpy array.

    Rows: real requests first, then padding rows with `req_pool_indices = prefix_lens = extend_lens = 0`.
    Tokens: request-major; row r's `extend_lens[r]` new tokens start at `sum(extend_lens[:r])`. Padding tokens
    have `input_ids = positions = out_cache_loc = 0` (slot 0 is the padding slot).

    Attributes:
      req_pool_indices: i32[max_batch] request-pool row of each batch row (0 = padding).
      prefix_lens: i32[max_batch] tokens already in the cache before this step.
      extend_lens: i32[max_batch] new tokens this step (1 in decode, k in a speculative verify step).
      req_to_token: i32[max_reqs, max_context_len] full-pool slot of each position, including this step's.
      input_ids: i32[max_tokens] token of each new token.
      positions: i32[max_tokens] 0-based position of each new token in its request.
      out_cache_loc: i32[max_tokens] full-pool slot each new token's KV is written to.
      swa_out_cache_loc: i32[max_tokens] SWA-pool slot of each new token (`lut[out_cache_loc]`; 0 without SWA).
      full_to_swa_index_mapping: i32[num_slots + 1] full->SWA LUT after this step's allocation (0 = not
        resident; all zeros without SWA).
      expected_input_ids: i32[max_tokens] what each input token should be, derived independently of
        `input_ids`: the oracle's token for generated positions in token-oracle mode, else the known token.
      req_to_token_ids: i32[max_reqs, max_context_len] token-id history per request row (mirrors
        `req_to_token`), for the canary's verify-token check.
      expected_tokens_valid_lens: i32[max_batch] valid length of each row's history (`prefix + extend`).
    """

    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    req_to_token: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    swa_out_cache_loc: np.ndarray
    full_to_swa_index_mapping: np.ndarray
    expected_input_ids: np.ndarray
    req_to_token_ids: np.ndarray
    expected_tokens_valid_lens: np.ndarray

    def canary(self) -> CanaryBatch:
        """The canary's view of this step (works on numpy and on traced fields)."""
        return CanaryBatch(
            req_pool_indices=self.req_pool_indices,
            prefix_lens=self.prefix_lens,
            extend_lens=self.extend_lens,
            req_to_token=self.req_to_token,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            full_to_swa_index_mapping=self.full_to_swa_index_mapping,
            expected_input_ids=self.expected_input_ids,
            token_ids=self.req_to_token_ids,
            token_ids_lens=self.expected_tokens_valid_lens,
        )

    @property
    def num_reqs(self) -> int:
        return int(np.count_nonzero(self.req_pool_indices))

    @property
    def num_tokens(self) -> int:
        return int(np.sum(self.extend_lens))


def pack_step_batch(
    rows: list[tuple[int, int, list[int], list[int], np.ndarray]],
    *,
    max_batch: int,
    max_tokens: int,
    req_to_token: np.ndarray,
    req_to_token_ids: np.ndarray,
    lut: np.ndarray,
) -> StepBatch:
    """Pads real rows `(pool_row, prefix_len, input_ids, expected_ids, slots)` into a StepBatch.

    Tables are copied: the scheduler keeps mutating its own, and a batch must stay a snapshot of this step.
    """
    if len(rows) > max_batch or sum(len(r[2]) for r in rows) > max_tokens:
        raise ValueError(f"batch exceeds max_batch={max_batch} or max_tokens={max_tokens}: {len(rows)} rows")
    b = {n: np.zeros(max_batch, np.int32) for n in ("req_pool_indices", "prefix_lens", "extend_lens", "valid")}
    t = {n: np.zeros(max_tokens, np.int32) for n in ("input_ids", "positions", "out_cache_loc", "expected")}
    off = 0
    for i, (row, prefix, ids, expected, slots) in enumerate(rows):
        n = len(ids)
        b["req_pool_indices"][i], b["prefix_lens"][i], b["extend_lens"][i] = row, prefix, n
        b["valid"][i] = prefix + n
        t["input_ids"][off : off + n] = ids
        t["expected"][off : off + n] = expected
        t["positions"][off : off + n] = np.arange(prefix, prefix + n)
        t["out_cache_loc"][off : off + n] = slots
        off += n
    return StepBatch(
        req_pool_indices=b["req_pool_indices"],
        prefix_lens=b["prefix_lens"],
        extend_lens=b["extend_lens"],
        req_to_token=req_to_token.copy(),
        input_ids=t["input_ids"],
        positions=t["positions"],
        out_cache_loc=t["out_cache_loc"],
        # Padding tokens sit on full slot 0, and lut[0] == 0, so they land on SWA padding slot 0 too.
        swa_out_cache_loc=lut[t["out_cache_loc"]].astype(np.int32),
        full_to_swa_index_mapping=lut.copy(),
        expected_input_ids=t["expected"],
        req_to_token_ids=req_to_token_ids.copy(),
        expected_tokens_valid_lens=b["valid"],
    )
