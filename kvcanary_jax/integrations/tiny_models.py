"""``python -m kvcanary_jax tiny-model DIR --arch NAME``: a tiny random model of each family sglang-jax serves that
the canary maps (:data:`ARCHS`), each family's writer in a module of its own, all with tiny_llama's local tokenizer."""

from __future__ import annotations

import os

from kvcanary_jax.integrations import tiny_deepseek, tiny_gemma2, tiny_llama, tiny_qwen3_5


def _llama(directory: str | os.PathLike, *, seed: int = 0) -> str:
    return tiny_llama.write_tiny_model(directory, seed=seed)


# model families ``tiny-model --arch`` writes (tiny, random weights, the local tokenizer): name -> writer(dir, seed=)
ARCHS = {"llama": _llama, "gemma2": tiny_gemma2.write_tiny_gemma2, "deepseek_v3": tiny_deepseek.write_tiny_deepseek_v3,
         "qwen3_5": tiny_qwen3_5.write_tiny_qwen3_5}  # fmt: skip


def write_arch(directory: str | os.PathLike, *, arch: str = "llama", seed: int = 0, size: str = "tiny") -> str:
    """Writes a tiny random model of family ``arch`` (:data:`ARCHS`), or with ``size`` a larger Llama config."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    if size != "tiny":
        if arch != "llama":
            raise ValueError(f"--size {size} is a Llama shape; it takes --arch llama, got --arch {arch}")
        return tiny_llama.write_tiny_model(directory, seed=seed, size=size)
    return ARCHS[arch](directory, seed=seed)
