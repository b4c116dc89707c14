"""Backend names and their resolution: ``xla`` (pure jnp), ``pallas`` (Triton on GPU), ``interpret``, ``auto``."""

from __future__ import annotations

import jax

BACKENDS = ("auto", "xla", "pallas", "interpret")


def validate(backend: str) -> str:
    """Raises ``ValueError`` for an unknown backend name; returns the name unchanged."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend=}")
    return backend


def resolve(backend: str) -> str:
    """Maps ``auto`` to ``pallas`` on GPU and ``xla`` elsewhere; an explicit name never falls back."""
    validate(backend)
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        return "pallas" if on_gpu else "xla"
    if backend == "pallas" and not on_gpu:
        raise NotImplementedError(
            f"backend='pallas' runs Triton kernels and needs a GPU, but jax's default backend is "
            f"{jax.default_backend()!r}; use backend='interpret' (same kernels, interpreted), 'xla' or 'auto'"
        )
    return backend
