"""Inputs typed with an explicit mesh sharding (jax's sharding in types, ``AxisType.Explicit``).

Engines such as sglang-jax build their mesh with explicit axes: a KV pool is typed
``bf16[pages@data, page_size, heads@tensor, packing, head_dim]`` and a batch array ``i32[T@data]``. Under sharding
in types, an op whose output sharding jax cannot infer fails at trace time (a prefix sum over a sharded axis, a
reshape merging a sharded axis, a gather from a sharded operand), and so does mixing an array typed on a mesh with
one typed on none in a ``dynamic_update_slice`` or a scatter. The xla path follows three rules:

1. :func:`context`: the op is traced under its inputs' mesh, so every array it creates (zeros, iotas, constants)
   is typed on that same mesh.
2. :func:`replicate`: small arrays (canary buffers, plans, batch indices: KBs to a few MBs) are made fully
   replicated; every device then runs the same canary arithmetic, as one device would.
3. KV arrays are never reshaped, resharded or copied: :func:`take` gathers the few elements the fold needs with a
   replicated ``out_sharding``, which XLA partitions as a masked gather on each shard plus a reduction of the
   gathered elements only.

Arrays on no mesh, or on a mesh of ``Auto`` axes only, pass through every helper unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _explicit(mesh) -> bool:
    return mesh is not None and not mesh.empty and any(t == AxisType.Explicit for t in mesh.axis_types)


def _type_mesh(x):
    """The (abstract or concrete) mesh in ``x``'s type, or None."""
    try:
        sharding = getattr(jax.typeof(x), "sharding", None)
    except TypeError:  # not a jax type (a Python scalar, a ShapeDtypeStruct without sharding)
        return None
    return getattr(sharding, "mesh", None)


def _arrays(trees) -> list:
    return [leaf for leaf in jax.tree.leaves(trees) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]


def explicit_mesh(*trees: Any):
    """The first mesh with an explicit axis in the types of the trees' array leaves, or None."""
    for leaf in _arrays(trees):
        if isinstance(leaf, jax.ShapeDtypeStruct) and getattr(leaf, "sharding", None) is None:
            continue
        mesh = _type_mesh(leaf)
        if _explicit(mesh):
            return mesh
    return None


def _active_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if _explicit(mesh) else None


@contextlib.contextmanager
def context(*trees: Any) -> Iterator[None]:
    """Traces the body under the explicit mesh of the trees' arrays (a no-op without one, or under a mesh already).

    Inside ``jax.jit`` this enters the abstract mesh of the inputs' types; eagerly, the concrete mesh of the first
    concrete input (``jax.set_mesh``).
    """
    mesh = None if _active_mesh() is not None else explicit_mesh(*trees)
    if mesh is None:
        yield
        return
    concrete = next(
        (
            leaf.sharding.mesh
            for leaf in _arrays(trees)
            if isinstance(leaf, jax.Array)
            and not isinstance(leaf, jax.core.Tracer)
            and isinstance(leaf.sharding, NamedSharding)
            and _explicit(leaf.sharding.mesh)
        ),
        None,
    )
    with jax.set_mesh(concrete) if concrete is not None else jax.sharding.use_abstract_mesh(mesh):
        yield


def replicate(tree: Any) -> Any:
    """Every array leaf fully replicated on the active explicit mesh (a no-op without one).

    Only for small arrays: the canary's buffers, plans and batch indices. Never a KV array.
    """
    if _active_mesh() is None:
        return tree

    def one(x):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty and all(s is None for s in sharding.spec):
            return x  # already replicated on a mesh
        return jax.sharding.reshard(x, P())

    return jax.tree.map(one, tree)


def take(x: jax.Array, indices: tuple[jax.Array, ...]) -> jax.Array:
    """``x[indices]`` (one index array per axis, all of one shape) as a gather whose result is replicated.

    Indices must have at least one dimension: jax turns scalar indices into a dynamic slice, which it cannot
    partition over a sharded axis.
    """
    out = P() if _active_mesh() is not None else None
    return x.at[indices].get(out_sharding=out, mode="clip")


def set_elements(x: jax.Array, indices: tuple[jax.Array, ...], values: jax.Array) -> jax.Array:
    """``x.at[indices].set(values)`` keeping ``x``'s own sharding (fault injection into a sharded KV array)."""
    out = jax.typeof(x).sharding.spec if _active_mesh() is not None else None
    return x.at[indices].set(values, out_sharding=out)


def entry_point(*small: str) -> Callable[[Callable], Callable]:
    """Decorates an op so it accepts inputs typed with an explicit mesh sharding, without touching its body.

    The op is traced under its array arguments' explicit mesh (:func:`context`), with the arguments named in
    ``small`` (canary state, buffers, plans, batch arrays) made replicated first (:func:`replicate`); the other
    arguments (KV arrays and sources) pass through untouched. Without an explicit mesh it only calls the op.
    """

    def decorate(op: Callable) -> Callable:
        signature = inspect.signature(op)

        @functools.wraps(op)
        def run(*args, **kwargs):
            if explicit_mesh(args, kwargs) is None and _active_mesh() is None:
                return op(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            with context(args, kwargs):
                for name in small:
                    if name in bound.arguments:
                        bound.arguments[name] = replicate(bound.arguments[name])
                return op(*bound.args, **bound.kwargs)

        return run

    return decorate
