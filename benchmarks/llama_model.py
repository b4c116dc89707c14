"""A Llama-3-8B-shaped decoder in JAX over a paged KV cache, for the decode-overhead benchmark.

Random bf16 weights, one array per layer and matrix; the layers are unrolled. The KV cache of all layers
is one array per K and V, ``[kv_heads, layers * pages, page_size, head_dim]``: layer ``l`` owns pages
``[l * pages, (l + 1) * pages)``. Decode attention is jax's Pallas paged-attention kernel reading the pages in place
through a block table (offset by ``l * pages``), so the step moves only the bytes the roofline counts; layer 0 is
the prefix of the page axis, which is what the canary's real-KV sources read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Decoder dimensions; ``llama3_8b()`` gives the benchmark's shape, ``tiny()`` a CPU smoke-test shape."""

    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def llama3_8b(cls) -> ModelShape:
        return cls(layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)

    @classmethod
    def tiny(cls) -> ModelShape:
        return cls(layers=2, hidden=64, q_heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)

    @property
    def weight_bytes_read(self) -> int:
        """Weight bytes one step reads: every layer, the final norm and ``lm_head`` (bf16). The embedding table is
        left out: a step reads only its looked-up rows."""
        h, qd, kvd = self.hidden, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * (qd + 2 * kvd) + qd * h + 3 * h * self.intermediate + 2 * h
        return 2 * (self.layers * per_layer + self.vocab * h + h)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (bf16)."""
        return 2 * 2 * self.layers * self.kv_heads * self.head_dim


def init_params(shape: ModelShape, key: jax.Array) -> dict:
    """Random bf16 weights generated on device, one array per layer and matrix (scaled so activations stay finite)."""
    h, qd, kvd = shape.hidden, shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    dims = {
        "wq": (h, qd),
        "wk": (h, kvd),
        "wv": (h, kvd),
        "wo": (qd, h),
        "w_gate": (h, shape.intermediate),
        "w_up": (h, shape.intermediate),
        "w_down": (shape.intermediate, h),
    }
    normal = lambda k, d: (jax.random.normal(k, d, jnp.float32) * d[0] ** -0.5).astype(jnp.bfloat16)  # noqa: E731
    layers = []
    for layer_key in jax.random.split(key, shape.layers):
        keys = jax.random.split(layer_key, len(dims))
        layer = {name: normal(k, d) for (name, d), k in zip(dims.items(), keys, strict=True)}
        layer.update(attn_norm=jnp.ones((h,), jnp.bfloat16), mlp_norm=jnp.ones((h,), jnp.bfloat16))
        layers.append(layer)
    embed_key, head_key = jax.random.split(jax.random.fold_in(key, 1))
    return {
        "layers": layers,
        "embed": normal(embed_key, (shape.vocab, h)),
        "lm_head": normal(head_key, (h, shape.vocab)),
        "final_norm": jnp.ones((h,), jnp.bfloat16),
    }


def init_kv_cache(shape: ModelShape, num_pages: int, page_size: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Random bf16 K and V pools ``[kv_heads, layers * num_pages, page_size, head_dim]`` (never zeros)."""
    dims = (shape.kv_heads, shape.layers * num_pages, page_size, shape.head_dim)
    k_key, v_key = jax.random.split(key)
    return (jax.random.normal(k_key, dims, jnp.bfloat16), jax.random.normal(v_key, dims, jnp.bfloat16))


def _rms_norm(x, weight):
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype) * weight


def _rope(x, positions):
    """Rotary embedding on ``x[..., tokens, heads, head_dim]`` at int32 ``positions[tokens]``."""
    half = x.shape[-1] // 2
    freq = 500000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _store_kv(pool, new, slots, layer_page_offset, page_size):
    """Scatters ``new[tokens, kv_heads, head_dim]`` into ``pool`` at ``slots`` of this layer (in place)."""
    pages = slots // page_size + layer_page_offset
    return pool.at[:, pages, slots % page_size].set(jnp.swapaxes(new, 0, 1), mode="drop")


def _mlp(x, p):
    gate = jnp.dot(x, p["w_gate"])
    return jnp.dot(jax.nn.silu(gate) * jnp.dot(x, p["w_up"]), p["w_down"])


def forward(
    params,
    kv_cache,
    tokens,
    positions,
    out_cache_loc,
    block_tables,
    seq_lens,
    *,
    shape: ModelShape,
    page_size: int,
    num_pages: int,
    interpret: bool = False,
    attention_kw: tuple = (),
):
    """One forward over ``tokens[T]``; returns ``(next_token[bs], kv_cache)``.

    Decode when ``T == bs`` (one token per request, paged attention over ``block_tables[bs, pages_per_seq]`` and
    ``seq_lens[bs]`` including the new token); prefill when ``T == bs * chunk`` (causal attention over the chunk,
    prefix 0). New K/V are written at ``out_cache_loc[T]`` before attention reads them.
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

    bs = seq_lens.shape[0]
    chunk = tokens.shape[0] // bs
    x = params["embed"][tokens]
    k_pool, v_pool = kv_cache
    # Layers are unrolled over per-layer weights: under lax.scan, XLA:GPU copied each layer's stacked weight slice
    # before its GEMV (3x the weight bytes; bs=1 ran at 12.3 ms instead of ~4 ms on the H200).
    for index in range(shape.layers):
        p = params["layers"][index]
        h = _rms_norm(x, p["attn_norm"])
        q = jnp.dot(h, p["wq"]).reshape(-1, shape.q_heads, shape.head_dim)
        k = jnp.dot(h, p["wk"]).reshape(-1, shape.kv_heads, shape.head_dim)
        v = jnp.dot(h, p["wv"]).reshape(-1, shape.kv_heads, shape.head_dim)
        q, k = _rope(q, positions), _rope(k, positions)
        offset = index * num_pages
        k_pool = _store_kv(k_pool, k, out_cache_loc, offset, page_size)
        v_pool = _store_kv(v_pool, v, out_cache_loc, offset, page_size)
        if chunk == 1:
            attn = pallas_paged.paged_attention(
                q, k_pool, v_pool, block_tables + offset, seq_lens, interpret=interpret, **dict(attention_kw)
            )
        else:
            as_batch = lambda t: t.reshape(bs, chunk, *t.shape[1:])  # noqa: E731
            attn = jax.nn.dot_product_attention(
                as_batch(q), as_batch(k), as_batch(v), is_causal=True, implementation=None if interpret else "cudnn"
            )
        x = x + jnp.dot(attn.reshape(x.shape[0], -1), p["wo"])
        x = x + _mlp(_rms_norm(x, p["mlp_norm"]), p)

    last = x.reshape(bs, chunk, -1)[:, -1]
    logits = jnp.dot(_rms_norm(last, params["final_norm"]), params["lm_head"])
    return jnp.argmax(logits, -1).astype(jnp.int32), (k_pool, v_pool)
