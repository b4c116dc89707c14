"""Trace-time argument validation, with messages that name the argument, the expectation and the value received."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def array(name: str, x, *, dtype=None, ndim: int | None = None, shape: tuple | None = None) -> None:
    """Checks that ``x`` is an array with the given dtype, rank and (partial, None = any) shape."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    if dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{name} must have dtype {jnp.dtype(dtype).name}; got {name}.dtype={jnp.dtype(x.dtype).name}")
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s); got {name}.shape={tuple(x.shape)}")
    if shape is not None:
        if len(x.shape) != len(shape) or any(e is not None and e != a for e, a in zip(shape, x.shape, strict=True)):
            dims = ", ".join("*" if e is None else str(e) for e in shape)
            want = f"({dims},)" if len(shape) == 1 else f"({dims})"  # (*, 4, 2), not ('*', 4, 2)
            raise ValueError(f"{name} must have shape {want}; got {name}.shape={tuple(x.shape)}")


def is_int(value) -> bool:
    """Whether ``value`` is a static integer: a Python int or a numpy integer scalar, not a bool or a tracer."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(name: str, value) -> int:
    """A static, positive integer (Python or numpy) as a Python int."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive static int; got {name}={value!r}")
    return int(value)


def static_int(name: str, value, *, minimum: int = 0, maximum: int | None = None) -> int:
    """A static integer (Python or numpy) in ``[minimum, maximum)``, as a Python int."""
    if not is_int(value):
        raise TypeError(f"{name} must be a static Python int; got {name}={value!r}")
    if value < minimum or (maximum is not None and value >= maximum):
        bound = f"[{minimum}, {maximum})" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be in {bound}; got {name}={value}")
    return int(value)


def same_length(names_and_arrays: dict) -> int:
    """All given 1-D arrays have the same length; returns it."""
    lengths = {name: x.shape[0] for name, x in names_and_arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"these arrays must have the same length: {lengths}")
    return next(iter(lengths.values()))


def canary_buffer(x, name: str = "canary_buf") -> int:
    """A ``u32[num_slots, 4, 2]`` canary buffer; returns num_slots."""
    array(name, x, dtype=jnp.uint32, shape=(None, 4, 2))
    if x.shape[0] < 1:
        raise ValueError(f"{name} needs at least one slot; got {name}.shape={tuple(x.shape)}")
    return x.shape[0]


def instance(name: str, value, cls: type | tuple[type, ...], *, what: str | None = None) -> None:
    """Checks that ``value`` is a ``cls`` (``what`` names it in the message; default: the class's name)."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {what or cls.__name__}; got {type(value).__name__}")
