"""sglang-jax's MLA and hybrid-linear models on CPU: a TPU kernel swapped for XLA writes, a missing CPU method added.

MLA: sglang-jax builds ``MLATokenToKVPool`` only with ``--attention-backend fa``, whose ``MLAAttentionBackend`` calls the
MLA v2 Pallas kernel (``kernels/mla/v2/kernel.py``: TPU only; it also asks the TPU for its VMEM size when built); on
CPU the runner falls back to the native backend, which cannot read that pool. :func:`install` makes a CPU engine
build ``MLAAttentionBackend`` anyway and swaps just the kernel for :func:`mla_ragged_paged_attention`, an XLA
equivalent: it writes each new token's latent row (``c_kv`` padded to 128, then ``k_pe`` padded to 128) at the slot
the kernel writes (its page from ``page_indices``, row ``pos % page_size`` of the page, token-major over the packed
axes), then attends over each sequence's cached rows (MQA on the latent). The cache layout, the slots written and the
rows read are the kernel's; the arithmetic is a plain softmax (CPU tokens differ from a TPU's).

Hybrid linear attention (Qwen3.5, Kimi-linear): off TPU the native backend writes KV through
``set_kv_buffer_legacy``, which ``HybridLinearKVPool`` lacks; :func:`install` gives it one that forwards to its inner
pool at the layer's physical index, as its ``set_kv_buffer`` does.
"""

from __future__ import annotations

import jax.numpy as jnp

_VMEM_BYTES = 64 << 20  # any value: the XLA kernel does not use it; it spares the backend its TPU query


def _align(x: int, a: int = 128) -> int:
    return -(-x // a) * a


def mla_ragged_paged_attention(
    ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution, *,
    sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None, **_tuning,
):  # fmt: skip
    """The v2 kernel's contract in XLA: ``(o_latent f[T, heads, kv_lora_rank], updated cache)``.

    ``cache_kv`` is ``[pages, page_size // packing, packing, align(lkv) + align(rope)]``; ``kv_lens`` each sequence's
    length after this step, ``cu_q_lens`` / ``cu_kv_lens`` (page-aligned) its new tokens / cached rows end to end,
    ``page_indices`` its pages end to end, ``distribution[2]`` the number of sequences.
    """
    pages, rows, packing, dim = cache_kv.shape
    ps, lkv, rope = rows * packing, new_kv_c.shape[-1], new_k_pe.shape[-1]
    nope_dim = _align(lkv)
    num_tokens, max_seqs, num_seqs = ql_nope.shape[0], kv_lens.shape[0], distribution[2]
    flat = cache_kv.reshape(pages * ps, dim)  # token-major: page p's token t is row p * ps + t

    # each new token: its sequence, its position, the slot the kernel writes
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1 : max_seqs + 1], t, side="right").astype(jnp.int32)
    q_ok = (seq < num_seqs) & (t < cu_q_lens[num_seqs])
    seq = jnp.clip(seq, 0, max_seqs - 1)
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (t - cu_q_lens[seq])
    page = page_indices[jnp.clip(cu_kv_lens[seq] // ps + pos // ps, 0, page_indices.shape[0] - 1)]
    slot = jnp.where(q_ok, page * ps + pos % ps, pages * ps)  # out of range: dropped
    new = jnp.zeros((num_tokens, dim), cache_kv.dtype)
    new = (
        new.at[:, :lkv]
        .set(new_kv_c.astype(cache_kv.dtype))
        .at[:, nope_dim : nope_dim + rope]
        .set(new_k_pe.astype(cache_kv.dtype))
    )
    flat = flat.at[slot].set(new, mode="drop")

    # each cached row the batch reads: its sequence, its position
    k = jnp.arange(page_indices.shape[0] * ps, dtype=jnp.int32)
    key_seq = jnp.searchsorted(cu_kv_lens[1 : max_seqs + 1], k, side="right").astype(jnp.int32)
    key_ok = key_seq < num_seqs
    key_seq = jnp.clip(key_seq, 0, max_seqs - 1)
    key_pos = k - cu_kv_lens[key_seq]
    key_ok &= key_pos < kv_lens[key_seq]
    keys = flat[page_indices[k // ps] * ps + k % ps].astype(jnp.float32)  # [N, dim]

    q = jnp.zeros((num_tokens, ql_nope.shape[1], dim), jnp.float32)
    q = (
        q.at[..., :lkv]
        .set(ql_nope.astype(jnp.float32))
        .at[..., nope_dim : nope_dim + rope]
        .set(q_pe.astype(jnp.float32))
    )
    scores = jnp.einsum("thd,nd->thn", q, keys) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = q_ok[:, None] & key_ok[None, :] & (key_seq[None, :] == seq[:, None]) & (key_pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask &= key_pos[None, :] > pos[:, None] - sliding_window
    scores = jnp.where(mask[:, None, :], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0))
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("thn,nd->thd", weights, keys[:, :lkv]).astype(ql_nope.dtype)
    return out, flat.reshape(cache_kv.shape)


def _attention_backend(runner):
    """``ModelRunner._get_attention_backend`` for an MLA model served with ``fa`` on CPU: the MLA backend (its
    kernel swapped), where the engine would fall back to the native one."""
    from sgl_jax.srt.layers.attention.hybrid_linear_attn_backend import attn_backend_wrapper
    from sgl_jax.srt.layers.attention.mla_backend import MLAAttentionBackend

    cfg = runner.model_config.hf_text_config
    backend = MLAAttentionBackend(
        num_attn_heads=runner.num_attn_heads, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, page_size=runner.page_size,
        mesh=runner.mesh, attention_data_partition_axis="data", vmem_limit_bytes=_VMEM_BYTES,
    )  # fmt: skip
    return attn_backend_wrapper(runner, backend)


def _hybrid_set_kv_buffer_legacy(self, layer_id, loc, cache_k, cache_v):
    """``HybridLinearKVPool.set_kv_buffer_legacy``: the inner pool's, at the layer's physical index."""
    return self.full_kv_pool.set_kv_buffer_legacy(self._to_physical(layer_id), loc, cache_k, cache_v)


def install(device: str) -> None:
    """On CPU, makes sglang-jax run ``--attention-backend fa`` MLA models (``MLATokenToKVPool``) with the XLA kernel,
    and hybrid linear-attention models (``HybridLinearKVPool``) with the native backend.

    ``device``: the engine's ``--device`` (``ServerArgs.device``); a no-op unless ``"cpu"`` (decided by the argument,
    not by asking jax: a launcher process that initialised an accelerator would hold its memory). Idempotent. Affects
    this process only (a served engine installs it in its scheduler process).
    """
    if device != "cpu":
        return
    from sgl_jax.srt.layers.attention import mla_backend
    from sgl_jax.srt.mem_cache.memory_pool import HybridLinearKVPool
    from sgl_jax.srt.model_executor.model_runner import ModelRunner

    if not hasattr(HybridLinearKVPool, "set_kv_buffer_legacy"):
        HybridLinearKVPool.set_kv_buffer_legacy = _hybrid_set_kv_buffer_legacy

    mla_backend.mla_ragged_paged_attention = mla_ragged_paged_attention  # the backend calls the module's name
    if getattr(ModelRunner, "_kvcanary_cpu_mla", False):
        return
    original = ModelRunner._get_attention_backend

    def _get_attention_backend(self):
        if self.use_mla_backend and self.server_args.attention_backend == "fa":
            return _attention_backend(self)
        return original(self)

    ModelRunner._get_attention_backend = _get_attention_backend
    ModelRunner._kvcanary_cpu_mla = True
