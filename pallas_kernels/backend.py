"""Backend names, and the dispatch of an op to the implementation each names.

* ``"xla"``: the pure-jnp reference; runs anywhere.
* ``"pallas"``: the platform's own Pallas kernels: Triton on GPU (cuda, rocm), Mosaic on TPU.
* ``"interpret"``: the Triton kernels in Pallas interpret mode; runs anywhere (CPU tests).
* ``"interpret_tpu"``: the Mosaic kernels in TPU interpret mode; runs anywhere.
* ``"auto"``: ``"pallas"`` on GPU and TPU, ``"xla"`` elsewhere.

``"pallas"`` and ``"auto"`` choose by the platform the computation is *lowered* for (``lax.platform_dependent``),
not by ``jax.default_backend()``: ``jax.export(..., platforms=["tpu"])`` on a CPU host gets the Mosaic kernels,
and ``platforms=["cuda"]`` the Triton ones. Every branch is traced; only the lowering platform's is lowered.

Inputs typed with an explicit mesh sharding (:mod:`pallas_kernels.mesh`) take the xla path outright under
``"auto"``: a ``pallas_call`` is not partitioned, and the kernel branches would fail while being traced. The
kernel backends refuse them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.extend as jex
from jax import lax
from jax.interpreters import mlir

from pallas_kernels import mesh

BACKENDS = ("auto", "xla", "pallas", "interpret", "interpret_tpu")

_NO_KERNELS = (
    "backend='pallas' runs the platform's own Pallas kernels and needs a GPU (Triton) or a TPU (Mosaic), but the "
    "computation is lowered for {platform}; use backend='interpret' (the Triton kernels, interpreted), "
    "'interpret_tpu' (the Mosaic kernels, interpreted), 'xla' or 'auto'"
)
_SHARDED = (
    "backend={backend!r} runs Pallas kernels, which take arrays on one device, but these inputs carry an explicit "
    "mesh sharding (AxisType.Explicit, mesh axes {axes}); call the op inside jax.shard_map, where each device sees "
    "its own shard, or use backend='xla' or 'auto', which read sharded arrays in place"
)


def validate(backend: str) -> str:
    """Raises ``ValueError`` for an unknown backend name; returns the name unchanged."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend=}")
    return backend


def dispatch(
    backend: str,
    *,
    xla: Callable,
    triton: Callable,
    mosaic: Callable | None,
) -> Callable:
    """The op's implementation on ``backend``, a function of the op's array arguments (pytrees allowed).

    Args:
      backend: one of ``BACKENDS``.
      xla: the reference, ``xla(*args)``.
      triton, mosaic: the kernels, ``triton(*args, interpret=bool)``; all three return identical pytrees.
        ``mosaic=None`` for an op without TPU kernels: ``"auto"`` then runs ``xla`` on TPU, ``"pallas"`` lowered
        for TPU and ``"interpret_tpu"`` raise.

    Raises:
      ValueError: an unknown backend name.
      NotImplementedError: ``"pallas"`` lowered for a platform without Pallas kernels, when lowered (or, run
        eagerly, when called); ``"interpret_tpu"`` for an op without Mosaic kernels; a kernel backend called
        with inputs typed with an explicit mesh sharding.
    """
    validate(backend)
    if backend == "xla":
        return xla
    if backend == "interpret":
        kernels = functools.partial(triton, interpret=True)
    elif backend == "interpret_tpu":
        if mosaic is None:
            raise NotImplementedError(
                "backend='interpret_tpu' runs Mosaic kernels, and this op has none; use 'xla', 'interpret' or 'auto'"
            )
        kernels = functools.partial(mosaic, interpret=True)
    else:
        gpu = functools.partial(triton, interpret=False)
        default = xla if backend == "auto" else functools.partial(_no_kernels, xla)
        tpu = default if mosaic is None else functools.partial(mosaic, interpret=False)

        def kernels(*args):
            return lax.platform_dependent(*args, cuda=gpu, rocm=gpu, tpu=tpu, default=default)

    def run(*args):
        sharded = mesh.explicit_mesh(args)
        if sharded is None:
            return kernels(*args)
        if backend == "auto":
            return xla(*args)
        raise NotImplementedError(_SHARDED.format(backend=backend, axes=tuple(sharded.axis_names)))

    return run


# A branch for platforms without Pallas kernels that fails only if it is lowered (or run eagerly): the other
# platforms' branches are traced as well, so it cannot raise at trace time.
_no_kernels_p = jex.core.Primitive("kvcanary_no_pallas_kernels")
_no_kernels_p.multiple_results = True
_no_kernels_p.def_abstract_eval(lambda *, avals: avals)


def _raise_eagerly(*, avals):
    del avals
    raise NotImplementedError(_NO_KERNELS.format(platform=repr(jax.default_backend())))


def _raise_when_lowered(ctx, *, avals):
    del avals
    raise NotImplementedError(_NO_KERNELS.format(platform=" or ".join(map(repr, ctx.module_context.platforms))))


_no_kernels_p.def_impl(_raise_eagerly)
mlir.register_lowering(_no_kernels_p, _raise_when_lowered)


def _no_kernels(xla: Callable, *args):
    """Placeholders shaped like the op's results (taken from the reference), from ``_no_kernels_p``."""
    leaves, tree = jax.tree.flatten(jax.eval_shape(xla, *args))
    avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
    return jax.tree.unflatten(tree, _no_kernels_p.bind(avals=avals))
