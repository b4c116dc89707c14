"""Pallas across jax 0.10.2 - 0.12: ``pallas_call`` wrappers that pin the Triton (GPU) or Mosaic (TPU) lowering."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax import export
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

# The custom-call target of a Pallas Triton kernel; jax >= 0.11 exports the name, 0.10.2 hard-codes it.
TRITON_CUSTOM_CALL_TARGET: str = getattr(plt, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1): Triton tensors must have power-of-2 sizes (pallas_notes §1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def triton_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    name: str,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    input_output_aliases: Mapping[int, int] | None = None,
) -> Callable[..., Any]:
    """``pl.pallas_call`` with whole-array refs, explicit Triton compiler params and a findable kernel name.

    A bare ``pallas_call`` lowers through Mosaic GPU on jax 0.10.2 but through Triton on 0.11+; passing
    ``plt.CompilerParams`` selects Triton on every version (pallas_notes §9, pitfall 1). ``interpret=True``
    ignores the params and runs the same kernel body anywhere (CPU tests). No ``BlockSpec`` is given: every ref is
    the whole array (a plain pointer in Triton, no copy) and kernels index it themselves with masks, because
    jax <= 0.11 adds no bounds masks for ragged blocks (pallas_notes §6).
    """
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=dict(input_output_aliases or {}),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )


def export_disabled_checks() -> list[export.DisabledSafetyCheck]:
    """Safety checks to disable so ``jax.export(..., platforms=["cuda"])`` accepts Triton custom calls."""
    return [export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL_TARGET)]


@contextlib.contextmanager
def cuda_export_target(device_kind: str = "NVIDIA H200", num_cores: int = 132) -> Iterator[None]:
    """Lets ``jax.export(..., platforms=["cuda"])`` lower Triton kernels on a machine without a GPU.

    jax 0.12 asks the default device for its compute capability while lowering a Triton call and fails on a CPU
    ("No supported GPU devices found"); an abstract mesh naming the target GPU answers it instead. jax <= 0.11 needs
    nothing, and has no ``AbstractDevice``.
    """
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device is None or not hasattr(jax.sharding, "use_abstract_mesh"):
        yield
        return
    target = abstract_device(device_kind=device_kind, num_cores=num_cores, platform="cuda")
    # Auto, not jax 0.12's default Explicit: an explicit axis would type every array on this mesh, and the kernel
    # backends refuse explicitly sharded inputs.
    auto = (jax.sharding.AxisType.Auto,)
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("export",), axis_types=auto, abstract_device=target)
    ):
        yield


# ------------------------------------------------------------------------------------------------- Pallas Mosaic (TPU)

# The custom-call target of a Pallas Mosaic (TPU) kernel; jax.export treats it as stable, so no check is disabled.
MOSAIC_CUSTOM_CALL_TARGET = "tpu_custom_call"


def mosaic_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid_spec: pltpu.PrefetchScalarGridSpec,
    name: str,
    dimension_semantics: tuple[str, ...],
    interpret: bool,
    input_output_aliases: Mapping[int, int] | None = None,
) -> Callable[..., Any]:
    """``pl.pallas_call`` of a Mosaic (TPU) kernel; ``interpret=True`` runs it in TPU interpret mode anywhere.

    ``pltpu.InterpretParams`` (jax 0.10.2 - 0.12) interprets the TPU primitives themselves (DMAs, semaphores,
    SMEM/VMEM), unlike ``interpret=True``, which only the Triton kernels' primitives support (pallas_notes §5).
    ``input_output_aliases`` counts the scalar-prefetch operands (pallas_notes §3).
    """
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        input_output_aliases=dict(input_output_aliases or {}),
        compiler_params=pltpu.CompilerParams(dimension_semantics=dimension_semantics),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )
