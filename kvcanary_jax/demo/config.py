"""The demo scheduler's settings: pool sizes, static batch shapes and the random workload."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Pool sizes, static batch shapes and the random workload. Ranges are inclusive `(lo, hi)`."""

    num_slots: int = 512
    max_reqs: int = 12
    max_context_len: int = 192
    max_batch: int = 8
    max_tokens: int = 64
    chunk_size: int = 24
    vocab_size: int = 256
    prompt_len: tuple[int, int] = (8, 80)
    max_new_tokens: tuple[int, int] = (4, 40)
    num_shared_prefixes: int = 4
    shared_prefix_len: tuple[int, int] = (8, 40)
    shared_prefix_prob: float = 0.5  # prompt = a shared "system prompt" + random suffix
    multi_turn_prob: float = 0.25  # prompt = a finished request's whole sequence + random suffix
    spec_prob: float = 0.0  # chance a decode row is a k-token speculative verify extend
    spec_k: int = 3
    token_oracle: bool = False
    swa_window: int = 0  # 0 = no SWA pool
    num_swa_slots: int = 0

    @property
    def max_decode_extend(self) -> int:
        return self.spec_k if self.spec_prob > 0 else 1

    def __post_init__(self):
        checks = {
            "max_reqs - 1 >= max_batch (row 0 is padding)": self.max_reqs - 1 >= self.max_batch,
            "max_tokens >= max_batch * max_decode_extend": self.max_tokens >= self.max_batch * self.max_decode_extend,
            "chunk_size >= 1 and spec_k >= 2": self.chunk_size >= 1 and self.spec_k >= 2,
            "prompt_len[1] + max_new_tokens[1] + spec_k <= max_context_len": (
                self.prompt_len[1] + self.max_new_tokens[1] + self.spec_k <= self.max_context_len
            ),
            "prompt_len[0] >= 2": self.prompt_len[0] >= 2,
            "max_context_len < num_slots": self.max_context_len < self.num_slots,
            "swa_window > 0 iff num_swa_slots > 0": (self.swa_window > 0) == (self.num_swa_slots > 0),
            "swa_window + max(chunk_size, spec_k) < num_swa_slots": (
                not self.swa_window or self.swa_window + max(self.chunk_size, self.spec_k) < self.num_swa_slots
            ),
        }
        if bad := [k for k, ok in checks.items() if not ok]:
            raise ValueError(f"SchedulerConfig needs {'; '.join(bad)}; got {self}")
