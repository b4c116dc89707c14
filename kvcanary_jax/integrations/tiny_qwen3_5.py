"""A tiny random Qwen3.5 (hybrid linear attention) for trials: ``tiny-model DIR --arch qwen3_5``.

Two layers: a Gated DeltaNet (linear attention: a per-request recurrent state, no KV slots) then a full-attention
layer (paged KV in sglang-jax's ``HybridLinearKVPool``, whose inner ``MHATokenToKVPool`` holds that one layer), dense
MLPs. Random weights under the Hugging Face names sglang-jax's ``qwen3_5`` loader reads, and the tiny Llama's local
tokenizer. On CPU serve it with ``--gdn-prefill-impl chunked_jax`` (the default prefill is a TPU-only kernel).
"""

from __future__ import annotations

import os

import numpy as np

from kvcanary_jax.integrations import tiny_llama

_TEXT = {
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 128, "attn_output_gate": True, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True,
                        "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}  # fmt: skip
TINY_QWEN3_5 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": _TEXT,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "vocab_size": _TEXT["vocab_size"], "max_position_embeddings": _TEXT["max_position_embeddings"],
}  # fmt: skip


def _weights(c: dict, seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hugging Face Qwen3.5 names (``[out, in]``): N(0, scale), norms 1."""
    rng = np.random.default_rng(seed)
    hidden, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    root = "model.language_model."
    shapes = {root + "embed_tokens.weight": (c["vocab_size"], hidden), "lm_head.weight": (c["vocab_size"], hidden)}
    ones = {root + "norm.weight": hidden}
    small = {}  # per-head decay parameters: near 0
    for i, kind in enumerate(c["layer_types"]):
        p = f"{root}layers.{i}."
        shapes |= {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}  # fmt: skip
        ones |= {p + "input_layernorm.weight": hidden, p + "post_attention_layernorm.weight": hidden}
        if kind == "full_attention":
            gate = 2 if c["attn_output_gate"] else 1
            shapes |= {p + "self_attn.q_proj.weight": (heads * hd * gate, hidden),
                       p + "self_attn.k_proj.weight": (kv * hd, hidden), p + "self_attn.v_proj.weight": (kv * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd)}  # fmt: skip
            ones |= {p + "self_attn.q_norm.weight": hd, p + "self_attn.k_norm.weight": hd}
        else:
            a = p + "linear_attn."
            shapes |= {a + "in_proj_qkv.weight": (2 * kd + vd, hidden), a + "in_proj_z.weight": (vd, hidden),
                       a + "in_proj_b.weight": (nv, hidden), a + "in_proj_a.weight": (nv, hidden),
                       a + "conv1d.weight": (2 * kd + vd, 1, c["linear_conv_kernel_dim"]),
                       a + "out_proj.weight": (hidden, vd)}  # fmt: skip
            ones |= {a + "norm.weight": c["linear_value_head_dim"]}
            small |= {a + "A_log": nv, a + "dt_bias": nv}
    out = {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in shapes.items()}
    out |= {k: np.ones(n, np.float32) for k, n in ones.items()}
    return out | {k: (rng.standard_normal(n) * scale).astype(np.float32) for k, n in small.items()}


def write_tiny_qwen3_5(directory: str | os.PathLike, *, seed: int = 0) -> str:
    """Writes the config, random weights (``model.safetensors``) and the local tokenizer; returns the path."""
    return tiny_llama.write_model_dir(directory, TINY_QWEN3_5, _weights(_TEXT, seed))
