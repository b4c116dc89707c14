"""A tiny random DeepSeek-V3 (multi-head latent attention) for trials: ``tiny-model DIR --arch deepseek_v3``.

Two layers, dense MLPs (no experts), no query LoRA, ``kv_lora_rank`` 128 and ``qk_rope_head_dim`` 64: each token's
latent KV row in sglang-jax's ``MLATokenToKVPool`` is 128 + 128 (the rope part padded to 128) bf16 values. Random
weights under the Hugging Face names sglang-jax's ``deepseek_v3`` loader reads, and the tiny Llama's local tokenizer.
sglang-jax builds the MLA pool with ``--attention-backend fa`` and a page size above 1; on CPU that backend's kernel
is swapped for an XLA one (:mod:`kvcanary_jax.integrations.sglang_cpu`).
"""

from __future__ import annotations

import os

import numpy as np

from kvcanary_jax.integrations import tiny_llama

TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "vocab_size": 512, "q_lora_rank": None, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
    "v_head_dim": 64, "n_routed_experts": None, "n_shared_experts": None, "first_k_dense_replace": 2,
    "moe_layer_freq": 1, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "rope_interleave": True, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def _weights(config: dict, seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hugging Face DeepSeek-V3 names (``[out, in]``): N(0, scale), norms 1."""
    c, rng = config, np.random.default_rng(seed)
    hidden, heads, lora = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "lm_head.weight": (c["vocab_size"], hidden)}
    norms = {"model.norm.weight": hidden}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * (nope + rope), hidden),
                   p + "self_attn.kv_a_proj_with_mqa.weight": (lora + rope, hidden),
                   p + "self_attn.kv_b_proj.weight": (heads * (nope + v), lora),
                   p + "self_attn.o_proj.weight": (hidden, heads * v),
                   p + "mlp.gate_proj.weight": (c["intermediate_size"], hidden),
                   p + "mlp.up_proj.weight": (c["intermediate_size"], hidden),
                   p + "mlp.down_proj.weight": (hidden, c["intermediate_size"])}  # fmt: skip
        norms |= {p + "input_layernorm.weight": hidden, p + "post_attention_layernorm.weight": hidden,
                  p + "self_attn.kv_a_layernorm.weight": lora}  # fmt: skip
    out = {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in shapes.items()}
    return out | {k: np.ones(n, np.float32) for k, n in norms.items()}


def write_tiny_deepseek_v3(directory: str | os.PathLike, *, seed: int = 0) -> str:
    """Writes the config, random weights (``model.safetensors``) and the local tokenizer; returns the path."""
    return tiny_llama.write_model_dir(directory, TINY_DEEPSEEK_V3, _weights(TINY_DEEPSEEK_V3, seed))
