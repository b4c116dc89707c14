"""A hand-rolled paged-KV decode loop of a few lines, wrapped with the canary: the smallest thing a user would test.

No model: the "forward" writes each new token's KV as a function of (token, position). One request lives in
``req_to_token`` row 1 and decodes one token per step into slots 1, 2, 3, ...
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import kvcanary_jax as kc
from kvcanary_jax import testing

NUM_SLOTS, PAGE_SIZE, MAX_CONTEXT = 64, 4, 32
CANARY = kc.KvCanary(
    kc.CanaryConfig(mode="raise", real_kv_hash_mode="partial", backend="xla"),
    kc.CanaryPool(num_slots=NUM_SLOTS, page_size=PAGE_SIZE, with_v=False),
)


def init():
    """``(kv f32[pages, page_size, 2, 8], canary state)``."""
    return jnp.zeros((NUM_SLOTS // PAGE_SIZE, PAGE_SIZE, 2, 8), jnp.float32), CANARY.init_state()


def batch(step: int) -> kc.CanaryBatch:
    """Decode step ``step`` (0-based): the request has ``step`` tokens cached and writes position ``step``."""
    table = np.zeros((2, MAX_CONTEXT), np.int32)
    table[1, : step + 1] = np.arange(1, step + 2)  # position p lives in slot p + 1
    i32 = functools.partial(np.array, dtype=np.int32)
    return kc.CanaryBatch(
        req_pool_indices=i32([1]),
        prefix_lens=i32([step]),
        extend_lens=i32([1]),
        req_to_token=table,
        input_ids=i32([100 + step]),
        positions=i32([step]),
        out_cache_loc=i32([step + 1]),
    )


@functools.partial(jax.jit, donate_argnums=(0, 1))
def step(kv, state, b: kc.CanaryBatch):
    state = CANARY.before_forward(state, b)
    state, kv = kc.fence(state, kv)
    slot = b.out_cache_loc
    row = jnp.stack([b.input_ids, b.positions], -1).astype(jnp.float32)[:, :, None] * jnp.ones((1, 1, 8))
    kv = kv.at[slot // PAGE_SIZE, slot % PAGE_SIZE].set(row)
    state, kv = kc.fence(state, kv)
    state = CANARY.after_forward(state, b, CANARY.kv_sources(full_k=kv))
    return kv, state


def run(num_steps: int, *, corrupt_at: int | None = None, step_fn=step):
    """Runs ``num_steps``; with ``corrupt_at``, flips a KV byte of slot 1 (position 0) before that step."""
    kv, state = init()
    for i in range(num_steps):
        if i == corrupt_at:
            kv = testing.flip_kv_byte(kv, jnp.int32(1), page_size=PAGE_SIZE)
        kv, state = step_fn(kv, state, batch(i))
    return kv, state
