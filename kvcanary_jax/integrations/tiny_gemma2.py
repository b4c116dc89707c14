"""A tiny random Gemma 2 for trials (``python -m kvcanary_jax tiny-model DIR --arch gemma2``): sliding-window
attention, so sglang-jax builds its hybrid ``SWAKVPool`` (a full and a sliding-window sub-pool).

Two layers, as Gemma 2 alternates them: layer 0 attends over a sliding window of :data:`SLIDING_WINDOW` tokens,
layer 1 over the whole sequence. The window is short, so a request of a few dozen tokens crosses it and the engine
frees the SWA slots that leave it. ``head_dim`` 128 (sglang-jax's native attention needs it); random weights under
the Hugging Face Gemma 2 names (tied embeddings: no ``lm_head``), so tokens vary; the local tokenizer of
:mod:`.tiny_llama`.
"""

from __future__ import annotations

import os

import numpy as np

from kvcanary_jax.integrations import tiny_llama

SLIDING_WINDOW = 8  # tokens an SWA layer attends to, its own included (sglang-jax: ``q - k < sliding_window``)

TINY_GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 128, "sliding_window": SLIDING_WINDOW,
    "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "attention_bias": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip


def _weights(seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hugging Face Gemma 2 names: N(0, scale); norms N(0, scale) too (Gemma's
    RMSNorm scales by ``1 + weight``)."""
    c, rng = TINY_GEMMA2, np.random.default_rng(seed)
    hidden = c["hidden_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= tiny_llama.layer_shapes(c, p)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            shapes[p + norm + ".weight"] = (hidden,)
    return {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in shapes.items()}


def write_tiny_gemma2(directory: str | os.PathLike, *, seed: int = 0) -> str:
    """Writes the tiny Gemma 2's ``config.json``, random weights (``model.safetensors``) and the local tokenizer into
    ``directory`` (made if missing); returns its path."""
    return tiny_llama.write_model_dir(directory, TINY_GEMMA2, _weights(seed))
