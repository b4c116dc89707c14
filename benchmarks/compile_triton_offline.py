"""Compiles the runner's decode-step Triton kernels to sm_90a cubins on a CPU host; fails on a compile error or a spill.

Setup: a separate venv, because jax 0.10.2 is the last release whose CUDA export carries each kernel's Triton IR (later
ones compile it while lowering), and pip triton is no dependency of the project:

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install "jax==0.10.2" triton chex numpy
    PYTHONPATH=. /tmp/tv/bin/python benchmarks/compile_triton_offline.py [--bs 64 --ctx 1024 --page 16] [--ptxas PATH]

What it does: exports ``before_forward`` + ``after_forward`` in one jit (as
``tests/pallas_kernels/test_export_cuda.py`` does) with ``platforms=["cuda"]``, for each padding convention and an SWA
pool (``--window 0`` skips it). Each Pallas kernel in the export is a Triton custom call whose
``mhlo.backend_config`` holds the kernel's Triton-dialect IR as MLIR bytecode. pip triton cannot read jaxlib's
bytecode, so jaxlib's MLIR bindings print it as text; pip triton compiles that text through TTGIR, LLVM IR and
PTX, and ``ptxas -v`` reports registers, spills and static shared memory. It prints a table per variant, kernels
in the order they are traced (batch checks, then each phase's check, ring and store: HEAD before TAIL, FULL before
SWA; identical launches merged), and exits nonzero naming any kernel that failed or spilled.

Why: it needs no GPU, and catches what the CUDA export test cannot (Triton compile failures, register spills) before
a GPU run. What it does not check: XLA compiles these kernels with its own bundled Triton, not pip triton, so the
numbers are indicative only; nothing runs, so correctness and speed are left to ``benchmarks/gpu_validate.py``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import triton
from jax import export
from jax.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir as jax_ir
from jaxlib.triton import dialect as jax_triton_dialect
from triton._C.libtriton import ir as triton_ir
from triton.backends.compiler import GPUTarget, Language
from triton.backends.nvidia import compiler as nvidia

import kvcanary_jax as kc
from pallas_kernels import compat

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
TARGET = GPUTarget("cuda", 90, 32)  # pip triton picks the arch-specific sm_90a for capability 90
PTXAS_STATS = {
    "registers": r"Used (\d+) registers",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "smem": r"(\d+) bytes smem",
}
S = jax.ShapeDtypeStruct
_START = time.perf_counter()


def log(line: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {line}", flush=True)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Triton kernel of an exported module: its launch parameters and its Triton-dialect IR as text."""

    name: str
    num_warps: int
    num_stages: int
    ir: str


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What compiling a kernel gave: ptxas statistics (``smem`` includes Triton's dynamic smem), or an error."""

    seconds: float
    stats: dict[str, int] | None = None
    error: str | None = None


def export_decode_step(bs: int, ctx: int, page: int, padding: str, swa_window: int = 0) -> str:
    """The runner's HEAD + TAIL step (K and V, real-KV PARTIAL) exported for CUDA, as MLIR text.

    Args:
      bs, ctx, page: batch rows, context length per row and KV page size; the full pool holds ``bs * ctx`` slots.
      padding: ``CanaryPool.padding``.
      swa_window: > 0 adds an SWA group of that window, with room for every row's window.
    """
    swa = None
    if swa_window:
        swa_slots = bs * (swa_window + page) + page
        swa = kc.SwaGroup(num_slots=swa_slots, window=swa_window, verify_capacity=bs * swa_window)
    canary = kc.KvCanary(
        kc.CanaryConfig(real_kv_hash_mode="partial", ring_capacity=1024),
        kc.CanaryPool(num_slots=bs * ctx + page, page_size=page, verify_capacity=bs * ctx, padding=padding, swa=swa),
    )
    state = jax.tree.map(lambda x: S(x.shape, x.dtype), jax.eval_shape(canary.init_state))
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    lut = i32(canary.pool.num_slots + 1) if swa else None
    batch = kc.CanaryBatch(i32(bs), i32(bs), i32(bs), i32(bs + 1, ctx), i32(bs), i32(bs), i32(bs), lut)
    full_kv = S((bs * ctx // page + 1, page, 8, 128), jnp.bfloat16)
    swa_kv = S((swa.num_slots // page, page, 8, 128), jnp.bfloat16) if swa else None

    def step(state, batch, full_kv, swa_kv):
        state = canary.before_forward(state, batch)
        sources = canary.kv_sources(full_k=full_kv, full_v=full_kv, swa_k=swa_kv, swa_v=swa_kv)
        return canary.after_forward(state, batch, sources)

    with compat.cuda_export_target():
        exported = export.export(
            jax.jit(step, donate_argnums=0), platforms=["cuda"], disabled_checks=compat.export_disabled_checks()
        )(state, batch, full_kv, swa_kv)
    return exported.mlir_module()


def triton_kernels(module_text: str) -> collections.Counter[Kernel]:
    """The Triton kernels of an exported module, each with its number of launches."""
    context = jax_mlir.make_ir_context()
    jax_triton_dialect.register_dialect(context)  # to read the kernels' bytecode
    kernels: collections.Counter[Kernel] = collections.Counter()

    def visit(op):
        target = op.attributes["call_target_name"] if op.name == "stablehlo.custom_call" else None
        if target is not None and jax_ir.StringAttr(target).value == compat.TRITON_CUSTOM_CALL_TARGET:
            config = jax_ir.DictAttr(op.attributes["mhlo.backend_config"])
            kernel_ir = jax_ir.Module.parse(jax_ir.StringAttr(config["ir"]).value_bytes)
            warps, stages = (jax_ir.IntegerAttr(config[key]).value for key in ("num_warps", "num_stages"))
            text = kernel_ir.operation.get_asm(enable_debug_info=False)
            kernels[Kernel(jax_ir.StringAttr(config["name"]).value, warps, stages, text)] += 1
        return jax_ir.WalkResult.ADVANCE

    with context:
        jax_ir.Module.parse(module_text).operation.walk(visit)
    return kernels


@functools.cache  # variants share most kernels
def compile_kernel(kernel: Kernel) -> Compiled:
    """Compiles one kernel with pip triton (TTIR -> TTGIR -> LLVM IR -> PTX), then ``ptxas -v`` to a cubin."""
    log(f"compiling {kernel.name} ({kernel.num_warps} warps)")
    backend = nvidia.CUDABackend(TARGET)
    options = backend.parse_options({"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    metadata = {"hash": "0", "target": TARGET, **options.__dict__, "triton_version": triton.__version__}
    stages: dict = {}
    backend.add_stages(stages, options, Language.TRITON)
    start, stage = time.perf_counter(), "parse"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "kernel.ttir")
            path.write_text(kernel.ir)
            module = triton_ir.parse_mlir_module(str(path), context)
            module.context = context  # as triton's own IR loader does; its passes read it
            for stage in ("ttir", "ttgir", "llir", "ptx"):
                module = stages[stage](module, metadata)
            stage = "ptxas"
            path.with_suffix(".ptx").write_text(module)
            ptxas_log = _ptxas(path.with_suffix(".ptx"), fp_fusion=options.enable_fp_fusion)
    except Exception as e:  # noqa: BLE001 - any failure is a result to report
        return Compiled(time.perf_counter() - start, error=f"{stage}: {type(e).__name__}: {e}".strip())
    stats = {key: max(map(int, re.findall(rx, ptxas_log)), default=0) for key, rx in PTXAS_STATS.items()}
    stats["smem"] += metadata["shared"]  # Triton's shared memory is dynamic: ptxas sees only the static part
    return Compiled(time.perf_counter() - start, stats=stats)


def _ptxas(ptx: Path, *, fp_fusion: bool) -> str:
    """Assembles ``ptx`` with the flags of triton's own cubin stage; returns the ``-v`` log."""
    ptxas = nvidia.get_ptxas(TARGET.arch).path
    arch = nvidia.sm_arch_from_capability(TARGET.arch)
    fmad = [] if fp_fusion else ["--fmad=false"]
    cmd = [ptxas, *fmad, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(ptx), "-o", str(ptx) + ".cubin"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"ptxas exited with {result.returncode}:\n{result.stderr}")
    return result.stdout + result.stderr


def check_variant(label: str, module_text: str) -> list[str]:
    """Compiles every kernel of one exported variant, prints its table and returns its failures."""
    kernels = triton_kernels(module_text)
    rows, failures = [], []
    for kernel, calls in kernels.items():
        result = compile_kernel(kernel)
        if result.error:
            failures.append(f"{label}: {kernel.name} failed at {result.error.splitlines()[0]}")
            error = "\n    ".join(result.error.splitlines()[:20])
            rows.append(f"{kernel.name:44} {calls:>5} {kernel.num_warps:>5}  FAILED at {error}")
            continue
        st = result.stats
        spills = f"{st['spill_stores']}/{st['spill_loads']}"
        if st["spill_stores"] or st["spill_loads"]:
            failures.append(f"{label}: {kernel.name} spills (bytes stored/loaded: {spills})")
        rows.append(
            f"{kernel.name:44} {calls:>5} {kernel.num_warps:>5} {st['registers']:>4} {spills:>11} {st['smem']:>6}"
            f" {result.seconds:>5.1f}"
        )
    print(f"\n== {label}: {sum(kernels.values())} Triton launches, {len(kernels)} distinct kernels")
    print(f"{'kernel':44} {'calls':>5} {'warps':>5} {'regs':>4} {'spill st/ld':>11} {'smem':>6} {'sec':>5}")
    print("\n".join(rows) + "\n", flush=True)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bs", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--window", type=int, default=128, help="SWA variant's window; 0 skips the SWA variant")
    parser.add_argument("--ptxas", type=Path, help="ptxas to use instead of pip triton's bundled one")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default; setting it silences a warning
    if args.ptxas:
        # For sm_90+ triton runs its "ptxas-blackwell" tool and targets the PTX ISA of that tool's CUDA version.
        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = str(args.ptxas.resolve())
    ptxas = nvidia.get_ptxas(TARGET.arch)
    if args.ptxas and ptxas.path != str(args.ptxas.resolve()):  # triton falls back silently to its bundled one
        parser.error(f"--ptxas must be a working ptxas (it answers --version with its CUDA release); got {args.ptxas}")
    log(f"jax {jax.__version__}, pip triton {triton.__version__}, ptxas {ptxas.path} (CUDA {ptxas.version})")
    variants = [("negative", 0), ("reserved", 0)] + ([("negative", args.window)] if args.window else [])
    failures = []
    for padding, window in variants:
        label = f"bs={args.bs} ctx={args.ctx} page={args.page} padding={padding}" + (f" swa={window}" if window else "")
        log(f"{label}: exporting")
        failures += check_variant(label, export_decode_step(args.bs, args.ctx, args.page, padding, window))
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures))
    log(f"all kernels compiled without spills ({len(variants)} variants)")


if __name__ == "__main__":
    main()
