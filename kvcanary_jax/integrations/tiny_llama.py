"""A tiny Llama model directory for trials, no hub: ``python -m kvcanary_jax tiny-model DIR [--size tiny|1b|8b]``.

Writes a ``config.json`` (sizes that run on CPU with sglang-jax's native attention: ``head_dim`` 128, below which it
breaks), random weights as ``model.safetensors`` (dummy weights, ``--load-format dummy``, give an all-zero KV cache
and all-zero tokens), and a small local byte-level BPE tokenizer (``tokenizer.json``, built with ``tokenizers``), so
an OpenAI-style ``/v1/completions`` request with a text prompt works.

``--size 1b`` / ``8b`` write Llama-shaped configs for benchmarks (:data:`SIZES`; 8b is Llama-3-8B's shape) and the
tokenizer, padded to their vocabulary, but no weights (gigabytes): serve them with ``--load-format dummy``.

``--draft standalone|eagle3|dflash`` writes a draft model for the tiny Llama (:data:`DRAFTS`, same vocabulary and
tokenizer), for sglang-jax's ``--speculative-draft-model-path``: ``standalone`` a one-layer Llama with random weights
(``--speculative-algorithm STANDALONE``), ``eagle3`` a one-layer ``LlamaForCausalLMEagle3`` head (EAGLE3, and EAGLE /
NEXTN, which load a Llama draft as that class), ``dflash`` a one-layer ``DFlashDraftModel`` (block size 4, reading
target layer 0); the last two as configs only (serve them with ``--load-format dummy``). What each does on the engine
today is in ``docs/sglang-jax.md`` ("Speculative decoding").
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SIZES = {
    "tiny": TINY_LLAMA,
    # a 1B-class Llama (Llama-3.2-1B's depth and width, head_dim 128 as the native attention needs): ~1.5 B parameters
    "1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=8),
    # Llama-3-8B's shape
    "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
}  # fmt: skip
_DRAFT_LAYER = dict(TINY_LLAMA, num_hidden_layers=1)
DRAFTS = {
    # a smaller Llama of the same vocabulary: --speculative-algorithm STANDALONE
    "standalone": _DRAFT_LAYER,
    # sglang-jax's EAGLE3 head (one decoder layer on the target's hidden states); draft_vocab_size None: the target's
    # vocabulary and LM head. EAGLE and NEXTN load a LlamaForCausalLM draft as this class too.
    "eagle3": dict(_DRAFT_LAYER, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=None),
    # a DFlash block-diffusion draft: blocks of 4 tokens, conditioned on target layer 0 (--speculative-algorithm DFLASH)
    "dflash": dict(_DRAFT_LAYER, architectures=["DFlashDraftModel"], num_key_value_heads=2,
                   dflash_config={"block_size": 4, "target_layer_ids": [0], "mask_token_id": 3}),
}  # fmt: skip
_SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the config's bos / eos
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A KV cache holds the keys and values of every token a request has "
    "seen; a canary record per slot says which token, at which position, after which hash. Servers batch requests, "
    "share prompt prefixes in a radix tree, and page their memory. Once upon a time there was a small model that "
    "answered questions about numbers: one two three four five six seven eight nine ten."
)


def write_config(
    directory: str | os.PathLike, *, kv_heads: int | None = None, size: str = "tiny", draft: str | None = None
) -> pathlib.Path:
    """Writes the Llama's ``config.json`` (:data:`SIZES`) into ``directory`` (made if missing); returns the directory.

    ``kv_heads``: its KV heads (sglang-jax's tensor parallelism splits them: at least one per device); default: the
    size's own (1 for ``tiny``). ``draft``: a draft model for the tiny Llama instead (:data:`DRAFTS`).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}; got {size!r}")
    if draft is not None and (draft not in DRAFTS or size != "tiny"):
        raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, for size 'tiny'; got {draft=}, {size=}")
    config = SIZES[size] if draft is None else DRAFTS[draft]
    kv_heads = config["num_key_value_heads"] if kv_heads is None else kv_heads
    if not isinstance(kv_heads, int) or not 1 <= kv_heads <= config["num_attention_heads"]:
        raise ValueError(f"kv_heads must be an int in [1, {config['num_attention_heads']}]; got {kv_heads=}")
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config, num_key_value_heads=kv_heads), indent=1))
    return path


def layer_shapes(config: dict, prefix: str) -> dict[str, tuple[int, int]]:
    """A Llama-style decoder layer's attention and MLP projections (Hugging Face names under ``prefix``): shapes."""
    hidden, inter, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    return {prefix + "self_attn.q_proj.weight": (q, hidden), prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.weight": (kv, hidden), prefix + "self_attn.o_proj.weight": (hidden, q),
            prefix + "mlp.gate_proj.weight": (inter, hidden), prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter)}  # fmt: skip


def write_model_dir(directory: str | os.PathLike, config: dict, weights: dict[str, np.ndarray]) -> str:
    """Writes ``config.json``, the weights (``model.safetensors``) and the local tokenizer (padded to the config's
    vocabulary) into ``directory`` (made if missing); returns its path. The tiny families' common last step."""
    from safetensors.numpy import save_file

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(path / "model.safetensors"))
    _write_tokenizer(path, config)
    return str(path)


def _weights(seed: int, scale: float = 0.05, config: dict = TINY_LLAMA) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hugging Face Llama names: N(0, scale), norms 1."""
    c, rng = config, np.random.default_rng(seed)
    hidden = c["hidden_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "lm_head.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        shapes |= layer_shapes(c, f"model.layers.{i}.")
    out = {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in shapes.items()}
    layer_norms = ("input_layernorm.weight", "post_attention_layernorm.weight")
    layers = range(c["num_hidden_layers"])
    norms = ["model.norm.weight"] + [f"model.layers.{i}.{n}" for i in layers for n in layer_norms]
    out |= {k: np.ones(hidden, np.float32) for k in norms}
    return out


def _write_tokenizer(path: pathlib.Path, config: dict = TINY_LLAMA) -> None:
    """A byte-level BPE with the model's vocabulary size, trained on a built-in paragraph."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(config["vocab_size"], TINY_LLAMA["vocab_size"]), special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    # every id the model can sample decodes to something: pad the vocabulary to the model's
    tok.add_tokens([f"<x{i}>" for i in range(config["vocab_size"] - tok.get_vocab_size())])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": config["max_position_embeddings"]}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_tiny_model(
    directory: str | os.PathLike, *, seed: int = 0, size: str = "tiny", draft: str | None = None
) -> str:
    """Writes the config, random weights (``tiny`` and the ``standalone`` draft only: the others are served with
    ``--load-format dummy``) and tokenizer into ``directory``; returns its path. ``draft``: see :data:`DRAFTS`."""
    path = write_config(directory, size=size, draft=draft)
    if size == "tiny" and draft in (None, "standalone"):
        from safetensors.numpy import save_file

        config = TINY_LLAMA if draft is None else DRAFTS[draft]
        save_file(_weights(seed, config=config), str(path / "model.safetensors"))
    _write_tokenizer(path, SIZES[size])
    return str(path)
