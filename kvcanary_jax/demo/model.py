"""A tiny random-weight decoder-only transformer over a paged KV cache: the model the canary wraps in the demo."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of the demo model.

    `swa_layers` lists the layers that use sliding-window attention over the SWA pool (window `swa_window`);
    the others attend to the full context through the full pool, like SGLang's hybrid SWA models.
    """

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 128
    rope_theta: float = 10000.0
    swa_window: int = 0
    swa_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads must be a multiple of num_kv_heads; got {self}")
        if bool(self.swa_layers) != (self.swa_window > 0):
            raise ValueError(f"swa_layers and swa_window > 0 go together; got {self.swa_layers=}, {self.swa_window=}")
        if any(not 0 <= i < self.num_layers for i in self.swa_layers):
            raise ValueError(f"swa_layers must index layers 0..{self.num_layers - 1}; got {self.swa_layers=}")


@dataclasses.dataclass(frozen=True)
class KvCacheLayout:
    """Shape of the paged KV pools: slot s lives at page s // page_size, row s % page_size.

    The full pool has `num_slots` slots (slot 0 is padding). Layers in `swa_layers` use a separate SWA pool of
    `num_swa_slots` slots, addressed through the full->SWA lookup table.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    page_size: int = 8
    dtype: Any = jnp.bfloat16
    swa_layers: tuple[int, ...] = ()
    num_swa_slots: int = 0

    def __post_init__(self):
        for name in ("num_slots", "num_swa_slots"):
            if getattr(self, name) % self.page_size:
                raise ValueError(f"{name} must be a multiple of page_size; got {self}")
        if bool(self.swa_layers) != (self.num_swa_slots > 0):
            raise ValueError(f"swa_layers need num_swa_slots > 0 and vice versa; got {self}")

    @classmethod
    def for_model(cls, config: ModelConfig, **kwargs: Any) -> KvCacheLayout:
        """Layout matching `config`'s layers and heads; kwargs set pool sizes, page size and dtype."""
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, swa_layers=config.swa_layers, **kwargs)

    def pool_shape(self, layer: int) -> tuple[int, int, int, int]:
        """[num_pages, page_size, num_kv_heads, head_dim] of `layer`'s K (and V) array."""
        slots = self.num_swa_slots if layer in self.swa_layers else self.num_slots
        return (slots // self.page_size, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KvCache:
    """Per-layer K and V arrays, each `[num_pages, page_size, num_kv_heads, head_dim]` of its layer's pool."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array  # f32[hidden]
    wq: jax.Array  # f32[hidden, num_q_heads * head_dim]
    wk: jax.Array  # f32[hidden, num_kv_heads * head_dim]
    wv: jax.Array  # f32[hidden, num_kv_heads * head_dim]
    wo: jax.Array  # f32[num_q_heads * head_dim, hidden]
    mlp_norm: jax.Array  # f32[hidden]
    w_up: jax.Array  # f32[hidden, mlp_hidden]
    w_down: jax.Array  # f32[mlp_hidden, hidden]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """Model weights; `config` is static so `forward(params, kv_cache, batch)` needs no other argument."""

    embed: jax.Array  # f32[vocab, hidden]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # f32[hidden]
    lm_head: jax.Array  # f32[hidden, vocab]
    config: ModelConfig = dataclasses.field(metadata={"static": True})


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random weights scaled by 1/sqrt(fan_in), so activations stay O(1) and logits are not flat."""
    c = config

    def dense(k, fan_in, fan_out):
        return jax.random.normal(k, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)

    keys = jax.random.split(key, 2 + 6 * c.num_layers)
    layers = []
    for i in range(c.num_layers):
        k = keys[2 + 6 * i : 8 + 6 * i]
        ones = jnp.ones((c.hidden,), jnp.float32)
        layers.append(
            LayerParams(
                attn_norm=ones,
                wq=dense(k[0], c.hidden, c.num_q_heads * c.head_dim),
                wk=dense(k[1], c.hidden, c.num_kv_heads * c.head_dim),
                wv=dense(k[2], c.hidden, c.num_kv_heads * c.head_dim),
                wo=dense(k[3], c.num_q_heads * c.head_dim, c.hidden),
                mlp_norm=ones,
                w_up=dense(k[4], c.hidden, c.mlp_hidden),
                w_down=dense(k[5], c.mlp_hidden, c.hidden),
            )
        )
    return Params(
        embed=jax.random.normal(keys[0], (c.vocab_size, c.hidden), jnp.float32),
        layers=tuple(layers),
        final_norm=jnp.ones((c.hidden,), jnp.float32),
        lm_head=dense(keys[1], c.hidden, c.vocab_size),
        config=config,
    )


def init_kv_cache(layout: KvCacheLayout) -> KvCache:
    """Zero-filled pools: zeros (not garbage) so masked-out context can never inject NaN into attention."""
    arrays = [jnp.zeros(layout.pool_shape(i), layout.dtype) for i in range(layout.num_layers)]
    return KvCache(k=tuple(arrays), v=tuple(jnp.zeros_like(a) for a in arrays))


def _rms_norm(x: jax.Array, w: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE; x: f32[T, heads, head_dim], positions: i32[T]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[:, None, None] * freqs
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], axis=-1)


def _qkv(c: ModelConfig, lp: LayerParams, x: jax.Array, positions: jax.Array):
    h = _rms_norm(x, lp.attn_norm)
    q = (h @ lp.wq).reshape(-1, c.num_q_heads, c.head_dim)
    k = (h @ lp.wk).reshape(-1, c.num_kv_heads, c.head_dim)
    v = (h @ lp.wv).reshape(-1, c.num_kv_heads, c.head_dim)
    return _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta), v


def _mlp(lp: LayerParams, x: jax.Array) -> jax.Array:
    return x + jax.nn.gelu(_rms_norm(x, lp.mlp_norm) @ lp.w_up) @ lp.w_down


def _attend(c: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """GQA softmax attention. q: f32[T, H, d]; k, v: [T, C, KVH, d] (per-query context); mask: bool[T, C]."""
    t = q.shape[0]
    q = q.reshape(t, c.num_kv_heads, c.num_q_heads // c.num_kv_heads, c.head_dim)
    s = jnp.einsum("tkgd,tckd->tkgc", q, k.astype(jnp.float32)) / np.sqrt(c.head_dim)
    # where() rather than adding -inf: fully masked padding queries then give a uniform, finite softmax.
    s = jnp.where(mask[:, None, None, :], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("tkgc,tckd->tkgd", p, v.astype(jnp.float32))
    return out.reshape(t, c.num_q_heads * c.head_dim)


def forward(params: Params, kv_cache: KvCache, batch: Any) -> tuple[jax.Array, KvCache]:
    """One paged step: write the new tokens' K/V, then attend causally over each request's context.

    Args:
      params: model weights.
      kv_cache: the pools; donate it under `jax.jit`, it is returned updated.
      batch: a `StepBatch` (numpy or traced): `req_pool_indices, prefix_lens, extend_lens i32[B]`,
        `req_to_token i32[R, C]` (already holding this step's slots), `input_ids, positions, out_cache_loc,
        swa_out_cache_loc i32[T]` request-major, and `full_to_swa_index_mapping i32[num_slots + 1]`.

    Returns:
      `(logits f32[B, vocab], new_kv_cache)`: logits of each row's last new token (zeros for padding rows).
    """
    c = params.config
    num_rows, num_tokens = batch.extend_lens.shape[0], batch.input_ids.shape[0]
    ctx_len = batch.req_to_token.shape[1]
    ends = jnp.cumsum(batch.extend_lens)
    # Request-major layout: token t belongs to the first row whose cumulative extend end exceeds t.
    t = jnp.arange(num_tokens)
    tok_row = jnp.minimum(jnp.searchsorted(ends, t, side="right"), num_rows - 1)
    tok_valid = t < ends[-1]
    seq_lens = batch.prefix_lens + batch.extend_lens
    ctx_pos = jnp.arange(ctx_len)
    q_pos = batch.positions
    mask = (ctx_pos[None, :] <= q_pos[:, None]) & (ctx_pos[None, :] < seq_lens[tok_row][:, None]) & tok_valid[:, None]
    swa_mask = mask & (q_pos[:, None] - ctx_pos[None, :] < c.swa_window)
    ctx_full = batch.req_to_token[batch.req_pool_indices]  # i32[B, C] full-pool slots
    # Out-of-window tokens map to SWA slot 0 (evicted); the window mask keeps them out of the softmax.
    ctx_swa = batch.full_to_swa_index_mapping[ctx_full]
    loc_full = jnp.maximum(batch.out_cache_loc, 0)  # negative = skip: park it on padding slot 0
    loc_swa = jnp.maximum(batch.swa_out_cache_loc, 0)

    x = params.embed[batch.input_ids]
    new_k, new_v = [], []
    for i, lp in enumerate(params.layers):
        is_swa = i in c.swa_layers
        kc, vc = kv_cache.k[i], kv_cache.v[i]
        page = kc.shape[1]
        loc, ctx, m = (loc_swa, ctx_swa, swa_mask) if is_swa else (loc_full, ctx_full, mask)
        q, k, v = _qkv(c, lp, x, q_pos)
        kc = kc.at[loc // page, loc % page].set(k.astype(kc.dtype))
        vc = vc.at[loc // page, loc % page].set(v.astype(vc.dtype))
        # Gather after the write, so each token also sees this step's earlier tokens of its own request.
        k_ctx = kc[ctx // page, ctx % page][tok_row]  # [T, C, KVH, d]
        v_ctx = vc[ctx // page, ctx % page][tok_row]
        x = x + _attend(c, q, k_ctx, v_ctx, m) @ lp.wo
        x = _mlp(lp, x)
        new_k.append(kc)
        new_v.append(vc)

    last = jnp.clip(ends - 1, 0, num_tokens - 1)
    logits = _rms_norm(x[last], params.final_norm) @ params.lm_head
    logits = jnp.where((batch.extend_lens > 0)[:, None], logits, 0.0)
    return logits, KvCache(k=tuple(new_k), v=tuple(new_v))


def dense_forward(params: Params, token_ids: jax.Array, *, kv_dtype: Any = jnp.float32) -> jax.Array:
    """Non-paged reference: full causal (and windowed) attention over one sequence, no cache.

    Args:
      token_ids: i32[L], positions 0..L-1. Trailing padding is harmless: causality keeps it out of earlier logits.
      kv_dtype: K/V are rounded to this dtype, as the paged cache stores them.

    Returns:
      f32[L, vocab] logits of every position.
    """
    c = params.config
    n = token_ids.shape[0]
    pos = jnp.arange(n)
    causal = pos[None, :] <= pos[:, None]
    window = causal & (pos[:, None] - pos[None, :] < c.swa_window)
    x = params.embed[token_ids]
    for i, lp in enumerate(params.layers):
        q, k, v = _qkv(c, lp, x, pos)
        k, v = k.astype(kv_dtype).astype(jnp.float32), v.astype(kv_dtype).astype(jnp.float32)
        m = window if i in c.swa_layers else causal
        q = q.reshape(n, c.num_kv_heads, -1, c.head_dim)
        s = jnp.einsum("tkgd,ckd->tkgc", q, k) / np.sqrt(c.head_dim)
        p = jax.nn.softmax(jnp.where(m[:, None, None, :], s, -jnp.inf), axis=-1)
        x = x + jnp.einsum("tkgc,ckd->tkgd", p, v).reshape(n, -1) @ lp.wo
        x = _mlp(lp, x)
    return _rms_norm(x, params.final_norm) @ params.lm_head
