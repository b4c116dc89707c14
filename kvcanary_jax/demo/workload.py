"""Random prompts for the demo scheduler, shaped so that prefix sharing, multi-turn reuse and eviction happen."""

from __future__ import annotations

import collections

import numpy as np

from kvcanary_jax.demo.config import SchedulerConfig


class PromptSource:
    """Draws `(prompt, max_new_tokens)` from a seeded RNG.

    A prompt is one of: a shared "system prompt" plus a random suffix (prefix hits across requests), a recently
    finished request's whole sequence plus a suffix (multi-turn: the hit covers the generated tokens too), or
    fully random tokens.
    """

    def __init__(self, config: SchedulerConfig, rng: np.random.Generator):
        self.config, self.rng = config, rng
        lo, hi = config.shared_prefix_len
        self._shared = [self.tokens(int(rng.integers(lo, hi + 1))) for _ in range(config.num_shared_prefixes)]
        self._recent: collections.deque[list[int]] = collections.deque(maxlen=16)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.config.vocab_size, n).tolist()

    def remember(self, sequence: list[int]) -> None:
        """Offers a finished request's tokens as the start of a later multi-turn prompt."""
        self._recent.append(list(sequence))

    def draw(self) -> tuple[list[int], int]:
        c, rng = self.config, self.rng
        max_new = int(rng.integers(c.max_new_tokens[0], c.max_new_tokens[1] + 1))
        u = rng.random()
        if self._recent and u < c.multi_turn_prob:
            prompt = self._recent[rng.integers(len(self._recent))] + self.tokens(int(rng.integers(1, 17)))
        elif u < c.multi_turn_prob + c.shared_prefix_prob:
            prompt = self._shared[rng.integers(len(self._shared))] + self.tokens(int(rng.integers(1, 33)))
        else:
            prompt = self.tokens(int(rng.integers(c.prompt_len[0], c.prompt_len[1] + 1)))
        # Multi-turn chains grow without bound: cut so prompt + generation (+ a last speculative extend) fits.
        return prompt[: c.max_context_len - max_new - c.max_decode_extend], max_new
